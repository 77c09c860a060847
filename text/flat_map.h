// Two open-addressing hash tables for the encoder's hot path, where
// std::unordered_map's node allocations and pointer chasing would cost more
// than the BPE itself: MergeMap (token pair -> rank and merged token) and
// WordCache (a pre-tokenized piece's bytes -> its token ids).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace ember::text {

inline uint64_t mix64(uint64_t h) {
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  return h;
}

inline uint64_t hash_bytes(const char* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0x100000001b3ull);
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ w) * 0xbf58476d1ce4e5b9ull;
    h ^= h >> 29;
    p += 8;
    n -= 8;
  }
  if (n) {
    uint64_t w = 0;
    std::memcpy(&w, p, n);
    h = (h ^ w) * 0x94d049bb133111ebull;
  }
  return mix64(h);
}

// uint64 key -> uint64 value; the key ~0 is reserved (empty slot).
class MergeMap {
 public:
  static constexpr uint64_t kEmpty = ~0ull;
  static uint64_t key(uint32_t a, uint32_t b) { return (uint64_t{a} << 32) | b; }

  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    keys_.assign(cap, kEmpty);
    values_.assign(cap, 0);
    size_ = 0;
  }
  // Inserts or overwrites (a later duplicate merge wins, as in Hugging Face).
  void put(uint64_t k, uint64_t v) {
    if (2 * (size_ + 1) > keys_.size()) grow();
    size_t i = slot(k);
    if (keys_[i] == kEmpty) ++size_, keys_[i] = k;
    values_[i] = v;
  }
  // The value, or kEmpty.
  uint64_t get(uint64_t k) const {
    if (keys_.empty()) return kEmpty;
    const size_t i = slot(k);
    return keys_[i] == k ? values_[i] : kEmpty;
  }
  size_t size() const { return size_; }

 private:
  size_t slot(uint64_t k) const {
    const size_t mask = keys_.size() - 1;
    size_t i = mix64(k) & mask;
    while (keys_[i] != kEmpty && keys_[i] != k) i = (i + 1) & mask;
    return i;
  }
  void grow() {
    std::vector<uint64_t> ok = std::move(keys_), ov = std::move(values_);
    reserve(ok.empty() ? 8 : ok.size());
    for (size_t i = 0; i < ok.size(); ++i)
      if (ok[i] != kEmpty) put(ok[i], ov[i]);
  }
  std::vector<uint64_t> keys_, values_;
  size_t size_ = 0;
};

// Piece bytes -> token ids, bounded: when full it starts over, so a long
// stream with a drifting vocabulary keeps its recent words.
class WordCache {
 public:
  explicit WordCache(size_t slots = size_t{1} << 18) : slots_(slots) {}

  const int32_t* find(std::string_view key, uint64_t h, uint32_t* n) const {
    if (slots_.empty()) return nullptr;
    const size_t mask = slots_.size() - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
      const Slot& s = slots_[i];
      if (s.key_len == 0) return nullptr;
      if (s.hash == h && s.key_len == key.size() &&
          std::memcmp(keys_.data() + s.key_off, key.data(), key.size()) == 0) {
        *n = s.ids_len;
        return ids_.data() + s.ids_off;
      }
    }
  }

  void insert(std::string_view key, uint64_t h, const int32_t* ids, uint32_t n) {
    if (2 * (size_ + 1) > slots_.size()) clear();
    const size_t mask = slots_.size() - 1;
    size_t i = h & mask;
    while (slots_[i].key_len != 0) i = (i + 1) & mask;
    slots_[i] = Slot{h, static_cast<uint32_t>(keys_.size()), static_cast<uint32_t>(key.size()),
                     static_cast<uint32_t>(ids_.size()), n};
    keys_.append(key);
    ids_.insert(ids_.end(), ids, ids + n);
    ++size_;
  }

  void clear() {
    for (Slot& s : slots_) s.key_len = 0;
    keys_.clear();
    ids_.clear();
    size_ = 0;
  }

 private:
  struct Slot {
    uint64_t hash = 0;
    uint32_t key_off = 0, key_len = 0;  // key_len 0: empty (pieces are never empty)
    uint32_t ids_off = 0, ids_len = 0;
  };
  std::vector<Slot> slots_;
  std::string keys_;
  std::vector<int32_t> ids_;
  size_t size_ = 0;
};

}  // namespace ember::text
