// CUDA launchers for fused attention (attention.cc has the op and the CPU
// kernel; attention_flash.cu the tensor-core kernels 16-bit inputs take),
// the CPU kernel's algorithm on the GPU: blocks of query rows, for
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
#include "core/device.h"
#include "core/ops/attention.cuh"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"

namespace ember {
namespace {

constexpr int64_t kScratch = int64_t{1} << 23;  // elements of one [heads, rows, keys] buffer
std::atomic<int64_t> scratch_override{0};       // set_attention_cuda_scratch
using attention_cuda::delta_kernel;
using attention_cuda::kept;
using attention_cuda::kWarp;
using attention_cuda::Rows;
using attention_cuda::warp_grid;

__host__ __device__ __forceinline__ int64_t keys_for(const AttentionArgs& a, int64_t i) {
  return a.causal ? (i + 1 < a.tk ? i + 1 : a.tk) : a.tk;
}

template <typename T>
__device__ __forceinline__ T drop(const AttentionArgs& a, int64_t b, int64_t i, int64_t j, T x) {
  return kept(a, b, i, j) ? x * static_cast<T>(1.0 / (1.0 - a.dropout_p)) : T(0);
}

// One warp per row of a block (rows [i0, i0 + rows) of every head): s holds
// the row's scaled scores against keys [0, kmax). Writes the probabilities
// (zero past the row's last key) to p and their dropped copy to pd, either
// of which may be null or s itself.
template <typename T>
__global__ void probs_kernel(const AttentionArgs a, int64_t i0, int64_t rows, int64_t kmax, const T* s, T* p, T* pd,
                             T* lse) {
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
  const T total = cuda::warp_sum(sum), inv = T(1) / total;
  if (lse && lane == 0) lse[b * a.tq + i] = m + log(total);
  for (int64_t j = lane; j < kmax; j += kWarp) {
    const T v = j < lim ? exp(row[j] - m) * inv : T(0);
    if (p) p[w * kmax + j] = v;
    if (pd) pd[w * kmax + j] = j < lim && a.dropout_p > 0 ? drop(a, b, i, j, v) : v;
  }
}

// [n, t, d] contiguous.
Rows dense_rows(int64_t t, int64_t d) {
  Rows r;
  r.s0 = t * d;
  r.row = static_cast<int>(d);
  return r;
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

template <typename T>
void forward(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor* lse) {
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
    probs_kernel<T><<<warp_grid(a.n * rows), cuda::kBlockSize, 0, stream>>>(a, i0, rows, kmax, sp, nullptr, sp,
                                                                            lse ? lse->data<T>() : nullptr);
    EMBER_CUDA_CHECK(cudaGetLastError());
    bgemm(dt, dev, a.n, rows, a.dv, kmax, false, false, sp, kmax, rows * kmax, v.data<T>(), a.dv, a.tk * a.dv,
          out.data<T>() + i0 * a.dv, a.dv, a.tq * a.dv);
  }
}

template <typename T>
void backward(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
              const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const Tensor* dlse) {
  cuda::DeviceGuard guard(q);
  cudaStream_t stream = cuda::stream_for(q);
  const int dev = q.device().index;
  const DType dt = q.dtype();
  const int64_t br = block_rows(a), scratch = a.n * std::min(br, a.tq) * a.tk;
  Tensor delta = Tensor::empty({a.n * a.tq}, q.options());
  const Rows rows = dense_rows(a.tq, a.dv);
  delta_kernel<T, T><<<warp_grid(a.n * a.tq), cuda::kBlockSize, 0, stream>>>(
      a.n * a.tq, a.tq, a.dv, out.data<T>(), rows, dout.data<T>(), rows, dlse ? dlse->data<T>() : nullptr,
      delta.data<T>());
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
                                                                            a.dropout_p > 0 ? pdp : nullptr, nullptr);
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

}  // namespace

void set_attention_cuda_scratch(int64_t elements) { scratch_override.store(elements); }

void attention_forward_cuda(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                            Tensor* lse) {
  if (a.n * a.tq == 0) return;
  if (q.dtype() == DType::Float64)
    forward<double>(a, q, k, v, out, lse);
  else
    forward<float>(a, q, k, v, out, lse);
}

void attention_backward_cuda(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                             const Tensor* dlse) {
  if (a.n * a.tq == 0) return;
  if (q.dtype() == DType::Float64)
    backward<double>(a, q, k, v, out, dout, dq, dk, dv, dlse);
  else
    backward<float>(a, q, k, v, out, dout, dq, dk, dv, dlse);
}

}  // namespace ember
