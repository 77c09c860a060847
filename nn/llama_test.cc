// The LLaMA family's pieces against references computed another way:
// rms_norm against its formula in float64 and finite differences; rotary
// embeddings against Hugging Face's rotate_half written with narrow/cat,
// their defining property (q.k after rotation depends only on the
// positions' difference) and finite differences; grouped-query attention
// against multi-head attention with the k/v heads copied out, and against
// MultiheadAttention itself when it is plain multi-head; SwiGLU against its
// composition and LLaMA's hidden-size rule at LLaMA-7B's size; the LLaMA
// GPT's names, causality and a short fit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/gradcheck.h"
#include "core/ops.h"
#include "core/ops_nn.h"
#include "nn/functional.h"
#include "nn/transformer.h"
#include "optim/optimizer.h"

namespace ember::nn {
namespace {

Tensor f64(const Shape& s) { return randn(s, DType::Float64); }

TEST(RMSNorm, MatchesItsFormulaAndFiniteDifferences) {
  manual_seed(1);
  Tensor x = f64({3, 5, 7}), w = f64({7});
  // y = x / sqrt(mean(x^2) + eps) * w
  Tensor want = x / sqrt(mean(x * x, {-1}, true) + 1e-6) * w;
  EXPECT_TRUE(allclose(rms_norm(x, 1, w, 1e-6), want, 1e-12, 1e-12));
  RMSNorm m({7}, 1e-6);
  EXPECT_TRUE(
      allclose(m(x.to(DType::Float32)), (x / sqrt(mean(x * x, {-1}, true) + 1e-6)).to(DType::Float32), 1e-5, 1e-6));
  for (bool weighted : {true, false}) {
    Tensor xi = f64({4, 6}).requires_grad_(), wi = f64({6}).requires_grad_();
    auto r = autograd::gradcheck(
        [&](const std::vector<Tensor>& in) { return rms_norm(in[0], 1, weighted ? in[1] : Tensor(), 1e-5); }, {xi, wi});
    EXPECT_TRUE(r.ok) << r.message;
  }
  Tensor xi = f64({2, 3, 4}).requires_grad_(), wi = f64({3, 4}).requires_grad_();
  auto r =
      autograd::gradcheck([&](const std::vector<Tensor>& in) { return rms_norm(in[0], 2, in[1], 1e-5); }, {xi, wi});
  EXPECT_TRUE(r.ok) << r.message;
}

// HF: q * cat(cos, cos) + rotate_half(q) * cat(sin, sin), rotate_half(x) =
// cat(-x2, x1), with [T, D/2] tables broadcast over batch and heads.
Tensor hf_rope(const Tensor& q, const Tensor& c, const Tensor& s) {
  const int64_t D = q.size(-1), T = q.size(-3);
  Tensor cc = cat({c, c}, 1).reshape({T, 1, D}), ss = cat({s, s}, 1).reshape({T, 1, D});
  Tensor x1 = q.narrow(-1, 0, D / 2), x2 = q.narrow(-1, D / 2, D / 2);
  return q * cc + cat({-x2, x1}, -1) * ss;
}

TEST(RotaryEmbedding, MatchesHuggingFacesRotateHalfAndFiniteDifferences) {
  manual_seed(2);
  Tensor q = f64({2, 5, 3, 8});
  RotaryTables t = rotary_tables(8, 10000.0, 5, Tensor(), kCPU);
  Tensor c = t.cos.to(DType::Float64), s = t.sin.to(DType::Float64);
  EXPECT_TRUE(allclose(rotary_embedding(q, c, s), hf_rope(q, c, s), 1e-12, 1e-12));
  // The tables: position 0 turns nothing; pair i at position t turns by
  // t * 10000^(-2i/8).
  EXPECT_DOUBLE_EQ(t.cos.to_vector()[0], 1.0);
  EXPECT_NEAR(t.sin.to_vector()[3 * 4 + 1], std::sin(3.0 * std::pow(10000.0, -2.0 / 8)), 1e-6);
  Tensor qi = f64({1, 4, 2, 6}).requires_grad_();
  RotaryTables u = rotary_tables(6, 500.0, 4, Tensor(), kCPU);
  auto r = autograd::gradcheck(
      [&](const std::vector<Tensor>& in) {
        return rotary_embedding(in[0], u.cos.to(DType::Float64), u.sin.to(DType::Float64));
      },
      {qi});
  EXPECT_TRUE(r.ok) << r.message;
}

// The property RoPE exists for: rotate q at position m and k at n, and
// their dot product depends on m - n alone.
TEST(RotaryEmbedding, DotProductsDependOnlyOnRelativePosition) {
  manual_seed(3);
  Tensor q = f64({1, 1, 1, 16}), k = f64({1, 1, 1, 16});
  auto dot_at = [&](int64_t m, int64_t n) {
    Tensor pm = Tensor::from_vector({static_cast<double>(m)}, {1}, DType::Int64);
    Tensor pn = Tensor::from_vector({static_cast<double>(n)}, {1}, DType::Int64);
    RotaryTables a = rotary_tables(16, 100.0, 1, pm, kCPU), b = rotary_tables(16, 100.0, 1, pn, kCPU);
    Tensor qm = rotary_embedding(q, a.cos.to(DType::Float64), a.sin.to(DType::Float64));
    Tensor kn = rotary_embedding(k, b.cos.to(DType::Float64), b.sin.to(DType::Float64));
    return sum(qm * kn).item();
  };
  EXPECT_NEAR(dot_at(7, 3), dot_at(4, 0), 1e-5);
  EXPECT_NEAR(dot_at(12, 2), dot_at(10, 0), 1e-5);
  EXPECT_GT(std::abs(dot_at(7, 3) - dot_at(7, 2)), 1e-3);  // and it does depend on the difference
}

// Copies `src`'s weights into `dst`, a multi-head attention (n_kv_head =
// n_head), with each k/v head repeated for the q heads of its group.
void copy_grouped_into_multihead(GroupedQueryAttention& src, GroupedQueryAttention& dst) {
  NoGradGuard ng;
  const int64_t D = src.head_dim, rep = src.n_head / src.n_kv_head;
  dst.q_proj->weight.copy_(src.q_proj->weight);
  dst.o_proj->weight.copy_(src.o_proj->weight);
  for (int64_t h = 0; h < src.n_head; ++h) {
    dst.k_proj->weight.narrow(0, h * D, D).copy_(src.k_proj->weight.narrow(0, (h / rep) * D, D));
    dst.v_proj->weight.narrow(0, h * D, D).copy_(src.v_proj->weight.narrow(0, (h / rep) * D, D));
  }
}

TEST(GroupedQueryAttention, EqualsMultiheadWithTheKvHeadsRepeated) {
  manual_seed(4);
  for (double theta : {0.0, 10000.0}) {
    GroupedQueryAttention gqa(16, 4, {.n_kv_head = 2, .rope_theta = theta});
    GroupedQueryAttention mha(16, 4, {.n_kv_head = 4, .rope_theta = theta});
    copy_grouped_into_multihead(gqa, mha);
    EXPECT_EQ(gqa.k_proj->weight.sizes(), Shape({8, 16}));
    Tensor x = randn({2, 5, 16}).requires_grad_(), x2 = x.detach().clone().requires_grad_();
    Tensor a = gqa(x), b = mha(x2);
    EXPECT_TRUE(allclose(a, b, 1e-5, 1e-6)) << "theta " << theta;
    Tensor w = randn({2, 5, 16});
    sum(a * w).backward();
    sum(b * w).backward();
    EXPECT_TRUE(allclose(x.grad(), x2.grad(), 1e-5, 1e-6));
    // A kv head's gradient is the sum over the q heads of its group.
    Tensor gk = mha.k_proj->weight.grad();
    Tensor want = gk.narrow(0, 0, 4) + gk.narrow(0, 4, 4);
    EXPECT_TRUE(allclose(gqa.k_proj->weight.grad().narrow(0, 0, 4), want, 1e-4, 1e-6));
  }
}

// The rotary tables are cached between calls: positions changed in place
// (the same tensor), a new theta and a new sequence length each give what a
// fresh module gives.
TEST(GroupedQueryAttention, CachedRotaryTablesFollowPositionsAndTheta) {
  manual_seed(9);
  GroupedQueryAttention m(16, 4, {.n_kv_head = 2, .rope_theta = 100.0});
  auto fresh = [&](const Tensor& x) {
    GroupedQueryAttention f(16, 4, {.n_kv_head = 2, .rope_theta = m.options.rope_theta});
    NoGradGuard ng;
    for (auto& [name, p] : f.named_parameters()) {
      Tensor dst = p;
      dst.copy_(*m.state_dict().find(name));
    }
    if (m.positions.defined()) f.positions = m.positions.clone();
    return f(x);
  };
  Tensor x = randn({1, 4, 16});
  m.positions = Tensor::from_vector({0, 1, 2, 3}, {4}, DType::Int64);
  EXPECT_TRUE(allclose(m(x), fresh(x), 0, 0));
  m.positions.copy_(Tensor::from_vector({8, 9, 10, 11}, {4}, DType::Int64));  // in place
  const Tensor moved = m(x);
  EXPECT_TRUE(allclose(moved, fresh(x), 0, 0));
  m.options.rope_theta = 10000.0;
  EXPECT_TRUE(allclose(m(x), fresh(x), 0, 0));
  EXPECT_FALSE(allclose(m(x), moved, 1e-4, 1e-5));
  m.positions = Tensor();
  Tensor x6 = randn({1, 6, 16});
  EXPECT_TRUE(allclose(m(x6), fresh(x6), 0, 0));
}

TEST(GroupedQueryAttention, WithoutRopeOrGroupsItIsMultiheadAttention) {
  manual_seed(5);
  GroupedQueryAttention gqa(12, 3, {.bias = true});
  MultiheadAttention mha(12, 3);
  {
    NoGradGuard ng;
    mha.in_proj_weight.copy_(cat({gqa.q_proj->weight, gqa.k_proj->weight, gqa.v_proj->weight}, 0));
    mha.in_proj_bias.copy_(cat({gqa.q_proj->bias, gqa.k_proj->bias, gqa.v_proj->bias}, 0));
    mha.out_proj->weight.copy_(gqa.o_proj->weight);
    mha.out_proj->bias.copy_(gqa.o_proj->bias);
  }
  Tensor x = randn({2, 4, 12});
  EXPECT_TRUE(allclose(gqa(x), mha(x), 1e-5, 1e-6));
}

TEST(GroupedQueryAttention, FiniteDifferencesAndNamedErrors) {
  manual_seed(6);
  GroupedQueryAttention m(8, 4, {.n_kv_head = 2, .rope_theta = 50.0});
  m.to(kCPU, DType::Float64);
  Tensor x = f64({2, 3, 8}).requires_grad_();
  auto r = autograd::gradcheck([&](const std::vector<Tensor>& in) { return m(in[0]); },
                               {x, m.q_proj->weight, m.k_proj->weight, m.v_proj->weight, m.o_proj->weight});
  EXPECT_TRUE(r.ok) << r.message;
  auto error_of = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error_of([] { GroupedQueryAttention(12, 4, {.n_kv_head = 3}); }).find("multiple of n_kv_head 3"),
            std::string::npos);
  EXPECT_NE(error_of([] { GroupedQueryAttention(12, 4, {.rope_theta = 1e4}); }).find("even head_dim, got 3"),
            std::string::npos);
  EXPECT_NE(error_of([] { GPT(GPTOptions{.n_head = 4, .n_embd = 16, .n_kv_head = 2}); }).find("needs arch llama"),
            std::string::npos);
}

TEST(SwiGLU, ComposesAndFollowsLlamasHiddenSizeRule) {
  manual_seed(7);
  SwiGLU m(6, 10);
  Tensor x = randn({3, 6});
  Tensor g = mm(x, m.gate_proj->weight.t()), u = mm(x, m.up_proj->weight.t());
  Tensor want = mm(g * sigmoid(g) * u, m.down_proj->weight.t());
  EXPECT_TRUE(allclose(m(x), want, 1e-5, 1e-6));
  // LLaMA-7B: dim 4096 -> 2/3 of 16384 = 10922 -> a multiple of 256: 11008.
  EXPECT_EQ(GPTOptions::llama({.n_embd = 4096}).ffn_width(), 11008);
  EXPECT_EQ(GPTOptions::llama({.n_embd = 64, .ffn_hidden = 100}).ffn_width(), 100);
  EXPECT_EQ(GPTOptions({.n_embd = 64}).ffn_width(), 256);
  Tensor xi = f64({2, 3}).requires_grad_();
  auto r = autograd::gradcheck([](const std::vector<Tensor>& in) { return silu(in[0]); }, {xi});
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(Llama, NamesCausalityAndAShortFit) {
  manual_seed(8);
  GPT m(GPTOptions::llama(
      {.vocab_size = 13, .block_size = 8, .n_layer = 2, .n_head = 4, .n_embd = 16, .n_kv_head = 2, .ffn_hidden = 24}));
  std::vector<std::string> names;
  for (auto& [n, p] : m.named_parameters()) names.push_back(n);
  const std::vector<std::string> want = {"wte.weight",
                                         "h.0.ln_1.weight",
                                         "h.0.attn.q_proj.weight",
                                         "h.0.attn.k_proj.weight",
                                         "h.0.attn.v_proj.weight",
                                         "h.0.attn.o_proj.weight",
                                         "h.0.ln_2.weight",
                                         "h.0.mlp.gate_proj.weight",
                                         "h.0.mlp.up_proj.weight",
                                         "h.0.mlp.down_proj.weight"};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(names.at(i), want[i]);
  EXPECT_EQ(names.back(), "lm_head.weight");
  EXPECT_EQ(names.size(), 1 + 2 * 9 + 2);  // no wpe, no biases
  EXPECT_EQ(m.named_parameters().at(2).second.sizes(), Shape({16, 16}));
  EXPECT_EQ(m.named_parameters().at(3).second.sizes(), Shape({8, 16}));
  // A later token cannot change an earlier logit.
  Tensor a = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {1, 6}, DType::Int64);
  Tensor b = Tensor::from_vector({1, 2, 3, 9, 9, 9}, {1, 6}, DType::Int64);
  Tensor la = m(a), lb = m(b);
  EXPECT_TRUE(allclose(la.narrow(1, 0, 3), lb.narrow(1, 0, 3), 1e-6, 1e-7));
  EXPECT_FALSE(allclose(la.narrow(1, 3, 1), lb.narrow(1, 3, 1), 1e-3, 1e-4));
  // Next token = (token + 1) mod 13: learnable from the current token.
  std::vector<double> ids, next;
  for (int b2 = 0; b2 < 4; ++b2)
    for (int t = 0; t < 8; ++t) ids.push_back((3 * b2 + t) % 13);
  for (double v : ids) next.push_back(std::fmod(v + 1, 13));
  Tensor tokens = Tensor::from_vector(ids, {4, 8}, DType::Int64),
         targets = Tensor::from_vector(next, {32}, DType::Int64);
  optim::AdamW opt(m.parameters(), {.lr = 1e-2});
  double first = 0, last = 0;
  for (int s = 0; s < 40; ++s) {
    opt.zero_grad();
    Tensor loss = functional::cross_entropy(m(tokens).reshape({32, 13}), targets);
    loss.backward();
    opt.step();
    (s == 0 ? first : last) = loss.item();
  }
  EXPECT_LT(last, 0.2 * first) << first << " -> " << last;
}

}  // namespace
}  // namespace ember::nn
