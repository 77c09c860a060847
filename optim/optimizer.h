// torch.optim for ember: the Optimizer base (parameter groups, per-parameter
// state, zero_grad, state_dict/load_state_dict) and SGD, Adam and AdamW.
//
//   ember::optim::SGD opt(model.parameters(), {.lr = 0.1, .momentum = 0.9});
//   for (...) { opt.zero_grad(); loss(model).backward(); opt.step(); }
//
// float16 and bfloat16 parameters are stepped in float32: their state is
// float32 and a float32 master copy ("master_param" in the state) takes the
// update, which is then rounded into the parameter, so updates smaller than
// the 16-bit spacing accumulate instead of vanishing. (torch keeps 16-bit
// state for 16-bit parameters; mixed-precision recipes keep float32 masters,
// which is what this gives without a second model. With autocast the
// parameters stay float32 and nothing changes.) A parameter written from
// outside (load_state_dict, an average swapped in) is noticed at the next
// step: each element whose value no longer equals its master rounded takes
// the parameter's value into the master.
//
// Hyperparameters live per group in a map<string, double>, as in torch's
// param_group dicts (booleans are 0/1, Adam's betas are "beta1"/"beta2"), so
// schedulers and checkpoints treat every optimizer alike. Steps run the
// fused kernels of core/ops_optim.h under NoGradGuard and update parameters
// in place; parameters whose grad is undefined are skipped, as in torch.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/ops_optim.h"
#include "core/tensor.h"

namespace ember::optim {

using Options = std::map<std::string, double>;

struct ParamGroup {
  std::vector<Tensor> params;
  // Entries override the optimizer's defaults; missing ones are filled in by
  // add_param_group. Schedulers add "initial_lr", as torch does.
  Options options;
  // Optional: the learning rate as a one-element float32 tensor on the
  // parameters' device, which the fused step reads there (torch's tensor
  // lr): a schedule or tuner can change it without a host synchronisation.
  // When set it is the learning rate used; options["lr"] stays the host's
  // record, and set_lr (what schedulers call) writes both.
  Tensor lr_tensor;
  double lr() const { return options.at("lr"); }
};

// Sets a group's learning rate: options["lr"], and lr_tensor on its device
// (a fill, no synchronisation) when the group has one.
void set_lr(ParamGroup& group, double lr);

// A checkpointable snapshot: tensors and plain numbers only, so it can be
// written as safetensors (the tensors, by name) plus JSON (the groups).
struct OptimizerStateDict {
  // "state.<index>.<name>", ordered by index then name. The index is torch's:
  // parameters numbered across groups in order. The tensors alias the live
  // state (as torch's state_dict does): write them out or clone them before
  // the next step if the snapshot must stay fixed.
  std::vector<std::pair<std::string, Tensor>> state;
  struct Group {
    Options options;
    std::vector<int64_t> params;  // the indices of this group's parameters
    // Their names in the model, where known (checkpoints record them), so a
    // load can match state to parameters by name rather than position.
    std::vector<std::string> param_names;
  };
  std::vector<Group> param_groups;
};

// The dtype optimizer state has for a parameter of `param` dtype: float32
// for float16/bfloat16 (see above), else the parameter's.
DType state_dtype(DType param);

// Fills every group's param_names from `named` (a model's
// named_parameters()); a parameter the model does not hold gets "".
void name_parameters(OptimizerStateDict& sd, const class Optimizer& opt,
                     const std::vector<std::pair<std::string, Tensor>>& named);
// The state dict with each group's indices reordered so that position i
// holds the index saved under the name of `opt`'s parameter i of that group:
// load_state_dict (positional, as torch's) then gives every parameter its
// own state even if the model registers parameters in another order. Where
// names are missing (older checkpoints, torch's format) `sd` comes back as
// it is. Throws naming the parameter when the names do not match up.
OptimizerStateDict match_by_name(const OptimizerStateDict& sd, const class Optimizer& opt,
                                 const std::vector<std::pair<std::string, Tensor>>& named);

// Splits a state dict key "state.<index>.<name>"; false when it is not one.
bool parse_state_key(const std::string& key, int64_t* index, std::string* name);

class Optimizer {
 public:
  using ParamState = std::map<std::string, Tensor>;

  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Adds a group; its options default to the optimizer's. Rejects unknown
  // option names, invalid values, and parameters already being optimized.
  void add_param_group(ParamGroup group);
  // Clears every parameter's gradient: releases it (set_to_none, torch's
  // default) or zeroes it in place.
  void zero_grad(bool set_to_none = true);
  virtual void step() = 0;
  // The step, unless `found_inf` (a one-element float32 tensor on the
  // parameters' device, GradScaler's flag) holds a value > 0. Optimizers
  // whose fused kernels read the flag on the device (skips_on_device())
  // decide there, without a host synchronisation; the default reads it.
  virtual void step_unless_inf(const Tensor& found_inf);
  virtual bool skips_on_device() const { return false; }

  std::vector<ParamGroup>& param_groups() { return groups_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  const Options& defaults() const { return defaults_; }
  // The state of parameter `p` (empty until its first step).
  const ParamState& state(const Tensor& p) const;
  const std::string& name() const { return name_; }

  // Virtual so a wrapper that shards the state (ZeroRedundancyOptimizer)
  // can stand in wherever an optimizer is checkpointed.
  virtual OptimizerStateDict state_dict() const;
  // The groups (options and parameter indices) without the state: what
  // trainer.json records, on any rank of any optimizer.
  OptimizerStateDict groups_dict() const;
  // The state this rank holds, for sharded checkpoints that write each
  // rank's part: per parameter (the parameter object the groups hold) and
  // state name, its value. `part` is set by an optimizer that keeps only
  // part of a parameter's state (ZeroRedundancyOptimizer: a run of its
  // elements), as the sharding vocabulary's ShardSpec
  // (distributed/sharding); null: the state covers what the parameter
  // itself holds. By default every parameter's state(), whole.
  struct LocalState {
    Tensor param;
    std::string name;
    Tensor value;
    std::shared_ptr<const ShardMetaBase> part;
  };
  virtual std::vector<LocalState> local_state() const;
  // Restores groups' hyperparameters and per-parameter state, copied to the
  // parameter's device in its state dtype (state_dtype; "step": a float32
  // count). Everything is checked before anything changes: group count,
  // parameters per group, state names and shapes, with the offending entry
  // named.
  virtual void load_state_dict(const OptimizerStateDict& sd);

  // Throws on out-of-range hyperparameters, as add_param_group does (for
  // wrappers that keep groups of their own).
  void check_options(const Options& o) const { validate(o); }
  // Names this optimizer keeps per parameter; "step" is a 0-dim tensor, the
  // others have the parameter's shape.
  virtual std::vector<std::string> state_names() const = 0;

 protected:
  Optimizer(std::string name, Options defaults);
  // Subclasses call this at the end of their constructor, once validate()
  // can dispatch to them.
  void init(std::vector<ParamGroup> groups);
  // Throws on an out-of-range hyperparameter (keys are checked already).
  virtual void validate(const Options& o) const = 0;
  ParamState& mutable_state(const Tensor& p) { return state_[p.impl_ptr().get()]; }

 private:
  std::string name_;
  Options defaults_;
  std::vector<ParamGroup> groups_;
  // Keyed by TensorImpl: parameter handles share one, and set_data (moving a
  // module) keeps it, so state follows the parameter.
  std::unordered_map<const TensorImpl*, ParamState> state_;
};

// torch.optim.SGD's hyperparameters: core's one struct for them (the fused
// kernels take the same), and its form in a parameter group's options.
using SGDOptions = ::ember::SgdOptions;
Options to_map(const SGDOptions& o);

// torch.optim.SGD. State: "momentum_buffer" (when momentum != 0).
class SGD : public Optimizer {
 public:
  explicit SGD(std::vector<Tensor> params, SGDOptions defaults = {});
  SGD(std::vector<ParamGroup> groups, SGDOptions defaults = {});
  void step() override;
  void step_unless_inf(const Tensor& found_inf) override;
  // Once every momentum buffer exists (a first step with momentum must run
  // to set it, so it is decided on the host).
  bool skips_on_device() const override;
  // Whether every trainable parameter of a group with momentum has its
  // buffer (made on its first step that was not skipped): what a CUDA
  // graph of the step needs first (GraphedStepOptions::ready), gradients
  // present or not.
  bool momentum_buffers_made() const;
  std::vector<std::string> state_names() const override { return {"momentum_buffer", "master_param"}; }

 protected:
  void validate(const Options& o) const override;

 private:
  void step_impl(const Tensor& found_inf);
};

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;
  bool maximize = false;
  Options to_map() const;
};

// torch.optim.Adam. State: "step" (0-dim float32 on the parameter's device,
// as torch's fused Adam keeps it),
// "exp_avg", "exp_avg_sq", and "max_exp_avg_sq" with amsgrad.
class Adam : public Optimizer {
 public:
  explicit Adam(std::vector<Tensor> params, AdamOptions defaults = {});
  Adam(std::vector<ParamGroup> groups, AdamOptions defaults = {});
  void step() override;
  void step_unless_inf(const Tensor& found_inf) override;
  bool skips_on_device() const override { return true; }
  std::vector<std::string> state_names() const override {
    return {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"};
  }

 protected:
  Adam(std::string name, Options defaults, bool decoupled);
  void validate(const Options& o) const override;

 private:
  void step_impl(const Tensor& found_inf);
  bool decoupled_ = false;
};

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool amsgrad = false;
  bool maximize = false;
  Options to_map() const;
};

// torch.optim.AdamW: Adam with decoupled weight decay (p *= 1 - lr * wd).
class AdamW : public Adam {
 public:
  explicit AdamW(std::vector<Tensor> params, AdamWOptions defaults = {});
  AdamW(std::vector<ParamGroup> groups, AdamWOptions defaults = {});
};

}  // namespace ember::optim
