// One training step (zero_grad, forward, cross-entropy, backward, SGD step)
// of ResNet-18 with the small-image stem on 1x28x28 inputs, batch 64, fp32,
// SGD(momentum 0.9, lr 0.05): the workload of the PyTorch peer
// bench/peers/resnet18_train_step.py. --width 16 gives the narrow variant.
//
//   bazel run -c opt //bench:train_bench -- --benchmark_min_time=20
//
// Counters: img/s. Threads: OpenMP's default (all cores) for our kernels,
// oneDNN and OpenBLAS alike.
//
// BM_ResNet50StepCuda is the GPU step workload (ResNet-50, batch 256,
// 3x224x224, fp32, channels-last activations); it reports "skipped: no GPU"
// on a machine without one.
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>

#include "bench/train_step.h"
#include "core/autocast.h"
#include "core/profiler.h"
#include "nn/models.h"
#include "optim/grad_scaler.h"
#include "optim/optimizer.h"

namespace ember {
namespace {

// The ResNet-18 step of the benchmarks below, warmed up (primitive
// creation, allocator caches).
struct ResNetStep {
  ResNetStep(int64_t width, int64_t batch) {
    manual_seed(0);
    model = nn::resnet18({.num_classes = 10, .in_channels = 1, .small_stem = true, .width = width});
    model->train();
    opt = std::make_unique<optim::SGD>(model->parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
    x = randn({batch, 1, 28, 28});
    y = randint(0, 10, {batch});
    for (int i = 0; i < 3; ++i) (*this)();
  }
  double operator()() { return bench::train_step(*model, *opt, x, y); }
  std::shared_ptr<nn::Module> model;
  std::unique_ptr<optim::SGD> opt;
  Tensor x, y;
};

void BM_ResNet18Step(benchmark::State& state) {
  const int64_t batch = state.range(1);
  ResNetStep step(state.range(0), batch);
  for (auto _ : state) benchmark::DoNotOptimize(step());
  state.counters["img_per_s"] = benchmark::Counter(static_cast<double>(batch), benchmark::Counter::kIsIterationInvariantRate);
  // The process's peak RSS so far (the peer reports the same): filter to one
  // benchmark per process for a per-configuration figure.
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  state.counters["peak_rss_MiB"] = static_cast<double>(ru.ru_maxrss) / 1024.0;
  // Of which tensors at their peak, and what the allocator holds (live + cached).
  state.counters["peak_alloc_MiB"] = static_cast<double>(cpu_allocator()->stats().peak_allocated) / (1 << 20);
  state.counters["reserved_MiB"] = static_cast<double>(cpu_allocator()->stats().reserved) / (1 << 20);
}
BENCHMARK(BM_ResNet18Step)->Args({64, 64})->Args({16, 64})->Unit(benchmark::kMillisecond)->UseRealTime();

// The same step with the profiler recording it (a session per step: start,
// step, stop; the events of the last step stay until the next start), for
// the profiler's cost: compare with BM_ResNet18Step in one run. The off
// state's cost is BM_ResNet18Step built with and without the hooks
// (--copt=-DEMBER_PROFILER_HOOKS=0).
void BM_ResNet18StepProfiled(benchmark::State& state) {
  const int64_t batch = state.range(1);
  ResNetStep step(state.range(0), batch);
  size_t events = 0;
  for (auto _ : state) {
    profiler::start();
    benchmark::DoNotOptimize(step());
    profiler::stop();
  }
  const auto last = profiler::events();
  events = last.size();
  state.counters["events_per_step"] = static_cast<double>(events);
  // The last step's table (torch.profiler's key_averages), on stderr.
  if (std::getenv("EMBER_BENCH_PROFILE_TABLE")) std::fputs(profiler::summary_table(last, 30).c_str(), stderr);
  state.counters["img_per_s"] = benchmark::Counter(static_cast<double>(batch), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_ResNet18StepProfiled)->Args({64, 64})->Args({16, 64})->Unit(benchmark::kMillisecond)->UseRealTime();

// The same step in mixed precision: mode 0 float32, 1 bfloat16
// autocast, 2 float16 autocast + GradScaler, as the peer's
// `resnet18_train_step.py --amp bf16|fp16` does it (autocast around forward
// and loss; backward and step outside). Batch 64.
void BM_ResNet18StepAmp(benchmark::State& state) {
  const int64_t width = state.range(0), mode = state.range(1), batch = 64;
  manual_seed(0);
  auto model = nn::resnet18({.num_classes = 10, .in_channels = 1, .small_stem = true, .width = width});
  model->train();
  optim::SGD opt(model->parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
  optim::GradScaler scaler({.enabled = mode == 2});
  Tensor x = randn({batch, 1, 28, 28});
  Tensor y = randint(0, 10, {batch});
  auto step = [&] {
    opt.zero_grad();
    Tensor loss;
    {
      std::optional<AutocastGuard> amp;
      if (mode > 0) amp.emplace(DeviceType::CPU, mode == 1 ? DType::BFloat16 : DType::Float16);
      loss = nn::functional::cross_entropy((*model)(x), y);
    }
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
    return loss.item();
  };
  for (int i = 0; i < 3; ++i) step();
  // Peak memory of one step: what the step allocates above what lives
  // between steps (parameters, gradients, momentum, the batch), and the
  // process's high-water mark of tensor memory during it.
  opt.zero_grad();
  Allocator* alloc = cpu_allocator();
  const double live = static_cast<double>(alloc->stats().allocated);
  alloc->reset_peak_stats();
  step();
  const double peak = static_cast<double>(alloc->stats().peak_allocated);
  for (auto _ : state) benchmark::DoNotOptimize(step());
  state.counters["img_per_s"] = benchmark::Counter(static_cast<double>(batch), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_MiB"] = peak / (1 << 20);
  state.counters["step_MiB"] = (peak - live) / (1 << 20);
  state.SetLabel(mode == 0 ? "fp32" : mode == 1 ? "bf16 autocast" : "fp16 autocast + GradScaler");
}
BENCHMARK(BM_ResNet18StepAmp)
    ->ArgNames({"width", "mode"})
    ->ArgsProduct({{16, 64}, {0, 1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_ResNet50StepCuda(benchmark::State& state) {
  if (!cuda_is_available()) {
    state.SkipWithError(("no GPU: " + cuda_unavailable_reason()).c_str());
    return;
  }
  const int64_t batch = state.range(0);
  const bool channels_last = state.range(1) != 0;
  manual_seed(0);
  auto model = nn::resnet50({.num_classes = 1000,
                             .memory_format = channels_last ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous});
  model->to(cuda_device(0));
  model->train();
  optim::SGD opt(model->parameters(), optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-4});
  Tensor x = randn({batch, 3, 224, 224}).cuda();
  Tensor y = randint(0, 1000, {batch}).cuda();
  auto step = [&] { return bench::train_step(*model, opt, x, y); };
  for (int i = 0; i < 3; ++i) step();
  for (auto _ : state) benchmark::DoNotOptimize(step());
  state.counters["img_per_s"] = benchmark::Counter(static_cast<double>(batch), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_ResNet50StepCuda)->Args({256, 1})->Args({256, 0})->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_MlpStep(benchmark::State& state) {
  manual_seed(0);
  auto model = nn::mlp({784, 512, 256, 10});
  optim::SGD opt(model->parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
  Tensor x = randn({128, 1, 28, 28});
  Tensor y = randint(0, 10, {128});
  for (auto _ : state) benchmark::DoNotOptimize(bench::train_step(*model, opt, x, y));
  state.counters["img_per_s"] = benchmark::Counter(128.0, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_MlpStep)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace ember
