// FSDP's unit at run time: its state machine (sharded / gathered / freed),
// the all-gathers and reduce-scatters that move it between the states, the
// root's queue of pending reductions, and the module hooks (forward,
// backward, prefetch) that drive it. fsdp.cc wraps modules into units and
// holds the FSDPModule handle; this file is what a unit does once wrapped,
// kept apart so the state machine reads on its own. See fsdp.h for the
// design; the comments here say why each step is where it is.
#include "distributed/parallel/fsdp/fsdp_unit.h"

#include <algorithm>
#include <deque>

#include "autograd/autograd.h"
#include "autograd/checkpoint.h"
#include "core/ops.h"
#include "distributed/parallel/flat_buffer.h"
#include "distributed/parallel/fsdp/fsdp.h"

namespace ember::distributed {

using Unit = FSDPModule::Unit;

namespace fsdp_internal {

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

}  // namespace fsdp_internal

using namespace fsdp_internal;

namespace {

bool is_view_of(const Tensor& g, const Tensor& v) {
  return g.defined() && v.defined() && g.impl().storage == v.impl().storage &&
         g.storage_offset() == v.storage_offset() && g.sizes() == v.sizes() && g.strides() == v.strides() &&
         g.dtype() == v.dtype();
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

namespace {
const char* const kUnshardOverFloat8 =
    " is gathered in float8 for its forward and backward (enable_fsdp_float8_all_gather): its float8 layers' "
    "weights are casts only; call unshard() once the unit is resharded (after the step's backward, or "
    "reshard() first)";
}  // namespace

void Unit::start_gather(bool compute) {
  EMBER_CHECK(compute || !f8.active || state == State::SHARDED, "FSDPModule::unshard(): unit ", type,
              kUnshardOverFloat8);
  if (state == State::UNSHARDED || gathering) return;
  if (shares_storage) return;  // the shard is the whole buffer: nothing to gather
  if (compute && float8_gather_applies()) {
    start_float8_gather();
    return;
  }
  drop_float8_gathered();
  NoGradGuard ng;
  MemoryKindScope gathered_memory(MemoryKind::Gathered);
  if (layout.released()) layout.restore();
  Tensor src = shard_on_device();
  if (shard_size == 1) {
    // The cast to the compute dtype within the copy: one pass, no
    // temporary the unit's size.
    Tensor flat = layout.flat();
    flat.copy_(src);
    return;
  }
  if (src.dtype() != compute_dtype) src = src.to(compute_dtype);
  gather_src = src;
  gather_work = layout.all_gather(*shard_pg, src);
  gathering = true;
}

void Unit::finish_gather() {
  if (!gathering) return;
  gathering = false;
  if (f8.active) {
    finish_float8_gather();
    return;
  }
  auto w = std::move(gather_work);
  gather_src = Tensor();
  w->synchronize();
}

void Unit::unshard(bool compute) {
  if (!compute && f8.active) {
    EMBER_CHECK(state == State::SHARDED, "FSDPModule::unshard(): unit ", type, kUnshardOverFloat8);
    // A float8 prefetch in flight: let it land, then gather as asked.
    finish_gather();
    drop_float8_gathered();
  }
  if (state == State::UNSHARDED) return;
  start_gather(compute);
  finish_gather();
  if (state == State::SHARDED) {
    // The sharded gradients the parameters carry now (honouring a
    // zero_grad since) are kept aside while the parameters are whole.
    shard_grad = reconcile(live_shard_grad(), true, shard_numel(), master_options());
    shard_grad_weak.reset();
    for (size_t i = 0; i < params.size(); ++i)
      if (trainable[i]) seen_shard[i] = params[i].grad().defined();
    point_params_at_gathered();
    expose_grads(grad_flat, false);
  } else if (!shares_storage) {
    // FREED: the same buffers again, unless this gather is of the other
    // kind (float8 or not) than the forward's.
    point_params_at_gathered();
  }
  state = State::UNSHARDED;
}

void Unit::free_unsharded() {
  if (state != State::UNSHARDED || shares_storage) return;
  finish_gather();
  if (f8.active)
    drop_float8_gathered(/*keep=*/true);  // for this forward's backward
  else
    layout.release(
        "its FSDP unit freed the gathered parameters after the forward (FULL_SHARD) and gathers them again for "
        "backward; after the step the parameters are shards (FSDPModule::unshard() gathers them whole)");
  state = State::FREED;
}

void Unit::reshard() {
  finish_gather();
  if (state == State::SHARDED) {
    drop_float8_gathered();  // a float8 prefetch that landed: nothing computes with it
    return;
  }
  grad_flat = reconcile(grad_flat, false, layout.padded_numel(), compute_options());
  for (size_t i = 0; i < params.size(); ++i) params[i].set_data(shard_view(shard, i));
  expose_grads(shard_grad, true);
  if (!shares_storage && !layout.released()) layout.release();
  drop_float8_gathered();
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
  unshard(/*compute=*/true);
  fwd_float8 = f8.active;
  if (!shares_storage) fwd_version = gathered_storage().storage_version();
  if (forward_prefetch) {
    const std::vector<std::shared_ptr<Unit>> order = alive(r->prev_fwd_order);
    auto it = std::find(order.begin(), order.end(), shared_from_this());
    for (int k = 0; it != order.end() && k < prefetch_limit && ++it != order.end(); ++k)
      (*it)->start_gather(/*compute=*/true);
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
  unshard(/*compute=*/fwd_float8);
  // The forward saved these parameters at fwd_version; they hold the same
  // values again (gathered from the unchanged shards). See Note [storage
  // version after a re-gather] (docs/design.md).
  if (!shares_storage) gathered_storage().unsafe_set_storage_version(fwd_version);
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
    next.start_gather(/*compute=*/next.fwd_float8);
  }
}
}  // namespace ember::distributed
