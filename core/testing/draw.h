// Drawn test cases: a seeded generator of geometries, values and layouts for
// the kernel tests, so that they cover what nobody listed (a non-square
// window, a NaN in a pool, a strided view) as well as the cases written out.
//
//   for_each_draw("pool", 60, [&](Draw& d) {
//     const int64_t kh = d.integer(1, 4), kw = d.integer(1, 4);
//     Tensor x = d.values({2, 3, 9, 7}, DType::Float32, Specials::all());
//     ...
//   });
//
// Each draw has its own seed (a hash of the family's name and the draw's
// index); every failure inside a draw carries that seed and the command that
// replays just it (EMBER_TEST_SEED), and a family stops at its first failing
// draw. EMBER_TEST_DRAWS=N runs N draws per family instead of its CI count
// (thousands for a soak run: tools/cuda_mutants.py and the note in
// docs/design.md, Note [numerics], say when). Draw i is the same on every
// machine and every run, so CI's draws are a fixed prefix of a soak's.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/ops.h"

namespace ember::testing {

// Which special values a drawn tensor may hold, each at a few random places.
struct Specials {
  bool nan = false, inf = false;
  bool ties = false;        // values on a coarse grid, so maxima and argmaxes tie
  bool denormals = false;   // subnormal magnitudes of the tensor's dtype
  bool equal_rows = false;  // some rows of the last dim all one value
  // The ordinary values at least this far from zero: near a pole (rsqrt,
  // a divisor, a negative power) a 16-bit gradient, composed of ops that
  // each round, is ill-conditioned beyond any useful tolerance.
  double min_abs = 0;
  static Specials finite() { return {false, false, true, true, true}; }
  static Specials all() { return {true, true, true, true, true}; }
};

// splitmix64: a tiny generator with no state but one word, so a draw is
// replayed from its seed alone.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline uint64_t hash_name(const std::string& s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

class Draw {
 public:
  explicit Draw(uint64_t seed) : seed_(seed), state_(seed) {}
  uint64_t seed() const { return seed_; }

  uint64_t bits() { return mix64(state_++); }
  double uniform() { return static_cast<double>(bits() >> 11) * 0x1.0p-53; }  // [0, 1)
  int64_t integer(int64_t lo, int64_t hi) {                                   // [lo, hi]
    return lo + static_cast<int64_t>(bits() % static_cast<uint64_t>(hi - lo + 1));
  }
  bool chance(double p) { return uniform() < p; }
  template <typename T>
  T pick(const std::vector<T>& options) {
    return options[static_cast<size_t>(integer(0, static_cast<int64_t>(options.size()) - 1))];
  }
  double normal() {  // Box-Muller
    const double u = 1.0 - uniform(), v = uniform();
    return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
  }
  // A size in [lo, hi], or now and then the edge sizes 0 (when allow_empty)
  // and 1, which kernels special-case.
  int64_t size(int64_t lo, int64_t hi, bool allow_empty = false) {
    if (allow_empty && chance(0.04)) return 0;
    if (lo <= 1 && chance(0.08)) return 1;
    return integer(lo, hi);
  }
  Shape shape(int rank, int64_t lo, int64_t hi, bool allow_empty = false) {
    Shape s;
    for (int i = 0; i < rank; ++i) s.push_back(size(lo, hi, allow_empty));
    return s;
  }

  // Values of `sizes` in `dt` (on the CPU, contiguous): N(0, scale^2) plus
  // `sp`'s special values. Built in float64 and rounded once, so the
  // float64 reference of a 16-bit case sees exactly the case's inputs.
  Tensor values(const Shape& sizes, DType dt, Specials sp = {}, double scale = 1.0) {
    int64_t n = 1;
    for (int64_t s : sizes) n *= s;
    std::vector<double> v(static_cast<size_t>(n));
    const bool ties = sp.ties && chance(0.5);
    for (double& x : v) {
      x = ties ? std::round(normal() * 2.0) / 2.0 * scale : normal() * scale;
      if (std::abs(x) < sp.min_abs) x = x < 0 ? -sp.min_abs : sp.min_abs;
    }
    const double tiny = dt == DType::Float16 ? 6.1e-5 : dt == DType::Float64 ? 2.2e-308 : 1.17e-38;
    const int64_t row = sizes.empty() ? 1 : sizes.back();
    if (n > 0) {
      if (sp.denormals && chance(0.5))
        for (int k = 0; k < 1 + n / 16; ++k) v[bits() % n] = (chance(0.5) ? 1 : -1) * tiny * uniform();
      if (sp.equal_rows && row > 0 && chance(0.5)) {
        const int64_t r = static_cast<int64_t>(bits() % static_cast<uint64_t>(n / row));
        const double c = std::round(normal() * 4) / 4 * scale;
        for (int64_t j = 0; j < row; ++j) v[r * row + j] = c;
      }
      const double inf = std::numeric_limits<double>::infinity();
      if (sp.inf && chance(0.4))
        for (int k = 0; k < 1 + n / 64; ++k) v[bits() % n] = chance(0.5) ? inf : -inf;
      if (sp.nan && chance(0.4))
        for (int k = 0; k < 1 + n / 64; ++k) v[bits() % n] = std::numeric_limits<double>::quiet_NaN();
    }
    return Tensor::from_vector(v, sizes, DType::Float64).to(dt);
  }

  // x (contiguous) in a drawn layout with the same values: as it is,
  // channels-last (4-D), a view into a larger buffer (an offset and a step
  // along one dim), as the strided kernels see them, or contiguous one
  // element into its buffer, as a slice of a batch is: a kernel's vector
  // path must see that the pointer is not aligned for it.
  Tensor layout(const Tensor& x, std::string* how = nullptr) {
    const int64_t which = integer(0, 3);
    if (which == 3 && x.numel() > 0) {
      Tensor buf = full({x.numel() + 1}, std::numeric_limits<double>::quiet_NaN(), {x.dtype(), x.device()});
      Tensor view = buf.slice(0, 1, x.numel() + 1).view(x.sizes());
      view.copy_(x);
      if (how) *how = "contiguous at an offset of one element";
      return view;
    }
    if (which == 1 && x.dim() == 4) {
      if (how) *how = "channels-last";
      return x.contiguous(MemoryFormat::ChannelsLast);
    }
    if (which == 2 && x.dim() >= 1 && x.numel() > 0) {
      const int64_t d = integer(0, x.dim() - 1), step = integer(2, 3), off = integer(0, 1);
      Shape big = x.sizes();
      big[d] = x.size(d) * step + off;
      Tensor buf = full(big, std::numeric_limits<double>::quiet_NaN(), {x.dtype(), x.device()});
      Tensor view = buf.slice(d, off, off + x.size(d) * step, step);
      view.copy_(x);
      if (how) *how = detail::str_cat("strided view (dim ", d, ", step ", step, ", offset ", off, ")");
      return view;
    }
    if (how) *how = "contiguous";
    return x;
  }

 private:
  uint64_t seed_, state_;
};

// Draws per family: the test's own CI count, or EMBER_TEST_DRAWS.
inline int draw_count(int ci_count) {
  const char* e = std::getenv("EMBER_TEST_DRAWS");
  return e && *e ? std::atoi(e) : ci_count;
}

// Runs `body` for draws 0 .. draw_count(ci_count) - 1 of `family`, or only
// for the seed EMBER_TEST_SEED names (decimal or 0x-hex). A failure inside
// a draw is reported with its seed and the replay command; the family stops
// at its first failing draw.
inline void for_each_draw(const std::string& family, int ci_count, const std::function<void(Draw&)>& body) {
  const char* replay = std::getenv("EMBER_TEST_SEED");
  std::vector<uint64_t> seeds;
  if (replay && *replay) {
    seeds.push_back(std::strtoull(replay, nullptr, 0));
  } else {
    for (int i = 0; i < draw_count(ci_count); ++i) seeds.push_back(mix64(hash_name(family) + static_cast<uint64_t>(i)));
  }
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string test = info ? detail::str_cat(info->test_suite_name(), ".", info->name()) : family;
  for (size_t i = 0; i < seeds.size(); ++i) {
    char hex[32];
    std::snprintf(hex, sizeof(hex), "0x%016llx", static_cast<unsigned long long>(seeds[i]));
    SCOPED_TRACE(detail::str_cat("drawn case ", family, " #", i, ", seed ", hex,
                                 "; replay it alone with --test_env=EMBER_TEST_SEED=", hex, " --test_filter=", test));
    Draw d(seeds[i]);
    body(d);
    if (::testing::Test::HasFailure()) return;
  }
}

// Compares `got` with `want` elementwise: the same shape, NaN where and only
// where `want` has NaN, equal infinities, and finite elements within
// tol * (max |want| over finite elements) -- the error relative to the
// tensor's scale, the measure Note [numerics] tabulates. The scale is at
// least 1: the drawn inputs and the backward's projection are of order 1,
// and a result far smaller than its terms (the query gradient of a one-key
// attention, zero in exact arithmetic; a softmax gradient) carries their
// rounding, of order eps, not eps times itself.
// Reports the first offending element with both values.
// `overflow_ok` (comparisons with a float64 reference): where the reference
// is infinite in the result's dtype, NaN is accepted too, since an
// intermediate that overflows in float32 (a denormal squared, then divided
// by) can meet an infinity of the other sign where float64 stays finite.
inline void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what,
                         bool overflow_ok = false) {
  ASSERT_EQ(got.defined(), want.defined()) << what;
  if (!want.defined()) return;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  const std::vector<double> g = got.cpu().to_vector(), w = want.cpu().to_vector();
  double scale = 1.0;
  for (double x : w)
    if (std::isfinite(x)) scale = std::max(scale, std::abs(x));
  for (size_t i = 0; i < g.size(); ++i) {
    const bool ok = std::isnan(w[i])       ? std::isnan(g[i])
                    : !std::isfinite(w[i]) ? g[i] == w[i] || (overflow_ok && std::isnan(g[i]))
                                           : std::isfinite(g[i]) && std::abs(g[i] - w[i]) <= tol * scale;
    if (!ok) {
      ADD_FAILURE() << what << ": element " << i << " of " << shape_str(want.sizes()) << " is " << g[i] << ", expected "
                    << w[i] << " (tolerance " << tol << " x scale " << scale << ")";
      return;
    }
  }
}

}  // namespace ember::testing
