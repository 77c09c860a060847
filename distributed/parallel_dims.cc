// ParallelDims (parallel_dims.h): resolving "-1", the checks with their
// named errors, the mesh in its one order and its flattened views.
#include "distributed/parallel_dims.h"

#include <utility>

#include "core/exception.h"
#include "distributed/init.h"

namespace ember::distributed {

namespace {

// "dp_shard=3 x tp=2": the named degrees of more than one rank (or the one
// asked for), as an error shows them.
std::string product(const std::vector<std::pair<const char*, int>>& dims) {
  std::string out;
  for (const auto& [name, v] : dims)
    if (v != 1 && v != -1) out += (out.empty() ? "" : " x ") + std::string(name) + "=" + std::to_string(v);
  return out.empty() ? "every degree 1" : out;
}

std::vector<std::pair<const char*, int>> degrees(const ParallelDims& d) {
  return {{"pp", d.pp}, {"dp_replicate", d.dp_replicate}, {"dp_shard", d.dp_shard}, {"cp", d.cp}, {"tp", d.tp}};
}

}  // namespace

void ParallelDims::check_degrees() const {
  std::string rest;
  for (const auto& [name, v] : degrees(*this)) {
    EMBER_CHECK(v >= 1 || v == -1, "ParallelDims: ", name, "=", v,
                " (a degree is a positive size, or -1 for the rest)");
    if (v == -1) rest += (rest.empty() ? "" : " and ") + std::string(name);
  }
  EMBER_CHECK(ep >= 1, "ParallelDims: ep=", ep, " (expert parallelism takes a positive size)");
  EMBER_CHECK(rest.find(" and ") == std::string::npos, "ParallelDims: ", rest,
              " are both -1; at most one degree takes the rest");
}

void ParallelDims::check_experts(int64_t num_experts) const {
  EMBER_CHECK(ep == 1 || num_experts > 0, "ParallelDims: ep=", ep,
              " but the model has no mixture-of-experts layer (give it experts, or leave ep at 1)");
  EMBER_CHECK(num_experts == 0 || num_experts % ep == 0, "ParallelDims: ep=", ep, " does not divide the model's ",
              num_experts, " experts per MoE layer");
}

ParallelDims ParallelDims::resolved(int world) const {
  EMBER_CHECK(world >= 1, "ParallelDims: a world of ", world, " ranks");
  check_degrees();
  ParallelDims d = *this;
  int known = 1;
  for (const auto& [name, v] : degrees(d))
    if (v != -1) known *= v;
  EMBER_CHECK(world % known == 0, "ParallelDims: ", product(degrees(d)), " does not divide a world of ", world);
  for (int* v : {&d.pp, &d.dp_replicate, &d.dp_shard, &d.cp, &d.tp})
    if (*v == -1) *v = world / known;
  d.validate(world);
  return d;
}

void ParallelDims::validate(int world) const {
  for (const auto& [name, v] : degrees(*this))
    EMBER_CHECK(v >= 1, "ParallelDims: ", name, "=", v, " is unresolved or not a size (resolved(world) first)");
  EMBER_CHECK(this->world() == world, "ParallelDims: ", product(degrees(*this)), " makes ", this->world(),
              " ranks, not a world of ", world);
  EMBER_CHECK(ep >= 1, "ParallelDims: ep=", ep, " (expert parallelism takes a positive size)");
  EMBER_CHECK(ep == 1 || dp_shard_cp() % ep == 0, "ParallelDims: ep=", ep,
              " is borrowed from dp_shard x cp = ", dp_shard_cp(), " and must divide it");
  EMBER_CHECK(ep == 1 || ep % cp == 0, "ParallelDims: ep=", ep, " must be a multiple of cp=", cp,
              " (an expert group spans whole context-parallel groups)");
}

std::vector<std::string> ParallelDims::mesh_dim_names() const {
  std::vector<std::string> names;
  if (pp > 1) names.push_back("pp");
  names.insert(names.end(), {"dp_replicate", "dp_shard"});
  if (cp > 1) names.push_back("cp");
  names.push_back("tp");
  return names;
}

std::vector<int> ParallelDims::mesh_shape() const {
  std::vector<int> shape;
  if (pp > 1) shape.push_back(pp);
  shape.insert(shape.end(), {dp_replicate, dp_shard});
  if (cp > 1) shape.push_back(cp);
  shape.push_back(tp);
  return shape;
}

std::shared_ptr<DeviceMesh> ParallelDims::build_mesh() const {
  EMBER_CHECK(is_initialized(), "ParallelDims::build_mesh: init_process_group() has not run");
  validate(default_group()->size());  // before any group is made
  auto mesh = DeviceMesh::create(mesh_shape(), mesh_dim_names());
  // The views, every rank in the same order (each may make groups).
  mesh->flatten({"dp_replicate", "dp_shard"}, "dp");
  if (cp > 1) {
    mesh->flatten({"dp_shard", "cp"}, "dp_shard_cp");
    mesh->flatten({"dp_replicate", "dp_shard", "cp"}, "dp_cp");
  }
  if (ep > 1 && ep == dp_shard_cp()) {
    // The whole of dp_shard x cp: a product of whole dimensions, so a
    // parameter expert parallelism splits is described on the mesh with
    // them (composing with tensor parallelism's tp).
    mesh->flatten(cp > 1 ? std::vector<std::string>{"dp_shard", "cp"} : std::vector<std::string>{"dp_shard"}, "ep");
  } else if (ep > 1) {
    // ep ranks: ep / cp consecutive dp_shard coordinates times the whole cp
    // group, the other coordinates fixed (torchtitan's dp_shard_in_ep x cp).
    const int in_ep = ep / cp;
    std::vector<std::vector<int>> partition;
    const int ds = mesh->dim_index("dp_shard"), cd = cp > 1 ? mesh->dim_index("cp") : -1;
    for (int i = 0; i < mesh->size(); ++i) {
      // A group is listed once, at its first rank (dp_shard % in_ep == 0, cp == 0).
      const std::vector<int> c = mesh->coordinate_of(i);
      if (c[ds] % in_ep != 0 || (cd >= 0 && c[cd] != 0)) continue;
      std::vector<int> members;
      std::vector<int> m = c;
      for (int k = 0; k < in_ep; ++k)
        for (int j = 0; j < cp; ++j) {
          m[ds] = c[ds] + k;
          if (cd >= 0) m[cd] = j;
          members.push_back(mesh->rank_at(m));
        }
      partition.push_back(std::move(members));
    }
    mesh->flatten("ep", partition);
    // The ranks holding the same experts: one per ep group, the same place
    // in each (torchtitan's dp_shard_mod_ep), over which FSDP shards them.
    std::vector<std::vector<int>> mod;
    for (int i = 0; i < mesh->size(); ++i) {
      const std::vector<int> c = mesh->coordinate_of(i);
      if (c[ds] >= in_ep) continue;  // listed at the first group's ranks
      std::vector<int> members, m = c;
      for (int g = 0; g < dp_shard / in_ep; ++g) {
        m[ds] = g * in_ep + c[ds];
        members.push_back(mesh->rank_at(m));
      }
      mod.push_back(std::move(members));
    }
    mesh->flatten("dp_shard_mod_ep", mod);
  }
  return mesh;
}

std::shared_ptr<DeviceMesh> ParallelDims::fsdp_mesh(const DeviceMesh& mesh) const {
  const std::string shard = cp > 1 ? "dp_shard_cp" : "dp_shard";
  if (dp_replicate > 1) {
    EMBER_CHECK(cp == 1, "ParallelDims: HSDP (dp_replicate=", dp_replicate, ") with cp=", cp,
                " needs a 2-D mesh over a flattened dimension, which DeviceMesh does not cut yet");
    return mesh.submesh({"dp_replicate", "dp_shard"});
  }
  // dp_shard 1: FSDP's ranks are cp's, and cp's own dimension (cut from the
  // mesh, unlike a flattened view) lets it compose with tensor parallelism.
  if (cp > 1 && dp_shard == 1) return mesh.submesh({"cp"});
  return mesh.submesh({shard});
}

int ParallelDims::dp_rank(const DeviceMesh& mesh) const {
  return mesh.coordinate("dp_replicate") * dp_shard + mesh.coordinate("dp_shard");
}

const std::vector<ParallelDims::Flag>& ParallelDims::flags() {
  static const std::vector<Flag> table = {
      {"--pp", &ParallelDims::pp, 1, "P", "pipeline parallelism over P ranks (the mesh's outermost dimension)"},
      {"--dp-replicate", &ParallelDims::dp_replicate, -1, "R", "replicas (DDP, or HSDP with --dp-shard); -1: the rest"},
      {"--dp-shard", &ParallelDims::dp_shard, -1, "S", "FSDP's sharding over S ranks; -1: the rest"},
      {"--cp", &ParallelDims::cp, 1, "C",
       "context parallelism: each sequence split over C ranks (head-tail chunks; FSDP shards over dp_shard x cp)"},
      {"--tp", &ParallelDims::tp, -1, "T", "tensor parallelism over T ranks (the innermost dimension); -1: the rest"},
      {"--ep", &ParallelDims::ep, 1, "E",
       "expert parallelism: each MoE layer's experts split over E ranks borrowed from dp_shard x cp"},
  };
  return table;
}

std::string ParallelDims::str() const {
  std::string out = "dp_replicate=" + std::to_string(dp_replicate) + " dp_shard=" + std::to_string(dp_shard) +
                    " tp=" + std::to_string(tp) + " pp=" + std::to_string(pp);
  if (cp != 1) out += " cp=" + std::to_string(cp);
  if (ep != 1) out += " ep=" + std::to_string(ep);
  return out;
}

std::string ParallelDims::line() const {
  std::string out = "mesh";
  if (pp > 1) out += " pp=" + std::to_string(pp);
  if (dp_replicate > 1) out += " dp_replicate=" + std::to_string(dp_replicate);
  if (dp_shard > 1 || (dp_replicate == 1 && cp == 1 && tp == 1 && pp == 1))
    out += " dp_shard=" + std::to_string(dp_shard);
  if (cp > 1) out += " cp=" + std::to_string(cp);
  if (tp > 1) out += " tp=" + std::to_string(tp);
  if (ep > 1) out += " ep=" + std::to_string(ep);
  return out;
}

}  // namespace ember::distributed
