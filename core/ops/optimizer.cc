// Fused optimizer steps (core/ops_optim.h): operand checks, grouping by
// device and dtype, and the CPU kernels. A CPU step makes one pass over each
// parameter, reading and writing every operand once, split across threads
// for large tensors; optimizer.cu holds the CUDA multi-tensor kernel.
#include <atomic>
#include <map>
#include <tuple>

#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops_optim.h"

namespace ember {

// ---- CPU kernels ----
namespace {
// Masters on the CPU: the 16-bit gradient and parameter staged through
// float32 chunks that stay in L1, so that the float32 element loops
// (vectorized) run on them as they are. One loop with the 16-bit
// conversions inline ran scalar: 1.3x slower than the op-by-op passes it
// replaced. `loop(j0, g, n)` steps elements [j0, j0 + n) reading g[0, n).
template <typename L, typename Loop>
void staged_masters(float* p, const L* g, L* low, int64_t lo, int64_t hi, const Loop& loop) {
  constexpr int64_t kStage = 1024;
  float gb[kStage];
  for (int64_t j0 = lo; j0 < hi; j0 += kStage) {
    const int64_t n = std::min(kStage, hi - j0);
    float* pc = p + j0;
    const L* gc = g + j0;
    L* lc = low + j0;
    for (int64_t k = 0; k < n; ++k) gb[k] = load_as<float>(gc + k);
    for (int64_t k = 0; k < n; ++k) pc[k] = optim_fns::master_value(pc[k], lc[k]);
    loop(j0, static_cast<const float*>(gb), n);
    for (int64_t k = 0; k < n; ++k) store_as(lc + k, pc[k]);
  }
}

// Runs loop(j0, g, n) over a parameter's n elements, split across threads:
// on its gradient as it is, or, for a master (`low` defined), staged as above.
template <typename T, typename Loop>
void step_elements(T* p, const Tensor& grad, const Tensor& low, int64_t n, const Loop& loop) {
  parallel_for(n, kParallelGrain, [&](int64_t lo, int64_t hi) {
    if (!low.defined()) {
      loop(lo, grad.data<T>() + lo, hi - lo);
      return;
    }
    if constexpr (std::is_same_v<T, float>) {
      if (low.dtype() == DType::BFloat16)
        staged_masters(p, grad.data<BFloat16>(), low.data<BFloat16>(), lo, hi, loop);
      else
        staged_masters(p, grad.data<Half>(), low.data<Half>(), lo, hi, loop);
    }
  });
}
}  // namespace

void sgd_step_cpu(const std::vector<Tensor>& params, const std::vector<Tensor>& grads, const std::vector<Tensor>& bufs,
                  const std::vector<bool>& init, const SgdOptions& a, DeviceHyper dev, const std::vector<Tensor>& low) {
  if (params.empty()) return;
  // CPU tensors: the device values are host memory, read directly.
  if (dev.found_inf && *dev.found_inf > 0.f) return;
  EMBER_INTERNAL_ASSERT(low.empty() || params[0].dtype() == DType::Float32, "sgd_step_",
                        ": masters must be float32, got ", params[0].dtype());
  EMBER_DISPATCH_FLOAT(params[0].dtype(), "sgd_step_", [&] {
    using T = scalar_t;
    using C = acc_t<T>;
    auto s = optim_fns::sgd_scalars<C>(a);
    if (dev.lr) s = optim_fns::sgd_with_lr(s, static_cast<double>(*dev.lr));
    for (size_t i = 0; i < params.size(); ++i) {
      T* p = params[i].data<T>();
      T* b = s.has_momentum ? bufs[i].data<T>() : nullptr;
      const bool first = s.has_momentum && init[i];
      // Elements [j0, j0 + n) with their gradients at g[0, n).
      const auto loop = [&](int64_t j0, const T* g, int64_t n) {
        for (int64_t k = 0; k < n; ++k) {
          const int64_t j = j0 + k;
          C pv = static_cast<C>(p[j]);
          C bv = (b && !first) ? static_cast<C>(b[j]) : C(0);
          optim_fns::sgd_update<C>(pv, static_cast<C>(g[k]), bv, first, s);
          p[j] = static_cast<T>(pv);
          if (b) b[j] = static_cast<T>(bv);
        }
      };
      step_elements(p, grads[i], low.empty() ? Tensor() : low[i], params[i].numel(), loop);
    }
  });
}

namespace {
// Adam's element loop with the step's options as template parameters: gcc
// vectorizes only a loop without branches, and the options (amsgrad, weight
// decay and its kind, maximize) are the same for every element of a step.
// The arithmetic is adam_update's, shared with the CUDA kernel.
template <typename T, typename C, bool kAms, bool kWd, bool kDecoupled, bool kMax>
void adam_elements(T* p, const T* g, T* m, T* v, T* vmax, int64_t lo, int64_t hi, optim_fns::AdamScalars<C> s) {
  s.amsgrad = kAms;
  s.has_weight_decay = kWd;
  s.decoupled = kDecoupled;
  s.maximize = kMax;
  for (int64_t j = lo; j < hi; ++j) {
    C pv = static_cast<C>(p[j]), mv = static_cast<C>(m[j]), vv = static_cast<C>(v[j]);
    C xv = kAms ? static_cast<C>(vmax[j]) : C(0);
    optim_fns::adam_update<C>(pv, static_cast<C>(g[j]), mv, vv, xv, s);
    p[j] = static_cast<T>(pv);
    m[j] = static_cast<T>(mv);
    v[j] = static_cast<T>(vv);
    if (kAms) vmax[j] = static_cast<T>(xv);
  }
}

template <typename T, typename C>
using AdamLoop = void (*)(T*, const T*, T*, T*, T*, int64_t, int64_t, optim_fns::AdamScalars<C>);

template <typename T, typename C, bool kAms, bool kWd, bool kDecoupled>
AdamLoop<T, C> adam_loop_max(bool maximize) {
  return maximize ? adam_elements<T, C, kAms, kWd, kDecoupled, true> : adam_elements<T, C, kAms, kWd, kDecoupled, false>;
}
template <typename T, typename C, bool kAms>
AdamLoop<T, C> adam_loop_wd(const optim_fns::AdamScalars<C>& s) {
  if (!s.has_weight_decay) return adam_loop_max<T, C, kAms, false, false>(s.maximize);
  return s.decoupled ? adam_loop_max<T, C, kAms, true, true>(s.maximize)
                     : adam_loop_max<T, C, kAms, true, false>(s.maximize);
}
template <typename T, typename C>
AdamLoop<T, C> adam_loop_for(const optim_fns::AdamScalars<C>& s) {
  return s.amsgrad ? adam_loop_wd<T, C, true>(s) : adam_loop_wd<T, C, false>(s);
}
}  // namespace

void adam_step_cpu(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                   const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                   const std::vector<Tensor>& max_exp_avg_sqs, const std::vector<Tensor>& steps,
                   const AdamKernelArgs& a, const std::vector<Tensor>& low) {
  if (params.empty()) return;
  if (a.dev.found_inf && *a.dev.found_inf > 0.f) return;
  EMBER_INTERNAL_ASSERT(low.empty() || params[0].dtype() == DType::Float32, "adam_step_",
                        ": masters must be float32, got ", params[0].dtype());
  EMBER_DISPATCH_FLOAT(params[0].dtype(), "adam_step_", [&] {
    using T = scalar_t;
    using C = acc_t<T>;
    const auto base = optim_fns::adam_scalars<C>(a);
    const double lr = a.dev.lr ? static_cast<double>(*a.dev.lr) : a.lr;
    for (size_t i = 0; i < params.size(); ++i) {
      float* count = steps.empty() ? nullptr : steps[i].data<float>();
      auto s = base;
      // As the host computes it: (count + 1) in float32, as torch's step tensor.
      if (count) s = optim_fns::adam_resolve(base, lr, static_cast<double>(*count + 1.0f));
      else if (a.dev.lr) s = optim_fns::adam_resolve(base, lr, a.step);
      T* p = params[i].data<T>();
      T* m = exp_avgs[i].data<T>();
      T* v = exp_avg_sqs[i].data<T>();
      T* vmax = s.amsgrad ? max_exp_avg_sqs[i].data<T>() : nullptr;
      const auto elements = adam_loop_for<T, C>(s);
      // Elements [j0, j0 + n) with their gradients at g[0, n).
      const auto loop = [&](int64_t j0, const T* g, int64_t n) {
        elements(p + j0, g, m + j0, v + j0, vmax ? vmax + j0 : nullptr, 0, n, s);
      };
      step_elements(p, grads[i], low.empty() ? Tensor() : low[i], params[i].numel(), loop);
      if (count) *count += 1.0f;
    }
  });
}

void amp_unscale_cpu(const std::vector<Tensor>& grads, const Tensor& found_inf, const Tensor& inv_scale) {
  if (grads.empty()) return;
  float* found = found_inf.data<float>();
  const float inv = *inv_scale.data<float>();
  EMBER_DISPATCH_FLOAT(grads[0].dtype(), "amp_unscale_", [&] {
    using T = scalar_t;
    using C = acc_t<T>;
    const C inv_c = static_cast<C>(inv);
    for (const Tensor& t : grads) {
      T* g = t.data<T>();
      std::atomic<bool> any{false};
      parallel_for(t.numel(), kParallelGrain, [&](int64_t lo, int64_t hi) {
        bool f = false;
        for (int64_t j = lo; j < hi; ++j) g[j] = static_cast<T>(optim_fns::amp_unscale<C>(static_cast<C>(g[j]), inv_c, f));
        if (f) any = true;
      });
      if (any) *found = 1.f;
    }
  });
}

void amp_update_scale_cpu(const Tensor& scale, const Tensor& growth_tracker, const Tensor& found_inf,
                          const AmpScaleArgs& a) {
  optim_fns::amp_update_scale(*scale.data<float>(), *growth_tracker.data<int32_t>(), *found_inf.data<float>(),
                              a.growth_factor, a.backoff_factor, a.growth_interval);
}

// ---- Op layer ----
namespace {

void check_count(const char* op, const char* what, size_t got, size_t want) {
  EMBER_CHECK(got == want, op, ": expected one ", what, " per parameter (", want, "), got ", got);
}

void check_param(const char* op, const Tensor& p, size_t i) {
  EMBER_CHECK(p.defined(), op, ": parameter ", i, " is undefined");
  EMBER_CHECK(is_floating(p.dtype()), op, ": parameter ", i, " ", shape_str(p.sizes()),
              " has dtype ", p.dtype(), "; only floating parameters can be optimized");
  EMBER_CHECK(p.is_dense(), op, ": parameter ", i, " ", shape_str(p.sizes()), " with strides ", shape_str(p.strides()),
              " is neither contiguous nor channels-last; fused steps update parameters in place as flat arrays");
}

// Laid out as the parameter, element for element in memory (a channels-last
// parameter's state is channels-last), so both can be walked as flat arrays.
bool laid_out_as(const Tensor& t, const Tensor& p) { return t.is_contiguous(p.suggest_memory_format()); }

// A state tensor (or gradient) must match its parameter exactly.
void check_operand(const char* op, const char* what, const Tensor& t, const Tensor& p, size_t i,
                   bool need_contiguous) {
  EMBER_CHECK(t.defined(), op, ": ", what, " ", i, " is undefined");
  EMBER_CHECK(t.sizes() == p.sizes() && t.dtype() == p.dtype() && t.device() == p.device(), op, ": ", what, " ", i,
              " (", shape_str(t.sizes()), " ", t.dtype(), " on ", t.device(), ") does not match parameter ", i, " (",
              shape_str(p.sizes()), " ", p.dtype(), " on ", p.device(), ")");
  EMBER_CHECK(!need_contiguous || laid_out_as(t, p), op, ": ", what, " ", i, " ", shape_str(t.sizes()),
              " with strides ", shape_str(t.strides()), " is not laid out as its parameter (strides ",
              shape_str(p.strides()), "); optimizer state is updated in place as a flat array");
}

// The device-side hyperparameters: one-element float32 tensors on the
// device of every parameter (one device per call when either is given).
DeviceHyper device_hyper(const char* op, const Tensor& lr, const Tensor& found_inf, const std::vector<Tensor>& params) {
  DeviceHyper d;
  auto check = [&](const Tensor& t, const char* name) -> const float* {
    if (!t.defined()) return nullptr;
    EMBER_CHECK(t.numel() == 1 && t.dtype() == DType::Float32 && t.is_contiguous(), op, ": ", name,
                " must be a one-element float32 tensor, got ", shape_str(t.sizes()), " ", t.dtype());
    for (size_t i = 0; i < params.size(); ++i)
      EMBER_CHECK(params[i].device() == t.device(), op, ": ", name, " is on ", t.device(), " but parameter ", i,
                  " is on ", params[i].device(), "; it is read on the parameters' device");
    return static_cast<const float*>(t.raw_data());
  };
  d.lr = check(lr, "lr_tensor");
  d.found_inf = check(found_inf, "found_inf");
  return d;
}

// Parameter indices grouped by (device, dtype, the gradients' dtype: a
// master's 16-bit parameter's), in first-seen order so the launch order is
// deterministic.
std::vector<std::vector<size_t>> group_by_device_dtype(const std::vector<Tensor>& params,
                                                       const std::vector<Tensor>& grads = {}) {
  std::map<std::tuple<int, int, int, int>, size_t> slot;
  std::vector<std::vector<size_t>> groups;
  for (size_t i = 0; i < params.size(); ++i) {
    const Device d = params[i].device();
    auto key = std::make_tuple(static_cast<int>(d.type), d.is_cuda() ? d.index : 0, static_cast<int>(params[i].dtype()),
                               static_cast<int>(grads.empty() ? params[i].dtype() : grads[i].dtype()));
    auto [it, fresh] = slot.emplace(key, groups.size());
    if (fresh) groups.emplace_back();
    groups[it->second].push_back(i);
  }
  return groups;
}

std::vector<Tensor> pick(const std::vector<Tensor>& v, const std::vector<size_t>& idx) {
  std::vector<Tensor> out;
  if (v.empty()) return out;
  out.reserve(idx.size());
  for (size_t i : idx) out.push_back(v[i]);
  return out;
}

// Gradients are only read, so one laid out otherwise is copied into the
// parameter's layout rather than refused.
Tensor readable_grad(const Tensor& g, const Tensor& p) {
  return laid_out_as(g, p) ? g : g.contiguous(p.suggest_memory_format());
}

// Checks `model_params` (empty, or one per parameter: ops_optim.h's float32
// masters) and returns, per parameter, what its gradient must match: the
// parameter, or the 16-bit parameter whose master it is.
std::vector<Tensor> check_masters(const char* op, const std::vector<Tensor>& params,
                                  const std::vector<Tensor>& model_params) {
  if (model_params.empty()) return params;
  check_count(op, "entry of model_params", model_params.size(), params.size());
  std::vector<Tensor> like = params;
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& l = model_params[i];
    if (!l.defined()) continue;
    const Tensor& p = params[i];
    EMBER_CHECK(l.dtype() == DType::BFloat16 || l.dtype() == DType::Float16, op, ": model_params ", i, " has dtype ",
                l.dtype(), "; only float16 and bfloat16 parameters step through a float32 master");
    EMBER_CHECK(p.defined() && p.dtype() == DType::Float32, op, ": parameter ", i, " is the master of a ", l.dtype(),
                " model parameter and must be float32, got ",
                p.defined() ? dtype_name(p.dtype()) : "an undefined tensor");
    EMBER_CHECK(l.sizes() == p.sizes() && l.device() == p.device(), op, ": model_params ", i, " (",
                shape_str(l.sizes()), " on ", l.device(), ") does not match its master (", shape_str(p.sizes()), " on ",
                p.device(), ")");
    EMBER_CHECK(l.is_dense() && laid_out_as(l, p), op, ": model_params ", i, " ", shape_str(l.sizes()),
                " with strides ", shape_str(l.strides()), " is not laid out as its master (strides ",
                shape_str(p.strides()), "); both are updated in place as flat arrays");
    like[i] = l;
  }
  return like;
}

// The 16-bit parameters of group idx's masters: all defined, or none.
std::vector<Tensor> pick_masters(const std::vector<Tensor>& model_params, const std::vector<size_t>& idx) {
  if (model_params.empty() || !model_params[idx[0]].defined()) return {};
  std::vector<Tensor> out;
  for (size_t i : idx) out.push_back(model_params[i]);
  return out;
}

}  // namespace

void sgd_step_(std::vector<Tensor>& params, const std::vector<Tensor>& grads, std::vector<Tensor>& momentum_bufs,
               const SgdArgs& args) {
  profiler::Scope prof(profiler::Kind::Op, "sgd_step_");  // one event for the whole list
  prof.arg("tensors", static_cast<int64_t>(params.size()));
  const char* op = "sgd_step_";
  const bool momentum = args.momentum != 0.0;
  EMBER_CHECK(!args.nesterov || (momentum && args.dampening == 0.0), op,
              ": Nesterov momentum requires a momentum and zero dampening (got momentum ", args.momentum,
              ", dampening ", args.dampening, ")");
  check_count(op, "gradient", grads.size(), params.size());
  if (momentum) check_count(op, "momentum buffer", momentum_bufs.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) check_param(op, params[i], i);
  const std::vector<Tensor> like = check_masters(op, params, args.model_params);
  std::vector<Tensor> g(params.size());
  std::vector<bool> init(params.size(), false);
  for (size_t i = 0; i < params.size(); ++i) {
    check_operand(op, "gradient", grads[i], like[i], i, false);
    g[i] = readable_grad(grads[i], like[i]);
    if (momentum) {
      if (momentum_bufs[i].defined()) {
        check_operand(op, "momentum buffer", momentum_bufs[i], params[i], i, true);
      } else {
        init[i] = true;
      }
    }
  }
  // A skipped first step would leave a new buffer unset.
  if (args.found_inf.defined())
    for (size_t i = 0; i < params.size(); ++i)
      EMBER_CHECK(!init[i], op, ": momentum buffer ", i, " is new, and a step that found_inf may skip cannot "
                  "create it; take the first step without found_inf (decided on the host)");
  // All checks pass before anything is allocated or written.
  for (size_t i = 0; i < params.size(); ++i) {
    check_inplace(params[i], op);
    if (!like[i].is_same(params[i])) check_inplace(like[i], op);
    if (!momentum) continue;
    if (init[i]) momentum_bufs[i] = empty_like(params[i]);
    else check_inplace(momentum_bufs[i], op);
  }
  const DeviceHyper dev = device_hyper(op, args.lr_tensor, args.found_inf, params);
  for (const auto& idx : group_by_device_dtype(params, g)) {
    std::vector<bool> gi;
    for (size_t i : idx) gi.push_back(init[i]);
    auto p = pick(params, idx), gr = pick(g, idx), b = pick(momentum ? momentum_bufs : std::vector<Tensor>{}, idx);
    const auto low = pick_masters(args.model_params, idx);
    if (p[0].is_cuda())
      sgd_step_cuda(p, gr, b, gi, args, dev, low);
    else
      sgd_step_cpu(p, gr, b, gi, args, dev, low);
  }
}

void adam_step_(std::vector<Tensor>& params, const std::vector<Tensor>& grads, std::vector<Tensor>& exp_avgs,
                std::vector<Tensor>& exp_avg_sqs, std::vector<Tensor>& max_exp_avg_sqs, const AdamArgs& args) {
  profiler::Scope prof(profiler::Kind::Op, "adam_step_");  // one event for the whole list
  prof.arg("tensors", static_cast<int64_t>(params.size()));
  const char* op = "adam_step_";
  EMBER_CHECK(args.step >= 1, op, ": step must count this update (>= 1), got ", args.step);
  check_count(op, "gradient", grads.size(), params.size());
  check_count(op, "exp_avg", exp_avgs.size(), params.size());
  check_count(op, "exp_avg_sq", exp_avg_sqs.size(), params.size());
  if (args.amsgrad) check_count(op, "max_exp_avg_sq", max_exp_avg_sqs.size(), params.size());
  if (!args.steps.empty()) check_count(op, "step count", args.steps.size(), params.size());
  for (size_t i = 0; i < args.steps.size(); ++i) {
    const Tensor& c = args.steps[i];
    EMBER_CHECK(c.defined() && c.numel() == 1 && c.dtype() == DType::Float32 && c.is_contiguous() &&
                    c.device() == params[i].device(),
                op, ": step count ", i, " must be a one-element float32 tensor on parameter ", i, "'s device (",
                params[i].device(), "), got ", c.defined() ? shape_str(c.sizes()) : "undefined", " ",
                c.defined() ? dtype_name(c.dtype()) : "", c.defined() ? " on " + c.device().str() : "");
  }
  for (size_t i = 0; i < params.size(); ++i) check_param(op, params[i], i);
  const std::vector<Tensor> like = check_masters(op, params, args.model_params);
  std::vector<Tensor> g(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    check_operand(op, "gradient", grads[i], like[i], i, false);
    check_operand(op, "exp_avg", exp_avgs[i], params[i], i, true);
    check_operand(op, "exp_avg_sq", exp_avg_sqs[i], params[i], i, true);
    if (args.amsgrad) check_operand(op, "max_exp_avg_sq", max_exp_avg_sqs[i], params[i], i, true);
    g[i] = readable_grad(grads[i], like[i]);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    check_inplace(params[i], op);
    if (!like[i].is_same(params[i])) check_inplace(like[i], op);
    check_inplace(exp_avgs[i], op);
    check_inplace(exp_avg_sqs[i], op);
    if (args.amsgrad) check_inplace(max_exp_avg_sqs[i], op);
  }
  // Bias corrections in double on the host, as torch computes them in Python.
  const double bc1 = 1.0 - std::pow(args.beta1, static_cast<double>(args.step));
  const double bc2 = 1.0 - std::pow(args.beta2, static_cast<double>(args.step));
  const DeviceHyper dev = device_hyper(op, args.lr_tensor, args.found_inf, params);
  const AdamKernelArgs k{args.lr,        args.beta1,      args.beta2,     args.eps,     args.weight_decay,
                         args.lr / bc1,  std::sqrt(bc2),  args.decoupled, args.amsgrad, args.maximize,
                         static_cast<double>(args.step), dev};
  for (size_t i = 0; i < args.steps.size(); ++i) check_inplace(args.steps[i], op);
  for (const auto& idx : group_by_device_dtype(params, g)) {
    auto p = pick(params, idx), gr = pick(g, idx), m = pick(exp_avgs, idx), v = pick(exp_avg_sqs, idx);
    auto vmax = pick(args.amsgrad ? max_exp_avg_sqs : std::vector<Tensor>{}, idx);
    auto st = pick(args.steps, idx);
    const auto low = pick_masters(args.model_params, idx);
    if (p[0].is_cuda())
      adam_step_cuda(p, gr, m, v, vmax, st, k, low);
    else
      adam_step_cpu(p, gr, m, v, vmax, st, k, low);
  }
}

namespace {
void check_amp_state(const char* op, const char* name, const Tensor& t, DType dtype, const Device& device) {
  EMBER_CHECK(t.defined(), op, ": ", name, " is an undefined tensor");
  EMBER_CHECK(t.numel() == 1 && t.dtype() == dtype, op, ": ", name, " must be a one-element ", dtype_name(dtype),
              " tensor, got ", dtype_name(t.dtype()), " of shape ", shape_str(t.sizes()));
  EMBER_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(), " but must be on ", device);
  EMBER_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}
}  // namespace

void amp_unscale_(std::vector<Tensor>& grads, Tensor& found_inf, const Tensor& inv_scale) {
  profiler::Scope prof(profiler::Kind::Op, "amp_unscale_");  // one event for the whole list
  prof.arg("tensors", static_cast<int64_t>(grads.size()));
  const char* op = "amp_unscale_";
  if (grads.empty()) return;
  for (size_t i = 0; i < grads.size(); ++i) {
    EMBER_CHECK(grads[i].defined(), op, ": gradient ", i, " is an undefined tensor");
    EMBER_CHECK(is_floating(grads[i].dtype()), op, ": gradient ", i, " has dtype ", dtype_name(grads[i].dtype()),
                "; gradients are floating point");
    EMBER_CHECK(grads[i].device() == grads[0].device(), op, ": gradient ", i, " is on ", grads[i].device(),
                " but gradient 0 is on ", grads[0].device(), " (one call per device)");
  }
  check_amp_state(op, "found_inf", found_inf, DType::Float32, grads[0].device());
  check_amp_state(op, "inv_scale", inv_scale, DType::Float32, grads[0].device());
  // Strided gradients go through a contiguous copy, written back after.
  std::vector<Tensor> dense(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    check_inplace(grads[i], op);
    dense[i] = grads[i].is_dense() ? grads[i] : grads[i].contiguous();
  }
  for (const auto& idx : group_by_device_dtype(dense)) {
    auto g = pick(dense, idx);
    if (g[0].is_cuda()) amp_unscale_cuda(g, found_inf, inv_scale);
    else amp_unscale_cpu(g, found_inf, inv_scale);
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!dense[i].is_same(grads[i])) grads[i].copy_(dense[i]);
    ++grads[i].impl().storage->version;
  }
  ++found_inf.impl().storage->version;
}

void amp_update_scale_(Tensor& scale, Tensor& growth_tracker, const Tensor& found_inf, double growth_factor,
                       double backoff_factor, int64_t growth_interval) {
  EMBER_PROFILE_OP("amp_update_scale_", scale, found_inf);
  const char* op = "amp_update_scale_";
  EMBER_CHECK(scale.defined(), op, ": scale is an undefined tensor");
  check_amp_state(op, "scale", scale, DType::Float32, scale.device());
  check_amp_state(op, "growth_tracker", growth_tracker, DType::Int32, scale.device());
  check_amp_state(op, "found_inf", found_inf, DType::Float32, scale.device());
  EMBER_CHECK(growth_factor > 1.0, op, ": growth_factor must be > 1, got ", growth_factor);
  EMBER_CHECK(backoff_factor > 0.0 && backoff_factor < 1.0, op, ": backoff_factor must be in (0, 1), got ",
              backoff_factor);
  EMBER_CHECK(growth_interval >= 1 && growth_interval <= INT32_MAX, op, ": growth_interval must be a positive int32, got ",
              growth_interval);
  const AmpScaleArgs a{growth_factor, backoff_factor, static_cast<int32_t>(growth_interval)};
  if (scale.is_cuda()) amp_update_scale_cuda(scale, growth_tracker, found_inf, a);
  else amp_update_scale_cpu(scale, growth_tracker, found_inf, a);
  ++scale.impl().storage->version;
  ++growth_tracker.impl().storage->version;
}

}  // namespace ember
