// CUDA launchers for fused attention (attention.cc has the op and the CPU
// kernel), the CPU kernel's algorithm on the GPU: blocks of query rows, for
// every head at once, through cuBLAS's strided-batched GEMMs. A block's
// scores (scale q k^T against the keys its last row may see) go to a
// bounded scratch ([heads, rows, keys], at most kScratch elements, so memory
// does not grow with T^2 beyond it), a warp per row turns them into
// probabilities (masked, then dropout), and one more GEMM gives the block's
// output. The backward recomputes each block's probabilities (no [T, T]
// tensor is saved) and forms dV, dP, dS, dQ and dK as the CPU does, dV and
// dK accumulated over the blocks by the GEMMs (beta 1). Dropout redraws the
// CPU's mask (Philox at the same element index), so both backends keep the
// same elements. The first version, one thread per query row reading
// global memory, spent 84% of a GPT step on an H200 here (52 ms a layer).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>

#include "core/cuda_check.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"
#include "core/ops/philox.h"

namespace ember {
namespace {

constexpr int64_t kScratch = int64_t{1} << 23;  // elements of one [heads, rows, keys] buffer
std::atomic<int64_t> scratch_override{0};       // set_attention_cuda_scratch
constexpr int kWarp = cuda::kWarpSize;
constexpr int kRowsPerBlock = cuda::kBlockSize / kWarp;

__host__ __device__ __forceinline__ int64_t keys_for(const AttentionArgs& a, int64_t i) {
  return a.causal ? (i + 1 < a.tk ? i + 1 : a.tk) : a.tk;
}

template <typename T>
__device__ __forceinline__ T drop(const AttentionArgs& a, int64_t b, int64_t i, int64_t j, T x) {
  const int64_t idx = (b * a.tq + i) * a.tk + j;
  const bool keep = random_value(RandomKind::Bernoulli, idx, 0, 0, 1.0 - a.dropout_p, a.seed, a.offset) != 0.0;
  return keep ? x * static_cast<T>(1.0 / (1.0 - a.dropout_p)) : T(0);
}

// One warp per row of a block (rows [i0, i0 + rows) of every head): s holds
// the row's scaled scores against keys [0, kmax). Writes the probabilities
// (zero past the row's last key) to p and their dropped copy to pd, either
// of which may be null or s itself.
template <typename T>
__global__ void probs_kernel(const AttentionArgs a, int64_t i0, int64_t rows, int64_t kmax, const T* s, T* p, T* pd) {
  const int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (w >= a.n * rows) return;  // whole warps leave together: blockDim is a multiple of 32
  const int64_t b = w / rows, i = i0 + w % rows, lim = keys_for(a, i);
  const T* row = s + w * kmax;
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t j = lane; j < lim; j += kWarp) m = fmax(m, row[j]);
  m = cuda::warp_max(m);
  T sum = 0;
  for (int64_t j = lane; j < lim; j += kWarp) sum += exp(row[j] - m);
  const T inv = T(1) / cuda::warp_sum(sum);
  for (int64_t j = lane; j < kmax; j += kWarp) {
    const T v = j < lim ? exp(row[j] - m) * inv : T(0);
    if (p) p[w * kmax + j] = v;
    if (pd) pd[w * kmax + j] = j < lim && a.dropout_p > 0 ? drop(a, b, i, j, v) : v;
  }
}

// delta_i = dO_i . O_i for every query row (warp per row).
template <typename T>
__global__ void delta_kernel(const AttentionArgs a, const T* __restrict__ out, const T* __restrict__ dout,
                             T* __restrict__ delta) {
  const int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (w >= a.n * a.tq) return;
  T acc = 0;
  for (int64_t e = lane; e < a.dv; e += kWarp) acc += out[w * a.dv + e] * dout[w * a.dv + e];
  acc = cuda::warp_sum(acc);
  if (lane == 0) delta[w] = acc;
}

// In place over the block's dP (gradient of the kept probabilities):
// dS = P (drop(dP) - delta) * scale, zero past each row's last key.
template <typename T>
__global__ void dscore_kernel(const AttentionArgs a, int64_t i0, int64_t rows, int64_t kmax, const T* __restrict__ p,
                              const T* __restrict__ delta, T* __restrict__ dp) {
  const int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (w >= a.n * rows) return;
  const int64_t b = w / rows, i = i0 + w % rows, lim = keys_for(a, i);
  const T di = delta[b * a.tq + i], scale = static_cast<T>(a.scale);
  for (int64_t j = lane; j < kmax; j += kWarp) {
    T g = dp[w * kmax + j];
    if (a.dropout_p > 0 && j < lim) g = drop(a, b, i, j, g);
    dp[w * kmax + j] = j < lim ? p[w * kmax + j] * (g - di) * scale : T(0);
  }
}

// C[h] = alpha op(A[h]) op(B[h]) + beta C[h] for every head h (row-major, as GemmArgs).
void bgemm(DType dt, int dev, int64_t heads, int64_t m, int64_t n, int64_t k, bool ta, bool tb, const void* a,
           int64_t lda, int64_t sa, const void* b, int64_t ldb, int64_t sb, void* c, int64_t ldc, int64_t sc,
           double alpha = 1.0, double beta = 0.0) {
  GemmArgs g{dt, heads, m, n, k, ta, tb, a, lda, sa, b, ldb, sb, c, ldc, sc};
  g.alpha = alpha;
  g.beta = beta;
  gemm_cuda(g, dev);
}

// Query rows per block: as many as keep one [heads, rows, tk] buffer within
// kScratch, a multiple of 64 when above it.
int64_t block_rows(const AttentionArgs& a) {
  const int64_t cap = scratch_override.load() > 0 ? scratch_override.load() : kScratch;
  int64_t r = std::clamp<int64_t>(cap / std::max<int64_t>(1, a.n * a.tk), 1, a.tq);
  return r > 64 ? r - r % 64 : r;
}

unsigned warp_grid(int64_t warps) { return static_cast<unsigned>(cuda::ceil_div(warps, kRowsPerBlock)); }

template <typename T>
void forward(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  cuda::DeviceGuard guard(q);
  cudaStream_t stream = cuda::stream_for(q);
  const int dev = q.device().index;
  const DType dt = q.dtype();
  const int64_t br = block_rows(a);
  Tensor s = Tensor::empty({a.n * std::min(br, a.tq) * a.tk}, q.options());
  for (int64_t i0 = 0; i0 < a.tq; i0 += br) {
    const int64_t i1 = std::min(i0 + br, a.tq), rows = i1 - i0, kmax = keys_for(a, i1 - 1);
    T* sp = s.data<T>();
    bgemm(dt, dev, a.n, rows, kmax, a.d, false, true, q.data<T>() + i0 * a.d, a.d, a.tq * a.d, k.data<T>(), a.d,
          a.tk * a.d, sp, kmax, rows * kmax, a.scale);
    probs_kernel<T><<<warp_grid(a.n * rows), cuda::kBlockSize, 0, stream>>>(a, i0, rows, kmax, sp, nullptr, sp);
    EMBER_CUDA_CHECK(cudaGetLastError());
    bgemm(dt, dev, a.n, rows, a.dv, kmax, false, false, sp, kmax, rows * kmax, v.data<T>(), a.dv, a.tk * a.dv,
          out.data<T>() + i0 * a.dv, a.dv, a.tq * a.dv);
  }
}

template <typename T>
void backward(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
              const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  cuda::DeviceGuard guard(q);
  cudaStream_t stream = cuda::stream_for(q);
  const int dev = q.device().index;
  const DType dt = q.dtype();
  const int64_t br = block_rows(a), scratch = a.n * std::min(br, a.tq) * a.tk;
  Tensor delta = Tensor::empty({a.n * a.tq}, q.options());
  delta_kernel<T>
      <<<warp_grid(a.n * a.tq), cuda::kBlockSize, 0, stream>>>(a, out.data<T>(), dout.data<T>(), delta.data<T>());
  EMBER_CUDA_CHECK(cudaGetLastError());
  // dK and dV sum over the query blocks (and a causal block's keys stop
  // early): start from zero, every GEMM adds.
  EMBER_CUDA_CHECK(cudaMemsetAsync(dk.raw_data(), 0, dk.numel() * sizeof(T), stream));
  EMBER_CUDA_CHECK(cudaMemsetAsync(dv.raw_data(), 0, dv.numel() * sizeof(T), stream));
  Tensor p = Tensor::empty({scratch}, q.options()), dp = Tensor::empty({scratch}, q.options());
  Tensor pd = a.dropout_p > 0 ? Tensor::empty({scratch}, q.options()) : p;
  for (int64_t i0 = 0; i0 < a.tq; i0 += br) {
    const int64_t i1 = std::min(i0 + br, a.tq), rows = i1 - i0, kmax = keys_for(a, i1 - 1);
    const int64_t ld = rows * kmax;
    T *pp = p.data<T>(), *pdp = pd.data<T>(), *dpp = dp.data<T>();
    const T* qb = q.data<T>() + i0 * a.d;
    const T* dob = dout.data<T>() + i0 * a.dv;
    bgemm(dt, dev, a.n, rows, kmax, a.d, false, true, qb, a.d, a.tq * a.d, k.data<T>(), a.d, a.tk * a.d, pp, kmax, ld,
          a.scale);
    probs_kernel<T><<<warp_grid(a.n * rows), cuda::kBlockSize, 0, stream>>>(a, i0, rows, kmax, pp, pp,
                                                                            a.dropout_p > 0 ? pdp : nullptr);
    EMBER_CUDA_CHECK(cudaGetLastError());
    // dV += P_drop^T dO; dP_drop = dO V^T.
    bgemm(dt, dev, a.n, kmax, a.dv, rows, true, false, pdp, kmax, ld, dob, a.dv, a.tq * a.dv, dv.data<T>(), a.dv,
          a.tk * a.dv, 1.0, 1.0);
    bgemm(dt, dev, a.n, rows, kmax, a.dv, false, true, dob, a.dv, a.tq * a.dv, v.data<T>(), a.dv, a.tk * a.dv, dpp,
          kmax, ld);
    dscore_kernel<T>
        <<<warp_grid(a.n * rows), cuda::kBlockSize, 0, stream>>>(a, i0, rows, kmax, pp, delta.data<T>(), dpp);
    EMBER_CUDA_CHECK(cudaGetLastError());
    // dQ = dS K; dK += dS^T Q.
    bgemm(dt, dev, a.n, rows, a.d, kmax, false, false, dpp, kmax, ld, k.data<T>(), a.d, a.tk * a.d,
          dq.data<T>() + i0 * a.d, a.d, a.tq * a.d);
    bgemm(dt, dev, a.n, kmax, a.d, rows, true, false, dpp, kmax, ld, qb, a.d, a.tq * a.d, dk.data<T>(), a.d, a.tk * a.d,
          1.0, 1.0);
  }
}

// ---- The fused ("flash") kernels: 16-bit q, k, v on tensor cores ----
//
// FlashAttention-2's schedule (Dao, 2023) on mma.sync: a block of 4 warps
// takes 64 query rows (16 a warp, q's fragments held in registers) and
// walks the keys in tiles of 64 staged in shared memory; scores never leave
// registers, the softmax is online (running max and sum per row, the output
// rescaled when the max moves), probabilities become the A operand of P V
// without a trip through memory, and the output is written once, with the
// row's log-sum-exp for the backward. The backward gives each block 64 keys
// (dK and dV accumulate in registers), walks the query tiles that can see
// them, recomputes P from the saved log-sum-exp, and adds its share of dQ
// with float atomics (FlashAttention-2's dQ accumulator). Dropout redraws
// the CPU's Philox mask element by element. Operands are rounded to the
// input's 16-bit type before each product (P and dS too, as FlashAttention
// does); sums are float32.
namespace flash {

constexpr int kRows = 64;  // query rows per block: 4 warps x 16
constexpr int kKeys = 64;  // keys per shared-memory tile
constexpr int kThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;

std::atomic<bool> enabled{[] {
  const char* e = std::getenv("EMBER_FLASH_ATTENTION");
  return !(e && e[0] == '0');
}()};
std::atomic<int64_t> launches{0};

__device__ __forceinline__ uint32_t ld32(const uint16_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ uint32_t two(uint16_t lo, uint16_t hi) { return lo | (static_cast<uint32_t>(hi) << 16); }

// Rows [r0, r0 + n) of a [t, D] matrix into a shared tile of row stride D + 8
// (the padding spreads a fragment load's 32 lanes over distinct banks),
// zeros past row t; 16-byte copies.
template <int D>
__device__ __forceinline__ void load_tile(const uint16_t* __restrict__ src, int64_t r0, int64_t t, int n,
                                          uint16_t* dst) {
  constexpr int kVec = D / 8;
  for (int idx = threadIdx.x; idx < n * kVec; idx += kThreads) {
    const int r = idx / kVec, c = (idx % kVec) * 8;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r0 + r < t) val = *reinterpret_cast<const uint4*>(src + (r0 + r) * D + c);
    *reinterpret_cast<uint4*>(dst + r * (D + 8) + c) = val;
  }
}

// B fragment (k x n = 16 x 8) read down the columns of a row-major tile:
// B(kk, nn) = tile[(k0 + kk) * ld + n0 + nn], the transposed read that
// P V, dK and dQ need (two 16-bit loads a register).
__device__ __forceinline__ void b_down(const uint16_t* tile, int ld, int k0, int n0, int g, int t, uint32_t b[2]) {
  const uint16_t* p = tile + (k0 + 2 * t) * ld + n0 + g;
  b[0] = two(p[0], p[ld]);
  b[1] = two(p[8 * ld], p[9 * ld]);
}
// B fragment along rows: B(kk, nn) = tile[(n0 + nn) * ld + k0 + kk] (q k^T).
__device__ __forceinline__ void b_across(const uint16_t* tile, int ld, int k0, int n0, int g, int t, uint32_t b[2]) {
  const uint16_t* p = tile + (n0 + g) * ld + k0 + 2 * t;
  b[0] = ld32(p);
  b[1] = ld32(p + 8);
}
// A fragment (16 x 16) from rows m0.. of a row-major tile.
__device__ __forceinline__ void a_rows(const uint16_t* tile, int ld, int m0, int k0, int g, int t, uint32_t a[4]) {
  const uint16_t* p = tile + (m0 + g) * ld + k0 + 2 * t;
  a[0] = ld32(p);
  a[1] = ld32(p + 8 * ld);
  a[2] = ld32(p + 8);
  a[3] = ld32(p + 8 * ld + 8);
}
// Accumulator tiles nt = 2 kk and 2 kk + 1 (16 x 16) as the A operand of the
// next product, rounded to T.
template <typename T>
__device__ __forceinline__ void c_to_a(const float c0[4], const float c1[4], uint32_t a[4]) {
  a[0] = cuda::pack16<T>(c0[0], c0[1]);
  a[1] = cuda::pack16<T>(c0[2], c0[3]);
  a[2] = cuda::pack16<T>(c1[0], c1[1]);
  a[3] = cuda::pack16<T>(c1[2], c1[3]);
}

__device__ __forceinline__ bool kept(const AttentionArgs& a, int64_t b, int64_t i, int64_t j) {
  const int64_t idx = (b * a.tq + i) * a.tk + j;
  return random_value(RandomKind::Bernoulli, idx, 0, 0, 1.0 - a.dropout_p, a.seed, a.offset) != 0.0;
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// grid (query blocks, heads); out [n, tq, D] in T, lse [n, tq] (natural log
// of each row's sum of exp(scale q.k)).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    flash_forward_kernel(const AttentionArgs a, const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                         const uint16_t* __restrict__ v, uint16_t* __restrict__ out, float* __restrict__ lse) {
  constexpr int LD = D + 8, NT = kKeys / 8, DT = D / 8;
  extern __shared__ uint4 flash_smem[];
  uint16_t* ks = reinterpret_cast<uint16_t*>(flash_smem);
  uint16_t* vs = ks + kKeys * LD;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t b = blockIdx.y, i0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t row[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};
  const uint16_t* qb = q + b * a.tq * D;
  const uint16_t* kb = k + b * a.tk * D;
  const uint16_t* vb = v + b * a.tk * D;
  uint32_t qa[D / 16][4];
  for (int kk = 0; kk < D / 16; ++kk)
    for (int r = 0; r < 4; ++r) {
      const int64_t i = row[r % 2];
      qa[kk][r] = i < a.tq ? ld32(qb + i * D + kk * 16 + 2 * t + 8 * (r / 2)) : 0u;
    }
  const float sl = static_cast<float>(a.scale) * kLog2e;  // scores in log2 units: exp2 is one instruction
  const float keep_scale = a.dropout_p > 0 ? static_cast<float>(1.0 / (1.0 - a.dropout_p)) : 1.f;
  float o[DT][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int64_t last = (i0 + kRows < a.tq ? i0 + kRows : a.tq) - 1;
  const int64_t kend = a.causal && last + 1 < a.tk ? last + 1 : a.tk;
  for (int64_t j0 = 0; j0 < kend; j0 += kKeys) {
    __syncthreads();  // the last tile's readers are done
    load_tile<D>(kb, j0, a.tk, kKeys, ks);
    load_tile<D>(vb, j0, a.tk, kKeys, vs);
    __syncthreads();
    float s[NT][4] = {};
    for (int kk = 0; kk < D / 16; ++kk)
      for (int nt = 0; nt < NT; ++nt) {
        uint32_t bb[2];
        b_across(ks, LD, kk * 16, nt * 8, g, t, bb);
        cuda::mma_16816<T>(s[nt], qa[kk], bb);
      }
    float mx[2] = {-INFINITY, -INFINITY};
    for (int nt = 0; nt < NT; ++nt)
      for (int e = 0; e < 4; ++e) {
        const int64_t j = j0 + nt * 8 + 2 * t + e % 2, i = row[e / 2];
        const bool ok = j < a.tk && (!a.causal || j <= i);
        s[nt][e] = ok ? s[nt][e] * sl : -INFINITY;
        mx[e / 2] = fmaxf(mx[e / 2], s[nt][e]);
      }
    float base[2], alpha[2];
    for (int h = 0; h < 2; ++h) {
      const float mn = fmaxf(m[h], quad_max(mx[h]));
      base[h] = mn == -INFINITY ? 0.f : mn;  // a row with no key yet: exp2(-inf) = 0, not NaN
      alpha[h] = exp2f(m[h] - base[h]);
      m[h] = mn;
      l[h] *= alpha[h];
    }
    for (int nt = 0; nt < NT; ++nt)
      for (int e = 0; e < 4; ++e) {
        const float p = exp2f(s[nt][e] - base[e / 2]);
        l[e / 2] += p;  // the lane's share; the quad adds up at the end
        s[nt][e] = p;
        if (a.dropout_p > 0) {
          const int64_t j = j0 + nt * 8 + 2 * t + e % 2, i = row[e / 2];
          s[nt][e] = i < a.tq && j < a.tk && kept(a, b, i, j) ? p * keep_scale : 0.f;
        }
      }
    for (int nt = 0; nt < DT; ++nt)
      o[nt][0] *= alpha[0], o[nt][1] *= alpha[0], o[nt][2] *= alpha[1], o[nt][3] *= alpha[1];
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      uint32_t pa[4];
      c_to_a<T>(s[2 * kk], s[2 * kk + 1], pa);
      for (int nt = 0; nt < DT; ++nt) {
        uint32_t bb[2];
        b_down(vs, LD, kk * 16, nt * 8, g, t, bb);
        cuda::mma_16816<T>(o[nt], pa, bb);
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    l[h] = quad_sum(l[h]);
    const int64_t i = row[h];
    if (i >= a.tq) continue;
    const float inv = 1.f / l[h];
    uint16_t* orow = out + (b * a.tq + i) * D;
    for (int nt = 0; nt < DT; ++nt)
      *reinterpret_cast<uint32_t*>(orow + nt * 8 + 2 * t) = cuda::pack16<T>(o[nt][2 * h] * inv, o[nt][2 * h + 1] * inv);
    if (t == 0) lse[b * a.tq + i] = (m[h] + log2f(l[h])) / kLog2e;
  }
}

// delta_i = dO_i . O_i in float32 from 16-bit O and dO (warp per row).
template <typename T>
__global__ void flash_delta_kernel(int64_t rows, int64_t d, const T* __restrict__ out, const T* __restrict__ dout,
                                   float* __restrict__ delta) {
  const int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (w >= rows) return;
  float acc = 0;
  for (int64_t e = lane; e < d; e += kWarp)
    acc += static_cast<float>(out[w * d + e]) * static_cast<float>(dout[w * d + e]);
  acc = cuda::warp_sum(acc);
  if (lane == 0) delta[w] = acc;
}

// grid (key blocks, heads). dk, dv [n, tk, D] float32 written; dq [n, tq, D]
// float32 added to (zeroed by the launcher).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    flash_backward_kernel(const AttentionArgs a, const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                          const uint16_t* __restrict__ v, const uint16_t* __restrict__ dout,
                          const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dq,
                          float* __restrict__ dk, float* __restrict__ dv) {
  constexpr int LD = D + 8, LDS = kKeys + 8, NT = kRows / 8, DT = D / 8;
  extern __shared__ uint4 flash_smem[];
  uint16_t* qs = reinterpret_cast<uint16_t*>(flash_smem);
  uint16_t* dos = qs + kRows * LD;
  uint16_t* ks = dos + kRows * LD;
  uint16_t* vs = ks + kKeys * LD;
  uint16_t* dss = vs + kKeys * LD;  // dS of the tile as [query][key]
  float* ls = reinterpret_cast<float*>(dss + kRows * LDS);
  float* dl = ls + kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t b = blockIdx.y, j0 = static_cast<int64_t>(blockIdx.x) * kKeys;
  const int64_t key[2] = {j0 + warp * 16 + g, j0 + warp * 16 + g + 8};
  const uint16_t* qb = q + b * a.tq * D;
  const uint16_t* dob = dout + b * a.tq * D;
  load_tile<D>(k + b * a.tk * D, j0, a.tk, kKeys, ks);
  load_tile<D>(v + b * a.tk * D, j0, a.tk, kKeys, vs);
  const float sl = static_cast<float>(a.scale) * kLog2e, scale = static_cast<float>(a.scale);
  const float keep_scale = a.dropout_p > 0 ? static_cast<float>(1.0 / (1.0 - a.dropout_p)) : 1.f;
  float dva[DT][4] = {}, dka[DT][4] = {};
  // Causal: only query rows i >= j0 see these keys (kRows == kKeys).
  for (int64_t i0 = a.causal ? j0 : 0; i0 < a.tq; i0 += kRows) {
    __syncthreads();  // the last tile's readers are done
    load_tile<D>(qb, i0, a.tq, kRows, qs);
    load_tile<D>(dob, i0, a.tq, kRows, dos);
    for (int r = threadIdx.x; r < kRows; r += kThreads) {
      const int64_t i = i0 + r;
      ls[r] = i < a.tq ? lse[b * a.tq + i] * kLog2e : INFINITY;
      dl[r] = i < a.tq ? delta[b * a.tq + i] : 0.f;
    }
    __syncthreads();
    // S^T = K Q^T for the warp's 16 keys against the tile's 64 queries.
    float st[NT][4] = {};
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ka[4];
      a_rows(ks, LD, warp * 16, kk * 16, g, t, ka);
      for (int nt = 0; nt < NT; ++nt) {
        uint32_t bb[2];
        b_across(qs, LD, kk * 16, nt * 8, g, t, bb);
        cuda::mma_16816<T>(st[nt], ka, bb);
      }
    }
    // P^T from the saved log-sum-exp; pd its dropped copy; mask bit e of nt
    // kept for dS.
    float pd[NT][4];
    uint32_t keep = 0xffffffffu;
    for (int nt = 0; nt < NT; ++nt)
      for (int e = 0; e < 4; ++e) {
        const int c = nt * 8 + 2 * t + e % 2;
        const int64_t i = i0 + c, j = key[e / 2];
        const bool ok = j < a.tk && i < a.tq && (!a.causal || j <= i);
        const float p = ok ? exp2f(st[nt][e] * sl - ls[c]) : 0.f;
        st[nt][e] = p;
        pd[nt][e] = p * keep_scale;
        if (a.dropout_p > 0 && ok && !kept(a, b, i, j)) {
          pd[nt][e] = 0.f;
          keep &= ~(1u << (nt * 4 + e));
        }
      }
    // dV += Pd^T dO.
    for (int kk = 0; kk < kRows / 16; ++kk) {
      uint32_t pa[4];
      c_to_a<T>(pd[2 * kk], pd[2 * kk + 1], pa);
      for (int nt = 0; nt < DT; ++nt) {
        uint32_t bb[2];
        b_down(dos, LD, kk * 16, nt * 8, g, t, bb);
        cuda::mma_16816<T>(dva[nt], pa, bb);
      }
    }
    // dPd^T = V dO^T (into pd, free now).
    for (int nt = 0; nt < NT; ++nt) pd[nt][0] = pd[nt][1] = pd[nt][2] = pd[nt][3] = 0.f;
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t va[4];
      a_rows(vs, LD, warp * 16, kk * 16, g, t, va);
      for (int nt = 0; nt < NT; ++nt) {
        uint32_t bb[2];
        b_across(dos, LD, kk * 16, nt * 8, g, t, bb);
        cuda::mma_16816<T>(pd[nt], va, bb);
      }
    }
    // dS^T = P^T (dP^T - delta) scale, dP = the kept dPd scaled; into st.
    for (int nt = 0; nt < NT; ++nt)
      for (int e = 0; e < 4; ++e) {
        const int c = nt * 8 + 2 * t + e % 2;
        const float dp = (keep >> (nt * 4 + e)) & 1u ? pd[nt][e] * keep_scale : 0.f;
        st[nt][e] = st[nt][e] * (dp - dl[c]) * scale;
        dss[c * LDS + warp * 16 + g + 8 * (e / 2)] = T::from_float(st[nt][e]);
      }
    // dK += dS^T Q.
    for (int kk = 0; kk < kRows / 16; ++kk) {
      uint32_t da[4];
      c_to_a<T>(st[2 * kk], st[2 * kk + 1], da);
      for (int nt = 0; nt < DT; ++nt) {
        uint32_t bb[2];
        b_down(qs, LD, kk * 16, nt * 8, g, t, bb);
        cuda::mma_16816<T>(dka[nt], da, bb);
      }
    }
    __syncthreads();  // every warp's dS is in dss
    // dQ += dS K for the warp's 16 query rows, against all 64 keys.
    float dqa[DT][4] = {};
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      uint32_t da[4];
      a_rows(dss, LDS, warp * 16, kk * 16, g, t, da);
      for (int nt = 0; nt < DT; ++nt) {
        uint32_t bb[2];
        b_down(ks, LD, kk * 16, nt * 8, g, t, bb);
        cuda::mma_16816<T>(dqa[nt], da, bb);
      }
    }
    for (int e = 0; e < 4; ++e) {
      const int64_t i = i0 + warp * 16 + g + 8 * (e / 2);
      if (i >= a.tq) continue;
      float* dqrow = dq + (b * a.tq + i) * D + 2 * t + e % 2;
      for (int nt = 0; nt < DT; ++nt) atomicAdd(dqrow + nt * 8, dqa[nt][e]);
    }
  }
  for (int e = 0; e < 4; ++e) {
    const int64_t j = key[e / 2];
    if (j >= a.tk) continue;
    const int64_t off = (b * a.tk + j) * D + 2 * t + e % 2;
    for (int nt = 0; nt < DT; ++nt) dk[off + nt * 8] = dka[nt][e], dv[off + nt * 8] = dva[nt][e];
  }
}

const uint16_t* bits(const Tensor& t) { return static_cast<const uint16_t*>(t.raw_data()); }
uint16_t* bits(Tensor& t) { return static_cast<uint16_t*>(t.raw_data()); }

template <typename T, int D>
void forward(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse) {
  cuda::DeviceGuard guard(q);
  const size_t smem = 2 * kKeys * (D + 8) * sizeof(uint16_t);
  const dim3 grid(static_cast<unsigned>(cuda::ceil_div(a.tq, kRows)), static_cast<unsigned>(a.n));
  flash_forward_kernel<T, D>
      <<<grid, kThreads, smem, cuda::stream_for(q)>>>(a, bits(q), bits(k), bits(v), bits(out), lse.data<float>());
  EMBER_CUDA_CHECK(cudaGetLastError());
  launches.fetch_add(1);
}

template <typename T, int D>
void backward(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
              const Tensor& dout, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv) {
  cuda::DeviceGuard guard(q);
  cudaStream_t stream = cuda::stream_for(q);
  Tensor delta = Tensor::empty({a.n * a.tq}, {DType::Float32, q.device()});
  flash_delta_kernel<T><<<warp_grid(a.n * a.tq), cuda::kBlockSize, 0, stream>>>(a.n * a.tq, D, out.data<T>(),
                                                                                dout.data<T>(), delta.data<float>());
  EMBER_CUDA_CHECK(cudaGetLastError());
  EMBER_CUDA_CHECK(cudaMemsetAsync(dq.raw_data(), 0, dq.numel() * sizeof(float), stream));
  const size_t smem =
      (2 * kRows * (D + 8) + 2 * kKeys * (D + 8) + kRows * (kKeys + 8)) * sizeof(uint16_t) + 2 * kRows * sizeof(float);
  // Above 48 KiB a kernel must opt in, once per device.
  static std::atomic<uint32_t> opted_in{0};
  const uint32_t bit = 1u << (q.device().index % 32);
  if (!(opted_in.load() & bit)) {
    void (*fn)(AttentionArgs, const uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, const float*,
               const float*, float*, float*, float*) = flash_backward_kernel<T, D>;
    EMBER_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(fn),
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    opted_in.fetch_or(bit);
  }
  const dim3 grid(static_cast<unsigned>(cuda::ceil_div(a.tk, kKeys)), static_cast<unsigned>(a.n));
  flash_backward_kernel<T, D><<<grid, kThreads, smem, stream>>>(a, bits(q), bits(k), bits(v), bits(dout),
                                                                lse.data<float>(), delta.data<float>(),
                                                                dq.data<float>(), dk.data<float>(), dv.data<float>());
  EMBER_CUDA_CHECK(cudaGetLastError());
  launches.fetch_add(1);
}

// Calls f.template operator()<T, D>() for the tensor's 16-bit type and head dim.
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
  else
    by_dim(Half{});
}

}  // namespace flash

}  // namespace

void set_attention_cuda_scratch(int64_t elements) { scratch_override.store(elements); }

void attention_forward_cuda(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  if (a.n * a.tq == 0) return;
  if (q.dtype() == DType::Float64)
    forward<double>(a, q, k, v, out);
  else
    forward<float>(a, q, k, v, out);
}

void attention_backward_cuda(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  if (a.n * a.tq == 0) return;
  if (q.dtype() == DType::Float64)
    backward<double>(a, q, k, v, out, dout, dq, dk, dv);
  else
    backward<float>(a, q, k, v, out, dout, dq, dk, dv);
}

bool attention_flash_cuda_supports(const AttentionArgs& a, DType dt) {
  return flash::enabled.load() && (dt == DType::BFloat16 || dt == DType::Float16) && a.d == a.dv &&
         (a.d == 32 || a.d == 64 || a.d == 128) && a.n > 0 && a.n <= 65535 && a.tq > 0 && a.tk > 0;
}

void set_attention_cuda_flash(bool on) { flash::enabled.store(on); }
int64_t attention_cuda_flash_launches() { return flash::launches.load(); }

namespace {
// The kernels read 16-byte vectors: a view that starts off that alignment
// (an offset into its storage) is copied first.
Tensor aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0 ? t : t.clone(); }
}  // namespace

void attention_flash_forward_cuda(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v,
                                  Tensor& out, Tensor& lse) {
  EMBER_INTERNAL_ASSERT(attention_flash_cuda_supports(a, q.dtype()), "flash attention: unsupported ", q.dtype(), " d ",
                        a.d, " dv ", a.dv);
  const Tensor qa = aligned16(q), ka = aligned16(k), va = aligned16(v);
  flash::dispatch(q.dtype(), a.d, [&]<typename T, int D>() { flash::forward<T, D>(a, qa, ka, va, out, lse); });
}

void attention_flash_backward_cuda(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& out, const Tensor& dout, const Tensor& lse, Tensor& dq, Tensor& dk,
                                   Tensor& dv) {
  EMBER_INTERNAL_ASSERT(attention_flash_cuda_supports(a, q.dtype()), "flash attention: unsupported ", q.dtype(), " d ",
                        a.d, " dv ", a.dv);
  const Tensor qa = aligned16(q), ka = aligned16(k), va = aligned16(v), da = aligned16(dout);
  flash::dispatch(q.dtype(), a.d,
                  [&]<typename T, int D>() { flash::backward<T, D>(a, qa, ka, va, out, da, lse, dq, dk, dv); });
}

}  // namespace ember
