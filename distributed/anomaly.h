// Non-finite values in training: which module produced the first NaN or
// Inf, on which rank, at which step (torch.autograd.detect_anomaly, with
// the rank), and whether re-running the step reproduces it (Megatron's
// rerun state machine: the same NaN again is "persistent (data or
// model)", gone is "transient (hardware or race)").
//
//   AnomalyDetector anomaly(model, rank);         // hooks every module
//   anomaly.begin_step(step);
//   ... forward, backward ...
//   if (!std::isfinite(grad_norm)) {
//     auto found = gather_findings(anomaly.first(), *world);   // collective
//     for (const NonFinite& f : found) LOG0(f.describe());
//   }
//
// Every module's forward output and the gradient flowing back into it are
// checked (a sum, then an exact count when the sum is not finite): a host
// sync per module, a debugging mode as torch's.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "distributed/comm/process_group.h"
#include "nn/module.h"

namespace ember::distributed {

struct NonFinite {
  int rank = -1;
  int64_t step = -1;
  std::string module;     // its name in the model ("h.1.mlp.c_fc"; "(the model)" for the root)
  bool backward = false;  // the gradient into its output, not its forward output
  int64_t nan = 0, inf = 0, numel = 0;
  // "rank 1, step 3: the forward output of module 'wte' holds 2048 NaN and 0 Inf of 2048 values"
  std::string describe() const;
};

inline constexpr const char* kNanPersistent = "persistent (data or model)";
inline constexpr const char* kNanTransient = "transient (hardware or race)";

class AnomalyDetector {
 public:
  // Hooks every module of `model` (named as named_modules() names them).
  AnomalyDetector(nn::Module& model, int rank);
  ~AnomalyDetector();
  AnomalyDetector(const AnomalyDetector&) = delete;
  AnomalyDetector& operator=(const AnomalyDetector&) = delete;

  // Forgets the last step's finding; later findings carry `step`.
  void begin_step(int64_t step);
  // This rank's first finding since begin_step: forward outputs in the
  // order modules finish (the innermost first), then backward gradients.
  const std::optional<NonFinite>& first() const { return first_; }

 private:
  void check(const std::string& name, const Tensor& t, bool backward);
  int rank_;
  int64_t step_ = -1;
  std::optional<NonFinite> first_;
  std::vector<nn::HookHandle> hooks_;
};

// Every rank's finding (those that have one), in rank order. Collective
// over `pg`.
std::vector<NonFinite> gather_findings(const std::optional<NonFinite>& mine, ProcessGroup& pg);

}  // namespace ember::distributed
