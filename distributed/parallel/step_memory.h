// A training step's memory, part by part: parameters, gradients, optimizer
// state, gathered FSDP units, saved activations and the rest (temporaries,
// communication buffers), measured by the allocator at the step's peak
// (core/allocator.h's MemoryKind ledger) and predicted from the model and
// its layout, so the two can be printed side by side:
//
//   memory peak 51.4 MiB: params 0.4, grads 0.4, optimizer 0.8, gathered 1.2, activations 44.0, other 4.6
//
// The parts add up to the peak. Across ranks the breakdown reported is that
// of the rank with the largest peak (so it still adds up).
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "distributed/comm/process_group.h"
#include "nn/transformer.h"

namespace ember::distributed {

struct StepMemory {
  std::array<double, kMemoryKinds> mib{};  // indexed by MemoryKind
  double& operator[](MemoryKind k) { return mib[static_cast<int>(k)]; }
  double operator[](MemoryKind k) const { return mib[static_cast<int>(k)]; }
  double total() const;
  // "<what> X MiB: params A, grads B, optimizer C, gathered D, activations E, other F"
  std::string line(const std::string& what) const;
};

// The breakdown at the peak since the allocator's last reset_peak_stats().
StepMemory measured_step_memory(const AllocatorStats& stats);

// The planner's side: a training step (forward under the activations scope,
// backward, AdamW step) predicted by walking its tensors — their sizes and
// how long ember's ops keep them — through a timeline of allocations and
// frees, and taking the breakdown at the timeline's peak. Modelled: float32,
// one process or FSDP over `world` ranks (fully_shard on each block, then the
// root; full, grad_op or no_shard, prefetching one unit), the activation
// checkpointing policies, dropout 0. Not yet: tensor parallelism, mixed
// precision, dropout masks (refused by name).
struct StepPlan {
  int64_t micro_batch = 1;  // GPT: sequences of `seq` tokens; MLP: rows
  int64_t seq = 1;
  int world = 1;
  std::string strategy = "full";  // full | grad_op | no_shard
  std::string ac = "none";        // none | full | selective | every:K
};
StepMemory predict_gpt_step_memory(const nn::GPTOptions& model, const StepPlan& plan);
// fsdp_bench's MLP: `blocks` residual blocks x + fc2(gelu(fc1(LayerNorm(x)))),
// dim -> hidden -> dim, under an MSE loss against a [rows, dim] target.
StepMemory predict_mlp_step_memory(int64_t dim, int64_t hidden, int64_t blocks, const StepPlan& plan);
// The breakdown of the rank whose peak is largest (collective over `pg`;
// `device`: where pg's tensors live).
StepMemory largest_over_ranks(ProcessGroup& pg, const StepMemory& mine, Device device);

}  // namespace ember::distributed
