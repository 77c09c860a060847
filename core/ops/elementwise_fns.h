// Scalar math shared by the CPU and CUDA elementwise kernels, so both
// backends compute the same formula. C is the compute type (acc_t<T>).
#pragma once

#include <math.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/dtype.h"
#include "core/ops/kernels.h"

#if !defined(__CUDACC__) && defined(_OPENMP)
// The SIMD variants of expf in glibc's libmvec (//third_party:libmvec): a
// loop under `#pragma omp simd` that calls expf computes 8 at a time (0.7 ns
// an element against libm's 1.5, within 4 ulp). Only loops marked so use
// them (softmax_cpu's rows, the contiguous float32 exp).
extern "C" {
#pragma omp declare simd notinbranch
float expf(float);
}
#endif

namespace ember {

template <typename C> EMBER_HD C m_exp(C x) { if constexpr (std::is_same_v<C, float>) return expf(x); else return ::exp(x); }
template <typename C> EMBER_HD C m_log(C x) { if constexpr (std::is_same_v<C, float>) return logf(x); else return ::log(x); }
template <typename C> EMBER_HD C m_sqrt(C x) { if constexpr (std::is_same_v<C, float>) return sqrtf(x); else return ::sqrt(x); }
template <typename C> EMBER_HD C m_tanh(C x) { if constexpr (std::is_same_v<C, float>) return tanhf(x); else return ::tanh(x); }
// tanh for the GELU kernels. On the CPU a float tanh is libm's scalar
// tanhf, a call per element that stops the loop vectorizing (GELU cost as
// much as a transformer MLP's matmul); here it is 1 - 2 / (e^(2|x|) + 1)
// with e^y = 2^n 2^f (n = round(y log2 e), a degree-6 polynomial for 2^f on
// [-1/2, 1/2]), plain arithmetic the compiler vectorizes; within 2e-7 of
// tanhf (relative, |x| < 9; +-1 beyond). CUDA keeps tanhf, which is fast
// there; the cross-backend test compares them.
template <typename C>
EMBER_HD C m_tanh_gelu(C x) {
#if defined(__CUDA_ARCH__)
  return m_tanh(x);
#else
  if constexpr (!std::is_same_v<C, float>) {
    return m_tanh(x);
  } else {
    // Written so that gcc vectorizes it: floorf stays scalar (unless
    // -fno-trapping-math), and so does a float clamp of |x| feeding the
    // integer conversion; floor(y + 1/2) is a truncation here (y >= 0), and
    // the clamp is on n instead: for |x| >= 9 (n > 26) the polynomial alone
    // makes t exactly 1, and an infinite or NaN x still gives +-1 or NaN.
    const float y = std::fabs(x) * 2.f * 1.4426950408889634f;  // 2|x| log2(e)
    const int32_t ni = std::min(static_cast<int32_t>(y + 0.5f), 26);
    const float n = static_cast<float>(ni), f = y - n;  // f in [-1/2, 1/2] for |x| < 9
    float p = 1.5403530393381606e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.f;  // 2^f
    union {
      float v;
      uint32_t i;
    } scale;
    scale.i = static_cast<uint32_t>(ni + 127) << 23;  // 2^n
    const float t = 1.f - 2.f / (p * scale.v + 1.f);
    return std::copysign(t, x);
  }
#endif
}
template <typename C> EMBER_HD C m_erf(C x) { if constexpr (std::is_same_v<C, float>) return erff(x); else return ::erf(x); }
template <typename C> EMBER_HD C m_pow(C x, C y) {
  if constexpr (std::is_same_v<C, float>) return powf(x, y);
  else if constexpr (std::is_floating_point_v<C>) return ::pow(x, y);
  else {  // integer power by squaring; negative exponents give 0 as in torch (except base 1/-1)
    if (y < 0) return (x == 1) ? C(1) : (x == C(-1) ? ((y & 1) ? C(-1) : C(1)) : C(0));
    C r = 1;
    while (y) { if (y & 1) r *= x; x *= x; y >>= 1; }
    return r;
  }
}
template <typename C> EMBER_HD bool m_isnan(C x) {
  if constexpr (std::is_floating_point_v<C>) return x != x; else return false;
}

template <UnaryOp OP, typename C>
EMBER_HD C unary_fn(C x, C p0, C p1) {
  if constexpr (OP == UnaryOp::Neg) return -x;
  else if constexpr (OP == UnaryOp::Abs) return x < C(0) ? -x : x;
  else if constexpr (OP == UnaryOp::Relu) return x > C(0) ? x : (m_isnan(x) ? x : C(0));
  else if constexpr (OP == UnaryOp::Clamp) {  // p0/p1 are min/max; NaN propagates
    if (m_isnan(x)) return x;
    C y = x < p0 ? p0 : x;
    return y > p1 ? p1 : y;
  } else if constexpr (!std::is_floating_point_v<C>) {
    return x;  // float-only ops: the op layer casts integers to float first
  } else if constexpr (OP == UnaryOp::Exp) return m_exp(x);
  else if constexpr (OP == UnaryOp::Log) return m_log(x);
  else if constexpr (OP == UnaryOp::Sqrt) return m_sqrt(x);
  else if constexpr (OP == UnaryOp::Rsqrt) return C(1) / m_sqrt(x);
  else if constexpr (OP == UnaryOp::Sigmoid) return C(1) / (C(1) + m_exp(-x));
  else if constexpr (OP == UnaryOp::Tanh) return m_tanh(x);
  else if constexpr (OP == UnaryOp::Gelu) return C(0.5) * x * (C(1) + m_erf(x * C(0.70710678118654752440)));
  else if constexpr (OP == UnaryOp::Erf) return m_erf(x);
  else if constexpr (OP == UnaryOp::Silu)
    return x / (C(1) + m_exp(-x));
  else if constexpr (OP == UnaryOp::GeluTanh) {
    const C k = C(0.79788456080286535588);  // sqrt(2/pi)
    return C(0.5) * x * (C(1) + m_tanh_gelu(k * (x + C(0.044715) * x * x * x)));
  } else if constexpr (OP == UnaryOp::PowScalar) {
    if (p0 == C(2)) return x * x;
    return m_pow(x, p0);
  }
  return x;
}

template <BinaryOp OP, typename C>
EMBER_HD auto binary_fn(C a, C b, C alpha) {
  if constexpr (OP == BinaryOp::Add) return C(a + alpha * b);
  else if constexpr (OP == BinaryOp::Sub) return C(a - alpha * b);
  else if constexpr (OP == BinaryOp::Mul) return C(a * b);
  else if constexpr (OP == BinaryOp::Div) return C(a / b);
  else if constexpr (OP == BinaryOp::Pow) return m_pow(a, b);
  else if constexpr (OP == BinaryOp::Maximum) return (m_isnan(a) || a > b) ? a : b;
  else if constexpr (OP == BinaryOp::Minimum) return (m_isnan(a) || a < b) ? a : b;
  else if constexpr (OP == BinaryOp::ReluGrad) return b > C(0) ? a : C(0);
  else if constexpr (OP == BinaryOp::GeluGrad || OP == BinaryOp::GeluTanhGrad) {
    if constexpr (!std::is_floating_point_v<C>) {
      return a;                                       // float-only: the op layer computes in float
    } else if constexpr (OP == BinaryOp::GeluGrad) {  // Phi(x) + x phi(x)
      const C cdf = C(0.5) * (C(1) + m_erf(b * C(0.70710678118654752440)));
      const C pdf = m_exp(C(-0.5) * b * b) * C(0.39894228040143267794);
      return C(a * (cdf + b * pdf));
    } else {  // tanh form: 0.5 (1 + t) + 0.5 x (1 - t^2) du/dx, u = k (x + 0.044715 x^3)
      const C k = C(0.79788456080286535588);
      const C t = m_tanh_gelu(k * (b + C(0.044715) * b * b * b));
      const C du = k * (C(1) + C(3 * 0.044715) * b * b);
      return C(a * (C(0.5) * (C(1) + t) + C(0.5) * b * (C(1) - t * t) * du));
    }
  } else if constexpr (OP == BinaryOp::SiluGrad) {
    if constexpr (!std::is_floating_point_v<C>) {
      return a;  // float-only: the op layer computes in float
    } else {     // s (1 + x (1 - s)), s = sigmoid(x)
      const C s = C(1) / (C(1) + m_exp(-b));
      return C(a * (s * (C(1) + b * (C(1) - s))));
    }
  } else if constexpr (OP == BinaryOp::Eq)
    return a == b;
  else if constexpr (OP == BinaryOp::Ne) return a != b;
  else if constexpr (OP == BinaryOp::Lt) return a < b;
  else if constexpr (OP == BinaryOp::Le) return a <= b;
  else if constexpr (OP == BinaryOp::Gt) return a > b;
  else return a >= b;
}

// Runtime op -> compile-time op. F is called as f(std::integral_constant<UnaryOp, OP>{}).
template <typename F>
void dispatch_unary(UnaryOp op, F&& f) {
  switch (op) {
    // clang-format off
#define EMBER_U(name) case UnaryOp::name: f(std::integral_constant<UnaryOp, UnaryOp::name>{}); break;
    EMBER_U(Neg) EMBER_U(Abs) EMBER_U(Exp) EMBER_U(Log) EMBER_U(Sqrt) EMBER_U(Rsqrt) EMBER_U(Relu)
    EMBER_U(Sigmoid) EMBER_U(Tanh) EMBER_U(Gelu) EMBER_U(GeluTanh) EMBER_U(PowScalar) EMBER_U(Clamp) EMBER_U(Erf)
    EMBER_U(Silu)
#undef EMBER_U
    // clang-format on
  }
}

template <typename F>
void dispatch_binary(BinaryOp op, F&& f) {
  switch (op) {
    // One list, not a case per line:
    // clang-format off
#define EMBER_B(name) case BinaryOp::name: f(std::integral_constant<BinaryOp, BinaryOp::name>{}); break;
    EMBER_B(Add) EMBER_B(Sub) EMBER_B(Mul) EMBER_B(Div) EMBER_B(Pow) EMBER_B(Maximum) EMBER_B(Minimum) EMBER_B(ReluGrad)
    EMBER_B(GeluGrad) EMBER_B(GeluTanhGrad) EMBER_B(SiluGrad) EMBER_B(Eq) EMBER_B(Ne) EMBER_B(Lt) EMBER_B(Le) EMBER_B(Gt) EMBER_B(Ge)
#undef EMBER_B
    // clang-format on
  }
}

// Bool only takes ops that stay in {0, 1}: comparisons, maximum, minimum.
// (A namespace-scope helper: nvcc's host-side rewrite of std::is_same_v<T,
// bool> inside the dispatch lambda names std::iterator and trips gcc's
// deprecation warning.)
template <BinaryOp OP, typename T>
constexpr bool binary_supported_on() {
  return !std::is_same_v<T, bool> || OP >= BinaryOp::Eq || OP == BinaryOp::Maximum || OP == BinaryOp::Minimum;
}

// The dispatch both backends' binary launchers share: runtime dtype and op
// to compile-time ones, f(op, T{}, alpha) with op an integral_constant and
// alpha in the compute type acc_t<T>; arithmetic on bool is an error.
template <typename F>
void dispatch_binary_typed(BinaryOp op, DType dtype, double alpha, F&& f) {
  EMBER_DISPATCH_ALL(dtype, "binary", [&] {
    using T = scalar_t;
    const acc_t<T> al = static_cast<acc_t<T>>(alpha);
    dispatch_binary(op, [&](auto op_c) {
      if constexpr (binary_supported_on<decltype(op_c)::value, T>()) {
        f(op_c, T{}, al);
      } else {
        EMBER_CHECK(false, "binary op: arithmetic on bool tensors is not supported");
      }
    });
  });
}

// The same for the unary launchers: f(op, T{}, p0, p1), the op's scalar
// parameters in acc_t<T>.
template <typename F>
void dispatch_unary_typed(UnaryOp op, DType dtype, double p0, double p1, F&& f) {
  EMBER_DISPATCH_NUMERIC(dtype, "unary", [&] {
    using T = scalar_t;
    using C = acc_t<T>;
    const C c0 = static_cast<C>(p0), c1 = static_cast<C>(p1);
    dispatch_unary(op, [&](auto op_c) { f(op_c, T{}, c0, c1); });
  });
}

}  // namespace ember
