// ZeroRedundancyOptimizer across 2-4 real processes against plain DDP with
// the unsharded optimizer on the same data (the reference, run beside it in
// each worker): parameters after k steps equal exactly (each element goes
// through the same update), and the state consolidated onto rank 0 equals the
// plain optimizer's state dict entry by entry. SGD with momentum, Adam and
// AdamW; gradient accumulation; a parameter that never gets a gradient
// (find_unused_parameters); a learning-rate schedule; loading a full state
// dict into a fresh ZeRO; per-rank state bytes against full / N; and a rank
// dying in the middle of the parameter all-gather failing the others fast.
#include "distributed/parallel/zero.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "distributed/comm/backends.h"
#include "distributed/init.h"
#include "distributed/parallel/ddp.h"
#include "distributed/testing/dying_group.h"
#include "distributed/testing/multiprocess.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "optim/clip_grad.h"
#include "optim/grad_scaler.h"
#include "optim/lr_scheduler.h"
#include "optim/optimizer.h"

namespace ember::distributed {
namespace {

namespace mp = ::ember::distributed::testing;
using Clock = std::chrono::steady_clock;

// Sizes that no world size of 2-4 divides (5*7+7 + 7*3+3 = 66, + 3*2+2).
class Net : public nn::Module {
 public:
  Net(uint64_t seed, bool with_unused) : nn::Module("Net") {
    manual_seed(seed);
    a = register_module("a", std::make_shared<nn::Linear>(5, 7));
    b = register_module("b", std::make_shared<nn::Linear>(7, 3));
    if (with_unused) unused = register_module("unused", std::make_shared<nn::Linear>(3, 2));
  }
  Tensor forward(const Tensor& x) override { return (*b)(tanh((*a)(x))); }
  std::shared_ptr<nn::Linear> a, b, unused;
};

// Rank r's micro-batch i of step s: deterministic, different per rank.
std::pair<Tensor, Tensor> batch(int r, int s, int i) {
  std::vector<double> x, y;
  for (int k = 0; k < 4 * 5; ++k) x.push_back(std::sin(0.37 * k + 1.3 * r + 0.71 * s + 0.19 * i));
  for (int k = 0; k < 4 * 3; ++k) y.push_back(std::cos(0.23 * k + 0.9 * r + 0.31 * s + 0.41 * i));
  return {Tensor::from_vector(x, {4, 5}), Tensor::from_vector(y, {4, 3})};
}

std::unique_ptr<optim::Optimizer> make_opt(const std::string& kind, std::vector<optim::ParamGroup> groups) {
  if (kind == "sgd") return std::make_unique<optim::SGD>(std::move(groups), optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01});
  if (kind == "adamw") return std::make_unique<optim::AdamW>(std::move(groups), optim::AdamWOptions{.lr = 0.01});
  return std::make_unique<optim::Adam>(std::move(groups), optim::AdamOptions{.lr = 0.01, .amsgrad = true});
}

void expect_same_state(const optim::OptimizerStateDict& got, const optim::OptimizerStateDict& want) {
  WCHECK(got.state.size() == want.state.size(), got.state.size(), " state entries vs ", want.state.size());
  for (size_t i = 0; i < got.state.size(); ++i) {
    WCHECK(got.state[i].first == want.state[i].first, "entry ", i, ": ", got.state[i].first, " vs ",
           want.state[i].first);
    mp::check_close(got.state[i].second.reshape(want.state[i].second.sizes()), want.state[i].second, got.state[i].first,
                    0);
  }
  WCHECK(got.param_groups.size() == want.param_groups.size(), "group count");
  for (size_t g = 0; g < got.param_groups.size(); ++g) {
    WCHECK(got.param_groups[g].params == want.param_groups[g].params, "group ", g, " indices");
    for (const auto& [k, v] : want.param_groups[g].options)
      WCHECK(got.param_groups[g].options.at(k) == v, "group ", g, " option ", k);
  }
}

// arg: opt=sgd|adam|adamw, accum=<micro-steps>, unused=0|1, sched=0|1.
EMBER_WORKER(equals_ddp) {
  auto o = mp::parse_arg(env.arg);
  auto pg = make_gloo_group(env.store(), env.rank, env.world_size);
  const int r = env.rank, ws = env.world_size;
  const bool unused = o["unused"] == "1";
  const int accum = o.count("accum") ? std::stoi(o["accum"]) : 1;
  const std::string kind = o["opt"];
  DDPOptions dopts;
  dopts.process_group = pg;
  dopts.find_unused_parameters = unused;
  // Rank-dependent seeds: DDP's broadcast makes them equal.
  auto zero_model = std::make_shared<Net>(1 + r, unused), plain_model = std::make_shared<Net>(1, unused);
  const DType dt = o["dtype"] == "bf16" ? DType::BFloat16 : DType::Float32;
  zero_model->to(kCPU, dt);
  plain_model->to(kCPU, dt);
  auto zero_ddp = std::make_shared<DistributedDataParallel>(zero_model, dopts);
  auto plain_ddp = std::make_shared<DistributedDataParallel>(plain_model, dopts);
  // Two groups, so group options travel: the last layer's lr is halved.
  auto groups = [&](nn::Module& m) {
    auto named = m.named_parameters();
    std::vector<Tensor> first, last;
    for (auto& [name, p] : named) (name.rfind("b.", 0) == 0 ? last : first).push_back(p);
    return std::vector<optim::ParamGroup>{{first, {}}, {last, {{"lr", kind == "sgd" ? 0.025 : 0.005}}}};
  };
  ZeroRedundancyOptimizer zero(groups(*zero_model), [&](auto g) { return make_opt(kind, std::move(g)); }, {pg});
  auto plain = make_opt(kind, groups(*plain_model));
  std::unique_ptr<optim::StepLR> zs, ps;
  if (o["sched"] == "1") {
    zs = std::make_unique<optim::StepLR>(zero, 2, 0.5);
    ps = std::make_unique<optim::StepLR>(*plain, 2, 0.5);
  }
  GradientAccumulator zacc(*zero_ddp, accum), pacc(*plain_ddp, accum);
  // scaler=1: a GradScaler on each side, clipping after unscale_, and step 1
  // overflowing (an inf in one rank's input), which both must skip;
  // step_async on ZeRO (skipped on the device), step() on the plain side.
  const bool scaled = o["scaler"] == "1";
  optim::GradScaler zsc({.init_scale = 1024.0}), psc({.init_scale = 1024.0});
  const int steps = 4;
  for (int s = 0; s < steps; ++s) {
    zero.zero_grad();
    plain->zero_grad();
    for (int i = 0; i < accum; ++i) {
      auto [x, y] = batch(r, s, i);
      x = x.to(dt);
      y = y.to(dt);
      if (scaled && s == 1 && r == 0 && i == 0) {
        NoGradGuard g;
        Tensor first = x.narrow(0, 0, 1);
        first.fill_(std::numeric_limits<double>::infinity());
      }
      auto loss = [&](DistributedDataParallel& m, optim::GradScaler& sc) {
        Tensor l = nn::functional::mse_loss(m(x), y);
        return scaled ? sc.scale(l) : l;
      };
      zacc.backward([&] { return loss(*zero_ddp, zsc); });
      pacc.backward([&] { return loss(*plain_ddp, psc); });
    }
    if (scaled) {
      zsc.unscale_(zero);
      psc.unscale_(*plain);
      const double zn = optim::clip_grad_norm_(zero_model->parameters(), 0.5);
      const double pn = optim::clip_grad_norm_(plain_model->parameters(), 0.5);
      WCHECK(zn == pn || (std::isnan(zn) && std::isnan(pn)), "step ", s, " norms ", zn, " vs ", pn);
      zsc.step_async(zero);
      const bool stepped = psc.step(*plain);
      WCHECK(stepped == (s != 1), "step ", s, ": the plain side stepped=", stepped);
      zsc.update();
      psc.update();
      WCHECK(zsc.get_scale() == psc.get_scale(), "scales ", zsc.get_scale(), " vs ", psc.get_scale());
    } else {
      zero.step();
      plain->step();
    }
    if (zs) {
      zs->step();
      ps->step();
    }
    auto zp = zero_model->named_parameters(), pp = plain_model->named_parameters();
    for (size_t k = 0; k < zp.size(); ++k)
      mp::check_close(zp[k].second, pp[k].second,
                      "step " + std::to_string(s) + " rank " + std::to_string(r) + " " + zp[k].first, 0);
  }
  if (unused) WCHECK(!zero_model->unused->weight.grad().defined(), "the unused layer got a gradient");
  // State: consolidated onto rank 0, equal to the plain optimizer's.
  bool refused = false;
  try {
    (void)zero.state_dict();
  } catch (const Error& e) {
    refused = std::string(e.what()).find("consolidate_state_dict") != std::string::npos;
  }
  WCHECK(refused, "state_dict() before consolidate_state_dict must be an error");
  zero.consolidate_state_dict(0);
  const optim::OptimizerStateDict want = plain->state_dict();
  if (r == 0) {
    const optim::OptimizerStateDict got = zero.state_dict();
    expect_same_state(got, want);
    // The unused layer (indices 2 and 3 of group 0: a.weight, a.bias, unused.*) has no state.
    for (const auto& [key, t] : got.state)
      WCHECK(!unused || (key.rfind("state.2.", 0) != 0 && key.rfind("state.3.", 0) != 0), "state for ", key);
    // 16-bit parameters: the float32 moments and master come back float32.
    for (const auto& [key, t] : got.state)
      WCHECK(t.dtype() == DType::Float32 || t.dtype() == zero_model->a->weight.dtype(), key, " is ", t.dtype());
  }
  // Onto the last rank too: the same state there, and rank 0 no longer has it.
  zero.consolidate_state_dict(ws - 1);
  if (r == ws - 1) expect_same_state(zero.state_dict(), want);
  // Per-rank state bytes: full / N plus the step counters.
  int64_t full_bytes = 0, counters = 0;
  for (auto& [name, t] : want.state) (name.find(".step") != std::string::npos ? counters : full_bytes) += t.nbytes();
  const int64_t mine = zero.local_state_bytes();
  Tensor all = Tensor::from_vector({static_cast<double>(mine)}, {1}, DType::Float64);
  pg->allreduce(all, ReduceOp::Sum)->wait();
  WCHECK(static_cast<int64_t>(all.item()) >= full_bytes, "the ranks hold ", all.item(), " bytes, the full state ",
         full_bytes);
  // Padding is at most ws-1 elements; per-rank counters at most one per piece.
  WCHECK(mine <= (full_bytes + ws * 4 * 8) / ws + 64, "rank ", r, " holds ", mine, " bytes of state, full ",
         full_bytes, " / ", ws);
  // A fresh ZeRO loading the plain state dict continues like the plain run.
  auto fresh_model = std::make_shared<Net>(1, unused);
  fresh_model->to(kCPU, dt);
  {
    NoGradGuard g;
    auto fp = fresh_model->parameters(), pp = plain_model->parameters();
    for (size_t k = 0; k < fp.size(); ++k) fp[k].copy_(pp[k]);
  }
  auto fresh_ddp = std::make_shared<DistributedDataParallel>(fresh_model, dopts);
  ZeroRedundancyOptimizer fresh(groups(*fresh_model), [&](auto g) { return make_opt(kind, std::move(g)); }, {pg});
  fresh.load_state_dict(want);
  auto [x0, y0] = batch(r, steps, 0);
  Tensor x = x0.to(dt), y = y0.to(dt);
  fresh.zero_grad();
  plain->zero_grad();
  nn::functional::mse_loss((*fresh_ddp)(x), y).backward();
  nn::functional::mse_loss((*plain_ddp)(x), y).backward();
  fresh.step();
  plain->step();
  auto fp = fresh_model->named_parameters(), pp = plain_model->named_parameters();
  for (size_t k = 0; k < fp.size(); ++k) mp::check_close(fp[k].second, pp[k].second, "after load: " + fp[k].first, 0);
}

TEST(ZeroRedundancyOptimizer, EqualsDdpWithTheUnshardedOptimizer) {
  for (int ws : {2, 3, 4})
    for (const char* opt : {"sgd", "adam", "adamw"}) {
      EMBER_EXPECT_RANKS("equals_ddp", ws, {.arg = std::string("opt=") + opt});
    }
}

// Adam state bytes per rank on a model large enough that padding and step
// counters are small: at most 1.05 x the unsharded optimizer's / N.
EMBER_WORKER(state_bound) {
  auto pg = make_gloo_group(env.store(), env.rank, env.world_size);
  manual_seed(3);
  auto model = std::make_shared<nn::Sequential>(std::vector<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(301, 257), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(257, 97)});
  DDPOptions dopts;
  dopts.process_group = pg;
  auto ddp = std::make_shared<DistributedDataParallel>(model, dopts);
  ZeroRedundancyOptimizer zero(ddp->parameters(), [](auto g) { return make_opt("adamw", std::move(g)); }, {pg});
  sum((*ddp)(ones({2, 301}))).backward();
  zero.step();
  int64_t full = 0;
  for (const Tensor& p : model->parameters()) full += 2 * static_cast<int64_t>(p.nbytes()) + 4;  // m, v, step
  const int64_t mine = zero.local_state_bytes();
  std::printf("rank %d of %d: %lld state bytes, full %lld, ratio to full/N %.4f\n", env.rank, env.world_size,
              static_cast<long long>(mine), static_cast<long long>(full),
              static_cast<double>(mine) * env.world_size / static_cast<double>(full));
  WCHECK(mine * env.world_size <= full * 105 / 100, "rank ", env.rank, " holds ", mine, " bytes, more than 1.05 x ",
         full, " / ", env.world_size);
}

TEST(ZeroRedundancyOptimizer, StateBytesPerRankAreAtMost1_05xFullOverN) {
  for (int ws : {1, 2, 3, 4}) {
    EMBER_EXPECT_RANKS("state_bound", ws);
  }
}

TEST(ZeroRedundancyOptimizer, WithAccumulationUnusedParametersAndASchedule) {
  for (const char* arg : {"opt=adamw,accum=3", "opt=adam,unused=1", "opt=sgd,unused=1,accum=2,sched=1",
                          "opt=adam,dtype=bf16", "opt=sgd,dtype=bf16,accum=2", "opt=adamw,scaler=1,accum=2"}) {
    EMBER_EXPECT_RANKS("equals_ddp", 3, {.arg = arg});
  }
}

// The last rank dies 2 ms into its first all-gather (testing/dying_group.h):
// in the middle of the parameter all-gather, not before it.
EMBER_WORKER(dies_in_allgather) {
  auto pg = mp::dying_gloo_group(env, "allgather_into_tensor");
  // ~8M parameters: the gather usually takes long enough for the death to
  // land inside it; when it finished first, the next step's gather meets
  // the dead rank instead, and must fail as fast.
  manual_seed(1);
  auto model = std::make_shared<nn::Linear>(4096, 2048);
  DDPOptions dopts;
  dopts.process_group = pg;
  auto ddp = std::make_shared<DistributedDataParallel>(model, dopts);
  ZeroRedundancyOptimizer zero(ddp->parameters(), [](auto g) { return make_opt("adam", std::move(g)); }, {pg});
  Tensor x = ones({2, 4096});
  const auto t0 = Clock::now();
  std::string msg;
  for (int attempt = 0; attempt < 2 && msg.empty(); ++attempt) {
    try {
      if (attempt == 0) sum((*ddp)(x)).backward();  // the victim is gone by the second
      zero.step();
    } catch (const Error& e) {
      msg = e.what();
    }
  }
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("rank %d: step failed after %.2f s: %s\n", env.rank, took, msg.c_str());
  WCHECK(!msg.empty(), "the step must fail when a rank dies in the all-gather");
  WCHECK(msg.find("allgather_into_tensor") != std::string::npos, "names the collective: ", msg);
  WCHECK(took < 10.0, "took ", took, " s to fail (timeout 60 s)");
  WCHECK(msg.find("rank " + std::to_string(env.world_size - 1) + " (connection from") != std::string::npos,
         "names the dead rank: ", msg);
}

TEST(ZeroRedundancyOptimizer, ARankDyingInTheParameterAllGatherFailsTheOthersFast) {
  for (int ws : {2, 3}) {
    EMBER_EXPECT_RANKS("dies_in_allgather", ws, {.deadline = std::chrono::seconds(40), .expect_exit = {{ws - 1, 42}}});
  }
}

TEST(ZeroRedundancyOptimizer, ConstructionErrors) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  auto store = std::make_shared<FileStore>(std::string(tmp ? tmp : "/tmp") + "/zero_store_" + std::to_string(getpid()), 1);
  auto pg = make_gloo_group(store, 0, 1);
  auto adam = [](auto g) { return make_opt("adam", std::move(g)); };
  Tensor p = zeros({3}).requires_grad_();
  try {
    ZeroRedundancyOptimizer z({p, p}, adam, {pg});
    ADD_FAILURE() << "a repeated parameter must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than once"), std::string::npos) << e.what();
  }
  try {
    ZeroRedundancyOptimizer z({zeros({2}, DType::Int64)}, adam, {pg});
    ADD_FAILURE() << "an integer parameter must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("floating-point"), std::string::npos) << e.what();
  }
  // A world of one: the local optimizer holds everything, as plain Adam.
  Tensor q = Tensor::from_vector({1, 2, 3}, {3}).requires_grad_(), ref = q.detach().clone().requires_grad_();
  ZeroRedundancyOptimizer z({q}, adam, {pg});
  auto plain = make_opt("adam", {optim::ParamGroup{{ref}, {}}});
  for (int s = 0; s < 3; ++s) {
    q.set_grad(Tensor::from_vector({0.5, -1, 2}, {3}));
    ref.set_grad(Tensor::from_vector({0.5, -1, 2}, {3}));
    z.step();
    plain->step();
  }
  EXPECT_EQ(q.to_vector(), ref.to_vector());
  EXPECT_EQ(z.name(), "ZeroRedundancyOptimizer(Adam)");
}

}  // namespace
}  // namespace ember::distributed
