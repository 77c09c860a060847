// softmax / log_softmax over one dim: max-subtracted, computed in acc_t
// (fp32 for half types). Works on the [outer, r, inner] view of the input.
#include <algorithm>
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
// Contiguous float32 rows (a LM head's logits: the common case), vectorized:
// the max and the sum of exponentials as SIMD reductions, expf from libmvec
// (elementwise_fns.h), in a function of its own so gcc vectorizes it.
__attribute__((noinline)) void softmax_rows_f32(const float* __restrict x, float* __restrict y, int64_t rows, int64_t r,
                                                bool log) {
  for (int64_t j = 0; j < rows; ++j) {
    const float* xr = x + j * r;
    float* yr = y + j * r;
    float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
    for (int64_t k = 0; k < r; ++k) mx = std::max(mx, xr[k]);
    if (std::isinf(mx) && mx < 0) mx = 0;  // all -inf row: avoid inf - inf
    // The sum of exponentials in blocks of kSumBlock carried into a double
    // (cpu_loop.h).
    double total = 0;
    if (log) {
      for (int64_t b = 0; b < r; b += kSumBlock) {
        const int64_t e = std::min(r, b + kSumBlock);
        float block = 0;
#pragma omp simd reduction(+ : block)
        for (int64_t k = b; k < e; ++k) block += expf(xr[k] - mx);
        total += block;
      }
      const float sum = static_cast<float>(total);
      // (x - max) - lse, not x - (max + lse): a large max would round away
      // the small log-probabilities' digits.
      const float lse = logf(sum);
#pragma omp simd
      for (int64_t k = 0; k < r; ++k) yr[k] = (xr[k] - mx) - lse;
    } else {
      for (int64_t b = 0; b < r; b += kSumBlock) {
        const int64_t end = std::min(r, b + kSumBlock);
        float block = 0;
#pragma omp simd reduction(+ : block)
        for (int64_t k = b; k < end; ++k) {
          const float e = expf(xr[k] - mx);
          yr[k] = e;
          block += e;
        }
        total += block;
      }
      const float inv = static_cast<float>(1.0 / total);
#pragma omp simd
      for (int64_t k = 0; k < r; ++k) yr[k] *= inv;
    }
  }
}
}  // namespace

void softmax_cpu(const Tensor& in, Tensor& out, int64_t outer, int64_t r, int64_t inner, bool log) {
  EMBER_DISPATCH_FLOAT(in.dtype(), "softmax", [&] {
    using T = scalar_t;
    using C = acc_t<T>;
    const T* x = static_cast<const T*>(in.raw_data());
    T* y = static_cast<T*>(out.raw_data());
    parallel_for(outer * inner, std::max<int64_t>(1, 4096 / std::max<int64_t>(r, 1)), [&](int64_t b, int64_t e) {
      if constexpr (std::is_same_v<T, float>) {
        if (inner == 1)  // (casts: T is no template parameter here)
          return softmax_rows_f32(reinterpret_cast<const float*>(x) + b * r, reinterpret_cast<float*>(y) + b * r, e - b,
                                  r, log);
      }
      for (int64_t j = b; j < e; ++j) {
        int64_t o = j / inner, i = j % inner;
        const T* xr = x + o * r * inner + i;
        T* yr = y + o * r * inner + i;
        C mx = -std::numeric_limits<C>::infinity();
        for (int64_t k = 0; k < r; ++k) mx = std::max(mx, static_cast<C>(xr[k * inner]));
        if (std::isinf(mx) && mx < 0) mx = 0;  // all -inf row: avoid inf - inf
        // Summed in double for float math (a strided row does not vectorize
        // anyway): the same accuracy as the contiguous path's blocks.
        double total = 0;
        for (int64_t k = 0; k < r; ++k) total += m_exp(static_cast<C>(xr[k * inner]) - mx);
        const C sum = static_cast<C>(total);
        if (log) {
          C lse = m_log(sum);
          for (int64_t k = 0; k < r; ++k) yr[k * inner] = static_cast<T>(static_cast<C>(xr[k * inner]) - mx - lse);
        } else {
          C inv = C(1) / sum;
          for (int64_t k = 0; k < r; ++k)
            yr[k * inner] = static_cast<T>(m_exp(static_cast<C>(xr[k * inner]) - mx) * inv);
        }
      }
    });
  });
}

// ---- Op layer ----
namespace {
Tensor softmax_impl(const Tensor& x, int64_t dim, bool log, const char* name) {
  EMBER_CHECK(x.defined(), name, ": input is undefined");
  EMBER_CHECK(is_floating(x.dtype()), name, ": expected a floating dtype, got ", x.dtype());
  if (x.dim() == 0) return softmax_impl(x.reshape({1}), 0, log, name).reshape({});
  dim = wrap_dim(dim, x.dim(), name);
  Tensor in = x.contiguous();
  Tensor out = Tensor::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  int64_t outer = 1, inner = 1, r = x.sizes()[dim];
  for (int64_t d = 0; d < dim; ++d) outer *= x.sizes()[d];
  for (int64_t d = dim + 1; d < x.dim(); ++d) inner *= x.sizes()[d];
  if (x.is_cuda()) softmax_cuda(in, out, outer, r, inner, log);
  else softmax_cpu(in, out, outer, r, inner, log);
  return out;
}
}  // namespace

// Under autocast (autocast.h): 16-bit inputs in float32, then again.
Tensor softmax(const Tensor& x, int64_t dim) {
  if (Tensor c = autocast::fp32(x); !c.is_same(x)) return softmax(c, dim);
  return differentiable("softmax", {x}, [&] { return softmax_impl(x, dim, false, "softmax"); },
                        [&](const Tensor& y) {
                          // dx = y * (g - sum(g * y))
                          BackwardFn fn = [=](const Tensor& g) {
                            return std::vector<Tensor>{y * (g - sum(g * y, {dim}, true))};
                          };
                          return Recorded{fn, {y}};
                        });
}
Tensor log_softmax(const Tensor& x, int64_t dim) {
  if (Tensor c = autocast::fp32(x); !c.is_same(x)) return log_softmax(c, dim);
  return differentiable("log_softmax", {x}, [&] { return softmax_impl(x, dim, true, "log_softmax"); },
                        [&](const Tensor& y) {
                          // dx = g - exp(y) * sum(g)
                          BackwardFn fn = [=](const Tensor& g) {
                            return std::vector<Tensor>{g - exp(y) * sum(g, {dim}, true)};
                          };
                          return Recorded{fn, {y}};
                        });
}

}  // namespace ember
