// GPU op throughput against the device's own ceilings: elementwise add and a
// full sum in GB/s beside cudaMemcpy device-to-device of the same bytes, and
// matmul (fp32, fp16, bf16) beside cuBLAS called directly, the fused
// cross-entropy's forward and backward over a LLaMA-3 vocabulary in GB/s
// (each pass reads the bf16 logits once; the backward also writes the
// gradient) beside the same copy ceiling, and the mixture of experts'
// grouped GEMMs with their groups on the device beside one cuBLAS call per
// expert, and a GPT-2 block's linear layers with their bias and GELU in
// cuBLASLt's epilogue beside the separate ops, and AdamW over bfloat16
// parameters with float32 masters op by op beside the fused step's one
// kernel, and ResNet-50's max pool (the stem's, batch 256) in GB/s beside the
// copy ceiling, and layer_norm and rms_norm at a GPT's activation shape in
// GB/s. Every benchmark reports an error and skips when no GPU is present.
#include <benchmark/benchmark.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "bench/master_step.h"
#include "core/cuda_check.h"
#include "core/ops.h"
#include "core/ops/cublas_handle.h"
#include "core/ops/kernels.h"
#include "core/ops_nn.h"

namespace {
using namespace ember;

bool need_gpu(benchmark::State& state) {
  if (cuda_is_available()) return true;
  state.SkipWithError(("no GPU: " + cuda_unavailable_reason()).c_str());
  return false;
}

constexpr int64_t kN = 1 << 26;  // 256 MiB per fp32 tensor

void BM_CudaAdd(benchmark::State& state) {
  if (!need_gpu(state)) return;
  Tensor a = rand({kN}, {DType::Float32, cuda_device()}), b = rand({kN}, {DType::Float32, cuda_device()});
  for (auto _ : state) {
    Tensor c = a + b;
    cuda_synchronize();
  }
  state.counters["GB/s"] = benchmark::Counter(3.0 * kN * 4, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_CudaAdd)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_CudaSum(benchmark::State& state) {
  if (!need_gpu(state)) return;
  Tensor a = rand({kN}, {DType::Float32, cuda_device()});
  for (auto _ : state) {
    Tensor s = sum(a);
    cuda_synchronize();
  }
  state.counters["GB/s"] = benchmark::Counter(1.0 * kN * 4, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_CudaSum)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_CudaMemcpyD2D(benchmark::State& state) {
  if (!need_gpu(state)) return;
  const size_t bytes = static_cast<size_t>(1.5 * kN) * 4;  // the add's 3N floats moved
  Tensor src = rand({kN * 3 / 2}, {DType::Float32, cuda_device()}), dst = empty({kN * 3 / 2}, {DType::Float32, cuda_device()});
  for (auto _ : state) {
    EMBER_CUDA_CHECK(cudaMemcpy(dst.raw_data(), src.raw_data(), bytes, cudaMemcpyDeviceToDevice));
    cuda_synchronize();
  }
  state.counters["GB/s"] = benchmark::Counter(2.0 * bytes, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_CudaMemcpyD2D)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_CudaCrossEntropy(benchmark::State& state) {
  if (!need_gpu(state)) return;
  const int64_t rows = state.range(0), vocab = 128256;
  const CrossEntropyArgs a{rows, vocab, 0.0, -100};
  Tensor logits = randn({rows, vocab}, {DType::Float32, cuda_device()}).to(DType::BFloat16);
  Tensor target = randint(0, vocab, {rows}, {DType::Int64, cuda_device()});
  Tensor loss = empty({rows}, {DType::Float32, cuda_device()}), lse = empty({rows}, {DType::Float32, cuda_device()});
  Tensor g = full({rows}, 1.0 / static_cast<double>(rows), {DType::Float32, cuda_device()});
  Tensor grad = empty({rows, vocab}, {DType::BFloat16, cuda_device()});
  for (auto _ : state) {
    cross_entropy_forward_cuda(a, logits, target, loss, lse, nullptr);
    cross_entropy_backward_cuda(a, g, logits, target, lse, grad);
    cuda_synchronize();
  }
  state.counters["GB/s"] = benchmark::Counter(3.0 * rows * vocab * 2, benchmark::Counter::kIsIterationInvariantRate,
                                              benchmark::Counter::kIs1000);
}
BENCHMARK(BM_CudaCrossEntropy)->Arg(8192)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_CudaMatmul(benchmark::State& state) {
  if (!need_gpu(state)) return;
  const int64_t n = state.range(0);
  DType dt = static_cast<DType>(state.range(1));
  Tensor a = randn({n, n}, {dt, cuda_device()}), b = randn({n, n}, {dt, cuda_device()});
  for (auto _ : state) {
    Tensor c = matmul(a, b);
    cuda_synchronize();
  }
  state.SetLabel(dtype_name(dt));
  state.counters["TFLOP/s"] = benchmark::Counter(2.0 * n * n * n / 1e12, benchmark::Counter::kIsIterationInvariantRate);
}

// cuBLAS called directly on the same buffers: the ceiling for BM_CudaMatmul.
void BM_CublasDirect(benchmark::State& state) {
  if (!need_gpu(state)) return;
  const int n = static_cast<int>(state.range(0));
  DType dt = static_cast<DType>(state.range(1));
  Tensor a = randn({n, n}, {dt, cuda_device()}), b = randn({n, n}, {dt, cuda_device()}), c = empty({n, n}, {dt, cuda_device()});
  cudaDataType t = dt == DType::Float16 ? CUDA_R_16F : dt == DType::BFloat16 ? CUDA_R_16BF : CUDA_R_32F;
  auto h = static_cast<cublasHandle_t>(cublas_handle(0));
  float alpha = 1, beta = 0;
  for (auto _ : state) {
    EMBER_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, b.raw_data(), t, n, a.raw_data(), t, n,
                                    &beta, c.raw_data(), t, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    cuda_synchronize();
  }
  state.SetLabel(dtype_name(dt));
  state.counters["TFLOP/s"] = benchmark::Counter(2.0 * n * n * n / 1e12, benchmark::Counter::kIsIterationInvariantRate);
}

void MatmulArgs(benchmark::internal::Benchmark* b) {
  for (int dt : {static_cast<int>(DType::Float32), static_cast<int>(DType::Float16), static_cast<int>(DType::BFloat16)})
    for (int n : {512, 1024, 2048, 4096}) b->Args({n, dt});
}
BENCHMARK(BM_CudaMatmul)->Apply(MatmulArgs)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_CublasDirect)->Apply(MatmulArgs)->Unit(benchmark::kMicrosecond)->UseRealTime();

// The mixture of experts' grouped GEMMs, forward and both gradients of
// grouped_mm (x [16384, 2048] over G experts' [1536, 2048] weights, bf16,
// balanced groups): the groups as offsets on the device (arg 1 = 0:
// grouped_matmul.cu's kernels, one launch a product) or as sizes on the host
// (1: one cuBLAS call per expert and product). TFLOP/s of the three
// products; what routing on the device costs or saves against cuBLAS.
void BM_CudaGroupedMm(benchmark::State& state) {
  if (!need_gpu(state)) return;
  const int64_t G = state.range(0), N = 16384, K = 2048, M = 1536;
  const bool host = state.range(1) == 1;
  Tensor x = (randn({N, K}, {DType::Float32, cuda_device()}) * 0.1).to(DType::BFloat16).requires_grad_();
  Tensor w = (randn({G, M, K}, {DType::Float32, cuda_device()}) * 0.02).to(DType::BFloat16).requires_grad_();
  std::vector<int64_t> sizes(static_cast<size_t>(G), N / G);
  std::vector<double> ends;
  for (int64_t g = 1; g <= G; ++g) ends.push_back(static_cast<double>(g * (N / G)));
  const Tensor offsets = Tensor::from_vector(ends, {G}, DType::Int64).cuda();
  Tensor gy = full({N, M}, 1e-3, {DType::BFloat16, cuda_device()});
  for (auto _ : state) {
    Tensor y = host ? grouped_mm(x, w, sizes) : grouped_mm(x, w, offsets);
    y.backward(gy);
    cuda_synchronize();
  }
  state.SetLabel(host ? "sizes on the host (cuBLAS per expert)" : "offsets on the device");
  state.counters["TFLOP/s"] =
      benchmark::Counter(3.0 * 2.0 * N * M * K / 1e12, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_CudaGroupedMm)->ArgsProduct({{8, 64}, {0, 1}})->Unit(benchmark::kMillisecond)->UseRealTime();

// The linear layers of one GPT-2 block at 352 M parameters' width (8192
// tokens, dim 1024, bf16: c_attn, attn c_proj, c_fc with tanh GELU,
// mlp c_proj), forward and backward: arg 1 with the bias, GELU and the
// bias's gradient in cuBLASLt's epilogues (the default), 0 the separate
// ops (EMBER_CUBLASLT_EPILOGUE=0: bias add, bias_gelu, column sums).
// TFLOP/s of the 12 products; the label counts the epilogue calls per
// iteration (8 when every one was taken).
void BM_CudaGptLinears(benchmark::State& state) {
  if (!need_gpu(state)) return;
  const bool fused = state.range(0) == 1;
  const int64_t T = 8192, E = 1024;
  const TensorOptions o{DType::BFloat16, cuda_device()};
  auto param = [&](std::vector<int64_t> shape) {
    return (randn(shape, {DType::Float32, cuda_device()}) * 0.02).to(DType::BFloat16).requires_grad_();
  };
  Tensor x = param({T, E});
  Tensor w_attn = param({3 * E, E}), b_attn = param({3 * E}), w_proj = param({E, E}), b_proj = param({E});
  Tensor w_fc = param({4 * E, E}), b_fc = param({4 * E}), w_mp = param({E, 4 * E}), b_mp = param({E});
  const Tensor gy = full({T, E}, 1e-3, o), ga = full({T, 3 * E}, 1e-3, o);
  set_cublaslt_epilogues(fused);
  const GemmEpilogueStats s0 = gemm_epilogue_stats();
  for (auto _ : state) {
    Tensor qkv = linear(x, w_attn, b_attn);
    Tensor a = linear(x, w_proj, b_proj);
    Tensor h = linear_gelu(a, w_fc, b_fc, true);
    Tensor y = linear(h, w_mp, b_mp);
    y.backward(gy);
    qkv.backward(ga);
    cuda_synchronize();
  }
  const GemmEpilogueStats s1 = gemm_epilogue_stats();
  set_cublaslt_epilogues(true);
  const double per_iter = static_cast<double>(s1.fused - s0.fused) / static_cast<double>(state.iterations());
  state.SetLabel((fused ? "epilogues, " : "separate ops, ") + std::to_string(per_iter) + " fused calls an iteration");
  const double flops = 3.0 * 2.0 * T * E * E * (3 + 1 + 4 + 4);
  state.counters["TFLOP/s"] = benchmark::Counter(flops / 1e12, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_CudaGptLinears)->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime();

// AdamW's step over the 352 M GPT's parameters in bfloat16 (28 layers of
// 12.6 M, as 4 tensors each, and the embeddings: 116 tensors of 3 M) with
// float32 masters: op by op (0, six launches and a copy a tensor more) or
// fused (1, one launch). GB/s counts the fused kernel's 30 bytes an element
// for both: beside BM_CudaMemcpyD2D's, how near the copy ceiling it runs.
void BM_CudaAdamWMasters(benchmark::State& state) {
  if (!need_gpu(state)) return;
  const bool fused = state.range(0) == 1;
  const int64_t tensors = 116, numel = 3 << 20;
  bench::MasterStep s = bench::make_master_step(tensors, numel, DType::BFloat16, cuda_device());
  for (auto _ : state) {
    bench::master_step(s, fused);
    cuda_synchronize();
  }
  state.counters["GB/s"] =
      benchmark::Counter(static_cast<double>(tensors * numel * bench::kMasterStepBytes),
                         benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_CudaAdamWMasters)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

// ResNet-50's max pool at batch 256 ([256, 64, 112, 112] -> 56 x 56, window
// 3, stride 2, padding 1), its kernels alone: the forward (pass 0) or the
// backward (pass 1), NCHW or channels-last, float32 or bfloat16. GB/s counts
// the bytes a pass must move: forward reads x and writes y and the indices
// (one byte an output), backward reads dy and the indices and writes dx;
// beside BM_CudaMemcpyD2D's, how near the copy ceiling it runs. PyTorch's
// kernels took 0.86 ms forward and 1.84-1.89 ms backward on an H100
// (bench/results/gpu_breakdown.json), where ours took 1.05 and 3.4 before
// they indexed in 32 bits.
void BM_CudaMaxPool(benchmark::State& state) {
  if (!need_gpu(state)) return;
  const bool backward = state.range(0) == 1, nhwc = state.range(1) == 1;
  const DType dt = state.range(2) == 1 ? DType::BFloat16 : DType::Float32;
  const int64_t n = 256, c = 64, h = 112, oh = 56;
  PoolGeom g{n * c, h, h, oh, oh, 3, 3, 2, 2, 1, 1, false};
  g.nhwc = nhwc;
  g.c = c;
  const MemoryFormat fmt = nhwc ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous;
  const TensorOptions o{dt, cuda_device()};
  Tensor x = randn({n, c, h, h}, o).contiguous(fmt), dx = Tensor::empty({n, c, h, h}, o, fmt);
  Tensor y = Tensor::empty({n, c, oh, oh}, o, fmt), dy = randn({n, c, oh, oh}, o).contiguous(fmt);
  Tensor idx = Tensor::empty({n, c, oh, oh}, {pool_index_dtype(g), cuda_device()}, fmt);
  max_pool2d_cuda(g, x, y, idx);
  for (auto _ : state) {
    if (backward)
      max_pool2d_backward_cuda(g, dy, idx, dx);
    else
      max_pool2d_cuda(g, x, y, idx);
    cuda_synchronize();
  }
  const double bytes = static_cast<double>(x.numel() * dtype_size(dt) + y.numel() * (dtype_size(dt) + 1));
  state.counters["GB/s"] =
      benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_CudaMaxPool)
    ->ArgNames({"bwd", "nhwc", "bf16"})
    ->ArgsProduct({{0, 1}, {0, 1}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Strided copies at the 352 M GPT's attention shape (batch 8, 1,024
// tokens, 16 heads of 64): the fused backward's float32 dQ sum [B H, T, D]
// cast into q's bf16 columns of the packed qkv gradient [B, T, 3 E]
// (cast 1), and a bf16 transpose of heads [B, H, T, D] to [B, T, H, D]
// (cast 0). Both were one element a thread with a division a dim; the
// copy's vectors along D take one index decomposition for 4 or 8 elements
// and 16-byte accesses. GB/s counts the bytes read and written once.
void BM_CudaStridedCopy(benchmark::State& state) {
  if (!need_gpu(state)) return;
  const bool cast = state.range(0) == 1;
  const int64_t b = 8, h = 16, t = 1024, d = 64, e = h * d;
  const DType src_dt = cast ? DType::Float32 : DType::BFloat16;
  Tensor src = randn({b, h, t, d}, {src_dt, cuda_device()});
  Tensor qkv = zeros({b, t, 3 * e}, {DType::BFloat16, cuda_device()});
  Tensor dst = qkv.narrow(2, 0, e).view({b, t, h, d}).permute({0, 2, 1, 3});  // q's heads where they lie
  for (auto _ : state) {
    dst.copy_(src);
    cuda_synchronize();
  }
  const double bytes = static_cast<double>(src.numel()) * static_cast<double>(dtype_size(src_dt) + 2);
  state.counters["GB/s"] =
      benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_CudaStridedCopy)->ArgNames({"cast"})->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond)->UseRealTime();

// The row normalisations at the 352 M GPT's activation shape (8 x 1,024
// tokens of width 1,024): layer_norm (rms 0) or rms_norm (rms 1), forward
// or backward (dx with the weight's and the bias's gradients), bfloat16 or
// float32, through the CUDA kernels alone. GB/s counts what the op must
// move at least: x read and y written (forward); dy and x read and dx
// written (backward; the weight-gradient partials read dy and x again).
void BM_CudaRowNorm(benchmark::State& state) {
  if (!need_gpu(state)) return;
  const bool rms = state.range(0) == 1, bwd = state.range(1) == 1, bf16 = state.range(2) == 1;
  const int64_t rows = 8 * 1024, n = 1024;
  const DType dt = bf16 ? DType::BFloat16 : DType::Float32;
  const TensorOptions io{dt, cuda_device()}, f32{DType::Float32, cuda_device()};
  Tensor x = randn({rows, n}, io), w = randn({n}, io), b = randn({n}, io), dy = randn({rows, n}, io);
  Tensor y = Tensor::empty({rows, n}, io), dx = Tensor::empty({rows, n}, io);
  Tensor dw = Tensor::empty({n}, io), db = Tensor::empty({n}, io);
  Tensor mean = Tensor::empty({rows}, f32), rstd = Tensor::empty({rows}, f32);
  const auto forward = [&] {
    if (rms)
      rms_norm_forward_cuda(x, w, 1e-5, y, rstd);
    else
      layer_norm_forward_cuda(x, w, b, 1e-5, y, mean, rstd);
  };
  forward();  // the statistics the backward reads
  for (auto _ : state) {
    if (!bwd)
      forward();
    else if (rms)
      rms_norm_backward_cuda(dy, x, rstd, w, &dx, &dw);
    else
      layer_norm_backward_cuda(dy, x, mean, rstd, w, &dx, &dw, &db);
    cuda_synchronize();
  }
  const double bytes = static_cast<double>(rows * n) * static_cast<double>(dtype_size(dt)) * (bwd ? 3 : 2);
  state.counters["GB/s"] =
      benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_CudaRowNorm)
    ->ArgNames({"rms", "bwd", "bf16"})
    ->ArgsProduct({{0, 1}, {0, 1}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

}  // namespace
