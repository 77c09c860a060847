// CPU op throughput against the machine's own ceilings:
//  - matmul GFLOP/s at 512/1024/2048 beside OpenBLAS sgemm called directly
//    (ours adds only dispatch) and as a fraction of the FMA peak;
//  - elementwise add and a full sum in GB/s beside memcpy of the same bytes
//    (1 and all threads);
//  - batch norm then ReLU, forward and backward on a ResNet activation, as
//    two ops (/0) and as batch_norm_relu (/1); a residual block's tail,
//    relu(batch_norm(x) + residual), as three ops (/0) and as
//    batch_norm_add_relu (/1);
//  - AdamW on bfloat16 parameters through float32 masters, op by op (/0)
//    and in the fused step's one pass (/1).
// Bytes counted are bytes moved: add reads 2N and writes N floats; memcpy of
// S bytes moves 2S.
#include <benchmark/benchmark.h>
#include <cblas.h>
#include <omp.h>

#include <chrono>
#include <cstring>

#include "bench/master_step.h"
#include "core/ops.h"
#include "core/ops_nn.h"

extern "C" char* openblas_get_corename();

namespace {
using namespace ember;

// Measured fp32 peak: every thread runs independent chains of register-only
// FMAs at the widest vector width the CPU has (so the figure includes turbo
// and is comparable with what OpenBLAS's kernels can use).
typedef float v8f __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));

template <typename vec, int W>
[[gnu::always_inline]] inline double fma_gflops_one_thread() {
  vec acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = vec{} + static_cast<float>(i);
  const vec m = vec{} + 0.999999f, a = vec{} + 1e-7f;
  const int64_t iters = 20000000;
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < iters; ++k)
    for (int i = 0; i < 12; ++i) acc[i] = acc[i] * m + a;
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sink = 0;
  for (int i = 0; i < 12; ++i) sink += acc[i][0];
  benchmark::DoNotOptimize(sink);
  return 2.0 * W * 12 * iters / secs / 1e9;
}

__attribute__((target("avx512f"))) double fma_gflops_avx512() { return fma_gflops_one_thread<v16f, 16>(); }
double fma_gflops_avx2() { return fma_gflops_one_thread<v8f, 8>(); }

double peak_gflops() {
  static const double peak = [] {
    double total = 0;
#pragma omp parallel reduction(+ : total)
    total += __builtin_cpu_supports("avx512f") ? fma_gflops_avx512() : fma_gflops_avx2();
    return total;
  }();
  return peak;
}

void BM_Matmul(benchmark::State& state) {
  const int64_t n = state.range(0);
  Tensor a = randn({n, n}), b = randn({n, n});
  for (auto _ : state) benchmark::DoNotOptimize(matmul(a, b).raw_data());
  double flops = 2.0 * n * n * n;
  state.counters["GFLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
  state.counters["peak_GFLOP/s"] = peak_gflops();
}
BENCHMARK(BM_Matmul)->Arg(512)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_OpenBlasSgemm(benchmark::State& state) {
  const int64_t n = state.range(0);
  Tensor a = randn({n, n}), b = randn({n, n}), c = empty({n, n});
  state.SetLabel(openblas_get_corename());  // OPENBLAS_CORETYPE decides it
  for (auto _ : state)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data<float>(), n, b.data<float>(), n,
                0.0f, c.data<float>(), n);
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * n * n * n, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_OpenBlasSgemm)->Arg(512)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();

// A training-like mix: an OpenMP elementwise op, then a GEMM. Shows whether
// BLAS threads and our OpenMP threads share the cores or fight over them.
void BM_AddThenMatmul(benchmark::State& state) {
  const int64_t n = state.range(0);
  Tensor a = randn({n, n}), b = randn({n, n});
  for (auto _ : state) {
    Tensor c = relu(a + b);
    benchmark::DoNotOptimize(matmul(c, b).raw_data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * n * n * n, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_AddThenMatmul)->Arg(256)->Arg(512)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();

constexpr int64_t kN = 1 << 24;  // 64 MiB per fp32 tensor: far beyond cache

void BM_AddF32(benchmark::State& state) {
  Tensor a = rand({kN}), b = rand({kN});
  Tensor out = empty({kN});
  for (auto _ : state) {
    Tensor c = a + b;  // includes the output allocation, as a user sees it
    benchmark::DoNotOptimize(c.raw_data());
  }
  state.counters["GB/s"] = benchmark::Counter(3.0 * kN * 4, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_AddF32)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_AddInPlaceF32(benchmark::State& state) {
  Tensor a = rand({kN}), b = rand({kN});
  for (auto _ : state) {
    a += b;
    benchmark::DoNotOptimize(a.raw_data());
  }
  state.counters["GB/s"] = benchmark::Counter(3.0 * kN * 4, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_AddInPlaceF32)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_SumF32(benchmark::State& state) {
  Tensor a = rand({kN});
  for (auto _ : state) benchmark::DoNotOptimize(sum(a).raw_data());
  state.counters["GB/s"] = benchmark::Counter(1.0 * kN * 4, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_SumF32)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_SumRowsF32(benchmark::State& state) {  // [4096, 4096] over dim 1
  Tensor a = rand({4096, 4096});
  for (auto _ : state) benchmark::DoNotOptimize(sum(a, {1}).raw_data());
  state.counters["GB/s"] = benchmark::Counter(4096.0 * 4096 * 4, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_SumRowsF32)->Unit(benchmark::kMillisecond)->UseRealTime();

// memcpy of the add's bytes: 3N floats moved = 1.5N floats copied.
// A training step's batch norm + ReLU on layer1 of a ResNet-50 at batch 32
// ([32, 64, 56, 56] float32): forward, then backward of a fixed gradient.
void BM_BatchNormRelu(benchmark::State& state) {
  const bool fused = state.range(0) == 1;
  Generator g(1);
  const Tensor x0 = randn({32, 64, 56, 56}, {DType::Float32}, &g), dy = randn({32, 64, 56, 56}, {DType::Float32}, &g);
  Tensor w = ones({64}).requires_grad_(), b = zeros({64}).requires_grad_();
  Tensor rm = zeros({64}), rv = ones({64});
  for (auto _ : state) {
    Tensor x = x0.detach().requires_grad_();
    Tensor y = fused ? batch_norm_relu(x, w, b, rm, rv, true) : relu(batch_norm(x, w, b, rm, rv, true));
    y.backward(dy);
    benchmark::DoNotOptimize(x.grad().data<float>());
  }
  state.SetBytesProcessed(state.iterations() * x0.numel() * 4);
}
BENCHMARK(BM_BatchNormRelu)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

// A residual block's tail on the same activation, relu(batch_norm(x) +
// residual), forward then backward (the residual's gradient too): as three
// ops (/0) and as batch_norm_add_relu (/1).
void BM_BatchNormAddRelu(benchmark::State& state) {
  const bool fused = state.range(0) == 1;
  Generator g(3);
  const Tensor x0 = randn({32, 64, 56, 56}, {DType::Float32}, &g), r0 = randn({32, 64, 56, 56}, {DType::Float32}, &g);
  const Tensor dy = randn({32, 64, 56, 56}, {DType::Float32}, &g);
  Tensor w = ones({64}).requires_grad_(), b = zeros({64}).requires_grad_();
  Tensor rm = zeros({64}), rv = ones({64});
  for (auto _ : state) {
    Tensor x = x0.detach().requires_grad_(), r = r0.detach().requires_grad_();
    Tensor y = fused ? batch_norm_add_relu(x, r, w, b, rm, rv, true) : relu(batch_norm(x, w, b, rm, rv, true) + r);
    y.backward(dy);
    benchmark::DoNotOptimize(x.grad().data<float>());
    benchmark::DoNotOptimize(r.grad().data<float>());
  }
  state.SetBytesProcessed(state.iterations() * x0.numel() * 4);
}
BENCHMARK(BM_BatchNormAddRelu)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

// GPT-2's MLP activation at 124M width and 8 x 1024 tokens ([8192, 3072]
// float32): the bias add and tanh GELU forward, then backward of a fixed
// gradient with the bias's column sum; as two ops (linear's bias add, gelu)
// or as bias_gelu (0 / 1).
void BM_BiasGelu(benchmark::State& state) {
  const bool fused = state.range(0) == 1;
  Generator g(2);
  const Tensor h0 = randn({8192, 3072}, {DType::Float32}, &g), dy = randn({8192, 3072}, {DType::Float32}, &g);
  Tensor b = zeros({3072}).requires_grad_();
  for (auto _ : state) {
    Tensor h = h0.detach().requires_grad_();
    Tensor y;
    if (fused) {
      y = bias_gelu(h, b, true);
    } else {
      Tensor t = h + b;
      y = gelu(t, true);
    }
    y.backward(dy);
    benchmark::DoNotOptimize(h.grad().data<float>());
  }
  state.SetBytesProcessed(state.iterations() * h0.numel() * 4);
}
BENCHMARK(BM_BiasGelu)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

// AdamW's step over 16 bfloat16 parameters of 1 M elements with float32
// masters: op by op (0) or fused (1). GB/s counts the fused pass's bytes
// (30 an element) for both, so the ratio of the two is the speedup.
void BM_AdamWMasters(benchmark::State& state) {
  const bool fused = state.range(0) == 1;
  bench::MasterStep s = bench::make_master_step(16, 1 << 20, DType::BFloat16, kCPU);
  for (auto _ : state) bench::master_step(s, fused);
  state.counters["GB/s"] =
      benchmark::Counter(16.0 * (1 << 20) * bench::kMasterStepBytes, benchmark::Counter::kIsIterationInvariantRate,
                         benchmark::Counter::kIs1000);
}
BENCHMARK(BM_AdamWMasters)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Memcpy(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const size_t bytes = static_cast<size_t>(1.5 * kN) * 4;
  Tensor src = rand({kN * 3 / 2}), dst = empty({kN * 3 / 2});
  char* s = static_cast<char*>(src.raw_data());
  char* d = static_cast<char*>(dst.raw_data());
  for (auto _ : state) {
#pragma omp parallel num_threads(threads)
    {
      int t = omp_get_thread_num(), T = omp_get_num_threads();
      size_t b = bytes * t / T, e = bytes * (t + 1) / T;
      std::memcpy(d + b, s + b, e - b);
    }
    benchmark::ClobberMemory();
  }
  state.counters["GB/s"] = benchmark::Counter(2.0 * bytes, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_Memcpy)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
