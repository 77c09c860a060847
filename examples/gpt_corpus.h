// The GPT example's corpus (examples/gpt.cc) as two token streams, training
// and held out: either token shards (a directory //tools:tokenize or llm.c
// wrote, ids from a BPE tokenizer) or, by default, the quotes of Debian's
// `fortunes` package (synthetic sentences when it is missing) as
// characters, every byte of the text a token. Windows, batches and the
// unigram baseline are the streams' (data/tokens.h) either way.
#pragma once

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "data/tokens.h"
#include "distributed/logging/logging.h"
#include "text/bpe_trainer.h"
#include "text/tokenizer.h"

namespace ember::examples {

namespace fs = std::filesystem;

struct Corpus {
  data::TokenStream train, val;
  int64_t vocab = 0;
  // A token's text (decoding a sample), and the token a sample starts from.
  std::function<std::string(uint32_t)> piece;
  uint32_t start_token = 0;
  std::string unit = "characters";  // what a token is, for the lines that count them
  std::string tokenizer_path;       // the tokenizer.json the tokens are from (empty: characters)
  std::string description;
  bool synthetic = false;
};

// The quotes of every fortune file in `dir` (the files without an
// extension; ".dat" are indexes, ".u8" links), split at lines holding "%".
inline std::vector<std::string> read_fortunes(const fs::path& path) {
  std::vector<fs::path> files;
  if (fs::is_directory(path)) {
    for (auto& e : fs::directory_iterator(path))
      if (e.is_regular_file() && e.path().extension().empty()) files.push_back(e.path());
  } else {
    files.push_back(path);
  }
  std::sort(files.begin(), files.end());
  std::vector<std::string> quotes;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    EMBER_CHECK(in, "--data: cannot read ", f.string());
    std::string line, cur;
    while (std::getline(in, line)) {
      if (line == "%") {
        if (!cur.empty()) quotes.push_back(cur);
        cur.clear();
      } else {
        cur += line + "\n";
      }
    }
    if (!cur.empty()) quotes.push_back(cur);
  }
  return quotes;
}

// A tokenizer's pieces for samples, and the token a sample starts from
// (the end-of-text token, or a newline's first token).
inline void use_tokenizer(Corpus& c, const std::shared_ptr<const text::Tokenizer>& tok) {
  c.piece = [tok](uint32_t id) { return tok->decode(std::vector<int32_t>{static_cast<int32_t>(id)}); };
  const auto eot = tok->token_to_id("<|endoftext|>");
  c.start_token = static_cast<uint32_t>(eot ? *eot : tok->encode("\n").at(0));
}

// Token shards in `dir` (index.json's, or *train*.bin / *val*.bin); the
// vocabulary is the tokenizer's (`tok`, or the one index.json names when it
// still exists), else index.json's, else the largest id + 1.
inline Corpus load_token_corpus(const std::string& dir, std::shared_ptr<const text::Tokenizer> tok) {
  Corpus c;
  int64_t vocab = tok ? tok->vocab_size() : 0;
  if (auto index = data::read_shard_index(dir); index.ok()) {
    EMBER_CHECK(!tok || index->vocab_size == vocab, "--data ", dir, ": index.json's vocab_size ", index->vocab_size,
                " and the tokenizer's ", vocab, " differ (tokenized with another tokenizer?)");
    if (!tok && !index->tokenizer_path.empty() && fs::is_regular_file(index->tokenizer_path)) {
      tok = std::make_shared<const text::Tokenizer>(text::Tokenizer::from_file(index->tokenizer_path));
      c.tokenizer_path = index->tokenizer_path;
    }
    vocab = index->vocab_size;
  }
  auto open = [&](const char* split) {
    auto paths = data::token_shards(dir, split);
    EMBER_CHECK(paths.ok(), "--data: ", paths.status().message());
    auto s = data::TokenStream::open(*paths, vocab);
    EMBER_CHECK(s.ok(), "--data: ", s.status().message());
    return *std::move(s);
  };
  c.train = open("train");
  c.val = open("val");
  c.vocab = vocab > 0 ? vocab : static_cast<int64_t>(std::max(c.train.max_id(), c.val.max_id())) + 1;
  c.piece = [](uint32_t id) { return "<" + std::to_string(id) + ">"; };
  if (tok) use_tokenizer(c, tok);
  c.unit = "tokens";
  c.description = "token shards in " + dir + " (vocabulary " + std::to_string(c.vocab) + ")";
  return c;
}

// The tokenizer --tokenizer names: none (characters), a tokenizer.json, or
// "bpe:N", a byte-level BPE of N tokens trained on `train_text` (Hugging
// Face's BpeTrainer, as //tools:tokenize --train; deterministic, so every
// rank trains the same one) and written to `save_to` by rank 0.
inline std::shared_ptr<const text::Tokenizer> make_tokenizer(const std::string& spec, const std::string& train_text,
                                                             const std::string& save_to, bool writer) {
  if (spec.empty()) return nullptr;
  if (spec.rfind("bpe:", 0) != 0) return std::make_shared<const text::Tokenizer>(text::Tokenizer::from_file(spec));
  text::TrainOptions o;
  o.vocab_size = std::stoll(spec.substr(4));
  o.min_frequency = 2;
  o.special_tokens = {"<|endoftext|>"};
  text::BpeTrainer trainer(o);
  std::istringstream in(train_text);
  for (std::string line; std::getline(in, line);) trainer.feed(line + "\n");
  auto tok = std::make_shared<const text::Tokenizer>(trainer.train());
  if (writer) {
    fs::create_directories(fs::path(save_to).parent_path());
    tok->save(save_to);
  }
  return tok;
}

// `data`: a directory of token shards, a fortunes directory or file, or
// "synthetic"; text is tokenized by `tokenizer` (make_tokenizer's spec; the
// bpe:N one is saved to `tokenizer_out`), or as characters without one.
inline Corpus load_corpus(const std::string& data, const std::string& tokenizer = "",
                          const std::string& tokenizer_out = "", bool writer = false) {
  if (data != "synthetic" && fs::is_directory(data) && data::token_shards(data, "train").ok()) {
    EMBER_CHECK(tokenizer.rfind("bpe:", 0) != 0, "--tokenizer ", tokenizer, ": --data ", data,
                " is already tokenized; give its tokenizer.json (or none: index.json names it)");
    Corpus c = load_token_corpus(data, make_tokenizer(tokenizer, "", "", false));
    if (!tokenizer.empty()) c.tokenizer_path = fs::absolute(tokenizer).string();
    return c;
  }
  Corpus c;
  std::vector<std::string> quotes;
  if (data != "synthetic" && fs::exists(data)) {
    quotes = read_fortunes(data);
    c.description = std::to_string(quotes.size()) + " quotes from " + data;
  }
  if (quotes.empty()) {
    if (data != "synthetic")
      LOG0("WARNING: no fortunes at ", data,
           ".\nWARNING: training on SYNTHETIC text instead; the losses are not a "
           "real corpus'. Install it with `apt-get install fortunes` (tools/setup.sh does) or pass --data.");
    // Sentences from a small grammar: learnable structure, but not language.
    std::mt19937 g(1);
    const char* subj[] = {"the cat", "a dog", "my friend", "the old man", "every child", "no one"};
    const char* verb[] = {"sees", "likes", "finds", "remembers", "wants", "forgets"};
    const char* obj[] = {"the moon", "a small house", "the red ball", "his own shadow", "the long road"};
    for (int q = 0; q < 4000; ++q) {
      std::string s;
      for (int k = 0; k < 1 + static_cast<int>(g() % 3); ++k)
        s += std::string(subj[g() % 6]) + " " + verb[g() % 6] + " " + obj[g() % 5] + ".\n";
      quotes.push_back(s);
    }
    c.synthetic = true;
    c.description = "synthetic sentences (" + std::to_string(quotes.size()) + ")";
  }
  // A fixed split, whatever --seed: every 20th quote is held out.
  std::string train, val;
  for (size_t i = 0; i < quotes.size(); ++i) (i % 20 == 7 ? val : train) += quotes[i] + "\n";
  if (auto tok = make_tokenizer(tokenizer, train, tokenizer_out, writer)) {
    // The text's tokens, encoded here (a few MB: a fraction of a second).
    auto ids = [&](const std::string& t) {
      const std::vector<int32_t> v = tok->encode(t);
      return std::vector<uint32_t>(v.begin(), v.end());
    };
    c.train = data::TokenStream::from_ids(ids(train));
    c.val = data::TokenStream::from_ids(ids(val));
    c.vocab = tok->vocab_size();
    use_tokenizer(c, tok);
    c.unit = "tokens";
    c.tokenizer_path = fs::absolute(tokenizer.rfind("bpe:", 0) == 0 ? tokenizer_out : tokenizer).string();
    c.description += ", BPE vocabulary " + std::to_string(c.vocab) +
                     (tokenizer.rfind("bpe:", 0) == 0 ? " trained on it" : " of " + tokenizer);
    return c;
  }
  // The vocabulary: every byte of the text, sorted.
  std::vector<bool> seen(256, false);
  for (unsigned char ch : train + val) seen[ch] = true;
  std::vector<uint32_t> id(256, 0);
  auto chars = std::make_shared<std::vector<unsigned char>>();
  for (int b = 0; b < 256; ++b)
    if (seen[b]) id[b] = static_cast<uint32_t>(chars->size()), chars->push_back(static_cast<unsigned char>(b));
  auto ids = [&](const std::string& text) {
    std::vector<uint32_t> out(text.size());
    for (size_t i = 0; i < text.size(); ++i) out[i] = id[static_cast<unsigned char>(text[i])];
    return out;
  };
  c.train = data::TokenStream::from_ids(ids(train));
  c.val = data::TokenStream::from_ids(ids(val));
  c.vocab = static_cast<int64_t>(chars->size());
  c.piece = [chars](uint32_t t) { return std::string(1, static_cast<char>((*chars)[t])); };
  c.start_token = id['\n'];
  return c;
}

}  // namespace ember::examples
