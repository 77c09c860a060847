// The fused ("flash") attention kernels for float32 q, k, v and their
// launches: the 16-bit kernels' schedule (attention_flash.cu, whose
// launchers run these for float32) on TF32 tensor cores in 3xTF32, each
// product as three TF32 ones (mma_tiles.cuh's split_tf32 and
// mma_row_3xtf32), which keeps nearly float32's accuracy.
// That is the path PyTorch's efficient attention takes for float32
// (CUTLASS's OpMultiplyAddFastF32); ours ran float32 through the blocked
// kernels (attention.cu: cuBLAS's SGEMM, the scores in memory).
//
// Tiles lie in shared memory as float32, rows D + 4 apart, and fragments
// come by 32-bit loads (ldmatrix moves 16-bit elements): with that padding
// a warp's A and B reads (rows g, columns t) and the reads of a permuted B
// (rows 2t and 2t + 1, columns g) fall on 32 distinct banks; dQ's reads of
// k (rows t, columns g) and the dS stores meet two to a bank. The
// accumulator of m16n8k8 is not its A fragment as it lies, so the products
// whose A is one (P V, dV, dK) take their k in the order 2t, 2t + 1 of
// each 8 (frag_b_pairs), as do their B rows.
//
// Forward: a block of 4 warps takes 64 query rows (16 a warp) and walks the
// keys in tiles (64 up to head dim 64, 32 at 128, so the shared memory fits
// in 99 KiB devices too), online softmax as the 16-bit kernel. Backward: a
// block takes 64 keys (16 a warp) and walks the query tiles that see them
// (QR rows), S^T and dP^T per warp in registers, dV and dK accumulated
// there, dS through shared memory for dQ (split over the warps, added to a
// float32 sum by atomics).
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "core/ops/attention.cuh"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"
#include "core/ops/mma_tiles.cuh"

namespace ember {
namespace {
namespace tf32 {

using attention_cuda::Dropout;
using attention_cuda::dropout_of;
using attention_cuda::finish_rows;
using attention_cuda::HeadIndex;
using attention_cuda::keep_bits_t;
using attention_cuda::kLog2e;
using attention_cuda::load_tile;
using attention_cuda::mask_edge_tile;
using attention_cuda::mask_scores;
using attention_cuda::online_softmax;
using attention_cuda::Rows;
using cuda::mma_1688_3xtf32;
using cuda::mma_row_3xtf32;
using cuda::split_tf32;
using FragA = cuda::Tf32A;
using FragB = cuda::Tf32B;

constexpr int kThreads = 128;  // 4 warps, forward and backward
constexpr int kRows = 64;      // a forward block's query rows
constexpr int kKeys = 64;      // a backward block's keys

// Fragments split for 3xTF32 from float tiles of row stride ld (elements).
__device__ __forceinline__ void put(const float v, uint32_t& big, uint32_t& small) {
  const cuda::Tf32x2 p = split_tf32(v);
  big = p.big, small = p.small;
}
// A (16 x 8) whose lane (g, t) element (g, t) lies at p, rows (m) dm and
// columns (k) dk elements apart.
__device__ __forceinline__ FragA frag_a_at(const float* p, int dm, int dk) {
  FragA f;
  put(p[0], f.big[0], f.small[0]);
  put(p[8 * dm], f.big[1], f.small[1]);
  put(p[4 * dk], f.big[2], f.small[2]);
  put(p[8 * dm + 4 * dk], f.big[3], f.small[3]);
  return f;
}
// A (16 x 8) at rows m0.., columns k0.. of a row-major tile.
__device__ __forceinline__ FragA frag_a(const float* tile, int ld, int m0, int k0, int g, int t) {
  return frag_a_at(tile + (m0 + g) * ld + k0 + t, ld, 1);
}
// A (16 x 8) where A(m, k) = tile[k][m] (stored transposed): dS for dQ.
__device__ __forceinline__ FragA frag_a_cols(const float* tile, int ld, int m0, int k0, int g, int t) {
  return frag_a_at(tile + (k0 + t) * ld + m0 + g, 1, ld);
}
// A from an accumulator pair's worth of registers: the C tile c (16 x 8,
// mma_1688_tf32's C layout) as an A fragment with k permuted (fragment
// column t is C's column 2t, t + 4 is 2t + 1).
__device__ __forceinline__ FragA frag_a_acc(const float c[4]) {
  FragA f;
  put(c[0], f.big[0], f.small[0]);
  put(c[2], f.big[1], f.small[1]);
  put(c[1], f.big[2], f.small[2]);
  put(c[3], f.big[3], f.small[3]);
  return f;
}
// B (8 x 8) whose lane's two elements lie at p and p + dk.
__device__ __forceinline__ FragB frag_b_at(const float* p, int dk) {
  FragB f;
  put(p[0], f.big[0], f.small[0]);
  put(p[dk], f.big[1], f.small[1]);
  return f;
}
// B where B(k, n) = tile[n][k]: the tile's rows are B's columns.
__device__ __forceinline__ FragB frag_b_rows(const float* tile, int ld, int k0, int n0, int g, int t) {
  return frag_b_at(tile + (n0 + g) * ld + k0 + t, 4);
}
// B where B(k, n) = tile[k][n], rows t and t + 4 (k as it lies).
__device__ __forceinline__ FragB frag_b_cols(const float* tile, int ld, int k0, int n0, int g, int t) {
  return frag_b_at(tile + (k0 + t) * ld + n0 + g, 4 * ld);
}
// B where B(k, n) = tile[k][n] with k permuted as frag_a_acc's: rows 2t and
// 2t + 1.
__device__ __forceinline__ FragB frag_b_pairs(const float* tile, int ld, int k0, int n0, int g, int t) {
  return frag_b_at(tile + (k0 + 2 * t) * ld + n0 + g, ld);
}
// Forward keys a tile: 64 up to head dim 64, 32 at 128 (qs, ks, vs: 66
// KiB; 64 keys would take all 99 KiB of an sm_86, sm_89 or sm_120 block,
// and 8 n-tiles of scores more registers).
template <int D>
constexpr int forward_keys() {
  return D <= 64 ? 64 : 32;
}
constexpr size_t forward_smem(int d, int keys) { return static_cast<size_t>(kRows + 2 * keys) * (d + 4) * 4; }

// grid (query blocks of kRows, heads); out [n, tq, D], lse [n, tq] (natural
// log), as the 16-bit forward.
template <int D, bool Drop>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const AttentionArgs a, const float* __restrict__ q, const Rows rq, const float* __restrict__ k,
                   const Rows rk, const float* __restrict__ v, const Rows rv, float* __restrict__ out, const Rows ro,
                   float* __restrict__ lse) {
  constexpr int KEYS = forward_keys<D>(), LD = D + 4, NT = KEYS / 8, DT = D / 8;
  extern __shared__ uint4 tf32_smem[];
  float* qs = reinterpret_cast<float*>(tf32_smem);
  float* ks = qs + kRows * LD;
  float* vs = ks + KEYS * LD;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const auto f = attention_cuda::forward_block<D, kRows, KEYS, Drop>(a, q, rq, k, rk, v, rv, qs, ks);
  const int wr = warp * 16, wrow = f.i0 + wr;
  float o[DT][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  for (int j0 = 0; j0 < f.kend; j0 += KEYS) {
    cuda::cp_async_wait_all();
    __syncthreads();  // k's tile is in; every warp is done with the last v tile
    load_tile<D, KEYS>(f.vb, rv.row, j0, f.tk, vs);
    cuda::cp_async_commit();
    const bool active = wrow < f.tq && (!a.causal || j0 <= wrow + 15);
    float s[NT][4] = {};
    if (active) {
#pragma unroll
      for (int kk = 0; kk < D / 8; ++kk) {
        mma_row_3xtf32(s, frag_a(qs, LD, wr, kk * 8, g, t),
                       [&](int nt) { return frag_b_rows(ks, LD, kk * 8, nt * 8, g, t); });
      }
    }
    cuda::cp_async_wait_all();
    __syncthreads();  // v's tile is in; every warp is done with k's
    if (j0 + KEYS < f.kend) {
      load_tile<D, KEYS>(f.kb, rk.row, j0 + KEYS, f.tk, ks);
      cuda::cp_async_commit();
    }
    if (!active) continue;
    // The mask where a tile needs it, as the 16-bit forward's.
    mask_edge_tile<KEYS>(f.tk, j0, wrow, a.causal,
                         [&](int keys_left, int diag) { mask_scores(s, keys_left, diag, 0, g, t); });
    // The probabilities in place of the scores (P V's A comes from them).
    online_softmax<Drop>(s, m, l, o, f.sl, a, f.b, wrow, j0, f.drop, g, t, [&](int nt, const float(&p)[4]) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = p[e];
    });
    // O += P V: P's key tile kk (8 keys) as A, v's rows in the same order.
#pragma unroll
    for (int kk = 0; kk < NT; ++kk) {
      mma_row_3xtf32(o, frag_a_acc(s[kk]), [&](int nt) { return frag_b_pairs(vs, LD, kk * 8, nt * 8, g, t); });
    }
  }
  cuda::cp_async_wait_all();  // a warp past the last row waited for no copy
  finish_rows(m, l, f.sl, a, f.b, f.tq, wrow, g, t, lse, [&](int h, int64_t i, float inv) {
    float* orow = out + ro.at(f.hb) + i * ro.row;
#pragma unroll
    for (int nt = 0; nt < DT; ++nt)
      *reinterpret_cast<float2*>(orow + nt * 8 + 2 * t) = make_float2(o[nt][2 * h] * inv, o[nt][2 * h + 1] * inv);
  });
}

// Backward query rows a tile: 64 up to head dim 64, 32 at 128 (registers:
// dK and dV take D of them).
template <int D>
constexpr int backward_rows() {
  return D <= 64 ? 64 : 32;
}
// k, v, then q and dO, dS^T [keys][QR + 8], and the rows' lse and delta.
constexpr size_t backward_smem(int d, int qr) {
  return (static_cast<size_t>(2 * kKeys + 2 * qr) * (d + 4) + kKeys * (qr + 8) + 2 * qr) * 4;
}

// grid (key blocks of kKeys, heads). dk, dv [n, tk, D] written; dq [n, tq,
// D] float32 added to (zeroed by the launcher).
template <int D, bool Drop>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const AttentionArgs a, const float* __restrict__ q, const Rows rq, const float* __restrict__ k,
                    const Rows rk, const float* __restrict__ v, const Rows rv, const float* __restrict__ dout,
                    const Rows rdo, const float* __restrict__ lse, const float* __restrict__ delta,
                    float* __restrict__ dq, float* __restrict__ dk, const Rows rdk, float* __restrict__ dv,
                    const Rows rdv) {
  constexpr int QR = backward_rows<D>(), LD = D + 4, LDS = QR + 8, NQ = QR / 8, DT = D / 8;
  // dQ over the warps: QM along the tile's rows (16 each), 4 / QM along D.
  constexpr int QM = QR / 16, QDT = DT / (4 / QM);
  extern __shared__ uint4 tf32_smem[];
  float* ks = reinterpret_cast<float*>(tf32_smem);
  float* vs = ks + kKeys * LD;
  float* qs = vs + kKeys * LD;
  float* dos = qs + QR * LD;
  float* dst = dos + QR * LD;  // dS^T: [key][query]
  float* ls = dst + kKeys * LDS;
  float* dl = ls + QR;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wk = warp * 16;                                   // the warp's first key
  const int qm = warp % QM * 16, qd = warp / QM * (QDT * 8);  // dQ: first row, first column
  const int tq = static_cast<int>(a.tq), tk = static_cast<int>(a.tk);
  const int64_t b = blockIdx.y;
  const int j0 = static_cast<int>(blockIdx.x) * kKeys;
  const HeadIndex hb = rq.index(b);
  const float* qb = q + rq.at(hb);
  const float* dob = dout + rdo.at(hb);
  load_tile<D, kKeys>(k + rk.at(hb), rk.row, j0, tk, ks);
  load_tile<D, kKeys>(v + rv.at(hb), rv.row, j0, tk, vs);
  cuda::cp_async_commit();
  const float sl = static_cast<float>(a.scale) * kLog2e, scale = static_cast<float>(a.scale);
  const Dropout drop = dropout_of<Drop>(a);
  float dva[DT][4] = {}, dka[DT][4] = {};
  // Causal: only query rows i >= j0 see these keys (j0 is a multiple of QR).
  for (int i0 = a.causal ? j0 : 0; i0 < tq; i0 += QR) {
    // No barrier before these loads: every warp read the last tile's q, dO
    // and rows before its dS barrier, and writes dS^T again only past the
    // barrier below, which each warp reaches after its dQ products.
    load_tile<D, QR>(qb, rq.row, i0, tq, qs);
    load_tile<D, QR>(dob, rdo.row, i0, tq, dos);
    if (const int r = threadIdx.x; r < 2 * QR) {
      const int i = i0 + r % QR;
      const float* src = (r < QR ? lse : delta) + b * a.tq + i;
      cuda::cp_async<4>(ls + r, i < tq ? src : lse, i < tq);
    }
    cuda::cp_async_commit();
    cuda::cp_async_wait_all();
    __syncthreads();  // the tile is in
    // S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys x QR queries.
    float st[NQ][4] = {}, dpt[NQ][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 8; ++kk) {
      const FragA fk = frag_a(ks, LD, wk, kk * 8, g, t);
      const FragA fv = frag_a(vs, LD, wk, kk * 8, g, t);
#pragma unroll
      for (int nt = 0; nt < NQ; ++nt) {
        mma_1688_3xtf32(st[nt], fk, frag_b_rows(qs, LD, kk * 8, nt * 8, g, t));
        mma_1688_3xtf32(dpt[nt], fv, frag_b_rows(dos, LD, kk * 8, nt * 8, g, t));
      }
    }
    // P and dS, key r = wk + g + 8 (e / 2) against query c = nt 8 + 2t + e % 2:
    // st becomes P dropped and scaled (dV's A), dpt dS = P (dP - delta)
    // scale with dP the kept dPd scaled (dK's A, then dQ's through dst).
#pragma unroll
    for (int nt = 0; nt < NQ; ++nt) {
      const uint32_t keep = Drop ? keep_bits_t(a, drop, b, i0 + nt * 8 + 2 * t, j0 + wk + g, g) : 0u;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = nt * 8 + 2 * t + e % 2, r = wk + g + 8 * (e / 2);
        const int i = i0 + c, j = j0 + r;
        const bool in = i < tq && j < tk && (!a.causal || j <= i);
        const float p = in ? cuda::exp2_ftz(fmaf(st[nt][e], sl, -ls[c] * kLog2e)) : 0.f;
        float d = dpt[nt][e] * drop.scale, pd = p * drop.scale;
        if (Drop && !(keep >> e & 1u)) pd = d = 0.f;
        st[nt][e] = pd;
        dpt[nt][e] = p * (d - dl[c]) * scale;
        dst[r * LDS + c] = dpt[nt][e];
      }
    }
    // dV += Pd^T dO and dK += dS^T Q: the queries as k, in the accumulators' order.
#pragma unroll
    for (int kk = 0; kk < NQ; ++kk) {
      const FragA fp = frag_a_acc(st[kk]), fs = frag_a_acc(dpt[kk]);
#pragma unroll
      for (int nt = 0; nt < DT; ++nt) {
        mma_1688_3xtf32(dva[nt], fp, frag_b_pairs(dos, LD, kk * 8, nt * 8, g, t));
        mma_1688_3xtf32(dka[nt], fs, frag_b_pairs(qs, LD, kk * 8, nt * 8, g, t));
      }
    }
    __syncthreads();  // dS^T is whole
    // dQ += dS K for the warp's 16 rows x QDT column tiles.
    float dqa[QDT][4] = {};
#pragma unroll
    for (int kk = 0; kk < kKeys / 8; ++kk) {
      mma_row_3xtf32(dqa, frag_a_cols(dst, LDS, qm, kk * 8, g, t),
                     [&](int nt) { return frag_b_cols(ks, LD, kk * 8, qd + nt * 8, g, t); });
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i = i0 + qm + g + 8 * h;
      if (i >= tq) continue;
      float* dqrow = dq + (b * a.tq + i) * D + qd + 2 * t;
#pragma unroll
      for (int nt = 0; nt < QDT; ++nt) cuda::atomic_add2(dqrow + nt * 8, dqa[nt][2 * h], dqa[nt][2 * h + 1]);
    }
  }
  cuda::cp_async_wait_all();  // a causal block past the last row waited for no copy
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t j = j0 + wk + g + 8 * h;
    if (j >= tk) continue;
    float* krow = dk + rdk.at(hb) + j * rdk.row + 2 * t;
    float* vrow = dv + rdv.at(hb) + j * rdv.row + 2 * t;
#pragma unroll
    for (int nt = 0; nt < DT; ++nt) {
      *reinterpret_cast<float2*>(krow + nt * 8) = make_float2(dka[nt][2 * h], dka[nt][2 * h + 1]);
      *reinterpret_cast<float2*>(vrow + nt * 8) = make_float2(dva[nt][2 * h], dva[nt][2 * h + 1]);
    }
  }
}

}  // namespace tf32

// Calls f.template operator()<D, Drop>() for the head dim and dropout.
template <typename F>
void by_dim(int64_t d, bool drop, F&& f) {
  const auto with = [&]<int D>() {
    if (drop)
      f.template operator()<D, true>();
    else
      f.template operator()<D, false>();
  };
  switch (d) {
    case 32:
      return with.template operator()<32>();
    case 64:
      return with.template operator()<64>();
    case 128:
      return with.template operator()<128>();
    default:
      EMBER_INTERNAL_ASSERT(false, "float32 flash attention: head dim ", d, " has no kernel");
  }
}

}  // namespace

using attention_cuda::allow_smem;
using attention_cuda::Rows;

size_t attention_tf32_backward_smem(int d) { return d <= 64 ? tf32::backward_smem(d, 64) : tf32::backward_smem(d, 32); }

void attention_tf32_forward(const AttentionArgs& a, const float* q, const Rows& rq, const float* k, const Rows& rk,
                            const float* v, const Rows& rv, float* out, const Rows& ro, float* lse, int device,
                            cudaStream_t stream) {
  by_dim(a.d, a.dropout_p > 0, [&]<int D, bool Drop>() {
    const size_t smem = tf32::forward_smem(D, tf32::forward_keys<D>());
    allow_smem<tf32::forward_kernel<D, Drop>>(smem, device);
    const dim3 grid(static_cast<unsigned>(cuda::ceil_div(a.tq, tf32::kRows)), static_cast<unsigned>(a.n));
    tf32::forward_kernel<D, Drop><<<grid, tf32::kThreads, smem, stream>>>(a, q, rq, k, rk, v, rv, out, ro, lse);
    EMBER_CUDA_CHECK(cudaGetLastError());
  });
}

void attention_tf32_backward(const AttentionArgs& a, const float* q, const Rows& rq, const float* k, const Rows& rk,
                             const float* v, const Rows& rv, const float* dout, const Rows& rdo, const float* lse,
                             const float* delta, float* dq, float* dk, const Rows& rdk, float* dv, const Rows& rdv,
                             int device, cudaStream_t stream) {
  by_dim(a.d, a.dropout_p > 0, [&]<int D, bool Drop>() {
    const size_t smem = tf32::backward_smem(D, tf32::backward_rows<D>());
    EMBER_CUDA_CHECK(cudaMemsetAsync(dq, 0, static_cast<size_t>(a.n * a.tq * a.d) * sizeof(float), stream));
    allow_smem<tf32::backward_kernel<D, Drop>>(smem, device);
    const dim3 grid(static_cast<unsigned>(cuda::ceil_div(a.tk, tf32::kKeys)), static_cast<unsigned>(a.n));
    tf32::backward_kernel<D, Drop>
        <<<grid, tf32::kThreads, smem, stream>>>(a, q, rq, k, rk, v, rv, dout, rdo, lse, delta, dq, dk, rdk, dv, rdv);
    EMBER_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace ember
