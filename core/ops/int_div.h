// Integer division by a divisor fixed for a whole kernel (a tensor's size, a
// window's stride), for index math on both backends. On the GPU a `/` of 32
// bits is a float reciprocal and corrections, about twenty instructions, and
// one of 64 bits adds a test and a subroutine; decomposing an element's
// index into coordinates takes several. IntDiv<int32_t> divides by a
// multiply-high, an add and a shift instead (Granlund and Montgomery,
// "Division by invariant integers using multiplication", 1994; PyTorch's
// IntDivider and CUTLASS's FastDivmod use the same method), exact for every
// numerator in [0, 2^31): a kernel takes it where every index of its
// operation fits in 31 bits, and IntDiv<int64_t> (a plain `/`) otherwise.
#pragma once

#include <atomic>
#include <cstdint>

#include "core/dtype.h"

namespace ember {

template <typename I>
struct IntDiv;

template <>
struct IntDiv<int64_t> {
  int64_t d = 1;
  IntDiv() = default;
  explicit IntDiv(int64_t divisor) : d(divisor) {}
  EMBER_HD int64_t div(int64_t n) const { return n / d; }
};

// With s = ceil(log2 d) and M = floor(2^(32 + s) / d) + 1, 2^(32 + s) < M d
// <= 2^(32 + s) + 2^s, so floor(n M / 2^(32 + s)) = floor(n / d) for every n
// below 2^32 (the theorem's condition). M needs 33 bits; m = M - 2^32 fits in
// 32 (d < 2^31 makes it at most 2^32 - 3), and n M / 2^32 = n + n m / 2^32:
// the quotient is (n + mulhi(n, m)) >> s, whose sum fits in 32 bits for n
// below 2^31.
template <>
struct IntDiv<int32_t> {
  int32_t d = 1;
  uint32_t m = 0, s = 0;
  IntDiv() = default;
  // divisor in [1, 2^31); the caller checks (it comes from sizes that fit).
  explicit IntDiv(int64_t divisor) : d(static_cast<int32_t>(divisor)) {
    while ((int64_t{1} << s) < divisor) ++s;
    m = static_cast<uint32_t>((uint64_t{1} << 32) * ((uint64_t{1} << s) - static_cast<uint64_t>(divisor)) /
                                  static_cast<uint64_t>(divisor) +
                              1);
  }
  // n in [0, 2^31).
  EMBER_HD int32_t div(int32_t n) const {
    const auto u = static_cast<uint32_t>(n);
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(u, m);
#else
    const auto hi = static_cast<uint32_t>((static_cast<uint64_t>(u) * m) >> 32);
#endif
    return static_cast<int32_t>((hi + u) >> s);
  }
};

// Whether indices up to `extent` (every element offset and coordinate of an
// operation, plus what its index math adds to them) fit IntDiv<int32_t>.
inline bool fits_int_div32(int64_t extent) { return extent < (int64_t{1} << 31); }

// The kernels' choice (pooling, the rotary embedding on CUDA): 32-bit index
// math where the extent fits and lies below the limit, INT64_MAX unless a
// test lowers it (set_int_div32_limit) to run the 64-bit paths on small
// tensors. Inline, with no .cc: the CUDA kernels' archive links after the
// library's other objects and could not reach a definition among them.
inline std::atomic<int64_t> int_div32_limit{INT64_MAX};
inline bool use_int_div32(int64_t extent) {
  return fits_int_div32(extent) && extent < int_div32_limit.load(std::memory_order_relaxed);
}
inline void set_int_div32_limit(int64_t extent) { int_div32_limit.store(extent, std::memory_order_relaxed); }
// set_int_div32_limit for a scope: the limit before it is restored at its
// end, also when a test's check throws out of it.
class IntDiv32LimitScope {
 public:
  explicit IntDiv32LimitScope(int64_t extent) : before_(int_div32_limit.load(std::memory_order_relaxed)) {
    set_int_div32_limit(extent);
  }
  ~IntDiv32LimitScope() { set_int_div32_limit(before_); }
  IntDiv32LimitScope(const IntDiv32LimitScope&) = delete;
  IntDiv32LimitScope& operator=(const IntDiv32LimitScope&) = delete;

 private:
  int64_t before_;
};

}  // namespace ember
