// Tensor and sequence parallelism as transforms of a module, with the plan
// styles of torch.distributed.tensor.parallel: parallelize_module shards
// the parameters of the modules a plan names (they become DTensors: the
// local part, carrying its spec, so optimizers, clip_grad_norm_ and
// checkpoints see them) and converts activations at those modules'
// boundaries. Inside, modules compute on local tensors: a column-parallel
// Linear's output is its columns, a row-parallel one's a partial sum.
//
//   auto tp = DeviceMesh::create({2}, {"tp"});
//   parallelize_module(block, tp, {
//       {"attn", ColwiseParallel{}},                 // q, k, v by heads
//       {"attn.out_proj", RowwiseParallel{}},
//       {"mlp.c_fc", ColwiseParallel{}},
//       {"mlp.c_proj", RowwiseParallel{}},
//   });
//
// Styles (layouts are placements on the 1-D tp mesh; activations enter and
// leave as local tensors unless use_local_output is false, which leaves the
// output annotated so as_dtensor() reads it):
//   ColwiseParallel   Linear weight and bias Shard(0); Embedding weight
//                     Shard(1); MultiheadAttention's stacked in_proj split
//                     by heads (Shard(0, groups=3)). Input input_layouts ->
//                     Replicate (its gradient arrives Partial: all-reduced,
//                     or reduce-scattered back to a sequence shard); output
//                     Shard(-1) -> output_layouts.
//   RowwiseParallel   Linear weight Shard(1), bias Replicate (added once,
//                     after the reduction); Embedding weight Shard(0)
//                     (vocab-parallel: tokens outside this rank's rows give
//                     zeros). Input input_layouts -> Shard(-1) (Linear);
//                     output Partial -> output_layouts (all-reduce, or
//                     reduce-scatter to a sequence shard).
//   SequenceParallel  the module (LayerNorm, Dropout, a position embedding)
//                     runs on a sequence shard; its parameters stay
//                     replicated and their gradients are all-reduced over
//                     tp (each rank saw part of the sequence); its
//                     dropouts draw different masks on different ranks.
//   PrepareModuleInput / PrepareModuleOutput  convert the input / output
//                     between layouts, nothing else.
// The plan is an ordered list of (module name, style); a name may use * for
// one path component ("h.*.mlp.c_fc"); a module may appear under several
// entries (their hooks run in plan order). A name matching no module is an
// error listing the model's modules, before anything is changed.
//
// Debugging: with EMBER_TP_CHECK_REPLICATED=1 every input a style declares
// Replicate is compared across the tp ranks (a hash of its bytes, one small
// all-gather) and the first module whose input differs is named: silently
// different "replicated" activations (different data per tp rank, a
// dropout mask that differs) are the classic wrong-result of tensor
// parallelism, and the check is too dear to leave on.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "distributed/tensor/dtensor.h"
#include "nn/module.h"

namespace ember::distributed {

struct ColwiseParallel {
  Placement input_layouts = Replicate();
  Placement output_layouts = Shard(-1);
  bool use_local_output = true;
};

struct RowwiseParallel {
  Placement input_layouts = Shard(-1);
  Placement output_layouts = Replicate();
  bool use_local_output = true;
};

struct SequenceParallel {
  int sequence_dim = 1;
  // The input's layout: already a sequence shard (Shard(sequence_dim)), or
  // Replicate to be cut into one here (position ids).
  std::optional<Placement> input_layouts;
  bool use_local_output = true;
};

struct PrepareModuleInput {
  Placement input_layouts = Replicate();
  Placement desired_input_layouts = Replicate();
  // The layout the converted input's gradient arrives in (default: the
  // desired layout; Partial when the module computes with sharded weights).
  std::optional<Placement> desired_grad_layouts;
};

struct PrepareModuleOutput {
  Placement output_layouts = Replicate();
  Placement desired_output_layouts = Replicate();
  std::optional<Placement> desired_grad_layouts;
  bool use_local_output = true;
};

using ParallelStyle =
    std::variant<ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput>;
using ParallelizePlan = std::vector<std::pair<std::string, ParallelStyle>>;

// "ColwiseParallel(input Replicate(), output Shard(-1))".
std::string style_string(const ParallelStyle& style);

// Applies `plan` to `module`'s submodules (names relative to `module`; ""
// is the module itself) on the one-dimensional `tp_mesh`. Collective over
// the mesh: parameters are broadcast from its first rank before they are
// cut, so every rank holds parts of one model. Errors name the plan entry:
// a name matching no module, a style that does not apply to the module's
// kind, heads or sizes that do not split, a parameter sharded twice.
void parallelize_module(nn::Module& module, const std::shared_ptr<DeviceMesh>& tp_mesh, const ParallelizePlan& plan);

// The entries of `plan` whose first path component names a child of
// `module` (or is "*"), and whose numbered block ("h.3" of "h.3.mlp"),
// when an entry names one, is the module's: a pipeline stage's share of
// the whole model's plan (the embedding's entries only where the stage
// holds the embedding).
ParallelizePlan plan_for(const ParallelizePlan& plan, const nn::Module& module);

// The tp mesh `module`'s parameters were sharded over, or null.
std::shared_ptr<DeviceMesh> tensor_parallel_mesh(const nn::Module& module);

}  // namespace ember::distributed
