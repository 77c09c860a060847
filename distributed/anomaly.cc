// The anomaly detector's hooks and the findings' exchange (see anomaly.h).
#include "distributed/anomaly.h"

#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/autograd_hook.h"
#include "core/ops.h"
#include "distributed/comm/object_collectives.h"

namespace ember::distributed {

std::string NonFinite::describe() const {
  std::ostringstream os;
  os << "rank " << rank << ", step " << step << ": the "
     << (backward ? "gradient flowing back into the output" : "forward output") << " of module '" << module
     << "' holds " << nan << " NaN and " << inf << " Inf of " << numel << " values";
  return os.str();
}

AnomalyDetector::AnomalyDetector(nn::Module& model, int rank) : rank_(rank) {
  for (auto& [name, m] : model.named_modules()) {
    const std::string label = name.empty() ? "(the model)" : name;
    hooks_.push_back(m->register_forward_hook([this, label](nn::Module&, const Tensor&, const Tensor& out) {
      check(label, out, false);
      return Tensor();
    }));
    hooks_.push_back(m->register_full_backward_pre_hook([this, label](nn::Module&, const Tensor& grad) {
      check(label, grad, true);
      return Tensor();
    }));
  }
}

AnomalyDetector::~AnomalyDetector() {
  for (nn::HookHandle& h : hooks_) h.remove();
}

void AnomalyDetector::begin_step(int64_t step) {
  step_ = step;
  first_.reset();
}

void AnomalyDetector::check(const std::string& name, const Tensor& t, bool backward) {
  if (first_ || !t.defined() || t.numel() == 0 || !is_floating(t.dtype())) return;
  NoGradGuard no_grad;
  // The sum is finite when every value is (bar an overflow, which the
  // exact count below then clears).
  if (std::isfinite(sum(t.detach().to(DType::Float64)).item())) return;
  const std::vector<double> v = t.detach().to(kCPU).to(DType::Float64).to_vector();
  NonFinite f;
  for (double x : v) {
    if (std::isnan(x)) ++f.nan;
    if (std::isinf(x)) ++f.inf;
  }
  if (f.nan == 0 && f.inf == 0) return;
  f.rank = rank_;
  f.step = step_;
  f.module = name;
  f.backward = backward;
  f.numel = t.numel();
  first_ = std::move(f);
}

std::vector<NonFinite> gather_findings(const std::optional<NonFinite>& mine, ProcessGroup& pg) {
  nlohmann::json j;
  if (mine)
    j = {{"rank", mine->rank}, {"step", mine->step}, {"module", mine->module}, {"backward", mine->backward},
         {"nan", mine->nan},   {"inf", mine->inf},   {"numel", mine->numel}};
  std::vector<NonFinite> out;
  for (const std::string& s : allgather_strings(pg, mine ? j.dump() : std::string())) {
    if (s.empty()) continue;
    const nlohmann::json x = nlohmann::json::parse(s);
    NonFinite f;
    f.rank = x["rank"];
    f.step = x["step"];
    f.module = x["module"];
    f.backward = x["backward"];
    f.nan = x["nan"];
    f.inf = x["inf"];
    f.numel = x["numel"];
    out.push_back(std::move(f));
  }
  return out;
}

}  // namespace ember::distributed
