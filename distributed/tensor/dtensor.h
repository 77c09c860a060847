// Distributed tensors (torch.distributed.tensor.DTensor): a local tensor plus
// the mesh, the placements and the global shape that say which part of one
// global tensor it is. Built on the sharding vocabulary (placements, the
// chunk rule, ShardSpec) and the mesh; parallelisms hand DTensors around,
// and a tensor that carries a DTensorSpec (a parameter under tensor
// parallelism, a module output left sharded) is one again via as_dtensor.
//
//   auto mesh = DeviceMesh::create({2, 2}, {"dp", "tp"});
//   DTensor w = distribute_tensor(weight, mesh, {Replicate(), Shard(0)});
//   DTensor r = w.redistribute({Shard(1), Shard(1)});   // any placements to any
//   Tensor whole = w.full_tensor();                     // every rank: the global tensor
//
// Conversions, one mesh dimension at a time (mesh-dimension groups):
//   Shard(d)  -> Replicate   all-gather along d (uneven chunks padded, then cut)
//   Partial   -> Replicate   all-reduce
//   Partial   -> Shard(d)    reduce-scatter along d
//   Shard(a)  -> Shard(b)    all-to-all
//   Replicate -> Shard(d)    this rank's chunk (no communication)
//   Replicate -> Partial     rank 0 of the dimension keeps the value, the others 0 (sum)
// Sizes that do not divide follow torch.chunk: chunks of ceil(n / k), the
// last ones short or empty.
//
// Gradients. redistribute is differentiable: its backward converts the
// gradient back to the source placements (a Partial source gets a
// Replicate gradient: each addend's gradient is the whole one). The
// gradient's own placements are those of the output (Partial read as
// Replicate) unless `grad_placements` says otherwise, as torch's
// to_local(grad_placements=...): where a replicated activation feeds a
// computation with sharded weights, its gradient arrives Partial (each
// rank holds the part its weights see), and the conversion into that
// region says so. That is how Megatron's identity/all-reduce pair and
// sequence parallelism's all-gather/reduce-scatter pair are the same call.
//
// The loss convention is tensor parallelism's: every rank of the mesh
// computes the same (replicated) loss, and gradients are of that one loss.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "distributed/device_mesh.h"
#include "distributed/sharding/shard_spec.h"

namespace ember::distributed {

// A ShardSpec that also holds the mesh, so the tensor carrying it can be
// redistributed (the sharding vocabulary itself stays below the mesh).
struct DTensorSpec : ShardSpec {
  std::shared_ptr<DeviceMesh> mesh;
  // Norms over the global tensor: one holder of each element counts it,
  // and the partial sums combine over the whole mesh.
  bool counts_in_norm() const override { return writes; }
  const void* norm_domain() const override { return mesh.get(); }
  void reduce_norm_partial(const Tensor& partial, bool max) const override;
};

// The spec of a DTensor of `global_shape` with `placements` on `mesh`, at
// this rank: its region by the chunk rule, written by the rank at
// coordinate 0 of every dimension that does not shard it.
std::shared_ptr<const DTensorSpec> make_dtensor_spec(const std::shared_ptr<DeviceMesh>& mesh,
                                                     const std::vector<Placement>& placements,
                                                     const Shape& global_shape, const std::string& layout = "dtensor");

// This rank's local shape of a tensor of `global_shape` laid out by
// `placements` on `mesh`.
Shape local_shape(const Shape& global_shape, const DeviceMesh& mesh, const std::vector<Placement>& placements);

class DTensor {
 public:
  DTensor() = default;
  // `local` is this rank's part; `spec` says of what (checked: the local
  // shape is the spec's).
  DTensor(Tensor local, std::shared_ptr<const DTensorSpec> spec);

  bool defined() const { return local_.defined(); }
  const Tensor& to_local() const { return local_; }
  const std::shared_ptr<DeviceMesh>& device_mesh() const { return spec_->mesh; }
  const std::vector<Placement>& placements() const { return spec_->placements; }
  const Shape& shape() const { return spec_->global_shape; }
  int64_t dim() const { return static_cast<int64_t>(spec_->global_shape.size()); }
  DType dtype() const { return local_.dtype(); }
  const std::shared_ptr<const DTensorSpec>& spec() const { return spec_; }

  // The same global tensor laid out by `placements` (one per mesh
  // dimension). Collective over the mesh dimensions that change; see the
  // top of this file for the collectives and the gradient.
  DTensor redistribute(const std::vector<Placement>& placements,
                       const std::optional<std::vector<Placement>>& grad_placements = std::nullopt) const;
  // The global tensor on every rank (redistribute to all Replicate).
  Tensor full_tensor(const std::optional<std::vector<Placement>>& grad_placements = std::nullopt) const;

  // The local tensor with this DTensor's spec attached (an alias when
  // `local` already carries another spec, so nothing else changes): what a
  // module returns to leave its output sharded; as_dtensor() reads it back.
  Tensor as_annotated_tensor() const;

  // "DTensor([8, 6] [Shard(0), Replicate()] on DeviceMesh(dp=2, tp=2), local [4, 6])".
  std::string to_string() const;

 private:
  Tensor local_;
  std::shared_ptr<const DTensorSpec> spec_;
};

// Every rank passes the whole `tensor` (the same shape and dtype); the
// result holds this rank's part of it. `src_data_rank` (a global rank, by
// default the mesh's first) broadcasts its values first so all ranks
// agree; -1 skips that when the caller knows they do (parameters drawn
// from one seed). As torch's, the result is a new leaf, requiring grad when
// `tensor` does.
DTensor distribute_tensor(const Tensor& tensor, const std::shared_ptr<DeviceMesh>& mesh,
                          const std::vector<Placement>& placements, int src_data_rank = -2);

// A DTensor over this rank's `local` part. Without `global_shape` every
// Shard(d) is taken to split evenly (global size = local size times the
// shards), as torch's from_local; with it, sizes that do not divide are
// allowed and the local shape is checked against the chunk rule (an error
// naming the rank and both shapes). Keeps `local`'s autograd identity.
DTensor from_local(const Tensor& local, const std::shared_ptr<DeviceMesh>& mesh,
                   const std::vector<Placement>& placements, const std::optional<Shape>& global_shape = std::nullopt);

// Whether `t` carries a DTensorSpec, and the DTensor it is (an error naming
// the tensor's shape when it carries none).
bool is_dtensor(const Tensor& t);
DTensor as_dtensor(const Tensor& t);

}  // namespace ember::distributed
