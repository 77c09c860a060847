// The engine's contract: gradients, accumulation, graph freeing, no-grad,
// detach, leaf rules, hooks and their order, and the errors users hit.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/ops.h"

namespace ember {
namespace {

Tensor vec(std::vector<double> v, DType t = DType::Float64) {
  int64_t n = static_cast<int64_t>(v.size());
  return Tensor::from_vector(v, {n}, t);
}

void expect_vec(const Tensor& t, std::vector<double> want, double tol = 1e-12) {
  auto got = t.to_vector();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << "element " << i;
}

TEST(Autograd, SimpleChainRule) {
  Tensor x = vec({1, 2, 3}).requires_grad_();
  Tensor y = sum(x * x * 3.0 + exp(x));
  y.backward();
  expect_vec(x.grad(), {6 + std::exp(1.0), 12 + std::exp(2.0), 18 + std::exp(3.0)});
  EXPECT_TRUE(x.is_leaf());
  EXPECT_FALSE(y.is_leaf());
  EXPECT_EQ(autograd::grad_fn_name(y), "sum");
}

TEST(Autograd, GradientsAccumulateAcrossBackwardCalls) {
  Tensor w = vec({1, -1}).requires_grad_();
  for (int i = 0; i < 3; ++i) sum(w * 2.0).backward();
  expect_vec(w.grad(), {6, 6});
  autograd::zero_grad(w, /*set_to_none=*/false);
  expect_vec(w.grad(), {0, 0});
  autograd::zero_grad(w);
  EXPECT_FALSE(w.grad().defined());
}

TEST(Autograd, SharedSubexpressionSumsBothPaths) {
  Tensor x = vec({2}).requires_grad_();
  Tensor a = x * 3.0;
  Tensor y = a * a + a;  // (3x)^2 + 3x -> 18x + 3
  y.backward(ones({1}, DType::Float64));
  expect_vec(x.grad(), {39});
}

// A leaf's first gradient is kept as it arrives when nothing else holds it
// (PyTorch's AccumulateGrad steals it too) and copied when it is shared:
// add hands one gradient to both of its inputs, so a and b must not alias,
// and a later in-place change of one leaves the other alone. A gradient laid
// out differently from its leaf (a transposed view) is copied into the
// leaf's layout, not kept as a view.
TEST(Autograd, LeafGradientsAreTheirOwnStorage) {
  Tensor a = vec({1, 2}).requires_grad_(), b = vec({3, 4}).requires_grad_();
  sum((a + b) * 1.0).backward();
  ASSERT_TRUE(a.grad().defined() && b.grad().defined());
  EXPECT_FALSE(a.grad().shares_storage(b.grad()));
  a.grad().fill_(7.0);
  expect_vec(b.grad(), {1, 1});
  Tensor w = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {2, 3}).requires_grad_();
  Tensor m = Tensor::from_vector({1, 0, 0, 1, 1, 1}, {3, 2});
  sum(w.t() * m).backward();  // w's gradient arrives as a transposed view of a [3, 2] tensor
  EXPECT_TRUE(w.grad().is_contiguous());
  EXPECT_TRUE(allclose(w.grad(), m.t().contiguous()));
}

TEST(Autograd, BroadcastGradientsReduceToInputShape) {
  Tensor a = ones({2, 3}, DType::Float64).requires_grad_();
  Tensor b = vec({1, 2, 3}).requires_grad_();
  sum(a * b).backward();
  expect_vec(b.grad(), {2, 2, 2});
  expect_vec(a.grad().reshape({-1}), {1, 2, 3, 1, 2, 3});
}

// Runs backward and returns its error message ("" when it succeeded).
std::string backward_error(const Tensor& y) {
  try {
    y.backward();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Autograd, GraphIsFreedUnlessRetained) {
  Tensor x = vec({1, 2}).requires_grad_();
  Tensor y = sum(x * x);
  y.backward({}, /*retain_graph=*/true);
  y.backward();  // retained: runs again, accumulating
  expect_vec(x.grad(), {4, 8});
  const std::string err = backward_error(y);
  EXPECT_NE(err.find("second time"), std::string::npos) << err;
}

// As in torch, a node that saved nothing (a dtype cast) survives backward:
// two graphs that share one cast of a leaf (the autocast cache's case, e.g.
// the micro-steps of gradient accumulation) each backward once through it.
// The nodes after it are still released.
TEST(Autograd, ACastIsNotReleasedSoGraphsMayShareIt) {
  Tensor w = vec({1, 2}).requires_grad_();
  Tensor w32 = w.to(DType::Float32);  // one cast, shared
  sum(w32 * 3.0).backward();
  sum(w32 * w32).backward();
  expect_vec(w.grad(), {3 + 2, 3 + 4});
  Tensor y = sum(w32 * w32);
  y.backward();
  const std::string err = backward_error(y);
  EXPECT_NE(err.find("second time (node 'sum')"), std::string::npos) << err;
}

TEST(Autograd, NonScalarNeedsExplicitGradient) {
  Tensor x = vec({1, 2}).requires_grad_();
  Tensor y = x * 2.0;
  EXPECT_THROW(y.backward(), Error);
  y.backward(vec({1, 10}));
  expect_vec(x.grad(), {2, 20});
  EXPECT_THROW((x * 2.0).backward(vec({1, 2, 3})), Error);  // wrong shape
}

TEST(Autograd, NoGradDetachAndRequiresGradPropagation) {
  Tensor x = vec({1, 2}).requires_grad_();
  {
    NoGradGuard g;
    Tensor y = x * 2.0;
    EXPECT_FALSE(y.requires_grad());
  }
  Tensor d = x.detach();
  EXPECT_FALSE(d.requires_grad());
  EXPECT_TRUE(d.shares_storage(x));
  Tensor c = vec({1, 1});
  EXPECT_FALSE((c * 2.0).requires_grad());
  EXPECT_TRUE((c * x).requires_grad());
  EXPECT_THROW(sum(d).backward(), Error);
  // Only leaves may change requires_grad; integers can't require it.
  Tensor y = x * 2.0;
  EXPECT_THROW(y.requires_grad_(false), Error);
  Tensor i = Tensor::from_vector({1, 2}, {2}, DType::Int64);
  EXPECT_THROW(i.requires_grad_(), Error);
}

TEST(Autograd, InPlaceOnTrackedTensorIsRefused) {
  Tensor x = vec({1, 2}).requires_grad_();
  EXPECT_THROW(x += vec({1, 1}), Error);
  EXPECT_THROW(x.fill_(0), Error);
  {
    NoGradGuard g;
    x += vec({1, 1});  // optimizers update parameters like this
  }
  expect_vec(x, {2, 3});
}

TEST(Autograd, ModifyingASavedTensorIsDetected) {
  Tensor x = vec({1, 2}).requires_grad_();
  Tensor w = vec({3, 4});
  Tensor y = sum(x * w);  // saves w
  w += vec({1, 1});
  const std::string err = backward_error(y);
  EXPECT_NE(err.find("changed after the forward pass"), std::string::npos) << err;
}

TEST(Autograd, SetDataOnATensorAGraphSavedFailsItsBackward) {
  // The closure of x * w holds w's handle: after set_data it would read the
  // new values. The old storage's version names set_data instead.
  Tensor x = vec({1, 2}).requires_grad_();
  Tensor w = vec({3, 4}).requires_grad_();
  Tensor y = sum(x * w);
  {
    NoGradGuard g;
    w.set_data(vec({5, 6}));
  }
  std::string err = backward_error(y);
  EXPECT_NE(err.find("'set_data'"), std::string::npos) << err;
  EXPECT_NE(err.find("between iterations"), std::string::npos) << err;
  // Between iterations (a new forward after set_data) it is the safe way.
  Tensor y2 = sum(x * w);
  y2.backward();
  expect_vec(x.grad(), {5, 6});
  expect_vec(w.grad(), {1, 2});
}

TEST(Autograd, FreedStorageKeepsIdentityAndRefusesUseAndBackward) {
  Tensor x = vec({1, 2, 3}).requires_grad_();
  Tensor p = vec({4, 5, 6}).requires_grad_();
  Tensor view = p.detach().narrow(0, 1, 2);
  const TensorImpl* identity = p.impl_ptr().get();
  Tensor y = sum(x * p);
  p.free_storage();
  EXPECT_TRUE(p.storage_freed());
  EXPECT_TRUE(view.storage_freed());  // one storage, every view sees it
  EXPECT_EQ(p.impl_ptr().get(), identity);
  EXPECT_EQ(p.sizes(), Shape({3}));
  EXPECT_TRUE(p.requires_grad() && p.is_leaf());
  try {
    (void)view.to_vector();
    FAIL() << "reading a freed tensor must fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("storage was freed"), std::string::npos) << e.what();
  }
  std::string err = backward_error(y);
  EXPECT_NE(err.find("storage freed"), std::string::npos) << err;
  EXPECT_NE(err.find("'mul'"), std::string::npos) << err;
}

TEST(Autograd, BackwardAfterFreeAndRestoreIsCorrectOrAnError) {
  // FSDP's pattern: free after forward, re-gather the same values before
  // backward and set the version back: gradients equal a run that never
  // freed (dy/dx = p, dy/dp = x).
  for (bool vouch : {true, false}) {
    Tensor x = vec({1, 2, 3}).requires_grad_();
    Tensor p = vec({4, 5, 6}).requires_grad_();
    Tensor y = sum(x * p);
    const uint64_t version = p.storage_version();
    p.free_storage();
    p.restore_storage();
    EXPECT_FALSE(p.storage_freed());
    {
      NoGradGuard g;
      p.copy_(vec({4, 5, 6}));
    }
    if (vouch) {
      p.unsafe_set_storage_version(version);
      y.backward();
      expect_vec(x.grad(), {4, 5, 6});
      expect_vec(p.grad(), {1, 2, 3});
    } else {
      // Without the version set back nothing vouches for the contents.
      std::string err = backward_error(y);
      EXPECT_NE(err.find("changed after the forward pass"), std::string::npos) << err;
      EXPECT_FALSE(x.grad().defined());
    }
  }
  // Restored but never refilled: the restore itself is named.
  Tensor x = vec({1, 2}).requires_grad_();
  Tensor p = vec({3, 4}).requires_grad_();
  Tensor y = sum(x * p);
  p.free_storage();
  p.restore_storage();
  std::string err = backward_error(y);
  EXPECT_NE(err.find("'restore_storage'"), std::string::npos) << err;
}

TEST(Autograd, ViewsCarryGradients) {
  Tensor x = arange(6, DType::Float64).requires_grad_();
  Tensor m = x.view({2, 3});
  Tensor y = sum(m.t().slice(0, 1, 3) * 2.0) + sum(m.select(0, 1)) + sum(m.unsqueeze(0).expand({4, 2, 3}));
  y.backward();
  // slice of columns 1..2 (x1, x2, x4, x5) *2, row 1 (x3..x5) +1, expand 4 copies +4
  expect_vec(x.grad(), {4, 6, 6, 5, 7, 7});
}

TEST(Autograd, TensorHookCanRewriteGradient) {
  Tensor x = vec({1, 2}).requires_grad_();
  Tensor y = x * 3.0;
  autograd::register_hook(y, [](const Tensor& g) { return g * 10.0; });
  autograd::register_hook(x, [](const Tensor& g) { return g + 1.0; });
  sum(y).backward();
  expect_vec(x.grad(), {31, 31});
}

TEST(Autograd, RetainGradOnNonLeaf) {
  Tensor x = vec({1, 2}).requires_grad_();
  Tensor y = x * 3.0;
  autograd::retain_grad(y);
  sum(y * y).backward();
  expect_vec(y.grad(), {6, 12});
}

TEST(Autograd, PostAccumulateHooksFireInReadyOrderOncePerPass) {
  // Parameters used later in the forward get gradients first.
  Tensor w1 = vec({1, 2}).requires_grad_();
  Tensor w2 = vec({3, 4}).requires_grad_();
  Tensor w3 = vec({5, 6}).requires_grad_();
  std::vector<int> order;
  std::vector<double> seen;
  autograd::register_post_accumulate_grad_hook(w1, [&](const Tensor& t) {
    order.push_back(1);
    seen.push_back(t.grad().to_vector()[0]);
  });
  autograd::register_post_accumulate_grad_hook(w2, [&](const Tensor&) { order.push_back(2); });
  autograd::register_post_accumulate_grad_hook(w3, [&](const Tensor&) { order.push_back(3); });
  Tensor x = vec({1, 1});
  Tensor h = tanh(x * w1);
  h = tanh(h * w2);
  h = h * w3;
  sum(h).backward();
  EXPECT_EQ(order, (std::vector<int>{3, 2, 1}));
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_NE(seen[0], 0.0);  // .grad already holds this pass's gradient
  // A parameter used twice gets one hook call, after both contributions.
  std::vector<double> twice;
  Tensor p = vec({2}).requires_grad_();
  autograd::register_post_accumulate_grad_hook(p, [&](const Tensor& t) { twice.push_back(t.grad().item()); });
  sum(p * 3.0 + p * p).backward();
  ASSERT_EQ(twice.size(), 1u);
  EXPECT_DOUBLE_EQ(twice[0], 7.0);
}

TEST(Autograd, FunctionalGradLeavesDotGradAlone) {
  Tensor x = vec({1, 2}).requires_grad_();
  Tensor y = sum(x * x * x);
  auto g = autograd::grad(y, {x});
  expect_vec(g[0], {3, 12});
  EXPECT_FALSE(x.grad().defined());
}

TEST(Autograd, MatmulAndFloat32) {
  Tensor a = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {2, 3}).requires_grad_();
  Tensor b = Tensor::from_vector({1, 0, 0, 1, 1, 1}, {3, 2}).requires_grad_();
  sum(matmul(a, b)).backward();
  // d/da = ones[2,2] @ b^T: row sums of b per row of a
  expect_vec(a.grad().reshape({-1}), {1, 1, 2, 1, 1, 2}, 1e-6);
  expect_vec(b.grad().reshape({-1}), {5, 5, 7, 7, 9, 9}, 1e-6);
  EXPECT_EQ(a.grad().dtype(), DType::Float32);
}

TEST(Autograd, MixedDtypeGradientsComeBackInTheInputDtype) {
  Tensor a = vec({1, 2}, DType::Float32).requires_grad_();
  Tensor b = vec({3, 4}, DType::Float64).requires_grad_();
  sum(a * b).backward();
  EXPECT_EQ(a.grad().dtype(), DType::Float32);
  EXPECT_EQ(b.grad().dtype(), DType::Float64);
  expect_vec(a.grad(), {3, 4}, 1e-6);
}

TEST(Autograd, ReleasedGraphFreesSavedTensors) {
  Tensor x = vec({1, 2}).requires_grad_();
  Tensor big = ones({1000}, DType::Float64);
  std::weak_ptr<Storage> saved;
  Tensor y;
  {
    Tensor w = big * 2.0;
    saved = w.impl().storage;
    y = sum(x.unsqueeze(1) * w.unsqueeze(0));
  }
  EXPECT_FALSE(saved.expired());  // held by the graph for backward
  y.backward();
  EXPECT_TRUE(saved.expired());   // freed as backward went past it
}

// DDP's end-of-backward hook: callbacks queued from hooks run once, after
// every gradient of the pass, in order; errors surface from backward().
TEST(Autograd, QueueCallbackRunsAfterThePassInOrder) {
  EXPECT_FALSE(autograd::in_backward());
  EXPECT_THROW(autograd::queue_callback([] {}), Error);
  Tensor a = vec({1, 2}).requires_grad_();
  Tensor b = vec({3, 4}).requires_grad_();
  std::vector<std::string> log;
  bool queued = false;
  for (const Tensor* t : {&a, &b}) {
    autograd::register_post_accumulate_grad_hook(*t, [&](const Tensor&) {
      log.push_back("acc");
      EXPECT_TRUE(autograd::in_backward());
      if (queued) return;
      queued = true;
      autograd::queue_callback([&] {
        // Both gradients are final here.
        log.push_back("cb1:" + std::to_string(static_cast<int>(a.grad().to_vector()[1] + b.grad().to_vector()[1])));
        autograd::queue_callback([&] { log.push_back("cb2"); });
      });
    });
  }
  sum(a * b).backward();
  EXPECT_EQ(log, (std::vector<std::string>{"acc", "acc", "cb1:6", "cb2"}));
  EXPECT_FALSE(autograd::in_backward());

  // A second pass starts with an empty queue; a throwing callback fails backward.
  log.clear();
  queued = false;
  Tensor c = vec({5}).requires_grad_();
  autograd::register_post_accumulate_grad_hook(c, [&](const Tensor&) {
    autograd::queue_callback([] { throw Error("callback failed"); });
  });
  try {
    sum(c * 2.0).backward();
    ADD_FAILURE() << "expected the callback's error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("callback failed"), std::string::npos);
  }
  EXPECT_FALSE(autograd::in_backward());
}

}  // namespace
}  // namespace ember
