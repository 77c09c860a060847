// Unary elementwise ops (neg, abs, exp, log, sqrt, rsqrt, relu, sigmoid,
// tanh, gelu, pow with a scalar exponent, clamp): CPU kernel, then the op
// layer shared with unary.cu's launcher.
#include <cmath>
#include <limits>

#include "core/autocast.h"
#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops/elementwise_fns.h"

namespace ember {

// ---- CPU kernel ----
namespace {
// GELU (tanh form) over contiguous float32, in a function of its own: gcc
// vectorizes this loop here, but not inside unary_cpu's many
// instantiations, where it ran 8x slower (a transformer MLP's GELU cost a
// fifth of its matmuls).
__attribute__((noinline)) void gelu_tanh_f32(float* __restrict out, const float* __restrict in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = unary_fn<UnaryOp::GeluTanh, float>(in[i], 0.f, 0.f);
}
// exp over contiguous float32: libmvec's SIMD expf (elementwise_fns.h).
__attribute__((noinline)) void exp_f32(float* __restrict out, const float* __restrict in, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = expf(in[i]);
}
}  // namespace

void unary_cpu(UnaryOp op, const StridedIter& it, double p0, double p1) {
  dispatch_unary_typed(op, it.dtypes[0], p0, p1, [&](auto op_c, auto tag, auto c0, auto c1) {
    constexpr UnaryOp OP = decltype(op_c)::value;
    using T = decltype(tag);
    using C = decltype(c0);
    cpu_loop(it, [&](char** p, const int64_t* s, int64_t n) {
      T* out = reinterpret_cast<T*>(p[0]);
      const T* in = reinterpret_cast<const T*>(p[1]);
      if (s[0] == 1 && s[1] == 1) {
        if constexpr (OP == UnaryOp::Exp && std::is_same_v<T, float>) {
          if (out + n <= in || in + n <= out)
            return exp_f32(reinterpret_cast<float*>(out), reinterpret_cast<const float*>(in), n);
        }
        if constexpr (OP == UnaryOp::GeluTanh && std::is_same_v<T, float>) {
          // (a cast, not a template: T is no template parameter here)
          if (out + n <= in || in + n <= out)
            return gelu_tanh_f32(reinterpret_cast<float*>(out), reinterpret_cast<const float*>(in), n);
        }
        for (int64_t i = 0; i < n; ++i) store_as(out + i, unary_fn<OP, C>(static_cast<C>(in[i]), c0, c1));
      } else {
        for (int64_t i = 0; i < n; ++i)
          out[i * s[0]] = static_cast<T>(unary_fn<OP, C>(static_cast<C>(in[i * s[1]]), c0, c1));
      }
    });
  });
}

// ---- Op layer ----
namespace {

bool float_only(UnaryOp op) {
  return !(op == UnaryOp::Neg || op == UnaryOp::Abs || op == UnaryOp::Relu || op == UnaryOp::Clamp);
}

Tensor unary_op(UnaryOp op, const char* name, const Tensor& x, double p0 = 0, double p1 = 0) {
  EMBER_CHECK(x.defined(), name, ": input is undefined");
  EMBER_CHECK(x.dtype() != DType::Bool, name, ": not supported for bool tensors");
  // Like torch: exp/log/... of an integer tensor computes in float32.
  Tensor in = (float_only(op) && !is_floating(x.dtype())) ? x.to(DType::Float32) : x;
  Tensor out = Tensor::empty(in.sizes(), in.options(), in.suggest_memory_format());
  StridedIter it = make_iter(out, {in}, name);
  if (in.is_cuda()) unary_cuda(op, it, p0, p1); else unary_cpu(op, it, p0, p1);
  return out;
}

}  // namespace

// Each op's derivative sits beside it. `out` is the detached result.
using Grads = std::vector<Tensor>;
namespace {
template <typename Bwd>
Tensor unary_diff(UnaryOp op, const char* name, const Tensor& x, Bwd bwd, double p0 = 0, double p1 = 0,
                  bool save_out = false) {
  return differentiable(name, {x}, [&] { return unary_op(op, name, x, p0, p1); },
                        [&](const Tensor& out) {
                          Tensor xs = x;
                          return Recorded{[xs, out, bwd](const Tensor& g) { return Grads{bwd(g, xs, out)}; },
                                          save_out ? std::vector<Tensor>{out} : std::vector<Tensor>{xs}};
                        });
}
}  // namespace

Tensor neg(const Tensor& x) {
  return unary_diff(UnaryOp::Neg, "neg", x, [](const Tensor& g, const Tensor&, const Tensor&) { return neg(g); });
}
Tensor abs(const Tensor& x) {
  return unary_diff(UnaryOp::Abs, "abs", x, [](const Tensor& g, const Tensor& x, const Tensor&) {
    return g * (cast(gt(x, zeros({}, x.dtype())), g.dtype()) - cast(lt(x, zeros({}, x.dtype())), g.dtype()));
  });
}
// exp, log and pow run in float32 under autocast (autocast.h).
Tensor exp(const Tensor& x) {
  if (Tensor c = autocast::fp32(x); !c.is_same(x)) return exp(c);
  return unary_diff(UnaryOp::Exp, "exp", x, [](const Tensor& g, const Tensor&, const Tensor& y) { return g * y; },
                    0, 0, true);
}
Tensor log(const Tensor& x) {
  if (Tensor c = autocast::fp32(x); !c.is_same(x)) return log(c);
  return unary_diff(UnaryOp::Log, "log", x, [](const Tensor& g, const Tensor& x, const Tensor&) { return g / x; });
}
Tensor sqrt(const Tensor& x) {
  return unary_diff(UnaryOp::Sqrt, "sqrt", x,
                    [](const Tensor& g, const Tensor&, const Tensor& y) { return g / (y * 2.0); }, 0, 0, true);
}
Tensor rsqrt(const Tensor& x) {
  return unary_diff(UnaryOp::Rsqrt, "rsqrt", x, [](const Tensor& g, const Tensor& x, const Tensor& y) {
    return g * y * (-0.5) / x;
  });
}
Tensor relu(const Tensor& x) {
  return unary_diff(UnaryOp::Relu, "relu", x, [](const Tensor& g, const Tensor&, const Tensor& y) {
    return relu_backward(g, y);
  }, 0, 0, true);
}
Tensor sigmoid(const Tensor& x) {
  return unary_diff(UnaryOp::Sigmoid, "sigmoid", x, [](const Tensor& g, const Tensor&, const Tensor& y) {
    return g * y * (1.0 - y);
  }, 0, 0, true);
}
Tensor tanh(const Tensor& x) {
  return unary_diff(UnaryOp::Tanh, "tanh", x, [](const Tensor& g, const Tensor&, const Tensor& y) {
    return g * (1.0 - y * y);
  }, 0, 0, true);
}
Tensor gelu(const Tensor& x, bool tanh_approx) {
  return unary_diff(
      tanh_approx ? UnaryOp::GeluTanh : UnaryOp::Gelu, "gelu", x,
      // One fused pass (elementwise_fns.h); the composition of
      // a dozen elementwise ops cost as much as the layer's matmul.
      [tanh_approx](const Tensor& g, const Tensor& x, const Tensor&) { return gelu_backward(g, x, tanh_approx); });
}
Tensor silu(const Tensor& x) {
  return unary_diff(UnaryOp::Silu, "silu", x,
                    [](const Tensor& g, const Tensor& x, const Tensor&) { return silu_backward(g, x); });
}
Tensor erf(const Tensor& x) {
  return unary_diff(UnaryOp::Erf, "erf", x, [](const Tensor& g, const Tensor& x, const Tensor&) {
    return g * exp(x * x * (-1.0)) * M_2_SQRTPI;
  });
}
Tensor cast(const Tensor& x, DType dtype) { return x.to(dtype); }
Tensor pow(const Tensor& x, double exponent) {
  if (Tensor c = autocast::fp32(x); !c.is_same(x)) return pow(c, exponent);
  return unary_diff(UnaryOp::PowScalar, "pow", x, [exponent](const Tensor& g, const Tensor& x, const Tensor&) {
    if (exponent == 0.0) return zeros_like(g);
    return g * pow(x, exponent - 1.0) * exponent;
  }, exponent);
}

Tensor clamp(const Tensor& x, std::optional<double> lo, std::optional<double> hi) {
  EMBER_CHECK(lo || hi, "clamp: at least one of min and max must be given");
  double inf = std::numeric_limits<double>::infinity();
  double a = lo.value_or(-inf), b = hi.value_or(inf);
  if (!is_floating(x.dtype())) {  // keep bounds representable in the integer type
    double tmin = x.dtype() == DType::Int32 ? -2147483648.0 : x.dtype() == DType::UInt8 ? 0.0 : -9223372036854775808.0;
    double tmax = x.dtype() == DType::Int32 ? 2147483647.0 : x.dtype() == DType::UInt8 ? 255.0 : 9223372036854774784.0;
    a = std::min(std::max(a, tmin), tmax);
    b = std::min(std::max(b, tmin), tmax);
  }
  return unary_diff(UnaryOp::Clamp, "clamp", x, [a, b](const Tensor& g, const Tensor& x, const Tensor&) {
    // Gradient flows where the input was inside [min, max], as in torch.
    Tensor inside = mul(cast(ge(x, scalar_tensor(a, x.dtype())), g.dtype()),
                        cast(le(x, scalar_tensor(b, x.dtype())), g.dtype()));
    return g * inside;
  }, a, b);
}

Tensor Tensor::operator-() const { return neg(*this); }

}  // namespace ember
