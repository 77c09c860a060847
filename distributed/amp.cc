// found_inf_allreduce (amp.h): the GradScaler's found-inf agreement.
#include "distributed/amp.h"

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

}  // namespace ember::distributed
