// Transformer layers: attention against a float64 reference written out with
// loops, causality (a later token cannot change an earlier output), finite
// differences through attention and a whole block (inputs and parameters),
// GPT's parameter names and a short fit that must lower the loss.
#include "nn/transformer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/gradcheck.h"
#include "core/ops.h"
#include "nn/functional.h"
#include "optim/optimizer.h"

namespace ember::nn {
namespace {

// out[b, t] = out_proj(concat_h softmax_j<=t(q_h[t] . k_h[j] / sqrt(D)) v_h[j]),
// in float64 with plain loops.
std::vector<double> reference_attention(MultiheadAttention& m, const Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), E = m.embed_dim, H = m.num_heads, D = E / H;
  std::vector<double> X = x.to_vector(), W = m.in_proj_weight.to_vector(), Bi = m.in_proj_bias.to_vector();
  std::vector<double> Wo = m.out_proj->weight.to_vector(), Bo = m.out_proj->bias.to_vector();
  auto proj = [&](int64_t b, int64_t t, int64_t row) {
    double s = Bi[row];
    for (int64_t e = 0; e < E; ++e) s += W[row * E + e] * X[(b * T + t) * E + e];
    return s;
  };
  std::vector<double> out(static_cast<size_t>(B * T * E));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> concat(static_cast<size_t>(E), 0.0);
      for (int64_t h = 0; h < H; ++h) {
        const int64_t last = m.causal ? t : T - 1;
        std::vector<double> score;
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= last; ++j) {
          double s = 0;
          for (int64_t d = 0; d < D; ++d) s += proj(b, t, h * D + d) * proj(b, j, E + h * D + d);
          score.push_back(s / std::sqrt(static_cast<double>(D)));
          mx = std::max(mx, score.back());
        }
        double z = 0;
        for (double& s : score) z += (s = std::exp(s - mx));
        for (int64_t j = 0; j <= last; ++j)
          for (int64_t d = 0; d < D; ++d) concat[h * D + d] += score[j] / z * proj(b, j, 2 * E + h * D + d);
      }
      for (int64_t o = 0; o < E; ++o) {
        double s = Bo[o];
        for (int64_t e = 0; e < E; ++e) s += Wo[o * E + e] * concat[e];
        out[(b * T + t) * E + o] = s;
      }
    }
  return out;
}

TEST(MultiheadAttention, MatchesALoopReferenceCausalOrNot) {
  for (bool causal : {true, false}) {
    manual_seed(1);
    MultiheadAttention m(6, 3, 0.0, causal);
    m.to(kCPU, DType::Float64);
    {
      NoGradGuard g;
      Tensor b = m.in_proj_bias.detach(), ob = m.out_proj->bias.detach();
      b.copy_(randn({18}, DType::Float64) * 0.1);  // non-zero biases, so they are checked too
      ob.copy_(randn({6}, DType::Float64) * 0.1);
    }
    Tensor x = randn({2, 5, 6}, DType::Float64);
    std::vector<double> got = m(x).to_vector(), want = reference_attention(m, x);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-12) << "causal " << causal << " " << i;
  }
}

TEST(MultiheadAttention, ALaterTokenCannotChangeAnEarlierOutput) {
  manual_seed(2);
  MultiheadAttention m(8, 2);
  Tensor x = randn({1, 6, 8});
  Tensor y = m(x);
  Tensor x2 = x.clone();
  {
    NoGradGuard g;
    Tensor row = x2.narrow(1, 3, 1);
    row.copy_(randn({1, 1, 8}) * 10.0);
  }
  Tensor y2 = m(x2);
  EXPECT_EQ(y.narrow(1, 0, 3).to_vector(), y2.narrow(1, 0, 3).to_vector());
  EXPECT_NE(y.narrow(1, 3, 1).to_vector(), y2.narrow(1, 3, 1).to_vector());
}

TEST(MultiheadAttention, FiniteDifferencesThroughAttentionAndABlock) {
  manual_seed(3);
  MultiheadAttention m(4, 2);
  m.to(kCPU, DType::Float64);
  Tensor x = randn({2, 3, 4}, DType::Float64).requires_grad_();
  auto r = autograd::gradcheck([&](const std::vector<Tensor>& in) { return m(in[0]); },
                               {x, m.in_proj_weight, m.out_proj->weight});
  EXPECT_TRUE(r.ok) << r.message;

  TransformerBlock block(4, 2);
  block.to(kCPU, DType::Float64);
  std::vector<Tensor> inputs{x};
  for (const Tensor& p : block.parameters()) inputs.push_back(p);
  auto rb = autograd::gradcheck([&](const std::vector<Tensor>& in) { return block(in[0]); }, inputs);
  EXPECT_TRUE(rb.ok) << rb.message;
}

// The attention's q, k and v come from the in-projection through one node
// (attend_qkv) whose backward writes qkv's gradient once. The reference is
// the composition it replaces, three narrow views of qkv, each a zero-filled
// gradient of qkv's size that the engine sums: the same values bit for bit
// (x + 0 is x), forward and every gradient, with dropout drawing the same
// mask from the same generator; and a second backward through the same
// graph (retain_graph) gives the same gradients again.
TEST(MultiheadAttention, OneNodeFromQkvEqualsThreeViews) {
  for (bool causal : {true, false}) {
    manual_seed(4);
    MultiheadAttention m(12, 3, 0.25, causal);
    m.train();
    const Tensor x0 = randn({2, 7, 12}), w = randn({2, 7, 12});
    auto grads = [&](bool views, int backwards) {
      manual_seed(11);  // the dropout mask's draws
      m.zero_grad();
      Tensor x = x0.clone().requires_grad_();
      Tensor y;
      if (views) {
        const int64_t B = 2, T = 7, E = 12, H = 3, D = 4;
        Tensor qkv = linear(x, m.in_proj_weight, m.in_proj_bias);
        auto heads = [&](int64_t i) {
          return qkv.narrow(2, i * E, E).reshape({B, T, H, D}).permute({0, 2, 1, 3}).reshape({B, H, T, D});
        };
        Generator own;
        Tensor a =
            scaled_dot_product_attention(heads(0), heads(1), heads(2), causal, 0.25, m.attn_drop->generator(own));
        y = (*m.out_proj)(a.permute({0, 2, 1, 3}).reshape({B, T, E}));
      } else {
        y = m(x);
      }
      Tensor loss = sum(y * w);
      for (int i = 0; i < backwards; ++i) loss.backward(Tensor(), /*retain_graph=*/i + 1 < backwards);
      return std::vector<std::vector<double>>{y.to_vector(), x.grad().to_vector(), m.in_proj_weight.grad().to_vector(),
                                              m.in_proj_bias.grad().to_vector(), m.out_proj->weight.grad().to_vector()};
    };
    const auto want = grads(true, 1), got = grads(false, 1), twice = grads(false, 2);
    const char* what[] = {"output", "x", "in_proj_weight", "in_proj_bias", "out_proj.weight"};
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i], want[i]) << what[i] << " causal " << causal;
      if (i == 0) continue;
      std::vector<double> doubled = want[i];
      for (double& v : doubled) v *= 2;  // two backwards accumulate: exactly twice (x + x)
      EXPECT_EQ(twice[i], doubled) << what[i] << " after two backwards, causal " << causal;
    }
  }
}

// A module's own attention function (context parallelism's) takes q, k and
// v as views of qkv, not attend_qkv's node: what the function reads besides
// them gets its gradient (a nested pass to q, k and v alone would drop it),
// here a scale on q, against finite differences' reference d/ds sum(y w).
TEST(MultiheadAttention, AnAttentionFunctionsOtherInputsGetTheirGradients) {
  manual_seed(6);
  MultiheadAttention m(8, 2);
  m.to(kCPU, DType::Float64);
  Tensor s = full({1}, 1.5, DType::Float64).requires_grad_();
  m.attention = [&](const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double p, Generator* gen) {
    return scaled_dot_product_attention(q * s, k, v, causal, p, gen);
  };
  const Tensor x = randn({2, 5, 8}, DType::Float64), w = randn({2, 5, 8}, DType::Float64);
  Tensor loss = sum(m(x) * w);
  loss.backward();
  ASSERT_TRUE(s.grad().defined()) << "the function's own input got no gradient";
  auto at = [&](double v) {
    NoGradGuard g;
    Tensor s2 = full({1}, v, DType::Float64);
    m.attention = [&](const Tensor& q, const Tensor& k, const Tensor& vv, bool causal, double p, Generator* gen) {
      return scaled_dot_product_attention(q * s2, k, vv, causal, p, gen);
    };
    return sum(m(x) * w).item();
  };
  const double h = 1e-6, want = (at(1.5 + h) - at(1.5 - h)) / (2 * h);
  EXPECT_NEAR(s.grad().item(), want, 1e-6 * std::max(1.0, std::abs(want)));
}

// Without grad the module takes no node and gives the same output.
TEST(MultiheadAttention, NoGradGivesTheSameOutput) {
  manual_seed(5);
  MultiheadAttention m(8, 2);
  const Tensor x = randn({2, 5, 8});
  const std::vector<double> with = m(x).to_vector();
  NoGradGuard g;
  Tensor y = m(x);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_EQ(y.to_vector(), with);
}

// Tied weights: lm_head holds no parameter, and the embedding's gradient is the sum of what
// an untied copy gives its embedding and its head holding the same values.
TEST(GPT, TiedWeightsShareTheEmbeddingAndSumBothGradients) {
  manual_seed(5);
  GPT tied({.vocab_size = 9, .block_size = 6, .n_layer = 1, .n_head = 2, .n_embd = 8, .tie_weights = true});
  manual_seed(5);
  GPT untied({.vocab_size = 9, .block_size = 6, .n_layer = 1, .n_head = 2, .n_embd = 8});
  for (auto& [n, p] : tied.named_parameters()) EXPECT_EQ(n.find("lm_head"), std::string::npos) << n;
  EXPECT_EQ(tied.named_parameters().size() + 1, untied.named_parameters().size());
  {
    NoGradGuard ng;
    for (auto& [n, p] : untied.named_parameters()) {
      Tensor dst = p;
      dst.copy_(n == "lm_head.weight" ? tied.wte->weight : *tied.state_dict().find(n));
    }
  }
  Tensor tokens = Tensor::from_vector({1, 4, 2, 8, 0, 3, 5, 5, 7, 1, 2, 6}, {2, 6}, DType::Int64);
  Tensor w = randn({2, 6, 9});
  sum(tied(tokens) * w).backward();
  sum(untied(tokens) * w).backward();
  Tensor want = untied.wte->weight.grad() + std::dynamic_pointer_cast<Linear>(untied.lm_head)->weight.grad();
  EXPECT_TRUE(allclose(tied.wte->weight.grad(), want, 1e-5, 1e-6));
  EXPECT_TRUE(allclose(tied.h->parameters()[0].grad(), untied.h->parameters()[0].grad(), 1e-5, 1e-6));
}

TEST(GPT, NamesShapesAndAShortFit) {
  manual_seed(4);
  GPT gpt({.vocab_size = 11, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16});
  std::vector<std::string> names;
  for (auto& [n, p] : gpt.named_parameters()) names.push_back(n);
  for (const char* want : {"wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.attn.in_proj_weight",
                           "h.0.attn.in_proj_bias", "h.0.attn.out_proj.weight", "h.1.mlp.c_fc.weight",
                           "h.1.mlp.c_proj.bias", "h.1.ln_2.bias", "ln_f.weight", "lm_head.weight"})
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
  EXPECT_EQ(std::find(names.begin(), names.end(), "lm_head.bias"), names.end());
  // A repeating sequence: next token = (token + 1) mod 11, learnable from context.
  std::vector<double> ids;
  for (int b = 0; b < 4; ++b)
    for (int t = 0; t < 8; ++t) ids.push_back((b + t) % 11);
  Tensor tokens = Tensor::from_vector(ids, {4, 8}, DType::Int64);
  std::vector<double> next;
  for (double v : ids) next.push_back(std::fmod(v + 1, 11));
  Tensor targets = Tensor::from_vector(next, {32}, DType::Int64);
  Tensor logits = gpt(tokens);
  EXPECT_EQ(logits.sizes(), Shape({4, 8, 11}));
  optim::AdamW opt(gpt.parameters(), {.lr = 3e-3});
  double first = 0, last = 0;
  for (int s = 0; s < 40; ++s) {
    opt.zero_grad();
    Tensor loss = functional::cross_entropy(gpt(tokens).reshape({32, 11}), targets);
    loss.backward();
    opt.step();
    (s == 0 ? first : last) = loss.item();
  }
  EXPECT_NEAR(first, std::log(11.0), 0.3);  // near uniform at the start
  EXPECT_LT(last, 0.5 * first);
  // Longer than block_size is an error naming both.
  try {
    gpt(Tensor::from_vector(std::vector<double>(9, 1.0), {1, 9}, DType::Int64));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("exceeds block_size 8"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace ember::nn
