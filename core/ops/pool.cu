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
  using A = acc_t<T>;
  cuda::grid_stride_loop(total, [&](int64_t i) {
    int64_t p, oh, ow;
    pool_coords(g, i, g.oh, g.ow, &p, &oh, &ow);
    int64_t h0, h1, w0, w1;
    pool_window(oh, g.h, g.kh, g.sh, g.ph, &h0, &h1);
    pool_window(ow, g.w, g.kw, g.sw, g.pw, &w0, &w1);
    A best = -INFINITY;
    int64_t arg = h0 * g.w + w0;
    for (int64_t ih = h0; ih < h1; ++ih)
      for (int64_t iw = w0; iw < w1; ++iw) {
        const A v = cast_value<A>(x[pool_offset(g, p, ih, iw, g.h, g.w)]);
        if (v > best || v != v) {  // NaN wins, as on the CPU
          best = v;
          arg = ih * g.w + iw;
        }
      }
    y[i] = cast_value<T>(best);
    indices[i] = arg;
  });
}

template <typename T>
__global__ void max_pool_backward_kernel(const __grid_constant__ PoolGeom g, const T* __restrict__ dy,
                                         const int64_t* __restrict__ indices, T* __restrict__ dx, int64_t total) {
  using A = acc_t<T>;
  cuda::grid_stride_loop(total, [&](int64_t i) {
    int64_t p, ih, iw;
    pool_coords(g, i, g.h, g.w, &p, &ih, &iw);
    int64_t oh0, oh1, ow0, ow1;
    pool_covering(ih, g.oh, g.kh, g.sh, g.ph, &oh0, &oh1);
    pool_covering(iw, g.ow, g.kw, g.sw, g.pw, &ow0, &ow1);
    const int64_t pos = ih * g.w + iw;
    A acc = 0;
    for (int64_t oh = oh0; oh < oh1; ++oh)
      for (int64_t ow = ow0; ow < ow1; ++ow) {
        const int64_t o = pool_offset(g, p, oh, ow, g.oh, g.ow);
        if (indices[o] == pos) acc += cast_value<A>(dy[o]);
      }
    dx[i] = cast_value<T>(acc);
  });
}

template <typename T>
__global__ void avg_pool_kernel(const __grid_constant__ PoolGeom g, const T* __restrict__ x, T* __restrict__ y,
                                int64_t total) {
  using A = acc_t<T>;
  cuda::grid_stride_loop(total, [&](int64_t i) {
    int64_t p, oh, ow;
    pool_coords(g, i, g.oh, g.ow, &p, &oh, &ow);
    int64_t h0, h1, w0, w1;
    const int64_t size =
        pool_window(oh, g.h, g.kh, g.sh, g.ph, &h0, &h1) * pool_window(ow, g.w, g.kw, g.sw, g.pw, &w0, &w1);
    A acc = 0;
    for (int64_t ih = h0; ih < h1; ++ih)
      for (int64_t iw = w0; iw < w1; ++iw) acc += cast_value<A>(x[pool_offset(g, p, ih, iw, g.h, g.w)]);
    const int64_t div = g.count_include_pad ? size : (h1 - h0) * (w1 - w0);
    y[i] = cast_value<T>(div > 0 ? acc / static_cast<A>(div) : A(0));
  });
}

template <typename T>
__global__ void avg_pool_backward_kernel(const __grid_constant__ PoolGeom g, const T* __restrict__ dy,
                                         T* __restrict__ dx, int64_t total) {
  using A = acc_t<T>;
  cuda::grid_stride_loop(total, [&](int64_t i) {
    int64_t p, ih, iw;
    pool_coords(g, i, g.h, g.w, &p, &ih, &iw);
    int64_t oh0, oh1, ow0, ow1;
    pool_covering(ih, g.oh, g.kh, g.sh, g.ph, &oh0, &oh1);
    pool_covering(iw, g.ow, g.kw, g.sw, g.pw, &ow0, &ow1);
    A acc = 0;
    for (int64_t oh = oh0; oh < oh1; ++oh)
      for (int64_t ow = ow0; ow < ow1; ++ow) {
        int64_t h0, h1, w0, w1;
        const int64_t size =
            pool_window(oh, g.h, g.kh, g.sh, g.ph, &h0, &h1) * pool_window(ow, g.w, g.kw, g.sw, g.pw, &w0, &w1);
        const int64_t div = g.count_include_pad ? size : (h1 - h0) * (w1 - w0);
        acc += cast_value<A>(dy[pool_offset(g, p, oh, ow, g.oh, g.ow)]) / static_cast<A>(div);
      }
    dx[i] = cast_value<T>(acc);
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
