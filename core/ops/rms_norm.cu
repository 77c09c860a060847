// CUDA kernels of rms_norm (rms_norm.cc has the op, the math and the CPU
// reference). Forward and dx: a warp per row, the row's sums reduced with
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

template <typename T>
__global__ void forward_kernel(const T* __restrict__ x, const T* __restrict__ w, T eps, int64_t rows, int64_t n,
                               T* __restrict__ y, T* __restrict__ rstd) {
  const int64_t r = cuda::global_thread_id() / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;  // whole warps: blockDim is a multiple of 32
  const T* xr = x + r * n;
  T s = 0;
  for (int64_t j = lane; j < n; j += kWarp) s += xr[j] * xr[j];
  const T rs = T(1) / sqrt(cuda::warp_sum(s) / static_cast<T>(n) + eps);
  if (lane == 0) rstd[r] = rs;
  T* yr = y + r * n;
  for (int64_t j = lane; j < n; j += kWarp) yr[j] = w ? xr[j] * rs * w[j] : xr[j] * rs;
}

template <typename T>
__global__ void dx_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ rstd,
                          const T* __restrict__ w, int64_t rows, int64_t n, T* __restrict__ dx) {
  const int64_t r = cuda::global_thread_id() / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const T *dyr = dy + r * n, *xr = x + r * n;
  const T rs = rstd[r];
  T c = 0;
  for (int64_t j = lane; j < n; j += kWarp) c += (w ? dyr[j] * w[j] : dyr[j]) * (xr[j] * rs);
  const T mc = cuda::warp_sum(c) / static_cast<T>(n);
  T* dxr = dx + r * n;
  for (int64_t j = lane; j < n; j += kWarp) dxr[j] = rs * ((w ? dyr[j] * w[j] : dyr[j]) - xr[j] * rs * mc);
}

// Block (tile, column chunk): each thread one column, summing the tile's rows.
template <typename T>
__global__ void dw_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ rstd,
                                  int64_t rows, int64_t n, int64_t tile_rows, T* __restrict__ pw) {
  const int64_t j = cuda::global_thread_id();
  if (j >= n) return;
  const int64_t tile = blockIdx.y, r0 = tile * tile_rows, r1 = r0 + tile_rows < rows ? r0 + tile_rows : rows;
  T sw = 0;
  for (int64_t r = r0; r < r1; ++r) sw += dy[r * n + j] * (x[r * n + j] * rstd[r]);
  pw[tile * n + j] = sw;
}

template <typename T>
__global__ void dw_final_kernel(const T* __restrict__ pw, int64_t tiles, int64_t n, T* __restrict__ dw) {
  const int64_t j = cuda::global_thread_id();
  if (j >= n) return;
  T sw = 0;
  for (int64_t t = 0; t < tiles; ++t) sw += pw[t * n + j];
  dw[j] = sw;
}

template <typename T>
void forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  cuda::DeviceGuard guard(x);
  const int64_t rows = rstd.numel(), n = x.numel() / rows;
  forward_kernel<T><<<cuda::warp_rows_grid(rows), cuda::kBlockSize, 0, cuda::stream_for(x)>>>(
      x.data<T>(), data_or_null<T>(w), static_cast<T>(eps), rows, n, y.data<T>(), rstd.data<T>());
  EMBER_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& w, Tensor* dx, Tensor* dw) {
  cuda::DeviceGuard guard(x);
  cudaStream_t stream = cuda::stream_for(x);
  const int64_t rows = rstd.numel(), n = x.numel() / rows;
  if (dx) {
    dx_kernel<T><<<cuda::warp_rows_grid(rows), cuda::kBlockSize, 0, stream>>>(
        dy.data<T>(), x.data<T>(), rstd.data<T>(), data_or_null<T>(w), rows, n, dx->data<T>());
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
  if (dw) {
    const cuda::NormTiles nt(rows);
    const int64_t tile_rows = nt.rows_per_tile, tiles = nt.tiles;
    Tensor pw = Tensor::empty({tiles, n}, x.options());
    const dim3 grid(static_cast<unsigned>(cuda::ceil_div(n, cuda::kBlockSize)), static_cast<unsigned>(tiles));
    dw_partial_kernel<T><<<grid, cuda::kBlockSize, 0, stream>>>(dy.data<T>(), x.data<T>(), rstd.data<T>(), rows, n,
                                                                tile_rows, pw.data<T>());
    EMBER_CUDA_CHECK(cudaGetLastError());
    dw_final_kernel<T><<<cuda::grid_for(n), cuda::kBlockSize, 0, stream>>>(pw.data<T>(), tiles, n, dw->data<T>());
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace

void rms_norm_forward_cuda(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  if (x.dtype() == DType::Float64)
    forward<double>(x, w, eps, y, rstd);
  else
    forward<float>(x, w, eps, y, rstd);
}

void rms_norm_backward_cuda(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& w, Tensor* dx,
                            Tensor* dw) {
  if (x.dtype() == DType::Float64)
    backward<double>(dy, x, rstd, w, dx, dw);
  else
    backward<float>(dy, x, rstd, w, dx, dw);
}

}  // namespace ember
