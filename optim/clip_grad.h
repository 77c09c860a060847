// torch.nn.utils.clip_grad_norm_ for ember: rescales gradients so their
// combined norm is at most max_norm, the usual guard against exploding
// gradients.
#pragma once

#include <functional>
#include <vector>

#include "core/tensor.h"

namespace ember::optim {

// The norm_type-norm of all gradients together (as if concatenated), over
// the parameters whose grad is defined; norm_type may be any p > 0 or
// infinity. When the norm exceeds max_norm, every gradient is multiplied in
// place by max_norm / (norm + 1e-6). Returns the norm before clipping (0 when
// no parameter has a gradient). Like torch with error_if_nonfinite=false, a
// NaN or infinite norm is returned and clipping then leaves NaN/0 gradients.
//
// Distributed tensors (tensor parallelism's parameters, whose shard meta
// says so): the norm is over the global tensors, each element counted once
// (a replicated parameter by one rank) and the partial sums combined over
// each tensor's mesh, so every rank of it returns the same norm and
// clips alike. Every rank of the mesh must call it.
//
// Sharded gradients (FSDP, or any split of the parameters over ranks): each
// rank holds part of the gradient, and the norm is over all of it.
// `reduce_partial` receives this rank's partial, a one-element float64 CPU
// tensor (the sum of |g|^p, or the max |g| for the infinity norm; 0 when the
// rank holds no gradient), and must combine it over the ranks in place (sum,
// or max): distributed::grad_norm_allreduce(pg, norm_type) does. Every rank
// must call it, even one with no gradient.
double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0,
                       const std::function<void(const Tensor& partial)>& reduce_partial = nullptr);

// The same clipping with nothing waiting for the GPU, as torch's
// clip_grad_norm_ does it: the norm is a 0-dim float64 tensor on the
// gradients' device (one device for all), and every gradient is multiplied
// there by clamp(max_norm / (norm + 1e-6), max=1) (by exactly 1 when
// unclipped, which changes no value). So a CUDA graph can capture it
// (optim/graphed_step.h), and a step need not stop for the norm before the
// optimizer. `reduce_partial` receives a one-element float64 tensor on that
// device. The norm is the one clip_grad_norm_ returns, up to the order of
// its float64 sums.
Tensor clip_grad_norm_async_(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0,
                             const std::function<void(const Tensor& partial)>& reduce_partial = nullptr);

}  // namespace ember::optim
