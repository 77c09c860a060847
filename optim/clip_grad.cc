// Gradient-norm clipping. Per-gradient norms are reduced on each gradient's
// device and fetched with one host copy per device; the total and the clip
// coefficient are then plain doubles, so the function returns a number
// rather than a tensor the caller would have to sync on anyway.
#include "optim/clip_grad.h"

#include <cmath>
#include <limits>
#include <map>
#include <tuple>

#include "core/autograd_hook.h"
#include "core/ops.h"

namespace ember::optim {
namespace {

// One gradient's norm as a 0-dim tensor. 16-bit gradients are reduced in
// float32, where their squares cannot overflow.
Tensor grad_norm(const Tensor& grad, double p) {
  Tensor g = grad.dtype() == DType::Float16 || grad.dtype() == DType::BFloat16 ? grad.to(DType::Float32) : grad;
  if (std::isinf(p)) return max(abs(g));
  if (p == 1.0) return sum(abs(g));
  if (p == 2.0) return sqrt(sum(g * g));
  return pow(sum(pow(abs(g), p)), 1.0 / p);
}

// The gradients that count, by the domain their partial sums combine over
// (domains[0] = null: this rank's alone). A sharded parameter
// (ShardMetaBase: a DTensor) counts where this rank is its elements' one
// holder, and its domain's sum is taken over the domain's ranks; every rank
// visits the same domains in the same order, with a gradient or not.
struct Gathered {
  std::vector<const ShardMetaBase*> domains{nullptr};
  std::vector<Tensor> grads;                       // every defined, non-empty gradient (all are clipped)
  std::vector<std::pair<size_t, Tensor>> counted;  // (domain, gradient) of those the norm counts
};

Gathered gather(const std::vector<Tensor>& params, double norm_type, const char* op) {
  EMBER_CHECK(norm_type > 0.0 && !std::isnan(norm_type), op, ": norm_type must be positive or infinite, got ",
              norm_type);
  Gathered out;
  std::map<const void*, size_t> domain_index{{nullptr, 0}};
  for (const Tensor& p : params) {
    const ShardMetaBase* meta = p.impl().shard_meta.get();
    const void* key = meta ? meta->norm_domain() : nullptr;
    auto [it, fresh] = domain_index.emplace(key, out.domains.size());
    if (fresh) out.domains.push_back(meta);
    Tensor g = p.grad();
    if (!g.defined() || g.numel() == 0) continue;
    out.grads.push_back(g);
    if (!meta || meta->counts_in_norm()) out.counted.push_back({it->second, g});
  }
  return out;
}

// Dense float32/float64 gradients in one list op per device and dtype, the
// rest one multiply each; `coef` is a number or a one-element tensor.
template <typename Coef>
void scale_grads(std::vector<Tensor>& grads, const Coef& coef) {
  std::map<std::tuple<int, int, int>, std::vector<Tensor>> lists;
  for (Tensor& g : grads) {
    if ((g.dtype() == DType::Float32 || g.dtype() == DType::Float64) && g.is_dense())
      lists[{static_cast<int>(g.device().type), g.device().index, static_cast<int>(g.dtype())}].push_back(g);
    else
      g *= coef;
  }
  for (auto& [key, gs] : lists) foreach_mul_(gs, coef);
}

}  // namespace

double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type,
                       const std::function<void(const Tensor& partial)>& reduce_partial) {
  NoGradGuard no_grad;
  Gathered gathered = gather(params, norm_type, "clip_grad_norm_");
  const std::vector<const ShardMetaBase*>& domains = gathered.domains;
  std::vector<Tensor>& grads = gathered.grads;
  const auto& counted = gathered.counted;
  if (grads.empty() && !reduce_partial && domains.size() == 1) return 0.0;

  // Per (domain, device, dtype): the 2-norm's squares of float32/float64
  // gradients in one list op (two kernels for the lot), other norms and
  // dtypes one reduction per gradient; either way one host copy per group.
  std::map<std::tuple<size_t, int, int, int>, std::vector<Tensor>> by_group;
  for (const auto& [domain, g] : counted) {
    const Device d = g.device();
    by_group[{domain, static_cast<int>(d.type), d.is_cuda() ? d.index : 0, static_cast<int>(g.dtype())}].push_back(g);
  }
  const bool inf = std::isinf(norm_type);
  std::vector<double> per_domain(domains.size(), 0.0);
  for (auto& [key, gs] : by_group) {
    double& a = per_domain[std::get<0>(key)];
    const DType dt = gs[0].dtype();
    if (norm_type == 2.0 && (dt == DType::Float32 || dt == DType::Float64)) {
      for (double sq : foreach_sum_squares(gs).to_vector()) a += sq;
      continue;
    }
    std::vector<Tensor> norms;
    for (const Tensor& g : gs) norms.push_back(grad_norm(g, norm_type).to(DType::Float64));
    for (double n : stack(norms).to_vector()) {
      if (inf)
        a = (n > a || std::isnan(n)) ? n : a;
      else
        a += std::pow(n, norm_type);
    }
  }
  double acc = per_domain[0];
  for (size_t d = 1; d < domains.size(); ++d) {
    Tensor partial = Tensor::from_vector({per_domain[d]}, {1}, DType::Float64);
    domains[d]->reduce_norm_partial(partial, inf);
    const double v = partial.item();
    if (inf)
      acc = (v > acc || std::isnan(v)) ? v : acc;
    else
      acc += v;
  }
  if (reduce_partial) {
    // Combined over the ranks before the root: sums of |g|^p add, maxima max.
    Tensor partial = Tensor::from_vector({acc}, {1}, DType::Float64);
    reduce_partial(partial);
    acc = partial.item();
  }
  const double total = inf ? acc : std::pow(acc, 1.0 / norm_type);

  // torch multiplies by clamp(coef, max=1); skipping the multiply by exactly
  // 1 changes nothing, and a NaN coefficient still propagates.
  const double coef = max_norm / (total + 1e-6);
  if (!(coef >= 1.0)) scale_grads(grads, coef);
  return total;
}

Tensor clip_grad_norm_async_(const std::vector<Tensor>& params, double max_norm, double norm_type,
                             const std::function<void(const Tensor& partial)>& reduce_partial) {
  NoGradGuard no_grad;
  Gathered gathered = gather(params, norm_type, "clip_grad_norm_async_");
  // One device: the norm is a tensor there, and every gradient is scaled by
  // a coefficient read there.
  Device device = kCPU;
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor g = params[i].grad();
    const Device d = g.defined() ? g.device() : params[i].device();
    if (i == 0) device = d;
    EMBER_CHECK(d == device, "clip_grad_norm_async_: parameter ", i, "'s gradient is on ", d, ", parameter 0's on ",
                device, "; the norm stays on one device (clip_grad_norm_ takes several)");
  }
  const bool inf = std::isinf(norm_type);
  const TensorOptions f64{DType::Float64, device};
  // Each domain's partial (the sum of |g|^p, or the max |g|) as a 0-dim
  // float64 tensor on the device.
  std::vector<Tensor> per_domain(gathered.domains.size());
  std::map<std::pair<size_t, int>, std::vector<Tensor>> by_group;
  for (const auto& [domain, g] : gathered.counted) by_group[{domain, static_cast<int>(g.dtype())}].push_back(g);
  auto combine = [inf](Tensor& a, const Tensor& b) { a = !a.defined() ? b : inf ? maximum(a, b) : a + b; };
  for (auto& [key, gs] : by_group) {
    const DType dt = gs[0].dtype();
    Tensor part;
    if (norm_type == 2.0 && (dt == DType::Float32 || dt == DType::Float64)) {
      part = sum(foreach_sum_squares(gs));
    } else {
      std::vector<Tensor> norms;
      for (const Tensor& g : gs) norms.push_back(grad_norm(g, norm_type).to(DType::Float64));
      const Tensor n = stack(norms);
      part = inf ? max(n) : sum(pow(n, norm_type));
    }
    combine(per_domain[key.first], part);
  }
  for (Tensor& p : per_domain)
    if (!p.defined()) p = zeros({}, f64);
  Tensor acc = per_domain[0];
  for (size_t d = 1; d < gathered.domains.size(); ++d) {
    Tensor partial = per_domain[d].reshape({1}).contiguous();
    gathered.domains[d]->reduce_norm_partial(partial, inf);
    combine(acc, partial.reshape({}));
  }
  if (reduce_partial) {
    Tensor partial = acc.reshape({1}).contiguous();
    reduce_partial(partial);
    acc = partial.reshape({});
  }
  const Tensor total = inf ? acc : norm_type == 2.0 ? sqrt(acc) : pow(acc, 1.0 / norm_type);
  // torch's clamp(max_norm / (norm + 1e-6), max=1): a NaN norm gives a NaN
  // coefficient, which the gradients then carry.
  const Tensor coef = clamp(max_norm / (total + 1e-6), std::nullopt, 1.0);
  if (!gathered.grads.empty()) scale_grads(gathered.grads, coef);
  return total;
}

}  // namespace ember::optim
