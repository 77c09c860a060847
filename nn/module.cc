// Module bookkeeping: registration, traversal, device moves, state dicts.
#include "nn/module.h"

#include <algorithm>
#include <optional>
#include <sstream>
#include <unordered_set>

#include "autograd/autograd.h"
#include "core/autograd_hook.h"
#include "core/ops.h"
#include "nn/checkpoint.h"

namespace ember::nn {

void StateDict::insert(const std::string& name, const Tensor& t) {
  EMBER_CHECK(find(name) == nullptr, "state_dict: duplicate key '", name, "'");
  items_.emplace_back(name, t);
}

const Tensor* StateDict::find(const std::string& name) const {
  for (const auto& [k, v] : items_)
    if (k == name) return &v;
  return nullptr;
}

void HookHandle::remove() {
  if (remove_) {
    auto f = std::move(remove_);
    remove_ = nullptr;
    f();
  }
}

template <typename H>
HookHandle Module::add_hook(std::vector<std::pair<uint64_t, H>> Hooks::*list, H hook) {
  EMBER_CHECK(hook != nullptr, type_name_, ": cannot register an empty hook");
  const uint64_t id = hooks_->next_id++;
  ((*hooks_).*list).emplace_back(id, std::move(hook));
  HookHandle h;
  std::weak_ptr<Hooks> weak = hooks_;
  h.remove_ = [weak, list, id] {
    if (auto hs = weak.lock()) {
      auto& v = (*hs).*list;
      v.erase(std::remove_if(v.begin(), v.end(), [id](const auto& e) { return e.first == id; }), v.end());
    }
  };
  return h;
}

HookHandle Module::register_forward_pre_hook(ForwardPreHook hook) { return add_hook(&Hooks::pre, std::move(hook)); }
HookHandle Module::register_forward_hook(ForwardHook hook) { return add_hook(&Hooks::post, std::move(hook)); }
HookHandle Module::register_full_backward_pre_hook(BackwardPreHook hook) {
  return add_hook(&Hooks::backward_pre, std::move(hook));
}

Tensor Module::operator()(const Tensor& x) {
  // Copies: a hook may register or remove hooks while they run.
  Tensor in = x;
  for (auto [id, hook] : std::vector(hooks_->pre)) {
    Tensor r = hook(*this, in);
    if (r.defined()) in = r;
  }
  // A checkpointed module's forward runs as one region (nn/checkpoint.h);
  // its hooks stay outside it.
  const bool checkpointed = !transform_states_.empty() && transform_state("activation_checkpoint");
  Tensor out = checkpointed ? detail::checkpointed_forward(*this, in) : forward(in);
  for (auto [id, hook] : std::vector(hooks_->post)) {
    Tensor r = hook(*this, in, out);
    if (r.defined()) out = r;
  }
  if (!hooks_->backward_pre.empty() && out.defined() && out.requires_grad() && !out.is_leaf()) {
    // On the output's gradient (a hook on the node that made it): it runs
    // before the backward of every op this forward recorded. A leaf output
    // (forward returned its input unchanged) would put the hook on the
    // input itself, so it is not armed there. The module must outlive the
    // graph.
    std::weak_ptr<Hooks> weak = hooks_;
    autograd::register_hook(out, [this, weak](const Tensor& g) {
      Tensor grad = g;
      if (auto hs = weak.lock())
        for (auto [id, hook] : std::vector(hs->backward_pre)) {
          Tensor r = hook(*this, grad);
          if (r.defined()) grad = r;
        }
      return grad.is_same(g) ? Tensor() : grad;
    });
  }
  return out;
}

bool Module::plain_call() const {
  return hooks_->pre.empty() && hooks_->post.empty() && hooks_->backward_pre.empty() &&
         (transform_states_.empty() || !transform_state("activation_checkpoint"));
}

Tensor Module::forward(const Tensor&) {
  EMBER_CHECK(false, type_name_, ": this module has no single-tensor forward(); call its own forward signature");
  return Tensor();
}

void Module::check_new_name(const std::string& name) const {
  EMBER_CHECK(!name.empty() && name.find('.') == std::string::npos, type_name_, ": invalid name '", name,
              "' (must be non-empty without '.')");
  for (const auto& p : params_) EMBER_CHECK(p.first != name, type_name_, ": '", name, "' is already a parameter");
  for (const auto& b : buffers_) EMBER_CHECK(b.name != name, type_name_, ": '", name, "' is already a buffer");
  for (const auto& c : children_) EMBER_CHECK(c.first != name, type_name_, ": '", name, "' is already a submodule");
}

Tensor& Module::register_parameter(const std::string& name, Tensor t, bool requires_grad) {
  check_new_name(name);
  EMBER_CHECK(t.defined(), type_name_, ": parameter '", name, "' is undefined");
  if (requires_grad && !t.requires_grad()) t.requires_grad_(true);
  params_.emplace_back(name, t);
  return params_.back().second;
}

Tensor& Module::register_buffer(const std::string& name, Tensor t, bool persistent) {
  check_new_name(name);
  buffers_.push_back({name, t, persistent});
  return buffers_.back().t;
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> m) {
  check_new_name(name);
  EMBER_CHECK(m != nullptr, type_name_, ": submodule '", name, "' is null");
  children_.emplace_back(name, std::move(m));
}

std::vector<std::pair<std::string, Tensor>> Module::named_parameters(bool recurse) const {
  std::vector<std::pair<std::string, Tensor>> out(params_.begin(), params_.end());
  if (!recurse) return out;
  std::unordered_set<TensorImpl*> seen;
  for (auto& p : out) seen.insert(p.second.impl_ptr().get());
  for (const auto& [cname, child] : children_)
    for (auto& [n, t] : child->named_parameters(true))
      if (seen.insert(t.impl_ptr().get()).second) out.emplace_back(cname + "." + n, t);  // shared params once
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& p : named_parameters(recurse)) out.push_back(p.second);
  return out;
}

std::vector<std::pair<std::string, Tensor>> Module::named_buffers(bool recurse) const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& b : buffers_) out.emplace_back(b.name, b.t);
  if (!recurse) return out;
  for (const auto& [cname, child] : children_)
    for (auto& [n, t] : child->named_buffers(true)) out.emplace_back(cname + "." + n, t);
  return out;
}

std::vector<Tensor> Module::buffers(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& b : named_buffers(recurse)) out.push_back(b.second);
  return out;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules(const std::string& prefix) {
  std::vector<std::pair<std::string, Module*>> out{{prefix, this}};
  for (auto& [cname, child] : children_) {
    auto sub = child->named_modules(prefix.empty() ? cname : prefix + "." + cname);
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& c : children_) c.second->train(on);
}

namespace {
void move_tensor(const Tensor& t, std::optional<Device> device, std::optional<DType> dtype) {
  if (!t.defined()) return;
  NoGradGuard g;
  Device d = device.value_or(t.device());
  DType ty = (dtype && is_floating(t.dtype())) ? *dtype : t.dtype();
  if (d == t.device() && ty == t.dtype()) return;
  t.set_data(t.detach().to(d, ty));
  Tensor grad = t.grad();
  if (grad.defined()) t.set_grad(grad.to(d, ty));
}
}  // namespace

void Module::to(Device device, DType dtype) {
  for (auto& p : named_parameters()) move_tensor(p.second, device, dtype);
  for (auto& b : named_buffers()) move_tensor(b.second, device, dtype);
}

void Module::to(Device device) {
  for (auto& p : named_parameters()) move_tensor(p.second, device, std::nullopt);
  for (auto& b : named_buffers()) move_tensor(b.second, device, std::nullopt);
}

void Module::to(DType dtype) {
  for (auto& p : named_parameters()) move_tensor(p.second, std::nullopt, dtype);
  for (auto& b : named_buffers()) move_tensor(b.second, std::nullopt, dtype);
}

void Module::to(MemoryFormat format) {
  // A parameter that is a view into a larger buffer (fully_shard's or
  // ZeRO's flat parameters) would be cut off from it by set_data: the
  // buffer's gathers and updates would no longer reach the module.
  for (const auto& [name, p] : named_parameters())
    EMBER_CHECK(!p.defined() || p.dim() != 4 || p.is_contiguous(format) ||
                    (p.storage_offset() == 0 && p.impl().storage->nbytes == p.nbytes()),
                "Module::to(", format == MemoryFormat::ChannelsLast ? "ChannelsLast" : "Contiguous", "): parameter '",
                name, "' ", shape_str(p.sizes()), " is a view into a larger buffer (a flat parameter of fully_shard ",
                "or ZeRO?); lay the model out before wrapping it");
  auto relayout = [format](const Tensor& t) {
    if (!t.defined() || t.dim() != 4 || t.is_contiguous(format)) return;
    NoGradGuard g;
    t.set_data(t.detach().contiguous(format));
    Tensor grad = t.grad();
    if (grad.defined() && !grad.is_contiguous(format)) t.set_grad(grad.contiguous(format));
  };
  for (auto& p : named_parameters()) relayout(p.second);
  for (auto& b : named_buffers()) relayout(b.second);
}

void Module::collect_state(const std::string& prefix, StateDict& out) const {
  for (const auto& [n, t] : params_) out.insert(prefix + n, t);
  for (const auto& b : buffers_)
    if (b.persistent && b.t.defined()) out.insert(prefix + b.name, b.t);
  for (const auto& [cname, child] : children_) child->collect_state(prefix + cname + ".", out);
}

StateDict Module::state_dict() const {
  StateDict sd;
  collect_state("", sd);
  return sd;
}

void Module::load_state_dict(const StateDict& state, bool strict) {
  StateDict mine = state_dict();
  std::vector<std::string> missing, unexpected;
  for (const auto& [k, t] : mine)
    if (!state.contains(k)) missing.push_back(k);
  for (const auto& [k, t] : state)
    if (!mine.contains(k)) unexpected.push_back(k);
  if (strict && (!missing.empty() || !unexpected.empty())) {
    std::ostringstream os;
    os << "load_state_dict: error(s) loading state_dict for " << type_name_ << ":";
    if (!missing.empty()) {
      os << " missing key(s):";
      for (auto& k : missing) os << " \"" << k << "\"";
      os << ".";
    }
    if (!unexpected.empty()) {
      os << " unexpected key(s):";
      for (auto& k : unexpected) os << " \"" << k << "\"";
      os << ".";
    }
    EMBER_CHECK(false, os.str());
  }
  // Check every shape before copying anything, so a failed load changes nothing.
  for (const auto& [k, t] : mine) {
    const Tensor* src = state.find(k);
    if (!src) continue;
    EMBER_CHECK(src->sizes() == t.sizes(), "load_state_dict: size mismatch for ", k, ": copying a param with shape ",
                shape_str(src->sizes()), " from checkpoint, the shape in current model is ", shape_str(t.sizes()));
  }
  NoGradGuard g;
  for (const auto& [k, t] : mine) {
    const Tensor* src = state.find(k);
    if (!src) continue;
    Tensor dst = t.detach();
    dst.copy_(*src);
  }
}

void Module::apply(const std::function<void(Module&)>& fn) {
  for (auto& c : children_) c.second->apply(fn);
  fn(*this);
}

void Module::zero_grad(bool set_to_none) {
  for (auto& p : parameters()) autograd::zero_grad(p, set_to_none);
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (auto& p : parameters()) n += p.numel();
  return n;
}

void Module::set_transform_state(const std::string& key, std::shared_ptr<void> state) {
  for (auto it = transform_states_.begin(); it != transform_states_.end(); ++it)
    if (it->first == key) {
      if (state)
        it->second = std::move(state);
      else
        transform_states_.erase(it);
      return;
    }
  if (state) transform_states_.emplace_back(key, std::move(state));
}

std::shared_ptr<void> Module::transform_state(const std::string& key) const {
  for (const auto& [k, v] : transform_states_)
    if (k == key) return v;
  return nullptr;
}

}  // namespace ember::nn
