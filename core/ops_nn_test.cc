// conv2d, batch_norm, max_pool2d and avg_pool2d on the CPU: forward against
// naive float64 loops written here (independently of the kernels),
// backward through the finite-difference gradient checker, the float32
// (oneDNN) gradients against the float64 ones, PyTorch's running-stats rule
// and output-size formulas, and the error messages.
#include "core/ops_nn.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/gradcheck.h"
#include "core/ops.h"
#include "core/ops/int_div.h"
#include "core/testing/conv_cases.h"
#include "core/testing/error_of.h"
#include "core/testing/pool_cases.h"

namespace ember {
namespace {

using Dims = std::array<int64_t, 2>;
using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

Tensor rnd(const Shape& s, uint64_t seed, DType dt = DType::Float64) {
  Generator g(seed);
  return randn(s, {DType::Float64}, &g).to(dt);
}
Tensor leaf(const Tensor& t) { return t.detach().contiguous().requires_grad_(); }

void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const std::vector<double> g = got.to_vector(), w = want.to_vector();
  for (size_t i = 0; i < g.size(); ++i)
    ASSERT_NEAR(g[i], w[i], tol * std::max(1.0, std::abs(w[i]))) << what << " at " << i;
}

void check_grad(const std::string& name, const Fn& f, const std::vector<Tensor>& xs) {
  auto r = autograd::gradcheck(f, xs);
  EXPECT_TRUE(r.ok) << name << ": " << r.message << " (max error " << r.max_abs_error << ")";
}

using ::ember::testing::error_of;

// ---- Naive references ----

Tensor naive_conv(const Tensor& x, const Tensor& w, const Tensor& b, Dims s, Dims p, Dims d, int64_t groups) {
  const std::vector<double> xv = x.to_vector(), wv = w.to_vector();
  const std::vector<double> bv = b.defined() ? b.to_vector() : std::vector<double>(w.size(0), 0.0);
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t O = w.size(0), KH = w.size(2), KW = w.size(3), cg = C / groups, og = O / groups;
  const int64_t OH = (H + 2 * p[0] - d[0] * (KH - 1) - 1) / s[0] + 1;
  const int64_t OW = (W + 2 * p[1] - d[1] * (KW - 1) - 1) / s[1] + 1;
  std::vector<double> out(N * O * OH * OW);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t i = 0; i < OH; ++i)
        for (int64_t j = 0; j < OW; ++j) {
          double acc = bv[o];
          for (int64_t ci = 0; ci < cg; ++ci)
            for (int64_t a = 0; a < KH; ++a)
              for (int64_t c = 0; c < KW; ++c) {
                const int64_t ih = i * s[0] - p[0] + a * d[0], iw = j * s[1] - p[1] + c * d[1];
                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                const int64_t ch = (o / og) * cg + ci;
                acc += xv[((n * C + ch) * H + ih) * W + iw] * wv[((o * cg + ci) * KH + a) * KW + c];
              }
          out[((n * O + o) * OH + i) * OW + j] = acc;
        }
  return Tensor::from_vector(out, {N, O, OH, OW}, DType::Float64);
}

int64_t naive_out_size(int64_t in, int64_t k, int64_t s, int64_t p, bool ceil_mode) {
  const double v = static_cast<double>(in + 2 * p - k) / s;
  int64_t o = static_cast<int64_t>(ceil_mode ? std::ceil(v) : std::floor(v)) + 1;
  if (ceil_mode && (o - 1) * s >= in + p) --o;
  return o;
}

Tensor naive_pool(const Tensor& x, Dims k, Dims s, Dims p, bool ceil_mode, bool is_max, bool include_pad) {
  const std::vector<double> xv = x.to_vector();
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t OH = naive_out_size(H, k[0], s[0], p[0], ceil_mode), OW = naive_out_size(W, k[1], s[1], p[1], ceil_mode);
  std::vector<double> out;
  for (int64_t pl = 0; pl < N * C; ++pl)
    for (int64_t i = 0; i < OH; ++i)
      for (int64_t j = 0; j < OW; ++j) {
        double best = -std::numeric_limits<double>::infinity(), sum = 0;
        int64_t inside = 0, padded = 0;  // window cells in the input / in the padded input
        for (int64_t a = 0; a < k[0]; ++a)
          for (int64_t c = 0; c < k[1]; ++c) {
            const int64_t ih = i * s[0] - p[0] + a, iw = j * s[1] - p[1] + c;
            if (ih < H + p[0] && iw < W + p[1]) ++padded;
            if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
            const double v = xv[(pl * H + ih) * W + iw];
            best = std::max(best, v);
            sum += v;
            ++inside;
          }
        out.push_back(is_max ? best : sum / static_cast<double>(include_pad ? padded : inside));
      }
  return Tensor::from_vector(out, {N, C, OH, OW}, DType::Float64);
}

// ---- conv2d ----

using testing::ConvCase;
const std::vector<ConvCase> kConvCases = testing::conv_cases({
    {{2, 3, 9, 8}, {5, 3, 3, 3}, {2, 2}, {1, 1}, {1, 1}, 1, true},  // stride 2, padding 1
    {{2, 5, 8, 8}, {5, 1, 3, 3}, {1, 1}, {1, 1}, {1, 1}, 5, true},  // depthwise
    {{1, 3, 6, 6}, {6, 1, 3, 3}, {2, 2}, {1, 1}, {1, 1}, 3, true},  // depthwise, multiplier 2
    {{3, 8, 5, 5}, {4, 8, 1, 1}, {1, 1}, {0, 0}, {1, 1}, 1, true},  // 1x1
});

// Labels via str_cat: GCC 12 warns (-Wrestrict, falsely) on "literal" + std::string.
template <typename... Args>
std::string cat(const Args&... args) {
  return detail::str_cat(args...);
}

std::string describe(const ConvCase& c) {
  return cat("x", c.x, " w", c.w, " s", c.stride[0], c.stride[1], " p", c.pad[0], c.pad[1], " d", c.dil[0], c.dil[1],
             " g", c.groups);
}

TEST(Conv2d, ForwardMatchesNaiveLoops) {
  uint64_t seed = 1;
  for (const ConvCase& c : kConvCases)
    for (DType dt : {DType::Float32, DType::Float64}) {
      Tensor x = rnd(c.x, seed++), w = rnd(c.w, seed++), b = c.bias ? rnd({c.w[0]}, seed++) : Tensor();
      Tensor want = naive_conv(x, w, b, c.stride, c.pad, c.dil, c.groups);
      Tensor got = conv2d(x.to(dt), w.to(dt), c.bias ? b.to(dt) : Tensor(), c.stride, c.pad, c.dil, c.groups);
      EXPECT_EQ(got.dtype(), dt);
      expect_close(got, want, dt == DType::Float32 ? 1e-4 : 1e-10, cat(describe(c), " ", dt));
    }
}

TEST(Conv2d, NonContiguousInputAndWeight) {
  for (DType dt : {DType::Float32, DType::Float64}) {
    Tensor x_nhwc = rnd({2, 7, 8, 3}, 11, dt), w_t = rnd({3, 4, 3, 3}, 12, dt);
    Tensor x = x_nhwc.permute({0, 3, 1, 2});  // channels-last view
    Tensor w = w_t.transpose(0, 1);           // [4, 3, 3, 3], non-contiguous
    Tensor xs = rnd({2, 3, 14, 8}, 13, dt).slice(2, 0, 14, 2);  // strided rows
    ASSERT_FALSE(x.is_contiguous());
    ASSERT_FALSE(xs.is_contiguous());
    expect_close(conv2d(x, w, Tensor(), {1, 1}, {1, 1}), naive_conv(x, w, Tensor(), {1, 1}, {1, 1}, {1, 1}, 1),
                 dt == DType::Float32 ? 1e-4 : 1e-10, "permuted");
    expect_close(conv2d(xs, w, Tensor(), {2, 1}), naive_conv(xs, w, Tensor(), {2, 1}, {0, 0}, {1, 1}, 1),
                 dt == DType::Float32 ? 1e-4 : 1e-10, "sliced");
  }
}

// 16-bit convolutions run on oneDNN's native kernels where the CPU has them
// (bfloat16 on AVX512-BF16/AMX), otherwise through float32: either way
// forward and backward match float64 on the same (representable) values.
TEST(Conv2d, HalfTypesMatchFloat64ForwardAndBackward) {
  Tensor x = rnd({2, 3, 6, 6}, 21), w = rnd({4, 3, 3, 3}, 22) * 0.2, b = rnd({4}, 23);
  Tensor want = naive_conv(x, w, b, {1, 1}, {1, 1}, {1, 1}, 1);
  for (DType dt : {DType::Float16, DType::BFloat16}) {
    Tensor got = conv2d(x.to(dt), w.to(dt), b.to(dt), {1, 1}, {1, 1});
    EXPECT_EQ(got.dtype(), dt);
    expect_close(got, want, dt == DType::Float16 ? 1e-2 : 5e-2, dtype_name(dt));
  }
  struct Case {
    Shape x, w;
    std::array<int64_t, 2> stride, pad;
    int64_t groups;
  };
  for (const Case& c : {Case{{2, 4, 9, 7}, {6, 4, 3, 3}, {1, 1}, {1, 1}, 1}, Case{{1, 4, 8, 8}, {4, 2, 3, 3}, {2, 2}, {1, 0}, 2},
                        Case{{3, 8, 5, 5}, {16, 8, 1, 1}, {1, 1}, {0, 0}, 1}}) {
    for (DType dt : {DType::Float16, DType::BFloat16}) {
      const std::string what = cat(dtype_name(dt), " x", c.x, " w", c.w, " groups ", c.groups);
      // Values representable in dt, so float64 sees exactly the same inputs.
      Tensor x64 = rnd(c.x, 31).to(dt).to(DType::Float64), w64 = (rnd(c.w, 32) * 0.3).to(dt).to(DType::Float64);
      Tensor b64 = rnd({c.w[0]}, 33).to(dt).to(DType::Float64), gy;
      auto grads = [&](DType t) {
        Tensor xt = x64.to(t).detach().requires_grad_(), wt = w64.to(t).detach().requires_grad_(),
               bt = b64.to(t).detach().requires_grad_();
        Tensor y = conv2d(xt, wt, bt, c.stride, c.pad, {1, 1}, c.groups);
        if (!gy.defined()) gy = rnd(y.sizes(), 34).to(dt).to(DType::Float64);
        sum(y * gy.to(t)).backward();
        return std::vector<Tensor>{y, xt.grad(), wt.grad(), bt.grad()};
      };
      auto ref = grads(DType::Float64), got = grads(dt);
      const char* names[] = {"y", "dx", "dw", "db"};
      for (int k = 0; k < 4; ++k) {
        EXPECT_EQ(got[k].dtype(), dt) << what << " " << names[k];
        const double scale = max(abs(ref[k])).item();
        expect_close(got[k].to(DType::Float64) / scale, ref[k] / scale, dt == DType::Float16 ? 4e-3 : 3e-2,
                     what + " " + names[k]);
      }
    }
  }
}

TEST(Conv2d, GradcheckFloat64) {
  uint64_t seed = 100;
  for (const ConvCase& c : kConvCases) {
    Tensor x = leaf(rnd(c.x, seed++)), w = leaf(rnd(c.w, seed++));
    std::vector<Tensor> in = {x, w};
    if (c.bias) in.push_back(leaf(rnd({c.w[0]}, seed++)));
    check_grad(cat("conv2d ", describe(c)), [&](const std::vector<Tensor>& v) {
      return conv2d(v[0], v[1], v.size() > 2 ? v[2] : Tensor(), c.stride, c.pad, c.dil, c.groups);
    }, in);
  }
  // Strides and padding with groups, depthwise without bias, 1x1.
  Tensor x = leaf(rnd({2, 4, 5, 4}, 150)), wg = leaf(rnd({6, 2, 3, 2}, 151)), wd = leaf(rnd({4, 1, 3, 3}, 152));
  Tensor w1 = leaf(rnd({3, 4, 1, 1}, 153)), b = leaf(rnd({6}, 154));
  check_grad("conv2d groups=2", [](auto& v) { return conv2d(v[0], v[1], v[2], {2, 1}, {1, 0}, {1, 1}, 2); }, {x, wg, b});
  check_grad("conv2d depthwise", [](auto& v) { return conv2d(v[0], v[1], Tensor(), {1, 1}, {1, 1}, {1, 1}, 4); },
             {x, wd});
  check_grad("conv2d 1x1", [](auto& v) { return conv2d(v[0], v[1]); }, {x, w1});
}

// The oneDNN (float32) backward against the float64 reference backward.
TEST(Conv2d, Float32GradientsMatchFloat64) {
  uint64_t seed = 200;
  for (const ConvCase& c : kConvCases) {
    Tensor x64 = rnd(c.x, seed++), w64 = rnd(c.w, seed++), b64 = rnd({c.w[0]}, seed++);
    // Which inputs need gradients varies, to cover oneDNN's partial passes
    // (data only, weights only, bias without weights).
    for (int mask : {7, 1, 2, 4}) {
      if (!c.bias && mask == 4) continue;
      std::vector<Tensor> grads[2];
      for (int k = 0; k < 2; ++k) {
        const DType dt = k == 0 ? DType::Float32 : DType::Float64;
        Tensor x = x64.to(dt).detach(), w = w64.to(dt).detach(), b = c.bias ? b64.to(dt).detach() : Tensor();
        if (mask & 1) x.requires_grad_();
        if (mask & 2) w.requires_grad_();
        if (c.bias && (mask & 4)) b.requires_grad_();
        Tensor y = conv2d(x, w, b, c.stride, c.pad, c.dil, c.groups);
        Tensor r = rnd(y.sizes(), 999, dt);
        sum(y * r).backward();
        grads[k] = {x.grad(), w.grad(), b.defined() ? b.grad() : Tensor()};
      }
      for (int i = 0; i < 3; ++i) {
        ASSERT_EQ(grads[0][i].defined(), grads[1][i].defined()) << describe(c) << " mask " << mask << " grad " << i;
        if (grads[0][i].defined())
          expect_close(grads[0][i], grads[1][i], 1e-4, cat(describe(c), " mask ", mask, " grad ", i));
      }
    }
  }
}

// Winograd (the CPU default for 3x3 stride-1 convolutions, ConvAlgorithm::
// Auto) against the direct algorithm, both measured against float64: forward
// and both gradients, on ResNet-like layers. Winograd's transforms round
// more, so its error is larger; it must stay within 2e-5 of the output's
// scale (measured: about 1e-6), where the direct algorithm is at about 3e-7 to 1e-6
// (docs/design.md, Note [numerics], has the figures and why Winograd stays the default).
TEST(Conv2d, WinogradMatchesDirectAndFloat64) {
  struct Case {
    Shape x;
    int64_t o;
    bool bias;
  };
  const Case cases[] = {{{4, 32, 14, 14}, 32, false}, {{2, 64, 7, 7}, 128, true}, {{3, 16, 28, 28}, 16, false}};
  uint64_t seed = 400;
  const ConvAlgorithm saved = cpu_conv_algorithm();
  for (const Case& c : cases) {
    Tensor x64 = rnd(c.x, seed++), w64 = rnd({c.o, c.x[1], 3, 3}, seed++), b64 = rnd({c.o}, seed++);
    std::vector<Tensor> out[3];  // direct fp32, auto fp32, float64
    for (int k = 0; k < 3; ++k) {
      set_cpu_conv_algorithm(k == 1 ? ConvAlgorithm::Auto : ConvAlgorithm::Direct);
      const DType dt = k == 2 ? DType::Float64 : DType::Float32;
      Tensor x = x64.to(dt).detach().requires_grad_(), w = w64.to(dt).detach().requires_grad_();
      Tensor b = c.bias ? b64.to(dt).detach().requires_grad_() : Tensor();
      Tensor y = conv2d(x, w, b, {1, 1}, {1, 1});
      sum(y * rnd(y.sizes(), 999, dt)).backward();
      out[k] = {y, x.grad(), w.grad()};
    }
    const char* what[] = {"output", "grad input", "grad weight"};
    for (int i = 0; i < 3; ++i) {
      const double scale = max(abs(out[2][i])).item();
      const double e_direct = max(abs(out[0][i].to(DType::Float64) - out[2][i])).item() / scale;
      const double e_auto = max(abs(out[1][i].to(DType::Float64) - out[2][i])).item() / scale;
      std::printf("conv %s -> %lld, %s: max error / max |ref|: direct %.2e, auto (Winograd) %.2e\n",
                  shape_str(c.x).c_str(), static_cast<long long>(c.o), what[i], e_direct, e_auto);
      EXPECT_LT(e_direct, 5e-6) << shape_str(c.x) << " " << what[i];
      EXPECT_LT(e_auto, 2e-5) << shape_str(c.x) << " " << what[i];
    }
  }
  set_cpu_conv_algorithm(saved);
}

TEST(Conv2d, ConcurrentCallsShareCachedPlans) {
  Tensor x = rnd({2, 8, 12, 12}, 300, DType::Float32), w = rnd({8, 8, 3, 3}, 301, DType::Float32);
  Tensor want = conv2d(x, w, Tensor(), {1, 1}, {1, 1});
  std::vector<Tensor> got(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back([&, t] { got[t] = conv2d(x, w, Tensor(), {1, 1}, {1, 1}); });
  for (auto& t : threads) t.join();
  for (const Tensor& g : got) expect_close(g, want, 0, "thread");
}

TEST(Conv2d, ErrorsNameTheOpAndShapes) {
  Tensor x = zeros({2, 3, 5, 5}), w = zeros({4, 3, 3, 3});
  std::string e = error_of([&] { conv2d(x, zeros({4, 2, 3, 3})); });
  EXPECT_NE(e.find("conv2d"), std::string::npos) << e;
  EXPECT_NE(e.find("[2,3,5,5]"), std::string::npos) << e;
  EXPECT_NE(e.find("[4,2,3,3]"), std::string::npos) << e;
  e = error_of([&] { conv2d(zeros({2, 4, 5, 5}), zeros({6, 2, 3, 3}), Tensor(), {1, 1}, {0, 0}, {1, 1}, 3); });
  EXPECT_NE(e.find("groups=3"), std::string::npos) << e;
  e = error_of([&] { conv2d(x, zeros({4, 3, 7, 7})); });
  EXPECT_NE(e.find("larger than the padded input"), std::string::npos) << e;
  EXPECT_NE(e.find("[2,3,5,5]"), std::string::npos) << e;
  e = error_of([&] { conv2d(x, zeros({4, 3, 3, 3}), Tensor(), {1, 1}, {0, 0}, {3, 3}); });  // dilated 7x7
  EXPECT_NE(e.find("dilated"), std::string::npos) << e;
  e = error_of([&] { conv2d(zeros({3, 5, 5}), w); });
  EXPECT_NE(e.find("4-D input"), std::string::npos) << e;
  EXPECT_NE(e.find("[3,5,5]"), std::string::npos) << e;
  e = error_of([&] { conv2d(x, w, zeros({3})); });
  EXPECT_NE(e.find("bias [3]"), std::string::npos) << e;
  e = error_of([&] { conv2d(x, w.to(DType::Float64)); });
  EXPECT_NE(e.find("same dtype"), std::string::npos) << e;
  e = error_of([&] { conv2d(x, w, Tensor(), {0, 1}); });
  EXPECT_NE(e.find("stride"), std::string::npos) << e;
  // Regression: an empty H with padding covering the kernel was accepted (and
  // gave bias values on the CPU while cuDNN rejects it); PyTorch rejects it.
  e = error_of([&] { conv2d(zeros({1, 3, 0, 5}), zeros({4, 3, 1, 1}), Tensor(), {1, 1}, {1, 1}); });
  EXPECT_NE(e.find("[1,3,0,5]"), std::string::npos) << e;
  EXPECT_NE(e.find("empty spatial dimension"), std::string::npos) << e;
  // An empty batch stays valid.
  EXPECT_EQ(conv2d(zeros({0, 3, 5, 5}), w).sizes(), (Shape{0, 4, 3, 3}));
}

// ---- batch_norm ----

// Per-channel mean and biased variance of [N, C, H, W], by hand.
void channel_stats(const Tensor& x, std::vector<double>& mean, std::vector<double>& var) {
  const std::vector<double> v = x.to_vector();
  const int64_t N = x.size(0), C = x.size(1), S = x.size(2) * x.size(3);
  mean.assign(C, 0);
  var.assign(C, 0);
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t s = 0; s < S; ++s) mean[c] += v[(n * C + c) * S + s];
    mean[c] /= N * S;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t s = 0; s < S; ++s) var[c] += std::pow(v[(n * C + c) * S + s] - mean[c], 2);
    var[c] /= N * S;
  }
}

Tensor normalize_by(const Tensor& x, const std::vector<double>& mean, const std::vector<double>& var,
                    const std::vector<double>& w, const std::vector<double>& b, double eps) {
  std::vector<double> v = x.to_vector();
  const int64_t C = x.size(1), S = x.size(2) * x.size(3);
  for (size_t i = 0; i < v.size(); ++i) {
    const int64_t c = (static_cast<int64_t>(i) / S) % C;
    v[i] = (v[i] - mean[c]) / std::sqrt(var[c] + eps) * w[c] + b[c];
  }
  return Tensor::from_vector(v, x.sizes(), DType::Float64);
}

TEST(BatchNorm, TrainingUpdatesRunningStatsLikePyTorchAndEvalUsesThem) {
  for (DType dt : {DType::Float32, DType::Float64}) {
    const double tol = dt == DType::Float32 ? 1e-5 : 1e-12;
    Tensor x = rnd({3, 2, 2, 3}, 400) * 2.0 + 1.0;
    const std::vector<double> w = {1.5, -0.5}, b = {0.25, 2.0};
    Tensor wt = Tensor::from_vector(w, {2}, dt), bt = Tensor::from_vector(b, {2}, dt);
    Tensor rm = Tensor::from_vector({0.5, -1.0}, {2}, dt), rv = Tensor::from_vector({1.0, 2.0}, {2}, dt);
    std::vector<double> mean, var;
    channel_stats(x, mean, var);
    const double m = 3 * 2 * 3, mom = 0.3, eps = 1e-3;
    Tensor y = batch_norm(x.to(dt), wt, bt, rm, rv, true, mom, eps);
    expect_close(y, normalize_by(x, mean, var, w, b, eps), tol * 10, "train output");
    // PyTorch: running = (1 - momentum) * running + momentum * stat, variance unbiased.
    const std::vector<double> rm1 = {0.7 * 0.5 + 0.3 * mean[0], 0.7 * -1.0 + 0.3 * mean[1]};
    const std::vector<double> rv1 = {0.7 * 1.0 + 0.3 * var[0] * m / (m - 1), 0.7 * 2.0 + 0.3 * var[1] * m / (m - 1)};
    expect_close(rm, Tensor::from_vector(rm1, {2}, DType::Float64), tol, "running_mean");
    expect_close(rv, Tensor::from_vector(rv1, {2}, DType::Float64), tol, "running_var");
    // Eval normalises by the running stats and leaves them alone.
    Tensor x2 = rnd({2, 2, 3, 1}, 401);
    Tensor y2 = batch_norm(x2.to(dt), wt, bt, rm, rv, false, mom, eps);
    expect_close(y2, normalize_by(x2, rm1, rv1, w, b, eps), tol * 10, "eval output");
    expect_close(rm, Tensor::from_vector(rm1, {2}, DType::Float64), tol, "running_mean after eval");
    expect_close(rv, Tensor::from_vector(rv1, {2}, DType::Float64), tol, "running_var after eval");
  }
}

TEST(BatchNorm, OptionalAffineAndRunningStats) {
  Tensor x = rnd({4, 3, 2, 2}, 410);
  std::vector<double> mean, var;
  channel_stats(x, mean, var);
  const std::vector<double> ones3(3, 1.0), zeros3(3, 0.0);
  expect_close(batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), true),
               normalize_by(x, mean, var, ones3, zeros3, 1e-5), 1e-12, "no affine, no running stats");
  // Default momentum 0.1.
  Tensor rm = zeros({3}, DType::Float64), rv = ones({3}, DType::Float64);
  batch_norm(x, Tensor(), Tensor(), rm, rv, true);
  expect_close(rm, Tensor::from_vector({0.1 * mean[0], 0.1 * mean[1], 0.1 * mean[2]}, {3}, DType::Float64), 1e-12,
               "default momentum");
}

TEST(BatchNorm, FloatAndHalfInputsMatchFloat64) {
  Tensor x = rnd({4, 3, 5, 5}, 420) * 3.0 + 10.0;  // |mean| >> std: the variance must not cancel
  Tensor w = rnd({3}, 421), b = rnd({3}, 422);
  Tensor want = batch_norm(x, w, b, Tensor(), Tensor(), true);
  expect_close(batch_norm(x.to(DType::Float32), w.to(DType::Float32), b.to(DType::Float32), Tensor(), Tensor(), true),
               want, 1e-5, "float32");
  expect_close(batch_norm(x.to(DType::BFloat16), w.to(DType::Float32), b.to(DType::Float32), Tensor(), Tensor(), true),
               batch_norm(x.to(DType::BFloat16).to(DType::Float64), w, b, Tensor(), Tensor(), true), 2e-2, "bfloat16");
}

TEST(BatchNorm, Gradcheck) {
  Tensor x = leaf(rnd({3, 2, 3, 2}, 430)), w = leaf(rnd({2}, 431)), b = leaf(rnd({2}, 432));
  Tensor rm = rnd({2}, 433), rv = rnd({2}, 434) * 0.2 + 1.0;
  check_grad("batch_norm train", [&](auto& v) { return batch_norm(v[0], v[1], v[2], Tensor(), Tensor(), true); },
             {x, w, b});
  // Updating running stats every call must not disturb the gradient.
  Tensor rm2 = rm.clone(), rv2 = rv.clone();
  check_grad("batch_norm train + running stats",
             [&](auto& v) { return batch_norm(v[0], v[1], v[2], rm2, rv2, true, 0.2); }, {x, w, b});
  check_grad("batch_norm train, no affine", [&](auto& v) { return batch_norm(v[0], Tensor(), Tensor(), rm, rv, true); },
             {x});
  // Nonlinear downstream, so the xhat term of dx matters.
  check_grad("batch_norm train, squared", [&](auto& v) {
    Tensor y = batch_norm(v[0], v[1], Tensor(), Tensor(), Tensor(), true);
    return y * y;
  }, {x, w});
  check_grad("batch_norm eval", [&](auto& v) { return batch_norm(v[0], v[1], v[2], rm, rv, false); }, {x, w, b});
}

TEST(BatchNorm, Errors) {
  Tensor x = zeros({2, 3, 4, 4});
  std::string e = error_of([&] { batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), false); });
  EXPECT_NE(e.find("running_mean"), std::string::npos) << e;
  e = error_of([&] { batch_norm(x, zeros({4}), Tensor(), Tensor(), Tensor(), true); });
  EXPECT_NE(e.find("batch_norm: weight [4]"), std::string::npos) << e;
  EXPECT_NE(e.find("[2,3,4,4]"), std::string::npos) << e;
  e = error_of([&] { batch_norm(zeros({2, 3, 4}), Tensor(), Tensor(), Tensor(), Tensor(), true); });
  EXPECT_NE(e.find("4-D input"), std::string::npos) << e;
  e = error_of([&] { batch_norm(zeros({1, 3, 1, 1}), Tensor(), Tensor(), Tensor(), Tensor(), true); });
  EXPECT_NE(e.find("more than 1 value per channel"), std::string::npos) << e;
}

// ---- Pooling ----

TEST(Pool, OutputSizesFollowPyTorch) {
  EXPECT_EQ(pool_output_size(5, 2, 2, 0, 1, false), 2);
  EXPECT_EQ(pool_output_size(5, 2, 2, 0, 1, true), 3);
  EXPECT_EQ(pool_output_size(6, 3, 2, 1, 1, false), 3);
  EXPECT_EQ(pool_output_size(6, 3, 2, 1, 1, true), 4);
  // ceil would give 3, but the third window would start in the right padding.
  EXPECT_EQ(pool_output_size(5, 3, 3, 1, 1, true), 2);
  EXPECT_EQ(pool_output_size(112, 3, 2, 1, 1, false), 56);  // ResNet stem
}

using testing::PoolCase;
const std::vector<PoolCase> kPoolCases = testing::pool_cases({{{1, 1, 4, 4}, {4, 4}, {1, 1}, {0, 0}, false}});

TEST(Pool, ForwardMatchesNaiveLoops) {
  uint64_t seed = 500;
  for (const PoolCase& c : kPoolCases)
    for (DType dt : {DType::Float32, DType::Float64, DType::BFloat16}) {
      Tensor x = rnd(c.x, seed++).to(dt).to(DType::Float64);  // representable in dt
      const std::string what = cat("x", c.x, " k", c.k[0], " s", c.s[0], " p", c.p[0], c.ceil ? " ceil " : " ", dt);
      const double tol = dt == DType::BFloat16 ? 1e-2 : dt == DType::Float32 ? 1e-6 : 1e-12;
      expect_close(max_pool2d(x.to(dt), c.k, c.s, c.p, c.ceil), naive_pool(x, c.k, c.s, c.p, c.ceil, true, true), tol,
                   cat("max ", what));
      for (bool include_pad : {true, false})
        expect_close(avg_pool2d(x.to(dt), c.k, c.s, c.p, c.ceil, include_pad),
                     naive_pool(x, c.k, c.s, c.p, c.ceil, false, include_pad), tol,
                     cat("avg ", include_pad ? "incl " : "excl ", what));
    }
  // Channels-last input pools in place (pool_offset) and stays channels-last.
  for (const PoolCase& c : kPoolCases) {
    Tensor x = rnd(c.x, seed++).contiguous(MemoryFormat::ChannelsLast);
    const std::string what = cat("channels-last x", c.x, " k", c.k[0]);
    Tensor y = max_pool2d(x, c.k, c.s, c.p, c.ceil), a = avg_pool2d(x, c.k, c.s, c.p, c.ceil, false);
    expect_close(y, naive_pool(x, c.k, c.s, c.p, c.ceil, true, true), 1e-12, cat("max ", what));
    expect_close(a, naive_pool(x, c.k, c.s, c.p, c.ceil, false, false), 1e-12, cat("avg ", what));
    EXPECT_TRUE(y.is_contiguous(MemoryFormat::ChannelsLast) && a.is_contiguous(MemoryFormat::ChannelsLast)) << what;
  }
  // Non-contiguous input.
  Tensor x = rnd({2, 6, 6, 3}, 550).permute({0, 3, 1, 2});
  expect_close(max_pool2d(x, {3, 3}, {2, 2}, {1, 1}), naive_pool(x, {3, 3}, {2, 2}, {1, 1}, false, true, true), 1e-12,
               "max permuted");
  expect_close(avg_pool2d(x, {2, 2}, {1, 1}), naive_pool(x, {2, 2}, {1, 1}, {0, 0}, false, false, true), 1e-12,
               "avg permuted");
}

// The multiply-high division the pooling kernels index with, against `/`:
// divisors of every bit length with their neighbours, numerators at the
// multiples' edges and at the top of the range, and drawn pairs.
TEST(IntDiv, MatchesDivision) {
  std::vector<int64_t> divisors;
  for (int b = 0; b < 31; ++b)
    for (int64_t d : {(int64_t{1} << b) - 1, int64_t{1} << b, (int64_t{1} << b) + 1})
      if (d >= 1 && d < (int64_t{1} << 31)) divisors.push_back(d);
  for (int64_t d : {3, 5, 7, 56, 64, 112, 3136, 12544, 802816, 2147483647}) divisors.push_back(d);
  uint64_t state = 42;
  const auto next = [&] {  // splitmix64
    state += 0x9e3779b97f4a7c15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  for (int i = 0; i < 200; ++i) divisors.push_back(1 + static_cast<int64_t>(next() % ((uint64_t{1} << 31) - 1)));
  const int64_t top = (int64_t{1} << 31) - 1;
  for (int64_t d : divisors) {
    const IntDiv<int32_t> by(d);
    std::vector<int64_t> ns = {0, 1, top, top - 1, top / d * d, top / d * d - 1};
    for (int64_t q : {int64_t{1}, int64_t{2}, int64_t{3}, top / d / 2, top / d - 1})
      for (int64_t e : {-1, 0, 1}) ns.push_back(q * d + e);
    for (int i = 0; i < 200; ++i) ns.push_back(static_cast<int64_t>(next() % (uint64_t{1} << 31)));
    for (int64_t n : ns) {
      if (n < 0 || n > top) continue;
      ASSERT_EQ(by.div(static_cast<int32_t>(n)), n / d) << n << " / " << d;
    }
  }
  EXPECT_EQ(IntDiv<int64_t>(7).div(int64_t{1} << 40), (int64_t{1} << 40) / 7);
  EXPECT_TRUE(fits_int_div32(top));
  EXPECT_FALSE(fits_int_div32(top + 1));
}

// The tests' switch to the 64-bit paths is undone when its scope ends,
// a check's exception included, and scopes nest.
TEST(IntDiv, LimitScopeRestoresTheLimitBefore) {
  ASSERT_TRUE(use_int_div32(1000));
  try {
    const IntDiv32LimitScope outer(0);
    EXPECT_FALSE(use_int_div32(1000));
    {
      const IntDiv32LimitScope inner(2000);
      EXPECT_TRUE(use_int_div32(1000));
      EXPECT_FALSE(use_int_div32(2000));
    }
    EXPECT_FALSE(use_int_div32(1000));
    throw std::runtime_error("a failed check");
  } catch (const std::runtime_error&) {
  }
  EXPECT_TRUE(use_int_div32(1000));
  EXPECT_TRUE(use_int_div32((int64_t{1} << 31) - 1));
}

TEST(Pool, MaxPropagatesNaN) {
  Tensor x = Tensor::from_vector({1, std::nan(""), 3, 4}, {1, 1, 2, 2});
  EXPECT_TRUE(std::isnan(max_pool2d(x, {2, 2}, {2, 2}).item()));
}

TEST(Pool, Gradcheck) {
  uint64_t seed = 600;
  for (const PoolCase& c : kPoolCases) {
    // Distinct values with gaps far above the finite-difference step, so no argmax flips.
    Tensor x = leaf(rnd(c.x, seed++));
    const std::string what = cat("x", c.x, c.ceil ? " ceil" : "");
    check_grad(cat("max_pool2d ", what), [&](auto& v) { return max_pool2d(v[0], c.k, c.s, c.p, c.ceil); }, {x});
    for (bool include_pad : {true, false})
      check_grad(cat("avg_pool2d ", what),
                 [&](auto& v) { return avg_pool2d(v[0], c.k, c.s, c.p, c.ceil, include_pad); }, {x});
    // The channels-last kernels, forward and backward, through a layout copy.
    const auto cl = [](const Tensor& t) { return t.contiguous(MemoryFormat::ChannelsLast); };
    check_grad(cat("max_pool2d channels-last ", what),
               [&](auto& v) { return max_pool2d(cl(v[0]), c.k, c.s, c.p, c.ceil); }, {x});
    check_grad(cat("avg_pool2d channels-last ", what),
               [&](auto& v) { return avg_pool2d(cl(v[0]), c.k, c.s, c.p, c.ceil, true); }, {x});
  }
}

TEST(Pool, Errors) {
  Tensor x = zeros({2, 3, 5, 5});
  std::string e = error_of([&] { max_pool2d(zeros({3, 5, 5}), {2, 2}, {2, 2}); });
  EXPECT_NE(e.find("max_pool2d: expected a 4-D input"), std::string::npos) << e;
  EXPECT_NE(e.find("[3,5,5]"), std::string::npos) << e;
  e = error_of([&] { avg_pool2d(x, {3, 3}, {1, 1}, {2, 2}); });
  EXPECT_NE(e.find("avg_pool2d: padding"), std::string::npos) << e;
  e = error_of([&] { max_pool2d(x, {8, 8}, {1, 1}); });
  EXPECT_NE(e.find("larger than the padded input"), std::string::npos) << e;
  EXPECT_NE(e.find("[2,3,5,5]"), std::string::npos) << e;
  e = error_of([&] { avg_pool2d(x, {2, 2}, {0, 2}); });
  EXPECT_NE(e.find("stride"), std::string::npos) << e;
}

// ---- Together ----

// A tiny ResNet-style block end to end: every backward composes.
TEST(NnOps, ConvBnReluPoolChainGradcheck) {
  Tensor x = leaf(rnd({2, 2, 6, 6}, 700)), w = leaf(rnd({3, 2, 3, 3}, 701) * 0.5);
  Tensor g = leaf(rnd({3}, 702)), b = leaf(rnd({3}, 703));
  check_grad("conv-bn-relu-pool", [](auto& v) {
    Tensor y = relu(batch_norm(conv2d(v[0], v[1], Tensor(), {1, 1}, {1, 1}), v[2], v[3], Tensor(), Tensor(), true));
    return avg_pool2d(max_pool2d(y, {2, 2}, {2, 2}), {3, 3}, {1, 1});
  }, {x, w, g, b});
}

// ---- Channels-last (NHWC memory behind NCHW sizes) ----
constexpr MemoryFormat kCL = MemoryFormat::ChannelsLast;

TEST(ChannelsLast, LayoutApi) {
  Tensor x = rnd({2, 3, 4, 5}, 800);
  Tensor c = x.contiguous(kCL);
  EXPECT_EQ(c.sizes(), x.sizes());
  EXPECT_EQ(c.strides(), (Shape{60, 1, 15, 3}));
  EXPECT_TRUE(c.is_contiguous(kCL));
  EXPECT_FALSE(c.is_contiguous());
  EXPECT_EQ(c.suggest_memory_format(), kCL);
  EXPECT_EQ(x.suggest_memory_format(), MemoryFormat::Contiguous);
  EXPECT_EQ(c.to_vector(), x.to_vector());
  EXPECT_TRUE(c.contiguous().is_contiguous());
  EXPECT_EQ(c.contiguous().to_vector(), x.to_vector());
  EXPECT_TRUE(c.contiguous(kCL).is_same(c));  // already so: no copy
  // One channel: NHWC and NCHW are the same memory; plain contiguous wins.
  EXPECT_EQ(rnd({2, 1, 4, 5}, 801).contiguous(kCL).suggest_memory_format(), MemoryFormat::Contiguous);
  EXPECT_EQ(Tensor::empty({2, 3, 4, 5}, {}, kCL).strides(), (Shape{60, 1, 15, 3}));
  EXPECT_THROW(rnd({3, 4}, 802).contiguous(kCL), Error);
}

TEST(ChannelsLast, ElementwiseOpsKeepTheLayout) {
  Tensor x = rnd({2, 3, 4, 5}, 810), bias = rnd({3, 1, 1}, 811), other = rnd({2, 3, 4, 5}, 812);
  Tensor xc = x.contiguous(kCL);
  Tensor want = relu(x) * 2.0 + bias - other;
  Tensor got = relu(xc) * 2.0 + bias - other;
  EXPECT_EQ(got.suggest_memory_format(), kCL);
  EXPECT_EQ(got.to_vector(), want.to_vector());
  Tensor sel = where(gt(xc, zeros({}, x.dtype())), xc, other);
  EXPECT_EQ(sel.suggest_memory_format(), kCL);
  EXPECT_EQ(sel.to_vector(), where(gt(x, zeros({}, x.dtype())), x, other).to_vector());
  // A plain-contiguous operand of full shape and a channels-last one: values
  // are right either way.
  EXPECT_EQ((other + xc).to_vector(), (other + x).to_vector());
}

TEST(ChannelsLast, BatchNormAndPoolingMatchNchwForwardAndBackward) {
  Tensor x0 = rnd({3, 4, 6, 6}, 820), w0 = rnd({4}, 821), b0 = rnd({4}, 822), proj = rnd({3, 4, 3, 3}, 823);
  auto run = [&](bool cl, Tensor& x, Tensor& w, Tensor& b, Tensor& rm) {
    x = leaf(x0), w = leaf(w0), b = leaf(b0), rm = zeros({4}, DType::Float64);
    Tensor rv = ones({4}, DType::Float64);
    Tensor in = cl ? x.contiguous(kCL) : x;
    Tensor h = relu(batch_norm(in, w, b, rm, rv, true, 0.1));
    EXPECT_EQ(h.suggest_memory_format(), cl ? kCL : MemoryFormat::Contiguous);
    Tensor y = avg_pool2d(max_pool2d(h, {2, 2}, {2, 2}), {1, 1}, {1, 1});
    EXPECT_EQ(y.suggest_memory_format(), cl ? kCL : MemoryFormat::Contiguous);
    sum(y * proj).backward();
    return y;
  };
  Tensor xa, wa, ba, rma, xb, wb, bb, rmb;
  Tensor ya = run(false, xa, wa, ba, rma), yb = run(true, xb, wb, bb, rmb);
  expect_close(yb, ya, 1e-12, "forward");
  expect_close(rmb, rma, 1e-12, "running_mean");
  expect_close(xb.grad(), xa.grad(), 1e-12, "dx");
  expect_close(wb.grad(), wa.grad(), 1e-12, "dweight");
  expect_close(bb.grad(), ba.grad(), 1e-12, "dbias");
  Tensor x = leaf(rnd({2, 3, 4, 4}, 824)), w = leaf(rnd({3}, 825));
  check_grad("channels-last batch_norm + pool", [](auto& v) {
    Tensor y = batch_norm(v[0].contiguous(kCL), v[1], Tensor(), Tensor(), Tensor(), true);
    return max_pool2d(y * y, {2, 2}, {2, 2});
  }, {x, w});
}

// ---- grouped_mm ----

// Each group's rows times its own weight, through mm on narrowed slices.
Tensor grouped_reference(const Tensor& x, const Tensor& w, const std::vector<int64_t>& sizes) {
  std::vector<Tensor> parts;
  int64_t row = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    parts.push_back(mm(x.narrow(0, row, sizes[g]), w.select(0, static_cast<int64_t>(g)).t()));
    row += sizes[g];
  }
  return ::ember::cat(parts, 0);
}

TEST(GroupedMm, MatchesPerGroupMatmulsWithEmptyGroups) {
  for (const std::vector<int64_t>& sizes : std::vector<std::vector<int64_t>>{{3, 0, 5, 2}, {0, 0, 4}, {6}, {0, 0}}) {
    int64_t n = 0;
    for (int64_t s : sizes) n += s;
    const int64_t G = static_cast<int64_t>(sizes.size());
    const Tensor x0 = rnd({n, 7}, 1), w0 = rnd({G, 5, 7}, 2), proj = rnd({n, 5}, 3);
    Tensor x = leaf(x0), w = leaf(w0), xr = leaf(x0), wr = leaf(w0);
    Tensor y = grouped_mm(x, w, sizes);
    sum(y * proj).backward();
    Tensor yr = n ? grouped_reference(xr, wr, sizes) : zeros({0, 5}, {DType::Float64});
    if (n) sum(yr * proj).backward();
    const std::string what = cat("sizes ", sizes.size(), " n ", n);
    expect_close(y, yr, 1e-12, what + " forward");
    if (n) expect_close(x.grad(), xr.grad(), 1e-12, what + " dx");
    // A group of no rows gets a zero weight gradient (defined, like the others).
    Tensor dw_ref = n ? wr.grad() : zeros({G, 5, 7}, {DType::Float64});
    for (int64_t g = 0; g < G; ++g)
      if (sizes[g] == 0) dw_ref.select(0, g).zero_();
    expect_close(w.grad(), dw_ref, 1e-12, what + " dw");
  }
  check_grad("grouped_mm",
             [](const std::vector<Tensor>& v) {
               return grouped_mm(v[0], v[1], {2, 0, 3});
             },
             {leaf(rnd({5, 4}, 4)), leaf(rnd({3, 3, 4}, 5))});
}

TEST(GroupedMm, Float32AndHalfTypesMatchFloat64) {
  const std::vector<int64_t> sizes{4, 1, 0, 3};
  const Tensor x = rnd({8, 16}, 6), w = rnd({4, 8, 16}, 7);
  const Tensor want = grouped_mm(x, w, sizes);
  for (auto [dt, t] : {std::pair{DType::Float32, 1e-5}, {DType::BFloat16, 3e-2}, {DType::Float16, 1e-2}}) {
    Tensor got = grouped_mm(x.to(dt), w.to(dt), sizes).to(DType::Float64);
    expect_close(got, want, t * 4, cat("grouped_mm ", dt));
  }
}

// The groups as offsets (cumulative row ends), read where the CPU has them:
// the same values and gradients as the sizes, bit for bit; bad offsets named.
TEST(GroupedMm, OffsetsMatchSizes) {
  const std::vector<int64_t> sizes{3, 0, 5, 2};
  const Tensor offsets = Tensor::from_vector({3, 3, 8, 10}, {4}, DType::Int64);
  const Tensor x0 = rnd({10, 7}, 11), w0 = rnd({4, 5, 7}, 12), proj = rnd({10, 5}, 13);
  Tensor x = leaf(x0), w = leaf(w0), xs = leaf(x0), ws = leaf(w0);
  Tensor y = grouped_mm(x, w, offsets), ys = grouped_mm(xs, ws, sizes);
  sum(y * proj).backward();
  sum(ys * proj).backward();
  expect_close(y, ys, 0, "forward");
  expect_close(x.grad(), xs.grad(), 0, "dx");
  expect_close(w.grad(), ws.grad(), 0, "dw");
  const auto offs = [](std::vector<double> v) {
    const int64_t n = static_cast<int64_t>(v.size());
    return Tensor::from_vector(v, {n}, DType::Int64);
  };
  EXPECT_NE(error_of([&] {
              grouped_mm(x0, w0, offs({3, 2, 8, 10}));
            }).find("group 1 ends at 2 after 3"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              grouped_mm(x0, w0, offs({3, 3, 8, 9}));
            }).find("end at 9 but x has 10 rows"),
            std::string::npos);
  EXPECT_NE(error_of([&] { grouped_mm(x0, w0, offs({3, 10})); }).find("offsets must be int64 [4]"), std::string::npos);
  EXPECT_NE(error_of([&] { grouped_mm(x0, w0, offsets.to(DType::Int32)); }).find("got [4] int32"), std::string::npos);
}

// group_order against a sort by (group, position in the input): rows,
// positions and offsets, empty groups and no rows included.
TEST(GroupOrder, StableCountingSort) {
  Generator g(21);
  for (auto [n, k, groups] : {std::tuple<int64_t, int64_t, int64_t>{9, 2, 4}, {1, 3, 5}, {0, 2, 3}, {40, 1, 1}}) {
    const Tensor ids = randint(0, groups, {n, k}, DType::Int64, &g);
    const GroupOrder o = group_order(ids, groups);
    std::vector<std::pair<int64_t, int64_t>> keyed;  // (group, item)
    for (int64_t i = 0; i < n * k; ++i) keyed.emplace_back(ids.data<int64_t>()[i], i);
    std::sort(keyed.begin(), keyed.end());
    const std::string what = cat("n ", n, " k ", k, " groups ", groups);
    ASSERT_EQ(o.rows.numel(), n * k) << what;
    ASSERT_EQ(o.positions.sizes(), (Shape{n, k})) << what;
    for (int64_t at = 0; at < n * k; ++at) {
      EXPECT_EQ(o.rows.data<int64_t>()[at], keyed[at].second / k) << what << " position " << at;
      EXPECT_EQ(o.positions.data<int64_t>()[keyed[at].second], at) << what << " item " << keyed[at].second;
    }
    int64_t end = 0;
    for (int64_t e = 0; e < groups; ++e) {
      for (const auto& [grp, item] : keyed) end += grp == e;
      EXPECT_EQ(o.offsets.data<int64_t>()[e], end) << what << " group " << e;
    }
  }
  EXPECT_NE(error_of([] {
              group_order(Tensor::from_vector({0, 4}, {1, 2}, DType::Int64), 4);
            }).find("group_order: values must be in [0, 4), got [0, 4]"),
            std::string::npos);
  EXPECT_NE(error_of([] { group_order(zeros({3}, {DType::Int64}), 4); }).find("ids must be int64 [rows, choices]"),
            std::string::npos);
}

TEST(GroupedMm, ErrorsNameTheOpAndShapes) {
  const Tensor x = rnd({5, 4}, 1), w = rnd({2, 3, 4}, 2);
  EXPECT_NE(error_of([&] {
              grouped_mm(x, w, {2, 2});
            }).find("sum to 4 rows but x [5,4] has 5"),
            std::string::npos)
      << error_of([&] {
           grouped_mm(x, w, {2, 2});
         });
  EXPECT_NE(error_of([&] { grouped_mm(x, w, {5}); }).find("1 group sizes for w [2,3,4] with 2 groups"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              grouped_mm(x, rnd({2, 3, 5}, 3), {2, 3});
            }).find("inner dimensions 4 and 5"),
            std::string::npos);
  EXPECT_NE(error_of([&] { grouped_mm(x, w, {6, -1}); }).find("group 1 has size -1"), std::string::npos);
}

}  // namespace
}  // namespace ember
