// Gloo collectives between 2 processes on this machine (TCP over loopback):
// allreduce, allgather_into_tensor and reduce_scatter_tensor, float32, from
// 4 KiB to 64 MiB, with nccl-tests' figures as counters:
//   algbw = size / time, size being the whole buffer (allreduce: the tensor;
//           allgather: the output; reduce_scatter: the input);
//   busbw = algbw * 2(n-1)/n for allreduce, * (n-1)/n for allgather and
//           reduce_scatter (n = 2 here: 1 and 1/2).
// bench/collectives_peer.py prints the same table for torch.distributed's
// Gloo, so one run of each gives the ratio.
//
// Google Benchmark runs in one process, so this process is rank 0 and, the
// first time a benchmark needs the group, starts itself again as rank 1 with
// the same arguments (minus --benchmark_out*). The peer runs the same
// benchmarks in the same order; every benchmark has a fixed iteration count,
// so both sides issue exactly the same sequence of collectives. Times are
// rank 0's wall-clock per op, back to back (each op waited for), after 3
// warm-up ops. Signature checks are off: this measures the engine.
//
//   bazel run -c opt //bench:collectives_bench
//   /usr/bin/python3 bench/collectives_peer.py
#include <benchmark/benchmark.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "core/ops.h"
#include "distributed/comm/backends.h"
#include "distributed/init.h"
#include "distributed/testing/multiprocess.h"

namespace {
using namespace ember;
using namespace ember::distributed;

constexpr int kWorld = 2;

struct Session {
  std::shared_ptr<Store> store;
  std::shared_ptr<ProcessGroup> pg;
  pid_t peer = -1;
};

// This process's argv, from /proc (benchmark_main does not share it).
std::vector<std::string> own_args() {
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  size_t start = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i] != '\0') continue;
    args.push_back(all.substr(start, i - start));
    start = i + 1;
  }
  if (!args.empty()) args.erase(args.begin());  // argv[0]
  return args;
}

Session& session() {
  static Session* s = [] {
    auto* s = new Session;  // leaked: the group lives until exit
    ProcessGroupOptions o;
    o.timeout = std::chrono::seconds(120);
    o.check_signatures = false;
    if (const char* port = std::getenv("EMBER_BENCH_PEER_PORT")) {
      TCPStoreOptions so;
      so.timeout = std::chrono::seconds(60);
      s->store = std::make_shared<TCPStore>("127.0.0.1", std::atoi(port), so);
      s->pg = make_gloo_group(s->store, 1, kWorld, o);
      return s;
    }
    TCPStoreOptions so;
    so.is_server = true;
    so.wait_for_workers = false;
    so.timeout = std::chrono::seconds(60);
    auto server = std::make_shared<TCPStore>("127.0.0.1", 0, so);
    s->store = server;
    std::vector<std::string> args;
    for (auto& a : own_args())
      if (a.rfind("--benchmark_out", 0) != 0) args.push_back(a);
    const char* tmp = std::getenv("TMPDIR");
    std::string log = std::string(tmp && *tmp ? tmp : "/tmp") + "/ember_collectives_bench_peer.log";
    s->peer = testing::spawn_self(args, {"EMBER_BENCH_PEER_PORT=" + std::to_string(server->port())}, log);
    std::fprintf(stderr, "collectives_bench: rank 1 is pid %d (log: %s)\n", s->peer, log.c_str());
    s->pg = make_gloo_group(s->store, 0, kWorld, o);
    std::atexit([] {
      // The peer finishes the same benchmarks; give it a moment, then reap.
      testing::WorkerResult r;
      testing::wait_or_kill(session().peer, std::chrono::steady_clock::now() + std::chrono::seconds(30), r);
      if (r.exit_code != 0) std::fprintf(stderr, "collectives_bench: the peer exited with %d (signal %d)\n",
                                         r.exit_code, r.signal);
    });
    return s;
  }();
  return *s;
}

enum class Op { Allreduce, Allgather, ReduceScatter };

void run_collective(benchmark::State& state, Op op, int64_t bytes) {
  ProcessGroup& pg = *session().pg;
  const int n = pg.size();
  const int64_t numel = bytes / 4;
  // Zeros: repeated sums stay finite.
  Tensor whole = zeros({numel});
  Tensor part = zeros({numel / n});
  auto once = [&] {
    switch (op) {
      case Op::Allreduce: pg.allreduce(whole)->wait(); break;
      case Op::Allgather: pg.allgather_into_tensor(whole, part)->wait(); break;
      case Op::ReduceScatter: pg.reduce_scatter_tensor(part, whole)->wait(); break;
    }
  };
  for (int i = 0; i < 3; ++i) once();
  for (auto _ : state) once();
  const double factor = op == Op::Allreduce ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
  const double moved = static_cast<double>(bytes) * static_cast<double>(state.iterations());
  state.counters["algbw"] = benchmark::Counter(moved, benchmark::Counter::kIsRate);
  state.counters["busbw"] = benchmark::Counter(moved * factor, benchmark::Counter::kIsRate);
  state.SetLabel("rank " + std::to_string(pg.rank()) + " of " + std::to_string(n) + ", float32, bytes/s");
}

// The same iteration counts as bench/collectives_peer.py.
int iterations_for(int64_t bytes) {
  return bytes <= (64 << 10) ? 200 : bytes <= (1 << 20) ? 50 : bytes <= (16 << 20) ? 20 : 10;
}

const bool registered = [] {
  const std::vector<std::pair<const char*, int64_t>> sizes = {
      {"4K", 4 << 10}, {"64K", 64 << 10}, {"256K", 256 << 10}, {"1M", 1 << 20},
      {"4M", 4 << 20}, {"16M", 16 << 20}, {"64M", 64 << 20}};
  const std::vector<std::pair<const char*, Op>> ops = {
      {"allreduce", Op::Allreduce}, {"allgather_into_tensor", Op::Allgather},
      {"reduce_scatter_tensor", Op::ReduceScatter}};
  for (auto [op_name, op] : ops) {
    for (auto [label, bytes] : sizes) {
      benchmark::RegisterBenchmark((std::string("gloo_") + op_name + "/" + label).c_str(),
                                   [op = op, bytes = bytes](benchmark::State& st) { run_collective(st, op, bytes); })
          ->Iterations(iterations_for(bytes))
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
  }
  return true;
}();

}  // namespace
