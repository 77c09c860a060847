// The launcher behind //tools:launch and spawn_local_workers (see launch.h):
// fork/exec of the workers, the poll loop that prefixes their output, and
// the failure/signal handling that tears the job down without leaving
// processes behind.
#include "distributed/launch/launch.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/exception.h"
#include "distributed/launch/launch_internal.h"

extern char** environ;

namespace ember::distributed {
namespace launch_detail {
namespace {

using Clock = std::chrono::steady_clock;

// How long one poll() may sleep: bounds how late we notice a worker exit
// whose pipes are held open by its children, a signal that arrived just
// before poll(), or the grace deadline.
constexpr int kPollMs = 20;
// A line longer than this is flushed without waiting for its newline, so a
// worker that never prints one cannot grow the launcher without bound.
constexpr size_t kMaxLine = 64 * 1024;

// Signals the launcher forwards to the workers; set by the handler, read by
// the loop. Only one launch() runs at a time (documented), so one slot.
volatile sig_atomic_t g_signal = 0;
volatile sig_atomic_t g_signal_count = 0;
int g_handled_signals = 0;  // how many of them the worker loop has acted on
constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

void on_signal(int sig) {
  g_signal = sig;
  g_signal_count = g_signal_count + 1;
}

// SIGUSR1 to the launcher: forwarded to the workers, whose flight
// recorders dump (flight_recorder.h); the job goes on.
volatile sig_atomic_t g_usr1_count = 0;
int g_handled_usr1 = 0;
void on_usr1(int) { g_usr1_count = g_usr1_count + 1; }

// How long a failed job's teardown waits for the survivors' dumps after
// asking for them (they take milliseconds; a worker that cannot dump must
// not hold the teardown up).
constexpr auto kDumpWait = std::chrono::seconds(3);

void write_all(int fd, const char* data, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;  // stdout closed or broken: nothing sensible left to do with the text
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

void say(const std::string& msg) {
  std::string line = "launch: " + msg + "\n";
  write_all(STDERR_FILENO, line.data(), line.size());
}

namespace {

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return "was killed by signal " + std::to_string(sig) + (name ? std::string(" (SIG") + name + ")" : "");
  }
  return "ended with wait status " + std::to_string(status);
}

// The shell's convention: exit code, or 128 + the signal that killed it.
int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

// execvp's search, done in the parent: the child may only make
// async-signal-safe calls between fork and exec, and a missing program is
// better reported once, by name, than by every worker.
std::string resolve_program(const std::string& prog) {
  EMBER_CHECK(!prog.empty(), "launch: the program to run is empty");
  if (prog.find('/') != std::string::npos) {
    EMBER_CHECK(::access(prog.c_str(), X_OK) == 0, "launch: cannot execute '", prog, "': ", std::strerror(errno));
    return prog;
  }
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    std::string dir = dirs.substr(start, end - start);
    std::string cand = (dir.empty() ? std::string(".") : dir) + "/" + prog;
    struct stat st {};
    if (::stat(cand.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(cand.c_str(), X_OK) == 0) return cand;
    start = end + 1;
  }
  EMBER_CHECK(false, "launch: program '", prog, "' not found in PATH");
  return {};
}

namespace {

// One stream (stdout or stderr) of one worker, prefixed line by line.
struct OutStream {
  int fd = -1;    // read end, non-blocking; -1 once closed
  int dest = -1;  // the launcher's stdout or stderr
  std::string prefix;
  std::string pending;  // the current, unfinished line

  // Reads what is available; writes every complete line with its prefix.
  // Returns false at EOF.
  bool pump() {
    char buf[16384];
    for (;;) {
      ssize_t n = ::read(fd, buf, sizeof buf);
      if (n > 0) {
        emit(buf, static_cast<size_t>(n));
        continue;
      }
      if (n == 0) return false;
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      return false;  // a read error on our own pipe: treat as closed
    }
  }

  // Batches all complete lines of one chunk into a single write (whole
  // lines only, so ranks interleave by lines, never mid-line).
  void emit(const char* data, size_t n) {
    std::string out;
    size_t begin = 0;
    for (size_t i = 0; i < n; ++i) {
      if (data[i] != '\n') continue;
      out += prefix;
      out += pending;
      out.append(data + begin, i + 1 - begin);
      pending.clear();
      begin = i + 1;
    }
    pending.append(data + begin, n - begin);
    if (pending.size() >= kMaxLine) {
      out += prefix + pending + "\n";
      pending.clear();
    }
    if (!out.empty()) write_all(dest, out.data(), out.size());
  }

  // The last line of a worker that did not end it with a newline.
  void finish() {
    if (fd >= 0) {
      pump();
      ::close(fd);
      fd = -1;
    }
    if (!pending.empty()) {
      std::string out = prefix + pending + "\n";
      write_all(dest, out.data(), out.size());
      pending.clear();
    }
  }
};

struct Worker {
  int rank = 0, local_rank = 0;
  pid_t pid = -1;  // also its process group id
  bool running = false;
  int status = 0;
  OutStream out, err;
};

void signal_worker(const Worker& w, int sig) {
  if (!w.running) return;
  // The whole group: whatever the worker started goes too.
  if (::kill(-w.pid, sig) != 0) ::kill(w.pid, sig);
}

std::vector<char*> c_strings(std::vector<std::string>& v) {
  std::vector<char*> out;
  out.reserve(v.size() + 1);
  for (auto& s : v) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

}  // namespace

// The launcher's environment with the worker's variables put over it.
// 128 random bits from the kernel, as hex: the store token of one job.
std::string random_token() {
  unsigned char bytes[16];
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  EMBER_CHECK(fd >= 0, "launch: cannot open /dev/urandom for the job's store token: ", std::strerror(errno));
  size_t got = 0;
  while (got < sizeof bytes) {
    ssize_t r = ::read(fd, bytes + got, sizeof bytes - got);
    if (r < 0 && errno == EINTR) continue;
    EMBER_CHECK(r > 0, "launch: cannot read /dev/urandom for the job's store token");
    got += static_cast<size_t>(r);
  }
  ::close(fd);
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}

std::vector<std::string> worker_env(const std::vector<std::pair<std::string, std::string>>& set) {
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv = *e;
    std::string key = kv.substr(0, kv.find('='));
    bool overridden = false;
    for (const auto& [k, v] : set) overridden = overridden || k == key;
    if (!overridden) env.push_back(std::move(kv));
  }
  for (const auto& [k, v] : set) env.push_back(k + "=" + v);
  return env;
}

namespace {

void make_pipe(int fds[2]) {
  EMBER_CHECK(::pipe2(fds, O_CLOEXEC) == 0, "launch: pipe failed: ", std::strerror(errno));
  ::fcntl(fds[0], F_SETFL, ::fcntl(fds[0], F_GETFL) | O_NONBLOCK);
}

// Everything the child needs is computed before fork(); between fork and
// exec it only makes async-signal-safe calls.
//
// The forwarded signals arrive blocked (launch() blocks them around fork):
// until the handlers are reset below, the launcher's handler is installed
// here too, and would swallow a SIGTERM meant for this worker. Blocked, it
// stays pending and kills the worker when the mask is cleared before exec.
// `pause_ms` > 0 (EMBER_LAUNCH_TEST_FORK_PAUSE_MS, for launch_test only)
// widens that window so the test can hit it.
[[noreturn]] void exec_child(const char* path, char* const* args, char* const* envp, int out_fd, int err_fd,
                             pid_t launcher, int max_fd, long pause_ms) {
  if (pause_ms > 0) {
    timespec ts{pause_ms / 1000, (pause_ms % 1000) * 1000000};
    while (::nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
  }
  ::setpgid(0, 0);
  // If the launcher dies without cleaning up (SIGKILL, crash), the workers
  // must not live on as orphans.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) ::_exit(1);  // it died before the prctl took effect
  if (out_fd >= 0) ::dup2(out_fd, STDOUT_FILENO);
  if (err_fd >= 0) ::dup2(err_fd, STDERR_FILENO);
  // Other descriptors of the launcher's process (another worker's pipe, a
  // test's files) are not the worker's business; torchrun closes them too.
  if (::syscall(SYS_close_range, 3u, ~0u, 0u) != 0)
    for (int fd = 3; fd < max_fd; ++fd) ::close(fd);
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  for (int sig : kForwarded) ::sigaction(sig, &dfl, nullptr);
  ::sigaction(SIGPIPE, &dfl, nullptr);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::execve(path, args, envp);
  int e = errno;
  auto put = [](const char* text) {
    ssize_t r = ::write(STDERR_FILENO, text, std::strlen(text));
    (void)r;  // nowhere left to report a failed report
  };
  put("launch: exec failed: ");
  put(path);
  put(": ");
  put(std::strerror(e));  // not formally async-signal-safe; we are exiting anyway
  put("\n");
  ::_exit(127);
}

}  // namespace

SignalScope::SignalScope() {
  g_signal = 0;
  g_signal_count = 0;
  g_handled_signals = 0;
  static_assert(std::size(kForwarded) == 4, "SignalScope::old_ holds one slot per forwarded signal");
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: let the signal cut poll() short
  for (size_t i = 0; i < std::size(kForwarded); ++i) sigaction(kForwarded[i], &sa, &old_[i]);
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGCHLD, &dfl, &old_chld_);
  g_usr1_count = 0;
  g_handled_usr1 = 0;
  struct sigaction usr1 {};
  usr1.sa_handler = on_usr1;
  sigemptyset(&usr1.sa_mask);
  sigaction(SIGUSR1, &usr1, &old_usr1_);
}

SignalScope::~SignalScope() {
  for (size_t i = 0; i < std::size(kForwarded); ++i) sigaction(kForwarded[i], &old_[i], nullptr);
  sigaction(SIGCHLD, &old_chld_, nullptr);
  sigaction(SIGUSR1, &old_usr1_, nullptr);
}

int take_signal() {
  const int count = g_signal_count;
  if (count <= g_handled_signals) return 0;
  g_handled_signals = count;
  return g_signal;
}

namespace {

// One run of a set of workers, from their start to the last one reaped:
// the state the poll loop's steps share (the workers, the first failure,
// the termination under way), so that each step (start, signals, stop,
// reap, escalation, output) is a function of its own.
class WorkerRun {
 public:
  WorkerRun(const std::string& path, const std::vector<std::string>& argv, std::vector<WorkerSpec> specs, bool prefix,
            std::chrono::milliseconds grace, const std::function<bool()>& stop, const ReplaceWorker& replace)
      : path_(path),
        self_(::getpid()),
        specs_(std::move(specs)),
        prefix_(prefix),
        grace_(grace),
        stop_(stop),
        replace_(replace) {
    const char* pause_env = std::getenv("EMBER_LAUNCH_TEST_FORK_PAUSE_MS");
    fork_pause_ms_ = pause_env ? std::strtol(pause_env, nullptr, 10) : 0;
    max_fd_ = static_cast<int>(std::min<long>(::sysconf(_SC_OPEN_MAX), 1 << 16));
    nproc_ = static_cast<int>(specs_.size());
    started_ns_ = system_now_ns();
    setup_flight_recorder();
    args_ = argv;
    c_args_ = c_strings(args_);
    c_envs_.resize(nproc_);
    for (int local = 0; local < nproc_; ++local) c_envs_[local] = c_strings(specs_[local].env);
    workers_.resize(nproc_);
  }
  WorkerRun(const WorkerRun&) = delete;
  WorkerRun& operator=(const WorkerRun&) = delete;

  WorkersResult run() {
    for (int local = 0; local < nproc_; ++local) start(local);
    while (running_ > 0) {
      forward_signals();
      forward_usr1();
      check_stop();
      check_dumps();
      reap();
      if (running_ == 0) break;
      escalate();
      pump_output();
    }
    return finish();
  }

 private:
  void kill_all(int sig) {
    for (auto& w : workers_) signal_worker(w, sig);
  }

  // A failure while starting: take down whoever is already up (the caller
  // then throws).
  void abort_start(std::initializer_list<int> fds) {
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
    kill_all(SIGKILL);
    for (auto& v : workers_)
      if (v.running) ::waitpid(v.pid, nullptr, 0);
    for (auto& v : workers_) {
      v.out.finish();
      v.err.finish();
    }
  }

  // Starts (or, for live recovery, starts again) the worker of `local`.
  void start(int local) {
    Worker& w = workers_[local];
    w.local_rank = specs_[local].local_rank;
    w.rank = specs_[local].rank;
    w.status = 0;
    int out[2] = {-1, -1}, err[2] = {-1, -1};
    if (prefix_) {
      try {
        make_pipe(out);
        make_pipe(err);
      } catch (...) {
        abort_start({out[0], out[1], err[0], err[1]});
        throw;
      }
    }
    // Blocked around fork: see exec_child. The parent's copy is unblocked at
    // once, and a signal that came meanwhile is handled (and forwarded) then.
    sigset_t forwarded, prev_mask;
    sigemptyset(&forwarded);
    for (int sig : kForwarded) sigaddset(&forwarded, sig);
    ::pthread_sigmask(SIG_BLOCK, &forwarded, &prev_mask);
    pid_t pid = ::fork();
    if (pid == 0)
      exec_child(path_.c_str(), c_args_.data(), c_envs_[local].data(), out[1], err[1], self_, max_fd_, fork_pause_ms_);
    int fork_errno = errno;
    ::pthread_sigmask(SIG_SETMASK, &prev_mask, nullptr);
    if (pid < 0) {
      abort_start({out[0], out[1], err[0], err[1]});
      EMBER_CHECK(false, "launch: fork of local rank ", local, " failed: ", std::strerror(fork_errno));
    }
    for (int fd : {out[1], err[1]})
      if (fd >= 0) ::close(fd);
    // Also from the parent: a signal sent to the group before the child got
    // to its own setpgid must still find the group.
    ::setpgid(pid, pid);
    w.pid = pid;
    w.running = true;
    ++running_;
    std::string line_prefix = "[rank " + std::to_string(w.rank) + "]: ";
    w.out = OutStream{out[0], STDOUT_FILENO, line_prefix, {}};
    w.err = OutStream{err[0], STDERR_FILENO, line_prefix, {}};
  }

  void start_termination(int sig) {
    terminating_ = true;
    kill_all(sig);
    // A stopped worker keeps the signal pending until it runs again.
    for (const Worker& w : workers_)
      if (w.running && is_stopped(w.pid)) signal_worker(w, SIGCONT);
    deadline_ = Clock::now() + grace_;
  }

  // Signals to the launcher: forward the first, SIGKILL on a second.
  void forward_signals() {
    int count = g_signal_count;
    if (count <= g_handled_signals) return;
    int sig = g_signal;
    g_handled_signals = count;
    res_.by_signal = true;
    if (!failed_) {
      failed_ = true;
      result_ = 128 + sig;
    }
    if (!terminating_) {
      say("received signal " + std::to_string(sig) + ", forwarding it to the workers");
      start_termination(sig);
    } else if (!killed_) {
      say("received another signal, killing the workers");
      killed_ = true;
      kill_all(SIGKILL);
    }
  }

  // The caller's stop request (an elastic agent's new rendezvous round):
  // every worker goes, none of them failed.
  void check_stop() {
    if (stop_ && !terminating_ && stop_()) {
      res_.stopped = true;
      failed_ = true;  // what follows is the stop, not a failure to report
      start_termination(SIGTERM);
    }
  }

  // Reap whoever has exited (only our own pids: the host process may have
  // other children that are none of our business).
  void reap() {
    for (int local = 0; local < nproc_; ++local) {
      Worker& w = workers_[local];
      if (!w.running) continue;
      int status = 0;
      pid_t r = ::waitpid(w.pid, &status, WNOHANG);
      if (r == 0 || (r < 0 && errno == EINTR)) continue;
      w.running = false;
      w.status = r == w.pid ? status : 0;
      --running_;
      bool ok = WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0;
      // Whatever a failed (or stopped) worker left running in its group goes
      // with it. Done right after the reap: the group id cannot have been
      // reused yet.
      if (!ok || terminating_) ::kill(-w.pid, SIGKILL);
      if (!ok && !failed_) on_failure(local);
    }
  }

  // The first failed worker: replaced in place (live recovery) when the
  // caller says so, else the job's failure, and the others are stopped.
  void on_failure(int local) {
    Worker& w = workers_[local];
    res_.failed_rank = w.rank;
    // Its last words first, then ours.
    if (w.out.fd >= 0) w.out.pump();
    if (w.err.fd >= 0) w.err.pump();
    const std::string failure = "rank " + std::to_string(w.rank) + " (local rank " + std::to_string(w.local_rank) +
                                ", pid " + std::to_string(w.pid) + ") " + describe_status(w.status);
    // Live recovery: the caller may start a replacement in its place
    // while the others go on.
    std::vector<std::string> again = replace_ ? replace_(specs_[local], failure, w.status) : std::vector<std::string>{};
    if (!again.empty()) {
      w.out.finish();
      w.err.finish();
      specs_[local].env = std::move(again);
      if (std::none_of(specs_[local].env.begin(), specs_[local].env.end(),
                       [](const std::string& e) { return e.rfind("EMBER_FR_DUMP_DIR=", 0) == 0; }))
        specs_[local].env.push_back("EMBER_FR_DUMP_DIR=" + fr_dir_);
      c_envs_[local] = c_strings(specs_[local].env);
      start(local);
      return;
    }
    failed_ = true;
    result_ = exit_code(w.status);
    res_.failure = failure;
    say(res_.failure + (running_ > 0 ? "; stopping the other workers" : ""));
    name_frozen_workers();
    if (running_ > 0) ask_for_dumps();
  }

  // The flight recorder's directory: the user's EMBER_FR_DUMP_DIR, else a
  // fresh one of this job's (default_fr_dir), given to every worker.
  void setup_flight_recorder() {
    const std::string key = "EMBER_FR_DUMP_DIR=";
    for (const std::string& e : specs_.empty() ? std::vector<std::string>{} : specs_[0].env) {
      if (e.rfind(key, 0) == 0) fr_dir_ = e.substr(key.size());
      if (e == "EMBER_FR_BUFFER=0") fr_off_ = true;
    }
    if (!fr_dir_.empty()) return;
    fr_dir_ = default_fr_dir();
    for (WorkerSpec& spec : specs_) spec.env.push_back(key + fr_dir_);
  }

  // A worker stopped by SIGSTOP (or a debugger) is the likely cause of a
  // failure that is another rank's timeout: say so, by name.
  void name_frozen_workers() {
    for (const Worker& w : workers_)
      if (w.running && is_stopped(w.pid)) {
        frozen_.push_back(w.rank);
        say("rank " + std::to_string(w.rank) + " (local rank " + std::to_string(w.local_rank) + ", pid " +
            std::to_string(w.pid) +
            ") is frozen: stopped by a signal (SIGSTOP) or a debugger; the ranks that timed out were waiting for it");
      }
  }

  // Before the teardown: every live, unfrozen worker dumps its flight
  // recorder (SIGUSR1), so fr_trace sees the survivors' side of a hang too.
  void ask_for_dumps() {
    if (fr_off_) {
      start_termination(SIGTERM);
      return;
    }
    dump_asked_ns_ = system_now_ns();
    for (const Worker& w : workers_)
      if (w.running && !is_stopped(w.pid) && catches_signal(w.pid, SIGUSR1)) {
        ::kill(w.pid, SIGUSR1);
        dumping_ = true;
      }
    if (!dumping_) {
      start_termination(SIGTERM);
      return;
    }
    dump_deadline_ = Clock::now() + kDumpWait;
  }

  // The dump wait ends when every worker still running has dumped since it
  // was asked, or at its deadline; then the teardown goes on.
  void check_dumps() {
    if (!dumping_) return;
    if (terminating_) {
      dumping_ = false;
      return;
    }
    bool all = true;
    for (const Worker& w : workers_)
      if (w.running && !is_stopped(w.pid) && catches_signal(w.pid, SIGUSR1) &&
          !dumped_since(fr_dir_, w.rank, dump_asked_ns_))
        all = false;
    if (!all && Clock::now() < dump_deadline_) return;
    dumping_ = false;
    if (running_ > 0) start_termination(SIGTERM);
  }

  // SIGUSR1 to the launcher: every worker dumps; nothing stops.
  void forward_usr1() {
    const int count = g_usr1_count;
    if (count <= g_handled_usr1) return;
    g_handled_usr1 = count;
    say("received SIGUSR1: the workers dump their flight recorders to " + fr_dir_);
    for (const Worker& w : workers_)
      if (w.running && catches_signal(w.pid, SIGUSR1)) ::kill(w.pid, SIGUSR1);
  }

  // Workers that outlived the grace period after the signal get SIGKILL.
  void escalate() {
    if (terminating_ && !killed_ && Clock::now() >= deadline_) {
      killed_ = true;
      say("workers still running " + std::to_string(grace_.count()) + " ms after the signal; sending SIGKILL");
      kill_all(SIGKILL);
    }
  }

  // Wait for output, or at most kPollMs; copy what came, prefixed.
  void pump_output() {
    std::vector<pollfd> fds;
    std::vector<OutStream*> streams;
    for (auto& w : workers_)
      for (OutStream* s : {&w.out, &w.err})
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          streams.push_back(s);
        }
    int n = ::poll(fds.data(), fds.size(), kPollMs);
    if (n <= 0) return;  // timeout, or EINTR from a signal: the loop handles both
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      if (!streams[i]->pump()) {
        ::close(streams[i]->fd);
        streams[i]->fd = -1;
      }
    }
  }

  WorkersResult finish() {
    // Everyone is reaped. Drain what is left in the pipes without waiting for
    // EOF: a grandchild holding a pipe open must not hang the launcher.
    for (auto& w : workers_) {
      w.out.finish();
      w.err.finish();
    }
    // A stop that came as the last workers were exiting 0 on their own: the
    // job is done, not interrupted.
    if (res_.stopped) {
      bool all_ok = true;
      for (const auto& w : workers_) all_ok = all_ok && WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0;
      if (all_ok) res_.stopped = false;
    }
    res_.status = result_;
    // A failed job (not one stopped on purpose): what the dumps say.
    if (result_ != 0 && !res_.by_signal && !res_.stopped) {
      std::vector<int> here;
      for (const WorkerSpec& spec : specs_) here.push_back(spec.rank);
      report_dumps(fr_dir_, started_ns_, here);
      if (!frozen_.empty()) {
        std::string ranks;
        for (int r : frozen_) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
        say("the job's likely cause: frozen rank(s) " + ranks + " (the first failure above timed out waiting)");
      }
    }
    return res_;
  }

  const std::string& path_;
  const pid_t self_;
  std::vector<WorkerSpec> specs_;
  const bool prefix_;
  const std::chrono::milliseconds grace_;
  const std::function<bool()>& stop_;
  const ReplaceWorker& replace_;
  long fork_pause_ms_ = 0;
  int max_fd_ = 0, nproc_ = 0;
  std::vector<std::string> args_;
  std::vector<char*> c_args_;
  std::vector<std::vector<char*>> c_envs_;
  std::vector<Worker> workers_;
  int running_ = 0;

  WorkersResult res_;
  int result_ = 0;
  bool failed_ = false;       // the first failure (or signal) decided `result_`
  bool terminating_ = false;  // SIGTERM (or the forwarded signal) has gone out
  bool killed_ = false;       // SIGKILL has gone out
  Clock::time_point deadline_{};
  // The flight recorder: where the workers dump, when this run started
  // (older dumps are another job's), the teardown's wait for the dumps.
  std::string fr_dir_;
  bool fr_off_ = false;
  int64_t started_ns_ = 0, dump_asked_ns_ = 0;
  bool dumping_ = false;
  Clock::time_point dump_deadline_{};
  std::vector<int> frozen_;
};

}  // namespace

WorkersResult run_workers(const std::string& path, const std::vector<std::string>& argv, std::vector<WorkerSpec> specs,
                          bool prefix, std::chrono::milliseconds grace, const std::function<bool()>& stop,
                          const ReplaceWorker& replace) {
  WorkerRun run(path, argv, std::move(specs), prefix, grace, stop, replace);
  return run.run();
}

}  // namespace launch_detail

using namespace launch_detail;

ReservedPort::ReservedPort() {
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  EMBER_CHECK(fd_ >= 0, "launch: cannot reserve a port for the store: socket failed: ", std::strerror(errno));
  // SO_REUSEADDR before the bind: the store's listener (which sets it too)
  // can then bind the same port while this socket holds it. A bind to port
  // 0 never shares a port, whatever the flag.
  int one = 1;
  ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  const bool ok = ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int err = errno;
  if (!ok) {
    ::close(fd_);
    fd_ = -1;
  }
  EMBER_CHECK(ok, "launch: cannot reserve a port for the store: bind failed: ", std::strerror(err));
  port_ = ntohs(addr.sin_port);
}

ReservedPort::~ReservedPort() {
  if (fd_ >= 0) ::close(fd_);
}

ReservedPort::ReservedPort(ReservedPort&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), port_(std::exchange(other.port_, 0)) {}

int launch(const LaunchOptions& opt, const std::vector<std::string>& argv) {
  EMBER_CHECK(opt.nproc_per_node >= 1, "launch: nproc_per_node must be >= 1, got ", opt.nproc_per_node);
  EMBER_CHECK(opt.nnodes >= 1, "launch: nnodes must be >= 1, got ", opt.nnodes);
  EMBER_CHECK(opt.node_rank >= 0 && opt.node_rank < opt.nnodes, "launch: node_rank ", opt.node_rank,
              " is outside [0, nnodes=", opt.nnodes, ")");
  EMBER_CHECK(opt.master_port >= 0 && opt.master_port <= 65535, "launch: master_port ", opt.master_port,
              " is outside [0, 65535]");
  EMBER_CHECK(opt.master_port != 0 || opt.nnodes == 1,
              "launch: master_port 0 (pick a free port) only works with nnodes=1: the other "
              "nodes could not know the port; got nnodes=",
              opt.nnodes);
  EMBER_CHECK(!opt.master_addr.empty(), "launch: master_addr is empty");
  EMBER_CHECK(opt.grace.count() >= 0, "launch: grace must be >= 0 ms, got ", opt.grace.count());
  EMBER_CHECK(!argv.empty(), "launch: no program given");
  EMBER_CHECK(opt.max_restarts >= 0, "launch: max_restarts must be >= 0, got ", opt.max_restarts);
  EMBER_CHECK(opt.max_restarts == 0 || opt.nnodes == 1, "launch: max_restarts ", opt.max_restarts,
              " restarts one node's workers only, and a job of ", opt.nnodes,
              " nodes would lose the others' (elastic agents that meet in rendezvous rounds: elastic_launch, "
              "//tools:launch --nnodes MIN:MAX --rdzv-endpoint HOST:PORT)");

  const int nproc = opt.nproc_per_node;
  const int world = nproc * opt.nnodes;
  const std::string path = resolve_program(argv[0]);

  bool set_omp = nproc > 1 && std::getenv("OMP_NUM_THREADS") == nullptr;
  if (set_omp) {
    // torchrun's notice, word for word, so people recognise it.
    say("\n*****************************************\n"
        "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to "
        "avoid your system being overloaded, please further tune the variable for optimal "
        "performance in your application as needed. \n"
        "*****************************************");
  }

  // The store's job token: the user's, else (one node, where this launcher
  // starts every rank) a fresh one. Launchers of a multi-node job cannot
  // agree on a random one, so there the user exports the same one on each.
  std::string token = std::getenv("EMBER_STORE_TOKEN") ? std::getenv("EMBER_STORE_TOKEN") : "";
  if (token.empty() && opt.nnodes == 1) {
    token = random_token();
  } else if (token.empty()) {
    say("launch: EMBER_STORE_TOKEN is not set, so the job's store serves any client that reaches MASTER_ADDR:" +
        std::to_string(opt.master_port) +
        "; export the same secret as EMBER_STORE_TOKEN on every node to keep others out");
  }

  // Our own stdio first, so nothing buffered earlier lands after worker lines.
  std::fflush(stdout);
  std::fflush(stderr);

  SignalScope signals;
  // One start of the workers; `by_signal`: a signal to the launcher ended it.
  auto attempt = [&](int restart, bool* by_signal) -> int {
    // Held until the workers are gone: rank 0's store binds it meanwhile.
    std::optional<ReservedPort> reserved;
    if (opt.master_port == 0) reserved.emplace();
    const int port = reserved ? reserved->port() : opt.master_port;
    std::vector<WorkerSpec> specs(nproc);
    for (int local = 0; local < nproc; ++local) {
      std::vector<std::pair<std::string, std::string>> set = {
          {"RANK", std::to_string(opt.node_rank * nproc + local)},
          {"WORLD_SIZE", std::to_string(world)},
          {"LOCAL_RANK", std::to_string(local)},
          {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
          {"GROUP_RANK", std::to_string(opt.node_rank)},
          {"GROUP_WORLD_SIZE", std::to_string(opt.nnodes)},
          {"MASTER_ADDR", opt.master_addr},
          {"MASTER_PORT", std::to_string(port)},
      };
      if (set_omp) set.emplace_back("OMP_NUM_THREADS", "1");
      if (!token.empty()) set.emplace_back("EMBER_STORE_TOKEN", token);
      // Which start this is (torchelastic's name too, for programs written for it).
      set.emplace_back("EMBER_RESTART_COUNT", std::to_string(restart));
      set.emplace_back("TORCHELASTIC_RESTART_COUNT", std::to_string(restart));
      specs[local] = {opt.node_rank * nproc + local, local, worker_env(set)};
    }
    const WorkersResult r = run_workers(path, argv, std::move(specs), opt.prefix_output, opt.grace, nullptr);
    *by_signal = r.by_signal;
    return r.status;
  };

  for (int restart = 0;; ++restart) {
    bool by_signal = false;
    const int result = attempt(restart, &by_signal);
    if (by_signal) {
      say("stopped by signal " + std::to_string(result - 128));
      return result;
    }
    if (result == 0) return 0;
    if (restart >= opt.max_restarts) {
      if (opt.max_restarts > 0)
        say("giving up after " + std::to_string(opt.max_restarts) + " restart" + (opt.max_restarts == 1 ? "" : "s") +
            ": the last failure is above");
      return result;
    }
    // Every worker is gone: start them all again (torchrun's
    // --max-restarts); they resume from their newest checkpoint.
    say("restarting the workers (restart " + std::to_string(restart + 1) + " of " + std::to_string(opt.max_restarts) +
        ")");
  }
}

int spawn_local_workers(int nproc, int argc, char** argv, bool prefix_output) {
  auto set = [](const char* name) { return std::getenv(name) != nullptr; };
  bool torchrun = set("RANK") && set("WORLD_SIZE");
  bool srun = set("SLURM_PROCID") && set("SLURM_NTASKS") && set("SLURM_STEP_ID");
  if (torchrun || srun) return -1;
  EMBER_CHECK(nproc >= 1, "spawn_local_workers: nproc must be >= 1, got ", nproc);

  // The real path rather than "/proc/self/exe" as argv[0]: programs find
  // their runfiles (and name themselves in messages) from argv[0].
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  EMBER_CHECK(n > 0, "spawn_local_workers: cannot read /proc/self/exe: ", std::strerror(errno));
  std::vector<std::string> args{std::string(buf, static_cast<size_t>(n))};
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);

  LaunchOptions opt;
  opt.nproc_per_node = nproc;
  opt.master_port = 0;
  opt.prefix_output = prefix_output;
  return launch(opt, args);
}

}  // namespace ember::distributed
