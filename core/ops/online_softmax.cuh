// The online softmax statistics (Milakov & Gimelshein, 2018) shared by the
// kernels that reduce a row to its max and sum of exponentials in one pass
// (softmax.cu, cross_entropy.cu): each thread keeps a running (max, sum of
// exp(x - max)), rescales the sum when the max grows, and partial pairs
// merge the same way. A -inf element adds nothing; a NaN or +inf makes the
// sum NaN, as the CPU's two-pass kernels give.
#pragma once

#include <limits>

#include "core/ops/cuda_utils.cuh"
#include "core/ops/elementwise_fns.h"

namespace ember::cuda {

template <typename C>
struct MaxSum {
  C m;  // running max
  C s;  // sum of exp(x - m)
};

template <typename C>
__device__ __forceinline__ MaxSum<C> ms_identity() {
  return {-std::numeric_limits<C>::infinity(), C(0)};
}

template <typename C>
__device__ __forceinline__ void ms_add(MaxSum<C>& a, C x) {
  if (x > a.m) {
    // The new max contributes exp(x - x): 1, except NaN for x = +inf, which
    // is what the two-pass CPU kernel gets too (inf - inf).
    a.s = a.s * m_exp(a.m - x) + (C(1) + (x - x));
    a.m = x;
  } else if (x != -std::numeric_limits<C>::infinity()) {  // -inf - -inf would be NaN
    a.s += m_exp(x - a.m);
  }
}

template <typename C>
__device__ __forceinline__ MaxSum<C> ms_merge(MaxSum<C> a, MaxSum<C> b) {
  const C m = a.m > b.m ? a.m : b.m;
  // An empty partial (s == 0) may have m == -inf; skip it rather than form
  // exp(-inf - -inf).
  const C s = (a.s == C(0) ? C(0) : a.s * m_exp(a.m - m)) + (b.s == C(0) ? C(0) : b.s * m_exp(b.m - m));
  return {m, s};
}

template <typename C>
__device__ __forceinline__ MaxSum<C> ms_warp_allreduce(MaxSum<C> v) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask /= 2)
    v = ms_merge(v, MaxSum<C>{shfl_xor(v.m, mask), shfl_xor(v.s, mask)});
  return v;
}

}  // namespace ember::cuda
