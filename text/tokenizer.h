// A byte-level BPE tokenizer (GPT-2's algorithm) read from and written to a
// Hugging Face tokenizer.json. encode() gives the ids that Hugging Face
// tokenizers' Tokenizer.encode(text, add_special_tokens=False) gives:
//
//   1. added/special tokens are split off first (added_tokens.h);
//   2. each run of text between them is pre-tokenized: optional Split steps
//      (LLaMA-3's form), then ByteLevel (its add_prefix_space, and GPT-2's
//      split regex unless use_regex is false) — regexes through PCRE2;
//   3. each piece's bytes go through the BPE merges (bpe_model.h).
//
// Supported tokenizer.json: model BPE (vocab; merges as "a b" strings or
// [a, b] pairs; unk_token, fuse_unk, byte_fallback, ignore_merges), no
// normalizer, pre_tokenizer ByteLevel or Sequence[Split..., ByteLevel],
// decoder ByteLevel or none; any post_processor (encode() never adds
// template tokens, as add_special_tokens=False). Anything else is an
// ember::Error naming the file, the field and what is supported.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "text/added_tokens.h"
#include "text/bpe_model.h"

namespace ember::text {

class Tokenizer {
 public:
  static Tokenizer from_file(const std::string& path);
  // origin names the document in error messages.
  static Tokenizer from_json(std::string_view json, const std::string& origin = "tokenizer.json");

  // The token ids of text (valid UTF-8, else an Error naming the byte).
  // Thread-safe.
  std::vector<int32_t> encode(std::string_view text) const;
  // Appends to out (no allocation per call once out has grown).
  void encode(std::string_view text, std::vector<int32_t>& out) const;

  // The bytes the ids stand for (not replaced when a cut splits a UTF-8
  // character, unlike Hugging Face's lossy String); special tokens are kept
  // unless skip_special_tokens. An id outside the vocabulary is an Error.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(int32_t id) const;
  // One past the largest id (model vocabulary and added tokens): the range
  // a token id file must hold.
  int64_t vocab_size() const;

  const BpeModel& model() const;
  const std::vector<AddedToken>& added_tokens() const;

  // The tokenizer.json text: the document it was read from, or for a
  // trained tokenizer the one train_bpe built (Hugging Face's layout).
  const std::string& to_json() const;
  // Writes to_json() to path (through a temporary file and a rename, so a
  // failed save leaves any old file whole).
  void save(const std::string& path) const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace ember::text
