// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
// 3", SC'11): a counter-based RNG, so element i of a random op can be drawn
// independently by any thread on any device. The CPU and CUDA random kernels
// both call random_value(), which is why a seed gives the same tensor on both.
#pragma once

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

// Element i's draw, in double; the kernels round it to the output dtype.
// Uniform: U[a, b). Normal: Box-Muller, mean a, std b. Bernoulli: 1 if u < p.
EMBER_HD double random_value(RandomKind kind, int64_t i, double a, double b, double p, uint64_t seed,
                             uint64_t offset) {
  Philox4 r = philox4x32_10(static_cast<uint64_t>(i), offset, seed);
  double u = uniform01(r.v[0], r.v[1]);
  if (kind == RandomKind::Uniform) return a + (b - a) * u;
  if (kind == RandomKind::Normal) {
    double u2 = uniform01(r.v[2], r.v[3]);
    double radius = ::sqrt(-2.0 * ::log(1.0 - u));  // 1-u is in (0, 1]: log is finite
    return a + b * radius * ::cos(6.283185307179586 * u2);
  }
  return u < p ? 1.0 : 0.0;
}

}  // namespace ember
