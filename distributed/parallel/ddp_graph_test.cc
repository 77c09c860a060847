// //examples:resnet_ddp --cuda-graph 1's step as one CUDA graph: a ResNet
// (batch norms fused with their ReLUs, channels-last) under DDP on a world
// of one (whose buckets need no collective), SGD with Nesterov momentum on
// a warm-up schedule, autocast with the loss scaler skipping on the device,
// captured through optim::GraphedStep after three eager steps and
// replayed, gives the eager steps' losses, parameters and batch-norm
// statistics bit for bit. The same across 2 ranks over NCCL, whose bucket
// allreduces and buffer broadcasts the graph captures: each rank's replayed
// steps equal its eager ones, and the ranks' replicas stay equal; with
// SyncBatchNorm too (its statistics' allreduces in the graph, the running
// statistics equal across the ranks). On a GPU
// (skips without one, and the 2 ranks without 2 GPUs) and under the
// emulation (ddp_graph_emu_test, with the emulated NCCL).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/autocast.h"
#include "core/device.h"
#include "core/ops.h"
#include "distributed/init.h"
#include "distributed/parallel/ddp.h"
#include "distributed/testing/multiprocess.h"
#include "distributed/testing/world_of_one.h"
#include "nn/functional.h"
#include "nn/models.h"
#include "optim/grad_scaler.h"
#include "optim/graphed_step.h"
#include "optim/lr_scheduler.h"

namespace ember::distributed {
namespace {

struct Trainer {
  std::shared_ptr<nn::ResNet> model;
  std::shared_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<GradientAccumulator> acc;
  std::unique_ptr<optim::SGD> opt;
  std::unique_ptr<optim::LinearLR> sched;
  std::unique_ptr<optim::GradScaler> scaler;
  std::unique_ptr<optim::GraphedStep> step;
  std::vector<double> losses;
};

// In place: the step's function keeps pointers into `t`. `sync_bn`: the
// batch norms' statistics summed over the default group's ranks
// (convert_sync_batchnorm), their allreduces inside the graph.
void make(Trainer& t, const std::string& amp, bool graphed, bool sync_bn = false) {
  manual_seed(9);
  t.model = nn::resnet18({.num_classes = 5,
                          .in_channels = 1,
                          .small_stem = true,
                          .width = 4,
                          .memory_format = MemoryFormat::ChannelsLast});
  t.model->to(Device(DeviceType::CUDA, 0));
  if (sync_bn) convert_sync_batchnorm(*t.model, nullptr);
  t.ddp = std::make_shared<DistributedDataParallel>(t.model);
  t.acc = std::make_unique<GradientAccumulator>(*t.ddp, 1);
  t.opt = std::make_unique<optim::SGD>(
      t.model->parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true});
  t.sched = std::make_unique<optim::LinearLR>(*t.opt, 0.1, 1.0, 5);
  t.scaler = std::make_unique<optim::GradScaler>(
      optim::GradScalerOptions{.init_scale = 1e9, .backoff_factor = 1.0 / 256, .enabled = amp == "fp16"});
  Trainer* p = &t;
  auto fn = [p, amp](const std::vector<Tensor>& in) {
    p->opt->zero_grad();
    Tensor loss;
    {
      std::optional<AutocastGuard> cast;
      if (amp != "off") cast.emplace(DeviceType::CUDA, amp == "bf16" ? DType::BFloat16 : DType::Float16);
      loss = nn::functional::cross_entropy((*p->ddp)(in[0]), in[1]);
    }
    p->acc->backward(p->scaler->scale(loss));
    p->scaler->step_async(*p->opt);
    p->scaler->update();
    return std::vector<Tensor>{loss.detach()};
  };
  optim::SGD* opt = t.opt.get();
  t.step = std::make_unique<optim::GraphedStep>(
      fn, optim::GraphedStepOptions{.device = 0, .warmup = 3, .optimizers = {opt}, .enabled = graphed, .ready = [opt] {
                                      return opt->momentum_buffers_made();
                                    }});
}

// `rank`'s batches differ from every other rank's.
void train(Trainer& t, int steps, int rank = 0) {
  for (int s = 0; s < steps; ++s) {
    Generator g(500 + s + 1000 * rank);
    Tensor x = randn({4, 1, 8, 8}, {DType::Float32}, &g).cuda();
    Tensor y = randint(0, 5, {4}, DType::Int64, &g).cuda();
    t.losses.push_back((*t.step)({x, y})[0].cpu().item());
    t.sched->step();
    t.opt->zero_grad();  // as the example's loop does: ready() must not need the gradients
  }
}

class DdpGraph : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!cuda_is_available()) GTEST_SKIP() << "no GPU: " << cuda_unavailable_reason();
    if (!cuda_allocator_caching(0)) GTEST_SKIP() << "EMBER_NO_CUDA_MEMORY_CACHING is set: graphs need the caching";
    testing::init_world_of_one();  // DDP's buckets need no collective
    // Bit for bit needs deterministic algorithms: cuDNN's fastest weight
    // gradients add with atomics (the emulated cuDNN's too, by design).
    set_deterministic_algorithms(true);
  }
  void TearDown() override {
    set_deterministic_algorithms(false);
    if (cuda_is_available() && cuda_allocator_caching(0)) destroy_process_group();
  }
};

TEST_P(DdpGraph, ReplayedStepsEqualEagerStepsBitForBit) {
  const std::string amp = GetParam();
  constexpr int kSteps = 9;
  Trainer eager, graphed;
  make(eager, amp, false);
  train(eager, kSteps);
  make(graphed, amp, true);
  train(graphed, kSteps);
  ASSERT_TRUE(graphed.step->captured());
  // float16: the first steps overflow and are skipped before SGD has its
  // momentum buffers, so the capture waits for them (ready()).
  if (amp == "fp16")
    EXPECT_GT(graphed.step->captured_at(), 4);
  else
    EXPECT_EQ(graphed.step->captured_at(), 4);
  ASSERT_EQ(graphed.losses.size(), eager.losses.size());
  for (size_t i = 0; i < eager.losses.size(); ++i)
    EXPECT_TRUE(graphed.losses[i] == eager.losses[i] || (std::isnan(graphed.losses[i]) && std::isnan(eager.losses[i])))
        << "step " << i + 1 << ": " << graphed.losses[i] << " vs " << eager.losses[i];
  const auto se = eager.model->state_dict().items(), sg = graphed.model->state_dict().items();
  ASSERT_EQ(se.size(), sg.size());
  for (size_t i = 0; i < se.size(); ++i)
    EXPECT_EQ(sg[i].second.cpu().to_vector(), se[i].second.cpu().to_vector()) << se[i].first;
  EXPECT_EQ(graphed.scaler->get_scale(), eager.scaler->get_scale());
  if (amp == "fp16") {
    EXPECT_LT(eager.scaler->get_scale(), 1e9) << "no step overflowed: the skip went untested";
  }
}

INSTANTIATE_TEST_SUITE_P(Ddp, DdpGraph, ::testing::Values("off", "bf16", "fp16"),
                         [](const auto& info) { return info.param; });

// Each rank trains on its own batches, eagerly and graphed; its arg is the
// precision, "+sync_bn" after it for SyncBatchNorm.
EMBER_WORKER(ddp_graph_ranks) {
  testing::init_world(env, Millis{0}, "nccl");
  set_deterministic_algorithms(true);
  const bool sync_bn = env.arg.find("+sync_bn") != std::string::npos;
  const std::string amp = env.arg.substr(0, env.arg.find('+'));
  constexpr int kSteps = 7;
  Trainer eager, graphed;
  make(eager, amp, false, sync_bn);
  train(eager, kSteps, env.rank);
  make(graphed, amp, true, sync_bn);
  train(graphed, kSteps, env.rank);
  WCHECK(graphed.step->captured() && graphed.step->captured_at() == 4, "captured at step 4, not ",
         graphed.step->captured_at());
  for (size_t i = 0; i < eager.losses.size(); ++i)
    WCHECK(graphed.losses[i] == eager.losses[i], "rank ", env.rank, " step ", i + 1, ": ", graphed.losses[i], " vs ",
           eager.losses[i]);
  const auto se = eager.model->state_dict().items(), sg = graphed.model->state_dict().items();
  for (size_t i = 0; i < se.size(); ++i)
    WCHECK(sg[i].second.cpu().to_vector() == se[i].second.cpu().to_vector(), "rank ", env.rank, ": ", se[i].first);
  // Replicas agree: had a replay skipped its allreduces, each rank's own
  // batches would have moved its parameters apart. The batch norms'
  // running statistics too under SyncBatchNorm, whose statistics are every
  // rank's batches' (otherwise each rank's last forward updated its own).
  auto pg = default_group();
  std::vector<std::pair<std::string, Tensor>> shared = graphed.model->named_parameters();
  if (sync_bn)
    for (const auto& nb : graphed.model->named_buffers()) shared.push_back(nb);
  for (const auto& [name, p] : shared) {
    Tensor theirs = p.clone();
    pg->broadcast(theirs, 0)->wait();
    WCHECK(theirs.cpu().to_vector() == p.cpu().to_vector(), "rank ", env.rank, " differs from rank 0: ", name);
  }
  WCHECK(eager.losses[kSteps - 1] != eager.losses[0], "the steps trained nothing");
  set_deterministic_algorithms(false);
  destroy_process_group();
}

TEST(DdpGraphRanks, TwoRanksOverNcclReplayedEqualEager) {
  if (!testing::nccl_ranks_runnable(2)) GTEST_SKIP() << "needs 2 GPUs (or the emulation)";
  if (!cuda_allocator_caching(0)) GTEST_SKIP() << "EMBER_NO_CUDA_MEMORY_CACHING is set: graphs need the caching";
  for (const char* arg : {"off", "bf16", "bf16+sync_bn"}) EMBER_EXPECT_RANKS("ddp_graph_ranks", 2, {.arg = arg}) << arg;
}

}  // namespace
}  // namespace ember::distributed
