// FSDP's float8 all-gather (nn/float8.h's enable_fsdp_float8_all_gather, as
// torchao's with FSDP2): the weights of a unit's float8 layers travel as
// e4m3, a byte per element, cast on each rank from its shard of the master
// weight with the scale of the whole weight, and the layers compute with
// the gathered cast (their Float8LinearState) instead of casting a gathered
// high-precision copy. Everything else in the unit travels in param_dtype.
//
// Why the result equals a plain gather's float8 layer: the amax of a weight
// is the max of its shards' amaxes (a max is exact), so every rank derives
// the same scale the unsharded layer would, and casting elementwise with
// it gives the same bytes wherever the element sits. One all-reduce (max)
// per unit carries the amaxes of all its float8 weights.
//
// The layout stays the one FlatBuffer every other part of FSDP reads
// (shards, pieces, gradients, checkpoints); only the gather differs. Rank
// r's shard splits into its high-precision pieces and its float8 pieces;
// each kind goes into one all-gather whose per-rank segment is the most
// any rank holds of that kind, and runs of elements are copied from the
// segments into two compact buffers (hp_full in param_dtype, f8_full in
// e4m3), entries of a kind back to back in layout order.
#include <algorithm>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "core/ops_float8.h"
#include "distributed/comm/flight_recorder.h"
#include "distributed/parallel/fsdp/fsdp_unit.h"

namespace ember::distributed {

using Unit = FSDPModule::Unit;

namespace {

constexpr DType kE4M3 = DType::Float8E4M3;

// What reading a float8-gathered weight's high-precision data says.
constexpr const char* kGhostWhy =
    "this weight of a float8 layer is gathered in float8 (FSDP's float8 all-gather, "
    "enable_fsdp_float8_all_gather): while its unit is gathered for forward and backward only its float8 "
    "layers read it, through the gathered cast; once the unit is resharded (after the step), "
    "FSDPModule::unshard() gathers the whole weight";

// A flat tensor of `numel` elements of `dtype` over `storage`.
Tensor flat_over(std::shared_ptr<Storage> storage, int64_t numel, DType dtype) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->sizes = {numel};
  impl->strides = {1};
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

// A tensor of `numel` elements whose storage is freed from the start (no
// memory is ever allocated for it): reads fail with `why`.
Tensor freed_placeholder(int64_t numel, TensorOptions o, const char* why) {
  auto storage = std::make_shared<Storage>();
  storage->data.device = o.device;
  storage->nbytes = static_cast<size_t>(numel) * dtype_size(o.dtype);
  storage->freed = true;
  storage->freed_why = why;
  return flat_over(std::move(storage), numel, o.dtype);
}

// The scales of `count` weights from their amaxes at [from, from + count).
std::vector<Tensor> scales_of(const Tensor& amaxes, int64_t from, size_t count) {
  std::vector<Tensor> scales;
  for (size_t j = 0; j < count; ++j) scales.push_back(float8_scale(amaxes.narrow(0, from++, 1), kE4M3));
  return scales;
}

// Appends `run`, or extends the last run when it continues it in both the
// source and the destination (and `merge` allows).
void add_run(std::vector<Float8Gather::Run>& runs, const Float8Gather::Run& run, bool merge) {
  if (merge && !runs.empty()) {
    Float8Gather::Run& last = runs.back();
    if (last.rank == run.rank && (last.f8 < 0) == (run.f8 < 0) && last.seg_offset + last.numel == run.seg_offset &&
        last.compact_offset + last.numel == run.compact_offset && last.shard_offset + last.numel == run.shard_offset) {
      last.numel += run.numel;
      return;
    }
  }
  runs.push_back(run);
}

}  // namespace

bool Unit::float8_gather_applies() {
  if (f8.planned) return !f8.states.empty();
  f8.planned = true;
  if (shard_size == 1 || shares_storage || !shard_pg) return false;
  const size_t n = params.size();
  // The layers computing with each parameter (a weight two float8 layers
  // share gets its cast handed to both).
  std::vector<std::vector<std::shared_ptr<nn::Float8LinearState>>> state_of(n);
  for (const auto& named : module->named_modules()) {
    auto st = named.second->transform_state_as<nn::Float8LinearState>(nn::kFloat8StateKey);
    if (!st || !st->all_gather_in_float8) continue;
    for (size_t i = 0; i < n; ++i)
      if (params[i].is_same(st->weight)) state_of[i].push_back(st);
  }
  const DType master = shard.dtype();
  if (master != DType::Float32 && master != DType::BFloat16 && master != DType::Float16) return false;
  f8.f8_index.assign(n, -1);
  f8.compact.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = layout.entries()[i].numel;
    if (!state_of[i].empty()) {
      f8.f8_index[i] = static_cast<int>(f8.states.size());
      f8.states.push_back(state_of[i]);
      f8.f8_entry.push_back(i);
      f8.compact[i] = f8.f8_numel;
      f8.f8_numel += numel;
    } else {
      f8.compact[i] = f8.hp_numel;
      f8.hp_numel += numel;
    }
  }
  if (f8.states.empty()) return false;
  for (int r = 0; r < shard_size; ++r) {
    int64_t hp_off = 0, f8_off = 0;
    for (const FlatBuffer::Piece& pc : layout.pieces(r)) {
      const int j = f8.f8_index[pc.entry];
      int64_t& seg = j < 0 ? hp_off : f8_off;
      const Float8Gather::Run run{.f8 = j,
                                  .rank = r,
                                  .shard_offset = pc.shard_offset,
                                  .seg_offset = seg,
                                  .compact_offset = f8.compact[pc.entry] + pc.entry_offset,
                                  .numel = pc.numel};
      seg += pc.numel;
      if (pc.numel == 0) continue;
      // Packing casts each float8 piece with its own weight's scale.
      if (r == shard_rank) add_run(f8.pack, run, /*merge=*/j < 0);
      add_run(f8.unpack, run, /*merge=*/true);
    }
    f8.hp_seg = std::max(f8.hp_seg, hp_off);
    f8.f8_seg = std::max(f8.f8_seg, f8_off);
  }
  // The float8 weights' parameters while gathered: the right shape and
  // dtype for autograd, no memory, and a reason for whoever reads them.
  f8.ghost = freed_placeholder(f8.f8_numel, compute_options(), kGhostWhy);
  return true;
}

void Unit::start_float8_gather() {
  NoGradGuard ng;
  MemoryKindScope gathered_memory(MemoryKind::Gathered);
  fr::CallerTag caller("FSDP float8 all-gather (parameters)");
  if (!f8.hp_full.defined())
    f8.hp_full = Tensor::empty({f8.hp_numel}, compute_options());
  else if (f8.hp_full.storage_freed())
    f8.hp_full.restore_storage();
  const Tensor src = shard_on_device();
  // The backward of the forward that gathered last: its float8 layers still
  // hold the casts (unless they are recomputed), so only the rest travels.
  // (The shards have not changed since that forward: its scales hold.)
  const bool same_forward = f8.kept_generation == generation && !f8.kept_scales.empty();
  std::shared_ptr<Storage> kept = same_forward ? f8.kept_f8.lock() : nullptr;
  f8.kept_f8.reset();
  if (kept) {
    f8.f8_full = flat_over(std::move(kept), f8.f8_numel, kE4M3);
    f8.scales = std::move(f8.kept_scales);
  } else {
    f8.f8_full = Tensor::empty({f8.f8_numel}, TensorOptions{kE4M3, device});
    if (same_forward) {
      f8.scales = std::move(f8.kept_scales);
    } else if (!f8.pre_scales.empty()) {
      // Every rank precomputed, so every rank takes them here. A shard
      // written since would make them stale: refused, not silently used
      // (an all-reduce on this rank alone would not line up).
      EMBER_CHECK(f8.pre_version == shard.storage_version(), "FSDP(", type,
                  "): its parameters were written after precompute_float8_dynamic_scale_for_fsdp() and before "
                  "the float8 all-gather that uses its scales; call it after the last write (after "
                  "optimizer.step() and any checkpoint load)");
      f8.scales = std::move(f8.pre_scales);
      f8.pre_scales.clear();
    } else {
      // Each weight's amax over the ranks, then its scale, as float8_scale
      // of the whole weight would give.
      Tensor amaxes = local_float8_amaxes(src);
      shard_pg->allreduce(amaxes, ReduceOp::Max)->synchronize();
      float8_amaxes_over_tp(amaxes);
      f8.scales = scales_of(amaxes, 0, f8.states.size());
    }
    f8.f8_send = Tensor::empty({f8.f8_seg}, TensorOptions{kE4M3, device});
    f8.f8_recv = Tensor::empty({f8.f8_seg * shard_size}, TensorOptions{kE4M3, device});
  }
  f8.kept_scales.clear();
  // Pack this rank's shard; a segment's tail past what this rank holds is
  // padding nobody reads.
  f8.hp_send = Tensor::empty({f8.hp_seg}, compute_options());
  f8.hp_recv = Tensor::empty({f8.hp_seg * shard_size}, compute_options());
  for (const auto& run : f8.pack) {
    const Tensor from = src.narrow(0, run.shard_offset, run.numel);
    if (run.f8 < 0)
      f8.hp_send.narrow(0, run.seg_offset, run.numel).copy_(from);
    else if (f8.f8_send.defined())
      f8.f8_send.narrow(0, run.seg_offset, run.numel).copy_(to_float8(from, f8.scales[run.f8].select(0, 0), kE4M3));
  }
  if (f8.hp_seg > 0) f8.hp_work = shard_pg->allgather_into_tensor(f8.hp_recv, f8.hp_send);
  if (f8.f8_seg > 0 && f8.f8_send.defined()) f8.f8_work = shard_pg->allgather_into_tensor(f8.f8_recv, f8.f8_send);
  f8.active = true;
  gathering = true;
}

Tensor Unit::local_float8_amaxes(const Tensor& src) const {
  std::vector<Tensor> amax(f8.states.size());
  for (const auto& run : f8.pack)
    if (run.f8 >= 0) amax[run.f8] = float8_scale(src.narrow(0, run.shard_offset, run.numel), kE4M3).narrow(0, 2, 1);
  for (Tensor& a : amax)
    if (!a.defined()) a = zeros({1}, TensorOptions{DType::Float32, device});
  return cat(amax, 0);
}

bool Unit::float8_amaxes_over_tp(Tensor& amaxes) const {
  for (const auto& layers : f8.states)
    for (const auto& st : layers)
      if (st->sync.weight) {
        st->sync.weight(amaxes);  // elementwise: every weight's amax at once
        return true;
      }
  return false;
}

void FSDPModule::precompute_float8_dynamic_scale_for_fsdp() {
  NoGradGuard ng;
  fr::CallerTag caller("FSDP precompute_float8_dynamic_scale_for_fsdp");
  // The units gathering in float8, by shard group, in module order (the
  // same on every rank of a group).
  std::vector<std::pair<ProcessGroup*, std::vector<Unit*>>> groups;
  for (auto& u : units()) {
    if (u->state != Unit::State::SHARDED || !u->float8_gather_applies()) continue;
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == u->shard_pg.get(); });
    if (it == groups.end()) it = groups.insert(groups.end(), {u->shard_pg.get(), {}});
    it->second.push_back(u.get());
  }
  for (auto& [pg, us] : groups) {
    std::vector<Tensor> parts;
    for (Unit* u : us) parts.push_back(u->local_float8_amaxes(u->shard_on_device()));
    Tensor amaxes = cat(parts, 0);
    pg->allreduce(amaxes, ReduceOp::Max)->synchronize();
    // Over tp too where layers are split, the whole group's at once (every
    // rank of a tp group holds the same units).
    for (Unit* u : us)
      if (u->float8_amaxes_over_tp(amaxes)) break;
    int64_t at = 0;
    for (Unit* u : us) {
      u->f8.pre_scales = scales_of(amaxes, at, u->f8.states.size());
      at += static_cast<int64_t>(u->f8.states.size());
      u->f8.pre_version = u->shard.storage_version();
    }
  }
}

void Unit::finish_float8_gather() {
  NoGradGuard ng;
  for (auto* w : {&f8.hp_work, &f8.f8_work})
    if (auto work = std::move(*w)) work->synchronize();
  for (const auto& run : f8.unpack) {
    const bool is_f8 = run.f8 >= 0;
    if (is_f8 && !f8.f8_recv.defined()) continue;  // kept from the forward
    const Tensor& recv = is_f8 ? f8.f8_recv : f8.hp_recv;
    const int64_t seg = is_f8 ? f8.f8_seg : f8.hp_seg;
    (is_f8 ? f8.f8_full : f8.hp_full)
        .narrow(0, run.compact_offset, run.numel)
        .copy_(recv.narrow(0, run.rank * seg + run.seg_offset, run.numel));
  }
  f8.hp_send = f8.f8_send = f8.hp_recv = f8.f8_recv = Tensor();
  for (size_t j = 0; j < f8.states.size(); ++j) {
    const FlatEntry& e = layout.entries()[f8.f8_entry[j]];
    const Float8Weight cast{f8.f8_full.narrow(0, f8.compact[f8.f8_entry[j]], e.numel).view(e.shape), f8.scales[j]};
    for (auto& st : f8.states[j]) st->cast = cast;
  }
}

void Unit::point_params_at_gathered() {
  for (size_t i = 0; i < params.size(); ++i) {
    if (!f8.active) {
      params[i].set_data(full_view(layout.flat(), i));
      continue;
    }
    const FlatEntry& e = layout.entries()[i];
    const Tensor& buffer = f8.f8_index[i] >= 0 ? f8.ghost : f8.hp_full;
    params[i].set_data(buffer.narrow(0, f8.compact[i], e.numel).view(e.shape));
  }
}

void Unit::drop_float8_gathered(bool keep) {
  if (!f8.active) return;
  for (auto& states : f8.states)
    for (auto& st : states) st->cast = Float8Weight{};
  if (keep && f8.f8_full.defined()) {
    f8.kept_f8 = f8.f8_full.impl().storage;
    f8.kept_scales = f8.scales;
    f8.kept_generation = generation;
  } else {
    f8.kept_f8.reset();
    f8.kept_scales.clear();
  }
  f8.f8_full = Tensor();
  f8.scales.clear();
  if (f8.hp_full.defined()) f8.hp_full.free_storage();
  // Kept for the backward, the parameters stay what the float8 gather made them.
  f8.active = keep;
}

Tensor Unit::shard_on_device() const { return shard.device() == device ? shard : shard.to(device); }

Tensor Unit::gathered_storage() const { return f8.active ? f8.hp_full : layout.flat(); }

}  // namespace ember::distributed
