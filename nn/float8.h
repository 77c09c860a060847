// Float8 training for a model's linear layers (torchao's
// convert_to_float8_training with tensorwise dynamic scaling): every Linear,
// TiedLinear and attention in-projection it converts computes through
// float8_linear (core/ops_float8.h), e4m3 forward and e5m2 for gradients;
// so do a mixture of experts' stacked experts (GroupedExperts::kernel),
// expert by expert over padded groups (the MoE needs a capacity_factor).
// The parameters stay as they are (names, dtypes, state dicts), so a
// checkpoint moves between float8 and high-precision runs, and FSDP, mixed
// precision, activation checkpointing and CUDA graphs compose with it.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/ops_float8.h"
#include "nn/module.h"

namespace ember::nn {

struct Float8Options {
  // Modules whose fully qualified name equals one of these, or ends in
  // "." + one, stay in high precision: by default the LM head, whose
  // output feeds the loss over the whole vocabulary (torchtitan's default
  // keeps its "output" layer out for the same reason).
  std::vector<std::string> skip_fqns = {"lm_head"};
  // Further choice, on the fqn and the module; unset: every candidate.
  std::function<bool(const std::string& fqn, const Module& m)> filter;
  // Under fully_shard, gather these layers' weights already cast to e4m3
  // (torchao's enable_fsdp_float8_all_gather): each rank casts its shard of
  // the float32 master weight with the scale of the whole weight (the max
  // of the ranks' amaxes, one all-reduce per unit), so the all-gather moves
  // a byte per element instead of param_dtype's two or four, and the layer
  // computes with the gathered cast as it would with its own. The scale is
  // of the master weight, as torchao's, so under a bfloat16 param_dtype it
  // may differ from the one of the bfloat16 weight a plain gather gives.
  bool enable_fsdp_float8_all_gather = false;
};

// What conversion keeps on each converted module (Module::transform_state
// under kFloat8StateKey), for the parallelisms around it: the weight
// parameter, whether it may be gathered in float8, and the cast a
// parallelism gathered (FSDP sets it while the weight is gathered so and
// clears it when it reshards). While `cast` is set and the weight's data
// is absent (its storage freed: the gather's placeholder), the layer
// computes with the cast.
// Tensor parallelism sets `sync` when it splits the layer: the amaxes of
// the operands it splits are maxed over its group, so the scales are the
// whole tensors' and the layer computes what it would in one process.
struct Float8LinearState {
  Tensor weight;
  bool all_gather_in_float8 = false;
  Float8Weight cast;
  Float8AmaxSync sync;
};
inline constexpr const char* kFloat8StateKey = "float8";

// Converts the linear layers under `root` and returns their fqns. Layers
// whose in or out features are not multiples of 16 are skipped (float8
// matmuls need it). A layer that already has a kernel of its own (tensor
// parallelism's sequence-gathering linear) is refused by name: convert
// before parallelizing (tensor parallelism then keeps the float8 kernel and
// sets the state's sync), as torchao's float8 with torchtitan's plans.
std::vector<std::string> convert_to_float8_training(Module& root, const Float8Options& options = {});

}  // namespace ember::nn
