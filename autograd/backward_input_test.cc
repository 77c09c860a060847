// The split backward of zero-bubble pipelines (backward_input, then the
// deferred weight gradients) against one ordinary backward of the same
// graph: the same gradients bit for bit, the weights' computed only at
// run(), hooks firing then, and a graph whose input needs no gradient
// deferring everything.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/checkpoint.h"
#include "core/ops.h"
#include "core/ops_nn.h"
#include "core/profiler.h"
#include "core/testing/bitwise.h"
#include "core/testing/error_of.h"

namespace ember {
namespace {
using testing::error_of;

using testing::expect_bitwise;

// A pre-norm MLP block twice, with a weight used by both (tied), a matmul
// with a weight on the right, a bias-free linear, and an optional
// checkpointed middle.
struct Net {
  Tensor w1, b1, w2, ln_w, ln_b, shared, right;
  explicit Net(uint64_t seed) {
    manual_seed(seed);
    w1 = (randn({32, 16}) * 0.2).requires_grad_();
    b1 = (randn({32}) * 0.1).requires_grad_();
    w2 = (randn({16, 32}) * 0.2).requires_grad_();
    ln_w = (1.0 + randn({16}) * 0.1).requires_grad_();
    ln_b = (randn({16}) * 0.1).requires_grad_();
    shared = (randn({16, 16}) * 0.2).requires_grad_();
    right = (randn({16, 16}) * 0.2).requires_grad_();
  }
  std::vector<Tensor> params() const { return {w1, b1, w2, ln_w, ln_b, shared, right}; }
  Tensor block(const Tensor& x) const {
    Tensor h = layer_norm(x, 1, ln_w, ln_b, 1e-5);
    h = gelu(linear(h, w1, b1));
    return x + linear(h, w2) + tanh(linear(x, shared));
  }
  Tensor forward(const Tensor& x, bool ckpt) const {
    Tensor y = block(x);
    y = ckpt ? autograd::checkpoint([this](const Tensor& in) { return block(in); }, y) : block(y);
    return sum(matmul(y, right) * y);
  }
};

TEST(BackwardInput, InputGradsNowWeightGradsAtRunBitForBit) {
  for (bool ckpt : {false, true}) {
    Net a(1), b(1);
    manual_seed(2);
    Tensor x = randn({8, 16});
    Tensor xa = x.clone().requires_grad_(), xb = x.clone().requires_grad_();
    a.forward(xa, ckpt).backward();

    autograd::DeferredBackward rest = autograd::backward_input(b.forward(xb, ckpt), Tensor(), {xb});
    expect_bitwise(xa.grad(), xb.grad(), "input");
    ASSERT_TRUE(rest.pending());
    // Without checkpointing every weight's op splits; a checkpointed
    // region computes its weights' gradients with its input's.
    EXPECT_EQ(rest.unsplit_ops() > 0, ckpt);
    if (!ckpt) {
      // Every weight's GEMM waited: nothing of a weight gradient exists yet.
      for (const Tensor& p : b.params()) EXPECT_FALSE(p.grad().defined()) << "ckpt " << ckpt;
    }
    rest.run();
    EXPECT_FALSE(rest.pending());
    for (size_t i = 0; i < a.params().size(); ++i)
      expect_bitwise(a.params()[i].grad(), b.params()[i].grad(), "param " + std::to_string(i));
    EXPECT_NE(error_of([&] { rest.run(); }).find("nothing left to run"), std::string::npos);
  }
}

TEST(BackwardInput, WeightGemmsRunAtRunNotBefore) {
  // The split must move work, not repeat it. Two linears: backward_input
  // runs the dx GEMMs of both (the first layer's is needed for the input)
  // and asks both again at run() for their dW (split_ops; an op ignoring
  // the mask would have computed them already: unsplit_ops), which run()
  // does in one deferred pass (one WeightGradsBackward profiler event).
  Net n(3);
  Tensor x = randn({4, 16}).requires_grad_();
  Tensor h = linear(gelu(linear(x, n.w1, n.b1)), n.w2);
  Tensor loss = sum(h * h);
  profiler::start();
  autograd::DeferredBackward rest = autograd::backward_input(loss, Tensor(), {x});
  EXPECT_EQ(rest.split_ops(), 2);
  EXPECT_EQ(rest.unsplit_ops(), 0);
  EXPECT_FALSE(n.w1.grad().defined());
  EXPECT_FALSE(n.w2.grad().defined());
  EXPECT_FALSE(n.b1.grad().defined());
  EXPECT_TRUE(x.grad().defined());
  rest.run();
  EXPECT_TRUE(n.w1.grad().defined() && n.w2.grad().defined() && n.b1.grad().defined());
  int weight_grads = 0;
  profiler::stop();
  for (const auto& e : profiler::events())
    if (e.name == "WeightGradsBackward") ++weight_grads;
  EXPECT_EQ(weight_grads, 1);
}

TEST(BackwardInput, HooksFireAtRunAndInputWithoutGradDefersEverything) {
  Net a(4), b(4);
  Tensor x = randn({8, 16});  // no grad: a first stage's token embeddings, say
  a.forward(x, false).backward();
  int fired = 0;
  autograd::register_post_accumulate_grad_hook(b.w1, [&](const Tensor&) { ++fired; });
  autograd::DeferredBackward rest = autograd::backward_input(b.forward(x, false), Tensor(), {x});
  EXPECT_EQ(fired, 0);
  for (const Tensor& p : b.params()) EXPECT_FALSE(p.grad().defined());
  rest.run();
  EXPECT_EQ(fired, 1);
  for (size_t i = 0; i < a.params().size(); ++i)
    expect_bitwise(a.params()[i].grad(), b.params()[i].grad(), "param " + std::to_string(i));
}

TEST(BackwardInput, NonLeafInputIsAnError) {
  Tensor x = randn({2, 2}).requires_grad_();
  Tensor y = x * 2.0;
  EXPECT_NE(error_of([&] { autograd::backward_input(sum(y * y), Tensor(), {y}); }).find("must be a leaf"),
            std::string::npos);
}

}  // namespace
}  // namespace ember
