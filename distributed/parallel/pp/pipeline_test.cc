// Pipelines on real processes. Every worker trains a small GPT twice: alone
// in-process (the reference: the same micro-batches accumulated one after
// another, in the order the schedule runs their backwards) and as its pp
// rank's stages under the schedule; after several AdamW steps every
// parameter it holds must equal the reference's bit for bit (float32 on
// the CPU, same order of additions), the last stage's losses too. Tied
// embeddings (summed across the first and last stage) within a tolerance;
// the global clipping norm; the splits; stages that disagree or die.
#include "distributed/parallel/pp/pipeline.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/ops.h"
#include "core/testing/error_of.h"
#include "distributed/checkpoint/sharded.h"
#include "distributed/device_mesh.h"
#include "distributed/init.h"
#include "distributed/parallel/fsdp/fsdp.h"
#include "distributed/parallel/tp/gpt_plan.h"
#include "distributed/parallel/tp/loss_parallel.h"
#include "distributed/parallel/tp/tensor_parallel.h"
#include "distributed/tensor/dtensor.h"
#include "distributed/testing/multiprocess.h"
#include "nn/functional.h"
#include "optim/clip_grad.h"
#include "optim/optimizer.h"

namespace ember::distributed::pp {
namespace {

namespace mp = ::ember::distributed::testing;
using ::ember::testing::error_of;

constexpr int64_t kMicro = 2, kT = 8;

nn::GPTOptions small_gpt(bool tied, int64_t layers) {
  return {.vocab_size = 23, .block_size = 16, .n_layer = layers, .n_head = 2, .n_embd = 16, .tie_weights = tied};
}

// Micro-batch m of step s: [kMicro, kT] tokens and targets.
std::pair<Tensor, Tensor> micro(int step, int m) {
  Generator g(1000 + 97 * step + m);
  return {randint(0, 23, {kMicro, kT}, DType::Int64, &g), randint(0, 23, {kMicro, kT}, DType::Int64, &g)};
}

Tensor lm_loss(const Tensor& logits, const Tensor& target) {
  return nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}));
}

// The order in which a schedule runs the micro-batches' backwards (the
// same on every stage of these schedules).
std::vector<int> backward_order(const Schedule& s) {
  std::vector<int> order;
  for (const Action& a : s.actions[s.rank_of(s.num_stages() - 1)])
    if (a.kind == ActionKind::B && a.stage == s.num_stages() - 1) order.push_back(a.mb);
  return order;
}

struct Spec {
  std::string schedule = "1f1b";
  int V = 1, M = 4, steps = 3;
  bool tied = false, clip = false;
  bool ordered = false;  // transfers matched in the sender's order (NCCL's rule) instead of by tag
  std::string save;      // a directory: save a sharded checkpoint at the end, rank 0 reads it back
};

Spec parse(const std::string& arg) {
  auto o = mp::parse_arg(arg);
  Spec s;
  if (o.count("schedule")) s.schedule = o["schedule"];
  if (o.count("V")) s.V = std::stoi(o["V"]);
  if (o.count("M")) s.M = std::stoi(o["M"]);
  s.tied = o.count("tied") != 0;
  s.clip = o.count("clip") != 0;
  s.ordered = o.count("ordered") != 0;
  if (o.count("save")) s.save = o["save"];
  return s;
}

optim::AdamW adamw(const std::vector<Tensor>& params) {
  return optim::AdamW(params, {.lr = 1e-2, .eps = 1e-6, .weight_decay = 0.1});
}

// `steps` AdamW steps of one process, each accumulating micro-batches
// `order` of micro(step, m) with their losses scaled by `scale`.
void train_reference(nn::GPT& ref, int steps, const std::vector<int>& order, double scale) {
  optim::AdamW opt = adamw(ref.parameters());
  for (int step = 0; step < steps; ++step) {
    for (int m : order) {
      auto [x, y] = micro(step, m);
      (lm_loss(ref(x), y) * scale).backward();
    }
    opt.step();
    opt.zero_grad();
  }
}

// `steps` AdamW steps of a pipeline on micro(step, first + m), m < M.
void train_pipeline(Pipeline& pipe, int steps, int first, int M) {
  optim::AdamW opt = adamw(pipe.parameters());
  for (int step = 0; step < steps; ++step) {
    std::vector<Tensor> xs, ys;
    for (int m = 0; m < M; ++m) {
      auto [x, y] = micro(step, first + m);
      xs.push_back(x), ys.push_back(y);
    }
    pipe.step(xs, ys);
    opt.step();
    opt.zero_grad();
  }
}

// Every parameter of `st` (whole, for a DTensor) within `tol` of the one
// process's of the same name.
void check_close(PipelineStage& st, nn::GPT& ref, double tol, bool dtensors) {
  for (auto& [pn, p] : st.named_parameters()) {
    Tensor want;
    for (auto& [rn, rp] : ref.named_parameters())
      if (rn == pn) want = rp;
    WCHECK(want.defined() && (!dtensors || is_dtensor(p)), pn);
    const Tensor got = is_dtensor(p) ? as_dtensor(p).full_tensor() : p.detach();
    const double err = max(abs(got - want)).item();
    WCHECK(err <= tol, st.description(), ": ", pn, " differs from one process by ", err);
  }
}

// Clips the pipeline's gradients to 0.3: the global norm must be one
// process's (which clipping must have changed something at).
void clip_as_reference(Pipeline& pipe, double ref_norm, int step) {
  const double norm = pipe.clip_grad_norm_(0.3);
  WCHECK(std::abs(norm - ref_norm) <= 1e-5 * ref_norm && ref_norm > 0.3, "step ", step, " norm ", norm,
         " vs one process ", ref_norm);
}

EMBER_WORKER(gpt) {
  mp::init_world(env);
  const Spec spec = parse(env.arg);
  const int P = env.world_size, S = P * spec.V;
  const Schedule sched = make_schedule(spec.schedule, P, spec.V, spec.M);
  const int64_t layers = std::max(S, 2);

  // The reference: one process, the micro-batches accumulated in order.
  manual_seed(7);
  nn::GPT ref(small_gpt(spec.tied, layers));
  optim::AdamW ref_opt = adamw(ref.parameters());
  std::vector<std::vector<double>> ref_losses;
  std::vector<double> ref_norms;
  for (int step = 0; step < spec.steps; ++step) {
    ref_losses.emplace_back(spec.M);
    for (int m : backward_order(sched)) {
      auto [x, y] = micro(step, m);
      Tensor loss = lm_loss(ref(x), y);
      ref_losses.back()[m] = loss.item();
      (loss * (1.0 / spec.M)).backward();
    }
    if (spec.clip) ref_norms.push_back(optim::clip_grad_norm_(ref.parameters(), 0.3));
    ref_opt.step();
    ref_opt.zero_grad();
  }

  // The pipeline: the same initial model, cut; this rank keeps its stages.
  manual_seed(7);
  nn::GPT whole(small_gpt(spec.tied, layers));
  auto all = split_gpt(whole, S);
  std::vector<std::shared_ptr<PipelineStage>> mine;
  for (int s : sched.stages_of(env.rank)) mine.push_back(all[s]);
  Pipeline pipe(sched, mine, default_group(), {.loss = lm_loss, .ordered_transfers = spec.ordered});
  optim::AdamW opt = adamw(pipe.parameters());
  const bool last = sched.rank_of(S - 1) == env.rank;
  // Bit for bit, unless the gradients were summed in another order (tied
  // weights: two stages' parts added after the step's backwards; clipping:
  // a norm summed over ranks).
  const bool exact = !spec.tied && !spec.clip;
  for (int step = 0; step < spec.steps; ++step) {
    std::vector<Tensor> xs, ys;
    for (int m = 0; m < spec.M; ++m) {
      auto [x, y] = micro(step, m);
      xs.push_back(x), ys.push_back(y);
    }
    std::vector<Tensor> losses = pipe.step(xs, ys);
    WCHECK(static_cast<int>(losses.size()) == (last ? spec.M : 0), losses.size());
    for (size_t m = 0; m < losses.size(); ++m)
      WCHECK(exact ? losses[m].item() == ref_losses[step][m]
                   : std::abs(losses[m].item() - ref_losses[step][m]) <= 1e-5 * ref_losses[step][m],
             "step ", step, " micro-batch ", m, " loss ", losses[m].item(), " vs one process ", ref_losses[step][m]);
    if (spec.clip) clip_as_reference(pipe, ref_norms[step], step);
    opt.step();
    opt.zero_grad();
  }
  int checked = 0;
  for (auto& st : mine)
    for (auto& [name, p] : st->named_parameters()) {
      Tensor want;
      for (auto& [rn, rp] : ref.named_parameters())
        if (rn == name) want = rp;
      WCHECK(want.defined(), name, " is not a parameter of the unsplit model");
      const double err = max(abs(p.detach() - want)).item();
      WCHECK(exact ? err == 0 : err <= 2e-4, st->description(), ": ", name, " differs from one process by ", err);
      ++checked;
    }
  WCHECK(checked > 0, "rank ", env.rank, " checked no parameter");
  {
    // Evaluation: forwards only, another shape (one sequence per
    // micro-batch), the trained weights' losses as one process's.
    Pipeline eval(forward_schedule(P, spec.V, 3), mine, default_group(),
                  {.loss = lm_loss, .ordered_transfers = spec.ordered});
    std::vector<Tensor> xs, ys;
    for (int m = 0; m < 3; ++m) {
      auto [x, y] = micro(99, m);
      xs.push_back(x.narrow(0, 0, 1)), ys.push_back(y.narrow(0, 0, 1));
    }
    std::vector<Tensor> losses = eval.step(xs, ys);
    WCHECK(static_cast<int>(losses.size()) == (last ? 3 : 0), losses.size());
    NoGradGuard ng;
    for (size_t m = 0; m < losses.size(); ++m) {
      const double want = lm_loss(ref(xs[m]), ys[m]).item();
      WCHECK(exact ? losses[m].item() == want : std::abs(losses[m].item() - want) <= 1e-4 * want, "evaluation ", m,
             ": ", losses[m].item(), " vs one process ", want);
      WCHECK(!losses[m].requires_grad(), "evaluation recorded a graph");
    }
  }
  if (!spec.save.empty()) {
    // Each rank writes its stages' tensors; the checkpoint is the unsplit
    // model's: every name once, optimizer state included.
    auto part = rank_part(mine);
    TrainingState state;
    state.step = spec.steps;
    auto st = save_sharded_checkpoint(spec.save, *part, &opt, nullptr, state, *default_group());
    WCHECK(st.ok(), st.message());
    if (env.rank == 0) {
      auto index = read_checkpoint_index(spec.save);
      WCHECK(index.ok(), index.status().message());
      for (auto& [name, want] : ref.named_parameters()) {
        const auto* entry = index->find(name);
        WCHECK(entry != nullptr, name, " is not in the checkpoint");
        auto got = read_checkpoint_tensor(spec.save, *entry);
        WCHECK(got.ok(), got.status().message());
        WCHECK(max(abs(*got - want)).item() == 0, name, " read back differs from one process");
        WCHECK(index->find("optim.state." + name + ".exp_avg") != nullptr, name, ": no optimizer state saved");
      }
    }
  }
  default_group()->barrier()->wait();
}

void run(int world, const std::string& arg) { EMBER_EXPECT_RANKS("gpt", world, {.arg = arg}); }

TEST(Pipeline, GPipeP2MatchesOneProcess) { run(2, "schedule=gpipe,M=4"); }
TEST(Pipeline, OneFOneBP2MatchesOneProcess) { run(2, "schedule=1f1b,M=4"); }
TEST(Pipeline, ZeroBubbleP2MatchesOneProcess) { run(2, "schedule=zb-h1,M=4"); }
TEST(Pipeline, InterleavedP2V2MatchesOneProcess) { run(2, "schedule=interleaved,V=2,M=4"); }
TEST(Pipeline, GPipeP4MatchesOneProcess) { run(4, "schedule=gpipe,M=6"); }
TEST(Pipeline, OneFOneBP4MatchesOneProcess) { run(4, "schedule=1f1b,M=6"); }
TEST(Pipeline, ZeroBubbleP4MatchesOneProcess) { run(4, "schedule=zb-h1,M=6"); }
TEST(Pipeline, InterleavedP4V2MatchesOneProcess) { run(4, "schedule=interleaved,V=2,M=8"); }
TEST(Pipeline, OneRankTwoStagesHandsOverLocally) { run(1, "schedule=gpipe,V=2,M=3"); }
TEST(Pipeline, TiedEmbeddingsAcrossFirstAndLastStage) { run(2, "schedule=1f1b,M=4,tied"); }
TEST(Pipeline, TiedEmbeddingsZeroBubbleP4) { run(4, "schedule=zb-h1,M=4,tied"); }
TEST(Pipeline, GlobalNormClipsAsOneProcess) { run(2, "schedule=1f1b,M=4,clip"); }
// Transfers matched in each sender's order, as NCCL matches them (no
// tags): every schedule, the interleaved ones with two boundaries on each
// pair of ranks, tied weights; bit for bit as by tag.
TEST(Pipeline, OrderedTransfersEverySchedule) {
  run(2, "schedule=1f1b,M=4,ordered");
  run(2, "schedule=interleaved,V=2,M=4,ordered");
  run(4, "schedule=zb-h1,M=6,ordered");
  run(4, "schedule=interleaved,V=2,M=8,ordered");
  run(4, "schedule=gpipe,M=4,tied,ordered");
}
TEST(Pipeline, ShardedCheckpointIsTheUnsplitModels) {
  const std::string dir = ::testing::TempDir() + "/pp_ckpt";
  run(2, "schedule=interleaved,V=2,M=2,save=" + dir);
}

// Tensor parallelism inside the stages: a 2 x 2 mesh (pp outermost), the
// stages' share of the GPT plan, the vocab-parallel loss; against one
// process within a tolerance (tensor parallelism sums in another order).
EMBER_WORKER(tp_pp) {
  mp::init_world(env);
  auto o = mp::parse_arg(env.arg);
  const bool sp = o.count("sp") != 0;
  const std::string name = o.count("schedule") ? o["schedule"] : "1f1b";
  const int M = 4, steps = 2;
  auto mesh = DeviceMesh::create({2, 2}, {"pp", "tp"});
  const Schedule sched = make_schedule(name, 2, 1, M);
  manual_seed(7);
  nn::GPT ref(small_gpt(false, 2));
  train_reference(ref, steps, backward_order(sched), 1.0 / M);
  manual_seed(7);
  nn::GPT whole(small_gpt(false, 2));
  auto all = split_gpt(whole, 2);
  auto st = all[mesh->coordinate("pp")];
  parallelize_module(*st, mesh->submesh({"tp"}), plan_for(gpt_tp_plan(whole, sp), *st));
  Pipeline pipe(sched, {st}, mesh->group("pp"),
                {.loss = [](const Tensor& logits, const Tensor& y) { return parallel_cross_entropy(logits, y); }});
  train_pipeline(pipe, steps, 0, M);
  check_close(*st, ref, 2e-4, /*dtensors=*/true);
  default_group()->barrier()->wait();
}

TEST(Pipeline, TensorParallelInsideStagesTp2Pp2) {
  for (const char* arg : {"schedule=1f1b", "schedule=zb-h1,sp"}) {
    EMBER_EXPECT_RANKS("tp_pp", 4, {.arg = arg});
  }
}

// Replicas of a pipeline: a 2 x 2 mesh (pp, dp), each replica on its own
// micro-batches, gradients averaged over dp; against one process
// accumulating all of them (within a tolerance: another order of sums).
EMBER_WORKER(dp_pp) {
  mp::init_world(env);
  const int M = 3, steps = 3;
  auto mesh = DeviceMesh::create({2, 2}, {"pp", "dp"});
  const Schedule sched = make_schedule(env.arg.empty() ? "1f1b" : env.arg, 2, 1, M);
  manual_seed(7);
  nn::GPT ref(small_gpt(false, 2));
  std::vector<int> both(2 * M);
  for (int m = 0; m < 2 * M; ++m) both[m] = m;
  train_reference(ref, steps, both, 1.0 / (2 * M));
  manual_seed(7);
  nn::GPT whole(small_gpt(false, 2));
  auto all = split_gpt(whole, 2);
  auto st = all[mesh->coordinate("pp")];
  Pipeline pipe(sched, {st}, mesh->group("pp"), {.loss = lm_loss, .dp_group = mesh->group("dp")});
  train_pipeline(pipe, steps, mesh->coordinate("dp") * M, M);
  check_close(*st, ref, 2e-4, /*dtensors=*/false);
  default_group()->barrier()->wait();
}

TEST(Pipeline, ReplicasAverageGradientsDp2Pp2) {
  for (const char* arg : {"1f1b", "zb-h1"}) {
    EMBER_EXPECT_RANKS("dp_pp", 4, {.arg = arg});
  }
}

// Over NCCL (two GPUs or more; skipped elsewhere): 1F1B and interleaved
// 1F1B on two ranks, every transfer on its pair's own communicator and
// stream (ProcessGroup::connect_p2p); the losses and parameters within a
// tolerance of one process on the CPU (cuBLAS sums in another order).
EMBER_WORKER(nccl_pp) {
  InitOptions io;
  io.rank = env.rank;
  io.world_size = env.world_size;
  io.store = env.store();
  io.backend = "nccl";
  init_process_group(io);
  const Device gpu = cuda_device(env.rank);
  for (const std::string name : {"1f1b", "interleaved"}) {
    const int V = name == "interleaved" ? 2 : 1, M = 4, steps = 2;
    const Schedule sched = make_schedule(name, 2, V, M);
    manual_seed(7);
    nn::GPT ref(small_gpt(true, 2 * V));
    train_reference(ref, steps, backward_order(sched), 1.0 / M);
    manual_seed(7);
    nn::GPT whole(small_gpt(true, 2 * V));
    whole.to(gpu);
    auto all = split_gpt(whole, 2 * V);
    std::vector<std::shared_ptr<PipelineStage>> mine;
    for (int st : sched.stages_of(env.rank)) mine.push_back(all[st]);
    Pipeline pipe(sched, mine, default_group(), {.loss = lm_loss});
    optim::AdamW opt = adamw(pipe.parameters());
    for (int step = 0; step < steps; ++step) {
      std::vector<Tensor> xs, ys;
      for (int m = 0; m < M; ++m) {
        auto [x, y] = micro(step, m);
        xs.push_back(x.to(gpu)), ys.push_back(y.to(gpu));
      }
      pipe.step(xs, ys);
      opt.step();
      opt.zero_grad();
    }
    for (auto& st : mine)
      for (auto& [pn, p] : st->named_parameters()) {
        Tensor want;
        for (auto& [rn, rp] : ref.named_parameters())
          if (rn == pn) want = rp;
        const double err = max(abs(p.detach().to(kCPU) - want)).item();
        WCHECK(err <= 1e-3, name, ": ", pn, " differs from one process by ", err);
      }
  }
  default_group()->barrier()->wait();
}

TEST(Pipeline, OverNcclOnTwoGpus) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two GPUs (NCCL puts one rank on each)";
  EMBER_EXPECT_RANKS("nccl_pp", 2, {});
}

// FSDP inside the stages: a (pp, dp_shard) mesh of 2 x 2, or with
// "hsdp" (pp, dp_replicate, dp_shard) of 2 x 2 x 2; every block of a stage
// a unit, the stage the root; each data-parallel rank on its own
// micro-batches. Against one process accumulating all of them (within a
// tolerance: the reduce-scatter sums in another order), read back whole
// through each stage's full state dict; the units sharded again after
// each step; evaluation through the sharded stages; a sharded checkpoint
// that is the unsplit model's.
EMBER_WORKER(fsdp_pp) {
  mp::init_world(env);
  auto o = mp::parse_arg(env.arg);
  const std::string name = o.count("schedule") ? o["schedule"] : "1f1b";
  const int V = o.count("V") ? std::stoi(o["V"]) : 1, M = 4, steps = 3;
  const bool tied = o.count("tied") != 0, clip = o.count("clip") != 0, hsdp = o.count("hsdp") != 0;
  auto mesh = hsdp ? DeviceMesh::create({2, 2, 2}, {"pp", "dp_replicate", "dp_shard"})
                   : DeviceMesh::create({2, 2}, {"pp", "dp_shard"});
  const int dp = hsdp ? 4 : 2;
  const int dp_rank =
      hsdp ? mesh->coordinate("dp_replicate") * 2 + mesh->coordinate("dp_shard") : mesh->coordinate("dp_shard");
  const Schedule sched = make_schedule(name, 2, V, M);
  const int64_t layers = 2 * V;
  manual_seed(7);
  nn::GPT ref(small_gpt(tied, layers));
  optim::AdamW ref_opt = adamw(ref.parameters());
  std::vector<double> ref_norms;
  for (int step = 0; step < steps; ++step) {
    for (int m = 0; m < dp * M; ++m) {
      auto [x, y] = micro(step, m);
      (lm_loss(ref(x), y) * (1.0 / (dp * M))).backward();
    }
    if (clip) ref_norms.push_back(optim::clip_grad_norm_(ref.parameters(), 0.3));
    ref_opt.step();
    ref_opt.zero_grad();
  }

  manual_seed(7);
  nn::GPT whole(small_gpt(tied, layers));
  auto all = split_gpt(whole, 2 * V);
  std::vector<std::shared_ptr<PipelineStage>> mine;
  std::vector<std::shared_ptr<FSDPModule>> roots;
  FSDPOptions fo;
  fo.mesh = hsdp ? mesh->submesh({"dp_replicate", "dp_shard"}) : mesh->submesh({"dp_shard"});
  fo.strategy = hsdp ? ShardingStrategy::HYBRID_SHARD : ShardingStrategy::FULL_SHARD;
  for (int s : sched.stages_of(mesh->coordinate("pp"))) {
    mine.push_back(all[s]);
    roots.push_back(fully_shard_auto(all[s], {.types = {"TransformerBlock"}}, fo));
  }
  Pipeline pipe(sched, mine, mesh->group("pp"), {.loss = lm_loss});
  optim::AdamW opt = adamw(pipe.parameters());
  for (int step = 0; step < steps; ++step) {
    std::vector<Tensor> xs, ys;
    for (int m = 0; m < M; ++m) {
      auto [x, y] = micro(step, dp_rank * M + m);
      xs.push_back(x), ys.push_back(y);
    }
    pipe.step(xs, ys);
    for (auto& r : roots) {
      const auto mem = r->memory();
      WCHECK(mem.unsharded_params == 0 && mem.unsharded_grads == 0 && mem.sharded_grads > 0, "after step ", step,
             " the units hold ", mem.unsharded_params, " gathered parameter bytes, ", mem.unsharded_grads,
             " whole gradient bytes, ", mem.sharded_grads, " sharded gradient bytes");
    }
    if (clip) clip_as_reference(pipe, ref_norms[step], step);
    opt.step();
    opt.zero_grad();
  }
  int checked = 0;
  for (auto& r : roots) {
    const nn::StateDict sd = full_state_dict(*r, {.rank0_only = false});
    for (auto& [pn, got] : sd.items()) {
      Tensor want;
      for (auto& [rn, rp] : ref.named_parameters())
        if (rn == pn) want = rp;
      if (!want.defined()) continue;  // a buffer
      const double err = max(abs(got - want)).item();
      WCHECK(err <= 2e-4, r->module().type_name(), ": ", pn, " differs from one process by ", err);
      ++checked;
    }
  }
  WCHECK(checked > 0, "rank ", env.rank, " checked no parameter");
  {
    // Replicas averaged by the pipeline on top of FSDP's own reduction: refused.
    Pipeline both(sched, mine, mesh->group("pp"), {.loss = lm_loss, .dp_group = fo.mesh->group(0)});
    std::vector<Tensor> xs, ys;
    for (int m = 0; m < M; ++m) {
      auto [x, y] = micro(0, m);
      xs.push_back(x), ys.push_back(y);
    }
    const std::string e = error_of([&] { both.step(xs, ys); });
    WCHECK(e.find("stages wrapped by fully_shard reduce their own") != std::string::npos, e);
  }
  {
    Pipeline eval(forward_schedule(2, V, 2), mine, mesh->group("pp"), {.loss = lm_loss});
    std::vector<Tensor> xs, ys;
    for (int m = 0; m < 2; ++m) {
      auto [x, y] = micro(99, m);
      xs.push_back(x), ys.push_back(y);
    }
    std::vector<Tensor> losses = eval.step(xs, ys);
    NoGradGuard ng;
    for (size_t m = 0; m < losses.size(); ++m) {
      const double want = lm_loss(ref(xs[m]), ys[m]).item();
      WCHECK(std::abs(losses[m].item() - want) <= 1e-4 * want, "evaluation ", m, ": ", losses[m].item(),
             " vs one process ", want);
    }
  }
  if (o.count("save")) {
    const std::string dir = o["save"];
    TrainingState state;
    state.step = steps;
    auto st = save_sharded_checkpoint(dir, *rank_part(mine), &opt, nullptr, state, *default_group());
    WCHECK(st.ok(), st.message());
    if (env.rank == 0) {
      auto index = read_checkpoint_index(dir);
      WCHECK(index.ok(), index.status().message());
      for (auto& [pn, want] : ref.named_parameters()) {
        const auto* entry = index->find(pn);
        WCHECK(entry != nullptr, pn, " is not in the checkpoint");
        auto got = read_checkpoint_tensor(dir, *entry);
        WCHECK(got.ok(), got.status().message());
        WCHECK(max(abs(*got - want)).item() <= 2e-4, pn, " read back differs from one process");
        WCHECK(index->find("optim.state." + pn + ".exp_avg") != nullptr, pn, ": no optimizer state saved");
      }
    }
  }
  default_group()->barrier()->wait();
}

TEST(Pipeline, FullyShardedStagesPp2DpShard2) {
  const std::string dir = ::testing::TempDir() + "/pp_fsdp_ckpt";
  for (const std::string& arg :
       std::vector<std::string>{"schedule=1f1b,tied,clip", "schedule=zb-h1,tied,save=" + dir + "_tied",
                                "schedule=interleaved,V=2,save=" + dir}) {
    EMBER_EXPECT_RANKS("fsdp_pp", 4, {.arg = arg});
  }
}

TEST(Pipeline, HybridShardedStagesPp2Replicate2Shard2) {
  EMBER_EXPECT_RANKS("fsdp_pp", 8, {.arg = "schedule=1f1b,tied,hsdp"});
}

// A valid hand-written zero-bubble schedule whose transfers interleave so
// that a receive was posted behind a send its peer answers late: with
// sends and receives completing in one queue it hung until the timeout;
// they complete independently now. The losses are one process's.
EMBER_WORKER(hand_schedule) {
  mp::init_world(env, std::chrono::seconds(30));
  auto A = [](ActionKind k, int mb) { return Action{k, mb, 0}; };
  auto Bk = [](ActionKind k, int mb) { return Action{k, mb, 1}; };
  using K = ActionKind;
  std::vector<std::vector<Action>> compute{
      {A(K::F, 3), A(K::F, 2), A(K::B, 3), A(K::F, 0), A(K::W, 3), A(K::B, 2), A(K::W, 2), A(K::F, 1), A(K::B, 0),
       A(K::W, 0), A(K::B, 1), A(K::W, 1)},
      {Bk(K::F, 3), Bk(K::B, 3), Bk(K::W, 3), Bk(K::F, 2), Bk(K::B, 2), Bk(K::W, 2), Bk(K::F, 1), Bk(K::B, 1),
       Bk(K::W, 1), Bk(K::F, 0), Bk(K::B, 0), Bk(K::W, 0)}};
  const Schedule sched = with_communication("hand", 2, 1, 4, compute);
  validate(sched);
  manual_seed(7);
  nn::GPT ref(small_gpt(false, 2));
  manual_seed(7);
  nn::GPT whole(small_gpt(false, 2));
  auto all = split_gpt(whole, 2);
  Pipeline pipe(sched, {all[env.rank]}, default_group(), {.loss = lm_loss});
  std::vector<Tensor> xs, ys;
  for (int m = 0; m < 4; ++m) {
    auto [x, y] = micro(0, m);
    xs.push_back(x), ys.push_back(y);
  }
  std::vector<Tensor> losses = pipe.step(xs, ys);
  NoGradGuard ng;
  for (size_t m = 0; m < losses.size(); ++m)
    WCHECK(losses[m].item() == lm_loss(ref(xs[m]), ys[m]).item(), "micro-batch ", m);
  default_group()->barrier()->wait();
}

TEST(Pipeline, TransfersCompleteIndependently) {
  EMBER_EXPECT_RANKS("hand_schedule", 2, {.deadline = std::chrono::seconds(60)});
}

EMBER_WORKER(disagree) {
  mp::init_world(env);
  // Rank 1 was given another schedule (or micro-batch count).
  const bool other_m = env.arg == "microbatches";
  const std::string name = env.rank == 1 && !other_m ? "gpipe" : "1f1b";
  const int M = env.rank == 1 && other_m ? 6 : 4;
  const Schedule sched = make_schedule(name, 2, 1, M);
  manual_seed(7);
  nn::GPT whole(small_gpt(false, 2));
  auto all = split_gpt(whole, 2);
  Pipeline pipe(sched, {all[env.rank]}, default_group(), {.loss = lm_loss});
  std::vector<Tensor> xs, ys;
  for (int m = 0; m < M; ++m) {
    auto [x, y] = micro(0, m);
    xs.push_back(x), ys.push_back(y);
  }
  const std::string e = error_of([&] { pipe.step(xs, ys); });
  WCHECK(e.find("disagree at the first step") != std::string::npos, e);
  WCHECK(e.find(other_m ? "6 micro-batches" : "gpipe") != std::string::npos, e);
}

TEST(Pipeline, StagesThatDisagreeFailAtTheFirstStep) {
  for (const char* arg : {"schedule", "microbatches"}) {
    EMBER_EXPECT_RANKS("disagree", 2, {.arg = arg});
  }
}

EMBER_WORKER(dies) {
  mp::init_world(env, std::chrono::seconds(60));
  const Schedule sched = make_schedule("1f1b", 2, 1, 4);
  manual_seed(7);
  nn::GPT whole(small_gpt(false, 2));
  auto all = split_gpt(whole, 2);
  std::shared_ptr<PipelineStage> st = all[env.rank];
  if (env.rank == 1) {
    // Stage 1 dies in its second micro-batch's forward.
    auto inner = st;
    int calls = 0;
    st = std::make_shared<PipelineStage>(1, 2, "dies", [inner, calls](PipelineStage&, const Tensor& x) mutable {
      if (++calls == 2) _exit(3);
      return (*inner)(x);
    });
  }
  Pipeline pipe(sched, {st}, default_group(), {.loss = lm_loss});
  std::vector<Tensor> xs, ys;
  for (int m = 0; m < 4; ++m) {
    auto [x, y] = micro(0, m);
    xs.push_back(x), ys.push_back(y);
  }
  pipe.step(xs, ys);
}

TEST(Pipeline, AStageThatDiesFailsTheOtherFastNamingIt) {
  mp::RunOptions o;
  o.deadline = std::chrono::seconds(50);
  auto r = mp::run_workers("dies", 2, o);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[1].exit_code, 3) << mp::describe(r);
  // Rank 0 waits in a receive from rank 1: an error, well before the
  // 60-second timeout, that names the peer.
  EXPECT_FALSE(r[0].ok()) << mp::describe(r);
  EXPECT_FALSE(r[0].killed_at_deadline) << mp::describe(r);
  EXPECT_LT(r[0].seconds, 30) << mp::describe(r);
  EXPECT_NE(r[0].output.find("rank 1"), std::string::npos) << mp::describe(r);
}

TEST(Pipeline, SplitsPutEveryLayerInOneStage) {
  manual_seed(1);
  nn::GPT g(small_gpt(false, 6));
  auto st = split_gpt(g, 3, {1, 3, 2});
  std::vector<std::string> names;
  for (auto& s : st)
    for (auto& [n, p] : s->named_parameters()) names.push_back(n);
  std::vector<std::string> want;
  for (auto& [n, p] : g.named_parameters()) want.push_back(n);
  std::sort(names.begin(), names.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(names, want);  // every parameter once, under its own name
  EXPECT_EQ(st[1]->description(), "stage 1 of 3: h.1-h.3");
  EXPECT_NE(error_of([&] {
              split_gpt(g, 3, {1, 3, 1});
            }).find("add up to 5 blocks but the model has 6"),
            std::string::npos);
  EXPECT_NE(error_of([&] { split_gpt(g, 3, {0, 3, 3}); }).find("needs at least one"), std::string::npos);
  EXPECT_NE(error_of([&] { split_gpt(g, 7); }).find("cannot fill 7 stages"), std::string::npos);
  // Balanced: the embeddings weigh on the first stage, the head on the last.
  EXPECT_EQ(balance_by_params({10, 1, 1, 1, 1, 10}, 3), (std::vector<int>{1, 4, 1}));
  EXPECT_EQ(balance_by_params({1, 1, 1, 1}, 2), (std::vector<int>{2, 2}));
  // A Sequential: layer i keeps the name "i".
  nn::Sequential seq;
  for (int i = 0; i < 4; ++i) seq.push_back(std::make_shared<nn::Linear>(3, 3));
  auto ss = split_sequential(seq, 2);
  EXPECT_EQ(ss[1]->named_parameters().front().first, "2.weight");
  Tensor x = randn({2, 3});
  Tensor y = seq(x), z = (*ss[1])((*ss[0])(x));
  EXPECT_EQ(max(abs(y - z)).item(), 0.0);
}

}  // namespace
}  // namespace ember::distributed::pp
