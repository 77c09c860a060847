// Fused optimizer steps: the arithmetic of torch.optim's SGD and Adam/AdamW
// for a whole list of parameters in one pass per tensor (CPU) or one
// multi-tensor kernel launch per device and dtype (CUDA), instead of the
// half-dozen elementwise ops per tensor an op-by-op step would launch.
// optim/ builds the optimizer classes (param groups, state, state_dict) on
// these; they are exposed here so other trainers (e.g. a sharded optimizer
// over flat buffers) can call them directly.
//
// Rules shared by both steps: every list has one entry per parameter; each
// state tensor and gradient matches its parameter in shape, dtype and device;
// parameters and state must be contiguous (they are written in place), while
// a non-contiguous gradient is read through a contiguous copy. Parameters
// may be float32, float64, float16 or bfloat16; the math runs in float32 for
// the 16-bit types and float32, in float64 for float64, with the scalars
// rounded to that type first, as PyTorch's kernels do. Call under
// NoGradGuard when parameters require grad (optimizers do).
//
// Float32 masters of 16-bit parameters (mixed precision's master weights,
// as optim/'s classes keep them): `model_params`, when not empty, has one
// entry per parameter. A defined entry is a float16 or bfloat16 tensor of
// its parameter's shape and layout, and makes params[i] its float32 master:
// grads[i] is then in the 16-bit tensor's dtype, read as it is, and in the
// same pass each master element whose 16-bit element no longer equals it
// rounded (written from outside since the last step) first takes that
// element's value, then steps, and is written back rounded. An undefined
// entry leaves parameter i stepped as above. A step that found_inf skips
// moves nothing, masters included: an outside write is taken at the next
// step that runs. This is what re-seeding the
// master, casting the gradient, stepping and copying the master back did
// op by op: six more kernels and a copy a tensor, and 78 bytes an element
// of memory traffic for Adam where this pass moves 30.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace ember {

// Hyperparameters on the device. Both steps take, optionally, one-element
// float32 tensors on the parameters' device that the kernel reads there, so
// no host synchronisation is needed to use them:
//   lr_tensor  replaces `lr` (a schedule or a tuner writes it on the device);
//   found_inf  when it holds a value > 0 the step changes nothing: no
//              parameter, state or step count moves (torch's fused steps'
//              found_inf, which GradScaler sets; see amp_unscale_).
// All parameters of one call must then be on that one device.
// SGD's hyperparameters (torch.optim.SGD's): the one struct for them, from
// the user's optimizer options (optim::SGDOptions is this struct) down to
// the kernels.
struct SgdOptions {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
};
// sgd_step_'s arguments: the hyperparameters and the device tensors above.
struct SgdArgs : SgdOptions {
  Tensor lr_tensor;
  Tensor found_inf;
  std::vector<Tensor> model_params;  // the 16-bit parameters of float32 masters (above)
};

// torch.optim.SGD's update for each parameter p with gradient g:
//   d = g (or -g when maximizing) + weight_decay * p
//   momentum != 0: buf = d on the first step (an undefined entry in
//     `momentum_bufs`, which is then allocated), else buf = momentum * buf +
//     (1 - dampening) * d; d = nesterov ? d + momentum * buf : buf
//   p -= lr * d
// `momentum_bufs` is ignored (and may be empty) when momentum is 0.
void sgd_step_(std::vector<Tensor>& params, const std::vector<Tensor>& grads, std::vector<Tensor>& momentum_bufs,
               const SgdArgs& args);

struct AdamArgs {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = false;  // AdamW: p *= 1 - lr * weight_decay instead of an L2 term in g
  bool amsgrad = false;
  bool maximize = false;
  int64_t step = 1;  // this update's step count (1 on the first), for bias correction
  Tensor lr_tensor;
  Tensor found_inf;
  // Per parameter, its step count so far as a one-element float32 tensor on
  // the parameter's device (torch's state["step"], kept with the parameter
  // as its fused Adam does). When given, `step` is ignored: each parameter's
  // bias correction uses its count + 1, and the count is incremented on the
  // device unless found_inf skips the step.
  std::vector<Tensor> steps;
  std::vector<Tensor> model_params;  // the 16-bit parameters of float32 masters (above)
};

// torch.optim.Adam / AdamW's update, `step` already incremented:
//   g += weight_decay * p (Adam) or p *= 1 - lr * weight_decay (AdamW)
//   m = lerp(m, g, 1 - beta1); v = beta2 * v + (1 - beta2) * g * g
//   amsgrad: vmax = max(vmax, v), used in place of v below
//   p -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// `max_exp_avg_sqs` is ignored (and may be empty) unless amsgrad.
void adam_step_(std::vector<Tensor>& params, const std::vector<Tensor>& grads, std::vector<Tensor>& exp_avgs,
                std::vector<Tensor>& exp_avg_sqs, std::vector<Tensor>& max_exp_avg_sqs, const AdamArgs& args);

// ---- Mixed precision: GradScaler's fused steps (optim/grad_scaler.h) ----
// torch._amp_foreach_non_finite_check_and_unscale_: every gradient is
// multiplied in place by inv_scale, and found_inf is set to 1 when any
// gradient element was inf or NaN (it is never cleared here). inv_scale and
// found_inf are one-element float32 tensors on the gradients' device and are
// read and written there: no host synchronisation. Gradients may be float32,
// float64, float16 or bfloat16 (math in float32 for the 16-bit types), all on
// one device; a non-contiguous one is unscaled through a contiguous copy.
void amp_unscale_(std::vector<Tensor>& grads, Tensor& found_inf, const Tensor& inv_scale);

// torch._amp_update_scale_, on the scale's device: if found_inf > 0, scale *=
// backoff_factor and growth_tracker = 0; otherwise growth_tracker += 1, and
// when it reaches growth_interval, scale *= growth_factor (kept only if
// finite) and growth_tracker = 0. scale and found_inf: one-element float32;
// growth_tracker: one-element int32; all on one device.
void amp_update_scale_(Tensor& scale, Tensor& growth_tracker, const Tensor& found_inf, double growth_factor,
                       double backoff_factor, int64_t growth_interval);

// ---- Launchers (optimizer.cc / optimizer.cu). Operands are checked by the
// functions above; each launcher gets tensors of one device and one dtype.
// Operand layout per parameter: {param, grad, state...} (SGD: momentum
// buffer; Adam: exp_avg, exp_avg_sq[, max_exp_avg_sq]). `low`: empty, or
// the 16-bit parameters whose float32 masters `params` are (every one
// defined, of one dtype: the gradients' dtype).
// Device-side values (null: the host's): lr replaces the learning rate;
// found_inf > 0 skips the whole step.
struct DeviceHyper {
  const float* lr = nullptr;
  const float* found_inf = nullptr;
};
struct AdamKernelArgs {
  double lr, beta1, beta2, eps, weight_decay;
  double step_size;           // lr / (1 - beta1^step)
  double bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  bool decoupled, amsgrad, maximize;
  double step;                // this update's count, for bias corrections computed on the device
  DeviceHyper dev;
};
// `init[i]`: parameter i's momentum buffer is new and takes d rather than
// being decayed into (torch's first-step clone). The hyperparameters are the
// one SgdOptions struct; the op's tensors arrive as `dev`'s raw pointers.
void sgd_step_cpu(const std::vector<Tensor>& params, const std::vector<Tensor>& grads, const std::vector<Tensor>& bufs,
                  const std::vector<bool>& init, const SgdOptions& a, DeviceHyper dev, const std::vector<Tensor>& low);
void sgd_step_cuda(const std::vector<Tensor>& params, const std::vector<Tensor>& grads, const std::vector<Tensor>& bufs,
                   const std::vector<bool>& init, const SgdOptions& a, DeviceHyper dev, const std::vector<Tensor>& low);
// `steps`: empty (the host's step in `a`), or one count per parameter
// (read for the bias corrections, then incremented unless skipped).
void adam_step_cpu(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                   const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                   const std::vector<Tensor>& max_exp_avg_sqs, const std::vector<Tensor>& steps,
                   const AdamKernelArgs& a, const std::vector<Tensor>& low);
void adam_step_cuda(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                    const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                    const std::vector<Tensor>& max_exp_avg_sqs, const std::vector<Tensor>& steps,
                    const AdamKernelArgs& a, const std::vector<Tensor>& low);

void amp_unscale_cpu(const std::vector<Tensor>& grads, const Tensor& found_inf, const Tensor& inv_scale);
void amp_unscale_cuda(const std::vector<Tensor>& grads, const Tensor& found_inf, const Tensor& inv_scale);
// The factors stay double: torch multiplies the float scale by the double
// factor and rounds the product to float, which a float factor does not
// reproduce bit for bit (0.3f is not 0.3).
struct AmpScaleArgs {
  double growth_factor, backoff_factor;
  int32_t growth_interval;
};
void amp_update_scale_cpu(const Tensor& scale, const Tensor& growth_tracker, const Tensor& found_inf,
                          const AmpScaleArgs& a);
void amp_update_scale_cuda(const Tensor& scale, const Tensor& growth_tracker, const Tensor& found_inf,
                           const AmpScaleArgs& a);

// ---- Per-element math, shared by the CPU loop and the CUDA kernel so the
// two backends cannot drift. C is the compute type (acc_t of the param
// dtype); every scalar is rounded to C once, on the host, as torch rounds a
// Python float when it meets a float32 tensor. The operation order follows
// torch's single-tensor ops (mul_ then add_, addcmul_ = v + s*g*g, addcdiv_
// = p + s*m/d) so results agree with it up to FMA contraction.
namespace optim_fns {

template <typename C>
struct SgdScalars {
  C neg_lr, momentum, one_minus_dampening, weight_decay;
  bool has_momentum, has_weight_decay, nesterov, maximize;
};

template <typename C>
SgdScalars<C> sgd_scalars(const SgdOptions& a) {
  return {static_cast<C>(-a.lr), static_cast<C>(a.momentum), static_cast<C>(1.0 - a.dampening),
          static_cast<C>(a.weight_decay), a.momentum != 0.0, a.weight_decay != 0.0, a.nesterov, a.maximize};
}

// The learning rate read on the device, rounded to C as the host's would be.
template <typename C>
EMBER_HD SgdScalars<C> sgd_with_lr(SgdScalars<C> s, double lr) {
  s.neg_lr = static_cast<C>(-lr);
  return s;
}

// `buf` is read only when !init.
template <typename C>
EMBER_HD void sgd_update(C& p, C g, C& buf, bool init, const SgdScalars<C>& s) {
  C d = s.maximize ? -g : g;
  if (s.has_weight_decay) d = d + s.weight_decay * p;
  if (s.has_momentum) {
    buf = init ? d : buf * s.momentum + s.one_minus_dampening * d;
    d = s.nesterov ? d + s.momentum * buf : buf;
  }
  p = p + s.neg_lr * d;
}

template <typename C>
struct AdamScalars {
  C weight_decay, decay_factor, one_minus_beta1, beta2, one_minus_beta2, eps, neg_step_size, bias_correction2_sqrt;
  bool has_weight_decay, decoupled, amsgrad, maximize;
  // The host's values, for scalars resolved on the device (adam_resolve).
  double lr_d, beta1_d, beta2_d, weight_decay_d;
};

template <typename C>
AdamScalars<C> adam_scalars(const AdamKernelArgs& a) {
  return {static_cast<C>(a.weight_decay), static_cast<C>(1.0 - a.lr * a.weight_decay),
          static_cast<C>(1.0 - a.beta1), static_cast<C>(a.beta2), static_cast<C>(1.0 - a.beta2),
          static_cast<C>(a.eps), static_cast<C>(-a.step_size), static_cast<C>(a.bias_correction2_sqrt),
          a.weight_decay != 0.0, a.decoupled, a.amsgrad, a.maximize, a.lr, a.beta1, a.beta2, a.weight_decay};
}

// Scalars for a learning rate and a step count (this update's, >= 1) known
// only on the device: the host's formulas, in double, then rounded to C.
template <typename C>
EMBER_HD AdamScalars<C> adam_resolve(AdamScalars<C> s, double lr, double step) {
#if defined(__CUDA_ARCH__)
  const double bc1 = 1.0 - ::pow(s.beta1_d, step), bc2 = 1.0 - ::pow(s.beta2_d, step);
  s.bias_correction2_sqrt = static_cast<C>(::sqrt(bc2));
#else
  const double bc1 = 1.0 - std::pow(s.beta1_d, step), bc2 = 1.0 - std::pow(s.beta2_d, step);
  s.bias_correction2_sqrt = static_cast<C>(std::sqrt(bc2));
#endif
  s.decay_factor = static_cast<C>(1.0 - lr * s.weight_decay_d);
  s.neg_step_size = static_cast<C>(-(lr / bc1));
  return s;
}

template <typename C>
EMBER_HD C opt_sqrt(C x) {
#if defined(__CUDA_ARCH__)
  return ::sqrt(x);
#else
  return std::sqrt(x);
#endif
}

// torch.lerp's two-sided form: exact at both ends and monotone in w.
template <typename C>
EMBER_HD C lerp(C a, C b, C w) {
  return (w < C(0.5) && w > C(-0.5)) ? a + w * (b - a) : b - (b - a) * (C(1) - w);
}

// `vmax` is read and written only with amsgrad. NaN propagates through the
// max, as torch.maximum does.
template <typename C>
EMBER_HD void adam_update(C& p, C g, C& m, C& v, C& vmax, const AdamScalars<C>& s) {
  if (s.maximize) g = -g;
  if (s.has_weight_decay) {
    if (s.decoupled) p = p * s.decay_factor;
    else g = g + s.weight_decay * p;
  }
  m = lerp(m, g, s.one_minus_beta1);
  v = v * s.beta2;
  v = v + s.one_minus_beta2 * g * g;
  C second = v;
  if (s.amsgrad) {
    vmax = (vmax > v || vmax != vmax) ? vmax : v;
    second = vmax;
  }
  const C denom = opt_sqrt(second) / s.bias_correction2_sqrt + s.eps;
  p = p + s.neg_step_size * m / denom;
}

// A master element for this step: its 16-bit parameter's value where that
// no longer equals the master rounded (written from outside since the last
// step; NaN included), else the master.
template <typename L, typename C>
EMBER_HD C master_value(C master, L low) {
  const C l = static_cast<C>(low);
  return static_cast<C>(static_cast<L>(master)) != l ? l : master;
}

template <typename C>
EMBER_HD bool opt_isfinite(C x) {
#if defined(__CUDA_ARCH__)
  return ::isfinite(x);
#else
  return std::isfinite(x);
#endif
}

// One gradient element: checked before it is scaled (inf * 0 would hide it),
// as torch's kernel does; an inv_scale of exactly 1 leaves it untouched.
template <typename C>
EMBER_HD C amp_unscale(C g, C inv_scale, bool& found) {
  if (!opt_isfinite(g)) found = true;
  return inv_scale == C(1) ? g : g * inv_scale;
}

// torch's _amp_update_scale_cpu_/_cuda_ kernel, on one-element state.
EMBER_HD void amp_update_scale(float& scale, int32_t& growth_tracker, float found_inf, double growth_factor,
                                      double backoff_factor, int32_t growth_interval) {
  // As torch's _amp_update_scale_: the product in double, rounded to float.
  if (found_inf > 0.f) {
    scale = static_cast<float>(static_cast<double>(scale) * backoff_factor);
    growth_tracker = 0;
    return;
  }
  const int32_t successful = growth_tracker + 1;
  if (successful == growth_interval) {
    const float grown = static_cast<float>(static_cast<double>(scale) * growth_factor);
    if (opt_isfinite(grown)) scale = grown;
    growth_tracker = 0;
  } else {
    growth_tracker = successful;
  }
}

}  // namespace optim_fns

}  // namespace ember
