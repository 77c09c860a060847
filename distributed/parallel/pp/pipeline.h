// The pipeline runtime: executes any schedule (schedule.h) on this rank's
// stages, moving activations forward and gradients backward over the `pp`
// process group with point-to-point sends and receives.
//
//   auto sched = pp::make_schedule("1f1b", pp_size, 1, /*microbatches=*/8);
//   pp::Pipeline pipe(sched, my_stages, mesh->group("pp"), {.loss = cross_entropy_fn});
//   opt.zero_grad();
//   std::vector<Tensor> losses = pipe.step(token_microbatches, target_microbatches);  // last stage: M losses
//   pipe.clip_grad_norm_(1.0);
//   opt.step();
//
// What it guarantees:
// - Gradients: micro-batch m's loss is backpropagated as loss_m / M (then
//   through `scale_loss`, a GradScaler's scale), so M equal micro-batches
//   give the gradient of the whole batch's mean loss — the same as one
//   process accumulating them.
// - Agreement at the first step: the pp ranks check they run the same
//   schedule (name, pp size, virtual stages, micro-batches, every rank's
//   action list), and each stage boundary agrees once on the activation's
//   shape and dtype (the sender's header, under the group's timeout);
//   a later micro-batch of another shape is an error naming both stages.
// - Errors name the rank, the stage and the action; a peer that dies
//   fails the receive that waits for it (the group's timeout at most).
// - Sends are asynchronous (posted, waited at the end of the step); the
//   receives a compute action needs next are posted before the current one
//   runs, so transfers overlap compute.
// - Over NCCL (no tags, a pair's transfers matched in order) each pair of
//   ranks gets its own communicator and stream (ProcessGroup::connect_p2p)
//   and receives are posted in the sender's order (ordered_transfers).
// - Tied parameters (a GPT's embedding on the first and last stage) get the
//   sum of both stages' gradients at the end of the step; with replicas
//   (PipelineOptions::dp_group) every gradient is then averaged over them.
// - FSDP inside stages: a stage wrapped by fully_shard (its blocks first,
//   then the stage as the root) is gathered once per step and its
//   gradients accumulate whole through the micro-batches, reduce-scattered
//   once at the end of the step (FSDPModule::begin_micro_batches; the
//   tied gradients are summed before, on the whole tensors). HSDP's
//   replicas average inside FSDP's reduction.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "autograd/autograd.h"
#include "distributed/comm/process_group.h"
#include "distributed/parallel/fsdp/fsdp.h"
#include "distributed/parallel/pp/schedule/schedule.h"
#include "distributed/parallel/pp/stage.h"

namespace ember::distributed::pp {

struct PipelineOptions {
  // The last stage's loss of one micro-batch: (stage output, target) -> a
  // scalar, the micro-batch's mean.
  std::function<Tensor(const Tensor& output, const Tensor& target)> loss = nullptr;
  // Applied to loss / M before backward (GradScaler::scale); null: none.
  // Ranks without the last stage call it once a step on a zero, so a
  // GradScaler there is set up to unscale the scaled gradients it receives.
  std::function<Tensor(const Tensor& loss)> scale_loss = nullptr;
  // Replicas of this pipeline (data parallelism across pipelines, each on
  // its own batches): at the end of every step the gradients are averaged
  // over this group, one all-reduce per dtype (DDP's result, without its
  // overlap with backward). Null or one rank: none.
  std::shared_ptr<ProcessGroup> dp_group = nullptr;
  // Match each (sender, receiver) pair's transfers in the order they are
  // sent, not by tag: what an NCCL group does (it has no tags), so it is
  // forced there (ProcessGroup::p2p_in_order). The receiver posts its
  // receives in the sender's order, which the schedule says; on Gloo this
  // mode tests that ordering.
  bool ordered_transfers = false;
};

// One compute action's time in the last step, in seconds from the start of
// this rank's step (CLOCK_MONOTONIC: one clock for the processes of a host).
struct ActionTime {
  Action action;
  double start = 0, end = 0;
};

class Pipeline {
 public:
  // `stages`: this rank's, in schedule.stages_of(pp->rank()) order. Not
  // collective; the first step() is.
  Pipeline(Schedule schedule, std::vector<std::shared_ptr<PipelineStage>> stages, std::shared_ptr<ProcessGroup> pp,
           PipelineOptions options);
  ~Pipeline();

  // One step's forwards and backwards (forwards only, without recording,
  // under a forward_schedule: evaluation). `inputs`: the M micro-batches' inputs
  // (read on the rank of stage 0; may be empty elsewhere); `targets`: their
  // targets (read on the last stage's rank). Gradients accumulate into the
  // parameters' .grad(). Returns the M losses (detached, unscaled) on the
  // last stage's rank, nothing elsewhere. Collective over the pp group.
  std::vector<Tensor> step(const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets);

  // This rank's parameters (each once).
  std::vector<Tensor> parameters() const;
  // Clips the gradients of the whole pipeline to a global norm (over the
  // pp ranks, each tensor's own mesh, a tied parameter counted once);
  // returns the norm. Collective over the pp group.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);

  const Schedule& schedule() const { return schedule_; }
  const std::vector<std::shared_ptr<PipelineStage>>& stages() const { return stages_; }
  int rank() const { return rank_; }

  // The last step's compute actions with their times, this rank's.
  const std::vector<ActionTime>& last_step_times() const { return times_; }
  // The last step measured over the pp ranks (collective): the bubble
  // fraction, 1 - sum(busy) / (P * (last end - first start)); the mean
  // cost of F, B and W (seconds) over all stages and per stage; and the
  // transfer latency (costs.comm): the mean time from a send's post to
  // its data being there, over the receives that had to wait for it (a
  // receive reached later than its data says nothing of the transfer).
  // simulate(schedule(), costs, stage_costs) is the prediction to compare.
  struct Measured {
    double bubble_fraction = 0, makespan = 0;
    Costs costs;
    std::vector<Costs> stage_costs;
  };
  Measured measure_last_step();

 private:
  struct Slot;
  void check_agreement();
  void run_action(size_t index, const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets,
                  std::vector<Tensor>& losses);
  // Posts the receive of `a` (ordered: and every earlier message from its
  // sender). False, posting nothing, when that would wait for a boundary's
  // header and `may_block` is not set.
  bool post_recv(const Action& a, bool may_block = true);
  void post_one(int tag, const Action& a);
  int source_of(const Action& a) const;  // a receive's sending rank
  int dest_of(const Action& a) const;    // a send's receiving rank
  // The tag a message of tag `t` from `sender` travels under: its own, or
  // in ordered mode one per sender (each pair's messages in send order).
  int wire_tag(int t, int sender) const;
  Tensor take_recv(const Action& a);
  void send(const Tensor& t, const Action& a);
  void exchange_tied_grads();
  // The FSDP roots of this rank's stages (a stage that holds units must be
  // one), found at each step: wrapping may follow the constructor.
  std::vector<std::shared_ptr<FSDPModule>> fsdp_stages() const;
  void average_over_replicas();
  PipelineStage& stage(int index) const;
  int tag(const Action& a) const;

  Schedule schedule_;
  std::vector<std::shared_ptr<PipelineStage>> stages_;
  std::shared_ptr<ProcessGroup> pp_;
  PipelineOptions options_;
  int rank_ = 0;
  bool agreed_ = false;
  std::string failed_;  // set when a step fails: no further steps
  bool split_ = false;
  bool ordered_ = false;  // PipelineOptions::ordered_transfers, or the group matches in order
  // Ordered transfers: per sending rank, the tags of one step's messages to
  // this rank in the order it sends them, this rank's receive of each, and
  // how many of them this step has posted.
  std::map<int, std::vector<int>> inbound_;
  std::map<int, Action> recv_of_;
  std::map<int, size_t> inbound_posted_;
  // Per stage boundary (the receiving stage): the activation's agreed shape
  // and dtype; sent once (sender) or learnt once (receiver).
  std::map<int, std::pair<Shape, DType>> in_meta_, out_meta_;
  std::map<std::pair<int, int>, std::unique_ptr<Slot>> slots_;  // (mb, stage)
  struct Posted {
    Tensor buffer;
    std::shared_ptr<Work> work;
  };
  std::map<int, Posted> recvs_;  // by tag
  std::vector<std::pair<std::shared_ptr<Work>, Tensor>> sends_;
  std::vector<ActionTime> times_;
  // Per message of the last step (by tag): when its send was posted, and
  // when its receive's data was there and whether the receive waited.
  std::map<int, double> send_posted_;
  std::map<int, std::pair<double, bool>> recv_done_;
  std::chrono::steady_clock::time_point step_start_;
};

}  // namespace ember::distributed::pp
