// A training step captured as one CUDA graph and replayed (PyTorch's
// whole-network capture recipe, torch.cuda.graph): the first calls run the
// step eagerly (the warm-up, in which the optimizers and the loss scaler
// make their state), the next captures it on static copies of its inputs
// and replays it, and every later call copies its inputs into those and
// replays: the step's hundreds of launches cost the host one.
//
//   optim::GraphedStep step([&](const std::vector<Tensor>& in) {
//     opt.zero_grad();
//     Tensor loss = cross_entropy(model(in[0]), in[1]);
//     loss.backward();
//     Tensor norm = optim::clip_grad_norm_async_(model.parameters(), 1.0);  // no host sync
//     opt.step();
//     return std::vector<Tensor>{loss.detach(), norm};
//   }, {.device = 0, .optimizers = {&opt}});
//   for (...) {
//     std::vector<Tensor> out = step({x, y});  // x, y on the host or the device
//     sched.step();                             // reaches the graph: the lr is on the device
//     log(out[0].item());                       // the step's one wait, when wanted
//   }
//
// What the step may do is what core/cuda_graph.h allows; what it may not
// (an item(), a host copy, a GradScaler::step instead of
// step_async) is refused by name at the capture, and the step stays
// eager-runnable. The optimizers' learning rates live on the device from
// the start (ParamGroup::lr_tensor), so a schedule's changes reach the
// replays, and a run with the graph off (enabled = false) computes the
// same numbers as one with it.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "core/cuda_graph.h"
#include "core/tensor.h"
#include "optim/optimizer.h"

namespace ember::optim {

struct GraphedStepOptions {
  int device = 0;  // the CUDA device the step runs on
  // Eager calls before the capture: at least one where an optimizer or the
  // loss scaler makes its state on its first step (a capture refuses that).
  int warmup = 1;
  // Optimizers the step steps: their groups get a learning rate on the
  // device (lr_tensor) at construction.
  std::vector<Optimizer*> optimizers;
  bool enabled = true;  // false: every call runs eagerly (same numbers, for comparison)
  // Optional: after the warm-up, the step is captured at the first call
  // where this says it can be, and runs eagerly until then. E.g. SGD with
  // momentum under a loss scaler makes its buffers on its first step that
  // is not skipped, which an overflowing start can put off: then
  // [&] { return sgd.skips_on_device(); }.
  std::function<bool()> ready;
};

class GraphedStep {
 public:
  using Fn = std::function<std::vector<Tensor>(const std::vector<Tensor>& inputs)>;
  explicit GraphedStep(Fn fn, GraphedStepOptions options = {});

  // One step on `inputs` (on the host or the device; moved to the device).
  // After the capture every call's inputs must have the captured shapes and
  // dtypes. The outputs of a replayed step are the graph's own tensors,
  // which the next call overwrites: read or clone them before it.
  std::vector<Tensor> operator()(const std::vector<Tensor>& inputs);

  bool captured() const { return graph_ && graph_->captured(); }
  int64_t calls() const { return calls_; }
  // The call whose step was captured (1-based; 0 while none).
  int64_t captured_at() const { return captured_at_; }

 private:
  Fn fn_;
  GraphedStepOptions options_;
  std::vector<Tensor> inputs_, outputs_;  // the graph's static inputs and outputs
  int64_t calls_ = 0, captured_at_ = 0;
  // Last: destroyed first, its destructor waits for the last replay before
  // the static inputs (outside its pool) go back to the allocator.
  std::unique_ptr<CudaGraph> graph_;
};

}  // namespace ember::optim
