// GradScaler (grad_scaler.h): the per-optimizer stage machine and the state
// dict around the fused kernels of core/ops_optim.h.
#include "optim/grad_scaler.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "core/autograd_hook.h"
#include "core/cuda_graph.h"
#include "core/exception.h"
#include "core/ops.h"
#include "core/ops_optim.h"

namespace ember::optim {
namespace {

constexpr const char* kKeys[] = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"};

void check_options(const GradScalerOptions& o, const char* where) {
  EMBER_CHECK(std::isfinite(o.init_scale) && o.init_scale > 0, where, ": the scale must be a positive finite number, got ",
              o.init_scale);
  EMBER_CHECK(std::isfinite(o.growth_factor) && o.growth_factor > 1.0, where, ": growth_factor must be > 1, got ",
              o.growth_factor);
  EMBER_CHECK(o.backoff_factor > 0.0 && o.backoff_factor < 1.0, where, ": backoff_factor must be in (0, 1), got ",
              o.backoff_factor);
  EMBER_CHECK(o.growth_interval >= 1 && o.growth_interval <= INT32_MAX, where,
              ": growth_interval must be a positive int32, got ", o.growth_interval);
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(options), pending_scale_(options.init_scale) {
  if (options_.enabled) check_options(options_, "GradScaler");
}

void GradScaler::lazy_init(const Device& device) {
  if (scale_.defined()) return;
  if (device.is_cuda())
    check_not_capturing("GradScaler making its scale",
                        "the first scale() fills it, and every replay would fill it again; run one step before "
                        "capture (a warm-up)");
  scale_ = full({1}, pending_scale_, {DType::Float32, device});
  growth_tracker_ = full({1}, static_cast<double>(pending_tracker_), {DType::Int32, device});
}

Tensor GradScaler::scale(const Tensor& loss) {
  if (!options_.enabled) return loss;
  EMBER_CHECK(loss.defined(), "GradScaler::scale: the loss is an undefined tensor");
  EMBER_CHECK(is_floating(loss.dtype()), "GradScaler::scale: the loss has dtype ", dtype_name(loss.dtype()),
              "; only floating-point losses can be scaled");
  lazy_init(loss.device());
  Tensor s = scale_.to(loss.device());
  // [1] -> the loss's shape class: a 0-dim loss stays 0-dim.
  return loss * (loss.dim() == 0 ? s.view({}) : s);
}

void GradScaler::unscale_(Optimizer& opt) {
  if (!options_.enabled) return;
  PerOptimizer& st = per_optimizer_[&opt];
  EMBER_CHECK(st.stage != Stage::Unscaled,
              "GradScaler::unscale_: already called on this optimizer since the last update() (unscaling twice "
              "would divide the gradients by the scale twice)");
  EMBER_CHECK(st.stage != Stage::Stepped, "GradScaler::unscale_: called after step() on this optimizer; call "
              "update() first");
  EMBER_CHECK(scale_.defined(), "GradScaler::unscale_: nothing was scaled yet; call scale(loss).backward() first");
  NoGradGuard no_grad;
  // 1/scale in double, then float32, as torch computes it; on the scale's
  // device, so no host synchronisation.
  const Tensor inv = (1.0 / scale_.to(DType::Float64)).to(DType::Float32).reshape({1});
  std::vector<std::pair<Device, std::vector<Tensor>>> by_device;  // first-seen order
  for (auto& group : opt.param_groups())
    for (auto& p : group.params) {
      Tensor g = p.grad();
      if (!g.defined()) continue;
      auto it = std::find_if(by_device.begin(), by_device.end(), [&](const auto& e) { return e.first == g.device(); });
      if (it == by_device.end()) it = by_device.insert(by_device.end(), {g.device(), {}});
      it->second.push_back(g);
    }
  st.found_inf.clear();
  int64_t n_grads = 0;
  for (auto& [device, grads] : by_device) {
    Tensor found = zeros({1}, {DType::Float32, device});
    Tensor inv_here = inv.to(device);
    amp_unscale_(grads, found, inv_here);
    st.found_inf.push_back(found);
    n_grads += static_cast<int64_t>(grads.size());
  }
  if (options_.sync_found_inf) {
    // One flag for the rank, on the scale's device, summed over the ranks;
    // the collective's wait stands in for step()'s host sync.
    Tensor flags = Tensor::from_vector({0.0, static_cast<double>(n_grads)}, {2}, {DType::Float32, scale_.device()});
    Tensor found = flags.narrow(0, 0, 1);
    for (const Tensor& f : st.found_inf) found.copy_(found + f.to(scale_.device()));
    options_.sync_found_inf(flags);
    st.found_inf = {found};
    st.synced_flags = flags;
  }
  st.stage = Stage::Unscaled;
}

bool GradScaler::step(Optimizer& opt) {
  if (!options_.enabled) {
    opt.step();
    return true;
  }
  EMBER_CHECK(per_optimizer_[&opt].stage != Stage::Stepped,
              "GradScaler::step: already called on this optimizer since the last update()");
  check_not_capturing("GradScaler::step",
                      "it reads on the host whether the gradients hold an inf; step_async() skips the step on the "
                      "device instead");
  if (per_optimizer_[&opt].stage == Stage::Ready) unscale_(opt);
  PerOptimizer& st = per_optimizer_[&opt];
  double found = 0;
  if (st.synced_flags.defined()) {
    const std::vector<double> flags = st.synced_flags.to_vector();  // the step's one host sync
    EMBER_CHECK(flags[1] > 0, "GradScaler::step: no inf checks were recorded for this optimizer on any rank: none of "
                "its parameters has a gradient (call scale(loss).backward() before step())");
    found = flags[0];
  } else {
    EMBER_CHECK(!st.found_inf.empty(), "GradScaler::step: no inf checks were recorded for this optimizer: none of "
                "its parameters has a gradient (call scale(loss).backward() before step())");
    for (const Tensor& f : st.found_inf) found += f.cpu().item();  // the step's one host sync
  }
  const bool stepped = found == 0;
  if (stepped) opt.step();
  st.stage = Stage::Stepped;
  return stepped;
}

void GradScaler::step_async(Optimizer& opt) {
  if (!options_.enabled) {
    opt.step();
    return;
  }
  EMBER_CHECK(per_optimizer_[&opt].stage != Stage::Stepped,
              "GradScaler::step_async: already called on this optimizer since the last update()");
  if (per_optimizer_[&opt].stage == Stage::Ready) unscale_(opt);
  PerOptimizer& st = per_optimizer_[&opt];
  Tensor flag;
  if (st.synced_flags.defined()) {
    flag = st.synced_flags.narrow(0, 0, 1);  // {found inf, gradients seen}: the first, summed over ranks
  } else {
    EMBER_CHECK(!st.found_inf.empty(), "GradScaler::step_async: no inf checks were recorded for this optimizer: none "
                "of its parameters has a gradient (call scale(loss).backward() before step_async())");
    if (st.found_inf.size() == 1) flag = st.found_inf[0];
  }
  if (!flag.defined() || !opt.skips_on_device()) {
    check_not_capturing("GradScaler::step_async",
                        "this optimizer (or its several devices' flags) cannot skip its step on the device, so the "
                        "scaler would read the flag on the host");
    (void)step(opt);
    return;
  }
  opt.step_unless_inf(flag);
  st.stage = Stage::Stepped;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  std::vector<Tensor> founds;
  for (auto& [opt, st] : per_optimizer_)
    for (const Tensor& f : st.found_inf) founds.push_back(f);
  EMBER_CHECK(!founds.empty(), "GradScaler::update: no inf checks were recorded since the last update(); call "
              "step() (or unscale_()) on an optimizer first");
  Tensor total = founds[0].to(scale_.device());
  if (founds.size() > 1) {
    total = total.clone();
    for (size_t i = 1; i < founds.size(); ++i) total = total + founds[i].to(scale_.device());
  }
  amp_update_scale_(scale_, growth_tracker_, total, options_.growth_factor, options_.backoff_factor,
                    options_.growth_interval);
  per_optimizer_.clear();
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled) return;
  EMBER_CHECK(std::isfinite(new_scale) && new_scale > 0, "GradScaler::update: new_scale must be a positive finite "
              "number, got ", new_scale);
  if (scale_.defined()) scale_.fill_(new_scale);
  else pending_scale_ = new_scale;
  per_optimizer_.clear();
}

Tensor GradScaler::scale_tensor(const Device& device) {
  if (!options_.enabled) return Tensor();
  lazy_init(device);
  EMBER_CHECK(scale_.device() == device, "GradScaler::scale_tensor: the scale lives on ", scale_.device().str(),
              ", asked for on ", device.str());
  return scale_;
}

double GradScaler::get_scale() const {
  if (!options_.enabled) return 1.0;
  return scale_.defined() ? scale_.cpu().item() : pending_scale_;
}

int64_t GradScaler::growth_tracker() const {
  if (!options_.enabled) return 0;
  return growth_tracker_.defined() ? static_cast<int64_t>(growth_tracker_.cpu().item()) : pending_tracker_;
}

std::map<std::string, double> GradScaler::state_dict() const {
  if (!options_.enabled) return {};
  return {{"scale", get_scale()},
          {"growth_factor", options_.growth_factor},
          {"backoff_factor", options_.backoff_factor},
          {"growth_interval", static_cast<double>(options_.growth_interval)},
          {"_growth_tracker", static_cast<double>(growth_tracker())}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  if (!options_.enabled) return;
  EMBER_CHECK(!state.empty(), "GradScaler::load_state_dict: the state is empty, possibly because it was saved from "
              "a disabled GradScaler");
  for (const auto& [k, v] : state) {
    bool known = false;
    for (const char* key : kKeys) known = known || k == key;
    EMBER_CHECK(known, "GradScaler::load_state_dict: unknown key '", k,
                "' (expected scale, growth_factor, backoff_factor, growth_interval, _growth_tracker)");
  }
  for (const char* key : kKeys)
    EMBER_CHECK(state.count(key), "GradScaler::load_state_dict: missing key '", key, "'");
  GradScalerOptions o = options_;
  o.init_scale = state.at("scale");
  o.growth_factor = state.at("growth_factor");
  o.backoff_factor = state.at("backoff_factor");
  const double interval = state.at("growth_interval"), tracker = state.at("_growth_tracker");
  EMBER_CHECK(interval == std::floor(interval), "GradScaler::load_state_dict: growth_interval ", interval,
              " is not an integer");
  o.growth_interval = static_cast<int64_t>(interval);
  check_options(o, "GradScaler::load_state_dict");
  EMBER_CHECK(tracker == std::floor(tracker) && tracker >= 0 && tracker < interval,
              "GradScaler::load_state_dict: _growth_tracker ", tracker, " must be an integer in [0, growth_interval=",
              interval, ")");
  options_ = o;
  if (scale_.defined()) {
    scale_.fill_(o.init_scale);
    growth_tracker_.fill_(tracker);
  } else {
    pending_scale_ = o.init_scale;
    pending_tracker_ = static_cast<int64_t>(tracker);
  }
  per_optimizer_.clear();
}

}  // namespace ember::optim
