// The tensor-parallel plan of nn::GPT (Megatron-LM's split, torch's
// styles), with or without sequence parallelism:
//   wte                 RowwiseParallel: vocab-parallel embedding
//   h.*.attn            ColwiseParallel: q, k and v by heads
//   h.*.attn.out_proj   RowwiseParallel
//   h.*.mlp.c_fc        ColwiseParallel
//   h.*.mlp.c_proj      RowwiseParallel
//   lm_head             ColwiseParallel, output left vocab-sharded for
//                       parallel_cross_entropy (tied to wte or not)
// The LLaMA family the same way: h.*.attn (q_proj, k_proj, v_proj by
// heads; the kv heads must split over tp) and o_proj, gate_proj and
// up_proj column-parallel, down_proj row-parallel; RMSNorms as LayerNorms.
// With sequence parallelism the norms, dropouts and the position
// embedding run on sequence shards (SequenceParallel), each TP region is
// entered by an all-gather and left by a reduce-scatter instead of the
// all-reduces, and the sequence length must divide by the tp degree.
#pragma once

#include "distributed/parallel/tp/tensor_parallel.h"
#include "nn/transformer.h"

namespace ember::distributed {

ParallelizePlan gpt_tp_plan(const nn::GPT& model, bool sequence_parallel);

}  // namespace ember::distributed
