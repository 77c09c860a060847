// Context-parallel attention: every rank of the cp group holds the
// head-tail slice of the sequence (load_balance.h: chunks r and 2·cp−1−r of
// 2·cp) for q, k and v, and attention exchanges keys and values so that
// each rank's output slice equals the same slice of attention over the
// whole sequence. Three exchanges, as the field has them:
//
//   ring       k and v travel around the ring (send to r+1, receive from
//              r−1) cp−1 times; the transfer of the next block is posted
//              before the attention of the block in hand and waited for
//              after it (overlap); the partial results merge by their
//              log-sum-exps (scaled_dot_product_attention_lse). Backward:
//              the gradients of k and v travel back around the ring.
//              Sends (cp−1)/cp of k and v per rank in the forward.
//   allgather  k and v all-gathered once (torchtitan's default); each local
//              chunk attends to the keys before it (full) and to its own
//              chunk (causal), merged by log-sum-exp.
//   alltoall   DeepSpeed-Ulysses: q, k and v traded from a sequence split to
//              a head split (cp must divide the heads), plain attention on
//              the whole sequence, and the output traded back: 4 all-to-alls.
//
// Causal masks follow the global positions, so the head-tail layout's
// chunks see exactly the keys they would unsharded. Dropout is not
// supported under context parallelism (the mask's Philox index would need
// global positions). Differentiable; every rank of the group calls it with
// the same shapes, in the same order.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "core/tensor.h"
#include "distributed/comm/process_group.h"

namespace ember::distributed::cp {

enum class Exchange { Ring, AllGather, AllToAll };
// "ring", "allgather", "alltoall" (the example's --cp-exchange); a named
// error otherwise.
Exchange parse_exchange(const std::string& name);
const char* exchange_name(Exchange e);

// q, k, v [..., H, S, D] with S = 2·c this rank's slice of a sequence of
// cp·S; k and v share q's leading dims (repeat grouped k/v heads first).
// Returns this rank's slice of softmax(q k^T · scale [+ causal]) v, in q's
// dtype. Named errors: S odd, shapes that differ, cp not dividing H under
// alltoall.
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, Exchange exchange,
                 const std::shared_ptr<ProcessGroup>& pg, std::optional<double> scale = std::nullopt);

}  // namespace ember::distributed::cp
