// layer_norm as one op (torch's F.layer_norm): per row of the normalised
// dims, y = (x - mean) * rstd * weight + bias with the biased variance, and
// its own derivative, so autograd keeps x, the rows' mean and 1/std (and the
// weight), not the five intermediates of the composition, and a GPU step
// launches two kernels per layer norm and direction instead of about twenty
// (the composition was a visible share of a GPT step on an H200). With
// xhat = (x - mean) * rstd and dyw = dy * weight:
//   dx = rstd * (dyw - mean(dyw) - xhat * mean(dyw * xhat))   (means over a row)
//   dweight = sum(dy * xhat), dbias = sum(dy)                  (over the rows)
// The CPU kernels are the reference for the CUDA ones (layer_norm.cu); both
// compute in float32 (float64 for float64) and accumulate a row in a wider
// or compensated way, and the weight and bias gradients sum the rows in a
// fixed order (deterministic).
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

template <typename T>
void forward_cpu(const T* x, const T* w, const T* b, double eps, int64_t rows, int64_t n, T* y, T* mean, T* rstd) {
  parallel_for(rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * n;
      double s = 0;
      for (int64_t j = 0; j < n; ++j) s += xr[j];
      const double mu = s / static_cast<double>(n);
      double v = 0;
      for (int64_t j = 0; j < n; ++j) v += (xr[j] - mu) * (xr[j] - mu);
      const T m = static_cast<T>(mu), rs = static_cast<T>(1.0 / std::sqrt(v / static_cast<double>(n) + eps));
      mean[r] = m;
      rstd[r] = rs;
      T* yr = y + r * n;
      for (int64_t j = 0; j < n; ++j) {
        T t = (xr[j] - m) * rs;
        if (w) t *= w[j];
        if (b) t += b[j];
        yr[j] = t;
      }
    }
  });
}

template <typename T>
void backward_cpu(const T* dy, const T* x, const T* mean, const T* rstd, const T* w, int64_t rows, int64_t n, T* dx,
                  T* dw, T* db) {
  if (dx)
    parallel_for(rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T *dyr = dy + r * n, *xr = x + r * n;
        const T m = mean[r], rs = rstd[r];
        double a = 0, c = 0;  // sum(dyw), sum(dyw * xhat)
        for (int64_t j = 0; j < n; ++j) {
          const T g = w ? dyr[j] * w[j] : dyr[j];
          a += g;
          c += g * ((xr[j] - m) * rs);
        }
        const T ma = static_cast<T>(a / static_cast<double>(n)), mc = static_cast<T>(c / static_cast<double>(n));
        T* dxr = dx + r * n;
        for (int64_t j = 0; j < n; ++j) {
          const T g = w ? dyr[j] * w[j] : dyr[j];
          dxr[j] = rs * (g - ma - (xr[j] - m) * rs * mc);
        }
      }
    });
  if (dw || db)
    // Columns in chunks, each summing every row in order.
    parallel_for(n, 64, [&](int64_t c0, int64_t c1) {
      std::vector<double> sw(static_cast<size_t>(c1 - c0), 0.0), sb(sw.size(), 0.0);
      for (int64_t r = 0; r < rows; ++r) {
        const T *dyr = dy + r * n, *xr = x + r * n;
        const T m = mean[r], rs = rstd[r];
        for (int64_t j = c0; j < c1; ++j) {
          sw[j - c0] += dyr[j] * ((xr[j] - m) * rs);
          sb[j - c0] += dyr[j];
        }
      }
      for (int64_t j = c0; j < c1; ++j) {
        if (dw) dw[j] = static_cast<T>(sw[j - c0]);
        if (db) db[j] = static_cast<T>(sb[j - c0]);
      }
    });
}

}  // namespace

void layer_norm_forward_cpu(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                            Tensor& rstd) {
  const int64_t rows = mean.numel(), n = rows ? x.numel() / rows : 0;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    forward_cpu<T>(x.data<T>(), data_or_null<T>(w), data_or_null<T>(b), eps, rows, n, y.data<T>(), mean.data<T>(),
                   rstd.data<T>());
  };
  if (x.dtype() == DType::Float64)
    run(double{});
  else
    run(float{});
}

void layer_norm_backward_cpu(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& w,
                             Tensor* dx, Tensor* dw, Tensor* db) {
  const int64_t rows = mean.numel(), n = rows ? x.numel() / rows : 0;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    backward_cpu<T>(dy.data<T>(), x.data<T>(), mean.data<T>(), rstd.data<T>(), data_or_null<T>(w), rows, n,
                    data_or_null<T>(dx), data_or_null<T>(dw), data_or_null<T>(db));
  };
  if (x.dtype() == DType::Float64)
    run(double{});
  else
    run(float{});
}

// ---- Op ----

Tensor NormRows::prep(const Tensor& t) const {
  if (!t.defined()) return t;
  return (t.dtype() == io ? t : t.to(io)).contiguous();
}

NormRows norm_rows(const char* op, const Tensor& x, int64_t ndim,
                   std::initializer_list<std::pair<const char*, const Tensor*>> params) {
  EMBER_CHECK(x.defined(), op, ": input must be defined");
  EMBER_CHECK(ndim >= 1 && ndim <= x.dim(), op, ": cannot normalise the last ", ndim, " dims of ",
              shape_str(x.sizes()));
  EMBER_CHECK(is_floating(x.dtype()), op, ": expected a floating input, got ", x.dtype());
  NormRows r;
  r.norm_shape = Shape(x.sizes().end() - ndim, x.sizes().end());
  for (const auto& [name, p] : params) {
    if (!p->defined()) continue;
    EMBER_CHECK(p->sizes() == r.norm_shape, op, ": ", name, " ", shape_str(p->sizes()),
                " must have the normalised shape ", shape_str(r.norm_shape), " of input ", shape_str(x.sizes()));
    EMBER_CHECK(p->device() == x.device(), op, ": input is on ", x.device(), " but ", name, " is on ", p->device());
  }
  r.n = shape_numel(r.norm_shape);
  r.rows = r.n ? x.numel() / r.n : 0;
  // Float32 compute for 16-bit types (the kernels' accumulation type), as
  // under autocast; the result and the gradients come back in each
  // tensor's dtype.
  r.compute = x.dtype() == DType::Float64 ? DType::Float64 : DType::Float32;
  bool native = x.is_cuda() && (x.dtype() == DType::BFloat16 || x.dtype() == DType::Float16);
  for (const auto& [name, p] : params) native = native && (!p->defined() || p->dtype() == x.dtype());
  r.io = native ? x.dtype() : r.compute;
  return r;
}

Tensor layer_norm(const Tensor& x_in, int64_t normalized_ndim, const Tensor& weight, const Tensor& bias, double eps) {
  if (Tensor c = autocast::fp32(x_in); !c.is_same(x_in)) return layer_norm(c, normalized_ndim, weight, bias, eps);
  const Tensor& x = x_in;
  const NormRows nr = norm_rows("layer_norm", x, normalized_ndim, {{"weight", &weight}, {"bias", &bias}});
  const Shape& norm_shape = nr.norm_shape;
  const int64_t n = nr.n, rows = nr.rows;
  std::vector<Tensor> inputs{x};
  if (weight.defined()) inputs.push_back(weight);
  if (bias.defined()) inputs.push_back(bias);
  Tensor mean, rstd;
  return differentiable(
      "layer_norm", inputs,
      [&] {
        const Tensor xc = nr.prep(x), wc = nr.prep(weight), bc = nr.prep(bias);
        Tensor y = Tensor::empty(x.sizes(), {nr.io, x.device()});
        mean = Tensor::empty({rows}, {nr.compute, x.device()});
        rstd = Tensor::empty({rows}, {nr.compute, x.device()});
        if (rows > 0 && n > 0) {
          if (x.is_cuda())
            layer_norm_forward_cuda(xc, wc, bc, eps, y, mean, rstd);
          else
            layer_norm_forward_cpu(xc, wc, bc, eps, y, mean, rstd);
        }
        return y.dtype() == x.dtype() ? y : y.to(x.dtype());
      },
      [&](const Tensor&) {
        const Tensor sx = x, smu = mean, srstd = rstd, sw = weight;
        const bool has_w = weight.defined(), has_b = bias.defined();
        const bool gx_ = x.requires_grad(), gw_ = has_w && weight.requires_grad();
        const bool gb_ = has_b && bias.requires_grad();
        const DType wdt = has_w ? weight.dtype() : x.dtype(), bdt = has_b ? bias.dtype() : x.dtype();
        BackwardFn fn = [=](const Tensor& g) {
          std::vector<Tensor> grads(1 + has_w + has_b);
          const bool gx = gx_ && grad_wanted(0), gw = gw_ && grad_wanted(1), gb = gb_ && grad_wanted(has_w ? 2 : 1);
          const Tensor xc = nr.prep(sx), wc = nr.prep(sw), gc = nr.prep(g);
          Tensor dx = gx ? Tensor::empty(sx.sizes(), {nr.io, sx.device()}) : Tensor();
          Tensor dw = gw ? Tensor::empty(norm_shape, {nr.io, sx.device()}) : Tensor();
          Tensor db = gb ? Tensor::empty(norm_shape, {nr.io, sx.device()}) : Tensor();
          if (rows > 0 && n > 0) {
            if (sx.is_cuda())
              layer_norm_backward_cuda(gc, xc, smu, srstd, wc, gx ? &dx : nullptr, gw ? &dw : nullptr,
                                       gb ? &db : nullptr);
            else
              layer_norm_backward_cpu(gc, xc, smu, srstd, wc, gx ? &dx : nullptr, gw ? &dw : nullptr,
                                      gb ? &db : nullptr);
          } else {
            for (Tensor* t : {&dx, &dw, &db})
              if (t->defined()) t->zero_();
          }
          if (gx) grads[0] = dx.dtype() == sx.dtype() ? dx : dx.to(sx.dtype());
          if (gw) grads[1] = dw.dtype() == wdt ? dw : dw.to(wdt);
          if (gb) grads[has_w ? 2 : 1] = db.dtype() == bdt ? db : db.to(bdt);
          return grads;
        };
        std::vector<Tensor> saved{sx, smu, srstd};
        if (has_w) saved.push_back(sw);
        return Recorded{fn, saved};
      });
}

}  // namespace ember
