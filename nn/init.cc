// torch.nn.init, with the same fan and gain conventions.
#include "nn/init.h"

#include <cmath>

#include "core/autograd_hook.h"

namespace ember::nn::init {

std::pair<int64_t, int64_t> fans(const Tensor& t) {
  EMBER_CHECK(t.dim() >= 2, "init: fan in/out need at least 2 dims, got ", shape_str(t.sizes()));
  int64_t receptive = 1;
  for (int64_t d = 2; d < t.dim(); ++d) receptive *= t.size(d);
  return {t.size(1) * receptive, t.size(0) * receptive};
}

double calculate_gain(const std::string& nl, double param) {
  if (nl == "linear" || nl == "sigmoid" || nl == "conv2d") return 1.0;
  if (nl == "tanh") return 5.0 / 3.0;
  if (nl == "relu") return std::sqrt(2.0);
  if (nl == "leaky_relu") return std::sqrt(2.0 / (1 + param * param));
  EMBER_CHECK(false, "calculate_gain: unsupported nonlinearity '", nl, "'");
  return 0;
}

void uniform_(const Tensor& t, double a, double b, Generator* gen) {
  NoGradGuard g;
  Tensor d = t.detach();
  ember::uniform_(d, a, b, gen);
}

void normal_(const Tensor& t, double mean, double std, Generator* gen) {
  NoGradGuard g;
  Tensor d = t.detach();
  ember::normal_(d, mean, std, gen);
}

void constant_(const Tensor& t, double value) {
  NoGradGuard g;
  t.detach().fill_(value);
}
void zeros_(const Tensor& t) { constant_(t, 0.0); }
void ones_(const Tensor& t) { constant_(t, 1.0); }

namespace {
double kaiming_std(const Tensor& t, double a, FanMode mode, const std::string& nl) {
  auto [fan_in, fan_out] = fans(t);
  int64_t fan = mode == FanMode::FanIn ? fan_in : fan_out;
  EMBER_CHECK(fan > 0, "kaiming init: tensor ", shape_str(t.sizes()), " has zero fan");
  return calculate_gain(nl, a) / std::sqrt(static_cast<double>(fan));
}
}  // namespace

void kaiming_uniform_(const Tensor& t, double a, FanMode mode, const std::string& nl, Generator* gen) {
  double bound = std::sqrt(3.0) * kaiming_std(t, a, mode, nl);
  uniform_(t, -bound, bound, gen);
}

void kaiming_normal_(const Tensor& t, double a, FanMode mode, const std::string& nl, Generator* gen) {
  normal_(t, 0.0, kaiming_std(t, a, mode, nl), gen);
}

void xavier_uniform_(const Tensor& t, double gain, Generator* gen) {
  auto [fan_in, fan_out] = fans(t);
  double a = gain * std::sqrt(6.0 / static_cast<double>(fan_in + fan_out));
  uniform_(t, -a, a, gen);
}

}  // namespace ember::nn::init
