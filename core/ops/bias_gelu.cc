// bias_gelu(x, bias) = gelu(x + bias) over the last dimension, GPT-2's MLP
// activation fused with its first linear layer's bias, as one op with its
// own derivative. With t = x + bias (rounded to x's dtype, as linear's bias
// add writes it):
//   y  = gelu(t)
//   dx = g gelu'(t),  dbias = the sum of dx over the rows
// The composition (linear's GEMM, its bias add, gelu) writes and reads t
// once more each way: forward the bias add's pass over [rows, cols], and
// backward gelu's gradient pass and linear's bias sum read the same
// gradient. Here one pass forward and one backward (plus the bias's column
// sum), computed by the formulas gelu uses (elementwise_fns.h), so the
// results are the composition's bit for bit. Inputs x [..., cols]
// contiguous with bias [cols] of x's dtype take it; anything else is the
// composition. The CPU kernels are the reference for bias_gelu.cu's.
#include "core/autocast.h"
#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops/elementwise_fns.h"
#include "core/ops/kernels.h"

namespace ember {

// ---- CPU kernels ----
namespace {

// f(r, c, t) over [rows, cols] split by rows across threads, with t =
// x + bias rounded to T as linear's bias add leaves it (the loop vectorizes
// along the row).
template <typename T, typename F>
void each_biased(const T* x, const T* b, int64_t rows, int64_t cols, F&& f) {
  using C = acc_t<T>;
  parallel_for(rows, std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(cols, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c)
        f(r * cols + c, static_cast<C>(static_cast<T>(load_as<C>(xr + c) + load_as<C>(b + c))));
    }
  });
}

template <typename T, UnaryOp OP>
void forward_cpu(const T* x, const T* b, T* y, int64_t rows, int64_t cols) {
  using C = acc_t<T>;
  each_biased(x, b, rows, cols, [&](int64_t i, C t) { store_as(y + i, unary_fn<OP, C>(t, C(0), C(0))); });
}

template <typename T, BinaryOp OP>
void backward_cpu(const T* g, const T* x, const T* b, T* dx, int64_t rows, int64_t cols) {
  using C = acc_t<T>;
  each_biased(x, b, rows, cols,
              [&](int64_t i, C t) { store_as(dx + i, binary_fn<OP, C>(load_as<C>(g + i), t, C(1))); });
}

}  // namespace

void bias_gelu_forward_cpu(const Tensor& x, const Tensor& bias, bool tanh_approx, Tensor& y) {
  const int64_t cols = bias.numel(), rows = x.numel() / cols;
  EMBER_DISPATCH_FLOAT(x.dtype(), "bias_gelu", [&] {
    using T = scalar_t;
    if (tanh_approx)
      forward_cpu<T, UnaryOp::GeluTanh>(x.data<T>(), bias.data<T>(), y.data<T>(), rows, cols);
    else
      forward_cpu<T, UnaryOp::Gelu>(x.data<T>(), bias.data<T>(), y.data<T>(), rows, cols);
  });
}

void bias_gelu_backward_cpu(const Tensor& g, const Tensor& x, const Tensor& bias, bool tanh_approx, Tensor& dx) {
  const int64_t cols = bias.numel(), rows = x.numel() / cols;
  EMBER_DISPATCH_FLOAT(x.dtype(), "bias_gelu", [&] {
    using T = scalar_t;
    if (tanh_approx)
      backward_cpu<T, BinaryOp::GeluTanhGrad>(g.data<T>(), x.data<T>(), bias.data<T>(), dx.data<T>(), rows, cols);
    else
      backward_cpu<T, BinaryOp::GeluGrad>(g.data<T>(), x.data<T>(), bias.data<T>(), dx.data<T>(), rows, cols);
  });
}

// ---- Op ----

Tensor bias_gelu(const Tensor& x, const Tensor& bias, bool tanh_approx) {
  EMBER_CHECK(x.defined() && bias.defined(), "bias_gelu: undefined input");
  // Under autocast the bias is cast as linear would cast it.
  const Tensor b = bias.dtype() == x.dtype() ? bias : autocast::low(bias);
  if (b.dtype() != x.dtype() || b.device() != x.device() || b.dim() != 1 || x.dim() < 1 || x.size(-1) != b.sizes()[0] ||
      !is_floating(x.dtype()) || b.numel() == 0)
    return gelu(x + bias, tanh_approx);
  const int64_t cols = b.numel(), rows = x.numel() / cols;
  const Shape x_shape = x.sizes();
  return differentiable(
      "bias_gelu", {x, b},
      [&] {
        const Tensor xc = x.contiguous(), bc = b.contiguous();
        Tensor y = Tensor::empty(x_shape, x.options());
        if (y.numel() > 0) {
          if (x.is_cuda())
            bias_gelu_forward_cuda(xc, bc, tanh_approx, y);
          else
            bias_gelu_forward_cpu(xc, bc, tanh_approx, y);
        }
        return y;
      },
      [&](const Tensor&) {
        const Tensor sx = x, sb = b;
        const bool gx_ = x.requires_grad(), gb_ = b.requires_grad();
        BackwardFn fn = [sx, sb, gx_, gb_, tanh_approx, rows, cols, x_shape](const Tensor& g) {
          const bool gx = gx_ && grad_wanted(0), gb = gb_ && grad_wanted(1);
          std::vector<Tensor> grads(2);
          if (!gx && !gb) return grads;
          const Tensor xc = sx.contiguous(), bc = sb.contiguous(), gc = g.to(sx.dtype()).contiguous();
          Tensor dx = Tensor::empty(x_shape, sx.options());
          if (dx.numel() > 0) {
            if (xc.is_cuda())
              bias_gelu_backward_cuda(gc, xc, bc, tanh_approx, dx);
            else
              bias_gelu_backward_cpu(gc, xc, bc, tanh_approx, dx);
          }
          // As linear's backward sums its output gradient (a [1, rows, cols] view).
          if (gb) grads[1] = sum(dx.reshape({1, rows, cols}), {0, 1});
          if (gx) grads[0] = dx;
          return grads;
        };
        return Recorded{std::move(fn), {sx, sb}};
      });
}

}  // namespace ember
