// CUDA kernels for grouped_mm with its groups given on the device
// (grouped_matmul.cc has the op and the CPU loop), and the stable counting
// sort that makes those groups (group_order). With both, a mixture of
// experts routes and runs its experts without the host reading a count, so
// a step waits for nothing and a CUDA graph can capture it (torch's
// _grouped_mm takes its offsets on the device for the same reason).
//
// The GEMM: 64 x 64 output tiles, 4 warps of 32 x 32 on mma.m16n8k16 with
// float32 accumulation, k steps of 32 double-buffered by cp.async, 16-bit
// operands whose rows are multiples of 8 elements (16-byte copies). One
// kernel serves the three products, by where the groups cut:
//   Forward  c_g [n_g, M] = a_g [n_g, K] b[g]^T    rows of a and c cut
//   Input    c_g [n_g, K] = a_g [n_g, M] b[g]      rows of a and c cut
//   Weight   c[g] [M, K]  = a_g^T b_g              the reduction cut
// A block of the first two finds its group and row tile by walking the
// offsets (the grid's x covers the most tiles any grouping can need: N / 64
// + G); a Weight block is one group's (M, K) tile and reduces over that
// group's rows, zero for an empty group. The offsets are checked on the
// device (non-decreasing, ending at N; an error names them at the next
// synchronisation) and clamped, so bad ones cannot send a copy out of range.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "core/device.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"
#include "core/ops/mma_tiles.cuh"

namespace ember {
namespace {

constexpr int BM = 64, BN = 64, BK = 32, kThreads = 128;

// Rows [r0, r0 + ROWS) and columns [c0, c0 + COLS) of a row-major matrix
// (row stride ld) into a shared tile of row stride COLS + 8, zeros past
// row_end and col_end (col_end a multiple of 8): cp.async, the caller commits.
template <int ROWS, int COLS>
__device__ __forceinline__ void load_tile(uint16_t* dst, const uint16_t* src, int64_t ld, int64_t r0, int64_t row_end,
                                          int64_t c0, int64_t col_end) {
  constexpr int kVec = COLS / 8, kStep = kThreads / kVec;
  static_assert(kThreads % kVec == 0 && ROWS % kStep == 0, "whole passes of the block");
  const int r = threadIdx.x / kVec, c = threadIdx.x % kVec * 8;
#pragma unroll
  for (int it = 0; it < ROWS / kStep; ++it) {
    const int rr = r + it * kStep;
    const int64_t row = r0 + rr, col = c0 + c;
    const bool ok = row < row_end && col < col_end;
    cuda::cp_async<16>(dst + rr * (COLS + 8) + c, ok ? src + row * ld + col : src, ok);
  }
}

struct GroupedArgs {
  const uint16_t* a;
  const uint16_t* b;
  uint16_t* c;
  const int64_t* offs;  // [G]: group g's rows end at offs[g]
  int64_t G, N;         // groups; rows of a (Weight: of a and b)
  int64_t M, K;         // b [G, M, K] (Forward, Input); a [N, M] and b [N, K] (Weight)
  DeviceErrorSlot* slot;
  int32_t code;
};

// Group g's rows [start, end), clamped into [0, N] and non-decreasing.
__device__ __forceinline__ void group_rows(const GroupedArgs& p, int64_t g, int64_t& start, int64_t& end) {
  start = g == 0 ? 0 : p.offs[g - 1];
  end = p.offs[g];
  start = start < 0 ? 0 : (start > p.N ? p.N : start);
  end = end < start ? start : (end > p.N ? p.N : end);
}

// Product: 0 Forward, 1 Input, 2 Weight (grouped_matmul.cc's Product).
template <typename T, int P>
__global__ void __launch_bounds__(kThreads) grouped_gemm_kernel(const GroupedArgs p) {
  // uint4: 16-byte aligned for cp.async and ldmatrix; each stage's tile
  // holds either orientation (BM x (BK + 8) >= BK x (BM + 8)).
  __shared__ uint4 smem_a[2][BM * (BK + 8) / 8];
  __shared__ uint4 smem_b[2][BN * (BK + 8) / 8];
  static_assert(BK * (BM + 8) <= BM * (BK + 8) && BK * (BN + 8) <= BN * (BK + 8), "either orientation fits");
  // (Pointers computed where used: an array of them indexed by the stage
  // went to local memory.)
  const auto as = [&](int buf) { return reinterpret_cast<uint16_t*>(smem_a[buf]); };
  const auto bs = [&](int buf) { return reinterpret_cast<uint16_t*>(smem_b[buf]); };
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0) {
    int64_t prev = 0;
    for (int64_t g = 0; g < p.G; ++g) {
      const int64_t end = p.offs[g];
      if (end < prev || end > p.N) cuda::record_error(p.slot, p.code, 1, end, prev, p.N + 1);
      prev = end > prev ? end : prev;
    }
    if (p.G > 0 && p.offs[p.G - 1] != p.N) cuda::record_error(p.slot, p.code, 1, p.offs[p.G - 1], p.N, p.N + 1);
  }
  // The block's group, its rows (or reduction range) and its output tile.
  int64_t g = 0, start = 0, end = 0, row0 = 0;
  // Forward and Input: row tiles along x (2^31 of them), column tiles along
  // y; Weight: column tiles along x, row tiles along y, groups along z.
  const int64_t n0 = static_cast<int64_t>(P == 2 ? blockIdx.x : blockIdx.y) * BN;
  if constexpr (P == 2) {
    g = blockIdx.z;
    group_rows(p, g, start, end);
    row0 = static_cast<int64_t>(blockIdx.y) * BM;
  } else {
    int64_t t = blockIdx.x;
    for (g = 0; g < p.G; ++g) {
      group_rows(p, g, start, end);
      const int64_t tiles = (end - start + BM - 1) / BM;
      if (t < tiles) break;
      t -= tiles;
    }
    if (g == p.G) return;  // past the last group's tiles
    row0 = start + t * BM;
  }
  const int64_t rows_c = P == 2 ? p.M : end;  // rows of c: [row0, rows_c)
  const int64_t cols_c = P == 0 ? p.M : p.K;
  const int64_t red = P == 0 ? p.K : (P == 1 ? p.M : end - start);
  const uint16_t* bg = P == 2 ? p.b : p.b + g * p.M * p.K;
  const int64_t steps = (red + BK - 1) / BK;
  const auto load = [&](int64_t s, int buf) {
    const int64_t k0 = s * BK;
    if constexpr (P == 0) {
      load_tile<BM, BK>(as(buf), p.a, p.K, row0, end, k0, p.K);
      load_tile<BN, BK>(bs(buf), bg, p.K, n0, p.M, k0, p.K);
    } else if constexpr (P == 1) {
      load_tile<BM, BK>(as(buf), p.a, p.M, row0, end, k0, p.M);
      load_tile<BK, BN>(bs(buf), bg, p.K, k0, p.M, n0, p.K);
    } else {
      load_tile<BK, BM>(as(buf), p.a, p.M, start + k0, end, row0, p.M);
      load_tile<BK, BN>(bs(buf), p.b, p.K, start + k0, end, n0, p.K);
    }
    cuda::cp_async_commit();
  };
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wm = warp % 2 * 32, wn = warp / 2 * 32;
  float acc[2][4][4] = {};
  if (steps > 0) load(0, 0);
  for (int64_t s = 0; s < steps; ++s) {
    const int buf = static_cast<int>(s % 2);
    cuda::cp_async_wait_all();
    __syncthreads();  // step s is in; every warp is done with step s - 1's buffer
    if (s + 1 < steps) load(s + 1, buf ^ 1);
    if constexpr (P == 2) {
      cuda::warp_mma<T, BK / 16, true>(
          acc,
          [&](int kk, int mt, uint32_t f[4]) { cuda::frag_a_cols(as(buf), BM + 8, wm + mt * 16, kk * 16, lane, f); },
          bs(buf) + wn, BN + 8, lane);
    } else {
      const auto a_frag = [&](int kk, int mt, uint32_t f[4]) {
        cuda::frag_a(as(buf), BK + 8, wm + mt * 16, kk * 16, lane, f);
      };
      if constexpr (P == 0)
        cuda::warp_mma<T, BK / 16, false>(acc, a_frag, bs(buf) + wn * (BK + 8), BK + 8, lane);
      else
        cuda::warp_mma<T, BK / 16, true>(acc, a_frag, bs(buf) + wn, BN + 8, lane);
    }
  }
  cuda::cp_async_wait_all();
  // c's rows: the group's (Forward, Input) or group g's [M, K] block (Weight).
  uint16_t* cg = P == 2 ? p.c + g * p.M * p.K : p.c;
  const int gq = lane / 4, tq = lane % 4;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row0 + wm + mt * 16 + gq + 8 * h;
      if (row >= rows_c) continue;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int64_t col = n0 + wn + nt * 8 + 2 * tq;  // even, and cols_c a multiple of 8: col + 1 too
        if (col < cols_c)
          *reinterpret_cast<uint32_t*>(cg + row * cols_c + col) =
              cuda::pack16<T>(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
      }
    }
}

// group_order's counting sort in one block: for each group in turn, every
// thread counts its slice's ids of that group, a block scan gives each
// slice its first position, and the slice's items take the next positions
// in item order, so ties keep (row, choice) order. G passes over the ids:
// a dispatch's few groups and tens of thousands of items.
constexpr int kOrderThreads = 256;

__global__ void __launch_bounds__(kOrderThreads)
    group_order_kernel(const int64_t* ids, int64_t items, int64_t k, int64_t G, int64_t* rows, int64_t* positions,
                       int64_t* offsets, DeviceErrorSlot* slot, int32_t code) {
  __shared__ int64_t scan[kOrderThreads];
  const int tid = threadIdx.x;
  const int64_t per = (items + kOrderThreads - 1) / kOrderThreads;
  const int64_t lo = tid * per < items ? tid * per : items, hi = lo + per < items ? lo + per : items;
  // An id out of range is named (at the next synchronisation) and counted
  // in the last group, so every item still gets a position.
  const auto id_of = [&](int64_t i) {
    const int64_t e = ids[i];
    if (e < 0 || e >= G) {
      cuda::record_error(slot, code, 1, e, 0, G);
      return G - 1;
    }
    return e;
  };
  int64_t base = 0;
  for (int64_t e = 0; e < G; ++e) {
    int64_t mine = 0;
    for (int64_t i = lo; i < hi; ++i) mine += id_of(i) == e;
    scan[tid] = mine;
    __syncthreads();
    for (int d = 1; d < kOrderThreads; d *= 2) {  // inclusive scan (Hillis-Steele)
      const int64_t add = tid >= d ? scan[tid - d] : 0;
      __syncthreads();
      scan[tid] += add;
      __syncthreads();
    }
    int64_t at = base + scan[tid] - mine;
    for (int64_t i = lo; i < hi; ++i)
      if (id_of(i) == e) positions[i] = at, rows[at] = i / k, ++at;
    base += scan[kOrderThreads - 1];
    if (tid == 0) offsets[e] = base;
    __syncthreads();  // scan is read before the next group's counts overwrite it
  }
}

}  // namespace

void grouped_gemm_offsets_cuda(int product, const Tensor& a, const Tensor& b, const Tensor& offsets, Tensor& out) {
  cuda::DeviceGuard guard(a);
  cudaStream_t stream = cuda::stream_for(a);
  const int device = a.device().index;
  GroupedArgs p{};
  p.a = static_cast<const uint16_t*>(a.raw_data());
  p.b = static_cast<const uint16_t*>(b.raw_data());
  p.c = static_cast<uint16_t*>(out.raw_data());
  p.offs = offsets.data<int64_t>();
  p.G = offsets.numel();
  p.N = a.size(0);
  p.M = product == 2 ? a.size(1) : b.size(1);
  p.K = product == 2 ? b.size(1) : b.size(2);
  p.slot = cuda_error_slot(device);
  p.code = cuda_error_op_code("grouped_mm (group offsets)");
  const int64_t cols = product == 0 ? p.M : p.K, col_tiles = cuda::ceil_div(cols, BN);
  EMBER_CHECK(col_tiles <= 65535 && (product != 2 || (cuda::ceil_div(p.M, BM) <= 65535 && p.G <= 65535)),
              "grouped_mm: ", p.G, " groups of [", p.M, ", ", p.K, "] weights exceed the grouped kernel's grid");
  dim3 grid;
  if (product == 2)
    grid = dim3(static_cast<unsigned>(col_tiles), static_cast<unsigned>(cuda::ceil_div(p.M, BM)),
                static_cast<unsigned>(p.G));
  else  // the most row tiles a grouping of N rows into G groups needs
    grid = dim3(static_cast<unsigned>(cuda::ceil_div(p.N, BM) + p.G), static_cast<unsigned>(col_tiles), 1);
  const auto launch = [&](auto t) {
    using T = decltype(t);
    if (product == 0) grouped_gemm_kernel<T, 0><<<grid, kThreads, 0, stream>>>(p);
    if (product == 1) grouped_gemm_kernel<T, 1><<<grid, kThreads, 0, stream>>>(p);
    if (product == 2) grouped_gemm_kernel<T, 2><<<grid, kThreads, 0, stream>>>(p);
  };
  if (a.dtype() == DType::BFloat16)
    launch(BFloat16{});
  else
    launch(Half{});
  EMBER_CUDA_CHECK(cudaGetLastError());
  cuda::maybe_check_now(device, stream);
}

void group_order_cuda(const Tensor& ids, int64_t groups, Tensor& rows, Tensor& positions, Tensor& offsets) {
  cuda::DeviceGuard guard(ids);
  cudaStream_t stream = cuda::stream_for(ids);
  const int device = ids.device().index;
  group_order_kernel<<<1, kOrderThreads, 0, stream>>>(
      ids.data<int64_t>(), ids.numel(), ids.size(1), groups, rows.data<int64_t>(), positions.data<int64_t>(),
      offsets.data<int64_t>(), cuda_error_slot(device), cuda_error_op_code("group_order"));
  EMBER_CUDA_CHECK(cudaGetLastError());
  cuda::maybe_check_now(device, stream);
}

}  // namespace ember
