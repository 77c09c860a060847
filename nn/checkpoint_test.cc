// Module-level activation checkpointing (checkpoint.h): every policy's
// gradients equal the unwrapped model's bit for bit in float32 (the GPT with
// dropout, ResNet with BatchNorm), BatchNorm's running statistics updated
// once, train/eval modes of the first run recomputed, the policy parser, and
// a buffer the recompute would change again named in the error.
#include "nn/checkpoint.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/testing/bitwise.h"
#include "core/testing/error_of.h"
#include "nn/functional.h"
#include "nn/models.h"
#include "nn/transformer.h"

namespace ember::nn {
namespace {

using testing::expect_bitwise;

std::shared_ptr<GPT> make_gpt() {
  manual_seed(1);
  GPTOptions o;
  o.vocab_size = 64;
  o.block_size = 16;
  o.n_layer = 4;
  o.n_head = 2;
  o.n_embd = 32;
  o.dropout = 0.1;
  return std::make_shared<GPT>(o);
}

// One step's loss and gradients (by name) under `policy`.
std::pair<double, std::vector<std::pair<std::string, Tensor>>> gpt_step(const std::string& policy) {
  auto gpt = make_gpt();
  EXPECT_EQ(apply_activation_checkpointing(gpt->h->named_children(), ActivationCheckpointing::parse(policy)),
            policy == "none"      ? 0
            : policy == "every:2" ? 2
                                  : 4);
  manual_seed(2);
  Tensor tokens = randint(0, 64, {3, 16});
  Tensor targets = randint(0, 64, {3, 16});
  manual_seed(3);
  Tensor loss = functional::cross_entropy((*gpt)(tokens).view({-1, 64}), targets.view({-1}));
  loss.backward();
  std::vector<std::pair<std::string, Tensor>> grads;
  for (auto& [n, p] : gpt->named_parameters()) grads.emplace_back(n, p.grad());
  return {loss.item(), grads};
}

TEST(CheckpointWrapper, GptGradientsEqualForEveryPolicy) {
  auto [ref_loss, ref] = gpt_step("none");
  for (const std::string policy : {"full", "selective", "every:2"}) {
    auto [loss, got] = gpt_step(policy);
    EXPECT_EQ(loss, ref_loss) << policy;
    ASSERT_EQ(got.size(), ref.size());
    for (size_t i = 0; i < ref.size(); ++i) {
      ASSERT_EQ(got[i].first, ref[i].first);  // names unchanged by the wrap
      expect_bitwise(ref[i].second, got[i].second, policy + " " + ref[i].first);
    }
  }
}

TEST(CheckpointWrapper, ResNetBatchNormUpdatesRunningStatisticsOnce) {
  auto run = [](bool ck) {
    manual_seed(4);
    auto net = resnet18({.num_classes = 5, .in_channels = 1, .small_stem = true, .width = 8});
    if (ck) {
      std::vector<std::pair<std::string, std::shared_ptr<Module>>> blocks;
      for (auto* layer : {&net->layer1, &net->layer2, &net->layer3, &net->layer4})
        for (auto& c : (*layer)->named_children()) blocks.push_back(c);
      EXPECT_EQ(apply_activation_checkpointing(blocks, ActivationCheckpointing::parse("full")), 8);
    }
    manual_seed(5);
    Tensor x = randn({4, 1, 12, 12});
    Tensor y = Tensor::from_vector(std::vector<double>{0, 1, 2, 3}, {4}, DType::Int64);
    functional::cross_entropy((*net)(x), y).backward();
    return net;
  };
  auto plain = run(false), ck = run(true);
  auto ps = plain->state_dict(), cs = ck->state_dict();
  for (const auto& [name, t] : ps.items()) {
    const Tensor* other = cs.find(name);
    ASSERT_NE(other, nullptr) << name;
    expect_bitwise(t, *other, "state " + name);
  }
  EXPECT_EQ(cs.find("layer1.0.bn1.num_batches_tracked")->to_vector()[0], 1.0);
  auto pp = plain->named_parameters(), cp = ck->named_parameters();
  for (size_t i = 0; i < pp.size(); ++i) expect_bitwise(pp[i].second.grad(), cp[i].second.grad(), pp[i].first);
}

// Dropout's mode in the recompute is the first run's, even if the model's
// mode changed between forward and backward.
TEST(CheckpointWrapper, RecomputeUsesTheFirstRunsMode) {
  auto plain = make_gpt(), ck = make_gpt();
  apply_activation_checkpointing(ck->h->named_children(), ActivationCheckpointing::parse("full"));
  manual_seed(6);
  Tensor tokens = randint(0, 64, {2, 16});
  auto grads = [&](GPT& g) {
    manual_seed(7);
    Tensor loss = sum((*g.h)((*g.wte)(tokens)));
    g.eval();  // after the forward: the recompute must still drop as in training
    loss.backward();
    g.train();
    return g.h->named_parameters();
  };
  auto a = grads(*plain), b = grads(*ck);
  for (size_t i = 0; i < a.size(); ++i) expect_bitwise(a[i].second.grad(), b[i].second.grad(), a[i].first);
}

struct Counting : Module {
  Tensor w, count;
  Counting() : Module("Counting") {
    w = register_parameter("w", ones({3}));
    count = register_buffer("count", zeros({}));
  }
  Tensor forward(const Tensor& x) override {
    {
      NoGradGuard ng;
      count += ones({});
    }
    return x * w;
  }
};

TEST(CheckpointWrapper, ABufferTheRecomputeChangesAgainIsNamed) {
  auto m = std::make_shared<Counting>();
  checkpoint_wrapper(*m, nullptr, "blocks.0");
  EXPECT_TRUE(is_checkpointed(*m));
  Tensor y = (*m)(ones({2, 3}));
  std::string msg = testing::error_of([&] { sum(y).backward(); });
  EXPECT_NE(msg.find("checkpoint_wrapper(blocks.0): the recompute changed 'count'"), std::string::npos) << msg;
  remove_checkpoint_wrapper(*m);
  EXPECT_FALSE(is_checkpointed(*m));
  sum((*m)(ones({2, 3}))).backward();  // unwrapped: fine
}

TEST(CheckpointWrapper, PolicyParsing) {
  EXPECT_EQ(ActivationCheckpointing::parse("every:3").every, 3);
  EXPECT_EQ(ActivationCheckpointing::parse("every:3").str(), "every:3");
  EXPECT_EQ(ActivationCheckpointing::parse("selective").str(), "selective");
  for (const char* bad : {"every:0", "every:", "every:x", "some"}) {
    std::string msg = testing::error_of([&] { ActivationCheckpointing::parse(bad); });
    EXPECT_NE(msg.find(std::string("'") + bad + "'"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace ember::nn
