// CUDA kernels of layer_norm (layer_norm.cc has the op, the math and the CPU
// reference). 16-bit tensors are read and written in their own dtype and
// computed in float32 (no float32 copies around the kernels). Forward and dx: a warp per row (a transformer's rows are
// a few hundred to a few thousand wide), the row's sums reduced with shuffles; the row stays in L1 between its passes.
// dweight and dbias: blocks of cuda::kNormTileRows rows write per-column partial sums, and one more kernel adds the
// partials of each column in tile order (deterministic, no atomics), as batch_norm.cu's finalize does.
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
__global__ void forward_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, C eps,
                               int64_t rows, int64_t n, T* __restrict__ y, C* __restrict__ mean, C* __restrict__ rstd) {
  const int64_t r = cuda::global_thread_id() / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;  // whole warps: blockDim is a multiple of 32
  const T* xr = x + r * n;
  C s = 0;
  for (int64_t j = lane; j < n; j += kWarp) s += static_cast<C>(xr[j]);
  const C mu = cuda::warp_sum(s) / static_cast<C>(n);
  C v = 0;
  for (int64_t j = lane; j < n; j += kWarp) {
    const C d = static_cast<C>(xr[j]) - mu;
    v += d * d;
  }
  const C rs = C(1) / sqrt(cuda::warp_sum(v) / static_cast<C>(n) + eps);
  if (lane == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
  T* yr = y + r * n;
  for (int64_t j = lane; j < n; j += kWarp) {
    C t = (static_cast<C>(xr[j]) - mu) * rs;
    if (w) t *= static_cast<C>(w[j]);
    if (b) t += static_cast<C>(b[j]);
    yr[j] = static_cast<T>(t);
  }
}

template <typename T, typename C>
__global__ void dx_kernel(const T* __restrict__ dy, const T* __restrict__ x, const C* __restrict__ mean,
                          const C* __restrict__ rstd, const T* __restrict__ w, int64_t rows, int64_t n,
                          T* __restrict__ dx) {
  const int64_t r = cuda::global_thread_id() / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const T *dyr = dy + r * n, *xr = x + r * n;
  const C m = mean[r], rs = rstd[r];
  auto gw = [&](int64_t j) { return w ? static_cast<C>(dyr[j]) * static_cast<C>(w[j]) : static_cast<C>(dyr[j]); };
  C a = 0, c = 0;
  for (int64_t j = lane; j < n; j += kWarp) {
    const C g = gw(j);
    a += g;
    c += g * ((static_cast<C>(xr[j]) - m) * rs);
  }
  const C ma = cuda::warp_sum(a) / static_cast<C>(n), mc = cuda::warp_sum(c) / static_cast<C>(n);
  T* dxr = dx + r * n;
  for (int64_t j = lane; j < n; j += kWarp)
    dxr[j] = static_cast<T>(rs * (gw(j) - ma - (static_cast<C>(xr[j]) - m) * rs * mc));
}

// Block (tile, column chunk): each thread one column, summing the tile's rows.
template <typename T, typename C>
__global__ void dwdb_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x, const C* __restrict__ mean,
                                    const C* __restrict__ rstd, int64_t rows, int64_t n, int64_t tile_rows,
                                    C* __restrict__ pw, C* __restrict__ pb) {
  const int64_t j = cuda::global_thread_id();
  if (j >= n) return;
  const int64_t tile = blockIdx.y, r0 = tile * tile_rows, r1 = r0 + tile_rows < rows ? r0 + tile_rows : rows;
  C sw = 0, sb = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const C g = static_cast<C>(dy[r * n + j]);
    sw += g * ((static_cast<C>(x[r * n + j]) - mean[r]) * rstd[r]);
    sb += g;
  }
  if (pw) pw[tile * n + j] = sw;
  if (pb) pb[tile * n + j] = sb;
}

template <typename T, typename C>
__global__ void dwdb_final_kernel(const C* __restrict__ pw, const C* __restrict__ pb, int64_t tiles, int64_t n,
                                  T* __restrict__ dw, T* __restrict__ db) {
  const int64_t j = cuda::global_thread_id();
  if (j >= n) return;
  C sw = 0, sb = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    if (pw) sw += pw[t * n + j];
    if (pb) sb += pb[t * n + j];
  }
  if (dw) dw[j] = static_cast<T>(sw);
  if (db) db[j] = static_cast<T>(sb);
}

template <typename T, typename C>
void forward(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean, Tensor& rstd) {
  cuda::DeviceGuard guard(x);
  const int64_t rows = mean.numel(), n = x.numel() / rows;
  forward_kernel<T, C><<<cuda::warp_rows_grid(rows), cuda::kBlockSize, 0, cuda::stream_for(x)>>>(
      x.data<T>(), data_or_null<T>(w), data_or_null<T>(b), static_cast<C>(eps), rows, n, y.data<T>(), mean.data<C>(),
      rstd.data<C>());
  EMBER_CUDA_CHECK(cudaGetLastError());
}

template <typename T, typename C>
void backward(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& w, Tensor* dx,
              Tensor* dw, Tensor* db) {
  cuda::DeviceGuard guard(x);
  cudaStream_t stream = cuda::stream_for(x);
  const int64_t rows = mean.numel(), n = x.numel() / rows;
  if (dx) {
    dx_kernel<T, C><<<cuda::warp_rows_grid(rows), cuda::kBlockSize, 0, stream>>>(
        dy.data<T>(), x.data<T>(), mean.data<C>(), rstd.data<C>(), data_or_null<T>(w), rows, n, dx->data<T>());
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
  if (dw || db) {
    const cuda::NormTiles nt(rows);
    const int64_t tile_rows = nt.rows_per_tile, tiles = nt.tiles;
    Tensor pw = dw ? Tensor::empty({tiles, n}, mean.options()) : Tensor();
    Tensor pb = db ? Tensor::empty({tiles, n}, mean.options()) : Tensor();
    const dim3 grid(static_cast<unsigned>(cuda::ceil_div(n, cuda::kBlockSize)), static_cast<unsigned>(tiles));
    dwdb_partial_kernel<T, C><<<grid, cuda::kBlockSize, 0, stream>>>(dy.data<T>(), x.data<T>(), mean.data<C>(),
                                                                     rstd.data<C>(), rows, n, tile_rows,
                                                                     data_or_null<C>(&pw), data_or_null<C>(&pb));
    EMBER_CUDA_CHECK(cudaGetLastError());
    dwdb_final_kernel<T, C><<<cuda::grid_for(n), cuda::kBlockSize, 0, stream>>>(
        data_or_null<C>(pw), data_or_null<C>(pb), tiles, n, data_or_null<T>(dw), data_or_null<T>(db));
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace

void layer_norm_forward_cuda(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                             Tensor& rstd) {
  cuda::dispatch_io(x.dtype(), [&]<typename T, typename C>() { forward<T, C>(x, w, b, eps, y, mean, rstd); });
}

void layer_norm_backward_cuda(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                              const Tensor& w, Tensor* dx, Tensor* dw, Tensor* db) {
  cuda::dispatch_io(x.dtype(), [&]<typename T, typename C>() { backward<T, C>(dy, x, mean, rstd, w, dx, dw, db); });
}

}  // namespace ember
