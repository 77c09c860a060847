// core/dtype.h's Half and BFloat16 have a host branch (bit manipulation) and
// a device branch (__CUDA_ARCH__: CUDA's conversion intrinsics). The device
// branch cannot run here, so this test compiles it on the host against
// cuda_fp16_emu.h (hardware F16C / a double-precision rounding, i.e. computed
// another way) and checks both branches agree: every half and bfloat16 bit
// pattern to float, and float to 16 bits at every rounding boundary (each
// representable value, the midpoints to its neighbours and one float ulp on
// either side), plus a strided sweep of all 2^32 floats.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "core/dtype.h"  // the host branch, as every other TU sees it

// The device branch lives in fp16_device_path.cc (dtype.h is #pragma once, so
// one TU cannot hold both branches), inside namespace `device`.
namespace device::ember {
uint16_t half_from_float(float f);
float half_to_float(uint16_t h);
uint16_t bfloat16_from_float(float f);
float bfloat16_to_float(uint16_t b);
}  // namespace device::ember

namespace {

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Host branch H against the device branch's conversion functions.
template <typename H>
void expect_same_from_float(float f, uint16_t (*device_from)(float), float (*device_to)(uint16_t), const char* type) {
  const uint16_t h = H::from_float(f), d = device_from(f);
  if (std::isnan(f)) {
    // Both NaN; the payload differs by design (host 0x7e00/0x7fc0, device 0x7fff).
    EXPECT_TRUE(std::isnan(H::to_float(h)) && std::isnan(device_to(d))) << type << " NaN";
    return;
  }
  ASSERT_EQ(h, d) << type << " from_float(" << f << ") host 0x" << std::hex << h << " device 0x" << d;
}
void expect_half(float f) {
  expect_same_from_float<ember::Half>(f, device::ember::half_from_float, device::ember::half_to_float, "half");
}
void expect_bf16(float f) {
  expect_same_from_float<ember::BFloat16>(f, device::ember::bfloat16_from_float, device::ember::bfloat16_to_float,
                                          "bfloat16");
}

TEST(Fp16DevicePath, HalfToFloatAgreesOnEveryBitPattern) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float h = ember::Half::to_float(static_cast<uint16_t>(b));
    const float d = device::ember::half_to_float(static_cast<uint16_t>(b));
    if (std::isnan(h)) { EXPECT_TRUE(std::isnan(d)) << b; continue; }
    ASSERT_EQ(std::memcmp(&h, &d, 4), 0) << "half 0x" << std::hex << b << ": host " << h << " device " << d;
  }
}

TEST(Fp16DevicePath, BFloat16ToFloatAgreesOnEveryBitPattern) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float h = ember::BFloat16::to_float(static_cast<uint16_t>(b));
    const float d = device::ember::bfloat16_to_float(static_cast<uint16_t>(b));
    ASSERT_EQ(std::memcmp(&h, &d, 4), 0) << "bfloat16 0x" << std::hex << b;
  }
}

// Every float at and around a rounding decision of T: each representable
// value v, the midpoint to the next one, and the floats just beside both.
template <typename T>
std::vector<float> boundary_floats() {
  std::vector<float> out;
  for (uint32_t b = 0; b < 0x7c00u + (std::is_same_v<T, ember::Half> ? 0 : 0x0380u); ++b) {
    const float v = T::to_float(static_cast<uint16_t>(b)), next = T::to_float(static_cast<uint16_t>(b + 1));
    if (!std::isfinite(v)) break;
    const float mid = static_cast<float>((static_cast<double>(v) + next) / 2);  // exact in float
    for (float x : {v, mid, std::nextafter(v, 0.f), std::nextafter(v, INFINITY), std::nextafter(mid, 0.f),
                    std::nextafter(mid, INFINITY)}) {
      out.push_back(x);
      out.push_back(-x);
    }
  }
  for (float x : {INFINITY, -INFINITY, NAN, 65504.f, 65520.f, 65519.99f, 3.4028235e38f, 3.3961776e38f})
    out.push_back(x);
  return out;
}

TEST(Fp16DevicePath, HalfFromFloatAgreesAtEveryRoundingBoundary) {
  const auto xs = boundary_floats<ember::Half>();
  EXPECT_GT(xs.size(), 300000u);
  for (float x : xs) expect_half(x);
}

TEST(Fp16DevicePath, BFloat16FromFloatAgreesAtEveryRoundingBoundary) {
  const auto xs = boundary_floats<ember::BFloat16>();
  EXPECT_GT(xs.size(), 300000u);
  for (float x : xs) expect_bf16(x);
}

TEST(Fp16DevicePath, BothFromFloatAgreeOnAStridedSweepOfAllFloats) {
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 4099) {  // a prime stride: every exponent, varied mantissas
    const float f = bits_to_float(static_cast<uint32_t>(u));
    expect_half(f);
    expect_bf16(f);
  }
}

}  // namespace
