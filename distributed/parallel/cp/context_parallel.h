// Context parallelism as a transform of a module (torchtitan's
// context_parallel, as a transform rather than a context manager): every
// attention in the module computes through cp::attention over the cp group
// with the chosen exchange, and the positions the model sees are those of
// this rank's head-tail chunks (rotary tables on every attention, GPT-2's
// learned positions on an nn::GPT root). The transform keeps its state on
// the modules it changes (their `attention` function holds the group).
//
//   apply_context_parallel(*gpt, mesh->submesh({"cp"})->group(), {.exchange = Exchange::Ring, .seq = 1024});
//   Tensor x = cp::shard(tokens, 1, cp, rank), y = cp::shard(targets, 1, cp, rank);
//   loss = cross_entropy((*gpt)(x), y);   // this rank's share: the mean over dp_cp is the whole batch's
//
// The parameters are not split (FSDP shards them over dp_shard x cp), so
// checkpoints do not change with cp.
#pragma once

#include <cstdint>
#include <memory>

#include "distributed/comm/process_group.h"
#include "distributed/parallel/cp/attention.h"
#include "nn/module.h"

namespace ember::distributed::cp {

struct ContextParallelOptions {
  Exchange exchange = Exchange::Ring;
  int64_t seq = 0;  // the whole sequence's length (every rank holds 2 chunks of seq / (2 cp))
};

// Named errors, before any step runs: seq that 2·cp does not divide; an
// attention with dropout (the mask's Philox index would need global
// positions); a module whose type names an attention the transform does
// not route (only MultiheadAttention and GroupedQueryAttention are); under
// alltoall, heads cp does not divide. pg null or of one rank: nothing.
void apply_context_parallel(nn::Module& module, const std::shared_ptr<ProcessGroup>& pg,
                            const ContextParallelOptions& options);

}  // namespace ember::distributed::cp
