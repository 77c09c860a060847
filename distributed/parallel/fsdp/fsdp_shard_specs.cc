// What FSDP says on each parameter it shards: the ShardSpec (sharding
// vocabulary) naming the region of the whole parameter this rank's shard
// holds, how its norm's partial sums combine over the shard and replicate
// groups, and where its data lives in any unit state. Checkpoints and
// gradient clipping read only these specs, never the unit, so this is the
// whole of FSDP's contract with them; fully_shard (fsdp.cc) attaches them
// once a unit is laid out. Composition with tensor parallelism is here too:
// a parameter both shard is described on the mesh both were cut from.
#include <algorithm>
#include <cctype>
#include <cmath>

#include "distributed/device_mesh.h"
#include "distributed/parallel/fsdp/fsdp.h"
#include "distributed/parallel/fsdp/fsdp_unit.h"
#include "distributed/parallel/rank_agreement.h"
#include "distributed/sharding/shard_spec.h"
#include "distributed/tensor/dtensor.h"
#include "optim/clip_grad.h"

namespace ember::distributed {

using Unit = FSDPModule::Unit;

namespace {

// FSDP's description of a parameter's shard, which norms over the whole
// parameters (optim::clip_grad_norm_) read: each element counted by its one
// writer, the partial sums combined over the shard and replicate groups
// (one combination for every unit on the same mesh).
struct FsdpShardSpec : ShardSpec {
  std::shared_ptr<ProcessGroup> shard_pg, replicate_pg;
  const void* domain = nullptr;
  bool counts_in_norm() const override { return writes; }
  const void* norm_domain() const override { return shard_pg || replicate_pg ? domain : nullptr; }
  void reduce_norm_partial(const Tensor& partial, bool max) const override {
    for (const auto* g : {&shard_pg, &replicate_pg})
      if (*g) grad_norm_allreduce(*g, max ? INFINITY : 2.0)(partial);
  }
};

// Where a spec's region lives whatever state the unit is in (the float32
// shard view, so a save gathers and reshards nothing), and the reshard a
// load needs first (no gathered copy of the old values outlives it).
void attach_shard_data(ShardSpec& spec, const std::shared_ptr<Unit>& u, size_t i) {
  std::weak_ptr<Unit> weak = u;
  spec.local = [weak, i] {
    auto uu = weak.lock();
    EMBER_CHECK(uu != nullptr, "FSDP: the unit of this parameter is gone");
    return uu->shard_view(uu->shard, i);
  };
  spec.before_load = [weak] {
    if (auto uu = weak.lock()) uu->reshard();
  };
}

// The run of this rank's FSDP shard of a parameter (`pc`'s part of the
// entry; none: an empty run) through the boxes another parallelism's
// `split` says the local tensor holds: `spec`'s region(s).
void run_through(ShardSpec& spec, const ShardSpec& split, const FlatBuffer::Piece* pc) {
  const int64_t begin = pc ? pc->entry_offset : 0, end = begin + (pc ? pc->numel : 0);
  std::vector<Region> rs;
  int64_t off = 0;
  for (const Region& r : split.regions()) {
    const int64_t lo = std::max(begin, off), hi = std::min(end, off + r.numel);
    if (hi > lo) rs.push_back(Region{r.box, r.begin + (lo - off), hi - lo});
    off += r.numel;
  }
  if (rs.empty()) rs.push_back(Region{split.region.box, 0, 0});
  spec.region = rs.front();
  if (rs.size() > 1) spec.parts = rs;
}

// A parameter tensor parallelism sharded before FSDP took its local part:
// described on the mesh both were cut from (FSDP's dimensions, the tp
// dimension, Replicate on any other), its regions the run of this rank's
// FSDP shard through the tp part's boxes. Written where both would write.
std::shared_ptr<const DTensorSpec> compose_with_tensor_parallel(const std::shared_ptr<Unit>& up, size_t i,
                                                                const DTensorSpec& tp, const FlatBuffer::Piece* pc,
                                                                const std::string& layout, int replica) {
  const Unit& u = *up;
  const std::string name = u.names[i];
  // FSDP over a flattened view (dp_shard x cp): its dimensions on the mesh
  // it was flattened from, each sharding dim 0 (row-major, as the view's
  // ranks are), the shard itself the run computed below.
  auto root = u.mesh->root();
  std::vector<std::string> fsdp_dims = u.mesh->dim_names();
  if (auto source = u.mesh->flattened_from()) root = source->root(), fsdp_dims = u.mesh->flattened_dims();
  const auto fsdp_has = [&](const std::string& dim) {
    return std::find(fsdp_dims.begin(), fsdp_dims.end(), dim) != fsdp_dims.end();
  };
  EMBER_CHECK(tp.mesh->root() == root, "fully_shard(", u.type, "): parameter '", name,
              "' is sharded by tensor parallelism on ", tp.mesh->to_string(), " but FSDP's mesh ", u.mesh->to_string(),
              " is not cut from the same DeviceMesh; make one mesh (e.g. (dp_shard, tp)) and pass its sub-meshes to ",
              "parallelize_module and fully_shard");
  // The dimensions that lay the tensor out: FSDP's and tensor
  // parallelism's. Another dimension of the mesh (pp: other stages hold
  // other tensors) is none of this tensor's business, and norms and
  // checkpoints must not combine over it.
  std::vector<std::string> dims;
  for (const std::string& dim : root->dim_names())
    if (fsdp_has(dim) || tp.mesh->has_dim(dim)) dims.push_back(dim);
  std::shared_ptr<DeviceMesh> mesh = dims.size() == static_cast<size_t>(root->ndim())
                                         ? std::const_pointer_cast<DeviceMesh>(root)
                                         : root->submesh(dims);
  auto spec = std::make_shared<DTensorSpec>();
  spec->mesh = mesh;
  spec->global_shape = tp.global_shape;
  spec->mesh_dims = mesh->dim_names();
  spec->mesh_shape = mesh->shape();
  spec->coord = mesh->coordinate();
  for (const std::string& dim : mesh->dim_names()) {
    Placement p = Replicate();
    if (fsdp_has(dim)) {
      const bool shards = u.strategy == ShardingStrategy::HYBRID_SHARD && u.mesh->has_dim(dim)
                              ? u.mesh->dim_index(dim) == 1
                              : u.strategy != ShardingStrategy::NO_SHARD;
      if (shards) p = Shard(0);
    } else if (tp.mesh->has_dim(dim)) {
      p = tp.placements[tp.mesh->dim_index(dim)];
    }
    spec->placements.push_back(p);
  }
  run_through(*spec, tp, pc);
  spec->layout = "fsdp:" + layout + "+tensor_parallel";
  spec->writes = tp.writes && replica == 0 && (u.layout.entries()[i].numel > 0 || u.shard_rank == 0);
  attach_shard_data(*spec, up, i);
  return spec;
}

// A parameter expert parallelism split over its ep view and FSDP shards
// again over dp_shard_mod_ep (or replicates over dp_replicate): its
// regions the run of this rank's FSDP shard through the expert split's
// boxes; its norm's partial sums combined over the split's mesh, then over
// FSDP's groups (a replica that does not write adds nothing); written
// where both would write.
struct ExpertShardSpec : ShardSpec {
  std::shared_ptr<const DTensorSpec> inner;
  std::shared_ptr<ProcessGroup> shard_pg, replicate_pg;
  const void* domain = nullptr;
  bool counts_in_norm() const override { return writes; }
  const void* norm_domain() const override { return domain; }
  void reduce_norm_partial(const Tensor& partial, bool max) const override {
    inner->reduce_norm_partial(partial, max);
    for (const auto* g : {&shard_pg, &replicate_pg})
      if (*g) grad_norm_allreduce(*g, max ? INFINITY : 2.0)(partial);
  }
};

std::shared_ptr<const ShardSpec> compose_with_expert_parallel(const std::shared_ptr<Unit>& up, size_t i,
                                                              const std::shared_ptr<const DTensorSpec>& ep,
                                                              const FlatBuffer::Piece* pc, const std::string& layout,
                                                              int replica) {
  const Unit& u = *up;
  auto spec = std::make_shared<ExpertShardSpec>();
  spec->inner = ep;
  spec->shard_pg = u.shard_pg;
  spec->replicate_pg = u.replicate_pg;
  spec->domain = u.mesh.get();
  spec->global_shape = ep->global_shape;
  // The dimension FSDP adds: its shards over dp_shard_mod_ep, or NO_SHARD's
  // replicas over dp_replicate.
  const bool replicas = u.shard_size == 1 && u.replicate_pg != nullptr;
  spec->mesh_dims = ep->mesh_dims;
  spec->mesh_dims.push_back(replicas ? "dp_replicate" : "dp_shard_mod_ep");
  spec->mesh_shape = ep->mesh_shape;
  spec->mesh_shape.push_back(replicas ? u.replicate_pg->size() : u.shard_size);
  spec->coord = ep->coord;
  spec->coord.push_back(replicas ? replica : u.shard_rank);
  spec->placements = ep->placements;
  spec->placements.push_back(replicas ? Placement(Replicate()) : Placement(Shard(0)));
  run_through(*spec, *ep, pc);
  spec->layout = "fsdp:" + layout + "+expert_parallel";
  spec->writes = ep->writes && replica == 0 && (u.layout.entries()[i].numel > 0 || u.shard_rank == 0);
  attach_shard_data(*spec, up, i);
  return spec;
}

}  // namespace

namespace fsdp_internal {

// Says on each parameter what this rank holds of it (sharding vocabulary),
// so checkpoints and norms need nothing of FSDP's: the run of the entry in
// this rank's shard of the flat buffer, over a (dp_replicate, dp_shard)
// mesh; of replicas, replicate rank 0 writes (attach_shard_data: where the
// region's data lives).
void attach_shard_specs(const std::shared_ptr<Unit>& u) {
  std::string layout = strategy_name(u->strategy);
  for (char& c : layout) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const int replicas = u->replicate_pg ? u->replicate_pg->size() : 1;
  const int replica = u->replicate_pg ? u->replicate_pg->rank() : 0;
  for (size_t i = 0; i < u->params.size(); ++i) {
    const FlatEntry& e = u->layout.entries()[i];
    const FlatBuffer::Piece* pc = nullptr;
    for (const auto& piece : u->pieces)
      if (piece.entry == i) pc = &piece;
    if (auto tp = std::dynamic_pointer_cast<const DTensorSpec>(shard_spec_ptr(u->params[i]))) {
      if (tp->layout == "expert_parallel")
        set_shard_spec(u->params[i], compose_with_expert_parallel(u, i, tp, pc, layout, replica));
      else
        set_shard_spec(u->params[i], compose_with_tensor_parallel(u, i, *tp, pc, layout, replica));
      continue;
    }
    auto spec = std::make_shared<FsdpShardSpec>();
    spec->shard_pg = u->shard_pg;
    spec->replicate_pg = u->replicate_pg;
    spec->domain = u->mesh.get();
    spec->global_shape = e.shape;
    spec->mesh_dims = {"dp_replicate", "dp_shard"};
    spec->mesh_shape = {replicas, u->shard_size};
    spec->coord = {replica, u->shard_rank};
    spec->placements = {Replicate(), Shard(0)};
    spec->layout = "fsdp:" + layout;
    spec->region = pc ? run_region(e.shape, pc->entry_offset, pc->numel) : run_region(e.shape, 0, 0);
    // An entry of no elements is in no shard: shard rank 0 registers it.
    spec->writes = replica == 0 && (e.numel > 0 || u->shard_rank == 0);
    attach_shard_data(*spec, u, i);
    set_shard_spec(u->params[i], std::move(spec));
  }
}

}  // namespace fsdp_internal
}  // namespace ember::distributed
