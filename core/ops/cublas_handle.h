// The cuBLAS handle ember's GEMMs run on, one per device, exposed so
// benchmarks and tests can call cuBLAS directly on the same handle (and so
// compare against exactly what matmul uses). Returned as void* so including
// this header does not pull in cublas_v2.h; cast to cublasHandle_t.
#pragma once

namespace ember {

// Created on first use for `device` (thread-safe) and never destroyed:
// cublasDestroy at static-destruction time can run after the CUDA runtime
// has shut down. Its stream is whatever the last ember GEMM set; call
// cublasSetStream before using it yourself.
void* cublas_handle(int device);

}  // namespace ember
