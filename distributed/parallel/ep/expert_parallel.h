// Expert parallelism as a transform of a module: every nn::MoE layer's
// experts split over the ranks of a 1-D `ep` mesh, its tokens sent to them
// and back with all-to-alls (torchtitan's ExpertParallel, Megatron's
// all-to-all token dispatcher, DeepSpeed-MoE).
//
//   auto mesh = dims.build_mesh();                     // dims.ep = 2: the "ep" view
//   expert_parallel(*model, mesh->submesh({"ep"}));
//   set_moe_balance_group(*model, mesh->submesh({"dp"})->group());
//
// Per layer, rank i of ep keeps experts [i E/ep, (i+1) E/ep) of the stacked
// weights: experts.w1/w2/w3 become DTensors Shard(0) on the ep mesh of
// their global [E, ...] shape, so a sharded checkpoint holds one tensor per
// layer and loads at any other ep (or in one process). The router stays
// whole and routes locally, so every token's choices are what one process
// computes. The dispatch the layer calls (nn::MoE::dispatch), on the tokens
// the layer sorted by expert:
//   1. the per-expert counts exchanged (an all-to-all of E ints);
//   2. the tokens sent with those uneven splits (all_to_all_v), received
//      grouped by source rank, reordered by local expert;
//   3. the local experts' grouped GEMMs;
//   4. the results reordered back and returned by the reverse all_to_all_v.
// The backward runs the same exchanges in reverse (functional::all_to_all_v).
// With a capacity (MoEOptions::capacity_factor) the counts are not sent:
// every expert's group is C rows, padding included, so each all-to-all has
// even splits of E/ep x C rows and nothing is read on the host (a captured
// step holds it); each rank drops its own choices past C before sending
// (Megatron's capacity per rank), so a rank's output is what one process
// gives for its tokens alone. The ep ranks must pad alike (route as many
// tokens per forward): an eager forward checks it (an all-gather of C, read
// on the host: the one wait of the padded exchange), a captured step relies
// on its warm-up's checks (a replay cannot change a shape).
//
// Gradients: the experts' weights receive the gradient of the sum of the
// ep ranks' losses (tokens from every rank meet there), and are divided by
// ep, so that with each rank's loss the mean of its own batch they are the
// mean over the ep ranks' batches, as a data-parallel average would make
// them. A data-parallel wrapper over the ranks not in ep (FSDP over
// dp_shard / ep, or replicas) averages over those. The router, the shared
// experts and the rest of the model are data-parallel as usual.
#pragma once

#include <memory>

#include "distributed/comm/process_group.h"
#include "distributed/device_mesh.h"
#include "nn/module.h"

namespace ember::distributed {

// Collective over the ep mesh's ranks. Every MoE layer of `model` (nn::moe_layers)
// is split; a layer whose expert count ep does not divide is a named error
// before anything changes. Applied once, before data parallelism wraps the model.
void expert_parallel(nn::Module& model, const std::shared_ptr<DeviceMesh>& ep_mesh);

// The MoE layers' load-balancing counts summed over `pg` (the data-parallel
// ranks: each layer's f_e is then the whole batch's, as in one process).
void set_moe_balance_group(nn::Module& model, const std::shared_ptr<ProcessGroup>& pg);

}  // namespace ember::distributed
