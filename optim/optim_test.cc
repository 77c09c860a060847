// Optimizers, schedulers and clipping against float64 references written out
// here (torch's update rules, step by step), checkpoint round trips that must
// resume bit-exactly, the errors users hit, and one end-to-end fit.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <numbers>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "core/ops_optim.h"
#include "optim/clip_grad.h"
#include "optim/lr_scheduler.h"
#include "optim/optimizer.h"

namespace ember::optim {
namespace {

using V = std::vector<double>;

Tensor param(V v, DType t = DType::Float64) {
  const auto n = static_cast<int64_t>(v.size());
  return Tensor::from_vector(v, {n}, t).requires_grad_();
}

void set_grad(const Tensor& p, const V& g) { p.set_grad(Tensor::from_vector(g, p.sizes(), p.dtype())); }

void expect_vec(const Tensor& t, const V& want, double tol) {
  auto got = t.to_vector();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], tol * std::max(1.0, std::abs(want[i]))) << i;
}

template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// The gradients fed on steps 1..3 (shrinking, so amsgrad's max matters).
const std::vector<V> kGrads = {{0.5, -1.0, 2.0}, {0.3, -0.2, -1.5}, {-0.1, 0.05, 0.4}};
const V kInit = {1.0, -2.0, 0.5};

// ---- float64 references: torch.optim's single-tensor updates ----
struct SgdRef {
  double lr, momentum = 0, dampening = 0, wd = 0;
  bool nesterov = false;
  V p = kInit, buf = {};
  void step(const V& g) {
    const bool first = buf.empty();
    buf.resize(p.size());
    for (size_t i = 0; i < p.size(); ++i) {
      double d = g[i];
      if (wd != 0) d = d + wd * p[i];
      if (momentum != 0) {
        buf[i] = first ? d : buf[i] * momentum + (1 - dampening) * d;
        d = nesterov ? d + momentum * buf[i] : buf[i];
      }
      p[i] = p[i] - lr * d;
    }
  }
};

struct AdamRef {
  double lr, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0;
  bool amsgrad = false, decoupled = false;
  V p = kInit, m = V(3, 0.0), v = V(3, 0.0), vmax = V(3, 0.0);
  int t = 0;
  void step(const V& grad) {
    ++t;
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      double g = grad[i];
      if (wd != 0 && decoupled) p[i] = p[i] * (1 - lr * wd);
      if (wd != 0 && !decoupled) g = g + wd * p[i];
      m[i] = m[i] + (1 - b1) * (g - m[i]);
      v[i] = v[i] * b2 + (1 - b2) * g * g;
      vmax[i] = std::max(vmax[i], v[i]);
      const double denom = std::sqrt(amsgrad ? vmax[i] : v[i]) / std::sqrt(bc2) + eps;
      p[i] = p[i] - (lr / bc1) * m[i] / denom;
    }
  }
};

template <typename Ref>
void run_against(Optimizer& opt, const Tensor& p, Ref ref, double tol) {
  for (const V& g : kGrads) {
    set_grad(p, g);
    opt.step();
    ref.step(g);
    expect_vec(p, ref.p, tol);
  }
}

TEST(SGD, HandValuesMomentumAndNesterov) {
  // p = 1, g = 1 each step, lr 0.1, momentum 0.9: buf 1, 1.9, 2.71.
  for (bool nesterov : {false, true}) {
    Tensor p = param({1.0});
    SGD opt({p}, {.lr = 0.1, .momentum = 0.9, .nesterov = nesterov});
    V want = nesterov ? V{0.81, 0.539, 0.1951} : V{0.9, 0.71, 0.439};
    for (double w : want) {
      set_grad(p, {1.0});
      opt.step();
      expect_vec(p, {w}, 1e-14);
    }
  }
}

TEST(SGD, MatchesReference) {
  for (SGDOptions o : {SGDOptions{.lr = 0.1}, SGDOptions{.lr = 0.1, .weight_decay = 0.01},
                       SGDOptions{.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01},
                       SGDOptions{.lr = 0.05, .momentum = 0.8, .weight_decay = 0.1, .nesterov = true}}) {
    for (DType dt : {DType::Float64, DType::Float32}) {
      Tensor p = param(kInit, dt);
      SGD opt({p}, o);
      run_against(opt, p, SgdRef{.lr = o.lr, .momentum = o.momentum, .dampening = o.dampening, .wd = o.weight_decay, .nesterov = o.nesterov},
                  dt == DType::Float64 ? 1e-14 : 1e-6);
    }
  }
}

TEST(SGD, MaximizeAscends) {
  Tensor p = param({1.0});
  SGD opt({p}, {.lr = 0.1, .maximize = true});
  set_grad(p, {2.0});
  opt.step();
  expect_vec(p, {1.2}, 1e-15);
}

TEST(Adam, HandValuesFirstStep) {
  // First step: m = 0.1 g, v = 0.001 g^2, both bias-corrected back to g and
  // g^2, so the update is lr * g / (|g| + eps) = lr for g > 0.
  Tensor p = param({1.0});
  Adam opt({p}, {.lr = 0.1});
  set_grad(p, {2.0});
  opt.step();
  expect_vec(p, {0.9}, 1e-8);
  // AdamW first shrinks p by 1 - lr * wd = 0.99.
  Tensor q = param({1.0});
  AdamW optw({q}, {.lr = 0.1, .weight_decay = 0.1});
  set_grad(q, {2.0});
  optw.step();
  expect_vec(q, {0.89}, 1e-8);
  EXPECT_EQ(AdamW({param({1.0})}).defaults().at("weight_decay"), 1e-2);
  EXPECT_EQ(Adam({param({1.0})}).defaults().at("weight_decay"), 0.0);
}

TEST(Adam, MatchesReferenceWithWeightDecayAndAmsgrad) {
  for (bool amsgrad : {false, true})
    for (double wd : {0.0, 0.1})
      for (DType dt : {DType::Float64, DType::Float32}) {
        const double tol = dt == DType::Float64 ? 1e-13 : 2e-6;
        Tensor p = param(kInit, dt);
        Adam opt({p}, {.lr = 0.01, .beta1 = 0.8, .weight_decay = wd, .amsgrad = amsgrad});
        AdamRef ref{.lr = 0.01, .b1 = 0.8, .wd = wd, .amsgrad = amsgrad};
        run_against(opt, p, ref, tol);
        EXPECT_EQ(opt.state(p).at("step").item(), 3.0);
        EXPECT_EQ(opt.state(p).count("max_exp_avg_sq"), amsgrad ? 1u : 0u);

        Tensor q = param(kInit, dt);
        AdamW optw({q}, {.lr = 0.01, .weight_decay = wd + 0.05, .amsgrad = amsgrad});
        run_against(optw, q, AdamRef{.lr = 0.01, .wd = wd + 0.05, .amsgrad = amsgrad, .decoupled = true}, tol);
      }
}

TEST(Adam, LateParametersKeepTheirOwnStepCount) {
  Tensor a = param(kInit), b = param(kInit);
  Adam opt({a, b}, {.lr = 0.01});
  AdamRef ra{.lr = 0.01}, rb{.lr = 0.01};
  for (size_t s = 0; s < kGrads.size(); ++s) {
    set_grad(a, kGrads[s]);
    ra.step(kGrads[s]);
    if (s > 0) {  // b's first gradient arrives on step 2
      set_grad(b, kGrads[s]);
      rb.step(kGrads[s]);
    }
    opt.step();
    expect_vec(a, ra.p, 1e-13);
    expect_vec(b, rb.p, 1e-13);
  }
  EXPECT_EQ(opt.state(b).at("step").item(), 2.0);
}

TEST(Adam, ThreadedLargeTensorMatchesPiecewise) {
  // 3 x 50000 elements: parallel_for splits each across threads; the same
  // update on 1000-element pieces (one thread each) must agree bit for bit.
  manual_seed(3);
  auto make = [](int64_t n) { return std::vector<Tensor>{randn({n}), randn({n}), zeros({n}), zeros({n}), zeros({n})}; };
  std::vector<Tensor> big = make(150000);
  std::vector<std::vector<Tensor>> pieces;
  for (int64_t s = 0; s < 150000; s += 1000) {
    pieces.emplace_back();
    for (const Tensor& t : big) pieces.back().push_back(t.narrow(0, s, 1000).clone());
  }
  auto run = [](std::vector<Tensor>& t, int64_t step) {
    std::vector<Tensor> p{t[0]}, g{t[1]}, m{t[2]}, v{t[3]}, x{t[4]};
    adam_step_(p, g, m, v, x, {.lr = 0.01, .weight_decay = 0.1, .amsgrad = true, .step = step});
  };
  for (int64_t step = 1; step <= 2; ++step) {
    run(big, step);
    for (auto& piece : pieces) run(piece, step);
  }
  std::vector<Tensor> joined;
  for (auto& piece : pieces) joined.push_back(piece[0]);
  EXPECT_EQ(cat(joined).to_vector(), big[0].to_vector());
}

TEST(Optimizer, StateSurvivesFreeingAndRestoringAParameter) {
  // FSDP frees parameters between uses: the optimizer keeps the same state
  // for the same handle, and the result equals a run that never freed.
  Tensor a = param({1, -2, 3}), b = param({1, -2, 3});
  Adam oa({a}, {.lr = 0.1}), ob({b}, {.lr = 0.1});
  for (int step = 0; step < 3; ++step) {
    set_grad(a, {0.5, -1, 2});
    set_grad(b, {0.5, -1, 2});
    oa.step();
    ob.step();
    std::vector<double> keep = b.to_vector();
    b.free_storage();
    b.restore_storage();
    NoGradGuard g;
    b.copy_(Tensor::from_vector(keep, b.sizes(), b.dtype()));
  }
  expect_vec(b, a.to_vector(), 0);
  EXPECT_DOUBLE_EQ(ob.state(b).at("step").item(), 3);
  expect_vec(ob.state(b).at("exp_avg"), oa.state(a).at("exp_avg").to_vector(), 0);
}

TEST(Optimizer, SixteenBitParametersStepThroughAFloat32Master) {
  // Updates of ~1e-4 on values near 1: below bfloat16's spacing there
  // (2^-7), so a bfloat16-only step would leave the parameter at 1 forever.
  // The master copy takes exactly the float32 run's values, and the
  // parameter is that master rounded.
  for (DType dt : {DType::BFloat16, DType::Float16}) {
    for (const char* kind : {"adam", "sgd"}) {
      Tensor low = Tensor::from_vector({1, -1, 0.5}, {3}, dt).requires_grad_();
      Tensor ref = Tensor::from_vector({1, -1, 0.5}, {3}, DType::Float32).requires_grad_();
      std::unique_ptr<Optimizer> a, b;
      if (std::string(kind) == "adam") {
        a = std::make_unique<Adam>(std::vector<Tensor>{low}, AdamOptions{.lr = 1e-4});
        b = std::make_unique<Adam>(std::vector<Tensor>{ref}, AdamOptions{.lr = 1e-4});
      } else {
        a = std::make_unique<SGD>(std::vector<Tensor>{low}, SGDOptions{.lr = 1e-4, .momentum = 0.9});
        b = std::make_unique<SGD>(std::vector<Tensor>{ref}, SGDOptions{.lr = 1e-4, .momentum = 0.9});
      }
      for (int s = 0; s < 100; ++s) {
        // Gradients representable in both dtypes, so both runs see the same.
        low.set_grad(Tensor::from_vector({0.5, -0.25, 1}, {3}, dt));
        ref.set_grad(Tensor::from_vector({0.5, -0.25, 1}, {3}, DType::Float32));
        a->step();
        b->step();
      }
      const auto& st = a->state(low);
      ASSERT_TRUE(st.count("master_param")) << kind;
      EXPECT_EQ(st.at("master_param").dtype(), DType::Float32);
      for (const auto& [name, t] : st)
        if (name != "step") {
          EXPECT_EQ(t.dtype(), DType::Float32) << kind << " " << name;
        }
      EXPECT_EQ(st.at("master_param").to_vector(), ref.to_vector()) << kind;
      EXPECT_EQ(low.to_vector(), ref.to(dt).to_vector()) << kind;
      EXPECT_NE(low.to_vector()[0], 1.0) << kind << ": the small updates were lost";
      // A checkpoint round trip keeps the master and the float32 state.
      std::unique_ptr<Optimizer> c;
      Tensor again = low.detach().clone().requires_grad_();
      if (std::string(kind) == "adam") c = std::make_unique<Adam>(std::vector<Tensor>{again}, AdamOptions{.lr = 1e-4});
      else c = std::make_unique<SGD>(std::vector<Tensor>{again}, SGDOptions{.lr = 1e-4, .momentum = 0.9});
      c->load_state_dict(a->state_dict());
      EXPECT_EQ(c->state(again).at("master_param").to_vector(), ref.to_vector());
      EXPECT_EQ(c->state(again).at("master_param").dtype(), DType::Float32);
    }
  }
}

// Within rel of each other element for element (relative to the larger
// magnitude, at least 1), NaN for NaN.
void expect_near_nan(const Tensor& got, const Tensor& want, double rel, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  const V a = got.to_vector(), b = want.to_vector();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) {
      ASSERT_TRUE(std::isnan(a[i]) && std::isnan(b[i])) << what << " element " << i << ": " << a[i] << " vs " << b[i];
      continue;
    }
    ASSERT_LE(std::abs(a[i] - b[i]), rel * std::max({1.0, std::abs(a[i]), std::abs(b[i])}))
        << what << " element " << i << ": " << a[i] << " vs " << b[i];
  }
}

// The fused steps' float32 masters (model_params) against the op-by-op
// composition they replace: the master re-seeded where its 16-bit
// parameter was written from outside (a value and a NaN), the gradient
// cast to float32, a float32 step, the master copied back rounded. The same
// float32 arithmetic in the same order, up to the compiler's contraction
// into FMAs, which differs between the two loops (a float32 ulp or two; a
// 16-bit parameter rounded across a boundary: one of its ulps). One call holds a
// bfloat16 and a float16 master and a float32 parameter of its own; a
// found_inf step moves nothing.
TEST(Optimizer, MastersStepInOnePassAsTheOpByOpComposition) {
  for (const char* kind : {"adam", "sgd"}) {
    Generator gen(11);
    const std::vector<DType> lows = {DType::BFloat16, DType::Float32, DType::Float16};
    const std::vector<int64_t> sizes = {7, 5, 70001};  // the last split between threads, in stages
    std::vector<Tensor> low, master, plain_ref, master_ref, low_ref;
    for (size_t i = 0; i < lows.size(); ++i) {
      Tensor x = randn({sizes[i]}, {}, &gen).to(lows[i]);
      low.push_back(x);
      low_ref.push_back(x.clone());
      // A master a little off its parameter, as after real steps.
      Tensor m = x.to(DType::Float32) + randn({sizes[i]}, {}, &gen) * 1e-4;
      if (lows[i] == DType::Float32)
        m = x;  // no master: the parameter steps itself
      else
        m = where(eq(m.to(lows[i]).to(DType::Float32), x.to(DType::Float32)), m, x.to(DType::Float32));
      master.push_back(m);
      master_ref.push_back(m.clone());
      // A float32 parameter is its own "master".
      if (lows[i] == DType::Float32) low_ref.back() = master_ref.back();
    }
    std::vector<Tensor> model(lows.size());
    for (size_t i = 0; i < lows.size(); ++i)
      if (lows[i] != DType::Float32) model[i] = low[i];
    auto state = [&] {
      std::vector<Tensor> v;
      for (const Tensor& m : master) v.push_back(zeros_like(m));
      return v;
    };
    std::vector<Tensor> m = state(), v = state(), x = state(), m_ref = state(), v_ref = state(), x_ref = state();
    std::vector<Tensor> buf(lows.size()), buf_ref(lows.size());
    for (int step = 1; step <= 4; ++step) {
      if (step == 3) {
        // Written from outside: a value and a NaN.
        for (size_t i = 0; i < lows.size(); ++i) {
          if (lows[i] == DType::Float32) continue;
          for (Tensor* t : {&low[i], &low_ref[i]}) {
            t->narrow(0, 1, 2).fill_(0.375);
            t->narrow(0, 4, 1).fill_(std::nan(""));
          }
        }
      }
      std::vector<Tensor> g, g_ref;
      for (size_t i = 0; i < lows.size(); ++i) {
        g.push_back(randn({sizes[i]}, {}, &gen).to(lows[i]));
        g_ref.push_back(g.back().to(DType::Float32));
      }
      const Tensor found_inf = full({}, step == 2 ? 1.0 : 0.0, DType::Float32);
      // The composition, on the masters' copies.
      if (step != 2) {
        for (size_t i = 0; i < lows.size(); ++i) {
          if (lows[i] == DType::Float32) continue;
          Tensor& mr = master_ref[i];
          mr.copy_(where(ne(low_ref[i], mr.to(lows[i])), low_ref[i].to(DType::Float32), mr));
        }
      }
      std::vector<Tensor> ref_params = master_ref;
      const uint64_t version = low[0].storage_version();
      if (std::string(kind) == "adam") {
        AdamArgs a{.lr = 1e-2, .weight_decay = 0.1, .decoupled = true, .amsgrad = true};
        a.found_inf = found_inf;
        a.step = step;
        adam_step_(ref_params, g_ref, m_ref, v_ref, x_ref, a);
        a.model_params = model;
        adam_step_(master, g, m, v, x, a);
      } else {
        SgdArgs a{{.lr = 1e-2, .momentum = 0.9, .weight_decay = 0.01}};
        if (step > 1) a.found_inf = found_inf;  // the first step makes the buffers
        sgd_step_(ref_params, g_ref, buf_ref, a);
        a.model_params = model;
        sgd_step_(master, g, buf, a);
      }
      EXPECT_GT(low[0].storage_version(), version) << kind << ": the step wrote the 16-bit parameter";
      if (step != 2)
        for (size_t i = 0; i < lows.size(); ++i)
          if (lows[i] != DType::Float32) low_ref[i].copy_(master_ref[i]);
      for (size_t i = 0; i < lows.size(); ++i) {
        const std::string what = std::string(kind) + " step " + std::to_string(step) + " tensor " + std::to_string(i);
        const double ulp = lows[i] == DType::BFloat16 ? 0x1p-7 : lows[i] == DType::Float16 ? 0x1p-10 : 1e-6;
        expect_near_nan(master[i], master_ref[i], 1e-6, what + " master");
        expect_near_nan(low[i], low_ref[i], ulp, what + " parameter");
        if (std::string(kind) == "adam") {
          expect_near_nan(m[i], m_ref[i], 1e-6, what + " exp_avg");
          expect_near_nan(x[i], x_ref[i], 1e-6, what + " max_exp_avg_sq");
        } else {
          expect_near_nan(buf[i], buf_ref[i], 1e-6, what + " momentum");
        }
      }
    }
    // The NaN written from outside went into the master; the value too.
    EXPECT_TRUE(std::isnan(master[0].to_vector()[4])) << kind;
    EXPECT_NE(master[2].to_vector()[1], 0.375) << kind << ": stepped after the re-seed";
  }
  // What the masters' arguments must be, named.
  std::vector<Tensor> p{zeros({3})}, g{zeros({3}, DType::BFloat16)}, m{zeros({3})}, v{zeros({3})}, none;
  AdamArgs a;
  a.model_params = {zeros({3})};
  expect_error([&] { adam_step_(p, g, m, v, none, a); }, "model_params 0 has dtype float32; only float16 and bfloat16");
  a.model_params = {zeros({4}, DType::BFloat16)};
  expect_error([&] { adam_step_(p, g, m, v, none, a); }, "model_params 0 ([4] on cpu) does not match its master");
  a.model_params = {zeros({3}, DType::BFloat16), zeros({3}, DType::BFloat16)};
  expect_error([&] { adam_step_(p, g, m, v, none, a); }, "expected one entry of model_params per parameter (1), got 2");
  a.model_params = {zeros({3}, DType::Float16)};
  expect_error([&] { adam_step_(p, g, m, v, none, a); }, "gradient 0 ([3] bfloat16 on cpu) does not match parameter 0");
  std::vector<Tensor> p64{zeros({3}, DType::Float64)}, m64{zeros({3}, DType::Float64)}, v64{zeros({3}, DType::Float64)};
  a.model_params = {zeros({3}, DType::BFloat16)};
  expect_error([&] { adam_step_(p64, g, m64, v64, none, a); },
               "parameter 0 is the master of a bfloat16 model parameter and must be float32, got float64");
}

// A channels-last parameter (a convolution weight stored OHWI) steps in
// place as a flat array: the same values as the contiguous run, element for
// element, with its state laid out as it is, for SGD, Adam(W) and a 16-bit
// parameter's master; a gradient in the other layout is read through a copy.
// A parameter neither contiguous nor channels-last is a named error.
TEST(Optimizer, ChannelsLastParametersStepAsTheContiguousRun) {
  const Shape shape{4, 3, 2, 5};
  for (DType dt : {DType::Float32, DType::BFloat16}) {
    for (const char* kind : {"sgd", "adamw"}) {
      Generator gen(3);
      Tensor init = randn(shape, {}, &gen).to(dt);
      Tensor plain = init.clone().requires_grad_();
      Tensor cl = init.contiguous(MemoryFormat::ChannelsLast).requires_grad_();
      ASSERT_FALSE(cl.is_contiguous());
      auto make = [&](const Tensor& p) -> std::unique_ptr<Optimizer> {
        if (std::string(kind) == "sgd")
          return std::make_unique<SGD>(std::vector<Tensor>{p},
                                       SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-2});
        return std::make_unique<AdamW>(std::vector<Tensor>{p}, AdamWOptions{.lr = 0.01, .amsgrad = true});
      };
      // `late` is laid out channels-last after its first step (as
      // Module::to(ChannelsLast) does, set_data): its state follows.
      Tensor late = init.clone().requires_grad_();
      auto a = make(plain), b = make(cl), l = make(late);
      for (int s = 0; s < 3; ++s) {
        Tensor g = randn(shape, {}, &gen).to(dt);
        plain.set_grad(g.clone());
        // Step 1 in the parameter's layout, then a contiguous gradient.
        cl.set_grad(s == 0 ? g.contiguous(MemoryFormat::ChannelsLast) : g.clone());
        if (s == 1) late.set_data(late.detach().contiguous(MemoryFormat::ChannelsLast));
        late.set_grad(g.clone());
        a->step();
        b->step();
        l->step();
      }
      const std::string what = std::string(kind) + " " + dtype_name(dt);
      EXPECT_EQ(plain.to_vector(), cl.to_vector()) << what;
      EXPECT_EQ(plain.to_vector(), late.to_vector()) << what << ", laid out after a step";
      for (const auto& [name, t] : l->state(late))
        if (name != "step") EXPECT_TRUE(t.is_contiguous(MemoryFormat::ChannelsLast)) << what << " late " << name;
      EXPECT_TRUE(cl.is_contiguous(MemoryFormat::ChannelsLast)) << what << ": the step moved the parameter";
      for (const auto& [name, t] : b->state(cl)) {
        if (name == "step") continue;
        EXPECT_TRUE(t.is_contiguous(MemoryFormat::ChannelsLast))
            << what << " " << name << " " << shape_str(t.strides());
        EXPECT_EQ(t.to_vector(), a->state(plain).at(name).to_vector()) << what << " " << name;
      }
      // A checkpoint loads into a channels-last parameter's layout.
      Tensor again = cl.detach().clone().contiguous(MemoryFormat::ChannelsLast).requires_grad_();
      auto c = make(again);
      c->load_state_dict(a->state_dict());
      for (const auto& [name, t] : c->state(again))
        if (name != "step") EXPECT_TRUE(t.is_contiguous(MemoryFormat::ChannelsLast)) << what << " loaded " << name;
    }
  }
  Tensor odd = zeros({3, 4}).t().requires_grad_();
  SGD sgd({odd}, SGDOptions{.lr = 0.1});
  odd.set_grad(zeros({4, 3}));
  expect_error([&] { sgd.step(); }, "neither contiguous nor channels-last");
}

TEST(Optimizer, ATensorLearningRateFollowsTheScheduleAndSkipsWithFoundInf) {
  // A group whose learning rate is a tensor (read by the kernel) against the
  // same optimizer with the host's double, under StepLR; then
  // step_unless_inf with a set flag moves nothing (state and step count
  // included) and with a clear flag is a step.
  for (const char* kind : {"sgd", "adam", "adamw"}) {
    Tensor a = param({1, -2, 3}, DType::Float32), b = param({1, -2, 3}, DType::Float32);
    auto make = [&](const Tensor& p, bool tensor_lr) -> std::unique_ptr<Optimizer> {
      ParamGroup g{{p}, {}};
      if (tensor_lr) g.lr_tensor = zeros({}, DType::Float32);
      if (std::string(kind) == "sgd")
        return std::make_unique<SGD>(std::vector<ParamGroup>{g}, SGDOptions{.lr = 0.25, .momentum = 0.9});
      if (std::string(kind) == "adam") return std::make_unique<Adam>(std::vector<ParamGroup>{g}, AdamOptions{.lr = 0.25});
      return std::make_unique<AdamW>(std::vector<ParamGroup>{g}, AdamWOptions{.lr = 0.25});
    };
    auto oa = make(a, true), ob = make(b, false);
    EXPECT_EQ(oa->param_groups()[0].lr_tensor.item(), 0.25) << "add_param_group fills the tensor";
    StepLR sa(*oa, 1, 0.5), sb(*ob, 1, 0.5);
    for (int s = 0; s < 4; ++s) {
      set_grad(a, {0.5, -1, 2 + s});
      set_grad(b, {0.5, -1, 2 + s});
      oa->step();
      ob->step();
      sa.step();
      sb.step();
      expect_vec(a, b.to_vector(), 0);
      EXPECT_EQ(oa->param_groups()[0].lr_tensor.item(), ob->param_groups()[0].lr()) << kind;
    }
    // Changing the tensor alone changes the step: the kernel reads it.
    oa->param_groups()[0].lr_tensor.fill_(0.0);
    const std::vector<double> keep = a.to_vector();
    set_grad(a, {1, 1, 1});
    oa->step();
    if (std::string(kind) != "adamw") {
      expect_vec(a, keep, 0);  // lr 0 (AdamW's decay is lr-scaled too)
    }
    // found_inf set: nothing moves.
    set_lr(oa->param_groups()[0], 0.1);
    const std::vector<double> p0 = a.to_vector();
    std::map<std::string, std::vector<double>> st0;
    for (const auto& [n, t] : oa->state(a)) st0[n] = t.to_vector();
    set_grad(a, {3, 3, 3});
    oa->step_unless_inf(full({}, 1.0, DType::Float32));
    expect_vec(a, p0, 0);
    for (const auto& [n, t] : oa->state(a)) EXPECT_EQ(t.to_vector(), st0[n]) << kind << " " << n;
    oa->step_unless_inf(full({}, 0.0, DType::Float32));
    EXPECT_NE(a.to_vector(), p0) << kind;
  }
}

TEST(Optimizer, SkipsMissingGradsAndZeroGrad) {
  Tensor a = param({1, 2}), b = param({3, 4});
  SGD opt({a, b}, {.lr = 0.5, .momentum = 0.9});
  set_grad(a, {1, 1});
  opt.step();
  expect_vec(a, {0.5, 1.5}, 0);
  expect_vec(b, {3, 4}, 0);
  EXPECT_TRUE(opt.state(b).empty());
  opt.zero_grad(false);
  expect_vec(a.grad(), {0, 0}, 0);
  EXPECT_FALSE(b.grad().defined());
  opt.zero_grad();
  EXPECT_FALSE(a.grad().defined());
}

TEST(Optimizer, ParamGroupsAndMixedDtypes) {
  Tensor a = param({1.0}), b = param({1.0}, DType::Float32), c = param({1.0});
  SGD opt(std::vector<ParamGroup>{{{a, b}, {}}, {{c}, {{"lr", 0.01}}}}, SGDOptions{.lr = 0.1});
  EXPECT_EQ(opt.param_groups()[0].lr(), 0.1);
  EXPECT_EQ(opt.param_groups()[1].lr(), 0.01);
  EXPECT_EQ(opt.param_groups()[1].options.at("momentum"), 0.0);
  for (const Tensor& p : {a, b, c}) set_grad(p, {1.0});
  opt.step();
  expect_vec(a, {0.9}, 1e-15);
  expect_vec(b, {0.9}, 1e-7);
  expect_vec(c, {0.99}, 1e-15);
  Tensor d = param({5.0});
  opt.add_param_group({{d}, {{"lr", 1.0}}});
  set_grad(d, {1.0});
  opt.step();
  expect_vec(d, {4.0}, 0);
}

TEST(Optimizer, ConstructionErrors) {
  Tensor a = param({1.0});
  expect_error([&] { SGD(std::vector<Tensor>{}); }, "empty parameter list");
  expect_error([&] { SGD({a, a}); }, "more than once");
  expect_error([&] { SGD(std::vector<ParamGroup>{{{a}, {{"momentun", 0.9}}}}, {}); }, "unknown option 'momentun'");
  expect_error([&] { SGD({a}, {.lr = 0.1, .nesterov = true}); }, "Nesterov momentum requires");
  expect_error([&] { SGD({a}, {.lr = -1}); }, "invalid learning rate");
  expect_error([&] { Adam({a}, {.beta2 = 1.0}); }, "invalid beta parameter at index 1");
  expect_error([&] { SGD({a * 2.0}); }, "not a leaf");
  expect_error([&] { SGD({Tensor::from_vector({1}, {1}, DType::Int64)}); }, "only floating");
  // The fused op refuses what it cannot update in place, naming the operand.
  std::vector<Tensor> ps{zeros({2, 3}).t()}, gs{zeros({3, 2})}, bufs{Tensor()};
  expect_error([&] { sgd_step_(ps, gs, bufs, {{.lr = 0.1, .momentum = 0.9}}); }, "parameter 0 [3,2] with strides");
  std::vector<Tensor> qs{zeros({3})}, hs{zeros({2})};
  expect_error([&] { sgd_step_(qs, hs, bufs, {{.lr = 0.1, .momentum = 0.9}}); }, "gradient 0 ([2] float32");
}

// ---- state_dict: 3 steps, checkpoint, fresh optimizer, 2 steps == 5 steps ----

// Grads come from a real backward so they depend on the parameters.
void train(Optimizer& opt, const Tensor& w, const Tensor& b, int steps) {
  Tensor x = Tensor::from_vector({0.5, -1.0, 2.0, 0.25, 1.5, -0.75}, {2, 3}, w.dtype());
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    Tensor y = matmul(x, w) + b;  // [2, 2]
    sum(y * y * 0.5 + tanh(y)).backward();
    opt.step();
  }
}

template <typename Make>
void check_resume(Make make, DType dt) {
  auto fresh = [&] {
    Tensor w = Tensor::from_vector({0.1, -0.2, 0.3, 0.4, -0.5, 0.6}, {3, 2}, dt).requires_grad_();
    Tensor b = Tensor::from_vector({0.05, -0.05}, {2}, dt).requires_grad_();
    return std::pair{w, b};
  };
  auto [w5, b5] = fresh();
  auto opt5 = make(std::vector<Tensor>{w5, b5});
  train(*opt5, w5, b5, 5);

  auto [w, b] = fresh();
  auto opt = make(std::vector<Tensor>{w, b});
  train(*opt, w, b, 3);
  OptimizerStateDict sd = opt->state_dict();
  // As a checkpoint would: copies of the tensors and numbers only.
  for (auto& [name, t] : sd.state) t = t.clone();
  Tensor w2 = w.detach().clone().requires_grad_(), b2 = b.detach().clone().requires_grad_();
  opt.reset();
  auto opt2 = make(std::vector<Tensor>{w2, b2});
  opt2->load_state_dict(sd);
  train(*opt2, w2, b2, 2);
  EXPECT_EQ(w2.to_vector(), w5.to_vector());
  EXPECT_EQ(b2.to_vector(), b5.to_vector());
  EXPECT_EQ(opt2->state_dict().state.size(), opt5->state_dict().state.size());
}

TEST(StateDict, ResumesBitExactly) {
  for (DType dt : {DType::Float32, DType::Float64}) {
    check_resume([](std::vector<Tensor> p) {
      return std::make_unique<SGD>(p, SGDOptions{.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 1e-3});
    }, dt);
    check_resume([](std::vector<Tensor> p) {
      return std::make_unique<Adam>(p, AdamOptions{.lr = 0.01, .weight_decay = 0.1, .amsgrad = true});
    }, dt);
    check_resume([](std::vector<Tensor> p) { return std::make_unique<AdamW>(p, AdamWOptions{.lr = 0.01}); }, dt);
  }
}

TEST(StateDict, NamesAndGroups) {
  Tensor a = param({1, 2}), b = param({3}), c = param({4});
  Adam opt(std::vector<ParamGroup>{{{a}, {}}, {{b, c}, {{"lr", 0.5}}}}, AdamOptions{});
  set_grad(a, {1, 1});
  set_grad(c, {1});
  opt.step();
  OptimizerStateDict sd = opt.state_dict();
  std::vector<std::string> names;
  for (auto& [n, t] : sd.state) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"state.0.exp_avg", "state.0.exp_avg_sq", "state.0.step",
                                             "state.2.exp_avg", "state.2.exp_avg_sq", "state.2.step"}));
  ASSERT_EQ(sd.param_groups.size(), 2u);
  EXPECT_EQ(sd.param_groups[1].params, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(sd.param_groups[1].options.at("lr"), 0.5);
  EXPECT_EQ(sd.param_groups[0].options.at("beta2"), 0.999);
}

TEST(StateDict, LoadErrorsNameTheMismatch) {
  Tensor a = param({1, 2}), b = param({3});
  SGD opt({a, b}, {.lr = 0.1, .momentum = 0.9});
  set_grad(a, {1, 1});
  set_grad(b, {1});
  opt.step();
  const OptimizerStateDict good = opt.state_dict();

  SGD one({param({1, 2})}, {.lr = 0.1, .momentum = 0.9});
  expect_error([&] { one.load_state_dict(good); }, "parameter group 0 has 2 parameters in the state dict, 1 in");
  SGD two_groups(std::vector<ParamGroup>{{{param({1, 2})}, {}}, {{param({3})}, {}}}, SGDOptions{});
  expect_error([&] { two_groups.load_state_dict(good); }, "the state dict has 1 parameter groups, the optimizer has 2");

  SGD target({param({0, 0}), param({0})}, {.lr = 0.1, .momentum = 0.9});
  auto bad = good;
  bad.state[1].second = zeros({2}, DType::Float64);
  expect_error([&] { target.load_state_dict(bad); },
               "entry 'state.1.momentum_buffer' has shape [2] but parameter 1 has shape [1]");
  bad = good;
  bad.state[0].first = "state.0.exp_avg";
  expect_error([&] { target.load_state_dict(bad); }, "'state.0.exp_avg': SGD keeps no state named 'exp_avg'");
  bad = good;
  bad.state[0].first = "state.x.momentum_buffer";
  expect_error([&] { target.load_state_dict(bad); }, "is not named state.<index>.<name>");
  bad = good;
  bad.state[0].first = "state.7.momentum_buffer";
  expect_error([&] { target.load_state_dict(bad); }, "refers to parameter 7");
  // A failed load changes nothing; a good one restores lr and buffers.
  EXPECT_TRUE(target.state(target.param_groups()[0].params[0]).empty());
  target.param_groups()[0].options["lr"] = 9.0;
  target.load_state_dict(good);
  EXPECT_EQ(target.param_groups()[0].lr(), 0.1);
  expect_vec(target.state(target.param_groups()[0].params[0]).at("momentum_buffer"), {1, 1}, 0);
}

// ---- LR schedulers against their closed forms ----
void expect_schedule(LRScheduler& s, Optimizer& opt, int epochs, const std::function<double(double, int)>& want) {
  for (int e = 0; e < epochs; ++e) {
    if (e > 0) s.step();
    ASSERT_EQ(s.last_epoch(), e);
    for (size_t g = 0; g < opt.param_groups().size(); ++g) {
      const double base = opt.param_groups()[g].options.at("initial_lr");
      EXPECT_NEAR(s.get_last_lr()[g], want(base, e), 1e-15) << "epoch " << e << " group " << g;
      EXPECT_EQ(opt.param_groups()[g].lr(), s.get_last_lr()[g]);
    }
  }
}

std::unique_ptr<SGD> two_group_sgd() {
  return std::make_unique<SGD>(std::vector<ParamGroup>{{{param({1})}, {}}, {{param({1})}, {{"lr", 0.5}}}},
                               SGDOptions{.lr = 0.1});
}

TEST(LRScheduler, StepMultiStepCosineLinear) {
  auto o1 = two_group_sgd();
  StepLR step(*o1, 3, 0.5);
  expect_schedule(step, *o1, 10, [](double b, int e) { return b * std::pow(0.5, e / 3); });

  auto o2 = two_group_sgd();
  MultiStepLR multi(*o2, {6, 2, 6}, 0.1);
  expect_schedule(multi, *o2, 9, [](double b, int e) { return b * (e < 2 ? 1 : e < 6 ? 0.1 : 0.001); });

  auto o3 = two_group_sgd();
  CosineAnnealingLR cos(*o3, 10, 0.001);
  expect_schedule(cos, *o3, 15, [](double b, int e) {
    return 0.001 + (b - 0.001) * (1 + std::cos(std::numbers::pi * e / 10)) / 2;
  });
  auto o4 = two_group_sgd();
  LinearLR lin(*o4, 0.25, 1.0, 4);
  expect_schedule(lin, *o4, 8, [](double b, int e) { return b * (0.25 + 0.75 * std::min(e, 4) / 4.0); });
  EXPECT_EQ(o4->param_groups()[1].options.at("initial_lr"), 0.5);
}

TEST(LRScheduler, WarmupThenCosineAndResume) {
  auto opt = two_group_sgd();
  auto warmup = std::make_shared<LinearLR>(*opt, 0.1, 1.0, 5);
  auto cosine = std::make_shared<CosineAnnealingLR>(*opt, 20, 0.0);
  SequentialLR sched(*opt, {warmup, cosine}, {5});
  auto want = [](double b, int e) {
    return e < 5 ? b * (0.1 + 0.9 * e / 5.0) : b * (1 + std::cos(std::numbers::pi * (e - 5) / 20)) / 2;
  };
  expect_schedule(sched, *opt, 12, want);
  EXPECT_NEAR(sched.get_last_lr()[0], 0.1 * (1 + std::cos(std::numbers::pi * 6 / 20)) / 2, 1e-15);

  // Resume: a fresh optimizer + scheduler continue from the saved counters.
  auto opt2 = two_group_sgd();
  opt2->load_state_dict(opt->state_dict());
  SequentialLR sched2(*opt2, {std::make_shared<LinearLR>(*opt2, 0.1, 1.0, 5),
                              std::make_shared<CosineAnnealingLR>(*opt2, 20, 0.0)}, {5});
  sched2.load_state_dict(sched.state_dict());
  sched.step();
  sched2.step();
  EXPECT_EQ(sched2.get_last_lr(), sched.get_last_lr());
  EXPECT_EQ(opt2->param_groups()[1].lr(), opt->param_groups()[1].lr());

  expect_error([&] { SequentialLR(*opt, {warmup, cosine}, {5, 6}); }, "one more scheduler than milestones");
  auto other = two_group_sgd();
  expect_error([&] { SequentialLR(*other, {warmup}, {}); }, "different optimizer");
  expect_error([&] { LinearLR(*opt, 0.0); }, "greater than 0");
  EXPECT_DOUBLE_EQ(scaled_lr(0.1, 1024, 256), 0.4);
}

// ---- clip_grad_norm_ ----
TEST(ClipGradNorm, TwoNormInfNormAndNoClip) {
  Tensor a = param({3, 4}), b = param({12}), c = param({7});  // c has no grad
  set_grad(a, {3, 4});
  set_grad(b, {12});
  EXPECT_NEAR(clip_grad_norm_({a, b, c}, 6.5), 13.0, 1e-12);
  const double k = 6.5 / (13.0 + 1e-6);
  expect_vec(a.grad(), {3 * k, 4 * k}, 1e-14);
  expect_vec(b.grad(), {12 * k}, 1e-14);

  set_grad(a, {3, -4});
  set_grad(b, {-12});
  EXPECT_NEAR(clip_grad_norm_({a, b}, 100.0), 13.0, 1e-12);  // under the limit: untouched
  expect_vec(a.grad(), {3, -4}, 0);

  EXPECT_EQ(clip_grad_norm_({a, b}, 6.0, INFINITY), 12.0);
  expect_vec(b.grad(), {-12 * 6.0 / (12.0 + 1e-6)}, 1e-14);

  set_grad(a, {3, -4});
  set_grad(b, {-12});
  EXPECT_NEAR(clip_grad_norm_({a, b}, 100.0, 1.0), 19.0, 1e-12);
  EXPECT_EQ(clip_grad_norm_({c}, 1.0), 0.0);
  expect_error([&] { clip_grad_norm_({a}, 1.0, -1.0); }, "norm_type");
}

// ---- end to end: fit y = 3x + 1 with autograd and SGD momentum ----
TEST(EndToEnd, FitsALineWithSgdMomentum) {
  Tensor x = arange(-1.0, 1.0, 0.1, DType::Float32);
  Tensor y = x * 3.0 + 1.0;
  Tensor w = zeros({1}).requires_grad_(), b = zeros({1}).requires_grad_();
  SGD opt({w, b}, {.lr = 0.1, .momentum = 0.9});
  double loss_v = 0;
  for (int i = 0; i < 300; ++i) {
    opt.zero_grad();
    Tensor err = w * x + b - y;
    Tensor loss = mean(err * err);
    loss.backward();
    opt.step();
    loss_v = loss.item();
  }
  EXPECT_NEAR(w.item(), 3.0, 1e-3);
  EXPECT_NEAR(b.item(), 1.0, 1e-3);
  EXPECT_LT(loss_v, 1e-6);
}

}  // namespace
}  // namespace ember::optim
