// A whole training step (forward, cross-entropy, backward, optimizer)
// captured as one CUDA graph (core/cuda_graph.h) and replayed on new
// batches gives the eager steps' losses and parameters bit for bit: the
// same kernels with the same arguments on the graph's memory, the
// optimizers' state (SGD's momentum, AdamW's step count and moments) read
// and written on the device. A step that would make its state inside the
// capture is refused, naming the warm-up it needs. On a GPU (skips without
// one) and under the emulation's stream capture (cuda_graph_step_emu_test).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/allocator.h"
#include "core/autocast.h"
#include "core/cuda_graph.h"
#include "core/device.h"
#include "core/ops.h"
#include "core/ops_nn.h"
#include "core/testing/error_of.h"
#include "nn/models.h"
#include "optim/grad_scaler.h"
#include "optim/optimizer.h"

namespace ember::optim {
namespace {

struct Mlp {
  Tensor w1, b1, w2;
  std::vector<Tensor> params() const { return {w1, b1, w2}; }
};

Mlp make_mlp(uint64_t seed) {
  Generator g(seed);
  auto leaf = [&](const Shape& s) { return (randn(s, {DType::Float32}, &g) * 0.5).cuda().requires_grad_(); };
  return {leaf({16, 6}), leaf({16}), leaf({5, 16})};
}

Tensor loss_of(const Mlp& m, const Tensor& x, const Tensor& y) {
  Tensor logits = linear(gelu(linear(x, m.w1, m.b1)), m.w2, Tensor());
  return mean(cross_entropy_rows(logits, y, 0.1));
}

struct Batch {
  Tensor x, y;
};
std::vector<Batch> batches(int n) {
  Generator g(99);
  std::vector<Batch> out;
  for (int i = 0; i < n; ++i)
    out.push_back({randn({8, 6}, {DType::Float32}, &g).cuda(), randint(0, 5, {8}, DType::Int64, &g).cuda()});
  return out;
}

using MakeOpt = std::function<std::unique_ptr<Optimizer>(const Mlp&)>;

void check_graph_matches_eager(const MakeOpt& make_opt) {
  const std::vector<Batch> data = batches(6);
  Mlp eager = make_mlp(5), graphed = make_mlp(5);
  auto eager_opt = make_opt(eager), graph_opt = make_opt(graphed);
  std::vector<double> eager_losses;
  for (const Batch& b : data) {
    eager_opt->zero_grad();
    Tensor loss = loss_of(eager, b.x, b.y);
    loss.backward();
    eager_opt->step();
    eager_losses.push_back(loss.item());
  }
  // Warm-up: one eager step makes the optimizer's state.
  graph_opt->zero_grad();
  loss_of(graphed, data[0].x, data[0].y).backward();
  graph_opt->step();
  Tensor static_x = data[0].x.clone(), static_y = data[0].y.clone(), loss;
  CudaGraph graph(0);
  graph.capture([&] {
    graph_opt->zero_grad();
    loss = loss_of(graphed, static_x, static_y);
    loss.backward();
    graph_opt->step();
  });
  for (size_t i = 1; i < data.size(); ++i) {
    static_x.copy_(data[i].x);
    static_y.copy_(data[i].y);
    graph.replay();
    EXPECT_EQ(loss.item(), eager_losses[i]) << "step " << i;
  }
  for (size_t p = 0; p < eager.params().size(); ++p)
    EXPECT_EQ(graphed.params()[p].to_vector(), eager.params()[p].to_vector()) << "parameter " << p;
  EXPECT_NE(eager_losses.front(), eager_losses.back()) << "the steps trained nothing";
}

// Bit for bit needs deterministic algorithms: cuDNN's fastest weight
// gradients add with atomics (the emulated cuDNN's too, by design), which
// change the last bits between the eager and the replayed steps.
class CudaGraphStep : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_is_available()) GTEST_SKIP() << "no GPU: " << cuda_unavailable_reason();
    if (!cuda_allocator_caching(0))  // the AddressSanitizer run's exact-size allocations
      GTEST_SKIP() << "EMBER_NO_CUDA_MEMORY_CACHING is set: CUDA graphs need the caching allocator";
    set_deterministic_algorithms(true);
  }
  void TearDown() override { set_deterministic_algorithms(false); }
};

TEST_F(CudaGraphStep, SgdWithMomentumMatchesEagerBitForBit) {
  check_graph_matches_eager([](const Mlp& m) {
    return std::make_unique<SGD>(m.params(), SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-3});
  });
}

TEST_F(CudaGraphStep, AdamWMatchesEagerBitForBit) {
  check_graph_matches_eager(
      [](const Mlp& m) { return std::make_unique<AdamW>(m.params(), AdamWOptions{.lr = 0.01, .weight_decay = 0.01}); });
}

// More tensors than one launch's parameter table holds: eagerly the fused
// step copies its table from the host, which a graph could not replay, so
// under capture it launches once per table-full instead.
TEST_F(CudaGraphStep, StepsOverMoreTensorsThanOneLaunchTableMatchEager) {
  constexpr int kParams = 400;  // above the 384 entries of one launch
  std::vector<Tensor> a, b;
  Generator g(3);
  for (int i = 0; i < kParams; ++i) {
    Tensor v = randn({3}, {DType::Float32}, &g).cuda();
    a.push_back(v.clone().requires_grad_());
    b.push_back(v.clone().requires_grad_());
  }
  Tensor scale = Tensor::from_vector({0.5, -1.0, 2.0}, {3}, DType::Float32).cuda();
  auto loss_of = [&](const std::vector<Tensor>& ps) {
    Tensor total = sum(ps[0] * ps[0] * scale);
    for (int i = 1; i < kParams; ++i) total = total + sum(ps[i] * ps[i] * scale);
    return total;
  };
  AdamW eager(a, AdamWOptions{.lr = 0.05}), graphed(b, AdamWOptions{.lr = 0.05});
  for (int s = 0; s < 4; ++s) {
    eager.zero_grad();
    loss_of(a).backward();
    eager.step();
  }
  graphed.zero_grad();
  loss_of(b).backward();
  graphed.step();
  CudaGraph graph(0);
  graph.capture([&] {
    graphed.zero_grad();
    loss_of(b).backward();
    graphed.step();
  });
  for (int s = 1; s < 4; ++s) graph.replay();
  for (int i = 0; i < kParams; ++i) ASSERT_EQ(b[i].to_vector(), a[i].to_vector()) << "parameter " << i;
}

// Mixed precision in the graph: float16 autocast and the loss scaler with
// its checks on the device (step_async: the optimizer skips a step whose
// gradients hold an inf inside its kernels; update() backs the scale off or
// grows it in a kernel). A batch whose float16 activations overflow is
// skipped in the replay as in the eager steps, and the scale follows the
// same path (halved, then doubled after growth_interval clean steps).
TEST_F(CudaGraphStep, Float16WithTheLossScalerOnTheDeviceMatchesEager) {
  std::vector<Batch> data = batches(7);
  data[3].x = data[3].x * 1e6;  // float16 overflows: inf gradients, a skipped step
  for (bool adam : {false, true}) {
    Mlp eager = make_mlp(8), graphed = make_mlp(8);
    auto make = [&](const Mlp& m) -> std::unique_ptr<Optimizer> {
      if (adam) return std::make_unique<AdamW>(m.params(), AdamWOptions{.lr = 0.01});
      return std::make_unique<SGD>(m.params(), SGDOptions{.lr = 0.1, .momentum = 0.9});
    };
    auto eager_opt = make(eager), graph_opt = make(graphed);
    const GradScalerOptions so{.init_scale = 1024, .growth_interval = 2};
    GradScaler eager_scaler(so), graph_scaler(so);
    auto step = [](const Mlp& m, Optimizer& opt, GradScaler& scaler, const Tensor& x, const Tensor& y) {
      opt.zero_grad();
      Tensor loss;
      {
        AutocastGuard amp(DeviceType::CUDA, DType::Float16);
        loss = loss_of(m, x, y);
      }
      scaler.scale(loss).backward();
      scaler.step_async(opt);
      scaler.update();
      return loss;
    };
    std::vector<double> eager_losses, eager_scales;
    for (const Batch& b : data) {
      eager_losses.push_back(step(eager, *eager_opt, eager_scaler, b.x, b.y).item());
      eager_scales.push_back(eager_scaler.get_scale());
    }
    (void)step(graphed, *graph_opt, graph_scaler, data[0].x, data[0].y);  // warm-up
    Tensor static_x = data[0].x.clone(), static_y = data[0].y.clone(), loss;
    CudaGraph graph(0);
    graph.capture([&] { loss = step(graphed, *graph_opt, graph_scaler, static_x, static_y); });
    for (size_t i = 1; i < data.size(); ++i) {
      static_x.copy_(data[i].x);
      static_y.copy_(data[i].y);
      graph.replay();
      const double l = loss.item();
      EXPECT_TRUE(l == eager_losses[i] || (std::isnan(l) && std::isnan(eager_losses[i]))) << "step " << i;
      EXPECT_EQ(graph_scaler.get_scale(), eager_scales[i]) << "step " << i;
    }
    for (size_t p = 0; p < eager.params().size(); ++p)
      EXPECT_EQ(graphed.params()[p].to_vector(), eager.params()[p].to_vector()) << (adam ? "AdamW" : "SGD") << " " << p;
    EXPECT_EQ(eager_scales[3], eager_scales[2] / 2) << "the overflowing batch backs the scale off";
    EXPECT_GT(eager_scales.back(), eager_scales[3]) << "clean steps grow it again";
    // step() reads the flag on the host: refused inside a capture, naming step_async.
    CudaGraph refused(0);
    const std::string e = testing::error_of([&] {
      refused.capture([&] {
        graph_opt->zero_grad();
        graph_scaler.scale(loss_of(graphed, static_x, static_y)).backward();
        graph_scaler.step(*graph_opt);
      });
    });
    EXPECT_NE(e.find("GradScaler::step inside a CUDA graph capture"), std::string::npos) << e;
    EXPECT_NE(e.find("step_async()"), std::string::npos) << e;
  }
}

// A convolutional network's step: cuDNN's convolutions, batch norm in
// training (its running statistics updated on the device at each replay),
// pooling, channels-last; SGD with momentum. Parameters and buffers equal
// the eager run's bit for bit.
TEST_F(CudaGraphStep, ResNetStepWithBatchNormMatchesEager) {
  auto make = [] {
    manual_seed(4);
    auto net = nn::resnet18({.num_classes = 4,
                             .in_channels = 1,
                             .small_stem = true,
                             .width = 4,
                             .memory_format = MemoryFormat::ChannelsLast});
    net->to(cuda_device(0));
    net->train();
    return net;
  };
  auto eager = make(), graphed = make();
  SGD eager_opt(eager->parameters(), SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-4});
  SGD graph_opt(graphed->parameters(), SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-4});
  Generator g(21);
  std::vector<Batch> data;
  for (int i = 0; i < 4; ++i)
    data.push_back({randn({2, 1, 8, 8}, {DType::Float32}, &g).cuda(), randint(0, 4, {2}, DType::Int64, &g).cuda()});
  auto step = [](nn::Module& net, Optimizer& opt, const Tensor& x, const Tensor& y) {
    opt.zero_grad();
    Tensor loss = mean(cross_entropy_rows(net(x), y));
    loss.backward();
    opt.step();
    return loss;
  };
  std::vector<double> eager_losses;
  for (const Batch& b : data) eager_losses.push_back(step(*eager, eager_opt, b.x, b.y).item());
  (void)step(*graphed, graph_opt, data[0].x, data[0].y);
  Tensor static_x = data[0].x.clone(), static_y = data[0].y.clone(), loss;
  CudaGraph graph(0);
  graph.capture([&] { loss = step(*graphed, graph_opt, static_x, static_y); });
  for (size_t i = 1; i < data.size(); ++i) {
    static_x.copy_(data[i].x);
    static_y.copy_(data[i].y);
    graph.replay();
    EXPECT_EQ(loss.item(), eager_losses[i]) << "step " << i;
  }
  const auto pe = eager->named_parameters(), pg = graphed->named_parameters();
  for (size_t i = 0; i < pe.size(); ++i) EXPECT_EQ(pg[i].second.to_vector(), pe[i].second.to_vector()) << pe[i].first;
  const auto be = eager->named_buffers(), bg = graphed->named_buffers();
  for (size_t i = 0; i < be.size(); ++i) EXPECT_EQ(bg[i].second.to_vector(), be[i].second.to_vector()) << be[i].first;
}

TEST_F(CudaGraphStep, AStepThatMakesItsStateIsRefused) {
  const std::vector<Batch> data = batches(1);
  for (bool adam : {false, true}) {
    Mlp m = make_mlp(1);
    std::unique_ptr<Optimizer> opt;
    if (adam)
      opt = std::make_unique<AdamW>(m.params(), AdamWOptions{.lr = 0.01});
    else
      opt = std::make_unique<SGD>(m.params(), SGDOptions{.lr = 0.1, .momentum = 0.9});
    CudaGraph graph(0);
    const std::string e = testing::error_of([&] {
      graph.capture([&] {
        loss_of(m, data[0].x, data[0].y).backward();
        opt->step();
      });
    });
    EXPECT_NE(e.find(adam ? "AdamW.step making its state inside a CUDA graph capture"
                          : "SGD.step making its momentum buffers inside a CUDA graph capture"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("run one step before capture"), std::string::npos) << e;
    EXPECT_FALSE(graph.captured());
  }
}

}  // namespace
}  // namespace ember::optim
