// The vocab-parallel cross-entropy (loss_parallel.h): one op with its own
// backward, so autograd keeps the local softmax and the target columns,
// and the backward is local.
#include "distributed/parallel/tp/loss_parallel.h"

#include <limits>

#include "core/autograd_hook.h"
#include "core/exception.h"
#include "core/ops.h"
#include "distributed/tensor/dtensor.h"
#include "nn/functional.h"

namespace ember::distributed {

Tensor parallel_cross_entropy(const Tensor& logits, const Tensor& targets) {
  EMBER_CHECK(logits.defined() && logits.dim() >= 1, "parallel_cross_entropy: logits must be [..., vocab]");
  Shape want = logits.sizes();
  want.pop_back();
  EMBER_CHECK(targets.sizes() == want, "parallel_cross_entropy: targets ", shape_str(targets.sizes()),
              " do not match logits ", shape_str(logits.sizes()), " (expected ", shape_str(want), ")");
  const int64_t v_local = logits.size(logits.dim() - 1);
  auto spec = std::dynamic_pointer_cast<const DTensorSpec>(shard_spec_ptr(logits));
  if (!spec) return nn::functional::cross_entropy(logits.reshape({-1, v_local}), targets.reshape({-1}));
  EMBER_CHECK(spec->placements.size() == 1 && spec->placements[0] == Shard(static_cast<int>(logits.dim()) - 1),
              "parallel_cross_entropy: logits laid out ", placements_string(spec->placements),
              "; the vocab-parallel loss takes [Shard(", logits.dim() - 1, ")] on a 1-D mesh");
  const int64_t v0 = spec->region.box.offsets.back();
  const std::shared_ptr<ProcessGroup> pg = spec->mesh->group();
  Tensor x = logits.reshape({-1, v_local});
  if (x.dtype() != DType::Float32 && x.dtype() != DType::Float64) x = cast(x, DType::Float32);
  const Tensor t = targets.reshape({-1}).to(DType::Int64);
  const int64_t n = x.size(0);
  Tensor probs, idx, mine;  // kept for backward: the softmax, the target's local column and whether it is here
  return differentiable(
      "vocab_parallel_cross_entropy", {x},
      [&] {
        const TensorOptions f = x.options();
        // The row maximum over every rank's columns (for a stable exp).
        Tensor m = v_local > 0 ? max(x, {1}) : full({n}, -std::numeric_limits<double>::infinity(), f);
        m = m.contiguous();
        if (n > 0) pg->allreduce(m, ReduceOp::Max)->wait();
        Tensor z = x - m.unsqueeze(1);
        Tensor e = exp(z);
        Tensor s = sum(e, {1}).contiguous();
        if (n > 0) pg->allreduce(s, ReduceOp::Sum)->wait();
        // The target's logit, from the rank whose columns hold it.
        Tensor lo = full_like(t, static_cast<double>(v0)), hi = full_like(t, static_cast<double>(v0 + v_local));
        mine = cast(ge(t, lo), f.dtype) * cast(lt(t, hi), f.dtype);
        idx = where(gt(mine, zeros_like(mine)), t - lo, zeros_like(t));
        Tensor picked = v_local > 0 ? gather(z, 1, idx.unsqueeze(1)).squeeze(1) * mine : zeros({n}, f);
        picked = picked.contiguous();
        if (n > 0) pg->allreduce(picked, ReduceOp::Sum)->wait();
        probs = e / s.unsqueeze(1);
        return mean(log(s) - picked);
      },
      [&](const Tensor&) {
        Tensor p = probs, i = idx, m = mine;
        const int64_t v = v_local;
        BackwardFn fn = [p, i, m, n, v](const Tensor& g) {
          // softmax - one_hot(target) on this rank's columns, the one-hot
          // made here rather than kept: [tokens, vocab / t] floats saved.
          Tensor d = p * (g * (1.0 / n));
          if (v > 0) d = d - cast(one_hot(i, v), d.dtype()) * (m * (g * (1.0 / n))).unsqueeze(1);
          return std::vector<Tensor>{d};
        };
        return Recorded{std::move(fn), {p, i, m}};
      });
}

}  // namespace ember::distributed
