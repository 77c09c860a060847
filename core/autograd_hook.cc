// Grad mode, the recorder slot autograd/ fills, and the shared helpers that
// op derivatives use.
#include "core/autograd_hook.h"

#include "core/autocast.h"

#include <atomic>

#include "core/ops.h"

namespace ember {
namespace {
thread_local bool g_grad_enabled = true;
thread_local SavedOpOutputs* t_saved_op_outputs = nullptr;
thread_local const std::vector<bool>* t_grad_wanted = nullptr;
std::atomic<AutogradRecorder*> g_recorder{nullptr};
}  // namespace

bool GradMode::is_enabled() { return g_grad_enabled; }
void GradMode::set_enabled(bool enabled) { g_grad_enabled = enabled; }

SavedOpOutputs* saved_op_outputs() { return t_saved_op_outputs; }
void set_saved_op_outputs(SavedOpOutputs* s) { t_saved_op_outputs = s; }

bool grad_wanted(size_t input) {
  return t_grad_wanted == nullptr || input >= t_grad_wanted->size() || (*t_grad_wanted)[input];
}
GradWantedScope::GradWantedScope(const std::vector<bool>* wanted) : prev_(t_grad_wanted) { t_grad_wanted = wanted; }
GradWantedScope::~GradWantedScope() { t_grad_wanted = prev_; }

void set_autograd_recorder(AutogradRecorder* r) { g_recorder = r; }
AutogradRecorder* autograd_recorder() { return g_recorder.load(std::memory_order_relaxed); }

bool needs_grad_list(const std::vector<Tensor>& inputs) {
  if (!GradMode::is_enabled() || autograd_recorder() == nullptr) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

void check_inplace(const Tensor& t, const char* op) {
  EMBER_CHECK(!(GradMode::is_enabled() && t.requires_grad()), op, ": in-place operation on a tensor ",
              shape_str(t.sizes()),
              " that requires grad; autograd may need its old value. Use the out-of-place op, or run it under "
              "NoGradGuard (as optimizers do) or on a detach()ed tensor");
  t.impl().storage->bump_version(op);
}

namespace {
AutogradRecorder& recorder(const char* what) {
  AutogradRecorder* r = autograd_recorder();
  EMBER_CHECK(r != nullptr, what, ": autograd is not linked into this binary; depend on //autograd");
  return *r;
}
}  // namespace

Tensor& Tensor::requires_grad_(bool enabled) {
  recorder("requires_grad_").set_requires_grad(*this, enabled);
  return *this;
}
bool Tensor::is_leaf() const { return autograd_recorder() == nullptr || autograd_recorder()->is_leaf(*this); }
Tensor Tensor::grad() const { return autograd_recorder() ? autograd_recorder()->grad(*this) : Tensor(); }
void Tensor::set_grad(const Tensor& g) const { recorder("set_grad").set_grad(*this, g); }
void Tensor::backward(const Tensor& grad, bool retain_graph) const {
  // Backward runs in the forward's dtypes, not under the caller's autocast.
  autocast::DisabledScope no_autocast;
  recorder("backward").backward(*this, grad, retain_graph);
}

Tensor sum_to(const Tensor& grad, const Shape& shape) {
  if (grad.sizes() == shape) return grad;
  const int64_t lead = grad.dim() - static_cast<int64_t>(shape.size());
  EMBER_INTERNAL_ASSERT(lead >= 0, "sum_to: ", shape_str(grad.sizes()), " -> ", shape_str(shape));
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < grad.dim(); ++d)
    if (d < lead || (shape[d - lead] == 1 && grad.sizes()[d] != 1)) dims.push_back(d);
  Tensor s = dims.empty() ? grad : sum(grad, dims, true);
  return s.reshape(shape);
}

}  // namespace ember
