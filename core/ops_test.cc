// Every CPU op against hand-computed values or float64 reference loops,
// including broadcasting, non-contiguous inputs and error messages.
#include "core/ops.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <functional>

#include "core/testing/error_of.h"

namespace ember {
namespace {

using V = std::vector<double>;
Tensor T(const V& v, const Shape& s, DType t = DType::Float32) { return Tensor::from_vector(v, s, t); }

void expect_near(const V& got, const V& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i])) EXPECT_TRUE(std::isnan(got[i])) << "at " << i;
    else EXPECT_NEAR(got[i], want[i], tol * std::max(1.0, std::abs(want[i]))) << "at " << i;
  }
}

using ::ember::testing::error_of;

const std::vector<DType> kFloatTypes = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16};
double tol_for(DType t) { return t == DType::Float16 ? 2e-3 : t == DType::BFloat16 ? 1e-2 : t == DType::Float32 ? 1e-6 : 1e-12; }

TEST(Unary, MatchesScalarMathAcrossDtypes) {
  V xs = {-2.5, -1.0, -0.1, 0.0, 0.3, 1.0, 2.0, 4.0};
  struct Case { const char* name; std::function<Tensor(const Tensor&)> op; std::function<double(double)> ref; bool pos; };
  std::vector<Case> cases = {
      {"neg", [](const Tensor& x) { return neg(x); }, [](double x) { return -x; }, false},
      {"abs", [](const Tensor& x) { return abs(x); }, [](double x) { return std::abs(x); }, false},
      {"exp", [](const Tensor& x) { return exp(x); }, [](double x) { return std::exp(x); }, false},
      {"log", [](const Tensor& x) { return log(x); }, [](double x) { return std::log(x); }, true},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, [](double x) { return std::sqrt(x); }, true},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, [](double x) { return 1 / std::sqrt(x); }, true},
      {"relu", [](const Tensor& x) { return relu(x); }, [](double x) { return x > 0 ? x : 0; }, false},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, [](double x) { return 1 / (1 + std::exp(-x)); }, false},
      {"tanh", [](const Tensor& x) { return tanh(x); }, [](double x) { return std::tanh(x); }, false},
      {"gelu", [](const Tensor& x) { return gelu(x); }, [](double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); }, false},
      {"gelu_tanh", [](const Tensor& x) { return gelu(x, true); },
       [](double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); }, false},
      {"pow3", [](const Tensor& x) { return pow(x, 3.0); }, [](double x) { return x * x * x; }, false},
      {"pow0.5", [](const Tensor& x) { return pow(x, 0.5); }, [](double x) { return std::sqrt(x); }, true},
      {"clamp", [](const Tensor& x) { return clamp(x, -1.0, 1.5); }, [](double x) { return std::min(std::max(x, -1.0), 1.5); }, false},
  };
  for (DType dt : kFloatTypes) {
    for (const Case& c : cases) {
      V in;
      for (double x : xs) if (!c.pos || x > 0) in.push_back(x);
      Tensor x = T(in, {static_cast<int64_t>(in.size())}, dt);
      V xr = x.to_vector();  // inputs as rounded to dt
      V want;
      for (double v : xr) want.push_back(c.ref(v));
      Tensor y = c.op(x);
      EXPECT_EQ(y.dtype(), dt) << c.name;
      SCOPED_TRACE(std::string(c.name) + " " + dtype_name(dt));
      expect_near(y.to_vector(), want, tol_for(dt) * 4);
    }
  }
}

// GELU's tanh form in float32 (its own vectorized tanh on the CPU) over
// the whole range: against float64 near the origin, exact limits far out,
// NaN kept, and the contiguous (vectorized) and strided paths bit-equal.
TEST(Unary, GeluTanhFloat32WholeRange) {
  V xs = {-1e10, -30, -9.5, -9, -8.99, -3, -1e-3, -0.0, 0.0, 1e-3, 0.7, 3, 8.99, 9, 9.5, 30, 1e10};
  const int64_t n = static_cast<int64_t>(xs.size());
  Tensor x = T(xs, {n}, DType::Float32);
  Tensor g = T(V(xs.size(), 1.0), {n}, DType::Float32);
  V y = gelu(x, true).to_vector(), dy = gelu_backward(g, x, true).to_vector();
  const double k = std::sqrt(2 / M_PI);
  for (int64_t i = 0; i < n; ++i) {
    const double v = x.to_vector()[i], t = std::tanh(k * (v + 0.044715 * v * v * v));
    const double want = 0.5 * v * (1 + t);
    const double dwant = 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * k * (1 + 3 * 0.044715 * v * v);
    EXPECT_NEAR(y[i], want, 1e-6 * (1 + std::abs(want))) << "gelu(" << v << ")";
    EXPECT_NEAR(dy[i], dwant, 1e-5 * (1 + std::abs(dwant))) << "gelu'(" << v << ")";
  }
  EXPECT_EQ(gelu(T({1e30}, {1}, DType::Float32), true).item(), 1e30f);
  EXPECT_TRUE(std::isinf(gelu(T({INFINITY}, {1}, DType::Float32), true).item()));
  EXPECT_TRUE(std::isnan(gelu(T({NAN}, {1}, DType::Float32), true).item()));
  EXPECT_TRUE(std::isnan(gelu_backward(T({1}, {1}, DType::Float32), T({NAN}, {1}, DType::Float32), true).item()));
  // A strided view takes the generic loop: the same bits.
  Tensor wide = zeros({n, 2}, DType::Float32);
  wide.narrow(1, 0, 1).copy_(x.view({n, 1}));
  Tensor xs_strided = wide.narrow(1, 0, 1).squeeze(1);
  EXPECT_EQ(gelu(xs_strided, true).to_vector(), y);
  EXPECT_EQ(gelu_backward(g, xs_strided, true).to_vector(), dy);
}

TEST(Unary, IntegersPromoteForFloatOpsOnly) {
  Tensor i = T({-2, 3}, {2}, DType::Int32);
  EXPECT_EQ(abs(i).dtype(), DType::Int32);
  EXPECT_EQ(abs(i).to_vector(), (V{2, 3}));
  EXPECT_EQ(exp(i).dtype(), DType::Float32);
  EXPECT_EQ(clamp(i, 0.0, std::nullopt).to_vector(), (V{0, 3}));
  EXPECT_TRUE(std::isnan(relu(T({NAN}, {1})).item()));
  EXPECT_TRUE(std::isnan(clamp(T({NAN}, {1}), 0.0, 1.0).item()));
}

TEST(Unary, WorksOnNonContiguousViews) {
  Tensor base = arange(24, DType::Float64).view({2, 3, 4});
  Tensor v = base.permute({2, 0, 1}).slice(0, 1, 4, 2);  // [2, 2, 3], strided
  Tensor y = exp(v * 0.1);
  V src = v.contiguous().to_vector(), want;
  for (double s : src) want.push_back(std::exp(s * 0.1));
  expect_near(y.to_vector(), want, 1e-12);
}

// Binary ops against a float64 reference with explicit broadcasting.
V broadcast_ref(const Tensor& a, const Tensor& b, const std::function<double(double, double)>& f, Shape& out_shape) {
  out_shape = broadcast_shapes(a.sizes(), b.sizes(), "ref");
  Tensor ea = a.expand(out_shape).contiguous(), eb = b.expand(out_shape).contiguous();
  V x = ea.to_vector(), y = eb.to_vector(), out;
  for (size_t i = 0; i < x.size(); ++i) out.push_back(f(x[i], y[i]));
  return out;
}

TEST(Binary, BroadcastsAgainstReference) {
  manual_seed(1);
  std::vector<std::pair<Shape, Shape>> shapes = {
      {{3, 4}, {3, 4}}, {{3, 4}, {4}}, {{3, 1}, {1, 4}}, {{2, 1, 4}, {3, 1}}, {{5}, {}}, {{}, {2, 2}}};
  struct Case { const char* name; std::function<Tensor(const Tensor&, const Tensor&)> op; std::function<double(double, double)> ref; };
  std::vector<Case> cases = {
      {"add", [](auto& a, auto& b) { return a + b; }, [](double x, double y) { return x + y; }},
      {"sub", [](auto& a, auto& b) { return a - b; }, [](double x, double y) { return x - y; }},
      {"mul", [](auto& a, auto& b) { return a * b; }, [](double x, double y) { return x * y; }},
      {"div", [](auto& a, auto& b) { return a / b; }, [](double x, double y) { return x / y; }},
      {"add_alpha", [](auto& a, auto& b) { return add(a, b, 2.5); }, [](double x, double y) { return x + 2.5 * y; }},
      {"maximum", [](auto& a, auto& b) { return maximum(a, b); }, [](double x, double y) { return std::max(x, y); }},
      {"minimum", [](auto& a, auto& b) { return minimum(a, b); }, [](double x, double y) { return std::min(x, y); }},
      {"pow", [](auto& a, auto& b) { return pow(abs(a) + 0.5, b); }, [](double x, double y) { return std::pow(std::abs(x) + 0.5, y); }},
      {"lt", [](auto& a, auto& b) { return lt(a, b); }, [](double x, double y) { return double(x < y); }},
      {"ge", [](auto& a, auto& b) { return ge(a, b); }, [](double x, double y) { return double(x >= y); }},
      {"eq", [](auto& a, auto& b) { return eq(a, a); }, [](double x, double) { return 1.0; }},
  };
  for (auto& [sa, sb] : shapes) {
    Tensor a = randn(sa, DType::Float64), b = randn(sb, DType::Float64) + 3.0;
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(c.name) + " " + shape_str(sa) + " " + shape_str(sb));
      Shape out_shape;
      V want = broadcast_ref(a, b, c.ref, out_shape);
      if (std::string(c.name) == "pow") {
        want.clear();
        Tensor aa = abs(a) + 0.5;
        want = broadcast_ref(aa, b, [](double x, double y) { return std::pow(x, y); }, out_shape);
      }
      if (std::string(c.name) == "eq") out_shape = a.sizes(), want.assign(a.numel(), 1.0);
      Tensor y = c.op(a, b);
      EXPECT_EQ(y.sizes(), out_shape);
      expect_near(y.to_vector(), want, 1e-12);
    }
  }
}

TEST(Binary, PromotesTypesLikeTorch) {
  Tensor i = T({1, 2, 3}, {3}, DType::Int32), f = T({0.5, 0.5, 0.5}, {3});
  EXPECT_EQ((i + f).dtype(), DType::Float32);
  EXPECT_EQ((i + i).dtype(), DType::Int32);
  EXPECT_EQ((i / i).dtype(), DType::Float32);  // true division
  EXPECT_EQ((i / T({2, 2, 2}, {3}, DType::Int64)).to_vector(), (V{0.5, 1.0, 1.5}));
  EXPECT_EQ((i * 2.5).dtype(), DType::Float32);
  EXPECT_EQ((i * 2.0).dtype(), DType::Int32);
  EXPECT_EQ((T({1}, {1}, DType::Float16) + T({1}, {1}, DType::BFloat16)).dtype(), DType::Float32);
  EXPECT_EQ(lt(i, f).dtype(), DType::Bool);
  EXPECT_EQ((2.0 - f).to_vector(), (V{1.5, 1.5, 1.5}));
  EXPECT_EQ((1.0 / T({4}, {1})).item(), 0.25);
}

TEST(Binary, InPlaceAndErrors) {
  Tensor a = zeros({2, 3});
  a += T({1, 2, 3}, {3});
  a *= 2.0;
  EXPECT_EQ(a.to_vector(), (V{2, 4, 6, 2, 4, 6}));
  a /= T({2}, {1});
  EXPECT_EQ(a.to_vector(), (V{1, 2, 3, 1, 2, 3}));
  Tensor view = a.t();  // in-place through a strided view writes the base
  view -= ones({3, 2});
  EXPECT_EQ(a.to_vector(), (V{0, 1, 2, 0, 1, 2}));
  std::string msg = error_of([] { add(zeros({2, 3}), zeros({4})); });
  EXPECT_NE(msg.find("add"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2,3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4]"), std::string::npos) << msg;
  EXPECT_THROW(a += zeros({4, 2, 3}), Error);
  EXPECT_THROW(T({1}, {1}, DType::Bool) + T({1}, {1}, DType::Bool), Error);
}

TEST(Where, SelectsWithBroadcast) {
  Tensor c = T({1, 0, 1}, {3}, DType::Bool);
  Tensor y = where(c, T({1, 2, 3}, {3}), T({-1}, {1}));
  EXPECT_EQ(y.to_vector(), (V{1, -1, 3}));
  Tensor y2 = where(gt(T({1, 5}, {2, 1}), T({3}, {1})), ones({2, 2}), zeros({2}));
  EXPECT_EQ(y2.to_vector(), (V{0, 0, 1, 1}));
  EXPECT_THROW(where(T({1}, {1}), ones({1}), ones({1})), Error);
}

// Reductions against float64 loops, over every subset of dims of a 3-d tensor.
TEST(Reduce, AllDimSubsetsMatchReference) {
  manual_seed(2);
  Tensor x = randn({3, 4, 5}, DType::Float64);
  Tensor xt = x.permute({1, 0, 2});  // non-contiguous input as well
  V v = x.to_vector();
  Shape sz = {3, 4, 5};
  for (int mask = 1; mask < 8; ++mask) {
    std::vector<int64_t> dims;
    for (int d = 0; d < 3; ++d) if (mask & (1 << d)) dims.push_back(d);
    Shape out_shape;
    for (int d = 0; d < 3; ++d) out_shape.push_back((mask & (1 << d)) ? 1 : sz[d]);
    int64_t n_out = shape_numel(out_shape);
    V s(n_out, 0), mx(n_out, -INFINITY), mn(n_out, INFINITY), cnt(n_out, 0), sq(n_out, 0);
    auto out_index = [&](int i, int j, int k) {
      int c[3] = {i, j, k};
      int64_t o = 0;
      for (int d = 0; d < 3; ++d) o = o * out_shape[d] + ((mask & (1 << d)) ? 0 : c[d]);
      return o;
    };
    for (int i = 0; i < 3; ++i) for (int j = 0; j < 4; ++j) for (int k = 0; k < 5; ++k) {
      double val = v[(i * 4 + j) * 5 + k];
      int64_t o = out_index(i, j, k);
      s[o] += val; mx[o] = std::max(mx[o], val); mn[o] = std::min(mn[o], val); cnt[o] += 1;
    }
    for (int i = 0; i < 3; ++i) for (int j = 0; j < 4; ++j) for (int k = 0; k < 5; ++k) {
      int64_t o = out_index(i, j, k);
      double dv = v[(i * 4 + j) * 5 + k] - s[o] / cnt[o];
      sq[o] += dv * dv;
    }
    V mean_ref, var_ref;
    for (int64_t o = 0; o < n_out; ++o) { mean_ref.push_back(s[o] / cnt[o]); var_ref.push_back(sq[o] / (cnt[o] - 1)); }
    SCOPED_TRACE("mask " + std::to_string(mask));
    EXPECT_EQ(sum(x, dims, true).sizes(), out_shape);
    expect_near(sum(x, dims, true).to_vector(), s, 1e-12);
    expect_near(mean(x, dims, true).to_vector(), mean_ref, 1e-12);
    expect_near(max(x, dims, true).to_vector(), mx, 0);
    expect_near(min(x, dims, true).to_vector(), mn, 0);
    expect_near(var(x, dims, true).to_vector(), var_ref, 1e-12);
    // Same through a permuted view: permute dims back in the reference.
    std::vector<int64_t> tdims;
    for (int64_t d : dims) tdims.push_back(d == 0 ? 1 : d == 1 ? 0 : 2);
    expect_near(sum(xt, tdims, true).permute({1, 0, 2}).contiguous().to_vector(), sum(x, dims, true).to_vector(), 1e-12);
  }
}

// A channels-last input, over every subset of its 4 dims, with and without
// keepdim: the same values as its contiguous copy, whether the plan reduces
// it in place (H and W, C, all) or through the permuting copy (the rest).
TEST(Reduce, ChannelsLastMatchesContiguousForEveryDimSubset) {
  manual_seed(3);
  Tensor plain = randn({2, 3, 4, 5}, DType::Float64), cl = plain.contiguous(MemoryFormat::ChannelsLast);
  ASSERT_FALSE(cl.is_contiguous());
  for (int mask = 1; mask < 16; ++mask)
    for (bool keepdim : {false, true}) {
      std::vector<int64_t> dims;
      for (int d = 0; d < 4; ++d)
        if (mask & (1 << d)) dims.push_back(d);
      SCOPED_TRACE("dims " + shape_str(dims) + (keepdim ? " keepdim" : ""));
      EXPECT_EQ(sum(cl, dims, keepdim).sizes(), sum(plain, dims, keepdim).sizes());
      expect_near(sum(cl, dims, keepdim).to_vector(), sum(plain, dims, keepdim).to_vector(), 1e-12);
      expect_near(max(cl, dims, keepdim).to_vector(), max(plain, dims, keepdim).to_vector(), 0);
      expect_near(var(cl, dims, keepdim).to_vector(), var(plain, dims, keepdim).to_vector(), 1e-12);
    }
}

// Every permutation of a 4-d tensor's dims, over every subset of dims,
// with and without keepdim: the same values as the contiguous copy's
// reduction; where the reduced dims are one block of the order the dims lie
// in memory, the output lies as the kept dims lie in the input (no copy in
// or out), else contiguous (through the permuting copy). A size-1
// dim anywhere and argmax too.
TEST(Reduce, PermutedInputsReduceWhereTheyLie) {
  manual_seed(4);
  Tensor base = randn({2, 3, 4, 5}, DType::Float64);
  std::vector<int64_t> perm = {0, 1, 2, 3};
  int laid_out = 0;
  do {
    const Tensor x = base.permute(perm), plain = x.contiguous();
    for (int mask = 1; mask < 16; ++mask)
      for (bool keepdim : {false, true}) {
        std::vector<int64_t> dims;
        for (int d = 0; d < 4; ++d)
          if (mask & (1 << d)) dims.push_back(d);
        SCOPED_TRACE("perm " + shape_str(perm) + " dims " + shape_str(dims) + (keepdim ? " keepdim" : ""));
        const Tensor s = sum(x, dims, keepdim);
        ASSERT_EQ(s.sizes(), sum(plain, dims, keepdim).sizes());
        expect_near(s.to_vector(), sum(plain, dims, keepdim).to_vector(), 1e-12);
        expect_near(max(x, dims, keepdim).to_vector(), max(plain, dims, keepdim).to_vector(), 0);
        // Memory positions of x's dims (x's dim d is base's perm[d]), and
        // whether the reduced ones are one block of them.
        int lo = 4, hi = -1;
        for (int64_t d : dims)
          lo = std::min<int>(lo, static_cast<int>(perm[d])), hi = std::max<int>(hi, static_cast<int>(perm[d]));
        const bool block = hi - lo + 1 == static_cast<int>(dims.size());
        // The output's kept dims, in x's order, with base's position each.
        std::vector<std::pair<int64_t, int64_t>> kept;  // (output dim, memory position)
        for (int64_t d = 0, o = 0; d < 4; ++d) {
          const bool reduced = (mask & (1 << d)) != 0;
          if (!reduced) kept.push_back({o, perm[d]});
          if (!reduced || keepdim) ++o;
        }
        bool ordered = true;  // the kept dims lie in their logical order
        for (size_t i = 1; i < kept.size(); ++i) ordered = ordered && kept[i - 1].second < kept[i].second;
        if (!block || ordered) {
          EXPECT_TRUE(s.is_contiguous()) << shape_str(s.strides());
          continue;
        }
        ++laid_out;
        for (const auto& [oa, pa] : kept)
          for (const auto& [ob, pb] : kept)
            if (pa < pb) EXPECT_GT(s.strides()[oa], s.strides()[ob]) << "output dims " << oa << ", " << ob;
      }
  } while (std::next_permutation(perm.begin(), perm.end()));
  EXPECT_GT(laid_out, 50) << "permuted outputs seen";
  // A size-1 dim between reduced ones, and argmax's indices.
  Tensor y = randn({3, 1, 4, 5}, DType::Float64).permute({2, 1, 0, 3});  // [4, 1, 3, 5]
  expect_near(sum(y, {0, 2}).to_vector(), sum(y.contiguous(), {0, 2}).to_vector(), 1e-12);
  expect_near(sum(y, {0, 1, 2}, true).to_vector(), sum(y.contiguous(), {0, 1, 2}, true).to_vector(), 1e-12);
  EXPECT_EQ(argmax(y, 2).to_vector(), argmax(y.contiguous(), 2).to_vector());
  EXPECT_EQ(argmax(y, 0, true).to_vector(), argmax(y.contiguous(), 0, true).to_vector());
}

TEST(Reduce, KeepdimDtypesAndEdgeCases) {
  Tensor x = T({1, 5, 3, 5, 2, 0}, {2, 3});
  EXPECT_EQ(sum(x, {1}).sizes(), (Shape{2}));
  EXPECT_EQ(sum(x, {-1}, true).sizes(), (Shape{2, 1}));
  EXPECT_EQ(sum(x).sizes(), (Shape{}));
  EXPECT_EQ(sum(x).item(), 16);
  EXPECT_EQ(sum(T({1, 2}, {2}, DType::Int32)).dtype(), DType::Int64);
  EXPECT_EQ(sum(T({1, 0, 1}, {3}, DType::Bool)).item(), 2);
  EXPECT_EQ(argmax(x).item(), 1);  // first maximum over the flattened tensor
  EXPECT_EQ(argmax(x, 1).to_vector(), (V{1, 0}));
  EXPECT_EQ(argmin(x, 0, true).to_vector(), (V{0, 1, 1}));
  EXPECT_EQ(argmin(x, 0, true).sizes(), (Shape{1, 3}));
  EXPECT_EQ(argmax(x, 0).dtype(), DType::Int64);
  EXPECT_TRUE(std::isnan(max(T({1, NAN, 3}, {3})).item()));
  EXPECT_EQ(argmax(T({1, NAN, 3}, {3})).item(), 1);
  EXPECT_EQ(sum(zeros({0, 3}), {0}).to_vector(), (V{0, 0, 0}));
  EXPECT_THROW(max(zeros({0, 3}), {0}), Error);
  EXPECT_THROW(sum(x, {2}), Error);
  EXPECT_THROW(mean(T({1}, {1}, DType::Int32)), Error);
  EXPECT_EQ(var(T({1, 2, 3, 4}, {4}), {}, false, 0).item(), 1.25);
}

TEST(Reduce, LargeSumsAreAccurateInHalfTypes) {
  // 1e5 ones: fp16 itself cannot count past 2048, so this checks fp32 accumulation.
  EXPECT_EQ(sum(ones({100000}, DType::Float32)).item(), 100000);
  EXPECT_NEAR(sum(ones({100000}, DType::BFloat16)).item(), 100000, 512);
  EXPECT_TRUE(std::isinf(sum(ones({100000}, DType::Float16)).item()));  // 1e5 > fp16 max: inf, as in torch
  EXPECT_NEAR(mean(ones({100000}, DType::Float16)).item(), 1.0, 1e-3);
  Tensor big = full({3, 300000}, 0.5);
  expect_near(sum(big, {1}).to_vector(), V(3, 150000), 1e-6);
}

TEST(Softmax, RowsSumToOneAndMatchReference) {
  manual_seed(3);
  for (int64_t dim : {0, 1, 2}) {
    Tensor x = randn({3, 4, 5}, DType::Float64) * 5.0;
    Tensor y = softmax(x, dim), ly = log_softmax(x, dim);
    expect_near(sum(y, {dim}).to_vector(), V(shape_numel(sum(y, {dim}).sizes()), 1.0), 1e-12);
    Tensor ref = exp(x - max(x, {dim}, true));
    ref = ref / sum(ref, {dim}, true);
    expect_near(y.to_vector(), ref.to_vector(), 1e-12);
    expect_near(ly.to_vector(), log(ref).to_vector(), 1e-10);
  }
  // Large logits do not overflow; -inf entries get probability 0.
  Tensor z = softmax(T({1000, 1000, -INFINITY}, {3}), 0);
  expect_near(z.to_vector(), (V{0.5, 0.5, 0}), 1e-7);
  for (DType dt : {DType::Float16, DType::BFloat16}) {
    Tensor h = softmax(T({1, 2, 3}, {3}, dt), 0);
    expect_near(h.to_vector(), (V{0.09003057, 0.24472847, 0.66524096}), tol_for(dt) * 2);
  }
}

// Matmul against a float64 triple loop.
V matmul_ref(const Tensor& a, const Tensor& b) {
  int64_t m = a.sizes()[0], k = a.sizes()[1], n = b.sizes()[1];
  V x = a.to_vector(), y = b.to_vector(), out(m * n, 0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t p = 0; p < k; ++p) out[i * n + j] += x[i * k + p] * y[p * n + j];
  return out;
}

TEST(Matmul, MatchesReferenceForLayoutsAndDtypes) {
  manual_seed(4);
  for (DType dt : {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16, DType::Int64, DType::Int32}) {
    Tensor a = is_floating(dt) ? randn({7, 5}, DType::Float64).to(dt) : randint(-5, 5, {7, 5}, dt);
    Tensor b = is_floating(dt) ? randn({5, 9}, DType::Float64).to(dt) : randint(-5, 5, {5, 9}, dt);
    double tol = is_floating(dt) ? tol_for(dt) * 20 : 0;
    SCOPED_TRACE(dtype_name(dt));
    expect_near(mm(a, b).to_vector(), matmul_ref(a, b), tol);
    // Transposed views go through BLAS flags, sliced ones through copies.
    expect_near(mm(b.t().contiguous().t(), b.t()).to_vector(), matmul_ref(b, b.t()), tol);
    expect_near(mm(a.slice(1, 0, 5, 2), b.slice(0, 0, 5, 2)).to_vector(),
                matmul_ref(a.slice(1, 0, 5, 2), b.slice(0, 0, 5, 2)), tol);
  }
}

// bfloat16/float16 GEMMs (oneDNN's native kernels where the CPU has them,
// else widened) against float64 on the same rounded inputs, for every
// operand layout the op layer passes down: plain, transposed either side
// (strides, no copy), batched, a broadcast operand, and sizes large enough
// for the blocked kernels. One rounding of a float32-accumulated result:
// within a few units of the low dtype's last place of the largest entry.
TEST(Matmul, HalfTypesMatchFloat64OnEveryLayout) {
  manual_seed(6);
  auto check = [](const Tensor& got, const Tensor& want, double rel, const std::string& what) {
    SCOPED_TRACE(what);
    EXPECT_EQ(got.sizes(), want.sizes());
    const double scale = max(abs(want)).item();
    V g = got.to_vector(), w = want.to_vector();
    double worst = 0;
    for (size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::fabs(g[i] - w[i]));
    EXPECT_LE(worst, rel * scale) << "largest entry " << scale;
  };
  for (DType dt : {DType::BFloat16, DType::Float16}) {
    SCOPED_TRACE(dtype_name(dt));
    const double rel = dt == DType::BFloat16 ? 8e-3 : 1e-3;
    auto r = [&](Shape s) { return randn(s, DType::Float64).to(dt); };
    auto f64 = [](const Tensor& t) { return t.to(DType::Float64); };
    // [1, 26] x [26, 60] and [1, 63] x [63, 60]: shapes oneDNN 2.6's AMX
    // kernels got wrong or died on (onednn::cap_isa), on CPUs that have AMX.
    for (auto [m, k, n] : {std::array<int64_t, 3>{7, 5, 9}, {64, 96, 80}, {1, 33, 17}, {1, 26, 60}, {1, 63, 60}}) {
      const std::string dims = std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n);
      Tensor a = r({m, k}), b = r({k, n}), at = r({k, m}), bt = r({n, k});
      check(mm(a, b), mm(f64(a), f64(b)), rel, dims + " plain");
      check(mm(at.t(), b), mm(f64(at).t(), f64(b)), rel, dims + " a transposed");
      check(mm(a, bt.t()), mm(f64(a), f64(bt).t()), rel, dims + " b transposed");
      check(mm(at.t(), bt.t()), mm(f64(at).t(), f64(bt).t()), rel, dims + " both transposed");
      Tensor ba = r({3, m, k}), bb = r({3, k, n});
      check(bmm(ba, bb), bmm(f64(ba), f64(bb)), rel, dims + " batched");
      check(bmm(ba, bb.transpose(1, 2).contiguous().transpose(1, 2)), bmm(f64(ba), f64(bb)), rel,
            dims + " batched, b transposed");
      check(matmul(ba, b), matmul(f64(ba), f64(b)), rel, dims + " b broadcast over the batch");
      check(matmul(a, bb), matmul(f64(a), f64(bb)), rel, dims + " a broadcast over the batch");
      Tensor x = r({2, m, k}), w = r({n, k}), bias = r({n});
      check(linear(x, w, bias), linear(f64(x), f64(w), f64(bias)), rel, dims + " linear");
    }
  }
}

TEST(Matmul, BatchedBroadcastVectorAndLinear) {
  manual_seed(5);
  Tensor a = randn({2, 3, 4, 5}, DType::Float64), b = randn({3, 5, 6}, DType::Float64);
  Tensor c = matmul(a, b);
  EXPECT_EQ(c.sizes(), (Shape{2, 3, 4, 6}));
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      expect_near(c.select(0, i).select(0, j).to_vector(), matmul_ref(a.select(0, i).select(0, j), b.select(0, j)), 1e-12);
  Tensor v = randn({5}, DType::Float64);
  EXPECT_EQ(matmul(a, v).sizes(), (Shape{2, 3, 4}));
  EXPECT_EQ(matmul(v, b).sizes(), (Shape{3, 6}));
  EXPECT_NEAR(matmul(v, v).item(), sum(v * v).item(), 1e-12);
  Tensor bb = randn({2, 5, 6}, DType::Float64), aa = randn({2, 4, 5}, DType::Float64);
  expect_near(bmm(aa, bb).select(0, 1).to_vector(), matmul_ref(aa.select(0, 1), bb.select(0, 1)), 1e-12);
  // linear = x W^T + b on a 3-d input.
  Tensor x = randn({2, 3, 5}, DType::Float64), w = randn({4, 5}, DType::Float64), bias = randn({4}, DType::Float64);
  Tensor y = linear(x, w, bias);
  EXPECT_EQ(y.sizes(), (Shape{2, 3, 4}));
  expect_near(y.to_vector(), (matmul(x, w.t().contiguous()) + bias).to_vector(), 1e-12);
}

TEST(Matmul, ErrorsNameOpAndShapes) {
  std::string msg = error_of([] { matmul(zeros({2, 3}), zeros({4, 5})); });
  EXPECT_NE(msg.find("matmul: [2,3] x [4,5]: inner dimensions 3 and 4 differ"), std::string::npos) << msg;
  EXPECT_NE(error_of([] { mm(zeros({2, 3}), zeros({3, 2}, DType::Float64)); }).find("dtypes differ"), std::string::npos);
  EXPECT_NE(error_of([] { bmm(zeros({2, 3, 4}), zeros({3, 4, 5})); }).find("batch sizes"), std::string::npos);
  EXPECT_NE(error_of([] { linear(zeros({2, 3}), zeros({4, 5})); }).find("linear"), std::string::npos);
}

TEST(Join, CatAndStack) {
  Tensor a = T({1, 2, 3, 4}, {2, 2}), b = T({5, 6}, {1, 2});
  EXPECT_EQ(cat({a, b}, 0).to_vector(), (V{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(cat({a, a.t()}, 1).to_vector(), (V{1, 2, 1, 3, 3, 4, 2, 4}));
  EXPECT_EQ(stack({a, a}, 1).sizes(), (Shape{2, 2, 2}));
  EXPECT_EQ(stack({a, a}, 1).to_vector(), (V{1, 2, 1, 2, 3, 4, 3, 4}));
  EXPECT_EQ(stack({a, a}, -1).to_vector(), (V{1, 1, 2, 2, 3, 3, 4, 4}));
  std::string msg = error_of([&] { cat({a, b}, 1); });
  EXPECT_NE(msg.find("cat"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[1,2]"), std::string::npos) << msg;
  EXPECT_THROW(stack({a, b}), Error);
}

TEST(Index, IndexSelectGatherOneHot) {
  Tensor x = arange(12, DType::Float32).view({3, 4});
  Tensor idx = T({2, 0, 2}, {3}, DType::Int64);
  EXPECT_EQ(index_select(x, 0, idx).to_vector(), (V{8, 9, 10, 11, 0, 1, 2, 3, 8, 9, 10, 11}));
  EXPECT_EQ(index_select(x, 1, T({3, -4}, {2}, DType::Int64)).to_vector(), (V{3, 0, 7, 4, 11, 8}));
  EXPECT_NE(error_of([&] { index_select(x, 0, T({3}, {1}, DType::Int64)); }).find("index 3 is out of bounds"),
            std::string::npos);
  Tensor gi = T({0, 3, 1, 1}, {2, 2}, DType::Int64);
  EXPECT_EQ(gather(x, 1, gi).to_vector(), (V{0, 3, 5, 5}));
  EXPECT_EQ(gather(x, 0, T({2, 1, 0}, {1, 3}, DType::Int64)).to_vector(), (V{8, 5, 2}));
  EXPECT_THROW(gather(x, 1, T({4}, {1, 1}, DType::Int64)), Error);
  Tensor oh = one_hot(T({2, 0}, {2}, DType::Int64), 3);
  EXPECT_EQ(oh.dtype(), DType::Int64);
  EXPECT_EQ(oh.to_vector(), (V{0, 0, 1, 1, 0, 0}));
  EXPECT_EQ(one_hot(T({1, 3}, {2}, DType::Int64)).sizes(), (Shape{2, 4}));
  EXPECT_THROW(one_hot(T({5}, {1}, DType::Int64), 3), Error);
}

TEST(Factories, ArangeFullZerosOnes) {
  EXPECT_EQ(arange(5).to_vector(), (V{0, 1, 2, 3, 4}));
  EXPECT_EQ(arange(1, 2, 0.25).to_vector(), (V{1, 1.25, 1.5, 1.75}));
  EXPECT_EQ(arange(3, 0, -1, DType::Int64).to_vector(), (V{3, 2, 1}));
  EXPECT_THROW(arange(0, 1, 0), Error);
  EXPECT_THROW(arange(0, 1, -1), Error);
  EXPECT_EQ(full({2}, 2.5, DType::Float16).to_vector(), (V{2.5, 2.5}));
  EXPECT_EQ(sum(ones({3, 3}, DType::Int32)).item(), 9);
  EXPECT_EQ(zeros({2, 0}).numel(), 0);
}

TEST(Random, SeededReproducibleAndDistributed) {
  Generator g1(42), g2(42), g3(43);
  Tensor a = rand({1000}, {}, &g1), b = rand({1000}, {}, &g2), c = rand({1000}, {}, &g3);
  EXPECT_EQ(a.to_vector(), b.to_vector());
  EXPECT_NE(a.to_vector(), c.to_vector());
  EXPECT_NE(rand({1000}, {}, &g1).to_vector(), a.to_vector());  // the counter advances
  EXPECT_GE(min(a).item(), 0.0);
  EXPECT_LT(max(a).item(), 1.0);
  Tensor u = rand({200000}, DType::Float64, &g1);
  EXPECT_NEAR(mean(u).item(), 0.5, 0.005);
  EXPECT_NEAR(var(u).item(), 1.0 / 12, 0.002);
  Tensor n = randn({200000}, DType::Float64, &g1);
  EXPECT_NEAR(mean(n).item(), 0.0, 0.01);
  EXPECT_NEAR(var(n).item(), 1.0, 0.02);
  Tensor t = empty({100000});
  normal_(t, 3.0, 2.0, &g1);
  EXPECT_NEAR(mean(t).item(), 3.0, 0.03);
  uniform_(t, -2.0, -1.0, &g1);
  EXPECT_GE(min(t).item(), -2.0);
  EXPECT_LT(max(t).item(), -1.0);
  Tensor bern = bernoulli({100000}, 0.3, {}, &g1);
  EXPECT_NEAR(mean(bern).item(), 0.3, 0.01);
  Tensor p = T({0, 1, 0, 1}, {4});
  EXPECT_EQ(bernoulli(p, &g1).to_vector(), (V{0, 1, 0, 1}));
  EXPECT_THROW(bernoulli(T({1.5}, {1})), Error);
  Tensor ri = randint(-3, 3, {10000}, DType::Int64, &g1);
  EXPECT_EQ(min(ri).item(), -3);
  EXPECT_EQ(max(ri).item(), 2);
  // manual_seed resets the default generator.
  manual_seed(7);
  V first = randn({10}).to_vector();
  manual_seed(7);
  EXPECT_EQ(randn({10}).to_vector(), first);
}

}  // namespace
}  // namespace ember

namespace ember {
namespace {

// Regressions found in review: 0-dim tensors, in-place casting rules, zero
// sizes, overflow, overlapping copies, scalar promotion.
TEST(EdgeCases, ZeroDimTensors) {
  Tensor s = scalar_tensor(2.0);
  EXPECT_EQ(s.reshape({1}).sizes(), (Shape{1}));
  EXPECT_EQ(s.flatten().sizes(), (Shape{1}));
  EXPECT_EQ(softmax(s, 0).item(), 1.0);
  EXPECT_EQ(argmax(s).item(), 0);
  EXPECT_THROW(s.size(0), Error);
  EXPECT_THROW(s.select(0, 0), Error);
  EXPECT_THROW(s.slice(0, 0, 1), Error);
  EXPECT_EQ(gather(s, 0, scalar_tensor(0, DType::Int64)).item(), 2.0);
  EXPECT_THROW(gather(s, 0, scalar_tensor(3, DType::Int64)), Error);
}

TEST(EdgeCases, InPlaceOpsDoNotNarrowTheResultType) {
  Tensor i = Tensor::from_vector({3}, {1}, DType::Int32);
  EXPECT_THROW(i /= Tensor::from_vector({0.5}, {1}), Error);
  EXPECT_THROW(i *= 0.5, Error);
  EXPECT_THROW(i += Tensor::from_vector({1.5}, {1}), Error);
  i += Tensor::from_vector({2}, {1}, DType::Int64);  // int into int is allowed
  EXPECT_EQ(i.item(), 5);
  Tensor f = ones({2});
  f += Tensor::from_vector({1, 2}, {2}, DType::Int64);
  EXPECT_EQ(f.to_vector(), (std::vector<double>{2, 3}));
}

TEST(EdgeCases, ZeroSizeMatmulOverflowAndOverlap) {
  EXPECT_EQ(matmul(zeros({2, 3, 0}), zeros({0, 4})).to_vector(), std::vector<double>(24, 0.0));
  EXPECT_EQ(matmul(zeros({2, 0, 3}), zeros({2, 3, 4})).sizes(), (Shape{2, 0, 4}));
  EXPECT_THROW(Tensor::empty({int64_t{1} << 62}), Error);
  EXPECT_THROW(Tensor::empty({int64_t{1} << 40, int64_t{1} << 40}), Error);
  Tensor a = arange(6);
  a.slice(0, 1, 6).copy_(a.slice(0, 0, 5));
  EXPECT_EQ(a.to_vector(), (std::vector<double>{0, 0, 1, 2, 3, 4}));
  Tensor m = arange(4).view({2, 2});
  m += m.t();
  EXPECT_EQ(m.to_vector(), (std::vector<double>{0, 3, 3, 6}));
}

TEST(EdgeCases, ScalarPromotionAndCasts) {
  EXPECT_EQ((ones({2}, DType::Float16) * scalar_tensor(2.0)).dtype(), DType::Float16);
  EXPECT_EQ((ones({2}, DType::Int32) + scalar_tensor(5, DType::Int64)).dtype(), DType::Int32);
  EXPECT_EQ((ones({2}, DType::Int32) + scalar_tensor(0.5)).dtype(), DType::Float32);
  EXPECT_TRUE(std::isinf((ones({1}) + INFINITY).item()));
  EXPECT_TRUE(std::isnan((ones({1}) * NAN).item()));
  EXPECT_EQ(Tensor::from_vector({-1.0}, {1}).to(DType::UInt8).item(), 255);  // via int64, as torch on x86
  Tensor big = Tensor::from_vector({-9223372036854775807.0}, {1}, DType::Int64);
  EXPECT_EQ(clamp(big, std::nullopt, 0.0).item(), -9223372036854775807.0);
}

}  // namespace
}  // namespace ember

namespace ember {
namespace {
// scatter_add_ against a loop, repeated indices summing; its errors.
TEST(ScatterAdd, InPlaceAddsAlongDimAndChecks) {
  Tensor out = zeros({2, 4}, DType::Float64);
  Tensor idx = Tensor::from_vector({1, 1, 3, 0, 2, -1}, {2, 3}, DType::Int64);
  Tensor src = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {2, 3}, DType::Float64);
  scatter_add_(out, 1, idx, src);
  EXPECT_EQ(out.to_vector(), (std::vector<double>{0, 3, 0, 3, 4, 0, 5, 6}));
  std::string e = testing::error_of([&] {
    scatter_add_(out, 1, Tensor::from_vector({4}, {1, 1}, DType::Int64), ones({1, 1}, DType::Float64));
  });
  EXPECT_NE(e.find("scatter_add_"), std::string::npos) << e;
  e = testing::error_of([&] { scatter_add_(out, 1, idx, ones({2, 3})); });
  EXPECT_NE(e.find("src of its dtype"), std::string::npos) << e;
}

// The list ops against per-tensor sums in float64: an empty tensor, sizes
// below, at and across the 16384-element chunk, both dtypes; the in-place
// multiply; mixed lists and non-contiguous in-place targets are named errors.
TEST(Foreach, SumSquaresAndMulMatchPerTensorOps) {
  for (DType dt : {DType::Float32, DType::Float64}) {
    std::vector<Tensor> ts;
    uint64_t seed = 7;
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{16384}, int64_t{40000}, int64_t{15}}) {
      Generator g(seed++);
      ts.push_back(randn({n}, {dt}, &g));
    }
    const std::vector<double> got = foreach_sum_squares(ts).to_vector();
    ASSERT_EQ(got.size(), ts.size());
    for (size_t i = 0; i < ts.size(); ++i) {
      const Tensor t64 = ts[i].to(DType::Float64);
      const double want = ts[i].numel() ? sum(t64 * t64).item() : 0.0;
      EXPECT_NEAR(got[i], want, 1e-9 * (1 + want)) << dt << " tensor " << i;
    }
    std::vector<Tensor> want;
    for (const Tensor& t : ts) want.push_back(t * 0.25);
    foreach_mul_(ts, 0.25);
    for (size_t i = 0; i < ts.size(); ++i) EXPECT_TRUE(allclose(ts[i], want[i], 0, 0)) << dt << " tensor " << i;
  }
  std::string e = testing::error_of([] { foreach_sum_squares({ones({2}), ones({2}, DType::Float64)}); });
  EXPECT_NE(e.find("tensor 1 is float64"), std::string::npos) << e;
  e = testing::error_of([] { foreach_mul_({ones({2, 3}).t()}, 2.0); });
  EXPECT_NE(e.find("neither contiguous nor channels-last"), std::string::npos) << e;
  // A channels-last tensor is walked in place as a flat array: the same
  // sum and product as its contiguous copy, and it stays channels-last.
  Generator g(11);
  Tensor cl = randn({2, 3, 4, 5}, {}, &g).contiguous(MemoryFormat::ChannelsLast), plain = cl.contiguous();
  ASSERT_FALSE(cl.is_contiguous());
  EXPECT_NEAR(foreach_sum_squares({cl}).item(), sum(plain * plain).item(), 1e-4);
  std::vector<Tensor> l{cl};
  foreach_mul_(l, -0.5);
  EXPECT_TRUE(allclose(cl, plain * -0.5, 0, 0));
  EXPECT_TRUE(cl.is_contiguous(MemoryFormat::ChannelsLast));
}
}  // namespace
}  // namespace ember
