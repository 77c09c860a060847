// Which pieces of the training state this rank holds and writes
// (sharded_layout.h), read off each tensor's ShardSpec or whole.
#include "distributed/checkpoint/sharded_layout.h"

#include <xxhash.h>

#include <sstream>
#include <unordered_set>

#include "distributed/checkpoint/sharded_internal.h"
#include "distributed/comm/object_collectives.h"

namespace ember::distributed::sharded_internal {
namespace {

uint64_t name_hash(const std::string& s) { return XXH64(s.data(), s.size(), 0); }

// `local` (the elements of p's regions in order) as held pieces, one per region.
void add_held(std::vector<Held>& out, const std::string& name, const Place& p, const Tensor& local) {
  if (p.regions.size() == 1) {
    out.push_back({name, p.shape, local.dtype(), p.regions[0], local, p.writer, p.placement});
    return;
  }
  Tensor flat = local.contiguous().view({-1});
  int64_t off = 0;
  for (const Region& r : p.regions) {
    if (r.numel > 0)
      out.push_back({name, p.shape, local.dtype(), r, flat.narrow(0, off, r.numel), p.writer, p.placement});
    off += r.numel;
  }
}

// "[Shard(0), Replicate()] on (dp_shard=2, tp=2), fsdp:full_shard".
std::string placement_text(const ShardSpec& spec) {
  std::string out = placements_string(spec.placements) + " on (";
  for (size_t d = 0; d < spec.mesh_dims.size(); ++d)
    out +=
        (d ? ", " : "") + spec.mesh_dims[d] + "=" + std::to_string(d < spec.mesh_shape.size() ? spec.mesh_shape[d] : 0);
  return out + ")" + (spec.layout.empty() ? "" : ", " + spec.layout);
}

}  // namespace

ModelLayout model_layout(nn::Module& model, ProcessGroup& pg) {
  ModelLayout out;
  const int rank = pg.rank(), world = pg.size();
  std::unordered_set<const TensorImpl*> params;
  for (const Tensor& p : model.parameters()) params.insert(p.impl_ptr().get());
  const nn::StateDict sd = model.state_dict();
  std::vector<Place> places;
  for (const auto& [name, t] : sd.items()) {
    Place p;
    if (const ShardSpec* spec = shard_spec(t)) {
      // Whoever sharded it says what this rank holds and whether it writes
      // it. A tensor of no elements is held by none: its writer registers
      // its shape.
      int64_t global = 1;
      for (int64_t d : spec->global_shape) global *= d;
      const bool holds = spec->held_numel() > 0 || (global == 0 && spec->writes);
      p = {name,           spec->global_shape, spec->regions(),      holds, holds && spec->writes,
           local_shard(t), spec->before_load,  placement_text(*spec)};
      if (out.description.empty()) out.description = spec->layout.empty() ? "sharded" : spec->layout;
    } else {
      p = {name, t.sizes(), {whole_region(t.sizes())}, true, true, t, nullptr, world > 1 ? "whole on its holders" : ""};
    }
    EMBER_CHECK(p.local.numel() == p.numel(), "save_sharded_checkpoint: '", name, "' holds ", p.local.numel(),
                " elements here, its shard spec's region ", p.numel());
    places.push_back(std::move(p));
  }
  if (world > 1) {
    // Ranks may hold different tensors (pipeline stages), and a tensor may
    // be laid out more than once (a tied weight on two stages, each
    // sharded over its own ranks): one all-gather of what each rank holds
    // whole (names) and would write of a sharded tensor (regions) chooses
    // one writer per element.
    //  - Whole: a parameter is written by one of its holders chosen by
    //    name, so that the writes spread over the ranks (DDP keeps the
    //    copies equal); a buffer by its first holder: buffers may differ
    //    between ranks (batch norm's running statistics), and rank 0's are
    //    the ones DDP broadcasts, so the ones training continues from.
    //  - Sharded: in rank order, a rank's regions are written unless they
    //    overlap what a lower rank writes. Each copy's ranks come in mesh
    //    order (pp outermost), so the copy of the lowest ranks is written
    //    whole and the others not at all; the index's check that every
    //    element is in exactly one piece holds any other case to it.
    std::ostringstream mine;
    for (size_t i = 0; i < places.size(); ++i) {
      const Place& p = places[i];
      if (!shard_spec(sd.items()[i].second)) {
        mine << "U\t" << p.name << "\n";
      } else if (!p.writer) {
        mine << "H\t" << p.name << "\n";  // in the model here: one rank's layout must not call it unexpected
      } else {
        mine << "S\t" << p.name;
        for (const Region& r : p.regions) {
          mine << "\t" << r.begin << ' ' << r.numel;
          for (size_t d = 0; d < r.box.offsets.size(); ++d) mine << ' ' << r.box.offsets[d] << ' ' << r.box.lengths[d];
        }
        mine << "\n";
      }
    }
    std::unordered_map<std::string, std::vector<int>> holders;
    std::unordered_map<std::string, std::vector<std::pair<int, std::vector<Region>>>> writers;
    const std::vector<std::string> all = allgather_strings(pg, mine.str());
    for (int r = 0; r < world; ++r) {
      std::istringstream in(all[r]);
      for (std::string line; std::getline(in, line);) {
        std::vector<std::string> f;
        for (std::istringstream ls(line); ls.good();) {
          std::string x;
          std::getline(ls, x, '\t');
          f.push_back(x);
        }
        if (f.size() < 2) continue;
        out.anywhere.insert(f[1]);
        if (f[0] == "H") continue;
        if (f[0] == "U") {
          holders[f[1]].push_back(r);
          continue;
        }
        std::vector<Region> rs;
        for (size_t k = 2; k < f.size(); ++k) {
          std::istringstream ns(f[k]);
          Region g;
          ns >> g.begin >> g.numel;
          for (int64_t o, l; ns >> o >> l;) g.box.offsets.push_back(o), g.box.lengths.push_back(l);
          rs.push_back(std::move(g));
        }
        writers[f[1]].emplace_back(r, std::move(rs));
      }
    }
    for (size_t i = 0; i < places.size(); ++i) {
      Place& p = places[i];
      if (auto h = holders.find(p.name); h != holders.end()) {
        const std::vector<int>& hs = h->second;
        const bool is_param = params.count(sd.items()[i].second.impl_ptr().get()) != 0;
        p.writer = is_param ? hs[name_hash(p.name) % hs.size()] == rank : hs.front() == rank;
      } else if (auto w = writers.find(p.name); p.writer && w != writers.end()) {
        std::vector<Region> taken;
        for (const auto& [r, rs] : w->second) {
          bool free = true;
          for (const Region& a : rs)
            for (const Region& b : taken) free = free && (a.numel == 0 || b.numel == 0 || overlap(p.shape, a, b) == 0);
          if (r == rank) p.writer = free;
          if (free) taken.insert(taken.end(), rs.begin(), rs.end());
        }
      }
    }
  }
  for (size_t i = 0; i < places.size(); ++i) {
    out.anywhere.insert(places[i].name);
    const Tensor& t = sd.items()[i].second;
    const Place& p = places[i];
    // A tensor under two names (tied weights): the first, as the optimizer's
    // name_parameters names it, so its state is found again on load.
    out.by_impl.emplace(t.impl_ptr().get(), p);
    out.by_name[p.name] = p;
    if (p.holds) add_held(out.held, p.name, p, p.local);
  }
  if (out.description.empty()) out.description = world > 1 ? "replicated" : "single";
  return out;
}

std::vector<Held> optimizer_held(const optim::Optimizer& opt, const ModelLayout& L) {
  std::vector<Held> out;
  for (const optim::Optimizer::LocalState& s : opt.local_state()) {
    auto it = L.by_impl.find(s.param.impl_ptr().get());
    EMBER_CHECK(it != L.by_impl.end(), "save_sharded_checkpoint: the optimizer holds state '", s.name,
                "' of a parameter that is not the model's");
    Place p = it->second;
    if (s.part) {
      const auto* spec = dynamic_cast<const ShardSpec*>(s.part.get());
      EMBER_CHECK(spec != nullptr && spec->global_shape == p.shape,
                  "save_sharded_checkpoint: the optimizer's part of '", p.name, "' is not a ShardSpec of its shape ",
                  shape_str(p.shape));
      p.regions = spec->regions();
      p.holds = spec->held_numel() > 0;
      p.writer = p.holds && spec->writes;
      p.placement = placement_text(*spec);
    }
    const std::string name = kOptimPrefix + p.name + "." + s.name;
    const Tensor& t = s.value;
    if (t.dim() == 0) {
      int64_t global = 1;
      for (int64_t d : p.shape) global *= d;
      bool first = global == 0;
      for (const Region& r : p.regions) first = first || overlap(p.shape, r, run_region(p.shape, 0, 1)) == 1;
      if (p.holds && first && p.writer) out.push_back({name, {}, t.dtype(), whole_region({}), t, true, ""});
      continue;
    }
    EMBER_CHECK(t.numel() == p.numel(), "save_sharded_checkpoint: optimizer state '", name, "' has ", t.numel(),
                " elements here, the parameter's region ", p.numel());
    if (p.holds) add_held(out, name, p, t);
  }
  return out;
}
}  // namespace ember::distributed::sharded_internal
