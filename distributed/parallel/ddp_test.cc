// DistributedDataParallel and SyncBatchNorm across 1-4 real processes on
// localhost (Gloo, CPU, float32). Every worker also trains a single-process
// reference on the concatenated batch of all ranks (it knows every rank's
// data: all batches come from fixed seeds) and checks DDP against it value
// by value: parameters after k SGD steps, gradients, outputs, running stats.
// Each rank initialises its model from its own seed, so agreeing with the
// reference (initialised like rank 0) also checks the initial broadcast.
// Then the failure modes: mismatched models, unused parameters, a rank dying.
#include "distributed/parallel/ddp.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/autocast.h"
#include "core/ops.h"
#include "core/testing/error_of.h"
#include "distributed/comm/backends.h"
#include "distributed/comm/process_group.h"
#include "distributed/init.h"
#include "distributed/testing/multiprocess.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "optim/clip_grad.h"
#include "optim/grad_scaler.h"
#include "optim/optimizer.h"

namespace ember::distributed {
namespace {

namespace mp = ::ember::distributed::testing;
using Clock = std::chrono::steady_clock;

constexpr double kTol = 1e-5;

std::shared_ptr<ProcessGroup> group(const mp::WorkerEnv& env, Millis timeout = std::chrono::seconds(60)) {
  ProcessGroupOptions o;
  o.timeout = timeout;
  return make_gloo_group(env.store(), env.rank, env.world_size, o);
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

using ::ember::testing::error_of;

double max_abs_diff(const Tensor& a, const Tensor& b) {
  WCHECK(a.sizes() == b.sizes(), shape_str(a.sizes()), " vs ", shape_str(b.sizes()));
  std::vector<double> x = a.to_vector(), y = b.to_vector();
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::fabs(x[i] - y[i]));
  return m;
}

void expect_close(const Tensor& got, const Tensor& want, const std::string& what, double tol = kTol) {
  WCHECK(got.defined() && want.defined(), what, ": got ", got.defined() ? "a tensor" : "undefined", ", want ",
         want.defined() ? "a tensor" : "undefined");
  double d = max_abs_diff(got, want);
  WCHECK(d <= tol, what, ": max abs diff ", d, " > ", tol);
}

// Same names, same values (the DDP replica against the reference).
void expect_same_params(nn::Module& got, nn::Module& want, const std::string& when) {
  auto g = got.named_parameters(), w = want.named_parameters();
  WCHECK(g.size() == w.size(), when, ": ", g.size(), " vs ", w.size(), " parameters");
  for (size_t i = 0; i < g.size(); ++i) {
    WCHECK(g[i].first == w[i].first, g[i].first, " vs ", w[i].first);
    expect_close(g[i].second, w[i].second, when + ": parameter " + g[i].first);
  }
}

void expect_same_grads(nn::Module& got, nn::Module& want, const std::string& when) {
  auto g = got.named_parameters(), w = want.named_parameters();
  for (size_t i = 0; i < g.size(); ++i) {
    if (!w[i].second.grad().defined()) {
      WCHECK(!g[i].second.grad().defined(), when, ": ", g[i].first, " has a gradient, the reference none");
      continue;
    }
    expect_close(g[i].second.grad(), w[i].second.grad(), when + ": gradient of " + g[i].first);
  }
}

// The end of a lockstep iteration: both optimizers step, then the replica's
// parameters must equal the reference's.
void step_both(optim::Optimizer& opt, optim::Optimizer& opt_ref, nn::Module& local, nn::Module& ref, int step) {
  opt.step();
  opt_ref.step();
  expect_same_params(local, ref, "after step " + std::to_string(step));
}

// ---- Models: built from a seed, buffers included ----

std::shared_ptr<nn::Module> make_mlp(uint64_t seed, int64_t hidden2 = 12) {
  manual_seed(seed);
  return std::make_shared<nn::Sequential>(std::vector<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(8, 16), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(16, hidden2),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(hidden2, 4)});
}

// Conv net on [N, 2, 8, 8]; with_bn adds a BatchNorm2d whose running stats
// (random, from the seed) matter in eval mode.
std::shared_ptr<nn::Module> make_convnet(uint64_t seed, bool with_bn) {
  manual_seed(seed);
  std::vector<std::shared_ptr<nn::Module>> layers{std::make_shared<nn::Conv2d>(2, 4, 3, 1, 1)};
  if (with_bn) {
    auto bn = std::make_shared<nn::BatchNorm2d>(4);
    NoGradGuard g;
    bn->running_mean.copy_(randn({4}) * 0.1);
    bn->running_var.copy_(rand({4}) + 0.5);
    Tensor w = bn->weight.detach(), b = bn->bias.detach();
    w.copy_(rand({4}) + 0.5);
    b.copy_(randn({4}) * 0.1);
    layers.push_back(bn);
  }
  layers.push_back(std::make_shared<nn::ReLU>());
  layers.push_back(std::make_shared<nn::Conv2d>(4, 4, 3, 2, 1));
  layers.push_back(std::make_shared<nn::Flatten>());
  layers.push_back(std::make_shared<nn::Linear>(4 * 4 * 4, 3));
  return std::make_shared<nn::Sequential>(layers);
}

// A model with a parameter its forward never touches.
struct WithUnused : nn::Module {
  std::shared_ptr<nn::Linear> fc1, extra, fc2;
  WithUnused() : Module("WithUnused") {
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(8, 6));
    extra = register_module("extra", std::make_shared<nn::Linear>(6, 6));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(6, 4));
  }
  Tensor forward(const Tensor& x) override { return (*fc2)(relu((*fc1)(x))); }
};

std::shared_ptr<nn::Module> make_with_unused(uint64_t seed) {
  manual_seed(seed);
  return std::make_shared<WithUnused>();
}

// ---- Data: the global batch of a step, identical on every rank ----

struct Batch {
  Tensor x, y;
  Batch rows(int64_t start, int64_t n) const { return {x.narrow(0, start, n), y.narrow(0, start, n)}; }
};

Batch global_batch(bool conv, int64_t n, int step) {
  Generator gen(1000 + step);
  Tensor x = conv ? randn({n, 2, 8, 8}, {}, &gen) : randn({n, 8}, {}, &gen);
  Tensor y = randint(0, conv ? 3 : 4, {n}, DType::Int64, &gen);
  return {x, y};
}

Tensor loss_of(nn::Module& m, const Batch& b) { return nn::functional::cross_entropy(m(b.x), b.y); }

// The start of a lockstep iteration: both gradients zeroed, the replica's
// backward on rank r's b rows of `all`, the reference's on all of them.
void backward_both(optim::Optimizer& opt, optim::Optimizer& opt_ref, nn::Module& ddp, nn::Module& ref, const Batch& all,
                   int r, int64_t b) {
  opt.zero_grad();
  opt_ref.zero_grad();
  loss_of(ddp, all.rows(r * b, b)).backward();
  loss_of(ref, all).backward();
}

// The setup most workers share: rank r's MLP replica (seeded 1 + r, so
// agreeing with the reference also checks DDP's initial broadcast) wrapped
// in DDP over `pg`, the one-process reference (seed 1), and SGD with
// momentum on each.
struct MlpWithReference {
  std::shared_ptr<nn::Module> ref, local;
  std::shared_ptr<DistributedDataParallel> ddp;
  optim::SGD opt_ddp, opt_ref;
  MlpWithReference(std::shared_ptr<ProcessGroup> pg, int rank, DDPOptions opts = {})
      : ref(make_mlp(1)),
        local(make_mlp(1 + rank)),
        ddp(std::make_shared<DistributedDataParallel>(local, with_group(std::move(opts), std::move(pg)))),
        opt_ddp(ddp->parameters(), {.lr = 0.1, .momentum = 0.9}),
        opt_ref(ref->parameters(), {.lr = 0.1, .momentum = 0.9}) {}
  static DDPOptions with_group(DDPOptions o, std::shared_ptr<ProcessGroup> pg) {
    o.process_group = std::move(pg);
    return o;
  }
};

// ---------------------------------------------------------------------------
// Worker scenarios.

// k SGD steps (momentum, zero_grad releasing grads) of DDP with per-rank
// batch b against one process on the 2b/4b batch. arg: model=mlp|conv|convbn|
// convcl (the conv net's replica channels-last: its gradients are bucket
// views laid out as the parameters, which stay channels-last),
// cap=<MB>, first=<MB>, overlap=0|1, layout=<expected bucket_indices>.
EMBER_WORKER(train) {
  auto o = mp::parse_arg(env.arg);
  auto pg = group(env);
  const int r = env.rank, ws = env.world_size;
  const std::string model = o["model"];
  const bool conv = model != "mlp";
  auto make = [&](uint64_t seed) {
    return model == "mlp" ? make_mlp(seed) : make_convnet(seed, model == "convbn");
  };
  auto ref = make(1);
  auto local = make(1 + r);  // rank 0's values reach the others by broadcast
  const bool cl = model == "convcl";
  if (cl) local->to(MemoryFormat::ChannelsLast);
  auto expect_channels_last = [&](const char* when) {
    if (!cl) return;
    for (const auto& [name, p] : local->named_parameters()) {
      if (p.dim() != 4) continue;
      WCHECK(p.is_contiguous(MemoryFormat::ChannelsLast) && !p.is_contiguous(), when, ": ", name, " strides ",
             shape_str(p.strides()));
      WCHECK(!p.grad().defined() || p.grad().strides() == p.strides(), when, ": ", name, "'s gradient strides ",
             shape_str(p.grad().strides()), " are not its ", shape_str(p.strides()));
    }
  };
  if (model == "convbn") {
    ref->eval();
    local->eval();
  }
  DDPOptions opts;
  opts.process_group = pg;
  if (o.count("cap")) opts.bucket_cap_mb = std::stod(o["cap"]);
  if (o.count("first")) opts.first_bucket_cap_mb = std::stod(o["first"]);
  if (o.count("overlap")) opts.overlap = o["overlap"] == "1";
  auto ddp = std::make_shared<DistributedDataParallel>(local, opts);

  // The layout: every parameter once, reverse registration order.
  auto layout = ddp->bucket_indices();
  std::vector<int64_t> flat;
  std::ostringstream desc;
  for (auto& b : layout) {
    desc << "[";
    for (size_t k = 0; k < b.size(); ++k) desc << (k ? " " : "") << b[k];
    desc << "]";
    flat.insert(flat.end(), b.begin(), b.end());
  }
  const int64_t np = static_cast<int64_t>(local->parameters().size());
  WCHECK(static_cast<int64_t>(flat.size()) == np, "layout ", desc.str(), " for ", np, " parameters");
  for (int64_t i = 0; i < np; ++i) WCHECK(flat[i] == np - 1 - i, "layout ", desc.str(), " is not reverse order");
  if (o.count("layout")) WCHECK(desc.str() == o["layout"], "layout ", desc.str(), ", expected ", o["layout"]);
  // Names are the wrapped module's, under "module." as in PyTorch.
  WCHECK(ddp->named_parameters().front().first == "module." + local->named_parameters().front().first,
         ddp->named_parameters().front().first);

  optim::SGD opt_ddp(ddp->parameters(), {.lr = 0.1, .momentum = 0.9});
  optim::SGD opt_ref(ref->parameters(), {.lr = 0.1, .momentum = 0.9});
  const int64_t b = 3;
  expect_same_params(*local, *ref, "after construction");
  for (int step = 0; step < 3; ++step) {
    Batch all = global_batch(conv, b * ws, step);
    backward_both(opt_ddp, opt_ref, *ddp, *ref, all, r, b);
    expect_same_grads(*local, *ref, "step " + std::to_string(step));
    expect_channels_last("backward");
    step_both(opt_ddp, opt_ref, *local, *ref, step);
    expect_channels_last("step");
  }
  // Gradients are views into the flat buckets: members of a bucket share storage.
  auto params = local->parameters();
  for (auto& bucket : layout)
    for (size_t k = 1; k < bucket.size(); ++k)
      WCHECK(params[bucket[k]].grad().shares_storage(params[bucket[0]].grad()), "parameter ", bucket[k],
             " has a gradient outside its bucket");
  if (model == "convbn")
    for (auto& [name, buf] : local->named_buffers()) {
      const Tensor* want = ref->state_dict().find(name);
      WCHECK(want != nullptr, name);
      expect_close(buf, *want, "buffer " + name, 0);
    }
}

// Gradient accumulation over k micro-batches: no_sync by hand and with
// GradientAccumulator, against one process on all k * ws micro-batches.
EMBER_WORKER(accumulate) {
  auto pg = group(env);
  const int r = env.rank, ws = env.world_size;
  const bool use_accumulator = env.arg == "accumulator";
  MlpWithReference m(pg, r);
  auto& [ref, local, ddp, opt_ddp, opt_ref] = m;
  GradientAccumulator acc(*ddp, 3);
  const int k = 3;
  const int64_t b = 2;
  for (int step = 0; step < 2; ++step) {
    // Micro-batch i of rank r: rows [(i * ws + r) * b, +b) of the global batch.
    Batch all = global_batch(false, b * ws * k, step);
    opt_ddp.zero_grad();
    opt_ref.zero_grad();
    for (int i = 0; i < k; ++i) {
      Batch mine = all.rows((i * ws + r) * b, b);
      if (use_accumulator) {
        bool synced = acc.backward(loss_of(*ddp, mine));
        WCHECK(synced == (i == k - 1), "micro-step ", i, " synced=", synced);
      } else if (i < k - 1) {
        auto guard = ddp->no_sync();
        (loss_of(*ddp, mine) * (1.0 / k)).backward();
      } else {
        (loss_of(*ddp, mine) * (1.0 / k)).backward();
      }
      if (i < k - 1 && ws > 1) {
        // Not synchronized yet: the local gradient differs from the reference's final one.
        loss_of(*ref, all).backward();
        double d = max_abs_diff(local->parameters().front().grad(), ref->parameters().front().grad());
        WCHECK(d > 1e-4, "micro-step ", i, ": gradients look synchronized already (diff ", d, ")");
        opt_ref.zero_grad();
      }
    }
    loss_of(*ref, all).backward();
    expect_same_grads(*local, *ref, "step " + std::to_string(step));
    step_both(opt_ddp, opt_ref, *local, *ref, step);
  }
}

// DDP + mixed precision (arg "fp16": autocast to float16 with a GradScaler;
// "bf16": autocast to bfloat16) equals one process doing the same on the
// whole batch, up to the low dtype's rounding: a rank's weight gradient is
// one low-precision GEMM over its rows, the reference's one over all rows,
// so the two round differently (2e-3 relative for fp16, 2e-2 for bf16 on
// the gradients; the loss scale must agree exactly). "fp16_accum": each
// rank's rows in 2 micro-steps through GradientAccumulator (scaled losses,
// one unscale_ after the last), then clip_grad_norm_ on both sides.
EMBER_WORKER(amp) {
  auto pg = group(env);
  const int r = env.rank, ws = env.world_size;
  const bool fp16 = env.arg != "bf16";
  const bool accum = env.arg == "fp16_accum";
  const DType low = fp16 ? DType::Float16 : DType::BFloat16;
  MlpWithReference m(pg, r);
  auto& [ref, local, ddp, opt_ddp, opt_ref] = m;
  optim::GradScaler scaler_ddp({.enabled = fp16}), scaler_ref({.enabled = fp16});
  const double tol = fp16 ? 2e-3 : 2e-2;
  const int64_t b = 4;
  for (int step = 0; step < 3; ++step) {
    Batch all = global_batch(false, b * ws, step);
    opt_ddp.zero_grad();
    opt_ref.zero_grad();
    Tensor l_ddp, l_ref;
    {
      AutocastGuard amp(DeviceType::CPU, low);
      l_ref = loss_of(*ref, all);
      if (accum) {
        GradientAccumulator acc(*ddp, 2);
        for (int m = 0; m < 2; ++m) {
          Tensor l = loss_of(*ddp, all.rows(r * b + m * b / 2, b / 2));
          WCHECK(acc.backward(scaler_ddp.scale(l)) == (m == 1), "micro-step ", m);
        }
      } else {
        l_ddp = loss_of(*ddp, all.rows(r * b, b));
        WCHECK(l_ddp.dtype() == DType::Float32, "the loss runs in float32 under autocast");
      }
    }
    if (!accum) scaler_ddp.scale(l_ddp).backward();
    scaler_ref.scale(l_ref).backward();
    scaler_ddp.unscale_(opt_ddp);
    scaler_ref.unscale_(opt_ref);
    if (accum) {
      const double n_ddp = optim::clip_grad_norm_(local->parameters(), 0.05);
      const double n_ref = optim::clip_grad_norm_(ref->parameters(), 0.05);
      WCHECK(n_ref > 0.05, "the clip must bite: the reference norm is ", n_ref);
      WCHECK(std::fabs(n_ddp - n_ref) <= tol * n_ref, "step ", step, ": gradient norms ", n_ddp, " vs ", n_ref);
    }
    auto gl = local->parameters(), gr = ref->parameters();
    for (size_t i = 0; i < gl.size(); ++i) {
      const double scale = max(abs(gr[i].grad())).item();
      const double d = max_abs_diff(gl[i].grad(), gr[i].grad());
      WCHECK(d <= tol * std::max(scale, 1e-6), "step ", step, " parameter ", i, ": gradient differs by ", d,
             " (largest entry ", scale, ")");
    }
    scaler_ddp.step(opt_ddp);
    scaler_ref.step(opt_ref);
    scaler_ddp.update();
    scaler_ref.update();
    WCHECK(scaler_ddp.get_scale() == scaler_ref.get_scale(), "loss scales ", scaler_ddp.get_scale(), " vs ",
           scaler_ref.get_scale());
  }
  auto pl = local->parameters(), pr = ref->parameters();
  for (size_t i = 0; i < pl.size(); ++i) WCHECK(max_abs_diff(pl[i], pr[i]) < 1e-3, "parameter ", i, " after 3 steps");
}

// Gradient compression (arg "fp16" / "bf16": fp16_compress_hook /
// bf16_compress_hook; "+join": inside join_uneven_inputs, rank 0 running one
// step fewer). The averaged gradients equal the float32 reference within the
// low dtype's rounding (a few units of its last place, relative to the
// tensor's largest entry), and every value is one the low dtype can hold:
// the sum really travelled in it (the default hook fails this).
EMBER_WORKER(compress) {
  auto pg = group(env);
  const int r = env.rank, ws = env.world_size;
  const bool fp16 = has(env.arg, "fp16"), join = has(env.arg, "+join");
  const DType low = fp16 ? DType::Float16 : DType::BFloat16;
  MlpWithReference m(pg, r, {.comm_hook = fp16 ? fp16_compress_hook() : bf16_compress_hook()});
  // References, not a structured binding: the lambdas below capture them.
  std::shared_ptr<nn::Module> &ref = m.ref, &local = m.local;
  std::shared_ptr<DistributedDataParallel>& ddp = m.ddp;
  optim::SGD &opt_ddp = m.opt_ddp, &opt_ref = m.opt_ref;
  // Low-dtype rounding, twice (the cast, the sum's result), in units of the
  // largest entry.
  const double tol = fp16 ? 2e-3 : 1.6e-2;
  const int64_t b = 4;
  const int steps = 3;
  auto check_step = [&](int step) {
    auto gl = local->parameters(), gr = ref->parameters();
    for (size_t i = 0; i < gl.size(); ++i) {
      const double scale = max(abs(gr[i].grad())).item();
      const double d = max_abs_diff(gl[i].grad(), gr[i].grad());
      WCHECK(d <= tol * scale, "step ", step, " parameter ", i, ": gradient differs by ", d, " (largest entry ",
             scale, ")");
      WCHECK(max_abs_diff(gl[i].grad().to(low).to(DType::Float32), gl[i].grad()) == 0, "step ", step,
             " parameter ", i, ": the averaged gradient holds values ", dtype_name(low), " cannot, so it was not "
             "reduced in ", dtype_name(low));
    }
  };
  auto body = [&](int my_steps) {
    for (int step = 0; step < my_steps; ++step) {
      Batch all = global_batch(false, b * ws, step);
      opt_ddp.zero_grad();
      opt_ref.zero_grad();
      loss_of(*ddp, all.rows(r * b, b)).backward();
      // The reference: every active rank's rows that step (a joined rank
      // adds zeros, and DDP divides by the initial world size).
      for (int rr = 0; rr < ws; ++rr)
        if (!(join && rr == 0 && step == steps - 1)) (loss_of(*ref, all.rows(rr * b, b)) * (1.0 / ws)).backward();
      check_step(step);
      opt_ddp.step();
      opt_ref.step();
    }
  };
  if (join) {
    join_uneven_inputs(*ddp, [&] { body(r == 0 ? steps - 1 : steps); });
  } else {
    body(steps);
  }
  if (join && r == 0) return;  // its replica missed the last step
  auto pl = local->parameters(), pr = ref->parameters();
  for (size_t i = 0; i < pl.size(); ++i) WCHECK(max_abs_diff(pl[i], pr[i]) < 1e-2, "parameter ", i, " after the steps");
}

// Rank ws-1 builds a different second layer: every rank's constructor
// throws naming the parameter and the ranks.
EMBER_WORKER(mismatch) {
  auto pg = group(env, std::chrono::seconds(20));
  const int r = env.rank, ws = env.world_size;
  auto local = make_mlp(1, r == ws - 1 ? 13 : 12);
  DDPOptions opts;
  opts.process_group = pg;
  std::string msg = error_of([&] { DistributedDataParallel ddp(local, opts); });
  std::printf("rank %d: %s\n", r, msg.c_str());
  WCHECK(has(msg, "different parameters"), msg);
  WCHECK(has(msg, "'2.weight' [13,16]") && has(msg, "'2.weight' [12,16]"), "names the parameter and shapes: ", msg);
  WCHECK(has(msg, "rank 0") && has(msg, "rank " + std::to_string(ws - 1)), "names the ranks: ", msg);
  WCHECK(has(msg, "differing: [" + std::to_string(ws - 1) + "]"), msg);
  // The same conv net, channels-last on the last rank only: its bucket would
  // hold the weights' elements in another order, so it is refused by name.
  auto conv = make_convnet(1, false);
  if (r == ws - 1) conv->to(MemoryFormat::ChannelsLast);
  msg = error_of([&] { DistributedDataParallel ddp(conv, opts); });
  WCHECK(has(msg, "different parameters") && has(msg, "'0.weight' [4,2,3,3] float32 channels-last"),
         "names the layout: ", msg);
}

// arg "error": find_unused_parameters=false, so backward fails naming the
// unused parameters. arg "find": reduced with zero gradients, equal to the
// reference, and extra.* keeps no gradient as without DDP.
EMBER_WORKER(unused) {
  auto pg = group(env, std::chrono::seconds(20));
  const int r = env.rank, ws = env.world_size;
  auto ref = make_with_unused(1);
  auto local = make_with_unused(1 + r);
  DDPOptions opts;
  opts.process_group = pg;
  opts.find_unused_parameters = env.arg == "find";
  auto ddp = std::make_shared<DistributedDataParallel>(local, opts);
  const int64_t b = 3;
  if (env.arg == "error") {
    Batch all = global_batch(false, b * ws, 0);
    std::string msg = error_of([&] { loss_of(*ddp, all.rows(r * b, b)).backward(); });
    WCHECK(has(msg, "extra.weight") && has(msg, "extra.bias") && has(msg, "find_unused_parameters"), msg);
    WCHECK(!has(msg, "fc1.weight"), msg);
    return;
  }
  optim::SGD opt_ddp(ddp->parameters(), {.lr = 0.1, .momentum = 0.9});
  optim::SGD opt_ref(ref->parameters(), {.lr = 0.1, .momentum = 0.9});
  for (int step = 0; step < 3; ++step) {
    Batch all = global_batch(false, b * ws, step);
    backward_both(opt_ddp, opt_ref, *ddp, *ref, all, r, b);
    WCHECK(!static_cast<WithUnused&>(*local).extra->weight.grad().defined(), "extra.weight got a gradient");
    expect_same_grads(*local, *ref, "step " + std::to_string(step));
    step_both(opt_ddp, opt_ref, *local, *ref, step);
  }
}

// SyncBatchNorm in training mode: outputs, gradients, running stats and
// parameters after SGD steps equal BatchNorm2d on the concatenated batch.
EMBER_WORKER(syncbn) {
  auto pg = group(env);
  const int r = env.rank, ws = env.world_size;
  auto ref = make_convnet(1, true);
  auto local = make_convnet(1 + r, true);
  convert_sync_batchnorm(*local, pg);
  DDPOptions opts;
  opts.process_group = pg;
  auto ddp = std::make_shared<DistributedDataParallel>(local, opts);
  optim::SGD opt_ddp(ddp->parameters(), {.lr = 0.05});
  optim::SGD opt_ref(ref->parameters(), {.lr = 0.05});
  const int64_t b = 4;
  for (int step = 0; step < 3; ++step) {
    Batch all = global_batch(true, b * ws, step);
    // Shift and scale so the statistics are not those of N(0, 1).
    all.x = all.x * 3.0 + 2.0;
    opt_ddp.zero_grad();
    opt_ref.zero_grad();
    Tensor out = (*ddp)(all.x.narrow(0, r * b, b));
    Tensor ref_out = (*ref)(all.x);
    expect_close(out, ref_out.narrow(0, r * b, b), "step " + std::to_string(step) + ": output");
    // The reference loss is the mean over all rows; each rank's mean over its
    // rows, averaged by DDP, is the same.
    nn::functional::cross_entropy(out, all.y.narrow(0, r * b, b)).backward();
    nn::functional::cross_entropy(ref_out, all.y).backward();
    expect_same_grads(*local, *ref, "step " + std::to_string(step));
    auto want = ref->state_dict();
    for (auto& [name, buf] : local->named_buffers())
      expect_close(buf, *want.find(name), "step " + std::to_string(step) + ": buffer " + name);
    step_both(opt_ddp, opt_ref, *local, *ref, step);
  }
}

// Buffer broadcast before each forward. Every rank first gets running stats
// of its own; then, in eval mode and in train mode, a forward through DDP
// must behave as the plain model holding rank 0's stats (arg "1",
// broadcast_buffers=true, PyTorch's default) or the rank's own (arg "0"):
// the same output and, in train mode, the same momentum-updated stats.
EMBER_WORKER(buffers) {
  auto pg = group(env);
  const int r = env.rank, ws = env.world_size;
  const bool broadcast = env.arg == "1";
  auto local = make_convnet(1 + r, true);
  DDPOptions opts;
  opts.process_group = pg;
  opts.broadcast_buffers = broadcast;
  auto ddp = std::make_shared<DistributedDataParallel>(local, opts);
  auto set_stats = [](nn::Module& m, int owner) {
    NoGradGuard g;
    for (auto& [name, buf] : m.named_buffers()) {
      if (has(name, "running_mean")) buf.copy_(arange(4) * 0.1 - 0.3 + 0.05 * owner);
      if (has(name, "running_var")) buf.copy_(arange(4) * 0.2 + 0.5 + 0.25 * owner);
    }
  };
  const int owner = broadcast ? 0 : r;
  for (bool train : {false, true}) {
    const std::string when = train ? "train mode" : "eval mode";
    set_stats(*local, r);
    auto ref = make_convnet(1, true);  // rank 0's parameters, which DDP broadcast
    set_stats(*ref, owner);
    ddp->train(train);
    ref->train(train);
    Batch all = global_batch(true, 4 * ws, 7);
    Tensor x = all.x.narrow(0, 4 * r, 4) * 2.0 + 1.0;
    Tensor out, ref_out;
    {
      NoGradGuard g;
      out = (*ddp)(x);
      ref_out = (*ref)(x);
    }
    expect_close(out, ref_out, when + ": output");
    auto want = ref->state_dict();
    for (auto& [name, buf] : local->named_buffers())
      expect_close(buf, *want.find(name), when + ": buffer " + name, 1e-6);
  }
  // The check can fail: ranks other than 0 really held different stats.
  // (Every rank runs the forward: it is a collective.)
  if (broadcast) {
    auto mine = make_convnet(1, true);
    set_stats(*mine, r);
    mine->eval();
    ddp->eval();
    set_stats(*local, r);
    NoGradGuard g;
    Batch all = global_batch(true, 4, 8);
    double d = max_abs_diff((*ddp)(all.x), (*mine)(all.x));
    WCHECK(r == 0 || d > 1e-3, "rank ", r, "'s own stats give the same output as rank 0's (diff ", d, ")");
  }
}

// Under live recovery (EMBER_LIVE_RECOVERY=1, arg "1") a synchronizing
// backward leaves every rank with rank 0's buffers, so a step committed on
// any rank is the same step: batch norm's running statistics, updated by
// each rank's forward from its own batch, are rank 0's again before the
// next forward (a survivor of rank 0 hands on these, not its own). Without
// it (arg "0") they differ until the next forward: the check can fail.
EMBER_WORKER(buffers_at_commit) {
  setenv("EMBER_LIVE_RECOVERY", env.arg == "1" ? "1" : "0", 1);
  auto pg = group(env);
  const int r = env.rank, ws = env.world_size;
  DDPOptions opts;
  opts.process_group = pg;
  auto ddp = std::make_shared<DistributedDataParallel>(make_convnet(1, true), opts);
  Batch all = global_batch(true, 4 * ws, 3);
  loss_of(*ddp, all.rows(4 * r, 4)).backward();
  double worst = 0;
  for (auto& [name, buf] : ddp->module().named_buffers()) {
    if (!has(name, "running")) continue;
    Tensor mine = buf.clone(), root = buf.clone();
    pg->broadcast(root, 0)->wait();
    worst = std::max(worst, max_abs_diff(mine, root));
  }
  if (env.arg == "1")
    WCHECK(worst == 0, "rank ", r, ": running statistics differ from rank 0's by ", worst, " after the backward");
  else
    WCHECK(r == 0 || worst > 1e-4, "rank ", r, ": running statistics equal rank 0's without the broadcast");
}

// The last rank dies before its second backward: the others' backward
// fails within the group's timeout, naming the allreduce.
EMBER_WORKER(rank_dies) {
  const Millis timeout{3000};
  auto pg = group(env, timeout);
  const int r = env.rank, ws = env.world_size;
  auto local = make_mlp(1);
  DDPOptions opts;
  opts.process_group = pg;
  auto ddp = std::make_shared<DistributedDataParallel>(local, opts);
  optim::SGD opt(ddp->parameters(), {.lr = 0.1});
  const int64_t b = 2;
  for (int step = 0; step < 3; ++step) {
    Batch all = global_batch(false, b * ws, step);
    if (step == 1 && r == ws - 1) {
      std::fflush(stdout);
      _exit(42);
    }
    opt.zero_grad();
    Tensor loss = loss_of(*ddp, all.rows(r * b, b));
    if (step < 1) {
      loss.backward();
      opt.step();
      continue;
    }
    auto start = Clock::now();
    std::string msg = error_of([&] { loss.backward(); });
    auto took = std::chrono::duration_cast<Millis>(Clock::now() - start);
    std::printf("rank %d: %s (after %lld ms)\n", r, msg.c_str(), static_cast<long long>(took.count()));
    WCHECK(!msg.empty(), "backward with a dead peer must fail");
    WCHECK(has(msg, "allreduce"), msg);
    WCHECK(took < timeout + Millis{5000}, "failed after ", took.count(), " ms");
    return;
  }
}

// The model outlives its DDP wrapper: the hooks left on its parameters do
// nothing, and plain backward and steps work as without DDP.
EMBER_WORKER(outlives_ddp) {
  auto pg = group(env);
  auto local = make_mlp(1);
  auto ref = make_mlp(1);
  Batch all = global_batch(false, 4, 0);
  {
    DDPOptions opts;
    opts.process_group = pg;
    auto ddp = std::make_shared<DistributedDataParallel>(local, opts);
    loss_of(*ddp, all).backward();
    loss_of(*ref, all).backward();
    expect_same_grads(*local, *ref, "with DDP");
  }
  local->zero_grad();
  ref->zero_grad();
  loss_of(*local, all).backward();
  loss_of(*ref, all).backward();
  expect_same_grads(*local, *ref, "after DDP is gone");
}

// replicate() as an in-place transform: the model itself is called, its
// ranks end where one process on the whole batch ends; no_sync through the
// handle; a second replicate is refused; after remove() the model trains
// alone (rank 0 alone runs a backward: a collective would hang the test).
EMBER_WORKER(replicate_in_place) {
  auto pg = group(env);
  const int r = env.rank, ws = env.world_size;
  auto local = make_mlp(1 + r), ref = make_mlp(1);
  auto rep = replicate(local, {}, DeviceMesh::from_group(pg, "dp"));
  WCHECK(replicated_of(*local) != nullptr && &rep->process_group() == pg.get(), "the state lives on the module");
  const std::string twice = error_of([&] { replicate(local); });
  WCHECK(has(twice, "already replicated"), twice);
  optim::SGD opt(local->parameters(), {.lr = 0.1, .momentum = 0.9});
  optim::SGD opt_ref(ref->parameters(), {.lr = 0.1, .momentum = 0.9});
  const int64_t b = 3;
  for (int step = 0; step < 3; ++step) {
    Batch all = global_batch(false, b * ws, step);
    opt.zero_grad();
    opt_ref.zero_grad();
    if (step == 2) {  // two micro-batches, the first inside no_sync
      {
        auto guard = rep->no_sync();
        (loss_of(*local, all.rows(r * b, 1)) * (1.0 / b)).backward();
      }
      (loss_of(*local, all.rows(r * b + 1, b - 1)) * ((b - 1.0) / b)).backward();
    } else {
      loss_of(*local, all.rows(r * b, b)).backward();
    }
    loss_of(*ref, all).backward();
    expect_same_grads(*local, *ref, "step " + std::to_string(step));
    step_both(opt, opt_ref, *local, *ref, step);
  }
  rep->remove();
  WCHECK(replicated_of(*local) == nullptr, "remove() takes the state off");
  // A handle that outlives its module: remove() is then a no-op, not a
  // dangling access.
  {
    auto gone = make_mlp(1);
    auto late = replicate(gone, {}, DeviceMesh::from_group(pg, "dp"));
    gone.reset();
    late->remove();
    WCHECK(has(error_of([&] { late->module(); }), "the module is gone"), "module() after the module died");
  }
  if (r == 0) loss_of(*local, global_batch(false, 2, 9)).backward();
  pg->barrier()->wait();
}

// ---------------------------------------------------------------------------
// Parent-side tests.

// Uneven inputs: rank r has 2 + r steps (rank 0 runs out first), inside
// join_uneven_inputs. Each rank's parameters must equal one process that,
// at step s, sums the gradients of the ranks still training divided by the
// world size (torch's Join with DDP's default), after that rank's own last
// step; and each rank shadows exactly the steps it did not have. arg
// "accumulate": two micro-batches per step through GradientAccumulator with
// the forward inside it (the no_sync forwards are shadowed without
// gradients).
EMBER_WORKER(uneven) {
  auto pg = group(env);
  const int r = env.rank, ws = env.world_size;
  const bool accumulate = env.arg == "accumulate";
  const int micro = accumulate ? 2 : 1;
  auto steps_of = [](int rank) { return 2 + rank; };
  auto batch = [](int rank, int i) {
    Generator gen(5000 + 100 * rank + i);
    return Batch{randn({3, 8}, {}, &gen), randint(0, 4, {3}, DType::Int64, &gen)};
  };
  auto ref = make_mlp(1);
  auto local = make_mlp(1 + r);
  DDPOptions opts;
  opts.process_group = pg;
  opts.first_bucket_cap_mb = 0.0005;  // several buckets, so shadowing keeps their order
  auto ddp = std::make_shared<DistributedDataParallel>(local, opts);
  optim::SGD opt_ddp(ddp->parameters(), {.lr = 0.1, .momentum = 0.9});
  GradientAccumulator acc(*ddp, micro);
  const int64_t shadowed = join_uneven_inputs(*ddp, [&] {
    for (int s = 0; s < steps_of(r); ++s) {
      opt_ddp.zero_grad();
      for (int m = 0; m < micro; ++m) acc.backward([&] { return loss_of(*ddp, batch(r, s * micro + m)); });
      opt_ddp.step();
    }
  });
  const int max_steps = steps_of(ws - 1);
  WCHECK(shadowed == int64_t{micro} * (max_steps - steps_of(r)), "rank ", r, " shadowed ", shadowed, " forwards");
  optim::SGD opt_ref(ref->parameters(), {.lr = 0.1, .momentum = 0.9});
  for (int s = 0; s < steps_of(r); ++s) {
    opt_ref.zero_grad();
    for (int rr = 0; rr < ws; ++rr)
      if (s < steps_of(rr))
        for (int m = 0; m < micro; ++m) (loss_of(*ref, batch(rr, s * micro + m)) * (1.0 / (micro * ws))).backward();
    opt_ref.step();
  }
  expect_same_params(*local, *ref, "after rank " + std::to_string(r) + "'s " + std::to_string(steps_of(r)) + " steps");
  // The group is in step afterwards: a plain collective still works.
  Tensor t = full({1}, 1.0);
  pg->allreduce(t)->wait();
  WCHECK(t.to_vector()[0] == ws, "allreduce after the join");
}

mp::RunOptions with_arg(const std::string& arg, int seconds = 120) {
  mp::RunOptions o;
  o.arg = arg;
  o.deadline = std::chrono::seconds(seconds);
  return o;
}

class DDPWorlds : public ::testing::TestWithParam<int> {};

TEST_P(DDPWorlds, MlpMatchesSingleProcessOnTheWholeBatch) {
  EMBER_EXPECT_RANKS("train", GetParam(), with_arg("model=mlp"));
}

TEST_P(DDPWorlds, ConvNetMatchesSingleProcess) { EMBER_EXPECT_RANKS("train", GetParam(), with_arg("model=conv")); }

TEST_P(DDPWorlds, ChannelsLastConvNetMatchesSingleProcess) {
  EMBER_EXPECT_RANKS("train", GetParam(), with_arg("model=convcl"));
}

TEST_P(DDPWorlds, ConvNetWithEvalBatchNormMatchesSingleProcess) {
  EMBER_EXPECT_RANKS("train", GetParam(), with_arg("model=convbn"));
}

INSTANTIATE_TEST_SUITE_P(World, DDPWorlds, ::testing::Values(1, 2, 4));

// MLP parameter sizes in reverse order: 16, 192, 48, 768, 64, 512 bytes.
// 1 KB caps (0.001 MiB = 1048.6 B): the bucket closes once it reaches the cap.
TEST(DDP, SmallBucketsGiveTheSameResultAndLayout) {
  EMBER_EXPECT_RANKS("train", 2, with_arg("model=mlp,cap=0.001,first=0.001,layout=[5 4 3 2 1][0]"));
  // A smaller first bucket (524 B): [5 4 3 2] reaches it, the rest fits in 1 KB.
  EMBER_EXPECT_RANKS("train", 2, with_arg("model=mlp,cap=0.001,first=0.0005,layout=[5 4 3 2][1 0]"));
  // Tiny caps: one parameter per bucket.
  EMBER_EXPECT_RANKS("train", 2, with_arg("model=conv,cap=0.000001,first=0.000001,layout=[5][4][3][2][1][0]"));
  // Default caps: one bucket.
  EMBER_EXPECT_RANKS("train", 2, with_arg("model=mlp,layout=[5 4 3 2 1 0]"));
}

TEST(DDP, WithoutOverlapGivesTheSameResult) {
  for (const char* arg : {"model=mlp,overlap=0", "model=conv,overlap=0,cap=0.001,first=0.001"}) {
    SCOPED_TRACE(arg);
    EMBER_EXPECT_RANKS("train", 2, with_arg(arg));
  }
}

TEST(DDP, NoSyncAccumulatesLocallyThenSynchronizesTheSum) {
  for (int ws : {2, 3}) {
    EMBER_EXPECT_RANKS("accumulate", ws, with_arg("no_sync"));
  }
}

TEST(DDP, GradientAccumulatorEqualsTheWholeBatch) {
  for (int ws : {2, 4}) {
    EMBER_EXPECT_RANKS("accumulate", ws, with_arg("accumulator"));
  }
}

TEST(DDP, ParameterMismatchNamesTheParameterAndRanks) {
  for (int ws : {2, 3}) {
    EMBER_EXPECT_RANKS("mismatch", ws, with_arg("", 60));
  }
}

TEST(DDP, UnusedParameterIsAnErrorNamingIt) { EMBER_EXPECT_RANKS("unused", 2, with_arg("error", 60)); }

TEST(DDP, FindUnusedParametersMatchesSingleProcess) { EMBER_EXPECT_RANKS("unused", 2, with_arg("find")); }

TEST(DDP, SyncBatchNormMatchesBatchNormOnTheWholeBatch) {
  for (int ws : {2, 3}) {
    EMBER_EXPECT_RANKS("syncbn", ws, with_arg(""));
  }
}

TEST(DDP, BuffersFollowRankZeroBeforeEachForwardUnlessDisabled) {
  for (const char* arg : {"1", "0"}) {
    SCOPED_TRACE(std::string("broadcast_buffers=") + arg);
    for (int ws : {2, 3}) {
      EMBER_EXPECT_RANKS("buffers", ws, with_arg(arg));
    }
  }
}

TEST(DDP, UnderLiveRecoveryABackwardLeavesRankZerosBuffersEverywhere) {
  for (const char* arg : {"1", "0"}) {
    SCOPED_TRACE(std::string("live recovery ") + arg);
    EMBER_EXPECT_RANKS("buffers_at_commit", 2, with_arg(arg));
  }
}

TEST(DDP, DyingRankFailsTheOthersWithinTheTimeout) {
  mp::RunOptions o = with_arg("", 60);
  o.expect_exit = {{2, 42}};
  EMBER_EXPECT_RANKS("rank_dies", 3, o);
}

TEST(DDP, UnevenInputsJoinInsteadOfHanging) {
  for (int ws : {2, 3}) {
    for (const char* arg : {"plain", "accumulate"}) {
      SCOPED_TRACE(std::string("world ") + std::to_string(ws) + ", " + arg);
      EMBER_EXPECT_RANKS("uneven", ws, with_arg(arg, 60));
    }
  }
}

TEST(DDP, MixedPrecisionMatchesOneProcessOnTheWholeBatch) {
  for (const char* arg : {"fp16", "bf16", "fp16_accum"}) {
    SCOPED_TRACE(arg);
    EMBER_EXPECT_RANKS("amp", 2, with_arg(arg, 60));
  }
}

TEST(DDP, CompressionHooksReduceInTheLowDtype) {
  for (const char* arg : {"fp16", "bf16"})
    for (int ws : {2, 3}) {
      SCOPED_TRACE(std::string(arg) + " world " + std::to_string(ws));
      EMBER_EXPECT_RANKS("compress", ws, with_arg(arg, 60));
    }
  EMBER_EXPECT_RANKS("compress", 2, with_arg("bf16+join", 60));
}

TEST(DDP, ReplicateTransformsTheModuleInPlace) { EMBER_EXPECT_RANKS("replicate_in_place", 2, with_arg("", 60)); }

TEST(DDP, ModelOutlivesItsWrapper) { EMBER_EXPECT_RANKS("outlives_ddp", 1, with_arg("", 60)); }

// Where the spawned workers start (see multiprocess.h).
}  // namespace
}  // namespace ember::distributed
