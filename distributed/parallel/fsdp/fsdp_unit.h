// FSDP's internal unit state, shared by fsdp.cc (wrapping and the handle),
// fsdp_unit.cc (the state machine and hooks), fsdp_shard_specs.cc (each
// parameter's ShardSpec) and fsdp_state_dict.cc (full state dicts). Not part
// of the API.
//
// A unit's parameters are in one of three states:
//   SHARDED    each parameter is its sharded view of `shard` (float32), its
//              .grad() the same view of `shard_grad`: what optimizers see.
//   UNSHARDED  each parameter is its view of layout.flat() (param_dtype, the
//              whole unit gathered), its .grad() a view of `grad_flat`.
//   FREED      as UNSHARDED, but layout.flat()'s memory is given back
//              (FULL_SHARD between a unit's forward and its backward).
// With a shard group of one rank and no cast (NO_SHARD), `shard` is
// layout.flat() itself (shares_storage): the views coincide, and only the
// gradients move between the two states.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "distributed/parallel/flat_buffer.h"
#include "distributed/parallel/fsdp/fsdp.h"
#include "nn/float8.h"

namespace ember::distributed {

struct PendingReduce {
  std::shared_ptr<FSDPModule::Unit> unit;
  Tensor input;            // the unit's full gradient buffer in reduce_dtype, until the reduce-scatter ends
  Tensor output;           // its shard, reduced
  std::vector<bool> seen;  // which parameters it holds a gradient of
  std::shared_ptr<Work> rs, ar;
};

// A unit's float8 all-gather (fsdp_float8.cc; nn/float8.h's
// enable_fsdp_float8_all_gather): which of its entries are float8 layers'
// weights, and how every rank's shard splits into the part gathered in
// param_dtype and the part gathered in e4m3. While a unit is gathered so,
// its high-precision parameters are views of `hp_full` and the float8
// weights views of `ghost` (a freed buffer whose reads say why), their
// casts views of `f8_full` handed to their layers' Float8LinearState.
struct Float8Gather {
  bool planned = false;
  // Per layout entry: the index of its float8 layer in `states`, or -1;
  // and its offset in hp_full or f8_full (compact: entries of one kind
  // back to back, in layout order).
  std::vector<int> f8_index;
  std::vector<int64_t> compact;
  std::vector<size_t> f8_entry;  // per float8 weight: its layout entry
  // Per float8 weight: the layers computing with it (one, unless layers share it).
  std::vector<std::vector<std::shared_ptr<nn::Float8LinearState>>> states;
  int64_t hp_numel = 0, f8_numel = 0;
  // Elements per rank in each all-gather: the most any rank holds of each
  // kind (the others pad).
  int64_t hp_seg = 0, f8_seg = 0;
  // A run of elements one copy moves: from rank `rank`'s segment of a kind
  // (or, packing, from this rank's shard) to its compact place.
  struct Run {
    int f8 = -1;  // the float8 layer (packing: its scale), -1: high precision
    int rank = 0;
    int64_t shard_offset = 0, seg_offset = 0, compact_offset = 0, numel = 0;
  };
  std::vector<Run> pack;    // this rank's shard into the send buffers
  std::vector<Run> unpack;  // every rank's segments into hp_full / f8_full
  Tensor hp_full, f8_full, ghost;
  std::vector<Tensor> scales;  // per float8 weight: float32 [3], while gathered
  // What the last forward's float8 gather left when the unit was freed:
  // f8_full's memory, alive while that forward's float8 layers keep their
  // casts for backward (they do unless recomputed), and its scales. The
  // backward's gather of the same forward (`kept_generation`) takes them
  // instead of gathering the float8 part again.
  std::weak_ptr<Storage> kept_f8;
  std::vector<Tensor> kept_scales;
  uint64_t kept_generation = 0;
  // FSDPModule::precompute_float8_dynamic_scale_for_fsdp's scales, for the
  // unit's next float8 gather (which takes them: one use, decided alike on
  // every rank), and the shard's storage version they were computed at.
  std::vector<Tensor> pre_scales;
  uint64_t pre_version = 0;
  // In flight.
  Tensor hp_send, f8_send, hp_recv, f8_recv;
  std::shared_ptr<Work> hp_work, f8_work;
  bool active = false;  // the unit's gathered (or gathering) parameters are these
};

struct FSDPModule::Unit : std::enable_shared_from_this<FSDPModule::Unit> {
  enum class State { SHARDED, UNSHARDED, FREED };

  nn::Module* module = nullptr;
  std::string type;
  ShardingStrategy strategy = ShardingStrategy::FULL_SHARD;
  std::shared_ptr<ProcessGroup> shard_pg, replicate_pg;  // null: one rank / none
  std::shared_ptr<DeviceMesh> mesh;                      // what the groups were taken from
  int shard_size = 1, shard_rank = 0;

  std::vector<std::string> names;  // relative to `module`
  std::vector<Tensor> params;      // the module's own parameter objects
  std::vector<bool> trainable;
  // Which parameters' sharded gradients hold something (exposed as .grad()),
  // and which got a gradient into grad_flat since its last reduction: a
  // parameter that got none keeps .grad() undefined, as torch's FSDP2 leaves
  // it, so optimizers skip it (no weight decay) as they would unsharded.
  std::vector<bool> seen_shard, seen_unsharded;
  Device device;  // where the unit computes
  DType compute_dtype = DType::Float32, reduce_dtype = DType::Float32;
  std::optional<DType> output_dtype;
  bool cast_inputs = true;

  FlatBuffer layout;                      // the whole unit in compute_dtype (released unless gathered)
  std::vector<FlatBuffer::Piece> pieces;  // what of each entry this rank's shard holds
  Tensor shard;                           // [shard_numel] master dtype, on the shard device
  // [shard_numel] master dtype, or undefined. While SHARDED and exposed
  // as the parameters' .grad() views, the unit holds it only weakly, so a
  // zero_grad(set_to_none) frees it as it would unsharded gradients.
  Tensor shard_grad;
  std::weak_ptr<Storage> shard_grad_weak;
  Tensor grad_flat;  // [padded_numel] compute_dtype: unsharded gradients, or undefined
  bool shares_storage = false;
  State state = State::SHARDED;

  bool gathering = false;
  std::shared_ptr<Work> gather_work;
  Tensor gather_src;
  uint64_t fwd_version = 0;
  Float8Gather f8;
  // The last forward gathered in float8: its backward gathers the same kind
  // (the saved parameters are views of that kind's buffers).
  bool fwd_float8 = false;

  bool reshard_after_forward = true, reshard_after_backward = true, requires_sync = true;
  // The settings begin_micro_batches() put aside, while it is in force.
  struct Saved {
    bool reshard_after_forward, reshard_after_backward, requires_sync;
  };
  std::optional<Saved> micro_batches;
  bool forward_prefetch = true, backward_prefetch = true;
  int prefetch_limit = 1;

  // Per forward/backward.
  uint64_t generation = 0;
  bool expects_backward = false, post_backward_done = false, input_hooked = false;
  int64_t waiting = 0;

  // Root only.
  bool is_root = false, root_initialized = false, callback_queued = false;
  // Weak: the root is in its own lists, and the modules' hooks own the units;
  // strong references here kept a model's units (and their shards) alive
  // after the model was gone.
  std::vector<std::weak_ptr<Unit>> subtree;
  std::vector<std::weak_ptr<Unit>> fwd_order, prev_fwd_order, post_fwd_order;
  std::deque<PendingReduce> pending;
  std::weak_ptr<Unit> bwd_anchor;  // the unit whose backward started last

  std::vector<nn::HookHandle> hooks;

  Tensor full_view(const Tensor& flat, size_t i) const;
  Tensor shard_view(const Tensor& shard_flat, size_t i) const;
  int64_t num_trainable() const;
  int64_t shard_numel() const;
  TensorOptions master_options() const;
  TensorOptions compute_options() const;
  // The flat buffer (sharded or whole layout) holding the parameters'
  // current gradients: `flat` itself when each is still its view, else a new
  // one they are copied into, undefined when none has a gradient.
  Tensor reconcile(const Tensor& flat, bool sharded, int64_t numel, TensorOptions opts) const;
  void expose_grads(const Tensor& flat, bool sharded);
  // The sharded gradient, whether held or only seen through the parameters.
  Tensor live_shard_grad() const;
  // While SHARDED: let the parameters' views be what keeps it alive.
  void hold_shard_grad_weakly();
  int64_t shard_offset_of(size_t i) const;

  // `compute`: the gather is for the unit's forward (or the backward of a
  // forward gathered so), which may take float8 layers' weights in float8;
  // otherwise every parameter is gathered as it is, and an explicit unshard
  // of a unit gathered in float8 for its forward is refused by name.
  void start_gather(bool compute = false);
  void finish_gather();
  void unshard(bool compute = false);
  void free_unsharded();
  // The tensor whose storage holds the gathered parameters the forward
  // saves (layout.flat(), or the float8 gather's hp_full).
  Tensor gathered_storage() const;
  // fsdp_float8.cc: whether this unit gathers float8 weights in float8
  // (planned once: the float8 layers among its parameters, shard group > 1);
  // the two halves of such a gather; pointing the parameters at what was
  // gathered; letting it go.
  bool float8_gather_applies();
  void start_float8_gather();
  // This rank's amax of each float8 weight (float32 [weights], 0 where it
  // holds none of it), from `src`, the shard on the compute device.
  Tensor local_float8_amaxes(const Tensor& src) const;
  // Makes amaxes all-reduced over the shard group the whole weights' where
  // tensor parallelism splits them too (their states' sync: a max over tp
  // of the whole vector, a no-op for a weight tp does not split); nothing
  // when none of this unit's is split. Returns whether it did.
  bool float8_amaxes_over_tp(Tensor& amaxes) const;
  void finish_float8_gather();
  void point_params_at_gathered();
  // Lets the gathered float8 buffers and the layers' casts go, and the
  // unit leaves float8 mode; `keep` (a FREED unit between its forward and
  // backward): it stays in it, and f8_full is remembered for the backward
  // (Float8Gather::kept_f8).
  void drop_float8_gathered(bool keep = false);
  // The master shard on the compute device (a copy under CPU offload).
  Tensor shard_on_device() const;
  void reshard();
  void accumulate_shard_grad(const Tensor& reduced, const std::vector<bool>& seen);
  void issue_reduce(const Tensor& grads);
  // Root: one step of each pending reduction (waits); true when it is done.
  bool advance(std::deque<PendingReduce>::iterator it);
  void advance_pending();
  void post_backward();
  void on_grad_ready(uint64_t generation);
  void ensure_grad_buffer();
  void finalize_backward();

  std::shared_ptr<Unit> root();
  void init_root();
  Tensor pre_forward(const Tensor& input);
  Tensor post_forward(const Tensor& output);
  void pre_backward();
  void prefetch_backward();  // root: gathers ahead of bwd_anchor within the limit

 private:
  std::weak_ptr<Unit> root_;
};

// What the files of the fsdp library share of one another (not the API).
namespace fsdp_internal {

// The unit lives on its module (Module::transform_state under this key):
// no registry maps modules or parameters to units.
inline constexpr const char* kStateKey = "fully_shard";

// The live units of a root's list, in order (fsdp_unit.cc).
std::vector<std::shared_ptr<FSDPModule::Unit>> alive(const std::vector<std::weak_ptr<FSDPModule::Unit>>& units);

// The unit wrapping `m` itself, or null (fsdp_unit.cc).
std::shared_ptr<FSDPModule::Unit> unit_of(const nn::Module* m);

// Says on each of the unit's parameters what this rank holds of it
// (fsdp_shard_specs.cc); fully_shard calls it once the unit is laid out.
void attach_shard_specs(const std::shared_ptr<FSDPModule::Unit>& u);

}  // namespace fsdp_internal

}  // namespace ember::distributed
