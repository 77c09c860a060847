// DataLoader throughput in examples/s, against what training consumes
// (~80-700 images/s on this machine, so the loader should be far ahead):
//  - Fashion-MNIST train (60000 x 1x28x28 uint8) with the standard
//    augmentation (random crop 28 with padding 2, horizontal flip, uint8 ->
//    float, normalize 0.2860/0.3530), batch 64 and 128, 0/1/2/4 workers;
//    one iteration is one epoch;
//  - the same chain run step by step per example and stacked with
//    ember::stack: what the fused collation saves;
//  - CIFAR-shaped synthetic images (3x32x32, crop 32 pad 4), generated on
//    the fly, to show a heavier per-example cost.
// Worker threads do the work, so times are wall-clock (UseRealTime).
#include <benchmark/benchmark.h>

#include <filesystem>

#include "core/ops.h"
#include "data/loader.h"
#include "data/readers.h"

namespace {
using namespace ember;
using namespace ember::data;

std::shared_ptr<const Dataset> fashion_train() {
  static const std::shared_ptr<const Dataset> ds = []() -> std::shared_ptr<const Dataset> {
    if (std::filesystem::is_directory(kFashionMnistRoot)) return std::make_shared<FashionMNIST>();
    return std::make_shared<SyntheticImages>(60000, Shape{1, 28, 28}, 10);  // same shape when the files are absent
  }();
  return ds;
}

TransformPtr fashion_transform() {
  return compose({random_crop(28, 2), random_horizontal_flip(), to_float(), normalize({0.2860}, {0.3530})});
}

void BM_FashionMnistEpoch(benchmark::State& state) {
  auto ds = fashion_train();
  DataLoader loader(ds, {.batch_size = state.range(0), .shuffle = true, .num_workers = static_cast<int>(state.range(1)),
                         .transform = fashion_transform(), .seed = 1});
  int64_t examples = 0;
  for (auto _ : state) {
    for (Batch& b : loader) {
      benchmark::DoNotOptimize(b.data.raw_data());
      examples += b.size();
    }
  }
  state.counters["examples/s"] = benchmark::Counter(static_cast<double>(examples), benchmark::Counter::kIsRate);
  state.SetLabel(std::filesystem::is_directory(kFashionMnistRoot) ? "fashion-mnist" : "synthetic 1x28x28");
}
BENCHMARK(BM_FashionMnistEpoch)
    ->ArgNames({"batch", "workers"})
    ->ArgsProduct({{64, 128}, {0, 1, 2, 4}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The unfused way: every example through the chain as separate tensors
// (crop -> flip -> float -> normalized), then ember::stack. 100 batches per
// iteration.
void BM_StepByStepThenStack(benchmark::State& state) {
  auto ds = fashion_train();
  auto tf = fashion_transform();
  const int64_t batch = state.range(0), batches = 100;
  int64_t examples = 0;
  for (auto _ : state) {
    for (int64_t b = 0; b < batches; ++b) {
      std::vector<Tensor> xs;
      std::vector<double> labels;
      for (int64_t j = 0; j < batch; ++j) {
        int64_t idx = b * batch + j;
        Example e = ds->get(idx);
        RandomStream rng(1, StreamKind::Transform, 0, idx);
        xs.push_back(tf->apply(e.data, rng));
        labels.push_back(static_cast<double>(e.label));
      }
      Tensor x = stack(xs), y = Tensor::from_vector(labels, {batch}, DType::Int64);
      benchmark::DoNotOptimize(x.raw_data());
      benchmark::DoNotOptimize(y.raw_data());
      examples += batch;
    }
  }
  state.counters["examples/s"] = benchmark::Counter(static_cast<double>(examples), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_StepByStepThenStack)->ArgName("batch")->Arg(64)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_SyntheticCifarEpoch(benchmark::State& state) {
  auto ds = std::make_shared<SyntheticImages>(10000, Shape{3, 32, 32}, 10);
  auto tf = compose({random_crop(32, 4), random_horizontal_flip(), to_float(),
                     normalize({0.4914, 0.4822, 0.4465}, {0.2470, 0.2435, 0.2616})});
  DataLoader loader(ds, {.batch_size = 128, .shuffle = true, .num_workers = static_cast<int>(state.range(0)),
                         .transform = tf});
  int64_t examples = 0;
  for (auto _ : state)
    for (Batch& b : loader) examples += b.size();
  state.counters["examples/s"] = benchmark::Counter(static_cast<double>(examples), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_SyntheticCifarEpoch)->ArgName("workers")->Arg(0)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
