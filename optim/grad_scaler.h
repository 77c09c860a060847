// GradScaler: dynamic loss scaling for float16 training, with
// torch.amp.GradScaler's semantics and defaults. The loss is multiplied by a
// scale (65536 at first) so small float16 gradients do not underflow to
// zero; before the optimizer step the gradients are divided back (unscale_),
// and a step whose gradients hold an inf or NaN is skipped while the scale
// backs off (x0.5); after growth_interval (2000) clean steps in a row it
// grows (x2).
//
//   optim::GradScaler scaler;                      // {.enabled = false} passes everything through
//   for (...) {
//     opt.zero_grad();
//     scaler.scale(loss_fn(model(x), y)).backward();
//     scaler.unscale_(opt);                        // optional: e.g. to clip the true gradients
//     scaler.step(opt);                            // skipped if any gradient is inf/NaN
//     scaler.update();
//   }
//
// The scale lives on the loss's device; unscale_ is one fused kernel per
// device and dtype (core/ops_optim.h amp_unscale_) that also records
// whether a non-finite value was seen, without a host synchronisation; step
// reads that flag once (one sync per step, as torch does), step_async hands
// it to the optimizer's kernels instead (no sync). bfloat16 has
// float32's range and needs no scaling: construct with enabled = false.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "optim/optimizer.h"

namespace ember::optim {

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;
  // Agreement across ranks, for when ranks hold different gradients (an
  // optimizer that owns a shard of the parameters, FSDP): unscale_ passes a
  // float32 tensor [2] = {non-finite values seen, gradients seen} on the
  // scale's device, and this must sum it over the ranks in place (every rank
  // calls unscale_/step in the same order, even one with no gradients). Then
  // either every rank steps or every rank skips, and the scales stay equal.
  // distributed::found_inf_allreduce(pg) gives one. Not needed after DDP,
  // whose averaged gradients are identical on every rank already.
  std::function<void(const Tensor& flags)> sync_found_inf = nullptr;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  // loss * scale (recorded by autograd); the loss itself when disabled.
  Tensor scale(const Tensor& loss);
  // Divides `opt`'s gradients by the scale in place and records non-finite
  // values. At most once per optimizer between update() calls.
  void unscale_(Optimizer& opt);
  // unscale_ if not done yet, then opt.step() unless a gradient was inf or
  // NaN. Returns whether the optimizer stepped.
  bool step(Optimizer& opt);
  // The same without the host read: the optimizer skips itself on the
  // device when found_inf is set (SGD, Adam, AdamW, ZeRO over them:
  // Optimizer::skips_on_device), as torch's scaler does for fused
  // optimizers. Falls back to step() where the optimizer cannot, or the
  // gradients span several devices. Whether it stepped is known on the
  // device only, so nothing is returned and a step with no gradients at all
  // on any rank is not diagnosed here. (With sync_found_inf, unscale_ still
  // waits for the agreement's allreduce.)
  void step_async(Optimizer& opt);
  // Adjusts the scale from every optimizer stepped since the last update.
  void update();
  // Sets the scale to `new_scale` instead (torch's update(new_scale)).
  void update(double new_scale);

  double get_scale() const;  // 1 when disabled; reads the device value
  // The live scale, float32 [1] on `device` (made there when no scale() ran
  // yet): the tensor update() changes in place, so a term that enters the
  // backward on its own scales as the loss does without a read (an MoE's
  // router losses, Megatron's MoEAuxLossAutoScaler.set_loss_scale).
  // Undefined when disabled.
  Tensor scale_tensor(const Device& device);
  int64_t growth_tracker() const;
  bool is_enabled() const { return options_.enabled; }
  const GradScalerOptions& options() const { return options_; }

  // torch's keys: "scale", "growth_factor", "backoff_factor",
  // "growth_interval", "_growth_tracker"; empty when disabled.
  std::map<std::string, double> state_dict() const;
  // Checks every key and value (naming what is wrong) before changing anything.
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  enum class Stage { Ready, Unscaled, Stepped };
  struct PerOptimizer {
    Stage stage = Stage::Ready;
    std::vector<Tensor> found_inf;  // one per device its gradients are on (one in all with sync_found_inf)
    Tensor synced_flags;            // with sync_found_inf: {found, gradients} summed over the ranks
  };
  void lazy_init(const Device& device);

  GradScalerOptions options_;
  Tensor scale_;            // float32 [1], on the loss's device once scale() ran
  Tensor growth_tracker_;   // int32 [1], same device
  double pending_scale_;    // the scale before the first scale() call
  int64_t pending_tracker_ = 0;
  std::map<const Optimizer*, PerOptimizer> per_optimizer_;
};

}  // namespace ember::optim
