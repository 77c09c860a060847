// The GPT recipe's step as one CUDA graph, FSDP included: gpt_step_on_device
// on a parallelize_gpt model (FSDP FULL_SHARD units of every block and the
// root, on a world of one: FSDP's hooks, its unsharded parameters and
// gradient views, its mixed precision casts all run inside the capture)
// through optim::GraphedStep, captured after three eager steps and
// replayed, gives the losses, gradient norms and parameters of the same
// steps run eagerly bit for bit: GPT-2 in float32 with two micro-batches,
// LLaMA with bf16 parameters under FSDP's policy, and float16 with the loss
// scaler skipping an overflowing step on the device; with dropout (drawn
// anew at every replay, as eagerly), also under full activation
// checkpointing (whose recompute redraws the forward's masks). What //examples:gpt
// --cuda-graph 1 runs, on a GPU (skips without one) and under the emulation
// (gpt_graph_emu_test), where nothing else can run the example's step.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/device.h"
#include "core/ops.h"
#include "distributed/init.h"
#include "distributed/parallel/recipes/gpt.h"
#include "distributed/testing/world_of_one.h"
#include "optim/graphed_step.h"
#include "optim/lr_scheduler.h"

namespace ember::distributed {
namespace {

constexpr int64_t kVocab = 40, kSeq = 8, kBatch = 2;

struct Trainer {
  std::shared_ptr<nn::GPT> gpt;
  Parallelized par;
  std::unique_ptr<optim::AdamW> opt;
  std::unique_ptr<optim::LinearLR> sched;
  std::unique_ptr<optim::GradScaler> scaler;
  std::unique_ptr<optim::GraphedStep> step;
  std::vector<double> losses, norms, scales;
};

struct Case {
  nn::Arch arch;
  std::string amp;  // off | bf16 | fp16
  int micro;
  double dropout = 0.0;     // embeddings, attention, residuals: drawn anew at every replay
  std::string ac = "none";  // activation checkpointing: the recompute redraws the forward's dropout
  bool float8 = false;      // the blocks' linears in float8: scales computed and read on the device
};

// In place: the step's function keeps pointers into `t`.
void make(Trainer& t, const Case& c, bool graphed) {
  manual_seed(5);
  nn::GPTOptions o{.vocab_size = kVocab, .block_size = kSeq, .n_layer = 2, .n_head = 2, .n_embd = 32};
  o.arch = c.arch;
  o.dropout = c.dropout;
  t.gpt = std::make_shared<nn::GPT>(o);
  t.gpt->to(Device(DeviceType::CUDA, 0));
  const ParallelDims dims = ParallelDims{}.resolved(1);
  GPTParallelOptions po;
  po.ac = c.ac;
  po.float8 = c.float8;
  if (c.amp != "off") {
    po.fsdp.mp_policy.param_dtype = c.amp == "bf16" ? DType::BFloat16 : DType::Float16;
    po.fsdp.mp_policy.reduce_dtype = DType::Float32;
    po.fsdp.mp_policy.output_dtype = DType::Float32;
  }
  t.par = parallelize_gpt(t.gpt, dims, dims.build_mesh(), po);
  t.opt = std::make_unique<optim::AdamW>(t.gpt->parameters(), optim::AdamWOptions{.lr = 3e-3, .weight_decay = 0.1});
  t.sched = std::make_unique<optim::LinearLR>(*t.opt, 0.2, 1.0, 5);
  // float16: a scale that overflows at first, so the scaler skips steps
  // and backs off on the device, replays included.
  t.scaler = std::make_unique<optim::GradScaler>(
      optim::GradScalerOptions{.init_scale = 16777216.0, .backoff_factor = 1.0 / 64, .enabled = c.amp == "fp16"});
  nn::GPT* gpt = t.gpt.get();
  Parallelized* par = &t.par;
  optim::AdamW* opt = t.opt.get();
  optim::GradScaler* scaler = t.scaler.get();
  t.step = std::make_unique<optim::GraphedStep>(
      [=](const std::vector<Tensor>& in) { return gpt_step_on_device(*gpt, *par, *opt, *scaler, in, 0.5); },
      optim::GraphedStepOptions{.device = 0, .warmup = 3, .optimizers = {t.opt.get()}, .enabled = graphed});
}

void train(Trainer& t, const Case& c, int steps) {
  for (int s = 0; s < steps; ++s) {
    Generator g(300 + s);
    std::vector<Tensor> in;
    for (int m = 0; m < c.micro; ++m) {
      in.push_back(randint(0, kVocab, {kBatch, kSeq}, DType::Int64, &g));
      in.push_back(randint(0, kVocab, {kBatch, kSeq}, DType::Int64, &g));
    }
    const std::vector<Tensor> out = (*t.step)(in);
    t.losses.push_back(out[0].cpu().item());
    t.norms.push_back(out[1].cpu().item());
    t.scales.push_back(t.scaler->get_scale());
    t.sched->step();
  }
}

class GptGraph : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!cuda_is_available()) GTEST_SKIP() << "no GPU: " << cuda_unavailable_reason();
    if (!cuda_allocator_caching(0)) GTEST_SKIP() << "EMBER_NO_CUDA_MEMORY_CACHING is set: graphs need the caching";
    testing::init_world_of_one();  // FSDP drops its one-rank groups
  }
  void TearDown() override {
    if (cuda_is_available() && cuda_allocator_caching(0)) destroy_process_group();
  }
};

TEST_P(GptGraph, ReplayedStepsEqualEagerStepsBitForBit) {
  const Case c = GetParam();
  constexpr int kSteps = 7;
  Trainer eager, graphed;
  make(eager, c, false);
  train(eager, c, kSteps);
  make(graphed, c, true);
  train(graphed, c, kSteps);
  ASSERT_TRUE(graphed.step->captured());
  EXPECT_EQ(graphed.step->captured_at(), 4);
  EXPECT_EQ(graphed.losses, eager.losses);
  // The same numbers, a NaN norm (a skipped step's) included.
  ASSERT_EQ(graphed.norms.size(), eager.norms.size());
  for (size_t i = 0; i < eager.norms.size(); ++i)
    EXPECT_TRUE(graphed.norms[i] == eager.norms[i] || (std::isnan(graphed.norms[i]) && std::isnan(eager.norms[i])))
        << "step " << i + 1 << ": " << graphed.norms[i] << " vs " << eager.norms[i];
  const auto pe = eager.gpt->named_parameters(), pg = graphed.gpt->named_parameters();
  ASSERT_EQ(pe.size(), pg.size());
  for (size_t i = 0; i < pe.size(); ++i)
    EXPECT_EQ(pg[i].second.cpu().to_vector(), pe[i].second.cpu().to_vector()) << pe[i].first;
  if (c.amp == "fp16") {
    // Overflowing steps skipped and the scale backed off, on the device:
    // the norms of those steps are not finite.
    EXPECT_FALSE(std::isfinite(eager.norms.front())) << "the first step overflows";
    EXPECT_TRUE(std::isfinite(eager.norms.back())) << "a later one does not";
    EXPECT_LT(eager.scales.back(), 16777216.0);
  } else if (c.dropout == 0) {  // (dropout's noise can outweigh 7 steps' progress)
    EXPECT_LT(eager.losses.back(), eager.losses.front()) << "it trained";
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, GptGraph,
                         ::testing::Values(Case{nn::Arch::GPT2, "off", 2}, Case{nn::Arch::Llama, "bf16", 1},
                                           Case{nn::Arch::GPT2, "fp16", 1}, Case{nn::Arch::GPT2, "bf16", 2, 0.2},
                                           Case{nn::Arch::GPT2, "off", 1, 0.2, "full"},
                                           Case{nn::Arch::Llama, "bf16", 2, 0.0, "none", true}),
                         [](const auto& info) {
                           const Case& c = info.param;
                           return std::string(nn::arch_name(c.arch)) + "_" + c.amp + (c.dropout > 0 ? "_dropout" : "") +
                                  (c.ac != "none" ? "_ac_" + c.ac : "") + (c.float8 ? "_float8" : "");
                         });

}  // namespace
}  // namespace ember::distributed
