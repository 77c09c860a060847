// norm_rows.cuh: the rows of the row normalisations' CUDA kernels
// (layer_norm.cu, rms_norm.cu), a warp per row. A lane holds its part of a
// chunk of the row in registers as loaded, 32 elements in vectors of VEC
// (16 bytes where the row's width and the pointers allow) at columns
// c0 + (32 i + lane) VEC: a warp's load instruction reads 512 contiguous
// bytes, and a lane's loads are independent, all in flight at once. A row
// of up to one chunk (1,024 elements, a transformer's width or less) is
// read from memory once and its passes (the sums, then the output) run on
// the registers; a wider row is read again for each pass, a chunk at a
// time. Also the tiles of the weight-gradient kernels (layer_norm.cu).
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

}  // namespace ember::cuda
