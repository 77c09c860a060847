// Multi-process tests on one machine: the test binary re-runs itself
// (/proc/self/exe) as `world_size` worker processes, each running a named
// scenario with its rank, while the parent hosts the TCPStore they meet at.
// The parent is no rank, so the store outlives a worker that dies on
// purpose, and it kills every worker still alive at the deadline, so a test
// can fail but never hang.
//
//   EMBER_WORKER(allreduce_sum) {                 // runs in each worker
//     auto pg = make_gloo_group(env.store(), env.rank, env.world_size);
//     ...; WCHECK(ok, "rank ", env.rank, ...);    // an exception = failure, message to the log
//   }
//   TEST(PG, Allreduce) {                          // runs in the parent
//     EMBER_EXPECT_RANKS("allreduce_sum", 3);      // every rank must exit 0
//     EMBER_EXPECT_RANKS("allreduce_sum", 2, {.arg = "bf16"}) << "context";
//   }
//
// The workers start at the test MultiProcessWorker.Entry, which a test
// binary gets by depending on //distributed/testing:worker_entry (tests
// that look at each rank's result themselves call run_workers and
// describe).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/exception.h"
#include "core/tensor.h"
#include "distributed/store/store.h"

namespace ember::distributed::testing {

struct WorkerEnv {
  std::string scenario;
  int rank = 0;
  int world_size = 1;
  std::string arg;         // RunOptions::arg, for scenarios with variants
  std::string store_host;  // the parent's TCPStore
  int store_port = 0;
  // A fresh client of the parent's store.
  std::shared_ptr<Store> store(Millis timeout = std::chrono::seconds(30)) const;
};

using WorkerFn = std::function<void(const WorkerEnv&)>;

// Static registration; returns true so it can initialise a global.
bool register_worker(const std::string& name, WorkerFn fn);

#define EMBER_WORKER(name)                                                              \
  static void ember_worker_##name(const ::ember::distributed::testing::WorkerEnv& env); \
  [[maybe_unused]] static const bool ember_worker_registered_##name =                   \
      ::ember::distributed::testing::register_worker(#name, ember_worker_##name);       \
  static void ember_worker_##name(const ::ember::distributed::testing::WorkerEnv& env)

// In a worker: init_process_group for its rank at the parent's store (the
// default group the scenario then uses). `timeout` 0: the default;
// `backend` "gloo" or "nccl".
void init_world(const WorkerEnv& env, Millis timeout = Millis{0}, const std::string& backend = "gloo");

// Whether `world` ranks of the nccl backend can run here: a GPU each, or
// the emulation (each worker process its own emulated device).
bool nccl_ranks_runnable(int world);

// True in a process started by run_workers.
bool is_worker();
// In a worker: runs its scenario and exits the process (0 on success; 1 and
// the exception's message on stderr when it throws; 2 for an unknown
// scenario; run_workers reports 4 for a worker that exited 0 without
// getting here). Returns at once in any other process.
void run_if_worker();

struct RunOptions {
  // Workers still running this long after the start are killed (SIGKILL).
  Millis deadline = std::chrono::seconds(120);
  std::string arg;
  // Arguments for the re-run binary: by default the GoogleTest filter that
  // selects the entry test above.
  std::vector<std::string> argv = {"--gtest_filter=MultiProcessWorker.Entry"};
  // Extra environment for the workers, "NAME=value".
  std::vector<std::string> env;
  // For check_workers / EMBER_EXPECT_RANKS: ranks that must fail on purpose,
  // rank -> the exit code they must end with (every other rank must exit 0).
  std::map<int, int> expect_exit;
};

struct WorkerResult {
  int rank = 0;
  int exit_code = -1;  // -1 when killed by a signal
  int signal = 0;      // the signal that ended it, if any
  bool killed_at_deadline = false;
  double seconds = 0;  // from start to exit
  std::string output;  // its stdout and stderr
  bool ok() const { return exit_code == 0; }
};

std::vector<WorkerResult> run_workers(const std::string& scenario, int world_size, const RunOptions& options = {});

bool all_succeeded(const std::vector<WorkerResult>& results);
// Scenario options from RunOptions::arg written "key=value,key,..." (a bare
// key means "1").
std::map<std::string, std::string> parse_arg(const std::string& arg);
// Every worker's status and output, for a failure message.
std::string describe(const std::vector<WorkerResult>& results);

// ---- One call per run: run the workers, check every rank's exit ----

struct RanksOutcome {
  bool ok = false;
  // When not ok: the scenario, world size and arg, each rank that ended
  // otherwise than expected (its exit code or signal), then describe().
  std::string message;
};
// run_workers, then every rank must exit 0, or with the code
// options.expect_exit gives it.
RanksOutcome check_workers(const std::string& scenario, int world_size, const RunOptions& options = {});

// In a GoogleTest test: EMBER_EXPECT_RANKS(scenario, world_size[, options])
// runs check_workers and fails the test (EXPECT: and goes on; ASSERT: and
// returns) with its message; `<< ...` after it adds context, as after
// EXPECT_TRUE. `options` may be a braced RunOptions: {.arg = "x"}.
#define EMBER_EXPECT_RANKS(scenario, world_size, ...) \
  EMBER_RANKS_CHECK_(ADD_FAILURE, scenario, world_size __VA_OPT__(, ) __VA_ARGS__)
#define EMBER_ASSERT_RANKS(scenario, world_size, ...) \
  EMBER_RANKS_CHECK_(FAIL, scenario, world_size __VA_OPT__(, ) __VA_ARGS__)
// (The pragmas: gcc 12 warns of the members a braced {.arg = ...} leaves out.)
// clang-format off
#define EMBER_RANKS_CHECK_(fail, ...)                                                          \
  _Pragma("GCC diagnostic push")                                                               \
  _Pragma("GCC diagnostic ignored \"-Wmissing-field-initializers\"")                           \
  switch (0)                                                                                   \
  case 0:                                                                                      \
  default:                                                                                     \
    if (const ::ember::distributed::testing::RanksOutcome ember_ranks_outcome =                \
            ::ember::distributed::testing::check_workers(__VA_ARGS__);                         \
        ember_ranks_outcome.ok) {                                                              \
    } else                                                                                     \
      _Pragma("GCC diagnostic pop") fail() << ember_ranks_outcome.message
// clang-format on

// ---- Checks inside a worker (a failed one throws, failing the worker) ----

// EMBER_CHECK with the line and the condition in the message.
#define WCHECK(cond, ...) EMBER_CHECK(cond, "line ", __LINE__, ": check failed: " #cond ": ", __VA_ARGS__)

// Throws unless `got` and `want` are both defined, have one shape, and every
// element has |got - want| <= tol * (1 + |want|), compared in float64
// (tol 0: equal). The message names `what`, the first element out of
// tolerance with both values, and the largest difference.
void check_close(const Tensor& got, const Tensor& want, const std::string& what, double tol);

// Lower level, for benchmarks that need a peer process: starts this
// executable with `args` and the extra environment ("NAME=value"), its
// stdout/stderr going to `log_path` (inherited when empty). GoogleTest and
// Bazel test variables that would confuse a second copy (sharding, XML
// output, premature-exit file) are dropped from its environment.
pid_t spawn_self(const std::vector<std::string>& args, const std::vector<std::string>& env,
                 const std::string& log_path);
// Waits for `pid` until `deadline`, then SIGKILLs it. Fills exit_code,
// signal, killed_at_deadline.
void wait_or_kill(pid_t pid, std::chrono::steady_clock::time_point deadline, WorkerResult& result);

}  // namespace ember::distributed::testing
