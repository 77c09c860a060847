// CUDA launchers for fused attention (attention.cc has the op and the CPU
// kernel). A straightforward first version: one thread per query row for the
// forward (the row's max and sum in one online pass, then its output) and for
// dQ, one thread per key row for dK and dV, after a pass that stores each
// query row's log-sum-exp and dO . O. No [tq, tk] matrix is ever stored, as on
// the CPU; the rows are read from global memory without tiling into shared
// memory, so this is correct rather than fast (a tiled flash-attention kernel
// is the GPU-speed issue's). Dropout redraws the CPU's mask (Philox, the same
// element index), so both backends keep the same elements.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "core/cuda_check.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"
#include "core/ops/philox.h"

namespace ember {
namespace {

__device__ __forceinline__ int64_t keys_for(const AttentionArgs& a, int64_t i) {
  return a.causal ? (i + 1 < a.tk ? i + 1 : a.tk) : a.tk;
}

template <typename T>
__device__ __forceinline__ T drop(const AttentionArgs& a, int64_t b, int64_t i, int64_t j, T x) {
  if (a.dropout_p <= 0) return x;
  const int64_t idx = (b * a.tq + i) * a.tk + j;
  const bool keep = random_value(RandomKind::Bernoulli, idx, 0, 0, 1.0 - a.dropout_p, a.seed, a.offset) != 0.0;
  return keep ? x * static_cast<T>(1.0 / (1.0 - a.dropout_p)) : T(0);
}

template <typename T>
__device__ __forceinline__ T dot(const T* x, const T* y, int64_t n) {
  T s = 0;
  for (int64_t e = 0; e < n; ++e) s += x[e] * y[e];
  return s;
}

// Row i's max and sum of exp(s - max) over the keys it sees, in one pass.
template <typename T>
__device__ void row_stats(const AttentionArgs& a, const T* qi, const T* kb, int64_t lim, T& m, T& l) {
  m = -std::numeric_limits<T>::infinity();
  l = 0;
  for (int64_t j = 0; j < lim; ++j) {
    const T s = dot(qi, kb + j * a.d, a.d) * static_cast<T>(a.scale);
    if (s > m) {
      l = l * exp(m - s) + T(1);
      m = s;
    } else {
      l += exp(s - m);
    }
  }
}

template <typename T>
__global__ void forward_kernel(const AttentionArgs a, const T* __restrict__ q, const T* __restrict__ k,
                               const T* __restrict__ v, T* __restrict__ out) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= a.n * a.tq) return;
  const int64_t b = t / a.tq, i = t % a.tq, lim = keys_for(a, i);
  const T* qi = q + t * a.d;
  const T* kb = k + b * a.tk * a.d;
  const T* vb = v + b * a.tk * a.dv;
  T* oi = out + t * a.dv;
  T m, l;
  row_stats(a, qi, kb, lim, m, l);
  for (int64_t e = 0; e < a.dv; ++e) oi[e] = T(0);
  for (int64_t j = 0; j < lim; ++j) {
    const T p = drop(a, b, i, j, exp(dot(qi, kb + j * a.d, a.d) * static_cast<T>(a.scale) - m) / l);
    if (p == T(0)) continue;
    for (int64_t e = 0; e < a.dv; ++e) oi[e] += p * vb[j * a.dv + e];
  }
}

// Per query row: log-sum-exp of its scores and delta = dO . O.
template <typename T>
__global__ void stats_kernel(const AttentionArgs a, const T* __restrict__ q, const T* __restrict__ k,
                             const T* __restrict__ out, const T* __restrict__ dout, T* __restrict__ lse,
                             T* __restrict__ delta) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= a.n * a.tq) return;
  const int64_t b = t / a.tq, i = t % a.tq;
  T m, l;
  row_stats(a, q + t * a.d, k + b * a.tk * a.d, keys_for(a, i), m, l);
  lse[t] = m + log(l);
  delta[t] = dot(dout + t * a.dv, out + t * a.dv, a.dv);
}

// dS_ij = P_ij (dP_ij - delta_i) * scale, dP the gradient of the kept probabilities.
template <typename T>
__device__ __forceinline__ T grad_score(const AttentionArgs& a, int64_t b, int64_t i, int64_t j, const T* qi,
                                        const T* kj, const T* vj, const T* doi, T lse_i, T delta_i) {
  const T p = exp(dot(qi, kj, a.d) * static_cast<T>(a.scale) - lse_i);
  const T dp = drop(a, b, i, j, dot(doi, vj, a.dv));
  return p * (dp - delta_i) * static_cast<T>(a.scale);
}

template <typename T>
__global__ void dq_kernel(const AttentionArgs a, const T* __restrict__ q, const T* __restrict__ k,
                          const T* __restrict__ v, const T* __restrict__ dout, const T* __restrict__ lse,
                          const T* __restrict__ delta, T* __restrict__ dq) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= a.n * a.tq) return;
  const int64_t b = t / a.tq, i = t % a.tq, lim = keys_for(a, i);
  const T* kb = k + b * a.tk * a.d;
  const T* vb = v + b * a.tk * a.dv;
  T* dqi = dq + t * a.d;
  for (int64_t e = 0; e < a.d; ++e) dqi[e] = T(0);
  for (int64_t j = 0; j < lim; ++j) {
    const T ds = grad_score(a, b, i, j, q + t * a.d, kb + j * a.d, vb + j * a.dv, dout + t * a.dv, lse[t], delta[t]);
    for (int64_t e = 0; e < a.d; ++e) dqi[e] += ds * kb[j * a.d + e];
  }
}

template <typename T>
__global__ void dkv_kernel(const AttentionArgs a, const T* __restrict__ q, const T* __restrict__ k,
                           const T* __restrict__ v, const T* __restrict__ dout, const T* __restrict__ lse,
                           const T* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= a.n * a.tk) return;
  const int64_t b = t / a.tk, j = t % a.tk;
  const T* kj = k + t * a.d;
  const T* vj = v + t * a.dv;
  T* dkj = dk + t * a.d;
  T* dvj = dv + t * a.dv;
  for (int64_t e = 0; e < a.d; ++e) dkj[e] = T(0);
  for (int64_t e = 0; e < a.dv; ++e) dvj[e] = T(0);
  for (int64_t i = a.causal ? j : 0; i < a.tq; ++i) {
    const int64_t r = b * a.tq + i;
    const T* qi = q + r * a.d;
    const T* doi = dout + r * a.dv;
    const T p = drop(a, b, i, j, exp(dot(qi, kj, a.d) * static_cast<T>(a.scale) - lse[r]));
    for (int64_t e = 0; e < a.dv; ++e) dvj[e] += p * doi[e];
    const T ds = grad_score(a, b, i, j, qi, kj, vj, doi, lse[r], delta[r]);
    for (int64_t e = 0; e < a.d; ++e) dkj[e] += ds * qi[e];
  }
}

template <typename T>
void forward(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  cuda::DeviceGuard guard(q);
  cudaStream_t stream = cuda::stream_for(q);
  const int64_t rows = a.n * a.tq;
  forward_kernel<T>
      <<<cuda::grid_for(rows), cuda::kBlockSize, 0, stream>>>(a, q.data<T>(), k.data<T>(), v.data<T>(), out.data<T>());
  EMBER_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void backward(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
              const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  cuda::DeviceGuard guard(q);
  cudaStream_t stream = cuda::stream_for(q);
  const int64_t rows = a.n * a.tq, keys = a.n * a.tk;
  Tensor lse = Tensor::empty({rows}, q.options()), delta = Tensor::empty({rows}, q.options());
  stats_kernel<T><<<cuda::grid_for(rows), cuda::kBlockSize, 0, stream>>>(
      a, q.data<T>(), k.data<T>(), out.data<T>(), dout.data<T>(), lse.data<T>(), delta.data<T>());
  EMBER_CUDA_CHECK(cudaGetLastError());
  dq_kernel<T><<<cuda::grid_for(rows), cuda::kBlockSize, 0, stream>>>(
      a, q.data<T>(), k.data<T>(), v.data<T>(), dout.data<T>(), lse.data<T>(), delta.data<T>(), dq.data<T>());
  EMBER_CUDA_CHECK(cudaGetLastError());
  dkv_kernel<T><<<cuda::grid_for(keys), cuda::kBlockSize, 0, stream>>>(a, q.data<T>(), k.data<T>(), v.data<T>(),
                                                                       dout.data<T>(), lse.data<T>(), delta.data<T>(),
                                                                       dk.data<T>(), dv.data<T>());
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void attention_forward_cuda(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  if (q.dtype() == DType::Float64)
    forward<double>(a, q, k, v, out);
  else
    forward<float>(a, q, k, v, out);
}

void attention_backward_cuda(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  if (q.dtype() == DType::Float64)
    backward<double>(a, q, k, v, out, dout, dq, dk, dv);
  else
    backward<float>(a, q, k, v, out, dout, dq, dk, dv);
}

}  // namespace ember
