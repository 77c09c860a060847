// CUDA launcher for the unary elementwise ops (neg, abs, exp, log, sqrt,
// rsqrt, relu, sigmoid, tanh, gelu, pow with a scalar exponent, clamp). The
// math is unary_fn from elementwise_fns.h, the same function the CPU kernel
// in unary.cc calls, so both backends evaluate one formula in acc_t<T>. A
// contiguous input takes a 16-byte vectorized path (elementwise ops are
// bandwidth-bound, and wide loads halve the number of memory transactions);
// anything else unravels each linear index over the merged iteration shape.
#include <cuda_runtime.h>

// unary_fn's `x < 0` for abs is always false for uint8; the warning (raised inside elementwise_fns.h) is noise.
#pragma nv_diag_suppress 186

#include "core/cuda_check.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/elementwise_fns.h"
#include "core/ops/kernels.h"

namespace ember {
namespace {

using cuda::VecN;

// ---- Kernels ----

// Each thread handles VEC consecutive elements per step; the n % VEC tail is
// picked up element-wise after the vector loop.
template <UnaryOp OP, typename T, int VEC>
__global__ void unary_contig_kernel(T* __restrict__ out, const T* __restrict__ in, int64_t n, acc_t<T> p0,
                                    acc_t<T> p1) {
  using C = acc_t<T>;
  const int64_t nvec = n / VEC;
  for (int64_t v = cuda::global_thread_id(); v < nvec; v += cuda::grid_stride()) {
    VecN<T, VEC> x = reinterpret_cast<const VecN<T, VEC>*>(in)[v];
    VecN<T, VEC> y;
#pragma unroll
    for (int j = 0; j < VEC; ++j) y.v[j] = static_cast<T>(unary_fn<OP, C>(static_cast<C>(x.v[j]), p0, p1));
    reinterpret_cast<VecN<T, VEC>*>(out)[v] = y;
  }
  for (int64_t i = nvec * VEC + cuda::global_thread_id(); i < n; i += cuda::grid_stride())
    out[i] = static_cast<T>(unary_fn<OP, C>(static_cast<C>(in[i]), p0, p1));
}

template <UnaryOp OP, typename T>
__global__ void unary_strided_kernel(const __grid_constant__ StridedIter it,
                                     const __grid_constant__ cuda::SizeDivs divs, acc_t<T> p0, acc_t<T> p1) {
  using C = acc_t<T>;
  cuda::grid_stride_loop(it.numel, [&](int64_t i) {
    int64_t off[2];
    cuda::strided_offsets<2>(it, divs, i, off);
    const T x = *cuda::operand_ptr<const T>(it, 1, off[1]);
    *cuda::operand_ptr<T>(it, 0, off[0]) = static_cast<T>(unary_fn<OP, C>(static_cast<C>(x), p0, p1));
  });
}

// ---- Launchers ----

template <UnaryOp OP, typename T>
void launch_unary(const StridedIter& it, acc_t<T> p0, acc_t<T> p1, cudaStream_t stream) {
  constexpr int VEC = cuda::vec_width<T>();
  const int block = cuda::kBlockSize;
  if (it.all_contiguous()) {
    T* out = reinterpret_cast<T*>(it.data[0]);
    const T* in = reinterpret_cast<const T*>(it.data[1]);
    if (cuda::is_aligned_for<T, VEC>(out) && cuda::is_aligned_for<T, VEC>(in)) {
      unary_contig_kernel<OP, T, VEC><<<cuda::grid_for(it.numel, block, VEC), block, 0, stream>>>(out, in, it.numel,
                                                                                                  p0, p1);
    } else {  // a view at an odd offset: same kernel, one element per step
      unary_contig_kernel<OP, T, 1><<<cuda::grid_for(it.numel, block), block, 0, stream>>>(out, in, it.numel, p0, p1);
    }
  } else {
    unary_strided_kernel<OP, T><<<cuda::grid_for(it.numel, block), block, 0, stream>>>(it, cuda::size_divs(it), p0, p1);
  }
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void unary_cuda(UnaryOp op, const StridedIter& it, double p0, double p1) {
  if (it.numel == 0) return;
  const int device = cuda::device_of(it);
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::stream_for(device);
  dispatch_unary_typed(op, it.dtypes[0], p0, p1, [&](auto op_c, auto tag, auto c0, auto c1) {
    launch_unary<decltype(op_c)::value, decltype(tag)>(it, c0, c1, stream);
  });
}

}  // namespace ember
