// Batch norm on the GPU at every ResNet-50 shape (batch 256): ours (the
// kernels of core/ops/batch_norm.cu) beside cuDNN's batch norm called
// directly (cudnnBatchNormalizationForwardTrainingEx / BackwardEx in
// SPATIAL_PERSISTENT mode, what PyTorch calls for float32), NCHW and NHWC,
// float32 and bfloat16. A training forward (statistics, running statistics,
// normalise) and a backward (dx, dw, db) per iteration.
//
// GB/s counts the bytes the passes must move at the least: forward reads x
// twice (statistics, normalise) and writes y; backward reads x and dy twice
// and writes dx. Compare with BM_CudaMemcpyD2D in ops_cuda_bench (read +
// write, about 2.9 TB/s on an H100): the target is at least 75 % of it.
//
//   bench/gpu_perf.sh kernels     (on the GPU machine, from the gpu-bundle)
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <vector>

#include "core/cuda_check.h"
#include "core/ops.h"
#include "core/ops/kernels.h"

namespace {
using namespace ember;

// (C, H) of every batch norm in torchvision's ResNet-50 (H = W).
const std::vector<std::pair<int64_t, int64_t>> kShapes = {{64, 112}, {64, 56},  {256, 56}, {128, 56},
                                                          {128, 28}, {512, 28}, {256, 28}, {256, 14},
                                                          {1024, 14}, {512, 14}, {512, 7},  {2048, 7}};
constexpr int64_t kBatch = 256;

void Shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"C", "H", "nhwc", "bf16"});
  for (auto [c, h] : kShapes)
    for (int nhwc : {0, 1})
      for (int bf16 : {0, 1}) b->Args({c, h, nhwc, bf16});
}

bool need_gpu(benchmark::State& state) {
  if (cuda_is_available()) return true;
  state.SkipWithError(("no GPU: " + cuda_unavailable_reason()).c_str());
  return false;
}

struct Problem {
  int64_t c, h;
  bool nhwc;
  DType dt;
  Tensor x, dy, y, dx;  // as the kernels see them: [n, c, s] memory
  Tensor w, b, rm, rv, mean, invstd, dw, db;
  explicit Problem(const benchmark::State& s)
      : c(s.range(0)), h(s.range(1)), nhwc(s.range(2) != 0), dt(s.range(3) ? DType::BFloat16 : DType::Float32) {
    // NHWC memory is [N*H*W, C, 1, 1] to the kernels (batch_norm.cc's view).
    const Shape shape = nhwc ? Shape{kBatch * h * h, c, 1, 1} : Shape{kBatch, c, h, h};
    const TensorOptions o{dt, cuda_device()}, f{DType::Float32, cuda_device()};
    x = randn(shape, o);
    dy = randn(shape, o);
    y = empty(shape, o);
    dx = empty(shape, o);
    w = rand({c}, f);
    b = rand({c}, f);
    rm = zeros({c}, f);
    rv = ones({c}, f);
    mean = empty({c}, f);
    invstd = empty({c}, f);
    dw = empty({c}, f);
    db = empty({c}, f);
  }
  double bytes_per_iter() const { return 8.0 * static_cast<double>(x.numel() * dtype_size(dt)); }
};

void report(benchmark::State& state, const Problem& p) {
  state.counters["GB/s"] =
      benchmark::Counter(p.bytes_per_iter(), benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}

void BM_BatchNormOurs(benchmark::State& state) {
  if (!need_gpu(state)) return;
  Problem p(state);
  for (auto _ : state) {
    batch_norm_stats_cuda(p.x, p.mean, p.invstd, 1e-5, &p.rm, &p.rv, 0.1);
    batch_norm_apply_cuda(p.x, p.mean, p.invstd, p.w, p.b, p.y);
    batch_norm_backward_cuda(p.x, p.dy, p.mean, p.invstd, p.w, true, &p.dx, &p.dw, &p.db);
    cuda_synchronize();
  }
  report(state, p);
}
BENCHMARK(BM_BatchNormOurs)->Apply(Shapes)->Unit(benchmark::kMicrosecond)->UseRealTime();

#define CUDNN_OK(call) EMBER_CUDNN_CHECK(call)

void BM_BatchNormCudnn(benchmark::State& state) {
  if (!need_gpu(state)) return;
  Problem p(state);
  cudnnHandle_t h = nullptr;
  CUDNN_OK(cudnnCreate(&h));
  cudnnTensorDescriptor_t xd, pd;
  CUDNN_OK(cudnnCreateTensorDescriptor(&xd));
  CUDNN_OK(cudnnCreateTensorDescriptor(&pd));
  const cudnnDataType_t cdt = p.dt == DType::BFloat16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
  CUDNN_OK(cudnnSetTensor4dDescriptor(xd, p.nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW, cdt, kBatch,
                                      static_cast<int>(p.c), static_cast<int>(p.h), static_cast<int>(p.h)));
  CUDNN_OK(cudnnDeriveBNTensorDescriptor(pd, xd, CUDNN_BATCHNORM_SPATIAL_PERSISTENT));
  const auto mode = CUDNN_BATCHNORM_SPATIAL_PERSISTENT;
  const auto ops = CUDNN_BATCHNORM_OPS_BN;
  size_t fws = 0, bws = 0, rs = 0;
  CUDNN_OK(cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(h, mode, ops, xd, nullptr, xd, pd, nullptr, &fws));
  CUDNN_OK(cudnnGetBatchNormalizationBackwardExWorkspaceSize(h, mode, ops, xd, xd, xd, nullptr, xd, pd, nullptr, &bws));
  CUDNN_OK(cudnnGetBatchNormalizationTrainingExReserveSpaceSize(h, mode, ops, nullptr, xd, &rs));
  Tensor ws = empty({static_cast<int64_t>(std::max(fws, bws)) + 1}, {DType::UInt8, cuda_device()});
  Tensor reserve = empty({static_cast<int64_t>(rs) + 1}, {DType::UInt8, cuda_device()});
  const float one = 1, zero = 0;
  for (auto _ : state) {
    CUDNN_OK(cudnnBatchNormalizationForwardTrainingEx(
        h, mode, ops, &one, &zero, xd, p.x.raw_data(), nullptr, nullptr, xd, p.y.raw_data(), pd, p.w.raw_data(),
        p.b.raw_data(), 0.1, p.rm.raw_data(), p.rv.raw_data(), 1e-5, p.mean.raw_data(), p.invstd.raw_data(), nullptr,
        ws.raw_data(), fws, reserve.raw_data(), rs));
    CUDNN_OK(cudnnBatchNormalizationBackwardEx(
        h, mode, ops, &one, &zero, &one, &zero, xd, p.x.raw_data(), nullptr, nullptr, xd, p.dy.raw_data(), nullptr,
        nullptr, xd, p.dx.raw_data(), pd, p.w.raw_data(), nullptr, p.dw.raw_data(), p.db.raw_data(), 1e-5,
        p.mean.raw_data(), p.invstd.raw_data(), nullptr, ws.raw_data(), bws, reserve.raw_data(), rs));
    cuda_synchronize();
  }
  report(state, p);
  cudnnDestroyTensorDescriptor(xd);
  cudnnDestroyTensorDescriptor(pd);
  cudnnDestroy(h);
}
BENCHMARK(BM_BatchNormCudnn)->Apply(Shapes)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace
