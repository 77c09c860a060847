// The GPT under context parallelism against one process on the whole
// batch: every step's loss (the mean over the dp x cp ranks) and gradient
// norm, and the loss of held-out tokens after training (a function of every
// final weight), on
//   * dp_shard 2 x cp 2 (GPT-2: learned positions, MultiheadAttention; FSDP
//     over dp_shard x cp), each exchange;
//   * cp 2 x tp 2 (LLaMA: rotary positions, grouped-query attention,
//     vocab-parallel loss), each exchange;
//   * pp 2 x cp 2 (GPT-2 in two 1F1B stages), each exchange;
//   * dp_shard 2 x cp 2 x tp 2 (LLaMA; FSDP over dp_shard x cp composed
//     with tensor parallelism), ring and alltoall.
// Each rank takes its data-parallel rows and its head-tail slice of every
// sequence (cp::shard of the tokens and the targets); the recipe installs
// the exchange and the positions. Also the transform's named errors.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "core/testing/error_of.h"
#include "distributed/init.h"
#include "distributed/parallel/cp/context_parallel.h"
#include "distributed/parallel/cp/load_balance.h"
#include "distributed/parallel/recipes/gpt.h"
#include "distributed/parallel/tp/loss_parallel.h"
#include "distributed/testing/multiprocess.h"
#include "nn/transformer.h"
#include "optim/clip_grad.h"
#include "optim/optimizer.h"

namespace ember::distributed {
namespace {

namespace mp = ::ember::distributed::testing;
using ::ember::testing::error_of;

constexpr int64_t kVocab = 32, kB = 4, kT = 16;
constexpr int kSteps = 3;

std::shared_ptr<nn::GPT> make_gpt(bool llama) {
  manual_seed(7);
  nn::GPTOptions o{.vocab_size = kVocab, .block_size = kT, .n_layer = 2, .n_head = 4, .n_embd = 32, .dropout = 0.0};
  if (llama) {
    o = nn::GPTOptions::llama(o);
    o.n_kv_head = 2;
  }
  return std::make_shared<nn::GPT>(o);
}

// The training batch (the same every step, so that 3 steps visibly learn)
// or, at step 100, the held-out one: tokens and targets (the next token).
std::pair<Tensor, Tensor> batch(int step) {
  Generator g(step < 100 ? 900 : 900 + step);
  Tensor seq = randint(0, kVocab, {kB, kT + 1}, DType::Int64, &g);
  return {seq.narrow(1, 0, kT).contiguous(), seq.narrow(1, 1, kT).contiguous()};
}

struct Run {
  std::vector<double> losses, norms;
  double heldout = 0;
};

Tensor lm_loss(const Tensor& logits, const Tensor& y) { return parallel_cross_entropy(logits, y); }

Run reference(bool llama) {
  auto gpt = make_gpt(llama);
  optim::AdamW opt(gpt->parameters(), {.lr = 1e-2});
  Run r;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    Tensor loss = lm_loss((*gpt)(x), y);
    loss.backward();
    r.norms.push_back(optim::clip_grad_norm_(gpt->parameters(), 1.0));
    opt.step();
    opt.zero_grad();
    r.losses.push_back(loss.item());
  }
  NoGradGuard ng;
  auto [x, y] = batch(100);
  r.heldout = lm_loss((*gpt)(x), y).item();
  return r;
}

double mean_over(const DeviceMesh& mesh, const char* view, double v) {
  Tensor t = Tensor::from_vector({v}, {1}, DType::Float64);
  mesh.submesh({view})->group()->allreduce(t, ReduceOp::Avg)->wait();
  return t.item();
}

void expect_same(const Run& got, const Run& want, const std::string& what);

void run_case(const mp::WorkerEnv& env, const ParallelDims& want_dims, bool llama) {
  const cp::Exchange ex = cp::parse_exchange(mp::parse_arg(env.arg).at("exchange"));
  const Run want = reference(llama);
  const ParallelDims dims = want_dims.resolved(env.world_size);
  auto mesh = dims.build_mesh();
  auto gpt = make_gpt(llama);
  Parallelized par = parallelize_gpt(gpt, dims, mesh, {.cp = {.exchange = ex, .seq = kT}});
  optim::AdamW opt(gpt->parameters(), {.lr = 1e-2});
  const int cp = dims.cp, cp_rank = mesh->coordinate("cp");
  const int64_t rows = kB / dims.dp(), from = dims.dp_rank(*mesh) * rows;
  auto loss_of = [&](int step) {
    auto [x, y] = batch(step);
    x = cp::shard(x.narrow(0, from, rows), 1, cp, cp_rank).contiguous();
    y = cp::shard(y.narrow(0, from, rows), 1, cp, cp_rank).contiguous();
    return lm_loss((*gpt)(x), y);
  };
  Run got;
  for (int s = 0; s < kSteps; ++s) {
    Tensor loss = loss_of(s);
    loss.backward();
    got.norms.push_back(par.clip_grad_norm_(1.0));
    opt.step();
    opt.zero_grad();
    got.losses.push_back(mean_over(*mesh, "dp_cp", loss.item()));
  }
  {
    NoGradGuard ng;
    got.heldout = mean_over(*mesh, "dp_cp", loss_of(100).item());
  }
  expect_same(got, want, dims.line() + " " + cp::exchange_name(ex) + (llama ? " llama" : " gpt2"));
}

void expect_same(const Run& got, const Run& want, const std::string& what) {
  for (int s = 0; s < kSteps; ++s) {
    WCHECK(std::abs(got.losses[s] - want.losses[s]) <= 2e-5 * (1 + want.losses[s]), what, " step ", s, " loss ",
           got.losses[s], " vs one process ", want.losses[s]);
    WCHECK(std::abs(got.norms[s] - want.norms[s]) <= 2e-5 * (1 + want.norms[s]), what, " step ", s, " gradient norm ",
           got.norms[s], " vs one process ", want.norms[s]);
  }
  WCHECK(std::abs(got.heldout - want.heldout) <= 2e-5 * (1 + want.heldout), what, " held-out loss ", got.heldout,
         " vs one process ", want.heldout);
  WCHECK(want.losses.back() < want.losses.front(), what, ": the reference did not learn");
}

EMBER_WORKER(dp_shard_cp) {
  mp::init_world(env);
  run_case(env, ParallelDims{.dp_shard = 2, .cp = 2}, /*llama=*/false);
}

// All three: FSDP over the flattened dp_shard x cp view composed with
// tensor parallelism's DTensor specs (described on the whole mesh, dim 0
// sharded by dp_shard and by cp).
EMBER_WORKER(dp_shard_cp_tp) {
  mp::init_world(env);
  run_case(env, ParallelDims{.dp_shard = 2, .cp = 2, .tp = 2}, /*llama=*/true);
}

EMBER_WORKER(cp_tp) {
  mp::init_world(env);
  run_case(env, ParallelDims{.dp_shard = 1, .cp = 2, .tp = 2}, /*llama=*/true);
}

// pp 2 x cp 2: the GPT-2 cut into 2 stages (the first embeds this rank's
// chunks' learned positions), 1F1B over 2 micro-batches, FSDP in each.
EMBER_WORKER(pp_cp) {
  mp::init_world(env);
  const cp::Exchange ex = cp::parse_exchange(mp::parse_arg(env.arg).at("exchange"));
  const Run want = reference(false);
  const ParallelDims dims = ParallelDims{.pp = 2, .dp_shard = 1, .cp = 2}.resolved(env.world_size);
  auto mesh = dims.build_mesh();
  const int micro = 2;
  const auto schedule = pp::make_schedule("1f1b", dims.pp, 1, micro);
  auto loss_fn = [](const Tensor& out, const Tensor& y) { return lm_loss(out, y); };
  PipelineParallel pipe =
      pipeline_gpt(make_gpt(false), dims, mesh, schedule, {.cp = {.exchange = ex, .seq = kT}}, {.loss = loss_fn});
  optim::AdamW opt(pipe.part->parameters(), {.lr = 1e-2});
  const int cp = dims.cp, cp_rank = mesh->coordinate("cp");
  const int64_t rows = kB / micro;
  auto slices = [&](int step) {
    auto [x, y] = batch(step);
    std::vector<Tensor> xs, ys;
    for (int m = 0; m < micro; ++m) {
      xs.push_back(cp::shard(x.narrow(0, m * rows, rows), 1, cp, cp_rank).contiguous());
      ys.push_back(cp::shard(y.narrow(0, m * rows, rows), 1, cp, cp_rank).contiguous());
    }
    return std::pair{xs, ys};
  };
  auto mean_loss = [&](const std::vector<Tensor>& losses) {
    double total = 0;
    for (const Tensor& l : losses) total += l.item() / micro;
    Tensor t = Tensor::from_vector({total}, {1}, DType::Float64);
    mesh->group("pp")->allreduce(t, ReduceOp::Sum)->wait();  // the last stage's ranks hold them
    return mean_over(*mesh, "dp_cp", t.item());
  };
  Run got;
  for (int s = 0; s < kSteps; ++s) {
    auto [xs, ys] = slices(s);
    got.losses.push_back(mean_loss(pipe.pipe->step(xs, ys)));
    got.norms.push_back(pipe.pipe->clip_grad_norm_(1.0));
    opt.step();
    opt.zero_grad();
  }
  pp::Pipeline eval(pp::forward_schedule(dims.pp, 1, micro), pipe.stages, mesh->group("pp"), {.loss = loss_fn});
  {
    NoGradGuard ng;
    auto [xs, ys] = slices(100);
    got.heldout = mean_loss(eval.step(xs, ys));
  }
  expect_same(got, want, dims.line() + " " + cp::exchange_name(ex) + " gpt2");
}

TEST(GptContextParallel, DpShard2xCp2MatchesOneProcess) {
  for (const char* ex : {"ring", "allgather", "alltoall"})
    EMBER_EXPECT_RANKS("dp_shard_cp", 4, {.arg = std::string("exchange=") + ex}) << ex;
}

TEST(GptContextParallel, Pp2xCp2MatchesOneProcess) {
  for (const char* ex : {"ring", "allgather", "alltoall"})
    EMBER_EXPECT_RANKS("pp_cp", 4, {.arg = std::string("exchange=") + ex}) << ex;
}

TEST(GptContextParallel, Cp2xTp2MatchesOneProcess) {
  for (const char* ex : {"ring", "allgather", "alltoall"})
    EMBER_EXPECT_RANKS("cp_tp", 4, {.arg = std::string("exchange=") + ex}) << ex;
}

TEST(GptContextParallel, DpShard2xCp2xTp2MatchesOneProcess) {
  for (const char* ex : {"ring", "alltoall"})
    EMBER_EXPECT_RANKS("dp_shard_cp_tp", 8, {.arg = std::string("exchange=") + ex}) << ex;
}

EMBER_WORKER(cp_errors) {
  mp::init_world(env);
  auto pg = default_group();
  auto gpt = make_gpt(false);
  std::string e = error_of([&] { cp::apply_context_parallel(*gpt, pg, {.seq = 6}); });
  WCHECK(e.find("6") != std::string::npos && e.find("2") != std::string::npos, e);
  e = error_of([&] { cp::apply_context_parallel(*gpt, pg, {.seq = 64}); });
  WCHECK(e.find("exceeds the GPT's block_size 16") != std::string::npos, e);
  auto dropped = std::make_shared<nn::GPT>(
      nn::GPTOptions{.vocab_size = kVocab, .block_size = kT, .n_layer = 1, .n_head = 4, .n_embd = 32, .dropout = 0.1});
  e = error_of([&] { cp::apply_context_parallel(*dropped, pg, {.seq = kT}); });
  WCHECK(e.find("has dropout 0.1") != std::string::npos, e);
  struct OtherAttention : nn::Module {
    OtherAttention() : Module("CrossAttention") {}
    Tensor forward(const Tensor& x) override { return x; }
  };
  auto other = std::make_shared<nn::Sequential>();
  other->push_back(std::make_shared<OtherAttention>());
  e = error_of([&] { cp::apply_context_parallel(*other, pg, {.seq = kT}); });
  WCHECK(e.find("of type CrossAttention is an attention the transform cannot route") != std::string::npos, e);
  auto three = std::make_shared<nn::GPT>(
      nn::GPTOptions{.vocab_size = kVocab, .block_size = kT, .n_layer = 1, .n_head = 3, .n_embd = 24, .dropout = 0.0});
  e = error_of([&] { cp::apply_context_parallel(*three, pg, {.exchange = cp::Exchange::AllToAll, .seq = kT}); });
  WCHECK(e.find("3 heads, which cp 2 does not divide") != std::string::npos, e);
  const ParallelDims dims = ParallelDims{.dp_shard = 1, .cp = 2}.resolved(env.world_size);
  auto mesh = dims.build_mesh();
  e = error_of([&] { parallelize_gpt(make_gpt(false), dims, mesh, {}); });
  WCHECK(e.find("cp=2 needs the sequence length") != std::string::npos, e);
}

TEST(GptContextParallel, NamedErrors) { EMBER_EXPECT_RANKS("cp_errors", 2); }

}  // namespace
}  // namespace ember::distributed
