// The BPE trainer's merge loop (text/bpe_trainer.h). It follows Hugging
// Face's algorithm step for step, including what decides ties: the queue
// holds (count, pair, word positions) entries that are refreshed lazily when
// popped, and a merge is applied only to the words its entry lists.
#include "text/bpe_trainer.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>

#include "core/exception.h"
#include "text/byte_level.h"

namespace ember::text {

BpeTrainer::BpeTrainer(TrainOptions options) : options_(std::move(options)), split_(kGpt2Pattern) {
  EMBER_CHECK(options_.vocab_size > 0, "train: vocab_size must be positive, got ", options_.vocab_size);
  EMBER_CHECK(options_.min_frequency >= 0, "train: min_frequency must be >= 0, got ", options_.min_frequency);
}

void BpeTrainer::feed(std::string_view seq) {
  if (seq.empty()) return;
  const size_t bad = find_invalid_utf8(seq);
  EMBER_CHECK(bad == std::string_view::npos, "train: the text is not valid UTF-8 at byte ", bad);
  std::string prefixed;
  if (options_.add_prefix_space && seq[0] != ' ') {
    prefixed.reserve(seq.size() + 1);
    prefixed += ' ';
    prefixed += seq;
    seq = prefixed;
  }
  split_.split_isolated(seq, [&](size_t b, size_t e) { ++words_[std::string(seq.substr(b, e - b))]; });
}

void BpeTrainer::feed_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EMBER_CHECK(in, path, ": cannot open the corpus file");
  std::ostringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const size_t bad = find_invalid_utf8(text);
  EMBER_CHECK(bad == std::string::npos, path, ": not valid UTF-8 at byte ", bad);
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    const size_t end = nl == std::string::npos ? text.size() : nl + 1;
    feed(std::string_view(text).substr(pos, end - pos));
    pos = end;
  }
}

namespace {

using Pair = uint64_t;  // left id << 32 | right id: orders as Hugging Face's (u32, u32) tuple
Pair make_pair(uint32_t a, uint32_t b) { return (uint64_t{a} << 32) | b; }

struct QueueEntry {
  int64_t count;
  Pair pair;
  size_t pos;  // index of its word-position list in the pool
};
// The top is the highest count, then the smallest pair.
struct QueueOrder {
  bool operator()(const QueueEntry& x, const QueueEntry& y) const {
    if (x.count != y.count) return x.count < y.count;
    return x.pair > y.pair;
  }
};

// Hugging Face's Word::merge: every non-overlapping occurrence of (a, b),
// left to right, becomes `merged`; the pair changes (-1 for pairs that went
// away, +1 for new ones) go to `changes`.
void merge_word(std::vector<uint32_t>& s, uint32_t a, uint32_t b, uint32_t merged,
                std::vector<std::pair<Pair, int>>& changes) {
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != a || i + 1 >= s.size() || s[i + 1] != b) continue;
    if (i > 0) {
      changes.emplace_back(make_pair(s[i - 1], a), -1);
      changes.emplace_back(make_pair(s[i - 1], merged), 1);
    }
    s[i] = merged;
    s.erase(s.begin() + i + 1);
    if (i + 1 < s.size()) {
      changes.emplace_back(make_pair(b, s[i + 1]), -1);
      changes.emplace_back(make_pair(merged, s[i + 1]), 1);
    }
  }
}

}  // namespace

Tokenizer BpeTrainer::train() const {
  // Token strings are in byte-level form, as Hugging Face keys them: a merge
  // whose result equals an existing token (a special token's content, or
  // the same string merged another way) reuses that token's id.
  std::unordered_map<std::string, uint32_t> word_to_id;
  std::vector<std::string> id_to_word;
  auto add_token = [&](const std::string& s) {
    auto [it, inserted] = word_to_id.emplace(s, static_cast<uint32_t>(id_to_word.size()));
    if (inserted) id_to_word.push_back(s);
    return it->second;
  };
  // Special tokens first, each once (Hugging Face ignores a repeat).
  std::vector<std::string> specials;
  for (const std::string& s : options_.special_tokens)
    if (!s.empty() && !word_to_id.count(s)) specials.push_back(s), add_token(s);
  // The alphabet, in code point order: all 256 bytes' characters
  // (ByteLevel.alphabet(), a superset of those seen).
  std::vector<uint32_t> alphabet;
  for (int b = 0; b < 256; ++b) alphabet.push_back(byte_to_codepoint(static_cast<uint8_t>(b)));
  std::sort(alphabet.begin(), alphabet.end());
  uint32_t byte_id[256];
  for (uint32_t cp : alphabet) {
    std::string s;
    append_utf8(cp, s);
    byte_id[codepoint_to_byte(cp)] = add_token(s);
  }

  std::vector<std::vector<uint32_t>> words;
  std::vector<int64_t> counts;
  words.reserve(words_.size());
  for (const auto& [w, c] : words_) {
    std::vector<uint32_t> s;
    s.reserve(w.size());
    for (unsigned char b : w) s.push_back(byte_id[b]);
    words.push_back(std::move(s));
    counts.push_back(static_cast<int64_t>(c));
  }

  std::unordered_map<Pair, int64_t> pair_counts;
  std::unordered_map<Pair, std::vector<uint32_t>> where;
  for (size_t i = 0; i < words.size(); ++i) {
    const auto& s = words[i];
    for (size_t k = 0; k + 1 < s.size(); ++k) {
      const Pair p = make_pair(s[k], s[k + 1]);
      pair_counts[p] += counts[i];
      auto& v = where[p];
      if (v.empty() || v.back() != i) v.push_back(static_cast<uint32_t>(i));
    }
  }
  std::vector<std::vector<uint32_t>> pool;  // word positions of queue entries
  std::priority_queue<QueueEntry, std::vector<QueueEntry>, QueueOrder> queue;
  auto push_where = [&]() {
    for (auto& [p, pos] : where) {
      const int64_t c = pair_counts[p];
      if (c <= 0) continue;
      std::sort(pos.begin(), pos.end());
      pos.erase(std::unique(pos.begin(), pos.end()), pos.end());
      pool.push_back(std::move(pos));
      queue.push({c, p, pool.size() - 1});
    }
    where.clear();
  };
  push_where();

  std::vector<std::pair<Pair, uint32_t>> merges;  // in order, duplicates included
  std::vector<std::pair<Pair, int>> changes;
  while (static_cast<int64_t>(word_to_id.size()) < options_.vocab_size && !queue.empty()) {
    if (options_.max_merges >= 0 && static_cast<int64_t>(merges.size()) >= options_.max_merges) break;
    QueueEntry top = queue.top();
    queue.pop();
    const int64_t current = pair_counts[top.pair];
    if (top.count != current) {
      top.count = current;
      queue.push(top);
      continue;
    }
    if (top.count < 1 || options_.min_frequency > top.count) break;
    const auto a = static_cast<uint32_t>(top.pair >> 32), b = static_cast<uint32_t>(top.pair & 0xFFFFFFFFu);
    const uint32_t merged = add_token(id_to_word[a] + id_to_word[b]);
    merges.emplace_back(top.pair, merged);
    std::vector<uint32_t> pos = std::move(pool[top.pos]);
    for (uint32_t i : pos) {
      changes.clear();
      merge_word(words[i], a, b, merged, changes);
      for (const auto& [p, change] : changes) {
        pair_counts[p] += change * counts[i];
        if (change > 0) where[p].push_back(i);
      }
    }
    push_where();
  }

  // A pair merged twice (Hugging Face's queue can list it again when a
  // reused token id raises its count) keeps its last rank, as their merge
  // map does.
  std::unordered_map<Pair, size_t> last_rank;
  for (size_t r = 0; r < merges.size(); ++r) last_rank[merges[r].first] = r;

  nlohmann::ordered_json model;
  model["type"] = "BPE";
  model["dropout"] = nullptr;
  model["unk_token"] = nullptr;
  model["continuing_subword_prefix"] = nullptr;
  model["end_of_word_suffix"] = nullptr;
  model["fuse_unk"] = false;
  model["byte_fallback"] = false;
  model["ignore_merges"] = false;
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  for (size_t id = 0; id < id_to_word.size(); ++id) vocab[id_to_word[id]] = id;
  model["vocab"] = std::move(vocab);
  nlohmann::ordered_json merge_list = nlohmann::ordered_json::array();
  for (size_t r = 0; r < merges.size(); ++r) {
    if (last_rank[merges[r].first] != r) continue;
    merge_list.push_back({id_to_word[merges[r].first >> 32], id_to_word[merges[r].first & 0xFFFFFFFFu]});
  }
  model["merges"] = std::move(merge_list);

  nlohmann::ordered_json doc;
  doc["version"] = "1.0";
  doc["truncation"] = nullptr;
  doc["padding"] = nullptr;
  nlohmann::ordered_json added = nlohmann::ordered_json::array();
  for (const std::string& s : specials) {
    added.push_back({{"id", word_to_id[s]},
                     {"content", s},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  doc["added_tokens"] = std::move(added);
  doc["normalizer"] = nullptr;
  doc["pre_tokenizer"] = {{"type", "ByteLevel"},
                          {"add_prefix_space", options_.add_prefix_space},
                          {"trim_offsets", true},
                          {"use_regex", true}};
  doc["post_processor"] = nullptr;
  doc["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  doc["model"] = std::move(model);
  return Tokenizer::from_json(doc.dump(2), "trained tokenizer");
}

Tokenizer train_bpe(const std::vector<std::string>& sequences, const TrainOptions& options) {
  BpeTrainer trainer(options);
  for (const std::string& s : sequences) trainer.feed(s);
  return trainer.train();
}

}  // namespace ember::text
