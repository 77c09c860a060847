// nn: module bookkeeping (names, order, state dicts and their errors, to(),
// train/eval), every layer's forward against hand-computed or float64
// reference values, backward through the gradient checker, and the models'
// torchvision names and sizes.
#include <gtest/gtest.h>

#include <cmath>

#include "autograd/autograd.h"
#include "autograd/gradcheck.h"
#include "core/allocator.h"
#include "core/autocast.h"
#include "core/safetensors.h"
#include "core/testing/error_of.h"
#include "nn/init.h"
#include "nn/models.h"

namespace ember {
namespace {

namespace F = nn::functional;

using ::ember::testing::error_of;

Tensor f64(const Shape& s, uint64_t seed) {
  Generator g(seed);
  return randn(s, {DType::Float64}, &g);
}

TEST(Module, NamesOrderAndStateDict) {
  auto net = nn::resnet18({.num_classes = 10, .in_channels = 1, .small_stem = true});
  auto params = net->named_parameters();
  ASSERT_EQ(params.size(), 62u);
  EXPECT_EQ(params.front().first, "conv1.weight");
  EXPECT_EQ(params[1].first, "bn1.weight");
  EXPECT_EQ(params[3].first, "layer1.0.conv1.weight");
  EXPECT_EQ(params.back().first, "fc.bias");
  auto sd = net->state_dict();
  EXPECT_EQ(sd.size(), 122u);  // torchvision's resnet18 state_dict has 122 entries
  EXPECT_TRUE(sd.contains("layer2.0.downsample.0.weight"));
  EXPECT_TRUE(sd.contains("layer2.0.downsample.1.running_var"));
  EXPECT_TRUE(sd.contains("layer4.1.bn2.num_batches_tracked"));
  EXPECT_EQ(sd.items()[2].first, "bn1.bias");
  EXPECT_EQ(sd.items()[3].first, "bn1.running_mean");  // params then buffers, per module
  EXPECT_EQ(net->num_parameters(), 11172810);          // the PyTorch peer's model: 11.17 M
  EXPECT_EQ(net->layer3->named_children().size(), 2u);
  for (auto& [n, p] : params) EXPECT_TRUE(p.requires_grad()) << n;
}

TEST(Module, ResNet50MatchesTorchvisionCount) {
  auto net = nn::resnet50();
  EXPECT_EQ(net->num_parameters(), 25557032);  // torchvision.models.resnet50()
  EXPECT_EQ(net->state_dict().size(), 320u);
  EXPECT_EQ(nn::resnet34()->num_parameters(), 21797672);
}

TEST(Module, LoadStateDictRoundTripAndErrors) {
  auto a = nn::mlp({4, 3, 2});
  auto b = nn::mlp({4, 3, 2});
  Tensor x = randn({5, 4});
  EXPECT_FALSE(allclose((*a)(x).detach(), (*b)(x).detach()));
  b->load_state_dict(a->state_dict());
  EXPECT_TRUE(allclose((*a)(x).detach(), (*b)(x).detach(), 0, 0));
  EXPECT_EQ(a->named_parameters()[0].first, "1.weight");  // nn.Sequential(Flatten, Linear, ...)

  nn::StateDict missing;
  missing.insert("1.weight", zeros({3, 4}));
  std::string e = error_of([&] { b->load_state_dict(missing); });
  EXPECT_NE(e.find("missing key(s)"), std::string::npos) << e;
  EXPECT_NE(e.find("\"3.bias\""), std::string::npos) << e;

  nn::StateDict extra = a->state_dict();
  extra.insert("9.weight", zeros({1}));
  e = error_of([&] { b->load_state_dict(extra); });
  EXPECT_NE(e.find("unexpected key(s): \"9.weight\""), std::string::npos) << e;
  b->load_state_dict(extra, /*strict=*/false);

  nn::StateDict bad;
  for (auto& [k, v] : a->state_dict()) bad.insert(k, k == "3.weight" ? zeros({2, 5}) : v);
  Tensor before = b->named_parameters()[0].second.clone();
  e = error_of([&] { b->load_state_dict(bad); });
  EXPECT_NE(e.find("size mismatch for 3.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("[2,5]"), std::string::npos) << e;
  EXPECT_TRUE(allclose(before, b->named_parameters()[0].second.detach(), 0, 0));  // nothing half-loaded
}

TEST(Module, ToKeepsHandlesAndTrainEvalPropagates) {
  auto net = nn::resnet18({.num_classes = 3, .in_channels = 1, .small_stem = true, .width = 4});
  Tensor w = net->conv1->weight;
  net->to(DType::Float64);
  EXPECT_EQ(w.dtype(), DType::Float64);
  EXPECT_EQ(net->conv1->weight.dtype(), DType::Float64);
  EXPECT_TRUE(w.requires_grad());
  EXPECT_EQ(net->bn1->num_batches_tracked.dtype(), DType::Int64);
  net->eval();
  EXPECT_FALSE(net->layer2->named_children()[0].second->is_training());
  net->train();
  EXPECT_TRUE(net->bn1->is_training());
}

// to(MemoryFormat) lays 4-D parameters, gradients and buffers out in place:
// the same handles and values, channels-last strides, and back again; 1-D
// and 2-D tensors are left alone. A parameter that is a view into a larger
// buffer (a flat parameter) is refused by name instead of being cut off.
TEST(Module, ToMemoryFormatKeepsHandlesAndValues) {
  manual_seed(3);
  auto net = nn::resnet18({.num_classes = 3, .in_channels = 2, .small_stem = true, .width = 4});
  Tensor w = net->conv1->weight, fc = net->fc->weight;
  w.set_grad(randn(w.sizes()));
  const auto values = w.to_vector(), grad = w.grad().to_vector(), fc_before = fc.to_vector();
  const Shape fc_strides = fc.strides();
  net->to(MemoryFormat::ChannelsLast);
  EXPECT_TRUE(w.is_same(net->conv1->weight));
  EXPECT_TRUE(w.is_contiguous(MemoryFormat::ChannelsLast) && !w.is_contiguous()) << shape_str(w.strides());
  EXPECT_TRUE(w.grad().is_contiguous(MemoryFormat::ChannelsLast));
  EXPECT_EQ(w.to_vector(), values);
  EXPECT_EQ(w.grad().to_vector(), grad);
  EXPECT_EQ(fc.strides(), fc_strides);
  EXPECT_EQ(fc.to_vector(), fc_before);
  net->to(MemoryFormat::Contiguous);
  EXPECT_TRUE(w.is_contiguous());
  EXPECT_EQ(w.to_vector(), values);

  nn::Conv2d conv(2, 3, 3);
  Tensor flat = zeros({100});
  conv.weight.set_data(flat.narrow(0, 10, 54).view({3, 2, 3, 3}));
  const std::string e = error_of([&] { conv.to(MemoryFormat::ChannelsLast); });
  EXPECT_NE(e.find("parameter 'weight' [3,2,3,3] is a view into a larger buffer"), std::string::npos) << e;
}

TEST(Module, DuplicateAndBadNamesAreRejected) {
  struct M : nn::Module {
    M() : Module("M") {
      register_parameter("w", zeros({1}));
      EXPECT_THROW(register_parameter("w", zeros({1})), Error);
      EXPECT_THROW(register_buffer("a.b", zeros({1})), Error);
    }
  };
  M m;
  EXPECT_THROW(m(zeros({1})), Error);
}

// The call entry's hooks: order (pre-hooks, forward, forward hooks, each in
// registration order), replacing input and output, removal (also from inside
// a hook, and after the module is gone), an exception from a hook, and the
// backward pre-hook running on the output's gradient before the module's own
// backward (its weight has no gradient yet), able to replace that gradient.
TEST(Module, HooksRunInOrderAroundForwardAndBeforeBackward) {
  auto lin = std::make_shared<nn::Linear>(3, 2);
  auto head = std::make_shared<nn::Linear>(2, 1);
  nn::Sequential seq({lin, head});
  std::vector<std::string> log;
  auto h1 = lin->register_forward_pre_hook([&](nn::Module& m, const Tensor& x) {
    log.push_back("pre1 " + m.type_name());
    return x * 2.0;  // replaces the input
  });
  auto h2 = lin->register_forward_pre_hook([&](nn::Module&, const Tensor&) {
    log.push_back("pre2");
    return Tensor();  // keeps it
  });
  auto h3 = lin->register_forward_hook([&](nn::Module&, const Tensor& in, const Tensor& out) {
    log.push_back("post");
    EXPECT_EQ(in.to_vector(), (std::vector<double>{2, 4, 6})) << "the forward hook sees the replaced input";
    return out + 1.0;
  });
  bool weight_grad_seen = true;
  auto h4 = lin->register_full_backward_pre_hook([&](nn::Module&, const Tensor& g) {
    log.push_back("backward_pre");
    weight_grad_seen = lin->weight.grad().defined();
    return g * 10.0;
  });
  Tensor x = Tensor::from_vector({1, 2, 3}, {1, 3});
  Tensor y = seq(x);
  EXPECT_EQ(log, (std::vector<std::string>{"pre1 Linear", "pre2", "post"}));
  {
    NoGradGuard ng;
    const Tensor want = linear(x * 2.0, lin->weight, lin->bias) + 1.0;
    EXPECT_EQ((*lin)(x).to_vector(), want.to_vector()) << "the hooks changed input and output";
  }
  log.clear();
  sum(y).backward();
  EXPECT_EQ(log, (std::vector<std::string>{"backward_pre"}));
  EXPECT_FALSE(weight_grad_seen) << "the backward pre-hook must run before the module's own backward";
  // d(sum y)/d(bias of lin) = head.weight, times the hook's 10.
  const std::vector<double> hw = head->weight.to_vector(), gb = lin->bias.grad().to_vector();
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(gb[i], 10.0 * hw[i], 1e-6);

  for (auto* h : {&h1, &h2, &h3, &h4}) h->remove();
  h1.remove();  // idempotent
  log.clear();
  NoGradGuard ng;
  EXPECT_EQ((*lin)(x).to_vector(), linear(x, lin->weight, lin->bias).to_vector());
  EXPECT_TRUE(log.empty());

  // A hook that removes itself runs once; an exception reaches the caller.
  nn::HookHandle once;
  int calls = 0;
  once = lin->register_forward_pre_hook([&](nn::Module&, const Tensor&) {
    ++calls;
    once.remove();
    return Tensor();
  });
  (*lin)(x);
  (*lin)(x);
  EXPECT_EQ(calls, 1);
  auto bad = lin->register_forward_hook([](nn::Module&, const Tensor&, const Tensor&) -> Tensor {
    throw Error("hook failed on purpose");
  });
  EXPECT_EQ(error_of([&] { (*lin)(x); }), "hook failed on purpose");
  bad.remove();
  EXPECT_NO_THROW((*lin)(x));

  // Removing after the module is gone does nothing.
  nn::HookHandle orphan;
  {
    nn::Linear tmp(2, 2);
    orphan = tmp.register_forward_pre_hook([](nn::Module&, const Tensor&) { return Tensor(); });
  }
  orphan.remove();
}

TEST(Layers, LinearForwardBackward) {
  nn::Linear lin(3, 2);
  lin.to(DType::Float64);
  Tensor x = Tensor::from_vector({1, 2, 3}, {1, 3}, DType::Float64);
  {
    NoGradGuard g;
    lin.weight.copy_(Tensor::from_vector({1, 0, -1, 2, 1, 0}, {2, 3}, DType::Float64));
    lin.bias.copy_(Tensor::from_vector({0.5, -0.5}, {2}, DType::Float64));
  }
  Tensor y = lin(x);
  EXPECT_EQ(y.to_vector(), (std::vector<double>{-1.5, 3.5}));
  sum(y).backward();
  EXPECT_EQ(lin.weight.grad().to_vector(), (std::vector<double>{1, 2, 3, 1, 2, 3}));
  EXPECT_EQ(lin.bias.grad().to_vector(), (std::vector<double>{1, 1}));
  std::string e = error_of([&] { lin(zeros({2, 4}, DType::Float64)); });
  EXPECT_NE(e.find("linear"), std::string::npos) << e;
}

TEST(Layers, DefaultInitMatchesPyTorchBounds) {
  manual_seed(0);
  nn::Linear lin(400, 300);
  double bound = 1.0 / std::sqrt(400.0);
  EXPECT_LE(max(abs(lin.weight.detach())).item(), bound);
  EXPECT_GT(max(abs(lin.weight.detach())).item(), 0.95 * bound);
  // kaiming_normal_(fan_out, relu): std = sqrt(2 / (out * k * k))
  auto net = nn::resnet18({.num_classes = 10, .in_channels = 1, .small_stem = true});
  Tensor w = net->layer1->named_parameters()[0].second.detach();
  double expect_std = std::sqrt(2.0 / (64 * 9));
  EXPECT_NEAR(std::sqrt(var(w).item()), expect_std, 0.05 * expect_std);
}

TEST(Layers, CrossEntropyAgainstFloat64Reference) {
  Tensor logits = f64({4, 5}, 1);
  Tensor target = Tensor::from_vector({0, 4, 2, 2}, {4}, DType::Int64);
  auto lv = logits.to_vector();
  auto tv = target.to_vector();
  for (double eps : {0.0, 0.1}) {
    double want = 0;
    for (int i = 0; i < 4; ++i) {
      double mx = -1e300, se = 0;
      for (int c = 0; c < 5; ++c) mx = std::max(mx, lv[i * 5 + c]);
      for (int c = 0; c < 5; ++c) se += std::exp(lv[i * 5 + c] - mx);
      double lse = mx + std::log(se);
      double nll = lse - lv[i * 5 + static_cast<int>(tv[i])];
      double smooth = 0;
      for (int c = 0; c < 5; ++c) smooth += (lse - lv[i * 5 + c]) / 5;
      want += ((1 - eps) * nll + eps * smooth) / 4;
    }
    EXPECT_NEAR(F::cross_entropy(logits, target, eps).item(), want, 1e-12) << "label_smoothing " << eps;
  }
  EXPECT_NEAR(F::nll_loss(log_softmax(logits, 1), target).item(), F::cross_entropy(logits, target).item(), 1e-12);
  EXPECT_NEAR(F::cross_entropy(logits, target, 0, F::Reduction::Sum).item(),
              4 * F::cross_entropy(logits, target).item(), 1e-12);
  std::string e = error_of([&] { F::cross_entropy(logits, Tensor::from_vector({0, 5, 1, 1}, {4}, DType::Int64)); });
  EXPECT_NE(e.find("cross_entropy: target 5 of row 1 is out of the range [0, 5) and is not ignore_index (-100)"),
            std::string::npos)
      << e;
  e = error_of([&] { F::cross_entropy(logits, Tensor::from_vector({0, 1}, {2}, DType::Int64)); });
  EXPECT_NE(e.find("does not match input [4,5]"), std::string::npos) << e;
  Tensor lg = logits.detach().requires_grad_();
  auto r = autograd::gradcheck([&](auto& v) { return F::cross_entropy(v[0], target, 0.1); }, {lg});
  EXPECT_TRUE(r.ok) << r.message;
  // Without smoothing, and per-row losses weighted (reduction none): the
  // fused backward's one-hot and per-row scale.
  r = autograd::gradcheck([&](auto& v) { return F::cross_entropy(v[0], target); }, {lg});
  EXPECT_TRUE(r.ok) << r.message;
  Tensor wts = Tensor::from_vector({0.5, -1.0, 2.0, 3.0}, {4}, DType::Float64);
  r = autograd::gradcheck([&](auto& v) { return F::cross_entropy(v[0], target, 0.2, F::Reduction::None) * wts; }, {lg});
  EXPECT_TRUE(r.ok) << r.message;
}

// ignore_index as PyTorch documents it: an ignored row adds 0 to the loss
// and nothing to the gradient, and the mean divides by the rows that count
// (with label smoothing too); every row ignored gives NaN (0 / 0); int32
// targets work as int64 ones; a 16-bit loss outside autocast is in the
// logits' dtype, computed from the same float32 sums.
TEST(Layers, CrossEntropyIgnoreIndex) {
  Tensor logits = f64({5, 4}, 3);
  Tensor target = Tensor::from_vector({1, -100, 3, 0, -100}, {5}, DType::Int64);
  Tensor kept_logits = cat({logits.narrow(0, 0, 1), logits.narrow(0, 2, 2)}, 0);
  Tensor kept_target = Tensor::from_vector({1, 3, 0}, {3}, DType::Int64);
  for (double eps : {0.0, 0.3}) {
    EXPECT_NEAR(F::cross_entropy(logits, target, eps).item(), F::cross_entropy(kept_logits, kept_target, eps).item(),
                1e-12);
    EXPECT_NEAR(F::cross_entropy(logits, target, eps, F::Reduction::Sum).item(),
                F::cross_entropy(kept_logits, kept_target, eps, F::Reduction::Sum).item(), 1e-12);
    auto rows = F::cross_entropy(logits, target, eps, F::Reduction::None).to_vector();
    EXPECT_EQ(rows[1], 0.0);
    EXPECT_EQ(rows[4], 0.0);
  }
  EXPECT_NEAR(F::cross_entropy(logits, target.to(DType::Int32)).item(), F::cross_entropy(logits, target).item(), 1e-15);
  Tensor other = Tensor::from_vector({1, 2, 3, 0, 2}, {5}, DType::Int64);
  EXPECT_NEAR(F::cross_entropy(logits, other, 0, F::Reduction::Mean, 2).item(),
              F::cross_entropy(kept_logits, kept_target).item(), 1e-12)
      << "ignore_index 2 ignores the rows whose target is 2";
  EXPECT_TRUE(std::isnan(F::cross_entropy(logits, full({5}, -100, {DType::Int64})).item()));
  Tensor lg = logits.detach().requires_grad_();
  F::cross_entropy(lg, target, 0.2).backward();
  auto g = lg.grad().to_vector();
  for (int c = 0; c < 4; ++c) {
    EXPECT_EQ(g[1 * 4 + c], 0.0) << "ignored row 1";
    EXPECT_EQ(g[4 * 4 + c], 0.0) << "ignored row 4";
  }
  Tensor lk = kept_logits.detach().requires_grad_();
  F::cross_entropy(lk, kept_target, 0.2).backward();
  auto gk = lk.grad().to_vector();
  for (int c = 0; c < 4; ++c) {
    EXPECT_NEAR(g[c], gk[c], 1e-15);
    EXPECT_NEAR(g[8 + c], gk[4 + c], 1e-15);
    EXPECT_NEAR(g[12 + c], gk[8 + c], 1e-15);
  }
  auto r = autograd::gradcheck([&](auto& v) { return F::cross_entropy(v[0], target, 0.1); }, {lg});
  EXPECT_TRUE(r.ok) << r.message;
  Tensor half_logits = logits.to(DType::BFloat16);
  Tensor h = F::cross_entropy(half_logits, other);
  EXPECT_EQ(h.dtype(), DType::BFloat16);
  EXPECT_NEAR(h.to(DType::Float64).item(), F::cross_entropy(half_logits.to(DType::Float64), other).item(), 1e-2);
}

// The loss of 16-bit logits under autocast keeps one float per row for the
// backward, not the logits in float32 (PyTorch's policy casts them, and the
// composition kept log_softmax of the cast: 8 bytes a logit), and its
// backward allocates the gradient in the logits' dtype and nothing else
// the size of the logits. Counted by the CPU allocator's requested bytes.
TEST(Layers, CrossEntropyKeepsNoFloat32Logits) {
  const int64_t n = 256, v = 8192;
  const size_t logit_bytes = static_cast<size_t>(n * v) * 2;  // bfloat16
  Generator g(11);
  Tensor logits = randn({n, v}, {DType::Float32}, &g).to(DType::BFloat16).requires_grad_();
  Tensor target = randint(0, v, {n}, {DType::Int64}, &g);
  Allocator* a = cpu_allocator();
  const size_t base = a->stats().requested;
  a->reset_peak_stats();
  Tensor loss;
  {
    AutocastGuard amp(DeviceType::CPU, DType::BFloat16);
    loss = F::cross_entropy(logits, target);
  }
  EXPECT_EQ(loss.dtype(), DType::Float32);
  const size_t kept = a->stats().requested - base, fwd_peak = a->stats().peak_requested - base;
  loss.backward();
  const size_t peak = a->stats().peak_requested - base;
  std::printf(
      "cross_entropy of %lld x %lld bf16 logits: kept %zu bytes, forward peak %zu, step peak %zu (logits %zu)\n",
      static_cast<long long>(n), static_cast<long long>(v), kept, fwd_peak, peak, logit_bytes);
  EXPECT_LE(kept, static_cast<size_t>(n) * 16 + 256) << "kept for the backward: per-row floats only";
  EXPECT_LE(fwd_peak, static_cast<size_t>(n) * 16 + 256) << "the forward allocates nothing the size of the logits";
  EXPECT_LE(peak, logit_bytes + static_cast<size_t>(n) * 16 + 256) << "the backward: the bf16 gradient only";
  EXPECT_EQ(logits.grad().dtype(), DType::BFloat16);
}

// Sizes that do not divide: PyTorch's overlapping bins
// [floor(i*H/out), ceil((i+1)*H/out)), against a direct loop in float64.
TEST(Layers, AdaptiveAvgPoolAnySize) {
  Tensor x = f64({2, 3, 7, 5}, 41);
  for (std::array<int64_t, 2> o : {std::array<int64_t, 2>{3, 2}, {4, 4}, {7, 5}, {1, 3}, {5, 1}}) {
    Tensor y = F::adaptive_avg_pool2d(x, o);
    ASSERT_EQ(y.sizes(), (Shape{2, 3, o[0], o[1]}));
    auto xv = x.to_vector(), yv = y.to_vector();
    for (int64_t nc = 0; nc < 6; ++nc)
      for (int64_t i = 0; i < o[0]; ++i)
        for (int64_t j = 0; j < o[1]; ++j) {
          int64_t h0 = i * 7 / o[0], h1 = ((i + 1) * 7 + o[0] - 1) / o[0];
          int64_t w0 = j * 5 / o[1], w1 = ((j + 1) * 5 + o[1] - 1) / o[1];
          double s = 0;
          for (int64_t h = h0; h < h1; ++h)
            for (int64_t w = w0; w < w1; ++w) s += xv[nc * 35 + h * 5 + w];
          EXPECT_NEAR(yv[(nc * o[0] + i) * o[1] + j], s / ((h1 - h0) * (w1 - w0)), 1e-12)
              << "out " << o[0] << "x" << o[1] << " at " << nc << "," << i << "," << j;
        }
  }
  auto r = autograd::gradcheck([](auto& v) { return F::adaptive_avg_pool2d(v[0], {3, 2}); },
                               {f64({1, 2, 7, 5}, 42).requires_grad_()});
  EXPECT_TRUE(r.ok) << r.message;
}

// layer_norm has its own derivative: checked for input, weight and bias
// by finite differences, over one and two normalised dims, with and without
// the affine parameters.
// linear is one node: its weight gradient comes out [out, in] directly (a
// transposed view through matmul cost an element-wise copy into .grad()).
TEST(Layers, LinearIsOneOpWithAContiguousWeightGradient) {
  Tensor w = f64({3, 5}, 31).requires_grad_(), b = f64({3}, 32).requires_grad_();
  Tensor y = linear(f64({2, 4, 5}, 33), w, b);
  EXPECT_EQ(autograd::grad_fn_name(y), "linear");
  sum(y).backward();
  EXPECT_EQ(w.grad().sizes(), Shape({3, 5}));
  EXPECT_TRUE(w.grad().is_contiguous());
}

TEST(Layers, LayerNormGradientsForInputWeightAndBias) {
  Tensor x = f64({2, 3, 4, 5}, 21);
  EXPECT_EQ(autograd::grad_fn_name(F::layer_norm(x.detach().requires_grad_(), 1, Tensor(), Tensor(), 1e-5)),
            "layer_norm");  // one node, not the composition's
  for (int nd : {1, 2}) {
    const Shape ns = nd == 1 ? Shape{5} : Shape{4, 5};
    Tensor w = f64(ns, 22) + 1.0, b = f64(ns, 23);
    auto r = autograd::gradcheck([&](auto& v) { return F::layer_norm(v[0], nd, v[1], v[2], 1e-5); },
                                 {x.detach().requires_grad_(), w.detach().requires_grad_(), b.detach().requires_grad_()});
    EXPECT_TRUE(r.ok) << nd << " dims: " << r.message;
    r = autograd::gradcheck([&](auto& v) { return F::layer_norm(v[0], nd, Tensor(), Tensor(), 1e-5); },
                            {x.detach().requires_grad_()});
    EXPECT_TRUE(r.ok) << nd << " dims, no affine: " << r.message;
    r = autograd::gradcheck([&](auto& v) { return F::layer_norm(v[0], nd, v[1], Tensor(), 1e-5); },
                            {x.detach().requires_grad_(), w.detach().requires_grad_()});
    EXPECT_TRUE(r.ok) << nd << " dims, weight only: " << r.message;
  }
}

TEST(Layers, MseDropoutLayerNormEmbedding) {
  Tensor a = Tensor::from_vector({1, 2, 3}, {3}, DType::Float64), b = Tensor::from_vector({1, 0, 0}, {3}, DType::Float64);
  EXPECT_DOUBLE_EQ(F::mse_loss(a, b).item(), 13.0 / 3);

  Generator gen(7);
  Tensor ones_ = ones({100000});
  Tensor d = F::dropout(ones_, 0.25, true, &gen);
  auto dv = d.to_vector();
  int64_t zeros_n = 0;
  for (double v : dv) {
    if (v == 0) ++zeros_n;
    else EXPECT_NEAR(v, 1 / 0.75, 1e-6);
  }
  EXPECT_NEAR(zeros_n / 100000.0, 0.25, 0.01);
  EXPECT_TRUE(F::dropout(ones_, 0.25, false).is_same(ones_));

  nn::LayerNorm ln({4});
  ln.to(DType::Float64);
  Tensor x = f64({3, 4}, 2);
  Tensor y = ln(x).detach();
  auto xv = x.to_vector(), yv = y.to_vector();
  for (int r = 0; r < 3; ++r) {
    double m = 0, v = 0;
    for (int c = 0; c < 4; ++c) m += xv[r * 4 + c] / 4;
    for (int c = 0; c < 4; ++c) v += (xv[r * 4 + c] - m) * (xv[r * 4 + c] - m) / 4;
    for (int c = 0; c < 4; ++c) EXPECT_NEAR(yv[r * 4 + c], (xv[r * 4 + c] - m) / std::sqrt(v + 1e-5), 1e-12);
  }
  auto r = autograd::gradcheck([&](auto& v) { return ln(v[0]); }, {x.detach().requires_grad_()});
  EXPECT_TRUE(r.ok) << r.message;

  // Loss and dropout backward through finite differences (dropout with a
  // fixed generator, so every evaluation draws the same mask).
  Tensor pa = f64({3, 4}, 31).requires_grad_(), pb = f64({3, 4}, 32);
  r = autograd::gradcheck([&](auto& v) { return F::mse_loss(v[0], pb); }, {pa});
  EXPECT_TRUE(r.ok) << "mse_loss " << r.message;
  r = autograd::gradcheck([&](auto& v) { return F::mse_loss(v[0], pb, F::Reduction::Sum); }, {pa});
  EXPECT_TRUE(r.ok) << "mse_loss sum " << r.message;
  Tensor cls = Tensor::from_vector({3, 0, 2}, {3}, DType::Int64);
  r = autograd::gradcheck([&](auto& v) { return F::nll_loss(log_softmax(v[0], 1), cls); }, {pa});
  EXPECT_TRUE(r.ok) << "nll_loss " << r.message;
  r = autograd::gradcheck([&](auto& v) {
    Generator g(11);
    return F::dropout(v[0], 0.4, true, &g);
  }, {pa});
  EXPECT_TRUE(r.ok) << "dropout " << r.message;

  nn::Embedding emb(10, 3);
  Tensor idx = Tensor::from_vector({1, 7, 1, 0}, {2, 2}, DType::Int64);
  Tensor e = emb(idx);
  EXPECT_EQ(e.sizes(), (Shape{2, 2, 3}));
  EXPECT_TRUE(allclose(e.select(0, 0).select(0, 0).detach(), emb.weight.select(0, 1).detach()));
  sum(e).backward();
  EXPECT_EQ(emb.weight.grad().select(0, 1).to_vector(), (std::vector<double>{2, 2, 2}));
  EXPECT_EQ(emb.weight.grad().select(0, 5).to_vector(), (std::vector<double>{0, 0, 0}));
  std::string err = error_of([&] { emb(Tensor::from_vector({10}, {1}, DType::Int64)); });
  EXPECT_NE(err.find("out of range"), std::string::npos) << err;
}

TEST(Layers, ConvBatchNormPoolModulesMatchFunctionalOps) {
  nn::Conv2d conv(2, 4, {3, 3}, {.stride = {2, 2}, .padding = {1, 1}});
  Tensor x = randn({2, 2, 7, 7});
  EXPECT_EQ(conv(x).sizes(), (Shape{2, 4, 4, 4}));
  std::string e = error_of([&] { conv(randn({2, 3, 7, 7})); });
  EXPECT_NE(e.find("Conv2d: expected input [N, 2, H, W], got [2,3,7,7]"), std::string::npos) << e;

  nn::BatchNorm2d bn(2);
  Tensor y = bn(x);
  EXPECT_NEAR(mean(y).item(), 0.0, 1e-5);
  EXPECT_EQ(bn.num_batches_tracked.item(), 1.0);
  // running_mean = 0.9 * 0 + 0.1 * batch mean
  Tensor batch_mean = mean(x, {0, 2, 3});
  EXPECT_TRUE(allclose(bn.running_mean, batch_mean * 0.1, 1e-5, 1e-6));
  bn.eval();
  Tensor ye = bn(x);
  Tensor want = (x - bn.running_mean.view({1, 2, 1, 1})) / sqrt(bn.running_var.view({1, 2, 1, 1}) + 1e-5);
  EXPECT_TRUE(allclose(ye.detach(), want, 1e-4, 1e-5));
  EXPECT_EQ(bn.num_batches_tracked.item(), 1.0);

  nn::MaxPool2d mp(2);
  EXPECT_EQ(mp(x).sizes(), (Shape{2, 2, 3, 3}));
  nn::AdaptiveAvgPool2d gap({1, 1});
  EXPECT_TRUE(allclose(gap(x).flatten(1), mean(x, {2, 3}), 1e-5, 1e-6));
}

// The SyncBatchNorm path with a world of one (the cross-replica sum is the
// identity): outputs, gradients and running stats equal plain batch norm's.
TEST(Layers, BatchNormCrossReplicaSumMatchesBatchNorm) {
  Tensor x = randn({4, 3, 5, 5}) * 2.0 + 1.5;
  auto run = [&](bool sync, const Tensor& input) {
    manual_seed(7);
    nn::BatchNorm2d bn(3);
    {
      NoGradGuard g;
      Tensor w = bn.weight.detach(), b = bn.bias.detach();
      w.copy_(rand({3}) + 0.5);
      b.copy_(randn({3}));
    }
    int calls = 0;
    if (sync) bn.cross_replica_sum = [&](const Tensor& t) {
      ++calls;
      EXPECT_EQ(t.sizes(), (Shape{7}));
      return t;
    };
    Tensor y = bn(input);
    sum(y * y * 0.5 + y).backward();
    EXPECT_EQ(calls, sync ? 1 : 0);
    return std::vector<Tensor>{y.detach(), bn.weight.grad(), bn.bias.grad(), bn.running_mean.clone(),
                               bn.running_var.clone()};
  };
  Tensor xs = x.detach().requires_grad_(), xp = x.detach().requires_grad_();
  auto got = run(true, xs), want = run(false, xp);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(allclose(got[i], want[i], 1e-4, 1e-5)) << i;
  EXPECT_TRUE(allclose(xs.grad(), xp.grad(), 1e-4, 1e-5));

  // Eval mode never calls the hook.
  nn::BatchNorm2d bn(3);
  bn.cross_replica_sum = [](const Tensor&) -> Tensor { throw Error("called in eval"); };
  bn.eval();
  EXPECT_NO_THROW(bn(x));

  // One value per channel here: the global count decides. Other replicas
  // adding values (their counts in the sum) pass; none is a named error.
  nn::BatchNorm2d one(3);
  const Tensor single = randn({1, 3, 1, 1});
  one.cross_replica_sum = [](const Tensor& t) {
    Tensor more = t.clone();
    more.narrow(0, 6, 1).fill_(4.0);  // 3 more values per channel elsewhere
    return more;
  };
  EXPECT_NO_THROW(one(single));
  one.cross_replica_sum = [](const Tensor& t) { return t; };
  const std::string e = error_of([&] { one(single); });
  EXPECT_NE(e.find("expected more than 1 value per channel across replicas when training, got 1"), std::string::npos)
      << e;
}

TEST(Models, ResNetForwardBackwardShapes) {
  auto net = nn::resnet18({.num_classes = 10, .in_channels = 1, .small_stem = true, .width = 8});
  Tensor x = randn({2, 1, 28, 28});
  Tensor y = (*net)(x);
  EXPECT_EQ(y.sizes(), (Shape{2, 10}));
  F::cross_entropy(y, Tensor::from_vector({3, 7}, {2}, DType::Int64)).backward();
  for (auto& [n, p] : net->named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << n;
    EXPECT_EQ(p.grad().sizes(), p.sizes()) << n;
  }
  auto big = nn::resnet50({.num_classes = 5, .width = 8});
  EXPECT_EQ((*big)(randn({1, 3, 64, 64})).sizes(), (Shape{1, 5}));
}

// The whole small ResNet in float64 through finite differences: every op on
// the path (conv, batch norm in training mode, relu, residual add, pooling,
// linear, cross entropy) composed.
TEST(Models, TinyResNetGradcheck) {
  manual_seed(3);
  auto net = nn::resnet18({.num_classes = 3, .in_channels = 1, .small_stem = true, .width = 2});
  net->to(DType::Float64);
  Tensor x = f64({2, 1, 8, 8}, 4);
  Tensor target = Tensor::from_vector({0, 2}, {2}, DType::Int64);
  Tensor w = net->layer2->named_parameters()[0].second;  // layer2.0.conv1.weight
  auto r = autograd::gradcheck([&](auto&) { return F::cross_entropy((*net)(x), target); }, {w}, 1e-6, 1e-5, 1e-3);
  EXPECT_TRUE(r.ok) << r.message;
}

// The channels-last option changes only the layout: same logits and
// gradients as NCHW (on CPU conv returns NCHW, so this covers the switch,
// batch norm and elementwise ops; the CUDA test covers cuDNN's NHWC path).
// Its convolution weights are stored channels-last (OHWI memory) and their
// gradients follow them (PyTorch's layout contract), and its state dict
// loads into an NCHW model, and back, value for value.
TEST(Models, ChannelsLastResNetMatchesNchw) {
  Tensor x = f64({2, 1, 8, 8}, 21);
  Tensor target = Tensor::from_vector({1, 2}, {2}, DType::Int64);
  std::vector<Tensor> logits, grads;
  std::vector<std::shared_ptr<nn::ResNet>> nets;
  for (MemoryFormat f : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
    manual_seed(5);
    auto net = nn::resnet18({.num_classes = 3, .in_channels = 1, .small_stem = true, .width = 4, .memory_format = f});
    net->to(DType::Float64);
    Tensor out = (*net)(x);
    F::cross_entropy(out, target).backward();
    logits.push_back(out.detach());
    grads.push_back(net->named_parameters()[0].second.grad());
    nets.push_back(net);
  }
  const auto a = logits[0].to_vector(), b = logits[1].to_vector();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-12);
  const auto ga = grads[0].to_vector(), gb = grads[1].to_vector();
  for (size_t i = 0; i < ga.size(); ++i) EXPECT_NEAR(ga[i], gb[i], 1e-12);

  int conv_weights = 0;
  for (const auto& [name, p] : nets[1]->named_parameters()) {
    if (p.dim() != 4) {
      EXPECT_TRUE(p.is_contiguous()) << name;
      continue;
    }
    ++conv_weights;
    EXPECT_TRUE(p.is_contiguous(MemoryFormat::ChannelsLast)) << name << " strides " << shape_str(p.strides());
    if (p.size(1) > 1 && p.size(2) * p.size(3) > 1) {  // else both layouts are one
      EXPECT_FALSE(p.is_contiguous()) << name;
    }
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_EQ(p.grad().strides(), p.strides()) << name << ": the gradient is laid out as its parameter";
  }
  EXPECT_EQ(conv_weights, 20);  // conv1, 16 in the blocks, 3 downsamples
  for (const auto& [name, p] : nets[0]->named_parameters()) EXPECT_TRUE(p.is_contiguous()) << name;

  // Each way round, through the file format: the values, not the memory, travel.
  for (int from : {0, 1}) {
    auto bytes = serialize_safetensors(nets[from]->state_dict().items());
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    auto file = parse_safetensors(*bytes);
    ASSERT_TRUE(file.ok()) << file.status();
    manual_seed(99);  // other values, so the load has something to do
    auto into = nn::resnet18({.num_classes = 3,
                              .in_channels = 1,
                              .small_stem = true,
                              .width = 4,
                              .memory_format = from == 0 ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous});
    into->to(DType::Float64);
    nn::StateDict sd;
    for (const auto& [k, t] : file->tensors) sd.insert(k, t);
    into->load_state_dict(sd);
    const auto src = nets[from]->named_parameters(), dst = into->named_parameters();
    ASSERT_EQ(src.size(), dst.size());
    for (size_t i = 0; i < src.size(); ++i) {
      EXPECT_EQ(src[i].second.to_vector(), dst[i].second.to_vector()) << "from " << from << ": " << src[i].first;
      if (dst[i].second.dim() == 4 && from == 0) {
        EXPECT_TRUE(dst[i].second.is_contiguous(MemoryFormat::ChannelsLast)) << "the load keeps the model's layout";
      }
    }
  }
}

TEST(Models, ConvBatchNormReluGradcheck) {
  Tensor x = f64({4, 2, 5, 5}, 11);
  nn::Conv2d conv(2, 3, 3, 1, 1, false);
  nn::BatchNorm2d bn(3);
  conv.to(DType::Float64);
  bn.to(DType::Float64);
  Tensor w = conv.weight;
  Tensor proj = f64({4, 3, 5, 5}, 12);
  auto r1 = autograd::gradcheck([&](auto&) { return conv(x); }, {w});
  EXPECT_TRUE(r1.ok) << "conv " << r1.message;
  auto r2 = autograd::gradcheck([&](auto&) { return bn(conv(x)); }, {w});
  EXPECT_TRUE(r2.ok) << "conv+bn " << r2.message;
  auto r3 = autograd::gradcheck([&](auto&) { return relu(bn(conv(x))); }, {w});
  EXPECT_TRUE(r3.ok) << "conv+bn+relu " << r3.message;
  Tensor xx = f64({4, 3, 5, 5}, 13).requires_grad_();
  auto r4 = autograd::gradcheck([&](auto& v) { return bn(v[0]); }, {xx});
  EXPECT_TRUE(r4.ok) << "bn x " << r4.message;
}

// BatchNorm2d::add_relu, a residual block's tail: the one op
// (batch_norm_add_relu) where its call is forward alone, the three ops
// where a hook must see the module's own output or the residual is of
// another dtype; the same outputs, gradients (x, residual, weight, bias),
// running statistics and batch count as relu(bn(x) + residual) on a twin,
// in training and eval; finite differences in float64 through both inputs.
TEST(Models, BatchNormAddReluIsTheThreeOps) {
  for (bool training : {true, false})
    for (int variant = 0; variant < 3; ++variant) {  // fused, a forward hook, a float64 residual
      nn::BatchNorm2d bn(3), twin(3);
      Generator g(31 + variant);
      for (nn::BatchNorm2d* m : {&bn, &twin}) {
        m->weight.detach().copy_(Tensor::from_vector({0.5, -1.5, 2.0}, {3}));
        m->bias.detach().copy_(Tensor::from_vector({0.1, 0.3, -0.2}, {3}));
        m->running_mean.detach().fill_(0.25);
        m->train(training);
      }
      Tensor seen;
      if (variant == 1)
        bn.register_forward_hook([&](nn::Module&, const Tensor&, const Tensor& out) {
          seen = out;
          return Tensor();
        });
      const Tensor x0 = randn({4, 3, 5, 5}, {}, &g);
      const Tensor r0 = randn({4, 3, 5, 5}, {variant == 2 ? DType::Float64 : DType::Float32}, &g);
      Tensor x1 = x0.clone().requires_grad_(), r1 = r0.clone().requires_grad_();
      Tensor x2 = x0.clone().requires_grad_(), r2 = r0.clone().requires_grad_();
      const std::string what = detail::str_cat(training ? "train" : "eval", " variant ", variant);
      const Tensor y = bn.add_relu(x1, r1), normed = twin(x2), want = relu(normed + r2);
      EXPECT_EQ(autograd::grad_fn_name(y), variant == 0 ? "batch_norm_add_relu" : "relu") << what;
      if (variant == 1) {
        ASSERT_TRUE(seen.defined()) << what << ": the hook ran";
        EXPECT_EQ(seen.to_vector(), normed.to_vector()) << what << ": the hook saw batch norm's own output";
      }
      ASSERT_EQ(y.dtype(), want.dtype()) << what;
      EXPECT_EQ(y.to_vector(), want.to_vector()) << what;
      const double zeros = sum(eq(y, zeros_like(y))).item();
      EXPECT_GT(zeros, 10) << what << ": the ReLU acted";
      const Tensor proj = randn(y.sizes(), {y.dtype()}, &g);
      sum(y * proj).backward();
      sum(want * proj).backward();
      EXPECT_EQ(x1.grad().to_vector(), x2.grad().to_vector()) << what;
      EXPECT_EQ(r1.grad().to_vector(), r2.grad().to_vector()) << what;
      EXPECT_EQ(bn.weight.grad().to_vector(), twin.weight.grad().to_vector()) << what;
      EXPECT_EQ(bn.bias.grad().to_vector(), twin.bias.grad().to_vector()) << what;
      EXPECT_EQ(bn.running_mean.to_vector(), twin.running_mean.to_vector()) << what;
      EXPECT_EQ(bn.running_var.to_vector(), twin.running_var.to_vector()) << what;
      EXPECT_EQ(bn.num_batches_tracked.item(), twin.num_batches_tracked.item()) << what;
    }

  // A channels-last residual over an NCHW input takes the three ops, whose
  // add lays the output out as the residual; a cross-replica sum is not
  // used in eval, so an eval call fuses.
  nn::BatchNorm2d lay(3);
  const Tensor xn = randn({2, 3, 4, 4}), rn = randn({2, 3, 4, 4}), rc = rn.contiguous(MemoryFormat::ChannelsLast);
  const Tensor mixed = lay.add_relu(xn, rc);
  EXPECT_EQ(autograd::grad_fn_name(mixed), "relu");
  EXPECT_EQ(mixed.suggest_memory_format(), MemoryFormat::ChannelsLast);
  lay.cross_replica_sum = [](const Tensor&) -> Tensor { throw Error("called in eval"); };
  lay.eval();
  EXPECT_EQ(autograd::grad_fn_name(lay.add_relu(xn, rn)), "batch_norm_add_relu");
  nn::BatchNorm2d bn(3);
  bn.to(DType::Float64);
  Tensor x = f64({4, 3, 5, 5}, 21).requires_grad_(), r = f64({4, 3, 5, 5}, 22).requires_grad_();
  auto check = autograd::gradcheck([&](auto& v) { return bn.add_relu(v[0], v[1]); }, {x, r});
  EXPECT_TRUE(check.ok) << check.message;

  bn.fused_relu = true;
  const std::string e = error_of([&] { bn.add_relu(x, r); });
  EXPECT_NE(e.find("fused_relu is set"), std::string::npos) << e;
  const std::string shape = error_of([&] { batch_norm_add_relu(x, r.narrow(3, 0, 4), {}, {}, {}, {}, true); });
  EXPECT_NE(shape.find("batch_norm_add_relu: the residual must be laid over the input: residual [4,3,5,4] float64"),
            std::string::npos)
      << shape;
}

}  // namespace
}  // namespace ember
