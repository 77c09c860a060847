// max_pool2d / avg_pool2d CUDA launchers: one thread per output element
// forward, one per input element backward (a gather over the windows that
// cover it: no atomics, so 16-bit gradients need no float scratch and the
// result is deterministic). Windows and divisors come from pool_window /
// pool_covering (kernels.h), the same functions the CPU kernels use.
// Threads walk memory order (pool_coords / pool_offset): in channels-last,
// neighbouring threads are neighbouring channels of one pixel, so every
// window read is coalesced across the warp.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "core/device.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"

namespace ember {
namespace {

using cuda::cast_value;

template <typename T>
__global__ void max_pool_kernel(const __grid_constant__ PoolGeom g, const T* __restrict__ x, T* __restrict__ y,
                                int64_t* __restrict__ indices, int64_t total) {
  cuda::grid_stride_loop(total, [&](int64_t i) {
    int64_t p, oh, ow;
    pool_coords(g, i, g.oh, g.ow, &p, &oh, &ow);
    int64_t arg;
    y[i] = cast_value<T>(max_pool_at<acc_t<T>>(g, x, p, oh, ow, &arg));
    indices[i] = arg;
  });
}

template <typename T>
__global__ void max_pool_backward_kernel(const __grid_constant__ PoolGeom g, const T* __restrict__ dy,
                                         const int64_t* __restrict__ indices, T* __restrict__ dx, int64_t total) {
  cuda::grid_stride_loop(total, [&](int64_t i) {
    int64_t p, ih, iw;
    pool_coords(g, i, g.h, g.w, &p, &ih, &iw);
    dx[i] = cast_value<T>(max_pool_backward_at<acc_t<T>>(g, dy, indices, p, ih, iw));
  });
}

template <typename T>
__global__ void avg_pool_kernel(const __grid_constant__ PoolGeom g, const T* __restrict__ x, T* __restrict__ y,
                                int64_t total) {
  cuda::grid_stride_loop(total, [&](int64_t i) {
    int64_t p, oh, ow;
    pool_coords(g, i, g.oh, g.ow, &p, &oh, &ow);
    y[i] = cast_value<T>(avg_pool_at<acc_t<T>>(g, x, p, oh, ow));
  });
}

template <typename T>
__global__ void avg_pool_backward_kernel(const __grid_constant__ PoolGeom g, const T* __restrict__ dy,
                                         T* __restrict__ dx, int64_t total) {
  cuda::grid_stride_loop(total, [&](int64_t i) {
    int64_t p, ih, iw;
    pool_coords(g, i, g.h, g.w, &p, &ih, &iw);
    dx[i] = cast_value<T>(avg_pool_backward_at<acc_t<T>>(g, dy, p, ih, iw));
  });
}

// Runs launch(scalar_t{}, stream) on x's device for a float dtype.
template <typename F>
void launch_on(const Tensor& t, const char* op, F&& launch) {
  cuda::DeviceGuard guard(t);
  cudaStream_t stream = cuda::stream_for(t);
  EMBER_DISPATCH_FLOAT(t.dtype(), op, [&] { launch(scalar_t{}, stream); });
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void max_pool2d_cuda(const PoolGeom& g, const Tensor& x, Tensor& y, Tensor& indices) {
  const int64_t total = y.numel();
  if (total == 0) return;
  launch_on(x, "max_pool2d", [&](auto tag, cudaStream_t stream) {
    using T = decltype(tag);
    max_pool_kernel<T><<<cuda::grid_for(total), cuda::kBlockSize, 0, stream>>>(
        g, static_cast<const T*>(x.raw_data()), static_cast<T*>(y.raw_data()),
        static_cast<int64_t*>(indices.raw_data()), total);
  });
}

void max_pool2d_backward_cuda(const PoolGeom& g, const Tensor& dy, const Tensor& indices, Tensor& dx) {
  const int64_t total = dx.numel();
  if (total == 0) return;
  launch_on(dy, "max_pool2d_backward", [&](auto tag, cudaStream_t stream) {
    using T = decltype(tag);
    max_pool_backward_kernel<T><<<cuda::grid_for(total), cuda::kBlockSize, 0, stream>>>(
        g, static_cast<const T*>(dy.raw_data()), static_cast<const int64_t*>(indices.raw_data()),
        static_cast<T*>(dx.raw_data()), total);
  });
}

void avg_pool2d_cuda(const PoolGeom& g, const Tensor& x, Tensor& y) {
  const int64_t total = y.numel();
  if (total == 0) return;
  launch_on(x, "avg_pool2d", [&](auto tag, cudaStream_t stream) {
    using T = decltype(tag);
    avg_pool_kernel<T><<<cuda::grid_for(total), cuda::kBlockSize, 0, stream>>>(
        g, static_cast<const T*>(x.raw_data()), static_cast<T*>(y.raw_data()), total);
  });
}

void avg_pool2d_backward_cuda(const PoolGeom& g, const Tensor& dy, Tensor& dx) {
  const int64_t total = dx.numel();
  if (total == 0) return;
  launch_on(dy, "avg_pool2d_backward", [&](auto tag, cudaStream_t stream) {
    using T = decltype(tag);
    avg_pool_backward_kernel<T><<<cuda::grid_for(total), cuda::kBlockSize, 0, stream>>>(
        g, static_cast<const T*>(dy.raw_data()), static_cast<T*>(dx.raw_data()), total);
  });
}

}  // namespace ember
