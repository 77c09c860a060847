// Mixed precision across ranks: the loss scaler's skip decision made
// together. A GradScaler whose ranks see different gradients (each rank's
// optimizer owns a shard of the parameters, as with optimizer-state sharding
// or FSDP) must skip a step on every rank when any rank saw an inf or NaN,
// or the replicas drift apart and their scales diverge:
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
#include "distributed/process_group.h"

namespace ember::distributed {

// Sums the scaler's {found, gradients} flags over the ranks of `pg` (null:
// the default group) in place; for GradScalerOptions::sync_found_inf. The
// tensor stays on its device (NCCL for a CUDA scale); waiting for the
// allreduce is the step's one host sync, which step() would make anyway.
// Every rank must call unscale_/step for the same optimizers in the same
// order.
std::function<void(const Tensor& flags)> found_inf_allreduce(std::shared_ptr<ProcessGroup> pg = nullptr);

}  // namespace ember::distributed
