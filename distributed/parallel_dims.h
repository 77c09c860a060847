// ParallelDims: the one description of a job's parallel layout
// (torchtitan's name). Six degrees, whose product (ep aside) is the world:
//
//   pp            pipeline stages' ranks               (outermost)
//   dp_replicate  replicas: DDP, or HSDP's replica dimension
//   dp_shard      FSDP's sharding dimension
//   cp            context parallelism: a sequence split over ranks
//   tp            tensor (and sequence) parallelism     (innermost)
//   ep            expert parallelism, borrowed from dp_shard x cp (torchtitan's
//                 dp2ep): not a dimension of its own, a view over part of
//                 those ranks
//
//   ParallelDims dims{.dp_shard = -1, .tp = 2};          // -1: the rest
//   dims = dims.resolved(world);                         // dp_shard = world / 2
//   auto mesh = dims.build_mesh();                       // collective
//   parallelize_module(model, mesh->submesh({"tp"}), plan);
//   fully_shard(block, {.mesh = dims.fsdp_mesh(*mesh)});
//   int dp_rank = dims.dp_rank(*mesh);                   // the data loader's
//
// The mesh's dimensions, in this order: pp (when pp > 1), dp_replicate,
// dp_shard, cp (when cp > 1), tp. Row-major, so a tp group is consecutive
// ranks (one host's) and pp groups are farthest apart. The flattened views
// build_mesh registers on it (DeviceMesh::flatten; mesh->submesh({name})):
//
//   dp            dp_replicate x dp_shard: the data loader's ranks, the loss's mean
//   dp_shard_cp   dp_shard x cp: FSDP's shards when cp > 1 (a rank's
//                 sequence part still shards its parameters)
//   dp_cp         dp_replicate x dp_shard x cp: where gradients are reduced
//   ep            the ranks one expert group spans (ep > 1)
//   dp_shard_mod_ep  the ranks holding the same experts, one per ep group
//                 (ep > 1 and below dp_shard x cp): FSDP shards the experts
//                 over them
//
// A new kind of parallelism is one field here, its transform, and the
// planner's terms (docs/mesh.md, "Adding a dimension").
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "distributed/device_mesh.h"

namespace ember::distributed {

struct ParallelDims {
  int pp = 1;
  int dp_replicate = 1;
  int dp_shard = -1;  // -1: the ranks the others leave
  int cp = 1;
  int tp = 1;
  int ep = 1;

  // The degrees with -1 (at most one of pp, dp_replicate, dp_shard, cp, tp)
  // resolved against `world`, validated. Errors name the degrees:
  // "ParallelDims: dp_shard=3 x tp=2 does not divide a world of 8".
  ParallelDims resolved(int world) const;
  // Every degree >= 1, their product the world, ep dividing dp_shard x cp
  // (or equal to 1). Errors as resolved's.
  void validate(int world) const;
  // What can be checked before the world is known (a program's flags):
  // each degree positive or -1, at most one -1.
  void check_degrees() const;
  // A model of `num_experts` experts per MoE layer (0: none) on this
  // layout: ep divides them, "ParallelDims: ep=4 does not divide the
  // model's 6 experts per MoE layer"; ep > 1 without experts is an error too.
  void check_experts(int64_t num_experts) const;

  int world() const { return pp * dp_replicate * dp_shard * cp * tp; }
  int dp() const { return dp_replicate * dp_shard; }
  int dp_shard_cp() const { return dp_shard * cp; }
  int dp_cp() const { return dp_replicate * dp_shard * cp; }
  bool pp_enabled() const { return pp > 1; }
  bool tp_enabled() const { return tp > 1; }
  bool cp_enabled() const { return cp > 1; }
  bool ep_enabled() const { return ep > 1; }
  bool hsdp() const { return dp_replicate > 1 && dp_shard > 1; }

  // The mesh's dimensions and their sizes, in the order above.
  std::vector<std::string> mesh_dim_names() const;
  std::vector<int> mesh_shape() const;
  // Collective over the default group: the mesh of a resolved layout, with
  // the flattened views registered on it.
  std::shared_ptr<DeviceMesh> build_mesh() const;

  // The views transforms take, on a mesh build_mesh made.
  // FSDP's: dp_shard (dp_shard_cp when cp > 1), with dp_replicate in
  // front for HSDP (2-D: replicated along the first, sharded along the last).
  std::shared_ptr<DeviceMesh> fsdp_mesh(const DeviceMesh& mesh) const;
  // This rank's index among the data-parallel ranks (dp_replicate major).
  int dp_rank(const DeviceMesh& mesh) const;

  // "dp_replicate=1 dp_shard=2 tp=2 pp=2": every degree (cp and ep when
  // above 1), the planner's form.
  std::string str() const;
  // "mesh dp_shard=2 tp=2": the dimensions of more than one rank (dp_shard
  // when there is no other), the line a training program logs.
  std::string line() const;
  bool operator==(const ParallelDims&) const = default;

  // The degrees a program takes on its command line, by flag: every
  // program with a mesh (//examples:gpt through examples/flags.h,
  // //tools:plan) reads this one table, so a dimension's flag is its row
  // here.
  struct Flag {
    const char* name;  // "--dp-shard"
    int ParallelDims::*degree;
    int min;  // -1: "the rest" is accepted
    const char* metavar;
    const char* help;
  };
  static const std::vector<Flag>& flags();
};

}  // namespace ember::distributed
