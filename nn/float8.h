// Float8 training for a model's linear layers (torchao's
// convert_to_float8_training with tensorwise dynamic scaling): every Linear,
// TiedLinear and attention in-projection it converts computes through
// float8_linear (core/ops_float8.h), e4m3 forward and e5m2 for gradients.
// The parameters stay as they are (names, dtypes, state dicts), so a
// checkpoint moves between float8 and high-precision runs, and FSDP, mixed
// precision, activation checkpointing and CUDA graphs compose with it.
#pragma once

#include <functional>
#include <string>
#include <vector>

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
};

// Converts the linear layers under `root` and returns their fqns. Layers
// whose in or out features are not multiples of 16 are skipped (float8
// matmuls need it). A layer that already has a kernel of its own (tensor
// parallelism's sequence-gathering linear) is refused by name: convert
// before parallelizing, and tensor parallelism in float8 is not supported.
std::vector<std::string> convert_to_float8_training(Module& root, const Float8Options& options = {});

}  // namespace ember::nn
