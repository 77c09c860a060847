// CUDA kernels of bias_gelu (bias_gelu.cc has the op, the math and the CPU
// reference): one grid-stride pass each way over contiguous x [rows, cols]
// with bias [cols], 16-byte loads when cols is a multiple of the vector
// width and every operand is aligned for it (a vector then lies inside one
// row), computed in acc_t<T> by gelu's own formulas (elementwise_fns.h).
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/elementwise_fns.h"
#include "core/ops/kernels.h"

namespace ember {
namespace {

using cuda::VecN;

// t = x + bias rounded to T (what linear's bias add leaves), read as C.
template <typename T, typename C>
__device__ __forceinline__ C biased(T x, T b) {
  return static_cast<C>(static_cast<T>(static_cast<C>(x) + static_cast<C>(b)));
}

template <typename T, UnaryOp OP, int VEC>
__global__ void bias_gelu_forward_kernel(const T* __restrict__ x, const T* __restrict__ b, T* __restrict__ y, int64_t n,
                                         int64_t cols) {
  using C = acc_t<T>;
  cuda::grid_stride_loop(n / VEC, [&](int64_t v) {
    const int64_t c0 = (v * VEC) % cols;
    const VecN<T, VEC> xv = reinterpret_cast<const VecN<T, VEC>*>(x)[v];
    const VecN<T, VEC> bv = reinterpret_cast<const VecN<T, VEC>*>(b + c0)[0];
    VecN<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      out.v[j] = static_cast<T>(unary_fn<OP, C>(biased<T, C>(xv.v[j], bv.v[j]), C(0), C(0)));
    reinterpret_cast<VecN<T, VEC>*>(y)[v] = out;
  });
}

template <typename T, BinaryOp OP, int VEC>
__global__ void bias_gelu_backward_kernel(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ b,
                                          T* __restrict__ dx, int64_t n, int64_t cols) {
  using C = acc_t<T>;
  cuda::grid_stride_loop(n / VEC, [&](int64_t v) {
    const int64_t c0 = (v * VEC) % cols;
    const VecN<T, VEC> gv = reinterpret_cast<const VecN<T, VEC>*>(g)[v];
    const VecN<T, VEC> xv = reinterpret_cast<const VecN<T, VEC>*>(x)[v];
    const VecN<T, VEC> bv = reinterpret_cast<const VecN<T, VEC>*>(b + c0)[0];
    VecN<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      out.v[j] = static_cast<T>(binary_fn<OP, C>(static_cast<C>(gv.v[j]), biased<T, C>(xv.v[j], bv.v[j]), C(1)));
    reinterpret_cast<VecN<T, VEC>*>(dx)[v] = out;
  });
}

}  // namespace

void bias_gelu_forward_cuda(const Tensor& x, const Tensor& bias, bool tanh_approx, Tensor& y) {
  cuda::DeviceGuard guard(x);
  cudaStream_t stream = cuda::stream_for(x);
  const int64_t n = x.numel(), cols = bias.numel();
  EMBER_DISPATCH_FLOAT(x.dtype(), "bias_gelu", [&] {
    using T = scalar_t;
    const T *xp = x.data<T>(), *bp = bias.data<T>();
    T* yp = y.data<T>();
    // A vector lies inside one row when the width divides cols.
    cuda::with_vec_width<T>(
        n, {xp, bp, yp},
        [&](auto vec, unsigned grid) {
          constexpr int VEC = decltype(vec)::value;
          if (tanh_approx)
            bias_gelu_forward_kernel<T, UnaryOp::GeluTanh, VEC>
                <<<grid, cuda::kBlockSize, 0, stream>>>(xp, bp, yp, n, cols);
          else
            bias_gelu_forward_kernel<T, UnaryOp::Gelu, VEC><<<grid, cuda::kBlockSize, 0, stream>>>(xp, bp, yp, n, cols);
        },
        cols % cuda::vec_width<T>() == 0);
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
}

void bias_gelu_backward_cuda(const Tensor& g, const Tensor& x, const Tensor& bias, bool tanh_approx, Tensor& dx) {
  cuda::DeviceGuard guard(x);
  cudaStream_t stream = cuda::stream_for(x);
  const int64_t n = x.numel(), cols = bias.numel();
  EMBER_DISPATCH_FLOAT(x.dtype(), "bias_gelu", [&] {
    using T = scalar_t;
    const T *gp = g.data<T>(), *xp = x.data<T>(), *bp = bias.data<T>();
    T* dp = dx.data<T>();
    cuda::with_vec_width<T>(
        n, {gp, xp, bp, dp},
        [&](auto vec, unsigned grid) {
          constexpr int VEC = decltype(vec)::value;
          if (tanh_approx)
            bias_gelu_backward_kernel<T, BinaryOp::GeluTanhGrad, VEC>
                <<<grid, cuda::kBlockSize, 0, stream>>>(gp, xp, bp, dp, n, cols);
          else
            bias_gelu_backward_kernel<T, BinaryOp::GeluGrad, VEC>
                <<<grid, cuda::kBlockSize, 0, stream>>>(gp, xp, bp, dp, n, cols);
        },
        cols % cuda::vec_width<T>() == 0);
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ember
