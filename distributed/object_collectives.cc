// allgather_strings (object_collectives.h).
#include "distributed/object_collectives.h"

#include <algorithm>
#include <cstring>

#include "core/ops.h"

namespace ember::distributed {

std::vector<std::string> allgather_strings(ProcessGroup& pg, const std::string& mine) {
  const Device device = pg.device();  // NCCL takes only CUDA tensors
  const int ws = pg.size();
  Tensor len = Tensor::from_vector({static_cast<double>(mine.size())}, {1}, {DType::Int64, device});
  Tensor lens = zeros({ws}, {DType::Int64, device});
  pg.allgather_into_tensor(lens, len)->wait();
  const std::vector<double> sizes = lens.to_vector();
  int64_t max_len = 1;
  for (double s : sizes) max_len = std::max(max_len, static_cast<int64_t>(s));
  Tensor in = zeros({max_len}, {DType::UInt8, kCPU});
  if (!mine.empty()) std::memcpy(in.data<uint8_t>(), mine.data(), mine.size());
  Tensor outs = zeros({ws * max_len}, {DType::UInt8, device});
  pg.allgather_into_tensor(outs, in.to(device))->wait();
  const Tensor host = outs.cpu();
  const char* p = reinterpret_cast<const char*>(host.data<uint8_t>());
  std::vector<std::string> result;
  for (int r = 0; r < ws; ++r) result.emplace_back(p + r * max_len, static_cast<size_t>(sizes[r]));
  return result;
}

}  // namespace ember::distributed
