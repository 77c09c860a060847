// Attention on the GPU in TFLOP/s, the shapes FlashAttention's papers and
// PyTorch's SDPA benchmarks use: 16k tokens a batch (batch 8 x sequence
// 2,048), hidden 2,048 (32 heads of 64 or 16 of 128), causal, bfloat16.
// Forward alone and forward + backward through scaled_dot_product_attention
// (the op users call, autograd included), fused kernels ("flash") beside the
// blocked-GEMM ones they replace ("blocked": EMBER_FLASH_ATTENTION=0's
// path), the fused backward under deterministic_algorithms() ("flash-det":
// dQ in a pass of its own instead of atomics), and the fused kernels with
// 64-key tiles instead of the default 128 ("flash-k64":
// set_attention_cuda_flash_tiles; head dim 128's forward takes 64 either
// way), and the fused backward loading its query tiles in one stage
// instead of two ("flash-s1"). And float32 q, k, v ("f32": the path the op
// takes for them, the blocked kernels today, where PyTorch's SDPA runs
// float32 on tensor cores in three TF32 products: its efficient backend).
// FLOPs as FlashAttention counts them: 4 b h T^2 d for the forward,
// halved when causal; the backward 2.5x the forward. bench/attention_compare.py
// runs this beside PyTorch's SDPA flash backend on the same shapes, timed
// the same way: kStepsPerSync steps queued back to back, then one
// synchronization (a synchronization after every step would leave the GPU
// idle through each step's launch latency and host work, tens of
// microseconds on steps of 120-300 of them, which PyTorch's side hides
// behind the steps queued ahead of it).
#include <benchmark/benchmark.h>

#include "core/ops.h"
#include "core/ops/kernels.h"
#include "core/ops_nn.h"

namespace {
using namespace ember;

constexpr int64_t kBatch = 8, kSeq = 2048, kHidden = 2048;
// Steps between synchronizations: attention_compare.py's PyTorch side times
// 30 steps between two CUDA events.
constexpr int kStepsPerSync = 30;

// args: head dim, causal, backward too, fused, deterministic, key tiles (0: the default), backward stages (0: the
// default), float32 (else bfloat16)
void BM_Attention(benchmark::State& state) {
  if (!cuda_is_available()) {
    state.SkipWithError(("no GPU: " + cuda_unavailable_reason()).c_str());
    return;
  }
  const int64_t d = state.range(0), heads = kHidden / d;
  const bool causal = state.range(1) != 0, bwd = state.range(2) != 0, fused = state.range(3) != 0;
  const bool det = state.range(4) != 0;
  const int keys = static_cast<int>(state.range(5)), stages = static_cast<int>(state.range(6));
  const bool f32 = state.range(7) != 0;
  set_attention_cuda_flash(fused);
  set_deterministic_algorithms(det);
  set_attention_cuda_flash_tiles({keys, keys, stages});
  const TensorOptions o{f32 ? DType::Float32 : DType::BFloat16, cuda_device()};
  Tensor q = randn({kBatch, heads, kSeq, d}, o), k = randn({kBatch, heads, kSeq, d}, o),
         v = randn({kBatch, heads, kSeq, d}, o), dout = randn({kBatch, heads, kSeq, d}, o);
  if (bwd) q.requires_grad_(), k.requires_grad_(), v.requires_grad_();
  auto step = [&] {
    Tensor out = scaled_dot_product_attention(q, k, v, causal);
    if (bwd) out.backward(dout);
  };
  step();  // first-call costs (the kernel's shared-memory opt-in, the allocator)
  cuda_synchronize();
  for (auto _ : state) {
    for (int i = 0; i < kStepsPerSync; ++i) step();
    cuda_synchronize();
  }
  set_attention_cuda_flash(true);
  set_deterministic_algorithms(false);
  set_attention_cuda_flash_tiles({});
  const double fwd = 4.0 * kBatch * heads * kSeq * kSeq * d / (causal ? 2 : 1);
  state.counters["TFLOP/s"] =
      benchmark::Counter(kStepsPerSync * (bwd ? 3.5 : 1.0) * fwd / 1e12, benchmark::Counter::kIsIterationInvariantRate);
  const std::string impl = f32      ? "f32"
                           : !fused ? "blocked"
                           : det    ? "flash-det"
                           : keys   ? "flash-k" + std::to_string(keys)
                           : stages ? "flash-s" + std::to_string(stages)
                                    : "flash";
  state.SetLabel(impl + (bwd ? " fwd+bwd" : " fwd") + " d" + std::to_string(d) + (causal ? " causal" : ""));
}
BENCHMARK(BM_Attention)
    ->ArgsProduct({{64, 128}, {1}, {0, 1}, {1, 0}, {0}, {0}, {0}, {0}})
    ->Args({128, 0, 0, 1, 0, 0, 0, 0})
    ->Args({128, 0, 1, 1, 0, 0, 0, 0})
    ->Args({64, 1, 1, 1, 1, 0, 0, 0})
    ->Args({128, 1, 1, 1, 1, 0, 0, 0})
    ->Args({64, 1, 0, 1, 0, 64, 0, 0})  // head dim 128's forward takes 64-key tiles either way
    ->Args({64, 1, 1, 1, 0, 64, 0, 0})
    ->Args({128, 1, 1, 1, 0, 64, 0, 0})
    ->Args({128, 0, 1, 1, 0, 64, 0, 0})
    ->Args({64, 1, 1, 1, 0, 0, 1, 0})
    ->Args({128, 1, 1, 1, 0, 0, 1, 0})
    ->Args({64, 1, 0, 1, 0, 0, 0, 1})  // float32: the GPT's head dim, and 128
    ->Args({64, 1, 1, 1, 0, 0, 0, 1})
    ->Args({128, 1, 1, 1, 0, 0, 0, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(0.3);

}  // namespace
