// CUDA GEMM through cuBLAS: gemm_cuda runs the row-major batched product the
// op layer describes in GemmArgs, and cublas_handle() owns the one handle
// per device. cuBLAS is column-major, and a row-major M x N matrix read as
// column-major is its transpose, so C = op(A) op(B) is computed as
// C^T = op(B)^T op(A)^T with the operands swapped: no data moves. All
// floating types accumulate in fp32 (fp64 for double) without TF32, the
// precision PyTorch gives by default.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <mutex>

#include "core/cuda_check.h"
#include "core/ops/cublas_handle.h"
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

}  // namespace ember
