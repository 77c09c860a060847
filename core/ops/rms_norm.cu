// CUDA kernels of rms_norm (rms_norm.cc has the op, the math and the CPU
// reference). 16-bit tensors are read and written in their own dtype and
// computed in float32 (no float32 copies of x, y, dy or dx around the
// kernels). Forward and dx: layer_norm's kernels with no mean (norm_rows.cuh,
// kMean false: the mean square, xhat = x rstd). dweight: layer_norm.cu's
// kernels (norm_weight_grads_cuda), with x rstd for its xhat.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"
#include "core/ops/norm_rows.cuh"

namespace ember {
namespace {

template <typename T, typename C>
void forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  cuda::DeviceGuard guard(x);
  const int64_t rows = rstd.numel(), n = x.numel() / rows;
  cuda::with_row_vec<T>(n, {x.raw_data(), y.raw_data(), data_or_null<T>(w)}, [&](auto vec) {
    constexpr int VEC = decltype(vec)::value;
    cuda::norm_rows_forward_kernel<T, C, VEC, false>
        <<<cuda::warp_rows_grid(rows), cuda::kBlockSize, 0, cuda::stream_for(x)>>>(
            x.data<T>(), data_or_null<T>(w), nullptr, static_cast<C>(eps), rows, n, y.data<T>(), nullptr,
            rstd.data<C>());
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
}

template <typename T, typename C>
void backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& w, Tensor* dx, Tensor* dw) {
  cuda::DeviceGuard guard(x);
  const int64_t rows = rstd.numel(), n = x.numel() / rows;
  if (dx) {
    cuda::with_row_vec<T>(n, {dy.raw_data(), x.raw_data(), dx->raw_data(), data_or_null<T>(w)}, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      cuda::norm_rows_dx_kernel<T, C, VEC, false>
          <<<cuda::warp_rows_grid(rows), cuda::kBlockSize, 0, cuda::stream_for(x)>>>(
              dy.data<T>(), x.data<T>(), nullptr, rstd.data<C>(), data_or_null<T>(w), rows, n, dx->data<T>());
    });
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
  if (dw) norm_weight_grads_cuda(dy, x, nullptr, rstd, dw, nullptr);
}

}  // namespace

void rms_norm_forward_cuda(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  cuda::dispatch_io(x.dtype(), [&]<typename T, typename C>() { forward<T, C>(x, w, eps, y, rstd); });
}

void rms_norm_backward_cuda(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& w, Tensor* dx,
                            Tensor* dw) {
  cuda::dispatch_io(x.dtype(), [&]<typename T, typename C>() { backward<T, C>(dy, x, rstd, w, dx, dw); });
}

}  // namespace ember
