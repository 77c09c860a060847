// FSDP against DDP and one process, on the workloads of
// bench/peers/torch2/fsdp_peer.py (PyTorch 2's fully_shard):
//   model:mlp  8 residual blocks x + fc2(gelu(fc1(LayerNorm(x)))), 1024 ->
//              4096 -> 1024, 67.2 M parameters, MSE, batch 16 rows per rank
//   model:gpt  nn::GPT with 6 layers, d 512, 8 heads, seq 128, vocab 8192,
//              untied head, 27.4 M parameters, cross-entropy, 1 sequence/rank
// Every block is an FSDP unit, the root one more; AdamW(lr 1e-3, weight
// decay 0.01); 1 thread per process, Gloo over loopback.
//
//   mode:plain     one process, no wrapper          (procs:1)
//   mode:ddp       DistributedDataParallel          (procs:2)
//   mode:full      fully_shard FULL_SHARD           (procs:1, 2)
//   mode:grad_op   fully_shard SHARD_GRAD_OP        (procs:1, 2)
//   mode:no_shard  fully_shard NO_SHARD             (procs:1, 2)
//   mode:full_noprefetch  FULL_SHARD without forward/backward prefetch (procs:2):
//                  what prefetch buys
//
// Counters (rank 0): step_ms_median; param_MiB, grad_MiB, state_MiB (the
// parameters, gradients after backward and AdamW state this rank holds);
// peak_rss_MiB (peak RSS above the RSS at the benchmark's start: run one
// benchmark per process for it to mean that configuration alone, as
// bench/fsdp_compare.py does); peak_alloc_MiB (the allocator's peak of live
// tensor bytes over the timed steps).
//
//   bazel run -c opt //bench:fsdp_bench -- --benchmark_filter='model:gpt/mode:full/procs:2'
//   python3 bench/fsdp_compare.py --ours bazel-out/k8-opt/bin/bench/fsdp_bench   # beside PyTorch
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_group.h"
#include "core/ops.h"
#include "distributed/comm/backends.h"
#include "distributed/comm/flight_recorder.h"
#include "distributed/parallel/ddp.h"
#include "distributed/parallel/fsdp/fsdp.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "nn/transformer.h"
#include "optim/optimizer.h"

namespace {
using namespace ember;
using namespace ember::distributed;

class MlpBlock : public nn::Module {
 public:
  MlpBlock() : nn::Module("MlpBlock") {
    norm = register_module("norm", std::make_shared<nn::LayerNorm>(std::vector<int64_t>{1024}));
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(1024, 4096));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(4096, 1024));
  }
  Tensor forward(const Tensor& x) override { return x + (*fc2)(gelu((*fc1)((*norm)(x)))); }
  std::shared_ptr<nn::LayerNorm> norm;
  std::shared_ptr<nn::Linear> fc1, fc2;
};

class MlpStack : public nn::Module {
 public:
  MlpStack() : nn::Module("MlpStack") {
    blocks = register_module("blocks", std::make_shared<nn::Sequential>());
    for (int i = 0; i < 8; ++i) blocks->push_back(std::make_shared<MlpBlock>());
  }
  Tensor forward(const Tensor& x) override { return (*blocks)(x); }
  std::shared_ptr<nn::Sequential> blocks;
};

using bench::mib;
using bench::peak_rss_bytes;
using bench::rss_bytes;

void BM_FsdpStep(benchmark::State& state, const std::string& name, const std::string& model_name,
                 const std::string& mode, int world) {
  omp_set_num_threads(1);
  const int64_t base_rss = rss_bytes();
  auto group = bench::join_group(name, world);
  std::shared_ptr<ProcessGroup> pg = group->pg;
  if (!pg && mode != "plain" && mode != "ddp") {
    const char* tmp = std::getenv("TMPDIR");
    const std::string path = std::string(tmp && *tmp ? tmp : "/tmp") + "/ember_fsdp_bench_" + std::to_string(getpid());
    std::remove(path.c_str());
    pg = make_gloo_group(std::make_shared<FileStore>(path, 1), 0, 1);
  }
  manual_seed(0);
  std::shared_ptr<nn::Module> model;
  if (model_name == "mlp") {
    model = std::make_shared<MlpStack>();
  } else {
    model = std::make_shared<nn::GPT>(
        nn::GPTOptions{.vocab_size = 8192, .block_size = 128, .n_layer = 6, .n_head = 8, .n_embd = 512});
  }
  nn::Module* net = model.get();
  std::shared_ptr<DistributedDataParallel> ddp;
  if (mode == "ddp") {
    ddp = std::make_shared<DistributedDataParallel>(model, DDPOptions{.process_group = pg});
    net = ddp.get();
  } else if (mode != "plain") {
    FSDPOptions o;
    o.mesh = distributed::DeviceMesh::from_group(pg, "dp_shard");
    const bool no_prefetch = mode == "full_noprefetch";
    o.strategy = parse_strategy(no_prefetch ? "full" : mode);
    o.forward_prefetch = o.backward_prefetch = !no_prefetch;
    fully_shard_auto(model, {.types = {"MlpBlock", "TransformerBlock"}}, o);
  }
  optim::AdamW opt(model->parameters(), optim::AdamWOptions{.lr = 1e-3, .weight_decay = 0.01});
  const int rank = pg ? pg->rank() : 0;
  manual_seed(1000 + rank);
  Tensor x, y;
  if (model_name == "mlp") {
    x = randn({16, 1024});
    y = randn({16, 1024});
  } else {
    x = randint(0, 8192, {1, 128});
    y = randint(0, 8192, {128});
  }
  int64_t grad_bytes = 0;
  auto step = [&] {
    Tensor loss;
    {
      MemoryKindScope activations(MemoryKind::Activations);
      Tensor out = (*net)(x);
      loss = model_name == "mlp" ? nn::functional::mse_loss(out, y)
                                 : nn::functional::cross_entropy(out.reshape({-1, 8192}), y);
    }
    return bench::backward_and_step(loss, *model, opt, grad_bytes);
  };
  step();  // warmup: optimizer state, allocator caches
  cpu_allocator()->reset_peak_stats();
  const int64_t recorded = distributed::fr::FlightRecorder::get().recorded();
  const double median = bench::timed_median(state, pg && world > 1 ? pg.get() : nullptr, step);
  state.counters["step_ms_median"] = median * 1e3;
  // The process groups' operations a step (the flight recorder's count,
  // with the benchmark's own per-step sync): what the recorder's per-op
  // cost (flight_recorder_bench) multiplies.
  state.counters["pg_ops_per_step"] =
      static_cast<double>(distributed::fr::FlightRecorder::get().recorded() - recorded) /
      static_cast<double>(std::max<int64_t>(1, state.iterations()));
  bench::model_state_counters(state, model->parameters(), opt, grad_bytes);
  state.counters["peak_rss_MiB"] = mib(peak_rss_bytes() - base_rss);
  const AllocatorStats st = cpu_allocator()->stats();
  state.counters["peak_alloc_MiB"] = mib(static_cast<int64_t>(st.peak_allocated));
  // The allocator's breakdown of tensor bytes at their peak (core/allocator.h).
  for (int k = 0; k < kMemoryKinds; ++k)
    state.counters[std::string("at_peak_") + memory_kind_name(static_cast<MemoryKind>(k)) + "_MiB"] =
        mib(static_cast<int64_t>(st.peak_by_kind[k]));
  state.SetLabel(std::to_string(world) + " proc x 1 thread, " + model_name + ", " + mode);
}

const bool registered = [] {
  for (std::string model : {"mlp", "gpt"})
    for (auto [mode, world] : std::vector<std::pair<std::string, int>>{{"plain", 1},
                                                                      {"full", 1},
                                                                      {"grad_op", 1},
                                                                      {"no_shard", 1},
                                                                      {"ddp", 2},
                                                                      {"full", 2},
                                                                      {"full_noprefetch", 2},
                                                                      {"grad_op", 2},
                                                                      {"no_shard", 2}}) {
      std::string name = "BM_FsdpStep/model:" + model + "/mode:" + mode + "/procs:" + std::to_string(world);
      benchmark::RegisterBenchmark(name.c_str(), [name, model, mode = mode, world = world](benchmark::State& st) {
        BM_FsdpStep(st, name, model, mode, world);
      })
          ->Iterations(3)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  return true;
}();

}  // namespace
