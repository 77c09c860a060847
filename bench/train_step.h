// The training step every training benchmark times, as the PyTorch peers
// write it: zero_grad, forward, cross-entropy, backward, optimizer step.
#pragma once

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

}  // namespace ember::bench
