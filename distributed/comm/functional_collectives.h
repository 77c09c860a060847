// Differentiable collectives (torch.distributed.nn.functional): tensor in,
// new tensor out, recorded by autograd, each backward the matching
// collective. The gradient they give is that of the sum of every rank's
// loss, which is what data parallelism needs (each rank's loss is its own
// micro-batch's); a layout that replicates one loss over ranks (tensor
// parallelism's replicated activations) says so in its own conversions.
//
//   y = functional::all_gather(x, 0, pg);          // every rank's x, stacked along dim 0
//   functional::all_reduce(partial, ReduceOp::Sum, pg);
//
//   forward                                 backward (of the output gradient g)
//   all_reduce(x, op)   sum / avg of x       all_reduce(g, the same op)
//   all_gather(x, d)    cat of x along d     reduce_scatter(g, d, sum): this rank's block
//   reduce_scatter(x,d) block r of the sum   all_gather(g, d) (divided by N for avg)
//   all_to_all(x,s,c)   block r of every x,  all_to_all(g, c, s)
//                       concatenated along c
//   all_to_all_v(x,o,i) uneven rows          all_to_all_v(g, i, o)
// Every rank of the group calls each with the same shape and dtype, and
// again in the same order in backward (the backward collectives run when
// autograd reaches them).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "distributed/comm/process_group.h"

namespace ember::distributed::functional {

// Sum, Avg, Max or Min over the group (Max/Min: no gradient is defined
// through them, as torch's; recording one is an error).
Tensor all_reduce(const Tensor& x, ReduceOp op, const std::shared_ptr<ProcessGroup>& pg);
// Every rank's x (all the same shape) concatenated along `dim` in rank order.
Tensor all_gather(const Tensor& x, int64_t dim, const std::shared_ptr<ProcessGroup>& pg);
// x cut into size() equal blocks along `dim` (the size must divide), block
// r of every rank reduced (Sum or Avg) onto rank r.
Tensor reduce_scatter(const Tensor& x, int64_t dim, ReduceOp op, const std::shared_ptr<ProcessGroup>& pg);
// x cut into size() equal blocks along `split_dim`, block r sent to rank r;
// the blocks received concatenated along `concat_dim` in rank order
// (torch's all_to_all_single on a reshaped tensor; Shard(i) -> Shard(j)).
Tensor all_to_all(const Tensor& x, int64_t split_dim, int64_t concat_dim, const std::shared_ptr<ProcessGroup>& pg);

// Uneven splits along dim 0 (torch's all_to_all_single with split sizes):
// input_splits[r] consecutive rows of x go to rank r; the result holds
// output_splits[q] rows from each rank q in rank order. The splits must
// agree across ranks (rank q's input_splits[r] is rank r's
// output_splits[q]). Backward: the same exchange with the splits swapped.
Tensor all_to_all_v(const Tensor& x, const std::vector<int64_t>& output_splits,
                    const std::vector<int64_t>& input_splits, const std::shared_ptr<ProcessGroup>& pg);

namespace detail {
// x's n equal blocks along `dim`, each contiguous, one after another in one
// flat tensor: the layout the flat collectives (all-gather into a tensor,
// reduce-scatter, all-to-all) take. The size along `dim` divides by n.
Tensor blocks_along(const Tensor& x, int64_t dim, int n);
}  // namespace detail

}  // namespace ember::distributed::functional
