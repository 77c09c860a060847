// cross_entropy as one op with its own derivative (F.cross_entropy over
// class indices, with label smoothing and ignore_index). Per row n of
// logits x [N, C] with target t:
//   lse  = log sum_c exp(x_c)
//   loss = (lse - x_t)                                   label_smoothing 0
//        = (1 - ls) (lse - x_t) + ls (lse - mean_c x_c)   otherwise
//   dx_c = g (exp(x_c - lse) - ls / C - (1 - ls) [c == t])
// and 0 (loss and gradient) where t == ignore_index. The forward keeps only
// lse beside the logits: the composition it replaces (log_softmax, gather,
// neg, the smoothing terms) kept log_softmax(x) in float32, and under
// autocast first cast the 16-bit logits to float32, so a 128k-token
// vocabulary cost 8 bytes per logit kept and 4 more in the backward's
// float32 softmax. Here the kernels read the logits in their own dtype,
// accumulate in float32 (float64 for float64) and write the gradient in
// the logits' dtype in one pass: 2 bytes per bf16 logit, nothing in
// float32 the size of the logits. The CPU kernels (here) are the reference
// for the CUDA ones (cross_entropy.cu); the CPU carries a row's sums into
// double every kSumBlock terms.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops/elementwise_fns.h"
#include "core/ops/kernels.h"
#include "core/ops_nn.h"

namespace ember {

// ---- CPU kernels ----
namespace {

int64_t row_grain(int64_t c) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(c, 1)); }

template <typename I>
int64_t target_at(const void* t, int64_t n) {
  return static_cast<int64_t>(static_cast<const I*>(t)[n]);
}

int64_t read_target(const Tensor& target, int64_t n) {
  return target.dtype() == DType::Int64 ? target_at<int64_t>(target.raw_data(), n)
                                        : target_at<int32_t>(target.raw_data(), n);
}

// A row's statistics: its max m (0 for a row of -inf only, as softmax's
// kernels take it), the sum of exp(x - m), and the sum of x (with label
// smoothing). A NaN or +inf in the row makes the sum NaN, as log_softmax
// gives.
struct RowStats {
  double m = 0, sum_exp = 0, sum_x = 0;
  double lse() const { return m + std::log(sum_exp); }
};

// float32 rows (the LM head's logits), vectorized as softmax_rows_f32: the
// max and the sums as SIMD reductions, expf from libmvec, each block of
// kSumBlock terms summed in float and carried into a double (cpu_loop.h).
// Functions of their own so gcc vectorizes them.
__attribute__((noinline)) RowStats row_stats_f32(const float* __restrict x, int64_t c, bool want_sum_x) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t k = 0; k < c; ++k) mx = std::max(mx, x[k]);
  if (std::isinf(mx) && mx < 0) mx = 0;
  RowStats st;
  st.m = mx;
  for (int64_t b = 0; b < c; b += kSumBlock) {
    const int64_t e = std::min(c, b + kSumBlock);
    float block = 0, bx = 0;
#pragma omp simd reduction(+ : block)
    for (int64_t k = b; k < e; ++k) block += expf(x[k] - mx);
    st.sum_exp += block;
    if (want_sum_x) {
#pragma omp simd reduction(+ : bx)
      for (int64_t k = b; k < e; ++k) bx += x[k];
      st.sum_x += bx;
    }
  }
  return st;
}

// out = g (exp(x - lse) - off), the row's gradient but the target's term.
__attribute__((noinline)) void row_grad_f32(const float* __restrict x, int64_t c, float g, float lse, float off,
                                            float* __restrict out) {
#pragma omp simd
  for (int64_t k = 0; k < c; ++k) out[k] = g * (expf(x[k] - lse) - off);
}

// float64 rows: the same in double, not vectorized (the reference dtype).
RowStats row_stats_f64(const double* x, int64_t c, bool want_sum_x) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t k = 0; k < c; ++k) mx = std::max(mx, x[k]);
  if (std::isinf(mx) && mx < 0) mx = 0;
  RowStats st;
  st.m = mx;
  for (int64_t k = 0; k < c; ++k) {
    st.sum_exp += std::exp(x[k] - mx);
    if (want_sum_x) st.sum_x += x[k];
  }
  return st;
}

// A row as float32: the row itself, or (16-bit logits) its conversion into
// the thread's buffer.
template <typename T>
const float* as_f32(const T* x, int64_t c, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    buf.resize(static_cast<size_t>(c));
    for (int64_t k = 0; k < c; ++k) buf[k] = static_cast<float>(x[k]);
    return buf.data();
  }
}

template <typename T, typename C>
void forward_cpu(const CrossEntropyArgs& a, const T* x, const Tensor& target, C* loss, C* lse, float* counted) {
  const double ls = a.label_smoothing;
  parallel_for(a.rows, row_grain(a.classes), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf;
    for (int64_t n = r0; n < r1; ++n) {
      const int64_t t = read_target(target, n);
      if (counted) counted[n] = t == a.ignore_index ? 0.f : 1.f;
      if (t == a.ignore_index) {
        loss[n] = 0;
        lse[n] = 0;
        continue;
      }
      RowStats st;
      double xt = 0;
      if constexpr (std::is_same_v<T, double>) {
        st = row_stats_f64(x + n * a.classes, a.classes, ls > 0);
        xt = x[n * a.classes + t];
      } else {
        const float* xr = as_f32(x + n * a.classes, a.classes, buf);
        st = row_stats_f32(xr, a.classes, ls > 0);
        xt = xr[t];
      }
      // (m - x_t) + log(sum), not lse - x_t: a large max would round away
      // a small loss's digits.
      const double log_sum = std::log(st.sum_exp);
      double v = (st.m - xt) + log_sum;
      if (ls > 0) v = v * (1.0 - ls) + ((st.m - st.sum_x / static_cast<double>(a.classes)) + log_sum) * ls;
      loss[n] = static_cast<C>(v);
      lse[n] = static_cast<C>(st.m + log_sum);
    }
  });
}

template <typename T, typename C>
void backward_cpu(const CrossEntropyArgs& a, const C* g, const T* x, const Tensor& target, const C* lse, T* dx) {
  const C hit = static_cast<C>(1.0 - a.label_smoothing),
          off = static_cast<C>(a.label_smoothing / static_cast<double>(a.classes));
  parallel_for(a.rows, row_grain(a.classes), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf, out;
    for (int64_t n = r0; n < r1; ++n) {
      const int64_t t = read_target(target, n);
      T* dr = dx + n * a.classes;
      if (t == a.ignore_index) {
        std::fill(dr, dr + a.classes, static_cast<T>(C(0)));
        continue;
      }
      const C gn = g[n], l = lse[n];
      if constexpr (std::is_same_v<T, double>) {
        const double* xr = x + n * a.classes;
        for (int64_t j = 0; j < a.classes; ++j) dr[j] = gn * (std::exp(xr[j] - l) - off);
        dr[t] -= gn * hit;
      } else if constexpr (std::is_same_v<T, float>) {
        row_grad_f32(x + n * a.classes, a.classes, gn, l, off, dr);
        dr[t] -= gn * hit;
      } else {
        const float* xr = as_f32(x + n * a.classes, a.classes, buf);
        out.resize(static_cast<size_t>(a.classes));
        row_grad_f32(xr, a.classes, gn, l, off, out.data());
        out[t] -= gn * hit;
        for (int64_t j = 0; j < a.classes; ++j) dr[j] = static_cast<T>(out[j]);
      }
    }
  });
}

// Targets out of [0, C) that are not ignore_index: the CPU names the first
// before any kernel runs (the CUDA kernel records it in the device's error
// slot instead, reported at the next synchronisation).
void check_targets_cpu(const CrossEntropyArgs& a, const Tensor& target) {
  for (int64_t n = 0; n < a.rows; ++n) {
    const int64_t t = read_target(target, n);
    EMBER_CHECK(t == a.ignore_index || (t >= 0 && t < a.classes), "cross_entropy: target ", t, " of row ", n,
                " is out of the range [0, ", a.classes, ") and is not ignore_index (", a.ignore_index, ")");
  }
}

}  // namespace

void cross_entropy_forward_cpu(const CrossEntropyArgs& a, const Tensor& logits, const Tensor& target, Tensor& loss,
                               Tensor& lse, Tensor* counted) {
  check_targets_cpu(a, target);
  float* cnt = counted ? counted->data<float>() : nullptr;
  EMBER_DISPATCH_FLOAT(logits.dtype(), "cross_entropy", [&] {
    using T = scalar_t;
    using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
    forward_cpu<T, C>(a, logits.data<T>(), target, loss.data<C>(), lse.data<C>(), cnt);
  });
}

void cross_entropy_backward_cpu(const CrossEntropyArgs& a, const Tensor& grad_loss, const Tensor& logits,
                                const Tensor& target, const Tensor& lse, Tensor& grad) {
  EMBER_DISPATCH_FLOAT(logits.dtype(), "cross_entropy", [&] {
    using T = scalar_t;
    using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
    backward_cpu<T, C>(a, grad_loss.data<C>(), logits.data<T>(), target, lse.data<C>(), grad.data<T>());
  });
}

// ---- Op ----

Tensor cross_entropy_rows(const Tensor& logits, const Tensor& target, double label_smoothing, int64_t ignore_index,
                          Tensor* counted) {
  EMBER_CHECK(logits.defined() && target.defined(), "cross_entropy: logits and target must be defined");
  EMBER_CHECK(logits.dim() == 2, "cross_entropy: expected logits [N, C], got ", shape_str(logits.sizes()));
  EMBER_CHECK(is_floating(logits.dtype()), "cross_entropy: logits must be floating, got ", logits.dtype());
  EMBER_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), "cross_entropy: target ",
              shape_str(target.sizes()), " does not match logits ", shape_str(logits.sizes()), " (expected [",
              logits.size(0), "])");
  EMBER_CHECK(target.dtype() == DType::Int64 || target.dtype() == DType::Int32,
              "cross_entropy: target must hold class indices (int64 or int32), got ", target.dtype());
  EMBER_CHECK(target.device() == logits.device(), "cross_entropy: target on ", target.device().str(), ", logits on ",
              logits.device().str());
  EMBER_CHECK(label_smoothing >= 0 && label_smoothing <= 1, "cross_entropy: label_smoothing must be in [0, 1], got ",
              label_smoothing);
  const CrossEntropyArgs args{logits.size(0), logits.size(1), label_smoothing, ignore_index};
  const DType acc = logits.dtype() == DType::Float64 ? DType::Float64 : DType::Float32;
  const Tensor t = target.contiguous();
  Tensor lse;
  Tensor cnt = counted ? Tensor::empty({args.rows}, {DType::Float32, logits.device()}) : Tensor();
  Tensor rows = differentiable(
      "cross_entropy", {logits},
      [&] {
        const Tensor x = logits.contiguous();
        Tensor loss = Tensor::empty({args.rows}, {acc, logits.device()});
        lse = Tensor::empty({args.rows}, {acc, logits.device()});
        if (args.rows > 0) {
          if (logits.is_cuda())
            cross_entropy_forward_cuda(args, x, t, loss, lse, counted ? &cnt : nullptr);
          else
            cross_entropy_forward_cpu(args, x, t, loss, lse, counted ? &cnt : nullptr);
        }
        return loss;
      },
      [&](const Tensor&) {
        const Tensor sx = logits, st = t, slse = lse;
        BackwardFn fn = [sx, st, slse, args](const Tensor& g) {
          const Tensor x = sx.contiguous(), gc = g.to(slse.dtype()).contiguous();
          Tensor dx = Tensor::empty(x.sizes(), x.options());
          if (args.rows > 0 && args.classes > 0) {
            if (x.is_cuda())
              cross_entropy_backward_cuda(args, gc, x, st, slse, dx);
            else
              cross_entropy_backward_cpu(args, gc, x, st, slse, dx);
          }
          return std::vector<Tensor>{dx};
        };
        return Recorded{std::move(fn), {sx, st, slse}};
      });
  if (counted) *counted = cnt;
  return rows;
}

}  // namespace ember
