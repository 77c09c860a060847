// The launcher's pieces that the elastic agent (elastic.cc) drives too: one
// start of a node's workers (fork/exec, rank-prefixed output, failure and
// signal handling) and the helpers around it. Not a public API: launch.h and
// elastic.h are.
#pragma once

#include <signal.h>

#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace ember::distributed::launch_detail {

// Installs the launcher's handlers for SIGINT, SIGTERM, SIGHUP and SIGQUIT
// (recorded, then forwarded to the workers by run_workers), SIGUSR1
// (forwarded, so the workers dump their flight recorders; the job goes on)
// and a default SIGCHLD for its lifetime. One at a time per process.
class SignalScope {
 public:
  SignalScope();
  ~SignalScope();
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

 private:
  struct sigaction old_[4];
  struct sigaction old_chld_;
  struct sigaction old_usr1_;
};

// A signal that arrived and that no worker loop has acted on yet (the
// newest), marked as acted on; 0 if none. For an agent between starts.
int take_signal();

// One worker: its ranks and its whole environment ("KEY=value").
struct WorkerSpec {
  int rank = 0, local_rank = 0;
  std::vector<std::string> env;
};

struct WorkersResult {
  int status = 0;          // 0, the first failure's exit code (128 + signal if killed), or 128 + a signal to us
  bool by_signal = false;  // a signal to the launcher ended the workers
  bool stopped = false;    // `stop` asked for it (no worker had failed)
  int failed_rank = -1;    // the first failing worker's rank
  std::string failure;     // "rank R (local rank L, pid P) exited with code C"
};

// Starts one worker per spec (path: an executable; argv[0] as given) and
// runs until all have exited: output prefixed by rank when `prefix`, the
// first failure or a signal stops the rest (SIGTERM, SIGKILL `grace` later).
// `stop`, when set, is called about every 20 ms; true stops every worker the
// same way. `replace`, when set, is asked first about each failing worker
// (its spec, "rank R (local rank L, pid P) exited with code C", its wait
// status): a non-empty environment starts a replacement with it in the same
// place and the others go on (live recovery); empty: the failure stops the
// rest. Needs a SignalScope alive.
using ReplaceWorker =
    std::function<std::vector<std::string>(const WorkerSpec& failed, const std::string& failure, int wait_status)>;
WorkersResult run_workers(const std::string& path, const std::vector<std::string>& argv, std::vector<WorkerSpec> specs,
                          bool prefix, std::chrono::milliseconds grace, const std::function<bool()>& stop,
                          const ReplaceWorker& replace = nullptr);

void say(const std::string& msg);  // "launch: msg" on stderr
std::string resolve_program(const std::string& prog);
std::string random_token();
// The launcher's environment with `set` put over it.
std::vector<std::string> worker_env(const std::vector<std::pair<std::string, std::string>>& set);

// ---- Diagnosing a failed job (launch_diagnosis.cc) ----
// Whether process `pid` is stopped (SIGSTOP, SIGTSTP or a debugger).
bool is_stopped(int pid);
// Whether process `pid` has a handler for `sig` (/proc/<pid>/status's
// SigCgt): SIGUSR1 goes only to workers whose flight recorder catches it,
// since its default action would kill any other program.
bool catches_signal(int pid, int sig);
int64_t system_now_ns();
// Where a job's workers dump their flight recorders when EMBER_FR_DUMP_DIR
// is not set: ember_fr/<date>-<time>-<launcher pid> in the working directory.
std::string default_fr_dir();
// Whether rank `rank`'s dump in `dir` was written at or after `since_ns`.
bool dumped_since(const std::string& dir, int rank, int64_t since_ns);
// fr_trace's verdict on the dumps in `dir` written since `since_ns`, said
// line by line; nothing when there are none. `here`: this launcher's ranks
// (with several nodes, the others' dumps are on their nodes).
void report_dumps(const std::string& dir, int64_t since_ns, const std::vector<int>& here);

}  // namespace ember::distributed::launch_detail
