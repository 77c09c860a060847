// Parallelizing a model on a ParallelDims mesh, in torchtitan's order: the
// library calls every recipe is made of, for the GPT (gpt.h) and for a
// user's own model alike.
//
//   ParallelDims dims = ParallelDims{.dp_replicate = 2, .dp_shard = 2, .tp = 2}.resolved(world);
//   auto mesh = dims.build_mesh();
//   ParallelizeOptions o{.tp_plan = my_plan, .block_types = {"MyBlock"}, .ac = "full"};
//   auto fsdp = parallelize(model, dims, mesh, o);      // TP -> AC -> FSDP (HSDP here)
//
// The steps, each callable alone:
//   1. tensor parallelism over "tp" (parallelize_module with the model's
//      plan, cut to the module by plan_for), when tp > 1; then expert
//      parallelism of the MoE layers over "ep", when ep > 1 (apply_ep);
//   2. activation checkpointing of the blocks (before fully_shard, so each
//      block's gather and re-gather stay outside its region);
//   3. fully_shard of every block and of the root over dims.fsdp_mesh:
//      FSDP over dp_shard, HSDP when dp_replicate > 1 too. With
//      ParallelizeOptions::ddp and no sharding, replicate() (DDP) instead.
// Under a pipeline (pipeline_parallelize) the same steps run on each of
// this rank's stages; FSDP only when dp_shard > 1 (replicas without
// sharding are the pipeline's own dp_group).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "distributed/parallel/cp/context_parallel.h"
#include "distributed/parallel/ddp.h"
#include "distributed/parallel/fsdp/fsdp.h"
#include "distributed/parallel/pp/pipeline.h"
#include "distributed/parallel/pp/schedule/schedule.h"
#include "distributed/parallel/pp/stage.h"
#include "distributed/parallel/tp/tensor_parallel.h"
#include "distributed/parallel_dims.h"
#include "nn/module.h"

namespace ember::distributed {

struct ParallelizeOptions {
  // The model's tensor-parallel plan, by module path; applied when tp > 1.
  ParallelizePlan tp_plan;
  // The blocks: FSDP's units and activation checkpointing's regions, by
  // type_name() ("TransformerBlock").
  std::vector<std::string> block_types;
  std::string ac = "none";  // none | full | selective | every:K (nn::ActivationCheckpointing)
  // Strategy and mixed precision; the mesh comes from the dims (a given
  // mesh is an error: one description of the layout). dp_replicate > 1
  // makes it HYBRID_SHARD (FULL_SHARD or HYBRID_SHARD only).
  FSDPOptions fsdp;
  // Without sharding (dp_shard = cp = 1): DDP over dp_replicate instead of
  // FSDP units of one rank. Off: FSDP regardless (the GPT recipe's choice,
  // which keeps its checkpoints' layout the same on every mesh).
  bool ddp = false;
  DDPOptions ddp_options = {};
  // Context parallelism's exchange and the whole sequence's length; applied
  // when cp > 1 (the seq is then required), to the model or to each stage.
  cp::ContextParallelOptions cp = {};
};

// What parallelize made: one of them set.
struct Parallelized {
  std::shared_ptr<nn::Module> model;
  std::shared_ptr<FSDPModule> fsdp;
  std::shared_ptr<Replicated> ddp;
  int ac_blocks = 0;  // blocks wrapped by activation checkpointing
  // Clips the gradients to a global norm, whichever it is (collective under
  // FSDP, whose shards make the norm); returns the norm.
  double clip_grad_norm_(double max_norm);
  // The same with the norm on the device and nothing waiting for it
  // (optim::clip_grad_norm_async_): what a captured step (GraphedStep) uses.
  Tensor clip_grad_norm_async_(double max_norm);
  // Off: the next backwards only accumulate (FSDP keeps unsharded
  // gradients, DDP is inside no_sync); on: the next one reduces.
  void set_requires_gradient_sync(bool sync);

 private:
  std::shared_ptr<Replicated::NoSync> no_sync_;
};

// Step 0: context parallelism of `module` over mesh "cp" (every attention
// through cp::attention, the positions of this rank's chunks); nothing
// when cp = 1.
void apply_cp(nn::Module& module, const ParallelDims& dims, const DeviceMesh& mesh,
              const cp::ContextParallelOptions& o);
// Step 1b (after tensor parallelism): the MoE layers' load-balance counts
// summed over the data ranks (dp, or dp_cp), and with ep > 1 expert
// parallelism over mesh "ep" (ep/expert_parallel.h). Returns the expert
// weights it split, which FSDP must leave alone (FSDPOptions::ignored_params).
// Nothing for a module without MoE layers (a pipeline stage of dense
// blocks; parallelize and pipeline_parallelize check the whole model: ep >
// 1 without MoE layers, ep not dividing the experts, named).
std::vector<Tensor> apply_ep(nn::Module& module, const ParallelDims& dims, const DeviceMesh& mesh);
// Step 3a (before the blocks' FSDP): each MoE layer's experts an FSDP
// unit of their own, `options` but the mesh: with ep below dp_shard x cp
// sharded over "dp_shard_mod_ep" (the ranks holding the same experts);
// with ep all of it and dp_replicate > 1, NO_SHARD over "dp_replicate"
// (HSDP's replicas average them); nothing otherwise.
void apply_expert_fsdp(nn::Module& module, const ParallelDims& dims, const DeviceMesh& mesh, FSDPOptions options);
// Step 1: tensor parallelism of `module` over mesh "tp" (a stage takes
// plan_for(plan, stage), its share); nothing when tp = 1.
void apply_tp(nn::Module& module, const ParallelDims& dims, const DeviceMesh& mesh, const ParallelizePlan& plan);
// Step 2: returns the blocks wrapped.
int apply_ac(nn::Module& module, const std::vector<std::string>& block_types, const std::string& ac);
// Step 3: fully_shard of every block and the root, on dims.fsdp_mesh.
std::shared_ptr<FSDPModule> apply_fsdp(const std::shared_ptr<nn::Module>& module, const ParallelDims& dims,
                                       const DeviceMesh& mesh, const std::vector<std::string>& block_types,
                                       FSDPOptions options);
// FSDPOptions as apply_fsdp completes them (mesh, HSDP): for logs and checkpoints.
FSDPOptions fsdp_options(const ParallelDims& dims, const DeviceMesh& mesh, FSDPOptions options);

// Steps 1-3 on a whole model.
Parallelized parallelize(const std::shared_ptr<nn::Module>& model, const ParallelDims& dims,
                         const std::shared_ptr<DeviceMesh>& mesh, const ParallelizeOptions& options);

// A pipeline over mesh "pp": this rank's stages of `all_stages` (by the
// schedule), each parallelized (steps 1-3, FSDP when dp_shard > 1), and
// the Pipeline that runs them. `pipeline_options.dp_group` is filled with
// dp_replicate's group when there are replicas and no FSDP.
struct PipelineParallel {
  std::vector<std::shared_ptr<pp::PipelineStage>> stages;  // this rank's
  std::shared_ptr<nn::Module> part;                        // pp::rank_part(stages): optimizer and checkpoints
  std::vector<std::shared_ptr<FSDPModule>> fsdp;           // per stage, with dp_shard > 1
  std::unique_ptr<pp::Pipeline> pipe;
  int ac_blocks = 0;
  // Every stage's description and its pp rank ("stage 1 of 4: h.2-h.4", 1), for logs.
  std::vector<std::pair<std::string, int>> layout;
};
PipelineParallel pipeline_parallelize(const std::vector<std::shared_ptr<pp::PipelineStage>>& all_stages,
                                      const pp::Schedule& schedule, const ParallelDims& dims,
                                      const std::shared_ptr<DeviceMesh>& mesh, const ParallelizeOptions& options,
                                      pp::PipelineOptions pipeline_options);

}  // namespace ember::distributed
