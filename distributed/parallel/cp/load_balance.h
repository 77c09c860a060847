// Context parallelism's sequence layout: causal attention gives a token at
// position t work proportional to t, so cutting the sequence into cp equal
// slices would give the last rank cp times the first's. The sequence is cut
// into 2·cp chunks instead and rank r holds chunks r and 2·cp−1−r (head and
// tail, as torchtitan's and Megatron's load balancing), so every rank's
// attention work is the same. These are the layout's pieces: which
// positions a rank holds (for its rotary embeddings and its mask), a
// tensor's slice for a rank along its sequence dim, and the inverse that
// puts gathered slices back in sequence order (for the loss and the data
// loader, which see the permutation undone).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace ember::distributed::cp {

// Checks that 2·cp divides seq (named error otherwise) and returns the
// chunk length seq / (2·cp).
int64_t chunk_length(int64_t seq, int cp);

// The global positions rank `rank` of `cp` holds, in the order its slice
// holds them: chunk r's, then chunk 2·cp−1−r's.
std::vector<int64_t> positions(int64_t seq, int cp, int rank);

// x's slice for `rank` along `dim` (the sequence): its two chunks,
// concatenated. Differentiable (narrow and cat).
Tensor shard(const Tensor& x, int64_t dim, int cp, int rank);

// The inverse of shard over all ranks: parts[r] is rank r's slice; returns
// the whole sequence in order along `dim`. Differentiable.
Tensor unshard(const std::vector<Tensor>& parts, int64_t dim, int cp);

}  // namespace ember::distributed::cp
