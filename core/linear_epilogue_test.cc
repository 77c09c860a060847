// linear's bias and linear_gelu's bias and tanh GELU in cuBLASLt's epilogue
// (matmul.cu's gemm_epilogue_cuda): forward and gradients against float64
// references computed on the CPU from the same rounded inputs, against the
// separate ops within one rounding, the epilogue counted as taken (or
// declined), and every path that must not take it: the CPU (linear_gelu
// equal to linear then bias_gelu bit for bit), erf's GELU, widths the aux
// matrix cannot have, the switch off, an activation checkpoint region, a
// heuristic without an algorithm (the emulation's knob). Under the
// emulation as linear_epilogue_emu_test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/checkpoint.h"
#include "core/autocast.h"
#include "core/ops.h"
#include "core/ops/kernels.h"
#include "core/profiler.h"
#include "core/testing/error_of.h"

namespace ember {
namespace {

struct Grads {
  Tensor y, dx, dw, db;
};

// y = f(x, w, b) and its gradients for g, on the inputs' device.
template <typename F>
Grads run(F&& f, const Tensor& x0, const Tensor& w0, const Tensor& b0, const Tensor& g) {
  Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
  Tensor y = f(x, w, b);
  y.backward(g);
  return {y.detach(), x.grad(), w.grad(), b.grad()};
}

double gelu_tanh(double t) { return 0.5 * t * (1 + std::tanh(0.7978845608028654 * (t + 0.044715 * t * t * t))); }
double gelu_tanh_grad(double t) {
  const double u = 0.7978845608028654 * (t + 0.044715 * t * t * t), th = std::tanh(u);
  return 0.5 * (1 + th) + 0.5 * t * (1 - th * th) * 0.7978845608028654 * (1 + 3 * 0.044715 * t * t);
}

// The float64 reference from the same (rounded) inputs: y = act(x W^T + b)
// and its gradients for g, with act the identity or tanh's GELU.
Grads reference(bool gelu, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& g) {
  const Tensor x64 = x.cpu().to(DType::Float64).reshape({-1, x.size(-1)}), w64 = w.cpu().to(DType::Float64);
  const Tensor b64 = b.cpu().to(DType::Float64), g64 = g.cpu().to(DType::Float64).reshape({x64.size(0), -1});
  const Tensor h = matmul(x64, w64.t()) + b64;
  Tensor y = h, dh = g64;
  if (gelu) {
    std::vector<double> hv = h.to_vector(), gv = g64.to_vector(), yv(hv.size()), dv(hv.size());
    for (size_t i = 0; i < hv.size(); ++i) yv[i] = gelu_tanh(hv[i]), dv[i] = gv[i] * gelu_tanh_grad(hv[i]);
    y = Tensor::from_vector(yv, h.sizes(), DType::Float64);
    dh = Tensor::from_vector(dv, h.sizes(), DType::Float64);
  }
  return {y.reshape(g.sizes()), matmul(dh, w64).reshape(x.sizes()), matmul(dh.t(), x64), sum(dh, {0})};
}

double tolerance(DType t) { return t == DType::Float32 ? 2e-5 : t == DType::Float16 ? 4e-3 : 2e-2; }

void expect_near(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const Tensor w64 = want.cpu().to(DType::Float64);
  const double miss = max(abs(got.cpu().to(DType::Float64) - w64)).item();
  const double scale = std::max(1.0, max(abs(w64)).item());
  EXPECT_LE(miss, tol * scale) << what;
}

void expect_bits(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const Tensor ac = a.cpu().contiguous(), bc = b.cpu().contiguous();
  EXPECT_EQ(std::memcmp(ac.raw_data(), bc.raw_data(), ac.nbytes()), 0) << what;
}

Tensor plain_linear_gelu(const Tensor& x, const Tensor& w, const Tensor& b, bool tanh_approx) {
  return bias_gelu(linear(x, w), b, tanh_approx);
}

TEST(LinearGelu, IsLinearThenBiasGeluOnTheCpu) {
  manual_seed(31);
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Float64})
    for (bool tanh_approx : {true, false}) {
      const Tensor x = randn({2, 3, 16}).to(dt), w = (randn({24, 16}) * 0.3).to(dt), b = randn({24}).to(dt);
      const Tensor g = randn({2, 3, 24}).to(dt);
      auto fused = [&](const Tensor& x, const Tensor& w, const Tensor& b) { return linear_gelu(x, w, b, tanh_approx); };
      auto plain = [&](const Tensor& x, const Tensor& w, const Tensor& b) {
        return plain_linear_gelu(x, w, b, tanh_approx);
      };
      const Grads got = run(fused, x, w, b, g), want = run(plain, x, w, b, g);
      const std::string what = std::string(dtype_name(dt)) + (tanh_approx ? " tanh" : " erf");
      expect_bits(got.y, want.y, what + " y");
      expect_bits(got.dx, want.dx, what + " dx");
      expect_bits(got.dw, want.dw, what + " dw");
      expect_bits(got.db, want.db, what + " db");
    }
}

TEST(LinearGelu, NamesBadInput) {
  const Tensor x = randn({4, 8}), w = randn({6, 8}), b = randn({6});
  EXPECT_NE(testing::error_of([&] { linear_gelu(x, w, Tensor(), true); }).find("linear_gelu: needs a bias"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] {
              linear_gelu(randn({4, 7}), w, b, true);
            }).find("linear_gelu: input [4,7] has last dim 7 but weight [6,8] expects 8"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] {
              linear_gelu(x, w, randn({5}), true);
            }).find("linear_gelu: bias [5] does not match weight [6,8]"),
            std::string::npos);
}

class LinearEpilogueCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_is_available()) GTEST_SKIP() << "no GPU: " << cuda_unavailable_reason();
    set_cublaslt_epilogues(true);
  }
  void TearDown() override { set_cublaslt_epilogues(true); }
};

struct Counts {
  int64_t fused, declined;
};
Counts since(const GemmEpilogueStats& s0) {
  const GemmEpilogueStats s = gemm_epilogue_stats();
  return {static_cast<int64_t>(s.fused - s0.fused), static_cast<int64_t>(s.declined - s0.declined)};
}

// Forward and backward through the epilogues: against float64, against the
// separate ops within one rounding, and two epilogue calls (forward, and
// the weight gradient's with the bias's).
void check_fused(bool gelu, DType dt, int64_t in, int64_t out, const std::string& what) {
  const Tensor x = randn({3, 5, in}).to(dt), w = (randn({out, in}) * 0.3).to(dt), b = randn({out}).to(dt);
  const Tensor g = randn({3, 5, out}).to(dt);
  auto op = [&](const Tensor& x, const Tensor& w, const Tensor& b) {
    return gelu ? linear_gelu(x, w, b, true) : linear(x, w, b);
  };
  const GemmEpilogueStats s0 = gemm_epilogue_stats();
  const Grads got = run(op, x.cuda(), w.cuda(), b.cuda(), g.cuda());
  const Counts c = since(s0);
  // The forward's epilogue and the weight gradient's. The emulation takes
  // both; a GPU's cuBLASLt may have no algorithm for a problem (then the
  // separate ops run, and the log says which).
  if (cuda_device_name(0) == "CUDA emulation") {
    EXPECT_EQ(c.fused, 2) << what;
  } else {
    EXPECT_EQ(c.fused + c.declined, 2) << what;
    std::printf("[epilogues] %s: %lld fused, %lld declined\n", what.c_str(), static_cast<long long>(c.fused),
                static_cast<long long>(c.declined));
  }
  const Grads want = reference(gelu, x, w, b, g);
  const double tol = tolerance(dt);
  expect_near(got.y, want.y, tol, what + " y");
  expect_near(got.dx, want.dx, tol, what + " dx");
  expect_near(got.dw, want.dw, tol, what + " dw");
  expect_near(got.db, want.db, tol, what + " db");
  // The separate ops round the product before the bias: one rounding apart.
  set_cublaslt_epilogues(false);
  auto plain = [&](const Tensor& x, const Tensor& w, const Tensor& b) {
    return gelu ? plain_linear_gelu(x, w, b, true) : linear(x, w, b);
  };
  const GemmEpilogueStats s1 = gemm_epilogue_stats();
  const Grads sep = run(plain, x.cuda(), w.cuda(), b.cuda(), g.cuda());
  EXPECT_EQ(since(s1).fused, 0) << what << ": switched off";
  set_cublaslt_epilogues(true);
  expect_near(got.y, sep.y, tol, what + " y against the separate ops");
  expect_near(got.db, sep.db, tol, what + " db against the separate ops");
}

TEST_F(LinearEpilogueCuda, LinearBiasMatchesFloat64) {
  manual_seed(32);
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16})
    for (auto [in, out] : {std::pair<int64_t, int64_t>{16, 24}, {12, 13}})  // widths off any vector too
      check_fused(false, dt, in, out, std::string("linear ") + dtype_name(dt) + " " + std::to_string(out));
}

TEST_F(LinearEpilogueCuda, LinearGeluMatchesFloat64) {
  manual_seed(33);
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16})
    check_fused(true, dt, 16, 24, std::string("linear_gelu ") + dtype_name(dt));
}

// The bias joins the float32 sum before the one rounding: each fused
// element is the float64 value's rounding to bf16 (half a unit in the last
// place, and a hair for the float32 sum). The separate ops round the
// product first, then the sum with a small bias: some element misses by
// more.
TEST_F(LinearEpilogueCuda, BiasRoundsOnceWithTheProduct) {
  manual_seed(34);
  const Tensor x = (randn({64, 32}) * 3).to(DType::BFloat16), w = (randn({48, 32}) * 3).to(DType::BFloat16);
  const Tensor b = (randn({48}) * 0.5).to(DType::BFloat16);
  const std::vector<double> want =
      (matmul(x.to(DType::Float64), w.to(DType::Float64).t()) + b.to(DType::Float64)).to_vector();
  const std::vector<double> got = linear(x.cuda(), w.cuda(), b.cuda()).cpu().to(DType::Float64).to_vector();
  set_cublaslt_epilogues(false);
  const std::vector<double> sep = linear(x.cuda(), w.cuda(), b.cuda()).cpu().to(DType::Float64).to_vector();
  set_cublaslt_epilogues(true);
  // Each element's float32 sum may be off by k eps32 sum |x||w| before the
  // rounding (a GPU's summation order; the emulation sums in double).
  const std::vector<double> mag = matmul(abs(x.to(DType::Float64)), abs(w.to(DType::Float64)).t()).to_vector();
  double worst_fused = 0;  // the excess over half a unit in the last place of bf16, in units
  int sep_beyond = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] == 0) continue;
    const double ulp = std::ldexp(1.0, static_cast<int>(std::floor(std::log2(std::fabs(want[i])))) - 7);
    const double allowed = 0.5 + 32 * std::ldexp(1.0, -24) * (mag[i] + std::fabs(want[i])) / ulp;
    worst_fused = std::max(worst_fused, std::fabs(got[i] - want[i]) / ulp - allowed);
    sep_beyond += std::fabs(sep[i] - want[i]) / ulp > allowed;
  }
  EXPECT_LE(worst_fused, 0.0);
  EXPECT_GT(sep_beyond, 0) << "the product rounded alone first";
}

// A plan is built once per problem and kept: each call must hand it its
// own bias, aux matrix and bias gradient, not the first call's.
TEST_F(LinearEpilogueCuda, AReusedPlanTakesEachCallsVectors) {
  manual_seed(38);
  const DType dt = DType::Float32;
  const Tensor x = randn({6, 16}), w = randn({24, 16}) * 0.3;
  const Tensor b1 = randn({24}), b2 = randn({24}), g1 = randn({6, 24}), g2 = randn({6, 24});
  auto op = [&](const Tensor& x, const Tensor& w, const Tensor& b) { return linear_gelu(x, w, b, true); };
  auto lin = [&](const Tensor& x, const Tensor& w, const Tensor& b) { return linear(x, w, b); };
  for (bool gelu : {false, true}) {
    // Both forwards before either backward: the first backward reads its
    // own call's aux matrix after the second call has run.
    Tensor xa = x.cuda().requires_grad_(), xb = x.cuda().requires_grad_();
    Tensor wa = w.cuda().requires_grad_(), wb = w.cuda().requires_grad_();
    Tensor ba = b1.cuda().requires_grad_(), bb = b2.cuda().requires_grad_();
    Tensor ya = gelu ? op(xa, wa, ba) : lin(xa, wa, ba), yb = gelu ? op(xb, wb, bb) : lin(xb, wb, bb);
    ya.backward(g1.cuda());
    yb.backward(g2.cuda());
    const std::string what = gelu ? "linear_gelu" : "linear";
    const Grads want_a = reference(gelu, x, w, b1, g1), want_b = reference(gelu, x, w, b2, g2);
    expect_near(ya, want_a.y, tolerance(dt), what + " first y");
    expect_near(yb, want_b.y, tolerance(dt), what + " second y");
    expect_near(xa.grad(), want_a.dx, tolerance(dt), what + " first dx");
    expect_near(ba.grad(), want_a.db, tolerance(dt), what + " first db");
    expect_near(bb.grad(), want_b.db, tolerance(dt), what + " second db");
  }
}

// A plan is chosen for the alignments of the vectors it was asked with: a
// bias at an odd offset (a view into a flat buffer) after an aligned one of
// the same shape gets a plan of its own, not one that assumes 256 bytes.
TEST_F(LinearEpilogueCuda, ABiasViewOfLessAlignment) {
  manual_seed(39);
  const Tensor x = randn({5, 16}).to(DType::BFloat16), w = (randn({24, 16}) * 0.3).to(DType::BFloat16);
  const Tensor flat = randn({25}).to(DType::BFloat16), aligned = randn({24}).to(DType::BFloat16);
  const Tensor g = randn({5, 24}).to(DType::BFloat16);
  auto lin = [](const Tensor& x, const Tensor& w, const Tensor& b) { return linear(x, w, b); };
  auto op = [](const Tensor& x, const Tensor& w, const Tensor& b) { return linear_gelu(x, w, b, true); };
  for (bool gelu : {false, true}) {
    run(gelu ? op : lin, x.cuda(), w.cuda(), aligned.cuda(), g.cuda());
    const Tensor flat_cuda = flat.cuda(), view = flat_cuda.narrow(0, 1, 24);  // 2 bytes past the buffer's start
    Tensor xv = x.cuda().requires_grad_(), wv = w.cuda().requires_grad_();
    Tensor y = gelu ? linear_gelu(xv, wv, view, true) : linear(xv, wv, view);
    y.backward(g.cuda());
    const Grads want = reference(gelu, x, w, flat.narrow(0, 1, 24), g);
    expect_near(y, want.y, tolerance(DType::BFloat16), gelu ? "linear_gelu y" : "linear y");
    expect_near(xv.grad(), want.dx, tolerance(DType::BFloat16), gelu ? "linear_gelu dx" : "linear dx");
  }
}

// Without a backward to come nothing keeps the sum before GELU: one
// GELU_BIAS call. Then the same shapes with a backward: the plan cache
// must not hand that call GELU_BIAS's plan (the key tells the two apart by
// the aux matrix), or the kept sum, and so every gradient, would be wrong.
TEST_F(LinearEpilogueCuda, NoGradKeepsNoAux) {
  manual_seed(40);
  const Tensor x = randn({3, 16}), w = randn({24, 16}) * 0.3, b = randn({24});
  const GemmEpilogueStats s0 = gemm_epilogue_stats();
  Tensor y;
  {
    NoGradGuard no_grad;
    y = linear_gelu(x.cuda(), w.cuda(), b.cuda(), true);
  }
  const Counts c = since(s0);
  EXPECT_EQ(c.fused + c.declined, 1);
  const Tensor g = randn({3, 24});
  const Grads want = reference(true, x, w, b, g);
  expect_near(y, want.y, tolerance(DType::Float32), "y");
  const Grads got = run([](const Tensor& x, const Tensor& w, const Tensor& b) { return linear_gelu(x, w, b, true); },
                        x.cuda(), w.cuda(), b.cuda(), g.cuda());
  expect_near(got.y, want.y, tolerance(DType::Float32), "y with a backward");
  expect_near(got.dx, want.dx, tolerance(DType::Float32), "dx after a GELU_BIAS call of the same shapes");
  expect_near(got.dw, want.dw, tolerance(DType::Float32), "dw after a GELU_BIAS call of the same shapes");
}

// A zero-bubble pipeline's split backward asks linear_gelu for dx first
// (backward_input) and for dW and db later (run()): GELU's gradient pass
// runs once, kept between the two calls, and the gradients are one
// backward's bit for bit. A mutant that computes it in each call fails the
// count.
TEST_F(LinearEpilogueCuda, SplitBackwardRunsGeluBackwardOnce) {
  manual_seed(41);
  const Tensor x0 = randn({3, 16}).cuda(), w0 = (randn({24, 16}) * 0.3).cuda(), b0 = randn({24}).cuda();
  const Tensor g = randn({3, 24}).cuda();
  auto op = [](const Tensor& x, const Tensor& w, const Tensor& b) { return linear_gelu(x, w, b, true); };
  const Grads whole = run(op, x0, w0, b0, g);
  for (bool split : {false, true}) {
    const std::string what = split ? "split" : "whole";
    Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
    const GemmEpilogueStats s0 = gemm_epilogue_stats();
    Tensor y = op(x, w, b);
    profiler::start();
    if (split) {
      autograd::DeferredBackward rest = autograd::backward_input(y, g, {x});
      EXPECT_EQ(rest.split_ops(), 1);
      EXPECT_TRUE(x.grad().defined());
      EXPECT_FALSE(w.grad().defined() || b.grad().defined());
      rest.run();
    } else {
      y.backward(g);
    }
    profiler::stop();
    int passes = 0;
    for (const auto& e : profiler::events()) passes += e.name == "gelu_backward";
    EXPECT_EQ(passes, 1) << what;
    if (cuda_device_name(0) == "CUDA emulation") EXPECT_EQ(since(s0).fused, 2) << what;
    expect_bits(x.grad(), whole.dx, what + " dx");
    expect_bits(w.grad(), whole.dw, what + " dw");
    expect_bits(b.grad(), whole.db, what + " db");
  }
}

// A split left unfinished (its DeferredBackward dropped without run())
// and then a backward through the op with another gradient: a named error,
// where the GELU gradient kept from the first would give this backward the
// first one's values.
TEST_F(LinearEpilogueCuda, AnUnfinishedSplitIsNamed) {
  manual_seed(42);
  Tensor x = randn({3, 16}).cuda().requires_grad_(), w = (randn({24, 16}) * 0.3).cuda().requires_grad_();
  Tensor b = randn({24}).cuda().requires_grad_();
  Tensor h = linear_gelu(x, w, b, true);
  { autograd::DeferredBackward dropped = autograd::backward_input(sum(h * 2.0), Tensor(), {x}); }
  EXPECT_NE(
      testing::error_of([&] { sum(h * 3.0).backward(); }).find("linear_gelu: backward through a node whose split"),
      std::string::npos);
}

TEST_F(LinearEpilogueCuda, PathsWithoutTheEpilogue) {
  manual_seed(35);
  const Tensor x = randn({4, 16}).cuda(), b24 = randn({24}).cuda(), w24 = randn({24, 16}).cuda();
  const Tensor b13 = randn({13}).cuda(), w13 = randn({13, 16}).cuda();
  auto fused_calls = [](auto&& f) {
    const GemmEpilogueStats s0 = gemm_epilogue_stats();
    f();
    return since(s0).fused;
  };
  // erf's GELU: the product's bias-free GEMM, then bias_gelu.
  EXPECT_EQ(fused_calls([&] { linear_gelu(x, w24, b24, false); }), 0);
  EXPECT_TRUE(allclose(linear_gelu(x, w24, b24, false), bias_gelu(linear(x, w24), b24), 0, 0));
  // 13 columns: no aux matrix of a leading dimension a multiple of 8.
  EXPECT_EQ(fused_calls([&] { linear_gelu(x, w13, b13, true); }), 0);
  EXPECT_EQ(fused_calls([&] { linear_gelu(x, w24, b24, true); }), 1);
  // float64 has no epilogue here: the separate ops.
  EXPECT_EQ(fused_calls([&] { linear(x.to(DType::Float64), w24.to(DType::Float64), b24.to(DType::Float64)); }), 0);
  // Inside an activation checkpoint region linear keeps its name (the
  // policies keep "linear"), so the fused GELU is not taken: a linear
  // without bias, then bias_gelu.
  const Tensor xr = x.clone().requires_grad_();
  const int64_t in_region =
      fused_calls([&] { autograd::checkpoint([&](const Tensor& t) { return linear_gelu(t, w24, b24, true); }, xr); });
  EXPECT_EQ(in_region, 0) << "linear without bias, then bias_gelu";
}

// The heuristic may have no algorithm for a problem: the same values by the
// separate ops, counted as declined. The emulation's knob plays that answer.
TEST_F(LinearEpilogueCuda, DeclinedByTheHeuristic) {
  if (cuda_device_name(0) != "CUDA emulation") GTEST_SKIP() << "the decline is the emulation's knob";
  manual_seed(36);
  const DType dt = DType::BFloat16;
  const Tensor x = randn({2, 7, 40}).to(dt), w = (randn({56, 40}) * 0.3).to(dt), b = randn({56}).to(dt);
  const Tensor g = randn({2, 7, 56}).to(dt);
  ASSERT_EQ(setenv("EMU_CUBLASLT_DECLINE_EPILOGUES", "1", 1), 0);
  const GemmEpilogueStats s0 = gemm_epilogue_stats();
  auto op = [&](const Tensor& x, const Tensor& w, const Tensor& b) { return linear_gelu(x, w, b, true); };
  const Grads got = run(op, x.cuda(), w.cuda(), b.cuda(), g.cuda());
  const Grads lin = run([](const Tensor& x, const Tensor& w, const Tensor& b) { return linear(x, w, b); }, x.cuda(),
                        w.cuda(), b.cuda(), g.cuda());
  unsetenv("EMU_CUBLASLT_DECLINE_EPILOGUES");
  const Counts c = since(s0);
  EXPECT_EQ(c.fused, 0);
  // linear_gelu's GELU and then its bias, the weight gradient's; linear's
  // bias and weight gradient's.
  EXPECT_EQ(c.declined, 5);
  const Grads want = reference(true, x, w, b, g), want_lin = reference(false, x, w, b, g);
  for (auto [r, ref, name] : {std::tuple{got, want, "linear_gelu"}, std::tuple{lin, want_lin, "linear"}}) {
    expect_near(r.y, ref.y, tolerance(dt), std::string(name) + " y");
    expect_near(r.dx, ref.dx, tolerance(dt), std::string(name) + " dx");
    expect_near(r.dw, ref.dw, tolerance(dt), std::string(name) + " dw");
    expect_near(r.db, ref.db, tolerance(dt), std::string(name) + " db");
  }
}

TEST_F(LinearEpilogueCuda, UnderAutocast) {
  manual_seed(37);
  const Tensor x = randn({4, 16}).cuda(), w = randn({24, 16}).cuda().requires_grad_();
  const Tensor b = randn({24}).cuda().requires_grad_();
  Tensor y;
  {
    AutocastGuard amp(DeviceType::CUDA, DType::BFloat16);
    y = linear_gelu(x, w, b, true);
  }
  EXPECT_EQ(y.dtype(), DType::BFloat16);
  sum(y).backward();
  EXPECT_EQ(w.grad().dtype(), DType::Float32) << "the parameter's gradient in its own dtype";
  EXPECT_EQ(b.grad().dtype(), DType::Float32);
}

}  // namespace
}  // namespace ember
