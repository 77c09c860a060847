// max_pool2d / avg_pool2d CUDA launchers: one thread per output element
// forward, one per input element backward (a gather over the windows that
// cover it: no atomics, so 16-bit gradients need no float scratch and the
// result is deterministic). The per-element bodies are pool.h's, the ones
// the CPU kernels run. Threads walk memory order (pool_coords /
// pool_offset): in channels-last, neighbouring threads are neighbouring
// channels of one pixel, so every window read is coalesced across the warp.
// Index math runs in 32 bits with multiply-high divisors wherever the
// tensors allow (I = int32_t): a ResNet stem's pool spent most of its time
// on the dozen 64-bit divisions an element took.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/device.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"
#include "core/ops/pool.h"

namespace ember {
namespace {

using cuda::cast_value;

template <typename T, typename J, typename I>
__global__ void max_pool_kernel(const __grid_constant__ PoolIndex<I> g, const T* __restrict__ x, T* __restrict__ y,
                                J* __restrict__ indices, int64_t total) {
  cuda::grid_stride_loop(total, [&](int64_t i) {
    I p, oh, ow;
    pool_coords(g, static_cast<I>(i), g.by_oh, g.by_ow, &p, &oh, &ow);
    I arg;
    y[i] = cast_value<T>(max_pool_at<acc_t<T>>(g, x, p, oh, ow, &arg));
    indices[i] = static_cast<J>(arg);
  });
}

template <typename T, typename J, typename I>
__global__ void max_pool_backward_kernel(const __grid_constant__ PoolIndex<I> g, const T* __restrict__ dy,
                                         const J* __restrict__ indices, T* __restrict__ dx, int64_t total) {
  cuda::grid_stride_loop(total, [&](int64_t i) {
    I p, ih, iw;
    pool_coords(g, static_cast<I>(i), g.by_h, g.by_w, &p, &ih, &iw);
    dx[i] = cast_value<T>(max_pool_backward_at<acc_t<T>>(g, dy, indices, p, ih, iw));
  });
}

template <typename T, typename I>
__global__ void avg_pool_kernel(const __grid_constant__ PoolIndex<I> g, const T* __restrict__ x, T* __restrict__ y,
                                int64_t total) {
  cuda::grid_stride_loop(total, [&](int64_t i) {
    I p, oh, ow;
    pool_coords(g, static_cast<I>(i), g.by_oh, g.by_ow, &p, &oh, &ow);
    y[i] = cast_value<T>(avg_pool_at<acc_t<T>>(g, x, p, oh, ow));
  });
}

template <typename T, typename I>
__global__ void avg_pool_backward_kernel(const __grid_constant__ PoolIndex<I> g, const T* __restrict__ dy,
                                         T* __restrict__ dx, int64_t total) {
  cuda::grid_stride_loop(total, [&](int64_t i) {
    I p, ih, iw;
    pool_coords(g, static_cast<I>(i), g.by_h, g.by_w, &p, &ih, &iw);
    dx[i] = cast_value<T>(avg_pool_backward_at<acc_t<T>>(g, dy, p, ih, iw));
  });
}

// Runs launch(scalar_t{}, PoolIndex<I>, stream) on t's device for its float
// dtype, I int32_t where the larger of the operation's element counts
// (numel) allows it (pool_fits_int32).
template <typename F>
void launch_on(const Tensor& t, const PoolGeom& g, int64_t numel, const char* op, F&& launch) {
  cuda::DeviceGuard guard(t);
  cudaStream_t stream = cuda::stream_for(t);
  EMBER_DISPATCH_FLOAT(t.dtype(), op, [&] {
    if (pool_fits_int32(g, numel))
      launch(scalar_t{}, PoolIndex<int32_t>(g), stream);
    else
      launch(scalar_t{}, PoolIndex<int64_t>(g), stream);
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
}
// Calls f(J{}) for the index tensor's element type J (pool_index_dtype).
template <typename F>
void with_index_type(const Tensor& indices, F&& f) {
  if (indices.dtype() == DType::UInt8)
    f(uint8_t{});
  else
    f(int32_t{});
}

}  // namespace

void max_pool2d_cuda(const PoolGeom& g, const Tensor& x, Tensor& y, Tensor& indices) {
  const int64_t total = y.numel();
  if (total == 0) return;
  with_index_type(indices, [&](auto jtag) {
    using J = decltype(jtag);
    launch_on(x, g, std::max(x.numel(), total), "max_pool2d", [&](auto tag, const auto& gi, cudaStream_t stream) {
      using T = decltype(tag);
      using I = typename std::decay_t<decltype(gi)>::index_type;
      max_pool_kernel<T, J, I><<<cuda::grid_for(total), cuda::kBlockSize, 0, stream>>>(
          gi, static_cast<const T*>(x.raw_data()), static_cast<T*>(y.raw_data()), static_cast<J*>(indices.raw_data()),
          total);
    });
  });
}

void max_pool2d_backward_cuda(const PoolGeom& g, const Tensor& dy, const Tensor& indices, Tensor& dx) {
  const int64_t total = dx.numel();
  if (total == 0) return;
  with_index_type(indices, [&](auto jtag) {
    using J = decltype(jtag);
    launch_on(dy, g, std::max(dy.numel(), total), "max_pool2d_backward",
              [&](auto tag, const auto& gi, cudaStream_t stream) {
                using T = decltype(tag);
                using I = typename std::decay_t<decltype(gi)>::index_type;
                max_pool_backward_kernel<T, J, I><<<cuda::grid_for(total), cuda::kBlockSize, 0, stream>>>(
                    gi, static_cast<const T*>(dy.raw_data()), static_cast<const J*>(indices.raw_data()),
                    static_cast<T*>(dx.raw_data()), total);
              });
  });
}

void avg_pool2d_cuda(const PoolGeom& g, const Tensor& x, Tensor& y) {
  const int64_t total = y.numel();
  if (total == 0) return;
  launch_on(x, g, std::max(x.numel(), total), "avg_pool2d", [&](auto tag, const auto& gi, cudaStream_t stream) {
    using T = decltype(tag);
    using I = typename std::decay_t<decltype(gi)>::index_type;
    avg_pool_kernel<T, I><<<cuda::grid_for(total), cuda::kBlockSize, 0, stream>>>(
        gi, static_cast<const T*>(x.raw_data()), static_cast<T*>(y.raw_data()), total);
  });
}

void avg_pool2d_backward_cuda(const PoolGeom& g, const Tensor& dy, Tensor& dx) {
  const int64_t total = dx.numel();
  if (total == 0) return;
  launch_on(dy, g, std::max(dy.numel(), total), "avg_pool2d_backward",
            [&](auto tag, const auto& gi, cudaStream_t stream) {
              using T = decltype(tag);
              using I = typename std::decay_t<decltype(gi)>::index_type;
              avg_pool_backward_kernel<T, I><<<cuda::grid_for(total), cuda::kBlockSize, 0, stream>>>(
                  gi, static_cast<const T*>(dy.raw_data()), static_cast<T*>(dx.raw_data()), total);
            });
}

}  // namespace ember
