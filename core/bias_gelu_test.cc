// bias_gelu against what it replaces, gelu(linear(x, w, b)): the output and
// the gradients of x, w and b bit for bit on the CPU; on CUDA the output bit
// for bit and the gradients within one rounding (each backend against its
// own composition), 4 dtypes, both GELU forms, widths
// on and off the vector width; CUDA against the CPU
// within the formulas' rounding; the fallback for what the fused op does
// not take. Under the emulation as bias_gelu_emu_test.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "autograd/autograd.h"
#include "core/autocast.h"
#include "core/ops.h"

namespace ember {
namespace {

struct Run {
  Tensor y, dx, dw, db;
};

// y = gelu(linear(x, w, b)) either way, and its gradients for g.
Run run(bool fused, bool tanh_approx, const Tensor& x0, const Tensor& w0, const Tensor& b0, const Tensor& g) {
  Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
  Tensor y = fused ? bias_gelu(linear(x, w), b, tanh_approx) : gelu(linear(x, w, b), tanh_approx);
  y.backward(g);
  return {y.detach(), x.grad(), w.grad(), b.grad()};
}

void expect_bits(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const Tensor ac = a.cpu().contiguous(), bc = b.cpu().contiguous();
  EXPECT_EQ(std::memcmp(ac.raw_data(), bc.raw_data(), ac.nbytes()), 0) << what;
}

// Within one rounding of T (what a different contraction of the same
// formula into fused multiply-adds can move).
void expect_close(const Tensor& a, const Tensor& b, const std::string& what) {
  const DType t = a.dtype();
  const double tol = t == DType::Float64 ? 1e-13 : t == DType::Float32 ? 1e-6 : t == DType::Float16 ? 1e-3 : 8e-3;
  EXPECT_TRUE(allclose(a.cpu(), b.cpu(), tol, tol)) << what;
}

// exact_grads: the gradients bit for bit too (the CPU); on CUDA the same
// gradient formula compiled into two kernels may contract differently.
void check_equal_to_composition(Device dev, bool exact_grads) {
  manual_seed(21);
  for (DType dt : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16})
    for (bool tanh_approx : {true, false})
      for (int64_t out : {int64_t{24}, int64_t{13}}) {
        const std::string what = std::string(dtype_name(dt)) + (tanh_approx ? " tanh " : " erf ") +
                                 std::to_string(out) + " on " + (dev.type == DeviceType::CUDA ? "cuda" : "cpu");
        const Tensor x = randn({3, 5, 16}).to(dt).to(dev), w = (randn({out, 16}) * 0.3).to(dt).to(dev);
        const Tensor b = randn({out}).to(dt).to(dev), g = randn({3, 5, out}).to(dt).to(dev);
        const Run want = run(false, tanh_approx, x, w, b, g), got = run(true, tanh_approx, x, w, b, g);
        expect_bits(got.y, want.y, what + " y");
        for (auto [g, w, name] : {std::tuple{got.dx, want.dx, " dx"}, std::tuple{got.dw, want.dw, " dw"},
                                  std::tuple{got.db, want.db, " db"}}) {
          if (exact_grads)
            expect_bits(g, w, what + name);
          else
            expect_close(g, w, what + name);
        }
      }
}

TEST(BiasGelu, IsLinearThenGeluBitForBit) { check_equal_to_composition(Device(DeviceType::CPU), true); }

TEST(BiasGelu, MatchesTheFormulaInFloat64) {
  manual_seed(22);
  const Tensor x = randn({4, 8}, DType::Float64), b = randn({8}, DType::Float64);
  const std::vector<double> y = bias_gelu(x, b).to_vector(), xv = x.to_vector(), bv = b.to_vector();
  for (size_t i = 0; i < y.size(); ++i) {
    const double t = xv[i] + bv[i % 8];
    EXPECT_NEAR(y[i], 0.5 * t * (1 + std::erf(t / std::sqrt(2.0))), 1e-15) << i;
  }
}

TEST(BiasGelu, FallsBackToTheComposition) {
  manual_seed(23);
  // A bias of another width broadcasts as x + bias would: a [1] bias.
  const Tensor x = randn({2, 6}), b1 = randn({1});
  EXPECT_TRUE(allclose(bias_gelu(x, b1, true), gelu(x + b1, true), 0, 0));
  // Mixed dtypes outside autocast promote as the composition does.
  const Tensor b64 = randn({6}, DType::Float64);
  EXPECT_EQ(bias_gelu(x, b64).dtype(), DType::Float64);
  // Under autocast the float32 bias is cast to bf16, as linear casts it.
  const Tensor xb = randn({2, 6}).to(DType::BFloat16), b = randn({6});
  AutocastGuard amp(DeviceType::CPU, DType::BFloat16);
  EXPECT_EQ(bias_gelu(xb, b).dtype(), DType::BFloat16);
}

class BiasGeluCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_is_available()) GTEST_SKIP() << "no GPU: " << cuda_unavailable_reason();
  }
};

// The composition's linear without cuBLASLt's bias epilogue, which rounds
// the product and the bias once (linear_epilogue_test): bias_gelu's
// contract is with the bias added to the rounded product.
TEST_F(BiasGeluCuda, IsLinearThenGelu) {
  set_cublaslt_epilogues(false);
  check_equal_to_composition(cuda_device(0), false);
  set_cublaslt_epilogues(true);
}

TEST_F(BiasGeluCuda, MatchesTheCpu) {
  manual_seed(24);
  for (DType dt : {DType::Float32, DType::BFloat16})
    for (bool tanh_approx : {true, false})
      for (int64_t cols : {int64_t{32}, int64_t{13}}) {  // vectors, and the scalar path
        const std::string what = std::string(dtype_name(dt)) + " " + std::to_string(cols);
        const Tensor x = randn({7, cols}).to(dt), b = randn({cols}).to(dt), g = randn({7, cols}).to(dt);
        Tensor xc = x.clone().requires_grad_(), xg = x.cuda().requires_grad_();
        Tensor bc = b.clone().requires_grad_(), bg = b.cuda().requires_grad_();
        Tensor yc = bias_gelu(xc, bc, tanh_approx), yg = bias_gelu(xg, bg, tanh_approx);
        yc.backward(g);
        yg.backward(g.cuda());
        // CUDA's tanhf against the CPU's polynomial (elementwise_fns.h).
        const double tol = dt == DType::BFloat16 ? 1.6e-2 : 2e-6;
        EXPECT_TRUE(allclose(yg.cpu(), yc, tol, tol)) << what;
        EXPECT_TRUE(allclose(xg.grad().cpu(), xc.grad(), tol, tol)) << what;
        EXPECT_TRUE(allclose(bg.grad().cpu(), bc.grad(), tol, tol)) << what;
      }
}

}  // namespace
}  // namespace ember
