// Activation checkpointing for modules: torch's checkpoint_wrapper and
// torchtitan's policies (full, every K-th block, selective per op) over
// autograd::checkpoint (autograd/checkpoint.h, non-reentrant semantics).
//
//   nn::apply_activation_checkpointing(gpt->h->named_children(),
//                                      nn::ActivationCheckpointing::parse("selective"));
//   // or one module: nn::checkpoint_wrapper(*block);
//
// A wrapped module's forward runs as one checkpointed region each call; the
// module itself is unchanged (its parameter names keep no
// `_checkpoint_wrapped_module.` prefix, unlike torch's wrapper, so state
// dicts and checkpoints are the same with and without it). Its hooks run
// outside the region: fully_shard's all-gather comes before the forward, and
// its re-gather for backward comes before the recompute, which uses it (no
// second all-gather, the cost of torch's checkpoint around an FSDP module,
// pytorch#105635). The recompute runs each submodule in the train/eval mode
// of the first run; BatchNorm updates its running statistics once, in the
// forward; a recompute that changes another buffer is an error naming it.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "autograd/checkpoint.h"
#include "nn/module.h"

namespace ember::nn {

// Checkpoints every call of `module` from now on; `save` keeps the outputs
// of the ops it names (selective), null recomputes everything. `name`
// names the region in errors (default: the module's type).
void checkpoint_wrapper(Module& module, autograd::SavePolicy save = nullptr, std::string name = "");
void remove_checkpoint_wrapper(Module& module);
bool is_checkpointed(const Module& module);

// torchtitan's activation-checkpointing modes, as //examples:gpt --ac.
struct ActivationCheckpointing {
  enum class Mode { None, Full, Selective, EveryK };
  Mode mode = Mode::None;
  int every = 1;  // EveryK: blocks K-1, 2K-1, ... (each K-th, torchtitan's ac_freq)
  // "none" | "full" | "selective" | "every:K" (K >= 1); throws naming the value otherwise.
  static ActivationCheckpointing parse(const std::string& s);
  std::string str() const;
};

// Wraps the blocks `ac` selects (full and selective: all; every:K: each
// K-th); returns how many were wrapped. Names label the regions' errors.
int apply_activation_checkpointing(const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& blocks,
                                   const ActivationCheckpointing& ac);
// The blocks are `root`'s submodules whose type_name() is one of
// `block_types` ("TransformerBlock", "BasicBlock"), in module order, named
// by their paths ("h.3", "layer2.1").
int apply_activation_checkpointing(Module& root, const std::vector<std::string>& block_types,
                                   const ActivationCheckpointing& ac);

namespace detail {
// Module::operator()'s path for a wrapped module.
Tensor checkpointed_forward(Module& module, const Tensor& x);
}  // namespace detail

}  // namespace ember::nn
