// The CPU's oneDNN engine and per-thread stream, shared by every op that runs
// oneDNN primitives (conv.cc, matmul.cc), and our dtypes in its terms.
#pragma once

#include <cstdlib>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace ember::onednn {

// oneDNN's kernels capped at AVX-512 with BF16, unless the user names a cap
// (ONEDNN_MAX_CPU_ISA): the AMX kernels of Debian's oneDNN 2.6 (Sapphire
// Rapids and later) get 16-bit products wrong for some shapes (every output
// of a bf16 [1, 26] x [26, 60] matmul with transposed weights) and die of an
// illegal instruction on others ([1, 63] x [63, 60]), where the AVX-512 BF16
// kernels got every one of a sweep's 17,920 shapes right (M up to 64, N up
// to 128, K 1-80, either operand transposed). Both failing shapes have K not
// a multiple of 32, the AMX tile's depth; oneDNN's tracker has the same class
// of bug (uxlfoundation/oneDNN#1661: illegal instruction on a bf16 matmul with
// K = 63; #5717: the AMX bf16 K tail reading other rows, still in v3.14 and
// fixed in July 2026), so a newer oneDNN alone does not retire this cap.
// oneDNN takes a cap only before it generates its first kernel, so everything
// here that calls oneDNN calls this first; a refusal (some other library ran
// oneDNN before us) leaves oneDNN's default.
inline void cap_isa() {
  static const bool capped = [] {
    for (const char* name : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"})
      if (const char* e = std::getenv(name); e != nullptr && *e != '\0') return false;
    return dnnl_set_max_cpu_isa(dnnl_cpu_isa_avx512_core_bf16) == dnnl_success;
  }();
  (void)capped;
}

inline dnnl::engine& cpu_engine() {
  static dnnl::engine engine = (cap_isa(), dnnl::engine(dnnl::engine::kind::cpu, 0));
  return engine;
}
// A CPU stream only names the engine; one per thread avoids sharing it.
inline dnnl::stream& cpu_stream() {
  thread_local dnnl::stream stream(cpu_engine());
  return stream;
}

inline dnnl::memory::data_type data_type(DType t) {
  return t == DType::BFloat16 ? dnnl::memory::data_type::bf16
         : t == DType::Float16 ? dnnl::memory::data_type::f16
                               : dnnl::memory::data_type::f32;
}

// oneDNN names its implementations ("brg:avx512_core_bf16", "jit:gemm",
// "ref:any"); the reference ones are plain loops, slower than widening to
// float32, so 16-bit work only goes to oneDNN when it has a native kernel.
inline bool is_reference_impl(const char* impl) {
  return std::string(impl).find("ref") != std::string::npos;
}

// A oneDNN memory over a buffer from our caching CPU allocator, kept alive
// by `keep` until the primitive has run. oneDNN's own allocation (a plain
// malloc per memory object) maps fresh pages for every large temporary of
// every call: measured as 12% of a bf16 ResNet-18 step in the kernel's page
// fault and clear_page paths before this.
inline dnnl::memory scratch_memory(const dnnl::memory::desc& desc, std::vector<Tensor>& keep) {
  keep.push_back(Tensor::empty({static_cast<int64_t>(desc.get_size())}, DType::UInt8));
  return dnnl::memory(desc, cpu_engine(), keep.back().raw_data());
}

}  // namespace ember::onednn
