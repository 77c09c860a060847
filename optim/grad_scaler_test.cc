// GradScaler against values computed by hand: the scale's sequence over
// steps with injected inf and NaN gradients (skip, back off, grow after
// growth_interval clean steps), the unscaled gradients and parameters, the
// state dict round trip, the disabled pass-through, float16 gradients that
// underflow to zero without scaling and survive with it, and every misuse
// as a named error. Each scenario runs on the CPU and, where a GPU (or the
// emulation: grad_scaler_emu_test) is present, on CUDA.
#include "optim/grad_scaler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "core/ops_optim.h"
#include "core/testing/error_of.h"
#include "optim/clip_grad.h"
#include "optim/lr_scheduler.h"
#include "optim/optimizer.h"

namespace ember::optim {
namespace {

using ::testing::HasSubstr;

std::vector<Device> devices() {
  std::vector<Device> d = {kCPU};
  if (cuda_is_available()) d.push_back(cuda_device(0));
  return d;
}

using ::ember::testing::error_of;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// One training step of loss = sum(p * x) through the scaler.
bool scaled_step(GradScaler& scaler, SGD& opt, const Tensor& p, const std::vector<double>& x, const Device& dev) {
  opt.zero_grad();
  Tensor xt = Tensor::from_vector(x, {static_cast<int64_t>(x.size())}, {DType::Float32, dev});
  scaler.scale(sum(p * xt)).backward();
  const bool stepped = scaler.step(opt);
  scaler.update();
  return stepped;
}

TEST(GradScaler, ScaleSequenceOverInjectedInfAndNaNMatchesHandComputedValues) {
  for (const Device& dev : devices()) {
    SCOPED_TRACE(::testing::Message() << dev);
    Tensor p = zeros({3}, {DType::Float32, dev}).requires_grad_();
    SGD opt({p}, {.lr = 0.5});
    GradScaler scaler({.init_scale = 8.0, .growth_interval = 3});
    // {x, stepped, scale after update, tracker after update}, worked out from
    // torch's rules: a non-finite step halves the scale and resets the
    // tracker; the third clean step in a row doubles it.
    struct Step {
      std::vector<double> x;
      bool stepped;
      double scale;
      int64_t tracker;
    };
    const std::vector<Step> steps = {
        {{1, 2, 3}, true, 8, 1},     {{0.5, 0.25, 1}, true, 8, 2}, {{1, kInf, 1}, false, 4, 0},
        {{1, 1, 1}, true, 4, 1},     {{2, 0, -2}, true, 4, 2},     {{1, 1, 1}, true, 8, 0},
        {{kNaN, 1, 1}, false, 4, 0}, {{-1, 3, 0.125}, true, 4, 1},
    };
    std::vector<double> want = {0, 0, 0};
    for (size_t s = 0; s < steps.size(); ++s) {
      SCOPED_TRACE("step " + std::to_string(s + 1));
      EXPECT_EQ(scaled_step(scaler, opt, p, steps[s].x, dev), steps[s].stepped);
      if (steps[s].stepped)
        for (int i = 0; i < 3; ++i) want[i] -= 0.5 * steps[s].x[i];
      EXPECT_EQ(scaler.get_scale(), steps[s].scale);
      EXPECT_EQ(scaler.growth_tracker(), steps[s].tracker);
      EXPECT_EQ(p.to_vector(), want) << "a skipped step must leave the parameters as they were";
    }
  }
}

// Any growth and backoff factor gives torch's scale bit for bit: the float
// scale times the double factor, rounded to float (torch's
// _amp_update_scale_). A float factor drifts from it within a few updates,
// which the reference below checks it would.
TEST(GradScaler, ScaleUpdateIsFloatTimesDoubleAsInPyTorch) {
  for (const Device& dev : devices()) {
    SCOPED_TRACE(::testing::Message() << dev);
    const double growth = 1.7, backoff = 0.3;
    Tensor scale = full({1}, 65536.0, {DType::Float32, dev});
    Tensor tracker = zeros({1}, {DType::Int32, dev});
    float want = 65536.0f, float_path = 65536.0f;
    bool drifted = false;
    // found_inf pattern: back off, back off, grow (interval 1), ...
    for (int i = 0; i < 12; ++i) {
      const bool inf = i % 3 != 2;
      Tensor found = full({1}, inf ? 1.0 : 0.0, {DType::Float32, dev});
      amp_update_scale_(scale, tracker, found, growth, backoff, 1);
      want = static_cast<float>(static_cast<double>(want) * (inf ? backoff : growth));
      float_path = float_path * static_cast<float>(inf ? backoff : growth);
      drifted = drifted || float_path != want;
      ASSERT_EQ(scale.cpu().to_vector()[0], static_cast<double>(want)) << "update " << i;
    }
    EXPECT_TRUE(drifted) << "the reference does not tell the two roundings apart";
  }
}

TEST(GradScaler, UnscaleGivesTheTrueGradientsOnce) {
  for (const Device& dev : devices()) {
    SCOPED_TRACE(::testing::Message() << dev);
    Tensor p = full({4}, 1.0, {DType::Float32, dev}).requires_grad_();
    SGD opt({p}, {.lr = 0.1});
    GradScaler scaler;  // 65536
    Tensor x = Tensor::from_vector({1.5, -2.0, 0.0, 1e-3}, {4}, {DType::Float32, dev});
    scaler.scale(sum(p * x)).backward();
    EXPECT_EQ(p.grad().to_vector()[0], 1.5 * 65536);
    scaler.unscale_(opt);
    EXPECT_EQ(p.grad().to_vector(), x.to_vector());
    EXPECT_THAT(error_of([&] { scaler.unscale_(opt); }), HasSubstr("already called on this optimizer"));
    EXPECT_TRUE(scaler.step(opt));  // uses the unscaled gradients, does not unscale again
    EXPECT_EQ(p.to_vector()[0], static_cast<float>(1.0 - 0.1 * 1.5));
    EXPECT_THAT(error_of([&] { scaler.step(opt); }), HasSubstr("already called on this optimizer since the last update"));
    EXPECT_THAT(error_of([&] { scaler.unscale_(opt); }), HasSubstr("called after step()"));
    scaler.update();
    EXPECT_EQ(scaler.growth_tracker(), 1);
  }
}

// The fused kernel on its own: mixed dtypes, several tensors, a strided one;
// found_inf is set by any non-finite element and never cleared.
TEST(GradScaler, FusedUnscaleKernelMatchesElementwiseMath) {
  for (const Device& dev : devices()) {
    for (DType dt : {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16}) {
      SCOPED_TRACE(::testing::Message() << dev << " " << dtype_name(dt));
      Generator gen(3);
      std::vector<Tensor> grads;
      for (int64_t n : {int64_t{1}, int64_t{5}, int64_t{40000}}) grads.push_back(randn({n}, DType::Float32, &gen).to(dev, dt));
      Tensor wide = randn({6, 4}, DType::Float32, &gen).to(dev, dt);
      grads.push_back(wide.transpose(0, 1));  // strided
      std::vector<Tensor> before;
      for (auto& g : grads) before.push_back(g.to(kCPU, DType::Float64).clone());  // to() may alias
      Tensor found = zeros({1}, {DType::Float32, dev});
      Tensor inv = full({1}, 0.25, {DType::Float32, dev});
      amp_unscale_(grads, found, inv);
      EXPECT_EQ(found.cpu().item(), 0.0);
      // Exact (a power of two), except where float16 results fall into its
      // subnormal range and round to a multiple of 2^-24.
      const double atol = dt == DType::Float16 ? std::ldexp(1.0, -25) : 0.0;
      for (size_t i = 0; i < grads.size(); ++i)
        EXPECT_TRUE(allclose(grads[i].to(kCPU, DType::Float64), before[i] * 0.25, 0, atol)) << "tensor " << i;
      // One non-finite element in the big tensor, at the end of a chunk.
      Tensor big = grads[2];
      big.narrow(0, 16383, 1).fill_(kInf);
      amp_unscale_(grads, found, inv);
      EXPECT_EQ(found.cpu().item(), 1.0);
      std::vector<Tensor> first = {grads[0]};
      amp_unscale_(first, found, inv);
      EXPECT_EQ(found.cpu().item(), 1.0) << "found_inf is never cleared by the kernel";
    }
  }
}

TEST(GradScaler, StateDictRoundTripContinuesIdentically) {
  for (const Device& dev : devices()) {
    SCOPED_TRACE(::testing::Message() << dev);
    auto run = [&](GradScaler& s, Tensor& p, SGD& opt, int from, int to) {
      for (int i = from; i < to; ++i) scaled_step(s, opt, p, {i % 4 == 2 ? kInf : 1.0, 2.0}, dev);
    };
    Tensor pa = zeros({2}, {DType::Float32, dev}).requires_grad_();
    SGD oa({pa}, {.lr = 0.1});
    GradScaler a({.init_scale = 1024, .growth_interval = 2});
    run(a, pa, oa, 0, 5);
    auto sd = a.state_dict();
    EXPECT_EQ(sd.size(), 5u);
    EXPECT_EQ(sd.at("scale"), a.get_scale());
    EXPECT_EQ(sd.at("_growth_tracker"), static_cast<double>(a.growth_tracker()));
    Tensor pb = pa.detach().clone().requires_grad_();
    SGD ob({pb}, {.lr = 0.1});
    GradScaler b;  // other defaults: everything comes from the state
    b.load_state_dict(sd);
    EXPECT_EQ(b.state_dict(), sd);
    run(a, pa, oa, 5, 11);
    run(b, pb, ob, 5, 11);
    EXPECT_EQ(a.state_dict(), b.state_dict());
    EXPECT_EQ(pa.to_vector(), pb.to_vector());
  }
}

TEST(GradScaler, DisabledPassesEverythingThrough) {
  Tensor p = full({2}, 1.0).requires_grad_();
  SGD opt({p}, {.lr = 0.5});
  GradScaler off({.enabled = false});
  Tensor loss = sum(p * 2.0);
  EXPECT_TRUE(off.scale(loss).is_same(loss));
  loss.backward();
  off.unscale_(opt);
  EXPECT_TRUE(off.step(opt));
  off.update();
  EXPECT_EQ(p.to_vector(), (std::vector<double>{0.0, 0.0}));
  EXPECT_EQ(off.get_scale(), 1.0);
  EXPECT_TRUE(off.state_dict().empty());
  EXPECT_FALSE(off.scale_tensor(kCPU).defined());
}

// scale_tensor: the live scale before any scale() (made there), the tensor
// scale() multiplies by and update() changes in place (so a holder of it
// follows a skipped step's back-off without reading it); asked for on
// another device than the one it lives on, a named error.
TEST(GradScaler, ScaleTensorIsTheLiveScale) {
  GradScaler s({.init_scale = 1024.0, .backoff_factor = 0.25});
  Tensor live = s.scale_tensor(kCPU);
  EXPECT_EQ(live.to_vector(), (std::vector<double>{1024.0}));
  Tensor p = zeros({2}, {DType::Float32}).requires_grad_();
  SGD opt({p}, {.lr = 0.5});
  EXPECT_FALSE(scaled_step(s, opt, p, {1.0, kInf}, kCPU));  // an inf: backed off
  EXPECT_EQ(live.to_vector(), (std::vector<double>{256.0}));
  EXPECT_TRUE(s.scale_tensor(kCPU).is_same(live));
  s.update(8.0);
  EXPECT_EQ(live.to_vector(), (std::vector<double>{8.0}));
  const std::string wrong = ::ember::testing::error_of([&] { s.scale_tensor(Device(DeviceType::CUDA, 0)); });
  EXPECT_NE(wrong.find("the scale lives on cpu"), std::string::npos) << wrong;
}

// Why scaling exists: a float16 gradient of 1e-8 is below float16's
// smallest subnormal (6e-8) and flushes to zero; scaled by 65536 it is
// 6.6e-4, kept, and unscaled in float32 it is 1e-8 again.
TEST(GradScaler, Float16GradientsUnderflowWithoutScalingAndSurviveWithIt) {
  for (const Device& dev : devices()) {
    SCOPED_TRACE(::testing::Message() << dev);
    auto grad_of = [&](GradScaler* scaler) {
      Tensor p = full({4}, 1.0, {DType::Float32, dev}).requires_grad_();  // float32 master weights
      SGD opt({p}, {.lr = 1.0});
      Tensor x = full({4}, 1e-4, {DType::Float16, dev});
      Tensor loss = sum((p.to(DType::Float16) * x).to(DType::Float32)) * 1e-4;  // float16 activations
      (scaler ? scaler->scale(loss) : loss).backward();
      if (scaler) scaler->unscale_(opt);
      return p.grad().to_vector();
    };
    for (double g : grad_of(nullptr)) EXPECT_EQ(g, 0.0) << "expected the float16 gradient to underflow";
    GradScaler scaler;
    for (double g : grad_of(&scaler)) EXPECT_NEAR(g, 1e-8, 1e-8 * 2e-3);
  }
}

// torch's recipe for clipping under a scaler (unscale_, clip_grad_norm_,
// step, update) with Adam and an LR scheduler, against the same training
// without a scaler, clipping the true gradients by hand and skipping the
// step whose gradient holds an inf. A skipped step leaves Adam's "step"
// count (its bias correction) where it was, while the scheduler, stepped by
// the user every iteration, advances as torch's does. The scale is a power
// of two, so scaling and unscaling are exact and the two runs agree to the
// bit.
// step_async hands found_inf to the optimizer's kernels: the same parameters,
// state and step counts as step()'s host read, over a run whose first step
// (SGD's momentum buffers are created then: decided on the host) and a later
// one overflow. One group's learning rate is a device tensor under a
// schedule.
TEST(GradScaler, StepAsyncSkipsOnTheDeviceAsStepDoes) {
  const std::vector<std::vector<double>> xs = {{1, kInf, 2, 3}, {1, 2, 3, 4}, {0.5, -1, 2, 1}, {kNaN, 1, 1, 1},
                                               {2, 1, -1, 0.25}};
  for (const Device& dev : devices()) {
    for (const char* kind : {"sgd", "adam"}) {
      SCOPED_TRACE(std::string(kind) + " on " + dev.str());
      Tensor p = full({4}, 1.0, {DType::Float32, dev}).requires_grad_();
      Tensor q = full({4}, 1.0, {DType::Float32, dev}).requires_grad_();
      auto make = [&](const Tensor& t, bool tensor_lr) -> std::unique_ptr<Optimizer> {
        ParamGroup g{{t}, {}};
        if (tensor_lr) g.lr_tensor = zeros({}, {DType::Float32, dev});
        if (std::string(kind) == "sgd")
          return std::make_unique<SGD>(std::vector<ParamGroup>{g}, SGDOptions{.lr = 0.125, .momentum = 0.5});
        return std::make_unique<Adam>(std::vector<ParamGroup>{g}, AdamOptions{.lr = 0.125});
      };
      auto a = make(p, true), b = make(q, false);
      StepLR sa(*a, 2, 0.5), sb(*b, 2, 0.5);
      GradScaler ga({.init_scale = 1024.0}), gb({.init_scale = 1024.0});
      for (size_t s = 0; s < xs.size(); ++s) {
        Tensor x = Tensor::from_vector(xs[s], {4}, {DType::Float32, dev});
        a->zero_grad();
        b->zero_grad();
        ga.scale(sum(p * x)).backward();
        gb.scale(sum(q * x)).backward();
        // SGD: not before its momentum buffers exist (the first step decides on the host).
        if (s == 0) {
          EXPECT_EQ(a->skips_on_device(), std::string(kind) == "adam");
        }
        ga.step_async(*a);
        gb.step(*b);
        ga.update();
        gb.update();
        sa.step();
        sb.step();
        EXPECT_EQ(p.cpu().to_vector(), q.cpu().to_vector()) << "step " << s;
        EXPECT_EQ(ga.get_scale(), gb.get_scale()) << "step " << s;
        EXPECT_EQ(a->param_groups()[0].lr_tensor.cpu().item(), a->param_groups()[0].lr()) << "step " << s;
      }
      EXPECT_TRUE(a->skips_on_device());
      if (std::string(kind) == "adam") {
        EXPECT_EQ(a->state(p).at("step").cpu().item(), 3.0);  // 5 steps, 2 skipped
      }
    }
  }
}

TEST(GradScaler, ClippingAfterUnscaleWithAdamAndASchedulerAsInPyTorch) {
  for (const Device& dev : devices()) {
    SCOPED_TRACE(::testing::Message() << dev);
    const std::vector<std::vector<double>> xs = {
        {3, -4, 0, 1}, {0.25, 0.5, -0.125, 0}, {1, kInf, 2, 3}, {-2, 1, 1, 0.5}, {0.1, 0.2, 0.3, 0.4}};
    Tensor p = full({4}, 1.0, {DType::Float32, dev}).requires_grad_();
    Tensor q = full({4}, 1.0, {DType::Float32, dev}).requires_grad_();
    Adam opt({p}, {.lr = 0.1}), opt_ref({q}, {.lr = 0.1});
    StepLR sched(opt, 1, 0.5), sched_ref(opt_ref, 1, 0.5);
    GradScaler scaler({.init_scale = 1024.0});
    int real_steps = 0;
    for (size_t s = 0; s < xs.size(); ++s) {
      SCOPED_TRACE("step " + std::to_string(s));
      Tensor x = Tensor::from_vector(xs[s], {4}, {DType::Float32, dev});
      opt.zero_grad();
      scaler.scale(sum(p * x)).backward();
      scaler.unscale_(opt);
      const double norm = clip_grad_norm_({p}, 1.0);
      const bool stepped = scaler.step(opt);
      scaler.update();
      sched.step();
      // The reference: the true gradient x, clipped by hand.
      double n2 = 0;
      for (double v : xs[s]) n2 += v * v;
      const double want_norm = std::sqrt(n2);
      EXPECT_EQ(stepped, std::isfinite(want_norm));
      if (std::isfinite(want_norm)) {
        EXPECT_NEAR(norm, want_norm, 1e-5 * want_norm) << "clip_grad_norm_ must see the unscaled gradients";
        opt_ref.zero_grad();
        sum(q * x).backward();
        if (want_norm > 1.0) {
          NoGradGuard ng;
          q.grad().copy_(q.grad() * (1.0 / (want_norm + 1e-6)));
        }
        opt_ref.step();
        ++real_steps;
      } else {
        EXPECT_FALSE(std::isfinite(norm));
      }
      sched_ref.step();
      EXPECT_EQ(opt.state(p).at("step").item(), real_steps) << "a skipped step must not count for Adam";
      EXPECT_EQ(sched.last_epoch(), static_cast<int64_t>(s + 1)) << "the scheduler advances per call, as torch's";
      EXPECT_EQ(sched.get_last_lr(), sched_ref.get_last_lr());
      const std::vector<double> got = p.to_vector(), want = q.to_vector();
      for (int i = 0; i < 4; ++i) EXPECT_NEAR(got[i], want[i], 1e-6) << "element " << i;
    }
    EXPECT_EQ(scaler.get_scale(), 512.0) << "one back-off";
  }
}

TEST(GradScaler, MisuseIsANamedError) {
  Tensor p = full({2}, 1.0).requires_grad_();
  SGD opt({p}, {.lr = 0.1});
  GradScaler scaler;
  EXPECT_THAT(error_of([&] { scaler.unscale_(opt); }), HasSubstr("nothing was scaled yet"));
  scaler.scale(sum(p * 2.0));  // scaled, but no backward: no gradients
  EXPECT_THAT(error_of([&] { scaler.step(opt); }), HasSubstr("none of its parameters has a gradient"));
  GradScaler fresh;
  EXPECT_THAT(error_of([&] { fresh.update(); }), HasSubstr("no inf checks were recorded since the last update()"));
  EXPECT_THAT(error_of([&] { fresh.scale(Tensor::from_vector({1.0}, {1}, DType::Int64)); }),
              HasSubstr("only floating-point losses"));
  EXPECT_THAT(error_of([&] { fresh.load_state_dict({}); }), HasSubstr("state is empty"));
  auto sd = fresh.state_dict();
  auto bad = sd;
  bad["loss_scale"] = 2;  // another format's key
  EXPECT_THAT(error_of([&] { fresh.load_state_dict(bad); }), HasSubstr("unknown key 'loss_scale'"));
  bad = sd;
  bad.erase("_growth_tracker");
  EXPECT_THAT(error_of([&] { fresh.load_state_dict(bad); }), HasSubstr("missing key '_growth_tracker'"));
  bad = sd;
  bad["_growth_tracker"] = 5000;
  EXPECT_THAT(error_of([&] { fresh.load_state_dict(bad); }), HasSubstr("_growth_tracker 5000 must be an integer"));
  bad = sd;
  bad["scale"] = -1;
  EXPECT_THAT(error_of([&] { fresh.load_state_dict(bad); }), HasSubstr("scale must be a positive finite number"));
  EXPECT_EQ(fresh.state_dict(), sd) << "a refused state changes nothing";
  EXPECT_THAT(error_of([] { GradScaler({.growth_factor = 0.5}); }), HasSubstr("growth_factor must be > 1"));
  EXPECT_THAT(error_of([] { GradScaler({.backoff_factor = 1.5}); }), HasSubstr("backoff_factor must be in (0, 1)"));
  Tensor found = zeros({1});
  std::vector<Tensor> ints = {Tensor::from_vector({1.0}, {1}, DType::Int32)};
  EXPECT_THAT(error_of([&] { amp_unscale_(ints, found, full({1}, 1.0)); }), HasSubstr("gradients are floating point"));
  std::vector<Tensor> ok = {full({1}, 1.0)};
  Tensor wrong = zeros({2});
  EXPECT_THAT(error_of([&] { amp_unscale_(ok, wrong, full({1}, 1.0)); }),
              HasSubstr("found_inf must be a one-element float32 tensor"));
}

}  // namespace
}  // namespace ember::optim
