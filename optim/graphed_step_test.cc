// GraphedStep (optim/graphed_step.h) and clip_grad_norm_async_: a LLaMA
// block's training step (and a GPT-2 block's with dropout, whose masks are
// drawn anew at every replay) under bf16 autocast, two micro-batches accumulated,
// the gradients clipped on the device and AdamW stepped on a warm-up then
// cosine schedule, captured once and replayed, gives the same losses,
// gradient norms and parameters bit for bit as the same step run eagerly
// (GraphedStepOptions::enabled = false), while the schedule moves the
// learning rate under the replays; inputs of other shapes, and a step that
// waits for the GPU, are refused by name. clip_grad_norm_async_ clips as
// clip_grad_norm_ does (every norm type, under and over the limit, NaN) on
// the CPU and on the device. On a GPU (skips without one) and under the
// emulation (graphed_step_emu_test).
#include "optim/graphed_step.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/allocator.h"
#include "core/autocast.h"
#include "core/device.h"
#include "core/ops.h"
#include "core/testing/error_of.h"
#include "nn/functional.h"
#include "nn/transformer.h"
#include "optim/clip_grad.h"
#include "optim/lr_scheduler.h"
#include "optim/optimizer.h"

namespace ember::optim {
namespace {

using testing::error_of;

bool have_gpu(std::string* why) {
  if (!cuda_is_available()) {
    *why = "no GPU: " + cuda_unavailable_reason();
    return false;
  }
  if (!cuda_allocator_caching(0)) {
    *why = "EMBER_NO_CUDA_MEMORY_CACHING is set: CUDA graphs need the caching allocator";
    return false;
  }
  return true;
}

// ---- clip_grad_norm_async_ against clip_grad_norm_ ----

std::vector<Tensor> params_with_grads(Device device, double scale, bool nan) {
  Generator g(7);
  std::vector<Tensor> ps;
  for (const Shape& s : std::vector<Shape>{{5, 3}, {40000}, {7}, {2, 2, 2}}) {
    Tensor p = randn(s, {DType::Float32}, &g).to(device).requires_grad_();
    Tensor grad = (randn(s, {DType::Float32}, &g) * scale).to(device);
    p.set_grad(grad);
    ps.push_back(p);
  }
  Tensor h = randn({6}, {DType::Float32}, &g).to(DType::BFloat16).to(device).requires_grad_();  // one 16-bit gradient
  h.set_grad((randn({6}, {DType::Float32}, &g) * scale).to(DType::BFloat16).to(device));
  ps.push_back(h);
  if (nan) {
    Tensor g0 = ps[2].grad().cpu();
    g0.data<float>()[3] = std::numeric_limits<float>::quiet_NaN();
    ps[2].set_grad(g0.to(device));
  }
  return ps;
}

void check_async_matches(Device device) {
  for (double norm_type : {2.0, 1.0, 3.0, std::numeric_limits<double>::infinity()})
    for (double scale : {1e-3, 1.0, 10.0})
      for (bool nan : {false, true}) {
        const std::string what = device.str() + " norm_type " + std::to_string(norm_type) + " scale " +
                                 std::to_string(scale) + (nan ? " with a NaN" : "");
        std::vector<Tensor> a = params_with_grads(device, scale, nan), b = params_with_grads(device, scale, nan);
        const double want = clip_grad_norm_(a, 1.0, norm_type);
        const Tensor got = clip_grad_norm_async_(b, 1.0, norm_type);
        ASSERT_EQ(got.device(), device) << what;
        ASSERT_EQ(got.dtype(), DType::Float64) << what;
        ASSERT_EQ(got.dim(), 0) << what;
        const double g = got.cpu().item();
        if (nan) {
          EXPECT_TRUE(std::isnan(g)) << what;
        } else {
          EXPECT_NEAR(g, want, 1e-12 * want) << what;
        }
        for (size_t i = 0; i < a.size(); ++i) {
          const std::vector<double> ga = a[i].grad().cpu().to_vector(), gb = b[i].grad().cpu().to_vector();
          ASSERT_EQ(ga.size(), gb.size());
          for (size_t k = 0; k < ga.size(); ++k) {
            if (nan) {
              ASSERT_TRUE(std::isnan(gb[k])) << what << ": parameter " << i << " element " << k;
            } else {
              // The coefficient from a norm summed in another order: a few
              // ulps of float32 at most.
              ASSERT_NEAR(gb[k], ga[k], 4e-7 * std::abs(ga[k]) + 1e-30) << what << ": parameter " << i;
            }
          }
        }
        if (!nan && scale == 1e-3)  // under the limit: untouched, bit for bit
          for (size_t i = 0; i < a.size(); ++i)
            ASSERT_EQ(b[i].grad().cpu().to_vector(), a[i].grad().cpu().to_vector()) << what;
      }
}

TEST(ClipGradNormAsync, MatchesClipGradNormOnTheCpu) { check_async_matches(kCPU); }

TEST(ClipGradNormAsync, MatchesClipGradNormOnTheDevice) {
  if (!cuda_is_available()) GTEST_SKIP() << "no GPU: " << cuda_unavailable_reason();
  check_async_matches(Device(DeviceType::CUDA, 0));
}

TEST(ClipGradNormAsync, NamesGradientsOnTwoDevices) {
  if (!cuda_is_available()) GTEST_SKIP() << "no GPU: " << cuda_unavailable_reason();
  Tensor a = ones({2}).requires_grad_(), b = ones({2}).cuda().requires_grad_();
  a.set_grad(ones({2}));
  b.set_grad(ones({2}).cuda());
  const std::string e = error_of([&] { clip_grad_norm_async_({a, b}, 1.0); });
  EXPECT_NE(e.find("clip_grad_norm_async_: parameter 1's gradient is on cuda:0, parameter 0's on cpu"),
            std::string::npos)
      << e;
}

// ---- A LLaMA step, graphed and eager ----

struct Trainer {
  std::shared_ptr<nn::GPT> model;
  std::unique_ptr<AdamW> opt;
  std::unique_ptr<SequentialLR> sched;
  std::unique_ptr<GraphedStep> step;
  std::vector<double> losses, norms, lrs;
};

constexpr int64_t kVocab = 40, kSeq = 8, kBatch = 2, kMicro = 2;

// LLaMA, or GPT-2 with dropout (embeddings, attention, MLP): the masks are
// drawn anew at every replay, as the eager steps draw them.
Trainer make_run(bool graphed, bool gpt2_dropout = false) {
  Trainer r;
  manual_seed(11);
  nn::GPTOptions o{.vocab_size = kVocab, .block_size = kSeq, .n_layer = 1, .n_head = 2, .n_embd = 32};
  if (gpt2_dropout) {
    o.dropout = 0.2;
  } else {
    o.arch = nn::Arch::Llama;
    o.n_kv_head = 1;
  }
  r.model = std::make_shared<nn::GPT>(o);
  r.model->to(Device(DeviceType::CUDA, 0));
  r.opt = std::make_unique<AdamW>(r.model->parameters(), AdamWOptions{.lr = 3e-3, .weight_decay = 0.1});
  auto warm = std::make_shared<LinearLR>(*r.opt, 0.1, 1.0, 3);
  auto cosine = std::make_shared<CosineAnnealingLR>(*r.opt, 4, 3e-4);
  r.sched = std::make_unique<SequentialLR>(*r.opt, std::vector<std::shared_ptr<LRScheduler>>{warm, cosine},
                                           std::vector<int64_t>{3});
  nn::GPT* model = r.model.get();
  AdamW* opt = r.opt.get();
  // inputs: x0, y0, x1, y1 (the micro-batches).
  auto fn = [model, opt](const std::vector<Tensor>& in) {
    opt->zero_grad();
    Tensor loss_sum;
    for (int m = 0; m < kMicro; ++m) {
      Tensor loss;
      {
        AutocastGuard cast(DeviceType::CUDA, DType::BFloat16);
        Tensor logits = (*model)(in[2 * m]);
        loss = nn::functional::cross_entropy(logits.reshape({-1, kVocab}), in[2 * m + 1].reshape({-1}));
      }
      (loss * (1.0 / kMicro)).backward();
      loss_sum = loss_sum.defined() ? loss_sum + loss.detach() : loss.detach();
    }
    Tensor norm = clip_grad_norm_async_(model->parameters(), 0.5);
    opt->step();
    return std::vector<Tensor>{loss_sum, norm};
  };
  r.step = std::make_unique<GraphedStep>(
      fn, GraphedStepOptions{.device = 0, .warmup = 2, .optimizers = {r.opt.get()}, .enabled = graphed});
  return r;
}

std::vector<Tensor> batch(int step) {
  Generator g(100 + step);
  std::vector<Tensor> in;
  for (int m = 0; m < kMicro; ++m) {
    in.push_back(randint(0, kVocab, {kBatch, kSeq}, DType::Int64, &g));  // on the host: GraphedStep copies
    in.push_back(randint(0, kVocab, {kBatch, kSeq}, DType::Int64, &g));
  }
  return in;
}

void train(Trainer& r, int steps) {
  manual_seed(12);  // both runs draw their dropout masks from one state
  for (int s = 0; s < steps; ++s) {
    r.lrs.push_back(r.opt->param_groups()[0].lr_tensor.cpu().item());
    const std::vector<Tensor> out = (*r.step)(batch(s));
    r.losses.push_back(out[0].cpu().item());
    r.norms.push_back(out[1].cpu().item());
    r.sched->step();
  }
}

class GraphedStepTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!have_gpu(&why)) GTEST_SKIP() << why;
  }
};

class GraphedStepModels : public GraphedStepTest, public ::testing::WithParamInterface<bool> {};

TEST_P(GraphedStepModels, StepReplayedEqualsEagerBitForBit) {
  constexpr int kSteps = 7;
  Trainer eager = make_run(false, GetParam()), graphed = make_run(true, GetParam());
  train(eager, kSteps);
  train(graphed, kSteps);
  EXPECT_FALSE(eager.step->captured());
  ASSERT_TRUE(graphed.step->captured());
  EXPECT_EQ(graphed.step->captured_at(), 3) << "two warm-up steps, then the capture";
  EXPECT_EQ(graphed.losses, eager.losses);
  EXPECT_EQ(graphed.norms, eager.norms);
  EXPECT_EQ(graphed.lrs, eager.lrs);
  const auto pe = eager.model->named_parameters(), pg = graphed.model->named_parameters();
  ASSERT_EQ(pe.size(), pg.size());
  for (size_t i = 0; i < pe.size(); ++i)
    EXPECT_EQ(pg[i].second.cpu().to_vector(), pe[i].second.cpu().to_vector()) << pe[i].first;
  // It trained, the schedule moved the rate under the replays, and the clip
  // acted (norms above 0.5 at first).
  if (!GetParam()) EXPECT_LT(eager.losses.back(), eager.losses.front());  // (dropout's noise can outweigh it)
  EXPECT_NE(eager.lrs[3], eager.lrs[5]);
  EXPECT_GT(eager.norms.front(), 0.5);
}

INSTANTIATE_TEST_SUITE_P(Models, GraphedStepModels, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "gpt2_dropout" : "llama"; });

TEST_F(GraphedStepTest, OtherShapesAfterTheCaptureAreRefusedByName) {
  Trainer r = make_run(true);
  train(r, 3);
  ASSERT_TRUE(r.step->captured());
  std::vector<Tensor> in = batch(3);
  in[2] = zeros({kBatch, kSeq + 1}, {DType::Int64});
  const std::string e = error_of([&] { (*r.step)(in); });
  EXPECT_NE(e.find("GraphedStep: input 2 is int64 [2,9]; the captured step's was int64 [2,8]"), std::string::npos) << e;
  EXPECT_NE(error_of([&] { (*r.step)({in[0]}); }).find("1 inputs; the captured step took 4"), std::string::npos);
}

TEST_F(GraphedStepTest, AStepThatWaitsForTheGpuIsRefusedAtTheCapture) {
  Tensor w = ones({4}).cuda().requires_grad_();
  SGD opt({w}, SGDOptions{.lr = 0.1});
  GraphedStep step(
      [&](const std::vector<Tensor>& in) {
        opt.zero_grad();
        Tensor loss = sum(w * in[0]);
        loss.backward();
        const double l = loss.item();  // a host sync: no graph can hold it
        opt.step();
        return std::vector<Tensor>{full({}, l)};
      },
      {.warmup = 1, .optimizers = {&opt}});
  step({ones({4})});
  const std::string e = error_of([&] { step({ones({4})}); });
  EXPECT_NE(e.find("item()"), std::string::npos) << e;
  EXPECT_FALSE(step.captured());
}

// A Dropout drawing from a stream of its own (tensor parallelism's shards)
// makes a generator per call from a host offset: refused inside a capture
// by name rather than kept as a pointer the replays would read.
TEST_F(GraphedStepTest, ADropoutWithAStreamOfItsOwnIsRefusedInACapture) {
  nn::Dropout drop(0.5);
  drop.stream = 1;
  const Tensor x = ones({8}).cuda();
  (void)drop(x);  // eagerly: fine
  CudaGraph g(0);
  const std::string e = error_of([&] { g.capture([&] { (void)drop(x); }); });
  EXPECT_NE(e.find("Dropout with a stream of its own (tensor parallelism's shards) inside a CUDA graph capture"),
            std::string::npos)
      << e;
  EXPECT_FALSE(g.captured());
}

}  // namespace
}  // namespace ember::optim
