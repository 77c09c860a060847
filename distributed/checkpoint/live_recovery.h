// Live recovery's state transfer (torchft's): the training state a
// replacement worker needs comes from a live replica over the network
// instead of from the newest checkpoint on disk. The process side (groups
// aborted and rebuilt, the replacement started in place by the elastic
// agent) is init.h's "Live recovery"; this is what moves over the rebuilt
// groups.
//
//   // a survivor, when a collective failed:
//   auto kept = distributed::capture_live_state(model, opt, &sched, &scaler, step);
//   distributed::abort_for_recovery(wait);   // then rebuild: init, mesh, model, optimizer
//   ...
//   // every rank of the new generation (the replacement with kept = nullptr):
//   auto r = distributed::recover_live_state(kept_or_null, model, opt, &sched, &scaler, *pg,
//                                            distributed::replicas_along(*mesh, "dp_replicate"));
//   step = r.step;
//
// What moves: every parameter and buffer as this rank holds it (its shard:
// local_shard), the optimizer's state (state_dict's tensors), the
// scheduler's counters, the loss scaler and the random generator — what a
// sharded checkpoint holds, for one rank. Replicas hold the same shards, so
// a rank's state can come from any rank that holds the same coordinates on
// every mesh dimension but the replicated one.
//
// Who sends: every rank says whether it kept its state and at which step.
// The survivors may differ by one step (a failure can end the step's last
// collective on some ranks and not on others); the newest step M wins: a
// rank that lacks state, or kept an older step, receives it from a replica
// that kept step M (the lowest such rank). When one has no such replica
// (no replicated dimension, or every replica lost), every rank throws the
// same error naming it, and the launcher's next round resumes from disk.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "distributed/comm/process_group.h"
#include "distributed/device_mesh.h"
#include "nn/module.h"
#include "optim/grad_scaler.h"
#include "optim/lr_scheduler.h"
#include "optim/optimizer.h"

namespace ember::distributed {

// One rank's training state, held in memory (the tensors are the live
// ones, not copies: capture costs nothing, and a survivor's old model and
// optimizer may go once it is captured).
struct LiveState {
  int64_t step = -1;  // optimizer steps done; -1: nothing kept
  // "model.<name>" (parameters and buffers, this rank's shard) and
  // "optim.<state dict key>" ("optim.state.3.exp_avg").
  std::vector<std::pair<std::string, Tensor>> tensors;
  // The scheduler's counters, the scaler's state and the generator's seed
  // and offset, as JSON.
  std::string meta = "{}";
  // The program's own fields (a JSON object, as a checkpoint's extra_json):
  // a data order's seed, say; the replacement gets its replica's.
  std::string extra = "{}";
  bool empty() const { return step < 0; }
};

// Buffers a forward changes (batch norm's running statistics): a fault in
// the middle of a step has already changed them with its forward, and the
// step is redone, so what a rank keeps for a step it did not finish must be
// the buffers as they were when it began. A forward pre-hook registered
// after DDP's takes them each step (after DDP has broadcast rank 0's, so
// every rank holds the same), before the step's first forward:
//
//   StepStartBuffers start;
//   model->register_forward_pre_hook([&](nn::Module& m, const Tensor&) { start.take(m, step); return Tensor(); });
//   ... capture_live_state(*model, opt, &sched, &scaler, step, extra, &start);
class StepStartBuffers {
 public:
  // Copies the module's buffers, once per `step` (the steps done).
  void take(nn::Module& model, int64_t step);
  int64_t step() const { return step_; }
  const std::vector<std::pair<std::string, Tensor>>& buffers() const { return buffers_; }

 private:
  int64_t step_ = -1;
  std::vector<std::pair<std::string, Tensor>> buffers_;
};

// `start`: the buffers of step `step`'s start, used when taken for it (the
// fault came before the step's optimizer step); else the buffers as they are.
LiveState capture_live_state(nn::Module& model, const optim::Optimizer& opt, const optim::LRScheduler* sched,
                             const optim::GradScaler* scaler, int64_t step, std::string extra = "{}",
                             const StepStartBuffers* start = nullptr);

struct LiveRecovery {
  int64_t step = 0;          // the step every rank continues from
  std::string extra = "{}";  // LiveState::extra of the state applied
  int source = -1;           // the rank this one received from; -1: it kept its own
  std::vector<int> sent_to;  // the ranks this one sent its state to
  int64_t bytes_received = 0, bytes_sent = 0;
  double seconds = 0;  // the collective, from its start to the state applied
};

// For each rank of `pg`, the ranks holding the same state (itself included).
using ReplicaMap = std::function<std::vector<int>(int rank)>;
// Ranks that share every coordinate of `mesh` but `dim`'s (the default
// group's ranks; the mesh must span it). Every rank its own only, when the
// mesh has no dimension `dim` or it is of size 1.
ReplicaMap replicas_along(const DeviceMesh& mesh, const std::string& dim);

// Collective over `pg`, the new generation's default group: every rank
// calls it after building its model, optimizer, scheduler and scaler
// afresh exactly as before the failure (same mesh, same parallelisms), the
// survivors with what they kept, the replacement with nullptr. Afterwards
// every rank's state is step M's (see the top). Errors name the rank and
// tensor (a kept tensor that no longer matches its model's shape).
LiveRecovery recover_live_state(const LiveState* kept, nn::Module& model, optim::Optimizer& opt,
                                optim::LRScheduler* sched, optim::GradScaler* scaler, ProcessGroup& pg,
                                const ReplicaMap& replicas);

}  // namespace ember::distributed
