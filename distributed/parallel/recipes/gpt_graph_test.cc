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
// checkpointing (whose recompute redraws the forward's masks). Also 2
// ranks over NCCL (FSDP FULL_SHARD across them: the units' all-gathers and
// reduce-scatters, the gradient norm's allreduce inside the graph), each on
// its own batches, its replayed steps equal to its eager ones. What
// //examples:gpt --cuda-graph 1 runs, on a GPU (skips without one; the 2
// ranks without 2 GPUs) and under the emulation (gpt_graph_emu_test, with the
// emulated NCCL), where nothing else can run the example's step.
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
#include "distributed/testing/multiprocess.h"
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

// In place: the step's function keeps pointers into `t`. `world`: FSDP
// shards over that many ranks (the default group's).
void make(Trainer& t, const Case& c, bool graphed, int world = 1) {
  manual_seed(5);
  nn::GPTOptions o{.vocab_size = kVocab, .block_size = kSeq, .n_layer = 2, .n_head = 2, .n_embd = 32};
  o.arch = c.arch;
  o.dropout = c.dropout;
  t.gpt = std::make_shared<nn::GPT>(o);
  t.gpt->to(Device(DeviceType::CUDA, 0));
  const ParallelDims dims = ParallelDims{}.resolved(world);
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

// `rank`'s batches differ from every other rank's.
void train(Trainer& t, const Case& c, int steps, int rank = 0) {
  for (int s = 0; s < steps; ++s) {
    Generator g(300 + s + 1000 * rank);
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

// 2 ranks over NCCL; the arg picks the case: "gpt2_off" (two micro-batches)
// or "llama_bf16".
EMBER_WORKER(gpt_graph_ranks) {
  testing::init_world(env, Millis{0}, "nccl");
  const Case c = env.arg == "llama_bf16" ? Case{nn::Arch::Llama, "bf16", 1} : Case{nn::Arch::GPT2, "off", 2};
  constexpr int kSteps = 6;
  Trainer eager, graphed;
  make(eager, c, false, env.world_size);
  train(eager, c, kSteps, env.rank);
  make(graphed, c, true, env.world_size);
  train(graphed, c, kSteps, env.rank);
  WCHECK(graphed.step->captured() && graphed.step->captured_at() == 4, "captured at step 4, not ",
         graphed.step->captured_at());
  WCHECK(graphed.losses == eager.losses, "rank ", env.rank, ": the replayed losses differ");
  WCHECK(graphed.norms == eager.norms, "rank ", env.rank, ": the replayed gradient norms differ");
  // Each rank holds its shards: equal to the eager run's, which needed every
  // rank's gradients (the reduce-scatters) and parameters (the all-gathers).
  const auto pe = eager.gpt->named_parameters(), pg = graphed.gpt->named_parameters();
  for (size_t i = 0; i < pe.size(); ++i)
    WCHECK(pg[i].second.cpu().to_vector() == pe[i].second.cpu().to_vector(), "rank ", env.rank, ": ", pe[i].first);
  WCHECK(eager.losses.back() != eager.losses.front(), "the steps changed nothing");
  destroy_process_group();
}

TEST(GptGraphRanks, TwoRanksOverNcclReplayedEqualEager) {
  if (!testing::nccl_ranks_runnable(2)) GTEST_SKIP() << "needs 2 GPUs (or the emulation)";
  if (!cuda_allocator_caching(0)) GTEST_SKIP() << "EMBER_NO_CUDA_MEMORY_CACHING is set: graphs need the caching";
  for (const char* c : {"gpt2_off", "llama_bf16"}) EMBER_EXPECT_RANKS("gpt_graph_ranks", 2, {.arg = c}) << c;
}

}  // namespace
}  // namespace ember::distributed
