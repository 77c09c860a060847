// A training step's time, predicted (the step-time cost model): per-layer
// compute from a ComputeProfile, every collective the step runs from a
// link model, and what overlaps what. One function, predict_step, used by
// the mesh planner for every candidate (//tools:plan) and printed term by
// term by `//tools:plan --explain`.
//
// Two sources for each half:
//
//   compute   ComputeProfile::from_hardware: FLOPs over a GPU's peak times an
//             efficiency (the planner's datacenter estimate); or
//             ComputeProfile::load: //bench:compute_profile's fits on this
//             machine, a transformer block's and the head's forward +
//             backward as overhead + FLOPs / rate, the optimizer's step as
//             overhead + parameters x cost
//   links     Links::analytic: ring collectives over Hardware's NVLink and
//             network bandwidths and latencies; or Links::measured: the
//             collectives' fits (comm_cost.h) of this machine
//
// On a CPU job whose ranks outnumber the cores (`cores`), every rank's
// compute is stretched by ranks / cores, and each collective's fit,
// measured with its group's processes alone on those cores, by the same
// ratio over its group's (the other groups run theirs at the same time).
// There collectives hide behind nothing (ComputeProfile::overlap 0: the
// cores are all computing); a GPU's copy engines hide the data-parallel
// collectives behind the backward (overlap 1).
//
// What a step runs, per rank, by mesh dimension (elem = 2 bytes in 16-bit
// training, 4 in float32; sbh = sequence x micro-batch x dim x elem, the
// bytes of one micro-batch's activations):
//
//   tp   per layer and micro-batch, under sequence parallelism
//        (Megatron-SP), 6 all-gathers of sbh (the backward gathers the
//        inputs again for the weights' gradients) and 4 reduce-scatters, 8
//        and 6 with full recompute, and once per step the replicated
//        norms' and biases' gradients all-reduced; without it 4
//        all-reduces of sbh (6 with recompute); the embedding's and the
//        head's, and the parallel loss's 3 all-reduces of s x b floats;
//        exposed (the counts are what ember's tensor-parallel GPT runs,
//        read off its profile)
//   dp   FSDP (FULL_SHARD) per unit (a block, and the root: embeddings and
//        head): an all-gather for each micro-batch's forward and each
//        block's backward, one reduce-scatter per step; SHARD_GRAD_OP one
//        all-gather per micro-batch; under a pipeline one all-gather per
//        step; HSDP adds the replicas' all-reduce of each shard; DDP an
//        all-reduce per unit; ZeRO-1 an all-reduce of the gradients and an
//        all-gather of the updated parameters after the step (exposed)
//   pp   per micro-batch and virtual stage a send of sbh / tp and a
//        receive of its gradient (exposed)
//   sync the loop's own scalar all-reduces over the job (the gradient
//        norm, the loss for the log)
//   optimizer  the step over the rank's parameters (sharded ones under
//        FSDP and ZeRO-1)
#pragma once

#include <absl/status/statusor.h>

#include <map>
#include <string>
#include <vector>

#include "distributed/parallel/comm_cost.h"
#include "distributed/parallel/plan_types.h"

namespace ember::distributed {

struct ComputeProfile {
  std::string source;  // where the figures come from, for --explain
  // A transformer block's forward + backward on one micro-batch:
  // block_overhead_s + FLOPs / block_flops_per_s.
  double block_flops_per_s = 0, block_overhead_s = 0;
  // The embeddings, final norm, LM head and loss (a model that is not a
  // transformer: its whole forward + backward).
  double head_flops_per_s = 0, head_overhead_s = 0;
  // Models that are not transformers, by ModelSpec::name, measured whole:
  // forward + backward overhead_s + samples x s_per_sample, the optimizer's
  // step optimizer_s (//bench:compute_profile's narrow ResNet-18).
  struct ModelRate {
    double overhead_s = 0, s_per_sample = 0, optimizer_s = 0;
  };
  std::map<std::string, ModelRate> models;
  // The optimizer step: optimizer_overhead_s + parameters x optimizer_s_per_param.
  double optimizer_s_per_param = 0, optimizer_overhead_s = 0;
  // The fraction of the backward the data-parallel collectives can hide
  // behind.
  double overlap = 1;
  // CPU cores the ranks share; 0: a device per rank.
  int cores = 0;
  double host_bw = 0;  // bytes/s between host and device, for CPU offload

  static ComputeProfile from_hardware(const Hardware& hw);
  // //bench:compute_profile's JSON; an error names the file and the field.
  static absl::StatusOr<ComputeProfile> load(const std::string& path);
};

// Seconds of one collective.
class Links {
 public:
  // Ring collectives over hw's bandwidths: a group of `size` ranks
  // `stride` apart crosses hosts when stride x size exceeds the GPUs per
  // host.
  static Links analytic(const Hardware& hw);
  // This machine's fits; a job of `job_ranks` processes on `cores` cores.
  // With `inter_host_bw` (bytes/s each way) the job's hosts, of
  // `ranks_per_host` ranks, are joined by such links (network namespaces
  // over a shaped veth pair): a ring spanning hosts sends its share of the
  // bytes over each host's link once per group with a member there, at
  // least the fit's latency plus that transfer.
  static Links measured(const CommCostModel& fits, int job_ranks, int cores, double inter_host_bw = 0,
                        int ranks_per_host = 0);
  // `op`: allreduce, allgather, reduce_scatter, broadcast, all_to_all,
  // send_recv; `bytes` as the process group's counters count them.
  double seconds(const std::string& op, double bytes, int group_size, int stride) const;
  std::string source() const;

 private:
  const Hardware* hw_ = nullptr;
  const CommCostModel* fits_ = nullptr;
  int job_ranks_ = 1, cores_ = 0;
  double inter_host_bw_ = 0;
  int ranks_per_host_ = 0;
};

// One line of the prediction: what runs, how often, how long in all.
struct StepTerm {
  std::string part;    // compute | bubble | tp | cp | ep | dp | pp | sync | optimizer | offload
  std::string what;    // "allgather 1.50 MiB over 2 ranks x 9"
  double seconds = 0;  // negative: hidden behind compute
};

struct StepTime {
  double compute = 0;  // the rank's forward + backward, all its micro-batches
  double bubble = 0;   // the pipeline's idle fraction
  double tp_comm = 0, dp_comm = 0, dp_exposed = 0, pp_comm = 0, sync = 0, optimizer = 0, offload_io = 0;
  double cp_comm = 0;  // context parallelism's exchanges, exposed
  double ep_comm = 0;  // expert parallelism's all-to-alls, exposed
  double step = 0;
  std::vector<StepTerm> terms;
  // A table of the terms and the sum, for --explain.
  std::string explain() const;
};

// `c`'s dimensions, schedule, micro-batches and micro-batch size (as
// evaluate_mesh fills them in), its strategy and AC policy; `bubble` from
// the schedule's simulation.
StepTime predict_step(const ModelSpec& model, const MeshCandidate& c, const PlanOptions& options,
                      const ComputeProfile& compute, const Links& links, double bubble);

}  // namespace ember::distributed
