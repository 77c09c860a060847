// The BPE model of a byte-level tokenizer: the vocabulary, the merges by
// rank, and the word-level encoder with its cache. Semantics are Hugging
// Face tokenizers' BPE model (models/bpe/model.rs): a word's bytes start as
// one symbol each, then the adjacent pair with the lowest merge rank (the
// leftmost of equal ones) is merged until no pair has a merge.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "text/flat_map.h"

namespace ember::text {

struct BpeOptions {
  std::optional<std::string> unk_token;
  bool fuse_unk = false;
  bool byte_fallback = false;  // unknown bytes as "<0xAB>" tokens
  bool ignore_merges = false;  // a word that is itself a token is that token (LLaMA-3)
};

class BpeModel {
 public:
  // vocab: token string (byte-level form) -> id. merges: pairs of token
  // strings by rank; a later duplicate of a pair replaces the earlier one's
  // rank. The caller has checked that every token of a merge, and their
  // concatenation, is in vocab.
  BpeModel(std::unordered_map<std::string, int32_t> vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options);

  // Appends the ids of one pre-tokenized piece (raw bytes, not the
  // byte-level string) to out. Thread-safe: the cache is per thread.
  void tokenize(std::string_view piece, std::vector<int32_t>& out) const;

  const std::unordered_map<std::string, int32_t>& vocab() const { return vocab_; }
  // The merges in rank order as token-id pairs (duplicates removed).
  const std::vector<std::pair<int32_t, int32_t>>& merges() const { return merge_list_; }
  const BpeOptions& options() const { return options_; }
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // One past the largest id in the vocabulary.
  int64_t id_bound() const { return id_bound_; }

  // The merge step alone, on initial symbol ids (exposed for tests): the
  // scan used for short words and the heap used for long ones must agree.
  void merge_symbols_scan(std::vector<int32_t>& symbols) const;
  void merge_symbols_heap(std::vector<int32_t>& symbols) const;

 private:
  void initial_symbols(std::string_view piece, std::vector<int32_t>& symbols) const;
  void merge_symbols(std::vector<int32_t>& symbols) const;

  std::unordered_map<std::string, int32_t> vocab_;
  std::unordered_map<std::string, int32_t> vocab_by_bytes_;  // only with ignore_merges
  MergeMap merges_;                                          // (a, b) -> rank << 32 | merged id
  std::vector<std::pair<int32_t, int32_t>> merge_list_;
  BpeOptions options_;
  int32_t byte_ids_[256];  // -1: the byte's character is not in the vocabulary
  std::optional<int32_t> unk_id_;
  int64_t id_bound_ = 0;
  uint64_t cache_uid_;  // which thread-local cache is this model's
};

}  // namespace ember::text
