// nn::Module: the base of every layer and model. A module owns named
// parameters, buffers and child modules in registration order, which fixes
// the PyTorch-style dotted names of state_dict() ("layer1.0.conv1.weight")
// and the order DDP buckets gradients in.
//
//   struct Net : nn::Module {
//     std::shared_ptr<nn::Linear> fc1, fc2;
//     Net() : Module("Net") {
//       fc1 = register_module("fc1", std::make_shared<nn::Linear>(784, 128));
//       fc2 = register_module("fc2", std::make_shared<nn::Linear>(128, 10));
//     }
//     Tensor forward(const Tensor& x) override { return (*fc2)(relu((*fc1)(x))); }
//   };
//
// Call modules through operator() (`(*fc1)(x)`, `model(x)`), not forward():
// operator() is the non-virtual entry that runs the hooks around forward, as
// torch's Module.__call__ does; forward() is only the part a module
// overrides. Hooks (each registration returns a handle whose remove() takes
// it off again):
//   register_forward_pre_hook(fn(module, input) -> new input or {})
//   register_forward_hook(fn(module, input, output) -> new output or {})
//   register_full_backward_pre_hook(fn(module, grad_output) -> new grad or {})
// The backward pre-hook runs when the gradient of the module's output
// arrives, before any of the module's own backward: where FSDP gathers a
// layer's parameters again. An exception from a hook propagates to the caller.
// Parameters are plain Tensors that require grad; to() and load_state_dict()
// update them in place, so the handles a module keeps stay valid.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace ember::nn {

// Ordered (name, tensor) pairs, as PyTorch's OrderedDict state_dict.
class StateDict {
 public:
  void insert(const std::string& name, const Tensor& t);
  const Tensor* find(const std::string& name) const;
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  const std::vector<std::pair<std::string, Tensor>>& items() const { return items_; }
  size_t size() const { return items_.size(); }
  auto begin() const { return items_.begin(); }
  auto end() const { return items_.end(); }

 private:
  std::vector<std::pair<std::string, Tensor>> items_;
};

class Module;
using ForwardPreHook = std::function<Tensor(Module& module, const Tensor& input)>;
using ForwardHook = std::function<Tensor(Module& module, const Tensor& input, const Tensor& output)>;
using BackwardPreHook = std::function<Tensor(Module& module, const Tensor& grad_output)>;

// Takes a hook off again (torch's RemovableHandle). Dropping the handle
// keeps the hook; remove() is idempotent and safe after the module is gone.
class HookHandle {
 public:
  HookHandle() = default;
  void remove();

 private:
  friend class Module;
  std::function<void()> remove_;
};

class Module {
 public:
  explicit Module(std::string type_name = "Module") : type_name_(std::move(type_name)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Single-tensor forward; modules with other signatures define their own.
  virtual Tensor forward(const Tensor& x);
  // The call entry: forward pre-hooks, forward, forward hooks, then the
  // backward pre-hooks armed on the output.
  Tensor operator()(const Tensor& x);
  // Whether operator() is forward() alone: no hooks of any kind and no
  // checkpointed region of its own. A module's fused entry that computes
  // more than its forward (BatchNorm2d::add_relu) is taken only then, since
  // a hook would see the fused op's output in place of the module's.
  bool plain_call() const;

  // Hooks run in registration order; see the top of this file.
  HookHandle register_forward_pre_hook(ForwardPreHook hook);
  HookHandle register_forward_hook(ForwardHook hook);
  HookHandle register_full_backward_pre_hook(BackwardPreHook hook);

  const std::string& type_name() const { return type_name_; }

  std::vector<std::pair<std::string, Tensor>> named_parameters(bool recurse = true) const;
  std::vector<Tensor> parameters(bool recurse = true) const;
  std::vector<std::pair<std::string, Tensor>> named_buffers(bool recurse = true) const;
  std::vector<Tensor> buffers(bool recurse = true) const;
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& named_children() const { return children_; }
  // This module ("" or prefix) and every descendant, depth first.
  std::vector<std::pair<std::string, Module*>> named_modules(const std::string& prefix = "");

  virtual void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // Moves or casts every parameter and buffer in place; integer buffers
  // (num_batches_tracked) keep their dtype, as in PyTorch.
  void to(Device device);
  void to(DType dtype);
  void to(Device device, DType dtype);
  // Lays every 4-D parameter and buffer (and its gradient) out in `format`,
  // in place, as PyTorch's module.to(memory_format=...): a channels-last
  // model keeps its convolution weights OHWI, the layout cuDNN's NHWC
  // kernels read, so no step converts them. Other tensors are left as they are.
  void to(MemoryFormat format);

  // Parameters and persistent buffers, module by module in registration order.
  StateDict state_dict() const;
  // Copies values into the existing tensors. strict: every key must match
  // both ways; errors name the missing, unexpected or mis-shaped entries.
  void load_state_dict(const StateDict& state, bool strict = true);

  // Calls fn on every module, children first (PyTorch's order), e.g. for init.
  void apply(const std::function<void(Module&)>& fn);
  void zero_grad(bool set_to_none = true);
  // Number of scalar parameters.
  int64_t num_parameters() const;

  // State a transform of this module keeps on it (fully_shard's unit,
  // replicate's reducer), by the transform's key: owned by the module, so
  // it lives and dies with it, and no global registry maps modules to it.
  // Null clears the slot; an unset key reads null.
  void set_transform_state(const std::string& key, std::shared_ptr<void> state);
  std::shared_ptr<void> transform_state(const std::string& key) const;
  template <typename T>
  std::shared_ptr<T> transform_state_as(const std::string& key) const {
    return std::static_pointer_cast<T>(transform_state(key));
  }

 protected:
  Tensor& register_parameter(const std::string& name, Tensor t, bool requires_grad = true);
  Tensor& register_buffer(const std::string& name, Tensor t, bool persistent = true);
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    add_child(name, m);
    return m;
  }

 private:
  void add_child(const std::string& name, std::shared_ptr<Module> m);
  void check_new_name(const std::string& name) const;
  void collect_state(const std::string& prefix, StateDict& out) const;

  std::string type_name_;
  bool training_ = true;
  std::vector<std::pair<std::string, Tensor>> params_;
  struct Buffer {
    std::string name;
    Tensor t;
    bool persistent;
  };
  std::vector<Buffer> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  // Shared with the handles (which hold it weakly) so remove() after the
  // module is gone does nothing.
  struct Hooks {
    uint64_t next_id = 0;
    std::vector<std::pair<uint64_t, ForwardPreHook>> pre;
    std::vector<std::pair<uint64_t, ForwardHook>> post;
    std::vector<std::pair<uint64_t, BackwardPreHook>> backward_pre;
  };
  std::shared_ptr<Hooks> hooks_ = std::make_shared<Hooks>();
  std::vector<std::pair<std::string, std::shared_ptr<void>>> transform_states_;
  template <typename H>
  HookHandle add_hook(std::vector<std::pair<uint64_t, H>> Hooks::*list, H hook);
};

}  // namespace ember::nn
