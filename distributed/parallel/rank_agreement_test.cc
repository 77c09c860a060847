// The GradScaler's skip decision across ranks whose optimizers own
// different shards of the parameters (optimizer-state sharding, FSDP): an
// inf that only the owner of one shard sees must make every rank skip the
// step and back off its scale. Each worker runs its shard of the training
// and, beside it, one process with one scaler over all the parameters (the
// reference), and compares its shard value by value. Without the agreement
// the ranks drift apart, which the "nosync" variant shows happening.
#include "distributed/parallel/rank_agreement.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "distributed/comm/backends.h"
#include "distributed/comm/process_group.h"
#include "distributed/init.h"
#include "distributed/store/store.h"
#include "distributed/testing/multiprocess.h"
#include "optim/clip_grad.h"
#include "optim/grad_scaler.h"
#include "optim/optimizer.h"

namespace ember::distributed {
namespace {

namespace mp = ::ember::distributed::testing;

constexpr int kParams = 4;
constexpr int kSteps = 5;
constexpr int kInfStep = 2;  // the step whose gradient holds an inf, on the last rank's shard only

// Parameter i's gradient at step s (loss = sum_i sum(p_i * x_i)).
Tensor data(int i, int s) {
  std::vector<double> v;
  for (int k = 0; k < 3; ++k) v.push_back(0.25 * (i + 1) - 0.5 * k + 0.125 * s);
  return Tensor::from_vector(v, {3});
}

std::vector<Tensor> make_params() {
  std::vector<Tensor> ps;
  for (int i = 0; i < kParams; ++i) ps.push_back(full({3}, 1.0 + i).requires_grad_());
  return ps;
}

// One step: backward of the whole loss (every rank computes every gradient,
// as after a reduce), then the inf that only `inf_param`'s owner sees.
void backward_with_inf(optim::GradScaler& scaler, const std::vector<Tensor>& ps, int s, int inf_param) {
  Tensor loss = zeros({});
  for (int i = 0; i < kParams; ++i) loss = loss + sum(ps[i] * data(i, s));
  scaler.scale(loss).backward();
  if (s == kInfStep && inf_param >= 0) {
    NoGradGuard ng;
    ps[inf_param].grad().narrow(0, 1, 1).fill_(std::numeric_limits<double>::infinity());
  }
}

// arg: "sync" (found_inf_allreduce), "nosync" (no agreement: the ranks must
// be seen to diverge), "empty" (sync; the last rank owns no parameter).
EMBER_WORKER(sharded_scaler) {
  auto pg = make_gloo_group(env.store(), env.rank, env.world_size);
  const int r = env.rank, ws = env.world_size;
  const bool empty = env.arg == "empty";
  const int owners = empty ? ws - 1 : ws;  // parameter i belongs to rank i % owners
  const int inf_param = owners - 1;        // on the last owning rank's shard
  const optim::GradScalerOptions base{.init_scale = 8.0, .growth_interval = 2};

  // The reference: one process, one scaler, every parameter.
  std::vector<Tensor> ref = make_params();
  optim::SGD opt_ref(ref, {.lr = 0.5});
  optim::GradScaler scaler_ref(base);
  std::vector<double> ref_scales;
  for (int s = 0; s < kSteps; ++s) {
    opt_ref.zero_grad();
    backward_with_inf(scaler_ref, ref, s, inf_param);
    scaler_ref.step(opt_ref);
    scaler_ref.update();
    ref_scales.push_back(scaler_ref.get_scale());
  }

  // This rank: the same loss, an optimizer over its shard only.
  std::vector<Tensor> ps = make_params(), mine;
  std::vector<int> mine_idx;
  for (int i = 0; i < kParams; ++i)
    if (i % owners == r) {
      mine.push_back(ps[i]);
      mine_idx.push_back(i);
    }
  optim::GradScalerOptions o = base;
  if (env.arg != "nosync") o.sync_found_inf = found_inf_allreduce(pg);
  optim::GradScaler scaler(o);
  optim::SGD opt(mine.empty() ? std::vector<Tensor>{zeros({1}).requires_grad_()} : mine, {.lr = 0.5});
  std::vector<double> scales;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    for (auto& p : ps) p.set_grad(Tensor());
    backward_with_inf(scaler, ps, s, r == inf_param % owners ? inf_param : -1);
    const bool stepped = scaler.step(opt);
    scaler.update();
    scales.push_back(scaler.get_scale());
    if (env.arg == "nosync") continue;
    WCHECK(stepped == (s != kInfStep), "rank ", r, " step ", s, ": stepped=", stepped);
  }
  // Gather every rank's scale sequence: equal across ranks, and (with the
  // agreement) equal to the reference's.
  Tensor mine_t = Tensor::from_vector(scales, {kSteps});
  Tensor lo = mine_t.clone(), hi = mine_t.clone();
  pg->allreduce(lo, ReduceOp::Min)->wait();
  pg->allreduce(hi, ReduceOp::Max)->wait();
  if (env.arg == "nosync") {
    // The owner of the inf skipped and backed off; the others stepped and
    // kept their scale: the replicas now disagree.
    const double l = lo.to_vector()[kInfStep], h = hi.to_vector()[kInfStep];
    WCHECK(l == ref_scales[kInfStep] && h == 2 * l,
           "without the agreement the scales should diverge at the inf step "
           "(the owner backs off to ",
           ref_scales[kInfStep], ", the others keep twice that); min ", l, " max ", h);
    return;
  }
  WCHECK(lo.to_vector() == hi.to_vector(), "rank ", r, ": the ranks' scales differ");
  WCHECK(scales == ref_scales, "rank ", r, ": scales differ from the one-process reference (step ", kInfStep,
         " backs off to ", ref_scales[kInfStep], ")");
  for (size_t k = 0; k < mine.size(); ++k)
    WCHECK(mine[k].to_vector() == ref[mine_idx[k]].to_vector(), "rank ", r, ": parameter ", mine_idx[k],
           " differs from the reference");
}

mp::RunOptions with_arg(const std::string& arg) {
  mp::RunOptions o;
  o.arg = arg;
  o.deadline = std::chrono::seconds(60);
  return o;
}

// Clipping gradients split over ranks by their global norm: each rank holds
// some of 5 float64 gradients (the last rank none), and the norm returned and
// the clipped gradients equal one process clipping all 5, for the 2-, 1- and
// infinity norms.
EMBER_WORKER(sharded_clip) {
  auto pg = make_gloo_group(env.store(), env.rank, env.world_size);
  const int ws = env.world_size, r = env.rank;
  for (double p : {2.0, 1.0, std::numeric_limits<double>::infinity()}) {
    std::vector<Tensor> all, mine;
    std::vector<int> mine_index;
    for (int i = 0; i < 5; ++i) {
      Tensor a = zeros({3}, DType::Float64).requires_grad_(), b = zeros({3}, DType::Float64).requires_grad_();
      a.set_grad(data(i, 1).to(DType::Float64) * (i + 1.0));
      b.set_grad(data(i, 1).to(DType::Float64) * (i + 1.0));
      all.push_back(a);
      if (i % (ws - 1) == r) {  // the last rank owns nothing
        mine.push_back(b);
        mine_index.push_back(i);
      }
    }
    const double want = optim::clip_grad_norm_(all, 1.0, p);
    const double got = optim::clip_grad_norm_(mine, 1.0, p, grad_norm_allreduce(pg, p));
    WCHECK(std::abs(got - want) <= 1e-12 * want, "norm ", p, ": rank ", r, " got ", got, ", one process ", want);
    WCHECK(want > 1.0, "the test must clip");
    for (size_t k = 0; k < mine.size(); ++k) {
      std::vector<double> g = mine[k].grad().to_vector(), w = all[mine_index[k]].grad().to_vector();
      for (size_t j = 0; j < g.size(); ++j)
        WCHECK(std::abs(g[j] - w[j]) <= 1e-12, "norm ", p, " gradient ", mine_index[k], "[", j, "]: ", g[j], " vs ",
               w[j]);
    }
  }
}

TEST(ShardedClipGradNorm, TheGlobalNormOverRanksEqualsOneProcess) {
  for (int ws : {2, 3}) {
    EMBER_EXPECT_RANKS("sharded_clip", ws);
  }
}

TEST(ShardedGradScaler, EveryRankSkipsWhenOneShardHoldsAnInf) {
  for (int ws : {2, 3}) {
    EMBER_EXPECT_RANKS("sharded_scaler", ws, with_arg("sync"));
  }
}

TEST(ShardedGradScaler, ARankWithoutGradientsStillTakesPartInTheAgreement) {
  EMBER_EXPECT_RANKS("sharded_scaler", 3, with_arg("empty"));
}

TEST(ShardedGradScaler, WithoutTheAgreementTheRanksDiverge) {
  EMBER_EXPECT_RANKS("sharded_scaler", 2, with_arg("nosync"));
}

TEST(ShardedGradScaler, TheHookChecksItsArgument) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  auto store = std::make_shared<FileStore>(std::string(tmp ? tmp : "/tmp") + "/amp_test_store", 1);
  auto fn = found_inf_allreduce(make_gloo_group(store, 0, 1));
  try {
    fn(zeros({3}));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("float32 [2]"), std::string::npos) << e.what();
  }
}

// Where the spawned workers start (see multiprocess.h).
}  // namespace
}  // namespace ember::distributed
