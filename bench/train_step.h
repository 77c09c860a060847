// The training step every training benchmark times, as the PyTorch peers
// write it: zero_grad, forward, cross-entropy, backward, optimizer step.
#pragma once

#include <optional>

#include "core/autocast.h"
#include "nn/functional.h"
#include "nn/module.h"
#include "optim/optimizer.h"

namespace ember::bench {

// Returns the loss; item() also waits for a GPU step to finish.
inline double train_step(nn::Module& net, optim::Optimizer& opt, const Tensor& x, const Tensor& y) {
  opt.zero_grad();
  Tensor loss = nn::functional::cross_entropy(net(x), y);
  loss.backward();
  opt.step();
  return loss.item();
}

// The same step with forward and loss under autocast to `amp` on `device`
// when amp is set (bfloat16 or float16), as the PyTorch peers write it.
inline double train_step_autocast(nn::Module& net, optim::Optimizer& opt, const Tensor& x, const Tensor& y,
                                  std::optional<DType> amp, DeviceType device = DeviceType::CUDA) {
  opt.zero_grad();
  Tensor loss;
  {
    std::optional<AutocastGuard> guard;
    if (amp) guard.emplace(device, *amp);
    loss = nn::functional::cross_entropy(net(x), y);
  }
  loss.backward();
  opt.step();
  return loss.item();
}

}  // namespace ember::bench
