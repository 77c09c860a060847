// Activation checkpointing: trade a region's saved activations for
// recomputing it in backward. One mode only, PyTorch's non-reentrant one
// (torch.utils.checkpoint(use_reentrant=False)):
//
//   std::vector<Tensor> y = autograd::checkpoint(
//       [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{block(in[0])}; }, {x});
//
// The forward runs the region once and keeps only its inputs (and, under a
// selective policy, the outputs of the ops the policy keeps); everything
// else the region's ops saved is freed when it returns. When the gradients
// of the region's outputs have all arrived, backward re-runs the region
// from the kept inputs, back-propagates through the recomputed ops and
// frees them: one region's activations alive at a time.
//
// As torch's non-reentrant checkpoint: any differentiable op, any number of
// inputs and outputs, inputs that do not require grad (the parameters inside
// still get gradients), outputs used several times or not at all, nested
// regions, autograd::grad, retain_graph. Gradients reach the region's
// parameters and inputs through the enclosing backward pass, so each
// parameter's hooks (DDP's, FSDP's) fire once, in the pass's order.
//
// Recomputation is exact: the default generator's position (dropout masks),
// the autocast state and the grad mode are those of the first run; the
// recompute must record the same ops and produce outputs of the same shapes
// and dtypes, and must not change a tensor the forward read or a watched
// tensor (a module's buffers) — each a clear error naming the region, as
// torch's determinism check. EMBER_CHECKPOINT_CHECK=1 also compares the
// recomputed outputs with the first run's bit for bit (a debugging aid: on
// a GPU, kernels with atomics may legitimately differ).
//
// Selective checkpointing (torch's create_selective_checkpoint_contexts,
// torchtitan's op-level AC): `save` names the ops whose outputs are kept,
// so the recompute skips them; only ops whose forward is just their result
// can be kept (keepable_ops()). save_compute_intensive() keeps the
// compute-heavy ones (linear, matmul, conv2d, attention) and the collectives of tensor
// parallelism, so a recompute redoes only the cheap elementwise work and
// no communication, as Megatron's selective recompute.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace ember::autograd {

// True: the op's output is kept in forward and not recomputed.
using SavePolicy = std::function<bool(const std::string& op)>;
// The ops a policy may keep (their forward computes only their result).
const std::vector<std::string>& keepable_ops();
// Keeps linear, matmul, conv2d, scaled_dot_product_attention,
// sequence_parallel_linear and the collectives.
SavePolicy save_compute_intensive();

struct CheckpointOptions {
  std::string name = "checkpoint";  // names the region in errors
  SavePolicy save = nullptr;        // null: recompute everything
  bool preserve_rng_state = true;   // torch's default
  // Tensors the region may change in its forward but must not change when
  // recomputed (a module's buffers, by name): a recompute that changes one
  // would apply the forward's update twice.
  std::vector<std::pair<std::string, Tensor>> watch;
};

using RegionFn = std::function<std::vector<Tensor>(const std::vector<Tensor>& inputs)>;
std::vector<Tensor> checkpoint(const RegionFn& fn, const std::vector<Tensor>& inputs,
                               const CheckpointOptions& options = {});
Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& x,
                  const CheckpointOptions& options = {});

// True while a region is being recomputed on this thread: BatchNorm uses its
// batch statistics there without updating the running ones again.
bool in_checkpoint_recompute();
// How many checkpointed regions' forwards are running on this thread.
int checkpoint_forward_depth();

}  // namespace ember::autograd
