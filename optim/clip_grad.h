// torch.nn.utils.clip_grad_norm_ for ember: rescales gradients so their
// combined norm is at most max_norm, the usual guard against exploding
// gradients.
#pragma once

#include <vector>

#include "core/tensor.h"

namespace ember::optim {

// The norm_type-norm of all gradients together (as if concatenated), over
// the parameters whose grad is defined; norm_type may be any p > 0 or
// infinity. When the norm exceeds max_norm, every gradient is multiplied in
// place by max_norm / (norm + 1e-6). Returns the norm before clipping (0 when
// no parameter has a gradient). Like torch with error_if_nonfinite=false, a
// NaN or infinite norm is returned and clipping then leaves NaN/0 gradients.
double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0);

}  // namespace ember::optim
