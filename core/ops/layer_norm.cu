// CUDA kernels of layer_norm (layer_norm.cc has the op, the math and the CPU
// reference). 16-bit tensors are read and written in their own dtype and
// computed in float32 (no float32 copies around the kernels). Forward and dx: a warp per row (a transformer's rows are
// a few hundred to a few thousand wide) in 16-byte loads, held in registers between its passes up to 1,024 columns
// (norm_rows.cuh), the row's sums reduced with shuffles.
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

constexpr int kWarp = cuda::kWarpSize;

// T: the tensors' dtype (16-bit read and written as they are), C: the
// compute and statistics dtype (float32, or float64 for float64), VEC: the
// elements a load moves (norm_rows.cuh). The mean, then the sum of squared
// deviations from it (two passes, as the CPU's), then the output.
template <typename T, typename C, int VEC>
__global__ void forward_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, C eps,
                               int64_t rows, int64_t n, T* __restrict__ y, C* __restrict__ mean, C* __restrict__ rstd) {
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
      for (int e = 0; e < VEC; ++e) s += xs.template at<C>(i, e);
    });
  }
  const C mu = cuda::warp_sum(s) / static_cast<C>(n);
  C v = 0;
  for (int64_t c0 = 0; c0 < n; c0 += Chunk::kCols) {
    if (!one) xs.load(xr, n, c0, lane);
    Chunk::each(n, c0, lane, [&](int i, int64_t) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const C d = xs.template at<C>(i, e) - mu;
        v += d * d;
      }
    });
  }
  const C rs = C(1) / sqrt(cuda::warp_sum(v) / static_cast<C>(n) + eps);
  if (lane == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
  T* yr = y + r * n;
  for (int64_t c0 = 0; c0 < n; c0 += Chunk::kCols) {
    if (!one) xs.load(xr, n, c0, lane);
    Chunk::each(n, c0, lane, [&](int i, int64_t j) {
      cuda::VecN<T, VEC> wv, bv, out;
      if (w) wv = cuda::load_vec<T, VEC>(w + j);
      if (b) bv = cuda::load_vec<T, VEC>(b + j);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        C t = (xs.template at<C>(i, e) - mu) * rs;
        if (w) t *= static_cast<C>(wv.v[e]);
        if (b) t += static_cast<C>(bv.v[e]);
        out.v[e] = static_cast<T>(t);
      }
      cuda::store_vec<T, VEC>(yr + j, out);
    });
  }
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy w, xhat = (x - mean) rstd.
template <typename T, typename C, int VEC>
__global__ void dx_kernel(const T* __restrict__ dy, const T* __restrict__ x, const C* __restrict__ mean,
                          const C* __restrict__ rstd, const T* __restrict__ w, int64_t rows, int64_t n,
                          T* __restrict__ dx) {
  using Chunk = cuda::RowChunk<T, VEC>;
  const int64_t r = cuda::global_thread_id() / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const T *dyr = dy + r * n, *xr = x + r * n;
  const C m = mean[r], rs = rstd[r];
  const bool one = n <= Chunk::kCols;
  Chunk dys, xs;
  // f(i, j, g, xhat) for each element of the lane's vectors of the chunk at c0.
  const auto each = [&](int64_t c0, auto&& f) {
    Chunk::each(n, c0, lane, [&](int i, int64_t j) {
      cuda::VecN<T, VEC> wv;
      if (w) wv = cuda::load_vec<T, VEC>(w + j);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        C g = dys.template at<C>(i, e);
        if (w) g *= static_cast<C>(wv.v[e]);
        f(i, e, g, (xs.template at<C>(i, e) - m) * rs);
      }
    });
  };
  C a = 0, c = 0;
  for (int64_t c0 = 0; c0 < n; c0 += Chunk::kCols) {
    dys.load(dyr, n, c0, lane);
    xs.load(xr, n, c0, lane);
    each(c0, [&](int, int, C g, C xh) {
      a += g;
      c += g * xh;
    });
  }
  const C ma = cuda::warp_sum(a) / static_cast<C>(n), mc = cuda::warp_sum(c) / static_cast<C>(n);
  T* dxr = dx + r * n;
  for (int64_t c0 = 0; c0 < n; c0 += Chunk::kCols) {
    if (!one) {
      dys.load(dyr, n, c0, lane);
      xs.load(xr, n, c0, lane);
    }
    cuda::VecN<T, VEC> out[Chunk::NV];
    each(c0, [&](int i, int e, C g, C xh) { out[i].v[e] = static_cast<T>(rs * (g - ma - xh * mc)); });
    Chunk::each(n, c0, lane, [&](int i, int64_t j) { cuda::store_vec<T, VEC>(dxr + j, out[i]); });
  }
}

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
    forward_kernel<T, C, VEC><<<cuda::warp_rows_grid(rows), cuda::kBlockSize, 0, cuda::stream_for(x)>>>(
        x.data<T>(), data_or_null<T>(w), data_or_null<T>(b), static_cast<C>(eps), rows, n, y.data<T>(), mean.data<C>(),
        rstd.data<C>());
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
  cudaStream_t stream = cuda::stream_for(x);
  const int64_t rows = mean.numel(), n = x.numel() / rows;
  if (dx) {
    cuda::with_row_vec<T>(n, {dy.raw_data(), x.raw_data(), dx->raw_data(), data_or_null<T>(w)}, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      dx_kernel<T, C, VEC><<<cuda::warp_rows_grid(rows), cuda::kBlockSize, 0, stream>>>(
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
