// See config_check.h. Rank 0's settings travel by broadcast (length, then
// bytes), each rank diffs them against its own, and one all-gather of
// "differs" flags lets every rank fail together, so no rank is left waiting
// in a later collective for a peer that stopped.
#include "distributed/config_check.h"

#include <map>
#include <sstream>

#include "core/ops.h"

namespace ember::distributed {
namespace {

std::string serialize(const std::vector<std::pair<std::string, std::string>>& settings) {
  std::string s;
  for (const auto& [k, v] : settings) s += k + "=" + v + "\n";
  return s;
}

std::map<std::string, std::string> parse(const std::string& text) {
  std::map<std::string, std::string> m;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const size_t eq = line.find('=');
    m[line.substr(0, eq)] = eq == std::string::npos ? "" : line.substr(eq + 1);
  }
  return m;
}

}  // namespace

void check_same_config(ProcessGroup& pg, const std::vector<std::pair<std::string, std::string>>& settings) {
  const std::string mine = serialize(settings);
  // On the group's device: NCCL takes only CUDA tensors (the examples' first
  // GPU run failed here, on a CPU tensor).
  const Device dev = pg.device();
  Tensor len = Tensor::from_vector({static_cast<double>(mine.size())}, {1}, {DType::Int64, dev});
  pg.broadcast(len, 0)->wait();
  const int64_t n = static_cast<int64_t>(len.to_vector()[0]);
  Tensor bytes = Tensor::empty({n}, DType::UInt8);
  if (pg.rank() == 0) std::copy(mine.begin(), mine.end(), bytes.data<uint8_t>());
  bytes = bytes.to(dev);
  pg.broadcast(bytes, 0)->wait();
  bytes = bytes.cpu();
  const std::string zeros(reinterpret_cast<const char*>(bytes.data<uint8_t>()), static_cast<size_t>(n));

  std::string diff;
  if (zeros != mine) {
    const auto a = parse(mine), b = parse(zeros);
    for (const auto& [k, v] : a) {
      auto it = b.find(k);
      const std::string theirs = it == b.end() ? "<unset>" : it->second;
      if (theirs != v) diff += (diff.empty() ? "" : "; ") + k + " is " + v + " here but " + theirs + " on rank 0";
    }
    for (const auto& [k, v] : b)
      if (!a.count(k)) diff += (diff.empty() ? "" : "; ") + k + " is <unset> here but " + v + " on rank 0";
  }
  Tensor flag = Tensor::from_vector({diff.empty() ? 0.0 : 1.0}, {1}, {DType::Int64, dev});
  Tensor flags = Tensor::empty({pg.size()}, {DType::Int64, dev});
  pg.allgather_into_tensor(flags, flag)->wait();
  std::string differing;
  const std::vector<double> f = flags.to_vector();
  for (int r = 0; r < pg.size(); ++r)
    if (f[r] != 0) differing += (differing.empty() ? "" : ", ") + std::to_string(r);
  EMBER_CHECK(diff.empty(), "the training configuration differs between ranks (rank ", pg.rank(), "): ", diff);
  EMBER_CHECK(differing.empty(), "the training configuration of rank(s) ", differing,
              " differs from rank 0's (each of them names the settings)");
}

}  // namespace ember::distributed
