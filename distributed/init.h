// init_process_group: where a job learns its rank, world and rendezvous.
//
// Resolution order for each field: the explicit option, then torchrun's
// environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT), then SLURM's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
// first host of SLURM_JOB_NODELIST for the address) when launched by srun.
// Invalid settings throw naming the variable and its value.
//
// The timeout (rendezvous, and every collective afterwards) is the option
// when set, else EMBER_DIST_TIMEOUT_SEC (seconds, as torch's `timeout=`
// takes a timedelta), else 10 minutes. It is for ranks that are alive but
// stuck; a rank that has died is detected separately. The rendezvous
// (reaching rank 0's store, and rank 0 hearing from every rank) gives up
// sooner: InitOptions::rendezvous_timeout, else EMBER_RDZV_TIMEOUT_SEC, else
// the smaller of the timeout and 2 minutes, printing a line every 10 s while
// it waits.
//
// The store rank 0 hosts listens only on MASTER_ADDR's addresses (every
// interface with EMBER_STORE_LISTEN_ALL=1) and, when EMBER_STORE_TOKEN is set
// (the launcher generates one per job), serves only clients presenting the
// same token. Each rank's store connection carries its rank, so a rank whose
// process dies is reported by name to the others within milliseconds.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "distributed/comm/process_group.h"
#include "distributed/store/store.h"

namespace ember::distributed {

struct InitOptions {
  std::string backend = "gloo";  // "gloo" (CPU tensors) or "nccl" (CUDA tensors)
  int rank = -1;                 // -1: from the environment
  int world_size = -1;
  int local_rank = -1;
  std::string master_addr;       // empty: from the environment
  int master_port = -1;
  Millis timeout{0};             // 0: EMBER_DIST_TIMEOUT_SEC, else kDefaultTimeout (10 min)
  Millis rendezvous_timeout{0};  // 0: EMBER_RDZV_TIMEOUT_SEC, else min(timeout, 2 min)
  std::shared_ptr<Store> store;  // given: used instead of a TCPStore on master_addr:master_port
};

// What the environment and options resolve to (exposed for tests and logs).
struct ResolvedEnv {
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1;
  std::string master_addr;
  int master_port = 0;
  std::string source;  // "explicit", "torchrun env" or "slurm"
  // Where master_addr / master_port came from ("MASTER_ADDR",
  // "InitOptions::master_port", ...), so a store that cannot be reached is
  // reported by the setting the user has to fix.
  std::string master_addr_from, master_port_from;
  std::string world_size_from;  // "WORLD_SIZE", "SLURM_NTASKS", "InitOptions::world_size", ...
  Millis timeout = kDefaultTimeout;
  std::string timeout_from;  // "InitOptions::timeout", "EMBER_DIST_TIMEOUT_SEC" or "the default"
  Millis rendezvous_timeout{120000};
  std::string rendezvous_timeout_from;
  std::string store_token;         // EMBER_STORE_TOKEN, empty when unset
  bool store_listen_all = false;   // EMBER_STORE_LISTEN_ALL=1
  // TORCHELASTIC_USE_AGENT_STORE=True (torchrun's): the launcher's agent
  // hosts the store at MASTER_ADDR:MASTER_PORT and rank 0 is a client, so
  // the store outlives any worker (launch --live-recovery).
  bool agent_store = false;
};
ResolvedEnv resolve_env(const InitOptions& options);

// Creates the default group (every rank) and returns it.
std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options = {});
bool is_initialized();
std::shared_ptr<ProcessGroup> default_group();  // throws if not initialized
int get_rank();
int get_world_size();
// What init_process_group resolved the job's placement to (local rank,
// ranks per node, where the store is), so callers need not resolve the
// environment a second time.
ResolvedEnv init_env();
// A sub-group of the default group's ranks; every rank of the default group
// must call it (with the same list) as torch does; ranks outside get nullptr.
// `backend` ("gloo", "nccl"; empty: the default group's) as torch's
// new_group(backend=): a Gloo group beside an NCCL job serves host-side work
// such as AsyncCheckpointer's background commit.
std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks, const std::string& backend = "");
void destroy_process_group();
// The name a group made now gets (ProcessGroup::set_name): `base`, or
// base@gen<g> once live recovery has made generation g's groups, so the
// flight recorder never mixes a group's sequence ids with those of the
// group it replaced.
std::string group_name(const std::string& base);

// ---- Live recovery (torchft's), under `launch --live-recovery` ----
//
// A worker that dies is replaced in place by its agent (same rank; the
// others keep running) instead of every worker restarting in a new
// rendezvous round. The survivors' collectives fail (the dead peer's
// sockets close, or the liveness check names it); each survivor keeps its
// training state in memory, calls abort_for_recovery() and then
// init_process_group() again; the replacement's init_process_group joins
// the same new generation of groups; the state then comes to the
// replacement from a live replica (distributed/checkpoint/live_recovery.h).
// Generations: the store's "live_recovery/generation" counter, advanced by
// each replacement once connected; generation g's groups use keys under
// "generation_<g>/". The store is the agent's (agent_store), so it outlives
// any worker.
//
// EMBER_LIVE_RECOVERY=1: the launcher recovers in place.
bool live_recovery_enabled();
// This process replaced a failed worker and has its state still to receive.
bool is_live_replacement();
// The generation of the groups in use (0: the first).
int64_t recovery_generation();
// Whether a failure is one live recovery handles: a rank of the job is lost
// (its process died without its goodbye) or a replacement has already
// opened the next generation. Asked of the store for up to `grace` (the
// store hears of a death a moment after the peers' sockets do). False
// when live recovery is off.
bool peer_lost(Millis grace);
// The commit point of optimizer step `step` (torchft's should_commit),
// called by every rank after the step's collectives and before it changes
// any state: returns once every rank of the job got here, through the
// store, which fails at once when a rank is lost. So a fault leaves every
// survivor at the same step: all before the optimizer step, or all after
// it; without it a collective can complete on some ranks and not on
// others, and a rank's only replica may be a step behind. One store round
// trip (two for the last rank) per step; a no-op without live recovery.
void commit_point(int64_t step);
// A survivor's step after a failed collective: aborts every group this
// process made (ProcessGroup::abort: peers blocked on this rank fail at
// once and come here too), forgets them as destroy_process_group does, and
// waits up to `wait` for the replacement to open the next generation, which
// it returns; the next init_process_group joins it. Throws when none comes
// in time (a whole node lost: the agents start a new round instead).
int64_t abort_for_recovery(Millis wait);

}  // namespace ember::distributed
