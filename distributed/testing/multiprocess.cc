// The multi-process test harness (see multiprocess.h): spawns the test
// binary as worker processes, hosts their store, collects exit statuses and
// output, and kills stragglers at the deadline.
#include "distributed/testing/multiprocess.h"

#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/device.h"
#include "core/exception.h"
#include "distributed/init.h"

extern char** environ;

// third_party/cuda_emu's launch record (written at exit; see run_if_worker).
extern "C" void ember_emu_write_launches() __attribute__((weak));

namespace ember::distributed::testing {
namespace {

using Clock = std::chrono::steady_clock;

std::map<std::string, WorkerFn>& registry() {
  static auto* r = new std::map<std::string, WorkerFn>;
  return *r;
}

const char* env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

// Variables a second copy of a GoogleTest binary under Bazel must not see:
// sharding would filter the entry test away, and the XML / premature-exit
// files belong to the parent.
bool dropped(const std::string& kv) {
  static const char* kDrop[] = {"GTEST_SHARD_INDEX=", "GTEST_TOTAL_SHARDS=", "TEST_SHARD_STATUS_FILE=",
                                "XML_OUTPUT_FILE=",   "GTEST_OUTPUT=",       "TEST_PREMATURE_EXIT_FILE=",
                                "EMBER_MP_"};
  for (const char* p : kDrop)
    if (kv.rfind(p, 0) == 0) return true;
  return false;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string temp_dir() {
  const char* d = std::getenv("TEST_TMPDIR");
  return d && *d ? d : "/tmp";
}

}  // namespace

std::shared_ptr<Store> WorkerEnv::store(Millis timeout) const {
  TCPStoreOptions o;
  o.is_server = false;
  o.timeout = timeout;
  return std::make_shared<TCPStore>(store_host, store_port, o);
}

bool register_worker(const std::string& name, WorkerFn fn) {
  registry()[name] = std::move(fn);
  return true;
}

std::map<std::string, std::string> parse_arg(const std::string& arg) {
  std::map<std::string, std::string> out;
  std::stringstream ss(arg);
  std::string item;
  while (std::getline(ss, item, ',')) {
    auto eq = item.find('=');
    out[item.substr(0, eq)] = eq == std::string::npos ? "1" : item.substr(eq + 1);
  }
  return out;
}

bool is_worker() { return std::getenv("EMBER_MP_SCENARIO") != nullptr; }

namespace {
// A worker that crashes prints where (the symbols of its stack) before it
// dies by the same signal: "killed by signal 11" alone names no line.
void on_crash(int sig) {
  char head[96];
  const int n = std::snprintf(head, sizeof head, "[rank %s] crashed with signal %d; stack:\n",
                              std::getenv("EMBER_MP_RANK") ? std::getenv("EMBER_MP_RANK") : "?", sig);
  if (n > 0) (void)!write(2, head, static_cast<size_t>(n));
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
  signal(sig, SIG_DFL);
  raise(sig);
}
}  // namespace

void run_if_worker() {
  if (!is_worker()) return;
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) signal(sig, on_crash);
  // Die with the parent: a killed test run must not leave workers behind.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (std::to_string(getppid()) != env_or("EMBER_MP_PARENT", "")) _exit(3);
  // Tells the parent that the entry test ran: a binary without it exits 0
  // having run nothing.
  if (const char* entered = std::getenv("EMBER_MP_ENTERED")) close(open(entered, O_WRONLY | O_CREAT, 0644));

  WorkerEnv env;
  env.scenario = env_or("EMBER_MP_SCENARIO", "");
  env.rank = std::atoi(env_or("EMBER_MP_RANK", "0"));
  env.world_size = std::atoi(env_or("EMBER_MP_WORLD", "1"));
  env.arg = env_or("EMBER_MP_ARG", "");
  env.store_host = env_or("EMBER_MP_STORE_HOST", "127.0.0.1");
  env.store_port = std::atoi(env_or("EMBER_MP_STORE_PORT", "0"));
  int code = 0;
  auto it = registry().find(env.scenario);
  if (it == registry().end()) {
    std::fprintf(stderr, "[rank %d] unknown worker scenario '%s'\n", env.rank, env.scenario.c_str());
    code = 2;
  } else {
    try {
      it->second(env);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[rank %d] scenario '%s' FAILED: %s\n", env.rank, env.scenario.c_str(), e.what());
      code = 1;
    } catch (...) {
      std::fprintf(stderr, "[rank %d] scenario '%s' FAILED: unknown exception\n", env.rank, env.scenario.c_str());
      code = 1;
    }
  }
  std::fflush(stdout);
  std::fflush(stderr);
  std::cout.flush();
  std::cerr.flush();
  // _exit: skip GoogleTest's remaining work and static destructors; the
  // scenario has already torn down what it built. It skips atexit too, so
  // the CUDA emulation's launch record is written first where it is linked.
  if (ember_emu_write_launches) ember_emu_write_launches();
  _exit(code);
}

pid_t spawn_self(const std::vector<std::string>& args, const std::vector<std::string>& env,
                 const std::string& log_path) {
  std::vector<std::string> argv_s = {"/proc/self/exe"};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e)
    if (!dropped(*e)) env_s.push_back(*e);
  env_s.insert(env_s.end(), env.begin(), env.end());
  std::vector<char*> argv, envp;
  for (auto& s : argv_s) argv.push_back(s.data());
  argv.push_back(nullptr);
  for (auto& s : env_s) envp.push_back(s.data());
  envp.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (!log_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
  }
  pid_t pid = 0;
  // /proc/self/exe resolves in the parent at spawn time: the same binary.
  int rc = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  EMBER_CHECK(rc == 0, "spawn_self: posix_spawn(/proc/self/exe) failed: ", std::strerror(rc));
  return pid;
}

void wait_or_kill(pid_t pid, Clock::time_point deadline, WorkerResult& result) {
  int status = 0;
  for (;;) {
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) return;
    if (Clock::now() >= deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      result.killed_at_deadline = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (WIFEXITED(status)) {
    result.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    result.exit_code = -1;
    result.signal = WTERMSIG(status);
  }
}

std::vector<WorkerResult> run_workers(const std::string& scenario, int world_size, const RunOptions& options) {
  EMBER_CHECK(world_size >= 1, "run_workers: world_size ", world_size);
  EMBER_CHECK(registry().count(scenario), "run_workers: no worker scenario named '", scenario,
              "' (register it with EMBER_WORKER)");
  TCPStoreOptions so;
  so.is_server = true;
  so.wait_for_workers = false;
  so.timeout = std::chrono::seconds(60);
  TCPStore store("127.0.0.1", 0, so);

  const auto start = Clock::now();
  const auto deadline = start + options.deadline;
  std::vector<pid_t> pids(world_size);
  std::vector<std::string> logs(world_size);
  std::vector<WorkerResult> results(world_size);
  for (int r = 0; r < world_size; ++r) {
    char path[4096];
    std::snprintf(path, sizeof path, "%s/ember_mp_%s_r%d_XXXXXX", temp_dir().c_str(), scenario.c_str(), r);
    int fd = mkstemp(path);
    EMBER_CHECK(fd >= 0, "run_workers: mkstemp(", path, "): ", std::strerror(errno));
    close(fd);
    logs[r] = path;
    std::vector<std::string> env = {
        "EMBER_MP_SCENARIO=" + scenario,
        "EMBER_MP_RANK=" + std::to_string(r),
        "EMBER_MP_WORLD=" + std::to_string(world_size),
        "EMBER_MP_ARG=" + options.arg,
        "EMBER_MP_STORE_HOST=127.0.0.1",
        "EMBER_MP_STORE_PORT=" + std::to_string(store.port()),
        "EMBER_MP_PARENT=" + std::to_string(getpid()),
        "EMBER_MP_ENTERED=" + logs[r] + ".entered",
    };
    // One OpenMP thread a worker unless the test or the caller says
    // otherwise, as //tools:launch and torchrun give several workers on one
    // host: N workers of a machine's thread count each oversubscribe it, and
    // OpenMP's spinning waits then take the time (a 4-rank pipeline test ran
    // 2.8x longer on 2 cores).
    if (world_size > 1 && std::getenv("OMP_NUM_THREADS") == nullptr &&
        std::none_of(options.env.begin(), options.env.end(),
                     [](const std::string& kv) { return kv.rfind("OMP_NUM_THREADS=", 0) == 0; }))
      env.push_back("OMP_NUM_THREADS=1");
    env.insert(env.end(), options.env.begin(), options.env.end());
    results[r].rank = r;
    pids[r] = spawn_self(options.argv, env, logs[r]);
  }
  // Reap in any order: a worker that dies early must not wait behind one
  // that is still running.
  std::vector<bool> done(world_size, false);
  int remaining = world_size;
  while (remaining > 0) {
    bool progressed = false;
    for (int r = 0; r < world_size; ++r) {
      if (done[r]) continue;
      int status = 0;
      pid_t got = waitpid(pids[r], &status, WNOHANG);
      if (got != pids[r]) continue;
      if (WIFEXITED(status)) results[r].exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) results[r].signal = WTERMSIG(status);
      results[r].seconds = std::chrono::duration<double>(Clock::now() - start).count();
      done[r] = true;
      --remaining;
      progressed = true;
    }
    if (remaining > 0 && Clock::now() >= deadline) {
      for (int r = 0; r < world_size; ++r) {
        if (done[r]) continue;
        wait_or_kill(pids[r], deadline, results[r]);
        results[r].seconds = std::chrono::duration<double>(Clock::now() - start).count();
        done[r] = true;
        --remaining;
      }
    }
    if (!progressed) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (int r = 0; r < world_size; ++r) {
    results[r].output = read_file(logs[r]);
    unlink(logs[r].c_str());
    const std::string entered = logs[r] + ".entered";
    if (access(entered.c_str(), F_OK) == 0) {
      unlink(entered.c_str());
    } else if (results[r].exit_code == 0) {
      results[r].exit_code = 4;
      results[r].output += "[rank " + std::to_string(r) +
                           "] never reached run_if_worker: the test binary has no MultiProcessWorker.Entry (depend on "
                           "//distributed/testing:worker_entry)\n";
    }
  }
  return results;
}

bool all_succeeded(const std::vector<WorkerResult>& results) {
  for (const auto& r : results)
    if (!r.ok()) return false;
  return true;
}

namespace {
// How a worker ended, for both the full report and the list of bad ranks.
void describe_end(std::ostream& os, const WorkerResult& r) {
  if (r.killed_at_deadline)
    os << "KILLED at the deadline (hung?)";
  else if (r.signal)
    os << "killed by signal " << r.signal << " (" << strsignal(r.signal) << ")";
  else
    os << "exit code " << r.exit_code;
}
}  // namespace

std::string describe(const std::vector<WorkerResult>& results) {
  std::ostringstream os;
  for (const auto& r : results) {
    os << "---- rank " << r.rank << ": ";
    describe_end(os, r);
    os << " after " << r.seconds << " s\n" << r.output;
    if (!r.output.empty() && r.output.back() != '\n') os << '\n';
  }
  return os.str();
}

RanksOutcome check_workers(const std::string& scenario, int world_size, const RunOptions& options) {
  const std::vector<WorkerResult> results = run_workers(scenario, world_size, options);
  std::ostringstream bad;
  for (const auto& r : results) {
    auto it = options.expect_exit.find(r.rank);
    const int want = it == options.expect_exit.end() ? 0 : it->second;
    if (r.exit_code == want && !r.killed_at_deadline) continue;
    bad << "\n  rank " << r.rank << ": ";
    describe_end(bad, r);
    bad << ", expected exit code " << want;
  }
  RanksOutcome out;
  out.ok = bad.str().empty();
  if (!out.ok) {
    std::ostringstream os;
    os << "scenario '" << scenario << "' on " << world_size << (world_size == 1 ? " rank" : " ranks");
    if (!options.arg.empty()) os << ", arg '" << options.arg << "'";
    os << ":" << bad.str() << "\n" << describe(results);
    out.message = os.str();
  }
  return out;
}

void check_close(const Tensor& got, const Tensor& want, const std::string& what, double tol) {
  EMBER_CHECK(got.defined() && want.defined(), what, ": got ", got.defined() ? "a tensor" : "undefined", ", want ",
              want.defined() ? "a tensor" : "undefined");
  EMBER_CHECK(got.sizes() == want.sizes(), what, ": shape ", shape_str(got.sizes()), " vs ", shape_str(want.sizes()));
  const std::vector<double> g = got.to(DType::Float64).to_vector(), w = want.to(DType::Float64).to_vector();
  size_t first = g.size(), worst = 0;
  double max_diff = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double d = std::fabs(g[i] - w[i]);
    if (!(d <= tol * (1 + std::fabs(w[i]))) && first == g.size()) first = i;
    if (d > max_diff || (std::isnan(d) && !std::isnan(max_diff))) max_diff = d, worst = i;
  }
  EMBER_CHECK(first == g.size(), what, ": element ", first, ": ", g[first], " vs ", w[first], " wanted, |diff| ",
              std::fabs(g[first] - w[first]), " > ", tol, " * (1 + |want|); max |diff| ", max_diff, " at element ",
              worst, " of ", g.size());
}

void init_world(const WorkerEnv& env, Millis timeout, const std::string& backend) {
  InitOptions io;
  io.backend = backend;
  io.rank = env.rank;
  io.world_size = env.world_size;
  io.store = env.store();
  io.timeout = timeout;
  init_process_group(io);
}

bool nccl_ranks_runnable(int world) {
  return cuda_is_available() && (cuda_device_name() == "CUDA emulation" || cuda_device_count() >= world);
}

}  // namespace ember::distributed::testing
