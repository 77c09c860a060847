// The memory planner: how many bytes per rank the parameters, gradients and
// optimizer state of a model take under each way of distributing it, and
// which one to use. The accounting is the ZeRO paper's (Rajbhandari et al.,
// 2020, section 3): with Psi parameters, 16-bit training keeps 2 Psi bytes of
// parameters, 2 Psi of gradients and K Psi of optimizer state (Adam: a
// float32 master plus two moments, K = 12), and each stage divides one more
// of those by the world size N:
//
//   strategy        parameters   gradients   optimizer state   + gathered
//   DDP             P            G           O
//   ZeRO-1          P            G           O / N
//   SHARD_GRAD_OP   P            G / N       O / N
//   FULL_SHARD      P / N        G / N       O / N             largest unit
//
// FULL_SHARD also holds the largest unit gathered (its parameters and, in
// backward, its unsharded gradients). Activations are the caller's to add
// (MemoryPlanOptions::activation_bytes).
//
//   auto plan = distributed::plan_memory(7'000'000'000, 200'000'000, {.world_size = 4, .mixed_precision = true});
//   std::cout << plan.table();   // one row per strategy, then the recommendation and why
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "nn/module.h"

namespace ember::distributed {

struct MemoryPlanOptions {
  // "adam" / "adamw" (two moments), "sgd" (momentum buffer), "sgd_plain" (none).
  std::string optimizer = "adam";
  int world_size = 1;
  // Memory of one device, and what the activations of a step take there.
  int64_t device_bytes = int64_t{80} * 1000 * 1000 * 1000;
  int64_t activation_bytes = 0;
  // 16-bit parameters and gradients with a float32 master in the optimizer
  // state (the ZeRO paper's setting); false: everything float32.
  bool mixed_precision = false;
};

struct MemoryPlanRow {
  std::string strategy;  // "DDP", "ZeRO-1", "SHARD_GRAD_OP", "FULL_SHARD"
  int64_t params = 0, grads = 0, optimizer_state = 0, gathered = 0;
  int64_t total() const { return params + grads + optimizer_state + gathered; }
  bool fits = false;  // total + activations <= device_bytes
};

struct MemoryPlan {
  int64_t num_params = 0, largest_unit_params = 0;
  MemoryPlanOptions options;
  std::vector<MemoryPlanRow> rows;  // in the order above
  // The first strategy that fits (least communication first), or
  // "FULL_SHARD + CPU offload" when none does; and why.
  std::string recommendation, reason;
  const MemoryPlanRow& row(const std::string& strategy) const;
  // A printable table: bytes per rank in GB (1e9), the fit, the recommendation.
  std::string table() const;
};

// From parameter counts: the model's, and its largest unit's (the most a
// FULL_SHARD unit gathers at once).
MemoryPlan plan_memory(int64_t num_params, int64_t largest_unit_params, const MemoryPlanOptions& options);
// From a model: its parameters, with each direct child as a unit, or, given
// unit_types, each module of those types (not nested in another) a unit and
// the rest the root's, as fully_shard_auto({.types = unit_types}) wraps it.
MemoryPlan plan_memory(const nn::Module& model, const MemoryPlanOptions& options,
                       const std::vector<std::string>& unit_types = {});

}  // namespace ember::distributed
