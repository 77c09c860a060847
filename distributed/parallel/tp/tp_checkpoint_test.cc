// Tensor parallelism composed with FSDP on a 2-D mesh (dp_shard x tp), and
// sharded checkpoints across layouts: a run saved under one layout, loaded
// under another and trained on must end where one process trained without
// a break ends (every tensor of the final checkpoint read whole and
// compared). Layouts: one process, tp 2 and 4 (with SP), FSDP over 3
// ranks, dp_shard 2 x tp 2. A checkpoint whose shapes do not match the model is
// refused with the tensor named and nothing changed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "core/safetensors.h"
#include "distributed/checkpoint/sharded.h"
#include "distributed/init.h"
#include "distributed/parallel/fsdp/fsdp.h"
#include "distributed/parallel/tp/gpt_plan.h"
#include "distributed/parallel/tp/loss_parallel.h"
#include "distributed/testing/multiprocess.h"
#include "optim/clip_grad.h"
#include "optim/optimizer.h"

namespace ember::distributed {
namespace {

namespace fs = std::filesystem;
namespace mp = ::ember::distributed::testing;

constexpr int64_t kB = 12, kT = 8;  // 12 rows split evenly over 1, 2, 3 and 4 data-parallel ranks

nn::GPTOptions gpt_options(int64_t vocab = 37) {
  return {.vocab_size = vocab, .block_size = 16, .n_layer = 2, .n_head = 4, .n_embd = 32, .tie_weights = true};
}

std::pair<Tensor, Tensor> batch(int step) {
  Generator g(500 + step);
  return {randint(0, 37, {kB, kT}, DType::Int64, &g), randint(0, 37, {kB, kT}, DType::Int64, &g)};
}

struct Job {
  std::shared_ptr<nn::GPT> model;
  std::unique_ptr<optim::AdamW> opt;
  int dp = 1, dp_rank = 0;
};

// layout: single | tp | fsdp | dp_tp.
Job make_job(const std::string& layout, int world) {
  Job j;
  manual_seed(7);
  j.model = std::make_shared<nn::GPT>(gpt_options());
  if (layout == "tp") {
    auto mesh = DeviceMesh::create({world}, {"tp"});
    parallelize_module(*j.model, mesh, gpt_tp_plan(*j.model, true));
  } else if (layout == "fsdp" || layout == "dp_tp") {
    std::shared_ptr<DeviceMesh> mesh, dp;
    if (layout == "dp_tp") {
      mesh = DeviceMesh::create({world / 2, 2}, {"dp_shard", "tp"});
      parallelize_module(*j.model, mesh->submesh({"tp"}), gpt_tp_plan(*j.model, true));
      dp = mesh->submesh({"dp_shard"});
    } else {
      dp = DeviceMesh::create({world}, {"dp_shard"});
    }
    for (auto& [name, block] : j.model->h->named_children()) fully_shard(block, {.mesh = dp});
    fully_shard(j.model, {.mesh = dp});
    j.dp = dp->size();
    j.dp_rank = dp->coordinate()[0];
  }
  j.opt = std::make_unique<optim::AdamW>(j.model->parameters(),
                                         optim::AdamWOptions{.lr = 1e-2, .eps = 1e-6, .weight_decay = 0.1});
  return j;
}

void train(Job& j, int from, int to) {
  for (int s = from; s < to; ++s) {
    auto [tokens, targets] = batch(s);
    const int64_t rows = kB / j.dp;
    Tensor loss = parallel_cross_entropy((*j.model)(tokens.narrow(0, j.dp_rank * rows, rows)),
                                         targets.narrow(0, j.dp_rank * rows, rows));
    loss.backward();
    optim::clip_grad_norm_(j.model->parameters(), 0.5);
    j.opt->step();
    j.opt->zero_grad();
  }
}

// arg: layout=L,from=F,to=T[,load=DIR][,save=DIR]
EMBER_WORKER(leg) {
  mp::init_world(env);
  auto a = mp::parse_arg(env.arg);
  Job j = make_job(a["layout"], env.world_size);
  const int from = std::stoi(a["from"]), to = std::stoi(a["to"]);
  auto pg = default_group();
  if (a.count("load")) {
    auto st = load_sharded_checkpoint(a["load"], *j.model, j.opt.get(), nullptr, *pg);
    WCHECK(st.ok(), st.status().message());
    WCHECK(st->step == from, "the checkpoint is of step ", st->step, ", expected ", from);
  }
  train(j, from, to);
  if (a.count("save")) {
    TrainingState st;
    st.step = to;
    auto s = save_sharded_checkpoint(a["save"], *j.model, j.opt.get(), nullptr, st, *pg);
    WCHECK(s.ok(), s.message());
  }
  pg->barrier()->wait();
}

// Every model tensor of the checkpoint in `dir` against one process trained
// for `steps` steps without a break.
void expect_matches_uninterrupted(const std::string& dir, int steps) {
  Job ref = make_job("single", 1);
  train(ref, 0, steps);
  auto index = read_checkpoint_index(dir);
  ASSERT_TRUE(index.ok()) << index.status().message();
  const nn::StateDict sd = ref.model->state_dict();
  for (const auto& [name, want] : sd.items()) {
    const CheckpointTensor* t = index->find(name);
    ASSERT_NE(t, nullptr) << name;
    auto got = read_checkpoint_tensor(dir, *t);
    ASSERT_TRUE(got.ok()) << got.status().message();
    const double err = max(abs(*got - want)).item(), scale = max(abs(want)).item();
    EXPECT_LE(err, 2e-4 * (1 + scale)) << name << " differs from the uninterrupted run (layout " << index->layout
                                       << ")";
  }
}

class TPCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("ember_tp_ckpt_" + std::to_string(::getpid()));
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string dir(const std::string& name) const { return (root_ / name).string(); }
  void leg(int world, const std::string& arg) { EMBER_ASSERT_RANKS("leg", world, {.arg = arg}); }
  fs::path root_;
};

TEST_F(TPCheckpoint, TensorParallelToFSDPOnThreeRanks) {
  leg(2, "layout=tp,from=0,to=2,save=" + dir("a"));
  leg(3, "layout=fsdp,from=2,to=3,load=" + dir("a") + ",save=" + dir("b"));
  expect_matches_uninterrupted(dir("b"), 3);
  // //tools:ckpt consolidate's one-process file of the tp checkpoint holds
  // the model an uninterrupted run reaches after 2 steps, PyTorch's names.
  ASSERT_TRUE(consolidate_checkpoint(dir("a"), dir("one")).ok());
  auto file = load_safetensors(dir("one") + "/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status().message();
  Job ref = make_job("single", 1);
  train(ref, 0, 2);
  for (const auto& [name, want] : ref.model->state_dict()) {
    const Tensor* got = file->find(name);
    ASSERT_NE(got, nullptr) << name;
    EXPECT_LE(max(abs(*got - want)).item(), 2e-4 * (1 + max(abs(want)).item())) << name;
  }
}

TEST_F(TPCheckpoint, FSDPTimesTensorParallelToOneProcessAndBack) {
  leg(4, "layout=dp_tp,from=0,to=2,save=" + dir("a"));
  leg(1, "layout=single,from=2,to=3,load=" + dir("a") + ",save=" + dir("b"));
  expect_matches_uninterrupted(dir("b"), 3);
  leg(4, "layout=dp_tp,from=3,to=4,load=" + dir("b") + ",save=" + dir("c"));
  expect_matches_uninterrupted(dir("c"), 4);
}

TEST_F(TPCheckpoint, AnotherTensorParallelDegree) {
  leg(2, "layout=tp,from=0,to=2,save=" + dir("a"));
  leg(4, "layout=tp,from=2,to=3,load=" + dir("a") + ",save=" + dir("b"));
  expect_matches_uninterrupted(dir("b"), 3);
}

// A checkpoint of another vocabulary: the tensor is named, nothing loads.
EMBER_WORKER(wrong_shapes) {
  mp::init_world(env);
  auto mesh = DeviceMesh::create({env.world_size}, {"tp"});
  manual_seed(7);
  nn::GPT model(gpt_options(41));
  parallelize_module(model, mesh, gpt_tp_plan(model, true));
  const Tensor before = model.wpe->weight.detach().clone();
  auto st = load_sharded_checkpoint(env.arg, model, nullptr, nullptr, *default_group());
  WCHECK(!st.ok(), "loaded a checkpoint of other shapes");
  const std::string m(st.status().message());
  WCHECK(m.find("tensor 'wte.weight' is [37,32] float32 in the checkpoint, [41,32] float32 in the model") !=
             std::string::npos,
         m);
  WCHECK(allclose(model.wpe->weight, before), "a refused load changed the model");
  default_group()->barrier()->wait();
}

TEST_F(TPCheckpoint, OtherShapesAreRefused) {
  leg(2, "layout=tp,from=0,to=1,save=" + dir("a"));
  EMBER_EXPECT_RANKS("wrong_shapes", 2, {.arg = dir("a")});
}

}  // namespace
}  // namespace ember::distributed
