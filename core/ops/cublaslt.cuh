// What ember's cuBLASLt calls share (float8.cu's scaled matmul, matmul.cu's
// GEMMs with a fused epilogue): the one handle per device, the descriptors
// of one problem destroyed together, the operands' real alignments for the
// preference, the workspace size, and a per-thread cache of plans (a
// problem's descriptors and the algorithm the heuristic chose), so a step
// that repeats its problems queries the heuristic once per problem.
#pragma once

#include <cublasLt.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>

#include "core/cuda_check.h"
#include "core/ops/cuda_utils.cuh"

namespace ember::cuda {

inline cublasLtHandle_t lt_handle(int device) {
  return handle_slot<cublasLtHandle_t>("cublasLt", device,
                                       [](cublasLtHandle_t* h) { EMBER_CUBLAS_CHECK(cublasLtCreate(h)); })
      .handle;
}

// A problem's descriptors, destroyed with it on every path out.
struct LtCall {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  LtCall() = default;
  LtCall(const LtCall&) = delete;
  LtCall& operator=(const LtCall&) = delete;
  ~LtCall() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

template <typename V>
void set_attr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const V& v) {
  EMBER_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v)));
}

// The largest power of two up to 256 that divides p's address.
inline uint32_t alignment_of(const void* p) {
  uint32_t a = 1;
  while (a < 256 && reinterpret_cast<uintptr_t>(p) % (2 * a) == 0) a *= 2;
  return a;
}

// Hopper's cuBLASLt workspace (PyTorch's size for sm_90), from the caching
// allocator: stream-ordered, and inside a capture from the graph's pool.
constexpr uint64_t kLtWorkspace = uint64_t{32} << 20;

// The preference: at most kLtWorkspace, and the operands' real alignments
// (the library defaults to 256 bytes; an algorithm chosen for more than a
// view has reads wrongly), as torch's cuBLASLt calls set them.
inline void set_preference(LtCall& call, const uint32_t (&align)[4]) {
  EMBER_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&call.pref));
  EMBER_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(call.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                          &kLtWorkspace, sizeof(kLtWorkspace)));
  const cublasLtMatmulPreferenceAttributes_t attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    EMBER_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(call.pref, attrs[i], &align[i], sizeof(align[i])));
}

// One problem's descriptors and the heuristic's algorithm (found == false:
// the library has none for it, and the caller takes another path).
struct LtPlan {
  LtCall call;
  cublasLtMatmulHeuristicResult_t heuristic{};
  bool found = false;
};

// Plans by key, per thread: no lock on the hot path, and a descriptor whose
// per-call pointers (scales, bias) are set for one call is not shared with
// another thread's. Bounded: a workload of ever-new shapes starts over past
// 256 plans. `make` builds a plan on a miss. The plans are per key type
// (a static member): each cache has a key type of its own.
template <typename Key>
class LtPlanCache {
 public:
  template <typename Make>
  LtPlan& get(const Key& key, Make&& make) {
    auto it = plans_.find(key);
    if (it != plans_.end()) {
      hits_.fetch_add(1, std::memory_order_relaxed);
      return *it->second;
    }
    if (plans_.size() >= 256) plans_.clear();
    misses_.fetch_add(1, std::memory_order_relaxed);
    return *plans_.emplace(key, make()).first->second;
  }
  uint64_t hits() const { return hits_.load(std::memory_order_relaxed); }
  uint64_t misses() const { return misses_.load(std::memory_order_relaxed); }

 private:
  inline static thread_local std::map<Key, std::unique_ptr<LtPlan>> plans_;
  std::atomic<uint64_t> hits_{0}, misses_{0};
};

}  // namespace ember::cuda
