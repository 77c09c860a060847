// The nn ops on CUDA against the CPU kernels, forward and backward, for every
// float dtype: conv2d (cuDNN, including channels-last inputs), batch_norm
// (training, eval, running stats) and both poolings. The float32 tolerance is
// tight enough that TF32 convolutions would fail it. Skips (with the reason)
// when no GPU is present.
#include <gtest/gtest.h>

#include <array>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <tuple>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "core/ops/int_div.h"
#include "core/ops/kernels.h"
#include "core/ops_nn.h"
#include "core/testing/conv_cases.h"
#include "core/testing/cuda_compare.h"
#include "core/testing/error_of.h"
#include "core/testing/pool_cases.h"

namespace ember {
namespace {

using Dims = std::array<int64_t, 2>;
using namespace testing::cuda_compare;

class CudaNnOps : public ::testing::Test {
 protected:
  // float32 convolutions compared at 1e-4 need exact float math: TF32
  // (cuDNN's default, as PyTorch's) is off except where a test turns it on.
  void SetUp() override {
    if (!cuda_is_available()) GTEST_SKIP() << cuda_unavailable_reason();
    set_cudnn_allow_tf32(false);
  }
  void TearDown() override {
    set_cudnn_allow_tf32(true);
    set_cudnn_graph_api(true);
    set_cudnn_benchmark(false);
    set_deterministic_algorithms(false);
  }
};

// x.permute to NHWC memory, viewed back as NCHW.
Tensor channels_last(const Tensor& x) { return x.permute({0, 2, 3, 1}).contiguous().permute({0, 3, 1, 2}); }

using testing::ConvCase;
const std::vector<ConvCase> kConvCases = testing::conv_cases({
    {{2, 8, 9, 8}, {16, 8, 3, 3}, {2, 2}, {1, 1}, {1, 1}, 1, true},
    {{2, 8, 8, 8}, {8, 1, 3, 3}, {1, 1}, {1, 1}, {1, 1}, 8, true},
    {{3, 16, 5, 5}, {8, 16, 1, 1}, {1, 1}, {0, 0}, {1, 1}, 1, true},
});

Fn conv_fn(const ConvCase& c) {
  return [c](const std::vector<Tensor>& v) { return conv2d(v[0], v[1], v[2], c.stride, c.pad, c.dil, c.groups); };
}

TEST_F(CudaNnOps, Conv2dMatchesCpu) {
  uint64_t seed = 1;
  for (const ConvCase& c : kConvCases)
    for (DType dt : kTypes) {
      std::vector<Tensor> in = {rnd(c.x, seed++, dt, 0.5), rnd(c.w, seed++, dt, 0.5),
                                c.bias ? rnd({c.w[0]}, seed++, dt) : Tensor()};
      compare(conv_fn(c), in, tol(dt), cat("conv2d x", c.x, " w", c.w, " g", c.groups, " ", dt));
    }
}

// layer_norm's kernels: widths below, at and above a warp, one and several
// normalised dims, with and without weight and bias, more rows than one
// dweight/dbias tile (128), float32 and float64, bfloat16 computed in float32.
TEST_F(CudaNnOps, LayerNormMatchesCpu) {
  uint64_t seed = 500;
  struct Case {
    Shape x;
    int64_t nd;
    bool w, b;
  };
  for (const Case& c : std::vector<Case>{{{3, 5, 1}, 1, true, true},
                                         {{4, 33}, 1, true, false},
                                         {{2, 3, 4, 5}, 2, false, true},
                                         {{130, 64}, 1, true, true},
                                         {{7}, 1, false, false}})
    for (DType dt : {DType::Float32, DType::Float64, DType::BFloat16}) {
      const Shape ns(c.x.end() - c.nd, c.x.end());
      std::vector<Tensor> in = {rnd(c.x, seed++, dt, 2.0), c.w ? rnd(ns, seed++, dt) : Tensor(),
                                c.b ? rnd(ns, seed++, dt) : Tensor()};
      Fn f = [c](const std::vector<Tensor>& v) { return layer_norm(v[0], c.nd, v[1], v[2], 1e-5); };
      compare(f, in, tol(dt) * 10, cat("layer_norm x", c.x, " nd ", c.nd, " w ", c.w, " b ", c.b, " ", dt));
    }
}

// The TF32 switches take effect (the emulated cuDNN and cuBLAS round float
// operands to TF32 when a call allows it, as the tensor cores do): off, a
// float32 convolution and matmul match the CPU to float rounding; on, they
// differ from it by TF32's rounding (10 mantissa bits, about 1e-3 relative),
// and the algorithm cache does not serve one mode's choice to the other.
TEST_F(CudaNnOps, Tf32SwitchesTakeEffect) {
  const bool emulated = cuda_device_name() == "CUDA emulation";
  Tensor x = rnd({2, 16, 9, 9}, 160, DType::Float32), w = rnd({8, 16, 3, 3}, 161, DType::Float32, 0.3);
  const Tensor ref = conv2d(x.to(DType::Float64), w.to(DType::Float64), Tensor(), {1, 1}, {1, 1});
  auto rel_err = [&](const Tensor& got, const Tensor& want) {
    return max(abs(got.cpu().to(DType::Float64) - want)).item() / max(abs(want)).item();
  };
  for (bool cl : {false, true}) {
    Tensor xg = cl ? channels_last(x.cuda()) : x.cuda();
    set_cudnn_allow_tf32(false);
    const double exact = rel_err(conv2d(xg, w.cuda(), Tensor(), {1, 1}, {1, 1}), ref);
    set_cudnn_allow_tf32(true);
    const double tf32 = rel_err(conv2d(xg, w.cuda(), Tensor(), {1, 1}, {1, 1}), ref);
    set_cudnn_allow_tf32(false);
    const double exact_again = rel_err(conv2d(xg, w.cuda(), Tensor(), {1, 1}, {1, 1}), ref);
    EXPECT_LT(exact, 1e-6) << "conv2d, TF32 off" << (cl ? ", channels-last" : "");
    EXPECT_EQ(exact, exact_again) << "conv2d: TF32 off again reuses the exact algorithm";
    // A real cuDNN may still pick an FMA kernel for so small a convolution
    // (seen on an H100); the emulation always rounds when allowed.
    if (emulated) {
      EXPECT_GT(tf32, 2e-5) << "conv2d, TF32 on: operands not rounded";
    }
    EXPECT_LT(tf32, 5e-3) << "conv2d, TF32 on";
  }
  Tensor a = rnd({33, 70}, 162, DType::Float32), b = rnd({70, 20}, 163, DType::Float32);
  const Tensor mref = matmul(a.to(DType::Float64), b.to(DType::Float64));
  EXPECT_FALSE(matmul_allow_tf32()) << "matmul TF32 is off by default, as in PyTorch";
  const double m_exact = rel_err(matmul(a.cuda(), b.cuda()), mref);
  set_matmul_allow_tf32(true);
  const double m_tf32 = rel_err(matmul(a.cuda(), b.cuda()), mref);
  set_matmul_allow_tf32(false);
  EXPECT_LT(m_exact, 1e-6);
  if (emulated) {
    EXPECT_GT(m_tf32, 2e-5);
  }
  EXPECT_LT(m_tf32, 5e-3);
}

// Benchmark mode (cudnnFind*Ex, PyTorch's cudnn.benchmark) picks algorithms
// that compute the same convolutions, in both layouts, and float32 without
// TF32 stays exact (no tensor-op algorithm is taken).
TEST_F(CudaNnOps, Conv2dBenchmarkModeMatchesCpu) {
  set_cudnn_benchmark(true);
  uint64_t seed = 700;
  for (const ConvCase& c : kConvCases)
    for (DType dt : {DType::Float32, DType::Float16})
      for (bool cl : {false, true}) {
        std::vector<Tensor> in = {rnd(c.x, seed++, dt, 0.5), rnd(c.w, seed++, dt, 0.5),
                                  c.bias ? rnd({c.w[0]}, seed++, dt) : Tensor()};
        compare(conv_fn(c), in, tol(dt), cat("conv2d benchmark mode x", c.x, " w", c.w, cl ? " channels-last " : " ", dt),
                [cl](Tensor t) { return cl ? channels_last(t) : t; });
      }
  set_cudnn_benchmark(false);
}

// Under deterministic_algorithms() a convolution's gradients come out the
// same bit for bit on every run, through the graph API, the legacy API's
// heuristics and benchmark mode, in float32 with TF32, bfloat16 and float16,
// NCHW and channels-last, and still match the CPU. The emulated cuDNN models
// what makes this matter (third_party/cuda_emu): its graph API lists a
// nondeterministic weight-gradient engine first, benchmark mode measures
// the nondeterministic legacy algorithms fastest, and each changes the last
// bits of its result from run to run; so without the switch two runs
// differ there, and the check can fail.
TEST_F(CudaNnOps, Conv2dDeterministicAlgorithmsRepeatBitForBit) {
  const bool emulated = cuda_device_name() == "CUDA emulation";
  struct Mode {
    const char* name;
    bool graph, benchmark, varies;  // varies: the emulated cuDNN's choice without the switch is nondeterministic
  };
  const ConvCase& c = kConvCases[0];
  uint64_t seed = 1300;
  for (const Mode& m : {Mode{"graph API", true, false, true}, Mode{"legacy heuristics", false, false, false},
                        Mode{"benchmark mode", false, true, true}})
    for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16})
      for (bool cl : {false, true}) {
        set_cudnn_graph_api(m.graph);
        set_cudnn_benchmark(m.benchmark);
        set_cudnn_allow_tf32(true);  // float32 on tensor cores, where the nondeterministic engine is
        const std::string what = cat("conv2d ", m.name, " ", dt, cl ? " channels-last" : "");
        std::vector<Tensor> in = {rnd(c.x, seed++, dt, 0.5), rnd(c.w, seed++, dt, 0.5),
                                  c.bias ? rnd({c.w[0]}, seed++, dt) : Tensor()};
        const auto layout = [cl](Tensor t) { return cl ? channels_last(t) : t; };
        const auto grads = [&] { return run(conv_fn(c), in, true, layout).grads; };
        const auto same = [](const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
          for (size_t i = 0; i < a.size(); ++i)
            if (a[i].defined() && !bitwise_equal(a[i], b[i])) return false;
          return true;
        };
        set_deterministic_algorithms(true);
        const std::vector<Tensor> first = grads(), second = grads();
        EXPECT_TRUE(same(first, second)) << what << ": deterministic algorithms gave two different gradients";
        set_cudnn_allow_tf32(dt != DType::Float32);  // the CPU comparison at float32's tolerance
        compare(conv_fn(c), in, tol(dt), what + " deterministic", layout);
        set_deterministic_algorithms(false);
        if (emulated && m.varies) {
          set_cudnn_allow_tf32(true);
          const std::vector<Tensor> a = grads(), b = grads();
          EXPECT_FALSE(same(a, b)) << what << ": without deterministic algorithms the emulated cuDNN's choice "
                                   << "should change its last bits between runs";
        }
      }
  set_cudnn_benchmark(false);
}

// Both ways of calling cuDNN (cudnn_graph_api: the graph API, PyTorch's
// way and the default, or the legacy API): the same convolutions as the CPU
// in every dtype and both layouts, each through its own plans (counted).
// float32 without TF32 stays exact: no tensor-core or input-down-converting
// engine is taken, though the emulated cuDNN lists both first (and dies
// running the latter); with TF32 allowed, operands are rounded as tensor
// cores round.
TEST_F(CudaNnOps, Conv2dGraphAndLegacyApisMatchCpu) {
  const bool emulated = cuda_device_name() == "CUDA emulation";
  EXPECT_TRUE(cudnn_graph_api() || std::getenv("EMBER_CUDNN_GRAPH")) << "the graph API is the default";
  for (bool graph : {true, false}) {
    set_cudnn_graph_api(graph);
    const char* api = graph ? "graph API" : "legacy API";
    const ConvPlanCounts before = conv_plan_counts_cuda();
    uint64_t seed = 900;
    for (const ConvCase& c : kConvCases)
      for (DType dt : kTypes)
        for (bool cl : {false, true}) {
          if (cl && dt == DType::Float64) continue;  // as the channels-last tests: no fp64 NHWC on a GPU
          std::vector<Tensor> in = {rnd(c.x, seed++, dt, 0.5), rnd(c.w, seed++, dt, 0.5),
                                    c.bias ? rnd({c.w[0]}, seed++, dt) : Tensor()};
          compare(conv_fn(c), in, tol(dt), cat("conv2d ", api, " x", c.x, " w", c.w, cl ? " channels-last " : " ", dt),
                  [cl](Tensor t) { return cl ? channels_last(t) : t; });
        }
    const ConvPlanCounts after = conv_plan_counts_cuda();
    std::printf("%s: %lld graph plans, %lld legacy plans\n", api, (long long)(after.graph - before.graph),
                (long long)(after.legacy - before.legacy));
    if (graph) {
      EXPECT_GT(after.graph, before.graph) << "no convolution ran through the graph API";
      if (emulated) {
        EXPECT_EQ(after.legacy, before.legacy) << "a pass fell back to the legacy API";
      }
    } else {
      EXPECT_EQ(after.graph, before.graph) << "the graph API ran with it switched off";
      EXPECT_GT(after.legacy, before.legacy);
    }
  }
  set_cudnn_graph_api(true);
  Tensor x = rnd({2, 16, 9, 9}, 960, DType::Float32), w = rnd({8, 16, 3, 3}, 961, DType::Float32, 0.3);
  const Tensor ref = conv2d(x.to(DType::Float64), w.to(DType::Float64), Tensor(), {1, 1}, {1, 1});
  auto rel_err = [&](const Tensor& got) {
    return max(abs(got.cpu().to(DType::Float64) - ref)).item() / max(abs(ref)).item();
  };
  for (bool cl : {false, true}) {
    Tensor xg = cl ? channels_last(x.cuda()) : x.cuda();
    set_cudnn_allow_tf32(false);
    const double exact = rel_err(conv2d(xg, w.cuda(), Tensor(), {1, 1}, {1, 1}));
    set_cudnn_allow_tf32(true);
    const double tf32 = rel_err(conv2d(xg, w.cuda(), Tensor(), {1, 1}, {1, 1}));
    set_cudnn_allow_tf32(false);
    EXPECT_LT(exact, 1e-6) << "conv2d graph API, TF32 off" << (cl ? ", channels-last" : "");
    if (emulated) {
      EXPECT_GT(tf32, 2e-5) << "conv2d graph API, TF32 on: operands not rounded";
    }
    EXPECT_LT(tf32, 5e-3) << "conv2d graph API, TF32 on";
  }
}

// PyTorch's defaults: cuDNN may use TF32, matmul may not; the environment
// overrides them (a bad value is a named error, checked in the device test).
TEST(Tf32Defaults, AsPyTorch) {
  if (!std::getenv("EMBER_CUDNN_ALLOW_TF32")) {
    EXPECT_TRUE(cudnn_allow_tf32());
  }
  if (!std::getenv("EMBER_MATMUL_ALLOW_TF32")) {
    EXPECT_FALSE(matmul_allow_tf32());
  }
}

TEST_F(CudaNnOps, Conv2dChannelsLastMatchesCpu) {
  uint64_t seed = 100;
  for (const ConvCase& c : kConvCases)
    for (DType dt : {DType::Float32, DType::Float16}) {
      std::vector<Tensor> in = {rnd(c.x, seed++, dt, 0.5), rnd(c.w, seed++, dt, 0.5),
                                c.bias ? rnd({c.w[0]}, seed++, dt) : Tensor()};
      compare(conv_fn(c), in, tol(dt), cat("conv2d channels-last x", c.x, " w", c.w, " ", dt),
              [](Tensor t) { return channels_last(t); });
    }
  // The output keeps the input's layout.
  Tensor x = channels_last(rnd({2, 8, 6, 6}, 150, DType::Float32).cuda());
  Tensor y = conv2d(x, rnd({4, 8, 3, 3}, 151, DType::Float32).cuda());
  EXPECT_EQ(y.stride(1), 1);
  // A channels-last weight (Module::to(ChannelsLast)) is read as it is: no
  // layout copy forward or backward, and its gradient is channels-last. An
  // OIHW weight beside a channels-last input costs two (OHWI for cuDNN,
  // and its gradient back to OIHW): the counter counts.
  for (bool cl_weight : {true, false}) {
    Tensor xi = channels_last(rnd({2, 8, 6, 6}, 152, DType::Float32).cuda()).requires_grad_();
    Tensor w = rnd({4, 8, 3, 3}, 153, DType::Float32).cuda();
    if (cl_weight) w = channels_last(w);
    w.requires_grad_();
    const uint64_t before = cuda_layout_copies();
    Tensor out = conv2d(xi, w, Tensor(), {1, 1}, {1, 1});
    sum(out * out).backward();
    EXPECT_EQ(cuda_layout_copies() - before, cl_weight ? 0u : 2u) << (cl_weight ? "OHWI" : "OIHW") << " weight";
    EXPECT_EQ(w.grad().strides(), w.strides());
    EXPECT_TRUE(xi.grad().is_contiguous(MemoryFormat::ChannelsLast));
  }
}

// Channels-last float32 computed through NCHW (the switch for cuDNN's slow
// NHWC FMA kernels): the same values as the CPU, and the output and the
// input's gradient stay channels-last for the layers around.
TEST_F(CudaNnOps, Conv2dChannelsLastViaNchwMatchesCpu) {
  set_cudnn_fp32_channels_last_via_nchw(true);
  uint64_t seed = 300;
  for (const ConvCase& c : kConvCases) {
    std::vector<Tensor> in = {rnd(c.x, seed++, DType::Float32, 0.5), rnd(c.w, seed++, DType::Float32, 0.5),
                              c.bias ? rnd({c.w[0]}, seed++, DType::Float32) : Tensor()};
    compare(conv_fn(c), in, tol(DType::Float32), cat("conv2d channels-last via NCHW x", c.x, " w", c.w),
            [](Tensor t) { return channels_last(t); });
  }
  Tensor x = channels_last(rnd({2, 8, 6, 6}, 350, DType::Float32).cuda()).requires_grad_();
  Tensor w = rnd({4, 8, 3, 3}, 351, DType::Float32).cuda().requires_grad_();
  Tensor y = conv2d(x, w);
  EXPECT_EQ(y.suggest_memory_format(), MemoryFormat::ChannelsLast);
  std::vector<Tensor> g = autograd::grad(sum(y * y), {x, w});
  EXPECT_EQ(g[0].suggest_memory_format(), MemoryFormat::ChannelsLast);
  EXPECT_TRUE(g[1].is_contiguous());  // the weight's own layout: .grad takes it without a copy
  set_cudnn_fp32_channels_last_via_nchw(false);
}

// Shapes at the edges: an empty batch gives an empty output on both backends;
// an empty spatial dimension is the same named error on both (before the
// check, the CPU returned bias values and cuDNN failed with BAD_PARAM).
TEST_F(CudaNnOps, Conv2dEmptyInputsAgreeWithCpu) {
  Tensor w = rnd({4, 3, 1, 1}, 5, DType::Float32);
  EXPECT_EQ(conv2d(zeros({0, 3, 5, 5}).cuda(), w.cuda()).sizes(), (Shape{0, 4, 5, 5}));
  for (bool cuda : {false, true}) {
    Tensor x = zeros({1, 3, 0, 5});
    try {
      conv2d(cuda ? x.cuda() : x, cuda ? w.cuda() : w, Tensor(), {1, 1}, {1, 1});
      ADD_FAILURE() << (cuda ? "cuda" : "cpu") << ": conv2d of an empty H was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("empty spatial dimension"), std::string::npos) << e.what();
    }
  }
}

// The adjoints of index_select and gather run sort_by_key_kernel, then
// index_add_sorted_kernel and scatter_add_sorted_kernel, which add several
// gradients into one element when an index repeats (as here).
TEST_F(CudaNnOps, IndexSelectAndGatherBackwardMatchCpu) {
  const Tensor idx = Tensor::from_vector({5, 0, 3, 3, 5, 1}, {6}, DType::Int64);
  Generator g(21);
  const Tensor gidx = randint(0, 5, {6, 5}, DType::Int64, &g);
  for (DType dt : {DType::Float32, DType::Float64}) {
    compare([&](const std::vector<Tensor>& v) { return index_select(v[0], 0, v[0].is_cuda() ? idx.cuda() : idx); },
            {rnd({7, 200}, 31, dt)}, tol(dt), cat("index_select dim 0 ", dt));
    compare([&](const std::vector<Tensor>& v) { return index_select(v[0], 1, v[0].is_cuda() ? idx.cuda() : idx); },
            {rnd({3, 7}, 32, dt)}, tol(dt), cat("index_select dim 1 ", dt));
    compare([&](const std::vector<Tensor>& v) { return gather(v[0], 1, v[0].is_cuda() ? gidx.cuda() : gidx); },
            {rnd({6, 5}, 33, dt)}, tol(dt), cat("gather ", dt));
  }
}

// Values of many magnitudes (10^-3 .. 10^3), so that a sum's order shows in
// its last bits.
Tensor spread(const Shape& s, uint64_t seed, DType dt) {
  Generator g(seed);
  const Tensor mag = rand(s, {DType::Float64}, &g) * 6.0 - 3.0;
  return (randn(s, {DType::Float64}, &g) * pow(full(s, 10.0, {DType::Float64}), mag)).to(dt);
}

// Indices in [-size, size) (negative ones counting from the end), a share
// `hot` of them naming row 3 (as 3 or as 3 - size).
Tensor draw_indices(const Shape& s, int64_t size, double hot, uint64_t seed) {
  std::mt19937_64 rng(seed);
  int64_t n = 1;
  for (int64_t v : s) n *= v;
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) {
    const bool is_hot = size > 3 && std::uniform_real_distribution<double>(0, 1)(rng) < hot;
    const int64_t k = is_hot ? 3 : std::uniform_int_distribution<int64_t>(0, size - 1)(rng);
    x = static_cast<double>(rng() % 2 ? k : k - size);
  }
  return Tensor::from_vector(v, s, DType::Int64);
}

// The adjoints' sums are the CPU kernels' bit for bit: each element adds its
// items in index order, starting from its value (out starts random here),
// whatever the number of sort passes (keys of 0, 1, 5, 7, 12 and 17 bits),
// tiles (up to 9000 items, three tiles of 4096) and repeats (half the items
// on one row). Summing the hot row in the opposite order changes its last
// bits, so the check can fail.
TEST_F(CudaNnOps, IndexAddAndScatterAddAreTheCpuSumsBitForBit) {
  struct AddCase {
    int64_t outer, size, inner, n;
    double hot;
  };
  const std::vector<AddCase> adds = {{1, 1, 5, 7, 0},         {1, 2, 3, 9, 0},      {1, 96, 128, 640, 0.3},
                                     {3, 17, 4, 50, 0.2},     {2, 300, 1, 4096, 0}, {1, 4000, 3, 4097, 0.1},
                                     {1, 70000, 2, 9000, 0.5}};
  uint64_t seed = 500;
  for (DType dt : {DType::Float32, DType::Float64})
    for (const AddCase& c : adds) {
      const std::string what =
          cat("index_add outer ", c.outer, " size ", c.size, " inner ", c.inner, " n ", c.n, " ", dt);
      const Tensor idx = draw_indices({c.n}, c.size, c.hot, seed++);
      const Tensor src = spread({c.outer, c.n, c.inner}, seed++, dt);
      const Tensor init = spread({c.outer, c.size, c.inner}, seed++, dt);
      Tensor want = init.clone(), got = init.cuda();
      index_add_cpu(want, idx, src, c.outer, c.size, c.inner);
      index_add_cuda(got, idx.cuda(), src.cuda(), c.outer, c.size, c.inner);
      EXPECT_TRUE(bitwise_equal(want, got))
          << what << ": largest difference " << max(abs(want - got.cpu())).item<double>();
      if (c.hot >= 0.5 && dt == DType::Float32) {
        std::vector<double> back(static_cast<size_t>(c.n));
        for (int64_t j = 0; j < c.n; ++j) back[static_cast<size_t>(j)] = static_cast<double>(c.n - 1 - j);
        const Tensor rev = Tensor::from_vector(back, {c.n}, DType::Int64);
        Tensor reversed = init.clone();
        index_add_cpu(reversed, index_select(idx, 0, rev), index_select(src, 1, rev), c.outer, c.size, c.inner);
        EXPECT_FALSE(bitwise_equal(want, reversed)) << what << ": the order does not show; the check cannot fail";
      }
    }
  struct ScatterCase {
    Shape out, index;
    int64_t dim;
    double hot;
  };
  const std::vector<ScatterCase> scatters = {{{6, 5}, {6, 5}, 1, 0},
                                             {{4}, {9}, 0, 0.3},
                                             {{3, 8, 5}, {3, 20, 5}, 1, 0.2},
                                             {{3, 40000}, {3, 3000}, 1, 0.5},
                                             {{9, 2}, {700, 2}, 0, 0.1}};
  for (DType dt : {DType::Float32, DType::Float64})
    for (const ScatterCase& c : scatters) {
      const std::string what =
          cat("scatter_add out ", shape_str(c.out), " index ", shape_str(c.index), " dim ", c.dim, " ", dt);
      const Tensor idx = draw_indices(c.index, c.out[static_cast<size_t>(c.dim)], c.hot, seed++);
      const Tensor src = spread(c.index, seed++, dt), init = spread(c.out, seed++, dt);
      Tensor want = init.clone(), got = init.cuda();
      scatter_add_cpu(want, idx, src, c.dim);
      scatter_add_cuda(got, idx.cuda(), src.cuda(), c.dim);
      EXPECT_TRUE(bitwise_equal(want, got))
          << what << ": largest difference " << max(abs(want - got.cpu())).item<double>();
    }
}

TEST_F(CudaNnOps, GroupedMmMatchesCpu) {
  const std::vector<int64_t> sizes{5, 0, 3, 9, 1};
  for (DType dt : kTypes)
    compare([&](const std::vector<Tensor>& v) { return grouped_mm(v[0], v[1], sizes); },
            {rnd({18, 24}, 41, dt), rnd({5, 12, 24}, 42, dt, 0.2)}, tol(dt), cat("grouped_mm ", dt));
}

// The groups as offsets on the device: 16-bit operands take the grouped
// kernels (row tiles across groups, an empty group, a group of more than
// one 64-row tile, M past one 64-column tile, K not a multiple of the 32
// k-step), float32 reads the offsets and takes the loop; forward and both
// gradients against the CPU's loop. Bad offsets are named at the next
// synchronisation.
TEST_F(CudaNnOps, GroupedMmOffsetsMatchesCpu) {
  const Tensor offsets = Tensor::from_vector({70, 70, 73, 82, 146, 147}, {6}, DType::Int64);
  for (DType dt : {DType::BFloat16, DType::Float16, DType::Float32})
    compare([&](const std::vector<Tensor>& v) { return grouped_mm(v[0], v[1], offsets.to(v[0].device())); },
            {rnd({147, 40}, 43, dt), rnd({6, 72, 40}, 44, dt, 0.2)}, tol(dt), cat("grouped_mm offsets ", dt));
  const Tensor x = rnd({10, 16}, 45, DType::BFloat16).cuda(), w = rnd({2, 8, 16}, 46, DType::BFloat16).cuda();
  Tensor y;
  EXPECT_NO_THROW(y = grouped_mm(x, w, Tensor::from_vector({6, 4}, {2}, DType::Int64).cuda()));
  const std::string e = testing::error_of([&] { y.cpu(); });
  EXPECT_NE(e.find("grouped_mm (group offsets): value 4 is out of the range [6, 11)"), std::string::npos) << e;
}

// group_order's kernel against the CPU's loop, exactly; an id out of range
// named at the next synchronisation.
TEST_F(CudaNnOps, GroupOrderMatchesCpu) {
  Generator g(47);
  for (auto [n, k, groups] : {std::tuple<int64_t, int64_t, int64_t>{300, 2, 8}, {5, 3, 7}, {0, 2, 3}, {1000, 1, 1}}) {
    const Tensor ids = randint(0, groups, {n, k}, DType::Int64, &g);
    const GroupOrder want = group_order(ids, groups), got = group_order(ids.cuda(), groups);
    const std::string what = cat("group_order n ", n, " k ", k, " groups ", groups);
    EXPECT_TRUE(bitwise_equal(want.rows, got.rows)) << what << " rows";
    EXPECT_TRUE(bitwise_equal(want.positions, got.positions)) << what << " positions";
    EXPECT_TRUE(bitwise_equal(want.offsets, got.offsets)) << what << " offsets";
  }
  GroupOrder bad;
  EXPECT_NO_THROW(bad = group_order(Tensor::from_vector({1, 9}, {1, 2}, DType::Int64).cuda(), 4));
  const std::string e = testing::error_of([&] { bad.rows.cpu(); });
  EXPECT_NE(e.find("group_order: value 9 is out of the range [0, 4)"), std::string::npos) << e;
}

TEST_F(CudaNnOps, BatchNormMatchesCpu) {
  uint64_t seed = 200;
  for (DType dt : kTypes) {
    // 16-bit inputs keep float32 affine parameters and statistics (mixed precision).
    const DType pt = dt == DType::Float64 ? DType::Float64 : DType::Float32;
    Tensor x = rnd({4, 3, 5, 6}, seed++, dt, 2.0) + 1.0;
    Tensor w = rnd({3}, seed++, pt), b = rnd({3}, seed++, pt);
    Tensor rm = rnd({3}, seed++, pt), rv = rnd({3}, seed++, pt, 0.1) + 1.0;
    for (bool training : {true, false}) {
      Tensor rm_c = rm.clone(), rv_c = rv.clone(), rm_g = rm.cuda(), rv_g = rv.cuda();
      // BatchNorm2d's counter, at 5: +1 for each training call (the GPU's in
      // the statistics kernel), none in eval.
      Tensor n_c = full({}, 5, DType::Int64), n_g = n_c.cuda();
      Fn cpu_f = [&](const std::vector<Tensor>& v) {
        return batch_norm(v[0], v[1], v[2], rm_c, rv_c, training, 0.2, 1e-5, n_c);
      };
      Fn gpu_f = [&](const std::vector<Tensor>& v) {
        return batch_norm(v[0], v[1], v[2], rm_g, rv_g, training, 0.2, 1e-5, n_g);
      };
      Outcome c = run(cpu_f, {x, w, b}, false), g = run(gpu_f, {x, w, b}, true);
      const std::string what = cat("batch_norm ", training ? "train " : "eval ", dt);
      expect_same(c.y, g.y, tol(dt), what + " forward");
      for (size_t i = 0; i < 3; ++i) expect_same(c.grads[i], g.grads[i], tol(dt) * 4, cat(what, " grad ", i));
      expect_same(rm_c, rm_g, tol(pt), what + " running_mean");
      expect_same(rv_c, rv_g, tol(pt), what + " running_var");
      EXPECT_EQ(n_c.item(), training ? 6.0 : 5.0) << what << " num_batches_tracked (cpu)";
      EXPECT_EQ(n_g.cpu().item(), training ? 6.0 : 5.0) << what << " num_batches_tracked";
    }
    // No affine parameters, no running statistics.
    Fn f = [](const std::vector<Tensor>& v) { return batch_norm(v[0], Tensor(), Tensor(), Tensor(), Tensor(), true); };
    compare(f, {x}, tol(dt) * 4, cat("batch_norm plain ", dt));
  }
}

// The same values: equal elements, NaN where the other has NaN.
bool same_values(const Tensor& a, const Tensor& b) {
  if (a.sizes() != b.sizes() || a.dtype() != b.dtype()) return false;
  const std::vector<double> x = a.cpu().to_vector(), y = b.cpu().to_vector();
  for (size_t i = 0; i < x.size(); ++i)
    if (!(x[i] == y[i] || (x[i] != x[i] && y[i] != y[i]))) return false;
  return true;
}

// batch_norm_relu is relu(batch_norm(...)) bit for bit, and
// batch_norm_add_relu is relu(batch_norm(...) + residual), forward and every
// gradient (the residual's too), on each backend (the CUDA kernels fold the
// ReLU, and the residual's add, into the normalising pass and the mask into
// both backward passes, the residual's gradient written by the sums pass and
// read back by the dx pass; the CPU ones likewise): every dtype, NCHW and
// channels-last, channel counts on and off the vector width, an unaligned
// 7x7 plane, training and eval, with and without affine parameters; and the
// two backends agree as batch_norm does. Over a tenth of the outputs are 0,
// so the mask matters.
TEST_F(CudaNnOps, BatchNormReluIsTheTwoOpsBitForBit) {
  uint64_t seed = 900;
  for (bool add : {false, true})
    for (DType dt : kTypes)
      for (const Shape& xs : {Shape{4, 8, 5, 6}, Shape{2, 65, 3, 3}, Shape{3, 3, 7, 7}})
        for (bool cl : {false, true})
          for (bool training : {true, false})
            for (bool affine : {true, false}) {
              const DType pt = dt == DType::Float64 ? DType::Float64 : DType::Float32;
              Tensor x = rnd(xs, seed++, dt, 2.0) + 0.5;
              Tensor w = affine ? rnd({xs[1]}, seed++, pt) : Tensor(), b = affine ? rnd({xs[1]}, seed++, pt) : Tensor();
              Tensor rm = rnd({xs[1]}, seed++, pt), rv = rnd({xs[1]}, seed++, pt, 0.1) + 1.0;
              Tensor r = add ? rnd(xs, seed++, dt) : Tensor();
              const std::string what =
                  cat(add ? "batch_norm_add_relu x" : "batch_norm_relu x", shape_str(xs), " ", dt,
                      cl ? " channels-last" : "", training ? " train" : " eval", affine ? " affine" : "");
              const std::vector<Tensor> inputs = add ? std::vector<Tensor>{x, w, b, r} : std::vector<Tensor>{x, w, b};
              std::vector<Outcome> fused, unfused;
              for (bool cuda : {false, true}) {
                Tensor rm1 = cuda ? rm.cuda() : rm.clone(), rv1 = cuda ? rv.cuda() : rv.clone();
                Tensor rm2 = rm1.clone(), rv2 = rv1.clone();
                auto layout = [cl](Tensor t) { return cl ? channels_last(t) : t; };
                fused.push_back(run(
                    [&](const std::vector<Tensor>& v) {
                      return add ? batch_norm_add_relu(v[0], v[3], v[1], v[2], rm1, rv1, training, 0.2)
                                 : batch_norm_relu(v[0], v[1], v[2], rm1, rv1, training, 0.2);
                    },
                    inputs, cuda, layout));
                unfused.push_back(run(
                    [&](const std::vector<Tensor>& v) {
                      Tensor y = batch_norm(v[0], v[1], v[2], rm2, rv2, training, 0.2);
                      return relu(add ? y + v[3] : y);
                    },
                    inputs, cuda, layout));
                ASSERT_TRUE(same_values(rm1, rm2) && same_values(rv1, rv2)) << what << " running stats";
                const std::string on = cat(what, cuda ? " (cuda)" : " (cpu)");
                ASSERT_TRUE(same_values(fused.back().y, unfused.back().y)) << on << " forward";
                EXPECT_EQ(fused.back().y.suggest_memory_format(), unfused.back().y.suggest_memory_format()) << on;
                for (size_t i = 0; i < inputs.size(); ++i) {
                  const Tensor& a = fused.back().grads[i];
                  const Tensor& u = unfused.back().grads[i];
                  ASSERT_EQ(a.defined(), u.defined()) << on << " grad " << i;
                  if (a.defined()) EXPECT_TRUE(same_values(a, u)) << on << " grad " << i << "\n" << a << "\n" << u;
                }
              }
              const double zeros = sum(eq(fused[0].y, zeros_like(fused[0].y))).item();
              EXPECT_GT(zeros, 0.1 * static_cast<double>(x.numel())) << what << ": the ReLU never acted";
              expect_same(fused[0].y, fused[1].y, tol(dt), what + " cpu vs cuda forward");
              for (size_t i = 0; i < inputs.size(); ++i)
                expect_same(fused[0].grads[i], fused[1].grads[i], tol(dt) * 4, cat(what, " cpu vs cuda grad ", i));
            }
}

// The residual's gradient where batch_norm_add_relu takes no backward sums
// (eval, no affine parameters, x without a gradient: a masked copy of its
// own) keeps a -0 gradient's sign where the output is positive, as
// relu_backward does, and is +0 where the ReLU cut: bits, not just values,
// against the three ops, on the CPU and on CUDA, NCHW and channels-last.
TEST_F(CudaNnOps, BatchNormAddReluResidualGradientKeepsNegativeZero) {
  for (bool cuda : {false, true})
    for (bool cl : {false, true}) {
      Tensor x = rnd({2, 8, 3, 3}, 41, DType::Float32), r0 = rnd({2, 8, 3, 3}, 42, DType::Float32);
      Tensor rm = rnd({8}, 43, DType::Float32), rv = rnd({8}, 44, DType::Float32, 0.1) + 1.0;
      if (cuda) x = x.cuda(), r0 = r0.cuda(), rm = rm.cuda(), rv = rv.cuda();
      if (cl) x = channels_last(x), r0 = channels_last(r0);
      std::vector<Tensor> y(2), grad(2);
      for (int fused = 0; fused < 2; ++fused) {
        Tensor r = r0.detach().requires_grad_();
        y[fused] =
            fused ? batch_norm_add_relu(x, r, {}, {}, rm, rv, false) : relu(batch_norm(x, {}, {}, rm, rv, false) + r);
        y[fused].backward(full_like(y[fused], -0.0));
        grad[fused] = r.grad().cpu().contiguous();
      }
      const std::string what = cat(cuda ? "cuda" : "cpu", cl ? " channels-last" : "");
      const std::vector<double> got = grad[1].to_vector(), want = grad[0].to_vector();
      const std::vector<double> out = y[1].cpu().contiguous().to_vector();
      int64_t positive = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(std::signbit(got[i]), std::signbit(want[i])) << what << " element " << i;
        positive += out[i] > 0;
      }
      EXPECT_GT(positive, 10) << what << ": some outputs positive, so some -0 gradients pass";
      EXPECT_TRUE(std::signbit(want[0]) || out[0] <= 0) << what << ": the unfused ops keep -0";
    }
}

// The reduction kernels at the shapes that exercise their geometry: one and
// few channels (many chunks of planes or rows), 64 and 65 channels (16-byte
// loads along C, and the scalar fallback when C is not a multiple of the
// vector), 2048 channels (several channel tiles), planes too small for a
// warp, and an input whose storage offset is not 16-byte aligned. NCHW and
// channels-last, every dtype, training (with running statistics) and eval.
// The mean is far from zero so that a one-pass variance that cancels would
// fail the tolerance.
TEST_F(CudaNnOps, BatchNormShapesMatchCpu) {
  struct Case {
    Shape x;
    bool offset;  // x on the device one element into its buffer (off every vector alignment)
  };
  const std::vector<Case> cases = {{{16, 1, 33, 31}, false}, {{5, 3, 13, 11}, false}, {{4, 64, 9, 9}, false},
                                   {{3, 65, 7, 5}, true},    {{2, 2048, 2, 3}, false}, {{40, 8, 1, 1}, false}};
  uint64_t seed = 500;
  for (const Case& cs : cases)
    for (DType dt : kTypes)
      for (bool cl : {false, true}) {
        const DType pt = dt == DType::Float64 ? DType::Float64 : DType::Float32;
        const int64_t c = cs.x[1];
        Tensor x = rnd(cs.x, seed++, dt, 2.0) + 3.0;
        Tensor w = rnd({c}, seed++, pt), b = rnd({c}, seed++, pt);
        Tensor rm = rnd({c}, seed++, pt), rv = rnd({c}, seed++, pt, 0.1) + 1.0;
        // The offset made on the device: a CPU view copied there (run()'s
        // .cuda()) is aligned, so while the offset was made on the CPU the
        // kernels never saw it (with it, 4 more of reduce_planes_kernel's
        // instantiations run here, its scalar ones).
        auto layout = [cl, offset = cs.offset](Tensor t) {
          if (cl) t = channels_last(t);
          if (!offset) return t;
          Tensor v = Tensor::empty({t.numel() + 1}, t.options()).as_strided(t.sizes(), t.strides(), 1);
          v.copy_(t);
          return v;
        };
        for (bool training : {true, false}) {
          Tensor rm_c = rm.clone(), rv_c = rv.clone(), rm_g = rm.cuda(), rv_g = rv.cuda();
          Fn cpu_f = [&](const std::vector<Tensor>& v) { return batch_norm(v[0], v[1], v[2], rm_c, rv_c, training, 0.1); };
          Fn gpu_f = [&](const std::vector<Tensor>& v) {
            Tensor y = batch_norm(v[0], v[1], v[2], rm_g, rv_g, training, 0.1);
            // (One channel or 1x1 planes: both layouts are the same memory.)
            if (c > 1 && cs.x[2] * cs.x[3] > 1) {
              EXPECT_EQ(y.suggest_memory_format(), cl ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous);
            }
            return y;
          };
          Outcome o_c = run(cpu_f, {x, w, b}, false), o_g = run(gpu_f, {x, w, b}, true, layout);
          const std::string what = cat("batch_norm x", cs.x, cl ? " channels-last " : " ", training ? "train " : "eval ", dt);
          expect_same(o_c.y, o_g.y, tol(dt) * 2, what + " forward");
          for (size_t i = 0; i < 3; ++i) expect_same(o_c.grads[i], o_g.grads[i], tol(dt) * 8, cat(what, " grad ", i));
          expect_same(rm_c, rm_g, tol(pt), what + " running_mean");
          expect_same(rv_c, rv_g, tol(pt), what + " running_var");
        }
      }
}

// Statistics far from zero (mean 1e4, std 1): a one-pass variance that
// cancels (E[x^2] - E[x]^2 in float) would be off by orders of magnitude;
// the kernels' shifted sums and Welford merges match float64 to the float
// rounding of x itself (about 1e4 * 6e-8 relative to the std).
TEST_F(CudaNnOps, BatchNormLargeMeanMatchesFloat64) {
  for (bool cl : {false, true}) {
    Tensor x = rnd({8, 4, 15, 15}, 950, DType::Float32) + 1e4;
    Tensor rm = zeros({4}), rv = ones({4}), rm_d = zeros({4}, DType::Float64), rv_d = ones({4}, DType::Float64);
    Tensor rm_g = rm.cuda(), rv_g = rv.cuda();
    Tensor xg = cl ? channels_last(x.cuda()) : x.cuda();
    Tensor y = batch_norm(xg, Tensor(), Tensor(), rm_g, rv_g, true, 0.5);
    Tensor ref = batch_norm(x.to(DType::Float64), Tensor(), Tensor(), rm_d, rv_d, true, 0.5);
    expect_same(ref.to(DType::Float32), y, 2e-3, cl ? "large mean, channels-last" : "large mean");
    expect_same(rv_d.to(DType::Float32), rv_g, 1e-3, "large mean running_var");
    expect_same(rm_d.to(DType::Float32), rm_g, 1e-3, "large mean running_mean");
  }
}

// The CUDA batch norm is deterministic: partials merge in a fixed order, so
// two runs give the same bits (no atomics), forward and backward.
TEST_F(CudaNnOps, BatchNormIsDeterministic) {
  for (bool cl : {false, true}) {
    Tensor x = rnd({6, 5, 17, 19}, 900, DType::Float32).cuda();
    if (cl) x = channels_last(x);
    Tensor w = rnd({5}, 901, DType::Float32).cuda(), b = rnd({5}, 902, DType::Float32).cuda();
    std::vector<Tensor> outs;
    for (int rep = 0; rep < 2; ++rep) {
      Tensor xi = x.detach().requires_grad_(), wi = w.detach().requires_grad_(), bi = b.detach().requires_grad_();
      Tensor y = batch_norm(xi, wi, bi, Tensor(), Tensor(), true);
      sum(y * y).backward();
      outs.push_back(y.cpu());
      outs.push_back(xi.grad().cpu());
      outs.push_back(wi.grad().cpu());
    }
    for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(allclose(outs[i], outs[3 + i], 0, 0)) << "output " << i << (cl ? " channels-last" : "");
  }
}

// A ResNet stem in channels-last on the GPU (cuDNN NHWC conv, batch norm
// through its [N*H*W, C] view, relu, max-pool) against NCHW on the CPU; the
// layout survives every op.
TEST_F(CudaNnOps, ChannelsLastStemMatchesCpu) {
  uint64_t seed = 300;
  for (DType dt : {DType::Float32, DType::Float16}) {
    const DType pt = DType::Float32;
    Tensor x = rnd({4, 3, 16, 16}, seed++, dt), w = rnd({8, 3, 3, 3}, seed++, dt, 0.5);
    Tensor g = rnd({8}, seed++, pt), b = rnd({8}, seed++, pt);
    Fn f = [](const std::vector<Tensor>& v) {
      Tensor h = relu(batch_norm(conv2d(v[0], v[1], Tensor(), {2, 2}, {1, 1}), v[2], v[3], Tensor(), Tensor(), true));
      if (h.is_cuda()) {
        EXPECT_EQ(h.suggest_memory_format(), MemoryFormat::ChannelsLast);
      }
      Tensor y = max_pool2d(h, {3, 3}, {2, 2}, {1, 1});
      if (y.is_cuda()) {
        EXPECT_EQ(y.suggest_memory_format(), MemoryFormat::ChannelsLast);
      }
      return y;
    };
    compare(f, {x, w, g, b}, tol(dt) * 4, cat("channels-last stem ", dt), [](Tensor t) { return channels_last(t); });
  }
}

using testing::PoolCase;
const std::vector<PoolCase> kPoolCases =
    testing::pool_cases({{{4, 8, 56, 56}, {3, 3}, {2, 2}, {1, 1}, false}});  // and the ResNet stem's size

// NCHW, and channels-last on the device (its native NHWC kernels) against
// NCHW on the CPU; a channels-last pool keeps the layout, forward and back.
TEST_F(CudaNnOps, PoolingMatchesCpu) {
  uint64_t seed = 300;
  for (bool cl : {false, true})
    for (const PoolCase& c : kPoolCases)
      for (DType dt : kTypes) {
        const std::vector<Tensor> in = {rnd(c.x, seed++, dt)};
        const std::string what = cat(cl ? "channels-last " : "", "x", c.x, " k", c.k[0], " s", c.s[0], " p", c.p[0],
                                     c.ceil ? " ceil " : " ", dt);
        auto layout = [cl](Tensor t) { return cl ? channels_last(t) : t; };
        auto keeps = [&](const Tensor& y) {
          if (cl && y.is_cuda() && y.size(1) > 1) {
            EXPECT_TRUE(y.is_contiguous(MemoryFormat::ChannelsLast)) << what;
          }
          return y;
        };
        compare([&](const std::vector<Tensor>& v) { return keeps(max_pool2d(v[0], c.k, c.s, c.p, c.ceil)); }, in,
                tol(dt), cat("max_pool2d ", what), layout);
        for (bool include_pad : {true, false})
          compare(
              [&](const std::vector<Tensor>& v) { return keeps(avg_pool2d(v[0], c.k, c.s, c.p, c.ceil, include_pad)); },
              in, tol(dt), cat("avg_pool2d ", include_pad ? "incl " : "excl ", what), layout);
      }
  // No layout copies in a channels-last pool, forward or backward.
  Tensor x = channels_last(rnd({2, 8, 9, 9}, 390, DType::Float32).cuda()).requires_grad_();
  const uint64_t before = cuda_layout_copies();
  sum(max_pool2d(x, {3, 3}, {2, 2}, {1, 1}) + avg_pool2d(x, {3, 3}, {2, 2}, {1, 1})).backward();
  EXPECT_EQ(cuda_layout_copies() - before, 0u);
  EXPECT_TRUE(x.grad().is_contiguous(MemoryFormat::ChannelsLast));
}

// The kernels index in 32 bits with multiply-high divisors where the tensors
// fit and in 64 bits otherwise: the two paths, and the CPU, give the same
// bits forward and backward (max and avg, both layouts, indices in one
// byte and in four). The 64-bit path runs on these small tensors with the
// 32-bit limit lowered to nothing.
TEST_F(CudaNnOps, PoolingIndexWidthsAgreeBitForBit) {
  uint64_t seed = 800;
  for (bool cl : {false, true})
    for (const PoolCase& c : kPoolCases)
      for (DType dt : {DType::Float32, DType::BFloat16}) {
        const std::string what = cat(cl ? "channels-last " : "", "x", c.x, " k", c.k[0], "x", c.k[1], " ", dt);
        Tensor x = rnd(c.x, seed++, dt), x_cl = cl ? channels_last(x) : x;
        for (bool max : {true, false}) {
          std::vector<Tensor> outs;
          for (int path = 0; path < 3; ++path) {  // CPU, CUDA 32-bit, CUDA 64-bit
            const IntDiv32LimitScope index_path(path == 2 ? 0 : INT64_MAX);
            Tensor xi = (path == 0 ? x_cl : x_cl.cuda()).detach().requires_grad_();
            Tensor y = max ? max_pool2d(xi, c.k, c.s, c.p, c.ceil) : avg_pool2d(xi, c.k, c.s, c.p, c.ceil, false);
            sum(y * y).backward();
            outs.push_back(y.cpu().contiguous());
            outs.push_back(xi.grad().cpu().contiguous());
          }
          for (int path = 1; path < 3; ++path)
            for (int k = 0; k < 2; ++k)
              EXPECT_TRUE(allclose(outs[2 * path + k], outs[k], 0, 0))
                  << (max ? "max " : "avg ") << what << (k ? " dx" : " y") << (path == 2 ? ", 64-bit" : ", 32-bit");
        }
      }
}

}  // namespace
}  // namespace ember
