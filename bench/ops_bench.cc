// CPU op throughput against the machine's own ceilings:
//  - matmul GFLOP/s at 512/1024/2048 beside OpenBLAS sgemm called directly
//    (ours adds only dispatch) and as a fraction of the FMA peak;
//  - elementwise add and a full sum in GB/s beside memcpy of the same bytes
//    (1 and all threads).
// Bytes counted are bytes moved: add reads 2N and writes N floats; memcpy of
// S bytes moves 2S.
#include <benchmark/benchmark.h>
#include <cblas.h>
#include <omp.h>

#include <cstring>
#include <fstream>
#include <string>

#include "core/ops.h"

namespace {
using namespace ember;

// Peak fp32 FLOP/s: cores x GHz x 32 (two 256-bit FMA pipes, 8 lanes, 2 flops),
// which is what Zen 4 and recent Intel cores sustain on AVX2/AVX-512 code.
double peak_gflops() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  double mhz = 0;
  while (std::getline(f, line))
    if (line.rfind("cpu MHz", 0) == 0) { mhz = std::stod(line.substr(line.find(':') + 1)); break; }
  return omp_get_max_threads() * (mhz / 1000.0) * 32.0;
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
  for (auto _ : state)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data<float>(), n, b.data<float>(), n,
                0.0f, c.data<float>(), n);
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * n * n * n, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_OpenBlasSgemm)->Arg(512)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();

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
