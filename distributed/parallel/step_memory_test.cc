// A step's memory by part: the allocator's breakdown at the peak adds up to
// the peak, and the planner's timeline (predict_gpt/mlp_step_memory)
// predicts each part within 10% of the peak, and the peak within 10%, for
// the GPT and the MLP, on 1 and 2 FSDP ranks, under each checkpointing
// policy; the parts the planner does not model are refused by name.
#include "distributed/parallel/step_memory.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/ops.h"
#include "core/testing/error_of.h"
#include "distributed/init.h"
#include "distributed/parallel/fsdp/fsdp.h"
#include "distributed/testing/multiprocess.h"
#include "nn/checkpoint.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "optim/optimizer.h"

namespace ember::distributed {
namespace {

namespace mp = ::ember::distributed::testing;

#define WCHECK(cond, ...) EMBER_CHECK(cond, "line ", __LINE__, ": check failed: " #cond ": ", __VA_ARGS__)

class MlpBlock : public nn::Module {
 public:
  MlpBlock(int64_t d, int64_t h) : nn::Module("MlpBlock") {
    norm = register_module("norm", std::make_shared<nn::LayerNorm>(std::vector<int64_t>{d}));
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(d, h));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(h, d));
  }
  Tensor forward(const Tensor& x) override { return x + (*fc2)(gelu((*fc1)((*norm)(x)))); }
  std::shared_ptr<nn::LayerNorm> norm;
  std::shared_ptr<nn::Linear> fc1, fc2;
};

constexpr int64_t kD = 256, kH = 1024, kBlocks = 4, kRows = 64;

// Two steps of the model; the breakdown of the second one's peak.
StepMemory measure(const std::string& model_name, const StepPlan& plan) {
  manual_seed(0);
  std::shared_ptr<nn::Module> model;
  std::vector<std::pair<std::string, std::shared_ptr<nn::Module>>> blocks;
  nn::GPTOptions g{.vocab_size = 512, .block_size = 64, .n_layer = 4, .n_head = 4, .n_embd = 64};
  if (model_name == "gpt") {
    auto gpt = std::make_shared<nn::GPT>(g);
    blocks = gpt->h->named_children();
    model = gpt;
  } else {
    auto seq = std::make_shared<nn::Sequential>();
    for (int i = 0; i < kBlocks; ++i) seq->push_back(std::make_shared<MlpBlock>(kD, kH));
    blocks = seq->named_children();
    model = seq;
  }
  nn::apply_activation_checkpointing(blocks, nn::ActivationCheckpointing::parse(plan.ac));
  FSDPOptions o;
  o.strategy = parse_strategy(plan.strategy);
  for (auto& [n, b] : blocks) fully_shard(b, o);
  fully_shard(model, o);
  optim::AdamW opt(model->parameters(), {.lr = 1e-3});
  manual_seed(1 + default_group()->rank());
  Tensor x = model_name == "gpt" ? randint(0, 512, {plan.micro_batch, plan.seq}) : randn({kRows, kD});
  Tensor y = model_name == "gpt" ? randint(0, 512, {plan.micro_batch * plan.seq}) : randn({kRows, kD});
  for (int s = 0; s < 2; ++s) {
    cpu_allocator()->reset_peak_stats();
    Tensor loss;
    {
      MemoryKindScope activations(MemoryKind::Activations);
      Tensor out = (*model)(x);
      loss = model_name == "gpt" ? nn::functional::cross_entropy(out.view({-1, 512}), y)
                                 : nn::functional::mse_loss(out, y);
    }
    loss.backward();
    opt.step();
    opt.zero_grad();
  }
  const AllocatorStats st = cpu_allocator()->stats();
  StepMemory m = measured_step_memory(st);
  WCHECK(std::abs(m.total() - static_cast<double>(st.peak_requested) / (1 << 20)) < 1e-6, "the parts ", m.total(),
         " MiB do not add up to the peak ", static_cast<double>(st.peak_requested) / (1 << 20));
  return m;
}

EMBER_WORKER(plan_vs_measured) {
  mp::init_world(env);
  auto opt = mp::parse_arg(env.arg);
  StepPlan plan;
  plan.world = env.world_size;
  plan.strategy = opt["strategy"];
  plan.ac = opt["ac"];
  const std::string model = opt["model"];
  plan.micro_batch = model == "gpt" ? 4 : kRows;
  plan.seq = model == "gpt" ? 64 : 1;
  const StepMemory got = measure(model, plan);
  const StepMemory want =
      model == "gpt" ? predict_gpt_step_memory(
                           {.vocab_size = 512, .block_size = 64, .n_layer = 4, .n_head = 4, .n_embd = 64}, plan)
                     : predict_mlp_step_memory(kD, kH, kBlocks, plan);
  if (env.rank == 0)
    std::fprintf(stderr, "%s\n%s\n", got.line("memory peak").c_str(), want.line("memory plan").c_str());
  const double peak = got.total();
  WCHECK(std::abs(want.total() - peak) <= 0.1 * peak, env.arg, ": planned peak ", want.total(), " MiB, measured ", peak,
         "\n", got.line("memory peak"), "\n", want.line("memory plan"));
  for (int k = 0; k < kMemoryKinds; ++k)
    WCHECK(std::abs(want.mib[k] - got.mib[k]) <= 0.1 * peak, env.arg, ": ",
           memory_kind_name(static_cast<MemoryKind>(k)), " planned ", want.mib[k], " MiB, measured ", got.mib[k], "\n",
           got.line("memory peak"), "\n", want.line("memory plan"));
}

void run(int world, const std::string& arg) {
  mp::RunOptions o;
  o.arg = arg;
  auto res = mp::run_workers("plan_vs_measured", world, o);
  EXPECT_TRUE(mp::all_succeeded(res)) << arg << "\n" << mp::describe(res);
  // EMBER_STEP_MEMORY_SHOW=1: both lines of every case (the docs' table).
  if (std::getenv("EMBER_STEP_MEMORY_SHOW")) std::fprintf(stderr, "%s\n%s\n", arg.c_str(), mp::describe(res).c_str());
}

TEST(StepMemory, GptOneRank) {
  for (const char* ac : {"none", "full", "selective", "every:2"})
    run(1, std::string("model=gpt,strategy=full,ac=") + ac);
}
TEST(StepMemory, GptTwoRanks) {
  for (const char* s : {"full", "grad_op", "no_shard"}) run(2, std::string("model=gpt,ac=none,strategy=") + s);
  run(2, "model=gpt,strategy=full,ac=full");
  run(2, "model=gpt,strategy=full,ac=selective");
}
TEST(StepMemory, MlpOneAndTwoRanks) {
  run(1, "model=mlp,strategy=full,ac=none");
  for (const char* s : {"full", "grad_op", "no_shard"}) run(2, std::string("model=mlp,ac=none,strategy=") + s);
  run(2, "model=mlp,strategy=full,ac=full");
}

TEST(StepMemory, UnmodelledConfigurationsAreRefused) {
  const std::string msg = ::ember::testing::error_of([] { predict_gpt_step_memory({.dropout = 0.1}, StepPlan{}); });
  EXPECT_NE(msg.find("dropout 0.1 is not modelled"), std::string::npos) << msg;
  const std::string msg2 = ::ember::testing::error_of([] {
    StepPlan p;
    p.strategy = "hybrid";
    predict_mlp_step_memory(8, 8, 1, p);
  });
  EXPECT_NE(msg2.find("strategy 'hybrid' is not modelled"), std::string::npos) << msg2;
}

TEST(MultiProcessWorker, Entry) {
  if (!mp::is_worker()) GTEST_SKIP() << "entry point of the worker processes";
  mp::run_if_worker();
}

}  // namespace
}  // namespace ember::distributed
