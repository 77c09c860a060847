// Every differentiable core op against central finite differences in
// float64, including broadcasting, views and non-contiguous inputs. The nn
// ops (conv, batch norm, pooling) are checked in core/ops_nn_test.cc.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "autograd/autograd.h"
#include "autograd/gradcheck.h"
#include "core/ops.h"

namespace ember {
namespace {

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

Tensor input(const Shape& s, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  Generator g(seed);
  Tensor t = rand(s, {DType::Float64}, &g) * (hi - lo) + lo;
  return t.detach().requires_grad_();
}

void check(const std::string& name, const Fn& f, const std::vector<Tensor>& xs) {
  auto r = autograd::gradcheck(f, xs);
  EXPECT_TRUE(r.ok) << name << ": " << r.message << " (max error " << r.max_abs_error << ")";
}

TEST(Gradcheck, Unary) {
  Tensor x = input({3, 4}, 1);
  Tensor pos = input({3, 4}, 2, 0.2, 2.0);
  check("neg", [](auto& v) { return neg(v[0]); }, {x});
  check("abs", [](auto& v) { return abs(v[0]); }, {pos});
  check("exp", [](auto& v) { return exp(v[0]); }, {x});
  check("log", [](auto& v) { return log(v[0]); }, {pos});
  check("sqrt", [](auto& v) { return sqrt(v[0]); }, {pos});
  check("rsqrt", [](auto& v) { return rsqrt(v[0]); }, {pos});
  check("relu", [](auto& v) { return relu(v[0]); }, {x});
  check("sigmoid", [](auto& v) { return sigmoid(v[0]); }, {x});
  check("tanh", [](auto& v) { return tanh(v[0]); }, {x});
  check("gelu", [](auto& v) { return gelu(v[0]); }, {x});
  check("gelu_tanh", [](auto& v) { return gelu(v[0], true); }, {x});
  check("erf", [](auto& v) { return erf(v[0]); }, {x});
  check("pow_scalar", [](auto& v) { return pow(v[0], 3.0); }, {x});
  check("pow_frac", [](auto& v) { return pow(v[0], 1.5); }, {pos});
  check("clamp", [](auto& v) { return clamp(v[0], -0.5, 0.4); }, {x});
}

TEST(Gradcheck, BinaryWithBroadcasting) {
  Tensor a = input({2, 3, 4}, 4), b = input({3, 1}, 5), c = input({4}, 6, 0.5, 2.0);
  Tensor bp = input({3, 1}, 7, 0.5, 2.0);
  check("add", [](auto& v) { return add(v[0], v[1], 2.5); }, {a, b});
  check("sub", [](auto& v) { return sub(v[0], v[1], 0.5); }, {a, b});
  check("mul", [](auto& v) { return v[0] * v[1]; }, {a, b});
  check("div", [](auto& v) { return v[0] / v[1]; }, {a, c});
  check("pow", [](auto& v) { return pow(v[0], v[1]); }, {bp, c});
  check("maximum", [](auto& v) { return maximum(v[0], v[1]); }, {a, b});
  check("minimum", [](auto& v) { return minimum(v[0], v[1]); }, {a, b});
  Tensor gate = input({2, 3, 4}, 8, -4.0, 4.0);
  check("swiglu", [](auto& v) { return swiglu(v[0], v[1]); }, {gate, a});
  check("swiglu_broadcast", [](auto& v) { return swiglu(v[0], v[1]); }, {a, b});  // the composition
  check("where", [](auto& v) { return where(gt(v[0], zeros({}, DType::Float64)), v[0], v[1]); }, {a, b});
  check("scalar_ops", [](auto& v) { return (2.0 - v[0]) / 3.0 + 1.0 / (v[1] + 3.0); }, {a, b});
}

TEST(Gradcheck, Reductions) {
  Tensor x = input({3, 4, 5}, 8);
  for (bool keep : {false, true}) {
    check("sum_all", [=](auto& v) { return sum(v[0], {}, keep); }, {x});
    check("sum_02", [=](auto& v) { return sum(v[0], {0, 2}, keep); }, {x});
    check("mean_1", [=](auto& v) { return mean(v[0], {1}, keep); }, {x});
    check("max_2", [=](auto& v) { return max(v[0], {2}, keep); }, {x});
    check("min_all", [=](auto& v) { return min(v[0], {}, keep); }, {x});
    check("var_01", [=](auto& v) { return var(v[0], {0, 1}, keep); }, {x});
  }
  check("softmax", [](auto& v) { return softmax(v[0], 1); }, {x});
  check("log_softmax", [](auto& v) { return log_softmax(v[0], -1); }, {x});
  check("softmax_permuted", [](auto& v) { return softmax(v[0].permute({2, 0, 1}), 0); }, {x});
}

TEST(Gradcheck, Matmul) {
  Tensor a = input({3, 4}, 9), b = input({4, 5}, 10), v1 = input({4}, 11);
  Tensor ba = input({2, 3, 4}, 12), bb = input({2, 4, 5}, 13), b1 = input({1, 4, 5}, 14);
  Tensor w = input({5, 4}, 15), bias = input({5}, 16);
  check("mm", [](auto& v) { return mm(v[0], v[1]); }, {a, b});
  check("mm_transposed", [](auto& v) { return mm(v[1].t(), v[0].t()); }, {a, b});
  check("matmul_vec", [](auto& v) { return matmul(v[0], v[1]); }, {a, v1});
  check("matmul_dot", [](auto& v) { return matmul(v[0], v[0]); }, {v1});
  check("bmm", [](auto& v) { return bmm(v[0], v[1]); }, {ba, bb});
  check("matmul_broadcast", [](auto& v) { return matmul(v[0], v[1]); }, {ba, b1});
  check("matmul_nd_2d", [](auto& v) { return matmul(v[0], v[1]); }, {ba, b});
  check("linear", [](auto& v) { return linear(v[0], v[1], v[2]); }, {ba, w, bias});
}

TEST(Gradcheck, ViewsAndIndexing) {
  Tensor x = input({3, 4}, 17);
  Tensor y = input({2, 4}, 18);
  check("view", [](auto& v) { return v[0].view({4, 3}) * 2.0; }, {x});
  check("reshape_copy", [](auto& v) { return v[0].t().reshape({12}) * 2.0; }, {x});
  check("flatten", [](auto& v) { return v[0].unsqueeze(0).flatten() * 2.0; }, {x});
  check("transpose", [](auto& v) { return v[0].transpose(0, 1).contiguous(); }, {x});
  check("permute", [](auto& v) { return v[0].unsqueeze(2).permute({2, 1, 0}) * 1.5; }, {x});
  check("slice_step", [](auto& v) { return v[0].slice(1, 1, 4, 2) * 3.0; }, {x});
  check("narrow_select", [](auto& v) { return v[0].narrow(0, 1, 2).select(1, -1) * 3.0; }, {x});
  check("expand", [](auto& v) { return v[0].unsqueeze(0).expand({5, 3, 4}) * 1.0; }, {x});
  check("squeeze", [](auto& v) { return v[0].unsqueeze(1).squeeze(1).squeeze() * 1.0; }, {x});
  check("clone", [](auto& v) { return v[0].clone(); }, {x});
  check("cat", [](auto& v) { return cat({v[0], v[1], v[0]}, 0); }, {x, y});
  check("stack", [](auto& v) { return stack({v[0].select(0, 0), v[1].select(0, 1)}, 1); }, {x, y});
  Tensor idx = Tensor::from_vector({2, 0, 2, 1}, {4}, DType::Int64);
  check("index_select_repeats", [=](auto& v) { return index_select(v[0], 0, idx); }, {x});
  check("index_select_dim1", [=](auto& v) { return index_select(v[0], 1, idx); }, {x});
  Tensor gidx = Tensor::from_vector({0, 3, 3, 1, 2, 2}, {3, 2}, DType::Int64);
  check("gather", [=](auto& v) { return gather(v[0], 1, gidx); }, {x});
}

TEST(Gradcheck, Composites) {
  Tensor x = input({4, 6}, 19);
  Tensor w = input({6}, 20), b = input({6}, 21);
  // Layer norm written from primitives, as nn::LayerNorm does.
  check("layer_norm", [](auto& v) {
    Tensor mu = mean(v[0], {-1}, true);
    Tensor d = v[0] - mu;
    Tensor var_ = mean(d * d, {-1}, true);
    return d * rsqrt(var_ + 1e-5) * v[1] + v[2];
  }, {x, w, b});
  Tensor target = Tensor::from_vector({1, 5, 0, 3}, {4, 1}, DType::Int64);
  check("cross_entropy", [=](auto& v) {
    return mean(neg(gather(log_softmax(v[0], 1), 1, target)));
  }, {x});
}

}  // namespace
}  // namespace ember
