// torch.nn.functional pieces built from differentiable core ops: their
// gradients come from the ops they are made of; layer_norm and the fused
// attention are core ops with their own derivatives (core/ops_nn.h).
#include "nn/functional.h"

#include "core/autocast.h"
#include "core/autograd_hook.h"

namespace ember::nn::functional {

Tensor dropout(const Tensor& x, double p, bool training, Generator* gen) {
  EMBER_CHECK(p >= 0 && p <= 1, "dropout: probability has to be between 0 and 1, but got ", p);
  if (!training || p == 0) return x;
  if (p == 1) return x * 0.0;
  Tensor keep = bernoulli(x.sizes(), 1.0 - p, x.options(), gen);
  return x * keep * (1.0 / (1.0 - p));
}

namespace {
Tensor reduce(const Tensor& loss, Reduction r) {
  switch (r) {
    case Reduction::Mean: return mean(loss);
    case Reduction::Sum: return sum(loss);
    case Reduction::None: return loss;
  }
  return loss;
}

void check_target_shape(const char* op, const Tensor& input, const Tensor& target) {
  EMBER_CHECK(input.dim() == 2, op, ": expected input [N, C], got ", shape_str(input.sizes()));
  EMBER_CHECK(target.dim() == 1 && target.size(0) == input.size(0), op, ": target ", shape_str(target.sizes()),
              " does not match input ", shape_str(input.sizes()), " (expected [", input.size(0), "])");
  EMBER_CHECK(target.dtype() == DType::Int64 || target.dtype() == DType::Int32, op,
              ": target must hold class indices (int64), got ", target.dtype());
}

void check_targets(const char* op, const Tensor& input, const Tensor& target) {
  check_target_shape(op, input, target);
  if (target.numel() == 0) return;
  if (target.is_cuda()) {  // checked on the device: no host synchronisation
    check_index_range(target, 0, input.size(1), op);
    return;
  }
  int64_t lo = static_cast<int64_t>(min(target).item()), hi = static_cast<int64_t>(max(target).item());
  EMBER_CHECK(lo >= 0 && hi < input.size(1), op, ": target values must be in [0, ", input.size(1), "), got [", lo,
              ", ", hi, "]");
}
}  // namespace

// The losses and layer_norm run in float32 under autocast (core/autocast.h).
Tensor nll_loss(const Tensor& log_probs, const Tensor& target, Reduction reduction) {
  if (Tensor c = autocast::fp32(log_probs); !c.is_same(log_probs)) return nll_loss(c, target, reduction);
  check_targets("nll_loss", log_probs, target);
  Tensor picked = gather(log_probs, 1, target.to(DType::Int64).unsqueeze(1)).squeeze(1);
  return reduce(neg(picked), reduction);
}

// One core op (core/ops/cross_entropy.cc) reads the logits in their own
// dtype and computes in float32, so under autocast the 16-bit logits are
// not cast first (PyTorch's policy casts them: an exact widening, so the
// values are the same) and nothing the size of the logits is kept in
// float32. Outside autocast the loss takes the logits' dtype, as PyTorch's.
Tensor cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing, Reduction reduction,
                     int64_t ignore_index) {
  EMBER_CHECK(logits.defined() && target.defined(), "cross_entropy: logits and target must be defined");
  check_target_shape("cross_entropy", logits, target);
  const bool mean = reduction == Reduction::Mean;
  Tensor counted;
  Tensor rows = cross_entropy_rows(logits, target, label_smoothing, ignore_index, mean ? &counted : nullptr);
  // The mean over the rows that count (PyTorch's with ignore_index: NaN
  // when none does), the count summed on the device: no synchronisation.
  Tensor loss = mean ? div(sum(rows), sum(counted).to(rows.dtype())) : reduce(rows, reduction);
  const bool keep_fp32 =
      (logits.dtype() == DType::BFloat16 || logits.dtype() == DType::Float16) && autocast_enabled(logits.device().type);
  return loss.dtype() == logits.dtype() || keep_fp32 ? loss : loss.to(logits.dtype());
}

Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction) {
  if (Tensor ci = autocast::fp32(input), ct = autocast::fp32(target); !ci.is_same(input) || !ct.is_same(target))
    return mse_loss(ci, ct, reduction);
  EMBER_CHECK(input.sizes() == target.sizes(), "mse_loss: input ", shape_str(input.sizes()), " and target ",
              shape_str(target.sizes()), " differ in shape");
  Tensor d = input - target;
  return reduce(d * d, reduction);
}

// The op and its derivative live in core (core/ops/layer_norm.{cc,cu}).
Tensor layer_norm(const Tensor& x, int64_t normalized_ndim, const Tensor& weight, const Tensor& bias, double eps) {
  return ::ember::layer_norm(x, normalized_ndim, weight, bias, eps);
}

Tensor adaptive_avg_pool2d(const Tensor& x, std::array<int64_t, 2> out) {
  EMBER_CHECK(x.dim() == 4, "adaptive_avg_pool2d: expected [N, C, H, W], got ", shape_str(x.sizes()));
  const int64_t h = x.size(2), w = x.size(3);
  EMBER_CHECK(out[0] > 0 && out[1] > 0, "adaptive_avg_pool2d: output size must be positive, got [", out[0], ",",
              out[1], "]");
  if (out[0] == 1 && out[1] == 1) return mean(x, {2, 3}, true);
  if (h % out[0] == 0 && w % out[1] == 0) {
    std::array<int64_t, 2> k{h / out[0], w / out[1]};
    return avg_pool2d(x, k, k);
  }
  // PyTorch's bins: output i averages rows [floor(i*H/out), ceil((i+1)*H/out)),
  // so bins may overlap or differ in size. A bin is a rectangle, so its mean
  // is the mean over rows of the mean over columns: pool H, then W, with
  // out_h + out_w differentiable narrow+mean ops.
  auto pool_dim = [](const Tensor& t, int dim, int64_t in, int64_t n) {
    std::vector<Tensor> parts;
    parts.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t start = i * in / n, end = ((i + 1) * in + n - 1) / n;
      parts.push_back(mean(t.narrow(dim, start, end - start), {dim}, true));
    }
    return cat(parts, dim);
  };
  return pool_dim(pool_dim(x, 2, h, out[0]), 3, w, out[1]);
}

}  // namespace ember::nn::functional
