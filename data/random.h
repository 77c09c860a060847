// Counter-based random streams for data loading. Every random decision (an
// epoch's shuffle, one example's crop offset) is a pure function of
// (seed, stream, draw number), so a run is reproducible whatever the number
// of worker threads and whatever order they happen to process examples in.
// Built on core's Philox4x32-10, the generator behind ember::rand.
#pragma once

#include <math.h>  // core/ops/philox.h calls ::sqrt etc. without including it

#include <cstdint>
#include <numeric>
#include <vector>

#include "core/exception.h"
#include "core/ops/philox.h"

namespace ember::data {

// Tags that keep the streams of different users of one seed apart.
enum class StreamKind : uint64_t { Shuffle = 1, Transform = 2, Synthetic = 3 };

class RandomStream {
 public:
  // `a` and `b` name the stream: (epoch, example index) for a transform,
  // (epoch, 0) for a shuffle. Different (kind, a, b) give independent streams.
  // The 128-bit Philox counter is laid out as (a | kind:8 b:32 block:24), the
  // key is the seed: distinct streams can never share a counter block.
  RandomStream(uint64_t seed, StreamKind kind, uint64_t a, uint64_t b)
      : seed_(seed), a_(a), hi_((static_cast<uint64_t>(kind) << 56) | (b << 24)) {
    EMBER_CHECK(b < (uint64_t{1} << 32), "RandomStream: stream index ", b, " does not fit in 32 bits");
  }

  uint32_t next_u32() {
    if (left_ == 0) {
      EMBER_CHECK(block_ < kMaxBlocks, "RandomStream: more than ", 4 * kMaxBlocks, " draws from one stream");
      Philox4 r = philox4x32_10(a_, hi_ | block_++, seed_);
      for (int i = 0; i < 4; ++i) buf_[i] = r.v[i];
      left_ = 4;
    }
    return buf_[--left_];
  }
  uint64_t next_u64() { return (static_cast<uint64_t>(next_u32()) << 32) | next_u32(); }
  // Uniform in [0, n), without modulo bias (Lemire's multiply-and-reject).
  uint64_t uniform_int(uint64_t n) {
    EMBER_CHECK(n > 0, "uniform_int: empty range");
    unsigned __int128 m = static_cast<unsigned __int128>(next_u64()) * n;
    uint64_t low = static_cast<uint64_t>(m);
    if (low < n) {
      const uint64_t threshold = -n % n;
      while (low < threshold) {
        m = static_cast<unsigned __int128>(next_u64()) * n;
        low = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }
  // Uniform in [0, 1).
  double uniform01() {
    uint32_t hi = next_u32(), lo = next_u32();
    return ember::uniform01(hi, lo);
  }

 private:
  static constexpr uint64_t kMaxBlocks = uint64_t{1} << 24;
  uint64_t seed_, a_, hi_;
  uint64_t block_ = 0;
  uint32_t buf_[4] = {};
  int left_ = 0;
};

// A permutation of 0..n-1 determined by (seed, epoch): Fisher-Yates driven by
// a RandomStream. Not torch.randperm's sequence (that depends on torch's
// Mersenne Twister), but the same role: one seed + epoch, one order.
inline std::vector<int64_t> randperm(int64_t n, uint64_t seed, int64_t epoch) {
  EMBER_CHECK(n >= 0, "randperm: negative size ", n);
  std::vector<int64_t> p(n);
  std::iota(p.begin(), p.end(), int64_t{0});
  RandomStream rng(seed, StreamKind::Shuffle, static_cast<uint64_t>(epoch), 0);
  for (int64_t i = n - 1; i > 0; --i) std::swap(p[i], p[rng.uniform_int(static_cast<uint64_t>(i) + 1)]);
  return p;
}

}  // namespace ember::data
