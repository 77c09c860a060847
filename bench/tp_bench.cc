// Tensor (and sequence) parallelism against one process, on the GPT of
// bench/peers/torch2/tp_peer.py (PyTorch 2's DTensor tensor parallelism):
// nn::GPT with 6 layers, d 512, 8 heads, seq 128, vocab 8192, untied head
// (27.4 M parameters), a batch of 4 sequences every tp rank shares,
// vocab-parallel cross-entropy, AdamW(lr 1e-3, weight decay 0.01); 1 thread
// per process, Gloo over loopback.
//
//   mode:plain   one process                                  (procs:1)
//   mode:tp      gpt_tp_plan without sequence parallelism     (procs:2)
//   mode:tp_sp   gpt_tp_plan with sequence parallelism        (procs:2)
//
// Counters (rank 0): step_ms_median; param_MiB, grad_MiB, state_MiB (what
// this rank holds: local shards and replicated parameters, gradients after
// backward, AdamW state) and model_state_MiB (their sum); act_MiB (tensor
// bytes alive at the end of forward beyond those alive before it, as the
// tensors asked for them (AllocatorStats::requested): what
// backward keeps, the loss's saved softmax included); peak_rss_MiB (peak
// RSS above the RSS at the benchmark's start; run one benchmark per process,
// as bench/tp_compare.py does).
//
//   bazel run -c opt //bench:tp_bench -- --benchmark_filter='mode:tp_sp'
//   python3 bench/tp_compare.py --ours bazel-out/k8-opt/bin/bench/tp_bench   # beside PyTorch
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_group.h"
#include "core/allocator.h"
#include "core/ops.h"
#include "core/profiler.h"
#include "distributed/comm/backends.h"
#include "distributed/parallel/tp/gpt_plan.h"
#include "distributed/parallel/tp/loss_parallel.h"
#include "nn/transformer.h"
#include "optim/optimizer.h"

namespace {
using namespace ember;
using namespace ember::distributed;

using bench::mib;
using bench::peak_rss_bytes;
using bench::rss_bytes;

void BM_TpStep(benchmark::State& state, const std::string& name, const std::string& mode, int world) {
  omp_set_num_threads(1);
  const int64_t base_rss = rss_bytes();
  auto group = bench::join_group(name, world);
  manual_seed(0);
  auto model = std::make_shared<nn::GPT>(
      nn::GPTOptions{.vocab_size = 8192, .block_size = 128, .n_layer = 6, .n_head = 8, .n_embd = 512});
  if (mode != "plain") {
    auto mesh = DeviceMesh::from_group(group->pg, "tp");
    parallelize_module(*model, mesh, gpt_tp_plan(*model, mode == "tp_sp"));
  }
  optim::AdamW opt(model->parameters(), optim::AdamWOptions{.lr = 1e-3, .weight_decay = 0.01});
  manual_seed(1000);  // the same batch on every tp rank
  Tensor x = randint(0, 8192, {4, 128}), y = randint(0, 8192, {4, 128});
  Allocator* alloc = cpu_allocator();
  int64_t grad_bytes = 0, act_bytes = 0;
  auto step = [&] {
    const int64_t before = static_cast<int64_t>(alloc->stats().requested);
    Tensor loss = parallel_cross_entropy((*model)(x), y);
    act_bytes = static_cast<int64_t>(alloc->stats().requested) - before;
    return bench::backward_and_step(loss, *model, opt, grad_bytes);
  };
  step();  // warmup: optimizer state, allocator caches
  // EMBER_TP_BENCH_PROFILE=1: the top ops of the timed steps by self time (stderr).
  const bool profile = std::getenv("EMBER_TP_BENCH_PROFILE") != nullptr;
  if (profile) profiler::start();
  const double median = bench::timed_median(state, world > 1 ? group->pg.get() : nullptr, step);
  if (profile) {
    profiler::stop();
    std::fprintf(stderr, "%s\n", profiler::summary_table(profiler::events(), 30).c_str());
  }
  state.counters["step_ms_median"] = median * 1e3;
  state.counters["model_state_MiB"] = mib(bench::model_state_counters(state, model->parameters(), opt, grad_bytes));
  state.counters["act_MiB"] = mib(act_bytes);
  state.counters["peak_rss_MiB"] = mib(peak_rss_bytes() - base_rss);
  state.SetLabel(std::to_string(world) + " proc x 1 thread, gpt, " + mode);
}

const bool registered = [] {
  for (auto [mode, world] : std::vector<std::pair<std::string, int>>{{"plain", 1}, {"tp", 2}, {"tp_sp", 2}}) {
    std::string name = "BM_TpStep/mode:" + mode + "/procs:" + std::to_string(world);
    benchmark::RegisterBenchmark(
        name.c_str(), [name, mode = mode, world = world](benchmark::State& st) { BM_TpStep(st, name, mode, world); })
        ->Iterations(5)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  return true;
}();

}  // namespace
