// Parameter initialisation, torch.nn.init's rules and names. Each fills a
// tensor in place (no autograd) from the default generator unless one is given.
#pragma once

#include <string>

#include "core/ops.h"

namespace ember::nn::init {

enum class FanMode { FanIn, FanOut };

// fan_in = size(1) * receptive field, fan_out = size(0) * receptive field.
std::pair<int64_t, int64_t> fans(const Tensor& t);
// gain for "linear", "relu", "leaky_relu" (with param = negative slope), "tanh", "sigmoid".
double calculate_gain(const std::string& nonlinearity, double param = 0.01);

void uniform_(const Tensor& t, double a, double b, Generator* gen = nullptr);
void normal_(const Tensor& t, double mean, double std, Generator* gen = nullptr);
void constant_(const Tensor& t, double value);
void zeros_(const Tensor& t);
void ones_(const Tensor& t);
void kaiming_uniform_(const Tensor& t, double a = 0, FanMode mode = FanMode::FanIn,
                      const std::string& nonlinearity = "leaky_relu", Generator* gen = nullptr);
void kaiming_normal_(const Tensor& t, double a = 0, FanMode mode = FanMode::FanIn,
                     const std::string& nonlinearity = "leaky_relu", Generator* gen = nullptr);
void xavier_uniform_(const Tensor& t, double gain = 1.0, Generator* gen = nullptr);

}  // namespace ember::nn::init
