// The fused ("flash") attention kernels: 16-bit q, k, v on tensor cores (the
// CUDA path of attention.cc's ops for bfloat16 and float16; attention.cu has
// the blocked kernels for the rest).
//
// FlashAttention-2's schedule (Dao, 2023) on mma.sync: a block of 4 warps
// takes 128 query rows (32 a warp) and walks the keys in tiles of KEYS
// staged in shared memory; scores never leave registers, the softmax is
// online (running max and sum per row, the output rescaled when the max
// moves), probabilities become the A operand of P V without a trip through
// memory, and the output is written once, with the row's log-sum-exp for
// the backward. The backward gives each block KEYS keys (16 a warp; dK and
// dV accumulate in registers), walks the query tiles of 64 rows that can
// see them (each loading while the one before is worked on, in two
// shared-memory stages where the device has room), recomputes P from the
// saved log-sum-exp, and adds its share of dQ with float atomics
// (FlashAttention-2's dQ accumulator). Dropout
// redraws the CPU's Philox mask (bernoulli()'s, four keys a Philox call:
// attention.cuh's keep_bits). Operands are rounded to
// the input's 16-bit type before each product (P and dS too, as
// FlashAttention does); sums are float32.
//
// Tile sizes follow FlashAttention-2's choices for sm80/sm90 (forward 128
// keys a tile for head dims up to 64 without dropout, else 64, where 128
// would spill the scores' registers: fwd_keys; backward 128 keys a block,
// 8 warps, so each query tile's loads and dQ atomics serve twice the keys
// of a 64-key block); set_attention_cuda_flash_tiles (EMBER_FLASH_KEYS,
// EMBER_FLASH_BWD_KEYS) picks the 64-key ones, for measuring.
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "core/cuda_check.h"
#include "core/device.h"
#include "core/ops/attention.cuh"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"
#include "core/ops/mma_tiles.cuh"

namespace ember {
namespace {

using attention_cuda::delta_kernel;
using attention_cuda::Dropout;
using attention_cuda::dropout_of;
using attention_cuda::HeadIndex;
using attention_cuda::keep_bits;
using attention_cuda::Rows;
using attention_cuda::warp_grid;
namespace flash {

using cuda::c_to_a;
using cuda::frag_a;
using cuda::frag_a_cols;
using cuda::warp_mma;

constexpr int kRows = 64;  // query rows of a backward tile and of a dQ-pass block
constexpr int kKeys = 64;  // keys of a dQ-pass tile
constexpr int kThreads = attention_cuda::kFlashThreads;
using attention_cuda::finish_rows;
using attention_cuda::kLog2e;
using attention_cuda::load_tile;
using attention_cuda::mask_edge_tile;
using attention_cuda::mask_scores;
using attention_cuda::online_softmax;
using attention_cuda::probabilities;
using attention_cuda::query_block;
using attention_cuda::softmax_rescale;

std::atomic<bool> enabled{[] {
  const char* e = std::getenv("EMBER_FLASH_ATTENTION");
  return !(e && e[0] == '0');
}()};
std::atomic<int64_t> launches{0};

// grid (query blocks of 64 MT rows, heads); out [n, tq, D] in T, lse [n, tq]
// (natural log of each row's sum of exp(scale q.k)). Each warp owns MT
// 16-row tiles, so every k and v fragment read from shared memory serves MT
// products (MT = 2: one tile a warp measured 5-15% slower on an H200). Key
// tiles hold KEYS keys, loaded asynchronously: v's while the scores are
// computed, the next k's during the softmax and P v (during P v alone with
// dropout).
template <typename T, int D, int MT, int KEYS, bool Drop>
__global__ void __launch_bounds__(kThreads)
    flash_forward_kernel(const AttentionArgs a, const uint16_t* __restrict__ q, const Rows rq,
                         const uint16_t* __restrict__ k, const Rows rk, const uint16_t* __restrict__ v, const Rows rv,
                         uint16_t* __restrict__ out, const Rows ro, float* __restrict__ lse) {
  constexpr int LD = D + 8, NT = KEYS / 8, DT = D / 8, BR = 64 * MT;
  extern __shared__ uint4 flash_smem[];
  uint16_t* qs = reinterpret_cast<uint16_t*>(flash_smem);
  uint16_t* ks = qs + BR * LD;
  uint16_t* vs = ks + KEYS * LD;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // P v interleaved with the softmax's exponentials (below) where a tile
  // holds 256 tensor-core instructions a warp (d 64 x 128 keys, d 128 x 64):
  // by tools/sass_paths.py's static measures it gains there and loses on
  // the smaller tiles (bench/README.md). Dropout keeps the whole softmax
  // before the barrier.
  constexpr bool Interleave = !Drop && D * KEYS >= 64 * 128;
  const auto f = attention_cuda::forward_block<D, BR, KEYS, Drop>(a, q, rq, k, rk, v, rv, qs, ks);
  const int wr = warp * 16 * MT;  // the warp's first row in the block
  const int wrow = f.i0 + wr;
  float o[MT][DT][4] = {};
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.f;
  for (int j0 = 0; j0 < f.kend; j0 += KEYS) {
    cuda::cp_async_wait_all();
    __syncthreads();  // k's tile is in; every warp is done with the last v tile
    load_tile<D, KEYS>(f.vb, rv.row, j0, f.tk, vs);
    cuda::cp_async_commit();
    // Warp-uniform: a warp whose rows all precede the tile (causal) or lie
    // past the end skips its products.
    const bool active = wrow < f.tq && (!a.causal || j0 <= wrow + 16 * MT - 1);
    // Without dropout, FlashAttention-2's order: the scores' products, then
    // the wait for v's tile and the block's barrier, then the softmax and P
    // v with no barrier between them, so the scheduler can issue the
    // exponentials of later keys beside the products of earlier ones (a d
    // 64 tile's 132 MUFU, at 16 results a clock an SM, take time comparable
    // with its 256 tensor-core instructions; with the barrier between the
    // softmax and P v, the warp's tensor pipe idled through the softmax).
    // The next k tile's load starts earlier too. With dropout, whose Philox
    // draws need registers of their own, the barrier stays after the
    // softmax: there the overlap spilled 176 bytes at d 128.
    const auto next_tile = [&] {
      cuda::cp_async_wait_all();
      __syncthreads();  // v's tile is in; every warp is done with k's
      if (j0 + KEYS < f.kend) {
        load_tile<D, KEYS>(f.kb, rk.row, j0 + KEYS, f.tk, ks);
        cuda::cp_async_commit();
      }
    };
    float s[MT][NT][4] = {};
    if (active)
      warp_mma<T, D / 16, false>(
          s, [&](int kk, int mt, uint32_t a[4]) { frag_a(qs, LD, wr + mt * 16, kk * 16, lane, a); }, ks, LD, lane);
    if constexpr (!Drop) next_tile();
    if (active)
      mask_edge_tile<KEYS>(f.tk, j0, wrow, a.causal, [&](int keys_left, int diag) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mask_scores(s[mt], keys_left, diag, 16 * mt, g, t);
      });
    if constexpr (Interleave) {
      // Each row tile's maximum and rescale first, then P v with each pair
      // of n-tiles' probabilities computed (rounded to T and packed as the
      // A fragment takes them) just before the products that read them. l
      // adds each row tile's n-tiles in online_softmax's order: the output
      // is bitwise the same (checked under the emulation; the data flow is
      // unchanged).
      if (active) {
        float base[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) softmax_rescale(s[mt], m[mt], l[mt], o[mt], f.sl, base[mt]);
        warp_mma<T, KEYS / 16, true>(
            o,
            [&](int kk, int mt, uint32_t af[4]) {
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                float pe[4];
                probabilities<false>(s[mt][2 * kk + h], base[mt], l[mt], f.sl, a, f.b, wrow + 16 * mt, j0, 2 * kk + h,
                                     f.drop, g, t, pe);
                af[2 * h] = cuda::pack16<T>(pe[0], pe[1]);
                af[2 * h + 1] = cuda::pack16<T>(pe[2], pe[3]);
              }
            },
            vs, LD, lane);
      }
    } else {
      // P rounded to T and packed in pairs as P v's A fragments take them,
      // as soon as it is known (half the registers of the float scores).
      uint32_t pk[MT][NT][2];
      if (active)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          online_softmax<Drop>(s[mt], m[mt], l[mt], o[mt], f.sl, a, f.b, wrow + 16 * mt, j0, f.drop, g, t,
                               [&](int nt, const float(&pe)[4]) {
                                 pk[mt][nt][0] = cuda::pack16<T>(pe[0], pe[1]);
                                 pk[mt][nt][1] = cuda::pack16<T>(pe[2], pe[3]);
                               });
      if constexpr (Drop) next_tile();
      if (active)
        warp_mma<T, KEYS / 16, true>(
            o,
            [&](int kk, int mt, uint32_t af[4]) {
              af[0] = pk[mt][2 * kk][0], af[1] = pk[mt][2 * kk][1];
              af[2] = pk[mt][2 * kk + 1][0], af[3] = pk[mt][2 * kk + 1][1];
            },
            vs, LD, lane);
    }
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    finish_rows(m[mt], l[mt], f.sl, a, f.b, f.tq, wrow + 16 * mt, g, t, lse, [&](int h, int64_t i, float inv) {
      uint16_t* orow = out + ro.at(f.hb) + i * ro.row;
#pragma unroll
      for (int nt = 0; nt < DT; ++nt)
        *reinterpret_cast<uint32_t*>(orow + nt * 8 + 2 * t) =
            cuda::pack16<T>(o[mt][nt][2 * h] * inv, o[mt][nt][2 * h + 1] * inv);
    });
}

// grid (key blocks of KEYS, heads), W = KEYS / 16 warps. dk, dv [n, tk, D]
// float32 written; dq [n, tq, D] float32 added to (zeroed by the launcher)
// when DQ, else left to flash_dq_kernel (deterministic_algorithms()).
//
// FlashAttention-2's backward layout: for each query tile of kRows, every
// product is split over the warps in two dimensions, with P and dS passed
// through shared memory. S and dP: each warp a 32-query x 32-key block;
// dV and dK: 32 keys x D / 2; dQ: 16 or 32 queries x the rest of D. The
// first version gave each warp 16 keys against the whole tile, so every
// warp read all of q and dO for each of its four products: 184 ldmatrix a
// tile at d 128, 128 keys (0.58 a tensor-core instruction) against these
// 144 (0.45), shared memory's bandwidth being what the backward runs at.
template <typename T, int D, int KEYS, bool Drop, bool DQ>
__global__ void __launch_bounds__(2 * KEYS)
    flash_backward_kernel(const AttentionArgs a, const uint16_t* __restrict__ q, const Rows rq,
                          const uint16_t* __restrict__ k, const Rows rk, const uint16_t* __restrict__ v, const Rows rv,
                          const uint16_t* __restrict__ dout, const Rows rdo, const float* __restrict__ lse,
                          const float* __restrict__ delta, float* __restrict__ dq, void* __restrict__ dk,
                          const Rows rdk, void* __restrict__ dv, const Rows rdv, const bool wide, const bool two) {
  static_assert(KEYS == 64 || KEYS == 128, "4 or 8 warps");
  constexpr int W = KEYS / 16, Threads = 32 * W, LD = D + 8, LDP = KEYS + 8;
  // dK and dV: KG groups of 32 keys x 2 halves of D. dQ: QM warps along the
  // tile's rows (MQ row tiles each) x W / QM along D (QN column tiles each).
  constexpr int KG = KEYS / 32, DN = D / 16;
  constexpr int QM = D / (W / 2) >= 16 ? 2 : 4, MQ = kRows / 16 / QM, QN = D / (W / QM) / 8;
  static_assert(QN % 2 == 0 && DN % 2 == 0, "ldmatrix reads B two 8-column tiles at a time");
  static_assert(
      ((2 * kRows + 2 * KEYS) * LD + 2 * kRows * LDP) % 8 == 0 && 2 * kRows * LD % 8 == 0 && Threads >= 2 * kRows,
      "lse and delta 16-byte aligned; a thread an element to stage them");
  // Shared memory: `two` (backward_smem) stages of a query tile (q, dO,
  // then their rows' lse and delta), k, v, P and dS. With two, the next
  // tile loads into the other stage while every product of this one runs
  // (FlashAttention-2's double-buffered q); with one, it loads behind dQ's
  // products alone, after a barrier of its own.
  extern __shared__ uint4 flash_smem[];
  constexpr int QS = 2 * kRows * LD;  // a stage's q and dO, in elements
  uint16_t* const q0 = reinterpret_cast<uint16_t*>(flash_smem);
  uint16_t* ks = q0 + (two ? 2 : 1) * QS;
  uint16_t* vs = ks + KEYS * LD;
  uint16_t* ps = vs + KEYS * LD;     // P, dropped, as [query][key]: dV's A
  uint16_t* dss = ps + kRows * LDP;  // dS as [query][key]: dK's A (transposed read) and dQ's
  float* const l0 = reinterpret_cast<float*>(dss + kRows * LDP);  // a stage's lse, then delta
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int sq = warp % 2 * 32, sk = warp / 2 * 32;                 // S, dP: first query, first key
  const int vk = warp % KG * 32, vd = warp / KG * (D / 2);          // dV, dK: first key, first column
  const int qq = warp % QM * (16 * MQ), qd = warp / QM * (QN * 8);  // dQ: first row, first column
  const int64_t b = blockIdx.y, j0 = static_cast<int64_t>(blockIdx.x) * KEYS;
  const HeadIndex hb = rq.index(b);  // the operands' heads agree (the launcher checks)
  const uint16_t* qb = q + rq.at(hb);
  const uint16_t* dob = dout + rdo.at(hb);
  load_tile<D, KEYS, Threads>(k + rk.at(hb), rk.row, static_cast<int>(j0), static_cast<int>(a.tk), ks);
  load_tile<D, KEYS, Threads>(v + rv.at(hb), rv.row, static_cast<int>(j0), static_cast<int>(a.tk), vs);
  cuda::cp_async_commit();
  const float sl = static_cast<float>(a.scale) * kLog2e, scale = static_cast<float>(a.scale);
  const Dropout drop = dropout_of<Drop>(a);
  float dva[2][DN][4] = {}, dka[2][DN][4] = {};
  // A query tile's q and dO and its rows' lse and delta (zeros past the
  // last row, which the mask's tiles drop) into stage st, all by cp.async:
  // a plain load of lse stalled its warp until it arrived.
  const auto stage = [&](int64_t i0, int st) {
    uint16_t* qd = q0 + st * QS;
    load_tile<D, kRows, Threads>(qb, rq.row, static_cast<int>(i0), static_cast<int>(a.tq), qd);
    load_tile<D, kRows, Threads>(dob, rdo.row, static_cast<int>(i0), static_cast<int>(a.tq), qd + kRows * LD);
    if (const int r = threadIdx.x; r < 2 * kRows) {
      const int64_t i = i0 + r % kRows;
      const float* src = (r < kRows ? lse : delta) + b * a.tq + i;
      cuda::cp_async<4>(l0 + st * 2 * kRows + r, i < a.tq ? src : lse, i < a.tq);
    }
    cuda::cp_async_commit();
  };
  // Causal: only query rows i >= j0 see these keys (j0 is a multiple of kRows).
  const int64_t first = a.causal ? j0 : 0;
  if (first < a.tq) stage(first, 0);
  for (int64_t i0 = first, it = 0; i0 < a.tq; i0 += kRows, ++it) {
    const int st = two ? static_cast<int>(it & 1) : 0;
    const uint16_t* qs = q0 + st * QS;
    const uint16_t* dos = qs + kRows * LD;
    const float* ls = l0 + st * 2 * kRows;
    const float* dl = ls + kRows;
    cuda::cp_async_wait_all();
    // The tile is in; every warp is done with the last P and dS, and with
    // the other stage (the last tile's).
    __syncthreads();
    if (two && i0 + kRows < a.tq) stage(i0 + kRows, st ^ 1);
    {
      // S = Q K^T and dPd = dO V^T for the warp's 32 queries x 32 keys.
      float s[2][4][4] = {}, dp[2][4][4] = {};
      warp_mma<T, D / 16, false>(
          s, [&](int kk, int mt, uint32_t f[4]) { frag_a(qs, LD, sq + mt * 16, kk * 16, lane, f); }, ks + sk * LD, LD,
          lane);
      // dPd's products before the exponentials of P, in the same basic block
      // (the mask's branch follows them), so the scheduler can issue the
      // MUFU and the tensor-core instructions side by side; after the mask
      // they ran back to back (27 MUFU in a row, the tensor pipe idle).
      warp_mma<T, D / 16, false>(
          dp, [&](int kk, int mt, uint32_t f[4]) { frag_a(dos, LD, sq + mt * 16, kk * 16, lane, f); }, vs + sk * LD, LD,
          lane);
      // The lane's rows mt * 16 + g + 8 h of the warp's 32: lse in log2 units, delta.
      float lr[2][2], dr[2][2];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          lr[mt][h] = ls[sq + mt * 16 + g + 8 * h] * kLog2e, dr[mt][h] = dl[sq + mt * 16 + g + 8 * h];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = cuda::exp2_ftz(fmaf(s[mt][nt][e], sl, -lr[mt][e / 2]));
      // Only tiles on the diagonal or at the last row or key run the mask's
      // tests, in the tile's 32-bit coordinates (query c, key kr): c <
      // rows_left, kr < keys_left, and (causal) kr - c <= diag. A select,
      // not a branch around the exp2: that was a branch a score.
      if (j0 + KEYS > a.tk || i0 + kRows > a.tq || (a.causal && j0 + KEYS - 1 > i0)) {
        const int keys_left = static_cast<int>(a.tk - j0 < KEYS ? a.tk - j0 : KEYS);
        const int rows_left = static_cast<int>(a.tq - i0 < kRows ? a.tq - i0 : kRows);
        const int diag = static_cast<int>(a.causal && i0 - j0 < KEYS ? i0 - j0 : KEYS);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int c = sq + mt * 16 + g + 8 * (e / 2), kr = sk + nt * 8 + 2 * t + e % 2;
              if (!(kr < keys_left && c < rows_left && kr - c <= diag)) s[mt][nt][e] = 0.f;
            }
      }
      // Pd = P dropped and scaled, into ps; dS = P (dP - delta) scale with dP
      // the kept dPd scaled, into dss: both rounded to T, pairs stored whole.
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const uint32_t keep = Drop ? keep_bits(a, drop, b, i0 + sq + mt * 16 + g, j0 + sk + nt * 8 + 2 * t, t) : 0u;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float pd[2], ds[2];
#pragma unroll
            for (int x = 0; x < 2; ++x) {
              const int e = 2 * h + x;
              const float p = s[mt][nt][e];
              float d = dp[mt][nt][e] * drop.scale;
              pd[x] = p * drop.scale;
              if (Drop && !(keep >> e & 1u)) pd[x] = d = 0.f;
              ds[x] = p * (d - dr[mt][h]) * scale;
            }
            const int off = (sq + mt * 16 + g + 8 * h) * LDP + sk + nt * 8 + 2 * t;
            *reinterpret_cast<uint32_t*>(ps + off) = cuda::pack16<T>(pd[0], pd[1]);
            *reinterpret_cast<uint32_t*>(dss + off) = cuda::pack16<T>(ds[0], ds[1]);
          }
        }
    }
    __syncthreads();  // P and dS are whole
    // dV += Pd^T dO and dK += dS^T Q for the warp's 32 keys x D / 2.
    warp_mma<T, kRows / 16, true>(
        dva, [&](int kk, int mt, uint32_t f[4]) { frag_a_cols(ps, LDP, vk + mt * 16, kk * 16, lane, f); }, dos + vd, LD,
        lane);
    warp_mma<T, kRows / 16, true>(
        dka, [&](int kk, int mt, uint32_t f[4]) { frag_a_cols(dss, LDP, vk + mt * 16, kk * 16, lane, f); }, qs + vd, LD,
        lane);
    if (!two) {
      __syncthreads();                              // every warp is done with q, dO, lse and delta
      if (i0 + kRows < a.tq) stage(i0 + kRows, 0);  // the next tile loads behind dQ's products
    }
    if constexpr (DQ) {
      // dQ += dS K for the warp's MQ row tiles x QN column tiles.
      float dqa[MQ][QN][4] = {};
      warp_mma<T, KEYS / 16, true>(
          dqa, [&](int kk, int mt, uint32_t f[4]) { frag_a(dss, LDP, qq + mt * 16, kk * 16, lane, f); }, ks + qd, LD,
          lane);
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t i = i0 + qq + mt * 16 + g + 8 * h;
          if (i >= a.tq) continue;
          float* dqrow = dq + (b * a.tq + i) * D + qd + 2 * t;
#pragma unroll
          for (int nt = 0; nt < QN; ++nt) cuda::atomic_add2(dqrow + nt * 8, dqa[mt][nt][2 * h], dqa[mt][nt][2 * h + 1]);
        }
    }
  }
  cuda::cp_async_wait_all();  // a causal block past the last row waited for no copy
  // dK and dV in float32, or rounded to T from the registers (FlashAttention-2's
  // way: a float32 copy and a pass converting it cost 6 bytes an element more).
  const int64_t dk0 = rdk.at(hb), dv0 = rdv.at(hb);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t j = j0 + vk + mt * 16 + g + 8 * h;
      if (j >= a.tk) continue;
      const int64_t ko = dk0 + j * rdk.row + vd + 2 * t, vo = dv0 + j * rdv.row + vd + 2 * t;
#pragma unroll
      for (int nt = 0; nt < DN; ++nt) {
        const float k0 = dka[mt][nt][2 * h], k1 = dka[mt][nt][2 * h + 1];
        const float v0 = dva[mt][nt][2 * h], v1 = dva[mt][nt][2 * h + 1];
        if (wide) {
          *reinterpret_cast<float2*>(static_cast<float*>(dk) + ko + nt * 8) = make_float2(k0, k1);
          *reinterpret_cast<float2*>(static_cast<float*>(dv) + vo + nt * 8) = make_float2(v0, v1);
        } else {
          *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(dk) + ko + nt * 8) = cuda::pack16<T>(k0, k1);
          *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(dv) + vo + nt * 8) = cuda::pack16<T>(v0, v1);
        }
      }
    }
}
// grid (query blocks of kRows, heads); dq [n, tq, D] float32 written. The
// deterministic alternative to the backward kernel's dQ atomics (used under
// deterministic_algorithms()): each block owns its 64 query rows and walks
// the keys they see, recomputing P (from the saved log-sum-exp) and dS as
// the backward kernel does, and adds dS K in registers in key order, so the
// sum's order is fixed. It costs the recomputation of S and dP: three
// products a tile where the backward kernel's atomics cost one. The key
// tiles take `two` (dq_smem) shared-memory stages as the backward's query
// tiles do: the next tile's k and v load while this one's products run.
template <typename T, int D, bool Drop>
__global__ void __launch_bounds__(kThreads)
    flash_dq_kernel(const AttentionArgs a, const uint16_t* __restrict__ q, const Rows rq,
                    const uint16_t* __restrict__ k, const Rows rk, const uint16_t* __restrict__ v, const Rows rv,
                    const uint16_t* __restrict__ dout, const Rows rdo, const float* __restrict__ lse,
                    const float* __restrict__ delta, float* __restrict__ dq, const bool two) {
  constexpr int LD = D + 8, NT = kKeys / 8, DT = D / 8, KS = 2 * kKeys * LD;  // a stage's k and v
  extern __shared__ uint4 flash_smem[];
  uint16_t* qs = reinterpret_cast<uint16_t*>(flash_smem);
  uint16_t* dos = qs + kRows * LD;
  uint16_t* const k0 = dos + kRows * LD;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t b = blockIdx.y, i0 = query_block(a.causal) * kRows;
  const int64_t wrow = i0 + warp * 16;  // the warp's first row
  const HeadIndex hb = rq.index(b);     // the operands' heads agree (the launcher checks)
  const uint16_t* kb = k + rk.at(hb);
  const uint16_t* vb = v + rv.at(hb);
  // Key tile j's k and v into stage st.
  const auto stage = [&](int64_t j, int st) {
    load_tile<D, kKeys>(kb, rk.row, static_cast<int>(j), static_cast<int>(a.tk), k0 + st * KS);
    load_tile<D, kKeys>(vb, rv.row, static_cast<int>(j), static_cast<int>(a.tk), k0 + st * KS + kKeys * LD);
  };
  load_tile<D, kRows>(q + rq.at(hb), rq.row, static_cast<int>(i0), static_cast<int>(a.tq), qs);
  load_tile<D, kRows>(dout + rdo.at(hb), rdo.row, static_cast<int>(i0), static_cast<int>(a.tq), dos);
  stage(0, 0);
  cuda::cp_async_commit();
  const float sl = static_cast<float>(a.scale) * kLog2e, scale = static_cast<float>(a.scale);
  const Dropout drop = dropout_of<Drop>(a);
  // The lane's two rows (g and g + 8 of the warp's 16): lse in log2 units, delta.
  float ls[2], dl[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t i = wrow + g + 8 * h;
    ls[h] = i < a.tq ? lse[b * a.tq + i] * kLog2e : INFINITY;
    dl[h] = i < a.tq ? delta[b * a.tq + i] : 0.f;
  }
  float dqa[DT][4] = {};
  const int64_t last = (i0 + kRows < a.tq ? i0 + kRows : a.tq) - 1;
  const int64_t kend = a.causal && last + 1 < a.tk ? last + 1 : a.tk;
  const bool active = wrow < a.tq;
  for (int64_t j0 = 0, it = 0; j0 < kend; j0 += kKeys, ++it) {
    const int st = two ? static_cast<int>(it & 1) : 0;
    const uint16_t* ks = k0 + st * KS;
    const uint16_t* vs = ks + kKeys * LD;
    if (!two && it > 0) {
      __syncthreads();  // every warp is done with the last tile's k and v
      stage(j0, 0);
      cuda::cp_async_commit();
    }
    cuda::cp_async_wait_all();
    // The tiles (and, the first time, q and dO) are in; with two stages,
    // every warp is done with the other one (the last tile's).
    __syncthreads();
    if (two && j0 + kKeys < kend) {
      stage(j0 + kKeys, st ^ 1);
      cuda::cp_async_commit();
    }
    // A warp whose rows all precede the tile (causal) has nothing to add.
    if (!active || (a.causal && j0 > wrow + 15)) continue;
    const bool masked = j0 + kKeys > a.tk || wrow + 16 > a.tq || (a.causal && j0 + kKeys - 1 > wrow);
    // S = Q K^T and dPd = dO V^T for the warp's 16 rows against the tile's keys.
    float s[NT][4] = {}, dp[NT][4] = {};
    warp_mma<T, D / 16, false>(
        s, [&](int kk, uint32_t f[4]) { frag_a(qs, LD, warp * 16, kk * 16, lane, f); }, ks, LD, lane);
    warp_mma<T, D / 16, false>(
        dp, [&](int kk, uint32_t f[4]) { frag_a(dos, LD, warp * 16, kk * 16, lane, f); }, vs, LD, lane);
    // dS = P (dP - delta) scale, dP the kept dPd scaled (the backward
    // kernel's formula).
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint32_t keep = Drop ? keep_bits(a, drop, b, wrow + g, j0 + nt * 8 + 2 * t, t) : 0u;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t j = j0 + nt * 8 + 2 * t + e % 2, i = wrow + g + 8 * (e / 2);
        const bool ok = !masked || (j < a.tk && i < a.tq && (!a.causal || j <= i));
        const float p = ok ? cuda::exp2_ftz(fmaf(s[nt][e], sl, -ls[e / 2])) : 0.f;
        float d = dp[nt][e] * drop.scale;
        if (Drop && !(keep >> e & 1u)) d = 0.f;
        s[nt][e] = p * (d - dl[e / 2]) * scale;
      }
    }
    // dQ += dS K, dS rounded to T as the backward kernel's shared copy is.
    warp_mma<T, kKeys / 16, true>(
        dqa, [&](int kk, uint32_t f[4]) { c_to_a<T>(s[2 * kk], s[2 * kk + 1], f); }, ks, LD, lane);
  }
  if (!active) return;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int64_t i = wrow + g + 8 * (e / 2);
    if (i >= a.tq) continue;
    float* dqrow = dq + (b * a.tq + i) * D + 2 * t + e % 2;
#pragma unroll
    for (int nt = 0; nt < DT; ++nt) dqrow[nt * 8] = dqa[nt][e];
  }
}

using attention_cuda::allow_smem;

// Tile sizes: set_attention_cuda_flash_tiles, else EMBER_FLASH_KEYS and
// EMBER_FLASH_BWD_KEYS (read once), else FlashAttention-2's (0 below).
int env_keys(const char* name) {
  const char* e = std::getenv(name);
  if (!e || !*e) return 0;
  const std::string s(e);
  EMBER_CHECK(s == "64" || s == "128", name, "=", s, ": the fused attention's key tiles are 64 or 128");
  return std::stoi(s);
}
std::atomic<int> fwd_keys_set{0}, bwd_keys_set{0};  // 0: not set
// ptxas -v (sm_90, bf16): without dropout, 128-key forward tiles fit in
// 255 registers at head dims 32 and 64 (not used at 128); with dropout (its
// Philox draws inlined) they spill at 64 (8 bytes), where 64 keys do not.
int fwd_keys(int d, bool drop) {
  static const int env = env_keys("EMBER_FLASH_KEYS");
  const int set = fwd_keys_set.load(), keys = set ? set : env;
  if (d > 64) return 64;
  return keys ? keys : drop ? 64 : 128;
}
int bwd_keys() {
  static const int env = env_keys("EMBER_FLASH_BWD_KEYS");
  const int set = bwd_keys_set.load(), keys = set ? set : env;
  return keys ? keys : 128;
}
// The backward's query-tile stages: set_attention_cuda_flash_tiles, else
// EMBER_FLASH_BWD_STAGES, else two where they fit (`two_fit`: 171 KiB at
// head dim 128 with 128 keys; a device of 99 KiB a block runs one stage of
// 64-key blocks). Two asked for where they do not fit run one.
std::atomic<int> bwd_stages_set{0};  // 0: not set
int bwd_stages(bool two_fit) {
  static const int env = [] {
    const char* e = std::getenv("EMBER_FLASH_BWD_STAGES");
    if (!e || !*e) return 0;
    const std::string s(e);
    EMBER_CHECK(s == "1" || s == "2", "EMBER_FLASH_BWD_STAGES=", s,
                ": the fused attention backward loads its query tiles in 1 or 2 stages");
    return std::stoi(s);
  }();
  const int set = bwd_stages_set.load(), stages = set ? set : env ? env : 2;
  return stages == 2 && two_fit ? 2 : 1;
}

// A [..., t, d] operand of the kernels where it lies: its leading dims viewed
// as [N, h1, h2] (h1 and h2 q's dims -4 and -3, 1 where it has none, for
// every operand of a call, whose kernels then divide a head's index once;
// reshape copies where the dims do not split or merge so), with dense rows, 16-byte aligned
// (cp.async's pieces) strides and address, and rows within the kernels'
// 32-bit offsets. nullopt when a check fails, or for an output (`write`)
// whose view would be a copy or has a zero stride (a broadcast; the ops
// hand the kernels no other overlapping outputs).
struct Operand {
  Tensor t;  // viewed [N, h1, h2, t, d]
  Rows r;
};
struct Heads {
  int64_t h1 = 1, h2 = 1;
};
Heads heads_of(const Tensor& q) { return {q.dim() >= 4 ? q.size(-4) : 1, q.dim() >= 3 ? q.size(-3) : 1}; }
std::optional<Operand> addressed(const Tensor& x, Heads heads, bool write) {
  const int64_t t = x.size(-2), d = x.size(-1), h1 = heads.h1, h2 = heads.h2;
  Operand o{x.detach().reshape({-1, h1, h2, t, d}), {}};
  const auto stride = [&](int dim) { return o.t.size(dim) == 1 ? 0 : o.t.stride(dim); };
  o.r.s0 = stride(0), o.r.s1 = stride(1), o.r.s2 = stride(2);
  o.r.h1 = static_cast<int>(h1), o.r.h2 = static_cast<int>(h2);
  const int64_t row = t == 1 ? d : o.t.stride(3);
  // Tile loads address rows in 16-bit elements: float32's count twice.
  const int64_t units = x.element_size() / 2;
  bool ok = o.t.stride(4) == 1 && row % 8 == 0 && o.r.s0 % 8 == 0 && o.r.s1 % 8 == 0 && o.r.s2 % 8 == 0 && row >= 0 &&
            o.r.s0 >= 0 && o.r.s1 >= 0 && o.r.s2 >= 0 && (t + 128) * row * units < (int64_t{1} << 31) &&
            reinterpret_cast<uintptr_t>(o.t.raw_data()) % 16 == 0;
  if (write)
    ok = ok && o.t.raw_data() == x.raw_data() && row >= d && (t == 1 || row > 0) && (h1 == 1 || o.r.s1 > 0) &&
         (h2 == 1 || o.r.s2 > 0) && (o.t.size(0) == 1 || o.r.s0 > 0);
  if (!ok) return std::nullopt;
  o.r.row = static_cast<int>(row);
  return o;
}
// An input: where it lies, or a contiguous copy.
Operand input(const Tensor& x, Heads heads) {
  if (auto o = addressed(x, heads, false)) return *std::move(o);
  Tensor c = Tensor::empty(x.sizes(), x.options());
  c.copy_(x.detach());
  auto o = addressed(c, heads, false);
  EMBER_INTERNAL_ASSERT(o.has_value(), "flash attention: a contiguous ", shape_str(x.sizes()), " not addressable");
  return *std::move(o);
}
// An output: written where it lies, or into a contiguous stand-in copied to
// it by done().
struct Output {
  Tensor& x;
  Operand o;
  Output(Tensor& x_, Heads heads) : x(x_) {
    if (auto w = addressed(x, heads, true)) {
      o = *std::move(w);
    } else {
      o = input(Tensor::empty(x.sizes(), x.options()), heads);
    }
  }
  void done() {
    if (o.t.raw_data() != x.raw_data()) x.copy_(o.t.view(x.sizes()));
  }
};

const uint16_t* bits(const Tensor& t) { return static_cast<const uint16_t*>(t.raw_data()); }
uint16_t* bits(Tensor& t) { return static_cast<uint16_t*>(t.raw_data()); }
const float* f32(const Tensor& t) { return static_cast<const float*>(t.raw_data()); }
float* f32(Tensor& t) { return static_cast<float*>(t.raw_data()); }

template <typename T, int D, int KEYS, bool Drop>
void forward_keys(const AttentionArgs& a, const Operand& q, const Operand& k, const Operand& v, Operand& out,
                  Tensor& lse) {
  constexpr int MT = 2;
  const size_t smem = (64 * MT + 2 * KEYS) * (D + 8) * sizeof(uint16_t);
  allow_smem<flash_forward_kernel<T, D, MT, KEYS, Drop>>(smem, q.t.device().index);
  const dim3 grid(static_cast<unsigned>(cuda::ceil_div(a.tq, 64 * MT)), static_cast<unsigned>(a.n));
  flash_forward_kernel<T, D, MT, KEYS, Drop><<<grid, kThreads, smem, cuda::stream_for(q.t)>>>(
      a, bits(q.t), q.r, bits(k.t), k.r, bits(v.t), v.r, bits(out.t), out.r, lse.data<float>());
  EMBER_CUDA_CHECK(cudaGetLastError());
  launches.fetch_add(1);
}

// Dropout is a template argument: its Philox draws, inlined into the
// unrolled loops, cost registers that a kernel without dropout should not pay.
template <typename T, int D>
void forward(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse) {
  cuda::DeviceGuard guard(q);
  const Heads heads = heads_of(q);
  const Operand qo = input(q, heads), ko = input(k, heads), vo = input(v, heads);
  Output oo(out, heads);
  EMBER_INTERNAL_ASSERT(qo.r.same_heads(ko.r) && qo.r.same_heads(vo.r) && qo.r.same_heads(oo.o.r),
                        "flash attention: the operands' leading dims differ");
  const bool drop = a.dropout_p > 0;
  const auto run = [&]<int KEYS>() {
    if (drop)
      forward_keys<T, D, KEYS, true>(a, qo, ko, vo, oo.o, lse);
    else
      forward_keys<T, D, KEYS, false>(a, qo, ko, vo, oo.o, lse);
  };
  if constexpr (std::is_same_v<T, float>) {  // attention_tf32.cu's kernel
    attention_tf32_forward(a, f32(qo.t), qo.r, f32(ko.t), ko.r, f32(vo.t), vo.r, f32(oo.o.t), oo.o.r, lse.data<float>(),
                           q.device().index, cuda::stream_for(q));
    launches.fetch_add(1);
  } else if constexpr (D <= 64) {
    if (fwd_keys(D, drop) == 128)
      run.template operator()<128>();
    else
      run.template operator()<64>();
  } else {
    run.template operator()<64>();
  }
  oo.done();
}

// The backward block's shared memory: `stages` of a query tile's q, dO and
// its rows' statistics, then k, v, P and dS.
size_t backward_smem(int d, int keys, int stages) {
  return (stages * 2 * kRows * (d + 8) + 2 * keys * (d + 8) + 2 * kRows * (keys + 8)) * sizeof(uint16_t) +
         stages * 2 * kRows * sizeof(float);
}
// The dQ pass's: q and dO, then `stages` of a key tile's k and v.
size_t dq_smem(int d, int stages) { return (2 * kRows + stages * 2 * kKeys) * (d + 8) * sizeof(uint16_t); }
// The most shared memory a block of the device may opt in to, asked once:
// 227 KiB on sm_90 and sm_100, 99 KiB on sm_86, sm_89 and sm_120, which run
// the sm_90 PTX (sm_120) and where the 128-key backward at head dim 128
// (137 KiB) cannot launch.
int smem_optin(int device) {
  static std::atomic<int> known[64] = {};  // 0: not asked yet
  std::atomic<int>& slot = known[device % 64];
  int v = slot.load();
  if (v == 0) {
    EMBER_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    slot.store(v);
  }
  return v;
}

// The backward's operands: q, k, v and dO where they lie; dK and dV written
// where they lie (float32 or T); dQ's float32 sum [n, tq, D].
struct BackwardOperands {
  Operand q, k, v, dout;
  Output dk, dv;
  Tensor dq;
  bool wide;  // dk and dv float32
};

template <typename T, int D, int KEYS, bool Drop>
void backward_keys(const AttentionArgs& a, BackwardOperands& o, const Tensor& lse, const Tensor& delta, int stages) {
  const Tensor& q = o.q.t;
  cudaStream_t stream = cuda::stream_for(q);
  const size_t smem = backward_smem(D, KEYS, stages);
  const dim3 grid(static_cast<unsigned>(cuda::ceil_div(a.tk, KEYS)), static_cast<unsigned>(a.n));
  if (!deterministic_algorithms()) {
    EMBER_CUDA_CHECK(cudaMemsetAsync(o.dq.raw_data(), 0, o.dq.numel() * sizeof(float), stream));
    allow_smem<flash_backward_kernel<T, D, KEYS, Drop, true>>(smem, q.device().index);
    flash_backward_kernel<T, D, KEYS, Drop, true><<<grid, 2 * KEYS, smem, stream>>>(
        a, bits(q), o.q.r, bits(o.k.t), o.k.r, bits(o.v.t), o.v.r, bits(o.dout.t), o.dout.r, lse.data<float>(),
        delta.data<float>(), o.dq.data<float>(), o.dk.o.t.raw_data(), o.dk.o.r, o.dv.o.t.raw_data(), o.dv.o.r, o.wide,
        stages == 2);
    EMBER_CUDA_CHECK(cudaGetLastError());
    launches.fetch_add(1);
    return;
  }
  allow_smem<flash_backward_kernel<T, D, KEYS, Drop, false>>(smem, q.device().index);
  flash_backward_kernel<T, D, KEYS, Drop, false><<<grid, 2 * KEYS, smem, stream>>>(
      a, bits(q), o.q.r, bits(o.k.t), o.k.r, bits(o.v.t), o.v.r, bits(o.dout.t), o.dout.r, lse.data<float>(),
      delta.data<float>(), nullptr, o.dk.o.t.raw_data(), o.dk.o.r, o.dv.o.t.raw_data(), o.dv.o.r, o.wide, stages == 2);
  EMBER_CUDA_CHECK(cudaGetLastError());
  // The dQ pass's key tiles in two stages where the device has room for
  // them (102 KiB at head dim 128), as the backward's query tiles.
  const int dq_stages = bwd_stages(dq_smem(D, 2) <= static_cast<size_t>(smem_optin(q.device().index)));
  allow_smem<flash_dq_kernel<T, D, Drop>>(dq_smem(D, dq_stages), q.device().index);
  const dim3 dq_grid(static_cast<unsigned>(cuda::ceil_div(a.tq, kRows)), static_cast<unsigned>(a.n));
  flash_dq_kernel<T, D, Drop><<<dq_grid, kThreads, dq_smem(D, dq_stages), stream>>>(
      a, bits(q), o.q.r, bits(o.k.t), o.k.r, bits(o.v.t), o.v.r, bits(o.dout.t), o.dout.r, lse.data<float>(),
      delta.data<float>(), o.dq.data<float>(), dq_stages == 2);
  EMBER_CUDA_CHECK(cudaGetLastError());
  launches.fetch_add(2);
}

// Float32 where its fused backward does not run: under
// deterministic_algorithms() (its dQ sums by atomics; the 16-bit kernels'
// deterministic dQ pass has no float32 twin), or on a device without the
// shared memory of its block (109 KiB at head dim 128: sm_86, sm_89 and
// sm_120 have 99). The blocked kernels on [n, t, d] copies, as the op runs
// them; they recompute P and need no lse.
void blocked_f32_backward(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const Tensor* dlse) {
  const auto rows = [&](const Tensor& x, int64_t t) { return x.detach().reshape({a.n, t, a.d}).contiguous(); };
  Tensor gq = Tensor::empty({a.n, a.tq, a.d}, q.options()), gk = Tensor::empty({a.n, a.tk, a.d}, q.options()),
         gv = Tensor::empty({a.n, a.tk, a.d}, q.options());
  const Tensor dl = dlse ? dlse->reshape({a.n * a.tq}).contiguous() : Tensor();
  attention_backward_cuda(a, rows(q, a.tq), rows(k, a.tk), rows(v, a.tk), rows(out, a.tq), rows(dout, a.tq), gq, gk, gv,
                          dlse ? &dl : nullptr);
  dq.copy_(gq.view(dq.sizes()));
  dk.copy_(gk.view(dk.sizes()));
  dv.copy_(gv.view(dv.sizes()));
}

template <typename T, int D>
void backward(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
              const Tensor& dout, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, const Tensor* dlse) {
  cuda::DeviceGuard guard(q);
  if constexpr (std::is_same_v<T, float>) {
    if (deterministic_algorithms() ||
        attention_tf32_backward_smem(D) > static_cast<size_t>(smem_optin(q.device().index)))
      return blocked_f32_backward(a, q, k, v, out, dout, dq, dk, dv, dlse);
  }
  EMBER_INTERNAL_ASSERT(dk.dtype() == dv.dtype() && (dk.dtype() == DType::Float32 || dk.dtype() == q.dtype()) &&
                            (dq.dtype() == DType::Float32 || dq.dtype() == q.dtype()),
                        "flash attention: gradients in float32 or ", q.dtype(), ", got dq ", dq.dtype(), ", dk ",
                        dk.dtype(), ", dv ", dv.dtype());
  // dQ's sum: dq itself when it is dense float32 (8-byte aligned: the
  // atomics add float2s).
  const bool dq_direct =
      dq.dtype() == DType::Float32 && dq.is_contiguous() && reinterpret_cast<uintptr_t>(dq.raw_data()) % 8 == 0;
  const Heads heads = heads_of(q);
  BackwardOperands o{input(q, heads),
                     input(k, heads),
                     input(v, heads),
                     input(dout, heads),
                     Output(dk, heads),
                     Output(dv, heads),
                     dq_direct ? dq : Tensor::empty({a.n, a.tq, a.d}, {DType::Float32, q.device()}),
                     dk.dtype() == DType::Float32};
  const Operand oo = input(out, heads);
  EMBER_INTERNAL_ASSERT(o.q.r.same_heads(o.k.r) && o.q.r.same_heads(o.v.r) && o.q.r.same_heads(o.dout.r) &&
                            o.q.r.same_heads(o.dk.o.r) && o.q.r.same_heads(o.dv.o.r) && o.q.r.same_heads(oo.r),
                        "flash attention: the operands' leading dims differ");
  Tensor delta = Tensor::empty({a.n * a.tq}, {DType::Float32, q.device()});
  delta_kernel<T, float><<<warp_grid(a.n * a.tq), cuda::kBlockSize, 0, cuda::stream_for(q)>>>(
      a.n * a.tq, a.tq, D, oo.t.data<T>(), oo.r, o.dout.t.data<T>(), o.dout.r, dlse ? dlse->data<float>() : nullptr,
      delta.data<float>());
  EMBER_CUDA_CHECK(cudaGetLastError());
  // 128-key blocks where the device gives a block their shared memory with
  // one stage; two stages where it has room for them (bwd_stages).
  const size_t optin = static_cast<size_t>(smem_optin(q.device().index));
  const bool drop = a.dropout_p > 0, wide = bwd_keys() == 128 && backward_smem(D, 128, 1) <= optin;
  const int stages = bwd_stages(backward_smem(D, wide ? 128 : 64, 2) <= optin);
  if constexpr (std::is_same_v<T, float>) {  // attention_tf32.cu's kernel, dQ summed by atomics
    attention_tf32_backward(a, f32(o.q.t), o.q.r, f32(o.k.t), o.k.r, f32(o.v.t), o.v.r, f32(o.dout.t), o.dout.r,
                            lse.data<float>(), delta.data<float>(), o.dq.data<float>(), f32(o.dk.o.t), o.dk.o.r,
                            f32(o.dv.o.t), o.dv.o.r, q.device().index, cuda::stream_for(q));
    launches.fetch_add(1);
  } else if (wide && drop)
    backward_keys<T, D, 128, true>(a, o, lse, delta, stages);
  else if (wide)
    backward_keys<T, D, 128, false>(a, o, lse, delta, stages);
  else if (drop)
    backward_keys<T, D, 64, true>(a, o, lse, delta, stages);
  else
    backward_keys<T, D, 64, false>(a, o, lse, delta, stages);
  o.dk.done(), o.dv.done();
  if (!dq_direct) dq.copy_(o.dq.view(dq.sizes()));
}

// Calls f.template operator()<T, D>() for the tensor's type (16-bit, or float
// for float32) and head dim.
template <typename F>
void dispatch(DType dt, int64_t d, F&& f) {
  const auto by_dim = [&](auto tag) {
    using T = decltype(tag);
    switch (d) {
      case 32:
        return f.template operator()<T, 32>();
      case 64:
        return f.template operator()<T, 64>();
      case 128:
        return f.template operator()<T, 128>();
      default:
        EMBER_INTERNAL_ASSERT(false, "flash attention: head dim ", d, " has no kernel");
    }
  };
  if (dt == DType::BFloat16)
    by_dim(BFloat16{});
  else if (dt == DType::Float32)
    by_dim(float{});
  else
    by_dim(Half{});
}

}  // namespace flash

}  // namespace

bool attention_flash_cuda_supports(const AttentionArgs& a, DType dt) {
  // The kernels' scale in log2 units (float) must be positive and finite:
  // a scale below float's smallest would make it 0 and the first rescale
  // exp2(-inf * 0), NaN.
  const float sl = static_cast<float>(a.scale) * flash::kLog2e;
  // Float32's tile loads address its rows as 16-bit elements, twice as many.
  const int64_t wide = dt == DType::Float32 ? 2 : 1;
  return flash::enabled.load() && (dt == DType::BFloat16 || dt == DType::Float16 || dt == DType::Float32) &&
         a.d == a.dv && sl > 0 && std::isfinite(sl) && (a.d == 32 || a.d == 64 || a.d == 128) && a.n > 0 &&
         a.n <= 65535 && a.tq > 0 && a.tk > 0 &&
         // The kernels' 32-bit row offsets, a tile's rows past the end included.
         (a.tq + 128) * a.d * wide < (int64_t{1} << 31) && (a.tk + 128) * a.d * wide < (int64_t{1} << 31);
}

void set_attention_cuda_flash(bool on) { flash::enabled.store(on); }
void set_attention_cuda_flash_tiles(FlashTiles tiles) {
  for (int keys : {tiles.fwd_keys, tiles.bwd_keys})
    EMBER_CHECK(keys == 0 || keys == 64 || keys == 128, "set_attention_cuda_flash_tiles: ", keys,
                " keys: a tile holds 64 or 128 (0: the default)");
  EMBER_CHECK(tiles.bwd_stages >= 0 && tiles.bwd_stages <= 2, "set_attention_cuda_flash_tiles: ", tiles.bwd_stages,
              " backward stages: 1 or 2 (0: the default)");
  flash::fwd_keys_set.store(tiles.fwd_keys);
  flash::bwd_keys_set.store(tiles.bwd_keys);
  flash::bwd_stages_set.store(tiles.bwd_stages);
}
int64_t attention_cuda_flash_launches() { return flash::launches.load(); }

void attention_flash_forward_cuda(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v,
                                  Tensor& out, Tensor& lse) {
  EMBER_INTERNAL_ASSERT(attention_flash_cuda_supports(a, q.dtype()), "flash attention: unsupported ", q.dtype(), " d ",
                        a.d, " dv ", a.dv);
  flash::dispatch(q.dtype(), a.d, [&]<typename T, int D>() { flash::forward<T, D>(a, q, k, v, out, lse); });
}

void attention_flash_backward_cuda(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& out, const Tensor& dout, const Tensor& lse, Tensor& dq, Tensor& dk,
                                   Tensor& dv, const Tensor* dlse) {
  EMBER_INTERNAL_ASSERT(attention_flash_cuda_supports(a, q.dtype()), "flash attention: unsupported ", q.dtype(), " d ",
                        a.d, " dv ", a.dv);
  flash::dispatch(q.dtype(), a.d,
                  [&]<typename T, int D>() { flash::backward<T, D>(a, q, k, v, out, dout, lse, dq, dk, dv, dlse); });
}

}  // namespace ember
