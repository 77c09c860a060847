// Measuring and reporting a step's memory by part (step_memory.h).
#include "distributed/parallel/step_memory.h"

#include <cstdio>

#include "core/ops.h"

namespace ember::distributed {

double StepMemory::total() const {
  double t = 0;
  for (double v : mib) t += v;
  return t;
}

std::string StepMemory::line(const std::string& what) const {
  // The order of the line: params, grads, optimizer, gathered, activations, other.
  const MemoryKind order[] = {MemoryKind::Parameters, MemoryKind::Gradients,   MemoryKind::Optimizer,
                              MemoryKind::Gathered,   MemoryKind::Activations, MemoryKind::Other};
  char buf[64];
  std::snprintf(buf, sizeof buf, " %.1f MiB:", total());
  std::string out = what + buf;
  for (size_t i = 0; i < 6; ++i) {
    std::snprintf(buf, sizeof buf, "%s %s %.1f", i ? "," : "", memory_kind_name(order[i]), (*this)[order[i]]);
    out += buf;
  }
  return out;
}

StepMemory measured_step_memory(const AllocatorStats& stats) {
  StepMemory m;
  for (int k = 0; k < kMemoryKinds; ++k) m.mib[k] = static_cast<double>(stats.peak_by_kind[k]) / (1 << 20);
  return m;
}

StepMemory largest_over_ranks(ProcessGroup& pg, const StepMemory& mine, Device device) {
  const int n = pg.size(), r = pg.rank();
  // Every rank's row, summed into place; then the row with the largest total.
  Tensor all = zeros({n, kMemoryKinds}, {DType::Float64, kCPU});
  for (int k = 0; k < kMemoryKinds; ++k) all.narrow(0, r, 1).narrow(1, k, 1).fill_(mine.mib[k]);
  Tensor on = all.to(device);
  pg.allreduce(on, ReduceOp::Sum)->wait();
  const std::vector<double> v = on.to(kCPU).to_vector();
  int best = 0;
  double best_total = -1;
  for (int i = 0; i < n; ++i) {
    double t = 0;
    for (int k = 0; k < kMemoryKinds; ++k) t += v[i * kMemoryKinds + k];
    if (t > best_total) best_total = t, best = i;
  }
  StepMemory out;
  for (int k = 0; k < kMemoryKinds; ++k) out.mib[k] = v[best * kMemoryKinds + k];
  return out;
}

}  // namespace ember::distributed
