// Unary elementwise ops (neg, abs, exp, log, sqrt, rsqrt, relu, sigmoid,
// tanh, gelu, pow with a scalar exponent, clamp): CPU kernel, then the op
// layer shared with unary.cu's launcher.
#include <limits>

#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops/elementwise_fns.h"

namespace ember {

// ---- CPU kernel ----
void unary_cpu(UnaryOp op, const StridedIter& it, double p0, double p1) {
  EMBER_DISPATCH_NUMERIC(it.dtypes[0], "unary", [&] {
    using T = scalar_t;
    using C = acc_t<T>;
    const C c0 = static_cast<C>(p0), c1 = static_cast<C>(p1);
    dispatch_unary(op, [&](auto op_c) {
      constexpr UnaryOp OP = decltype(op_c)::value;
      cpu_loop(it, [&](char** p, const int64_t* s, int64_t n) {
        T* out = reinterpret_cast<T*>(p[0]);
        const T* in = reinterpret_cast<const T*>(p[1]);
        if (s[0] == 1 && s[1] == 1) {
          for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(unary_fn<OP, C>(static_cast<C>(in[i]), c0, c1));
        } else {
          for (int64_t i = 0; i < n; ++i)
            out[i * s[0]] = static_cast<T>(unary_fn<OP, C>(static_cast<C>(in[i * s[1]]), c0, c1));
        }
      });
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
  Tensor out = Tensor::empty(in.sizes(), in.options());
  StridedIter it = make_iter(out, {in}, name);
  if (in.is_cuda()) unary_cuda(op, it, p0, p1); else unary_cpu(op, it, p0, p1);
  return out;
}

}  // namespace

Tensor neg(const Tensor& x) { return unary_op(UnaryOp::Neg, "neg", x); }
Tensor abs(const Tensor& x) { return unary_op(UnaryOp::Abs, "abs", x); }
Tensor exp(const Tensor& x) { return unary_op(UnaryOp::Exp, "exp", x); }
Tensor log(const Tensor& x) { return unary_op(UnaryOp::Log, "log", x); }
Tensor sqrt(const Tensor& x) { return unary_op(UnaryOp::Sqrt, "sqrt", x); }
Tensor rsqrt(const Tensor& x) { return unary_op(UnaryOp::Rsqrt, "rsqrt", x); }
Tensor relu(const Tensor& x) { return unary_op(UnaryOp::Relu, "relu", x); }
Tensor sigmoid(const Tensor& x) { return unary_op(UnaryOp::Sigmoid, "sigmoid", x); }
Tensor tanh(const Tensor& x) { return unary_op(UnaryOp::Tanh, "tanh", x); }
Tensor gelu(const Tensor& x, bool tanh_approx) {
  return unary_op(tanh_approx ? UnaryOp::GeluTanh : UnaryOp::Gelu, "gelu", x);
}
Tensor pow(const Tensor& x, double exponent) { return unary_op(UnaryOp::PowScalar, "pow", x, exponent); }

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
  return unary_op(UnaryOp::Clamp, "clamp", x, a, b);
}

Tensor Tensor::operator-() const { return neg(*this); }

}  // namespace ember
