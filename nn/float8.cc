// convert_to_float8_training: sets the kernel hook of each chosen linear
// layer (layers.h's LinearKernel) to float8_linear, and keeps the layer's
// Float8LinearState on it.
#include "nn/float8.h"

#include "core/ops_float8.h"
#include "nn/layers.h"
#include "nn/moe.h"
#include "nn/transformer.h"

namespace ember::nn {
namespace {

bool skipped(const std::string& fqn, const std::vector<std::string>& skip) {
  for (const std::string& s : skip) {
    if (fqn == s) return true;
    if (fqn.size() > s.size() && fqn.compare(fqn.size() - s.size(), s.size(), s) == 0 &&
        fqn[fqn.size() - s.size() - 1] == '.')
      return true;
  }
  return false;
}

}  // namespace

std::vector<std::string> convert_to_float8_training(Module& root, const Float8Options& options) {
  std::vector<std::string> converted;
  for (auto& [fqn, m] : root.named_modules()) {
    // A mixture's stacked experts: each expert's projections of its padded
    // group in float8 (the layer needs a capacity; tensorwise scales per
    // expert). Their weights are gathered as they are.
    if (auto* ex = dynamic_cast<GroupedExperts*>(m)) {
      if (skipped(fqn, options.skip_fqns) || (options.filter && !options.filter(fqn, *m))) continue;
      if (ex->w1.size(1) % 16 != 0 || ex->w1.size(2) % 16 != 0) continue;
      EMBER_CHECK(!ex->kernel, "convert_to_float8_training: the experts '", fqn, "' are converted already");
      ex->kernel = [](const Tensor& x, const Tensor& w, const Tensor& b) { return float8_linear(x, w, b); };
      converted.push_back(fqn);
      continue;
    }
    LinearKernel* kernel = nullptr;
    Tensor weight;
    if (auto* lin = dynamic_cast<Linear*>(m)) kernel = &lin->kernel, weight = lin->weight;
    if (auto* tied = dynamic_cast<TiedLinear*>(m)) kernel = &tied->kernel, weight = tied->weight;
    if (auto* attn = dynamic_cast<MultiheadAttention*>(m))
      kernel = &attn->in_proj_kernel, weight = attn->in_proj_weight;
    if (kernel == nullptr || skipped(fqn, options.skip_fqns)) continue;
    if (options.filter && !options.filter(fqn, *m)) continue;
    if (weight.dim() != 2 || weight.size(0) % 16 != 0 || weight.size(1) % 16 != 0) continue;
    EMBER_CHECK(!*kernel, "convert_to_float8_training: '", fqn, "' (", m->type_name(),
                ") already has a linear kernel of its own (tensor parallelism's?): convert to float8 before "
                "parallelizing (tensor parallelism keeps a float8 layer's kernel)");
    // A tied layer's weight is another module's too (the embedding reads
    // it whole), so it is gathered as it is.
    const bool tied = dynamic_cast<TiedLinear*>(m) != nullptr;
    auto state = std::make_shared<Float8LinearState>(Float8LinearState{
        .weight = weight, .all_gather_in_float8 = options.enable_fsdp_float8_all_gather && !tied, .cast = {}});
    m->set_transform_state(kFloat8StateKey, state);
    // The state, not the module: the kernel lives on the module. A cast
    // stands for the weight only while the weight's own data is absent (a
    // gather's placeholder): a real weight is never shadowed by a stale one.
    *kernel = [state](const Tensor& x, const Tensor& w, const Tensor& b) {
      const bool cast = state->cast.q.defined() && w.is_same(state->weight) && w.storage_freed();
      return float8_linear(x, w, b, cast ? state->cast : Float8Weight{}, state->sync);
    };
    converted.push_back(fqn);
  }
  return converted;
}

}  // namespace ember::nn
