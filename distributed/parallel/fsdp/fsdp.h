// Fully sharded data parallelism (FSDP) with PyTorch FSDP2's semantics:
// fully_shard() applied to the units a user picks (each transformer block),
// then to the root. Each unit's parameters are split across the ranks of its
// shard group, gathered only while the unit runs, and its gradients come
// back reduce-scattered, so every rank holds 1/N of the parameters,
// gradients and (through any optimizer over parameters()) optimizer state.
//
//   for (auto& block : gpt->h) distributed::fully_shard(block, opts);
//   auto fsdp = distributed::fully_shard(gpt, opts);        // the root: what is left
//   optim::AdamW opt(gpt->parameters(), {...});              // the local shards
//   loss = cross_entropy((*gpt)(x), y); loss.backward(); opt.step();
//
// How: a unit's parameters (those no inner unit took) are laid out in one
// distributed::FlatBuffer padded to the shard group's size; rank r keeps
// shard r (float32) and every parameter becomes a view of its own part of it
// ("the sharded view": the parameter's shape where the part is the whole
// tensor, else 1-D, possibly empty). The parameter objects never change, so
// names, optimizer state and the module's own handles stay valid; only their
// data is swapped (set_data), as torch's use_orig_params. Before the unit's
// forward one all-gather fills the unit's whole buffer (in param_dtype) and
// the parameters point at it; after the forward FULL_SHARD frees it, and the
// backward pre-hook gathers it again (the saved tensors' versions are set
// back, torch's _unsafe_set_version_counter). Gradients accumulate into one
// flat buffer per unit; once the unit's backward is over (every trainable
// parameter's gradient accumulated and the unit's input gradient computed),
// one reduce-scatter averages it into the sharded gradient, which
// parameters() expose as .grad() after backward. A callback at the end of
// backward handles units whose parameters got no gradient and waits for the
// collectives, so optimizer.step() can follow at once.
//
// Strategies (torch's ShardingStrategy):
//   FULL_SHARD     reshard after forward, gather again for backward (ZeRO-3)
//   SHARD_GRAD_OP  keep gathered from forward until the unit's backward (ZeRO-2)
//   NO_SHARD       every rank holds everything, gradients allreduced (DDP)
//   HYBRID_SHARD   FULL_SHARD within a shard group, replicated (allreduce of
//                  the sharded gradients) across a replicate group
// NO_SHARD is the hybrid case with shard groups of one rank: one mechanism.
//
// Rules, as FSDP2's: wrap bottom-up (inner units first); every rank wraps the
// same units in the same order (checked at wrap time, naming the unit); the
// module is on its final device and dtype before wrapping; a unit runs its
// forward once per backward. Buffers (BatchNorm statistics) are not sharded.
//
// Where the state lives: each unit on its module (Module::transform_state),
// each parameter's shard described on the parameter (its ShardSpec, which
// checkpoints read); nothing global. The root is the unit whose forward
// runs first with no unit's forward around it (FSDP2's lazy rule); it
// claims the units of its subtree then.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "distributed/comm/process_group.h"
#include "distributed/device_mesh.h"
#include "nn/module.h"

namespace ember::distributed {

enum class ShardingStrategy { FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD };
const char* strategy_name(ShardingStrategy s);
// "full" | "grad_op" | "no_shard" | "hybrid" and torch's names; throws otherwise.
ShardingStrategy parse_strategy(const std::string& s);

// torch's MixedPrecisionPolicy. Sharded parameters (and so the optimizer)
// stay float32; the gathered copies the unit computes with are param_dtype.
struct MixedPrecisionPolicy {
  // Dtype the unit gathers and computes in; nullopt: the parameters' own.
  std::optional<DType> param_dtype = std::nullopt;
  // Dtype of the gradient reduce-scatter; nullopt: param_dtype.
  std::optional<DType> reduce_dtype = std::nullopt;
  // The root's floating outputs are cast to this (e.g. float32 logits for the loss).
  std::optional<DType> output_dtype = std::nullopt;
  // Floating inputs of each unit are cast to param_dtype.
  bool cast_forward_inputs = true;
};

// torch's CPUOffloadPolicy / CPUOffload(offload_params=True): sharded
// parameters, gradients and so optimizer state live in (pinned) host memory
// and the optimizer steps on the CPU; a unit's shard is copied to the
// compute device before its all-gather, the reduced gradient shard back.
struct OffloadPolicy {
  bool offload_params = false;
  bool pin_memory = true;
};

struct FSDPOptions {
  // The ranks a unit is laid out over (torch's FSDP2 mesh). 1-D: sharded
  // over it (FULL_SHARD, SHARD_GRAD_OP) or replicated over it (NO_SHARD);
  // 2-D (dp_replicate, dp_shard): HYBRID_SHARD, sharded along the last
  // dimension and replicated along the first. Null: the default group as a
  // 1-D mesh. DeviceMesh::from_group makes one of an existing group.
  std::shared_ptr<DeviceMesh> mesh = nullptr;
  ShardingStrategy strategy = ShardingStrategy::FULL_SHARD;
  MixedPrecisionPolicy mp_policy = {};
  OffloadPolicy offload_policy = {};
  // Issue the next unit's all-gather (in the previous iteration's forward
  // order) before this unit's forward runs (torch's forward_prefetch).
  bool forward_prefetch = true;
  // Issue the next unit's all-gather in backward order when a unit's
  // backward starts (BackwardPrefetch.BACKWARD_PRE).
  bool backward_prefetch = true;
  // How many units ahead are gathered: at most 1 + prefetch_limit gathered
  // units are alive at once besides the root (torch's limit_all_gathers).
  int prefetch_limit = 1;
  // Rank 0's parameters and buffers are broadcast at wrap time (FSDP1's
  // sync_module_states), as DDP does, so ranks seeded differently agree.
  bool sync_module_states = true;
  // Parameters no unit takes (FSDP2's ignored_params): they keep their
  // data, gradients and shard specs, and are neither gathered nor reduced
  // here (expert parallelism's experts, which it splits and whose
  // gradients it reduces itself).
  std::vector<Tensor> ignored_params = {};
};

// A wrapped unit (torch's FSDPModule). Methods act on this unit and every
// unit inside its module.
class FSDPModule {
 public:
  struct Unit;
  explicit FSDPModule(std::shared_ptr<Unit> unit);
  ~FSDPModule();

  nn::Module& module() const;
  ShardingStrategy strategy() const;
  // The units in this module's subtree (this one first), in module order.
  std::vector<std::shared_ptr<Unit>> units() const;

  // Off: backward accumulates unsharded gradients locally (no collective,
  // full-size gradients per unit held until the next synchronizing
  // backward); on (default): every backward reduce-scatters and the sharded
  // gradients accumulate (1/N memory, one reduce-scatter per micro-batch).
  void set_requires_gradient_sync(bool on);
  // While gradient sync is off: keep the gathered parameters after backward
  // too (no all-gather on the next micro-batch, full parameters held).
  void set_reshard_after_backward(bool on);
  // Several forwards before their backwards (a pipeline's micro-batches,
  // pp::Pipeline calls these around each step): from begin_micro_batches()
  // every unit keeps its parameters gathered from its first forward and
  // accumulates whole gradients, so a unit is gathered once per step, not
  // once per micro-batch and again for its backward (torchtitan's default
  // under pipeline parallelism; torch's pipelining turns FSDP2's gradient
  // sync off until the last backward). end_micro_batches() then does what
  // a synchronizing backward would, once per unit: the reduce-scatter (and
  // replica all-reduce) of the accumulated gradients, then the reshard;
  // the units' own settings (strategy, no_sync) are back in force after it.
  // end is collective over each unit's groups.
  void begin_micro_batches();
  void end_micro_batches();
  // Gathers / frees every unit's parameters explicitly (e.g. for inference
  // outside forward, or a custom step that needs whole parameters).
  void unshard();
  void reshard();

  // torchao's precompute_float8_dynamic_scale_for_fsdp: with float8
  // all-gathers (nn/float8.h), the scales of every float8 weight of the
  // units in this subtree from one all-reduce of all their amaxes (one per
  // shard group), for each unit's next float8 gather to use instead of an
  // all-reduce of its own. Every rank calls it, after optimizer.step() (or
  // just before the next forward). A unit's parameters written between it
  // and that gather (a checkpoint load, say) are an error naming the unit:
  // the scales would be stale, and whether to use them must be decided
  // alike on every rank. No-op without float8 all-gathers.
  void precompute_float8_dynamic_scale_for_fsdp();

  // Bytes this rank holds now of sharded parameters, sharded gradients and
  // gathered (unsharded) parameters, over the units of this subtree.
  struct Memory {
    int64_t sharded_params = 0, sharded_grads = 0, unsharded_params = 0, unsharded_grads = 0;
    int64_t largest_unit = 0;  // bytes of the largest unit gathered in param dtype
  };
  Memory memory() const;

  // The group gradient norms are reduced over (null for NO_SHARD).
  std::shared_ptr<ProcessGroup> shard_group() const;
  // optim::clip_grad_norm_ over parameters() with the norm reduced over the
  // shard group (each element counted once). Every rank calls it.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);
  // The same on the device, waiting for nothing (optim::clip_grad_norm_async_).
  Tensor clip_grad_norm_async_(double max_norm, double norm_type = 2.0);

 private:
  std::shared_ptr<Unit> unit_;
};

// Wraps `module` as one unit: its parameters not already in a unit. Call on
// inner modules first, then on the root. Every rank calls it in the same
// order with the same structure.
std::shared_ptr<FSDPModule> fully_shard(const std::shared_ptr<nn::Module>& module, const FSDPOptions& options = {});

// The FSDPModule wrapping `module`, or null.
std::shared_ptr<FSDPModule> fsdp_of(const nn::Module& module);

// Auto-wrap (torch's ModuleWrapPolicy / size_based_auto_wrap_policy): wraps
// every submodule whose type_name() is in `types`, or that holds at least
// `min_num_params` parameters not yet wrapped (0: off), bottom-up, then the
// root. Returns the root's FSDPModule.
struct AutoWrapPolicy {
  std::vector<std::string> types;
  int64_t min_num_params = 0;
};
std::shared_ptr<FSDPModule> fully_shard_auto(const std::shared_ptr<nn::Module>& root, const AutoWrapPolicy& policy,
                                             const FSDPOptions& options = {});

// Full (unsharded) state dicts with the original names.
struct FullStateDictOptions {
  bool rank0_only = true;      // other ranks get an empty dict (they still take part)
  bool offload_to_cpu = true;  // tensors land in host memory
};
// Parameters gathered in their float32 master values plus buffers; every rank
// of the world calls it.
nn::StateDict full_state_dict(FSDPModule& root, const FullStateDictOptions& options = {});
// Loads a full state dict (every rank passes the same one, e.g. read from
// one file) into the sharded model: each rank keeps its shard. strict as
// Module::load_state_dict.
void load_full_state_dict(FSDPModule& root, const nn::StateDict& sd, bool strict = true);

}  // namespace ember::distributed
