// What attention's two CUDA files share (attention.cu, the blocked kernels
// for float32 and float64; attention_flash.cu, the fused ones for 16-bit
// inputs): where an operand's rows lie, the dropout mask's draw, and the
// backward's per-row delta.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"
#include "core/ops/philox.h"

namespace ember::attention_cuda {

constexpr int kWarp = cuda::kWarpSize;
constexpr int kRowsPerBlock = cuda::kBlockSize / kWarp;

// Where the rows of a [n, t, d] operand lie: head b (b < n, in the order of
// the view's leading dims) starts at element b / (h1 h2) s0 + b / h2 % h1 s1
// + b % h2 s2 and its rows are `row` apart. The fused kernels read and write
// views where they lie: the heads [B, H, T, D] of a packed projection
// [B, T, 3, H, D] (rows 3 H D apart), an output laid out [B, T, H, D], keys
// expanded over their query heads [B, Hkv, groups, T, D] (s2 = 0), as
// FlashAttention-2 does, instead of copying each into [n, t, d] first.
// Head b's index along the leading dims [N, h1, h2], which every operand of
// one call shares (their shapes agree), so a kernel divides once for all.
struct HeadIndex {
  int64_t i0;
  int i1, i2;
};
struct Rows {
  int64_t s0 = 0, s1 = 0, s2 = 0;
  int h1 = 1, h2 = 1, row = 0;
  // In 32 bits where there are heads to divide by (the fused kernels' n is
  // at most 65535): a 64-bit division is a routine of about 70 instructions.
  __host__ __device__ __forceinline__ HeadIndex index(int64_t b) const {
    if (h1 * h2 == 1) return {b, 0, 0};
    const int i = static_cast<int>(b);
    return {i / (h1 * h2), i / h2 % h1, i % h2};
  }
  __host__ __device__ __forceinline__ int64_t at(HeadIndex h) const { return h.i0 * s0 + h.i1 * s1 + h.i2 * s2; }
  bool same_heads(const Rows& o) const { return h1 == o.h1 && h2 == o.h2; }
};

// Whether dropout keeps element (b, i, j): the CPU's Philox draw at its
// index in a [n, tq, tk] tensor (the blocked and the fused kernels alike).
// Inside a CUDA graph the generator's state is read on the device (a.rng).
__device__ __forceinline__ bool kept(const AttentionArgs& a, int64_t b, int64_t i, int64_t j) {
  const int64_t idx = (b * a.tq + i) * a.tk + j;
  const uint64_t seed = a.rng ? a.rng[0] : a.seed, offset = a.rng ? a.rng[1] + a.offset : a.offset;
  return random_value(RandomKind::Bernoulli, idx, 0, 0, 1.0 - a.dropout_p, seed, offset) != 0.0;
}

// delta_i = dO_i . O_i - dlse_i for each of the n t rows of d elements (a
// warp a row; out's and dout's rows where ro and rd say), summed in Acc:
// the blocked kernels' (In = Acc) and the fused ones' (16-bit rows, float32
// sums). dlse may be null.
template <typename In, typename Acc>
__global__ void delta_kernel(int64_t rows, int64_t t, int64_t d, const In* __restrict__ out, Rows ro,
                             const In* __restrict__ dout, Rows rd, const Acc* __restrict__ dlse,
                             Acc* __restrict__ delta) {
  const int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (w >= rows) return;
  const HeadIndex h = ro.index(w / t);
  const In* o = out + ro.at(h) + w % t * ro.row;
  const In* g = dout + rd.at(h) + w % t * rd.row;
  Acc acc = 0;
  for (int64_t e = lane; e < d; e += kWarp) acc += static_cast<Acc>(o[e]) * static_cast<Acc>(g[e]);
  acc = cuda::warp_sum(acc);
  if (lane == 0) delta[w] = dlse ? acc - dlse[w] : acc;
}

inline unsigned warp_grid(int64_t warps) { return static_cast<unsigned>(cuda::ceil_div(warps, kRowsPerBlock)); }

}  // namespace ember::attention_cuda
