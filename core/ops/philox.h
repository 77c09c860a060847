// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
// 3", SC'11): a counter-based RNG, so element i of a random op can be drawn
// independently by any thread on any device. The CPU and CUDA random kernels
// both draw through the functions here (random_value(), and bernoulli_word's
// four words a call for Bernoulli draws), which is why a seed gives the same
// tensor on both.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "core/ops/kernels.h"

namespace ember {

struct Philox4 {
  uint32_t v[4];
};

EMBER_HD void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

EMBER_HD Philox4 philox4x32_10(uint64_t counter_lo, uint64_t counter_hi, uint64_t seed) {
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(0xD2511F53u, c0, hi0, lo0);
    mulhilo(0xCD9E8D57u, c2, hi1, lo1);
    uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// Uniform in [0, 1) with 53 random bits, from two 32-bit words.
EMBER_HD double uniform01(uint32_t hi, uint32_t lo) {
  uint64_t bits = ((static_cast<uint64_t>(hi) << 32) | lo) >> 11;
  return static_cast<double>(bits) * (1.0 / 9007199254740992.0);
}

// Word w of a call, by selects: an array indexed at run time would live in
// a kernel's local memory.
EMBER_HD uint32_t word_of(const Philox4& r, int64_t w) {
  return w == 0 ? r.v[0] : w == 1 ? r.v[1] : w == 2 ? r.v[2] : r.v[3];
}

EMBER_HD bool is_bernoulli(RandomKind kind) {
  return kind == RandomKind::Bernoulli || kind == RandomKind::Bernoulli_Tensor;
}
// Bernoulli draws take 32 bits each, four from one Philox call (PyTorch's
// CUDA kernels draw four values a call too): element i reads word i % 4 of
// the call at counter i / 4, and is 1 when that word w is below p 2^32
// (u = w 2^-32 < p: 32 bits of resolution, where PyTorch's bernoulli_ takes
// 24). One call an element, 53 bits of it used, left a dropout mask bound
// by its ten Philox rounds: in the fused attention kernels it tripled the
// instructions of a tile (bench/README.md).
EMBER_HD uint32_t bernoulli_word(int64_t i, uint64_t seed, uint64_t offset) {
  return word_of(philox4x32_10(static_cast<uint64_t>(i) / 4, offset, seed), i % 4);
}
// A word w is kept (1) when w < keep_threshold(p): ceil(p 2^32), exact in
// double (p scaled by a power of two), 2^32 when p is 1. p in [0, 1]; a
// NaN keeps nothing (as u < NaN), where the cast would be undefined.
EMBER_HD uint64_t keep_threshold(double p) { return p > 0 ? static_cast<uint64_t>(::ceil(p * 4294967296.0)) : 0; }

// Bernoulli draws in index order, one Philox call for each four: the CPU
// loops' and the blocked kernels' way to draw a mask element by element.
struct BernoulliDraws {
  uint64_t seed, offset;
  uint64_t counter = ~uint64_t{0};
  Philox4 r{};
  EMBER_HD uint32_t word(int64_t i) {
    const uint64_t c = static_cast<uint64_t>(i) / 4;
    if (c != counter) r = philox4x32_10(c, offset, seed), counter = c;
    return word_of(r, i % 4);
  }
};

// Element i's draw, in double; the kernels round it to the output dtype.
// Uniform: U[a, b). Normal: Box-Muller, mean a, std b. Bernoulli: 1 with
// probability p, from bernoulli_word.
EMBER_HD double random_value(RandomKind kind, int64_t i, double a, double b, double p, uint64_t seed,
                             uint64_t offset) {
  if (is_bernoulli(kind)) return bernoulli_word(i, seed, offset) < keep_threshold(p) ? 1.0 : 0.0;
  Philox4 r = philox4x32_10(static_cast<uint64_t>(i), offset, seed);
  const double u = uniform01(r.v[0], r.v[1]);
  if (kind == RandomKind::Normal) {
    double u2 = uniform01(r.v[2], r.v[3]);
    double radius = ::sqrt(-2.0 * ::log(1.0 - u));  // 1-u is in (0, 1]: log is finite
    return a + b * radius * ::cos(6.283185307179586 * u2);
  }
  return a + (b - a) * u;
}

}  // namespace ember
