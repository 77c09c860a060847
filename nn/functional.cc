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

void check_targets(const char* op, const Tensor& input, const Tensor& target) {
  EMBER_CHECK(input.dim() == 2, op, ": expected input [N, C], got ", shape_str(input.sizes()));
  EMBER_CHECK(target.dim() == 1 && target.size(0) == input.size(0), op, ": target ", shape_str(target.sizes()),
              " does not match input ", shape_str(input.sizes()), " (expected [", input.size(0), "])");
  EMBER_CHECK(target.dtype() == DType::Int64 || target.dtype() == DType::Int32, op,
              ": target must hold class indices (int64), got ", target.dtype());
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

Tensor cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing, Reduction reduction) {
  if (Tensor c = autocast::fp32(logits); !c.is_same(logits)) return cross_entropy(c, target, label_smoothing, reduction);
  check_targets("cross_entropy", logits, target);
  EMBER_CHECK(label_smoothing >= 0 && label_smoothing <= 1, "cross_entropy: label_smoothing must be in [0, 1], got ",
              label_smoothing);
  // One op: it keeps log_softmax(logits) for backward and forms the
  // gradient (softmax - smoothed one-hot) * g in one buffer, in place,
  // rather than back through gather, neg, the smoothing terms and
  // log_softmax's own backward, whose [N, C] temporaries (4 of them, 128 MiB
  // for a 1024 x 8192 batch of logits) were a step's peak.
  const Tensor ids = target.to(DType::Int64).unsqueeze(1);
  const double ls = label_smoothing;
  Tensor logp;
  Tensor rows = differentiable(
      "cross_entropy", {logits},
      [&] {
        logp = log_softmax(logits, 1);
        Tensor nll = neg(gather(logp, 1, ids).squeeze(1));
        return ls == 0 ? nll : nll * (1.0 - ls) + neg(mean(logp, {1})) * ls;
      },
      [&](const Tensor&) {
        const Tensor lp = logp, t = ids;
        BackwardFn fn = [lp, t, ls](const Tensor& g) {
          NoGradGuard ng;
          const int64_t c = lp.size(1);
          Tensor w = g.to(lp.dtype()).unsqueeze(1);  // [N, 1]
          Tensor grad = exp(lp);
          mul_(grad, w);
          if (ls > 0) add_(grad, w, -ls / static_cast<double>(c));
          Tensor hit = w * (ls - 1.0);
          if (!grad.is_contiguous() || (grad.dtype() != DType::Float32 && grad.dtype() != DType::Float64)) {
            grad = grad.contiguous().to(DType::Float32);
            hit = hit.to(DType::Float32);
          }
          scatter_add_(grad, 1, t, hit.contiguous());
          return std::vector<Tensor>{grad.to(lp.dtype())};
        };
        return Recorded{std::move(fn), {lp}};
      });
  return reduce(rows, reduction);
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
