// The memory planner's arithmetic (see memory_plan.h).
#include "distributed/parallel/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "core/exception.h"

namespace ember::distributed {
namespace {

// Bytes per parameter of optimizer state.
int64_t state_bytes_per_param(const std::string& optimizer, bool mixed) {
  const int64_t master = mixed ? 4 : 0;  // the float32 copy 16-bit training keeps
  if (optimizer == "adam" || optimizer == "adamw") return master + 8;
  if (optimizer == "sgd") return master + 4;
  if (optimizer == "sgd_plain") return master;
  EMBER_CHECK(false, "plan_memory: unknown optimizer '", optimizer, "' (adam, adamw, sgd, sgd_plain)");
  return 0;
}

std::string gb(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", static_cast<double>(bytes) / 1e9);
  return buf;
}

}  // namespace

const MemoryPlanRow& MemoryPlan::row(const std::string& strategy) const {
  for (const auto& r : rows)
    if (r.strategy == strategy) return r;
  EMBER_CHECK(false, "MemoryPlan: no strategy named '", strategy, "'");
  return rows.front();
}

MemoryPlan plan_memory(int64_t num_params, int64_t largest_unit_params, const MemoryPlanOptions& o) {
  EMBER_CHECK(num_params >= 0 && largest_unit_params >= 0 && largest_unit_params <= num_params,
              "plan_memory: ", num_params, " parameters with a largest unit of ", largest_unit_params,
              " (it must be between 0 and the total)");
  EMBER_CHECK(o.world_size >= 1, "plan_memory: world_size must be at least 1, got ", o.world_size);
  MemoryPlan plan;
  plan.num_params = num_params;
  plan.largest_unit_params = largest_unit_params;
  plan.options = o;
  const int64_t N = o.world_size;
  const int64_t elem = o.mixed_precision ? 2 : 4;
  const int64_t P = elem * num_params, G = elem * num_params;
  const int64_t O = state_bytes_per_param(o.optimizer, o.mixed_precision) * num_params;
  // Shards round up: every rank holds ceil(x / N) (padding to the world size).
  auto shard = [N](int64_t bytes) { return (bytes + N - 1) / N; };
  plan.rows = {
      {"DDP", P, G, O, 0},
      {"ZeRO-1", P, G, shard(O), 0},
      {"SHARD_GRAD_OP", P, shard(G), shard(O), 0},
      // The largest unit gathered: its parameters, and in backward its
      // unsharded gradients before the reduce-scatter.
      {"FULL_SHARD", shard(P), shard(G), shard(O), 2 * elem * largest_unit_params},
  };
  for (auto& r : plan.rows) r.fits = r.total() + o.activation_bytes <= o.device_bytes;
  for (const auto& r : plan.rows) {
    if (!r.fits) continue;
    plan.recommendation = N == 1 && r.strategy == "DDP" ? "single device" : r.strategy;
    plan.reason = r.strategy == "DDP"
                      ? "the whole model, gradients and optimizer state fit on each device: no sharding needed"
                      : "the first strategy that fits in " + gb(o.device_bytes) + " GB per device (" + gb(r.total()) +
                            " GB + " + gb(o.activation_bytes) + " GB activations); those before it do not, and " +
                            "it communicates less than those after it";
    return plan;
  }
  plan.recommendation = "FULL_SHARD + CPU offload";
  plan.reason = "no strategy fits in " + gb(o.device_bytes) + " GB per device (FULL_SHARD needs " +
                gb(plan.row("FULL_SHARD").total() + o.activation_bytes) +
                " GB): keep parameters and optimizer state in host memory, or add ranks";
  return plan;
}

MemoryPlan plan_memory(const nn::Module& model, const MemoryPlanOptions& options,
                       const std::vector<std::string>& unit_types) {
  int64_t total = 0, largest = 0;
  for (const auto& [name, p] : model.named_parameters()) total += p.numel();
  if (!unit_types.empty()) {
    // As fully_shard_auto wraps: every module of those types, the root the rest.
    int64_t in_units = 0;
    auto& root = const_cast<nn::Module&>(model);
    for (const auto& [name, m] : root.named_modules()) {
      if (std::find(unit_types.begin(), unit_types.end(), m->type_name()) == unit_types.end()) continue;
      const int64_t n = m->num_parameters();
      largest = std::max(largest, n);
      in_units += n;
    }
    return plan_memory(total, std::max(largest, total - in_units), options);
  }
  for (const auto& [name, child] : model.named_children()) {
    int64_t n = 0;
    for (const auto& [pn, p] : child->named_parameters()) n += p.numel();
    largest = std::max(largest, n);
  }
  if (model.named_children().empty()) largest = total;
  return plan_memory(total, largest, options);
}

std::string MemoryPlan::table() const {
  std::ostringstream os;
  os << num_params << " parameters (largest unit " << largest_unit_params << "), " << options.optimizer << ", "
     << (options.mixed_precision ? "16-bit with float32 master" : "float32") << ", " << options.world_size
     << " rank(s) of " << gb(options.device_bytes) << " GB\n";
  os << "| strategy | parameters GB | gradients GB | optimizer GB | gathered GB | total GB/rank | fits |\n";
  os << "|---|---|---|---|---|---|---|\n";
  for (const auto& r : rows)
    os << "| " << r.strategy << " | " << gb(r.params) << " | " << gb(r.grads) << " | " << gb(r.optimizer_state) << " | "
       << gb(r.gathered) << " | " << gb(r.total()) << " | " << (r.fits ? "yes" : "no") << " |\n";
  os << "recommendation: " << recommendation << " (" << reason << ")\n";
  return os.str();
}

}  // namespace ember::distributed
