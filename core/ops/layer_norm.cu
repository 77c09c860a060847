// CUDA kernels of layer_norm (layer_norm.cc has the op, the math and the CPU
// reference). 16-bit tensors are read and written in their own dtype and
// computed in float32 (no float32 copies around the kernels). Forward and dx: norm_rows.cuh's kernels (rms_norm's
// too), a warp per row (a transformer's rows are a few hundred to a few thousand wide) in 16-byte loads, held in
// registers between its passes up to 1,024 columns, the row's sums reduced with shuffles.
// dweight and dbias (rms_norm.cu's too): blocks of 32 rows write per-column partial sums in 16-byte loads, and one
// more kernel adds the partials of each column in tile order (deterministic, no atomics), as batch_norm.cu's finalize
// does.
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

// The weight's and the bias's gradients, layer_norm's and rms_norm's:
// block (column chunk, tile of rows), each thread VEC columns, summing the
// tile's rows of dy xhat and of dy (xhat = (x - mean) rstd, or x rstd
// without a mean: rms_norm's), its rows' loads independent of one another
// (norm_rows.cuh: NormTiles).
template <typename T, typename C, int VEC>
__global__ void weight_grads_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                            const C* __restrict__ mean, const C* __restrict__ rstd, int64_t rows,
                                            int64_t n, int64_t tile_rows, C* __restrict__ pw, C* __restrict__ pb) {
  const int64_t j = cuda::global_thread_id() * VEC;
  if (j >= n) return;
  const int64_t tile = blockIdx.y, r0 = tile * tile_rows, r1 = r0 + tile_rows < rows ? r0 + tile_rows : rows;
  C sw[VEC] = {}, sb[VEC] = {};
  // K rows' loads issued before any is used, unconditionally (a row past
  // the tile reads its last again and adds nothing): unrolled as one loop,
  // or with a test a row, nvcc put each row's sums between its loads and
  // the next row's.
  constexpr int K = 4;
  for (int64_t r = r0; r < r1; r += K) {
    cuda::VecN<T, VEC> g[K], xv[K];
    C m[K], rs[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t rr = r + k < r1 ? r + k : r1 - 1;
      g[k] = cuda::load_vec<T, VEC>(dy + rr * n + j);
      xv[k] = cuda::load_vec<T, VEC>(x + rr * n + j);
      m[k] = mean ? mean[rr] : C(0);
      rs[k] = rstd[rr];
    }
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (r + k < r1)
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          sw[e] += static_cast<C>(g[k].v[e]) * ((static_cast<C>(xv[k].v[e]) - m[k]) * rs[k]);
          sb[e] += static_cast<C>(g[k].v[e]);
        }
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    if (pw) pw[tile * n + j + e] = sw[e];
    if (pb) pb[tile * n + j + e] = sb[e];
  }
}

template <typename T, typename C>
__global__ void weight_grads_final_kernel(const C* __restrict__ pw, const C* __restrict__ pb, int64_t tiles, int64_t n,
                                          T* __restrict__ dw, T* __restrict__ db) {
  cuda::grid_stride_loop(n, [&](int64_t j) {  // grid_for caps the blocks
    C sw = 0, sb = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      if (pw) sw += pw[t * n + j];
      if (pb) sb += pb[t * n + j];
    }
    if (dw) dw[j] = static_cast<T>(sw);
    if (db) db[j] = static_cast<T>(sb);
  });
}

template <typename T, typename C>
void forward(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean, Tensor& rstd) {
  cuda::DeviceGuard guard(x);
  const int64_t rows = mean.numel(), n = x.numel() / rows;
  cuda::with_row_vec<T>(n, {x.raw_data(), y.raw_data(), data_or_null<T>(w), data_or_null<T>(b)}, [&](auto vec) {
    constexpr int VEC = decltype(vec)::value;
    cuda::norm_rows_forward_kernel<T, C, VEC, true>
        <<<cuda::warp_rows_grid(rows), cuda::kBlockSize, 0, cuda::stream_for(x)>>>(
            x.data<T>(), data_or_null<T>(w), data_or_null<T>(b), static_cast<C>(eps), rows, n, y.data<T>(),
            mean.data<C>(), rstd.data<C>());
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
}

// dw and db of either norm (mean null: rms_norm's xhat, x rstd).
template <typename T, typename C>
void weight_grads(const Tensor& dy, const Tensor& x, const Tensor* mean, const Tensor& rstd, Tensor* dw, Tensor* db) {
  cudaStream_t stream = cuda::stream_for(x);
  const int64_t rows = rstd.numel(), n = x.numel() / rows;
  const cuda::NormTiles nt(rows);
  const int64_t tile_rows = nt.rows_per_tile, tiles = nt.tiles;
  Tensor pw = dw ? Tensor::empty({tiles, n}, rstd.options()) : Tensor();
  Tensor pb = db ? Tensor::empty({tiles, n}, rstd.options()) : Tensor();
  cuda::with_row_vec<T>(n, {dy.raw_data(), x.raw_data()}, [&](auto vec) {
    constexpr int VEC = decltype(vec)::value;
    const int block = cuda::block_for(n / VEC);
    const dim3 grid(static_cast<unsigned>(cuda::ceil_div(n / VEC, int64_t{block})), static_cast<unsigned>(tiles));
    weight_grads_partial_kernel<T, C, VEC>
        <<<grid, block, 0, stream>>>(dy.data<T>(), x.data<T>(), mean ? mean->data<C>() : nullptr, rstd.data<C>(), rows,
                                     n, tile_rows, data_or_null<C>(&pw), data_or_null<C>(&pb));
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
  weight_grads_final_kernel<T, C><<<cuda::grid_for(n), cuda::kBlockSize, 0, stream>>>(
      data_or_null<C>(pw), data_or_null<C>(pb), tiles, n, data_or_null<T>(dw), data_or_null<T>(db));
  EMBER_CUDA_CHECK(cudaGetLastError());
}

template <typename T, typename C>
void backward(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& w, Tensor* dx,
              Tensor* dw, Tensor* db) {
  cuda::DeviceGuard guard(x);
  const int64_t rows = mean.numel(), n = x.numel() / rows;
  if (dx) {
    cuda::with_row_vec<T>(n, {dy.raw_data(), x.raw_data(), dx->raw_data(), data_or_null<T>(w)}, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      cuda::norm_rows_dx_kernel<T, C, VEC, true>
          <<<cuda::warp_rows_grid(rows), cuda::kBlockSize, 0, cuda::stream_for(x)>>>(
              dy.data<T>(), x.data<T>(), mean.data<C>(), rstd.data<C>(), data_or_null<T>(w), rows, n, dx->data<T>());
    });
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
  if (dw || db) weight_grads<T, C>(dy, x, &mean, rstd, dw, db);
}

}  // namespace

void layer_norm_forward_cuda(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                             Tensor& rstd) {
  cuda::dispatch_io(x.dtype(), [&]<typename T, typename C>() { forward<T, C>(x, w, b, eps, y, mean, rstd); });
}

void norm_weight_grads_cuda(const Tensor& dy, const Tensor& x, const Tensor* mean, const Tensor& rstd, Tensor* dw,
                            Tensor* db) {
  cuda::DeviceGuard guard(x);
  cuda::dispatch_io(x.dtype(), [&]<typename T, typename C>() { weight_grads<T, C>(dy, x, mean, rstd, dw, db); });
}

void layer_norm_backward_cuda(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                              const Tensor& w, Tensor* dx, Tensor* dw, Tensor* db) {
  cuda::dispatch_io(x.dtype(), [&]<typename T, typename C>() { backward<T, C>(dy, x, mean, rstd, w, dx, dw, db); });
}

}  // namespace ember
