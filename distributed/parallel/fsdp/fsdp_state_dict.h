// Full optimizer state dicts for an optimizer over a sharded model's
// parameters (torch's FSDP.full_optim_state_dict / optim_state_dict_to_load):
// each parameter's state (Adam's moments, SGD's momentum) gathered from the
// ranks' shards into the shape of the whole parameter, keyed and named as a
// plain optimizer over the unsharded model would save it, so a checkpoint
// written from N ranks loads into M ranks or into one process.
#pragma once

#include "distributed/parallel/fsdp/fsdp.h"
#include "optim/optimizer.h"

namespace ember::distributed {

// Every rank of the world calls it; with rank0_only the others get {}.
optim::OptimizerStateDict full_optim_state_dict(FSDPModule& root, const optim::Optimizer& opt,
                                                const FullStateDictOptions& options = {});
// Every rank passes the same full dict; each keeps its shard. Matches state
// to parameters by name where the dict has names.
void load_full_optim_state_dict(FSDPModule& root, optim::Optimizer& opt, const optim::OptimizerStateDict& full);

}  // namespace ember::distributed
