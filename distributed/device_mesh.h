// DeviceMesh: the job's ranks as an N-D array with named dimensions, the
// coordinate system every parallelism speaks (torch's init_device_mesh).
//
//   auto mesh = DeviceMesh::create({2, 2, 2}, {"pp", "dp", "tp"});  // every rank
//   mesh->group("tp")->allreduce(partial_sums);    // the ranks differing only in "tp"
//   int stage = mesh->coordinate("pp");
//   auto dp_tp = mesh->submesh({"dp", "tp"});      // this rank's 2x2 slice
//
// Ranks lie in row-major order: the last dimension varies fastest, so with
// the conventional order (pp outermost, tp innermost) a tensor-parallel
// group is consecutive ranks, the ones on one host. create() is collective
// over the default group: every rank checks that every other rank asked for
// the same mesh (an error naming the dimension otherwise), then one process
// group per slice of each dimension is made, once; sub-meshes share them.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "distributed/comm/process_group.h"

namespace ember::distributed {

class DeviceMesh : public std::enable_shared_from_this<DeviceMesh> {
 public:
  // Collective: every rank of the default group calls it with the same
  // shape and names; the product of the shape is the world size. `backend`
  // ("gloo", "nccl"; empty: the default group's) for the dimensions' groups.
  static std::shared_ptr<DeviceMesh> create(const std::vector<int>& shape, const std::vector<std::string>& names,
                                            const std::string& backend = "");

  // A one-dimensional mesh over an existing group (torch's
  // DeviceMesh.from_group): not collective, makes no group.
  static std::shared_ptr<DeviceMesh> from_group(std::shared_ptr<ProcessGroup> group, const std::string& name);

  int ndim() const { return static_cast<int>(shape_.size()); }
  const std::vector<int>& shape() const { return shape_; }
  const std::vector<std::string>& dim_names() const { return names_; }
  // Ranks in the mesh, and along one dimension.
  int size() const;
  int size(const std::string& dim) const { return shape_[dim_index(dim)]; }
  // The index of the dimension called `dim`; an error listing the mesh's
  // dimensions when there is none.
  int dim_index(const std::string& dim) const;
  bool has_dim(const std::string& dim) const;

  // The group of the ranks that share this rank's coordinates on every other
  // dimension (its slice along `dim`); group ranks follow the coordinate.
  const std::shared_ptr<ProcessGroup>& group(const std::string& dim) const { return groups_[dim_index(dim)]; }
  const std::shared_ptr<ProcessGroup>& group(int dim) const;
  // The group of a one-dimensional mesh.
  const std::shared_ptr<ProcessGroup>& group() const;

  // This rank's coordinate, on every dimension or on one.
  const std::vector<int>& coordinate() const { return coord_; }
  int coordinate(const std::string& dim) const { return coord_[dim_index(dim)]; }
  // This rank's rank in the default group.
  int global_rank() const { return global_rank_; }
  // The default group's ranks of the mesh, row-major.
  const std::vector<int>& ranks() const { return ranks_; }
  // The global rank at `coord` (one entry per dimension).
  int rank_at(const std::vector<int>& coord) const;
  // The coordinate of the mesh's `index`-th rank (row-major; rank_at's inverse).
  std::vector<int> coordinate_of(int index) const;

  // The mesh over `dims` (in that order) through this rank: the ranks that
  // share its coordinates on the other dimensions (torch's mesh["dp", "tp"]).
  // Not collective: it reuses the dimensions' groups. The same dims cut
  // from the same mesh object give the same object while it is in use, so
  // whatever keys on a mesh (norm domains: one reduction per mesh) sees one.
  // A flattened view registered by flatten() is found by its name too
  // (submesh({"dp"})), as torch's mesh["dp"] after _flatten("dp").
  std::shared_ptr<DeviceMesh> submesh(const std::vector<std::string>& dims) const;

  // A one-dimensional view named `name` over `dims` taken together (row-major
  // in the order given): the ranks that share this rank's coordinates on the
  // other dimensions (torch's mesh[dims]._flatten(name)). What transforms
  // need when a group spans several dimensions: data loading over
  // dp_replicate x dp_shard, FSDP over dp_shard x cp. Collective over the
  // default group when two or more of `dims` have more than one rank (a new
  // group per slice, made by every rank in the same order, over the default
  // backend); otherwise it reuses that dimension's group. Only on a mesh
  // made by create(), once per name. The
  // view is its own root (DTensors are not described on it) and is
  // registered on this mesh under `name`.
  std::shared_ptr<DeviceMesh> flatten(const std::vector<std::string>& dims, const std::string& name);
  // The same over an explicit partition of the mesh's ranks into equal
  // groups (every rank passes the same partition): for views that are not a
  // product of whole dimensions, such as expert parallelism borrowing part
  // of dp_shard.
  std::shared_ptr<DeviceMesh> flatten(const std::string& name, const std::vector<std::vector<int>>& partition);
  // The flattened view registered under `name`, or null.
  std::shared_ptr<DeviceMesh> flattened(const std::string& name) const;
  // For a view flatten(dims, name) made: the mesh it was made on and those
  // dims (FSDP over dp_shard x cp composed with tensor parallelism
  // describes a parameter on that mesh); null and empty otherwise.
  std::shared_ptr<const DeviceMesh> flattened_from() const { return flat_source_.lock(); }
  const std::vector<std::string>& flattened_dims() const { return flat_dims_; }

  // The mesh this one was cut from by submesh (through any number of
  // cuts), or this mesh: where parallelisms applied to different
  // sub-meshes (FSDP on dp_shard, tensor parallelism on tp) meet, so a
  // parameter they both shard is described on one mesh.
  std::shared_ptr<const DeviceMesh> root() const;

  // "DeviceMesh(pp=2, dp=2, tp=2)".
  std::string to_string() const;

 private:
  DeviceMesh() = default;
  std::vector<int> shape_;
  std::vector<std::string> names_;
  std::vector<int> ranks_;  // global ranks, row-major
  std::vector<int> coord_;
  int global_rank_ = 0;
  std::vector<std::shared_ptr<ProcessGroup>> groups_;
  std::shared_ptr<const DeviceMesh> root_;  // null: this is a root
  // submesh's results by dims, weakly (a sub-mesh holds its root).
  mutable std::mutex sub_mu_;
  mutable std::map<std::vector<std::string>, std::weak_ptr<DeviceMesh>> subs_;
  std::map<std::string, std::shared_ptr<DeviceMesh>> flats_;  // flatten()'s views, by name
  std::weak_ptr<const DeviceMesh> flat_source_;               // weak: the source holds its views
  std::vector<std::string> flat_dims_;
  void check_flatten_name(const std::string& name) const;
  // The indices of `dims`, each named once (`what` names the caller in errors).
  std::vector<int> dim_indices(const std::vector<std::string>& dims, const char* what) const;
  // The ranks at every coordinate of the dimensions `idx` (row-major in
  // that order), the other dimensions fixed at `c`'s.
  std::vector<int> slice_ranks(const std::vector<int>& idx, std::vector<int> c) const;
};

// Checks a mesh's shape and names without making it (the same checks and
// messages as create): sizes >= 1, one unique non-empty name per dimension,
// product == world_size.
void check_mesh_shape(const std::vector<int>& shape, const std::vector<std::string>& names, int world_size);

}  // namespace ember::distributed
