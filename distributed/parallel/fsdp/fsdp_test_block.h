// The residual block FSDP's tests wrap as a unit (fsdp_test,
// fsdp_float8_test): LayerNorm, then two Linears around a tanh, with the
// input added back.
#pragma once

#include <memory>
#include <vector>

#include "core/ops.h"
#include "nn/layers.h"
#include "nn/module.h"

namespace ember::distributed::testing {

class Block : public nn::Module {
 public:
  Block(int d, int h) : nn::Module("Block") {
    ln = register_module("ln", std::make_shared<nn::LayerNorm>(std::vector<int64_t>{d}));
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(d, h));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(h, d));
  }
  Tensor forward(const Tensor& x) override { return x + (*fc2)(tanh((*fc1)((*ln)(x)))); }
  std::shared_ptr<nn::LayerNorm> ln;
  std::shared_ptr<nn::Linear> fc1, fc2;
};

}  // namespace ember::distributed::testing
