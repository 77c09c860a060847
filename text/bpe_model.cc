// The BPE merge loop and the per-thread word cache (text/bpe_model.h).
#include "text/bpe_model.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <queue>

#include "core/exception.h"
#include "text/byte_level.h"

namespace ember::text {

namespace {

// Hugging Face caches words shorter than 256 bytes (utils/cache.rs); longer
// ones rarely repeat.
constexpr size_t kMaxCachedLen = 256;
// Words up to this many symbols merge by scanning for the lowest rank
// (quadratic, but no allocation and cache-friendly); longer ones by a heap.
constexpr size_t kScanMaxSymbols = 48;

std::atomic<uint64_t> next_cache_uid{1};

// A few models' caches per thread, so threads share no state and encoding
// takes no lock; a thread alternating between more models than slots only
// loses cache hits.
struct ThreadCaches {
  static constexpr int kSlots = 4;
  uint64_t uid[kSlots] = {};
  std::unique_ptr<WordCache> cache[kSlots];
  int next = 0;
  WordCache& get(uint64_t id) {
    for (int i = 0; i < kSlots; ++i)
      if (uid[i] == id) return *cache[i];
    const int i = next;
    next = (next + 1) % kSlots;
    uid[i] = id;
    cache[i] = std::make_unique<WordCache>();
    return *cache[i];
  }
};

WordCache& thread_cache(uint64_t uid) {
  thread_local ThreadCaches caches;
  return caches.get(uid);
}

}  // namespace

BpeModel::BpeModel(std::unordered_map<std::string, int32_t> vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options)
    : vocab_(std::move(vocab)), options_(std::move(options)), cache_uid_(next_cache_uid.fetch_add(1)) {
  for (const auto& [token, id] : vocab_) id_bound_ = std::max<int64_t>(id_bound_, int64_t{id} + 1);
  for (int b = 0; b < 256; ++b) {
    std::string s;
    append_utf8(byte_to_codepoint(static_cast<uint8_t>(b)), s);
    auto it = vocab_.find(s);
    byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
  }
  if (options_.unk_token) {
    auto it = vocab_.find(*options_.unk_token);
    EMBER_INTERNAL_ASSERT(it != vocab_.end(), "unk token checked by the loader");
    unk_id_ = it->second;
  }
  if (options_.ignore_merges) {
    for (const auto& [token, id] : vocab_)
      if (auto bytes = token_to_bytes(token)) vocab_by_bytes_.emplace(std::move(*bytes), id);
  }
  merges_.reserve(merges.size());
  std::vector<uint64_t> pair_of_rank;
  pair_of_rank.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    auto ia = vocab_.find(a), ib = vocab_.find(b), im = vocab_.find(a + b);
    EMBER_INTERNAL_ASSERT(ia != vocab_.end() && ib != vocab_.end() && im != vocab_.end(),
                          "merge tokens checked by the loader");
    const uint64_t k = MergeMap::key(ia->second, ib->second);
    merges_.put(k, (uint64_t{rank} << 32) | static_cast<uint32_t>(im->second));
    pair_of_rank.push_back(k);
  }
  // The rank order with each pair at its surviving (last) rank.
  for (size_t rank = 0; rank < pair_of_rank.size(); ++rank) {
    if ((merges_.get(pair_of_rank[rank]) >> 32) != rank) continue;
    merge_list_.emplace_back(static_cast<int32_t>(pair_of_rank[rank] >> 32),
                             static_cast<int32_t>(pair_of_rank[rank] & 0xFFFFFFFFu));
  }
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(std::string(token));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

void BpeModel::initial_symbols(std::string_view piece, std::vector<int32_t>& symbols) const {
  symbols.clear();
  // Hugging Face's merge_word on the byte-level string: one character per
  // byte; a character missing from the vocabulary becomes its UTF-8 bytes'
  // <0xAB> tokens (byte_fallback), else the unknown token (consecutive ones
  // fused with fuse_unk), else nothing.
  bool last_unk = false;
  for (unsigned char b : piece) {
    const int32_t id = byte_ids_[b];
    if (id >= 0) {
      symbols.push_back(id);
      last_unk = false;
      continue;
    }
    if (options_.byte_fallback) {
      std::string ch;
      append_utf8(byte_to_codepoint(b), ch);
      std::vector<int32_t> fb;
      for (unsigned char u : ch) {
        char name[8];
        std::snprintf(name, sizeof(name), "<0x%02X>", u);
        auto it = vocab_.find(name);
        if (it == vocab_.end()) break;
        fb.push_back(it->second);
      }
      if (fb.size() == ch.size()) {
        symbols.insert(symbols.end(), fb.begin(), fb.end());
        last_unk = false;
        continue;
      }
    }
    if (unk_id_) {
      if (!(last_unk && options_.fuse_unk)) symbols.push_back(*unk_id_);
      last_unk = true;
    }
  }
}

void BpeModel::merge_symbols_scan(std::vector<int32_t>& s) const {
  size_t n = s.size();
  if (n < 2) return;
  // r[i]: the merge of (s[i], s[i+1]) as rank << 32 | merged id, kEmpty if
  // none; comparing whole values orders by rank (equal ranks are the same
  // pair, so the same merged id), and the strict < keeps the leftmost.
  uint64_t r[kScanMaxSymbols];
  for (size_t i = 0; i + 1 < n; ++i) r[i] = merges_.get(MergeMap::key(s[i], s[i + 1]));
  while (true) {
    size_t best = n;
    uint64_t best_v = MergeMap::kEmpty;
    for (size_t i = 0; i + 1 < n; ++i)
      if (r[i] < best_v) best_v = r[i], best = i;
    if (best == n) break;
    s[best] = static_cast<int32_t>(best_v & 0xFFFFFFFFu);
    for (size_t i = best + 1; i + 1 < n; ++i) s[i] = s[i + 1], r[i] = r[i + 1];
    --n;
    if (best > 0) r[best - 1] = merges_.get(MergeMap::key(s[best - 1], s[best]));
    if (best + 1 < n) r[best] = merges_.get(MergeMap::key(s[best], s[best + 1]));
  }
  s.resize(n);
}

void BpeModel::merge_symbols_heap(std::vector<int32_t>& s) const {
  // Hugging Face's Word::merge_all: a min-heap of (rank, position) over a
  // linked list of symbols; an entry is stale when its symbol was merged
  // away or its pair changed.
  const size_t n = s.size();
  if (n < 2) return;
  std::vector<int32_t> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i < n; ++i) prev[i] = static_cast<int32_t>(i) - 1, next[i] = i + 1 < n ? i + 1 : -1;
  using Entry = std::pair<uint64_t, size_t>;  // (rank << 32 | merged id, position)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (size_t i = 0; i + 1 < n; ++i) {
    const uint64_t v = merges_.get(MergeMap::key(s[i], s[i + 1]));
    if (v != MergeMap::kEmpty) heap.emplace(v, i);
  }
  while (!heap.empty()) {
    const auto [v, pos] = heap.top();
    heap.pop();
    if (!alive[pos] || next[pos] < 0) continue;
    const size_t right = next[pos];
    if (merges_.get(MergeMap::key(s[pos], s[right])) != v) continue;
    s[pos] = static_cast<int32_t>(v & 0xFFFFFFFFu);
    alive[right] = false;
    next[pos] = next[right];
    if (next[pos] >= 0) prev[next[pos]] = static_cast<int32_t>(pos);
    if (prev[pos] >= 0) {
      const uint64_t pv = merges_.get(MergeMap::key(s[prev[pos]], s[pos]));
      if (pv != MergeMap::kEmpty) heap.emplace(pv, static_cast<size_t>(prev[pos]));
    }
    if (next[pos] >= 0) {
      const uint64_t nv = merges_.get(MergeMap::key(s[pos], s[next[pos]]));
      if (nv != MergeMap::kEmpty) heap.emplace(nv, pos);
    }
  }
  size_t k = 0;
  for (size_t i = 0; i < n; ++i)
    if (alive[i]) s[k++] = s[i];
  s.resize(k);
}

void BpeModel::merge_symbols(std::vector<int32_t>& symbols) const {
  if (symbols.size() <= kScanMaxSymbols)
    merge_symbols_scan(symbols);
  else
    merge_symbols_heap(symbols);
}

void BpeModel::tokenize(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  if (options_.ignore_merges) {
    auto it = vocab_by_bytes_.find(std::string(piece));
    if (it != vocab_by_bytes_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (piece.size() == 1 && byte_ids_[static_cast<unsigned char>(piece[0])] >= 0) {
    out.push_back(byte_ids_[static_cast<unsigned char>(piece[0])]);
    return;
  }
  thread_local std::vector<int32_t> symbols;
  if (piece.size() >= kMaxCachedLen) {
    initial_symbols(piece, symbols);
    merge_symbols(symbols);
    out.insert(out.end(), symbols.begin(), symbols.end());
    return;
  }
  WordCache& cache = thread_cache(cache_uid_);
  const uint64_t h = hash_bytes(piece.data(), piece.size());
  uint32_t n = 0;
  if (const int32_t* ids = cache.find(piece, h, &n)) {
    out.insert(out.end(), ids, ids + n);
    return;
  }
  initial_symbols(piece, symbols);
  merge_symbols(symbols);
  cache.insert(piece, h, symbols.data(), static_cast<uint32_t>(symbols.size()));
  out.insert(out.end(), symbols.begin(), symbols.end());
}

}  // namespace ember::text
