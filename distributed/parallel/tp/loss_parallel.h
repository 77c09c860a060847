// The cross-entropy of a language model whose logits stay sharded over the
// vocabulary (torch's loss_parallel, Megatron's vocab-parallel
// cross-entropy): the [tokens, vocab] logits are never gathered.
//
//   Tensor logits = model(tokens);          // lm_head: ColwiseParallel{.use_local_output = false}
//   Tensor loss = parallel_cross_entropy(logits, targets);
//
// Forward is three all-reduces over the tp group of one scalar per token
// (the row maximum, the sum of exponentials, the target's logit, held by
// the one rank whose rows include it); backward needs none: each rank's
// gradient is softmax - one_hot on its own columns. Shards of unequal size
// (a vocabulary tp does not divide) are fine.
#pragma once

#include "core/tensor.h"

namespace ember::distributed {

// The mean over positions of -log softmax(logits)[target]: logits
// [..., vocab], targets [...] int64. When `logits` is a DTensor's local
// part sharded on its last dimension over a 1-D mesh (as_dtensor), the
// vocab-parallel loss above, replicated on every tp rank; otherwise
// nn::functional::cross_entropy. Computes in float32 whatever the
// logits' dtype (as autocast does for losses).
Tensor parallel_cross_entropy(const Tensor& logits, const Tensor& targets);

}  // namespace ember::distributed
