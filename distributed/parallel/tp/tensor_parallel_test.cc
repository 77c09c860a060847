// Tensor and sequence parallelism on real processes. Every worker trains
// the same GPT twice: alone in-process (the reference, on the whole batch)
// and under gpt_tp_plan on the tp mesh; losses of every AdamW step and the
// final parameters (each DTensor's full_tensor) must agree. Variants: tp 2
// and 4, with and without SP, a vocabulary tp does not divide, tied
// weights, bf16 autocast, gradient accumulation. The process groups'
// counters are checked against Megatron's per-block traffic, the
// replicated-input check against tokens that differ, dropout masks against
// where they must and must not agree, and the errors.
#include "distributed/parallel/tp/tensor_parallel.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/autocast.h"
#include "core/ops.h"
#include "core/testing/error_of.h"
#include "distributed/init.h"
#include "distributed/parallel/tp/gpt_plan.h"
#include "distributed/parallel/tp/loss_parallel.h"
#include "distributed/testing/multiprocess.h"
#include "optim/clip_grad.h"
#include "optim/optimizer.h"

namespace ember::distributed {
namespace {

namespace mp = ::ember::distributed::testing;
using ::ember::testing::error_of;

constexpr int64_t kB = 4, kT = 8;

nn::GPTOptions small_gpt(bool tied, int64_t vocab = 37) {
  return {.vocab_size = vocab, .block_size = 16, .n_layer = 2, .n_head = 4, .n_embd = 32, .tie_weights = tied};
}

// The batch of step s: [kB, kT] tokens and targets, a function of s only.
std::pair<Tensor, Tensor> batch(int step, int64_t vocab) {
  Generator g(1000 + step);
  return {randint(0, vocab, {kB, kT}, DType::Int64, &g), randint(0, vocab, {kB, kT}, DType::Int64, &g)};
}

struct Run {
  std::vector<double> losses, norms;
};

// `steps` AdamW steps of `model`; each step's batch in `accum` micro-batches.
Run train(nn::GPT& model, int steps, int accum, bool bf16) {
  // eps 1e-6: a gradient that is zero in exact arithmetic (the key bias's,
  // by softmax's shift invariance) is rounding noise that Adam would blow
  // up to full-size steps of either sign.
  optim::AdamW opt(model.parameters(), {.lr = 1e-2, .eps = 1e-6, .weight_decay = 0.1});
  Run r;
  for (int s = 0; s < steps; ++s) {
    auto [tokens, targets] = batch(s, model.options.vocab_size);
    double total = 0;
    for (int m = 0; m < accum; ++m) {
      const int64_t rows = kB / accum;
      Tensor tk = tokens.narrow(0, m * rows, rows), tg = targets.narrow(0, m * rows, rows);
      Tensor loss;
      {
        AutocastGuard amp(DeviceType::CPU, DType::BFloat16, bf16);
        loss = parallel_cross_entropy(model(tk), tg) * (1.0 / accum);
      }
      loss.backward();
      total += loss.item();
    }
    // The norm over the global gradients (each replicated one counted
    // once), clipping so it bites: the same on every rank as in one process.
    r.norms.push_back(optim::clip_grad_norm_(model.parameters(), 0.5));
    opt.step();
    opt.zero_grad();
    r.losses.push_back(total);
  }
  return r;
}

Tensor whole(const Tensor& p) { return is_dtensor(p) ? as_dtensor(p).full_tensor() : p.detach(); }

EMBER_WORKER(equivalence) {
  mp::init_world(env);
  auto opt = mp::parse_arg(env.arg);
  const bool sp = opt.count("sp") != 0, tied = opt.count("tied") != 0, bf16 = opt.count("bf16") != 0;
  const int accum = opt.count("accum") ? std::stoi(opt["accum"]) : 1;
  const int steps = 3;
  manual_seed(7);
  nn::GPT ref(small_gpt(tied));
  const Run want = train(ref, steps, accum, bf16);

  auto mesh = DeviceMesh::create({env.world_size}, {"tp"});
  manual_seed(7);
  nn::GPT model(small_gpt(tied));
  parallelize_module(model, mesh, gpt_tp_plan(model, sp));
  WCHECK(tensor_parallel_mesh(model) == mesh, "the mesh is kept on the module");
  const Run got = train(model, steps, accum, bf16);

  const double tol = bf16 ? 1e-2 : 2e-5;
  for (int s = 0; s < steps; ++s)
    WCHECK(std::abs(got.losses[s] - want.losses[s]) <= tol * std::abs(want.losses[s]), "step ", s, " loss ",
           got.losses[s], " vs one process ", want.losses[s]);
  for (int s = 0; s < steps; ++s)
    WCHECK(std::abs(got.norms[s] - want.norms[s]) <= (bf16 ? 3e-2 : 1e-4) * want.norms[s] && want.norms[s] > 0.5,
           "step ", s, " gradient norm ", got.norms[s], " vs one process ", want.norms[s]);
  const auto rp = ref.named_parameters();
  const auto tp = model.named_parameters();
  WCHECK(rp.size() == tp.size(), rp.size(), " vs ", tp.size());
  for (size_t i = 0; i < rp.size(); ++i) {
    WCHECK(rp[i].first == tp[i].first, rp[i].first, " vs ", tp[i].first);
    const Tensor w = whole(tp[i].second);
    WCHECK(w.sizes() == rp[i].second.sizes(), tp[i].first, ": ", shape_str(w.sizes()));
    const double err = max(abs(w - rp[i].second)).item(), scale = max(abs(rp[i].second)).item();
    if (!bf16) {
      // 2% of one AdamW step (lr 1e-2): a wrong gradient moves a weight by
      // whole steps.
      WCHECK(err <= 2e-4 * (1 + scale), tp[i].first, " differs from one process by ", err);
      continue;
    }
    // bf16: the partial sums are rounded to bf16 before they are reduced,
    // and AdamW's first steps move a weight by ~lr whatever its gradient's
    // size, so an element whose gradient is near zero may step either way
    // (up to 2 lr a step). The mean difference must stay a small fraction
    // of one step.
    const double mean_err = mean(abs(w - rp[i].second)).item();
    WCHECK(mean_err <= 2e-3, tp[i].first, " differs from one process by ", mean_err, " on average (max ", err, ")");
  }
  // Every parameter is a DTensor: sharded or replicated on the tp mesh.
  for (auto& [name, p] : tp) WCHECK(is_dtensor(p), name, " is not a DTensor");
  default_group()->barrier()->wait();
}

void run_equivalence(int world, const std::string& arg) { EMBER_EXPECT_RANKS("equivalence", world, {.arg = arg}); }

TEST(TensorParallel, GPTMatchesOneProcessTp2) { run_equivalence(2, ""); }
TEST(TensorParallel, GPTMatchesOneProcessTp2SequenceParallel) { run_equivalence(2, "sp"); }
TEST(TensorParallel, GPTMatchesOneProcessTp4SequenceParallelTied) { run_equivalence(4, "sp,tied"); }
TEST(TensorParallel, GPTMatchesOneProcessTp4Tied) { run_equivalence(4, "tied"); }
TEST(TensorParallel, GPTMatchesOneProcessTp2Bf16Accumulation) { run_equivalence(2, "sp,bf16,accum=2"); }
TEST(TensorParallel, GPTMatchesOneProcessTp2Accumulation) { run_equivalence(2, "sp,accum=2"); }
TEST(TensorParallel, GPTMatchesOneProcessTp2Bf16) { run_equivalence(2, "bf16"); }

// Megatron's traffic per step of an L-block GPT on a [b, s] batch with
// hidden h (bytes of the whole activation, b*s*h*4): without SP, forward
// 2 all-reduces per block (+ the vocab-parallel embedding's), backward 2
// per block (+ the head's input); with SP each becomes a reduce-scatter
// plus an all-gather of the same bytes (and backward gathers each
// column-parallel input once more instead of keeping it), and the
// replicated parameters'
// gradients (LayerNorms, row-parallel biases, positions) are all-reduced.
// The loss: three all-reduces of b*s scalars, never b*s*vocab.
EMBER_WORKER(traffic) {
  mp::init_world(env);
  const bool sp = env.arg == "sp";
  auto mesh = DeviceMesh::create({env.world_size}, {"tp"});
  manual_seed(3);
  nn::GPT model(small_gpt(false, 40));
  parallelize_module(model, mesh, gpt_tp_plan(model, sp));
  auto [tokens, targets] = batch(0, 40);
  const auto& pg = mesh->group();
  const int64_t L = 2, bsh = kB * kT * 32 * 4, bs = kB * kT * 4;
  pg->reset_counters();
  Tensor loss = parallel_cross_entropy(model(tokens), targets);
  const auto fwd = pg->counters();
  pg->reset_counters();
  loss.backward();
  const auto bwd = pg->counters();
  auto get = [](const std::map<std::string, ProcessGroup::OpCount>& c, const std::string& op) {
    auto it = c.find(op);
    return it == c.end() ? ProcessGroup::OpCount{} : it->second;
  };
  auto expect = [&](const std::map<std::string, ProcessGroup::OpCount>& c, const std::string& op, int64_t calls,
                    int64_t bytes, const char* phase) {
    const auto got = get(c, op);
    WCHECK(got.calls == calls && got.bytes == bytes, phase, " ", op, ": ", got.calls, " calls of ", got.bytes,
           " bytes, expected ", calls, " of ", bytes);
  };
  if (!sp) {
    expect(fwd, "allreduce", 2 * L + 1 + 3, (2 * L + 1) * bsh + 3 * bs, "forward");
    expect(bwd, "allreduce", 2 * L + 1, (2 * L + 1) * bsh, "backward");
    for (const char* op : {"allgather", "reduce_scatter"}) {
      expect(fwd, op, 0, 0, "forward");
      expect(bwd, op, 0, 0, "backward");
    }
  } else {
    expect(fwd, "allgather", 2 * L + 1, (2 * L + 1) * bsh, "forward");
    expect(fwd, "reduce_scatter", 2 * L + 1, (2 * L + 1) * bsh, "forward");
    expect(fwd, "allreduce", 3, 3 * bs, "forward");
    // Backward gathers each column-parallel input again rather than keep
    // it (Megatron-SP): one more all-gather per region.
    expect(bwd, "allgather", 2 * (2 * L + 1), 2 * (2 * L + 1) * bsh, "backward");
    expect(bwd, "reduce_scatter", 2 * L + 1, (2 * L + 1) * bsh, "backward");
    // Replicated parameters' gradients: per block ln_1, ln_2 (weight and
    // bias), out_proj.bias, c_proj.bias; ln_f; the position table.
    const int64_t h = 32, params = L * (4 * h + 2 * h) + 2 * h + 16 * h;
    // All in one all-reduce when backward ends.
    expect(bwd, "allreduce", 1, params * 4, "backward");
  }
  default_group()->barrier()->wait();
}

TEST(TensorParallel, TrafficIsMegatrons) {
  for (const char* arg : {"", "sp"}) {
    EMBER_EXPECT_RANKS("traffic", 2, {.arg = arg});
  }
}

// EMBER_TP_CHECK_REPLICATED: tokens that differ on one tp rank are caught
// at the first module that declares them replicated, on every rank.
EMBER_WORKER(check_replicated) {
  mp::init_world(env);
  auto mesh = DeviceMesh::create({env.world_size}, {"tp"});
  manual_seed(3);
  nn::GPT model(small_gpt(false));
  parallelize_module(model, mesh, gpt_tp_plan(model, true));
  auto [tokens, targets] = batch(0, 37);
  model(tokens);  // the same tokens everywhere: no error
  Tensor bad = env.rank == 1 ? batch(5, 37).first : tokens;
  const std::string e = error_of([&] { model(bad); });
  WCHECK(e.find("RowwiseParallel on 'wte' (input) is declared Replicate but differs across the tp ranks (tp rank 1") !=
             std::string::npos,
         e);
  default_group()->barrier()->wait();
}

TEST(TensorParallel, ReplicatedInputCheckNamesTheModule) {
  EMBER_EXPECT_RANKS("check_replicated", 2, {.env = {"EMBER_TP_CHECK_REPLICATED=1"}});
}

// Dropout under SP: masks on sequence shards differ between tp ranks; on
// replicated activations (outside SP) they agree.
EMBER_WORKER(dropout_masks) {
  mp::init_world(env);
  auto mesh = DeviceMesh::create({env.world_size}, {"tp"});
  const auto& pg = mesh->group();
  auto gathered_differ = [&](nn::Module& drop) {
    manual_seed(11);
    Tensor mask = drop(ones({64}));
    Tensor all = Tensor::empty({64 * pg->size()});
    pg->allgather_into_tensor(all, mask.contiguous())->wait();
    return !allclose(all.narrow(0, 0, 64), all.narrow(0, 64, 64));
  };
  nn::GPTOptions o = small_gpt(false);
  o.dropout = 0.5;
  manual_seed(3);
  nn::GPT sp_model(o), plain(o);
  parallelize_module(sp_model, mesh, gpt_tp_plan(sp_model, true));
  parallelize_module(plain, mesh, gpt_tp_plan(plain, false));
  WCHECK(gathered_differ(*sp_model.drop), "SP: the embedding dropout's masks must differ across tp ranks");
  WCHECK(!gathered_differ(*plain.drop), "without SP the embedding dropout is replicated: masks must agree");
  WCHECK(gathered_differ(
             *static_cast<nn::MultiheadAttention&>(*static_cast<nn::TransformerBlock&>((*plain.h)[0]).attn).attn_drop),
         "attention heads differ per rank: their masks must too");
  default_group()->barrier()->wait();
}

TEST(TensorParallel, DropoutMasksDifferOnShardsAgreeOnReplicas) { EMBER_EXPECT_RANKS("dropout_masks", 2); }

EMBER_WORKER(errors) {
  mp::init_world(env);
  auto mesh = DeviceMesh::create({env.world_size}, {"tp"});
  manual_seed(3);
  nn::GPT model(small_gpt(false));
  std::string e = error_of([&] { parallelize_module(model, mesh, {{"h.9.attn", ColwiseParallel{}}}); });
  WCHECK(e.find("the plan's 'h.9.attn' (ColwiseParallel(input Replicate(), output Shard(-1))) names no module") !=
             std::string::npos,
         e);
  WCHECK(!is_dtensor(model.wte->weight), "a failed plan changes nothing");
  nn::GPTOptions three = small_gpt(false);
  three.n_head = 3;
  three.n_embd = 24;
  nn::GPT odd(three);
  e = error_of([&] { parallelize_module(odd, mesh, {{"h.0.attn", ColwiseParallel{}}}); });
  WCHECK(e.find("ColwiseParallel on 'h.0.attn': 3 attention heads do not split over tp=2") != std::string::npos, e);
  e = error_of([&] { parallelize_module(model, mesh, {{"h.0.ln_1", ColwiseParallel{}}}); });
  WCHECK(e.find("ColwiseParallel on 'h.0.ln_1': a LayerNorm") != std::string::npos, e);
  parallelize_module(model, mesh, {{"h.0.mlp.c_proj", RowwiseParallel{}}});
  e = error_of([&] { parallelize_module(model, mesh, {{"h.0.mlp.c_proj", ColwiseParallel{}}}); });
  WCHECK(e.find("h.0.mlp.c_proj.weight is already sharded") != std::string::npos, e);
  // GPT-2's c_fc carries its GELU (bias_gelu): split by rows, it is refused.
  e = error_of([&] { parallelize_module(model, mesh, {{"h.0.mlp.c_fc", RowwiseParallel{}}}); });
  WCHECK(e.find("RowwiseParallel on 'h.0.mlp.c_fc': a Linear with a fused activation") != std::string::npos, e);
  // A GELU fused after a Linear's bias would act on each rank's partial sum
  // if the Linear were split by rows.
  nn::Linear fused(8, 8);
  fused.activation = nn::LinearActivation::GeluTanh;
  e = error_of([&] { parallelize_module(fused, mesh, {{"", RowwiseParallel{}}}); });
  WCHECK(e.find("a Linear with a fused activation") != std::string::npos, e);
  // SP needs a sequence length the tp degree divides.
  nn::GPT sp_model(small_gpt(false));
  parallelize_module(sp_model, mesh, gpt_tp_plan(sp_model, true));
  e = error_of([&] { sp_model(zeros({2, 7}, DType::Int64)); });
  WCHECK(
      e.find("does not split evenly over tp=2 (tensor parallelism keeps activation shards even") != std::string::npos,
      e);
  default_group()->barrier()->wait();
}

TEST(TensorParallel, Errors) { EMBER_EXPECT_RANKS("errors", 2); }

}  // namespace
}  // namespace ember::distributed
