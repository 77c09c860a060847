// CUDA kernels of layer_norm (layer_norm.cc has the op, the math and the CPU
// reference). Forward and dx: a warp per row (a transformer's rows are a
// few hundred to a few thousand wide), the row's sums reduced with
// shuffles; the row stays in L1 between its passes. dweight and dbias:
// blocks of cuda::kNormTileRows rows write per-column partial sums, and one more
// kernel adds the partials of each column in tile order (deterministic,
// no atomics), as batch_norm.cu's finalize does.
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
__global__ void forward_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T eps,
                               int64_t rows, int64_t n, T* __restrict__ y, T* __restrict__ mean, T* __restrict__ rstd) {
  const int64_t r = cuda::global_thread_id() / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;  // whole warps: blockDim is a multiple of 32
  const T* xr = x + r * n;
  T s = 0;
  for (int64_t j = lane; j < n; j += kWarp) s += xr[j];
  const T mu = cuda::warp_sum(s) / static_cast<T>(n);
  T v = 0;
  for (int64_t j = lane; j < n; j += kWarp) v += (xr[j] - mu) * (xr[j] - mu);
  const T rs = T(1) / sqrt(cuda::warp_sum(v) / static_cast<T>(n) + eps);
  if (lane == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
  T* yr = y + r * n;
  for (int64_t j = lane; j < n; j += kWarp) {
    T t = (xr[j] - mu) * rs;
    if (w) t *= w[j];
    if (b) t += b[j];
    yr[j] = t;
  }
}

template <typename T>
__global__ void dx_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ mean,
                          const T* __restrict__ rstd, const T* __restrict__ w, int64_t rows, int64_t n,
                          T* __restrict__ dx) {
  const int64_t r = cuda::global_thread_id() / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const T *dyr = dy + r * n, *xr = x + r * n;
  const T m = mean[r], rs = rstd[r];
  T a = 0, c = 0;
  for (int64_t j = lane; j < n; j += kWarp) {
    const T g = w ? dyr[j] * w[j] : dyr[j];
    a += g;
    c += g * ((xr[j] - m) * rs);
  }
  const T ma = cuda::warp_sum(a) / static_cast<T>(n), mc = cuda::warp_sum(c) / static_cast<T>(n);
  T* dxr = dx + r * n;
  for (int64_t j = lane; j < n; j += kWarp) {
    const T g = w ? dyr[j] * w[j] : dyr[j];
    dxr[j] = rs * (g - ma - (xr[j] - m) * rs * mc);
  }
}

// Block (tile, column chunk): each thread one column, summing the tile's rows.
template <typename T>
__global__ void dwdb_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ mean,
                                    const T* __restrict__ rstd, int64_t rows, int64_t n, int64_t tile_rows,
                                    T* __restrict__ pw, T* __restrict__ pb) {
  const int64_t j = cuda::global_thread_id();
  if (j >= n) return;
  const int64_t tile = blockIdx.y, r0 = tile * tile_rows, r1 = r0 + tile_rows < rows ? r0 + tile_rows : rows;
  T sw = 0, sb = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const T g = dy[r * n + j];
    sw += g * ((x[r * n + j] - mean[r]) * rstd[r]);
    sb += g;
  }
  if (pw) pw[tile * n + j] = sw;
  if (pb) pb[tile * n + j] = sb;
}

template <typename T>
__global__ void dwdb_final_kernel(const T* __restrict__ pw, const T* __restrict__ pb, int64_t tiles, int64_t n,
                                  T* __restrict__ dw, T* __restrict__ db) {
  const int64_t j = cuda::global_thread_id();
  if (j >= n) return;
  T sw = 0, sb = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    if (pw) sw += pw[t * n + j];
    if (pb) sb += pb[t * n + j];
  }
  if (dw) dw[j] = sw;
  if (db) db[j] = sb;
}

template <typename T>
void forward(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean, Tensor& rstd) {
  cuda::DeviceGuard guard(x);
  const int64_t rows = mean.numel(), n = x.numel() / rows;
  forward_kernel<T><<<cuda::warp_rows_grid(rows), cuda::kBlockSize, 0, cuda::stream_for(x)>>>(
      x.data<T>(), data_or_null<T>(w), data_or_null<T>(b), static_cast<T>(eps), rows, n, y.data<T>(), mean.data<T>(),
      rstd.data<T>());
  EMBER_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void backward(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& w, Tensor* dx,
              Tensor* dw, Tensor* db) {
  cuda::DeviceGuard guard(x);
  cudaStream_t stream = cuda::stream_for(x);
  const int64_t rows = mean.numel(), n = x.numel() / rows;
  if (dx) {
    dx_kernel<T><<<cuda::warp_rows_grid(rows), cuda::kBlockSize, 0, stream>>>(
        dy.data<T>(), x.data<T>(), mean.data<T>(), rstd.data<T>(), data_or_null<T>(w), rows, n, dx->data<T>());
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
  if (dw || db) {
    const cuda::NormTiles nt(rows);
    const int64_t tile_rows = nt.rows_per_tile, tiles = nt.tiles;
    Tensor pw = dw ? Tensor::empty({tiles, n}, x.options()) : Tensor();
    Tensor pb = db ? Tensor::empty({tiles, n}, x.options()) : Tensor();
    const dim3 grid(static_cast<unsigned>(cuda::ceil_div(n, cuda::kBlockSize)), static_cast<unsigned>(tiles));
    dwdb_partial_kernel<T><<<grid, cuda::kBlockSize, 0, stream>>>(dy.data<T>(), x.data<T>(), mean.data<T>(),
                                                                  rstd.data<T>(), rows, n, tile_rows,
                                                                  data_or_null<T>(&pw), data_or_null<T>(&pb));
    EMBER_CUDA_CHECK(cudaGetLastError());
    dwdb_final_kernel<T><<<cuda::grid_for(n), cuda::kBlockSize, 0, stream>>>(
        data_or_null<T>(pw), data_or_null<T>(pb), tiles, n, data_or_null<T>(dw), data_or_null<T>(db));
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace

void layer_norm_forward_cuda(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                             Tensor& rstd) {
  if (x.dtype() == DType::Float64)
    forward<double>(x, w, b, eps, y, mean, rstd);
  else
    forward<float>(x, w, b, eps, y, mean, rstd);
}

void layer_norm_backward_cuda(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                              const Tensor& w, Tensor* dx, Tensor* dw, Tensor* db) {
  if (x.dtype() == DType::Float64)
    backward<double>(dy, x, mean, rstd, w, dx, dw, db);
  else
    backward<float>(dy, x, mean, rstd, w, dx, dw, db);
}

}  // namespace ember
