// CUDA launcher for random fills (uniform, normal, bernoulli with a scalar or
// per-element probability). Element i is drawn as the CPU kernel draws it
// (philox.h: random_value, or for bernoulli word i % 4 of the call at
// counter i / 4, a thread taking the four elements of a call), so a (seed,
// offset) pair gives bit-identical tensors on both devices regardless of
// launch geometry. The double draw is rounded to the output dtype; a
// uniform draw that rounds up to b in a floating output is replaced by a,
// keeping the range [a, b) (as random.cc).
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"
#include "core/ops/philox.h"

namespace ember {
namespace {

template <typename T>
constexpr bool clamps_uniform = std::is_floating_point_v<acc_t<T>>;

// p's dtype is a runtime switch, uniform across the grid, so the kernel is
// instantiated per output dtype only.
__device__ __forceinline__ double load_prob(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::Float32: return static_cast<const float*>(p)[i];
    case DType::Float16: return static_cast<float>(static_cast<const Half*>(p)[i]);
    case DType::BFloat16: return static_cast<float>(static_cast<const BFloat16*>(p)[i]);
    default: return static_cast<const double*>(p)[i];
  }
}

// ---- Kernels ----

template <typename T>
__global__ void random_kernel(T* __restrict__ out, int64_t n, RandomKind kind, double a, double b, uint64_t seed,
                              uint64_t offset, const void* __restrict__ p, DType p_dtype,
                              const uint64_t* __restrict__ rng) {
  if (rng) {  // inside a CUDA graph: the generator's state as the replay began
    seed = rng[0];
    offset += rng[1];
  }
  if (is_bernoulli(kind)) {
    // A thread takes the four elements of one Philox call.
    const uint64_t keep = keep_threshold(a);
    cuda::grid_stride_loop((n + 3) / 4, [&](int64_t c) {
      const Philox4 r = philox4x32_10(static_cast<uint64_t>(c), offset, seed);
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const int64_t i = 4 * c + w;
        if (i >= n) continue;  // not break: the loop stays unrolled, r in registers
        const uint64_t ki = kind == RandomKind::Bernoulli_Tensor ? keep_threshold(load_prob(p, p_dtype, i)) : keep;
        out[i] = cuda::cast_value<T, double>(r.v[w] < ki ? 1.0 : 0.0);
      }
    });
    return;
  }
  cuda::grid_stride_loop(n, [&](int64_t i) {
    T t = cuda::cast_value<T, double>(random_value(kind, i, a, b, 0.0, seed, offset));
    if constexpr (clamps_uniform<T>) {
      if (kind == RandomKind::Uniform && static_cast<double>(static_cast<acc_t<T>>(t)) >= b)
        t = cuda::cast_value<T, double>(a);
    }
    out[i] = t;
  });
}

__global__ void rng_state_kernel(uint64_t* state, uint64_t seed, uint64_t offset) {
  state[0] = seed;
  state[1] = offset;
}

}  // namespace

// ---- Launchers ----

void write_rng_state_cuda(uint64_t* state, uint64_t seed, uint64_t offset, int device) {
  cuda::DeviceGuard guard(device);
  rng_state_kernel<<<1, 1, 0, cuda::stream_for(device)>>>(state, seed, offset);
  EMBER_CUDA_CHECK(cudaGetLastError());
}

void random_cuda(RandomKind kind, Tensor& out, double a, double b, uint64_t seed, uint64_t offset, const Tensor& p,
                 const uint64_t* rng) {
  const int64_t n = out.numel();
  if (n == 0) return;
  EMBER_CHECK(out.is_contiguous(), "random: output must be contiguous");
  const void* pp = nullptr;
  DType p_dtype = DType::Float64;
  if (kind == RandomKind::Bernoulli_Tensor) {
    EMBER_CHECK(p.defined() && is_floating(p.dtype()), "bernoulli: probabilities must be a floating tensor, got ",
                p.defined() ? dtype_name(p.dtype()) : "undefined");
    EMBER_CHECK(p.numel() == n && p.is_contiguous(), "bernoulli: probabilities must be contiguous with ", n,
                " elements, got ", shape_str(p.sizes()));
    EMBER_CHECK(p.device() == out.device(), "bernoulli: probabilities on ", p.device(), " but output on ",
                out.device());
    pp = p.raw_data();
    p_dtype = p.dtype();
  }
  cuda::DeviceGuard guard(out);
  cudaStream_t stream = cuda::stream_for(out);
  EMBER_DISPATCH_ALL(out.dtype(), "random", [&] {
    using T = scalar_t;
    const int block = cuda::kBlockSize;
    random_kernel<T><<<cuda::grid_for(is_bernoulli(kind) ? (n + 3) / 4 : n, block), block, 0, stream>>>(
        static_cast<T*>(out.raw_data()), n, kind, a, b, seed, offset, pp, p_dtype, rng);
    EMBER_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace ember
