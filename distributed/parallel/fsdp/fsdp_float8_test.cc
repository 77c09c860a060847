// FSDP's float8 all-gather (nn/float8.h's enable_fsdp_float8_all_gather) on
// 2-3 real processes. Each worker trains three copies of one model on the
// same batches (SGD): fully_shard with the float8 layers' weights gathered in
// float8, fully_shard with them gathered as float32 (the layers casting
// the gathered weight themselves), and one process on every rank's batch.
// In float32 the first two agree bit for bit (the same scales, the same
// bytes: every loss and every parameter after 3 steps), with
// FULL_SHARD and SHARD_GRAD_OP, over shard sizes that split weights across
// ranks, and under activation checkpointing (the recompute uses the
// gathered cast); both stay within float8's error of the one process. The
// all-gathers move the bytes the layout says (float8 weights at one byte),
// the gathered memory shrinks, reading a float8-gathered weight fails
// naming why, and an explicit unshard() still gathers the whole weights.
// Under a bfloat16 param_dtype the float8 gather scales from the float32
// master weight: within bfloat16 + float8 error of the others.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "core/testing/error_of.h"
#include "distributed/comm/backends.h"
#include "distributed/init.h"
#include "distributed/parallel/fsdp/fsdp.h"
#include "distributed/parallel/fsdp/fsdp_state_dict.h"
#include "distributed/parallel/fsdp/fsdp_test_block.h"
#include "distributed/parallel/fsdp/fsdp_unit.h"
#include "distributed/testing/multiprocess.h"
#include "nn/checkpoint.h"
#include "nn/float8.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "optim/optimizer.h"

namespace ember::distributed {
namespace {

namespace mp = ::ember::distributed::testing;

using testing::Block;

// Float8 layers in two blocks and in the root unit ("inp"); the head's 8
// outputs are no multiple of 16, so it stays in float32; "scale" is frozen.
class Net : public nn::Module {
 public:
  Net() : nn::Module("Net") {
    manual_seed(11);
    inp = register_module("inp", std::make_shared<nn::Linear>(16, 32));
    b0 = register_module("b0", std::make_shared<Block>(32, 48));
    b1 = register_module("b1", std::make_shared<Block>(32, 64));
    head = register_module("head", std::make_shared<nn::Linear>(32, 8));
    scale = register_parameter("scale", full({32}, 1.25), /*requires_grad=*/false);
  }
  Tensor forward(const Tensor& x) override { return (*head)((*b1)((*b0)((*inp)(x))) * scale); }
  std::shared_ptr<nn::Linear> inp, head;
  std::shared_ptr<Block> b0, b1;
  Tensor scale;
};

constexpr int64_t kRows = 16;  // per rank: the weight gradients' float8 matmuls want a multiple of 16

std::pair<Tensor, Tensor> batch(int r, int s) {
  std::vector<double> x, y;
  for (int k = 0; k < kRows * 16; ++k) x.push_back(2.0 * std::sin(0.37 * k + 1.3 * r + 0.71 * s));
  for (int k = 0; k < kRows * 8; ++k) y.push_back(std::cos(0.23 * k + 0.9 * r + 0.31 * s));
  return {Tensor::from_vector(x, {kRows, 16}), Tensor::from_vector(y, {kRows, 8})};
}

struct Config {
  ShardingStrategy strategy = ShardingStrategy::FULL_SHARD;
  bool bf16 = false, ac = false;
  // Two micro-batches a step: all forwards, then the backwards
  // (begin/end_micro_batches: each unit gathered once a step).
  bool micro = false;
  // Step 1 starts with an explicit unshard(): that step's forward and
  // backward run on the whole float32 weights, the others in float8.
  bool explicit_unshard = false;
  // precompute_float8_dynamic_scale_for_fsdp after step 0 (used by step 1)
  // and not after step 1 (step 2's shards changed since: stale).
  bool precompute = false;
};

Config parse(const std::string& arg) {
  Config c;
  for (const auto& [k, v] : mp::parse_arg(arg)) {
    if (k == "strategy")
      c.strategy = parse_strategy(v);
    else if (k == "bf16")
      c.bf16 = true;
    else if (k == "ac")
      c.ac = true;
    else if (k == "micro")
      c.micro = true;
    else if (k == "explicit")
      c.explicit_unshard = true;
    else if (k == "pre")
      c.precompute = true;
    else
      EMBER_CHECK(false, "bad config key '", k, "'");
  }
  return c;
}

struct Model {
  std::shared_ptr<Net> net = std::make_shared<Net>();
  std::shared_ptr<FSDPModule> fsdp;
  std::unique_ptr<optim::SGD> opt;
  std::vector<std::string> converted;
};

Model make(const Config& c, bool sharded, bool all_gather_in_float8) {
  Model m;
  m.converted = nn::convert_to_float8_training(
      *m.net, {.skip_fqns = {}, .filter = nullptr, .enable_fsdp_float8_all_gather = all_gather_in_float8});
  if (c.ac) {
    nn::checkpoint_wrapper(*m.net->b0);
    nn::checkpoint_wrapper(*m.net->b1);
  }
  if (sharded) {
    FSDPOptions o;
    o.strategy = c.strategy;
    if (c.strategy == ShardingStrategy::HYBRID_SHARD)  // (dp_replicate, dp_shard): shards of 2 ranks
      o.mesh = DeviceMesh::create({get_world_size() / 2, 2}, {"dp_replicate", "dp_shard"});
    if (c.bf16)
      o.mp_policy = {.param_dtype = DType::BFloat16, .reduce_dtype = DType::Float32, .output_dtype = DType::Float32};
    fully_shard(m.net->b0, o);
    fully_shard(m.net->b1, o);
    m.fsdp = fully_shard(m.net, o);
  }
  std::vector<Tensor> params;
  for (auto& p : m.net->parameters())
    if (p.requires_grad()) params.push_back(p);
  // SGD: Adam's normalised step would turn float8's rounding of a tiny
  // gradient into a whole step of the other sign against the one process.
  m.opt = std::make_unique<optim::SGD>(params, optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
  return m;
}

nn::StateDict full_of(Model& m) { return m.fsdp ? full_state_dict(*m.fsdp) : m.net->state_dict(); }

// What one step's all-gathers move under the float8 gather: each unit with
// float8 layers once for forward, every rank's segment of each kind (float8
// elements at one byte); and again for backward unless it stays gathered
// (SHARD_GRAD_OP, the root, micro-batches), where the float8 part travels
// only if nothing kept the forward's casts (activation checkpointing
// recomputes the layers).
int64_t float8_gather_bytes(const FSDPModule& root, const Config& c) {
  int64_t bytes = 0;
  for (const auto& u : root.units()) {
    const int64_t es = static_cast<int64_t>(dtype_size(u->compute_dtype));
    const bool twice = !u->is_root && !c.micro && c.strategy != ShardingStrategy::SHARD_GRAD_OP;
    if (u->f8.states.empty()) {
      bytes += (twice ? 2 : 1) * u->layout.padded_numel() * es;
      continue;
    }
    const int64_t hp = u->f8.hp_seg * es * u->shard_size, f8 = u->f8.f8_seg * u->shard_size;
    bytes += hp + f8;
    if (twice) bytes += hp + (c.ac ? f8 : 0);
  }
  return bytes;
}

EMBER_WORKER(float8_gather) {
  mp::init_world(env);
  const Config c = parse(env.arg);
  Model f8 = make(c, true, true), plain = make(c, true, false), one = make(c, false, false);
  WCHECK(f8.converted == (std::vector<std::string>{"inp", "b0.fc1", "b0.fc2", "b1.fc1", "b1.fc2"}), "converted ",
         f8.converted.size(), " layers");
  const bool exact = !c.bf16;
  const int accum = c.micro ? 2 : 1;
  for (int s = 0; s < 3; ++s) {
    double losses[2] = {0, 0};
    int64_t gathered[2];
    for (int k = 0; k < 2; ++k) {
      Model& m = k == 0 ? f8 : plain;
      ProcessGroup& pg = *m.fsdp->shard_group();
      m.opt->zero_grad();
      pg.reset_counters();
      if (c.explicit_unshard && s == 1) m.fsdp->unshard();
      if (c.micro) m.fsdp->begin_micro_batches();
      std::vector<Tensor> loss(accum);
      for (int i = 0; i < accum; ++i) {
        auto [x, y] = batch(env.rank * accum + i, s);
        loss[i] = nn::functional::mse_loss((*m.net)(x), y) * (1.0 / accum);
      }
      if (k == 1 && c.strategy == ShardingStrategy::FULL_SHARD && !c.micro && !c.explicit_unshard && s == 0) {
        // FULL_SHARD freed the plain gather after the forward: a read says so.
        const std::string e = ::ember::testing::error_of([&] { (void)plain.net->b0->ln->weight.to_vector(); });
        WCHECK(e.find("freed the gathered parameters after the forward") != std::string::npos, e);
      }
      if (k == 0 && c.strategy == ShardingStrategy::SHARD_GRAD_OP && !c.ac) {
        // Between forward and backward the float8 weights are gathered as
        // float8 only: their float32 data is not there, and says so; an
        // explicit unshard now is refused by name.
        const auto mem_f8 = f8.fsdp->memory();
        WCHECK(::ember::testing::error_of([&] {
                 (void)f8.net->b0->fc1->weight.to_vector();
               }).find("gathered in float8") != std::string::npos,
               "reading a float8-gathered weight did not fail naming the float8 gather");
        const std::string e = ::ember::testing::error_of([&] { f8.fsdp->unshard(); });
        WCHECK(e.find("is gathered in float8 for its forward and backward") != std::string::npos, e);
        // Gathered: the float8 gather holds about a quarter of the float32 one.
        const int64_t full = f8.net->num_parameters() * 4;
        WCHECK(mem_f8.unsharded_params < full / 2, mem_f8.unsharded_params, " gathered bytes of ", full);
      }
      for (int i = accum - 1; i >= 0; --i) loss[i].backward();
      if (c.micro) m.fsdp->end_micro_batches();
      gathered[k] = pg.counter("allgather").bytes;
      if (k == 0 && !c.explicit_unshard && !c.micro) {
        // One amax all-reduce per float8 unit's forward gather (b0, b1, the
        // root; backwards reuse their forward's scales), none while a
        // precompute holds.
        const int64_t want = c.precompute && s == 1 ? 0 : 3;
        WCHECK(pg.counter("allreduce").calls == want, "step ", s, ": ", pg.counter("allreduce").calls,
               " all-reduces in forward and backward, want ", want);
      }
      m.opt->step();
      if (k == 0 && c.precompute && s == 0) m.fsdp->precompute_float8_dynamic_scale_for_fsdp();
      for (const Tensor& l : loss) losses[k] += l.item<double>();
    }
    if (!(c.explicit_unshard && s == 1)) {
      // The plain gather moves every unit whole in param_dtype; the float8
      // one what its segments say, a fraction of it.
      const int64_t want = float8_gather_bytes(*f8.fsdp, c);
      WCHECK(gathered[0] == want, "float8 gather moved ", gathered[0], " bytes, its segments say ", want);
      WCHECK(gathered[0] < gathered[1] * (c.bf16 ? 0.65 : 0.4), "float8 gather moved ", gathered[0],
             " bytes, the float32 one ", gathered[1]);
    }
    if (exact) WCHECK(losses[0] == losses[1], "step ", s, ": loss ", losses[0], " (float8 gather) vs ", losses[1]);
    // The one process on every rank's rows.
    std::vector<Tensor> xs, ys;
    for (int r = 0; r < env.world_size * accum; ++r) {
      auto [xr, yr] = batch(r, s);
      xs.push_back(xr), ys.push_back(yr);
    }
    one.opt->zero_grad();
    nn::functional::mse_loss((*one.net)(cat(xs, 0)), cat(ys, 0)).backward();
    one.opt->step();
  }
  // The parameters: bit for bit between the two gathers in float32; both
  // within float8's error (each rank scales its own gradients) of the one
  // process.
  nn::StateDict a = full_of(f8), b = full_of(plain), want = one.net->state_dict();
  if (env.rank == 0) {
    for (auto& [name, t] : want.items()) {
      WCHECK(a.contains(name) && b.contains(name), "missing ", name);
      if (exact) {
        const auto va = a.find(name)->to_vector(), vb = b.find(name)->to_vector();
        WCHECK(va == vb, name, " differs between the float8 and the float32 gather");
      }
      mp::check_close(*a.find(name), t, name, c.bf16 ? 3e-2 : 1e-2);
      mp::check_close(*b.find(name), t, name, c.bf16 ? 3e-2 : 1e-2);
    }
  }
  // An explicit unshard gathers the whole float32 weights, as they are.
  f8.fsdp->unshard();
  const Tensor w = f8.net->b1->fc2->weight;
  WCHECK(w.sizes() == (Shape{32, 64}) && w.dtype() == (c.bf16 ? DType::BFloat16 : DType::Float32), shape_str(w.sizes()),
         " ", w.dtype());
  if (env.rank == 0) mp::check_close(w.to(DType::Float32), *a.find("b1.fc2.weight"), "unsharded b1.fc2.weight", 1e-2);
  f8.fsdp->reshard();
  if (c.precompute) {
    // Scales precomputed, then the parameters written: the gather that
    // would use them refuses, naming the unit (on every rank alike).
    f8.fsdp->precompute_float8_dynamic_scale_for_fsdp();
    {
      NoGradGuard ng;
      for (auto& p : f8.net->parameters()) p *= 1.0;
    }
    auto [x, y] = batch(env.rank, 9);
    const std::string e = ::ember::testing::error_of([&] { (void)(*f8.net)(x); });
    WCHECK(e.find("were written after precompute_float8_dynamic_scale_for_fsdp()") != std::string::npos, e);
  }
  if (c.strategy == ShardingStrategy::FULL_SHARD && !c.micro && !c.ac && !c.bf16 && !c.precompute) {
    // A layer tensor parallelism splits too (its state's sync set, as the
    // plan's styles set it): the unit's amaxes, maxed over the shard group,
    // go through that sync once, all of them (b0's two), and no other
    // unit's do; tp_float8_test and llama_tokens_test run it under real tp.
    auto net = std::make_shared<Net>();
    nn::convert_to_float8_training(*net, {.skip_fqns = {}, .filter = nullptr, .enable_fsdp_float8_all_gather = true});
    int calls = 0;
    int64_t seen = 0;
    net->b0->fc1->transform_state_as<nn::Float8LinearState>(nn::kFloat8StateKey)->sync.weight = [&](Tensor& a) {
      ++calls;
      seen = a.numel();
    };
    fully_shard(net->b0, {});
    fully_shard(net->b1, {});
    fully_shard(net, {});
    auto [x, y] = batch(env.rank, 9);
    (void)(*net)(x);
    WCHECK(calls == 1 && seen == 2, "the tp sync ran ", calls, " time(s), last on ", seen, " amaxes");
  }
  destroy_process_group();
}

TEST(FSDPFloat8, GatherInFloat8EqualsTheFloat32GatherBitForBit) {
  for (const char* arg : {"strategy=full", "strategy=grad_op"}) EMBER_EXPECT_RANKS("float8_gather", 2, {.arg = arg});
  EMBER_EXPECT_RANKS("float8_gather", 3, {.arg = "strategy=full"});
}

// Micro-batches (each unit gathered once a step), an explicit unshard()
// before a step (that step in float32, its backward gathering the same
// way), HYBRID_SHARD (2 x 2: amaxes over the shard group), and scales
// precomputed after a step (used by the next; stale after another step).
TEST(FSDPFloat8, MicroBatchesExplicitUnshardAndHybrid) {
  EMBER_EXPECT_RANKS("float8_gather", 2, {.arg = "strategy=full,micro"});
  EMBER_EXPECT_RANKS("float8_gather", 2, {.arg = "strategy=full,explicit,ac"});
  EMBER_EXPECT_RANKS("float8_gather", 4, {.arg = "strategy=hybrid"});
  EMBER_EXPECT_RANKS("float8_gather", 2, {.arg = "strategy=full,pre"});
}

TEST(FSDPFloat8, UnderActivationCheckpointingTheRecomputeUsesTheGatheredCast) {
  EMBER_EXPECT_RANKS("float8_gather", 2, {.arg = "strategy=full,ac"});
}

TEST(FSDPFloat8, Bf16ParamDtypeWithinTolerance) {
  EMBER_EXPECT_RANKS("float8_gather", 2, {.arg = "strategy=full,bf16"});
}

}  // namespace
}  // namespace ember::distributed
