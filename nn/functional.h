// Stateless layer functions (torch.nn.functional): the modules in layers.h
// hold parameters and call these. Losses take class indices (int64 [N]) and
// reduce by mean unless told otherwise.
#pragma once

#include <array>
#include <string>

#include "core/ops.h"
#include "core/ops_nn.h"

namespace ember::nn::functional {

enum class Reduction { Mean, Sum, None };

// Zeroes each element with probability p and scales the rest by 1/(1-p) in
// training; the identity otherwise.
Tensor dropout(const Tensor& x, double p, bool training, Generator* gen = nullptr);

// logits [N, C], target int64 [N] in [0, C) or ignore_index. label_smoothing
// as in PyTorch: (1 - eps) * nll + eps * mean over classes of -log p. Rows
// whose target is ignore_index (PyTorch's default -100) count for nothing:
// loss 0, gradient 0, and the mean is over the other rows.
Tensor cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing = 0.0,
                     Reduction reduction = Reduction::Mean, int64_t ignore_index = -100);
Tensor nll_loss(const Tensor& log_probs, const Tensor& target, Reduction reduction = Reduction::Mean);
Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::Mean);

// Normalises over the trailing `normalized_ndim` dims.
Tensor layer_norm(const Tensor& x, int64_t normalized_ndim, const Tensor& weight, const Tensor& bias,
                  double eps = 1e-5);

// Output [N, C, oh, ow]; the input size must be a multiple of the output size
// (every ResNet/VGG use) or the output 1x1.
Tensor adaptive_avg_pool2d(const Tensor& x, std::array<int64_t, 2> output_size);

}  // namespace ember::nn::functional
