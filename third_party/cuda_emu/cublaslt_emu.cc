// cublaslt_emu.cc: the cuBLASLt calls ember makes, as a naive loop on host
// memory, holding the calls to the rules the real library documents, so
// ember's mapping of a row-major product onto cuBLASLt is what gets tested.
// Two kinds of call:
// - scaled_mm's float8 matmul (float8.cu): the "TN" layout (A transposed,
//   B not), leading dimensions and pointers multiples of 16 bytes, no e5m2
//   x e5m2, float32 compute and scale types, C and D of one type among
//   float32/bfloat16/float16. The scale pointers are device pointers read
//   when the matmul runs on its stream (as a captured graph replays them).
// - a GEMM with an epilogue (matmul.cu's gemm_epilogue_cuda): A, B, C and D
//   of one type among float32/bfloat16/float16, either transpose, float32
//   compute (TF32 allowed) and scale; BIAS, GELU_BIAS and GELU_AUX_BIAS add
//   a vector of D's rows' length and type (GELU's tanh form after it; for
//   GELU_AUX_BIAS the sum before GELU kept in the aux matrix, whose leading
//   dimension must be a multiple of 8 and at least D's rows), BGRADB
//   writes B's sums over k (a vector of D's columns' length). The bias and
//   aux pointers must be as aligned as the ones the heuristic was asked
//   with (the header's rule). EMU_CUBLASLT_DECLINE_EPILOGUES=1 makes the
//   heuristic find no algorithm for any epilogue, as the library may for a
//   problem, so the caller's other path can be tested.
// Anything else ember does not use answers CUBLAS_STATUS_NOT_SUPPORTED,
// loudly.
#include <cublasLt.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/dtype.h"
#include "third_party/cuda_emu/emu_runtime.h"

namespace {

struct Desc {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  int32_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  int8_t fast_accum = 0;
  uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  const void* aux = nullptr;
  int64_t aux_ld = 0;
};
struct Layout {
  cudaDataType type;
  uint64_t rows, cols;
  int64_t ld;
};
struct Pref {
  uint64_t max_workspace = 0;
  uint32_t min_align[4] = {256, 256, 256, 256};  // A, B, C, D: the library's default
};
// What the emulated heuristic asks for: a small workspace, so the caller's
// workspace path runs and is range-checked.
constexpr uint64_t kEmuWorkspace = 4096;

cublasStatus_t fail(const char* why) {
  std::fprintf(stderr, "[cublaslt-emu] %s\n", why);
  return CUBLAS_STATUS_INVALID_VALUE;
}
cublasStatus_t unsupported(const char* what) {
  std::fprintf(stderr, "[cublaslt-emu] %s is not emulated\n", what);
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

bool is_fp8(cudaDataType t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }
size_t elem_size(cudaDataType t) {
  return is_fp8(t) ? 1 : t == CUDA_R_32F ? 4 : t == CUDA_R_16BF || t == CUDA_R_16F ? 2 : 0;
}
double ld(const void* p, cudaDataType t, int64_t i) {
  switch (t) {
    case CUDA_R_8F_E4M3:
      return float(static_cast<const ember::Float8E4M3*>(p)[i]);
    case CUDA_R_8F_E5M2:
      return float(static_cast<const ember::Float8E5M2*>(p)[i]);
    case CUDA_R_32F:
      return static_cast<const float*>(p)[i];
    case CUDA_R_16F:
      return float(static_cast<const ember::Half*>(p)[i]);
    case CUDA_R_16BF:
      return float(static_cast<const ember::BFloat16*>(p)[i]);
    default:
      return 0;
  }
}
void st(void* p, cudaDataType t, int64_t i, float v) {
  switch (t) {
    case CUDA_R_32F:
      static_cast<float*>(p)[i] = v;
      break;
    case CUDA_R_16F:
      static_cast<ember::Half*>(p)[i] = ember::Half(v);
      break;
    case CUDA_R_16BF:
      static_cast<ember::BFloat16*>(p)[i] = ember::BFloat16(v);
      break;
    default:
      break;
  }
}

// The float8 rules (cuBLASLt's documentation of cublasLtMatmul for FP8).
cublasStatus_t check_fp8(const Desc& d, const Layout& a, const Layout& b, const Layout& c, const Layout& dd,
                         const void* pa, const void* pb, const void* pd) {
  if (!is_fp8(a.type) || !is_fp8(b.type)) return unsupported("cublasLtMatmul without float8 A and B");
  if (a.type == CUDA_R_8F_E5M2 && b.type == CUDA_R_8F_E5M2) return fail("float8: A and B both e5m2");
  if (d.transa != CUBLAS_OP_T || d.transb != CUBLAS_OP_N) return fail("float8 matmuls must be TN (A transposed)");
  if (d.compute != CUBLAS_COMPUTE_32F || d.scale != CUDA_R_32F) return fail("float8: compute/scale type not 32F");
  if (c.type != dd.type || elem_size(dd.type) < 2) return fail("float8: C and D must be one of 32F, 16BF, 16F");
  if (a.ld % 16 || b.ld % 16) return fail("float8: lda and ldb must be multiples of 16");
  if (reinterpret_cast<uintptr_t>(pa) % 16 || reinterpret_cast<uintptr_t>(pb) % 16 ||
      reinterpret_cast<uintptr_t>(pd) % 16)
    return fail("float8: A, B and D must be 16-byte aligned");
  return CUBLAS_STATUS_SUCCESS;
}

void check_matrix(const void* p, const Layout& l, const char* what) {
  if (l.rows == 0 || l.cols == 0) return;
  const uint64_t elems = (l.cols - 1) * static_cast<uint64_t>(l.ld) + l.rows;
  emu::check_device_range(p, elems * elem_size(l.type), what);
}

// cublasLtMatmul's checks shared by both kinds: the algorithm's workspace
// and the alignments it was chosen for.
cublasStatus_t check_algo(const cublasLtMatmulAlgo_t* algo, size_t workspace_bytes, const void* const (&ptrs)[4]) {
  if (algo == nullptr || workspace_bytes < algo->data[0]) return fail("cublasLtMatmul: workspace below the algo's");
  for (int i = 0; i < 4; ++i)
    if (reinterpret_cast<uintptr_t>(ptrs[i]) % algo->data[1 + i] != 0)
      return fail("cublasLtMatmul: a pointer is less aligned than the preference the algorithm was chosen for");
  return CUBLAS_STATUS_SUCCESS;
}

uint64_t alignment(const void* p) {
  uint64_t a = 1;
  while (a < 256 && reinterpret_cast<uintptr_t>(p) % (2 * a) == 0) a *= 2;
  return a;
}

float gelu_tanh(float x) {
  const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + std::tanh(inner));
}

// A 16/32-bit GEMM with BIAS, GELU_AUX_BIAS or BGRADB (or none): D = op(A)
// op(B) summed in double, rounded to float, then the epilogue in float, then
// one rounding to D's type.
cublasStatus_t matmul_epilogue(const Desc& d, const void* alpha, const void* A, const Layout& a, const void* B,
                               const Layout& b, const void* beta, const void* C, const Layout& c, void* D,
                               const Layout& dd, const cublasLtMatmulAlgo_t* algo, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream) {
  const cudaDataType t = dd.type;
  if (elem_size(t) < 2 || a.type != t || b.type != t || c.type != t)
    return unsupported("cublasLtMatmul with A, B, C and D not all of one type among 32F, 16F and 16BF");
  if ((d.compute != CUBLAS_COMPUTE_32F && d.compute != CUBLAS_COMPUTE_32F_FAST_TF32) || d.scale != CUDA_R_32F)
    return fail("cublasLtMatmul: compute type not 32F (or 32F_FAST_TF32), or scale type not 32F");
  if (d.a_scale || d.b_scale) return unsupported("scale pointers on a 16/32-bit matmul");
  const bool ta = d.transa == CUBLAS_OP_T, tb = d.transb == CUBLAS_OP_T;
  const uint64_t m = ta ? a.cols : a.rows, k = ta ? a.rows : a.cols;
  const uint64_t n = tb ? b.rows : b.cols, kb = tb ? b.cols : b.rows;
  if (kb != k || dd.rows != m || dd.cols != n || c.rows != m || c.cols != n)
    return fail("cublasLtMatmul: layouts do not form op(A) op(B) = D");
  const void* ptrs[4] = {A, B, C, D};
  if (cublasStatus_t s = check_algo(algo, workspace_bytes, ptrs); s != CUBLAS_STATUS_SUCCESS) return s;
  const float al_v = *static_cast<const float*>(alpha), be_v = *static_cast<const float*>(beta);
  if (be_v != 0 || C != D) return unsupported("cublasLtMatmul with beta != 0 or C != D");
  const uint32_t ep = d.epilogue;
  const bool keep_aux = ep == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  const bool gelu = keep_aux || ep == CUBLASLT_EPILOGUE_GELU_BIAS;
  const bool bias_in = gelu || ep == CUBLASLT_EPILOGUE_BIAS, bgrad = ep == CUBLASLT_EPILOGUE_BGRADB;
  if (!bias_in && !bgrad && ep != CUBLASLT_EPILOGUE_DEFAULT) return unsupported("this epilogue");
  const char* what = "cublasLtMatmul";
  if ((bias_in || bgrad) && d.bias == nullptr) return fail("cublasLtMatmul: the epilogue needs BIAS_POINTER");
  if ((algo->data[5] && reinterpret_cast<uintptr_t>(d.bias) % algo->data[5]) ||
      (algo->data[6] && reinterpret_cast<uintptr_t>(d.aux) % algo->data[6]))
    return fail("cublasLtMatmul: the bias or aux pointer is less aligned than the one the algorithm was chosen with");
  if (keep_aux) {
    if (d.aux == nullptr) return fail("cublasLtMatmul: GELU_AUX_BIAS needs EPILOGUE_AUX_POINTER");
    if (d.aux_ld % 8 != 0 || d.aux_ld < static_cast<int64_t>(m))
      return fail("cublasLtMatmul: EPILOGUE_AUX_LD must be a multiple of 8 and at least D's rows");
  }
  check_matrix(A, a, what);
  check_matrix(B, b, what);
  check_matrix(D, dd, what);
  // The vector is D's type (BIAS_DATA_TYPE left at its default).
  if (bias_in) emu::check_device_range(d.bias, m * elem_size(t), what);
  if (bgrad) emu::check_device_range(d.bias, n * elem_size(t), what);
  if (keep_aux) check_matrix(d.aux, Layout{t, m, n, d.aux_ld}, what);
  if (workspace_bytes > 0) emu::check_device_range(workspace, workspace_bytes, what);
  const void* bias = d.bias;
  void* aux = const_cast<void*>(d.aux);
  const int64_t aux_ld = d.aux_ld;
  emu::enqueue(
      stream,
      [=] {
        auto at = [&](uint64_t i, uint64_t p) { return ld(A, t, ta ? p + i * a.ld : i + p * a.ld); };
        auto bt = [&](uint64_t p, uint64_t j) { return ld(B, t, tb ? j + p * b.ld : p + j * b.ld); };
        for (uint64_t j = 0; j < n; ++j)
          for (uint64_t i = 0; i < m; ++i) {
            double acc = 0;
            for (uint64_t p = 0; p < k; ++p) acc += at(i, p) * bt(p, j);
            float v = static_cast<float>(acc) * al_v;
            if (bias_in) v += static_cast<float>(ld(bias, t, i));
            if (keep_aux) st(aux, t, i + j * aux_ld, v);
            if (gelu) v = gelu_tanh(v);
            st(D, t, i + j * dd.ld, v);
          }
        if (bgrad)
          for (uint64_t j = 0; j < n; ++j) {
            double s = 0;
            for (uint64_t p = 0; p < k; ++p) s += bt(p, j);
            st(const_cast<void*>(bias), t, j, static_cast<float>(s));
          }
      },
      what);
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

extern "C" {
cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
  *h = reinterpret_cast<cublasLtHandle_t>(new int(0));
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  delete reinterpret_cast<int*>(h);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t compute, cudaDataType_t scale) {
  *d = reinterpret_cast<cublasLtMatmulDesc_t>(new Desc{compute, scale});
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete reinterpret_cast<Desc*>(d);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t dp, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t size) {
  Desc& d = *reinterpret_cast<Desc*>(dp);
  auto take = [&](auto& field) {
    if (size != sizeof(field)) return fail("cublasLtMatmulDescSetAttribute: wrong size for the attribute");
    std::memcpy(&field, buf, size);
    return CUBLAS_STATUS_SUCCESS;
  };
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
      return take(d.transa);
    case CUBLASLT_MATMUL_DESC_TRANSB:
      return take(d.transb);
    case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER:
      return take(d.a_scale);
    case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER:
      return take(d.b_scale);
    case CUBLASLT_MATMUL_DESC_FAST_ACCUM:
      return take(d.fast_accum);
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      return take(d.epilogue);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      return take(d.bias);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
      return take(d.aux);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
      return take(d.aux_ld);
    default:
      return unsupported("this cublasLtMatmulDesc attribute");
  }
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
  if (ld < static_cast<int64_t>(rows > 1 ? rows : 1)) return fail("cublasLtMatrixLayoutCreate: ld < rows");
  *l = reinterpret_cast<cublasLtMatrixLayout_t>(new Layout{type, rows, cols, ld});
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete reinterpret_cast<Layout*>(l);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  *p = reinterpret_cast<cublasLtMatmulPreference_t>(new Pref);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  delete reinterpret_cast<Pref*>(p);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t size) {
  Pref& pr = *reinterpret_cast<Pref*>(p);
  int slot = -1;
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
      if (size != sizeof(uint64_t)) return fail("CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES takes a uint64_t");
      std::memcpy(&pr.max_workspace, buf, size);
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
      slot = 0;
      break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
      slot = 1;
      break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
      slot = 2;
      break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
      slot = 3;
      break;
    default:
      return unsupported("this preference attribute");
  }
  if (size != sizeof(uint32_t)) return fail("CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES take a uint32_t");
  uint32_t a;
  std::memcpy(&a, buf, size);
  if (a == 0 || (a & (a - 1)) != 0) return fail("CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES: not a power of two");
  pr.min_align[slot] = a;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t dp, cublasLtMatrixLayout_t,
                                              cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t* results, int* count) {
  if (requested < 1) return fail("cublasLtMatmulAlgoGetHeuristic: requestedAlgoCount < 1");
  const uint32_t epilogue = reinterpret_cast<Desc*>(dp)->epilogue;
  if (const char* e = std::getenv("EMU_CUBLASLT_DECLINE_EPILOGUES");
      e && std::strcmp(e, "1") == 0 && epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    *count = 0;
    return CUBLAS_STATUS_NOT_SUPPORTED;  // the library's answer when no algorithm fits
  }
  const uint64_t ws = reinterpret_cast<Pref*>(pref)->max_workspace;
  std::memset(&results[0], 0, sizeof(results[0]));
  results[0].workspaceSize = ws < kEmuWorkspace ? ws : kEmuWorkspace;
  results[0].algo.data[0] = results[0].workspaceSize;  // what cublasLtMatmul will need
  // The alignments the algorithm assumes: the caller's promised ones
  // (algo.data[1..4]); cublasLtMatmul checks the pointers against them, as
  // an algorithm chosen for an alignment the data lacks reads wrongly.
  for (int i = 0; i < 4; ++i) results[0].algo.data[1 + i] = reinterpret_cast<Pref*>(pref)->min_align[i];
  // The bias and aux pointers' alignments at the query: the library's
  // header says the heuristic expects at least those of later calls.
  const Desc& d = *reinterpret_cast<Desc*>(dp);
  results[0].algo.data[5] = d.bias ? alignment(d.bias) : 0;
  results[0].algo.data[6] = d.aux ? alignment(d.aux) : 0;
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *count = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t dp, const void* alpha, const void* A,
                              cublasLtMatrixLayout_t al, const void* B, cublasLtMatrixLayout_t bl, const void* beta,
                              const void* C, cublasLtMatrixLayout_t cl, void* D, cublasLtMatrixLayout_t dl,
                              const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream) {
  const Desc d = *reinterpret_cast<Desc*>(dp);
  const Layout a = *reinterpret_cast<Layout*>(al), b = *reinterpret_cast<Layout*>(bl);
  const Layout c = *reinterpret_cast<Layout*>(cl), dd = *reinterpret_cast<Layout*>(dl);
  if (!is_fp8(a.type) && !is_fp8(b.type))
    return matmul_epilogue(d, alpha, A, a, B, b, beta, C, c, D, dd, algo, workspace, workspace_bytes, stream);
  if (d.epilogue != CUBLASLT_EPILOGUE_DEFAULT) return unsupported("a float8 matmul with an epilogue");
  if (cublasStatus_t s = check_fp8(d, a, b, c, dd, A, B, D); s != CUBLAS_STATUS_SUCCESS) return s;
  // TN: op(A) = A^T is a.cols x a.rows, op(B) = B is b.rows x b.cols.
  const uint64_t m = a.cols, k = a.rows, n = b.cols;
  if (b.rows != k || dd.rows != m || dd.cols != n || c.rows != m || c.cols != n)
    return fail("cublasLtMatmul: layouts do not form op(A) op(B) = D");
  const void* ptrs[4] = {A, B, C, D};
  if (cublasStatus_t s = check_algo(algo, workspace_bytes, ptrs); s != CUBLAS_STATUS_SUCCESS) return s;
  const float al_v = *static_cast<const float*>(alpha), be_v = *static_cast<const float*>(beta);
  if (be_v != 0 || C != D) return unsupported("cublasLtMatmul with beta != 0 or C != D");
  const char* what = "cublasLtMatmul";
  check_matrix(A, a, what);
  check_matrix(B, b, what);
  check_matrix(D, dd, what);
  if (workspace_bytes > 0) emu::check_device_range(workspace, workspace_bytes, what);
  if (d.a_scale) emu::check_device_range(d.a_scale, sizeof(float), what);
  if (d.b_scale) emu::check_device_range(d.b_scale, sizeof(float), what);
  emu::enqueue(
      stream,
      [=] {
        // The products of two float8 values are exact; the sum runs in
        // double and is rounded once (the tensor cores' order differs).
        const float scale = al_v * (d.a_scale ? *d.a_scale : 1.0f) * (d.b_scale ? *d.b_scale : 1.0f);
        for (uint64_t j = 0; j < n; ++j)
          for (uint64_t i = 0; i < m; ++i) {
            double acc = 0;
            for (uint64_t p = 0; p < k; ++p) acc += ld(A, a.type, p + i * a.ld) * ld(B, b.type, p + j * b.ld);
            st(D, dd.type, i + j * dd.ld, static_cast<float>(acc) * scale);
          }
      },
      what);
  return CUBLAS_STATUS_SUCCESS;
}
}
