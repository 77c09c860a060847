// What the distributed training examples (resnet_ddp, gpt_fsdp) share, so
// each example is its config, its setup and its loop, and the parts around
// them are written once:
//
//   examples::Job job = examples::start_job(flags.timeout_sec);   // the process group, rank, device
//   ...setup, resume (examples::restore_scaler), the loop...
//   examples::save_step_checkpoint(dir, model, opt, sched, state, extra, scaler, *job.pg);
//   return examples::finish_job(job);                             // every rank done, "done in N s"
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/device.h"
#include "distributed/checkpoint/live_recovery.h"
#include "distributed/checkpoint/sharded.h"
#include "distributed/init.h"
#include "distributed/logging/logging.h"
#include "optim/grad_scaler.h"

namespace ember::examples {

using Clock = std::chrono::steady_clock;
inline double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// The median of v (the upper one of an even count; 0 when empty).
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// --cuda-graph 1's bookkeeping: for each replayed step, the host's time to
// queue it (the inputs' copies and the replay's launch) and the whole
// step's; line() reports their medians, the line bench/gpu_perf.sh reads
// (host_ms=, step_ms=).
struct GraphTimes {
  int64_t captured_step = 0;  // as the log numbers steps; 0: not captured
  std::vector<double> host_s, step_s;
  std::string line() const {
    std::ostringstream o;
    if (captured_step == 0) return "cuda graph: not captured (the run ended before the capture)";
    o << "cuda graph: captured at step " << captured_step;
    if (host_s.empty()) return o.str() + ", no step replayed after it";
    const double host = median(host_s), step = median(step_s);
    o << ", " << host_s.size() << " steps replayed; host " << host * 1e3 << " ms of a " << step * 1e3 << " ms step ("
      << 100.0 * host / step << " %, medians) host_ms=" << host * 1e3 << " step_ms=" << step * 1e3;
    return o.str();
  }
};

// A worker's place in the job: the default process group (NCCL on GPUs,
// else Gloo), its rank, world and device, and what the launcher said.
struct Job {
  std::shared_ptr<distributed::ProcessGroup> pg;
  int rank = 0, world = 1;
  Device device;
  bool cuda = false;
  distributed::ResolvedEnv env;
  Clock::time_point started;
};

// `timeout_sec` > 0: the rendezvous and collective timeout (--timeout);
// else EMBER_DIST_TIMEOUT_SEC, else 10 minutes.
inline Job start_job(double timeout_sec) {
  Job job;
  job.started = Clock::now();
  job.cuda = cuda_is_available();
  distributed::InitOptions init;
  init.backend = job.cuda ? "nccl" : "gloo";
  if (timeout_sec > 0) init.timeout = distributed::Millis{static_cast<int64_t>(timeout_sec * 1000)};
  job.pg = distributed::init_process_group(init);
  job.rank = job.pg->rank();
  job.world = job.pg->size();
  job.device = job.pg->device();  // the group decides: this rank's GPU under NCCL, else the CPU
  job.env = distributed::init_env();
  return job;
}

// The GradScaler's state saved in a checkpoint's "extra" JSON (a no-op when
// the scaler is off or the checkpoint has none); a wrong type names the file
// and the field.
inline void restore_scaler(optim::GradScaler& scaler, const nlohmann::json& extra, const std::string& dir) {
  auto it = extra.find("grad_scaler");
  if (it == extra.end() || !scaler.is_enabled()) return;
  EMBER_CHECK(it->is_object(), "--resume: ", dir, "/trainer.json: \"extra\".\"grad_scaler\" is ", it->dump(),
              ", expected an object");
  std::map<std::string, double> sd;
  for (const auto& [k, v] : it->items()) {
    EMBER_CHECK(v.is_number(), "--resume: ", dir, "/trainer.json: \"extra\".\"grad_scaler\".\"", k, "\" is ", v.dump(),
                ", expected a number");
    sd[k] = v.get<double>();
  }
  try {
    scaler.load_state_dict(sd);
  } catch (const Error& e) {
    EMBER_CHECK(false, "--resume: ", dir, "/trainer.json: \"extra\".\"grad_scaler\": ", e.what());
  }
}

// A sharded checkpoint of the training state (every rank writes its part),
// `extra` recorded in trainer.json with the scaler's state when it is on;
// an error names the directory.
inline void save_step_checkpoint(const std::string& dir, nn::Module& model, optim::Optimizer& opt,
                                 const optim::LRScheduler& sched, distributed::TrainingState st, nlohmann::json extra,
                                 const optim::GradScaler& scaler, distributed::ProcessGroup& pg,
                                 const std::string& mesh = "") {
  if (scaler.is_enabled()) extra["grad_scaler"] = scaler.state_dict();
  st.extra_json = extra.dump();
  distributed::ShardedSaveOptions options;
  options.mesh = mesh;
  const absl::Status s = distributed::save_sharded_checkpoint(dir, model, &opt, &sched, st, pg, options);
  EMBER_CHECK(s.ok(), "saving checkpoint ", dir, ": ", s.message());
}

// Whether the launcher started this worker again (--max-restarts, an
// elastic agent's rendezvous round after the first, or a live recovery's
// replacement): it resumes by itself.
inline bool restarted() {
  const char* r = std::getenv("EMBER_RESTART_COUNT");
  const char* live = std::getenv("EMBER_LIVE_RECOVERY_REPLACEMENT");
  return (r && std::atoi(r) > 0) || (live && std::string(live) == "1");
}

// A fresh run (not --resume, not --overwrite, not a launcher's restart)
// must not write over another run's checkpoints (HF Trainer's
// overwrite_output_dir rule): when `dir` already holds "<prefix><N>"
// checkpoints (or damaged ones), it stops with an error naming the newest,
// before anything is written. `allowed`: the caller's exceptions (the
// examples' default directory is scratch a fresh run replaces).
inline void refuse_overwrite(const std::string& dir, const std::string& prefix, bool allowed) {
  if (allowed || restarted()) return;
  auto latest = distributed::latest_checkpoint(dir, prefix);
  const bool holds = !latest.ok() || latest->has_value();
  EMBER_CHECK(!holds, "--checkpoint-dir ", dir, " already holds checkpoints of a run (",
              latest.ok() ? "newest: " + **latest : std::string(latest.status().message()),
              "); pass --resume to continue that run, --overwrite to replace it, or another directory");
}

// A run that survives the loss of a rank in place (launch --live-recovery,
// distributed/init.h): `build(job, kept)` makes the run's state on the job's
// groups: from the disk or the flags when `kept` is null and this process
// is no replacement, else afresh for `recover` (the state then comes from
// `kept`, or from a replica for the replacement); `loop(job, state)` trains.
// When the loop fails because a peer was lost, `capture(state)` keeps this
// rank's state in memory, the groups are aborted, and once the replacement
// has joined everything is built again on the new groups. Any other error
// is the job's.
template <typename State>
int train_recovering(double timeout_sec, const std::function<State(const Job&, bool from_disk)>& build,
                     const std::function<void(const Job&, State&, const distributed::LiveState*)>& recover,
                     const std::function<int(const Job&, State&)>& loop,
                     const std::function<distributed::LiveState(State&)>& capture) {
  distributed::LiveState kept;
  for (;;) {
    const Job job = start_job(timeout_sec);
    const bool live = distributed::is_live_replacement() || !kept.empty();
    State state = build(job, /*from_disk=*/!live);
    if (live) recover(job, state, kept.empty() ? nullptr : &kept);
    kept = {};
    try {
      return loop(job, state);
    } catch (const Error& e) {
      if (!distributed::peer_lost(std::chrono::seconds(2))) throw;
      kept = capture(state);
      LOG_ALL("live recovery: ", e.what(), "; keeping step ", kept.step, "'s state, waiting for a replacement");
      distributed::abort_for_recovery(distributed::init_env().timeout);
    }
  }
}

// The end of every run: nobody leaves (and tears the group down) before
// every rank is done. Returns the exit status.
inline int finish_job(const Job& job) {
  job.pg->barrier()->wait();
  LOG0("done in ", static_cast<int64_t>(seconds(job.started, Clock::now())), " s");
  return 0;
}

}  // namespace ember::examples
