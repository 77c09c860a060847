// CUDA kernels of swiglu (swiglu.cc has the op, the math and the CPU
// reference): one grid-stride pass each way over contiguous a, b (and g),
// 16-byte loads when every operand is aligned for them, computed in
// acc_t<T> (float32 for 16-bit inputs) and rounded once.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/elementwise_fns.h"
#include "core/ops/kernels.h"

namespace ember {
namespace {

using cuda::VecN;

template <typename C>
__device__ __forceinline__ C sig(C x) {
  return C(1) / (C(1) + m_exp(-x));
}

// VEC elements per step; the last n % VEC elements go one a thread after.
template <typename T, int VEC>
__global__ void swiglu_forward_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ y, int64_t n) {
  using C = acc_t<T>;
  const int64_t nv = n / VEC;
  cuda::grid_stride_loop(nv, [&](int64_t v) {
    const VecN<T, VEC> av = reinterpret_cast<const VecN<T, VEC>*>(a)[v];
    const VecN<T, VEC> bv = reinterpret_cast<const VecN<T, VEC>*>(b)[v];
    VecN<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const C x = static_cast<C>(av.v[j]);
      out.v[j] = static_cast<T>(x * sig(x) * static_cast<C>(bv.v[j]));
    }
    reinterpret_cast<VecN<T, VEC>*>(y)[v] = out;
  });
  cuda::grid_stride_loop(n - nv * VEC, [&](int64_t t) {
    const int64_t i = nv * VEC + t;
    const C x = static_cast<C>(a[i]);
    y[i] = static_cast<T>(x * sig(x) * static_cast<C>(b[i]));
  });
}

template <typename T, int VEC>
__global__ void swiglu_backward_kernel(const T* __restrict__ g, const T* __restrict__ a, const T* __restrict__ b,
                                       T* __restrict__ da, T* __restrict__ db, int64_t n) {
  using C = acc_t<T>;
  auto one = [&](C gi, C x, C bi, T& dai, T& dbi) {
    const C s = sig(x);
    dai = static_cast<T>(gi * bi * s * (C(1) + x * (C(1) - s)));
    dbi = static_cast<T>(gi * x * s);
  };
  const int64_t nv = n / VEC;
  cuda::grid_stride_loop(nv, [&](int64_t v) {
    const VecN<T, VEC> gv = reinterpret_cast<const VecN<T, VEC>*>(g)[v];
    const VecN<T, VEC> av = reinterpret_cast<const VecN<T, VEC>*>(a)[v];
    const VecN<T, VEC> bv = reinterpret_cast<const VecN<T, VEC>*>(b)[v];
    VecN<T, VEC> dav, dbv;
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      one(static_cast<C>(gv.v[j]), static_cast<C>(av.v[j]), static_cast<C>(bv.v[j]), dav.v[j], dbv.v[j]);
    if (da) reinterpret_cast<VecN<T, VEC>*>(da)[v] = dav;
    if (db) reinterpret_cast<VecN<T, VEC>*>(db)[v] = dbv;
  });
  cuda::grid_stride_loop(n - nv * VEC, [&](int64_t t) {
    const int64_t i = nv * VEC + t;
    T dai, dbi;
    one(static_cast<C>(g[i]), static_cast<C>(a[i]), static_cast<C>(b[i]), dai, dbi);
    if (da) da[i] = dai;
    if (db) db[i] = dbi;
  });
}

}  // namespace

void swiglu_forward_cuda(const Tensor& a, const Tensor& b, Tensor& y) {
  cuda::DeviceGuard guard(a);
  cudaStream_t stream = cuda::stream_for(a);
  const int64_t n = a.numel();
  EMBER_DISPATCH_FLOAT(a.dtype(), "swiglu", [&] {
    using T = scalar_t;
    const T *ap = a.data<T>(), *bp = b.data<T>();
    T* yp = y.data<T>();
    cuda::with_vec_width<T>(n, {ap, bp, yp}, [&](auto vec, unsigned grid) {
      constexpr int VEC = decltype(vec)::value;
      swiglu_forward_kernel<T, VEC><<<grid, cuda::kBlockSize, 0, stream>>>(ap, bp, yp, n);
    });
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
}

void swiglu_backward_cuda(const Tensor& g, const Tensor& a, const Tensor& b, Tensor* da, Tensor* db) {
  cuda::DeviceGuard guard(a);
  cudaStream_t stream = cuda::stream_for(a);
  const int64_t n = a.numel();
  EMBER_DISPATCH_FLOAT(a.dtype(), "swiglu", [&] {
    using T = scalar_t;
    const T *gp = g.data<T>(), *ap = a.data<T>(), *bp = b.data<T>();
    T* dap = da ? da->data<T>() : nullptr;
    T* dbp = db ? db->data<T>() : nullptr;
    cuda::with_vec_width<T>(n, {gp, ap, bp, dap, dbp}, [&](auto vec, unsigned grid) {
      constexpr int VEC = decltype(vec)::value;
      swiglu_backward_kernel<T, VEC><<<grid, cuda::kBlockSize, 0, stream>>>(gp, ap, bp, dap, dbp, n);
    });
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ember
