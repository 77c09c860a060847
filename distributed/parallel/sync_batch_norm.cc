// SyncBatchNorm for C++ modules: a differentiable cross-rank sum, and
// convert_sync_batchnorm, which hands it to every nn::BatchNorm2d (see
// BatchNorm2d::cross_replica_sum in nn/layers.h for the statistics).
#include <utility>

#include "core/autograd_hook.h"
#include "distributed/parallel/ddp.h"
#include "distributed/init.h"
#include "nn/layers.h"

namespace ember::distributed {

Tensor all_reduce_sum_differentiable(const Tensor& x, std::shared_ptr<ProcessGroup> pg) {
  EMBER_CHECK(x.defined(), "all_reduce_sum_differentiable: the input is undefined");
  if (!pg) pg = default_group();
  return differentiable(
      "all_reduce_sum", {x},
      [&] {
        Tensor y = x.contiguous().clone();
        pg->allreduce(y, ReduceOp::Sum)->wait();
        return y;
      },
      [&](const Tensor&) {
        // d(sum_r x_r)/d x_mine, with every rank's output feeding its own
        // loss: the gradient is the sum of all ranks' output gradients.
        BackwardFn fn = [pg](const Tensor& g) {
          Tensor s = g.contiguous().clone();
          pg->allreduce(s, ReduceOp::Sum)->wait();
          return std::vector<Tensor>{s};
        };
        return Recorded{std::move(fn), {}};
      });
}

void convert_sync_batchnorm(nn::Module& module, std::shared_ptr<ProcessGroup> pg) {
  for (auto& [name, m] : module.named_modules()) {
    auto* bn = dynamic_cast<nn::BatchNorm2d*>(m);
    if (!bn) continue;
    // A null group resolves at forward time, so conversion may precede
    // init_process_group as in PyTorch.
    bn->cross_replica_sum = [pg](const Tensor& stats) { return all_reduce_sum_differentiable(stats, pg); };
  }
}

}  // namespace ember::distributed
