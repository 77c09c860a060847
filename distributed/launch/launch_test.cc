// launch(), spawn_local_workers() and //tools:launch with real worker
// processes on localhost (the worker is launch_test_worker_main.cc): the
// environment each rank gets, rank-prefixed output, failure propagation, and
// that nothing is left running afterwards.
#include "distributed/launch/launch.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/exception.h"

extern char** environ;

namespace ember::distributed {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::string runfile(const std::string& rel) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  std::string path = std::string(srcdir ? srcdir : ".") + "/" + (ws ? ws : "ember") + "/" + rel;
  EXPECT_EQ(::access(path.c_str(), X_OK), 0) << path;
  return path;
}

std::string worker() { return runfile("distributed/launch/launch_test_worker"); }
std::string launcher() { return runfile("tools/launch"); }

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string tmpl = std::string(base ? base : "/tmp") + "/launch_test.XXXXXX";
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
    path_ = tmpl;
  }
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Dead, or a zombie (exited; only waiting for a parent that is not us).
bool alive(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f) return false;
  std::string line;
  std::getline(f, line);
  size_t paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) return false;
  char state = line[paren + 2];
  return state != 'Z' && state != 'X';
}

// Grandchildren are reparented and killed asynchronously: give them a moment.
bool dies_within(pid_t pid, std::chrono::milliseconds limit) {
  auto end = Clock::now() + limit;
  while (alive(pid)) {
    if (Clock::now() > end) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

pid_t read_pid(const std::string& path) {
  std::string s = read_file(path);
  EXPECT_FALSE(s.empty()) << path;
  return s.empty() ? -1 : static_cast<pid_t>(std::atol(s.c_str()));
}

// Options for nproc workers on this node, on a free master port.
LaunchOptions local_options(int nproc) {
  LaunchOptions opt;
  opt.nproc_per_node = nproc;
  opt.master_port = 0;
  return opt;
}

struct Result {
  int rc = -1;
  std::string out, err;
  std::chrono::milliseconds elapsed{};
};

// Checks that launch's stderr contains each of `parts`.
void expect_stderr_has(const Result& r, std::initializer_list<std::string> parts) {
  for (const std::string& part : parts) EXPECT_NE(r.err.find(part), std::string::npos) << part << " in:\n" << r.err;
}

// Runs launch() in this process with fds 1 and 2 sent to files.
Result run_launch(const LaunchOptions& opt, const std::vector<std::string>& argv) {
  TempDir dir;
  std::fflush(stdout);
  std::fflush(stderr);
  int saved_out = ::dup(1), saved_err = ::dup(2);
  int out = ::open(dir.file("out").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  int err = ::open(dir.file("err").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ::dup2(out, 1);
  ::dup2(err, 2);
  ::close(out);
  ::close(err);
  Result r;
  auto start = Clock::now();
  std::string error;
  try {
    r.rc = launch(opt, argv);
  } catch (const std::exception& e) {
    error = e.what();
  }
  r.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  std::fflush(stdout);
  std::fflush(stderr);
  ::dup2(saved_out, 1);
  ::dup2(saved_err, 2);
  ::close(saved_out);
  ::close(saved_err);
  r.out = read_file(dir.file("out"));
  r.err = read_file(dir.file("err"));
  if (!error.empty()) throw Error(error);
  return r;
}

// The test's environment without any rank variables, plus `extra`.
std::vector<std::string> clean_env(const std::vector<std::string>& extra = {}) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    std::string key = kv.substr(0, kv.find('='));
    if (key == "RANK" || key == "WORLD_SIZE" || key == "LOCAL_RANK" || key.rfind("SLURM_", 0) == 0) continue;
    env.push_back(kv);
  }
  env.insert(env.end(), extra.begin(), extra.end());
  return env;
}

// Starts a program with stdout/stderr sent to files in `dir`.
pid_t start(const std::vector<std::string>& argv, const TempDir& dir,
            const std::vector<std::string>& env = clean_env()) {
  std::vector<std::string> a = argv, e = env;
  std::vector<char*> ca, ce;
  for (auto& s : a) ca.push_back(s.data());
  ca.push_back(nullptr);
  for (auto& s : e) ce.push_back(s.data());
  ce.push_back(nullptr);
  std::string out = dir.file("out"), err = dir.file("err");
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t pid = ::fork();
  if (pid == 0) {
    int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int r = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(o, 1);
    ::dup2(r, 2);
    ::execve(ca[0], ca.data(), ce.data());
    ::_exit(127);
  }
  return pid;
}

Result finish(pid_t pid, const TempDir& dir) {
  Result r;
  int status = 0;
  ::waitpid(pid, &status, 0);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = read_file(dir.file("out"));
  r.err = read_file(dir.file("err"));
  return r;
}

Result run(const std::vector<std::string>& argv, const std::vector<std::string>& env = clean_env()) {
  TempDir dir;
  return finish(start(argv, dir, env), dir);
}

std::map<std::string, std::string> parse_env_file(const std::string& path) {
  std::map<std::string, std::string> m;
  std::istringstream in(read_file(path));
  std::string line;
  while (std::getline(in, line)) m[line.substr(0, line.find('='))] = line.substr(line.find('=') + 1);
  return m;
}

// OMP_NUM_THREADS of this process, unset for one test and put back after.
class ScopedUnset {
 public:
  explicit ScopedUnset(const char* name) : name_(name) {
    if (const char* v = std::getenv(name)) old_ = v, had_ = true;
    ::unsetenv(name);
  }
  ~ScopedUnset() {
    if (had_) ::setenv(name_, old_.c_str(), 1);
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

// The placement torchrun gives a worker, to check against its env.R file.
struct WorkerVars {
  int rank, world_size, local_rank, local_world_size, group_rank, group_world_size;
  std::string master_addr;
};
void expect_worker_vars(std::map<std::string, std::string>& env, const WorkerVars& w) {
  EXPECT_EQ(env["RANK"], std::to_string(w.rank));
  EXPECT_EQ(env["WORLD_SIZE"], std::to_string(w.world_size));
  EXPECT_EQ(env["LOCAL_RANK"], std::to_string(w.local_rank));
  EXPECT_EQ(env["LOCAL_WORLD_SIZE"], std::to_string(w.local_world_size));
  EXPECT_EQ(env["GROUP_RANK"], std::to_string(w.group_rank));
  EXPECT_EQ(env["GROUP_WORLD_SIZE"], std::to_string(w.group_world_size));
  EXPECT_EQ(env["MASTER_ADDR"], w.master_addr);
}

TEST(Launch, EveryRankGetsItsEnvironment) {
  ScopedUnset omp("OMP_NUM_THREADS");
  TempDir dir;
  LaunchOptions opt = local_options(3);
  Result r = run_launch(opt, {worker(), "env", dir.path()});
  ASSERT_EQ(r.rc, 0) << r.err;
  std::string port;
  for (int rank = 0; rank < 3; ++rank) {
    auto env = parse_env_file(dir.file("env." + std::to_string(rank)));
    expect_worker_vars(env, {rank, 3, rank, 3, 0, 1, "127.0.0.1"});
    EXPECT_EQ(env["OMP_NUM_THREADS"], "1");
    if (rank == 0) port = env["MASTER_PORT"];
    EXPECT_EQ(env["MASTER_PORT"], port);
  }
  EXPECT_GT(std::atoi(port.c_str()), 0);
  EXPECT_NE(r.err.find("Setting OMP_NUM_THREADS environment variable"), std::string::npos) << r.err;
}

// 0 when 127.0.0.1:port binds (and listens) as a socket with or without
// SO_REUSEADDR, else the errno.
int bind_error(int port, bool reuse) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  EXPECT_GE(fd, 0);
  int one = 1;
  if (reuse) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const int err = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::listen(fd, 4) == 0 ? 0 : errno;
  ::close(fd);
  return err;
}

// A reserved port is held against everyone but the store's own listener
// (SO_REUSEADDR, as the TCPStore server binds), and released with the
// object: a port found free and closed again (what the launcher did before)
// would bind plainly too, so a connect() or another job could take it
// before rank 0's store listens.
TEST(ReservedPort, HoldsThePortForTheStoresListenerOnly) {
  int port = 0;
  {
    ReservedPort held;
    port = held.port();
    ASSERT_GT(port, 0);
    EXPECT_EQ(bind_error(port, false), EADDRINUSE) << "a plain bind of the reserved port " << port;
    EXPECT_EQ(bind_error(port, true), 0) << "the store's bind of the reserved port " << port;
    ReservedPort other;
    EXPECT_NE(other.port(), port) << "a second reservation got the same port";
    ReservedPort moved = std::move(held);
    EXPECT_EQ(moved.port(), port);
    EXPECT_EQ(bind_error(port, false), EADDRINUSE) << "held by the moved-to reservation";
  }
  EXPECT_EQ(bind_error(port, false), 0) << "port " << port << " stays held after its reservation is gone";
}

// Under the launcher (MASTER_PORT 0: a free one), the port is held while
// the workers run, and rank 0 can listen on it as the store does.
TEST(Launch, TheStorePortIsHeldWhileTheWorkersRun) {
  TempDir dir;
  Result r = run_launch(local_options(2), {worker(), "listen", dir.path()});
  ASSERT_EQ(r.rc, 0) << r.err;
  std::ifstream f(dir.file("listen"));
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, std::string("plain=") + std::strerror(EADDRINUSE) + " store=ok");
}

// The store's job token: one fresh secret per job, the same for its ranks;
// a token the user exported is passed on unchanged.
TEST(Launch, EveryJobGetsItsOwnStoreToken) {
  ScopedUnset token_var("EMBER_STORE_TOKEN");
  std::vector<std::string> tokens;
  for (int job = 0; job < 2; ++job) {
    TempDir dir;
    LaunchOptions opt = local_options(2);
    Result r = run_launch(opt, {worker(), "env", dir.path()});
    ASSERT_EQ(r.rc, 0) << r.err;
    auto env0 = parse_env_file(dir.file("env.0"));
    auto env1 = parse_env_file(dir.file("env.1"));
    EXPECT_EQ(env0["EMBER_STORE_TOKEN"].size(), 32u) << env0["EMBER_STORE_TOKEN"];
    EXPECT_EQ(env0["EMBER_STORE_TOKEN"].find_first_not_of("0123456789abcdef"), std::string::npos);
    EXPECT_EQ(env0["EMBER_STORE_TOKEN"], env1["EMBER_STORE_TOKEN"]);
    tokens.push_back(env0["EMBER_STORE_TOKEN"]);
  }
  EXPECT_NE(tokens[0], tokens[1]);
  ::setenv("EMBER_STORE_TOKEN", "users-own-secret", 1);
  TempDir dir;
  ASSERT_EQ(run_launch(local_options(1), {worker(), "env", dir.path()}).rc, 0);
  EXPECT_EQ(parse_env_file(dir.file("env.0"))["EMBER_STORE_TOKEN"], "users-own-secret");
  ::unsetenv("EMBER_STORE_TOKEN");
}

TEST(Launch, SecondNodeRanksAndUserOmpSetting) {
  ::setenv("OMP_NUM_THREADS", "7", 1);
  TempDir dir;
  LaunchOptions opt;
  opt.nproc_per_node = 2;
  opt.nnodes = 2;
  opt.node_rank = 1;
  opt.master_addr = "10.1.2.3";
  opt.master_port = 29999;
  Result r = run_launch(opt, {worker(), "env", dir.path()});
  ::unsetenv("OMP_NUM_THREADS");
  ASSERT_EQ(r.rc, 0) << r.err;
  for (int local = 0; local < 2; ++local) {
    auto env = parse_env_file(dir.file("env." + std::to_string(2 + local)));
    expect_worker_vars(env, {2 + local, 4, local, 2, 1, 2, "10.1.2.3"});
    EXPECT_EQ(env["MASTER_PORT"], "29999");
    EXPECT_EQ(env["OMP_NUM_THREADS"], "7");  // the user's choice stands
  }
  EXPECT_EQ(r.err.find("OMP_NUM_THREADS"), std::string::npos) << r.err;
}

TEST(Launch, OutputLinesArePrefixedByRank) {
  LaunchOptions opt = local_options(2);
  Result r = run_launch(opt, {worker(), "print"});
  ASSERT_EQ(r.rc, 0) << r.err;
  for (int rank = 0; rank < 2; ++rank) {
    std::string p = "[rank " + std::to_string(rank) + "]: ";
    EXPECT_NE(r.out.find(p + "out line 1 of rank " + std::to_string(rank) + "\n"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(p + "out line 2 of rank " + std::to_string(rank) + "\n"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(p + "partial " + std::to_string(rank) + "\n"), std::string::npos) << r.out;
    EXPECT_NE(r.err.find(p + "err of rank " + std::to_string(rank) + "\n"), std::string::npos) << r.err;
  }
  // Every line is whole and tagged: no interleaving mid-line.
  std::istringstream lines(r.out);
  std::string line;
  int n = 0;
  while (std::getline(lines, line)) {
    EXPECT_EQ(line.rfind("[rank ", 0), 0u) << line;
    ++n;
  }
  EXPECT_EQ(n, 6);
}

TEST(Launch, NoPrefixPassesOutputThrough) {
  LaunchOptions opt = local_options(2);
  opt.prefix_output = false;
  Result r = run_launch(opt, {worker(), "print"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("out line 1 of rank 1\n"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("[rank"), std::string::npos) << r.out;
}

TEST(Launch, RankZeroLoggingUnderTheLauncher) {
  LaunchOptions opt = local_options(2);
  Result r = run_launch(opt, {worker(), "log"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("[rank 0]: only rank 0 says this\n"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("[rank 1]: only rank 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank 0]: [rank 0] every rank says this\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank 1]: [rank 1] every rank says this\n"), std::string::npos) << r.out;
}

// Checks that the workers (pid.R) and their children (child.R) are gone.
void expect_nothing_left(const TempDir& dir, int nproc, int failing) {
  for (int rank = 0; rank < nproc; ++rank) {
    pid_t pid = read_pid(dir.file("pid." + std::to_string(rank)));
    ASSERT_GT(pid, 0);
    // Workers are reaped by launch() itself: gone for good.
    EXPECT_EQ(::kill(pid, 0), -1) << "rank " << rank << " pid " << pid << " is still there";
    EXPECT_EQ(errno, ESRCH);
    if (rank == failing) continue;
    pid_t child = read_pid(dir.file("child." + std::to_string(rank)));
    ASSERT_GT(child, 0);
    EXPECT_TRUE(dies_within(child, 5s)) << "rank " << rank << "'s child " << child << " survived";
  }
}

TEST(Launch, FailingWorkerStopsTheOthersAndReturnsItsCode) {
  TempDir dir;
  LaunchOptions opt = local_options(3);
  Result r = run_launch(opt, {worker(), "fail", "1", "3", dir.path()});
  EXPECT_EQ(r.rc, 3) << r.err;
  // The others sleep for minutes unless killed, and SIGTERM was enough: the
  // grace period never ran out.
  EXPECT_LT(r.elapsed, 30s) << r.err;
  EXPECT_EQ(r.err.find("sending SIGKILL"), std::string::npos) << r.err;
  expect_stderr_has(r,
                    {"launch: rank 1 (local rank 1, pid ", "exited with code 3", "[rank 1]: rank 1 failing with 3\n"});
  expect_nothing_left(dir, 3, 1);
}

TEST(Launch, WorkerKilledBySignalReturns128PlusSignal) {
  TempDir dir;
  LaunchOptions opt = local_options(2);
  Result r = run_launch(opt, {worker(), "fail", "0", "sig9", dir.path()});
  EXPECT_EQ(r.rc, 128 + 9) << r.err;
  expect_stderr_has(r, {"rank 0 (local rank 0, pid ", "was killed by signal 9 (SIGKILL)"});
  expect_nothing_left(dir, 2, 0);
}

TEST(Launch, WorkersIgnoringSigtermAreKilledAfterTheGrace) {
  TempDir dir;
  LaunchOptions opt = local_options(2);
  opt.grace = 300ms;
  Result r = run_launch(opt, {worker(), "fail", "1", "5", dir.path(), "stubborn"});
  EXPECT_EQ(r.rc, 5) << r.err;
  EXPECT_GE(r.elapsed, 300ms);
  EXPECT_LT(r.elapsed, 5s);
  EXPECT_NE(r.err.find("sending SIGKILL"), std::string::npos) << r.err;
  expect_nothing_left(dir, 2, 1);
}

// torchrun's --max-restarts: a worker that fails in the first start stops
// the others, and every worker starts again with EMBER_RESTART_COUNT (and
// TORCHELASTIC_RESTART_COUNT) 1; a failure in every start ends the job
// after the last restart with its code.
TEST(Launch, MaxRestartsStartsEveryWorkerAgain) {
  TempDir dir;
  LaunchOptions opt = local_options(3);
  opt.max_restarts = 2;
  Result r = run_launch(opt, {worker(), "restart", "1", "1", dir.path()});
  EXPECT_EQ(r.rc, 0) << r.err;
  expect_stderr_has(r, {"[rank 1]: rank 1 failing in start 0\n", "launch: restarting the workers (restart 1 of 2)"});
  EXPECT_EQ(r.err.find("restart 2 of 2"), std::string::npos) << r.err;
  for (int rank = 0; rank < 3; ++rank) {
    std::ifstream f(dir.path() + "/restart." + std::to_string(rank));
    std::string got((std::istreambuf_iterator<char>(f)), {});
    EXPECT_EQ(got, "1 1") << "rank " << rank;
  }

  TempDir always;
  Result r2 = run_launch(opt, {worker(), "restart", "2", "99", always.path()});
  EXPECT_EQ(r2.rc, 3) << r2.err;
  expect_stderr_has(r2, {"[rank 2]: rank 2 failing in start 2\n", "launch: restarting the workers (restart 2 of 2)",
                         "launch: giving up after 2 restarts"});
  EXPECT_EQ(r2.err.find("restart 3"), std::string::npos) << r2.err;
}

TEST(Launch, AllSucceedingReturnsZeroAndBadOptionsThrow) {
  LaunchOptions opt = local_options(2);
  EXPECT_EQ(run_launch(opt, {"true"}).rc, 0);  // found through PATH
  EXPECT_EQ(run_launch(opt, {"false"}).rc, 1);

  auto message = [&](const LaunchOptions& o, std::vector<std::string> argv) {
    try {
      launch(o, argv);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(opt, {"no_such_program_xyz"}).find("'no_such_program_xyz' not found in PATH"), std::string::npos);
  EXPECT_NE(message(opt, {"/nonexistent/prog"}).find("cannot execute '/nonexistent/prog'"), std::string::npos);
  EXPECT_NE(message(opt, {}).find("no program"), std::string::npos);
  LaunchOptions bad = opt;
  bad.nproc_per_node = 0;
  EXPECT_NE(message(bad, {"true"}).find("nproc_per_node must be >= 1, got 0"), std::string::npos);
  bad = opt;
  bad.nnodes = 2;
  bad.node_rank = 2;
  bad.master_port = 1234;
  EXPECT_NE(message(bad, {"true"}).find("node_rank 2 is outside [0, nnodes=2)"), std::string::npos);
  bad.node_rank = 0;
  bad.master_port = 0;
  EXPECT_NE(message(bad, {"true"}).find("only works with nnodes=1"), std::string::npos);
  bad.master_port = 1234;
  bad.max_restarts = 1;
  EXPECT_NE(message(bad, {"true"}).find("restarts one node's workers only"), std::string::npos);
  bad = opt;
  bad.max_restarts = -1;
  EXPECT_NE(message(bad, {"true"}).find("max_restarts must be >= 0, got -1"), std::string::npos);
}

TEST(SpawnLocalWorkers, ReturnsMinusOneInAWorkerEnvironment) {
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  char arg0[] = "prog";
  char* argv[] = {arg0, nullptr};
  EXPECT_EQ(spawn_local_workers(2, 1, argv), -1);
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  ::setenv("SLURM_PROCID", "0", 1);
  ::setenv("SLURM_NTASKS", "4", 1);
  ::setenv("SLURM_STEP_ID", "0", 1);
  EXPECT_EQ(spawn_local_workers(2, 1, argv), -1);  // an srun step
  ::unsetenv("SLURM_PROCID");
  ::unsetenv("SLURM_NTASKS");
  ::unsetenv("SLURM_STEP_ID");
}

TEST(SpawnLocalWorkers, AProgramLaunchesItself) {
  Result r = run({worker(), "spawn", "2"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("[rank 0]: worker 0 of 2\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank 1]: worker 1 of 2\n"), std::string::npos) << r.out;
}

TEST(LaunchBinary, RunsTheProgramWithSpaceSeparatedFlags) {
  TempDir dir;
  Result r = run({launcher(), "--nproc_per_node", "2", "--master-port", "0", "--", worker(), "env", dir.path()});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(parse_env_file(dir.file("env.1"))["WORLD_SIZE"], "2");
}

TEST(LaunchBinary, ReturnsTheFailingWorkersCode) {
  TempDir dir;
  Result r = run({launcher(), "--nproc_per_node=2", "--master_port=0", worker(), "fail", "0", "7", dir.path()});
  EXPECT_EQ(r.rc, 7) << r.err;
  expect_nothing_left(dir, 2, 0);
}

// Starts the launcher binary with 2 workers that sleep, and waits until
// both have written their pids: the launcher's pid and the workers'.
void start_sleeping_workers(const TempDir& dir, const TempDir& logs, pid_t* pid, pid_t* w0, pid_t* w1) {
  *pid = start({launcher(), "--nproc_per_node=2", "--master_port=0", "--", worker(), "sleep", dir.path()}, logs);
  auto give_up = Clock::now() + 30s;
  while (!(exists(dir.file("pid.0")) && exists(dir.file("pid.1"))) && Clock::now() < give_up)
    std::this_thread::sleep_for(10ms);
  ASSERT_TRUE(exists(dir.file("pid.1")));
  *w0 = read_pid(dir.file("pid.0"));
  *w1 = read_pid(dir.file("pid.1"));
}

TEST(LaunchBinary, ForwardsSigtermToTheWorkers) {
  TempDir dir, logs;
  pid_t pid, w0, w1;
  ASSERT_NO_FATAL_FAILURE(start_sleeping_workers(dir, logs, &pid, &w0, &w1));
  ::kill(pid, SIGTERM);
  Result r = finish(pid, logs);
  EXPECT_EQ(r.rc, 128 + SIGTERM) << r.err;
  EXPECT_NE(r.err.find("received signal 15"), std::string::npos) << r.err;
  EXPECT_TRUE(dies_within(w0, 5s));
  EXPECT_TRUE(dies_within(w1, 5s));
}

// Regression: a SIGTERM that reached a worker between fork and exec ran the
// launcher's inherited handler there and was swallowed; the worker then
// lived until the SIGKILL after the grace period (5 s). The forwarded
// signals are now blocked across fork, so the worker dies as it should. The
// test hook pauses each child 1.5 s in that window.
TEST(LaunchBinary, SigtermBetweenForkAndExecIsNotLost) {
  TempDir dir, logs;
  std::vector<std::string> env = clean_env();
  env.push_back("EMBER_LAUNCH_TEST_FORK_PAUSE_MS=1500");
  auto t0 = Clock::now();
  pid_t pid = start(
      {launcher(), "--nproc_per_node=2", "--master_port=0", "--grace_ms=20000", "--", worker(), "sleep", dir.path()},
      logs, env);
  std::this_thread::sleep_for(500ms);  // the workers are inside the window
  ::kill(pid, SIGTERM);
  Result r = finish(pid, logs);
  const auto secs = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(r.rc, 128 + SIGTERM) << r.err;
  EXPECT_LT(secs, 10.0) << "the workers outlived the SIGTERM until the grace period's SIGKILL\n" << r.err;
  EXPECT_FALSE(exists(dir.file("pid.0")) || exists(dir.file("pid.1"))) << "a worker reached main() after SIGTERM";
}

TEST(LaunchBinary, KilledLauncherTakesItsWorkersAlong) {
  TempDir dir, logs;
  pid_t pid, w0, w1;
  ASSERT_NO_FATAL_FAILURE(start_sleeping_workers(dir, logs, &pid, &w0, &w1));
  ::kill(pid, SIGKILL);  // no chance to clean up: PR_SET_PDEATHSIG does it
  finish(pid, logs);
  EXPECT_TRUE(dies_within(w0, 5s));
  EXPECT_TRUE(dies_within(w1, 5s));
}

TEST(LaunchBinary, UsageErrorsNameTheFlag) {
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  std::vector<Case> cases = {
      {{}, "launch: no program given"},
      {{"--nproc_per_node=abc", "true"}, "--nproc_per_node: 'abc' is not an integer"},
      {{"--nproc_per_node=0", "true"}, "--nproc_per_node: 0 is outside [1, "},
      {{"--nproc_per_node"}, "--nproc_per_node needs a value"},
      {{"--bogus=1", "true"}, "unknown flag --bogus"},
      {{"--master_port=70000", "true"}, "--master_port: 70000 is outside [0, 65535]"},
      {{"--nnodes=2", "--node_rank=2", "true"}, "--node_rank 2 is outside [0, --nnodes=2)"},
      {{"--nnodes=2", "true"}, "needs --node_rank"},
      {{"--no-prefix=1", "true"}, "--no-prefix takes no value"},
      {{"--", "no_such_program_xyz"}, "'no_such_program_xyz' not found in PATH"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {launcher()};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    Result r = run(argv);
    EXPECT_EQ(r.rc, 2) << c.expected << "\n" << r.err;
    EXPECT_NE(r.err.find(c.expected), std::string::npos) << r.err;
  }
  Result help = run({launcher(), "--help"});
  EXPECT_EQ(help.rc, 0);
  EXPECT_NE(help.out.find("usage: launch"), std::string::npos);
}

TEST(LaunchBinary, ProgramIsRelativeToBuildWorkingDirectory) {
  // As under `bazel run`: the launcher starts elsewhere, the user's
  // directory is in BUILD_WORKING_DIRECTORY.
  TempDir dir;
  std::string w = worker();
  std::string wd = w.substr(0, w.rfind('/'));
  Result r = run({launcher(), "--nproc_per_node=1", "--master_port=0", "./launch_test_worker", "env", dir.path()},
                 clean_env({"BUILD_WORKING_DIRECTORY=" + wd}));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(parse_env_file(dir.file("env.0"))["RANK"], "0");
}

}  // namespace
}  // namespace ember::distributed
