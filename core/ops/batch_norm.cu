// batch_norm CUDA launchers. Reductions (the statistics, and the two sums
// backward needs) run one block per channel with a block-wide tree sum, in
// acc_t (float for 16-bit and float32 input, double for double): no atomics,
// so results do not depend on scheduling. The variance is two-pass (squared
// deviations from the mean), as on the CPU, to avoid cancellation. The
// elementwise passes (normalise, dx) are grid-stride loops over all of x.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "core/device.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"

namespace ember {
namespace {

using cuda::cast_value;

template <typename A>
__device__ A block_sum(A v) {
  __shared__ A partial[cuda::kBlockSize / cuda::kWarpSize];
  for (int d = cuda::kWarpSize / 2; d > 0; d /= 2) v += cuda::shfl_down(v, d);
  const int lane = threadIdx.x % cuda::kWarpSize, warp = threadIdx.x / cuda::kWarpSize;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / cuda::kWarpSize ? partial[threadIdx.x] : A(0);
  if (warp == 0)
    for (int d = cuda::kWarpSize / 2; d > 0; d /= 2) v += cuda::shfl_down(v, d);
  __syncthreads();  // partial is reused by the next block_sum
  return v;         // complete in thread 0
}

// Offset of the i-th element (over N and H*W) of channel ch in [n, c, s].
__device__ __forceinline__ int64_t bn_offset(int64_t i, int64_t ch, int64_t c, int64_t s) {
  return (i / s * c + ch) * s + i % s;
}

template <typename T, typename A>
__global__ void stats_kernel(const T* __restrict__ x, A* __restrict__ mean, A* __restrict__ var, int64_t n, int64_t c,
                             int64_t s) {
  __shared__ A shared_mean;
  const int64_t ch = blockIdx.x, m = n * s;
  A sum = 0;
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) sum += cast_value<A>(x[bn_offset(i, ch, c, s)]);
  sum = block_sum(sum);
  if (threadIdx.x == 0) shared_mean = sum / static_cast<A>(m);
  __syncthreads();
  const A mu = shared_mean;
  A sq = 0;
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) {
    const A d = cast_value<A>(x[bn_offset(i, ch, c, s)]) - mu;
    sq += d * d;
  }
  sq = block_sum(sq);
  if (threadIdx.x == 0) {
    mean[ch] = mu;
    var[ch] = sq / static_cast<A>(m);
  }
}

template <typename T, typename A>
__global__ void apply_kernel(const T* __restrict__ x, const A* __restrict__ mean, const A* __restrict__ invstd,
                             const A* __restrict__ w, const A* __restrict__ b, T* __restrict__ y, int64_t total,
                             int64_t c, int64_t s) {
  cuda::grid_stride_loop(total, [&](int64_t i) {
    const int64_t ch = (i / s) % c;
    const A scale = invstd[ch] * (w ? w[ch] : A(1));
    const A shift = (b ? b[ch] : A(0)) - mean[ch] * scale;
    y[i] = cast_value<T>(cast_value<A>(x[i]) * scale + shift);
  });
}

// sums[ch] = sum(dy), sums[c + ch] = sum(dy * xhat).
template <typename T, typename A>
__global__ void backward_reduce_kernel(const T* __restrict__ x, const T* __restrict__ dy, const A* __restrict__ mean,
                                       const A* __restrict__ invstd, A* __restrict__ sums, int64_t n, int64_t c,
                                       int64_t s) {
  const int64_t ch = blockIdx.x, m = n * s;
  const A mu = mean[ch], inv = invstd[ch];
  A sum_dy = 0, sum_dy_xhat = 0;
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) {
    const int64_t off = bn_offset(i, ch, c, s);
    const A g = cast_value<A>(dy[off]);
    sum_dy += g;
    sum_dy_xhat += g * (cast_value<A>(x[off]) - mu) * inv;
  }
  sum_dy = block_sum(sum_dy);
  sum_dy_xhat = block_sum(sum_dy_xhat);
  if (threadIdx.x == 0) {
    sums[ch] = sum_dy;
    sums[c + ch] = sum_dy_xhat;
  }
}

// train: dx = w * invstd / M * (M * dy - sum(dy) - xhat * sum(dy * xhat)); eval: dx = w * invstd * dy.
template <typename T, typename A>
__global__ void backward_dx_kernel(const T* __restrict__ x, const T* __restrict__ dy, const A* __restrict__ mean,
                                   const A* __restrict__ invstd, const A* __restrict__ w, const A* __restrict__ sums,
                                   T* __restrict__ dx, int64_t total, int64_t c, int64_t s, A inv_m, bool train) {
  cuda::grid_stride_loop(total, [&](int64_t i) {
    const int64_t ch = (i / s) % c;
    const A scale = invstd[ch] * (w ? w[ch] : A(1));
    A g = cast_value<A>(dy[i]);
    if (train) {
      const A xhat = (cast_value<A>(x[i]) - mean[ch]) * invstd[ch];
      g -= (sums[ch] + xhat * sums[c + ch]) * inv_m;
    }
    dx[i] = cast_value<T>(g * scale);
  });
}

template <typename A>
const A* opt_ptr(const Tensor& t) {
  return t.defined() ? static_cast<const A*>(t.raw_data()) : nullptr;
}

// [N, C, H, W] as (n, c, s = H * W).
struct Dims3 {
  int64_t n, c, s;
};
Dims3 dims_of(const Tensor& x) { return {x.size(0), x.size(1), x.size(2) * x.size(3)}; }

}  // namespace

void batch_norm_stats_cuda(const Tensor& x, Tensor& mean, Tensor& var) {
  const Dims3 d = dims_of(x);
  if (d.c == 0) return;
  cuda::DeviceGuard guard(x);
  cudaStream_t stream = cuda::stream_for(x);
  EMBER_DISPATCH_FLOAT(x.dtype(), "batch_norm", [&] {
    using A = acc_t<scalar_t>;
    stats_kernel<scalar_t, A><<<static_cast<unsigned>(d.c), cuda::kBlockSize, 0, stream>>>(
        static_cast<const scalar_t*>(x.raw_data()), static_cast<A*>(mean.raw_data()), static_cast<A*>(var.raw_data()),
        d.n, d.c, d.s);
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
}

void batch_norm_apply_cuda(const Tensor& x, const Tensor& mean, const Tensor& invstd, const Tensor& w,
                           const Tensor& b, Tensor& y) {
  const Dims3 d = dims_of(x);
  const int64_t total = x.numel();
  if (total == 0) return;
  cuda::DeviceGuard guard(x);
  cudaStream_t stream = cuda::stream_for(x);
  EMBER_DISPATCH_FLOAT(x.dtype(), "batch_norm", [&] {
    using A = acc_t<scalar_t>;
    apply_kernel<scalar_t, A><<<cuda::grid_for(total), cuda::kBlockSize, 0, stream>>>(
        static_cast<const scalar_t*>(x.raw_data()), static_cast<const A*>(mean.raw_data()),
        static_cast<const A*>(invstd.raw_data()), opt_ptr<A>(w), opt_ptr<A>(b), static_cast<scalar_t*>(y.raw_data()),
        total, d.c, d.s);
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
}

void batch_norm_backward_cuda(const Tensor& x, const Tensor& dy, const Tensor& mean, const Tensor& invstd,
                              const Tensor& w, bool train, Tensor* dx, Tensor* dw, Tensor* db) {
  const Dims3 d = dims_of(x);
  const int64_t total = x.numel();
  if (total == 0) return;
  cuda::DeviceGuard guard(x);
  cudaStream_t stream = cuda::stream_for(x);
  // The sums are only needed for dw, db, or the training-mode dx.
  const bool need_sums = dw || db || (dx && train);
  Tensor sums = need_sums ? Tensor::empty({2, d.c}, mean.options()) : Tensor();
  EMBER_DISPATCH_FLOAT(x.dtype(), "batch_norm_backward", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const T* xp = static_cast<const T*>(x.raw_data());
    const T* gp = static_cast<const T*>(dy.raw_data());
    const A* mp = static_cast<const A*>(mean.raw_data());
    const A* ip = static_cast<const A*>(invstd.raw_data());
    A* sp = need_sums ? static_cast<A*>(sums.raw_data()) : nullptr;
    if (need_sums)
      backward_reduce_kernel<T, A><<<static_cast<unsigned>(d.c), cuda::kBlockSize, 0, stream>>>(xp, gp, mp, ip, sp, d.n,
                                                                                              d.c, d.s);
    if (dx)
      backward_dx_kernel<T, A><<<cuda::grid_for(total), cuda::kBlockSize, 0, stream>>>(
          xp, gp, mp, ip, opt_ptr<A>(w), sp, static_cast<T*>(dx->raw_data()), total, d.c, d.s,
          A(1) / static_cast<A>(d.n * d.s), train);
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
  if (db) db->copy_(sums.select(0, 0));
  if (dw) dw->copy_(sums.select(0, 1));
}

}  // namespace ember
