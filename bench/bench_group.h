// Multi-process benchmarks: Google Benchmark runs in one process, so this
// process is rank 0: each multi-process benchmark starts N-1 copies of its
// binary filtered to that one benchmark (the ranks, logging to
// $TMPDIR/ember_bench_rank<r>.log), meets them at a TCPStore, and reaps them
// when the benchmark ends. Every benchmark has a fixed iteration count, so
// all ranks take the same number of steps. Used by ddp_scaling, fsdp_bench
// and tp_bench, which also share its memory counters.
#pragma once

#include <benchmark/benchmark.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "distributed/comm/backends.h"
#include "distributed/init.h"
#include "distributed/store/store.h"
#include "distributed/testing/multiprocess.h"

namespace ember::bench {

using namespace ember::distributed;
using Clock = std::chrono::steady_clock;

// This process's resident memory now and at its peak (Linux), and bytes as
// MiB: the memory counters the multi-process benchmarks report.
inline int64_t rss_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}
inline int64_t peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}
inline double mib(int64_t b) { return static_cast<double>(b) / (1 << 20); }

// The bytes of the gradients that params hold (after a backward).
inline int64_t grad_bytes_of(const std::vector<Tensor>& params) {
  int64_t bytes = 0;
  for (const Tensor& p : params)
    if (p.grad().defined()) bytes += static_cast<int64_t>(p.grad().nbytes());
  return bytes;
}

// The rest of a training step after its forward: the backward, the bytes of
// the gradients `model` then holds (noted once, while `grad_bytes` is 0),
// the optimizer's step and zero_grad. Returns the loss, which the step
// returns to timed_median.
template <typename Model, typename Opt>
Tensor backward_and_step(const Tensor& loss, Model& model, Opt& opt, int64_t& grad_bytes) {
  loss.backward();
  if (grad_bytes == 0) grad_bytes = grad_bytes_of(model.parameters());
  opt.step();
  opt.zero_grad();
  return loss;
}

// The model-state counters: param_MiB, grad_MiB and state_MiB (the
// optimizer's state of params, opt.state(p) naming its tensors); returns
// the three together, in bytes.
template <typename Optimizer>
int64_t model_state_counters(benchmark::State& state, const std::vector<Tensor>& params, const Optimizer& opt,
                             int64_t grad_bytes) {
  int64_t param_bytes = 0, state_bytes = 0;
  for (const Tensor& p : params) {
    param_bytes += static_cast<int64_t>(p.nbytes());
    for (const auto& [n, t] : opt.state(p)) state_bytes += static_cast<int64_t>(t.nbytes());
  }
  state.counters["param_MiB"] = mib(param_bytes);
  state.counters["grad_MiB"] = mib(grad_bytes);
  state.counters["state_MiB"] = mib(state_bytes);
  return param_bytes + grad_bytes + state_bytes;
}

// Set in the copies this binary starts: which rank they are and where the
// store is.
inline constexpr char kPortVar[] = "EMBER_DDP_BENCH_PORT";
inline constexpr char kRankVar[] = "EMBER_DDP_BENCH_RANK";

// True in a copy started by join_group (a rank other than 0).
inline bool is_peer() { return std::getenv(kPortVar) != nullptr; }

// Rank 0 hosts the store and starts ranks 1..N-1; they connect to it. The
// group lives until every peer has exited, so no peer ever sees its
// connections torn down mid-collective.
struct Group {
  std::shared_ptr<ProcessGroup> pg;
  std::shared_ptr<Store> store;
  std::vector<pid_t> peers;
  ~Group() {
    bool failed = false;
    for (pid_t pid : peers) {
      distributed::testing::WorkerResult r;
      distributed::testing::wait_or_kill(pid, Clock::now() + std::chrono::seconds(60), r);
      failed |= r.exit_code != 0;
    }
    if (failed) std::fprintf(stderr, "bench: a peer process failed; see its log under $TMPDIR or /tmp\n");
  }
};

inline std::unique_ptr<Group> join_group(const std::string& name, int world) {
  auto g = std::make_unique<Group>();
  if (world == 1) return g;
  TCPStoreOptions so;
  so.timeout = std::chrono::seconds(120);
  if (const char* port = std::getenv(kPortVar)) {
    g->store = std::make_shared<TCPStore>("127.0.0.1", std::atoi(port), so);
    g->pg = make_gloo_group(g->store, std::atoi(std::getenv(kRankVar)), world);
    return g;
  }
  so.is_server = true;
  so.wait_for_workers = false;
  auto server = std::make_shared<TCPStore>("127.0.0.1", 0, so);
  g->store = server;
  const char* tmp = std::getenv("TMPDIR");
  const std::string dir = tmp && *tmp ? tmp : "/tmp";
  for (int r = 1; r < world; ++r) {
    // Only this benchmark (Google Benchmark appends "/iterations:N/..." to
    // the registered name), in a process of its own with 1 thread.
    std::vector<std::string> args = {"--benchmark_filter=^" + name + "/"};
    std::vector<std::string> env = {std::string(kPortVar) + "=" + std::to_string(server->port()),
                                    std::string(kRankVar) + "=" + std::to_string(r), "OMP_NUM_THREADS=1"};
    g->peers.push_back(distributed::testing::spawn_self(args, env, dir + "/ember_bench_rank" + std::to_string(r) + ".log"));
  }
  g->pg = make_gloo_group(g->store, 0, world);
  return g;
}

// Times `step` once per benchmark iteration (manual time) and returns the
// median in seconds, after a barrier so every rank is done before rank 0
// reaps its peers.
template <typename Step>
double timed_median(benchmark::State& state, ProcessGroup* pg, Step&& step) {
  std::vector<double> times;
  for (auto _ : state) {
    auto t0 = Clock::now();
    benchmark::DoNotOptimize(step());
    double s = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(s);
    times.push_back(s);
  }
  if (pg) pg->barrier()->wait();
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace ember::bench
