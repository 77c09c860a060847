// The sharding vocabulary: how one tensor is laid out across a mesh of
// ranks, said the same way by every parallelism and read by everything
// that must not know which parallelism made it (checkpoints, norms).
//
//   Placements (torch's DTensor): per mesh dimension, Shard(dim) splits
//   tensor dimension `dim` into chunks by torch's chunk rule (chunks of
//   ceil(n / k), the last ones short or empty), Replicate() keeps it
//   whole, Partial(sum|avg) means each rank holds an addend.
//
//   A Region is what one rank holds: an N-D box of the global tensor plus
//   a run of that box's row-major flattening. A Shard(1) of a matrix is a
//   box of columns with the whole box as its run; FSDP's flat shard of a
//   parameter is a run of elements, its box the rows the run touches. A
//   checkpoint piece is a Region too: one description for holding, writing
//   and reading.
//
//   A ShardSpec (global shape, placements and the mesh they refer to, this
//   rank's Region, whether it writes that Region) is attached to the
//   parameter itself, as autograd's metadata is: owned by no parallelism.
//
// Depends on core only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace ember::distributed {

struct Placement {
  enum class Kind { Shard, Replicate, Partial };
  enum class Reduce { Sum, Avg };
  Kind kind = Kind::Replicate;
  int dim = -1;                 // Shard: the tensor dimension split
  Reduce reduce = Reduce::Sum;  // Partial: how the addends combine
  // Shard: the dimension is `groups` equal blocks stacked, each split by
  // the chunk rule, and a rank holds its chunk of every block, in order
  // (a stacked q, k, v projection split by heads; torch's _StridedShard).
  int groups = 1;
  bool is_shard() const { return kind == Kind::Shard; }
  bool is_replicate() const { return kind == Kind::Replicate; }
  bool is_partial() const { return kind == Kind::Partial; }
  bool operator==(const Placement& o) const {
    return kind == o.kind && (kind != Kind::Shard || (dim == o.dim && groups == o.groups)) &&
           (kind != Kind::Partial || reduce == o.reduce);
  }
  bool operator!=(const Placement& o) const { return !(*this == o); }
  // "Shard(0)", "Shard(0, groups=3)", "Replicate()", "Partial(sum)".
  std::string to_string() const;
};
Placement Shard(int dim, int groups = 1);
Placement Replicate();
Placement Partial(Placement::Reduce reduce = Placement::Reduce::Sum);
// "[Shard(0), Replicate()]".
std::string placements_string(const std::vector<Placement>& placements);

// A box of a tensor: offsets and lengths per dimension (empty vectors for a
// 0-d tensor, whose one element every box holds).
struct Box {
  Shape offsets, lengths;
  int64_t numel() const;
  bool operator==(const Box& o) const { return offsets == o.offsets && lengths == o.lengths; }
  // "[0:4, 2:4]".
  std::string to_string() const;
};
Box whole_box(const Shape& shape);
// The boxes' common part (lengths 0 where they do not meet).
Box intersect(const Box& a, const Box& b);

// Elements [begin, begin + numel) of `box`'s row-major flattening.
struct Region {
  Box box;
  int64_t begin = 0, numel = 0;
  std::string to_string() const;  // "[0:4, 2:4] elements 0..8"
};
// The whole tensor.
Region whole_region(const Shape& shape);
// Elements [begin, begin + numel) of the whole tensor's row-major
// flattening, as the rows of dimension 0 they touch and the run within
// them (what a flat shard of a parameter holds).
Region run_region(const Shape& shape, int64_t begin, int64_t numel);
// What `placements` on a mesh of `mesh_shape` give the rank at `coord`:
// each Shard(d) splits the box's current extent along d by torch's chunk
// rule, mesh dimensions in order (so two Shard(0) split the chunks again);
// the run is the whole box.
Region chunk_region(const Shape& shape, const std::vector<int>& mesh_shape, const std::vector<int>& coord,
                    const std::vector<Placement>& placements);
// chunk_region for placements that may hold a grouped shard (one tensor
// dimension at most): one region per block this rank holds a chunk of, in
// the order its data holds them; a single region otherwise.
std::vector<Region> chunk_regions(const Shape& shape, const std::vector<int>& mesh_shape, const std::vector<int>& coord,
                                  const std::vector<Placement>& placements);
// Checks `r` lies inside a tensor of `shape` (box inside, run inside the
// box); an error naming `what` otherwise.
void check_region(const Shape& shape, const Region& r, const std::string& what);

// How many elements `a` and `b` (regions of a tensor of `shape`) share.
int64_t overlap(const Shape& shape, const Region& a, const Region& b);
// Copies the elements `src` and `dst` share: src_data holds src's run (its
// numel elements in order), dst_data dst's; `element_size` bytes each.
// Returns the elements copied. Contiguous stretches common to both are one
// memcpy each: equal layouts are one copy, rows are one copy per row.
int64_t copy_overlap(const Shape& shape, const Region& src, const void* src_data, const Region& dst, void* dst_data,
                     size_t element_size);

// The region is what a rank holds; the placements say which mesh dimensions
// shard and replicate the tensor. For a layout the chunk rule makes
// (tensor parallelism) the region is chunk_region's; a flat shard (FSDP's
// run of its padded flat buffer) declares Shard(0) on its shard dimension
// and a run_region: the region, not the chunk rule, is the truth.
struct ShardSpec : ShardMetaBase {
  Shape global_shape;
  // The mesh the placements refer to (dimension names and sizes) and this
  // rank's coordinate on it; for messages and //tools:ckpt inspect.
  std::vector<std::string> mesh_dims;
  std::vector<int> mesh_shape, coord;
  std::vector<Placement> placements;
  // What laid it out, for messages and checkpoint indexes ("fsdp:full_shard").
  std::string layout;
  // What this rank holds of the global tensor (the tensor's own data, or
  // local() when set, holds exactly region.numel elements in order).
  Region region;
  // A grouped shard holds several regions, its data their elements one
  // after another; `region` is then the first. Empty: just `region`.
  std::vector<Region> parts;
  // `parts`, or `region` alone.
  std::vector<Region> regions() const { return parts.empty() ? std::vector<Region>{region} : parts; }
  int64_t held_numel() const;
  // Whether this rank writes its region in a checkpoint: of ranks holding
  // the same region (replicas), exactly one does.
  bool writes = true;
  // The data of the region when the tensor's current data is something
  // else (FSDP while a unit is gathered: the parameter is then the whole
  // tensor in the compute dtype, its region the float32 shard). Null: the
  // tensor itself.
  std::function<Tensor()> local;
  // Called before a checkpoint load writes into local(), so the owner can
  // drop copies made from the old values (FSDP frees gathered parameters).
  std::function<void()> before_load;

  // "[Shard(0), Replicate()] on (dp=2, tp=2) at (1, 0): [2:4, 0:8] elements 0..16".
  std::string to_string() const;
};

// Attaches `spec` to `t` (every handle sharing its TensorImpl sees it; the
// spec is checked: region inside global_shape, one placement per mesh
// dimension). Null clears it.
void set_shard_spec(const Tensor& t, std::shared_ptr<const ShardSpec> spec);
// The spec attached to `t`, or null.
const ShardSpec* shard_spec(const Tensor& t);
std::shared_ptr<const ShardSpec> shard_spec_ptr(const Tensor& t);
// The data of what `t` holds of its global tensor: local() when the spec
// sets it, else `t`.
Tensor local_shard(const Tensor& t);

}  // namespace ember::distributed
