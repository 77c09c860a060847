// Token data: shards of token ids in llm.c's .bin format, memory-mapped, and
// the (seq+1)-token windows a language model trains on.
//
// The format (llm.c's dev/data/data_common.py): a header of 256 int32 —
// [0] magic 20240520, [1] version, [2] the token count — then the tokens,
// little-endian: version 1 stores uint16 ids (vocabularies up to 65,536);
// version 2, ours, stores uint32 ids for larger vocabularies.
//
//   data::write_token_shard("train_000000.bin", ids);        // picks v1 or v2
//   auto s = data::TokenStream::open({"train_000000.bin"}, vocab);  // StatusOr
//   auto [x, y] = s->windows(starts, seq);   // int64 [n, seq], [n * seq]
//
// Every shard is checked when opened (magic, version, the file's size
// against the count, every id below the vocabulary), so a bad file is a
// named error before training starts, never a wrong token later. The
// files are mapped read-only: a 10 GB corpus costs no resident memory
// until read, and every process of a job shares the page cache.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/tensor.h"

namespace ember::data {

inline constexpr int32_t kTokenShardMagic = 20240520;
inline constexpr int kTokenHeaderInts = 256;

// Writes `ids` as one shard: version 1 (uint16) when every id fits, else
// version 2 (uint32), or the version asked for (an error if ids do not fit).
absl::Status write_token_shard(const std::string& path, const std::vector<uint32_t>& ids, int version = 0);

// One mapped shard.
class TokenShard {
 public:
  // Opens and checks `path`; vocab > 0 also checks every id < vocab.
  static absl::StatusOr<std::shared_ptr<TokenShard>> open(const std::string& path, int64_t vocab = 0);
  ~TokenShard();
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;
  int64_t size() const { return count_; }
  int version() const { return version_; }
  uint32_t operator[](int64_t i) const {
    return version_ == 1 ? static_cast<const uint16_t*>(tokens_)[i] : static_cast<const uint32_t*>(tokens_)[i];
  }
  const std::string& path() const { return path_; }

 private:
  TokenShard() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const void* tokens_ = nullptr;
  int64_t count_ = 0;
  int version_ = 1;
};

// Shards read as one stream of tokens, in the order given.
class TokenStream {
 public:
  static absl::StatusOr<TokenStream> open(const std::vector<std::string>& paths, int64_t vocab = 0);
  // Tokens already in memory (a small corpus tokenized on the fly).
  static TokenStream from_ids(std::vector<uint32_t> ids);
  int64_t size() const { return total_; }
  uint32_t operator[](int64_t i) const;
  // Inputs [n, seq] (int64) and targets [n * seq]: tokens s..s+seq-1 and
  // s+1..s+seq for each start s (0 <= s, s + seq < size()).
  std::pair<Tensor, Tensor> windows(const std::vector<int64_t>& starts, int64_t seq) const;
  // A step's global batch: `n` window starts drawn from (seed, step) alone,
  // so any mesh, and a run resumed on another one, trains on the same
  // windows; data-parallel rank d takes its slice.
  std::vector<int64_t> batch_starts(uint64_t seed, int64_t step, int64_t n, int64_t seq) const;
  // Per-token counts over the first `limit` tokens (the unigram
  // baseline's), `vocab` long; and the largest id.
  std::vector<int64_t> counts(int64_t vocab, int64_t limit = INT64_MAX) const;
  uint32_t max_id() const;

 private:
  std::vector<std::shared_ptr<TokenShard>> shards_;
  std::vector<int64_t> offsets_;  // first token of each shard; then the total
  std::vector<uint32_t> ids_;     // from_ids
  int64_t total_ = 0;
};

// A token directory's index.json (//tools:tokenize writes it): the shards
// in order with their split ("train", "val") and counts, the version, the
// vocabulary size and the tokenizer's path and xxh3 hash.
struct ShardIndex {
  struct Shard {
    std::string file;  // relative to the directory
    std::string split;
    int64_t tokens = 0;
  };
  int version = 1;
  int64_t vocab_size = 0, total_tokens = 0;
  std::string tokenizer_path, tokenizer_hash;
  std::vector<Shard> shards;
};
// Errors name the file and the field.
absl::StatusOr<ShardIndex> read_shard_index(const std::string& dir);

// Cuts each split's stream of ids into shards of `tokens_per_shard` tokens
// (<split>_000000.bin, ...) in `dir`, of the version the vocabulary needs,
// and writes index.json at finish().
class ShardWriter {
 public:
  ShardWriter(std::string dir, int64_t tokens_per_shard, int64_t vocab_size, std::string tokenizer_path,
              std::string tokenizer_hash);
  absl::Status add(const std::string& split, const std::vector<uint32_t>& ids);
  absl::StatusOr<ShardIndex> finish();

 private:
  absl::Status flush(const std::string& split);
  std::string dir_;
  int64_t per_shard_;
  ShardIndex index_;
  std::vector<std::pair<std::string, std::vector<uint32_t>>> buffers_;  // per split, in first-seen order
  std::vector<std::pair<std::string, int>> counts_;                     // shards written per split
};

// The shards of `split` in a token directory, in order: index.json's when
// there is one, else the files ending in .bin whose name holds `split`
// (llm.c's fineweb_train_000001.bin), sorted. NotFound naming the
// directory when there are none.
absl::StatusOr<std::vector<std::string>> token_shards(const std::string& dir, const std::string& split);

}  // namespace ember::data
