// Fused attention (core/ops/attention.cc) against the composed reference
// (matmul, mask, softmax, dropout, matmul) in float64, with the dropout
// mask dropout() draws from the same generator; finite differences through
// it; shapes several blocks long (the CPU kernel's 64-row blocks), 16-bit
// inputs, the packed projection's op, and the errors.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/gradcheck.h"
#include "core/ops.h"
#include "core/ops_nn.h"
#include "core/testing/error_of.h"

namespace ember {
namespace {

Tensor rnd(const Shape& s, uint64_t seed, DType dt = DType::Float64) {
  Generator g(seed);
  return randn(s, {DType::Float64}, &g).to(dt);
}

// softmax(q k^T * scale + mask) with dropout from `gen`, times v.
Tensor reference(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double p, Generator* gen) {
  const int64_t tq = q.size(-2), tk = k.size(-2);
  Tensor s = matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  if (causal) {
    std::vector<double> m(static_cast<size_t>(tq * tk));
    for (int64_t i = 0; i < tq; ++i)
      for (int64_t j = 0; j < tk; ++j) m[i * tk + j] = j > i ? -std::numeric_limits<double>::infinity() : 0.0;
    s = s + Tensor::from_vector(m, {tq, tk}, s.dtype());
  }
  Tensor a = softmax(s, -1);
  if (p > 0) {
    Tensor keep = bernoulli(a.sizes(), 1.0 - p, a.options(), gen);
    a = a * keep * (1.0 / (1.0 - p));
  }
  return matmul(a, v);
}

void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const auto g = got.to_vector(), w = want.to_vector();
  for (size_t i = 0; i < g.size(); ++i)
    ASSERT_NEAR(g[i], w[i], tol * std::max(1.0, std::abs(w[i]))) << what << " " << i;
}

struct Case {
  Shape q, k, v;
  bool causal;
  double p;
};

TEST(Attention, MatchesComposedReferenceForwardAndBackward) {
  const std::vector<Case> cases = {
      {{2, 3, 5, 4}, {2, 3, 5, 4}, {2, 3, 5, 4}, false, 0.0},   {{2, 3, 5, 4}, {2, 3, 5, 4}, {2, 3, 5, 6}, true, 0.0},
      {{1, 2, 70, 8}, {1, 2, 70, 8}, {1, 2, 70, 8}, true, 0.0},  // two query blocks
      {{3, 150, 16}, {3, 150, 16}, {3, 150, 16}, true, 0.25},    // three, with dropout
      {{2, 7, 8}, {2, 131, 8}, {2, 131, 3}, false, 0.1},         // more keys than queries
      {{2, 131, 8}, {2, 9, 8}, {2, 9, 3}, true, 0.0},            // fewer: rows past the last key see all
  };
  uint64_t seed = 1;
  for (const Case& c : cases)
    for (DType dt : {DType::Float64, DType::Float32}) {
      const std::string what =
          shape_str(c.q) + " causal " + std::to_string(c.causal) + " p " + std::to_string(c.p) + " " + dtype_name(dt);
      Tensor q = rnd(c.q, seed++, dt).requires_grad_(), k = rnd(c.k, seed++, dt).requires_grad_(),
             v = rnd(c.v, seed++, dt).requires_grad_();
      Tensor q64 = q.detach().to(DType::Float64).requires_grad_(), k64 = k.detach().to(DType::Float64).requires_grad_(),
             v64 = v.detach().to(DType::Float64).requires_grad_();
      Generator g1(5), g2(5);
      Tensor y = scaled_dot_product_attention(q, k, v, c.causal, c.p, &g1);
      Tensor want = reference(q64, k64, v64, c.causal, c.p, &g2);
      const double tol = dt == DType::Float64 ? 1e-10 : 2e-5;
      expect_close(y, want, tol, what + " forward");
      Tensor proj = rnd(y.sizes(), 99);
      sum(y * proj.to(dt)).backward();
      sum(want * proj).backward();
      expect_close(q.grad(), q64.grad(), tol * 10, what + " dq");
      expect_close(k.grad(), k64.grad(), tol * 10, what + " dk");
      expect_close(v.grad(), v64.grad(), tol * 10, what + " dv");
    }
}

TEST(Attention, Gradcheck) {
  for (bool causal : {false, true}) {
    std::vector<Tensor> xs = {rnd({2, 6, 4}, 11).requires_grad_(), rnd({2, 6, 4}, 12).requires_grad_(),
                              rnd({2, 6, 3}, 13).requires_grad_()};
    auto r = autograd::gradcheck(
        [causal](const std::vector<Tensor>& v) {
          Generator g(3);
          return scaled_dot_product_attention(v[0], v[1], v[2], causal, 0.2, &g);
        },
        xs);
    EXPECT_TRUE(r.ok) << "causal " << causal << ": " << r.message;
  }
}

// The log-sum-exp variant: [..., :Dv] the attention, [..., Dv] each row's
// log(sum_j exp(scale q_i.k_j)) over the keys it sees, both against the
// composed float64 reference, and gradients through both parts (a
// projection of each) against the reference's; finite differences too.
Tensor reference_lse(const Tensor& q, const Tensor& k, bool causal) {
  const int64_t tq = q.size(-2), tk = k.size(-2);
  Tensor s = matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  std::vector<double> m(static_cast<size_t>(tq * tk), 1.0);
  if (causal)
    for (int64_t i = 0; i < tq; ++i)
      for (int64_t j = i + 1; j < tk; ++j) m[i * tk + j] = 0.0;
  return log(sum(exp(s) * Tensor::from_vector(m, {tq, tk}, s.dtype()), {-1}));
}

TEST(Attention, LogSumExpVariantMatchesComposedReference) {
  const std::vector<Case> cases = {
      {{2, 3, 5, 4}, {2, 3, 5, 4}, {2, 3, 5, 6}, true, 0.0},
      {{1, 2, 70, 8}, {1, 2, 70, 8}, {1, 2, 70, 8}, true, 0.0},
      {{2, 7, 8}, {2, 131, 8}, {2, 131, 3}, false, 0.0},
      {{2, 131, 8}, {2, 9, 8}, {2, 9, 3}, true, 0.0},
  };
  uint64_t seed = 40;
  for (const Case& c : cases)
    for (DType dt : {DType::Float64, DType::Float32}) {
      const std::string what = shape_str(c.q) + " causal " + std::to_string(c.causal) + " " + dtype_name(dt);
      Tensor q = rnd(c.q, seed++, dt).requires_grad_(), k = rnd(c.k, seed++, dt).requires_grad_(),
             v = rnd(c.v, seed++, dt).requires_grad_();
      Tensor q64 = q.detach().to(DType::Float64).requires_grad_(), k64 = k.detach().to(DType::Float64).requires_grad_(),
             v64 = v.detach().to(DType::Float64).requires_grad_();
      const int64_t dv = c.v.back();
      Tensor packed = scaled_dot_product_attention_lse(q, k, v, c.causal);
      ASSERT_EQ(packed.size(-1), dv + 1) << what;
      Tensor y = packed.narrow(-1, 0, dv), lse = packed.select(-1, dv);
      Tensor want = reference(q64, k64, v64, c.causal, 0.0, nullptr), want_lse = reference_lse(q64, k64, c.causal);
      const double tol = dt == DType::Float64 ? 1e-10 : 2e-5;
      expect_close(y, want, tol, what + " forward");
      expect_close(lse, want_lse, tol, what + " lse");
      Tensor p1 = rnd(y.sizes(), 98), p2 = rnd(lse.sizes(), 97);
      (sum(y * p1.to(dt)) + sum(lse * p2.to(dt))).backward();
      (sum(want * p1) + sum(want_lse * p2)).backward();
      expect_close(q.grad(), q64.grad(), tol * 10, what + " dq");
      expect_close(k.grad(), k64.grad(), tol * 10, what + " dk");
      expect_close(v.grad(), v64.grad(), tol * 10, what + " dv");
    }
  for (bool causal : {false, true}) {
    std::vector<Tensor> xs = {rnd({2, 6, 4}, 51).requires_grad_(), rnd({2, 6, 4}, 52).requires_grad_(),
                              rnd({2, 6, 3}, 53).requires_grad_()};
    auto r = autograd::gradcheck(
        [causal](const std::vector<Tensor>& v) { return scaled_dot_product_attention_lse(v[0], v[1], v[2], causal); },
        xs);
    EXPECT_TRUE(r.ok) << "lse causal " << causal << ": " << r.message;
  }
  EXPECT_NE(testing::error_of([] {
              scaled_dot_product_attention_lse(rnd({2, 3, 4}, 1), rnd({2, 0, 4}, 2), rnd({2, 0, 4}, 3));
            }).find("scaled_dot_product_attention_lse: k [2,0,4] has no keys"),
            std::string::npos);
}

// Attention over keys split in blocks [0, s) (all visible) and [s, tk)
// (causal on its diagonal, as a context-parallel rank's own chunk): the
// block gradients, summed, are the whole attention's.
TEST(Attention, BlockGradsSumToTheMergedAttentionsGradients) {
  for (bool diag_causal : {false, true})
    for (DType dt : {DType::Float64, DType::Float32}) {
      const std::string what = std::string("causal ") + (diag_causal ? "diagonal " : "none ") + dtype_name(dt);
      const int64_t tq = 70, s = 45;  // the CPU kernel's 64-row blocks, and a partial one
      Tensor q = rnd({2, 3, tq, 8}, 61, dt), k = rnd({2, 3, s + tq, 8}, 62, dt), v = rnd({2, 3, s + tq, 5}, 63, dt);
      // The merged attention: keys [0, s) plus [s, s + tq) with the diagonal's mask.
      Tensor q64 = q.to(DType::Float64).requires_grad_(), k64 = k.to(DType::Float64).requires_grad_(),
             v64 = v.to(DType::Float64).requires_grad_();
      Tensor lo = scaled_dot_product_attention_lse(q64, k64.narrow(2, 0, s), v64.narrow(2, 0, s), false);
      Tensor hi = scaled_dot_product_attention_lse(q64, k64.narrow(2, s, tq), v64.narrow(2, s, tq), diag_causal);
      Tensor l0 = lo.select(-1, 5), l1 = hi.select(-1, 5), lse = log(exp(l0) + exp(l1));
      Tensor out =
          lo.narrow(-1, 0, 5) * exp(l0 - lse).unsqueeze(-1) + hi.narrow(-1, 0, 5) * exp(l1 - lse).unsqueeze(-1);
      Tensor dout = rnd(out.sizes(), 64);
      sum(out * dout).backward();
      const Tensor o = out.detach().to(dt), l = lse.detach().to(dt), g = dout.to(dt);
      auto [dq0, dk0, dv0] = scaled_dot_product_attention_block_grads(q, k.narrow(2, 0, s), v.narrow(2, 0, s), o, g, l,
                                                                      l0.detach().to(dt), false);
      auto [dq1, dk1, dv1] = scaled_dot_product_attention_block_grads(q, k.narrow(2, s, tq), v.narrow(2, s, tq), o, g,
                                                                      l, l1.detach().to(dt), diag_causal);
      const double tol = dt == DType::Float64 ? 1e-10 : 2e-4;
      expect_close(dq0 + dq1, q64.grad(), tol, what + " dq");
      expect_close(cat({dk0, dk1}, 2), k64.grad(), tol, what + " dk");
      expect_close(cat({dv0, dv1}, 2), v64.grad(), tol, what + " dv");
    }
  const std::string msg = testing::error_of([] {
    Tensor q = rnd({2, 4, 8}, 1);
    scaled_dot_product_attention_block_grads(q, q, q, rnd({2, 4, 8}, 2), rnd({2, 4, 8}, 3), rnd({2, 4}, 4),
                                             rnd({2, 3}, 5));
  });
  EXPECT_NE(msg.find("scaled_dot_product_attention_block_grads: for q [2,4,8] and v [2,4,8] out and dout must be "
                     "[2,4,8] and lse, block_lse [2,4]; got"),
            std::string::npos)
      << msg;
}

TEST(Attention, HalfInputsComputeInFloat32) {
  Tensor q = rnd({2, 9, 8}, 21), k = rnd({2, 9, 8}, 22), v = rnd({2, 9, 8}, 23);
  Tensor want = reference(q, k, v, true, 0, nullptr);
  for (DType dt : {DType::BFloat16, DType::Float16}) {
    Tensor y = scaled_dot_product_attention(q.to(dt), k.to(dt), v.to(dt), true);
    EXPECT_EQ(y.dtype(), dt);
    expect_close(y.to(DType::Float64), want, dt == DType::BFloat16 ? 3e-2 : 5e-3, dtype_name(dt));
  }
}

// The packed projection's op is attention of its three column blocks'
// heads, transposed back: against the composed reference on those views
// (their gradients assembled by narrow's and permute's backward), forward
// and qkv's gradient, causal and not, with dropout from one seed.
TEST(Attention, PackedQkvIsAttentionOfItsHeads) {
  const int64_t B = 2, T = 70, H = 3, D = 4, E = H * D;
  for (bool causal : {false, true})
    for (double p : {0.0, 0.25}) {
      const Tensor base = rnd({B, T, 3 * E}, 31);
      Tensor qkv = base.clone().requires_grad_(), qkv_ref = base.clone().requires_grad_();
      Generator g1(5), g2(5);
      const Tensor y = scaled_dot_product_attention_qkvpacked(qkv, H, causal, p, &g1);
      const auto heads = [&](int64_t i) {
        return qkv_ref.narrow(2, i * E, E).view({B, T, H, D}).permute({0, 2, 1, 3});
      };
      const Tensor want = reference(heads(0), heads(1), heads(2), causal, p, &g2).permute({0, 2, 1, 3});
      const std::string what = detail::str_cat("packed causal ", causal, " p ", p);
      ASSERT_EQ(y.sizes(), Shape({B, T, H, D})) << what;
      expect_close(y, want, 1e-10, what);
      const Tensor r = rnd({B, T, H, D}, 32);
      sum(y * r).backward();
      sum(want * r).backward();
      expect_close(qkv.grad(), qkv_ref.grad(), 1e-10, what + " grad");
    }
  // No positions, or no batch: empty outputs and gradients.
  for (const Shape& s : std::vector<Shape>{{2, 0, 3 * E}, {0, 5, 3 * E}}) {
    Tensor qkv = zeros(s).requires_grad_();
    const Tensor y = scaled_dot_product_attention_qkvpacked(qkv, H, true);
    ASSERT_EQ(y.sizes(), Shape({s[0], s[1], H, D}));
    sum(y).backward();
    EXPECT_EQ(qkv.grad().sizes(), s);
  }
  const auto msg = testing::error_of([] { scaled_dot_product_attention_qkvpacked(ones({2, 3, 10}), 2); });
  EXPECT_NE(msg.find("scaled_dot_product_attention_qkvpacked: qkv must be [B, T, 3 E] with E a multiple of heads (2), "
                     "got [2,3,10]"),
            std::string::npos)
      << msg;
}

TEST(Attention, Errors) {
  auto msg = testing::error_of([] { scaled_dot_product_attention(ones({2, 3, 4}), ones({2, 3, 5}), ones({2, 3, 4})); });
  EXPECT_NE(msg.find("scaled_dot_product_attention: q [2,3,4] and k [2,3,5] must have the same last dim"),
            std::string::npos)
      << msg;
  msg = testing::error_of([] { scaled_dot_product_attention(ones({2, 3, 4}), ones({2, 5, 4}), ones({2, 4, 4})); });
  EXPECT_NE(msg.find("must have the same number of keys"), std::string::npos) << msg;
  msg = testing::error_of([] { scaled_dot_product_attention(ones({3, 4}), ones({3, 4}), ones({3, 4}), false, 1.0); });
  EXPECT_NE(msg.find("dropout_p must be in [0, 1), got 1"), std::string::npos) << msg;
}

}  // namespace
}  // namespace ember
