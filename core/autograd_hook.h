// The seam between core ops and autograd/. Core ops do not know the graph:
// a differentiable op computes its result with recording switched off, then
// hands autograd a closure that maps the output gradient to input gradients.
// autograd/ installs the recorder at load time; without it (a core-only
// binary) nothing is recorded. Keeping each op's derivative beside its kernel
// (one file per op) is the point: the formula and the forward change together.
//
//   Tensor exp(const Tensor& x) {
//     return differentiable("exp", {x}, [&] { return unary_op(...); },
//         [](const Tensor& x, const Tensor& out) -> BackwardFn {
//           return [out](const Tensor& g) { return grads{g * out}; }; });
#pragma once

#include <functional>
#include <initializer_list>
#include <vector>

#include "core/profiler.h"
#include "core/tensor.h"

namespace ember {

// Whether ops record for autograd on this thread (torch.is_grad_enabled).
struct GradMode {
  static bool is_enabled();
  static void set_enabled(bool enabled);
};

// Switches recording off for a scope, as torch.no_grad().
class NoGradGuard {
 public:
  NoGradGuard() : prev_(GradMode::is_enabled()) { GradMode::set_enabled(false); }
  ~NoGradGuard() { GradMode::set_enabled(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

// Maps the gradient of an op's output to one gradient per input (an
// undefined Tensor where an input gets none).
using BackwardFn = std::function<std::vector<Tensor>(const Tensor& grad_output)>;

// Which of its inputs a backward function is asked for, at the call (torch's
// ctx.needs_input_grad narrowed per call): all of them, except while a
// zero-bubble pipeline splits a backward into the input gradients now and
// the weight gradients later (autograd.h, backward_input), when the engine
// asks a node first for the inputs that lead to the stage's input and later
// for the rest. A function may skip an unwanted input's gradient (linear,
// matmul, conv2d and layer_norm skip their weight GEMMs); one that computes
// it anyway is still correct, the engine keeps what it returned.
bool grad_wanted(size_t input);
// Set by the engine around one call of a backward function; `wanted` null:
// every input. Restores the previous mask on exit (a function may run a
// nested backward: a checkpointed region's recompute).
class GradWantedScope {
 public:
  explicit GradWantedScope(const std::vector<bool>* wanted);
  ~GradWantedScope();
  GradWantedScope(const GradWantedScope&) = delete;
  GradWantedScope& operator=(const GradWantedScope&) = delete;

 private:
  const std::vector<bool>* prev_;
};

// What autograd/ provides to core: recording and the Tensor members that
// need the graph (backward, grad, requires_grad_).
class AutogradRecorder {
 public:
  virtual ~AutogradRecorder() = default;
  // Makes `output` the result of a node that runs `fn`; `saved` are the
  // tensors `fn` reads, checked for in-place changes before it runs.
  // `stateless`: fn holds no tensor, so backward does not release it.
  virtual void record(const char* op, const std::vector<Tensor>& inputs, Tensor& output, BackwardFn fn,
                      const std::vector<Tensor>& saved, bool stateless) = 0;
  virtual void set_requires_grad(const Tensor& t, bool enabled) = 0;
  virtual bool is_leaf(const Tensor& t) = 0;
  virtual Tensor grad(const Tensor& t) = 0;
  virtual void set_grad(const Tensor& t, const Tensor& grad) = 0;
  virtual void backward(const Tensor& root, const Tensor& grad, bool retain_graph) = 0;
};
void set_autograd_recorder(AutogradRecorder* r);
AutogradRecorder* autograd_recorder();

// True when recording is on and some input requires grad.
inline bool needs_grad(std::initializer_list<Tensor> inputs) {
  if (!GradMode::is_enabled() || autograd_recorder() == nullptr) return false;
  for (const Tensor& t : inputs)
    if (t.requires_grad()) return true;
  return false;
}
bool needs_grad_list(const std::vector<Tensor>& inputs);

// An in-place write on `t`: refuses tensors autograd tracks (their old value
// may be needed by backward) and bumps the storage version.
void check_inplace(const Tensor& t, const char* op);

// Runs `forward` with recording off; if an input requires grad, records
// make_backward(out) -> {BackwardFn, saved tensors}.
struct Recorded {
  BackwardFn fn;
  std::vector<Tensor> saved;
  // fn captures no tensor (a cast, a copy): backward keeps the node, so a
  // second backward through it works, as torch allows for nodes without
  // saved variables. The autocast cache hands one cast of a parameter to
  // every forward of its scope, e.g. the micro-steps of gradient
  // accumulation, each backward separately.
  bool stateless = false;
};

// Selective activation checkpointing's seam (autograd/checkpoint.h): while
// a checkpointed region runs, differentiable ops offer their outputs to it
// (the region keeps those its policy names) and, when it is recomputed,
// take the kept ones back instead of computing again. Ops whose forward
// sets state beside its result (layer_norm's mean) are never kept: the
// region decides by name from the list of ops whose forward is only its
// result (checkpoint.cc).
class SavedOpOutputs {
 public:
  virtual ~SavedOpOutputs() = default;
  // True (and `out` set) when the recompute has this op's kept output.
  virtual bool replay(const char* op, Tensor& out) = 0;
  // The forward computed `out` for `op`.
  virtual void offer(const char* op, const Tensor& out) = 0;
};
// The innermost active region of this thread, or null; set by autograd/.
SavedOpOutputs* saved_op_outputs();
void set_saved_op_outputs(SavedOpOutputs* s);

template <typename Fwd, typename MakeBwd>
Tensor differentiable(const char* op, const std::vector<Tensor>& inputs, Fwd&& forward, MakeBwd&& make_backward) {
  SavedOpOutputs* kept = saved_op_outputs();
  const bool grad = needs_grad_list(inputs);
  Tensor out;
  // A kept output computes nothing: no profiler event.
  const bool replayed = grad && kept != nullptr && kept->replay(op, out);
  profiler::Scope prof(profiler::Kind::Op, replayed ? nullptr : op);  // every computing op is one profiler event
  if (prof.active()) prof.inputs(inputs);
  if (!replayed) {
    if (!grad) return forward();
    NoGradGuard g;
    out = forward();
    if (kept != nullptr) kept->offer(op, out);
  }
  // Saved outputs are detached aliases: the node must not own its output.
  Recorded r = make_backward(out.alias());
  autograd_recorder()->record(op, inputs, out, std::move(r.fn), r.saved, r.stateless);
  return out;
}

// Sums a broadcast gradient back down to `shape` (the inverse of expand).
Tensor sum_to(const Tensor& grad, const Shape& shape);

}  // namespace ember
