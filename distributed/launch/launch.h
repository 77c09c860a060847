// The process launcher (ember's torchrun): starts one worker process per
// local rank with the rendezvous environment set, prefixes their output by
// rank, and tears the whole job down when one worker fails, so a crashed rank
// never leaves the others hanging in a collective.
//
// Two ways in:
//   * the launcher binary:  bazel run //tools:launch -- --nproc_per_node=4 -- prog args...
//   * a program that launches itself, without a separate launcher:
//
//       int main(int argc, char** argv) {
//         if (int rc = ember::distributed::spawn_local_workers(4, argc, argv); rc >= 0)
//           return rc;                                  // we were the launcher; all workers are done
//         ember::distributed::init_process_group();     // we are a worker: RANK etc. are set
//         ...train...
//       }
//
// Running that program under //tools:launch or srun works unchanged: the
// environment already names a rank, so spawn_local_workers returns -1 at once.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace ember::distributed {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;  // this node's index in [0, nnodes)
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // 0: pick a free port (single-node jobs only)
  // Pipe each worker's stdout/stderr through the launcher and start every
  // line with "[rank N]: ". Off: workers write straight to the launcher's
  // stdout/stderr (keeps terminals' isatty, colours, progress bars).
  bool prefix_output = true;
  // After a failure (or a signal to the launcher) the other workers get
  // SIGTERM; whoever is still alive `grace` later gets SIGKILL.
  std::chrono::milliseconds grace = std::chrono::seconds(5);
  // torchrun's --max-restarts: after a worker fails (and the others are
  // stopped) every worker starts again, up to this many times, with
  // EMBER_RESTART_COUNT (and TORCHELASTIC_RESTART_COUNT) set to the
  // restart's number, 0 at first; a program resumes from its newest
  // checkpoint. A failure that happens every time ends the job after the
  // last restart with that failure's status. A signal to the launcher
  // never restarts. One node only: several nodes restart together through
  // the elastic agents' rendezvous (elastic.h).
  int max_restarts = 0;
};

// Runs argv (argv[0]: the program, searched in PATH when it has no '/')
// nproc_per_node times with RANK = node_rank * nproc_per_node + local rank,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (= node_rank),
// GROUP_WORLD_SIZE (= nnodes), MASTER_ADDR and MASTER_PORT set, and
// OMP_NUM_THREADS=1 when it is unset and there is more than one worker (as
// torchrun does, with the same notice), and EMBER_STORE_TOKEN: the user's if
// exported, else (one node) a fresh random secret, so only this job's ranks
// can use the store rank 0 hosts. Each worker leads its own process
// group, so signals reach everything it started.
//
// Returns 0 when every worker exits 0. Otherwise the first failure decides:
// the worker's exit code, or 128 + signal when it was killed by a signal; the
// launcher prints which rank failed and how, SIGTERMs the rest, SIGKILLs them
// after `grace` and reaps them all before returning. SIGINT, SIGTERM, SIGHUP
// and SIGQUIT sent to the launcher are forwarded to the workers (a second one
// SIGKILLs them) and launch() then returns 128 + that signal.
//
// Throws ember::Error for invalid options or a program that cannot be found.
// One launch() at a time per process: it owns those signals' handlers (and
// SIGCHLD's disposition) while it runs and restores them afterwards.
int launch(const LaunchOptions& options, const std::vector<std::string>& argv);

// For programs that launch themselves (see the example above). When neither
// RANK and WORLD_SIZE (torchrun, //tools:launch) nor SLURM_PROCID and
// SLURM_NTASKS inside an srun step are set, re-runs this executable
// (/proc/self/exe, argv[1..] unchanged) as `nproc` local workers on a free
// port and returns launch()'s status for main to return. Returns -1 when the
// environment already names a rank: go on as a worker. prefix_output=false
// lets the workers write straight to this process's stdout/stderr (a
// progress bar redrawn with '\r' on a terminal needs that).
int spawn_local_workers(int nproc, int argc, char** argv, bool prefix_output = true);

// A free TCP port on this host, held until the store that will listen on
// it is up: bound (not listening) with SO_REUSEADDR for as long as this
// object lives. A port merely found free and closed again (bind to 0, read
// it back, close) is up for grabs until rank 0 binds it: any connect() on
// the host may draw it as its ephemeral source port, and the store's bind
// then fails with EADDRINUSE. Held bound, Linux never hands it to a
// connect() (ports bound explicitly are skipped by the ephemeral search)
// nor to another bind to port 0, while the store's SO_REUSEADDR listener
// may still bind it (neither socket of the pair listens before it does).
class ReservedPort {
 public:
  ReservedPort();  // throws when no socket can be bound
  ~ReservedPort();
  ReservedPort(ReservedPort&& other) noexcept;
  ReservedPort& operator=(ReservedPort&&) = delete;
  ReservedPort(const ReservedPort&) = delete;
  ReservedPort& operator=(const ReservedPort&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1, port_ = 0;
};

}  // namespace ember::distributed
