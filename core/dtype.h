// Element types: the DType enum, the 16-bit and 8-bit float types usable on
// host and device, and EMBER_DISPATCH, which turns a runtime DType into a C++
// type.
#pragma once

#include <cstdint>
#include <cstring>
#include <ostream>
#include <string>
#include <type_traits>

#include "core/exception.h"

#if defined(__CUDACC__)
#define EMBER_HD __host__ __device__ __forceinline__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#else
#define EMBER_HD inline
#endif

namespace ember {

// Float8E4M3 and Float8E5M2 are torch.float8_e4m3fn and torch.float8_e5m2:
// storage formats for scaled matmuls (core/ops/float8.cc). As in PyTorch,
// casts, copies, views, reading and printing and scaled_mm take them;
// arithmetic refuses them by name (EMBER_DISPATCH_ALL's default,
// promote_types), except the float-only unary ops, which widen a
// non-floating input to float32 first as they do integers (is_floating is
// false for them).
enum class DType : uint8_t { Float32, Float16, BFloat16, Float64, Int32, Int64, UInt8, Bool, Float8E4M3, Float8E5M2 };

// A float's bits and back (host branches of the 16-bit conversions).
EMBER_HD uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
EMBER_HD float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// What Half and BFloat16 share: 16 bits, made from and read as float by
// the type's own from_float and to_float.
template <typename Self>
struct alignas(2) Float16Storage {
  uint16_t x = 0;
  Float16Storage() = default;
  EMBER_HD Float16Storage(float f) : x(Self::from_float(f)) {}
  EMBER_HD operator float() const { return Self::to_float(x); }
};

// IEEE binary16, stored as bits; arithmetic happens in float.
struct Half : Float16Storage<Half> {
  using Float16Storage::Float16Storage;

  static EMBER_HD uint16_t from_float(float f) {
#if defined(__CUDA_ARCH__)
    return __half_as_ushort(__float2half_rn(f));
#else
    uint32_t u = float_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t abs = u & 0x7fffffffu;
    if (abs >= 0x7f800000u) return sign | (abs > 0x7f800000u ? 0x7e00u : 0x7c00u);
    if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to inf
    if (abs < 0x38800000u) {                        // subnormal or zero
      // Adding 0.5 puts the subnormal's bits in the low mantissa, rounded RNE.
      const uint32_t r = float_bits(bits_float(abs) + 0.5f);
      return sign | static_cast<uint16_t>(r - 0x3f000000u);
    }
    uint32_t mant_odd = (abs >> 13) & 1u;
    abs += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round RNE
    return static_cast<uint16_t>(sign | (abs >> 13));
#endif
  }
  static EMBER_HD float to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(h));
#else
    uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
      u = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {
      u = float_bits(static_cast<float>(mant) * 5.9604644775390625e-8f) | sign;  // 2^-24
    } else {
      u = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    return bits_float(u);
#endif
  }
};

// bfloat16: the top half of a float32, rounded to nearest even.
struct BFloat16 : Float16Storage<BFloat16> {
  using Float16Storage::Float16Storage;

  static EMBER_HD uint16_t from_float(float f) {
#if defined(__CUDA_ARCH__)
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
    uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
#endif
  }
  static EMBER_HD float to_float(uint16_t b) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(static_cast<uint32_t>(b) << 16);
#else
    return bits_float(static_cast<uint32_t>(b) << 16);
#endif
  }
};

// The OCP 8-bit floats, E exponent and M mantissa bits: e4m3fn (E=4, M=3:
// bias 7, no infinities, S.1111.111 is NaN, largest 448) and e5m2 (E=5,
// M=2: IEEE-like, bias 15, infinities, largest 57344). One software
// conversion on host and device, so the CUDA kernels and the CPU reference
// round the same way and the emulation tests the device's code.
template <int E, int M>
struct Float8Format {
  static constexpr int kBias = (1 << (E - 1)) - 1;
  static constexpr bool kFiniteOnly = E == 4;  // e4m3fn
  static constexpr uint32_t kMaxCode = kFiniteOnly ? 0x7eu : 0x7bu;
  static constexpr float kMax = kFiniteOnly ? 448.0f : 57344.0f;

  // Round to nearest even. Past the largest finite value: the largest
  // (`saturate`, as torchao's scaled casts clamp), else NaN for e4m3fn and
  // infinity for e5m2 (c10's Float8_e4m3fn / Float8_e5m2 conversions).
  static EMBER_HD uint8_t from_float(float f, bool saturate = false) {
    const uint32_t u = float_bits(f);
    const uint32_t sign = (u >> 24) & 0x80u;
    uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);  // NaN stays NaN
    constexpr uint32_t kMinNormal = static_cast<uint32_t>(127 + 1 - kBias) << 23;
    uint32_t code;
    if (abs < kMinNormal) {
      // Subnormal or zero: multiples of 2^(1-bias-M). Adding a float whose
      // ulp is that spacing rounds (RNE) in the FPU, and the count of
      // spacings is the code (a count of 2^M is the smallest normal's).
      constexpr float kMagic = static_cast<float>(1u << (1 - kBias - M + 23));
      code = float_bits(bits_float(abs) + kMagic) - float_bits(kMagic);
    } else {
      // Rebias the exponent and round the mantissa RNE; a carry moves into
      // the exponent, and infinity lands past the largest code.
      const uint32_t odd = (abs >> (23 - M)) & 1u;
      abs += (static_cast<uint32_t>(kBias - 127) << 23) + ((1u << (22 - M)) - 1u) + odd;
      code = abs >> (23 - M);
    }
    if (code > kMaxCode) code = saturate ? kMaxCode : (kFiniteOnly ? 0x7fu : 0x7cu);
    return static_cast<uint8_t>(sign | code);
  }
  static EMBER_HD float to_float(uint8_t b) {
    const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
    const uint32_t exp = (b >> M) & ((1u << E) - 1u), mant = b & ((1u << M) - 1u);
    if (kFiniteOnly ? (b & 0x7fu) == 0x7fu : exp == (1u << E) - 1u)
      return bits_float(sign | (kFiniteOnly || mant ? 0x7fc00000u : 0x7f800000u));
    if (exp == 0)  // subnormal: mant * 2^(1-bias-M), exact in float
      return bits_float(float_bits(static_cast<float>(mant) / static_cast<float>(1u << (M - 1 + kBias))) | sign);
    return bits_float(sign | ((exp + 127u - kBias) << 23) | (mant << (23 - M)));
  }
};

// One byte, made from and read as float (RNE, overflow to NaN/infinity).
template <typename Self, typename Format>
struct alignas(1) Float8Storage {
  using format = Format;
  uint8_t x = 0;
  Float8Storage() = default;
  EMBER_HD Float8Storage(float f) : x(Format::from_float(f)) {}
  EMBER_HD operator float() const { return Format::to_float(x); }
  static EMBER_HD uint8_t from_float(float f) { return Format::from_float(f); }
  static EMBER_HD float to_float(uint8_t b) { return Format::to_float(b); }
};
struct Float8E4M3 : Float8Storage<Float8E4M3, Float8Format<4, 3>> {
  using Float8Storage::Float8Storage;
};
struct Float8E5M2 : Float8Storage<Float8E5M2, Float8Format<5, 2>> {
  using Float8Storage::Float8Storage;
};

// The type arithmetic happens in: float for the 16-bit floats (so half and
// bfloat16 kernels accumulate in fp32), the type itself otherwise.
template <typename T> struct AccType { using type = T; };
template <> struct AccType<Half> { using type = float; };
template <> struct AccType<BFloat16> { using type = float; };
template <>
struct AccType<Float8E4M3> {
  using type = float;
};
template <>
struct AccType<Float8E5M2> {
  using type = float;
};
template <> struct AccType<bool> { using type = bool; };
template <typename T> using acc_t = typename AccType<T>::type;

// Conversion between any two element types, the one rule the CPU and CUDA
// kernels share. 16-bit floats go through float; bool means "non-zero";
// floating -> integer goes through int64, as c10 does, because a direct cast
// of an out-of-range value is UB and differs between x86 and PTX.
template <typename T>
constexpr bool is_half_like_v = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;
template <typename T>
constexpr bool is_float8_v = std::is_same_v<T, Float8E4M3> || std::is_same_v<T, Float8E5M2>;
// Floats stored as bits (x), converted through float (from_float/to_float).
template <typename T>
constexpr bool is_bits_float_v = is_half_like_v<T> || is_float8_v<T>;

template <typename D, typename S>
EMBER_HD D cast_value(S s) {
  if constexpr (std::is_same_v<D, S>) {
    return s;
  } else if constexpr (is_bits_float_v<S>) {
    return cast_value<D, float>(static_cast<float>(s));
  } else if constexpr (is_bits_float_v<D>) {
    return D(static_cast<float>(s));
  } else if constexpr (std::is_same_v<D, bool>) {
    return s != S(0);
  } else if constexpr (std::is_integral_v<D> && std::is_floating_point_v<S>) {
    return static_cast<D>(static_cast<int64_t>(s));
  } else {
    return static_cast<D>(s);
  }
}

// *p = v converted to T, for kernel loops: a 16-bit float's bits are set in
// place, since assigning a converted temporary struct (out[i] =
// static_cast<BFloat16>(v)) keeps gcc from vectorizing the loop (measured:
// the bfloat16 batch-norm loops ran scalar, 25% of a narrow ResNet step).
template <typename T, typename V>
EMBER_HD void store_as(T* p, V v) {
  if constexpr (is_bits_float_v<T>)
    p->x = T::from_float(static_cast<float>(v));
  else *p = static_cast<T>(v);
}

// *p as A, the load side of store_as: a 16-bit float is read as its bits
// (a load of the 2-byte struct itself has no vector type for gcc).
template <typename A, typename T>
EMBER_HD A load_as(const T* p) {
  if constexpr (is_bits_float_v<T>)
    return static_cast<A>(T::to_float(p->x));
  else return static_cast<A>(*p);
}

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::Float32: case DType::Int32: return 4;
    case DType::Float16: case DType::BFloat16: return 2;
    case DType::Float64: case DType::Int64: return 8;
    case DType::UInt8:
    case DType::Bool:
    case DType::Float8E4M3:
    case DType::Float8E5M2:
      return 1;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::Float32: return "float32";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Float64: return "float64";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
    case DType::UInt8: return "uint8";
    case DType::Bool: return "bool";
    case DType::Float8E4M3:
      return "float8_e4m3fn";
    case DType::Float8E5M2:
      return "float8_e5m2";
  }
  return "?";
}

inline std::ostream& operator<<(std::ostream& os, DType t) { return os << dtype_name(t); }

inline bool is_floating(DType t) {
  return t == DType::Float32 || t == DType::Float16 || t == DType::BFloat16 || t == DType::Float64;
}

inline bool is_float8(DType t) { return t == DType::Float8E4M3 || t == DType::Float8E5M2; }

// PyTorch's promotion lattice, reduced to our types: bool < integers <
// floats; within a category the wider wins; float16 with bfloat16 is float32.
// The float8 types promote with nothing (as in PyTorch).
inline DType promote_types(DType a, DType b) {
  if (a == b) return a;
  EMBER_CHECK(!is_float8(a) && !is_float8(b), "type promotion of ", dtype_name(a), " with ", dtype_name(b),
              " is not supported: cast the float8 tensor first (.to(float32))");
  auto rank = [](DType t) {
    switch (t) {
      case DType::Bool: return 0;
      case DType::UInt8: return 1;
      case DType::Int32: return 2;
      case DType::Int64: return 3;
      case DType::Float16: case DType::BFloat16: return 4;
      case DType::Float32: return 5;
      case DType::Float64: return 6;
      case DType::Float8E4M3:
      case DType::Float8E5M2:
        return 7;  // refused above
    }
    return 0;
  };
  if ((a == DType::Float16 && b == DType::BFloat16) || (a == DType::BFloat16 && b == DType::Float16))
    return DType::Float32;
  return rank(a) >= rank(b) ? a : b;
}

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::Float32; }
template <> constexpr DType dtype_of<Half>() { return DType::Float16; }
template <> constexpr DType dtype_of<BFloat16>() { return DType::BFloat16; }
template <> constexpr DType dtype_of<double>() { return DType::Float64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::Int32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::Int64; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::UInt8; }
template <> constexpr DType dtype_of<bool>() { return DType::Bool; }
template <>
constexpr DType dtype_of<Float8E4M3>() {
  return DType::Float8E4M3;
}
template <>
constexpr DType dtype_of<Float8E5M2>() {
  return DType::Float8E5M2;
}

}  // namespace ember

#define EMBER_DISPATCH_CASE(enum_val, T, ...) \
  case ::ember::DType::enum_val: {            \
    using scalar_t = T;                       \
    __VA_ARGS__();                            \
    break;                                    \
  }

// The cases of the floating dtypes, and of the integer ones (not bool).
#define EMBER_DISPATCH_FLOAT_CASES(...)                         \
  EMBER_DISPATCH_CASE(Float32, float, __VA_ARGS__)              \
  EMBER_DISPATCH_CASE(Float16, ::ember::Half, __VA_ARGS__)      \
  EMBER_DISPATCH_CASE(BFloat16, ::ember::BFloat16, __VA_ARGS__) \
  EMBER_DISPATCH_CASE(Float64, double, __VA_ARGS__)
#define EMBER_DISPATCH_INT_CASES(...)              \
  EMBER_DISPATCH_CASE(Int32, int32_t, __VA_ARGS__) \
  EMBER_DISPATCH_CASE(Int64, int64_t, __VA_ARGS__) \
  EMBER_DISPATCH_CASE(UInt8, uint8_t, __VA_ARGS__)

#define EMBER_DISPATCH_FLOAT8_CASES(...)                            \
  EMBER_DISPATCH_CASE(Float8E4M3, ::ember::Float8E4M3, __VA_ARGS__) \
  EMBER_DISPATCH_CASE(Float8E5M2, ::ember::Float8E5M2, __VA_ARGS__)

// EMBER_DISPATCH_ALL(dtype, "op", [&] { kernel<scalar_t>(...); }): every
// dtype but the float8 ones, which only casts take (EMBER_DISPATCH_CAST).
#define EMBER_DISPATCH_ALL(dtype, name, ...)                           \
  do {                                                                 \
    switch (dtype) {                                                   \
      EMBER_DISPATCH_FLOAT_CASES(__VA_ARGS__)                          \
      EMBER_DISPATCH_INT_CASES(__VA_ARGS__)                            \
      EMBER_DISPATCH_CASE(Bool, bool, __VA_ARGS__)                     \
      default:                                                         \
        EMBER_CHECK(false, name, ": not supported for dtype ", dtype); \
    }                                                                  \
  } while (0)

// Every dtype: the element conversions of copy/to.
#define EMBER_DISPATCH_CAST(dtype, name, ...)      \
  do {                                             \
    switch (dtype) {                               \
      EMBER_DISPATCH_FLOAT_CASES(__VA_ARGS__)      \
      EMBER_DISPATCH_INT_CASES(__VA_ARGS__)        \
      EMBER_DISPATCH_CASE(Bool, bool, __VA_ARGS__) \
      EMBER_DISPATCH_FLOAT8_CASES(__VA_ARGS__)     \
    }                                              \
  } while (0)

#define EMBER_DISPATCH_FLOAT(dtype, name, ...)                                \
  do {                                                                        \
    switch (dtype) {                                                          \
      EMBER_DISPATCH_FLOAT_CASES(__VA_ARGS__)                                 \
      default:                                                                \
        EMBER_CHECK(false, name, ": expected a floating dtype, got ", dtype); \
    }                                                                         \
  } while (0)

// Everything but bool: arithmetic and reductions.
#define EMBER_DISPATCH_NUMERIC(dtype, name, ...)                       \
  do {                                                                 \
    switch (dtype) {                                                   \
      EMBER_DISPATCH_FLOAT_CASES(__VA_ARGS__)                          \
      EMBER_DISPATCH_INT_CASES(__VA_ARGS__)                            \
      default:                                                         \
        EMBER_CHECK(false, name, ": not supported for dtype ", dtype); \
    }                                                                  \
  } while (0)
