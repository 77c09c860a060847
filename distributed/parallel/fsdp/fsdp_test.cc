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
#include "distributed/parallel/fsdp/fsdp.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "autograd/autograd.h"
#include "core/autocast.h"
#include "core/ops.h"
#include "distributed/comm/backends.h"
#include "distributed/init.h"
#include "distributed/parallel/fsdp/fsdp_state_dict.h"
#include "distributed/parallel/fsdp/fsdp_test_block.h"
#include "distributed/parallel/fsdp/fsdp_unit.h"
#include "distributed/parallel/rank_agreement.h"
#include "distributed/store/store.h"
#include "distributed/testing/dying_group.h"
#include "distributed/testing/multiprocess.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "nn/transformer.h"
#include "optim/clip_grad.h"
#include "optim/grad_scaler.h"
#include "optim/optimizer.h"

namespace ember::distributed {
namespace {

namespace mp = ::ember::distributed::testing;

using testing::Block;

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

struct Config {
  ShardingStrategy strategy = ShardingStrategy::FULL_SHARD;
  bool prefetch = true;
  int accum = 1;  // micro-batches per step
  bool unsharded_accum = false;
  bool micro_batches = false;  // every forward, then the backwards in reverse (a pipeline's order)
  bool clip = false;
  bool bf16 = false;
  bool offload = false;
  std::string auto_wrap;  // "type" or "size": fully_shard_auto instead of by hand
  int steps = 3;
};

Config parse_config(const std::string& arg) {
  // The bare keys: each sets one flag.
  struct Switch {
    const char* key;
    bool Config::*flag;
    bool value;
  };
  static const Switch kSwitches[] = {
      {"noprefetch", &Config::prefetch, false},
      {"unsharded", &Config::unsharded_accum, true},
      {"micro", &Config::micro_batches, true},
      {"clip", &Config::clip, true},
      {"bf16", &Config::bf16, true},
      {"offload", &Config::offload, true},
  };
  Config c;
  for (const auto& [k, v] : mp::parse_arg(arg)) {
    const auto sw =
        std::find_if(std::begin(kSwitches), std::end(kSwitches), [&](const Switch& s) { return k == s.key; });
    if (sw != std::end(kSwitches))
      c.*sw->flag = sw->value;
    else if (k == "strategy")
      c.strategy = parse_strategy(v);
    else if (k == "accum")
      c.accum = std::stoi(v);
    else if (k == "auto")
      c.auto_wrap = v;
    else
      EMBER_CHECK(false, "bad config key '", k, "'");
  }
  return c;
}

using mp::init_world;

std::shared_ptr<FSDPModule> wrap(const std::shared_ptr<Net>& net, const Config& c) {
  FSDPOptions o;
  o.strategy = c.strategy;
  o.forward_prefetch = o.backward_prefetch = c.prefetch;
  if (c.strategy == ShardingStrategy::HYBRID_SHARD)  // (dp_replicate, dp_shard): shards of 2 ranks
    o.mesh = DeviceMesh::create({get_world_size() / 2, 2}, {"dp_replicate", "dp_shard"});
  if (c.bf16)
    o.mp_policy = {.param_dtype = DType::BFloat16, .reduce_dtype = DType::Float32, .output_dtype = DType::Float32};
  o.offload_policy.offload_params = c.offload;
  std::shared_ptr<FSDPModule> root;
  if (c.auto_wrap == "type") {
    root = fully_shard_auto(net, {.types = {"Block"}}, o);
  } else if (c.auto_wrap == "size") {
    root = fully_shard_auto(net, {.min_num_params = 150}, o);  // the blocks (186, 216), not the Linears inside
  } else {
    fully_shard(net->b0, o);
    fully_shard(net->b1, o);
    root = fully_shard(net, o);
  }
  // Three units: b0, b1 and the root's own parameters.
  auto units = root->units();
  WCHECK(units.size() == 3 && fsdp_of(*net->b0) && fsdp_of(*net->b1) && !fsdp_of(*net->b0->fc1), units.size(),
         " units");
  return root;
}

// One process on every rank's batches at once, the same steps.
// bf16 runs use SGD: Adam's normalised step turns a rounding difference in a
// tiny gradient into a whole lr-sized step of the other sign.
std::unique_ptr<optim::Optimizer> make_opt(const Config& c, std::vector<Tensor> params) {
  if (c.bf16) return std::make_unique<optim::SGD>(std::move(params), optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
  return std::make_unique<optim::AdamW>(std::move(params), optim::AdamWOptions{.lr = 0.02});
}

struct Reference {
  std::shared_ptr<Net> net = std::make_shared<Net>(7);
  std::unique_ptr<optim::Optimizer> opt;
  explicit Reference(const Config& c) { opt = make_opt(c, trainable(*net)); }
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
  Reference ref(c);
  if (c.strategy != ShardingStrategy::NO_SHARD)
    WCHECK(local < ref.net->num_parameters(), local, " local elements vs ", ref.net->num_parameters());
  auto opt_ptr = make_opt(c, trainable(*net));
  optim::Optimizer& opt = *opt_ptr;
  for (int s = 0; s < c.steps; ++s) {
    opt.zero_grad();
    if (c.micro_batches) {
      // All the forwards before any backward: each unit gathered once,
      // whole gradients accumulated, one reduction per unit at the end.
      fsdp->begin_micro_batches();
      std::vector<Tensor> losses;
      for (int i = 0; i < c.accum; ++i) {
        auto [x, y] = batch(env.rank, s, i);
        losses.push_back(nn::functional::mse_loss((*net)(x), y) * (1.0 / c.accum));
      }
      const auto during = fsdp->memory();
      WCHECK(during.unsharded_params > 0 && during.sharded_grads == 0,
             "between the forwards and backwards: ", during.unsharded_params, " gathered bytes, ", during.sharded_grads,
             " sharded gradient bytes");
      for (int i = c.accum - 1; i >= 0; --i) losses[i].backward();
      fsdp->end_micro_batches();
      const auto after = fsdp->memory();
      WCHECK(after.unsharded_params == 0 && after.unsharded_grads == 0,
             "after end_micro_batches: ", after.unsharded_params, " gathered bytes, ", after.unsharded_grads,
             " whole gradient bytes");
    }
    for (int i = 0; i < (c.micro_batches ? 0 : c.accum); ++i) {
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
  // bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.2%); after
  // 3 steps through 4 layers 1% is comfortably above it and far below
  // what a wrong gradient (a missing reduction, a stale shard) changes.
  const double tol = c.bf16 ? 1e-2 : 2e-5;
  nn::StateDict got = full_state_dict(*fsdp);
  auto sd_opt = full_optim_state_dict(*fsdp, opt);
  if (env.rank == 0) {
    nn::StateDict want = ref.net->state_dict();
    WCHECK(got.size() == want.size(), got.size(), " entries vs ", want.size());
    for (auto& [name, t] : want.items()) {
      WCHECK(got.contains(name), "missing ", name);
      mp::check_close(*got.find(name), t, name, tol);
    }
    if (!c.bf16) {
      auto want_opt = ref.opt->state_dict();
      optim::name_parameters(want_opt, *ref.opt, ref.net->named_parameters());
      WCHECK(sd_opt.state.size() == want_opt.state.size(), sd_opt.state.size(), " vs ", want_opt.state.size());
      for (size_t i = 0; i < want_opt.state.size(); ++i) {
        WCHECK(sd_opt.state[i].first == want_opt.state[i].first, sd_opt.state[i].first, " vs ",
               want_opt.state[i].first);
        mp::check_close(sd_opt.state[i].second, want_opt.state[i].second, want_opt.state[i].first, 1e-4);
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
    EMBER_EXPECT_RANKS("equivalence", ws, {.arg = arg});
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

TEST(FullyShard, SeveralForwardsBeforeTheirBackwards) {
  run_cases({{3, "strategy=full,accum=3,micro,clip"},
             {2, "strategy=grad_op,accum=2,micro"},
             {4, "strategy=hybrid,accum=2,micro"},
             {2, "strategy=full,accum=2,micro,bf16"}});
}

// NO_SHARD: shards of one rank, whose gather is a cast copy.
TEST(FullyShard, Bf16ComputeMatchesAutocastWithinTolerance) {
  run_cases({{2, "strategy=full,bf16"}, {3, "strategy=grad_op,bf16"}, {2, "strategy=no_shard,bf16"}});
}

TEST(FullyShard, AutoWrapAndOffloadLogic) {
  run_cases({{2, "strategy=full,auto=type"},
             {3, "strategy=grad_op,auto=size"},
             {2, "strategy=full,offload"},
             {2, "strategy=no_shard,offload"}});
}

// Train 2 steps, gather the full model and optimizer state on every rank,
// load them into a fresh model wrapped with another strategy (different
// seed: every value must come from the dicts), train 2 more: equal to one
// process doing 4 steps.
EMBER_WORKER(state_dict_roundtrip) {
  init_world(env);
  Config c;
  auto net = std::make_shared<Net>(7);
  auto fsdp = wrap(net, c);
  optim::AdamW opt(trainable(*net), optim::AdamWOptions{.lr = 0.02});
  Reference ref(c);
  auto train = [&](nn::Module& m, optim::Optimizer& o, int s) {
    o.zero_grad();
    auto [x, y] = batch(env.rank, s, 0);
    nn::functional::mse_loss(m(x), y).backward();
    o.step();
  };
  for (int s = 0; s < 2; ++s) train(*net, opt, s), ref.step(env.world_size, s, c);
  FullStateDictOptions all{.rank0_only = false, .offload_to_cpu = true};
  nn::StateDict sd = full_state_dict(*fsdp, all);
  optim::OptimizerStateDict osd = full_optim_state_dict(*fsdp, opt, all);

  Config c2;
  c2.strategy = parse_strategy(mp::parse_arg(env.arg).at("to"));
  auto net2 = std::make_shared<Net>(99);
  FSDPOptions o;
  o.strategy = c2.strategy;
  o.sync_module_states = false;
  fully_shard(net2->b1, o);  // other units than the first model's
  auto fsdp2 = fully_shard(net2, o);
  optim::AdamW opt2(trainable(*net2), optim::AdamWOptions{.lr = 0.5});  // the dict's lr wins
  load_full_state_dict(*fsdp2, sd);
  load_full_optim_state_dict(*fsdp2, opt2, osd);
  for (int s = 2; s < 4; ++s) train(*net2, opt2, s), ref.step(env.world_size, s, c);
  nn::StateDict got = full_state_dict(*fsdp2, all);
  const nn::StateDict want = ref.net->state_dict();
  for (auto& [name, t] : want.items()) {
    WCHECK(got.contains(name), "missing ", name);
    mp::check_close(*got.find(name), t, name, 2e-5);
  }

  // Errors name the entry, and nothing is written before every entry is checked.
  nn::StateDict bad;
  for (auto& [name, t] : sd.items()) bad.insert(name, name == "b1.fc2.weight" ? zeros({2, 2}) : t);
  std::string msg;
  try {
    load_full_state_dict(*fsdp2, bad);
  } catch (const Error& e) {
    msg = e.what();
  }
  WCHECK(msg.find("b1.fc2.weight") != std::string::npos && msg.find("[2,2]") != std::string::npos, msg);
  nn::StateDict after = full_state_dict(*fsdp2, all);
  for (auto& [name, t] : got.items()) mp::check_close(*after.find(name), t, name + " (after a refused load)", 0.0);
  destroy_process_group();
}

TEST(FullyShard, FullStateDictsLoadIntoAnotherStrategy) {
  for (auto [ws, to] : std::vector<std::pair<int, std::string>>{{2, "grad_op"}, {3, "no_shard"}, {3, "full"}}) {
    EMBER_EXPECT_RANKS("state_dict_roundtrip", ws, {.arg = "to=" + to});
  }
}

// A deeper stack: per-rank bytes of parameters + gradients + Adam state
// against full / N, and how many units are gathered at once.
class Stack : public nn::Module {
 public:
  explicit Stack(int depth) : nn::Module("Stack") {
    manual_seed(3);
    inp = register_module("inp", std::make_shared<nn::Linear>(5, 64));
    for (int i = 0; i < depth; ++i)
      blocks.push_back(register_module("h" + std::to_string(i), std::make_shared<Block>(64, 255)));
    head = register_module("head", std::make_shared<nn::Linear>(64, 3));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = (*inp)(x);
    for (auto& b : blocks) h = (*b)(h);
    return (*head)(h);
  }
  std::shared_ptr<nn::Linear> inp, head;
  std::vector<std::shared_ptr<Block>> blocks;
};

EMBER_WORKER(memory) {
  init_world(env);
  auto args = mp::parse_arg(env.arg);
  const bool prefetch = !args.count("noprefetch");
  const bool gpt = args.count("gpt") > 0;
  // The MLP-like stack, or a transformer (sizes no world size divides).
  std::shared_ptr<nn::Module> net;
  std::vector<std::shared_ptr<nn::Module>> blocks;
  if (gpt) {
    manual_seed(3);
    auto g = std::make_shared<nn::GPT>(
        nn::GPTOptions{.vocab_size = 37, .block_size = 16, .n_layer = 4, .n_head = 2, .n_embd = 30});
    for (auto& [n, b] : g->h->named_children()) blocks.push_back(b);
    net = g;
  } else {
    auto st = std::make_shared<Stack>(4);
    for (auto& b : st->blocks) blocks.push_back(b);
    net = st;
  }
  const int64_t full_params = net->num_parameters();
  FSDPOptions o;
  o.forward_prefetch = o.backward_prefetch = prefetch;
  o.prefetch_limit = 1;
  auto fsdp = fully_shard_auto(net, {.types = {"Block", "TransformerBlock"}}, o);
  optim::Adam opt(net->parameters(), optim::AdamOptions{.lr = 1e-3});
  auto loss_of = [&](int s) {
    if (!gpt) {
      auto [x, y] = batch(env.rank, s, 0, 8);
      return nn::functional::mse_loss((*net)(x), y);
    }
    Tensor tokens = randint(0, 37, {2, 16});
    Tensor logits = (*net)(tokens);
    return nn::functional::cross_entropy(logits.reshape({-1, 37}), randint(0, 37, {32}));
  };
  // Gathered blocks, seen from each block's forward and backward.
  int max_fwd = 0, max_bwd = 0;
  auto count = [&](int& max) {
    int n = 0;
    for (auto& u : fsdp->units())
      if (!u->is_root && (u->state == FSDPModule::Unit::State::UNSHARDED || u->gathering)) ++n;
    max = std::max(max, n);
  };
  std::vector<nn::HookHandle> hs;
  for (auto& b : blocks) {
    hs.push_back(b->register_forward_pre_hook([&](nn::Module&, const Tensor&) {
      count(max_fwd);
      return Tensor();
    }));
    hs.push_back(b->register_full_backward_pre_hook([&](nn::Module&, const Tensor&) {
      count(max_bwd);
      return Tensor();
    }));
  }
  for (int s = 0; s < 3; ++s) {
    opt.zero_grad();
    loss_of(s).backward();
    opt.step();
  }
  auto mem = fsdp->memory();
  int64_t state = 0;
  for (auto& [k, t] : opt.state_dict().state) state += t.numel() * 4;
  const int64_t held = mem.sharded_params + mem.sharded_grads + state;
  const double full = 4.0 * full_params * 4;  // float32 parameters, gradients, two moments
  const double bound = 1.1 * full / env.world_size + mem.largest_unit;
  std::printf(
      "%s, rank %d of %d: %lld bytes held (params %lld, grads %lld, state %lld), full %.0f, bound %.0f, "
      "largest unit %lld, at most %d blocks gathered at once in forward, %d in backward\n",
      gpt ? "GPT" : "MLP stack", env.rank, env.world_size, static_cast<long long>(held),
      static_cast<long long>(mem.sharded_params), static_cast<long long>(mem.sharded_grads),
      static_cast<long long>(state), full, bound, static_cast<long long>(mem.largest_unit), max_fwd, max_bwd);
  WCHECK(held <= bound, held, " bytes held > ", bound);
  WCHECK(mem.unsharded_params == 0 && mem.unsharded_grads == 0,
         "whole copies left after the step: ", mem.unsharded_params, " + ", mem.unsharded_grads);
  // zero_grad(set_to_none) frees the sharded gradients: FSDP keeps no copy.
  opt.zero_grad();
  WCHECK(fsdp->memory().sharded_grads == 0, fsdp->memory().sharded_grads, " bytes of gradients after zero_grad");
  if (env.world_size > 1) {
    // Forward: prefetch gathers one block ahead (limit 1); without it, one
    // at a time. Backward: a block is gathered before the one after it
    // is released (their hooks sit on one gradient), so two either way,
    // and the prefetch waits for that release.
    WCHECK(max_fwd == (prefetch ? 2 : 1), max_fwd, " blocks gathered at once in forward");
    WCHECK(max_bwd == 2, max_bwd, " blocks gathered at once in backward");
  }
  destroy_process_group();
}

TEST(FullyShard, PerRankMemoryIsFullOverNPlusOneUnit) {
  for (auto [ws, arg] : std::vector<std::pair<int, std::string>>{
           {1, ""}, {2, ""}, {4, ""}, {2, "noprefetch"}, {1, "gpt"}, {2, "gpt"}, {4, "gpt"}, {3, "gpt,noprefetch"}}) {
    mp::RunOptions o;
    o.arg = arg;
    auto res = mp::run_workers("memory", ws, o);
    EXPECT_TRUE(mp::all_succeeded(res)) << ws << " ranks " << arg << "\n" << mp::describe(res);
    // The figures, for the log: rank 0's line.
    std::istringstream out(res[0].output);
    for (std::string line; std::getline(out, line);)
      if (line.find("bytes held") != std::string::npos) std::cout << line << "\n";
  }
}

// Rank 1 builds its first block wider: the first fully_shard fails on every
// rank, naming the unit and each rank's count.
EMBER_WORKER(structure_mismatch) {
  init_world(env);
  auto other = std::make_shared<Block>(7, env.rank == 1 ? 12 : 11);
  std::string msg;
  try {
    fully_shard(other);
  } catch (const Error& e) {
    msg = e.what();
  }
  WCHECK(msg.find("the unit of Block (parameters ln.weight, ln.bias, fc1.weight, fc1.bias, ...)") != std::string::npos,
         msg);
  WCHECK(msg.find("rank 0 has 6 tensors / 186 elements; rank 1 has 6 tensors / 201 elements (names or shapes "
                  "other than rank 0's)") != std::string::npos,
         msg);
  destroy_process_group();
}

// Wrapping top-down (the root first, then a block inside it) is an error,
// not a block silently left with no parameters.
TEST(FullyShard, WrappingAnInnerModuleAfterItsRootIsAnError) {
  auto net = std::make_shared<Net>(7);
  FSDPOptions o;
  o.strategy = ShardingStrategy::NO_SHARD;
  const char* tmp = std::getenv("TEST_TMPDIR");
  o.mesh = DeviceMesh::from_group(
      make_gloo_group(
          std::make_shared<FileStore>(std::string(tmp ? tmp : "/tmp") + "/fsdp_store_" + std::to_string(getpid()), 1),
          0, 1),
      "dp_replicate");
  fully_shard(net, o);
  try {
    fully_shard(net->b0, o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fully_shard(Block): parameter 'ln.weight' already belongs to the unit of an "
                                         "enclosing module; call fully_shard on inner modules first"),
              std::string::npos)
        << e.what();
  }
}

TEST(FullyShard, MismatchedUnitsAcrossRanksFailAtWrapTimeNamingTheModule) {
  EMBER_EXPECT_RANKS("structure_mismatch", 2);
}

// The last rank dies in the middle of an all-gather (backward's re-gather)
// or of the first gradient reduce-scatter: the others fail fast, naming
// the collective and the rank.
EMBER_WORKER(dies) {
  const std::string op = mp::parse_arg(env.arg).at("op");
  // All-gathers: one structure check per unit at wrap time (3), one per
  // unit in the first forward (3): die in backward's re-gather of a block.
  auto pg = mp::dying_gloo_group(env, op, op == "allgather_into_tensor" ? 6 : 0);
  manual_seed(1);
  auto net = std::make_shared<Stack>(2);
  FSDPOptions o;
  o.mesh = DeviceMesh::from_group(pg, "dp_shard");
  fully_shard_auto(net, {.types = {"Block"}}, o);
  const auto t0 = std::chrono::steady_clock::now();
  std::string msg;
  for (int s = 0; s < 3 && msg.empty(); ++s) {
    try {
      auto [x, y] = batch(env.rank, s, 0, 8);
      nn::functional::mse_loss((*net)(x), y).backward();
    } catch (const Error& e) {
      msg = e.what();
    }
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("rank %d: failed after %.2f s: %s\n", env.rank, took, msg.c_str());
  WCHECK(!msg.empty(), "training must fail when a rank dies in ", op);
  WCHECK(took < 10.0, "took ", took, " s to fail (timeout 60 s)");
  WCHECK(msg.find("rank " + std::to_string(env.world_size - 1)) != std::string::npos, "names the dead rank: ", msg);
}

TEST(FullyShard, ARankDyingInACollectiveFailsTheOthersFast) {
  for (std::string op : {"allgather_into_tensor", "reduce_scatter_tensor"}) {
    EMBER_EXPECT_RANKS("dies", 3, {.deadline = std::chrono::seconds(40), .arg = "op=" + op, .expect_exit = {{2, 42}}});
  }
}

// GradScaler over sharded gradients: an inf in rank 0's shard only. With
// found_inf agreed over the shard group every rank skips the step and backs
// off the scale; without it (the control) the other ranks step, which is
// what the agreement prevents.
EMBER_WORKER(scaler) {
  init_world(env);
  const bool agree = !mp::parse_arg(env.arg).count("noagree");
  auto net = std::make_shared<Net>(7);
  auto fsdp = wrap(net, Config{});
  optim::AdamW opt(trainable(*net), optim::AdamWOptions{.lr = 0.02});
  optim::GradScalerOptions so;
  if (agree) so.sync_found_inf = found_inf_allreduce(fsdp->shard_group());
  optim::GradScaler scaler(so);
  auto [x, y] = batch(env.rank, 0, 0);
  scaler.scale(nn::functional::mse_loss((*net)(x), y)).backward();
  if (env.rank == 0) {
    Tensor g = net->b0->fc1->weight.grad();
    WCHECK(g.defined() && g.numel() > 0, "rank 0 holds part of b0.fc1.weight");
    NoGradGuard ng;
    g.view({-1}).narrow(0, 0, 1).fill_(std::numeric_limits<double>::infinity());
  }
  std::vector<Tensor> before;
  for (auto& p : trainable(*net)) before.push_back(p.clone());
  const bool stepped = scaler.step(opt);
  scaler.update();
  bool changed = false;
  auto params = trainable(*net);
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].numel() > 0) changed |= !allclose(params[i], before[i], 0.0, 0.0);
  std::printf("rank %d: stepped %d, changed %d, scale %g\n", env.rank, stepped, changed, scaler.get_scale());
  if (agree || env.rank == 0) {
    WCHECK(!stepped && !changed && scaler.get_scale() == 32768.0, "rank ", env.rank, " stepped ", stepped, ", changed ",
           changed, ", scale ", scaler.get_scale());
  } else {
    WCHECK(stepped && changed, "without agreement rank ", env.rank, " should have stepped");
  }
  destroy_process_group();
}

TEST(FullyShard, GradScalerAgreesOnAnInfInOneRanksShard) {
  for (std::string arg : {"", "noagree"}) {
    EMBER_EXPECT_RANKS("scaler", 3, {.arg = arg});
  }
}

// A root with no parameters of its own (every parameter in a block unit),
// eval forwards between steps, and a unit whose input needs no gradient:
// still equal to one process.
EMBER_WORKER(empty_root) {
  init_world(env);
  auto make = [] {
    manual_seed(11);
    return std::make_shared<nn::Sequential>(std::vector<std::shared_ptr<nn::Module>>{
        std::make_shared<Block>(5, 9), std::make_shared<Block>(5, 6), std::make_shared<Block>(5, 7)});
  };
  auto net = make(), ref = make();
  auto fsdp = fully_shard_auto(net, {.types = {"Block"}});
  WCHECK(fsdp->units().size() == 4, fsdp->units().size(), " units");
  optim::AdamW opt(net->parameters(), optim::AdamWOptions{.lr = 0.02});
  optim::AdamW ref_opt(ref->parameters(), optim::AdamWOptions{.lr = 0.02});
  for (int s = 0; s < 3; ++s) {
    auto xy = [&](int r) {
      auto [x, y] = batch(r, s, 0);
      return std::make_pair(x, cat({y, y.narrow(1, 0, 2)}, 1));  // [4, 5] targets
    };
    auto [x, y] = xy(env.rank);
    opt.zero_grad();
    nn::functional::mse_loss((*net)(x), y).backward();
    opt.step();
    {
      NoGradGuard ng;
      (*net)(x);  // an evaluation between steps gathers and frees again
    }
    std::vector<Tensor> xs, ys;
    for (int r = 0; r < env.world_size; ++r) xs.push_back(xy(r).first), ys.push_back(xy(r).second);
    ref_opt.zero_grad();
    nn::functional::mse_loss((*ref)(cat(xs, 0)), cat(ys, 0)).backward();
    ref_opt.step();
  }
  nn::StateDict got = full_state_dict(*fsdp, {.rank0_only = false});
  const nn::StateDict want = ref->state_dict();
  for (auto& [name, t] : want.items()) mp::check_close(*got.find(name), t, name, 2e-5);
  destroy_process_group();
}

TEST(FullyShard, ARootWithoutParametersAndEvalForwards) {
  for (int ws : {2, 3}) {
    EMBER_EXPECT_RANKS("empty_root", ws);
  }
}

// A dropped model takes its units, and their shards, with it: the root's
// lists of its units once held them strongly (the root is in its own list),
// so a second model allocated where the first had been was "already wrapped".
EMBER_WORKER(dropped_model) {
  init_world(env);
  std::vector<std::weak_ptr<FSDPModule::Unit>> units;
  for (int round = 0; round < 2; ++round) {
    auto net = std::make_shared<Net>(7);
    auto root = wrap(net, Config{});
    for (auto& u : root->units()) units.push_back(u);
    auto [x, y] = batch(env.rank, 0, 0);
    nn::functional::mse_loss((*net)(x), y).backward();
  }
  for (size_t i = 0; i < units.size(); ++i) WCHECK(units[i].expired(), "unit ", i, " outlived its model");
  destroy_process_group();
}

TEST(FullyShard, ADroppedModelFreesItsUnits) { EMBER_EXPECT_RANKS("dropped_model", 2); }

// A channels-last conv net under fully_shard trains as one contiguous
// process on the whole batch: the flat parameters are contiguous (shards
// count elements in logical order), the values travel by logical index, so
// nothing mixes elements; docs/gpu.md says the layout becomes contiguous.
EMBER_WORKER(channels_last) {
  init_world(env);
  auto make = [] {
    manual_seed(3);
    return std::make_shared<nn::Sequential>(std::vector<std::shared_ptr<nn::Module>>{
        std::make_shared<nn::Conv2d>(2, 4, 3, 1, 1), std::make_shared<nn::ReLU>(),
        std::make_shared<nn::Conv2d>(4, 4, 3, 2, 1), std::make_shared<nn::Flatten>(),
        std::make_shared<nn::Linear>(64, 3)});
  };
  auto ref = make(), local = make();
  local->to(MemoryFormat::ChannelsLast);
  auto root = fully_shard(local);
  for (const auto& [name, p] : local->named_parameters()) WCHECK(p.is_contiguous(), name, " is not contiguous");
  optim::SGD opt(local->parameters(), {.lr = 0.1, .momentum = 0.9}),
      opt_ref(ref->parameters(), {.lr = 0.1, .momentum = 0.9});
  const int64_t b = 2, ws = env.world_size;
  for (int step = 0; step < 3; ++step) {
    Generator gen(200 + static_cast<uint64_t>(step));
    Tensor x = randn({b * ws, 2, 8, 8}, {}, &gen), y = randint(0, 3, {b * ws}, DType::Int64, &gen);
    opt.zero_grad();
    opt_ref.zero_grad();
    Tensor mine = x.narrow(0, env.rank * b, b).contiguous(MemoryFormat::ChannelsLast);
    nn::functional::cross_entropy((*local)(mine), y.narrow(0, env.rank * b, b)).backward();
    nn::functional::cross_entropy((*ref)(x), y).backward();
    opt.step();
    opt_ref.step();
  }
  nn::StateDict got = full_state_dict(*root), want = ref->state_dict();
  if (env.rank == 0)
    for (auto& [name, t] : want.items()) {
      WCHECK(got.contains(name), "missing ", name);
      mp::check_close(*got.find(name), t, name, 2e-5);
    }
  destroy_process_group();
}

TEST(FullyShard, ChannelsLastModelTrainsAsOneProcess) { EMBER_EXPECT_RANKS("channels_last", 2); }

}  // namespace
}  // namespace ember::distributed
