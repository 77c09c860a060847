// CUDA kernel of rotary_embedding (rope.cc has the op, the convention and
// the CPU reference): a thread per pair (x[i], x[i + D/2]) of a head
// vector, so a warp reads a contiguous run of each half; backward is the
// same kernel with the sine negated. 16-bit x is read and written as it is,
// rotated in float32 with the float32 tables.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"

namespace ember {
namespace {

// T: x's and y's dtype (16-bit read and written as it is), C: the tables'
// and the arithmetic's (float32, or float64 for float64).
template <typename T, typename C>
__global__ void rotate_kernel(const T* __restrict__ x, const C* __restrict__ cos, const C* __restrict__ sin, C sign,
                              int64_t pairs, int64_t seq, int64_t heads, int64_t half, T* __restrict__ y) {
  // Grid-stride: grid_for caps the blocks.
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < pairs;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t v = p / half, i = p % half, t = (v / heads) % seq;
    const C c = cos[t * half + i], s = sign * sin[t * half + i];
    const C x1 = static_cast<C>(x[v * 2 * half + i]), x2 = static_cast<C>(x[v * 2 * half + half + i]);
    y[v * 2 * half + i] = static_cast<T>(x1 * c - x2 * s);
    y[v * 2 * half + half + i] = static_cast<T>(x2 * c + x1 * s);
  }
}

template <typename T, typename C>
void rotate(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse, const RopeGeom& g, Tensor& y) {
  cuda::DeviceGuard guard(x);
  const int64_t half = g.head_dim / 2, pairs = g.outer * g.seq * g.heads * half;
  rotate_kernel<T, C><<<cuda::grid_for(pairs), cuda::kBlockSize, 0, cuda::stream_for(x)>>>(
      x.data<T>(), cos.data<C>(), sin.data<C>(), inverse ? C(-1) : C(1), pairs, g.seq, g.heads, half, y.data<T>());
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void rope_cuda(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse, const RopeGeom& g, Tensor& y) {
  cuda::dispatch_io(x.dtype(), [&]<typename T, typename C>() { rotate<T, C>(x, cos, sin, inverse, g, y); });
}

}  // namespace ember
