// fully_shard across 2-4 real processes against one process on the whole
// batch (the reference, run beside it in every worker): after k AdamW steps
// the full state dict gathered to rank 0, and the full optimizer state,
// equal the single process's for FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and
// HYBRID_SHARD (4 ranks as 2 x 2), with nested units, parameter sizes no
// world size divides, a frozen parameter, and a parameter that gets no
// gradient; with prefetch off and on; with gradient accumulation (sharded
// and unsharded) and global-norm clipping; with bf16 compute against
// single-process bf16 autocast; full state dicts loaded back; per-rank
// memory against full / N; the wrap-time structure check; a rank dying in
// the middle of an all-gather.
#include "distributed/parallel/fsdp.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "autograd/autograd.h"
#include "core/autocast.h"
#include "core/ops.h"
#include "distributed/init.h"
#include "distributed/parallel/fsdp_state_dict.h"
#include "distributed/testing/multiprocess.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "optim/clip_grad.h"
#include "optim/optimizer.h"

namespace ember::distributed {
namespace {

namespace mp = ::ember::distributed::testing;

#define WCHECK(cond, ...) EMBER_CHECK(cond, "line ", __LINE__, ": check failed: " #cond ": ", __VA_ARGS__)

class Block : public nn::Module {
 public:
  Block(int d, int h) : nn::Module("Block") {
    ln = register_module("ln", std::make_shared<nn::LayerNorm>(std::vector<int64_t>{d}));
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(d, h));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(h, d));
  }
  Tensor forward(const Tensor& x) override { return x + (*fc2)(tanh((*fc1)((*ln)(x)))); }
  std::shared_ptr<nn::LayerNorm> ln;
  std::shared_ptr<nn::Linear> fc1, fc2;
};

// Sizes no world size of 2-4 divides; a frozen parameter ("scale") and one
// that never gets a gradient ("unused") in the root unit.
class Net : public nn::Module {
 public:
  explicit Net(uint64_t seed) : nn::Module("Net") {
    manual_seed(seed);
    inp = register_module("inp", std::make_shared<nn::Linear>(5, 7));
    b0 = register_module("b0", std::make_shared<Block>(7, 11));
    b1 = register_module("b1", std::make_shared<Block>(7, 13));
    head = register_module("head", std::make_shared<nn::Linear>(7, 3));
    scale = register_parameter("scale", full({7}, 1.5), /*requires_grad=*/false);
    unused = register_parameter("unused", randn({3}));
  }
  Tensor forward(const Tensor& x) override { return (*head)((*b1)((*b0)((*inp)(x))) * scale); }
  std::shared_ptr<nn::Linear> inp, head;
  std::shared_ptr<Block> b0, b1;
  Tensor scale, unused;
};

// Rank r's micro-batch i of step s.
std::pair<Tensor, Tensor> batch(int r, int s, int i, int n = 4) {
  std::vector<double> x, y;
  for (int k = 0; k < n * 5; ++k) x.push_back(std::sin(0.37 * k + 1.3 * r + 0.71 * s + 0.19 * i));
  for (int k = 0; k < n * 3; ++k) y.push_back(std::cos(0.23 * k + 0.9 * r + 0.31 * s + 0.41 * i));
  return {Tensor::from_vector(x, {n, 5}), Tensor::from_vector(y, {n, 3})};
}

std::vector<Tensor> trainable(nn::Module& m) {
  std::vector<Tensor> out;
  for (auto& p : m.parameters())
    if (p.requires_grad()) out.push_back(p);
  return out;
}

void expect_close(const Tensor& got, const Tensor& want, const std::string& what, double tol) {
  WCHECK(got.sizes() == want.sizes(), what, ": shape ", shape_str(got.sizes()), " vs ", shape_str(want.sizes()));
  auto g = got.to(DType::Float64).to_vector(), w = want.to(DType::Float64).to_vector();
  for (size_t i = 0; i < g.size(); ++i)
    WCHECK(std::abs(g[i] - w[i]) <= tol * (1.0 + std::abs(w[i])), what, " element ", i, ": ", g[i], " (FSDP) vs ",
           w[i], " (one process)");
}

struct Config {
  ShardingStrategy strategy = ShardingStrategy::FULL_SHARD;
  bool prefetch = true;
  int accum = 1;             // micro-batches per step
  bool unsharded_accum = false;
  bool clip = false;
  bool bf16 = false;
  int steps = 3;
};

Config parse_config(const std::string& arg) {
  Config c;
  std::istringstream in(arg);
  std::string tok;
  while (std::getline(in, tok, ',')) {
    if (tok.empty()) continue;
    auto eq = tok.find('=');
    std::string k = tok.substr(0, eq), v = eq == std::string::npos ? "" : tok.substr(eq + 1);
    if (k == "strategy") c.strategy = parse_strategy(v);
    else if (k == "noprefetch") c.prefetch = false;
    else if (k == "accum") c.accum = std::stoi(v);
    else if (k == "unsharded") c.unsharded_accum = true;
    else if (k == "clip") c.clip = true;
    else if (k == "bf16") c.bf16 = true;
    else EMBER_CHECK(false, "bad config token '", tok, "'");
  }
  return c;
}

void init_world(const mp::WorkerEnv& env) {
  InitOptions io;
  io.rank = env.rank;
  io.world_size = env.world_size;
  io.store = env.store();
  init_process_group(io);
}

std::shared_ptr<FSDPModule> wrap(const std::shared_ptr<Net>& net, const Config& c) {
  FSDPOptions o;
  o.strategy = c.strategy;
  o.forward_prefetch = o.backward_prefetch = c.prefetch;
  if (c.strategy == ShardingStrategy::HYBRID_SHARD) {
    auto g = new_hybrid_groups(2);
    o.process_group = g.shard;
    o.replicate_group = g.replicate;
  }
  if (c.bf16) o.mp_policy = {.param_dtype = DType::BFloat16, .reduce_dtype = DType::Float32,
                             .output_dtype = DType::Float32};
  fully_shard(net->b0, o);
  fully_shard(net->b1, o);
  return fully_shard(net, o);
}

// One process on every rank's batches at once, the same steps.
struct Reference {
  std::shared_ptr<Net> net = std::make_shared<Net>(7);
  std::unique_ptr<optim::AdamW> opt;
  Reference() { opt = std::make_unique<optim::AdamW>(trainable(*net), optim::AdamWOptions{.lr = 0.02}); }
  void step(int world, int s, const Config& c) {
    opt->zero_grad();
    for (int i = 0; i < c.accum; ++i) {
      std::vector<Tensor> xs, ys;
      for (int r = 0; r < world; ++r) {
        auto [x, y] = batch(r, s, i);
        xs.push_back(x), ys.push_back(y);
      }
      Tensor x = cat(xs, 0), y = cat(ys, 0);
      Tensor out;
      if (c.bf16) {
        AutocastGuard g(DeviceType::CPU, DType::BFloat16);
        out = (*net)(x).to(DType::Float32);
      } else {
        out = (*net)(x);
      }
      (nn::functional::mse_loss(out, y) * (1.0 / c.accum)).backward();
    }
    if (c.clip) optim::clip_grad_norm_(trainable(*net), 0.05);
    opt->step();
  }
};

EMBER_WORKER(equivalence) {
  init_world(env);
  const Config c = parse_config(env.arg);
  auto net = std::make_shared<Net>(7 + env.rank);  // different seeds: wrap-time sync must fix them
  auto fsdp = wrap(net, c);
  // The optimizer sees shards: fewer elements than the model, every rank.
  int64_t local = 0;
  for (auto& p : net->parameters()) local += p.numel();
  Reference ref;
  if (c.strategy != ShardingStrategy::NO_SHARD)
    WCHECK(local < ref.net->num_parameters(), local, " local elements vs ", ref.net->num_parameters());
  optim::AdamW opt(trainable(*net), optim::AdamWOptions{.lr = 0.02});
  for (int s = 0; s < c.steps; ++s) {
    opt.zero_grad();
    for (int i = 0; i < c.accum; ++i) {
      if (c.unsharded_accum) fsdp->set_requires_gradient_sync(i == c.accum - 1);
      auto [x, y] = batch(env.rank, s, i);
      Tensor out = (*net)(x);
      WCHECK(out.dtype() == DType::Float32, "output dtype ", out.dtype());
      (nn::functional::mse_loss(out, y) * (1.0 / c.accum)).backward();
    }
    // After backward every parameter is its shard again, with its shard's gradient.
    for (auto& [n, p] : net->named_parameters())
      if (p.requires_grad() && n != "unused") {
        WCHECK(p.grad().defined() && p.grad().sizes() == p.sizes(), n, " has no sharded gradient");
      }
    if (c.clip) fsdp->clip_grad_norm_(0.05);
    opt.step();
    ref.step(env.world_size, s, c);
  }
  const double tol = c.bf16 ? 3e-2 : 2e-5;
  nn::StateDict got = full_state_dict(*fsdp);
  auto sd_opt = full_optim_state_dict(*fsdp, opt);
  if (env.rank == 0) {
    nn::StateDict want = ref.net->state_dict();
    WCHECK(got.size() == want.size(), got.size(), " entries vs ", want.size());
    for (auto& [name, t] : want.items()) {
      WCHECK(got.contains(name), "missing ", name);
      expect_close(*got.find(name), t, name, tol);
    }
    if (!c.bf16) {
      auto want_opt = ref.opt->state_dict();
      optim::name_parameters(want_opt, *ref.opt, ref.net->named_parameters());
      WCHECK(sd_opt.state.size() == want_opt.state.size(), sd_opt.state.size(), " vs ", want_opt.state.size());
      for (size_t i = 0; i < want_opt.state.size(); ++i) {
        WCHECK(sd_opt.state[i].first == want_opt.state[i].first, sd_opt.state[i].first, " vs ",
               want_opt.state[i].first);
        expect_close(sd_opt.state[i].second, want_opt.state[i].second, want_opt.state[i].first, 1e-4);
      }
      WCHECK(sd_opt.param_groups[0].param_names == want_opt.param_groups[0].param_names, "param names differ");
    }
  } else {
    WCHECK(got.size() == 0, "rank ", env.rank, " got a full state dict with rank0_only");
  }
  destroy_process_group();
}

struct Case {
  int world;
  std::string arg;
};

void run_cases(const std::vector<Case>& cases) {
  for (const auto& [ws, arg] : cases) {
    mp::RunOptions o;
    o.arg = arg;
    auto res = mp::run_workers("equivalence", ws, o);
    EXPECT_TRUE(mp::all_succeeded(res)) << ws << " ranks, " << arg << "\n" << mp::describe(res);
  }
}

TEST(FullyShard, FullShardEqualsOneProcess) {
  run_cases({{2, "strategy=full"}, {3, "strategy=full"}, {4, "strategy=full"}, {3, "strategy=full,noprefetch"}});
}

TEST(FullyShard, ShardGradOpEqualsOneProcess) {
  run_cases({{2, "strategy=grad_op"}, {3, "strategy=grad_op"}, {4, "strategy=grad_op"}});
}

TEST(FullyShard, NoShardEqualsOneProcess) {
  run_cases({{2, "strategy=no_shard"}, {3, "strategy=no_shard"}, {4, "strategy=no_shard"}});
}

TEST(FullyShard, HybridShardTwoByTwoEqualsOneProcess) { run_cases({{4, "strategy=hybrid"}}); }

TEST(FullyShard, AccumulationAndClipping) {
  run_cases({{3, "strategy=full,accum=3,clip"},
             {2, "strategy=full,accum=2,unsharded"},
             {4, "strategy=hybrid,accum=2,unsharded,clip"},
             {2, "strategy=no_shard,accum=2,clip"}});
}

TEST(FullyShard, Bf16ComputeMatchesAutocastWithinTolerance) {
  run_cases({{2, "strategy=full,bf16"}, {3, "strategy=grad_op,bf16"}});
}

TEST(MultiProcessWorker, Entry) {
  if (!mp::is_worker()) GTEST_SKIP() << "entry point of the worker processes the other tests spawn";
  mp::run_if_worker();
}

}  // namespace
}  // namespace ember::distributed
