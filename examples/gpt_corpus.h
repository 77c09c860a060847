// The GPT example's corpus (examples/gpt.cc): the quotes of Debian's
// `fortunes` package (or synthetic sentences when it is missing), split into
// training and held-out text, a byte-level vocabulary, and the token windows
// a step trains on.
#pragma once

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "distributed/logging/logging.h"

namespace ember::examples {

namespace fs = std::filesystem;

struct Corpus {
  std::string train, val;            // text
  std::vector<unsigned char> chars;  // the vocabulary: every byte of the text, sorted
  std::vector<int> id;               // byte -> token id
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

inline Corpus load_corpus(const std::string& data) {
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
  for (size_t i = 0; i < quotes.size(); ++i) (i % 20 == 7 ? c.val : c.train) += quotes[i] + "\n";
  std::vector<bool> seen(256, false);
  for (unsigned char ch : c.train + c.val) seen[ch] = true;
  c.id.assign(256, -1);
  for (int b = 0; b < 256; ++b)
    if (seen[b]) c.id[b] = static_cast<int>(c.chars.size()), c.chars.push_back(static_cast<unsigned char>(b));
  return c;
}

// Token windows: inputs [n, seq] and targets [n * seq] (the next characters).
inline std::pair<Tensor, Tensor> windows(const Corpus& c, const std::string& text, const std::vector<int64_t>& starts,
                                         int64_t seq) {
  std::vector<double> x, y;
  for (int64_t s : starts)
    for (int64_t t = 0; t < seq; ++t) {
      x.push_back(c.id[static_cast<unsigned char>(text[s + t])]);
      y.push_back(c.id[static_cast<unsigned char>(text[s + t + 1])]);
    }
  const int64_t n = static_cast<int64_t>(starts.size());
  return {Tensor::from_vector(x, {n, seq}, DType::Int64), Tensor::from_vector(y, {n * seq}, DType::Int64)};
}

}  // namespace ember::examples
