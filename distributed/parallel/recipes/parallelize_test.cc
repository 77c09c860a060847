// The recipe's library calls on a model that is not the GPT: a small
// bidirectional transformer regressor of this file's own (its block type
// "MixBlock", its own tensor-parallel plan), trained on 2x2x2 meshes that
// ParallelDims builds, against the same model trained alone in-process on
// the whole batch:
//   * dp_replicate 2 x dp_shard 2 x tp 2 through parallelize() (TP, full
//     activation checkpointing, HSDP of every block and the root);
//   * pp 2 x dp_shard 2 x tp 2 through pipeline_parallelize() (1F1B over 2
//     micro-batches; TP, FSDP inside each stage).
// Every step's loss (the mean over the data-parallel ranks, through the
// flattened "dp" view) and gradient norm, and the loss of held-out inputs
// after training (a function of every final weight), must agree with one
// process. Also: DDP through parallelize(.ddp) on dp_replicate 4 x tp 2,
// and the recipe's errors.
#include "distributed/parallel/recipes/parallelize.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "core/testing/error_of.h"
#include "distributed/init.h"
#include "distributed/testing/multiprocess.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "nn/transformer.h"
#include "optim/clip_grad.h"
#include "optim/optimizer.h"

namespace ember::distributed {
namespace {

namespace mp = ::ember::distributed::testing;
using ::ember::testing::error_of;

constexpr int64_t kFeatures = 6, kDim = 32, kHeads = 4, kB = 8, kT = 8;
constexpr int kSteps = 4;

// Pre-norm block: bidirectional attention and a 3x-wide ReLU feed-forward
// with its own names (not the GPT's ln_1/mlp.c_fc).
class MixBlock : public nn::Module {
 public:
  MixBlock() : Module("MixBlock") {
    norm_a = register_module("norm_a", std::make_shared<nn::LayerNorm>(std::vector<int64_t>{kDim}));
    attn = register_module("attn", std::make_shared<nn::MultiheadAttention>(kDim, kHeads, 0.0, /*causal=*/false));
    norm_f = register_module("norm_f", std::make_shared<nn::LayerNorm>(std::vector<int64_t>{kDim}));
    up = register_module("up", std::make_shared<nn::Linear>(kDim, 3 * kDim));
    down = register_module("down", std::make_shared<nn::Linear>(3 * kDim, kDim));
  }
  Tensor forward(const Tensor& x) override {
    Tensor y = x + (*attn)((*norm_a)(x));
    return y + (*down)(relu((*up)((*norm_f)(y))));
  }
  std::shared_ptr<nn::LayerNorm> norm_a, norm_f;
  std::shared_ptr<nn::MultiheadAttention> attn;
  std::shared_ptr<nn::Linear> up, down;
};

// The model's head: a norm and one output per position.
class Head : public nn::Module {
 public:
  Head() : Module("Head") {
    norm = register_module("norm", std::make_shared<nn::LayerNorm>(std::vector<int64_t>{kDim}));
    out = register_module("out", std::make_shared<nn::Linear>(kDim, 1));
  }
  Tensor forward(const Tensor& x) override { return (*out)((*norm)(x)); }
  std::shared_ptr<nn::LayerNorm> norm;
  std::shared_ptr<nn::Linear> out;
};

// [B, T, kFeatures] -> [B, T, 1]: input projection, 4 blocks, head; a
// Sequential so that a pipeline can cut it ("0" the projection, "1".."4"
// the blocks, "5" the head).
std::shared_ptr<nn::Sequential> make_model() {
  manual_seed(11);
  auto m = std::make_shared<nn::Sequential>();
  m->push_back(std::make_shared<nn::Linear>(kFeatures, kDim));
  for (int i = 0; i < 4; ++i) m->push_back(std::make_shared<MixBlock>());
  m->push_back(std::make_shared<Head>());
  return m;
}

// Its own tensor-parallel plan: heads and the feed-forward's hidden units
// split over tp; norms, projection and head replicated.
ParallelizePlan mix_plan() {
  return {{"*.attn", ColwiseParallel{}},
          {"*.attn.out_proj", RowwiseParallel{}},
          {"*.up", ColwiseParallel{}},
          {"*.down", RowwiseParallel{}}};
}

// Step s's batch, a function of s only; `heldout` the evaluation's.
std::pair<Tensor, Tensor> batch(int step) {
  Generator g(500 + step);
  Tensor x = randn({kB, kT, kFeatures}, DType::Float32, &g);
  return {x, tanh(sum(x, {2}, true))};
}

struct Run {
  std::vector<double> losses, norms;
  double heldout = 0;
};

// One process on the whole batch; `micro` micro-batches accumulated (the
// pipeline's), data-parallel rank d's rows in order.
Run reference(int micro) {
  auto model = make_model();
  optim::SGD opt(model->parameters(), {.lr = 0.05, .momentum = 0.9});
  Run r;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    double total = 0;
    for (int m = 0; m < micro; ++m) {
      const int64_t rows = kB / micro;
      Tensor loss = nn::functional::mse_loss((*model)(x.narrow(0, m * rows, rows)), y.narrow(0, m * rows, rows));
      (loss * (1.0 / micro)).backward();
      total += loss.item() / micro;
    }
    r.norms.push_back(optim::clip_grad_norm_(model->parameters(), 1.0));
    opt.step();
    opt.zero_grad();
    r.losses.push_back(total);
  }
  NoGradGuard ng;
  auto [x, y] = batch(100);
  r.heldout = nn::functional::mse_loss((*model)(x), y).item();
  return r;
}

// The mean of `v` over the data-parallel ranks (the flattened view).
double dp_mean(const DeviceMesh& mesh, double v) {
  Tensor t = Tensor::from_vector({v}, {1}, DType::Float64);
  mesh.submesh({"dp"})->group()->allreduce(t, ReduceOp::Avg)->wait();
  return t.item();
}

void expect_same(const Run& got, const Run& want) {
  for (int s = 0; s < kSteps; ++s) {
    WCHECK(std::abs(got.losses[s] - want.losses[s]) <= 1e-5 * (1 + want.losses[s]), "step ", s, " loss ", got.losses[s],
           " vs one process ", want.losses[s]);
    WCHECK(std::abs(got.norms[s] - want.norms[s]) <= 1e-5 * (1 + want.norms[s]), "step ", s, " gradient norm ",
           got.norms[s], " vs one process ", want.norms[s]);
  }
  WCHECK(std::abs(got.heldout - want.heldout) <= 1e-5 * (1 + want.heldout), "held-out loss ", got.heldout,
         " vs one process ", want.heldout);
  // Training moved the weights: a recipe that dropped the step would not pass.
  WCHECK(want.losses.back() < 0.9 * want.losses.front(), "the reference did not learn");
}

// The distributed run without a pipeline: each data-parallel rank its
// rows of every step's batch (the tp ranks of one the same rows).
Run train_data_parallel(nn::Module& model, Parallelized& par, const ParallelDims& dims, const DeviceMesh& mesh) {
  optim::SGD opt(model.parameters(), {.lr = 0.05, .momentum = 0.9});
  const int64_t rows = kB / dims.dp(), from = dims.dp_rank(mesh) * rows;
  auto loss_of = [&](int step) {
    auto [x, y] = batch(step);
    return nn::functional::mse_loss(model(x.narrow(0, from, rows)), y.narrow(0, from, rows));
  };
  Run got;
  for (int s = 0; s < kSteps; ++s) {
    Tensor loss = loss_of(s);
    loss.backward();
    got.norms.push_back(par.clip_grad_norm_(1.0));
    opt.step();
    opt.zero_grad();
    got.losses.push_back(dp_mean(mesh, loss.item()));
  }
  NoGradGuard ng;
  got.heldout = dp_mean(mesh, loss_of(100).item());
  return got;
}

// dp_replicate 2 x dp_shard 2 x tp 2: HSDP over TP, every block checkpointed.
EMBER_WORKER(hsdp_tp) {
  mp::init_world(env);
  const Run want = reference(1);
  const ParallelDims dims = ParallelDims{.dp_replicate = 2, .dp_shard = 2, .tp = 2}.resolved(env.world_size);
  auto mesh = dims.build_mesh();
  auto model = make_model();
  Parallelized par = parallelize(model, dims, mesh, {.tp_plan = mix_plan(), .block_types = {"MixBlock"}, .ac = "full"});
  WCHECK(par.ac_blocks == 4 && par.fsdp != nullptr && par.fsdp->units().size() == 5, "ac ", par.ac_blocks);
  expect_same(train_data_parallel(*model, par, dims, *mesh), want);
}

// pp 2 x dp_shard 2 x tp 2: the model cut into 2 stages, 1F1B over 2
// micro-batches per data-parallel rank, TP and FSDP inside each stage.
EMBER_WORKER(pp_fsdp_tp) {
  mp::init_world(env);
  const int micro = 2;
  const ParallelDims dims = ParallelDims{.pp = 2, .dp_shard = 2, .tp = 2}.resolved(env.world_size);
  const Run want = reference(dims.dp() * micro);
  auto mesh = dims.build_mesh();
  auto model = make_model();
  const auto schedule = pp::make_schedule("1f1b", dims.pp, 1, micro);
  auto loss_fn = [](const Tensor& out, const Tensor& y) { return nn::functional::mse_loss(out, y); };
  PipelineParallel pipe =
      pipeline_parallelize(pp::split_sequential(*model, schedule.num_stages()), schedule, dims, mesh,
                           {.tp_plan = mix_plan(), .block_types = {"MixBlock"}}, {.loss = loss_fn});
  WCHECK(pipe.fsdp.size() == 1 && pipe.stages.size() == 1, pipe.fsdp.size());
  WCHECK(pipe.layout.size() == 2 && pipe.layout[1].second == 1, pipe.layout.size());
  optim::SGD opt(pipe.part->parameters(), {.lr = 0.05, .momentum = 0.9});
  const int64_t rows = kB / dims.dp() / micro, from = dims.dp_rank(*mesh) * rows * micro;
  auto run = [&](pp::Pipeline& p, int step) {
    auto [x, y] = batch(step);
    std::vector<Tensor> xs, ys;
    for (int m = 0; m < micro; ++m) {
      xs.push_back(x.narrow(0, from + m * rows, rows));
      ys.push_back(y.narrow(0, from + m * rows, rows));
    }
    double total = 0;
    const std::vector<Tensor> losses = p.step(xs, ys);  // the last stage's ranks hold them
    for (const Tensor& l : losses) total += l.item() / losses.size();
    Tensor t = Tensor::from_vector({total}, {1}, DType::Float64);
    mesh->group("pp")->allreduce(t, ReduceOp::Sum)->wait();
    return dp_mean(*mesh, t.item());
  };
  Run got;
  for (int s = 0; s < kSteps; ++s) {
    got.losses.push_back(run(*pipe.pipe, s));
    got.norms.push_back(pipe.pipe->clip_grad_norm_(1.0));
    opt.step();
    opt.zero_grad();
  }
  // Held out: forwards only, one micro-batch of all this rank's rows.
  pp::Pipeline eval(pp::forward_schedule(dims.pp, 1, micro), pipe.stages, mesh->group("pp"), {.loss = loss_fn});
  {
    NoGradGuard ng;
    auto [x, y] = batch(100);
    std::vector<Tensor> xs, ys;
    for (int m = 0; m < micro; ++m) {
      xs.push_back(x.narrow(0, from + m * rows, rows));
      ys.push_back(y.narrow(0, from + m * rows, rows));
    }
    double total = 0;
    for (const Tensor& l : eval.step(xs, ys)) total += l.item() / micro;
    Tensor t = Tensor::from_vector({total}, {1}, DType::Float64);
    mesh->group("pp")->allreduce(t, ReduceOp::Sum)->wait();
    got.heldout = dp_mean(*mesh, t.item());
  }
  expect_same(got, want);
}

// parallelize(.ddp): without sharding, replicate() over dp_replicate.
EMBER_WORKER(ddp_tp) {
  mp::init_world(env);
  const Run want = reference(1);
  const ParallelDims dims = ParallelDims{.dp_replicate = -1, .dp_shard = 1, .tp = 2}.resolved(env.world_size);
  auto mesh = dims.build_mesh();
  auto model = make_model();
  Parallelized par = parallelize(model, dims, mesh, {.tp_plan = mix_plan(), .block_types = {"MixBlock"}, .ddp = true});
  WCHECK(par.ddp != nullptr && par.fsdp == nullptr, "DDP expected");
  expect_same(train_data_parallel(*model, par, dims, *mesh), want);
}

// The recipe's errors, each before anything is changed.
EMBER_WORKER(errors) {
  mp::init_world(env);
  const ParallelDims dims = ParallelDims{.tp = 2}.resolved(env.world_size);
  auto mesh = dims.build_mesh();
  auto model = make_model();
  std::string e = error_of([&] { parallelize(model, dims, mesh, {.block_types = {"MixBlock"}}); });
  WCHECK(e.find("tp=2 but the model has no tensor-parallel plan") != std::string::npos, e);
  FSDPOptions given;
  given.mesh = mesh->submesh({"dp_shard"});
  e = error_of([&] { parallelize(model, dims, mesh, {.tp_plan = mix_plan(), .fsdp = given}); });
  WCHECK(e.find("the mesh comes from the ParallelDims") != std::string::npos, e);
  e = error_of([&] { parallelize(make_model(), dims, mesh, {.tp_plan = mix_plan(), .ac = "full"}); });
  WCHECK(e.find("needs the block types") != std::string::npos, e);
  // Replicas of SHARD_GRAD_OP units: refused before tensor parallelism
  // touched the model.
  const ParallelDims replicas = ParallelDims{.dp_replicate = 2, .dp_shard = 1, .tp = 2}.resolved(env.world_size);
  auto rmesh = replicas.build_mesh();
  auto fresh = make_model();
  FSDPOptions grad_op;
  grad_op.strategy = ShardingStrategy::SHARD_GRAD_OP;
  e = error_of([&] {
    parallelize(fresh, replicas, rmesh, {.tp_plan = mix_plan(), .block_types = {"MixBlock"}, .fsdp = grad_op});
  });
  WCHECK(e.find("does not combine with it") != std::string::npos, e);
  for (const Tensor& p : fresh->parameters()) WCHECK(!is_dtensor(p), "the model changed before the error");
}

TEST(Parallelize, CustomTransformerHsdpTp2x2x2MatchesOneProcess) { EMBER_EXPECT_RANKS("hsdp_tp", 8); }
TEST(Parallelize, CustomTransformerPpFsdpTp2x2x2MatchesOneProcess) { EMBER_EXPECT_RANKS("pp_fsdp_tp", 8); }
TEST(Parallelize, CustomTransformerDdpTpMatchesOneProcess) { EMBER_EXPECT_RANKS("ddp_tp", 8); }
TEST(Parallelize, Errors) { EMBER_EXPECT_RANKS("errors", 4); }

}  // namespace
}  // namespace ember::distributed
