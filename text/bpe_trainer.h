// Training a byte-level BPE vocabulary as Hugging Face tokenizers' BpeTrainer
// does with a ByteLevel pre-tokenizer and initial_alphabet =
// ByteLevel.alphabet() (models/bpe/trainer.rs): special tokens get the first
// ids, then the 256 byte characters in code point order, then one token per
// merge; each step merges the pair with the highest count over all words
// (weighted by word frequency), ties going to the smaller (left id, right
// id). docs/text.md says where the result can differ from theirs.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "text/regex.h"
#include "text/tokenizer.h"

namespace ember::text {

struct TrainOptions {
  // Hugging Face's vocab_size: training stops when special tokens, alphabet
  // and merged tokens number this many.
  int64_t vocab_size = 30000;
  // Also stop after this many merges (-1: no limit), for "N merges".
  int64_t max_merges = -1;
  // A pair seen fewer times than this is never merged.
  int64_t min_frequency = 0;
  std::vector<std::string> special_tokens;
  // The pre-tokenizer's add_prefix_space (GPT-2: false).
  bool add_prefix_space = false;
};

class BpeTrainer {
 public:
  explicit BpeTrainer(TrainOptions options);

  // Adds one sequence's words. Hugging Face's train(files) feeds each line
  // of a file with its line ending; feed_file() does the same. Special
  // tokens are not split off while counting (nor are they in Hugging Face).
  void feed(std::string_view sequence);
  // Reads path and feeds its lines (with their endings); errors name it.
  void feed_file(const std::string& path);

  // The distinct words counted so far.
  size_t word_count() const { return words_.size(); }

  // Runs the merges and returns the tokenizer (its to_json() is the
  // tokenizer.json to save).
  Tokenizer train() const;

 private:
  TrainOptions options_;
  Regex split_;
  std::unordered_map<std::string, uint64_t> words_;  // raw bytes -> count
};

// One call: feed every sequence, train.
Tokenizer train_bpe(const std::vector<std::string>& sequences, const TrainOptions& options);

}  // namespace ember::text
