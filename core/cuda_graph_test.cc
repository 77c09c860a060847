// CUDA graphs (cuda_graph.h): a captured region runs nothing until
// replayed, a replay repeats its kernels on the graph's memory with new
// values written into its static inputs, memory freed inside the region
// stays the graph's, random numbers are drawn anew at every replay as the
// eager region would draw them, and what a capture cannot hold (a host
// synchronisation, a host copy) is refused with an error naming it,
// leaving the device usable. On a GPU (skips without one) and
// under the emulation (cuda_graph_emu_test), which models stream capture:
// work on a capturing stream is recorded, not run, and the calls CUDA
// refuses during a capture are refused (third_party/cuda_emu/README.md).
#include "core/cuda_graph.h"

#include <gtest/gtest.h>

#if EMBER_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/device.h"
#include "core/ops.h"
#include "core/ops_nn.h"
#include "core/testing/error_of.h"

namespace ember {
namespace {

class CudaGraphTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_is_available()) GTEST_SKIP() << "no GPU: " << cuda_unavailable_reason();
    // The AddressSanitizer run turns caching off (exact-size allocations);
    // a graph's pool is the cache's (NeedsTheCachingAllocator below).
    if (!cuda_allocator_caching(0) && !allow_uncached_)
      GTEST_SKIP() << "EMBER_NO_CUDA_MEMORY_CACHING is set: CUDA graphs need the caching allocator";
  }
  bool allow_uncached_ = false;
  static Tensor dev(const std::vector<double>& v) {
    return Tensor::from_vector(v, {static_cast<int64_t>(v.size())}, DType::Float32).cuda();
  }
};

TEST_F(CudaGraphTest, ReplayRepeatsTheRegionOnNewInputs) {
  Tensor x = dev({1, 2, 3});
  Tensor y;
  CudaGraph g(0);
  EXPECT_FALSE(g.captured());
  g.capture([&] {
    Tensor t = x * 2.0;  // a temporary freed inside the region: its block stays the graph's
    y = exp(t - 2.0) + x;
  });
  ASSERT_TRUE(g.captured());
  x.copy_(dev({0.5, 1, -1}));
  g.replay();
  const std::vector<double> want{std::exp(-1.0) + 0.5, std::exp(0.0) + 1, std::exp(-4.0) - 1};
  std::vector<double> got = y.to_vector();
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6) << i;
  // Memory allocated after the capture does not take the graph's blocks:
  // a replay after it still finds its temporaries intact.
  Tensor other = dev({7, 7, 7}) * 3.0;
  x.copy_(dev({1, 1, 1}));
  g.replay();
  got = y.to_vector();
  for (double v : got) EXPECT_NEAR(v, 1.0 + 1.0, 1e-6);
  EXPECT_EQ(other.to_vector(), (std::vector<double>{21, 21, 21}));
  EXPECT_EQ(g.replays(), 2);
  // empty_cache() leaves the graph's pool alone.
  cuda_allocator(0)->empty_cache();
  x.copy_(dev({2, 2, 2}));
  g.replay();
  for (double v : y.to_vector()) EXPECT_NEAR(v, std::exp(2.0) + 2.0, 1e-5);
}

// Nothing runs at capture: the outputs hold what they held (poison under
// the emulation) until the first replay.
TEST_F(CudaGraphTest, CaptureRunsNothing) {
  Tensor x = dev({1, 2});
  Tensor acc = dev({10, 10});
  CudaGraph g(0);
  g.capture([&] { add_(acc, x); });
  EXPECT_EQ(acc.to_vector(), (std::vector<double>{10, 10})) << "the capture ran the add";
  g.replay();
  g.replay();
  EXPECT_EQ(acc.to_vector(), (std::vector<double>{12, 14}));
}

TEST_F(CudaGraphTest, WhatACaptureCannotHoldIsNamed) {
  Tensor x = dev({1, 2, 3});
  auto failing = [&](const std::function<void()>& region) {
    CudaGraph g(0);
    std::string e = testing::error_of([&] { g.capture(region); });
    EXPECT_FALSE(g.captured()) << e;
    EXPECT_NE(testing::error_of([&] { g.replay(); }).find("nothing captured"), std::string::npos);
    return e;
  };
  std::string e = failing([&] { (void)sum(x * 2.0).item(); });
  EXPECT_NE(e.find("a copy from the GPU to the CPU (item(), cpu(), to_vector()) inside a CUDA graph capture (cuda:0)"),
            std::string::npos)
      << e;
  e = failing([&] { cuda_synchronize(); });
  EXPECT_NE(e.find("cuda_synchronize() inside a CUDA graph capture"), std::string::npos) << e;
  e = failing([&] { (void)Tensor::from_vector({1.0}, {1}, DType::Float32).cuda(); });
  EXPECT_NE(e.find("a copy from the CPU to the GPU inside a CUDA graph capture"), std::string::npos) << e;
  EXPECT_NE(e.find("copy_ new values into it between replays"), std::string::npos) << e;
  e = failing([&] {
    CudaGraph inner(0);
    inner.capture([] {});
  });
  EXPECT_NE(e.find("captures do not nest"), std::string::npos) << e;
  // The device works on afterwards, and a fresh graph captures.
  EXPECT_EQ((x + 1.0).to_vector(), (std::vector<double>{2, 3, 4}));
  Tensor y;
  CudaGraph g(0);
  g.capture([&] { y = x * 3.0; });
  g.replay();
  EXPECT_EQ(y.to_vector(), (std::vector<double>{3, 6, 9}));
  EXPECT_NE(testing::error_of([&] { g.capture([] {}); }).find("already holds a capture"), std::string::npos);
}

// Random numbers in a graph (torch's graph-safe Philox): every replay draws
// what the same region run eagerly at that point of the generator would
// (rand, bernoulli, dropout, attention dropout forward and backward, and
// a second generator), the capture itself draws nothing, and each replay
// advances the generators as the eager region does.
TEST_F(CudaGraphTest, RandomNumbersAreDrawnAnewAtEveryReplayAsEagerly) {
  Generator other(77);
  Generator gq(3);  // head dim 32: the fused (flash) kernels' dropout
  const Tensor q = randn({1, 8, 32}, {DType::Float32}, &gq).cuda().to(DType::BFloat16);
  auto region = [&](Tensor& out) {
    Tensor u = rand({5}, {DType::Float32, cuda_device(0)});
    Tensor m = bernoulli({6}, 0.5, {DType::Float32, cuda_device(0)}, &other);
    Tensor qq = q.detach().requires_grad_();
    Tensor att = scaled_dot_product_attention(qq, qq, qq, /*is_causal=*/true, /*dropout_p=*/0.5);
    sum(att.to(DType::Float32)).backward();
    out = cat({u, m, att.to(DType::Float32).reshape({-1}), qq.grad().to(DType::Float32).reshape({-1})});
  };
  manual_seed(5);
  std::vector<std::vector<double>> eager;
  for (int i = 0; i < 3; ++i) {
    Tensor out;
    region(out);
    eager.push_back(out.to_vector());
  }
  const uint64_t eager_offset = default_generator().offset(), eager_other = other.offset();
  EXPECT_NE(eager[0], eager[1]) << "the eager steps drew the same numbers";
  manual_seed(5);
  other.set_offset(0);
  Tensor out;
  CudaGraph g(0);
  g.capture([&] { region(out); });
  EXPECT_EQ(default_generator().offset(), 0u) << "the capture drew nothing";
  EXPECT_EQ(other.offset(), 0u);
  for (int i = 0; i < 3; ++i) {
    g.replay();
    EXPECT_EQ(out.to_vector(), eager[i]) << "replay " << i;
  }
  EXPECT_EQ(default_generator().offset(), eager_offset);
  EXPECT_EQ(other.offset(), eager_other);
}

// A side stream forked inside the region (by waiting on an event of the
// capturing stream) joins the capture: its work is the graph's, its
// allocations come from the graph's pool, and it must be joined back
// before the capture ends, else CUDA refuses the capture.
TEST_F(CudaGraphTest, ASideStreamForkedInTheRegionJoinsTheGraph) {
  Tensor x = dev({1, 2, 3});
  std::shared_ptr<const Stream> side = new_stream(0);
  Tensor y, z;
  CudaGraph g(0);
  g.capture([&] {
    const Stream main = Stream::current(0);
    Event forked(0), joined(0);
    forked.record(main);
    forked.block(*side);
    {
      StreamGuard on(*side);
      // A temporary freed in the region while the side stream is current:
      // its block must stay the graph's, not go to the side stream's cache.
      Tensor t = x * 10.0;
      y = t + 0.0;
    }
    joined.record(*side);
    joined.block(main);
    z = y + x;
  });
  x.copy_(dev({1, 1, 1}));
  g.replay();
  EXPECT_EQ(z.to_vector(), (std::vector<double>{11, 11, 11}));
  // Eager work on the side stream after the capture, with blocks of the
  // temporary's size: none may be the graph's, which replays write.
  const Tensor base = dev({5, 5, 5});
  cuda_synchronize();
  Tensor after, twice;
  {
    StreamGuard on(*side);
    after = base * 2.0;
    twice = base + base;
  }
  cuda_synchronize();
  x.copy_(dev({2, 2, 2}));
  g.replay();
  EXPECT_EQ(z.to_vector(), (std::vector<double>{22, 22, 22}));
  EXPECT_EQ(after.to_vector(), (std::vector<double>{10, 10, 10})) << "a replay wrote into an eager tensor";
  EXPECT_EQ(twice.to_vector(), (std::vector<double>{10, 10, 10})) << "a replay wrote into an eager tensor";
#if EMBER_WITH_CUDA
  CudaGraph unjoined(0);
  const std::string e = testing::error_of([&] {
    unjoined.capture([&] {
      Event forked(0);
      forked.record(Stream::current(0));
      forked.block(*side);
      StreamGuard on(*side);
      (void)(x * 2.0);  // never joined back
    });
  });
  EXPECT_NE(e.find("cudaErrorStreamCaptureUnjoined"), std::string::npos) << e;
  cudaGetLastError();
#endif
}

// A destroyed graph's outputs still held by tensors are freed when those
// go, not cached under its dead stream; one that goes inside another
// graph's capture is kept for later instead (a cudaFree there would
// invalidate the capture).
TEST_F(CudaGraphTest, ADestroyedGraphsOutputFreedInsideAnotherCapture) {
  Tensor x = dev({1, 2});
  Tensor out;
  {
    CudaGraph a(0);
    a.capture([&] { out = x * 2.0; });
    a.replay();
    EXPECT_EQ(out.to_vector(), (std::vector<double>{2, 4}));
  }
  EXPECT_EQ(out.to_vector(), (std::vector<double>{2, 4})) << "the output outlives its graph";
  const size_t reserved = cuda_allocator(0)->stats().reserved;
  CudaGraph b(0);
  b.capture([&] { out = x * 3.0; });  // the first graph's output is released inside this capture
  b.replay();
  EXPECT_EQ(out.to_vector(), (std::vector<double>{3, 6}));
  cuda_allocator(0)->empty_cache();  // the block kept during the capture is freed now
  EXPECT_LE(cuda_allocator(0)->stats().reserved, reserved + 1024) << "a released block was neither freed nor reused";
}

class CudaGraphUncached : public CudaGraphTest {
 protected:
  void SetUp() override {
    allow_uncached_ = true;
    CudaGraphTest::SetUp();
  }
};

// Without the caching allocator a capture is refused by name (each free
// would be a cudaFree inside it); with it, this test has nothing to check.
TEST_F(CudaGraphUncached, NeedsTheCachingAllocator) {
  if (cuda_allocator_caching(0)) GTEST_SKIP() << "the caching allocator is on";
  CudaGraph g(0);
  const std::string e = testing::error_of([&] { g.capture([] {}); });
  EXPECT_NE(e.find("CUDA graphs need the caching allocator"), std::string::npos) << e;
}

// A capture the runtime invalidates behind ember's checks (a raw device
// synchronisation) is an error at the end of the capture, not a graph that
// replays half a region; empty_cache() inside a region frees nothing (a
// cudaFree would invalidate the capture).
TEST_F(CudaGraphTest, ARuntimeInvalidatedCaptureIsAnError) {
  Tensor x = dev({1});
#if EMBER_WITH_CUDA
  CudaGraph bad(0);
  const std::string e = testing::error_of([&] {
    bad.capture([&] {
      (void)(x * 2.0);
      (void)cudaDeviceSynchronize();
    });
  });
  EXPECT_NE(e.find("CudaGraph::capture: CUDA ended the capture with cudaErrorStreamCaptureInvalidated"),
            std::string::npos)
      << e;
  EXPECT_FALSE(bad.captured());
  cudaGetLastError();
#endif
  CudaGraph g(0);
  Tensor y;
  g.capture([&] {
    Tensor t = x * 2.0;
    t = Tensor();
    cuda_allocator(0)->empty_cache();
    y = x + 1.0;
  });
  g.replay();
  EXPECT_EQ(y.to_vector(), (std::vector<double>{2}));
}

}  // namespace
}  // namespace ember
