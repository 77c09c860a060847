// fully_shard: wraps a module into an FSDP unit (the mesh's groups, the
// checks that every rank wraps the same unit, the flat layout and the
// shards, the hooks), the automatic wrapping policy, and the FSDPModule
// handle (micro-batches, explicit unshard/reshard, memory, clipping). What
// a unit does once wrapped (its state machine and hooks) is in
// fsdp_unit.cc; what it says on each parameter (its ShardSpec) in
// fsdp_shard_specs.cc. See fsdp.h for the design.
#include "distributed/parallel/fsdp/fsdp.h"

#include <algorithm>
#include <cctype>
#include <sstream>
#include <unordered_set>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "distributed/device_mesh.h"
#include "distributed/init.h"
#include "distributed/parallel/flat_buffer.h"
#include "distributed/parallel/fsdp/fsdp_unit.h"
#include "distributed/parallel/rank_agreement.h"
#include "distributed/sharding/shard_spec.h"
#include "optim/clip_grad.h"

namespace ember::distributed {

const char* strategy_name(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::FULL_SHARD:
      return "FULL_SHARD";
    case ShardingStrategy::SHARD_GRAD_OP:
      return "SHARD_GRAD_OP";
    case ShardingStrategy::NO_SHARD:
      return "NO_SHARD";
    case ShardingStrategy::HYBRID_SHARD:
      return "HYBRID_SHARD";
  }
  return "?";
}

ShardingStrategy parse_strategy(const std::string& s) {
  std::string l;
  for (char c : s) l += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (l == "full" || l == "full_shard") return ShardingStrategy::FULL_SHARD;
  if (l == "grad_op" || l == "shard_grad_op") return ShardingStrategy::SHARD_GRAD_OP;
  if (l == "no_shard" || l == "none") return ShardingStrategy::NO_SHARD;
  if (l == "hybrid" || l == "hybrid_shard") return ShardingStrategy::HYBRID_SHARD;
  EMBER_CHECK(false, "unknown sharding strategy '", s, "' (expected full, grad_op, no_shard or hybrid)");
  return ShardingStrategy::FULL_SHARD;
}

using Unit = FSDPModule::Unit;

using namespace fsdp_internal;

namespace {

// Whether fully_shard sharded `p` (its ShardSpec says so): how a parameter
// is known to belong to some unit without a map from parameters to units.
bool sharded_by_fsdp(const Tensor& p) {
  const ShardSpec* spec = shard_spec(p);
  return spec && spec->layout.rfind("fsdp:", 0) == 0;
}

uint64_t fnv(uint64_t h, const std::string& s) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return (h ^ 0xff) * 1099511628211ULL;
}

std::string join_names(const std::vector<std::string>& names, size_t max = 4) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < max; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > max) out += ", ...";
  return out;
}

}  // namespace

// ---- wrapping ------------------------------------------------------------

namespace {

struct Groups {
  std::shared_ptr<ProcessGroup> shard, replicate;
  std::shared_ptr<DeviceMesh> mesh;
};

// The mesh's groups: a 1-D mesh shards over its group (or, NO_SHARD,
// replicates over it); a 2-D (dp_replicate, dp_shard) mesh is HSDP,
// sharded along its last dimension and replicated along its first.
Groups resolve_groups(const FSDPOptions& o, const std::string& who) {
  std::shared_ptr<DeviceMesh> mesh = o.mesh;
  if (!mesh) {
    EMBER_CHECK(is_initialized(), who, ": no mesh given and init_process_group() has not run; pass FSDPOptions::mesh");
    mesh = DeviceMesh::from_group(default_group(), "dp_shard");
  }
  Groups g;
  g.mesh = mesh;
  switch (o.strategy) {
    case ShardingStrategy::FULL_SHARD:
    case ShardingStrategy::SHARD_GRAD_OP:
    case ShardingStrategy::NO_SHARD:
      EMBER_CHECK(mesh->ndim() == 1, who, ": ", strategy_name(o.strategy), " takes a 1-D mesh, got ", mesh->to_string(),
                  "; a 2-D (dp_replicate, dp_shard) mesh is HYBRID_SHARD");
      (o.strategy == ShardingStrategy::NO_SHARD ? g.replicate : g.shard) = mesh->group(0);
      break;
    case ShardingStrategy::HYBRID_SHARD:
      EMBER_CHECK(mesh->ndim() == 2, who, ": HYBRID_SHARD takes a 2-D mesh (dp_replicate, dp_shard): shards along ",
                  "the last dimension, replicas along the first; got ", mesh->to_string());
      g.replicate = mesh->group(0);
      g.shard = mesh->group(1);
      break;
  }
  if (g.shard && g.shard->size() == 1) g.shard = nullptr;
  if (g.replicate && g.replicate->size() == 1) g.replicate = nullptr;
  return g;
}

// Every rank of `pg` must wrap the same unit: compares (tensors, elements,
// a hash of names and shapes) across the ranks and names the unit.
void check_same_structure(ProcessGroup& pg, const Unit& u, const FlatBuffer& layout) {
  uint64_t h = fnv(1469598103934665603ULL, u.type);
  int64_t numel = 0;
  for (size_t i = 0; i < u.params.size(); ++i) {
    h = fnv(h, u.names[i] + shape_str(layout.entries()[i].shape) + (u.trainable[i] ? "g" : "f"));
    numel += layout.entries()[i].numel;
  }
  // Values below 2^53: exact as the doubles from_vector takes.
  Tensor mine = Tensor::from_vector(
      {static_cast<double>(u.params.size()), static_cast<double>(numel), static_cast<double>(h >> 12)}, {3},
      TensorOptions{DType::Int64, pg.device()});
  Tensor all = empty({3 * pg.size()}, TensorOptions{DType::Int64, pg.device()});
  pg.allgather_into_tensor(all, mine)->wait();
  auto v = all.to_vector();
  bool same = true;
  for (int r = 1; r < pg.size(); ++r)
    for (int k = 0; k < 3; ++k) same &= v[3 * r + k] == v[k];
  if (same) return;
  std::ostringstream msg;
  msg << "fully_shard: the unit of " << u.type << " (parameters " << join_names(u.names)
      << ") differs across the ranks of the " << pg.backend_name() << " group:";
  for (int r = 0; r < pg.size(); ++r)
    msg << " rank " << r << " has " << static_cast<int64_t>(v[3 * r]) << " tensors / "
        << static_cast<int64_t>(v[3 * r + 1]) << " elements"
        << (v[3 * r + 2] != v[2] ? " (names or shapes other than rank 0's)" : "") << (r + 1 < pg.size() ? ";" : "");
  msg << ". Every rank must call fully_shard on the same modules in the same order";
  EMBER_CHECK(false, msg.str());
}

// A new unit's settings: the options and the mesh's groups.
std::shared_ptr<Unit> new_unit(const std::shared_ptr<nn::Module>& module, const FSDPOptions& options,
                               const Groups& groups) {
  auto u = std::make_shared<Unit>();
  u->module = module.get();
  u->type = module->type_name();
  u->strategy = options.strategy;
  u->shard_pg = groups.shard;
  u->replicate_pg = groups.replicate;
  u->mesh = groups.mesh;
  u->shard_size = groups.shard ? groups.shard->size() : 1;
  u->shard_rank = groups.shard ? groups.shard->rank() : 0;
  u->reshard_after_forward =
      options.strategy == ShardingStrategy::FULL_SHARD || options.strategy == ShardingStrategy::HYBRID_SHARD;
  u->forward_prefetch = options.forward_prefetch;
  u->backward_prefetch = options.backward_prefetch;
  u->prefetch_limit = options.prefetch_limit;
  u->cast_inputs = options.mp_policy.cast_forward_inputs;
  u->output_dtype = options.mp_policy.output_dtype;
  return u;
}

// The parameters no inner unit holds and none ignored, under their names in
// this module.
// One an enclosing unit holds means the wrapping went top-down.
std::vector<std::pair<std::string, Tensor>> own_parameters(const std::shared_ptr<nn::Module>& module,
                                                           const std::string& who, const std::vector<Tensor>& ignored) {
  std::unordered_set<const TensorImpl*> inner;
  for (const Tensor& p : ignored) inner.insert(p.impl_ptr().get());
  for (auto& [n, m] : module->named_modules())
    if (auto iu = unit_of(m))
      for (const Tensor& p : iu->params) inner.insert(p.impl_ptr().get());
  std::vector<std::pair<std::string, Tensor>> named;
  for (auto& [name, p] : module->named_parameters()) {
    if (inner.count(p.impl_ptr().get())) continue;
    EMBER_CHECK(!sharded_by_fsdp(p), who, ": parameter '", name,
                "' already belongs to the unit of an enclosing module; call fully_shard on inner modules first, "
                "then on the root");
    named.emplace_back(name, p);
  }
  // An inner unit that already ran forward took itself for the root (and
  // its subtree for everything): an outer unit now would make two roots.
  for (auto& [n, m] : module->named_modules())
    if (m != module.get())
      if (auto inner = unit_of(m); inner && inner->is_root)
        EMBER_CHECK(false, who, ": inner unit '", n,
                    "' already ran as a root; wrap every unit before the first forward");
  return named;
}

// Takes the parameters into the unit, checked to share one floating dtype
// and device (the groups' device), and sets the compute and reduce dtypes
// from the mixed-precision policy. Returns the parameters' (master) dtype.
DType adopt_parameters(Unit& unit, const std::vector<std::pair<std::string, Tensor>>& named, const Groups& groups,
                       const FSDPOptions& options, const std::string& who) {
  DType master = DType::Float32;
  Device device = kCPU;
  for (size_t i = 0; i < named.size(); ++i) {
    const Tensor& p = named[i].second;
    EMBER_CHECK(is_floating(p.dtype()), who, ": parameter '", named[i].first, "' is ", p.dtype(),
                "; only floating parameters can be sharded");
    if (i == 0) {
      master = p.dtype(), device = p.device();
    } else {
      EMBER_CHECK(p.dtype() == master && p.device() == device, who, ": parameter '", named[i].first, "' is ", p.dtype(),
                  " on ", p.device(), " but '", named[0].first, "' is ", master, " on ", device,
                  "; a unit's parameters share one dtype and device (move the module with to() before wrapping)");
    }
    unit.names.push_back(named[i].first);
    unit.params.push_back(p);
    unit.trainable.push_back(p.requires_grad());
  }
  for (auto* g : {groups.shard.get(), groups.replicate.get()})
    if (g)
      EMBER_CHECK(g->device().type == device.type, who, ": the parameters are on ", device, " but the ",
                  g->backend_name(), " group works on ", g->device(), "; move the module first");
  unit.device = device;
  unit.compute_dtype = options.mp_policy.param_dtype.value_or(master);
  unit.reduce_dtype = options.mp_policy.reduce_dtype.value_or(unit.compute_dtype);
  EMBER_CHECK(is_floating(unit.compute_dtype) && is_floating(unit.reduce_dtype), who,
              ": param_dtype and reduce_dtype must be floating");
  return master;
}

// The unit's flat layout and this rank's shard of it, loaded from the
// parameters (rank 0's with sync_module_states), checked to be the same
// unit on every rank.
void lay_out_shards(const std::shared_ptr<Unit>& u, nn::Module& module,
                    const std::vector<std::pair<std::string, Tensor>>& named, const Groups& groups,
                    const FSDPOptions& options, DType master) {
  const Device device = u->device;
  const bool offload = options.offload_policy.offload_params;
  const Device shard_device = offload ? kCPU : device;

  // The layout in the master dtype, loaded from the parameters (rank 0's).
  std::vector<std::pair<std::string, Shape>> entries;
  for (size_t i = 0; i < named.size(); ++i) entries.emplace_back(named[i].first, named[i].second.sizes());
  FlatBuffer init(entries, TensorOptions{master, device}, u->shard_size);
  {
    NoGradGuard ng;
    std::vector<Tensor> values(u->params.begin(), u->params.end());
    if (!values.empty()) init.copy_from(values);
  }
  for (auto* g : {groups.shard.get(), groups.replicate.get()})
    if (g) check_same_structure(*g, *u, init);
  if (options.sync_module_states) {
    for (auto* g : {groups.shard.get(), groups.replicate.get()}) {
      if (!g) continue;
      if (init.padded_numel() > 0) g->broadcast(init.flat(), 0)->wait();
      for (auto& [n, b] : module.named_buffers())
        if (b.defined() && b.numel() > 0) g->broadcast(b, 0)->wait();
    }
  }
  u->shares_storage = u->shard_size == 1 && u->compute_dtype == master && !offload;
  if (u->shares_storage) {
    u->layout = std::move(init);
    u->shard = u->layout.flat();
  } else {
    NoGradGuard ng;
    Tensor s = init.shard(u->shard_rank).to(shard_device).clone();
    if (offload && options.offload_policy.pin_memory && device.type != DeviceType::CPU) s = s.pin_memory();
    u->shard = s;
    u->layout = FlatBuffer(entries, TensorOptions{u->compute_dtype, device}, u->shard_size);
    u->layout.release();
  }
  u->pieces = u->layout.pieces(u->shard_rank);
}

// The gradient hooks on the parameters and the forward/backward hooks on
// the module that drive the unit's state machine (fsdp_unit.cc).
void register_hooks(const std::shared_ptr<Unit>& u, nn::Module& module) {
  std::weak_ptr<Unit> weak = u;
  for (size_t i = 0; i < u->params.size(); ++i)
    if (u->trainable[i]) {
      // Before the first gradient lands: the unit's gradient buffer.
      autograd::register_hook(u->params[i], [weak](const Tensor&) {
        if (auto uu = weak.lock()) uu->ensure_grad_buffer();
        return Tensor();
      });
      autograd::register_post_accumulate_grad_hook(u->params[i], [weak, i](const Tensor&) {
        if (auto uu = weak.lock()) {
          uu->seen_unsharded[i] = true;
          uu->on_grad_ready(uu->generation);
        }
      });
    }
  // The hooks own the unit: it lives as long as the module does.
  u->hooks.push_back(module.register_forward_pre_hook([u](nn::Module&, const Tensor& x) { return u->pre_forward(x); }));
  u->hooks.push_back(module.register_forward_hook(
      [u](nn::Module&, const Tensor&, const Tensor& out) { return u->post_forward(out); }));
  u->hooks.push_back(module.register_full_backward_pre_hook([u](nn::Module&, const Tensor&) {
    u->pre_backward();
    return Tensor();
  }));
}

}  // namespace

std::shared_ptr<FSDPModule> fully_shard(const std::shared_ptr<nn::Module>& module, const FSDPOptions& options) {
  EMBER_CHECK(module != nullptr, "fully_shard: module is null");
  const std::string who = "fully_shard(" + module->type_name() + ")";
  EMBER_CHECK(unit_of(module.get()) == nullptr, who, ": this module is already wrapped");
  EMBER_CHECK(options.prefetch_limit >= 0, who, ": prefetch_limit must be at least 0, got ", options.prefetch_limit);
  Groups groups = resolve_groups(options, who);

  auto u = new_unit(module, options, groups);
  const std::vector<std::pair<std::string, Tensor>> named = own_parameters(module, who, options.ignored_params);
  const DType master = adopt_parameters(*u, named, groups, options, who);
  lay_out_shards(u, *module, named, groups, options, master);
  for (size_t i = 0; i < u->params.size(); ++i) {
    u->params[i].set_grad(Tensor());
    u->params[i].set_data(u->shard_view(u->shard, i));  // Note [set_data keeps identity]
  }
  attach_shard_specs(u);
  u->state = Unit::State::SHARDED;
  u->seen_shard.assign(u->params.size(), false);
  u->seen_unsharded.assign(u->params.size(), false);

  module->set_transform_state(kStateKey, u);

  register_hooks(u, *module);
  return std::make_shared<FSDPModule>(u);
}

std::shared_ptr<FSDPModule> fsdp_of(const nn::Module& module) {
  auto u = unit_of(&module);
  return u ? std::make_shared<FSDPModule>(u) : nullptr;
}

namespace {
void wrap_children(const std::shared_ptr<nn::Module>& m, const AutoWrapPolicy& policy, const FSDPOptions& options) {
  for (auto& [name, child] : m->named_children()) {
    wrap_children(child, policy, options);
    bool by_type = std::find(policy.types.begin(), policy.types.end(), child->type_name()) != policy.types.end();
    bool by_size = false;
    if (policy.min_num_params > 0) {
      int64_t n = 0;
      for (auto& [pn, p] : child->named_parameters())
        if (!sharded_by_fsdp(p)) n += p.numel();
      by_size = n >= policy.min_num_params;
    }
    if ((by_type || by_size) && !unit_of(child.get())) fully_shard(child, options);
  }
}
}  // namespace

std::shared_ptr<FSDPModule> fully_shard_auto(const std::shared_ptr<nn::Module>& root, const AutoWrapPolicy& policy,
                                             const FSDPOptions& options) {
  EMBER_CHECK(root != nullptr, "fully_shard_auto: root is null");
  EMBER_CHECK(!policy.types.empty() || policy.min_num_params > 0,
              "fully_shard_auto: the policy wraps nothing (give types or min_num_params)");
  wrap_children(root, policy, options);
  return fully_shard(root, options);
}

// ---- the handle ----------------------------------------------------------

FSDPModule::FSDPModule(std::shared_ptr<Unit> unit) : unit_(std::move(unit)) {}
FSDPModule::~FSDPModule() = default;

nn::Module& FSDPModule::module() const { return *unit_->module; }
ShardingStrategy FSDPModule::strategy() const { return unit_->strategy; }

std::vector<std::shared_ptr<Unit>> FSDPModule::units() const {
  std::vector<std::shared_ptr<Unit>> out;
  for (auto& [n, m] : unit_->module->named_modules())
    if (auto u = unit_of(m)) out.push_back(u);
  return out;
}

void FSDPModule::set_requires_gradient_sync(bool on) {
  for (auto& u : units()) u->requires_sync = on;
}
void FSDPModule::set_reshard_after_backward(bool on) {
  for (auto& u : units()) u->reshard_after_backward = on;
}
void FSDPModule::begin_micro_batches() {
  for (auto& u : units()) {
    EMBER_CHECK(!u->micro_batches, "FSDP(", u->type, "): begin_micro_batches() twice without end_micro_batches()");
    u->micro_batches = Unit::Saved{u->reshard_after_forward, u->reshard_after_backward, u->requires_sync};
    u->reshard_after_forward = u->reshard_after_backward = u->requires_sync = false;
  }
}

void FSDPModule::end_micro_batches() {
  // In module order, the same on every rank of a unit's groups, so the
  // collectives line up: each unit that ran forward (gathered, or freed by
  // a unit's own setting since) ends its backward as a synchronizing
  // backward would have; one that did not holds nothing new.
  std::vector<std::shared_ptr<Unit>> roots;
  for (auto& u : units()) {
    EMBER_CHECK(u->micro_batches.has_value(), "FSDP(", u->type, "): end_micro_batches() without begin_micro_batches()");
    u->reshard_after_forward = u->micro_batches->reshard_after_forward;
    u->reshard_after_backward = u->micro_batches->reshard_after_backward;
    u->requires_sync = u->micro_batches->requires_sync;
    u->micro_batches.reset();
    if (u->state == Unit::State::SHARDED) continue;
    u->post_backward_done = false;
    u->post_backward();
    u->expects_backward = false;
    auto r = u->root();
    if (std::find(roots.begin(), roots.end(), r) == roots.end()) roots.push_back(r);
  }
  for (auto& r : roots)
    while (!r->pending.empty()) r->advance_pending();
}

void FSDPModule::unshard() {
  auto us = units();
  for (auto& u : us) u->start_gather();
  for (auto& u : us) u->unshard();
}
void FSDPModule::reshard() {
  for (auto& u : units()) u->reshard();
}

FSDPModule::Memory FSDPModule::memory() const {
  Memory m;
  for (auto& u : units()) {
    const int64_t es = static_cast<int64_t>(dtype_size(u->compute_dtype));
    m.sharded_params += u->shard.numel() * static_cast<int64_t>(dtype_size(u->shard.dtype()));
    if (Tensor g = u->live_shard_grad(); g.defined())
      m.sharded_grads += g.numel() * static_cast<int64_t>(dtype_size(g.dtype()));
    if (!u->shares_storage && !u->layout.released()) m.unsharded_params += u->layout.padded_numel() * es;
    // A float8 gather's two buffers (nn/float8.h's all-gather in float8).
    if (u->f8.hp_full.defined() && !u->f8.hp_full.storage_freed())
      m.unsharded_params += static_cast<int64_t>(u->f8.hp_full.nbytes());
    if (u->f8.f8_full.defined()) m.unsharded_params += static_cast<int64_t>(u->f8.f8_full.nbytes());
    if (u->grad_flat.defined()) m.unsharded_grads += u->grad_flat.numel() * es;
    m.largest_unit = std::max(m.largest_unit, u->layout.padded_numel() * es);
  }
  return m;
}

std::shared_ptr<ProcessGroup> FSDPModule::shard_group() const { return unit_->shard_pg; }

double FSDPModule::clip_grad_norm_(double max_norm, double norm_type) {
  // The parameters' shard specs say how their norm combines over ranks.
  return optim::clip_grad_norm_(unit_->module->parameters(), max_norm, norm_type);
}

Tensor FSDPModule::clip_grad_norm_async_(double max_norm, double norm_type) {
  return optim::clip_grad_norm_async_(unit_->module->parameters(), max_norm, norm_type);
}

}  // namespace ember::distributed