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
// its own batches, its replayed steps equal to its eager ones; and tensor
// parallelism (sequence parallel, the vocabulary-parallel loss), context
// parallelism (ring and all-to-all) across 2 ranks, dp_shard x tp and
// cp x tp across 4, every dimension's collectives inside the graph; and a
// mixture of experts, routed and run on the device (group_order, grouped_mm
// with offsets), its statistics replayed with the step; with a capacity,
// float32 experts (padded groups, batched GEMMs, choices dropped) and expert
// parallelism across 2 ranks (even all-to-alls inside the graph). What
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
#include "distributed/parallel/cp/load_balance.h"
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
  int tp = 1, cp = 1;       // over 2 ranks: tensor or context parallelism instead of FSDP's sharding
  cp::Exchange exchange = cp::Exchange::Ring;
  int experts = 0;      // every block's feed-forward a mixture of this many experts (top 2), routed on the device
  double capacity = 0;  // the experts' capacity factor (0: dropless): padded groups, any dtype, ep's even splits
  int ep = 1;           // expert parallelism over the FSDP ranks
};

// In place: the step's function keeps pointers into `t`. `world`: FSDP
// shards over that many ranks (the default group's).
void make(Trainer& t, const Case& c, bool graphed, int world = 1) {
  manual_seed(5);
  nn::GPTOptions o{.vocab_size = kVocab, .block_size = kSeq, .n_layer = 2, .n_head = 2, .n_embd = 32};
  o.arch = c.arch;
  o.dropout = c.dropout;
  if (c.experts > 0)
    o.moe = {.num_experts = c.experts, .top_k = 2, .hidden = 32, .z_loss_coef = 1e-3, .capacity_factor = c.capacity};
  t.gpt = std::make_shared<nn::GPT>(o);
  t.gpt->to(Device(DeviceType::CUDA, 0));
  const ParallelDims dims = ParallelDims{.cp = c.cp, .tp = c.tp, .ep = c.ep}.resolved(world);
  GPTParallelOptions po;
  po.cp = {.exchange = c.exchange, .seq = kSeq};
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
  // and backs off on the device, and grows every second clean step,
  // replays included (an MoE's router losses follow it there).
  t.scaler = std::make_unique<optim::GradScaler>(optim::GradScalerOptions{
      .init_scale = 16777216.0, .backoff_factor = 1.0 / 64, .growth_interval = 2, .enabled = c.amp == "fp16"});
  nn::GPT* gpt = t.gpt.get();
  Parallelized* par = &t.par;
  optim::AdamW* opt = t.opt.get();
  optim::GradScaler* scaler = t.scaler.get();
  t.step = std::make_unique<optim::GraphedStep>(
      [=](const std::vector<Tensor>& in) { return gpt_step_on_device(*gpt, *par, *opt, *scaler, in, 0.5); },
      optim::GraphedStepOptions{.device = 0, .warmup = 3, .optimizers = {t.opt.get()}, .enabled = graphed});
}

// `rank`'s batches differ from every other data-parallel rank's; the
// ranks of a tp group train on the same batches, those of a cp group on
// their head-tail chunks of the same sequences.
void train(Trainer& t, const Case& c, int steps, int rank = 0) {
  // The mesh is [dp_shard, cp, tp], row-major over the ranks.
  const int dp_rank = rank / (c.cp * c.tp), cp_rank = rank / c.tp % c.cp;
  auto slice = [&](const Tensor& x) { return c.cp > 1 ? cp::shard(x, 1, c.cp, cp_rank).contiguous() : x; };
  for (int s = 0; s < steps; ++s) {
    Generator g(300 + s + 1000 * dp_rank);
    std::vector<Tensor> in;
    for (int m = 0; m < c.micro; ++m) {
      in.push_back(slice(randint(0, kVocab, {kBatch, kSeq}, DType::Int64, &g)));
      in.push_back(slice(randint(0, kVocab, {kBatch, kSeq}, DType::Int64, &g)));
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
  if (c.experts > 0) {
    // The router's statistics are the last step's, replayed into the same
    // sums: what the eager step routed.
    const auto me = nn::moe_layers(*eager.gpt), mg = nn::moe_layers(*graphed.gpt);
    ASSERT_EQ(me.size(), mg.size());
    for (size_t i = 0; i < me.size(); ++i) {
      EXPECT_EQ(mg[i]->stats().tokens_per_expert, me[i]->stats().tokens_per_expert) << "MoE layer " << i;
      EXPECT_EQ(mg[i]->stats().forwards, c.micro) << "MoE layer " << i;
      EXPECT_EQ(mg[i]->stats().aux_loss, me[i]->stats().aux_loss) << "MoE layer " << i;
      EXPECT_EQ(mg[i]->stats().dropped, me[i]->stats().dropped) << "MoE layer " << i;
      EXPECT_EQ(static_cast<bool>(mg[i]->experts->kernel), c.float8) << "MoE layer " << i << ": float8 experts";
      if (c.capacity > 0 && c.capacity < 1) EXPECT_GT(me[i]->stats().dropped, 0) << "MoE layer " << i;
    }
  }
  if (c.amp == "fp16") {
    // Overflowing steps skipped and the scale backed off, on the device:
    // the norms of those steps are not finite.
    EXPECT_FALSE(std::isfinite(eager.norms.front())) << "the first step overflows";
    EXPECT_TRUE(std::isfinite(eager.norms.back())) << "a later one does not";
    EXPECT_LT(eager.scales.back(), 16777216.0);
    EXPECT_NE(eager.scales[3], eager.scales.back()) << "the scale should change in the replayed steps";
  } else if (c.dropout == 0) {  // (dropout's noise can outweigh 7 steps' progress)
    EXPECT_LT(eager.losses.back(), eager.losses.front()) << "it trained";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, GptGraph,
    ::testing::Values(
        Case{nn::Arch::GPT2, "off", 2}, Case{nn::Arch::Llama, "bf16", 1}, Case{nn::Arch::GPT2, "fp16", 1},
        Case{nn::Arch::GPT2, "bf16", 2, 0.2}, Case{nn::Arch::GPT2, "off", 1, 0.2, "full"},
        Case{nn::Arch::Llama, "bf16", 2, 0.0, "none", true},
        Case{.arch = nn::Arch::Llama, .amp = "bf16", .micro = 2, .experts = 4},
        // float16: the router losses take the scaler's live scale
        Case{.arch = nn::Arch::Llama, .amp = "fp16", .micro = 2, .experts = 4},
        // float32 experts: capacity-padded, one batched GEMM
        Case{.arch = nn::Arch::Llama, .amp = "off", .micro = 2, .experts = 4, .capacity = 0.75},
        // float8 experts, expert by expert on padded groups
        Case{.arch = nn::Arch::Llama, .amp = "bf16", .micro = 1, .float8 = true, .experts = 4, .capacity = 1.0}),
    [](const auto& info) {
      const Case& c = info.param;
      return std::string(nn::arch_name(c.arch)) + "_" + c.amp + (c.dropout > 0 ? "_dropout" : "") +
             (c.ac != "none" ? "_ac_" + c.ac : "") + (c.float8 ? "_float8" : "") + (c.experts > 0 ? "_moe" : "") +
             (c.capacity > 0 ? "_capacity" : "");
    });

// The 2-rank cases, by name: FSDP FULL_SHARD across the ranks, tensor
// parallelism (Megatron's split with sequence parallelism: its all-gathers
// and reduce-scatters of activations, the vocabulary-parallel loss's
// allreduces), context parallelism (keys and values around the ring, or
// all-gathered, or heads exchanged all-to-all, and their gradients back).
Case ranks_case(const std::string& name) {
  Case c{nn::Arch::GPT2, "off", 2};
  if (name == "llama_bf16") c = Case{nn::Arch::Llama, "bf16", 1};
  if (name == "gpt2_tp") c.tp = 2;
  if (name == "llama_bf16_tp") c = Case{nn::Arch::Llama, "bf16", 1}, c.tp = 2;
  if (name == "llama_cp_ring") c = Case{nn::Arch::Llama, "off", 1}, c.cp = 2;
  if (name == "gpt2_bf16_cp_alltoall")
    c = Case{nn::Arch::GPT2, "bf16", 2}, c.cp = 2, c.exchange = cp::Exchange::AllToAll;
  if (name == "gpt2_fsdp_tp") c.tp = 2;                                                 // on 4 ranks: dp_shard 2 x tp 2
  if (name == "llama_cp_tp") c = Case{nn::Arch::Llama, "bf16", 1}, c.cp = 2, c.tp = 2;  // on 4 ranks
  if (name == "llama_bf16_moe") c = Case{nn::Arch::Llama, "bf16", 2}, c.experts = 4;    // FSDP
  if (name == "llama_moe_ep_capacity")  // experts split over 2 ranks, even all-to-alls
    c = Case{nn::Arch::Llama, "off", 2}, c.experts = 4, c.capacity = 1.0, c.ep = 2;
  return c;
}

// 2 ranks over NCCL; the arg names the case (ranks_case).
EMBER_WORKER(gpt_graph_ranks) {
  testing::init_world(env, Millis{0}, "nccl");
  const Case c = ranks_case(env.arg);
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
  for (const char* c : {"gpt2_off", "llama_bf16", "gpt2_tp", "llama_bf16_tp", "llama_cp_ring", "gpt2_bf16_cp_alltoall",
                        "llama_bf16_moe", "llama_moe_ep_capacity"})
    EMBER_EXPECT_RANKS("gpt_graph_ranks", 2, {.arg = c}) << c;
  EMBER_EXPECT_RANKS("gpt_graph_tp_check", 2, {.env = {"EMBER_TP_CHECK_REPLICATED=1"}});
}

// EMBER_TP_CHECK_REPLICATED reads hashes back to the host, which a capture
// cannot: the capture fails naming the check, on every rank alike.
EMBER_WORKER(gpt_graph_tp_check) {
  testing::init_world(env, Millis{0}, "nccl");
  Case c{nn::Arch::GPT2, "off", 1};
  c.tp = 2;
  Trainer graphed;
  make(graphed, c, true, env.world_size);
  std::string error = "none";
  try {
    train(graphed, c, 4, env.rank);
  } catch (const Error& e) {
    error = e.what();
  }
  WCHECK(error.find("EMBER_TP_CHECK_REPLICATED") != std::string::npos &&
             error.find("is being captured in a CUDA graph") != std::string::npos,
         "rank ", env.rank, ": ", error);
  WCHECK(graphed.losses.size() == 3,
         "the eager warm-up steps ran (checked), the capture failed: ", graphed.losses.size(), " steps");
  destroy_process_group();
}

// Two dimensions, each with its communicator's collectives in the graph.
TEST(GptGraphRanks, FourRanksTwoDimensionsReplayedEqualEager) {
  if (!testing::nccl_ranks_runnable(4)) GTEST_SKIP() << "needs 4 GPUs (or the emulation)";
  if (!cuda_allocator_caching(0)) GTEST_SKIP() << "EMBER_NO_CUDA_MEMORY_CACHING is set: graphs need the caching";
  for (const char* c : {"gpt2_fsdp_tp", "llama_cp_tp"}) EMBER_EXPECT_RANKS("gpt_graph_ranks", 4, {.arg = c}) << c;
}

}  // namespace
}  // namespace ember::distributed
