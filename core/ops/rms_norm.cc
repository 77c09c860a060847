// rms_norm as one op (torch's F.rms_norm, Hugging Face's LlamaRMSNorm): per
// row of the normalised dims, y = x * rstd * weight with
// rstd = 1 / sqrt(mean(x^2) + eps), and its own derivative, so autograd keeps
// x and the rows' rstd rather than the intermediates of the composition
// (pow, mean, add, rsqrt, two muls: six kernels a direction per norm, twice
// per LLaMA block). With xhat = x * rstd and g = dy * weight:
//   dx = rstd * (g - xhat * mean(g * xhat))   (the mean over a row)
//   dweight = sum(dy * xhat)                  (over the rows)
// The CPU kernels are the reference for the CUDA ones (rms_norm.cu); both
// compute in float32 (float64 for float64), accumulate a row's sums wider
// (double on the CPU, a warp's shuffles on CUDA), and sum the weight's
// gradient over the rows in a fixed order (deterministic).
#include <cmath>
#include <vector>

#include "core/autocast.h"
#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops/kernels.h"
#include "core/ops_nn.h"

namespace ember {

// ---- CPU kernels ----
namespace {

int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

template <typename T>
void forward_cpu(const T* x, const T* w, double eps, int64_t rows, int64_t n, T* y, T* rstd) {
  parallel_for(rows, row_grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * n;
      double s = 0;
      for (int64_t j = 0; j < n; ++j) s += static_cast<double>(xr[j]) * xr[j];
      const T rs = static_cast<T>(1.0 / std::sqrt(s / static_cast<double>(n) + eps));
      rstd[r] = rs;
      T* yr = y + r * n;
      for (int64_t j = 0; j < n; ++j) yr[j] = w ? xr[j] * rs * w[j] : xr[j] * rs;
    }
  });
}

template <typename T>
void backward_cpu(const T* dy, const T* x, const T* rstd, const T* w, int64_t rows, int64_t n, T* dx, T* dw) {
  if (dx)
    parallel_for(rows, row_grain(n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T *dyr = dy + r * n, *xr = x + r * n;
        const T rs = rstd[r];
        double c = 0;  // sum(g * xhat)
        for (int64_t j = 0; j < n; ++j) c += static_cast<double>(w ? dyr[j] * w[j] : dyr[j]) * (xr[j] * rs);
        const T mc = static_cast<T>(c / static_cast<double>(n));
        T* dxr = dx + r * n;
        for (int64_t j = 0; j < n; ++j) dxr[j] = rs * ((w ? dyr[j] * w[j] : dyr[j]) - xr[j] * rs * mc);
      }
    });
  if (dw)
    // Columns in chunks, each summing every row in order.
    parallel_for(n, 64, [&](int64_t c0, int64_t c1) {
      std::vector<double> sw(static_cast<size_t>(c1 - c0), 0.0);
      for (int64_t r = 0; r < rows; ++r) {
        const T *dyr = dy + r * n, *xr = x + r * n;
        const T rs = rstd[r];
        for (int64_t j = c0; j < c1; ++j) sw[j - c0] += dyr[j] * (xr[j] * rs);
      }
      for (int64_t j = c0; j < c1; ++j) dw[j] = static_cast<T>(sw[j - c0]);
    });
}

}  // namespace

void rms_norm_forward_cpu(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  const int64_t rows = rstd.numel(), n = rows ? x.numel() / rows : 0;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    forward_cpu<T>(x.data<T>(), data_or_null<T>(w), eps, rows, n, y.data<T>(), rstd.data<T>());
  };
  if (x.dtype() == DType::Float64)
    run(double{});
  else
    run(float{});
}

void rms_norm_backward_cpu(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& w, Tensor* dx,
                           Tensor* dw) {
  const int64_t rows = rstd.numel(), n = rows ? x.numel() / rows : 0;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    backward_cpu<T>(dy.data<T>(), x.data<T>(), rstd.data<T>(), data_or_null<T>(w), rows, n, data_or_null<T>(dx),
                    data_or_null<T>(dw));
  };
  if (x.dtype() == DType::Float64)
    run(double{});
  else
    run(float{});
}

// ---- Op ----

Tensor rms_norm(const Tensor& x_in, int64_t normalized_ndim, const Tensor& weight, double eps) {
  if (Tensor c = autocast::fp32(x_in); !c.is_same(x_in)) return rms_norm(c, normalized_ndim, weight, eps);
  const Tensor& x = x_in;
  EMBER_CHECK(eps >= 0.0, "rms_norm: eps must be >= 0, got ", eps);
  const NormRows nr = norm_rows("rms_norm", x, normalized_ndim, {{"weight", &weight}});
  const Shape& norm_shape = nr.norm_shape;
  const int64_t n = nr.n, rows = nr.rows;
  std::vector<Tensor> inputs{x};
  if (weight.defined()) inputs.push_back(weight);
  Tensor rstd;
  return differentiable(
      "rms_norm", inputs,
      [&] {
        const Tensor xc = nr.prep(x), wc = nr.prep(weight);
        Tensor y = Tensor::empty(x.sizes(), {nr.io, x.device()});
        rstd = Tensor::empty({rows}, {nr.compute, x.device()});
        if (rows > 0 && n > 0) {
          if (x.is_cuda())
            rms_norm_forward_cuda(xc, wc, eps, y, rstd);
          else
            rms_norm_forward_cpu(xc, wc, eps, y, rstd);
        }
        return y.dtype() == x.dtype() ? y : y.to(x.dtype());
      },
      [&](const Tensor&) {
        const Tensor sx = x, srstd = rstd, sw = weight;
        const bool has_w = weight.defined();
        const bool gx_ = x.requires_grad(), gw_ = has_w && weight.requires_grad();
        const DType wdt = has_w ? weight.dtype() : x.dtype();
        BackwardFn fn = [=](const Tensor& g) {
          std::vector<Tensor> grads(1 + has_w);
          const bool gx = gx_ && grad_wanted(0), gw = gw_ && grad_wanted(1);
          const Tensor xc = nr.prep(sx), wc = nr.prep(sw), gc = nr.prep(g);
          Tensor dx = gx ? Tensor::empty(sx.sizes(), {nr.io, sx.device()}) : Tensor();
          Tensor dw = gw ? Tensor::empty(norm_shape, {nr.io, sx.device()}) : Tensor();
          if (rows > 0 && n > 0) {
            if (sx.is_cuda())
              rms_norm_backward_cuda(gc, xc, srstd, wc, gx ? &dx : nullptr, gw ? &dw : nullptr);
            else
              rms_norm_backward_cpu(gc, xc, srstd, wc, gx ? &dx : nullptr, gw ? &dw : nullptr);
          } else {
            for (Tensor* t : {&dx, &dw})
              if (t->defined()) t->zero_();
          }
          if (gx) grads[0] = dx.dtype() == sx.dtype() ? dx : dx.to(sx.dtype());
          if (gw) grads[1] = dw.dtype() == wdt ? dw : dw.to(wdt);
          return grads;
        };
        std::vector<Tensor> saved{sx, srstd};
        if (has_w) saved.push_back(sw);
        return Recorded{fn, saved};
      });
}

}  // namespace ember
