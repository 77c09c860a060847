// The CPU's oneDNN engine and per-thread stream, shared by every op that runs
// oneDNN primitives (conv.cc, matmul.cc), and our dtypes in its terms.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace ember::onednn {

inline dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
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
