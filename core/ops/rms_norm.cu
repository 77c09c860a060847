// CUDA kernels of rms_norm (rms_norm.cc has the op, the math and the CPU
// reference). 16-bit tensors are read and written in their own dtype and
// computed in float32 (no float32 copies of x, y, dy or dx around the
// kernels). Forward and dx: a warp per row in 16-byte loads, held in
// registers between its passes (norm_rows.cuh), the row's sums reduced with
// shuffles, as layer_norm.cu. dweight: layer_norm.cu's kernels
// (norm_weight_grads_cuda), with x rstd for its xhat.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/cuda_check.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"
#include "core/ops/norm_rows.cuh"

namespace ember {
namespace {

constexpr int kWarp = cuda::kWarpSize;

// T: the tensors' dtype (16-bit read and written as they are), C: the
// compute and statistics dtype (float32, or float64 for float64), VEC: the
// elements a load moves (norm_rows.cuh).
template <typename T, typename C, int VEC>
__global__ void forward_kernel(const T* __restrict__ x, const T* __restrict__ w, C eps, int64_t rows, int64_t n,
                               T* __restrict__ y, C* __restrict__ rstd) {
  using Chunk = cuda::RowChunk<T, VEC>;
  const int64_t r = cuda::global_thread_id() / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;  // whole warps: blockDim is a multiple of 32
  const T* xr = x + r * n;
  const bool one = n <= Chunk::kCols;  // the row stays in xs between passes
  Chunk xs;
  C s = 0;
  for (int64_t c0 = 0; c0 < n; c0 += Chunk::kCols) {
    xs.load(xr, n, c0, lane);
    Chunk::each(n, c0, lane, [&](int i, int64_t) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) s += xs.template at<C>(i, e) * xs.template at<C>(i, e);
    });
  }
  const C rs = C(1) / sqrt(cuda::warp_sum(s) / static_cast<C>(n) + eps);
  if (lane == 0) rstd[r] = rs;
  T* yr = y + r * n;
  for (int64_t c0 = 0; c0 < n; c0 += Chunk::kCols) {
    if (!one) xs.load(xr, n, c0, lane);
    Chunk::each(n, c0, lane, [&](int i, int64_t j) {
      cuda::VecN<T, VEC> wv, out;
      if (w) wv = cuda::load_vec<T, VEC>(w + j);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const C t = xs.template at<C>(i, e) * rs;
        out.v[e] = static_cast<T>(w ? t * static_cast<C>(wv.v[e]) : t);
      }
      cuda::store_vec<T, VEC>(yr + j, out);
    });
  }
}

// dx = rstd (g - xhat mean(g xhat)), g = dy w, xhat = x rstd.
template <typename T, typename C, int VEC>
__global__ void dx_kernel(const T* __restrict__ dy, const T* __restrict__ x, const C* __restrict__ rstd,
                          const T* __restrict__ w, int64_t rows, int64_t n, T* __restrict__ dx) {
  using Chunk = cuda::RowChunk<T, VEC>;
  const int64_t r = cuda::global_thread_id() / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const T *dyr = dy + r * n, *xr = x + r * n;
  const C rs = rstd[r];
  const bool one = n <= Chunk::kCols;
  Chunk dys, xs;
  // f(i, e, g, xhat) for each element of the lane's vectors of the chunk at c0.
  const auto each = [&](int64_t c0, auto&& f) {
    Chunk::each(n, c0, lane, [&](int i, int64_t j) {
      cuda::VecN<T, VEC> wv;
      if (w) wv = cuda::load_vec<T, VEC>(w + j);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        C g = dys.template at<C>(i, e);
        if (w) g *= static_cast<C>(wv.v[e]);
        f(i, e, g, xs.template at<C>(i, e) * rs);
      }
    });
  };
  C c = 0;
  for (int64_t c0 = 0; c0 < n; c0 += Chunk::kCols) {
    dys.load(dyr, n, c0, lane);
    xs.load(xr, n, c0, lane);
    each(c0, [&](int, int, C g, C xh) { c += g * xh; });
  }
  const C mc = cuda::warp_sum(c) / static_cast<C>(n);
  T* dxr = dx + r * n;
  for (int64_t c0 = 0; c0 < n; c0 += Chunk::kCols) {
    if (!one) {
      dys.load(dyr, n, c0, lane);
      xs.load(xr, n, c0, lane);
    }
    cuda::VecN<T, VEC> out[Chunk::NV];
    each(c0, [&](int i, int e, C g, C xh) { out[i].v[e] = static_cast<T>(rs * (g - xh * mc)); });
    Chunk::each(n, c0, lane, [&](int i, int64_t j) { cuda::store_vec<T, VEC>(dxr + j, out[i]); });
  }
}

template <typename T, typename C>
void forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  cuda::DeviceGuard guard(x);
  const int64_t rows = rstd.numel(), n = x.numel() / rows;
  cuda::with_row_vec<T>(n, {x.raw_data(), y.raw_data(), data_or_null<T>(w)}, [&](auto vec) {
    constexpr int VEC = decltype(vec)::value;
    forward_kernel<T, C, VEC><<<cuda::warp_rows_grid(rows), cuda::kBlockSize, 0, cuda::stream_for(x)>>>(
        x.data<T>(), data_or_null<T>(w), static_cast<C>(eps), rows, n, y.data<T>(), rstd.data<C>());
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
}

template <typename T, typename C>
void backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& w, Tensor* dx, Tensor* dw) {
  cuda::DeviceGuard guard(x);
  cudaStream_t stream = cuda::stream_for(x);
  const int64_t rows = rstd.numel(), n = x.numel() / rows;
  if (dx) {
    cuda::with_row_vec<T>(n, {dy.raw_data(), x.raw_data(), dx->raw_data(), data_or_null<T>(w)}, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      dx_kernel<T, C, VEC><<<cuda::warp_rows_grid(rows), cuda::kBlockSize, 0, stream>>>(
          dy.data<T>(), x.data<T>(), rstd.data<C>(), data_or_null<T>(w), rows, n, dx->data<T>());
    });
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
  if (dw) norm_weight_grads_cuda(dy, x, nullptr, rstd, dw, nullptr);
}

}  // namespace

void rms_norm_forward_cuda(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  cuda::dispatch_io(x.dtype(), [&]<typename T, typename C>() { forward<T, C>(x, w, eps, y, rstd); });
}

void rms_norm_backward_cuda(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& w, Tensor* dx,
                            Tensor* dw) {
  cuda::dispatch_io(x.dtype(), [&]<typename T, typename C>() { backward<T, C>(dy, x, rstd, w, dx, dw); });
}

}  // namespace ember
