// Optimizer bookkeeping (groups, state, checkpoints) and the SGD / Adam /
// AdamW steps, which gather each group's parameters and hand them to the
// fused kernels in core/ops_optim.h in one call.
#include "optim/optimizer.h"

#include <algorithm>
#include <optional>
#include <set>
#include <tuple>

#include "autograd/autograd.h"
#include "core/autograd_hook.h"
#include "core/cuda_graph.h"
#include "core/ops.h"
#include "core/ops_optim.h"
#include "core/profiler.h"

namespace ember::optim {
namespace {

constexpr const char* kInitialLr = "initial_lr";  // written by LR schedulers

std::string join_keys(const Options& o) {
  std::string s;
  for (const auto& [k, v] : o) s += (s.empty() ? "" : ", ") + k;
  return s;
}

bool flag(const Options& o, const char* key) { return o.at(key) != 0.0; }

// A plain parameter list is one group; an empty list is no group at all, so
// init() reports it as torch does.
std::vector<ParamGroup> one_group(std::vector<Tensor> params) {
  if (params.empty()) return {};
  return {ParamGroup{std::move(params), {}}};
}

// 16-bit parameters are stepped through a float32 master copy with float32
// state (see optimizer.h): their state dtype differs from theirs.
bool is_low_precision(const Tensor& p) { return state_dtype(p.dtype()) != p.dtype(); }

TensorOptions state_options(const Tensor& p) { return {state_dtype(p.dtype()), p.device()}; }
// A new state tensor for p: its state dtype, laid out as p (a channels-last
// weight's moments are channels-last), so the fused step walks both as flat
// arrays. Uninitialised; `value` fills it when given.
Tensor state_like(const Tensor& p, std::optional<double> value = std::nullopt) {
  Tensor t = Tensor::empty(p.sizes(), state_options(p), p.suggest_memory_format());
  if (value) t.fill_(*value);
  return t;
}

// The tensor the fused step updates for `p`: p itself, or for a 16-bit
// parameter its float32 master (created from p on first use), which the
// step re-seeds from p where p was written from outside, steps and writes
// back rounded, reading p's gradient as it is (ops_optim.h's model_params).
// State made while p had another layout (the module was laid out
// channels-last, or back, after some steps) follows p's layout first, values
// kept: the fused step walks p and its state as flat arrays.
Tensor step_target(const Tensor& p, Optimizer::ParamState& st) {
  const MemoryFormat fmt = p.suggest_memory_format();
  for (auto& [name, t] : st)
    if (t.sizes() == p.sizes() && !t.is_contiguous(fmt)) t = t.contiguous(fmt);
  if (!is_low_precision(p)) return p;
  auto it = st.find("master_param");
  if (it == st.end()) {
    Tensor master = state_like(p);
    master.copy_(p);
    it = st.emplace("master_param", master).first;
  }
  return it->second;
}

// The fused step's `model_params` entry for p stepped through `target`.
Tensor model_param(const Tensor& p, const Tensor& target) { return target.is_same(p) ? Tensor() : p; }

}  // namespace

DType state_dtype(DType param) {
  return param == DType::Float16 || param == DType::BFloat16 ? DType::Float32 : param;
}

bool parse_state_key(const std::string& key, int64_t* index, std::string* name) {
  const size_t dot = key.find('.', 6);
  if (key.rfind("state.", 0) != 0 || dot == std::string::npos || dot <= 6 || dot + 1 >= key.size()) return false;
  try {
    size_t used = 0;
    *index = std::stoll(key.substr(6, dot - 6), &used);
    if (used != dot - 6 || *index < 0) return false;
  } catch (const std::exception&) {
    return false;
  }
  *name = key.substr(dot + 1);
  return true;
}

namespace {
std::map<const TensorImpl*, std::string> names_by_impl(const std::vector<std::pair<std::string, Tensor>>& named) {
  std::map<const TensorImpl*, std::string> out;
  for (const auto& [name, t] : named) out.emplace(t.impl_ptr().get(), name);
  return out;
}
}  // namespace

void name_parameters(OptimizerStateDict& sd, const Optimizer& opt,
                     const std::vector<std::pair<std::string, Tensor>>& named) {
  const auto names = names_by_impl(named);
  for (size_t gi = 0; gi < sd.param_groups.size() && gi < opt.param_groups().size(); ++gi) {
    auto& out = sd.param_groups[gi].param_names;
    out.clear();
    for (const Tensor& p : opt.param_groups()[gi].params) {
      auto it = names.find(p.impl_ptr().get());
      out.push_back(it == names.end() ? std::string() : it->second);
    }
  }
}

OptimizerStateDict match_by_name(const OptimizerStateDict& sd, const Optimizer& opt,
                                 const std::vector<std::pair<std::string, Tensor>>& named) {
  const std::string op = opt.name() + "::load_state_dict";
  // Saved name -> (group, index); any group without complete names: positional.
  std::map<std::string, std::pair<size_t, int64_t>> saved;
  for (size_t gi = 0; gi < sd.param_groups.size(); ++gi) {
    const auto& g = sd.param_groups[gi];
    if (g.param_names.size() != g.params.size()) return sd;
    for (size_t i = 0; i < g.params.size(); ++i) {
      if (g.param_names[i].empty()) return sd;
      EMBER_CHECK(saved.emplace(g.param_names[i], std::make_pair(gi, g.params[i])).second, op,
                  ": the state dict names parameter '", g.param_names[i], "' twice");
    }
  }
  const auto names = names_by_impl(named);
  OptimizerStateDict out = sd;
  for (size_t gi = 0; gi < out.param_groups.size() && gi < opt.param_groups().size(); ++gi) {
    const auto& params = opt.param_groups()[gi].params;
    // A count mismatch is load_state_dict's to report.
    if (params.size() != out.param_groups[gi].params.size()) return sd;
    for (size_t i = 0; i < params.size(); ++i) {
      auto n = names.find(params[i].impl_ptr().get());
      if (n == names.end()) return sd;  // not a model parameter: positions are all there is
      auto it = saved.find(n->second);
      EMBER_CHECK(it != saved.end(), op, ": the state dict holds no entry for parameter '", n->second,
                  "' (parameter ", i, " of group ", gi, ")");
      EMBER_CHECK(it->second.first == gi, op, ": parameter '", n->second, "' is in parameter group ", gi,
                  " of the optimizer but group ", it->second.first, " of the state dict");
      out.param_groups[gi].params[i] = it->second.second;
      out.param_groups[gi].param_names[i] = n->second;
    }
  }
  return out;
}

// ---- Optimizer ----
Optimizer::Optimizer(std::string name, Options defaults) : name_(std::move(name)), defaults_(std::move(defaults)) {}

void Optimizer::init(std::vector<ParamGroup> groups) {
  EMBER_CHECK(!groups.empty(), name_, ": optimizer got an empty parameter list");
  for (auto& g : groups) add_param_group(std::move(g));
}

void Optimizer::add_param_group(ParamGroup group) {
  const size_t gi = groups_.size();
  for (const Tensor& p : group.params) set_memory_kind(p, MemoryKind::Parameters);
  for (const auto& [k, v] : group.options)
    EMBER_CHECK(defaults_.count(k) || k == kInitialLr, name_, ": unknown option '", k, "' in parameter group ", gi,
                " (known: ", join_keys(defaults_), ")");
  for (const auto& [k, v] : defaults_) group.options.emplace(k, v);
  validate(group.options);
  if (group.lr_tensor.defined()) {
    const Tensor& t = group.lr_tensor;
    EMBER_CHECK(t.numel() == 1 && t.dtype() == DType::Float32 && t.is_contiguous(), name_, ": lr_tensor of group ",
                gi, " must be a one-element float32 tensor, got ", shape_str(t.sizes()), " ", t.dtype());
    for (const Tensor& p : group.params)
      EMBER_CHECK(!p.defined() || p.device() == t.device(), name_, ": lr_tensor of group ", gi, " is on ",
                  t.device(), " but a parameter of the group is on ", p.device());
    set_lr(group, group.options.at("lr"));
  }
  std::set<const TensorImpl*> seen;
  for (const auto& g : groups_)
    for (const Tensor& p : g.params) seen.insert(p.impl_ptr().get());
  for (size_t i = 0; i < group.params.size(); ++i) {
    const Tensor& p = group.params[i];
    EMBER_CHECK(p.defined(), name_, ": parameter ", i, " of group ", gi, " is undefined");
    EMBER_CHECK(is_floating(p.dtype()), name_, ": parameter ", i, " of group ", gi, " ", shape_str(p.sizes()),
                " has dtype ", p.dtype(), "; only floating tensors can be optimized");
    EMBER_CHECK(p.is_leaf(), name_, ": parameter ", i, " of group ", gi, " ", shape_str(p.sizes()),
                " is not a leaf; optimize the tensor the computation starts from");
    EMBER_CHECK(seen.insert(p.impl_ptr().get()).second, name_, ": parameter ", i, " of group ", gi, " ",
                shape_str(p.sizes()), " appears more than once across parameter groups");
  }
  groups_.push_back(std::move(group));
}

void Optimizer::zero_grad(bool set_to_none) {
  for (auto& g : groups_)
    for (const Tensor& p : g.params) autograd::zero_grad(p, set_to_none);
}

void Optimizer::step_unless_inf(const Tensor& found_inf) {
  EMBER_CHECK(found_inf.defined() && found_inf.numel() == 1, name_, "::step_unless_inf: found_inf must be a ",
              "one-element tensor");
  if (found_inf.cpu().item() == 0.0) step();  // the host sync an optimizer without a device skip needs
}

void set_lr(ParamGroup& group, double lr) {
  group.options["lr"] = lr;
  if (group.lr_tensor.defined()) {
    NoGradGuard no_grad;
    group.lr_tensor.fill_(lr);
  }
}

const Optimizer::ParamState& Optimizer::state(const Tensor& p) const {
  static const ParamState kEmpty;
  auto it = state_.find(p.impl_ptr().get());
  return it == state_.end() ? kEmpty : it->second;
}

OptimizerStateDict Optimizer::state_dict() const {
  OptimizerStateDict sd;
  int64_t index = 0;
  for (const auto& g : groups_) {
    OptimizerStateDict::Group out{g.options, {}};
    for (const Tensor& p : g.params) {
      out.params.push_back(index);
      for (const auto& [name, t] : state(p))
        sd.state.emplace_back("state." + std::to_string(index) + "." + name, t);
      ++index;
    }
    sd.param_groups.push_back(std::move(out));
  }
  return sd;
}

OptimizerStateDict Optimizer::groups_dict() const {
  OptimizerStateDict sd;
  int64_t index = 0;
  for (const auto& g : groups_) {
    OptimizerStateDict::Group out{g.options, {}};
    for (size_t i = 0; i < g.params.size(); ++i) out.params.push_back(index++);
    sd.param_groups.push_back(std::move(out));
  }
  return sd;
}

std::vector<Optimizer::LocalState> Optimizer::local_state() const {
  std::vector<LocalState> out;
  for (const auto& g : groups_)
    for (const Tensor& p : g.params)
      for (const auto& [name, t] : state(p)) out.push_back({p, name, t, nullptr});
  return out;
}

void Optimizer::load_state_dict(const OptimizerStateDict& sd) {
  const std::string op = name_ + "::load_state_dict";
  EMBER_CHECK(sd.param_groups.size() == groups_.size(), op, ": the state dict has ", sd.param_groups.size(),
              " parameter groups, the optimizer has ", groups_.size());
  // Saved indices map to this optimizer's parameters by position, as torch
  // does: the checkpoint must come from the same model layout.
  std::map<int64_t, Tensor> param_of;
  std::vector<Options> options(groups_.size());
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const auto& saved = sd.param_groups[gi];
    const auto& cur = groups_[gi];
    EMBER_CHECK(saved.params.size() == cur.params.size(), op, ": parameter group ", gi, " has ",
                saved.params.size(), " parameters in the state dict, ", cur.params.size(), " in the optimizer");
    for (size_t i = 0; i < cur.params.size(); ++i)
      EMBER_CHECK(param_of.emplace(saved.params[i], cur.params[i]).second, op, ": parameter index ",
                  saved.params[i], " appears twice in the state dict's groups");
    options[gi] = cur.options;
    for (const auto& [k, v] : saved.options) {
      EMBER_CHECK(defaults_.count(k) || k == kInitialLr, op, ": parameter group ", gi, " has unknown option '", k,
                  "' (known: ", join_keys(defaults_), ")");
      options[gi][k] = v;
    }
    validate(options[gi]);
  }
  const std::vector<std::string> names = state_names();
  std::vector<std::tuple<Tensor, std::string, Tensor>> entries;  // param, state name, value
  for (const auto& [key, t] : sd.state) {
    int64_t index = -1;
    std::string name;
    EMBER_CHECK(parse_state_key(key, &index, &name), op, ": state dict entry '", key,
                "' is not named state.<index>.<name>");
    auto it = param_of.find(index);
    EMBER_CHECK(it != param_of.end(), op, ": state dict entry '", key, "' refers to parameter ", index,
                ", which no parameter group of the state dict lists");
    EMBER_CHECK(std::find(names.begin(), names.end(), name) != names.end(), op, ": state dict entry '", key, "': ",
                name_, " keeps no state named '", name, "'");
    EMBER_CHECK(t.defined(), op, ": state dict entry '", key, "' is an undefined tensor");
    const Tensor& p = it->second;
    if (name == "step") {
      EMBER_CHECK(t.numel() == 1, op, ": state dict entry '", key, "' should hold one number, has shape ",
                  shape_str(t.sizes()));
    } else {
      EMBER_CHECK(t.sizes() == p.sizes(), op, ": state dict entry '", key, "' has shape ", shape_str(t.sizes()),
                  " but parameter ", index, " has shape ", shape_str(p.sizes()));
      EMBER_CHECK(is_floating(t.dtype()), op, ": state dict entry '", key, "' has dtype ", t.dtype(),
                  "; expected a floating tensor");
    }
    entries.emplace_back(p, name, t);
  }
  // Everything checked: now replace, copying so two optimizers (or the
  // snapshot and the live run) never share buffers.
  NoGradGuard no_grad;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    groups_[gi].options = std::move(options[gi]);
    set_lr(groups_[gi], groups_[gi].options.at("lr"));
  }
  state_.clear();
  MemoryKindScope optimizer_memory(MemoryKind::Optimizer);
  for (auto& [p, name, t] : entries) {
    Tensor copy = name == "step" ? Tensor::empty({}, {DType::Float32, p.device()}) : state_like(p);
    copy.copy_(name == "step" ? t.reshape({}) : t);
    mutable_state(p)[name] = copy;
  }
}

// ---- SGD ----
Options to_map(const SGDOptions& o) {
  return {{"lr", o.lr},
          {"momentum", o.momentum},
          {"dampening", o.dampening},
          {"weight_decay", o.weight_decay},
          {"nesterov", o.nesterov ? 1.0 : 0.0},
          {"maximize", o.maximize ? 1.0 : 0.0}};
}

SGD::SGD(std::vector<Tensor> params, SGDOptions defaults) : SGD(one_group(std::move(params)), defaults) {}

SGD::SGD(std::vector<ParamGroup> groups, SGDOptions defaults) : Optimizer("SGD", to_map(defaults)) {
  init(std::move(groups));
}

void SGD::validate(const Options& o) const {
  EMBER_CHECK(o.at("lr") >= 0.0, "SGD: invalid learning rate: ", o.at("lr"));
  EMBER_CHECK(o.at("momentum") >= 0.0, "SGD: invalid momentum value: ", o.at("momentum"));
  EMBER_CHECK(o.at("weight_decay") >= 0.0, "SGD: invalid weight_decay value: ", o.at("weight_decay"));
  EMBER_CHECK(!flag(o, "nesterov") || (o.at("momentum") > 0.0 && o.at("dampening") == 0.0),
              "SGD: Nesterov momentum requires a momentum and zero dampening (got momentum ", o.at("momentum"),
              ", dampening ", o.at("dampening"), ")");
}

void SGD::step() { step_impl(Tensor()); }

bool SGD::skips_on_device() const {
  // A new momentum buffer takes d on its first step: were that step skipped
  // on the device, the buffer would be left unset. Until every buffer
  // exists, the skip is decided on the host.
  for (const auto& group : param_groups()) {
    if (group.options.at("momentum") == 0.0) continue;
    for (const Tensor& p : group.params)
      if (p.grad().defined() && !state(p).count("momentum_buffer")) return false;
  }
  return true;
}

bool SGD::momentum_buffers_made() const {
  for (const auto& group : param_groups()) {
    if (group.options.at("momentum") == 0.0) continue;
    for (const Tensor& p : group.params)
      if (p.requires_grad() && !state(p).count("momentum_buffer")) return false;
  }
  return true;
}

void SGD::step_unless_inf(const Tensor& found_inf) {
  EMBER_CHECK(found_inf.defined(), name(), "::step_unless_inf: found_inf is undefined");
  if (!skips_on_device()) {
    Optimizer::step_unless_inf(found_inf);
    return;
  }
  step_impl(found_inf);
}

void SGD::step_impl(const Tensor& found_inf) {
  // State the step creates (moments, momentum buffers, float32 masters) is
  // the optimizer's in the memory breakdown (core/allocator.h).
  MemoryKindScope optimizer_memory(MemoryKind::Optimizer);
  profiler::Scope prof(profiler::Kind::Optimizer, "SGD.step");
  NoGradGuard no_grad;
  for (auto& group : param_groups()) {
    const Options& o = group.options;
    SgdArgs args{{o.at("lr"), o.at("momentum"), o.at("dampening"), o.at("weight_decay"), flag(o, "nesterov"),
                  flag(o, "maximize")}};
    args.lr_tensor = group.lr_tensor;
    args.found_inf = found_inf;
    std::vector<Tensor> params, grads, bufs, owners;
    for (const Tensor& p : group.params) {
      Tensor g = p.grad();
      if (!g.defined()) continue;
      const Tensor target = step_target(p, mutable_state(p));
      owners.push_back(p);
      params.push_back(target);
      grads.push_back(g);
      args.model_params.push_back(model_param(p, target));
      if (args.momentum != 0.0) {
        auto& st = mutable_state(p);
        auto it = st.find("momentum_buffer");
        if (it == st.end() && p.is_cuda())
          check_not_capturing("SGD.step making its momentum buffers",
                              "the first step makes them from the gradients, and every replay would make them "
                              "again; run one step before capture (a warm-up, as PyTorch's CUDA graph recipe does)");
        bufs.push_back(it == st.end() ? Tensor() : it->second);
      }
    }
    if (params.empty()) continue;
    sgd_step_(params, grads, bufs, args);
    // New buffers were allocated by the step (torch's first-step clone).
    for (size_t i = 0; i < bufs.size(); ++i) mutable_state(owners[i])["momentum_buffer"] = bufs[i];
  }
}

// ---- Adam / AdamW ----
Options AdamOptions::to_map() const {
  return {{"lr", lr},   {"beta1", beta1},           {"beta2", beta2},
          {"eps", eps}, {"weight_decay", weight_decay}, {"amsgrad", amsgrad ? 1.0 : 0.0},
          {"maximize", maximize ? 1.0 : 0.0}};
}
Options AdamWOptions::to_map() const {
  return AdamOptions{lr, beta1, beta2, eps, weight_decay, amsgrad, maximize}.to_map();
}

Adam::Adam(std::string name, Options defaults, bool decoupled)
    : Optimizer(std::move(name), std::move(defaults)), decoupled_(decoupled) {}

Adam::Adam(std::vector<Tensor> params, AdamOptions defaults)
    : Adam(one_group(std::move(params)), defaults) {}

Adam::Adam(std::vector<ParamGroup> groups, AdamOptions defaults) : Adam("Adam", defaults.to_map(), false) {
  init(std::move(groups));
}

AdamW::AdamW(std::vector<Tensor> params, AdamWOptions defaults)
    : AdamW(one_group(std::move(params)), defaults) {}

AdamW::AdamW(std::vector<ParamGroup> groups, AdamWOptions defaults) : Adam("AdamW", defaults.to_map(), true) {
  init(std::move(groups));
}

void Adam::validate(const Options& o) const {
  const std::string& n = name();
  EMBER_CHECK(o.at("lr") >= 0.0, n, ": invalid learning rate: ", o.at("lr"));
  EMBER_CHECK(o.at("eps") >= 0.0, n, ": invalid epsilon value: ", o.at("eps"));
  EMBER_CHECK(o.at("beta1") >= 0.0 && o.at("beta1") < 1.0, n, ": invalid beta parameter at index 0: ", o.at("beta1"));
  EMBER_CHECK(o.at("beta2") >= 0.0 && o.at("beta2") < 1.0, n, ": invalid beta parameter at index 1: ", o.at("beta2"));
  EMBER_CHECK(o.at("weight_decay") >= 0.0, n, ": invalid weight_decay value: ", o.at("weight_decay"));
}

void Adam::step() { step_impl(Tensor()); }

void Adam::step_unless_inf(const Tensor& found_inf) {
  EMBER_CHECK(found_inf.defined(), name(), "::step_unless_inf: found_inf is undefined");
  step_impl(found_inf);
}

void Adam::step_impl(const Tensor& found_inf) {
  // State the step creates (moments, momentum buffers, float32 masters) is
  // the optimizer's in the memory breakdown (core/allocator.h).
  MemoryKindScope optimizer_memory(MemoryKind::Optimizer);
  profiler::Scope prof(profiler::Kind::Optimizer, name() + ".step");  // Adam or AdamW
  NoGradGuard no_grad;
  for (auto& group : param_groups()) {
    const Options& o = group.options;
    const bool amsgrad = flag(o, "amsgrad");
    std::vector<Tensor> P, G, M, V, VMAX, steps, low;
    for (const Tensor& p : group.params) {
      Tensor g = p.grad();
      if (!g.defined()) continue;
      auto& st = mutable_state(p);
      if (!st.count("step") || (amsgrad && !st.count("max_exp_avg_sq")))
        if (p.is_cuda())
          check_not_capturing((name() + ".step making its state").c_str(),
                              "the first step makes its step count and moments (zeros), and every replay would "
                              "reset them; run one step before capture (a warm-up, as PyTorch's CUDA graph "
                              "recipe does)");
      if (!st.count("step")) {
        st["step"] = zeros({}, {DType::Float32, p.device()});
        st["exp_avg"] = state_like(p, 0.0);
        st["exp_avg_sq"] = state_like(p, 0.0);
      }
      if (amsgrad && !st.count("max_exp_avg_sq")) st["max_exp_avg_sq"] = state_like(p, 0.0);
      // float32, counted in float32, as torch's step tensor, on the
      // parameter's device as its fused Adam keeps it: the kernel reads it
      // for the bias corrections and bumps it once the update went through.
      if (st["step"].device() != p.device()) st["step"] = st["step"].to(p.device());
      const Tensor target = step_target(p, st);
      P.push_back(target);
      G.push_back(g);
      low.push_back(model_param(p, target));
      M.push_back(st["exp_avg"]);
      V.push_back(st["exp_avg_sq"]);
      if (amsgrad) VMAX.push_back(st["max_exp_avg_sq"]);
      steps.push_back(st["step"]);
    }
    if (P.empty()) continue;
    AdamArgs args{o.at("lr"), o.at("beta1"), o.at("beta2"), o.at("eps"), o.at("weight_decay"),
                  decoupled_, amsgrad, flag(o, "maximize")};
    args.lr_tensor = group.lr_tensor;
    args.found_inf = found_inf;
    args.steps = steps;
    args.model_params = low;
    adam_step_(P, G, M, V, VMAX, args);
  }
}

}  // namespace ember::optim
