// The CPU strided loop every elementwise kernel uses: splits [0, numel) into
// one range per OpenMP thread (only when the work is big enough to pay for
// the fork) and calls `inner(ptrs, strides, n)` on runs along the innermost
// dim, so kernels write one tight loop and a contiguous fast path.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "core/ops/kernels.h"

namespace ember {

constexpr int64_t kParallelGrain = 32768;

// Float sums run in blocks of kSumBlock terms, each block's float sum
// carried into a double (reduce.cc's sums, softmax's sum of exponentials):
// a float accumulator's error grows with the number of terms it has taken
// (a sequential float sum of 10^4 positive terms was 4.5e-5 off, in a build
// that did not vectorize; a column sum over 10^5 rows 1.3e-5; softmax over
// a 50k-wide row 5.7e-6), and a block bounds it at kSumBlock terms at a
// cost too small to measure (docs/design.md, Note [numerics]).
constexpr int64_t kSumBlock = 256;

inline int threads_for(int64_t work) {
  if (work < kParallelGrain) return 1;
  return static_cast<int>(std::min<int64_t>(omp_get_max_threads(), work / kParallelGrain));
}

// Runs f(begin, end) over [0, n) split across threads.
template <typename F>
void parallel_for(int64_t n, int64_t grain, F&& f) {
  int nt = n < grain ? 1 : static_cast<int>(std::min<int64_t>(omp_get_max_threads(), n / grain));
  if (nt <= 1) {
    f(int64_t{0}, n);
    return;
  }
#pragma omp parallel num_threads(nt)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t b = n * t / T, e = n * (t + 1) / T;
    if (b < e) f(b, e);
  }
}

template <typename Inner>
void cpu_loop(const StridedIter& it, Inner&& inner) {
  if (it.numel == 0) return;
  const int nd = it.ndim, nops = it.nops;
  int64_t elsize[kMaxOperands], inner_stride[kMaxOperands];
  for (int o = 0; o < nops; ++o) {
    elsize[o] = static_cast<int64_t>(dtype_size(it.dtypes[o]));
    inner_stride[o] = it.strides[o][nd - 1];
  }
  auto run_range = [&](int64_t begin, int64_t end) {
    int64_t coord[kMaxDims];
    int64_t rem = begin;
    for (int d = nd - 1; d >= 0; --d) {
      coord[d] = rem % it.sizes[d];
      rem /= it.sizes[d];
    }
    char* ptr[kMaxOperands];
    while (begin < end) {
      for (int o = 0; o < nops; ++o) {
        int64_t off = 0;
        for (int d = 0; d < nd; ++d) off += coord[d] * it.strides[o][d];
        ptr[o] = it.data[o] + off * elsize[o];
      }
      int64_t n = std::min(it.sizes[nd - 1] - coord[nd - 1], end - begin);
      inner(ptr, inner_stride, n);
      begin += n;
      coord[nd - 1] += n;
      for (int d = nd - 1; d > 0 && coord[d] == it.sizes[d]; --d) {
        coord[d] = 0;
        coord[d - 1]++;
      }
    }
  };
  parallel_for(it.numel, kParallelGrain, run_range);
}

}  // namespace ember
