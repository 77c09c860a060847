// The MoE layer against a naive loop over tokens (float64, every token's
// routing chosen on the host by sorting its scores, each chosen expert a
// separate SwiGLU through mm): outputs, every gradient (x, the router, the
// three stacked expert weights, the shared experts) and both router losses,
// for k = 1 and 2, E = 4 and 6, softmax and sigmoid scores, with router
// ties and experts that receive no token. Then the model option.
#include "nn/moe.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/checkpoint.h"
#include "core/ops.h"
#include "core/testing/error_of.h"
#include "nn/float8.h"
#include "nn/transformer.h"

namespace ember::nn {
namespace {

Tensor rnd(const Shape& s, uint64_t seed, double scale = 1.0) {
  Generator g(seed);
  return randn(s, {DType::Float64}, &g) * scale;
}

void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  ASSERT_TRUE(got.defined() && want.defined()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const std::vector<double> g = got.to_vector(), w = want.to_vector();
  double scale = 0;
  for (double v : w) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < g.size(); ++i) ASSERT_NEAR(g[i], w[i], tol * std::max(scale, 1e-3)) << what << " at " << i;
}

struct Case {
  int64_t E, K;
  RouterScore score;
  bool normalize;
  int64_t shared;
};

// The inputs: tokens whose dim 0 is large and positive (half) or negative
// (half), dim 1 a constant 1. Gate rows 1 and 2 are equal (an exact tie,
// which routing breaks to expert 1) and favour positive tokens; the last
// row favours negative ones; row E-2 has -6 on dim 1, so no token picks it.
struct Inputs {
  Tensor x, gate;
};
Inputs make_inputs(int64_t N, int64_t D, int64_t E, uint64_t seed) {
  Tensor x = rnd({N, D}, seed, 0.5);
  for (int64_t t = 0; t < N; ++t) {
    x.select(0, t).select(0, 0).fill_(t % 2 ? 1.5 + 0.1 * t : -1.5 - 0.1 * t);
    x.select(0, t).select(0, 1).fill_(1.0);
  }
  Tensor gate = rnd({E, D}, seed + 1, 0.3);
  gate.select(0, 1).select(0, 0).fill_(1.0);
  gate.select(0, 2).copy_(gate.select(0, 1));
  gate.select(0, E - 1).select(0, 0).fill_(-1.0);
  gate.select(0, E - 2).select(0, 1).fill_(-6.0);
  return {x, gate};
}

struct Ref {
  Tensor y, aux, z;
  std::vector<int64_t> counts;
  int64_t dropped = 0;
};

// `capacity` >= 0: each expert takes the first `capacity` choices in
// (token, choice) order, the later ones add nothing.
Ref naive(const Tensor& x, const Tensor& gate, const Tensor& w1, const Tensor& w2, const Tensor& w3,
          const std::shared_ptr<SwiGLU>& shared, const Case& c, int64_t capacity = -1) {
  const int64_t N = x.size(0);
  std::vector<Tensor> ys, score_rows, lses;
  Ref r;
  r.counts.assign(static_cast<size_t>(c.E), 0);
  std::vector<int64_t> taken(static_cast<size_t>(c.E), 0);
  for (int64_t t = 0; t < N; ++t) {
    Tensor xt = x.select(0, t);
    Tensor logits = matmul(gate, xt);  // [E]
    Tensor s = c.score == RouterScore::Softmax ? softmax(logits, 0) : sigmoid(logits);
    const std::vector<double> sv = s.to_vector();
    std::vector<int64_t> order(static_cast<size_t>(c.E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sv[a] > sv[b]; });
    std::vector<Tensor> w;
    for (int64_t j = 0; j < c.K; ++j) w.push_back(s.select(0, order[j]));
    Tensor wsum = w[0];
    for (int64_t j = 1; j < c.K; ++j) wsum = wsum + w[j];
    Tensor yt = zeros({x.size(1)}, {DType::Float64});
    for (int64_t j = 0; j < c.K; ++j) {
      const int64_t e = order[j];
      ++r.counts[e];
      if (capacity >= 0 && taken[e]++ >= capacity) {
        ++r.dropped;
        continue;
      }
      Tensor h = silu(matmul(w1.select(0, e), xt)) * matmul(w3.select(0, e), xt);
      Tensor o = matmul(w2.select(0, e), h);
      yt = yt + o * (c.normalize && c.K > 1 ? w[j] / wsum : w[j]);
    }
    if (shared) yt = yt + (*shared)(xt.unsqueeze(0)).squeeze(0);
    ys.push_back(yt);
    score_rows.push_back(c.score == RouterScore::Softmax ? s : s / sum(s));
    Tensor m = max(logits).detach();
    lses.push_back(log(sum(exp(logits - m))) + m);
  }
  r.y = stack(ys, 0);
  Tensor p = mean(stack(score_rows, 0), {0});  // [E]
  Tensor aux = zeros({}, {DType::Float64});
  for (int64_t e = 0; e < c.E; ++e)
    aux = aux + p.select(0, e) * (static_cast<double>(r.counts[e]) * c.E / static_cast<double>(N));
  r.aux = aux;
  Tensor l = stack(lses, 0);
  r.z = mean(l * l);
  return r;
}

// The layer (float64, on [2, N/2, D]: a batch of sequences) against the
// naive loop on copies of its parameters, `capacity` told to both (-1:
// dropless): outputs, the statistics, both losses and every gradient
// within 1e-10. A first forward's statistics are reset before: they
// accumulate until then. Returns the reference.
Ref check_like_naive(const Case& c, double factor, int64_t N, uint64_t seed, const std::string& what) {
  const int64_t D = 8, H = 6;
  MoEOptions o{.num_experts = c.E,
               .top_k = c.K,
               .hidden = H,
               .score = c.score,
               .normalize_top_k = c.normalize,
               .shared_experts = c.shared,
               .aux_loss_coef = 0.3,
               .z_loss_coef = 0.05,
               .capacity_factor = factor};
  MoE moe(D, o);
  moe.to(DType::Float64);
  Inputs in = make_inputs(N, D, c.E, seed);
  moe.router->gate->weight.detach().copy_(in.gate);
  const Tensor proj = rnd({N, D}, seed + 77);
  Tensor x = in.x.clone().requires_grad_();
  moe(x.detach());
  moe.reset_stats();
  Tensor y = moe(x.view({2, N / 2, D}));
  sum(y.view({N, D}) * proj).backward();

  auto copy = [](const Tensor& t) { return t.detach().clone().requires_grad_(); };
  Tensor xr = in.x.clone().requires_grad_(), gr = copy(moe.router->gate->weight);
  Tensor w1 = copy(moe.experts->w1), w2 = copy(moe.experts->w2), w3 = copy(moe.experts->w3);
  std::shared_ptr<SwiGLU> shared;
  if (c.shared) {
    shared = std::make_shared<SwiGLU>(D, c.shared * H);
    shared->to(DType::Float64);
    shared->load_state_dict(moe.shared_experts->state_dict());
  }
  Ref r = naive(xr, gr, w1, w2, w3, shared, c, factor > 0 ? expert_capacity(o, N) : -1);
  (sum(r.y * proj) + r.aux * o.aux_loss_coef + r.z * o.z_loss_coef).backward();

  const double tol = 1e-10;
  expect_close(y.view({N, D}), r.y, tol, what + ": output");
  const MoEStats st = moe.stats();
  EXPECT_EQ(st.tokens_per_expert, r.counts) << what << ": every routed choice, dropped or not";
  EXPECT_EQ(st.tokens_per_expert[c.E - 2], 0) << what << ": the expert no token picks";
  EXPECT_EQ(st.routed, N * c.K) << what;
  EXPECT_EQ(st.dropped, r.dropped) << what;
  EXPECT_NEAR(st.aux_loss, r.aux.item(), tol) << what;
  EXPECT_NEAR(st.z_loss, r.z.item(), tol) << what;
  expect_close(x.grad(), xr.grad(), tol, what + ": dx");
  expect_close(moe.router->gate->weight.grad(), gr.grad(), tol, what + ": router");
  expect_close(moe.experts->w1.grad(), w1.grad(), tol, what + ": w1");
  expect_close(moe.experts->w2.grad(), w2.grad(), tol, what + ": w2");
  expect_close(moe.experts->w3.grad(), w3.grad(), tol, what + ": w3");
  if (c.shared)
    expect_close(moe.shared_experts->gate_proj->weight.grad(), shared->gate_proj->weight.grad(), tol,
                 what + ": shared");
  return r;
}

TEST(MoE, MatchesANaiveLoopOverTokensForwardAndBackward) {
  const std::vector<Case> cases = {
      {4, 1, RouterScore::Softmax, true, 0},  {4, 2, RouterScore::Softmax, true, 0},
      {6, 2, RouterScore::Softmax, false, 1}, {6, 1, RouterScore::Sigmoid, true, 0},
      {6, 2, RouterScore::Sigmoid, true, 2},  {4, 3, RouterScore::Softmax, true, 0},
  };
  for (const Case& c : cases) {
    const std::string what = "E " + std::to_string(c.E) + " k " + std::to_string(c.K) + " " +
                             router_score_name(c.score) + (c.normalize ? " normalised" : "") +
                             (c.shared ? " shared " + std::to_string(c.shared) : "");
    const Ref r = check_like_naive(c, 0.0, 14, 10 + c.E * 3 + c.K, what);
    EXPECT_EQ(r.dropped, 0) << what;
  }
}

// A capacity: each expert takes its first C = ceil(f N k / E) choices in
// (token, choice) order, the rest dropped (GShard's and Megatron's
// "position" policy), against the naive loop told the same C: outputs,
// every gradient, the losses (over every routed choice) and the dropped
// count. A factor of E / k (C = N, nothing to drop) gives the dropless
// layer's numbers.
TEST(MoE, CapacityDropsTheLaterChoicesAsANaiveLoop) {
  const int64_t N = 14;
  // A whole number in exact arithmetic that double puts just above it.
  EXPECT_EQ(expert_capacity({.num_experts = 2, .top_k = 1, .capacity_factor = 1.1}, 100), 55);
  EXPECT_EQ(expert_capacity({.num_experts = 2, .top_k = 1, .capacity_factor = 1.11}, 100), 56);
  struct CapCase {
    Case c;
    double factor;
  };
  const std::vector<CapCase> cases = {{{4, 1, RouterScore::Softmax, true, 0}, 1.0},
                                      {{4, 2, RouterScore::Softmax, true, 0}, 0.5},
                                      {{6, 2, RouterScore::Sigmoid, true, 1}, 1.25},
                                      {{6, 2, RouterScore::Softmax, false, 0}, 3.0},
                                      {{4, 3, RouterScore::Softmax, true, 0}, 4.0 / 3.0}};
  for (const auto& [c, factor] : cases) {
    const std::string what = "E " + std::to_string(c.E) + " k " + std::to_string(c.K) + " capacity factor " +
                             std::to_string(factor) + " " + router_score_name(c.score);
    const MoEOptions o{.num_experts = c.E, .top_k = c.K, .capacity_factor = factor};
    EXPECT_EQ(expert_capacity(o, N), static_cast<int64_t>(std::ceil(factor * N * c.K / c.E - 1e-9))) << what;
    const Ref r = check_like_naive(c, factor, N, 40 + c.E * 3 + c.K, what);
    if (factor * c.K < c.E)
      EXPECT_GT(r.dropped, 0) << what << ": the case should drop choices";
    else
      EXPECT_EQ(r.dropped, 0) << what << ": C = N leaves nothing to drop";
  }
  // No token: capacity 0, an empty output, a backward that works.
  MoE moe(8, {.num_experts = 4, .top_k = 2, .hidden = 4, .capacity_factor = 1.0});
  moe.to(DType::Float64);
  Tensor x = zeros({0, 8}, {DType::Float64}).requires_grad_();
  Tensor y = moe(x);
  EXPECT_EQ(y.sizes(), (Shape{0, 8}));
  sum(y).backward();
  EXPECT_EQ(x.grad().sizes(), (Shape{0, 8}));
  EXPECT_EQ(moe.stats().dropped, 0);
}

// Float8 experts (convert_to_float8_training): each expert's projections
// of its padded group through float8_linear, the capacity rounded up to 16
// rows (10 tokens x 2 / 4 experts x 2 = 10, then 16). Against the same layer
// in float32 with a capacity that drops nothing either way: close outputs
// and gradients, not equal ones (the casts happened). Dropless float8
// experts are a named error.
TEST(MoE, Float8ExpertsRunOnPaddedGroups) {
  const MoEOptions o{.num_experts = 4, .top_k = 2, .hidden = 32, .aux_loss_coef = 0.1, .capacity_factor = 2.0};
  EXPECT_EQ(expert_capacity(o, 10), 10);
  EXPECT_EQ(expert_capacity(o, 10, 16), 16);
  manual_seed(8);
  MoE ref(32, o), f8(32, o);
  f8.load_state_dict(ref.state_dict());
  EXPECT_EQ(convert_to_float8_training(f8), std::vector<std::string>{"experts"}) << "the gate's 4 outputs stay";
  const Tensor x0 = randn({10, 32}), proj = randn({10, 32});
  auto run = [&](MoE& m) {
    Tensor x = x0.clone().requires_grad_();
    Tensor y = m(x);
    sum(y * proj).backward();
    return std::make_pair(y.detach(), x.grad());
  };
  const auto [y_ref, dx_ref] = run(ref);
  const auto [y_f8, dx_f8] = run(f8);
  EXPECT_EQ(f8.stats().dropped, 0);
  const auto rel = [](const Tensor& a, const Tensor& b) {
    return std::sqrt(sum((a - b) * (a - b)).item() / sum(b * b).item());
  };
  for (const auto& [what, got, want] :
       {std::tuple{"output", y_f8, y_ref}, std::tuple{"dx", dx_f8, dx_ref},
        std::tuple{"w1 grad", f8.experts->w1.grad(), ref.experts->w1.grad()},
        std::tuple{"w2 grad", f8.experts->w2.grad(), ref.experts->w2.grad()},
        std::tuple{"router grad", f8.router->gate->weight.grad(), ref.router->gate->weight.grad()}}) {
    const double err = rel(got, want);
    EXPECT_GT(err, 1e-5) << what << ": the casts should show";
    EXPECT_LT(err, 0.1) << what << ": within float8's error";
  }
  MoE dropless(32, {.num_experts = 4, .top_k = 2, .hidden = 32});
  convert_to_float8_training(dropless);
  EXPECT_NE(
      ::ember::testing::error_of([&] { dropless(x0); }).find("need padded groups: give the MoE a capacity_factor"),
      std::string::npos);
}

TEST(MoE, TiesGoToTheLowerExpertAndAnEmptyExpertGetsAZeroGradient) {
  MoEOptions o{.num_experts = 4, .top_k = 1, .hidden = 4};
  MoE moe(8, o);
  moe.to(DType::Float64);
  Inputs in = make_inputs(10, 8, 4, 3);
  moe.router->gate->weight.detach().copy_(in.gate);
  Routing r = moe.router->route(in.x);
  for (int64_t t = 1; t < 10; t += 2) EXPECT_EQ(r.experts.select(0, t).item<int64_t>(), 1) << "token " << t;
  Tensor x = in.x.clone().requires_grad_();
  sum(moe(x)).backward();
  EXPECT_EQ(moe.stats().tokens_per_expert[2], 0);
  EXPECT_EQ(max(abs(moe.experts->w1.grad().select(0, 2))).item(), 0.0);
  EXPECT_GT(max(abs(moe.experts->w1.grad().select(0, 1))).item(), 0.0);
}

TEST(MoE, AuxGradScaleScalesOnlyTheRouterLossesGradient) {
  MoEOptions o{.num_experts = 4, .top_k = 2, .hidden = 4, .aux_loss_coef = 0.5, .z_loss_coef = 0.1};
  auto grad_of = [&](double scale, double coef, double on_device = 0) {
    manual_seed(3);  // the same experts each time
    MoE moe(8, o);
    moe.to(DType::Float64);
    moe.options.aux_loss_coef = coef;
    moe.options.z_loss_coef = coef / 5;
    // A loss scaler's live scale: float32 [1], multiplying the host's.
    set_moe_aux_grad_scale(moe, scale, on_device ? full({1}, on_device, {DType::Float32}) : Tensor());
    Inputs in = make_inputs(10, 8, 4, 5);
    moe.router->gate->weight.detach().copy_(in.gate);
    Tensor x = in.x;
    sum(moe(x)).backward();
    return moe.router->gate->weight.grad().clone();
  };
  // g(scale) = g_lm + scale * g_aux: linear in the scale.
  const Tensor none = grad_of(1.0, 0.0), one = grad_of(1.0, 0.5), three = grad_of(3.0, 0.5);
  expect_close(three - none, (one - none) * 3.0, 1e-10, "aux gradient scale");
  EXPECT_GT(max(abs(one - none)).item(), 1e-6);
  // The device tensor multiplies the host scale: 0.5 x 6 is 3.
  expect_close(grad_of(0.5, 0.5, 6.0) - none, (one - none) * 3.0, 1e-10, "aux gradient scale on the device");
}

// Under activation checkpointing the recompute builds the router losses
// again (the same gradients as without) and does not count the statistics
// twice; a forward without grad (an evaluation) counts none.
TEST(MoE, CheckpointRecomputeAndEvaluationKeepTheStatistics) {
  MoEOptions o{.num_experts = 4, .top_k = 2, .hidden = 4, .aux_loss_coef = 0.5, .z_loss_coef = 0.1};
  Inputs in = make_inputs(10, 8, 4, 7);
  auto run = [&](bool checkpointed) {
    manual_seed(5);
    auto moe = std::make_shared<MoE>(8, o);
    moe->to(DType::Float64);
    moe->router->gate->weight.detach().copy_(in.gate);
    Tensor x = in.x.clone().requires_grad_();
    Tensor y = checkpointed ? autograd::checkpoint([&](const Tensor& t) { return (*moe)(t); }, x) : (*moe)(x);
    sum(y * y).backward();
    return std::make_pair(moe, x.grad());
  };
  auto [plain, dx] = run(false);
  auto [ckpt, dx_ckpt] = run(true);
  expect_close(dx_ckpt, dx, 1e-12, "dx under checkpointing");
  expect_close(ckpt->router->gate->weight.grad(), plain->router->gate->weight.grad(), 1e-12, "router");
  expect_close(ckpt->experts->w2.grad(), plain->experts->w2.grad(), 1e-12, "w2");
  EXPECT_EQ(ckpt->stats().forwards, 1);
  EXPECT_EQ(ckpt->stats().tokens_per_expert, plain->stats().tokens_per_expert);
  EXPECT_NEAR(ckpt->stats().aux_loss, plain->stats().aux_loss, 1e-12);
  {
    NoGradGuard no_grad;
    (*plain)(in.x);
  }
  EXPECT_EQ(plain->stats().forwards, 1);
}

// No token (an empty batch, or a rank that routes nothing): an empty
// output, no NaN in the statistics, a backward that works.
TEST(MoE, NoTokens) {
  MoE moe(8, {.num_experts = 4, .top_k = 2, .hidden = 4, .z_loss_coef = 0.1});
  moe.to(DType::Float64);
  Tensor x = zeros({0, 8}, {DType::Float64}).requires_grad_();
  Tensor y = moe(x);
  EXPECT_EQ(y.sizes(), (Shape{0, 8}));
  EXPECT_EQ(moe.stats().aux_loss, 0.0);
  EXPECT_EQ(moe.stats().tokens_per_expert, (std::vector<int64_t>{0, 0, 0, 0}));
  sum(y).backward();
  EXPECT_EQ(x.grad().sizes(), (Shape{0, 8}));
}

TEST(MoE, BadOptionsAreNamed) {
  using ::ember::testing::error_of;
  EXPECT_NE(error_of([] { MoE(8, {.num_experts = 4, .top_k = 5, .hidden = 4}); }).find("top_k 5"), std::string::npos);
  EXPECT_NE(error_of([] { MoE(8, {.num_experts = 0, .hidden = 4}); }).find("num_experts 0"), std::string::npos);
  EXPECT_NE(error_of([] { parse_router_score("relu"); }).find("'relu'"), std::string::npos);
  EXPECT_NE(error_of([] { MoE(8, {.num_experts = 4, .hidden = 4, .capacity_factor = -1}); }).find("capacity_factor -1"),
            std::string::npos);
  MoE moe(8, {.num_experts = 4, .hidden = 4});
  EXPECT_NE(error_of([&] { moe(zeros({3, 7})); }).find("must end in dim 8"), std::string::npos);
}

TEST(MoE, ModelOptionPutsExpertsInEveryNthBlock) {
  GPTOptions o = GPTOptions::llama({.vocab_size = 32, .block_size = 16, .n_layer = 4, .n_head = 2, .n_embd = 16});
  o.moe = {.num_experts = 4, .top_k = 2, .hidden = 24, .every = 2};
  GPT gpt(o);
  EXPECT_EQ(moe_layers(gpt).size(), 2u);
  auto named = gpt.state_dict();
  EXPECT_TRUE(named.contains("h.0.mlp.router.gate.weight"));
  EXPECT_EQ(named.find("h.0.mlp.experts.w1")->sizes(), (Shape{4, 24, 16}));
  EXPECT_EQ(named.find("h.2.mlp.experts.w2")->sizes(), (Shape{4, 16, 24}));
  EXPECT_TRUE(named.contains("h.1.mlp.gate_proj.weight"));
  // GPT's initialisation covers the stacked experts: N(0, 0.02).
  const Tensor w3 = *named.find("h.0.mlp.experts.w3");
  const double sd = std::sqrt(mean(w3 * w3).item());
  EXPECT_NEAR(sd, 0.02, 0.002);
  Generator g(1);
  Tensor tokens = randint(0, 32, {2, 8}, DType::Int64, &g);
  Tensor logits = gpt(tokens);
  EXPECT_EQ(logits.sizes(), (Shape{2, 8, 32}));
  EXPECT_GT(moe_layers(gpt)[0]->stats().aux_loss, 0.0);
}

}  // namespace
}  // namespace ember::nn
