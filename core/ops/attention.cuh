// What attention's CUDA kernels share (attention.cu, the blocked kernels for
// float64 and what the fused ones do not take; attention_flash.cu, the fused
// ones for 16-bit inputs; attention_tf32.cu, the fused ones for float32):
// where an operand's rows lie, the dropout mask's draw, the backward's
// per-row delta, and the fused kernels' tile loads and row reductions.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <mutex>

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

// Dropout keeps element (b, i, j) as bernoulli(1 - p) fills a [n, tq, tk]
// tensor: the Philox word of index (b tq + i) tk + j (philox.h's
// bernoulli_word) below the threshold of 1 - p. A fused kernel reads it
// once (dropout_of): inside a CUDA graph the generator's state is on the
// device (a.rng), and reading it where each mask is drawn was a global load
// an n-tile (the blocked kernels' kept() still reads it an element).
struct Dropout {
  float scale = 1.f;  // 1 / (1 - p) with dropout, else 1
  uint64_t seed = 0, offset = 0;
  // keep_threshold(1 - p) - 1, the largest word kept: 1 - p > 0 puts the
  // threshold in [1, 2^32], so a 32-bit compare where 64 bits took two.
  uint32_t last = 0;
  // Philox's four words at the index of (b, i, j), j a multiple of 4 and tk
  // too, as bits: bit w for key j + w.
  __device__ __forceinline__ uint32_t group(const AttentionArgs& a, int64_t b, int64_t i, int64_t j) const {
    const Philox4 r = philox4x32_10(static_cast<uint64_t>((b * a.tq + i) * a.tk + j) / 4, offset, seed);
    uint32_t bits = 0;
#pragma unroll
    for (int w = 0; w < 4; ++w) bits |= static_cast<uint32_t>(r.v[w] <= last) << w;
    return bits;
  }
  __device__ __forceinline__ bool kept(const AttentionArgs& a, int64_t b, int64_t i, int64_t j) const {
    return bernoulli_word((b * a.tq + i) * a.tk + j, seed, offset) <= last;
  }
};
template <bool Drop>
__device__ __forceinline__ Dropout dropout_of(const AttentionArgs& a) {
  Dropout d;
  if constexpr (Drop) {
    d.scale = static_cast<float>(1.0 / (1.0 - a.dropout_p));
    d.seed = a.rng ? a.rng[0] : a.seed;
    d.offset = a.rng ? a.rng[1] + a.offset : a.offset;
    d.last = static_cast<uint32_t>(keep_threshold(1.0 - a.dropout_p) - 1);
  }
  return d;
}
// The blocked kernels' draw, an element at a time.
__device__ __forceinline__ bool kept(const AttentionArgs& a, int64_t b, int64_t i, int64_t j) {
  return dropout_of<true>(a).kept(a, b, i, j);
}
// The keep bits of a lane's four elements of an 8-column tile in the mma
// accumulator layout (lane 4 g + t): rows i and i + 8 (i the lane's row g),
// keys j and j + 1 (j = the tile's first key, a multiple of 8, + 2 t); bit
// 2 h + x for row i + 8 h, key j + x. A row's four keys from a multiple of
// 4 share one Philox call when tk is a multiple of 4: lanes t and t ^ 1
// hold its halves, so each draws the group of one of the two rows and the
// pair trades the other's halves by a shuffle, one call for four elements
// where kept() takes one an element. Every lane of the warp calls it.
__device__ __forceinline__ uint32_t keep_bits(const AttentionArgs& a, const Dropout& d, int64_t b, int64_t i, int64_t j,
                                              int t) {
  if (a.tk % 4 != 0) {
    uint32_t bits = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) bits |= static_cast<uint32_t>(d.kept(a, b, i + 8 * (e / 2), j + e % 2)) << e;
    return bits;
  }
  const int h = t & 1;  // the row this lane draws; its partner draws the other
  const uint32_t own = d.group(a, b, i + 8 * h, j - 2 * h);
  // The pair's keys are words 0, 1 (t even) and 2, 3 (t odd) of each group.
  const uint32_t mine = own >> (2 * h) & 3u, other = __shfl_xor_sync(0xffffffffu, own >> (2 - 2 * h) & 3u, 1);
  return h ? other | mine << 2 : mine | other << 2;
}
// The same for a transposed tile (rows keys, columns queries: the float32
// backward's S^T): the lane's keys j and j + 8 (j the lane's key g, the
// tile's first key a multiple of 8), queries i and i + 1 (i = the first
// query + 2 t); bit 2 h + x for key j + 8 h, query i + x. A query's four
// keys lie in the four lanes g % 4 = 0..3 of a t; lane c = g % 4 draws the
// group of query i + c % 2, keys from j - c + 8 (c / 2), and three
// shuffles bring each lane its key's bit of the other three groups.
__device__ __forceinline__ uint32_t keep_bits_t(const AttentionArgs& a, const Dropout& d, int64_t b, int64_t i,
                                                int64_t j, int g) {
  if (a.tk % 4 != 0) {
    uint32_t bits = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) bits |= static_cast<uint32_t>(d.kept(a, b, i + e % 2, j + 8 * (e / 2))) << e;
    return bits;
  }
  const int c = g % 4;
  const uint32_t own = d.group(a, b, i + c % 2, j - c + 8 * (c / 2));
  uint32_t bits = (own >> c & 1u) << c;
#pragma unroll
  for (int m = 1; m < 4; ++m) bits |= (__shfl_xor_sync(0xffffffffu, own, 4 * m) >> c & 1u) << (c ^ m);
  return bits;
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

// ---- The fused kernels' (attention_flash.cu, attention_tf32.cu) ----

// Kernels needing more than 48 KiB of shared memory must opt in, per device,
// to the most they are launched with (the backward's size depends on its
// stages).
template <auto Kernel>
inline void allow_smem(size_t smem, int device) {
  static std::atomic<size_t> allowed[64] = {};
  std::atomic<size_t>& slot = allowed[device % 64];
  if (smem <= 48 * 1024 || smem <= slot.load()) return;
  static std::mutex mu;  // so that a smaller size set later never undoes a larger one
  std::lock_guard<std::mutex> lock(mu);
  if (smem <= slot.load()) return;
  EMBER_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(Kernel),
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  slot.store(smem);
}

constexpr int kFlashThreads = 128;  // a forward block's threads
constexpr float kLog2e = 1.4426950408889634f;

// Rows [r0, r0 + N) of a [t, D] matrix whose rows lie `row` elements apart
// into a shared tile of row stride D + 8 (the padding puts ldmatrix's eight
// rows on distinct banks), zeros past row t, by cp.async from a block of
// Threads threads: the caller commits and waits. Each thread copies one
// 16-byte column of rows Threads / (D / 8) apart, so the loop unrolls into
// copies at constant multiples of the row stride from one address (a loop
// over threadIdx.x-dependent trip counts compiled to a branchy loop with
// 64-bit index arithmetic per piece).
template <int D, int N, int Threads = kFlashThreads>
__device__ __forceinline__ void load_tile(const uint16_t* __restrict__ src, int row, int r0, int t, uint16_t* dst) {
  constexpr int kVec = D / 8, kStep = Threads / kVec;  // 16-byte pieces a row; rows a pass
  static_assert(Threads % kVec == 0 && N % kStep == 0, "load_tile: whole passes of the block");
  const int r = threadIdx.x / kVec, c = threadIdx.x % kVec * 8;
  const int left = t - r0 < N ? t - r0 : N;  // rows in range
  const uint16_t* from = src + (r0 + r) * row + c;
  const int step = kStep * row;
  dst += r * (D + 8) + c;
  if (left == N) {  // the whole tile, as every tile but a matrix's last: no tests
#pragma unroll
    for (int it = 0; it < N / kStep; ++it) cuda::cp_async<16>(dst + it * kStep * (D + 8), from + it * step, true);
    return;
  }
#pragma unroll
  for (int it = 0; it < N / kStep; ++it) {
    const bool ok = r + it * kStep < left;
    cuda::cp_async<16>(dst + it * kStep * (D + 8), ok ? from + it * step : src, ok);
  }
}

// The same for a float32 matrix, into a tile of row stride D + 4 floats:
// its 16-bit view, rows of 2 D elements.
template <int D, int N, int Threads = kFlashThreads>
__device__ __forceinline__ void load_tile(const float* __restrict__ src, int row, int r0, int t, float* dst) {
  load_tile<2 * D, N, Threads>(reinterpret_cast<const uint16_t*>(src), 2 * row, r0, t,
                               reinterpret_cast<uint16_t*>(dst));
}

// This block's query block. Under a causal mask a query block's work grows
// with its index (it reads the keys up to its last row), so the grid runs
// them heaviest first: GPUs hand out blocks in the order of their index, and
// the longest-first order leaves the shortest blocks for the end, where
// they fill the SMs that finish early, instead of the longest blocks of the
// last heads running alone (a tail of up to one whole block's time). The
// backward's key blocks are heaviest first already (key block 0 meets
// every query).
__device__ __forceinline__ int64_t query_block(bool causal) { return causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x; }

// A forward block's start, both fused forwards' (E: uint16_t or float): the
// query rows [i0, i0 + BR) it owns, its head, how many keys it reads (kend:
// through its last row when causal), and q's tile and k's first on their
// way into qs and ks (committed; the loop's first wait takes them). Row and
// key indices in 32 bits (attention_flash_cuda_supports: tq and tk, plus a
// tile, times D below 2^31): 64-bit ones took registers the loop spilled.
template <typename E>
struct ForwardBlock {
  int tq, tk, i0, kend;
  int64_t b;
  HeadIndex hb;  // every operand's (the launcher checks that their heads agree)
  const E* kb;   // this head's keys and values
  const E* vb;
  // Scores stay unscaled until the exponent, exp2(s sl - m sl) with sl the
  // scale in log2 units: one FFMA and one MUFU a score (scale > 0, so the
  // maximum of the unscaled scores is the scaled ones').
  float sl;
  Dropout drop;
};
template <int D, int BR, int KEYS, bool Drop, typename E>
__device__ __forceinline__ ForwardBlock<E> forward_block(const AttentionArgs& a, const E* q, const Rows& rq, const E* k,
                                                         const Rows& rk, const E* v, const Rows& rv, E* qs, E* ks) {
  ForwardBlock<E> f;
  f.tq = static_cast<int>(a.tq), f.tk = static_cast<int>(a.tk);
  f.b = blockIdx.y;
  f.i0 = static_cast<int>(query_block(a.causal)) * BR;
  f.hb = rq.index(f.b);
  f.kb = k + rk.at(f.hb);
  f.vb = v + rv.at(f.hb);
  load_tile<D, BR>(q + rq.at(f.hb), rq.row, f.i0, f.tq, qs);
  load_tile<D, KEYS>(f.kb, rk.row, 0, f.tk, ks);
  cuda::cp_async_commit();
  f.sl = static_cast<float>(a.scale) * kLog2e;
  f.drop = dropout_of<Drop>(a);
  const int last = (f.i0 + BR < f.tq ? f.i0 + BR : f.tq) - 1;
  f.kend = a.causal && last + 1 < f.tk ? last + 1 : f.tk;
  return f;
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// The forwards' softmax over one warp's 16-row tile, shared by the 16-bit
// and the float32 kernels. Scores lie in the accumulators' layout: lane
// (g, t)'s element e of n-tile nt is key nt 8 + 2t + e % 2 of row
// g + 8 (e / 2).
//
// Scores of keys past the tile's end (key >= keys_left) or, causal, after
// their row (key > row + diag, rows counted from the warp's first, this
// tile's from r0) set to -inf, in the tile's 32-bit coordinates: only tiles on the diagonal or at the last key call
// this (a branch a tile; the test predicated into every score of every tile cost 270 of the 1,470 instructions of a d
// 128 tile).
template <int NT>
__device__ __forceinline__ void mask_scores(float (&s)[NT][4], int keys_left, int diag, int r0, int g, int t) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int jl = nt * 8 + 2 * t + e % 2, il = r0 + g + 8 * (e / 2);
      if (jl >= keys_left || jl > il + diag) s[nt][e] = -INFINITY;
    }
}
// Calls mask(keys_left, diag), mask_scores' bounds, where the warp whose
// first row is wrow needs the mask on key tile [j0, j0 + KEYS): the last
// tile (past tk) and, causal, those reaching past wrow. Only they run the
// mask's tests (FlashAttention keeps them in a loop of their own).
template <int KEYS, typename Mask>
__device__ __forceinline__ void mask_edge_tile(int tk, int j0, int wrow, bool causal, Mask&& mask) {
  if (j0 + KEYS > tk || (causal && j0 + KEYS - 1 > wrow))
    mask(tk - j0 < KEYS ? tk - j0 : KEYS, causal ? (wrow - j0 < KEYS ? wrow - j0 : KEYS) : KEYS);
}
// One key tile's step of the online softmax (FlashAttention-2's), in two
// parts that online_softmax below runs back to back:
//  - softmax_rescale: s the tile's unscaled scores, m each row's running
//    maximum (unscaled; the scale is positive), l the lane's share of each
//    row's sum, o the output's accumulators, rescaled when the maximum
//    moves; returns in base each row's new maximum in log2 units;
//  - probabilities: n-tile nt's four probabilities exp2(s sl - base), sl
//    the scale in log2 units (one FFMA and one MUFU a score), added to l
//    (before the drop) and, with dropout, dropped and scaled (the CPU's
//    Philox mask; rows from i0, keys from j0).
// Apart, a kernel can take each n-tile's probabilities just before the
// products that read them (the 16-bit forward's interleaved P v), so that
// the exponentials of later keys issue among the products of earlier ones.
template <int NT, int DT>
__device__ __forceinline__ void softmax_rescale(const float (&s)[NT][4], float (&m)[2], float (&l)[2],
                                                float (&o)[DT][4], float sl, float (&base)[2]) {
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) mx[e / 2] = fmaxf(mx[e / 2], s[nt][e]);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float mn = fmaxf(m[h], quad_max(mx[h]));
    base[h] = mn == -INFINITY ? 0.f : mn * sl;  // a row with no key yet: exp2(-inf) = 0, not NaN
    const float alpha = cuda::exp2_ftz(m[h] * sl - base[h]);
    m[h] = mn;
    l[h] *= alpha;
#pragma unroll
    for (int nt = 0; nt < DT; ++nt) o[nt][2 * h] *= alpha, o[nt][2 * h + 1] *= alpha;
  }
}
template <bool Drop>
__device__ __forceinline__ void probabilities(const float (&s)[4], const float (&base)[2], float (&l)[2], float sl,
                                              const AttentionArgs& a, int64_t b, int i0, int j0, int nt,
                                              const Dropout& dr, int g, int t, float (&pe)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float p = cuda::exp2_ftz(fmaf(s[e], sl, -base[e / 2]));
    l[e / 2] += p;  // the lane's share; the quad adds up at the end
    pe[e] = p;
  }
  if constexpr (Drop) {
    const uint32_t keep = keep_bits(a, dr, b, i0 + g, j0 + nt * 8 + 2 * t, t);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = j0 + nt * 8 + 2 * t + e % 2, i = i0 + g + 8 * (e / 2);
      pe[e] = i < static_cast<int>(a.tq) && j < static_cast<int>(a.tk) && (keep >> e & 1u) ? pe[e] * dr.scale : 0.f;
    }
  }
}
// Both parts for the whole tile: emit(nt, p) takes each n-tile's four as
// soon as they are known (the 16-bit kernel packs them, half the registers
// of the float scores).
template <bool Drop, int NT, int DT, typename Emit>
__device__ __forceinline__ void online_softmax(const float (&s)[NT][4], float (&m)[2], float (&l)[2], float (&o)[DT][4],
                                               float sl, const AttentionArgs& a, int64_t b, int i0, int j0,
                                               const Dropout& dr, int g, int t, Emit&& emit) {
  float base[2];
  softmax_rescale(s, m, l, o, sl, base);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    float pe[4];
    probabilities<Drop>(s[nt], base, l, sl, a, b, i0, j0, nt, dr, g, t, pe);
    emit(nt, pe);
  }
}
// The tile's rows once every key is in: store(h, i, inv) writes row i (g +
// 8 h of the tile, rows from i0, those before tq) scaled by inv, 1 / its
// sum, and the quad's first lane writes the row's log-sum-exp (natural log)
// to lse [n, tq] for the backward.
template <typename Store>
__device__ __forceinline__ void finish_rows(const float (&m)[2], const float (&l)[2], float sl, const AttentionArgs& a,
                                            int64_t b, int tq, int i0, int g, int t, float* __restrict__ lse,
                                            Store&& store) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float lsum = quad_sum(l[h]);
    const int64_t i = i0 + g + 8 * h;
    if (i >= tq) continue;  // tq as the kernel holds it in a register (a.tq would be reloaded from the parameters)
    store(h, i, 1.f / lsum);
    if (t == 0) lse[b * a.tq + i] = (m[h] * sl + log2f(lsum)) / kLog2e;
  }
}

}  // namespace ember::attention_cuda

namespace ember {

// attention_tf32.cu's fused kernels for float32 (attention_flash.cu's
// launchers run them): operands where their Rows say, head dim 32, 64 or
// 128; lse float32 [n, tq]; dq a float32 [n, tq, d] sum (zeroed here), dk
// and dv float32. The backward's block takes backward_smem(d) bytes of
// shared memory.
void attention_tf32_forward(const AttentionArgs& a, const float* q, const attention_cuda::Rows& rq, const float* k,
                            const attention_cuda::Rows& rk, const float* v, const attention_cuda::Rows& rv, float* out,
                            const attention_cuda::Rows& ro, float* lse, int device, cudaStream_t stream);
void attention_tf32_backward(const AttentionArgs& a, const float* q, const attention_cuda::Rows& rq, const float* k,
                             const attention_cuda::Rows& rk, const float* v, const attention_cuda::Rows& rv,
                             const float* dout, const attention_cuda::Rows& rdo, const float* lse, const float* delta,
                             float* dq, float* dk, const attention_cuda::Rows& rdk, float* dv,
                             const attention_cuda::Rows& rdv, int device, cudaStream_t stream);
size_t attention_tf32_backward_smem(int d);

}  // namespace ember
