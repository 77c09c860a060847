// CUDA GEMM through cuBLAS: gemm_cuda runs the row-major batched product the
// op layer describes in GemmArgs, and cublas_handle() owns the one handle
// per device. cuBLAS is column-major, and a row-major M x N matrix read as
// column-major is its transpose, so C = op(A) op(B) is computed as
// C^T = op(B)^T op(A)^T with the operands swapped: no data moves. All
// floating types accumulate in fp32 (fp64 for double) without TF32, the
// precision PyTorch gives by default. gemm_epilogue_cuda runs the same
// mapping through cuBLASLt with a fused epilogue (bias, GELU, the bias's
// gradient), as torch's addmm does its bias through cuBLASLt.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <mutex>
#include <tuple>

#include "core/cuda_check.h"
#include "core/ops/cublas_handle.h"
#include "core/ops/cublaslt.cuh"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"

namespace ember {
namespace {

using HandleSlot = cuda::HandleSlot<cublasHandle_t>;

HandleSlot& slot_for(int device) {
  return cuda::handle_slot<cublasHandle_t>("matmul", device, [](cublasHandle_t* h) {
    EMBER_CUBLAS_CHECK(cublasCreate(h));
    EMBER_CUBLAS_CHECK(cublasSetMathMode(*h, CUBLAS_DEFAULT_MATH));  // TF32 via the compute type only
  });
}

struct GemmTypes {
  cudaDataType data;
  cublasComputeType_t compute;
  bool fp64_scalars;  // alpha/beta are double for CUBLAS_COMPUTE_64F, float otherwise
};

GemmTypes gemm_types(DType t) {
  switch (t) {
    case DType::Float32:  // TF32 only when asked for (matmul_allow_tf32, off by default as in PyTorch)
      return {CUDA_R_32F, matmul_allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, false};
    case DType::Float16: return {CUDA_R_16F, CUBLAS_COMPUTE_32F, false};
    case DType::BFloat16: return {CUDA_R_16BF, CUBLAS_COMPUTE_32F, false};
    case DType::Float64: return {CUDA_R_64F, CUBLAS_COMPUTE_64F, true};
    default: break;
  }
  EMBER_CHECK(false, "matmul: dtype ", t, " not supported on CUDA (use float32, float16, bfloat16 or float64)");
  return {};
}

bool fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

}  // namespace

void* cublas_handle(int device) { return slot_for(device).handle; }

void gemm_cuda(const GemmArgs& g, int device) {
  if (g.batch == 0 || g.m == 0 || g.n == 0) return;
  const GemmTypes types = gemm_types(g.dtype);
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::stream_for(device);
  const size_t es = dtype_size(g.dtype);
  if (g.k == 0 && g.beta != 0) {  // empty sum added to C: C stays (only beta 1 is asked for)
    EMBER_INTERNAL_ASSERT(g.beta == 1.0);
    return;
  }
  if (g.k == 0) {  // empty sum: C is all zeros (cuBLAS with k == 0 is not documented to write C)
    const bool packed = g.stride_c == g.m * g.ldc;
    for (int64_t b = 0; b < (packed ? 1 : g.batch); ++b) {
      char* c = static_cast<char*>(g.c) + b * g.stride_c * es;
      EMBER_CUDA_CHECK(cudaMemset2DAsync(c, std::max(g.ldc, g.n) * es, 0, g.n * es, packed ? g.batch * g.m : g.m,
                                         stream));
    }
    return;
  }
  // Column-major view: first operand op(B)^T is n x k, second op(A)^T is k x m.
  const cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  // cuBLAS demands ld >= rows of the column-major storage even when the other
  // dimension is 1 and the stride is never used; views like x[:, None] can
  // carry a smaller one, so raise it where that is harmless.
  int64_t ldb = g.ldb, lda = g.lda;
  const int64_t b_rows = g.trans_b ? g.k : g.n, b_cols = g.trans_b ? g.n : g.k;
  const int64_t a_rows = g.trans_a ? g.m : g.k, a_cols = g.trans_a ? g.k : g.m;
  if (ldb < b_rows && b_cols == 1) ldb = b_rows;
  if (lda < a_rows && a_cols == 1) lda = a_rows;
  int64_t ldc = g.ldc;
  if (ldc < g.n && g.m == 1) ldc = g.n;

  const float alpha_f = static_cast<float>(g.alpha), beta_f = static_cast<float>(g.beta);
  const double alpha_d = g.alpha, beta_d = g.beta;
  const void* alpha = types.fp64_scalars ? static_cast<const void*>(&alpha_d) : &alpha_f;
  const void* beta = types.fp64_scalars ? static_cast<const void*>(&beta_d) : &beta_f;

  HandleSlot& slot = slot_for(device);
  std::lock_guard<std::mutex> lock(slot.mu);
  EMBER_CUBLAS_CHECK(cublasSetStream(slot.handle, stream));
  if (fits_int(g.m) && fits_int(g.n) && fits_int(g.k) && fits_int(lda) && fits_int(ldb) && fits_int(ldc) &&
      fits_int(g.batch)) {
    EMBER_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        slot.handle, op_b, op_a, static_cast<int>(g.n), static_cast<int>(g.m), static_cast<int>(g.k), alpha, g.b,
        types.data, static_cast<int>(ldb), g.stride_b, g.a, types.data, static_cast<int>(lda), g.stride_a, beta, g.c,
        types.data, static_cast<int>(ldc), g.stride_c, static_cast<int>(g.batch), types.compute,
        CUBLAS_GEMM_DEFAULT));
  } else {  // the 64-bit API is only needed past 2^31 rows/columns/batches
    EMBER_CUBLAS_CHECK(cublasGemmStridedBatchedEx_64(slot.handle, op_b, op_a, g.n, g.m, g.k, alpha, g.b, types.data,
                                                     ldb, g.stride_b, g.a, types.data, lda, g.stride_a, beta, g.c,
                                                     types.data, ldc, g.stride_c, g.batch, types.compute,
                                                     CUBLAS_GEMM_DEFAULT));
  }
}

// ---- cuBLASLt with an epilogue ----
namespace {

// Everything the heuristic's choice depends on: the device, dtype and
// compute type, the shape, transposes and leading dimensions, the
// epilogue, and the alignments of cuBLASLt's A, B and D and of the bias
// and aux vectors (cuBLASLt's header: the heuristic takes the alignment it
// may expect from the pointers set at the query). The pointers themselves
// are set per call.
using EpiKey = std::tuple<int, DType, int, int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t, int64_t, int,
                          uint32_t, uint32_t, uint32_t, uint32_t, uint32_t>;
cuda::LtPlanCache<EpiKey> g_epi_plans;
std::atomic<uint64_t> g_epi_fused{0}, g_epi_declined{0};

// GeluTanhAux without an aux matrix (a forward nothing will differentiate)
// is GELU_BIAS: nothing kept.
cublasLtEpilogue_t lt_epilogue(GemmEpilogue e, bool has_aux) {
  if (e == GemmEpilogue::GeluTanhAux && !has_aux) return CUBLASLT_EPILOGUE_GELU_BIAS;
  switch (e) {
    case GemmEpilogue::Bias:
      return CUBLASLT_EPILOGUE_BIAS;
    case GemmEpilogue::GeluTanhAux:
      return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case GemmEpilogue::BiasGradA:
      return CUBLASLT_EPILOGUE_BGRADB;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

// gemm_cuda's mapping in cuBLASLt's terms: D (n x m, column-major) =
// op(A') op(B') with A' our B and B' our A. Our column vector (a bias over
// C's columns) is D's row vector, which BIAS and GELU_AUX_BIAS broadcast;
// the sum over our op(A)'s rows is BGRADB's over B' along k.
std::unique_ptr<cuda::LtPlan> make_epilogue_plan(const GemmArgs& g, GemmEpilogue e, const GemmTypes& t,
                                                 const uint32_t (&align)[4], cublasLtHandle_t lt, void* vec,
                                                 void* aux) {
  using cuda::set_attr;
  auto plan = std::make_unique<cuda::LtPlan>();
  cuda::LtCall& call = plan->call;
  EMBER_CUBLAS_CHECK(cublasLtMatmulDescCreate(&call.desc, t.compute, CUDA_R_32F));
  set_attr(call.desc, CUBLASLT_MATMUL_DESC_TRANSA, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  set_attr(call.desc, CUBLASLT_MATMUL_DESC_TRANSB, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  set_attr(call.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, lt_epilogue(e, aux != nullptr));
  set_attr(call.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(vec));
  if (aux != nullptr) {
    set_attr(call.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, static_cast<const void*>(aux));
    set_attr(call.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, static_cast<int64_t>(g.ldc));
  }
  const uint64_t a_rows = g.trans_b ? g.k : g.n, a_cols = g.trans_b ? g.n : g.k;
  const uint64_t b_rows = g.trans_a ? g.m : g.k, b_cols = g.trans_a ? g.k : g.m;
  EMBER_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.a, t.data, a_rows, a_cols, g.ldb));
  EMBER_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.b, t.data, b_rows, b_cols, g.lda));
  EMBER_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.c, t.data, g.n, g.m, g.ldc));
  cuda::set_preference(call, align);
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, call.desc, call.a, call.b, call.c, call.c, call.pref, 1,
                                                           &plan->heuristic, &found);
  // No algorithm for the problem is an answer (the caller takes the
  // separate ops); anything else is a mistake in the call, raised.
  if (st != CUBLAS_STATUS_NOT_SUPPORTED) EMBER_CUBLAS_CHECK(st);
  plan->found = st == CUBLAS_STATUS_SUCCESS && found > 0;
  return plan;
}

}  // namespace

// kernels.h's contract; GeluTanhAux may also come without aux (GELU_BIAS,
// for a forward with no backward to come).
bool gemm_epilogue_cuda(const GemmArgs& g, GemmEpilogue e, void* vec, void* aux, int device) {
  EMBER_INTERNAL_ASSERT(g.batch == 1 && g.alpha == 1.0 && g.beta == 0.0 && g.k > 0 && g.m > 0 && g.n > 0);
  EMBER_INTERNAL_ASSERT(vec != nullptr && (e == GemmEpilogue::GeluTanhAux || aux == nullptr));
  if (g.dtype == DType::Float64) return false;
  const GemmTypes types = gemm_types(g.dtype);
  cuda::DeviceGuard guard(device);
  cudaStream_t stream = cuda::stream_for(device);
  cublasLtHandle_t lt = cuda::lt_handle(device);
  using cuda::alignment_of;
  const uint32_t align[4] = {alignment_of(g.b), alignment_of(g.a), alignment_of(g.c), alignment_of(g.c)};
  const EpiKey key{device,
                   g.dtype,
                   static_cast<int>(types.compute),
                   g.m,
                   g.n,
                   g.k,
                   g.trans_a,
                   g.trans_b,
                   g.lda,
                   g.ldb,
                   g.ldc,
                   static_cast<int>(e),
                   align[0],
                   align[1],
                   align[2],
                   alignment_of(vec),
                   aux ? alignment_of(aux) : 0u};
  cuda::LtPlan& plan = g_epi_plans.get(key, [&] { return make_epilogue_plan(g, e, types, align, lt, vec, aux); });
  if (!plan.found) {
    g_epi_declined.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  // This call's vectors: read (or written) by the device when the GEMM runs.
  cuda::set_attr(plan.call.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(vec));
  if (aux != nullptr)
    cuda::set_attr(plan.call.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, static_cast<const void*>(aux));
  const uint64_t ws = plan.heuristic.workspaceSize;
  const Tensor workspace = Tensor::empty({static_cast<int64_t>(ws)}, TensorOptions(DType::UInt8, cuda_device(device)));
  const float alpha = 1.0f, beta = 0.0f;
  EMBER_CUBLAS_CHECK(cublasLtMatmul(lt, plan.call.desc, &alpha, g.b, plan.call.a, g.a, plan.call.b, &beta, g.c,
                                    plan.call.c, g.c, plan.call.c, &plan.heuristic.algo,
                                    ws ? workspace.raw_data() : nullptr, ws, stream));
  g_epi_fused.fetch_add(1, std::memory_order_relaxed);
  return true;
}

GemmEpilogueStats gemm_epilogue_stats() {
  return {g_epi_fused.load(std::memory_order_relaxed), g_epi_declined.load(std::memory_order_relaxed)};
}

}  // namespace ember
