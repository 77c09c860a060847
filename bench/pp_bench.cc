// Pipeline schedules on 2 processes, on the GPT of
// bench/peers/torch2/pp_peer.py (PyTorch 2's torch.distributed.pipelining):
// nn::GPT with 8 layers, d 256, 4 heads, seq 128, vocab 4096, untied head
// (8.6 M parameters), a batch of 8 sequences per step in 4 micro-batches,
// cross-entropy, AdamW(lr 1e-3, weight decay 0.01); 1 thread per process,
// Gloo over loopback. The stages: 8 blocks split evenly (4 per stage, or 2
// per stage for interleaved's 4 stages), the embeddings on the first, the
// final norm and head on the last.
//
//   schedule:gpipe | 1f1b | interleaved (2 stages per rank) | zb-h1
//
// Counters (rank 0): step_ms_median; bubble_measured (the last timed step,
// over both ranks: 1 - busy / (P x span)) and bubble_simulated (the
// simulator with the measured F, B, W costs of each stage and the
// measured transfer latency), f_ms, b_ms, w_ms (means), comm_ms;
// act_peak_MiB_rank0/1 (each rank's peak of activation tensor bytes during
// a step: what its stages keep for backward) beside live_rank0/1 (the
// simulator's peak live micro-batches of the rank's stages, summed).
//
//   bazel run -c opt //bench:pp_bench -- --benchmark_filter='schedule:zb-h1'
//   python3 bench/pp_compare.py --ours bazel-out/k8-opt/bin/bench/pp_bench   # beside PyTorch
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_group.h"
#include "core/allocator.h"
#include "core/ops.h"
#include "core/profiler.h"
#include "distributed/parallel/pp/pipeline.h"
#include "nn/functional.h"
#include "nn/transformer.h"
#include "optim/optimizer.h"

namespace {
using namespace ember;
using namespace ember::distributed;

constexpr int kWorld = 2, kMicro = 4, kBatch = 8, kSeq = 128, kVocab = 4096;

// Step s's batch, as the peer's: torch's generator is not ours, so the
// tokens differ; the shapes and the work do not.
std::pair<Tensor, Tensor> batch(int s) {
  Generator g(1000 + s);
  Tensor x = randint(0, kVocab, {kBatch, kSeq + 1}, DType::Int64, &g);
  return {x.narrow(1, 0, kSeq).contiguous(), x.narrow(1, 1, kSeq).contiguous()};
}

void BM_PpStep(benchmark::State& state, const std::string& name, const std::string& schedule) {
  omp_set_num_threads(1);
  auto group = bench::join_group(name, kWorld);
  const int V = schedule == "interleaved" ? 2 : 1;
  const pp::Schedule sched = pp::make_schedule(schedule, kWorld, V, kMicro);
  manual_seed(0);
  nn::GPT whole({.vocab_size = kVocab, .block_size = kSeq, .n_layer = 8, .n_head = 4, .n_embd = 256});
  auto all = pp::split_gpt(whole, sched.num_stages(), std::vector<int>(sched.num_stages(), 8 / sched.num_stages()));
  std::vector<std::shared_ptr<pp::PipelineStage>> mine;
  for (int s : sched.stages_of(group->pg->rank())) mine.push_back(all[s]);
  all.clear();
  auto loss = [](const Tensor& logits, const Tensor& y) {
    return nn::functional::cross_entropy(logits.reshape({-1, kVocab}), y.reshape({-1}));
  };
  pp::Pipeline pipe(sched, mine, group->pg, {.loss = loss});
  optim::AdamW opt(pipe.parameters(), optim::AdamWOptions{.lr = 1e-3, .weight_decay = 0.01});
  Allocator* alloc = cpu_allocator();
  int s = 0;
  double act_peak = 0;
  auto step = [&] {
    auto [x, y] = batch(s++);
    std::vector<Tensor> xs, ys;
    for (int m = 0; m < kMicro; ++m) {
      xs.push_back(x.narrow(0, m * (kBatch / kMicro), kBatch / kMicro));
      ys.push_back(y.narrow(0, m * (kBatch / kMicro), kBatch / kMicro));
    }
    alloc->reset_peak_stats();
    {
      MemoryKindScope activations(MemoryKind::Activations);
      pipe.step(xs, ys);
    }
    act_peak = static_cast<double>(alloc->stats().peak_by_kind[static_cast<int>(MemoryKind::Activations)]);
    opt.step();
    opt.zero_grad();
    return s;
  };
  step();  // warmup: headers agreed, optimizer state, allocator caches
  // EMBER_PP_BENCH_PROFILE=1: the top ops of rank 0's timed steps by self time (stderr).
  const bool profile = std::getenv("EMBER_PP_BENCH_PROFILE") != nullptr;
  if (profile) profiler::start();
  const double median = bench::timed_median(state, group->pg.get(), step);
  if (profile) {
    profiler::stop();
    std::fprintf(stderr, "%s\n", profiler::summary_table(profiler::events(), 30).c_str());
  }
  const auto meas = pipe.measure_last_step();
  const auto sim = pp::simulate(sched, meas.costs, meas.stage_costs);
  // Both ranks' activation peaks, for rank 0's counters.
  Tensor acts = zeros({kWorld}, DType::Float64);
  acts.data<double>()[group->pg->rank()] = act_peak;
  group->pg->allreduce(acts, ReduceOp::Sum)->wait();
  state.counters["step_ms_median"] = median * 1e3;
  state.counters["bubble_measured"] = meas.bubble_fraction;
  state.counters["bubble_simulated"] = sim.bubble_fraction;
  state.counters["f_ms"] = meas.costs.f * 1e3;
  state.counters["b_ms"] = meas.costs.b * 1e3;
  state.counters["w_ms"] = meas.costs.w * 1e3;
  state.counters["comm_ms"] = meas.costs.comm * 1e3;
  for (int r = 0; r < kWorld; ++r) {
    int live = 0;
    for (int st : sched.stages_of(r)) live += sim.peak_live[st];
    state.counters["act_peak_MiB_rank" + std::to_string(r)] = bench::mib(static_cast<int64_t>(acts.data<double>()[r]));
    state.counters["live_rank" + std::to_string(r)] = live;
  }
  state.SetLabel(std::to_string(kWorld) + " proc x 1 thread, gpt 8x256, " + schedule + ", " + std::to_string(kMicro) +
                 " micro-batches");
}

const bool registered = [] {
  for (const std::string schedule : {"gpipe", "1f1b", "interleaved", "zb-h1"}) {
    std::string name = "BM_PpStep/schedule:" + schedule + "/procs:" + std::to_string(kWorld);
    benchmark::RegisterBenchmark(name.c_str(),
                                 [name, schedule](benchmark::State& st) { BM_PpStep(st, name, schedule); })
        ->Iterations(5)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  return true;
}();

}  // namespace
