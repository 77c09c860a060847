// Autocast (core/autocast.h) end to end, on the CPU and, where a GPU or the
// emulation (autocast_emu_test) is present, on CUDA: the dtype every op of
// the policy produces (low precision for matmul/linear/conv, float32 for
// softmax, exp, log, pow, reductions, the losses and layer_norm, promotion
// for mixed inputs, batch_norm's float32 statistics); nesting and disabling;
// the per-scope cast cache; gradients in each parameter's dtype that match
// float32 training within a stated tolerance on an MLP and a conv net; and
// backward called inside the scope running as if outside it.
#include <gmock/gmock.h>
#include <cmath>
#include <memory>
#include <sstream>
#include <gtest/gtest.h>

#include "autograd/autograd.h"
#include "core/autocast.h"
#include "core/ops.h"
#include "core/ops_nn.h"
#include "nn/functional.h"
#include "nn/layers.h"

namespace ember {
namespace {

using ::testing::HasSubstr;

struct Target {
  Device device;
  DType low;
};

std::vector<Target> targets() {
  std::vector<Target> t = {{kCPU, DType::BFloat16}, {kCPU, DType::Float16}};
  if (cuda_is_available()) {
    t.push_back({cuda_device(0), DType::Float16});
    t.push_back({cuda_device(0), DType::BFloat16});
  }
  return t;
}

std::string label(const Target& t) {
  std::ostringstream os;
  os << t.device << " " << dtype_name(t.low);
  return os.str();
}

TEST(Autocast, EveryOpOfThePolicyProducesItsDtype) {
  for (const Target& t : targets()) {
    SCOPED_TRACE(label(t));
    const TensorOptions f32{DType::Float32, t.device};
    Tensor a = randn({4, 8}, f32), b = randn({8, 3}, f32), w = randn({3, 8}, f32), bias = randn({3}, f32);
    Tensor img = randn({2, 3, 6, 6}, f32), k = randn({4, 3, 3, 3}, f32);
    Tensor half = a.to(t.low);
    AutocastGuard amp(t.device.type, t.low);
    EXPECT_EQ(matmul(a, b).dtype(), t.low);
    EXPECT_EQ(mm(a, b).dtype(), t.low);
    EXPECT_EQ(bmm(a.unsqueeze(0), b.unsqueeze(0)).dtype(), t.low);
    EXPECT_EQ(linear(a, w, bias).dtype(), t.low);
    EXPECT_EQ(conv2d(img, k).dtype(), t.low);
    // On CUDA autocast also moves convolutions to channels-last (cuDNN's
    // tensor-core layout), and the layout carries through the next conv.
    const MemoryFormat want_layout = t.device.is_cuda() ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous;
    EXPECT_EQ(conv2d(img, k).suggest_memory_format(), want_layout);
    EXPECT_EQ(conv2d(relu(conv2d(img, k, Tensor(), {1, 1}, {1, 1})), randn({2, 4, 1, 1}, f32)).suggest_memory_format(),
              want_layout);
    for (const Tensor& r : {softmax(half, 1), log_softmax(half, 1), exp(half), log(abs(half) + 1.0), pow(half, 2.0),
                            pow(half, half), sum(half), mean(half)})
      EXPECT_EQ(r.dtype(), DType::Float32);
    EXPECT_EQ((half + a).dtype(), DType::Float32) << "mixed inputs promote to the widest";
    EXPECT_EQ((half * 2.0).dtype(), t.low) << "ops outside the lists keep their input's dtype";
    Tensor target = Tensor::from_vector({0, 2, 1, 0}, {4}, {DType::Int64, t.device});
    Tensor logits = linear(a, w, bias);  // low precision
    EXPECT_EQ(nn::functional::cross_entropy(logits, target).dtype(), DType::Float32);
    EXPECT_EQ(nn::functional::nll_loss(log_softmax(logits, 1), target).dtype(), DType::Float32);
    EXPECT_EQ(nn::functional::mse_loss(logits, logits.detach()).dtype(), DType::Float32);
    EXPECT_EQ(nn::functional::layer_norm(half, 1, Tensor(), Tensor(), 1e-5).dtype(), DType::Float32);
    // batch_norm: the input's dtype out, float32 statistics and running stats.
    nn::BatchNorm2d bn(3);
    bn.to(t.device);
    Tensor y = bn(img.to(t.low));
    EXPECT_EQ(y.dtype(), t.low);
    EXPECT_EQ(bn.running_mean.dtype(), DType::Float32);
    EXPECT_GT(max(abs(bn.running_mean)).item(), 0.0) << "the running stats were updated";
    // A float64 input is left alone, as in torch; integers too.
    EXPECT_EQ(matmul(a.to(DType::Float64), b.to(DType::Float64)).dtype(), DType::Float64);
  }
}

TEST(Autocast, NestsDisablesAndLeavesOtherDevicesAlone) {
  Tensor a = randn({2, 2}), b = randn({2, 2});
  EXPECT_EQ(matmul(a, b).dtype(), DType::Float32);
  {
    AutocastGuard amp(DeviceType::CPU, DType::BFloat16);
    EXPECT_TRUE(autocast_enabled(DeviceType::CPU));
    EXPECT_FALSE(autocast_enabled(DeviceType::CUDA));
    {
      AutocastGuard off(DeviceType::CPU, DType::BFloat16, false);
      EXPECT_EQ(matmul(a, b).dtype(), DType::Float32);
      {
        AutocastGuard fp16(DeviceType::CPU, DType::Float16);
        EXPECT_EQ(matmul(a, b).dtype(), DType::Float16);
      }
    }
    EXPECT_EQ(matmul(a, b).dtype(), DType::BFloat16);
    AutocastGuard cuda_only(DeviceType::CUDA, DType::Float16);
    EXPECT_EQ(matmul(a, b).dtype(), DType::BFloat16) << "a CUDA guard does not change CPU ops";
  }
  EXPECT_FALSE(autocast_enabled(DeviceType::CPU));
  EXPECT_EQ(matmul(a, b).dtype(), DType::Float32);
}

TEST(Autocast, AParameterIsCastOncePerScope) {
  Tensor w = randn({4, 4}).requires_grad_();
  Tensor x = randn({2, 4});
  {
    AutocastGuard amp(DeviceType::CPU, DType::BFloat16);
    EXPECT_EQ(autocast::cached_casts(), 0);
    Tensor y1 = linear(x, w), y2 = linear(y1.to(DType::Float32), w);
    EXPECT_EQ(autocast::cached_casts(), 1) << "w used twice, cast once; x (no grad) is not cached";
    EXPECT_TRUE(autocast::low(w).is_same(autocast::low(w)));
    sum(y2).backward();
    EXPECT_EQ(w.grad().dtype(), DType::Float32) << "the gradient arrives in the parameter's dtype";
  }
  EXPECT_EQ(autocast::cached_casts(), 0) << "the cache ends with the outermost scope";
}

// The cast cache's value depends on the parameter's data (Note [caches]):
// inside one live scope (an outer guard around a training loop keeps it
// alive across steps), a parameter updated in place, or given new storage
// by set_data -- freed and reallocated at the same address where the CPU
// allocator's cache hands it back -- gets a fresh cast. Each check fails
// on a cache keyed by the TensorImpl alone.
TEST(Autocast, TheCastCacheFollowsTheParametersData) {
  const Shape ws = {256, 256};  // 256 KiB: the CPU allocator's cached sizes
  Tensor w = randn(ws).requires_grad_();
  Tensor x = randn({2, 256});
  auto fresh = [&](const Tensor& weight) { return linear(x.to(DType::BFloat16), weight.detach().to(DType::BFloat16)); };
  AutocastGuard outer(DeviceType::CPU, DType::BFloat16);
  Tensor y1 = linear(x, w);
  EXPECT_TRUE(allclose(y1, fresh(w), 0, 0));
  {
    NoGradGuard g;
    add_(w, ones(ws), 1.0);  // an optimizer step's in-place update
  }
  EXPECT_TRUE(allclose(linear(x, w), fresh(w), 0, 0)) << "a stale cast served after an in-place update";
  // New storage at (likely) the same address: the old block goes back to
  // the allocator's cache and the next tensor of its size takes it.
  const void* before = w.raw_data();
  w.set_data(zeros({1}));
  Tensor next = randn(ws);
  w.set_data(next);
  if (w.raw_data() != before) std::printf("(the new storage landed elsewhere; the check holds either way)\n");
  EXPECT_TRUE(allclose(linear(x, w), fresh(next), 0, 0)) << "a stale cast served after set_data";
}

// A cast made under no_grad has no graph; the next forward in the same
// scope that records one must make its own, or the parameter gets no
// gradient (an evaluation pass inside the training loop's scope).
TEST(Autocast, ACastMadeUnderNoGradIsNotServedToAGradForward) {
  Tensor w = randn({8, 4}).requires_grad_(), x = randn({2, 4});
  AutocastGuard amp(DeviceType::CPU, DType::BFloat16);
  {
    NoGradGuard g;
    linear(x, w);
  }
  sum(linear(x, w)).backward();
  ASSERT_TRUE(w.grad().defined()) << "a no-grad cast served to a forward that records a graph";
  // d sum(x w^T) / dw[o, i] = sum_n x[n, i], x rounded to bfloat16.
  const Tensor want = sum(x.to(DType::BFloat16).to(DType::Float32), {0}, true).expand({8, 4});
  EXPECT_TRUE(allclose(w.grad(), want, 1e-2, 1e-2)) << w.grad();
}

TEST(Autocast, ANonHalfDtypeIsANamedError) {
  for (DType bad : {DType::Float32, DType::Float64, DType::Int32}) {
    try {
      AutocastGuard amp(DeviceType::CPU, bad);
      FAIL() << "accepted " << dtype_name(bad);
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(std::string("dtype ") + dtype_name(bad) + " is not a low-precision"));
    }
  }
  AutocastGuard off(DeviceType::CPU, DType::Float32, false);  // disabling needs no half type
}

// Gradients of a model trained under autocast against float32: the same
// parameters, the same batch. Tolerances (max-norm error relative to the
// gradient's largest entry): float16 (11-bit mantissa) 5e-3 everywhere;
// bfloat16 (8 bits) 1e-2 on the MLP, and on the conv net 0.2 with a cosine
// similarity above 0.99: there bf16's rounding moves some pre-activations
// near zero across the ReLU's threshold, which moves whole terms of the
// conv gradients (measured: 0.15 on the conv weight with the ReLU, 5e-3
// without it, float16 6e-4 either way).
double rel_err(const Tensor& got, const Tensor& want) {
  return max(abs(got.to(DType::Float64) - want.to(DType::Float64))).item() /
         std::max(max(abs(want.to(DType::Float64))).item(), 1e-12);
}

double cosine(const Tensor& a, const Tensor& b) {
  Tensor x = a.to(DType::Float64).flatten(), y = b.to(DType::Float64).flatten();
  return sum(x * y).item() / std::sqrt(sum(x * x).item() * sum(y * y).item());
}

void compare_grads(nn::Module& model, const Tensor& x, const Tensor& y, const Target& t, double tol, double min_cos) {
  auto grads = [&](bool amp) {
    for (auto& p : model.parameters()) p.set_grad(Tensor());
    {
      std::unique_ptr<AutocastGuard> g;
      if (amp) g = std::make_unique<AutocastGuard>(t.device.type, t.low);
      Tensor loss = nn::functional::cross_entropy(model(x), y);
      EXPECT_EQ(loss.dtype(), DType::Float32);
      loss.backward();  // inside the scope on purpose: backward ignores autocast
    }
    std::vector<Tensor> out;
    for (auto& p : model.parameters()) {
      EXPECT_EQ(p.grad().dtype(), DType::Float32);
      out.push_back(p.grad().clone());
    }
    return out;
  };
  auto ref = grads(false), amp = grads(true);
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_LT(rel_err(amp[i], ref[i]), tol) << "parameter " << i;
    EXPECT_GT(cosine(amp[i], ref[i]), min_cos) << "parameter " << i;
  }
}

TEST(Autocast, MlpAndConvNetGradientsMatchFloat32WithinTolerance) {
  for (const Target& t : targets()) {
    SCOPED_TRACE(label(t));
    const bool bf16 = t.low == DType::BFloat16;
    manual_seed(5);
    nn::Sequential mlp({std::make_shared<nn::Linear>(16, 32), std::make_shared<nn::ReLU>(),
                        std::make_shared<nn::Linear>(32, 5)});
    mlp.to(t.device);
    Tensor x = randn({8, 16}, {DType::Float32, t.device});
    Tensor y = Tensor::from_vector({0, 1, 2, 3, 4, 0, 1, 2}, {8}, {DType::Int64, t.device});
    compare_grads(mlp, x, y, t, bf16 ? 1e-2 : 5e-3, 0.9999);
    nn::Sequential cnn({std::make_shared<nn::Conv2d>(3, 8, 3, 1, 1), std::make_shared<nn::BatchNorm2d>(8),
                        std::make_shared<nn::ReLU>(), std::make_shared<nn::Flatten>(),
                        std::make_shared<nn::Linear>(8 * 6 * 6, 5)});
    cnn.to(t.device);
    cnn.eval();  // fixed statistics: both runs normalise the same way
    Tensor img = randn({8, 3, 6, 6}, {DType::Float32, t.device});
    compare_grads(cnn, img, y, t, bf16 ? 0.2 : 5e-3, bf16 ? 0.99 : 0.99999);
  }
}

}  // namespace
}  // namespace ember
