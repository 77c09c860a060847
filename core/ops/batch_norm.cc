// batch_norm: CPU kernels and the op layer (batch_norm.cu has the CUDA ones).
// Statistics accumulate in double across planes whatever the input dtype: a
// channel of a ResNet batch holds ~10^5 values, and a float running sum of
// that many loses the low bits the variance is made of. Within one plane
// (H*W values) sums run in the compute type over SIMD lanes, which keeps the
// loops vectorized at no visible cost in accuracy. The variance is two-pass
// (sum of squared deviations from the mean) rather than E[x^2] - E[x]^2,
// which cancels catastrophically when |mean| >> std.
#include <cmath>
#include <type_traits>

#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops/kernels.h"
#include "core/ops_nn.h"

namespace ember {

// ---- CPU kernels ----
namespace {
// Elementwise math in double for double input, float otherwise.
template <typename T>
using elem_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

struct BnShape {
  int64_t n, c, s;  // x viewed as [n, c, s]
};
BnShape bn_shape(const Tensor& x) { return {x.size(0), x.size(1), x.size(2) * x.size(3)}; }

// Per-channel value of an optional [C] tensor.
template <typename S>
S at_or(const S* p, int64_t c, S fallback) {
  return p ? p[c] : fallback;
}
template <typename S>
const S* opt_ptr(const Tensor& t) {
  return t.defined() ? t.data<S>() : nullptr;
}

// Dispatches on the input type T and the statistics type S.
// relu's value (elementwise_fns.h): NaN kept. Rounding to a 16-bit output
// after it or before gives the same bits (it keeps signs and zeros).
template <typename S>
S relu_of(S v) {
  return v > S(0) ? v : (v != v ? v : S(0));
}

// v rounded to T and read back: batch norm's output as the unfused op stores
// it, before a fused residual add (for float and double, v itself): the
// conversions store_as and load_as make, on a value.
template <typename T, typename S>
S round_to(S v) {
  if constexpr (is_bits_float_v<T>)
    return static_cast<S>(T::to_float(T::from_float(static_cast<float>(v))));
  else
    return static_cast<S>(static_cast<T>(v));
}

template <typename F>
void bn_dispatch(DType t, F&& f) {
  EMBER_DISPATCH_FLOAT(t, "batch_norm", [&] { f(scalar_t{}, elem_t<scalar_t>{}); });
}
}  // namespace

void batch_norm_stats_cpu(const Tensor& x, Tensor& mean, Tensor& var) {
  const BnShape sh = bn_shape(x);
  bn_dispatch(x.dtype(), [&](auto t, auto s) {
    using T = decltype(t);
    using S = decltype(s);
    const T* xp = x.data<T>();
    S* mp = mean.data<S>();
    S* vp = var.data<S>();
    const double m = static_cast<double>(sh.n * sh.s);
    parallel_for(sh.c, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        // Each row (one plane) is summed in S (float, or double for double)
        // with SIMD lanes, rows in double: vectorized, and as accurate as a
        // double sum for planes of a few thousand elements.
        double sum = 0;
        for (int64_t n = 0; n < sh.n; ++n) {
          const T* row = xp + (n * sh.c + c) * sh.s;
          S acc = 0;
#pragma omp simd reduction(+ : acc)
          for (int64_t i = 0; i < sh.s; ++i) acc += load_as<S>(row + i);
          sum += acc;
        }
        const double mu = sum / m;
        const S mu_f = static_cast<S>(mu);
        double sq = 0;
        for (int64_t n = 0; n < sh.n; ++n) {
          const T* row = xp + (n * sh.c + c) * sh.s;
          S acc = 0;
#pragma omp simd reduction(+ : acc)
          for (int64_t i = 0; i < sh.s; ++i) {
            const S d = load_as<S>(row + i) - mu_f;
            acc += d * d;
          }
          sq += acc;
        }
        mp[c] = static_cast<S>(mu);
        vp[c] = static_cast<S>(sq / m);
      }
    });
  });
}

void batch_norm_apply_cpu(const Tensor& x, const Tensor& mean, const Tensor& invstd, const Tensor& w, const Tensor& b,
                          Tensor& y, bool relu, const Tensor* residual) {
  const BnShape sh = bn_shape(x);
  bn_dispatch(x.dtype(), [&](auto t, auto s) {
    using T = decltype(t);
    using S = decltype(s);
    const T* xp = x.data<T>();
    const T* rp = residual ? residual->data<T>() : nullptr;
    T* yp = y.data<T>();
    const S *mp = mean.data<S>(), *ip = invstd.data<S>(), *wp = opt_ptr<S>(w), *bp = opt_ptr<S>(b);
    // Planes, not channels, so a small C still fills every thread.
    parallel_for(sh.n * sh.c, std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(sh.s, 1)),
                 [&](int64_t begin, int64_t end) {
                   for (int64_t p = begin; p < end; ++p) {
                     const int64_t c = p % sh.c;
                     const S scale = ip[c] * at_or(wp, c, S(1));
                     const S shift = at_or(bp, c, S(0)) - mp[c] * scale;
                     const T* xr = xp + p * sh.s;
                     T* yr = yp + p * sh.s;
                     if (rp) {
                       const T* rr = rp + p * sh.s;
#pragma omp simd
                       for (int64_t i = 0; i < sh.s; ++i)
                         store_as(yr + i,
                                  relu_of(round_to<T>(load_as<S>(xr + i) * scale + shift) + load_as<S>(rr + i)));
                     } else if (relu) {
#pragma omp simd
                       for (int64_t i = 0; i < sh.s; ++i) store_as(yr + i, relu_of(load_as<S>(xr + i) * scale + shift));
                     } else {
#pragma omp simd
                       for (int64_t i = 0; i < sh.s; ++i) store_as(yr + i, load_as<S>(xr + i) * scale + shift);
                     }
                   }
                 });
  });
}

void batch_norm_backward_cpu(const Tensor& x, const Tensor& dy, const Tensor& mean, const Tensor& invstd,
                             const Tensor& w, bool train, Tensor* dx, Tensor* dw, Tensor* db, const Tensor* relu_out,
                             Tensor* dres) {
  EMBER_INTERNAL_ASSERT(!dres || relu_out, "batch_norm_backward_cpu: dres without relu_out");
  const BnShape sh = bn_shape(x);
  bn_dispatch(x.dtype(), [&](auto t, auto s) {
    using T = decltype(t);
    using S = decltype(s);
    const T *xp = x.data<T>(), *gp = dy.data<T>();
    // With the ReLU: dy counts where its output is > 0 (relu_backward's
    // rule), read in both loops below, none of it materialised.
    const T* yp = relu_out ? relu_out->data<T>() : nullptr;
    const S *mp = mean.data<S>(), *ip = invstd.data<S>(), *wp = opt_ptr<S>(w);
    T* dxp = dx ? dx->data<T>() : nullptr;
    T* drp = dres ? dres->data<T>() : nullptr;
    S* dwp = dw ? dw->data<S>() : nullptr;
    S* dbp = db ? db->data<S>() : nullptr;
    const double m = static_cast<double>(sh.n * sh.s);
    // kStore: the residual's gradient (the masked dy) written as the dx loop
    // reads it.
    auto run = [&](auto masked, auto store) {
      constexpr bool kMask = decltype(masked)::value;
      constexpr bool kStore = decltype(store)::value;
      parallel_for(sh.c, 1, [&](int64_t begin, int64_t end) {
        for (int64_t c = begin; c < end; ++c) {
          const double mu = mp[c], inv = ip[c];
          // Per-row SIMD sums in S, rows in double (see batch_norm_stats_cpu).
          double sum_dy = 0, sum_dy_xc = 0;
          const S mu_f = static_cast<S>(mu);
          for (int64_t n = 0; n < sh.n; ++n) {
            // Row pointers as locals: read through the lambda's captures, gcc
            // reloads them each iteration and cannot vectorize.
            const int64_t off = (n * sh.c + c) * sh.s;
            const T* gr = gp + off;
            const T* xr = xp + off;
            const T* yr = kMask ? yp + off : nullptr;
            S a_dy = 0, a_dyx = 0;
#pragma omp simd reduction(+ : a_dy, a_dyx)
            for (int64_t i = 0; i < sh.s; ++i) {
              S g = load_as<S>(gr + i);
              if constexpr (kMask) g = load_as<S>(yr + i) > S(0) ? g : S(0);
              a_dy += g;
              a_dyx += g * (load_as<S>(xr + i) - mu_f);
            }
            sum_dy += a_dy;
            sum_dy_xc += a_dyx;
          }
          const double sum_dy_xhat = sum_dy_xc * inv;
          if (dwp) dwp[c] = static_cast<S>(sum_dy_xhat);
          if (dbp) dbp[c] = static_cast<S>(sum_dy);
          // The residual's gradient, the masked dy, is written by the dx loop
          // below, which computes it anyway (a store in the sums' loop changed
          // gcc's vector width there, and with it the sums' bits at 16 bits).
          // Without dx, a loop of its own.
          if (!dxp && kStore)
            for (int64_t n = 0; n < sh.n; ++n) {
              const int64_t off = (n * sh.c + c) * sh.s;
              const T *gr = gp + off, *yr = yp + off;
              T* rr = drp + off;
#pragma omp simd
              for (int64_t i = 0; i < sh.s; ++i)
                store_as(rr + i, load_as<S>(yr + i) > S(0) ? load_as<S>(gr + i) : S(0));
            }
          if (!dxp) continue;
          const double wc = at_or(wp, c, S(1));
          // train: dx = w * invstd / M * (M * dy - sum(dy) - xhat * sum(dy * xhat)),
          // written as a * dy + b * xhat + k; eval: dx = w * invstd * dy.
          const S a = static_cast<S>(wc * inv);
          const S bx = train ? static_cast<S>(-wc * inv * sum_dy_xhat / m) : S(0);
          const S k = train ? static_cast<S>(-wc * inv * sum_dy / m) : S(0);
          const S mu_s = static_cast<S>(mu), inv_s = static_cast<S>(inv);
          for (int64_t n = 0; n < sh.n; ++n) {
            const int64_t off = (n * sh.c + c) * sh.s;
            const T *gr = gp + off, *xr = xp + off;
            const T* yr = kMask ? yp + off : nullptr;
            T* dr = dxp + off;
            T* rr = kStore ? drp + off : nullptr;
#pragma omp simd
            for (int64_t i = 0; i < sh.s; ++i) {
              S g = load_as<S>(gr + i);
              if constexpr (kMask) g = load_as<S>(yr + i) > S(0) ? g : S(0);
              if constexpr (kStore) store_as(rr + i, g);
              const S xhat = (load_as<S>(xr + i) - mu_s) * inv_s;
              store_as(dr + i, a * g + bx * xhat + k);
            }
          }
        }
      });
    };
    if (drp)
      run(std::true_type{}, std::true_type{});
    else if (yp)
      run(std::true_type{}, std::false_type{});
    else
      run(std::false_type{}, std::false_type{});
  });
}

// ---- Op layer ----
namespace {
void check_channel_param(const Tensor& t, const Tensor& x, const char* what) {
  if (!t.defined()) return;
  EMBER_CHECK(t.dim() == 1 && t.size(0) == x.size(1), "batch_norm: ", what, " ", shape_str(t.sizes()),
              " must be [", x.size(1), "] for input ", shape_str(x.sizes()));
  EMBER_CHECK(t.device() == x.device(), "batch_norm: ", what, " is on ", t.device(), " but input is on ", x.device());
  EMBER_CHECK(is_floating(t.dtype()), "batch_norm: ", what, " must be floating, got ", t.dtype());
}

// A [C] parameter as the kernels want it: contiguous, statistics dtype.
Tensor as_stat(const Tensor& t, DType sd) { return t.defined() ? t.detach().to(sd).contiguous() : Tensor(); }

Tensor batch_norm_op(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                     const Tensor& running_var, bool training, double momentum, double eps, bool relu,
                     const Tensor& counter, const Tensor& residual = Tensor()) {
  EMBER_CHECK(x.defined(), "batch_norm: input is undefined");
  if (residual.defined())
    EMBER_CHECK(residual.sizes() == x.sizes() && residual.dtype() == x.dtype() && residual.device() == x.device(),
                "batch_norm_add_relu: the residual must be laid over the input: residual ", shape_str(residual.sizes()),
                " ", residual.dtype(), " on ", residual.device(), ", input ", shape_str(x.sizes()), " ", x.dtype(),
                " on ", x.device());
  EMBER_CHECK(x.dim() == 4, "batch_norm: expected a 4-D input [N, C, H, W], got ", shape_str(x.sizes()));
  EMBER_CHECK(is_floating(x.dtype()), "batch_norm: expected a floating input, got ", x.dtype());
  check_channel_param(weight, x, "weight");
  check_channel_param(bias, x, "bias");
  check_channel_param(running_mean, x, "running_mean");
  check_channel_param(running_var, x, "running_var");
  EMBER_CHECK(running_mean.defined() == running_var.defined(),
              "batch_norm: running_mean and running_var must both be given or both be undefined");
  EMBER_CHECK(training || running_mean.defined(),
              "batch_norm: eval mode (training=false) needs running_mean and running_var; input ",
              shape_str(x.sizes()));
  if (counter.defined())
    EMBER_CHECK(counter.numel() == 1 && counter.dtype() == DType::Int64 && counter.device() == x.device(),
                "batch_norm: num_batches_tracked must be one int64 element on the input's device (", x.device(),
                "), got ", shape_str(counter.sizes()), " ", counter.dtype(), " on ", counter.device());
  // Counted with each update of the running statistics, as BatchNorm2d does.
  const bool count = counter.defined() && training && running_mean.defined();
  bool counted = false;
  const int64_t m = x.size(0) * x.size(2) * x.size(3);
  EMBER_CHECK(!training || m > 1, "batch_norm: expected more than 1 value per channel when training, got input ",
              shape_str(x.sizes()));
  const DType sd = x.dtype() == DType::Float64 ? DType::Float64 : DType::Float32;
  // The kernels see [N, C, S] memory. Channels-last (NHWC) memory is exactly
  // [N*H*W, C, 1] of that form, so it runs through the same kernels, and
  // y and dx come back channels-last.
  const bool cl = x.suggest_memory_format() == MemoryFormat::ChannelsLast;
  const Shape xs = x.sizes();
  auto to_kernel = [cl, xs](const Tensor& t) {
    return cl ? t.contiguous(MemoryFormat::ChannelsLast).permute({0, 2, 3, 1}).reshape({xs[0] * xs[2] * xs[3], xs[1], 1, 1})
              : t.contiguous();
  };
  auto from_kernel = [cl, xs](const Tensor& t) {
    return cl ? t.view({xs[0], xs[2], xs[3], xs[1]}).permute({0, 3, 1, 2}) : t;
  };
  const bool add = residual.defined();
  relu = relu || add;
  const char* name = add ? "batch_norm_add_relu" : relu ? "batch_norm_relu" : "batch_norm";
  Tensor xc, rc, wc, bc, mean, invstd;
  {
    NoGradGuard no_grad;  // statistics and copies are not part of the graph
    xc = to_kernel(x).detach();
    if (add) rc = to_kernel(residual).detach();  // laid out as x is
    wc = as_stat(weight, sd);
    bc = as_stat(bias, sd);
    if (training && x.is_cuda()) {
      // One kernel pair computes mean and invstd on the device and updates
      // running statistics kept as the kernels want them (contiguous, in
      // the statistics dtype) in place; others update as tensor ops below.
      mean = Tensor::empty({x.size(1)}, {sd, x.device()});
      invstd = Tensor::empty({x.size(1)}, {sd, x.device()});
      const bool in_place = running_mean.defined() && running_mean.dtype() == sd && running_var.dtype() == sd &&
                            running_mean.is_contiguous() && running_var.is_contiguous();
      Tensor rm = running_mean.defined() ? running_mean.detach() : Tensor();
      Tensor rv = running_var.defined() ? running_var.detach() : Tensor();
      Tensor n = count ? counter.detach() : Tensor();
      counted = count && x.numel() > 0;
      if (x.numel() > 0)
        batch_norm_stats_cuda(xc, mean, invstd, eps, in_place ? &rm : nullptr, in_place ? &rv : nullptr, momentum,
                              counted ? &n : nullptr);
      if (running_mean.defined() && !in_place && x.numel() > 0) {
        Tensor var = 1.0 / (invstd * invstd) - eps;  // back from invstd = 1 / sqrt(var + eps)
        rm.copy_(rm * (1.0 - momentum) + mean.to(rm.dtype()) * momentum);
        rv.copy_(rv * (1.0 - momentum) + var.to(rv.dtype()) * (momentum * m / (m - 1.0)));
      }
    } else if (training) {
      mean = Tensor::empty({x.size(1)}, {sd, x.device()});
      Tensor var = Tensor::empty({x.size(1)}, {sd, x.device()});
      if (x.numel() > 0) batch_norm_stats_cpu(xc, mean, var);
      invstd = rsqrt(var + eps);
      if (running_mean.defined()) {
        // running = (1 - momentum) * running + momentum * batch (unbiased var).
        Tensor rm = running_mean.detach(), rv = running_var.detach();
        rm.copy_(rm * (1.0 - momentum) + mean.to(rm.dtype()) * momentum);
        rv.copy_(rv * (1.0 - momentum) + var.to(rv.dtype()) * (momentum * m / (m - 1.0)));
      }
    } else {
      mean = as_stat(running_mean, sd);
      invstd = rsqrt(running_var.detach().to(sd) + eps).contiguous();
    }
    if (count) {
      Tensor n = counter.detach();
      check_inplace(n, "batch_norm");
      if (!counted) n += ones({}, DType::Int64);  // the CPU's, or an empty batch's
    }
  }
  std::vector<Tensor> inputs = {x, weight, bias};
  if (add) inputs.push_back(residual);
  return differentiable(
      name, inputs,
      [&] {
        Tensor y = Tensor::empty(xc.sizes(), xc.options());
        if (y.numel() == 0) return from_kernel(y);
        if (x.is_cuda())
          batch_norm_apply_cuda(xc, mean, invstd, wc, bc, y, relu, add ? &rc : nullptr);
        else
          batch_norm_apply_cpu(xc, mean, invstd, wc, bc, y, relu, add ? &rc : nullptr);
        return from_kernel(y);
      },
      [&](const Tensor& out) {
        // With the ReLU, its output masks the gradient (relu_backward's rule);
        // the residual's gradient is that masked gradient.
        const Tensor yk = relu ? to_kernel(out) : Tensor();
        const bool need_r = add && residual.requires_grad();
        const bool need_x = x.requires_grad();
        const bool need_w = weight.defined() && weight.requires_grad(), need_b = bias.defined() && bias.requires_grad();
        const DType wdt = weight.defined() ? weight.dtype() : sd, bdt = bias.defined() ? bias.dtype() : sd;
        BackwardFn fn = [=](const Tensor& gy) {
          Tensor dy = to_kernel(gy);
          Tensor dx = need_x ? Tensor::empty(xc.sizes(), xc.options()) : Tensor();
          Tensor dr = need_r ? Tensor::empty(xc.sizes(), xc.options()) : Tensor();
          // The CUDA kernels write every element; the CPU ones skip an empty batch.
          auto make = [&](bool need) {
            if (!need) return Tensor();
            return xc.is_cuda() ? Tensor::empty({xc.size(1)}, {sd, xc.device()})
                                : zeros({xc.size(1)}, {sd, xc.device()});
          };
          Tensor dw = make(need_w), db = make(need_b);
          if (xc.is_cuda() && xc.numel() == 0) {
            if (dw.defined()) dw.zero_();
            if (db.defined()) db.zero_();
          }
          if (xc.numel() > 0) {
            const Tensor* mask = relu ? &yk : nullptr;
            if (xc.is_cuda())
              batch_norm_backward_cuda(xc, dy, mean, invstd, wc, training, need_x ? &dx : nullptr,
                                       need_w ? &dw : nullptr, need_b ? &db : nullptr, mask, need_r ? &dr : nullptr);
            else
              batch_norm_backward_cpu(xc, dy, mean, invstd, wc, training, need_x ? &dx : nullptr,
                                      need_w ? &dw : nullptr, need_b ? &db : nullptr, mask, need_r ? &dr : nullptr);
          }
          std::vector<Tensor> grads = {need_x ? from_kernel(dx) : dx, need_w ? dw.to(wdt) : dw,
                                       need_b ? db.to(bdt) : db};
          if (add) grads.push_back(need_r ? from_kernel(dr) : dr);
          return grads;
        };
        return relu ? Recorded{fn, {xc, wc, out}} : Recorded{fn, {xc, wc}};
      });
}

}  // namespace

Tensor batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                  const Tensor& running_var, bool training, double momentum, double eps,
                  const Tensor& num_batches_tracked) {
  return batch_norm_op(x, weight, bias, running_mean, running_var, training, momentum, eps, false, num_batches_tracked);
}

Tensor batch_norm_relu(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                       const Tensor& running_var, bool training, double momentum, double eps,
                       const Tensor& num_batches_tracked) {
  return batch_norm_op(x, weight, bias, running_mean, running_var, training, momentum, eps, true, num_batches_tracked);
}

Tensor batch_norm_add_relu(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
                           const Tensor& running_mean, const Tensor& running_var, bool training, double momentum,
                           double eps, const Tensor& num_batches_tracked) {
  EMBER_CHECK(residual.defined(), "batch_norm_add_relu: the residual is undefined (input ",
              x.defined() ? shape_str(x.sizes()) : std::string("undefined"), ")");
  return batch_norm_op(x, weight, bias, running_mean, running_var, training, momentum, eps, true, num_batches_tracked,
                       residual);
}

}  // namespace ember
