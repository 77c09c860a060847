// The GPT recipes: nn::GPT parallelized on a ParallelDims mesh with the
// library's steps (parallelize.h), whole or as a pipeline. What
// //examples:gpt runs; a user's own transformer gets the same from
// parallelize / pipeline_parallelize with its own plan and block type.
//
//   auto dims = ParallelDims{.dp_shard = -1, .tp = 2}.resolved(world);
//   auto mesh = dims.build_mesh();
//   auto par = parallelize_gpt(gpt, dims, mesh, {.sequence_parallel = true, .ac = "selective"});
//
//   auto sched = pp::make_schedule("1f1b", dims.pp, 1, /*microbatches=*/8);
//   auto pipe = pipeline_gpt(gpt, dims, mesh, sched, {}, {.loss = parallel_cross_entropy});
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "distributed/parallel/recipes/parallelize.h"
#include "nn/transformer.h"
#include "optim/grad_scaler.h"
#include "optim/optimizer.h"

namespace ember::distributed {

struct GPTParallelOptions {
  bool sequence_parallel = true;       // under tp (Megatron-SP)
  std::string ac = "none";             // none | full | selective | every:K, of the transformer blocks
  FSDPOptions fsdp;                    // strategy and mixed precision (the mesh comes from the dims)
  std::vector<int> blocks_per_stage;   // pipeline_gpt: blocks per stage; empty: balanced by parameters
  cp::ContextParallelOptions cp = {};  // under cp > 1: the exchange and the whole sequence's length
  // The blocks' linear layers in float8 (nn/float8.h's
  // convert_to_float8_training: tensorwise dynamic scaling, the LM head kept
  // in high precision), applied first, as torchtitan's float8 converter;
  // tensor parallelism splits them with whole-tensor scales (the amaxes of
  // split operands maxed over tp).
  bool float8 = false;
  // With float8: FSDP gathers those layers' weights in float8 (nn/float8.h's
  // enable_fsdp_float8_all_gather, torchtitan's
  // float8.enable_fsdp_float8_all_gather), a byte per element.
  bool float8_all_gather = false;
};

// gpt_tp_plan (Megatron's split, vocab-parallel embedding and head),
// TransformerBlock as FSDP's unit and checkpointing's region.
ParallelizeOptions gpt_parallelize_options(const nn::GPT& gpt, const GPTParallelOptions& options);

// Tensor parallelism, activation checkpointing, FSDP of every block and the
// root (HSDP with dp_replicate), in that order. pp must be 1.
Parallelized parallelize_gpt(const std::shared_ptr<nn::GPT>& gpt, const ParallelDims& dims,
                             const std::shared_ptr<DeviceMesh>& mesh, const GPTParallelOptions& options);

// The GPT cut into the schedule's stages (pp::split_gpt), this rank's
// stages parallelized as parallelize_gpt does, and the Pipeline over "pp".
// The stages share `gpt`'s modules; the caller may drop `gpt` afterwards
// (then only this rank's stages stay alive).
PipelineParallel pipeline_gpt(const std::shared_ptr<nn::GPT>& gpt, const ParallelDims& dims,
                              const std::shared_ptr<DeviceMesh>& mesh, const pp::Schedule& schedule,
                              const GPTParallelOptions& options, pp::PipelineOptions pipeline_options);

// One optimizer step of a parallelize_gpt model that waits for nothing on
// the GPU, as a function of the micro-batches (in = {tokens 0, targets 0,
// tokens 1, targets 1, ...}, on the model's device): zero_grad, each
// micro-batch's forward (parallel_cross_entropy) and backward of
// scale(loss / micro-batches), the gradients reduced on the last, the
// scaler's unscale_, clipping to max_norm on the device, the scaler's
// step_async and update; MoE layers' router losses scaled per micro-batch
// and their statistics reset for the step. Returns {the micro-batches'
// summed loss, the gradient norm}, 0-dim tensors on the device. What
// //examples:gpt --cuda-graph 1 captures (optim::GraphedStep).
std::vector<Tensor> gpt_step_on_device(nn::GPT& gpt, Parallelized& par, optim::Optimizer& opt,
                                       optim::GradScaler& scaler, const std::vector<Tensor>& in, double max_norm = 1.0);

}  // namespace ember::distributed
