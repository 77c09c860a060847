// Activation checkpointing's memory against time, on the GPT of
// bench/peers/torch2/ac_peer.py (PyTorch 2's checkpoint_wrapper +
// fully_shard): nn::GPT with 8 blocks, d 384, 6 heads, seq 256, vocab 8192,
// untied head, each block checkpointed by the policy, then an FSDP unit;
// FULL_SHARD over 2 processes (Gloo, 1 thread each), 4 sequences per rank,
// AdamW(lr 1e-3, weight decay 0.01).
//
//   policy:none | selective | every:2 | full   (nn::ActivationCheckpointing)
//
// Counters (rank 0): step_ms_median; from the allocator's ledger at the
// step's peak (core/allocator.h): act_MiB (activations: what forward keeps
// for backward, and a block's recompute), gathered_MiB, grads_MiB,
// other_MiB, peak_MiB, beyond_state_MiB (the peak minus parameters,
// gradients and optimizer state); from RSS, measured
// as the peer measures it (run with MALLOC_MMAP_THRESHOLD_=65536 and
// EMBER_CPU_CACHE_MB=0, as bench/ac_compare.py does, so freed memory leaves
// the process): fwd_held_MiB (RSS at the end of forward minus before it:
// what backward will need) and step_peak_MiB (the peak RSS minus RSS before
// the forward).
//
//   bazel run -c opt //bench:ac_bench -- --benchmark_filter='policy:full'
//   python3 bench/ac_compare.py --ours bazel-out/k8-opt/bin/bench/ac_bench   # beside PyTorch
#include <benchmark/benchmark.h>
#include <omp.h>

#include <memory>
#include <string>
#include <vector>

#include "bench/bench_group.h"
#include "core/allocator.h"
#include "core/ops.h"
#include "distributed/comm/backends.h"
#include "distributed/parallel/fsdp/fsdp.h"
#include "nn/checkpoint.h"
#include "nn/functional.h"
#include "nn/transformer.h"
#include "optim/optimizer.h"

namespace {
using namespace ember;
using namespace ember::distributed;

using bench::mib;
using bench::peak_rss_bytes;
using bench::rss_bytes;

constexpr int64_t kVocab = 8192, kSeq = 256, kBatch = 4;

void BM_AcStep(benchmark::State& state, const std::string& name, const std::string& policy, int world) {
  omp_set_num_threads(1);
  auto group = bench::join_group(name, world);
  manual_seed(0);
  auto model = std::make_shared<nn::GPT>(
      nn::GPTOptions{.vocab_size = kVocab, .block_size = kSeq, .n_layer = 8, .n_head = 6, .n_embd = 384});
  nn::apply_activation_checkpointing(model->h->named_children(), nn::ActivationCheckpointing::parse(policy));
  FSDPOptions o;
  o.mesh = DeviceMesh::from_group(group->pg, "dp_shard");
  fully_shard_auto(model, {.types = {"TransformerBlock"}}, o);
  optim::AdamW opt(model->parameters(), optim::AdamWOptions{.lr = 1e-3, .weight_decay = 0.01});
  manual_seed(1000 + group->pg->rank());
  Tensor x = randint(0, kVocab, {kBatch, kSeq}), y = randint(0, kVocab, {kBatch * kSeq});
  Allocator* alloc = cpu_allocator();
  int64_t fwd_held = 0, step_peak = 0;
  auto step = [&] {
    alloc->reset_peak_stats();
    const int64_t before = rss_bytes();
    Tensor loss;
    {
      MemoryKindScope activations(MemoryKind::Activations);
      loss = nn::functional::cross_entropy((*model)(x).view({-1, kVocab}), y);
    }
    fwd_held = rss_bytes() - before;
    loss.backward();
    opt.step();
    opt.zero_grad();
    step_peak = peak_rss_bytes() - before;
    return loss;
  };
  step();  // warmup: optimizer state, allocator caches
  const double median = bench::timed_median(state, group->pg.get(), step);
  const AllocatorStats s = alloc->stats();
  auto part = [&](MemoryKind k) { return static_cast<int64_t>(s.peak_by_kind[static_cast<int>(k)]); };
  const int64_t state_bytes = part(MemoryKind::Parameters) + part(MemoryKind::Gradients) + part(MemoryKind::Optimizer);
  state.counters["step_ms_median"] = median * 1e3;
  state.counters["act_MiB"] = mib(part(MemoryKind::Activations));
  state.counters["gathered_MiB"] = mib(part(MemoryKind::Gathered));
  state.counters["grads_MiB"] = mib(part(MemoryKind::Gradients));
  state.counters["other_MiB"] = mib(part(MemoryKind::Other));
  state.counters["peak_MiB"] = mib(static_cast<int64_t>(s.peak_requested));
  state.counters["beyond_state_MiB"] = mib(static_cast<int64_t>(s.peak_requested) - state_bytes);
  state.counters["fwd_held_MiB"] = mib(fwd_held);
  state.counters["step_peak_MiB"] = mib(step_peak);
  state.SetLabel(std::to_string(world) + " proc x 1 thread, gpt 8x384 seq 256, FSDP full, ac " + policy);
}

const bool registered = [] {
  for (const std::string policy : {"none", "selective", "every:2", "full"}) {
    std::string name = "BM_AcStep/policy:" + policy + "/procs:2";
    benchmark::RegisterBenchmark(name.c_str(), [name, policy](benchmark::State& st) { BM_AcStep(st, name, policy, 2); })
        ->Iterations(4)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  return true;
}();

}  // namespace
