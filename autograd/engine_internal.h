// The graph's internals that autograd/'s own files share beyond
// autograd.h: activation checkpointing (checkpoint.cc) reads a region's
// recorded nodes and runs a backward confined to its recompute.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "autograd/autograd.h"

namespace ember::autograd::detail {

// The node a gradient for `t` flows into (its grad_fn or its leaf's
// accumulator); null when `t` does not require grad.
std::shared_ptr<Node> gradient_edge_of(const Tensor& t);
// The sequence number the next recorded node gets (peek), or takes one.
uint64_t peek_sequence_nr();
uint64_t take_sequence_nr();
// Inside a running backward pass: runs the nodes under `root` recorded
// from `first_seq` on; every other node reached (leaves' accumulators,
// nodes recorded before) is not run, and the gradients reaching it are
// summed into `boundary`. Callbacks queued meanwhile belong to the
// enclosing pass.
void run_backward_within(const std::shared_ptr<Node>& root, const Tensor& root_grad, uint64_t first_seq,
                         std::unordered_map<Node*, Tensor>& boundary);

}  // namespace ember::autograd::detail
