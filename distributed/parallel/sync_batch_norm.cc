// SyncBatchNorm for C++ modules: convert_sync_batchnorm hands every
// nn::BatchNorm2d a cross-rank sum of its statistics, the differentiable
// all-reduce of the communication layer (see BatchNorm2d::cross_replica_sum
// in nn/layers.h for the statistics).
#include <utility>

#include "distributed/comm/functional_collectives.h"
#include "distributed/init.h"
#include "distributed/parallel/ddp.h"
#include "nn/layers.h"

namespace ember::distributed {

void convert_sync_batchnorm(nn::Module& module, std::shared_ptr<ProcessGroup> pg) {
  for (auto& [name, m] : module.named_modules()) {
    auto* bn = dynamic_cast<nn::BatchNorm2d*>(m);
    if (!bn) continue;
    // A null group resolves at forward time, so conversion may precede
    // init_process_group as in PyTorch.
    bn->cross_replica_sum = [pg](const Tensor& stats) {
      return functional::all_reduce(stats, ReduceOp::Sum, pg ? pg : default_group());
    };
  }
}

}  // namespace ember::distributed
