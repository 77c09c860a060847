// norm_rows.cuh: the row normalisations' CUDA kernels (layer_norm.cu,
// rms_norm.cu), a warp per row. A lane holds its part of a chunk of the row
// in registers as loaded, 32 elements in vectors of VEC (16 bytes where the
// row's width and the pointers allow) at columns c0 + (32 i + lane) VEC: a
// warp's load instruction reads 512 contiguous bytes, and a lane's loads
// are independent, all in flight at once. A row of up to one chunk (1,024
// elements, a transformer's width or less) is read from memory once and its
// passes (the sums, then the output) run on the registers; a wider row is
// read again for each pass, a chunk at a time. The forward and input
// gradient kernels serve both norms: RMSNorm is layer norm with no mean
// (kMean false: the mean square, xhat = x rstd), so one kernel each, not
// two copies (the launches are the .cu files': cu2emu.py rewrites the
// launches of a .cu, not of its headers). Also the tiles of the
// weight-gradient kernels (layer_norm.cu).
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/ops/cuda_utils.cuh"

namespace ember::cuda {

// Blocks of warps, a warp a row.
inline unsigned warp_rows_grid(int64_t rows) { return static_cast<unsigned>(ceil_div(rows, kBlockSize / kWarpSize)); }
// The weight's (and the bias's) gradient: per-column partial sums over
// tiles of kNormTileRows rows (more where the tiles would pass grid.y's
// 65,535) that a second kernel adds in tile order (deterministic, no
// atomics). 32 rows: a GPT's 8,192 rows make 256 tiles of blocks, enough
// loads in flight to read dy and x at the memory's rate (128-row tiles
// made 64).
constexpr int64_t kNormTileRows = 32;
struct NormTiles {
  int64_t rows_per_tile, tiles;
  explicit NormTiles(int64_t rows)
      : rows_per_tile(std::max(kNormTileRows, ceil_div(rows, int64_t{65535}))), tiles(ceil_div(rows, rows_per_tile)) {}
};

template <typename T, int VEC>
__device__ __forceinline__ VecN<T, VEC> load_vec(const T* p) {
  return *reinterpret_cast<const VecN<T, VEC>*>(p);
}
template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* p, const VecN<T, VEC>& v) {
  *reinterpret_cast<VecN<T, VEC>*>(p) = v;
}

template <typename T, int VEC>
struct RowChunk {
  // Elements a lane holds: 32 in vectors (a chunk of 1,024 columns), 16
  // for float64; one at a time (rows of a width the vectors do not divide,
  // or misaligned), 8: the chunk's 256 columns are read again each pass,
  // and nvcc kept 32 elements' addresses and values in over 200 registers.
  static constexpr int kElems = VEC == 1 ? 8 : sizeof(T) > 4 ? 16 : 32;
  static constexpr int NV = kElems / VEC;
  static constexpr int64_t kCols = int64_t{kElems} * kWarpSize;
  static_assert(kElems % VEC == 0, "whole vectors a lane");
  // As loaded: 16-bit elements take half the registers of their float32
  // values, so more warps fit an SM (each pass converts again, one
  // instruction an element).
  VecN<T, VEC> v[NV];

  template <typename C>
  __device__ __forceinline__ C at(int i, int e) const {
    return static_cast<C>(v[i].v[e]);
  }
  // f(i, j) for each of the lane's vectors i inside the row, j its first
  // column (n is a multiple of VEC: a vector lies in the row or past it).
  template <typename F>
  __device__ __forceinline__ static void each(int64_t n, int64_t c0, int lane, F&& f) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t j = c0 + (static_cast<int64_t>(i) * kWarpSize + lane) * VEC;
      if (j < n) f(i, j);
    }
  }
  // The lane's part of row[c0, c0 + kCols): every load issued before any is used.
  __device__ __forceinline__ void load(const T* __restrict__ row, int64_t n, int64_t c0, int lane) {
    each(n, c0, lane, [&](int i, int64_t j) { v[i] = load_vec<T, VEC>(row + j); });
  }
};

// Launches with the 16-byte vector width of T where the row width is a
// multiple of it and every given pointer is aligned for it, else 1:
// launch(std::integral_constant<int, VEC>).
template <typename T, typename F>
void with_row_vec(int64_t n, std::initializer_list<const void*> ptrs, const F& launch) {
  with_vec_width<T>(
      n, ptrs, [&](auto vec, unsigned) { launch(vec); }, n % vec_width<T>() == 0);
}

// T: the tensors' dtype (16-bit read and written as they are), C: the
// compute and statistics dtype (float32, or float64 for float64), VEC: the
// elements a load moves, kMean: layer_norm's (the mean, then the sum of
// squared deviations from it: two passes, as the CPU's) or rms_norm's (the
// sum of squares; no mean written, b null).
template <typename T, typename C, int VEC, bool kMean>
__global__ void norm_rows_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                                         C eps, int64_t rows, int64_t n, T* __restrict__ y, C* __restrict__ mean,
                                         C* __restrict__ rstd) {
  using Chunk = RowChunk<T, VEC>;
  const int64_t r = global_thread_id() / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (r >= rows) return;  // whole warps: blockDim is a multiple of 32
  const T* xr = x + r * n;
  const bool one = n <= Chunk::kCols;  // the row stays in xs between passes
  Chunk xs;
  C mu = 0;
  if constexpr (kMean) {
    C s = 0;
    for (int64_t c0 = 0; c0 < n; c0 += Chunk::kCols) {
      xs.load(xr, n, c0, lane);
      Chunk::each(n, c0, lane, [&](int i, int64_t) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) s += xs.template at<C>(i, e);
      });
    }
    mu = warp_sum(s) / static_cast<C>(n);
  }
  C v = 0;
  for (int64_t c0 = 0; c0 < n; c0 += Chunk::kCols) {
    if (!kMean || !one) xs.load(xr, n, c0, lane);
    Chunk::each(n, c0, lane, [&](int i, int64_t) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const C d = kMean ? xs.template at<C>(i, e) - mu : xs.template at<C>(i, e);
        v += d * d;
      }
    });
  }
  const C rs = C(1) / sqrt(warp_sum(v) / static_cast<C>(n) + eps);
  if (lane == 0) {
    if constexpr (kMean) mean[r] = mu;
    rstd[r] = rs;
  }
  T* yr = y + r * n;
  for (int64_t c0 = 0; c0 < n; c0 += Chunk::kCols) {
    if (!one) xs.load(xr, n, c0, lane);
    Chunk::each(n, c0, lane, [&](int i, int64_t j) {
      VecN<T, VEC> wv, bv, out;
      if (w) wv = load_vec<T, VEC>(w + j);
      if (kMean && b) bv = load_vec<T, VEC>(b + j);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        C t = (kMean ? xs.template at<C>(i, e) - mu : xs.template at<C>(i, e)) * rs;
        if (w) t *= static_cast<C>(wv.v[e]);
        if (kMean && b) t += static_cast<C>(bv.v[e]);
        out.v[e] = static_cast<T>(t);
      }
      store_vec<T, VEC>(yr + j, out);
    });
  }
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy w, xhat = (x - mean)
// rstd; with no mean (rms_norm): rstd (g - xhat mean(g xhat)), xhat = x rstd.
template <typename T, typename C, int VEC, bool kMean>
__global__ void norm_rows_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x, const C* __restrict__ mean,
                                    const C* __restrict__ rstd, const T* __restrict__ w, int64_t rows, int64_t n,
                                    T* __restrict__ dx) {
  using Chunk = RowChunk<T, VEC>;
  const int64_t r = global_thread_id() / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (r >= rows) return;
  const T *dyr = dy + r * n, *xr = x + r * n;
  const C m = kMean ? mean[r] : C(0), rs = rstd[r];
  const bool one = n <= Chunk::kCols;
  Chunk dys, xs;
  // f(i, e, g, xhat) for each element of the lane's vectors of the chunk at c0.
  const auto each = [&](int64_t c0, auto&& f) {
    Chunk::each(n, c0, lane, [&](int i, int64_t j) {
      VecN<T, VEC> wv;
      if (w) wv = load_vec<T, VEC>(w + j);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        C g = dys.template at<C>(i, e);
        if (w) g *= static_cast<C>(wv.v[e]);
        f(i, e, g, (kMean ? xs.template at<C>(i, e) - m : xs.template at<C>(i, e)) * rs);
      }
    });
  };
  C a = 0, c = 0;
  for (int64_t c0 = 0; c0 < n; c0 += Chunk::kCols) {
    dys.load(dyr, n, c0, lane);
    xs.load(xr, n, c0, lane);
    each(c0, [&](int, int, C g, C xh) {
      if constexpr (kMean) a += g;
      c += g * xh;
    });
  }
  const C ma = kMean ? warp_sum(a) / static_cast<C>(n) : C(0), mc = warp_sum(c) / static_cast<C>(n);
  T* dxr = dx + r * n;
  for (int64_t c0 = 0; c0 < n; c0 += Chunk::kCols) {
    if (!one) {
      dys.load(dyr, n, c0, lane);
      xs.load(xr, n, c0, lane);
    }
    VecN<T, VEC> out[Chunk::NV];
    each(c0, [&](int i, int e, C g, C xh) {
      out[i].v[e] = static_cast<T>(kMean ? rs * (g - ma - xh * mc) : rs * (g - xh * mc));
    });
    Chunk::each(n, c0, lane, [&](int i, int64_t j) { store_vec<T, VEC>(dxr + j, out[i]); });
  }
}

}  // namespace ember::cuda
