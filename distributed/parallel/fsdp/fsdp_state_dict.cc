// Full (unsharded) state dicts of a sharded model and of its optimizer:
// gathered with each unit's one all-gather, under the original names, and
// loaded back by each rank keeping its own shard of a full dict. The shard of
// entry i that rank r holds is FlatBuffer::pieces(r) of the unit's layout:
// the same offsets the sharded checkpoints of the next step write.
#include "distributed/parallel/fsdp/fsdp_state_dict.h"

#include <map>
#include <unordered_map>

#include "core/autograd_hook.h"
#include "core/ops.h"
#include "distributed/parallel/fsdp/fsdp.h"
#include "distributed/parallel/fsdp/fsdp_unit.h"

namespace ember::distributed {

using Unit = FSDPModule::Unit;

namespace {

struct Where {
  Unit* unit = nullptr;
  size_t entry = 0;
};

std::unordered_map<const TensorImpl*, Where> managed(FSDPModule& root) {
  std::unordered_map<const TensorImpl*, Where> out;
  for (auto& u : root.units())
    for (size_t i = 0; i < u->params.size(); ++i) out[u->params[i].impl_ptr().get()] = {u.get(), i};
  return out;
}

bool is_rank0(const Unit& u) { return u.shard_rank == 0 && (!u.replicate_pg || u.replicate_pg->rank() == 0); }

// The unit's whole flat buffer in the master dtype from every rank's
// `local` shard ([shard_numel]), on the shard's device.
Tensor gather_flat(const Unit& u, const Tensor& local) {
  if (u.shard_size == 1) return local;
  Tensor src = local.to(u.device);
  Tensor full = empty({u.layout.padded_numel()}, TensorOptions{src.dtype(), u.device});
  u.shard_pg->allgather_into_tensor(full, src)->wait();
  return full;
}

Tensor output_copy(const Tensor& t, bool to_cpu) { return to_cpu ? t.to(kCPU).clone() : t.clone(); }

}  // namespace

nn::StateDict full_state_dict(FSDPModule& root, const FullStateDictOptions& options) {
  NoGradGuard ng;
  root.reshard();  // the shards are the truth; gathered copies may be in a low dtype
  auto where = managed(root);
  std::map<const Unit*, Tensor> full;
  for (auto& u : root.units()) full[u.get()] = gather_flat(*u, u->shard);
  const bool keep = !options.rank0_only || is_rank0(*root.units().front());
  nn::StateDict out;
  if (!keep) return out;
  const nn::StateDict mine = root.module().state_dict();
  for (const auto& [name, t] : mine.items()) {
    auto it = where.find(t.impl_ptr().get());
    if (it == where.end()) {
      out.insert(name, output_copy(t, options.offload_to_cpu));
    } else {
      const Unit& u = *it->second.unit;
      out.insert(name, output_copy(u.full_view(full.at(&u), it->second.entry), options.offload_to_cpu));
    }
  }
  return out;
}

void load_full_state_dict(FSDPModule& root, const nn::StateDict& sd, bool strict) {
  NoGradGuard ng;
  root.reshard();
  auto where = managed(root);
  const nn::StateDict mine = root.module().state_dict();
  std::vector<std::string> missing, unexpected;
  for (const auto& [name, t] : mine.items())
    if (!sd.contains(name)) missing.push_back(name);
  for (const auto& [name, t] : sd.items())
    if (!mine.contains(name)) unexpected.push_back(name);
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size() && i < 8; ++i) s += (i ? ", " : "") + v[i];
    return v.size() > 8 ? s + ", ..." : s;
  };
  EMBER_CHECK(!strict || (missing.empty() && unexpected.empty()), "load_full_state_dict: ",
              missing.empty() ? "" : "missing keys: " + list(missing) + (unexpected.empty() ? "" : "; "),
              unexpected.empty() ? "" : "unexpected keys: " + list(unexpected));
  // Check every entry before writing any.
  for (const auto& [name, t] : mine.items()) {
    const Tensor* v = sd.find(name);
    if (!v) continue;
    auto it = where.find(t.impl_ptr().get());
    const Shape want = it == where.end() ? t.sizes() : it->second.unit->layout.entries()[it->second.entry].shape;
    EMBER_CHECK(v->defined() && v->sizes() == want, "load_full_state_dict: '", name, "' has shape ",
                v->defined() ? shape_str(v->sizes()) : std::string("undefined"), " in the state dict, the model ",
                shape_str(want));
  }
  for (const auto& [name, t] : mine.items()) {
    const Tensor* v = sd.find(name);
    if (!v) continue;
    auto it = where.find(t.impl_ptr().get());
    if (it == where.end()) {
      Tensor dst = t;
      dst.copy_(*v);
      continue;
    }
    Unit& u = *it->second.unit;
    const size_t i = it->second.entry;
    Tensor dst = u.shard_view(u.shard, i);
    for (const auto& pc : u.pieces)
      if (pc.entry == i) dst.copy_(v->contiguous().view({-1}).narrow(0, pc.entry_offset, pc.numel).view(dst.sizes()));
  }
}

optim::OptimizerStateDict full_optim_state_dict(FSDPModule& root, const optim::Optimizer& opt,
                                                const FullStateDictOptions& options) {
  NoGradGuard ng;
  auto where = managed(root);
  optim::OptimizerStateDict sd = opt.state_dict();
  // Optimizer index -> parameter.
  std::vector<Tensor> by_index;
  for (const auto& g : opt.param_groups())
    for (const Tensor& p : g.params) by_index.push_back(p);
  std::map<std::pair<int64_t, std::string>, Tensor> local;
  for (const auto& [key, t] : sd.state) {
    int64_t idx;
    std::string name;
    EMBER_CHECK(optim::parse_state_key(key, &idx, &name), "full_optim_state_dict: bad key '", key, "'");
    local[{idx, name}] = t;
  }
  std::map<const TensorImpl*, int64_t> index_of;
  for (size_t i = 0; i < by_index.size(); ++i) index_of[by_index[i].impl_ptr().get()] = static_cast<int64_t>(i);

  // Per unit and state name: which ranks hold some of it (so every rank
  // takes part in the same gathers), then one all-gather of the unit's
  // shard of that state.
  std::vector<std::string> names;
  for (const auto& n : opt.state_names())
    if (n != "step") names.push_back(n);
  std::map<std::pair<int64_t, std::string>, Tensor> gathered;
  for (auto& u : root.units()) {
    if (u->params.empty()) continue;
    Tensor present = zeros({static_cast<int64_t>(names.size())}, TensorOptions{DType::Float32, u->device});
    {
      std::vector<double> flags(names.size(), 0.0);
      for (size_t k = 0; k < names.size(); ++k)
        for (const Tensor& p : u->params)
          if (auto ix = index_of.find(p.impl_ptr().get()); ix != index_of.end() && local.count({ix->second, names[k]}))
            flags[k] = 1.0;
      present.copy_(Tensor::from_vector(flags, {static_cast<int64_t>(names.size())}).to(u->device));
    }
    if (u->shard_pg) u->shard_pg->allreduce(present, ReduceOp::Max)->wait();
    if (u->replicate_pg) u->replicate_pg->allreduce(present, ReduceOp::Max)->wait();
    auto flags = present.to_vector();
    for (size_t k = 0; k < names.size(); ++k) {
      if (flags[k] == 0.0) continue;
      Tensor shard = zeros({u->shard_numel()}, u->master_options());
      for (size_t i = 0; i < u->params.size(); ++i) {
        auto ix = index_of.find(u->params[i].impl_ptr().get());
        if (ix == index_of.end()) continue;
        auto st = local.find({ix->second, names[k]});
        if (st == local.end()) continue;
        Tensor dst = u->shard_view(shard, i);
        dst.copy_(st->second.to(dst.device(), dst.dtype()));
      }
      Tensor full = gather_flat(*u, shard);
      for (size_t i = 0; i < u->params.size(); ++i) {
        auto ix = index_of.find(u->params[i].impl_ptr().get());
        if (ix == index_of.end() || !local.count({ix->second, names[k]})) continue;
        gathered[{ix->second, names[k]}] = output_copy(u->full_view(full, i), options.offload_to_cpu);
      }
    }
  }
  const bool keep = !options.rank0_only || root.units().empty() || is_rank0(*root.units().front());
  optim::OptimizerStateDict out;
  if (!keep) return out;
  for (const auto& [key, t] : sd.state) {
    int64_t idx;
    std::string name;
    optim::parse_state_key(key, &idx, &name);
    auto g = gathered.find({idx, name});
    const bool is_managed = idx < static_cast<int64_t>(by_index.size()) && where.count(by_index[idx].impl_ptr().get());
    if (g != gathered.end()) {
      out.state.emplace_back(key, g->second);
    } else {
      EMBER_CHECK(name == "step" || !is_managed, "full_optim_state_dict: internal: state '", key, "' not gathered");
      out.state.emplace_back(key, output_copy(t, options.offload_to_cpu));
    }
  }
  out.param_groups = sd.param_groups;
  optim::name_parameters(out, opt, root.module().named_parameters());
  return out;
}

void load_full_optim_state_dict(FSDPModule& root, optim::Optimizer& opt, const optim::OptimizerStateDict& full) {
  NoGradGuard ng;
  auto where = managed(root);
  optim::OptimizerStateDict sd = optim::match_by_name(full, opt, root.module().named_parameters());
  std::map<int64_t, int64_t> position;  // state dict index -> optimizer position
  std::vector<Tensor> by_pos;
  for (const auto& g : opt.param_groups())
    for (const Tensor& p : g.params) by_pos.push_back(p);
  size_t pos = 0;
  for (const auto& g : sd.param_groups)
    for (int64_t ix : g.params) position[ix] = static_cast<int64_t>(pos++);
  for (auto& [key, t] : sd.state) {
    int64_t idx;
    std::string name;
    EMBER_CHECK(optim::parse_state_key(key, &idx, &name), "load_full_optim_state_dict: bad key '", key, "'");
    if (name == "step") continue;
    auto ps = position.find(idx);
    if (ps == position.end() || ps->second >= static_cast<int64_t>(by_pos.size()))
      continue;  // load_state_dict names it
    auto w = where.find(by_pos[ps->second].impl_ptr().get());
    if (w == where.end()) continue;
    const Unit& u = *w->second.unit;
    const size_t i = w->second.entry;
    const Shape& shape = u.layout.entries()[i].shape;
    EMBER_CHECK(t.sizes() == shape, "load_full_optim_state_dict: '", key, "' has shape ", shape_str(t.sizes()),
                ", the full parameter '", u.names[i], "' ", shape_str(shape));
    Tensor piece = u.shard_view(u.shard, i);  // for its shape
    Tensor value = zeros(piece.sizes(), TensorOptions{t.dtype(), t.device()});
    for (const auto& pc : u.pieces)
      if (pc.entry == i) value = t.contiguous().view({-1}).narrow(0, pc.entry_offset, pc.numel).view(piece.sizes());
    t = value;
  }
  opt.load_state_dict(sd);
}

}  // namespace ember::distributed
