// Agreements across ranks that sharded training needs: the loss scaler's
// skip decision made together, and the global gradient norm for clipping. A GradScaler whose ranks see different
// gradients (each rank's optimizer owns a shard of the parameters, as with optimizer-state sharding or FSDP) must skip
// a step on every rank when any rank saw an inf or NaN, or the replicas drift apart and their scales diverge:
//
//   optim::GradScaler scaler({.sync_found_inf = distributed::found_inf_allreduce(pg)});
//
// After DDP the averaged gradients are the same on every rank, so their
// flags already agree and this is not needed (it would cost one 8-byte
// allreduce a step).
#pragma once

#include <functional>
#include <memory>

#include "core/tensor.h"
#include "distributed/comm/process_group.h"

namespace ember::distributed {

// Sums the scaler's {found, gradients} flags over the ranks of `pg` (null:
// the default group) in place; for GradScalerOptions::sync_found_inf. The
// tensor stays on its device (NCCL for a CUDA scale); waiting for the
// allreduce is the step's one host sync, which step() would make anyway.
// Every rank must call unscale_/step for the same optimizers in the same
// order.
std::function<void(const Tensor& flags)> found_inf_allreduce(std::shared_ptr<ProcessGroup> pg = nullptr);

// The other agreement sharded training needs: the global norm of gradients
// split over ranks, for optim::clip_grad_norm_'s reduce_partial. Sums this
// rank's partial (sum of |g|^p) over the ranks of `pg`, or takes the max for
// the infinity norm; one 8-byte allreduce on the group's device.
//
//   optim::clip_grad_norm_(shard_params, 1.0, 2.0, distributed::grad_norm_allreduce(pg, 2.0));
std::function<void(const Tensor& partial)> grad_norm_allreduce(std::shared_ptr<ProcessGroup> pg, double norm_type);

}  // namespace ember::distributed
