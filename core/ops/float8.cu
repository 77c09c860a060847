// CUDA kernels of float8 training (float8.cc has the ops and the CPU
// reference): the amax reduction and the scale, the saturated cast, and the
// scaled matmul through cuBLASLt (the only cuBLAS entry point with float8
// operands, as torch._scaled_mm uses). Nothing here reads a device value on
// the host, so a float8 step stays capturable.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <utility>

#include "core/cuda_check.h"
#include "core/ops/cublaslt.cuh"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"

namespace ember {
namespace {

using cuda::VecN;

// |v| as float bits: non-negative floats order as unsigned integers, and a
// NaN's bits lie above infinity's, so an integer max is a float max that
// keeps a NaN (torch.max's rule), and atomicMax on the bits is exact.
template <typename T>
__device__ __forceinline__ uint32_t abs_bits(T v) {
  return float_bits(static_cast<float>(v)) & 0x7fffffffu;
}
__device__ __forceinline__ uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

// ---- Kernels ----

// Each block folds its grid-stride share to one value and atomicMax-es it
// into *amax (zeroed before the launch). Max is order-free: deterministic.
template <typename T, int VEC>
__global__ void amax_kernel(const T* __restrict__ x, int64_t n, uint32_t* __restrict__ amax) {
  __shared__ uint32_t partial[cuda::kBlockSize / cuda::kWarpSize];
  uint32_t m = 0;
  const int64_t nv = n / VEC;
  for (int64_t v = cuda::global_thread_id(); v < nv; v += cuda::grid_stride()) {
    const VecN<T, VEC> xv = reinterpret_cast<const VecN<T, VEC>*>(x)[v];
#pragma unroll
    for (int j = 0; j < VEC; ++j) m = umax(m, abs_bits(xv.v[j]));
  }
  for (int64_t i = nv * VEC + cuda::global_thread_id(); i < n; i += cuda::grid_stride()) m = umax(m, abs_bits(x[i]));
  for (int o = cuda::kWarpSize / 2; o > 0; o /= 2) m = umax(m, cuda::shfl_xor(m, o));
  const int lane = threadIdx.x % cuda::kWarpSize, warp = threadIdx.x / cuda::kWarpSize;
  if (lane == 0) partial[warp] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x) / cuda::kWarpSize; ++w) m = umax(m, partial[w]);
    atomicMax(amax, m);
  }
}

// One thread: {scale, 1/scale, amax} from the amax bits in out[2].
__global__ void scale_kernel(float* out, float max_fp8) {
  const float amax = bits_float(*reinterpret_cast<const uint32_t*>(out + 2));
  const float s = float8_scale_of(amax, max_fp8);
  out[0] = s;
  out[1] = 1.0f / s;
  out[2] = amax;
}

template <typename T, typename F8, int VEC>
__global__ void to_float8_kernel(const T* __restrict__ x, const float* __restrict__ scale, F8* __restrict__ out,
                                 int64_t n) {
  const float s = *scale;
  const int64_t nv = n / VEC;
  for (int64_t v = cuda::global_thread_id(); v < nv; v += cuda::grid_stride()) {
    const VecN<T, VEC> xv = reinterpret_cast<const VecN<T, VEC>*>(x)[v];
    VecN<F8, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float y = static_cast<float>(xv.v[j]) * s;
      o.v[j].x = F8::format::from_float(y, true);
    }
    reinterpret_cast<VecN<F8, VEC>*>(out)[v] = o;
  }
  for (int64_t i = nv * VEC + cuda::global_thread_id(); i < n; i += cuda::grid_stride()) {
    const float y = static_cast<float>(x[i]) * s;
    out[i].x = F8::format::from_float(y, true);
  }
}

// ---- Launchers ----

// Blocks for a grid-stride pass: enough to fill the device, few enough that
// the amax atomics stay cheap.
unsigned pass_grid(int64_t n, int vec, int device) {
  const unsigned want = cuda::grid_for(n, cuda::kBlockSize, vec);
  const unsigned cap = static_cast<unsigned>(cuda::sm_count(device)) * 8u;
  return want < cap ? want : cap;
}

cudaDataType lt_type(DType t) {
  switch (t) {
    case DType::Float8E4M3:
      return CUDA_R_8F_E4M3;
    case DType::Float8E5M2:
      return CUDA_R_8F_E5M2;
    case DType::Float32:
      return CUDA_R_32F;
    case DType::BFloat16:
      return CUDA_R_16BF;
    case DType::Float16:
      return CUDA_R_16F;
    default:
      break;
  }
  EMBER_CHECK(false, "scaled_mm: dtype ", t, " has no cuBLASLt type here");
  return CUDA_R_32F;
}

// One problem's plan key: everything the heuristic's choice depends on
// (the device, m, n, k, the three dtypes, fast accumulation, the alignments
// of A, B and C/D). What differs between calls of one problem (the
// operands, the scale pointers) is set per call.
using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, DType, DType, DType, bool, uint32_t, uint32_t, uint32_t>;
cuda::LtPlanCache<PlanKey> g_plans;

// The descriptors and heuristic choice of one problem (see scaled_mm_cuda
// for the layout mapping).
std::unique_ptr<cuda::LtPlan> make_plan(cublasLtHandle_t lt, int64_t m, int64_t k, int64_t n, DType at, DType bt,
                                        DType ot, bool fast_accum, const uint32_t (&align)[4], const void* lt_a_scale,
                                        const void* lt_b_scale) {
  using cuda::set_attr;
  auto plan = std::make_unique<cuda::LtPlan>();
  cuda::LtCall& call = plan->call;
  EMBER_CUBLAS_CHECK(cublasLtMatmulDescCreate(&call.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_attr(call.desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_attr(call.desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  set_attr(call.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(fast_accum ? 1 : 0));
  EMBER_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.a, lt_type(bt), k, n, k));
  EMBER_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.b, lt_type(at), k, m, k));
  EMBER_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.c, lt_type(ot), n, m, n));
  cuda::set_preference(call, align);
  // The scale pointers' presence is part of the problem; each call sets
  // its own (this first call's for the query).
  set_attr(call.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, lt_a_scale);
  set_attr(call.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, lt_b_scale);
  int found = 0;
  EMBER_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, call.desc, call.a, call.b, call.c, call.c, call.pref, 1,
                                                    &plan->heuristic, &found));
  EMBER_CHECK(found > 0, "scaled_mm: cuBLASLt has no float8 algorithm for [", m, ", ", k, "] ", at, " x [", k, ", ", n,
              "] ", bt, " -> ", ot);
  plan->found = true;
  return plan;
}

}  // namespace

void float8_scale_cuda(const Tensor& x, DType fp8, Tensor& out) {
  cuda::DeviceGuard guard(x);
  cudaStream_t stream = cuda::stream_for(x);
  const int64_t n = x.numel();
  float* o = out.data<float>();
  EMBER_CUDA_CHECK(cudaMemsetAsync(o + 2, 0, sizeof(float), stream));
  EMBER_DISPATCH_FLOAT(x.dtype(), "float8_scale", [&] {
    using T = scalar_t;
    const T* xp = x.data<T>();
    constexpr int V = cuda::vec_width<T>();
    uint32_t* amax = reinterpret_cast<uint32_t*>(o + 2);
    if (n > 0) {
      if (cuda::is_aligned_for<T, V>(xp))
        amax_kernel<T, V><<<pass_grid(n, V, x.device().index), cuda::kBlockSize, 0, stream>>>(xp, n, amax);
      else
        amax_kernel<T, 1><<<pass_grid(n, 1, x.device().index), cuda::kBlockSize, 0, stream>>>(xp, n, amax);
      EMBER_CUDA_CHECK(cudaGetLastError());
    }
  });
  const float max_fp8 = fp8 == DType::Float8E4M3 ? Float8E4M3::format::kMax : Float8E5M2::format::kMax;
  scale_kernel<<<1, 1, 0, stream>>>(o, max_fp8);
  EMBER_CUDA_CHECK(cudaGetLastError());
}

void to_float8_cuda(const Tensor& x, const Tensor& scale, Tensor& out) {
  cuda::DeviceGuard guard(x);
  cudaStream_t stream = cuda::stream_for(x);
  const int64_t n = x.numel();
  const float* s = scale.data<float>();
  EMBER_DISPATCH_FLOAT(x.dtype(), "to_float8", [&] {
    using T = scalar_t;
    const T* xp = x.data<T>();
    auto launch = [&](auto* op) {
      using F8 = std::remove_pointer_t<decltype(op)>;
      constexpr int V = cuda::vec_width<T>();
      if (cuda::is_aligned_for<T, V>(xp) && cuda::is_aligned_for<F8, V>(op))
        to_float8_kernel<T, F8, V>
            <<<cuda::grid_for(n, cuda::kBlockSize, V), cuda::kBlockSize, 0, stream>>>(xp, s, op, n);
      else
        to_float8_kernel<T, F8, 1><<<cuda::grid_for(n), cuda::kBlockSize, 0, stream>>>(xp, s, op, n);
    };
    if (out.dtype() == DType::Float8E4M3)
      launch(out.data<Float8E4M3>());
    else
      launch(out.data<Float8E5M2>());
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
}

// out [m, n] row-major = a [m, k] row-major x b [k, n] column-major. In
// cuBLASLt's column-major terms out is out^T [n, m] = b^T a^T: its A is b's
// memory read as a k x n column-major matrix, transposed ("T"), and its B
// is a's memory as k x m, not transposed ("N"): the "TN" layout float8
// matmuls require, with both leading dimensions k.
void scaled_mm_cuda(const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b, bool fast_accum,
                    Tensor& out) {
  const int64_t m = a.sizes()[0], k = a.sizes()[1], n = b.sizes()[1];
  cuda::DeviceGuard guard(a);
  cudaStream_t stream = cuda::stream_for(a);
  const int device = a.device().index;
  cublasLtHandle_t lt = cuda::lt_handle(device);
  // cuBLASLt's A is b's memory, its B a's, C and D the output.
  using cuda::alignment_of;
  const uint32_t align[4] = {alignment_of(b.raw_data()), alignment_of(a.raw_data()), alignment_of(out.raw_data()),
                             alignment_of(out.raw_data())};
  const PlanKey key{device, m, n, k, a.dtype(), b.dtype(), out.dtype(), fast_accum, align[0], align[1], align[2]};
  cuda::LtPlan& plan = g_plans.get(key, [&] {
    return make_plan(lt, m, k, n, a.dtype(), b.dtype(), out.dtype(), fast_accum, align, scale_b.raw_data(),
                     scale_a.raw_data());
  });
  // This call's scales: read by the device when the matmul runs.
  cuda::set_attr(plan.call.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, scale_b.raw_data());
  cuda::set_attr(plan.call.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, scale_a.raw_data());
  const uint64_t ws = plan.heuristic.workspaceSize;
  const Tensor workspace = Tensor::empty({static_cast<int64_t>(ws)}, TensorOptions(DType::UInt8, a.device()));
  const float alpha = 1.0f, beta = 0.0f;
  EMBER_CUBLAS_CHECK(cublasLtMatmul(lt, plan.call.desc, &alpha, b.raw_data(), plan.call.a, a.raw_data(), plan.call.b,
                                    &beta, out.raw_data(), plan.call.c, out.raw_data(), plan.call.c,
                                    &plan.heuristic.algo, ws ? workspace.raw_data() : nullptr, ws, stream));
}

ScaledMmPlanStats scaled_mm_plan_stats() { return {g_plans.hits(), g_plans.misses()}; }

}  // namespace ember
