// CUDA kernels of rms_norm (rms_norm.cc has the op, the math and the CPU
// reference). 16-bit tensors are read and written in their own dtype and
// computed in float32 (no float32 copies of x, y, dy or dx around the
// kernels). Forward and dx: a warp per row, the row's sums reduced with
// shuffles, as layer_norm.cu. dweight: blocks of cuda::kNormTileRows rows write
// per-column partial sums and one more kernel adds each column's partials
// in tile order (deterministic, no atomics).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/cuda_check.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"

namespace ember {
namespace {

constexpr int kWarp = cuda::kWarpSize;

// T: the tensors' dtype (16-bit read and written as they are), C: the
// compute and statistics dtype (float32, or float64 for float64).
template <typename T, typename C>
__global__ void forward_kernel(const T* __restrict__ x, const T* __restrict__ w, C eps, int64_t rows, int64_t n,
                               T* __restrict__ y, C* __restrict__ rstd) {
  const int64_t r = cuda::global_thread_id() / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;  // whole warps: blockDim is a multiple of 32
  const T* xr = x + r * n;
  C s = 0;
  for (int64_t j = lane; j < n; j += kWarp) {
    const C v = static_cast<C>(xr[j]);
    s += v * v;
  }
  const C rs = C(1) / sqrt(cuda::warp_sum(s) / static_cast<C>(n) + eps);
  if (lane == 0) rstd[r] = rs;
  T* yr = y + r * n;
  for (int64_t j = lane; j < n; j += kWarp) {
    const C v = static_cast<C>(xr[j]) * rs;
    yr[j] = static_cast<T>(w ? v * static_cast<C>(w[j]) : v);
  }
}

template <typename T, typename C>
__global__ void dx_kernel(const T* __restrict__ dy, const T* __restrict__ x, const C* __restrict__ rstd,
                          const T* __restrict__ w, int64_t rows, int64_t n, T* __restrict__ dx) {
  const int64_t r = cuda::global_thread_id() / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const T *dyr = dy + r * n, *xr = x + r * n;
  const C rs = rstd[r];
  auto gw = [&](int64_t j) { return w ? static_cast<C>(dyr[j]) * static_cast<C>(w[j]) : static_cast<C>(dyr[j]); };
  C c = 0;
  for (int64_t j = lane; j < n; j += kWarp) c += gw(j) * (static_cast<C>(xr[j]) * rs);
  const C mc = cuda::warp_sum(c) / static_cast<C>(n);
  T* dxr = dx + r * n;
  for (int64_t j = lane; j < n; j += kWarp) dxr[j] = static_cast<T>(rs * (gw(j) - static_cast<C>(xr[j]) * rs * mc));
}

// Block (tile, column chunk): each thread one column, summing the tile's rows.
template <typename T, typename C>
__global__ void dw_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x, const C* __restrict__ rstd,
                                  int64_t rows, int64_t n, int64_t tile_rows, C* __restrict__ pw) {
  const int64_t j = cuda::global_thread_id();
  if (j >= n) return;
  const int64_t tile = blockIdx.y, r0 = tile * tile_rows, r1 = r0 + tile_rows < rows ? r0 + tile_rows : rows;
  C sw = 0;
  for (int64_t r = r0; r < r1; ++r) sw += static_cast<C>(dy[r * n + j]) * (static_cast<C>(x[r * n + j]) * rstd[r]);
  pw[tile * n + j] = sw;
}

template <typename T, typename C>
__global__ void dw_final_kernel(const C* __restrict__ pw, int64_t tiles, int64_t n, T* __restrict__ dw) {
  const int64_t j = cuda::global_thread_id();
  if (j >= n) return;
  C sw = 0;
  for (int64_t t = 0; t < tiles; ++t) sw += pw[t * n + j];
  dw[j] = static_cast<T>(sw);
}

template <typename T, typename C>
void forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  cuda::DeviceGuard guard(x);
  const int64_t rows = rstd.numel(), n = x.numel() / rows;
  forward_kernel<T, C><<<cuda::warp_rows_grid(rows), cuda::kBlockSize, 0, cuda::stream_for(x)>>>(
      x.data<T>(), data_or_null<T>(w), static_cast<C>(eps), rows, n, y.data<T>(), rstd.data<C>());
  EMBER_CUDA_CHECK(cudaGetLastError());
}

template <typename T, typename C>
void backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& w, Tensor* dx, Tensor* dw) {
  cuda::DeviceGuard guard(x);
  cudaStream_t stream = cuda::stream_for(x);
  const int64_t rows = rstd.numel(), n = x.numel() / rows;
  if (dx) {
    dx_kernel<T, C><<<cuda::warp_rows_grid(rows), cuda::kBlockSize, 0, stream>>>(
        dy.data<T>(), x.data<T>(), rstd.data<C>(), data_or_null<T>(w), rows, n, dx->data<T>());
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
  if (dw) {
    const cuda::NormTiles nt(rows);
    const int64_t tile_rows = nt.rows_per_tile, tiles = nt.tiles;
    Tensor pw = Tensor::empty({tiles, n}, rstd.options());
    const dim3 grid(static_cast<unsigned>(cuda::ceil_div(n, cuda::kBlockSize)), static_cast<unsigned>(tiles));
    dw_partial_kernel<T, C><<<grid, cuda::kBlockSize, 0, stream>>>(dy.data<T>(), x.data<T>(), rstd.data<C>(), rows, n,
                                                                   tile_rows, pw.data<C>());
    EMBER_CUDA_CHECK(cudaGetLastError());
    dw_final_kernel<T, C><<<cuda::grid_for(n), cuda::kBlockSize, 0, stream>>>(pw.data<C>(), tiles, n, dw->data<T>());
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
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
