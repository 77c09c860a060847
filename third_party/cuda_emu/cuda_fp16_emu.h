// The 16-bit float intrinsics that core/dtype.h's __CUDA_ARCH__ branches call
// (__float2half_rn, __half2float, __float2bfloat16_rn, the bit casts), on the
// host, so those device branches can be compiled and checked without a GPU
// (fp16_device_path_test.cc). Written from CUDA's documented semantics, and
// computed another way than dtype.h's host branch: float->half by the x86
// F16C instruction (round to nearest even in hardware), float->bfloat16 by
// comparing the two neighbouring candidates in double. NaN becomes the
// canonical 0x7FFF, as the device's cvt.rn instructions produce.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};

__attribute__((target("f16c"))) inline __half __float2half_rn(float f) {
  if (std::isnan(f)) return {0x7fff};
  return {static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))};
}
__attribute__((target("f16c"))) inline float __half2float(__half h) { return _cvtsh_ss(h.bits); }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline __half __ushort_as_half(unsigned short u) { return {u}; }

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  if (std::isnan(f)) return {0x7fff};
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t lo = u & 0xffff0000u;
  if (lo == u || std::isinf(f)) return {static_cast<uint16_t>(u >> 16)};
  // The two bfloat16 magnitudes around |f|: lo (truncation) and lo + one
  // bfloat16 ulp, measured in double, where both are exact. Past the largest
  // finite value the upper neighbour is infinity's bit pattern, and IEEE
  // rounding (as if the exponent were unbounded) picks it the same way.
  const uint32_t hi = lo + 0x10000u;
  const int e = static_cast<int>((lo >> 23) & 0xffu);
  const double ulp = std::ldexp(1.0, (e == 0 ? 1 : e) - 134);
  const double mag = std::fabs(static_cast<double>(f)), mag_lo = std::fabs(static_cast<double>(__uint_as_float(lo)));
  const double to_lo = mag - mag_lo, to_hi = mag_lo + ulp - mag;
  const bool up = to_hi < to_lo || (to_hi == to_lo && ((lo >> 16) & 1u));
  return {static_cast<uint16_t>((up ? hi : lo) >> 16)};
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.bits; }
