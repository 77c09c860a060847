// One-process training step of a LLaMA-style model (nn::GPT with
// GPTOptions::llama: RMSNorm, rotary embeddings, grouped-query attention,
// SwiGLU, untied head): zero_grad, forward, cross-entropy, backward,
// AdamW(lr 1e-3, weight decay 0.01), float32, on the CPU. The workload of
// bench/peers/torch2/llama_peer.py (the same model in PyTorch eager);
// bench/llama_compare.py runs both interleaved.
//
//   bazel run -c opt //bench:llama_bench
//
// Model: 6 blocks, d 512, 8 heads of 64, 4 key/value heads, SwiGLU 1408,
// vocab 8192, seq 256, batch 4 (1024 tokens a step); 26.8 M parameters.
// Counters: step_ms_median over the timed steps, tokens_per_s.
// BM_MoEStep/F: the same with mixture-of-experts feed-forwards, dropless
// (F = 0) or with a capacity factor of F / 100.
// EMBER_BENCH_PROFILE=1 prints the profiler's table of one more step
// (where the time goes, by op).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "core/ops.h"
#include "core/profiler.h"
#include "nn/functional.h"
#include "nn/moe.h"
#include "nn/transformer.h"
#include "optim/optimizer.h"

namespace ember {
namespace {

constexpr int64_t kLayers = 6, kDim = 512, kHeads = 8, kKvHeads = 4, kFfn = 1408, kVocab = 8192, kSeq = 256, kBatch = 4;

// One step: zero_grad, forward, cross-entropy, backward, AdamW; the loss.
double train_step(nn::GPT& model, optim::AdamW& opt, const Tensor& x, const Tensor& y) {
  opt.zero_grad();
  Tensor loss = nn::functional::cross_entropy(model(x).reshape({kBatch * kSeq, kVocab}), y);
  loss.backward();
  opt.step();
  return loss.item();
}

// The benchmark's iterations of `step`, each one's milliseconds.
template <typename F>
std::vector<double> timed_steps(benchmark::State& state, F&& step) {
  std::vector<double> ms;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(step());
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return ms;
}

void BM_LlamaStep(benchmark::State& state) {
  manual_seed(0);
  nn::GPT model(nn::GPTOptions::llama({.vocab_size = kVocab,
                                       .block_size = kSeq,
                                       .n_layer = kLayers,
                                       .n_head = kHeads,
                                       .n_embd = kDim,
                                       .n_kv_head = kKvHeads,
                                       .ffn_hidden = kFfn}));
  optim::AdamW opt(model.parameters(), {.lr = 1e-3, .weight_decay = 0.01});
  Tensor x = randint(0, kVocab, {kBatch, kSeq}), y = randint(0, kVocab, {kBatch * kSeq});
  auto step = [&] { return train_step(model, opt, x, y); };
  for (int i = 0; i < 2; ++i) step();  // warm-up: allocator caches, oneDNN primitives
  std::vector<double> ms = timed_steps(state, step);
  if (std::getenv("EMBER_BENCH_PROFILE") != nullptr) {
    profiler::start();
    step();
    profiler::stop();
    std::fputs(profiler::summary_table(profiler::events(), 30).c_str(), stderr);
  }
  std::sort(ms.begin(), ms.end());
  state.counters["step_ms_median"] = ms[ms.size() / 2];
  state.counters["tokens_per_s"] = kBatch * kSeq * 1e3 / ms[ms.size() / 2];
  state.counters["params_M"] = static_cast<double>(model.num_parameters()) / 1e6;
}
BENCHMARK(BM_LlamaStep)->Iterations(8)->Unit(benchmark::kMillisecond);

// The same step with every block's feed-forward a mixture of 8 experts of
// 704 (top 2: the dense SwiGLU's FLOPs a token), dropless (arg 0) or with a
// capacity factor of arg / 100 (padded groups, batched GEMMs, the later
// choices dropped): what the capacity's padding costs beside the grouped
// GEMMs. Counter dropped_frac: the choices dropped in the timed steps.
void BM_MoEStep(benchmark::State& state) {
  manual_seed(0);
  nn::GPTOptions o = nn::GPTOptions::llama({.vocab_size = kVocab,
                                            .block_size = kSeq,
                                            .n_layer = kLayers,
                                            .n_head = kHeads,
                                            .n_embd = kDim,
                                            .n_kv_head = kKvHeads,
                                            .ffn_hidden = kFfn});
  o.moe = {
      .num_experts = 8, .top_k = 2, .hidden = kFfn / 2, .capacity_factor = static_cast<double>(state.range(0)) / 100.0};
  nn::GPT model(o);
  optim::AdamW opt(model.parameters(), {.lr = 1e-3, .weight_decay = 0.01});
  Tensor x = randint(0, kVocab, {kBatch, kSeq}), y = randint(0, kVocab, {kBatch * kSeq});
  auto step = [&] { return train_step(model, opt, x, y); };
  for (int i = 0; i < 2; ++i) step();
  nn::reset_moe_stats(model);
  std::vector<double> ms = timed_steps(state, step);
  double routed = 0, dropped = 0;
  for (nn::MoE* m : nn::moe_layers(model)) {
    const nn::MoEStats st = m->stats();
    routed += static_cast<double>(st.routed), dropped += static_cast<double>(st.dropped);
  }
  std::sort(ms.begin(), ms.end());
  state.counters["step_ms_median"] = ms[ms.size() / 2];
  state.counters["tokens_per_s"] = kBatch * kSeq * 1e3 / ms[ms.size() / 2];
  state.counters["dropped_frac"] = routed > 0 ? dropped / routed : 0.0;
}
BENCHMARK(BM_MoEStep)->Arg(0)->Arg(100)->Arg(125)->Iterations(8)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace ember
