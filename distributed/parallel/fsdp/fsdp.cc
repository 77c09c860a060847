// fully_shard: the unit's state machine (sharded / gathered / freed), the
// module hooks that drive it, prefetch, and the gradient reductions. See
// fsdp.h for the design; the comments here say why each step is where it is.
#include "distributed/parallel/fsdp/fsdp.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <deque>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "autograd/autograd.h"
#include "autograd/checkpoint.h"
#include "core/ops.h"
#include "distributed/device_mesh.h"
#include "distributed/init.h"
#include "distributed/parallel/flat_buffer.h"
#include "distributed/parallel/fsdp/fsdp_unit.h"
#include "distributed/parallel/rank_agreement.h"
#include "distributed/sharding/shard_spec.h"
#include "distributed/tensor/dtensor.h"
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

namespace {

// The unit lives on its module (Module::transform_state under this key):
// no registry maps modules or parameters to units.
constexpr const char* kStateKey = "fully_shard";

// The live units of a root's list, in order.
std::vector<std::shared_ptr<Unit>> alive(const std::vector<std::weak_ptr<Unit>>& units) {
  std::vector<std::shared_ptr<Unit>> out;
  for (const auto& w : units)
    if (auto u = w.lock()) out.push_back(std::move(u));
  return out;
}

std::shared_ptr<Unit> unit_of(const nn::Module* m) {
  auto u = m->transform_state_as<Unit>(kStateKey);
  return u && u->module == m ? u : nullptr;
}

// Whether fully_shard sharded `p` (its ShardSpec says so): how a parameter
// is known to belong to some unit without a map from parameters to units.
bool sharded_by_fsdp(const Tensor& p) {
  const ShardSpec* spec = shard_spec(p);
  return spec && spec->layout.rfind("fsdp:", 0) == 0;
}

bool is_view_of(const Tensor& g, const Tensor& v) {
  return g.defined() && v.defined() && g.impl().storage == v.impl().storage &&
         g.storage_offset() == v.storage_offset() && g.sizes() == v.sizes() && g.strides() == v.strides() &&
         g.dtype() == v.dtype();
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

// ---- the unit ------------------------------------------------------------

Tensor Unit::full_view(const Tensor& flat, size_t i) const {
  const FlatEntry& e = layout.entries()[i];
  return flat.narrow(0, e.offset, e.numel).view(e.shape);
}

Tensor Unit::shard_view(const Tensor& shard_flat, size_t i) const {
  const FlatEntry& e = layout.entries()[i];
  for (const auto& pc : pieces)
    if (pc.entry == i) {
      Tensor v = shard_flat.narrow(0, pc.shard_offset, pc.numel);
      return pc.numel == e.numel ? v.view(e.shape) : v;
    }
  return shard_flat.narrow(0, 0, 0);
}

int64_t Unit::num_trainable() const {
  int64_t n = 0;
  for (bool t : trainable) n += t;
  return n;
}

Tensor Unit::reconcile(const Tensor& flat, bool sharded, int64_t numel, TensorOptions opts) const {
  MemoryKindScope grads_memory(MemoryKind::Gradients);  // the buffers it makes hold gradients
  // A parameter is expected to hold its view of `flat` when the sharded
  // gradient of it was exposed (or, unsharded, whenever `flat` exists).
  bool any = false, all_views = flat.defined();
  for (size_t i = 0; i < params.size(); ++i) {
    if (!trainable[i]) continue;
    const bool expected = flat.defined() && (!sharded || seen_shard[i]);
    Tensor g = params[i].grad();
    if (g.defined()) {
      any = true;
      if (!expected || !is_view_of(g, sharded ? shard_view(flat, i) : full_view(flat, i))) all_views = false;
    } else if (expected) {
      all_views = false;  // set to none since: its part must read zero
    }
  }
  if (!any) return Tensor();
  if (all_views) return flat;
  NoGradGuard ng;
  Tensor out = zeros({numel}, opts);
  for (size_t i = 0; i < params.size(); ++i) {
    if (!trainable[i]) continue;
    Tensor g = params[i].grad();
    if (!g.defined()) continue;
    Tensor v = sharded ? shard_view(out, i) : full_view(out, i);
    EMBER_CHECK(g.numel() == v.numel(), "FSDP(", type, "): the gradient of '", names[i], "' has shape ",
                shape_str(g.sizes()), ", expected ", shape_str(v.sizes()), " (set .grad() only to a tensor of the ",
                "parameter's current shape)");
    v.copy_(g.view(v.sizes()));
  }
  return out;
}

void Unit::expose_grads(const Tensor& flat, bool sharded) {
  for (size_t i = 0; i < params.size(); ++i)
    if (trainable[i])
      params[i].set_grad(flat.defined() && (!sharded || seen_shard[i])
                             ? (sharded ? shard_view(flat, i) : full_view(flat, i))
                             : Tensor());
}

int64_t Unit::shard_offset_of(size_t i) const {
  for (const auto& pc : pieces)
    if (pc.entry == i) return pc.shard_offset;
  return 0;  // shard_view's empty view sits at the start
}

Tensor Unit::live_shard_grad() const {
  if (shard_grad.defined()) return shard_grad;
  auto storage = shard_grad_weak.lock();
  if (!storage) return Tensor();
  for (size_t i = 0; i < params.size(); ++i) {
    if (!trainable[i]) continue;
    Tensor g = params[i].grad();
    if (g.defined() && g.impl().storage == storage)
      return g.as_strided({shard_numel()}, {1}, g.storage_offset() - shard_offset_of(i));
  }
  return Tensor();
}

void Unit::hold_shard_grad_weakly() {
  if (state != State::SHARDED || !shard_grad.defined()) return;
  bool exposed = false;
  for (size_t i = 0; i < params.size(); ++i) exposed = exposed || (trainable[i] && seen_shard[i]);
  if (!exposed) return;
  shard_grad_weak = shard_grad.impl().storage;
  shard_grad = Tensor();
}

void Unit::start_gather() {
  if (state == State::UNSHARDED || gathering) return;
  if (shares_storage) return;  // the shard is the whole buffer: nothing to gather
  NoGradGuard ng;
  MemoryKindScope gathered_memory(MemoryKind::Gathered);
  if (layout.released()) layout.restore();
  Tensor src = shard;
  if (src.device() != device) src = src.to(device);
  if (src.dtype() != compute_dtype) src = src.to(compute_dtype);
  if (shard_size == 1) {
    Tensor flat = layout.flat();
    flat.copy_(src);
    return;
  }
  gather_src = src;
  gather_work = layout.all_gather(*shard_pg, src);
  gathering = true;
}

void Unit::finish_gather() {
  if (!gathering) return;
  gathering = false;
  auto w = std::move(gather_work);
  gather_src = Tensor();
  w->synchronize();
}

void Unit::unshard() {
  if (state == State::UNSHARDED) return;
  start_gather();
  finish_gather();
  if (state == State::SHARDED) {
    // The sharded gradients the parameters carry now (honouring a
    // zero_grad since) are kept aside while the parameters are whole.
    shard_grad = reconcile(live_shard_grad(), true, shard_numel(), master_options());
    shard_grad_weak.reset();
    for (size_t i = 0; i < params.size(); ++i) {
      if (trainable[i]) seen_shard[i] = params[i].grad().defined();
      params[i].set_data(full_view(layout.flat(), i));
    }
    expose_grads(grad_flat, false);
  }
  state = State::UNSHARDED;
}

void Unit::free_unsharded() {
  if (state != State::UNSHARDED || shares_storage) return;
  finish_gather();
  layout.release();
  state = State::FREED;
}

void Unit::reshard() {
  finish_gather();
  if (state == State::SHARDED) return;
  grad_flat = reconcile(grad_flat, false, layout.padded_numel(), compute_options());
  for (size_t i = 0; i < params.size(); ++i) params[i].set_data(shard_view(shard, i));
  expose_grads(shard_grad, true);
  if (!shares_storage && !layout.released()) layout.release();
  state = State::SHARDED;
  hold_shard_grad_weakly();
}

void Unit::accumulate_shard_grad(const Tensor& reduced, const std::vector<bool>& seen) {
  NoGradGuard ng;
  for (size_t i = 0; i < seen.size(); ++i) seen_shard[i] = seen_shard[i] || seen[i];
  Tensor r = reduced.to(shard.device(), shard.dtype());
  Tensor current = live_shard_grad();
  if (current.defined()) {
    current += r;
    shard_grad = current;
  } else {
    shard_grad = r;  // the reduction's own buffer: nothing else holds it
    set_memory_kind(shard_grad, MemoryKind::Gradients);
  }
  shard_grad_weak.reset();
  if (state == State::SHARDED) {
    expose_grads(shard_grad, true);
    hold_shard_grad_weakly();
  }
}

TensorOptions Unit::master_options() const { return TensorOptions{shard.dtype(), shard.device()}; }
TensorOptions Unit::compute_options() const { return TensorOptions{compute_dtype, device}; }
int64_t Unit::shard_numel() const { return layout.shard_numel(); }

// The root is the unit whose forward runs first with no other unit's
// forward around it (FSDP2's lazy rule): it claims every unit in its
// module's subtree, so the units inside find their root when theirs runs.
std::shared_ptr<Unit> Unit::root() {
  if (auto r = root_.lock()) return r;
  init_root();
  return shared_from_this();
}

void Unit::init_root() {
  if (root_initialized) return;
  root_initialized = true;
  is_root = true;
  reshard_after_forward = false;  // backward needs it at once
  subtree.clear();
  for (auto& [n, m] : module->named_modules())
    if (auto u = unit_of(m)) {
      EMBER_CHECK(u.get() == this || !u->is_root, "fully_shard: unit '", n, "' (", u->type,
                  ") ran forward on its own, as a root, before the unit of its enclosing ", type,
                  " ran; call the outermost wrapped module (or wrap inner modules only)");
      subtree.push_back(u);
      u->root_ = shared_from_this();
    }
}

void Unit::issue_reduce(const Tensor& grads) {
  Unit& r = *root();
  r.advance_pending();
  PendingReduce p;
  p.unit = shared_from_this();
  p.seen = seen_unsharded;
  seen_unsharded.assign(params.size(), false);
  NoGradGuard ng;
  p.input = grads.dtype() == reduce_dtype ? grads : grads.to(reduce_dtype);
  if (shard_size == 1) {
    p.output = p.input;
  } else {
    p.output = empty({shard_numel()}, TensorOptions{reduce_dtype, device});
    // Through the layout, as the gather: the gradient buffer is laid out as
    // the parameters and is not read again, so the ring may reduce in it.
    p.rs = layout.reduce_scatter(*shard_pg, p.input, p.output, ReduceOp::Avg, /*consume_input=*/true);
  }
  if (!p.rs) {  // nothing to wait for in the shard group
    p.input = Tensor();
    if (replicate_pg) p.ar = replicate_pg->allreduce(p.output, ReduceOp::Avg);
  }
  r.pending.push_back(std::move(p));
}

void Unit::advance_pending() {
  for (auto it = pending.begin(); it != pending.end();) it = advance(it) ? pending.erase(it) : std::next(it);
}

bool Unit::advance(std::deque<PendingReduce>::iterator it) {
  PendingReduce& p = *it;
  if (p.rs) {
    p.rs->wait();
    p.rs = nullptr;
    p.input = Tensor();  // the full-size gradient buffer goes back now
    if (p.unit->replicate_pg) {
      p.ar = p.unit->replicate_pg->allreduce(p.output, ReduceOp::Avg);
      return false;
    }
  }
  if (p.ar) {
    p.ar->wait();
    p.ar = nullptr;
  }
  p.unit->accumulate_shard_grad(p.output, p.seen);
  return true;
}

void Unit::post_backward() {
  if (post_backward_done) return;
  post_backward_done = true;
  if (num_trainable() > 0) {
    Tensor gf = reconcile(grad_flat, false, layout.padded_numel(), compute_options());
    if (requires_sync) {
      // Every rank reduces every unit that ran forward for backward, with
      // zeros where no gradient arrived, so the collectives line up.
      if (!gf.defined()) gf = zeros({layout.padded_numel()}, compute_options());
      grad_flat = Tensor();
      expose_grads(Tensor(), false);
      issue_reduce(gf);
    } else {
      grad_flat = gf;
    }
  }
  if (requires_sync || reshard_after_backward) {
    reshard();
    root()->prefetch_backward();  // room for the next unit's gather now
  }
}

void Unit::ensure_grad_buffer() {
  if (!expects_backward || post_backward_done || state == State::SHARDED || grad_flat.defined()) return;
  // The reductions of the units before this one finish first, so their
  // full-size gradient buffers go back before this unit's is made: at most
  // one unit's unsharded gradients at a time, and the peak does not depend
  // on how fast the network was. They have had the unit's first backward
  // ops (its last layer's input and weight gradients) to run in.
  root()->advance_pending();
  // Backward accumulates in place into one buffer, the parameters' .grad()
  // its views (the engine adds into a defined .grad()).
  {
    // Charged as it is allocated: the step's peak is often this moment.
    MemoryKindScope grads_memory(MemoryKind::Gradients);
    grad_flat = zeros({layout.padded_numel()}, compute_options());
  }
  expose_grads(grad_flat, false);
}

void Unit::on_grad_ready(uint64_t generation) {
  if (generation != this->generation || !expects_backward || post_backward_done) return;
  if (--waiting == 0) post_backward();
}

void Unit::finalize_backward() {
  // Units whose backward never completed through the hooks (a parameter
  // that got no gradient, an input that needs none), in backward order.
  std::vector<std::shared_ptr<Unit>> order = alive(post_fwd_order);
  std::reverse(order.begin(), order.end());
  for (auto& u : order)
    if (u->expects_backward && !u->post_backward_done) u->post_backward();
  while (!pending.empty()) advance_pending();
  for (auto& u : alive(subtree)) u->expects_backward = false;
  bwd_anchor.reset();
  callback_queued = false;
}

// ---- hooks ---------------------------------------------------------------

Tensor Unit::pre_forward(const Tensor& input) {
  // A unit inside a checkpointed region would gather again (and redo its
  // bookkeeping) when the region is recomputed; the region's own module may
  // be a unit: its hooks run outside the region (nn/checkpoint.h).
  EMBER_CHECK(autograd::checkpoint_forward_depth() == 0 && !autograd::in_checkpoint_recompute(), "fully_shard: unit ",
              type,
              " runs inside an activation-checkpointed region; checkpoint the unit's own module (or modules "
              "inside it) instead of a module around it");
  auto r = root();
  if (r.get() == this) {
    // A new iteration: last forward's order drives this one's prefetch.
    if (!post_fwd_order.empty() || !fwd_order.empty()) prev_fwd_order = fwd_order;
    fwd_order.clear();
    post_fwd_order.clear();
  }
  ++generation;
  expects_backward = false;
  post_backward_done = false;
  r->fwd_order.push_back(shared_from_this());
  unshard();
  if (!shares_storage) fwd_version = layout.flat().storage_version();
  if (forward_prefetch) {
    const std::vector<std::shared_ptr<Unit>> order = alive(r->prev_fwd_order);
    auto it = std::find(order.begin(), order.end(), shared_from_this());
    for (int k = 0; it != order.end() && k < prefetch_limit && ++it != order.end(); ++k) (*it)->start_gather();
  }
  Tensor in = input;
  if (cast_inputs && in.defined() && is_floating(in.dtype()) && in.dtype() != compute_dtype) in = in.to(compute_dtype);
  input_hooked = false;
  if (GradMode::is_enabled() && in.defined() && in.requires_grad()) {
    std::weak_ptr<Unit> weak = shared_from_this();
    const uint64_t gen = generation;
    autograd::register_hook(in, [weak, gen](const Tensor&) {
      if (auto u = weak.lock()) u->on_grad_ready(gen);
      return Tensor();
    });
    input_hooked = true;
  }
  return in;
}

Tensor Unit::post_forward(const Tensor& output) {
  auto r = root();
  r->post_fwd_order.push_back(shared_from_this());
  const bool will_backward = GradMode::is_enabled() && output.defined() && output.requires_grad();
  if (will_backward) {
    expects_backward = true;
    // Note [when a unit's backward is over] (docs/design.md).
    waiting = num_trainable() + (input_hooked ? 1 : 0);
    if (reshard_after_forward && !is_root) free_unsharded();
  } else {
    reshard();
  }
  if (is_root && output_dtype && output.defined() && is_floating(output.dtype()) && output.dtype() != *output_dtype) {
    // The cast is the same distributed tensor (a tensor-parallel head's
    // vocab-sharded logits stay annotated for the parallel loss).
    Tensor cast_output = output.to(*output_dtype);
    if (auto meta = output.impl().shard_meta) cast_output.impl().shard_meta = meta;
    return cast_output;
  }
  return Tensor();
}

void Unit::pre_backward() {
  auto r = root();
  if (!r->callback_queued && autograd::in_backward()) {
    r->callback_queued = true;
    std::weak_ptr<Unit> weak = r;
    autograd::queue_callback([weak] {
      if (auto u = weak.lock()) u->finalize_backward();
    });
  }
  if (post_backward_done || !expects_backward) return;
  unshard();
  // The forward saved these parameters at fwd_version; they hold the same
  // values again (gathered from the unchanged shards). See Note [storage
  // version after a re-gather] (docs/design.md).
  if (!shares_storage) layout.flat().unsafe_set_storage_version(fwd_version);
  if (num_trainable() > 0) {
    // Gradients accumulated before (unsharded accumulation) stay; a new
    // buffer waits for the first gradient (ensure_grad_buffer): this hook
    // runs before the previous unit's post-backward frees its buffers.
    grad_flat = reconcile(grad_flat, false, layout.padded_numel(), compute_options());
    expose_grads(grad_flat, false);
  }
  r->bwd_anchor = shared_from_this();
  r->prefetch_backward();
}

void Unit::prefetch_backward() {
  auto anchor = bwd_anchor.lock();
  if (!anchor || !anchor->backward_prefetch) return;
  // Gathered units still to finish their backward (the anchor, the one
  // whose post-backward is about to run, earlier prefetches): at most
  // 1 + limit of them. The unit after this one in backward order finishes
  // just after this unit's backward starts (both hooks sit on the same
  // gradient), so its release, not this hook, makes room for the prefetch.
  auto live = [&] {
    int n = 0;
    for (auto& u : alive(subtree))
      if (!u->is_root && u->expects_backward && !u->post_backward_done &&
          (u->gathering || u->state == State::UNSHARDED))
        ++n;
    return n;
  };
  const std::vector<std::shared_ptr<Unit>> order = alive(post_fwd_order);
  auto it = std::find(order.rbegin(), order.rend(), anchor);
  for (int k = 0; it != order.rend() && k < anchor->prefetch_limit && ++it != order.rend(); ++k) {
    Unit& next = **it;
    if (!next.expects_backward || next.post_backward_done || next.gathering || next.state == State::UNSHARDED) continue;
    if (live() >= 1 + anchor->prefetch_limit) break;
    next.start_gather();
  }
}

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

// A parameter tensor parallelism sharded before FSDP took its local part:
// described on the mesh both were cut from (FSDP's dimensions, the tp
// dimension, Replicate on any other), its regions the run of this rank's
// FSDP shard through the tp part's boxes. Written where both would write.
std::shared_ptr<const DTensorSpec> compose_with_tensor_parallel(const std::shared_ptr<Unit>& up, size_t i,
                                                                const DTensorSpec& tp, const FlatBuffer::Piece* pc,
                                                                const std::string& layout, int replica) {
  const Unit& u = *up;
  const std::string name = u.names[i];
  auto root = u.mesh->root();
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
    if (u.mesh->has_dim(dim) || tp.mesh->has_dim(dim)) dims.push_back(dim);
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
    if (u.mesh->has_dim(dim)) {
      const bool shards = u.strategy == ShardingStrategy::HYBRID_SHARD ? u.mesh->dim_index(dim) == 1
                                                                       : u.strategy != ShardingStrategy::NO_SHARD;
      if (shards) p = Shard(0);
    } else if (tp.mesh->has_dim(dim)) {
      p = tp.placements[tp.mesh->dim_index(dim)];
    }
    spec->placements.push_back(p);
  }
  const int64_t begin = pc ? pc->entry_offset : 0, end = begin + (pc ? pc->numel : 0);
  std::vector<Region> rs;
  int64_t off = 0;
  for (const Region& r : tp.regions()) {
    const int64_t lo = std::max(begin, off), hi = std::min(end, off + r.numel);
    if (hi > lo) rs.push_back(Region{r.box, r.begin + (lo - off), hi - lo});
    off += r.numel;
  }
  if (rs.empty()) rs.push_back(Region{tp.region.box, 0, 0});
  spec->region = rs.front();
  if (rs.size() > 1) spec->parts = rs;
  spec->layout = "fsdp:" + layout + "+tensor_parallel";
  spec->writes = tp.writes && replica == 0 && (u.layout.entries()[i].numel > 0 || u.shard_rank == 0);
  attach_shard_data(*spec, up, i);
  return spec;
}

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

}  // namespace

std::shared_ptr<FSDPModule> fully_shard(const std::shared_ptr<nn::Module>& module, const FSDPOptions& options) {
  EMBER_CHECK(module != nullptr, "fully_shard: module is null");
  const std::string who = "fully_shard(" + module->type_name() + ")";
  EMBER_CHECK(unit_of(module.get()) == nullptr, who, ": this module is already wrapped");
  EMBER_CHECK(options.prefetch_limit >= 0, who, ": prefetch_limit must be at least 0, got ", options.prefetch_limit);
  Groups groups = resolve_groups(options, who);

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

  // The parameters no inner unit holds, under their names in this module.
  // One an enclosing unit holds means the wrapping went top-down.
  std::unordered_set<const TensorImpl*> inner;
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
    u->names.push_back(named[i].first);
    u->params.push_back(p);
    u->trainable.push_back(p.requires_grad());
  }
  for (auto* g : {groups.shard.get(), groups.replicate.get()})
    if (g)
      EMBER_CHECK(g->device().type == device.type, who, ": the parameters are on ", device, " but the ",
                  g->backend_name(), " group works on ", g->device(), "; move the module first");
  u->device = device;
  u->compute_dtype = options.mp_policy.param_dtype.value_or(master);
  u->reduce_dtype = options.mp_policy.reduce_dtype.value_or(u->compute_dtype);
  EMBER_CHECK(is_floating(u->compute_dtype) && is_floating(u->reduce_dtype), who,
              ": param_dtype and reduce_dtype must be floating");
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
      for (auto& [n, b] : module->named_buffers())
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
  for (size_t i = 0; i < u->params.size(); ++i) {
    u->params[i].set_grad(Tensor());
    u->params[i].set_data(u->shard_view(u->shard, i));  // Note [set_data keeps identity]
  }
  attach_shard_specs(u);
  u->state = Unit::State::SHARDED;
  u->seen_shard.assign(u->params.size(), false);
  u->seen_unsharded.assign(u->params.size(), false);

  module->set_transform_state(kStateKey, u);

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
  u->hooks.push_back(
      module->register_forward_pre_hook([u](nn::Module&, const Tensor& x) { return u->pre_forward(x); }));
  u->hooks.push_back(module->register_forward_hook(
      [u](nn::Module&, const Tensor&, const Tensor& out) { return u->post_forward(out); }));
  u->hooks.push_back(module->register_full_backward_pre_hook([u](nn::Module&, const Tensor&) {
    u->pre_backward();
    return Tensor();
  }));
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

}  // namespace ember::distributed
