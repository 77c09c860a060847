// One generator for CUDA, cuBLAS, cuDNN and NCCL status checks: each failure
// reports the statement, file:line and the library's own error string.
// Only for code that CUDA builds compile (.cu files, and .cc code under
// #if EMBER_WITH_CUDA).
#pragma once

#include <cuda_runtime.h>

#include "core/exception.h"

#define EMBER_CHECK_GEN(expr, ok, to_string)                                  \
  do {                                                                        \
    auto ember_status_ = (expr);                                              \
    if (ember_status_ != (ok)) [[unlikely]] {                                 \
      throw ::ember::Error(::ember::detail::str_cat(                          \
          #expr, " failed at ", __FILE__, ":", __LINE__, ": ",                \
          to_string(ember_status_)));                                         \
    }                                                                         \
  } while (0)

#define EMBER_CUDA_CHECK(expr) EMBER_CHECK_GEN(expr, cudaSuccess, cudaGetErrorString)
#define EMBER_CUBLAS_CHECK(expr) EMBER_CHECK_GEN(expr, CUBLAS_STATUS_SUCCESS, cublasGetStatusString)
#define EMBER_CUDNN_CHECK(expr) EMBER_CHECK_GEN(expr, CUDNN_STATUS_SUCCESS, cudnnGetErrorString)
#define EMBER_NCCL_CHECK(expr) EMBER_CHECK_GEN(expr, ncclSuccess, ncclGetErrorString)
