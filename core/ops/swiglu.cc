// swiglu(a, b) = silu(a) * b, LLaMA's feed-forward gate, as one op with its
// own derivative. With s = sigmoid(a):
//   y  = a s b
//   da = g b s (1 + a (1 - s))
//   db = g a s
// The composition silu(a) * b costs two kernels forward and three backward
// (mul's two products and silu's), and keeps silu(a) for mul's backward
// beside a and b: one activation the size of the feed-forward's hidden
// layer per block. Here one kernel each way, both gradients from one pass,
// and only a and b kept. Inputs of one shape, dtype and device take it;
// anything else (broadcasting, mixed dtypes) is the composition. The CPU
// kernels are the reference for the CUDA ones (swiglu.cu); both compute in
// float32 for 16-bit inputs (acc_t) and round once.
#include <cmath>

#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops/elementwise_fns.h"
#include "core/ops/kernels.h"

namespace ember {

// ---- CPU kernels ----
namespace {

template <typename T>
void forward_cpu(const T* a, const T* b, T* y, int64_t n) {
  using C = acc_t<T>;
  parallel_for(n, kParallelGrain, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) {
      const C x = static_cast<C>(a[i]);
      y[i] = static_cast<T>(x / (C(1) + m_exp(-x)) * static_cast<C>(b[i]));
    }
  });
}

template <typename T>
void backward_cpu(const T* g, const T* a, const T* b, T* da, T* db, int64_t n) {
  using C = acc_t<T>;
  parallel_for(n, kParallelGrain, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) {
      const C x = static_cast<C>(a[i]), gi = static_cast<C>(g[i]);
      const C s = C(1) / (C(1) + m_exp(-x));
      if (da) da[i] = static_cast<T>(gi * static_cast<C>(b[i]) * s * (C(1) + x * (C(1) - s)));
      if (db) db[i] = static_cast<T>(gi * x * s);
    }
  });
}

}  // namespace

void swiglu_forward_cpu(const Tensor& a, const Tensor& b, Tensor& y) {
  EMBER_DISPATCH_FLOAT(a.dtype(), "swiglu", [&] {
    using T = scalar_t;
    forward_cpu<T>(a.data<T>(), b.data<T>(), y.data<T>(), a.numel());
  });
}

void swiglu_backward_cpu(const Tensor& g, const Tensor& a, const Tensor& b, Tensor* da, Tensor* db) {
  EMBER_DISPATCH_FLOAT(a.dtype(), "swiglu", [&] {
    using T = scalar_t;
    backward_cpu<T>(g.data<T>(), a.data<T>(), b.data<T>(), da ? da->data<T>() : nullptr, db ? db->data<T>() : nullptr,
                    a.numel());
  });
}

// ---- Op ----

Tensor swiglu(const Tensor& a, const Tensor& b) {
  EMBER_CHECK(a.defined() && b.defined(), "swiglu: undefined input");
  if (a.sizes() != b.sizes() || a.dtype() != b.dtype() || a.device() != b.device() || !is_floating(a.dtype()))
    return silu(a) * b;
  return differentiable(
      "swiglu", {a, b},
      [&] {
        const Tensor ac = a.contiguous(), bc = b.contiguous();
        Tensor y = Tensor::empty(a.sizes(), a.options());
        if (y.numel() > 0) {
          if (a.is_cuda())
            swiglu_forward_cuda(ac, bc, y);
          else
            swiglu_forward_cpu(ac, bc, y);
        }
        return y;
      },
      [&](const Tensor&) {
        const Tensor sa = a, sb = b;
        const bool ga_ = a.requires_grad(), gb_ = b.requires_grad();
        BackwardFn fn = [sa, sb, ga_, gb_](const Tensor& g) {
          const bool ga = ga_ && grad_wanted(0), gb = gb_ && grad_wanted(1);
          std::vector<Tensor> grads(2);
          if (!ga && !gb) return grads;
          const Tensor ac = sa.contiguous(), bc = sb.contiguous(), gc = g.to(sa.dtype()).contiguous();
          Tensor da = ga ? Tensor::empty(sa.sizes(), sa.options()) : Tensor();
          Tensor db = gb ? Tensor::empty(sb.sizes(), sb.options()) : Tensor();
          if (ac.numel() > 0) {
            if (ac.is_cuda())
              swiglu_backward_cuda(gc, ac, bc, ga ? &da : nullptr, gb ? &db : nullptr);
            else
              swiglu_backward_cpu(gc, ac, bc, ga ? &da : nullptr, gb ? &db : nullptr);
          }
          grads[0] = da;
          grads[1] = db;
          return grads;
        };
        return Recorded{std::move(fn), {sa, sb}};
      });
}

}  // namespace ember
