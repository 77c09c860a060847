// CUDA launcher for softmax and log_softmax over the middle axis of a
// contiguous [outer, r, inner] tensor, computed in acc_t<T> (float for 16-bit
// inputs). The row max and the sum of exp(x - max) come from one "online"
// pass (Milakov & Gimelshein, 2018): each thread keeps a running (max, sum)
// and rescales the sum when the max grows, and partial pairs merge the same
// way, so the input is read twice (stats, then output) instead of three
// times. A -inf element adds nothing; a NaN or +inf anywhere in a row, or a
// row of only -inf, makes the row NaN, as softmax.cc's two-pass kernel does.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/cuda_check.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/elementwise_fns.h"
#include "core/ops/kernels.h"
#include "core/ops/online_softmax.cuh"

namespace ember {
namespace {

using cuda::MaxSum;
using cuda::ms_add;
using cuda::ms_identity;
using cuda::ms_merge;
using cuda::ms_warp_allreduce;
using cuda::VecN;

template <typename C>
__device__ __forceinline__ C softmax_out(C x, MaxSum<C> st, bool log) {
  return log ? x - st.m - m_log(st.s) : m_exp(x - st.m) / st.s;
}

constexpr int kMaxRowThreads = 1024;

// ---- Kernels ----

// inner == 1, r >= 32. Block (tx, ty): tx threads per row, ty rows per
// block. The row's (max, sum) is all-reduced across its warps so every
// thread can write. Input and output rows share their alignment (the host
// picks VEC == 1 otherwise), so each vector step loads and stores 16 bytes.
template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxRowThreads)
    softmax_rows_kernel(const T* __restrict__ in, T* __restrict__ out, int64_t outer, int64_t r, bool log) {
  using C = acc_t<T>;
  __shared__ MaxSum<C> smem[kMaxRowThreads / cuda::kWarpSize];
  const int tx = blockDim.x, tid = threadIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const T* p = in + row * r;
  T* q = out + row * r;
  MaxSum<C> st = ms_identity<C>();
  if (row < outer) {
    cuda::for_each_aligned<VEC>(
        p, 0, r, tid, tx, [&](int64_t i) { ms_add(st, static_cast<C>(p[i])); },
        [&](int64_t i) {
          const VecN<T, VEC> x = *reinterpret_cast<const VecN<T, VEC>*>(p + i);
#pragma unroll
          for (int j = 0; j < VEC; ++j) ms_add(st, static_cast<C>(x.v[j]));
        });
  }
  st = ms_warp_allreduce(st);
  const int nwarps = tx / cuda::kWarpSize;
  if (nwarps > 1) {
    const int warp = tid / cuda::kWarpSize, lane = tid % cuda::kWarpSize;
    MaxSum<C>* row_smem = smem + threadIdx.y * nwarps;
    if (lane == 0) row_smem[warp] = st;
    __syncthreads();
    st = ms_warp_allreduce(lane < nwarps ? row_smem[lane] : ms_identity<C>());
  }
  if (row >= outer) return;
  cuda::for_each_aligned<VEC>(
      p, 0, r, tid, tx, [&](int64_t i) { q[i] = static_cast<T>(softmax_out(static_cast<C>(p[i]), st, log)); },
      [&](int64_t i) {
        const VecN<T, VEC> x = *reinterpret_cast<const VecN<T, VEC>*>(p + i);
        VecN<T, VEC> y;
#pragma unroll
        for (int j = 0; j < VEC; ++j) y.v[j] = static_cast<T>(softmax_out(static_cast<C>(x.v[j]), st, log));
        *reinterpret_cast<VecN<T, VEC>*>(q + i) = y;
      });
}

// Strided layout (inner > 1, or rows shorter than a warp). Block (tx, ty):
// tx consecutive outputs q = o * inner + j (adjacent in memory for adjacent
// j, so loads coalesce), ty threads striding the softmax axis; their partial
// stats merge in shared memory and each thread then writes its own elements.
template <typename T>
__global__ void softmax_strided_kernel(const T* __restrict__ in, T* __restrict__ out, int64_t n_rows, int64_t r,
                                       int64_t inner, bool log) {
  using C = acc_t<T>;
  __shared__ MaxSum<C> smem[cuda::kBlockSize];
  const int tx = blockDim.x, ty = blockDim.y;
  const int64_t q = static_cast<int64_t>(blockIdx.x) * tx + threadIdx.x;
  const int64_t o = q / inner, j = q - o * inner;
  const int64_t base = o * r * inner + j;
  MaxSum<C> st = ms_identity<C>();
  if (q < n_rows)
    for (int64_t k = threadIdx.y; k < r; k += ty) ms_add(st, static_cast<C>(in[base + k * inner]));
  const int slot = threadIdx.y * tx + threadIdx.x;
  smem[slot] = st;
  __syncthreads();
  for (int s = ty / 2; s > 0; s /= 2) {  // ty is a power of two
    if (static_cast<int>(threadIdx.y) < s) smem[slot] = ms_merge(smem[slot], smem[slot + s * tx]);
    __syncthreads();
  }
  st = smem[threadIdx.x];  // row 0 of the block holds the merged stats
  if (q >= n_rows) return;
  for (int64_t k = threadIdx.y; k < r; k += ty)
    out[base + k * inner] = static_cast<T>(softmax_out(static_cast<C>(in[base + k * inner]), st, log));
}

// ---- Launchers ----

int64_t pow2_ceil(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}

template <typename T>
void launch_softmax(const T* in, T* out, int64_t outer, int64_t r, int64_t inner, bool log, cudaStream_t stream) {
  constexpr int VEC = cuda::vec_width<T>();
  if (inner == 1 && r >= cuda::kWarpSize) {
    // Threads per row: about 4 vectors each, from one warp up to 1024.
    const int64_t tx = std::clamp<int64_t>(pow2_ceil(cuda::ceil_div(r, VEC * 4)), cuda::kWarpSize, kMaxRowThreads);
    const dim3 block(static_cast<unsigned>(tx), static_cast<unsigned>(std::max<int64_t>(1, cuda::kBlockSize / tx)));
    const unsigned grid = static_cast<unsigned>(cuda::ceil_div(outer, block.y));
    if (cuda::is_aligned_for<T, VEC>(in) && cuda::is_aligned_for<T, VEC>(out))
      softmax_rows_kernel<T, VEC><<<grid, block, 0, stream>>>(in, out, outer, r, log);
    else
      softmax_rows_kernel<T, 1><<<grid, block, 0, stream>>>(in, out, outer, r, log);
  } else {
    // Few rows: more threads along r; short r: more rows per block.
    const int64_t n_rows = outer * inner;
    const int64_t tx0 = std::min<int64_t>(cuda::kWarpSize, pow2_ceil(n_rows));
    const int64_t ty = std::min<int64_t>(cuda::kBlockSize / tx0, pow2_ceil(r));
    const int64_t tx = std::min<int64_t>(cuda::kBlockSize / ty, pow2_ceil(n_rows));
    const dim3 block(static_cast<unsigned>(tx), static_cast<unsigned>(ty));
    const unsigned grid = static_cast<unsigned>(cuda::ceil_div(n_rows, tx));
    softmax_strided_kernel<T><<<grid, block, 0, stream>>>(in, out, n_rows, r, inner, log);
  }
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void softmax_cuda(const Tensor& in, Tensor& out, int64_t outer, int64_t r, int64_t inner, bool log) {
  if (outer * r * inner == 0) return;
  EMBER_CHECK(in.dtype() == out.dtype(), log ? "log_softmax" : "softmax", ": output dtype ", out.dtype(),
              " differs from input ", in.dtype());
  cuda::DeviceGuard guard(in);
  cudaStream_t stream = cuda::stream_for(in);
  EMBER_DISPATCH_FLOAT(in.dtype(), log ? "log_softmax" : "softmax", [&] {
    using T = scalar_t;
    launch_softmax<T>(static_cast<const T*>(in.raw_data()), static_cast<T*>(out.raw_data()), outer, r, inner, log,
                      stream);
  });
}

}  // namespace ember
