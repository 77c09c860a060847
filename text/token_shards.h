// Token id files in llm.c's .bin format, and a directory of them with an
// index: the output of //tools:tokenize and the input of a token dataset.
//
// A shard is a header of 256 little-endian int32 — [0] magic 20240520,
// [1] version, [2] the token count, the rest 0 — then the tokens: version 1
// (llm.c's) as uint16, version 2 (ours, for vocabularies over 65,536) as
// uint32. index.json beside the shards lists them in order with their
// counts, the dtype, the vocabulary size and the tokenizer's path and hash.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace ember::text {

inline constexpr int32_t kShardMagic = 20240520;
inline constexpr int kShardHeaderInts = 256;

// 1 (uint16) when every id fits, else 2 (uint32).
int shard_version_for(int64_t vocab_size);

// Writes one shard file; an id that does not fit the version's width is an
// Error.
void write_token_shard(const std::string& path, std::span<const int32_t> tokens, int version);

struct TokenShard {
  int version = 0;
  std::vector<uint32_t> tokens;
};

// Reads and checks one shard: a wrong magic, an unknown version, a file
// shorter than its header or its count, or longer than its count, is an
// Error naming the file and the field.
TokenShard read_token_shard(const std::string& path);

struct ShardIndex {
  struct Shard {
    std::string file;  // relative to the directory
    int64_t tokens = 0;
  };
  int version = 0;
  int64_t vocab_size = 0;
  int64_t total_tokens = 0;
  std::string tokenizer_path, tokenizer_hash;
  std::vector<Shard> shards;
};

// Reads dir/index.json (errors name the file and field).
ShardIndex read_shard_index(const std::string& dir);

// Cuts a stream of token ids into shards of tokens_per_shard tokens in dir
// (shard_000000.bin, ...) and writes index.json at finish().
class ShardWriter {
 public:
  ShardWriter(std::string dir, int64_t tokens_per_shard, int64_t vocab_size, std::string tokenizer_path,
              std::string tokenizer_hash);
  void add(std::span<const int32_t> tokens);
  // Writes the last (partial) shard and index.json; returns the index.
  ShardIndex finish();

 private:
  void flush();
  std::string dir_;
  int64_t per_shard_;
  ShardIndex index_;
  std::vector<int32_t> buffer_;
};

}  // namespace ember::text
