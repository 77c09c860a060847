// The measurements the communication cost model is fitted to:
// every collective a parallelism uses, over Gloo, at sizes from 4 KiB to
// 16 MiB, in a world of the launcher's size. Run under the launcher once per
// world size, then fit:
//
//   bazel build -c opt //bench:collectives_fit //tools:launch
//   for p in 2 4 8; do
//     bazel-bin/tools/launch --nproc_per_node=$p --master_port=0 -- bazel-bin/bench/collectives_fit \
//         --out /tmp/coll_$p.jsonl
//   done
//   python3 bench/collectives_fit.py /tmp/coll_*.jsonl > bench/results/collectives_fit.json
//
// Rank 0 writes one JSON line per (op, bytes): the median seconds of one op
// over its repetitions (each waited for, after a warm-up one; every rank
// runs the same count, chosen from the size), in each of three passes over
// all the points, and the median of the three. `bytes` is the whole buffer,
// as the process group's counters count it: allreduce and broadcast the
// tensor, all-gather the output, reduce-scatter and all-to-all the input,
// send/recv the message (ranks 0 and 1 exchange it, the time being half a
// round trip; the other ranks wait).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "core/ops.h"
#include "distributed/init.h"

namespace {

using namespace ember;
using namespace ember::distributed;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

int main(int argc, char** argv) {
  std::string out;
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--out" && i + 1 < argc) out = argv[++i];
  if (out.empty()) {
    std::fprintf(stderr, "usage: collectives_fit --out FILE.jsonl (under //tools:launch)\n");
    return 2;
  }
  auto pg = init_process_group({.backend = "gloo"});
  const int rank = pg->rank(), p = pg->size();
  std::ofstream file;
  if (rank == 0) {
    file.open(out);
    if (!file) {
      std::fprintf(stderr, "collectives_fit: cannot write %s\n", out.c_str());
      return 1;
    }
  }
  const std::vector<int64_t> sizes = {4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20};
  const std::vector<std::string> ops = {"allreduce", "allgather",  "reduce_scatter",
                                        "broadcast", "all_to_all", "send_recv"};
  // Three passes over everything, each point's median per pass, then the
  // median of the passes: a slow spell of the machine (a few ms that lasts
  // for a whole batch of repetitions, seen on this 2-core machine) then
  // moves one pass's value, not the point.
  std::map<std::string, std::vector<double>> medians;
  std::map<std::string, int> reps_of;
  for (int pass = 0; pass < 3; ++pass) {
    for (const std::string& op : ops) {
      for (int64_t bytes : sizes) {
        const int64_t numel = bytes / 4 / p * p;  // divisible by the world: the blocks are whole
        Tensor whole = full({numel}, 1.0);
        Tensor block = full({numel / p}, 1.0);
        Tensor out_whole = empty({numel});
        auto run = [&] {
          if (op == "allreduce") {
            pg->allreduce(whole)->wait();
          } else if (op == "allgather") {
            pg->allgather_into_tensor(out_whole, block)->wait();
          } else if (op == "reduce_scatter") {
            pg->reduce_scatter_tensor(block, whole)->wait();
          } else if (op == "broadcast") {
            pg->broadcast(whole, 0)->wait();
          } else if (op == "all_to_all") {
            pg->all_to_all_single(out_whole, whole)->wait();
          } else if (rank == 0) {  // send_recv: a round trip between ranks 0 and 1
            pg->send(whole, 1)->wait();
            pg->recv(whole, 1)->wait();
          } else if (rank == 1) {
            pg->recv(whole, 0)->wait();
            pg->send(whole, 0)->wait();
          }
        };
        const int reps = static_cast<int>(std::clamp<int64_t>((64 << 20) / bytes, 3, 30));
        run();  // warm-up
        std::vector<double> times;
        const bool barrier = std::getenv("COLLECTIVES_FIT_NO_BARRIER") == nullptr;
        for (int r = 0; r < reps; ++r) {
          if (barrier) pg->barrier()->wait();
          const auto t0 = Clock::now();
          run();
          times.push_back(seconds_since(t0) / (op == "send_recv" ? 2 : 1));
        }
        std::sort(times.begin(), times.end());
        medians[op + "/" + std::to_string(numel * 4)].push_back(times[times.size() / 2]);
        reps_of[op + "/" + std::to_string(numel * 4)] = reps;
      }
    }
  }
  if (rank == 0)
    for (const std::string& op : ops)
      for (int64_t bytes : sizes) {
        const int64_t numel = bytes / 4 / p * p;
        std::vector<double> m = medians[op + "/" + std::to_string(numel * 4)];
        std::sort(m.begin(), m.end());
        char line[320];
        std::snprintf(line, sizeof line,
                      "{\"op\": \"%s\", \"world\": %d, \"bytes\": %lld, \"seconds\": %.9g, \"passes\": [%.9g, "
                      "%.9g, %.9g], \"reps\": %d}\n",
                      op.c_str(), p, static_cast<long long>(numel * 4), m[1], m[0], m[1], m[2],
                      reps_of[op + "/" + std::to_string(numel * 4)]);
        file << line << std::flush;
      }
  pg->barrier()->wait();
  return 0;
}
