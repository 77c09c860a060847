// found_inf_allreduce and grad_norm_allreduce (rank_agreement.h): the agreements across ranks.
#include "distributed/parallel/rank_agreement.h"

#include <cmath>
#include <utility>

#include "core/exception.h"
#include "distributed/init.h"

namespace ember::distributed {

std::function<void(const Tensor& flags)> found_inf_allreduce(std::shared_ptr<ProcessGroup> pg) {
  if (!pg) pg = default_group();
  return [pg = std::move(pg)](const Tensor& flags) {
    EMBER_CHECK(flags.defined() && flags.dtype() == DType::Float32 && flags.numel() == 2,
                "found_inf_allreduce: expected the GradScaler's float32 [2] flags, got ",
                flags.defined() ? dtype_name(flags.dtype()) : "an undefined tensor",
                flags.defined() ? " " + shape_str(flags.sizes()) : "");
    if (pg->size() > 1) pg->allreduce(flags, ReduceOp::Sum)->wait();
  };
}

std::function<void(const Tensor& partial)> grad_norm_allreduce(std::shared_ptr<ProcessGroup> pg, double norm_type) {
  if (!pg) pg = default_group();
  const ReduceOp op = std::isinf(norm_type) ? ReduceOp::Max : ReduceOp::Sum;
  return [pg = std::move(pg), op](const Tensor& partial) {
    EMBER_CHECK(partial.defined() && partial.numel() == 1, "grad_norm_allreduce: expected a one-element partial norm");
    if (pg->size() == 1) return;
    Tensor t = partial.to(pg->device());  // NCCL needs it on the rank's GPU
    pg->allreduce(t, op)->wait();
    Tensor dst = partial;
    dst.copy_(t);
  };
}

}  // namespace ember::distributed
