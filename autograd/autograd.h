// Define-by-run reverse-mode autograd. Every differentiable op in core/
// records a node (its derivative closure and edges to its inputs' nodes);
// Tensor::backward() runs the graph once in reverse topological order,
// freeing saved tensors as it goes unless retain_graph is set. Leaves
// accumulate into .grad() across calls, which gradient accumulation relies
// on.
//
//   Tensor w = ember::randn({3, 2}).requires_grad_();
//   Tensor loss = ember::sum(ember::relu(ember::matmul(x, w)));
//   loss.backward();
//   w.grad();  // d loss / d w
//
// Hooks for the distributed package: register_hook on any tensor sees (and
// may replace) its gradient; register_post_accumulate_grad_hook on a leaf
// fires once its .grad() holds this pass's gradient, in the order gradients
// become ready — DDP starts a bucket's allreduce from there.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/autograd_hook.h"
#include "core/tensor.h"

namespace ember::autograd {

struct Node;

// A tensor hook: receives the gradient; returning a defined Tensor replaces it.
using TensorHook = std::function<Tensor(const Tensor& grad)>;
// Runs after a leaf's .grad() has been updated by this backward pass.
using PostAccumulateHook = std::function<void(const Tensor& leaf)>;

// Autograd's per-tensor state, hung on TensorImpl::autograd_meta.
struct AutogradMeta : AutogradMetaBase {
  Tensor grad;                              // leaves only
  std::shared_ptr<Node> grad_fn;            // null for leaves
  std::weak_ptr<Node> grad_accumulator;     // leaves: the node that fills .grad
  std::vector<TensorHook> hooks;            // leaves; a non-leaf's live on grad_fn
  std::vector<PostAccumulateHook> post_accumulate_hooks;
};

// One recorded op. Every differentiable op has one differentiable output, so
// a node has one incoming gradient and one edge per input.
struct Node {
  std::string name;
  BackwardFn fn;                              // null once released, or for accumulators
  std::vector<std::shared_ptr<Node>> next;    // per input; null where no grad flows
  std::vector<std::pair<std::shared_ptr<Storage>, uint64_t>> saved_versions;
  std::vector<TensorHook> pre_hooks;          // hooks on this node's output tensor
  uint64_t sequence_nr = 0;                   // creation order; later runs first
  Shape out_shape;
  DType out_dtype = DType::Float32;
  Device out_device;
  bool released = false;
  bool stateless = false;                     // fn holds no tensor: never released
  std::shared_ptr<TensorImpl> leaf;           // set for AccumulateGrad nodes
};

// Registers a hook on `t`'s gradient; for a leaf it runs before accumulation.
void register_hook(const Tensor& t, TensorHook hook);
// Registers a hook on leaf `t` that runs after its .grad() is accumulated.
void register_post_accumulate_grad_hook(const Tensor& t, PostAccumulateHook hook);
// Queues `callback` to run when the backward pass running on this thread
// finishes (torch's Variable._execution_engine.queue_callback), after every
// gradient and hook of that pass; callbacks run in queue order and may queue
// more. An exception from one propagates out of backward(). Throws when no
// backward is running. DDP waits for its bucket allreduces from here.
void queue_callback(std::function<void()> callback);
// True while a backward pass (backward() or autograd::grad) runs on this thread.
bool in_backward();
// Keeps the gradient of a non-leaf in its .grad() after backward.
void retain_grad(const Tensor& t);
// The name of the op that produced `t` ("" for leaves).
std::string grad_fn_name(const Tensor& t);
// Clears a leaf's gradient: releases it (set_to_none) or zeroes it in place.
void zero_grad(const Tensor& t, bool set_to_none = true);

// Gradients of `output` with respect to `inputs` without touching .grad()
// (torch.autograd.grad); `grad_output` defaults to 1 for one element.
std::vector<Tensor> grad(const Tensor& output, const std::vector<Tensor>& inputs,
                         const Tensor& grad_output = Tensor(), bool retain_graph = false);

// Zero-bubble pipelines' split backward (Qi et al., 2023; torch's
// stage_backward_input / stage_backward_weight): backward_input runs only
// the part of the graph under `root` that leads to `inputs` (leaves: a
// pipeline stage's received activations), leaving their gradients in their
// .grad(), and returns the rest — every gradient that leads only to other
// leaves, the weights' — as a DeferredBackward whose run() computes it
// later, into .grad() and through the leaves' hooks as backward() would.
// A node on both paths (linear: dx now, dW later) is asked for its input
// gradients first and for its weight gradients at run() (grad_wanted in
// core/autograd_hook.h); an op that cannot split computes both at once and
// its weight gradients wait, already computed, for run(). backward_input
// then run() give the gradients backward() gives, bit for bit. An input
// that does not require grad (the token ids of a first stage) defers
// everything. Callbacks queued during either part run at its end.
class DeferredBackward {
 public:
  DeferredBackward() = default;
  DeferredBackward(DeferredBackward&&) = default;
  DeferredBackward& operator=(DeferredBackward&&) = default;
  // Computes the deferred gradients; once (an error the second time).
  void run();
  // True until run(): something is left to compute.
  bool pending() const { return root_ != nullptr; }
  // How many ops were split (asked for their weight gradients at run()),
  // against those whose weight gradients were computed with their input
  // gradients (ops that cannot split, checkpointed regions).
  int split_ops() const { return split_ops_; }
  int unsplit_ops() const { return unsplit_ops_; }

 private:
  friend DeferredBackward backward_input(const Tensor&, const Tensor&, const std::vector<Tensor>&);
  std::shared_ptr<Node> root_;  // a node whose edges carry the deferred gradients
  int split_ops_ = 0, unsplit_ops_ = 0;
};
DeferredBackward backward_input(const Tensor& root, const Tensor& grad, const std::vector<Tensor>& inputs);

}  // namespace ember::autograd
