// Activation checkpointing (checkpoint.h) against the same computation
// without it: gradients equal bit for bit in float32 (same ops, same order),
// saved memory actually freed, torch's non-reentrant cases (several inputs
// and outputs, inputs without grad, outputs used twice or not at all,
// nesting, autograd::grad, retain_graph) and the errors for regions that
// would recompute differently.
#include "autograd/checkpoint.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/allocator.h"
#include "core/autocast.h"
#include "core/ops.h"
#include "core/profiler.h"
#include "core/testing/bitwise.h"
#include "core/testing/error_of.h"

namespace ember {
namespace {

using autograd::checkpoint;
using autograd::CheckpointOptions;

using testing::expect_bitwise;

// A region with matmuls, elementwise ops, a reduction and dropout.
struct Params {
  Tensor w1, w2, b;
  explicit Params(uint64_t seed) {
    manual_seed(seed);
    w1 = (randn({16, 32}) * 0.2).requires_grad_();
    w2 = (randn({32, 16}) * 0.2).requires_grad_();
    b = (randn({32}) * 0.1).requires_grad_();
  }
  std::vector<Tensor> grads() const { return {w1.grad(), w2.grad(), b.grad()}; }
};

Tensor block(const Params& p, const Tensor& x) {
  Tensor h = gelu(matmul(x, p.w1) + p.b);
  h = h * bernoulli(h.sizes(), 0.75) * (1.0 / 0.75);  // dropout: a mask from the default generator
  return x + tanh(matmul(h, p.w2)) * sigmoid(x);
}

// Runs `steps` blocks, checkpointing those `ckpt` says, and back-propagates.
std::vector<Tensor> run_chain(const Params& p, const Tensor& x0, int steps, bool ckpt,
                              const autograd::SavePolicy& save = nullptr) {
  manual_seed(7);
  Tensor x = x0;
  for (int i = 0; i < steps; ++i) {
    if (ckpt) {
      CheckpointOptions o;
      o.save = save;
      x = checkpoint([&p](const Tensor& in) { return block(p, in); }, x, o);
    } else {
      x = block(p, x);
    }
  }
  Tensor loss = sum(x * x);
  loss.backward();
  return p.grads();
}

TEST(Checkpoint, GradientsEqualWithoutCheckpointBitForBit) {
  for (const char* policy : {"full", "selective"}) {
    Params plain(1), ck(1);
    manual_seed(3);
    Tensor x = randn({8, 16});
    Tensor xa = x.clone().requires_grad_(), xb = x.clone().requires_grad_();
    auto ga = run_chain(plain, xa, 3, false);
    auto gb =
        run_chain(ck, xb, 3, true, std::string(policy) == "selective" ? autograd::save_compute_intensive() : nullptr);
    for (size_t i = 0; i < ga.size(); ++i)
      expect_bitwise(ga[i], gb[i], std::string(policy) + " param " + std::to_string(i));
    expect_bitwise(xa.grad(), xb.grad(), std::string(policy) + " input");
  }
}

TEST(Checkpoint, ForwardKeepsOnlyInputsAndRecomputeRunsOnce) {
  Params p(2);
  manual_seed(4);
  Tensor x = randn({256, 16}).requires_grad_();
  auto live_after_forward = [&](bool ck) {
    const size_t before = cpu_allocator()->stats().requested;
    Tensor y = ck ? checkpoint([&p](const Tensor& in) { return block(p, in); }, x) : block(p, x);
    return cpu_allocator()->stats().requested - before;
  };
  const size_t plain = live_after_forward(false), ck = live_after_forward(true);
  // Without: the [256, 32] intermediates (several) and the mask; with: the output only.
  const size_t out_bytes = 256 * 16 * 4;
  EXPECT_EQ(ck, out_bytes + 4) << "plain keeps " << plain;  // + the gradient token of the output node
  EXPECT_GT(plain, 5 * out_bytes);

  int runs = 0;
  Tensor y = checkpoint(
      [&](const Tensor& in) {
        ++runs;
        return block(p, in);
      },
      x);
  EXPECT_EQ(runs, 1);
  sum(y).backward();
  EXPECT_EQ(runs, 2);
}

TEST(Checkpoint, SelectiveKeepsMatmulsAndRecomputesTheRest) {
  Params p(5);
  manual_seed(6);
  Tensor x = randn({64, 16}).requires_grad_();
  auto count_matmuls_in_backward = [&](const autograd::SavePolicy& save) {
    CheckpointOptions o;
    o.save = save;
    Tensor y = checkpoint([&p](const Tensor& in) { return block(p, in); }, x, o);
    profiler::start();
    sum(y).backward();
    profiler::stop();
    int n = 0;
    for (const auto& e : profiler::events())
      if (e.kind == profiler::Kind::Op && e.name == "matmul") ++n;
    return n;
  };
  // Backward's own matmuls (2 per matmul) plus the recompute's forward ones.
  const int full = count_matmuls_in_backward(nullptr);
  const int selective = count_matmuls_in_backward(autograd::save_compute_intensive());
  EXPECT_EQ(full - selective, 2);
  // A policy naming an op that is not keepable keeps nothing.
  const int layer = count_matmuls_in_backward([](const std::string& op) { return op == "gelu"; });
  EXPECT_EQ(layer, full);
}

TEST(Checkpoint, SeveralInputsAndOutputsUsedTwiceOrNot) {
  auto run = [](bool ck, std::vector<Tensor>* grads) {
    manual_seed(11);
    Tensor a = randn({4, 5}).requires_grad_(), b = randn({5, 3}).requires_grad_();
    Tensor c = randn({4, 3});  // no grad
    Tensor w = randn({3, 3}).requires_grad_();
    autograd::RegionFn fn = [&](const std::vector<Tensor>& in) {
      Tensor m = matmul(in[0], in[1]);
      Tensor u = relu(m + in[2]);
      Tensor v = matmul(u, w);
      Tensor unused = exp(m);
      return std::vector<Tensor>{u, v, unused, in[2] * 2.0};
    };
    std::vector<Tensor> out = ck ? checkpoint(fn, {a, b, c}) : fn({a, b, c});
    EXPECT_TRUE(out[0].requires_grad());
    EXPECT_FALSE(out[3].requires_grad());
    Tensor loss = sum(out[0] * out[1]) + sum(out[1]) + mean(out[0]);
    loss.backward();
    *grads = {a.grad(), b.grad(), w.grad()};
  };
  std::vector<Tensor> ga, gb;
  run(false, &ga);
  run(true, &gb);
  for (size_t i = 0; i < ga.size(); ++i) expect_bitwise(ga[i], gb[i], "grad " + std::to_string(i));
}

TEST(Checkpoint, InputsWithoutGradStillReachParameters) {
  manual_seed(12);
  Tensor w = randn({6, 6}).requires_grad_();
  Tensor x = randn({2, 6});
  Tensor y = checkpoint([&](const Tensor& in) { return tanh(matmul(in, w)); }, x);
  ASSERT_TRUE(y.requires_grad());
  sum(y).backward();
  Tensor ref_w = w.detach().clone().requires_grad_();
  sum(tanh(matmul(x, ref_w))).backward();
  expect_bitwise(w.grad(), ref_w.grad(), "w");
  // Nothing requires grad: a plain run, nothing recorded.
  Tensor z = checkpoint([](const Tensor& in) { return in * 2.0; }, x);
  EXPECT_FALSE(z.requires_grad());
}

TEST(Checkpoint, NestedRegionsAutogradGradAndRetainGraph) {
  Params p(13);
  manual_seed(14);
  Tensor x = randn({8, 16}).requires_grad_();
  auto inner = [&p](const Tensor& in) { return block(p, in); };
  manual_seed(15);
  Tensor plain = block(p, block(p, x));
  auto ref = autograd::grad(sum(plain * plain), {x, p.w1});
  manual_seed(15);
  Tensor nested = checkpoint([&](const Tensor& in) { return block(p, checkpoint(inner, in)); }, x);
  Tensor loss = sum(nested * nested);
  auto got = autograd::grad(loss, {x, p.w1}, Tensor(), /*retain_graph=*/true);
  expect_bitwise(ref[0], got[0], "x");
  expect_bitwise(ref[1], got[1], "w1");
  EXPECT_FALSE(p.w1.grad().defined());  // autograd::grad leaves .grad alone
  auto again = autograd::grad(loss, {x});
  expect_bitwise(ref[0], again[0], "x, second backward");
}

TEST(Checkpoint, AutocastStateIsRecomputed) {
  Params plain(16), ck(16);
  manual_seed(17);
  Tensor x = randn({8, 16});
  auto run = [&](Params& p, bool c) {
    Tensor xi = x.clone().requires_grad_();
    Tensor y;
    {
      AutocastGuard amp(DeviceType::CPU, DType::BFloat16);
      manual_seed(18);
      y = c ? checkpoint([&p](const Tensor& in) { return block(p, in); }, xi) : block(p, xi);
    }
    sum(y.to(DType::Float32)).backward();
    return xi.grad();
  };
  Tensor ga = run(plain, false), gb = run(ck, true);
  expect_bitwise(ga, gb, "input");
  for (size_t i = 0; i < 3; ++i) expect_bitwise(plain.grads()[i], ck.grads()[i], "param " + std::to_string(i));
}

TEST(Checkpoint, ErrorsForRegionsThatWouldRecomputeDifferently) {
  manual_seed(19);
  Tensor w = randn({4, 4}).requires_grad_();
  // An input changed in place after the forward.
  {
    Tensor x = randn({2, 4});
    Tensor y = checkpoint([&](const Tensor& in) { return matmul(in, w); }, x);
    x += ones({2, 4});
    std::string msg = testing::error_of([&] { sum(y).backward(); });
    EXPECT_NE(msg.find("input 0 [2,4] was changed in place after the forward (by '"), std::string::npos) << msg;
  }
  // A region whose ops depend on state that changed.
  {
    int calls = 0;
    Tensor x = randn({2, 4});
    Tensor y = checkpoint(
        [&](const Tensor& in) {
          Tensor h = matmul(in, w);
          return ++calls == 1 ? h : relu(h);
        },
        x, CheckpointOptions{"my_region", nullptr, true, {}});
    std::string msg = testing::error_of([&] { sum(y).backward(); });
    EXPECT_NE(msg.find("my_region: the recompute recorded 4 autograd ops, the forward 3"), std::string::npos) << msg;
  }
  // A watched tensor the recompute changes again (a counter updated in forward).
  {
    Tensor counter = zeros({});
    CheckpointOptions o{"counting", nullptr, true, {}};
    o.watch = {{"counter", counter}};
    Tensor x = randn({2, 4});
    Tensor y = checkpoint(
        [&](const Tensor& in) {
          {
            NoGradGuard ng;
            counter += ones({});
          }
          return matmul(in, w) * 2.0;
        },
        x, o);
    std::string msg = testing::error_of([&] { sum(y).backward(); });
    EXPECT_NE(msg.find("counting: the recompute changed 'counter' (by '"), std::string::npos) << msg;
    EXPECT_NE(msg.find("which the forward already changed"), std::string::npos) << msg;
  }
  // A parameter changed between forward and backward (read by the forward's matmul).
  {
    Tensor x = randn({2, 4}).requires_grad_();
    Tensor y = checkpoint([&](const Tensor& in) { return matmul(in, w); }, x);
    {
      NoGradGuard ng;
      w *= 0.5;
    }
    std::string msg = testing::error_of([&] { sum(y).backward(); });
    EXPECT_NE(msg.find("a tensor the region read in its forward was changed before its recompute"), std::string::npos)
        << msg;
  }
  // The same under autocast, where the op saved the parameter's bfloat16
  // cast, not the parameter (Note [caches]): the parameter itself is checked.
  {
    Tensor x = randn({2, 4}).requires_grad_();
    Tensor y;
    {
      AutocastGuard amp(DeviceType::CPU, DType::BFloat16);
      y = checkpoint([&](const Tensor& in) { return matmul(in, w); }, x);
    }
    {
      NoGradGuard ng;
      w *= 0.5;
    }
    std::string msg = testing::error_of([&] { sum(y).backward(); });
    EXPECT_NE(msg.find("a parameter [4,4] the region read in its forward was changed before its recompute"),
              std::string::npos)
        << msg;
  }
  // A parameter given new storage between forward and backward (set_data:
  // the old storage freed, the new one perhaps at its address).
  {
    Tensor x = randn({2, 4}).requires_grad_();
    Tensor y = checkpoint([&](const Tensor& in) { return matmul(in, w); }, x);
    w.set_data(randn({4, 4}));
    std::string msg = testing::error_of([&] { sum(y).backward(); });
    EXPECT_NE(msg.find("a parameter [4,4] the region read in its forward was given other storage"), std::string::npos)
        << msg;
  }
}

}  // namespace
}  // namespace ember
