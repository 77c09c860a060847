// Activation checkpointing (checkpoint.h). The forward runs the region with
// the graph on, reads off the region's boundary — the nodes outside it that
// its ops' gradients flow into (parameters' accumulators, the inputs' and
// any captured tensor's producers) — and drops the region's own nodes,
// which frees everything they saved. The outputs get fresh nodes that
// collect their gradients and lead to one region node whose edges are that
// boundary. The region node recomputes the region from its inputs, runs a
// backward confined to the recomputed nodes (engine_internal.h) and hands
// the gradients that reached the boundary to the enclosing pass. Inputs
// are detached for the recompute, so their gradients arrive at fresh
// leaves and are passed on to the inputs' own nodes.
#include "autograd/checkpoint.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <unordered_set>

#include "autograd/engine_internal.h"
#include "core/allocator.h"
#include "core/autocast.h"
#include "core/ops.h"

namespace ember::autograd {
namespace {

thread_local int t_forward_depth = 0;
thread_local bool t_recomputing = false;

bool keepable(const char* op) {
  const auto& ops = keepable_ops();
  return std::find(ops.begin(), ops.end(), op) != ops.end();
}

// What an output was: the recompute's must match it.
struct OutMeta {
  bool defined = false;
  Shape sizes;
  DType dtype = DType::Float32;
  Device device;
  explicit OutMeta(const Tensor& t) : defined(t.defined()) {
    if (!defined) return;
    sizes = t.sizes();
    dtype = t.dtype();
    device = t.device();
  }
  bool operator==(const OutMeta& o) const {
    return defined == o.defined && (!defined || (sizes == o.sizes && dtype == o.dtype && device == o.device));
  }
  std::string str() const {
    if (!defined) return "undefined";
    return shape_str(sizes) + " " + dtype_name(dtype) + " on " + device.str();
  }
};

// The kept outputs of one region's ops, in forward order; the recompute
// takes them back in the same order.
class KeptOutputs final : public SavedOpOutputs {
 public:
  KeptOutputs(SavePolicy policy, std::string region) : policy_(std::move(policy)), region_(std::move(region)) {}

  bool replay(const char* op, Tensor& out) override {
    if (!recomputing_ || !wants(op)) return false;
    EMBER_CHECK(
        next_ < kept_.size() && kept_[next_].first == op, region_, ": the recompute ran '", op, "' where ",
        next_ < kept_.size() ? "the forward ran '" + kept_[next_].first + "'" : std::string("the forward had ended"),
        " (kept op ", next_, "); the region must run the same ops when recomputed");
    out = kept_[next_++].second.alias();
    return true;
  }
  void offer(const char* op, const Tensor& out) override {
    if (!recomputing_ && wants(op)) kept_.emplace_back(op, out.alias());
  }
  void begin_recompute() {
    recomputing_ = true;
    next_ = 0;
  }
  void end_recompute() {
    recomputing_ = false;
    EMBER_CHECK(next_ == kept_.size(), region_, ": the recompute ran ", next_, " of the ", kept_.size(),
                " ops the forward kept (next '", kept_[next_].first, "'); the region must run the same ops");
  }

 private:
  bool wants(const char* op) const { return policy_ && keepable(op) && policy_(op); }

  SavePolicy policy_;
  std::string region_;
  std::vector<std::pair<std::string, Tensor>> kept_;
  size_t next_ = 0;
  bool recomputing_ = false;
};

// Installs `kept` as this thread's SavedOpOutputs for a scope (null: none,
// so an enclosing region does not see a nested one's ops).
class KeptScope {
 public:
  explicit KeptScope(SavedOpOutputs* kept) : prev_(saved_op_outputs()) { set_saved_op_outputs(kept); }
  ~KeptScope() { set_saved_op_outputs(prev_); }

 private:
  SavedOpOutputs* prev_;
};

class GradEnabled {
 public:
  GradEnabled() : prev_(GradMode::is_enabled()) { GradMode::set_enabled(true); }
  ~GradEnabled() { GradMode::set_enabled(prev_); }

 private:
  bool prev_;
};

// Puts the default generator at `offset` for a scope, then back.
class RngScope {
 public:
  RngScope(bool on, uint64_t offset) : on_(on), saved_(default_generator().offset()) {
    if (on_) default_generator().set_offset(offset);
  }
  ~RngScope() {
    if (on_) default_generator().set_offset(saved_);
  }

 private:
  bool on_;
  uint64_t saved_;
};

template <typename T>
class FlagScope {
 public:
  FlagScope(T& flag, T value) : flag_(flag), prev_(flag) { flag_ = value; }
  ~FlagScope() { flag_ = prev_; }

 private:
  T& flag_;
  T prev_;
};

uint64_t digest(const Tensor& t) {
  if (!t.defined()) return 0;
  Tensor c = t.detach().contiguous().to(kCPU);
  const auto* p = static_cast<const unsigned char*>(c.raw_data());
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < static_cast<size_t>(c.numel()) * c.element_size(); ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

bool bitwise_check() {
  static const bool on = [] {
    const char* v = std::getenv("EMBER_CHECKPOINT_CHECK");
    return v != nullptr && std::strcmp(v, "0") != 0 && v[0] != '\0';
  }();
  return on;
}

Tensor detached_like(const Tensor& t) {
  if (!t.defined()) return t;
  Tensor d = t.detach();
  d.impl().shard_meta = t.impl().shard_meta;  // a distributed tensor stays one
  if (t.requires_grad()) d.requires_grad_();
  return d;
}

struct Region {
  CheckpointOptions opts;
  RegionFn fn;
  std::vector<Tensor> inputs;
  std::vector<uint64_t> input_versions;
  uint64_t rng_offset = 0;
  autocast::State autocast{};
  uint64_t forward_nodes = 0;
  std::vector<OutMeta> out_meta;
  std::vector<bool> out_grad;  // which outputs got a node
  std::vector<uint64_t> out_digest;
  std::vector<Tensor> out_grads;  // gathered from the output nodes in backward
  // The region node's edges (owned by it): the boundary of the region.
  std::vector<Node*> boundary;
  // Storages the region's ops saved for backward that outlive the region
  // (parameters, inputs, buffers), at the versions they were read at.
  std::vector<std::pair<std::weak_ptr<Storage>, uint64_t>> read;
  std::vector<uint64_t> watch_versions;  // after the forward
  // The leaves (parameters) the region's graph reaches, with the storage
  // and version they had after the forward. `read` above sees the storages
  // the ops saved, which for a parameter may be a copy (autocast's cast, a
  // channels-last weight): a step of the parameter, or new storage given
  // by set_data, would pass unseen there (Note [caches]).
  struct LeafRead {
    std::weak_ptr<TensorImpl> impl;
    std::weak_ptr<Storage> storage;
    uint64_t version;
  };
  std::vector<LeafRead> leaves;
  std::unique_ptr<KeptOutputs> kept;

  std::vector<Tensor> backward();
  void check_unchanged() const;
};

void Region::check_unchanged() const {
  const std::string& name = opts.name;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined() || inputs[i].storage_version() == input_versions[i]) continue;
    const char* why = inputs[i].impl().storage->last_change;
    EMBER_CHECK(false, name, ": input ", i, " ", shape_str(inputs[i].sizes()), " was changed in place after the ",
                "forward (by '", why ? why : "an in-place op", "'); the recompute would not see the values the ",
                "forward used. Clone it before changing it");
  }
  for (size_t i = 0; i < opts.watch.size(); ++i) {
    const Tensor& t = opts.watch[i].second;
    if (!t.defined() || t.storage_version() == watch_versions[i]) continue;
    const char* why = t.impl().storage->last_change;
    EMBER_CHECK(false, name, ": '", opts.watch[i].first, "' was changed after the region's forward (by '",
                why ? why : "an in-place op", "'); the recompute would read other values than the forward did");
  }
  for (const auto& [weak, version] : read) {
    auto s = weak.lock();
    if (!s || s->version == version) continue;
    EMBER_CHECK(!s->freed, name, ": a tensor the region read in its forward has had its storage freed since; ",
                "restore it before backward");
    EMBER_CHECK(false, name, ": a tensor the region read in its forward was changed before its recompute (version ",
                version, " -> ", s->version, ", last by '", s->last_change ? s->last_change : "an in-place op",
                "'); the recompute would not repeat the forward. Keep in-place updates of what the region reads ",
                "out of it, or after backward");
  }
  for (const LeafRead& l : leaves) {
    const std::shared_ptr<TensorImpl> impl = l.impl.lock();
    if (!impl || impl->storage == nullptr) continue;  // the parameter is gone: nothing reads it again
    EMBER_CHECK(l.storage.lock() == impl->storage, name, ": a parameter ", shape_str(impl->sizes),
                " the region read in its forward was given other storage before its recompute (set_data, or a ",
                "module moved with to()); the recompute would not repeat the forward");
    // Freeing bumps the version: a storage freed already in the forward
    // (a placeholder whose data the ops did not read, as FSDP's
    // float8-gathered weights) is no change.
    if (impl->storage->version == l.version) continue;
    EMBER_CHECK(!impl->storage->freed, name, ": a parameter ", shape_str(impl->sizes),
                " the region read in its forward has had its storage freed since; restore it before backward");
    EMBER_CHECK(false, name, ": a parameter ", shape_str(impl->sizes),
                " the region read in its forward was changed before its recompute (version ", l.version, " -> ",
                impl->storage->version, ", last by '",
                impl->storage->last_change ? impl->storage->last_change : "an in-place op",
                "'); the recompute would not repeat the forward. Keep in-place updates of what the region reads ",
                "out of it, or after backward");
  }
}

std::vector<Tensor> Region::backward() {
  const std::string& name = opts.name;
  check_unchanged();
  std::vector<Tensor> detached(inputs.size());
  std::vector<std::shared_ptr<Node>> input_acc(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    detached[i] = detached_like(inputs[i]);
    if (detached[i].defined() && detached[i].requires_grad()) input_acc[i] = detail::gradient_edge_of(detached[i]);
  }
  std::vector<uint64_t> watch_before(opts.watch.size());
  for (size_t i = 0; i < opts.watch.size(); ++i)
    if (opts.watch[i].second.defined()) watch_before[i] = opts.watch[i].second.storage_version();

  const uint64_t first = detail::peek_sequence_nr();
  std::vector<Tensor> outs;
  {
    FlagScope<bool> recomputing(t_recomputing, true);
    MemoryKindScope activations(MemoryKind::Activations);  // recomputed activations, in the memory breakdown
    GradEnabled grad_on;
    autocast::RegionScope ac(autocast);
    RngScope rng(opts.preserve_rng_state, rng_offset);
    KeptScope ks(kept.get());
    kept->begin_recompute();
    outs = fn(detached);
    kept->end_recompute();
  }
  const uint64_t recorded = detail::peek_sequence_nr() - first;
  for (size_t i = 0; i < opts.watch.size(); ++i) {
    const Tensor& t = opts.watch[i].second;
    if (!t.defined() || t.storage_version() == watch_before[i]) continue;
    const char* why = t.impl().storage->last_change;
    EMBER_CHECK(false, name, ": the recompute changed '", opts.watch[i].first, "' (by '", why ? why : "an in-place op",
                "'), which the forward already changed: the update would run twice. Make the update skip ",
                "recomputes (autograd::in_checkpoint_recompute(), as BatchNorm does) or keep it out of the region");
  }
  EMBER_CHECK(outs.size() == out_meta.size(), name, ": the recompute returned ", outs.size(), " outputs, the forward ",
              out_meta.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    const Tensor& o = outs[i];
    const OutMeta now(o);
    EMBER_CHECK(now == out_meta[i], name, ": the recompute's output ", i, " is ", now.str(), ", the forward's was ",
                out_meta[i].str(), "; the region must compute the same thing when run again");
    EMBER_CHECK(!out_grad[i] || o.requires_grad(), name, ": the recompute's output ", i,
                " does not require grad, the forward's did (was the region run under another grad mode?)");
    if (bitwise_check())
      EMBER_CHECK(digest(o) == out_digest[i], name, ": the recompute's output ", i, " ", now.str(),
                  " differs from the forward's (EMBER_CHECKPOINT_CHECK): dropout without its generator, a buffer "
                  "changed in forward, or a nondeterministic kernel");
  }
  EMBER_CHECK(recorded == forward_nodes, name, ": the recompute recorded ", recorded, " autograd ops, the forward ",
              forward_nodes,
              "; the region must run the same ops when recomputed (data-dependent control flow, or "
              "state that changed since the forward?)");

  auto root = std::make_shared<Node>();
  root->name = "checkpoint_recompute";
  root->sequence_nr = detail::take_sequence_nr();
  std::vector<Tensor> grads;
  for (size_t i = 0; i < outs.size(); ++i) {
    if (!out_grad[i] || !out_grads[i].defined()) continue;
    root->next.push_back(detail::gradient_edge_of(outs[i]));
    grads.push_back(std::move(out_grads[i]));
    out_grads[i] = Tensor();
  }
  std::unordered_map<Node*, Tensor> reached;
  if (!grads.empty()) {
    root->fn = [grads](const Tensor&) { return grads; };
    detail::run_backward_within(root, zeros({}), first, reached);
  }
  outs.clear();

  std::vector<Tensor> result(boundary.size());
  std::unordered_map<Node*, size_t> slot;
  for (size_t j = 0; j < boundary.size(); ++j) slot[boundary[j]] = j;
  auto add = [&](Node* target, Tensor g, const char* what) {
    auto it = slot.find(target);
    EMBER_CHECK(it != slot.end(), name, ": the recompute sent a gradient to ", what, " '", target->name,
                "' that the forward's ops did not lead to; the region must compute the same thing when run again");
    Tensor& r = result[it->second];
    r = r.defined() ? r + g : g;
  };
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!input_acc[i]) continue;
    auto it = reached.find(input_acc[i].get());
    if (it == reached.end()) continue;
    Tensor g = std::move(it->second);
    reached.erase(it);
    if (g.defined()) add(detail::gradient_edge_of(inputs[i]).get(), g, "input");
  }
  for (auto& [node, g] : reached)
    if (g.defined()) add(node, g, node->leaf ? "the leaf of" : "the node");
  return result;
}

}  // namespace

const std::vector<std::string>& keepable_ops() {
  // Computation, then communication (a DTensor's redistribute, the
  // functional collectives).
  static const std::vector<std::string> ops{"linear",       "matmul",     "conv2d",         "sequence_parallel_linear",
                                            "redistribute", "all_gather", "reduce_scatter", "all_reduce",
                                            "all_to_all",   "grouped_mm", "all_to_all_v"};
  return ops;
}

SavePolicy save_compute_intensive() {
  return [](const std::string& op) {
    return std::find(keepable_ops().begin(), keepable_ops().end(), op) != keepable_ops().end();
  };
}

bool in_checkpoint_recompute() { return t_recomputing; }
int checkpoint_forward_depth() { return t_forward_depth; }

std::vector<Tensor> checkpoint(const RegionFn& fn, const std::vector<Tensor>& inputs,
                               const CheckpointOptions& options) {
  EMBER_CHECK(fn != nullptr, options.name, ": no function to checkpoint");
  // Nothing is saved without the graph (torch.no_grad): run it plainly.
  if (!GradMode::is_enabled() || autograd_recorder() == nullptr) return fn(inputs);
  auto region = std::make_shared<Region>();
  region->opts = options;
  region->fn = fn;
  region->inputs = inputs;
  for (const Tensor& t : inputs) region->input_versions.push_back(t.defined() ? t.storage_version() : 0);
  region->rng_offset = default_generator().offset();
  region->autocast = autocast::current_state();
  region->kept = std::make_unique<KeptOutputs>(options.save, options.name);

  const uint64_t first = detail::peek_sequence_nr();
  std::vector<Tensor> outs;
  {
    FlagScope<int> depth(t_forward_depth, t_forward_depth + 1);
    autocast::RegionScope ac(region->autocast);
    KeptScope ks(region->kept.get());
    outs = fn(inputs);
  }
  region->forward_nodes = detail::peek_sequence_nr() - first;
  for (const auto& [n, t] : options.watch) region->watch_versions.push_back(t.defined() ? t.storage_version() : 0);

  // The boundary: walk the region's nodes from the outputs.
  std::vector<std::shared_ptr<Node>> boundary;
  std::unordered_set<Node*> seen;
  std::vector<Node*> stack;
  auto visit = [&](const std::shared_ptr<Node>& n) {
    if (!n || !seen.insert(n.get()).second) return;
    if (n->leaf || n->sequence_nr < first)
      boundary.push_back(n);
    else
      stack.push_back(n.get());
  };
  for (const Tensor& o : outs)
    if (o.defined() && o.requires_grad()) visit(detail::gradient_edge_of(o));
  std::vector<std::pair<std::weak_ptr<Storage>, uint64_t>> saved;
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const auto& [s, v] : n->saved_versions) saved.emplace_back(s, v);
    for (const auto& nx : n->next) visit(nx);
  }

  region->out_grads.resize(outs.size());
  region->out_grad.assign(outs.size(), false);
  for (const Tensor& o : outs) {
    region->out_meta.emplace_back(o);
    if (bitwise_check()) region->out_digest.push_back(digest(o));
  }
  auto node = std::make_shared<Node>();
  node->name = "checkpoint";
  node->next = boundary;
  for (const auto& b : boundary) {
    region->boundary.push_back(b.get());
    if (b->leaf && b->leaf->storage) region->leaves.push_back({b->leaf, b->leaf->storage, b->leaf->storage->version});
  }
  node->sequence_nr = detail::take_sequence_nr();
  node->out_shape = {};
  node->fn = [region](const Tensor&) { return region->backward(); };
  const Tensor token = zeros({});
  for (size_t i = 0; i < outs.size(); ++i) {
    Tensor& o = outs[i];
    if (!o.defined() || !o.requires_grad()) continue;
    region->out_grad[i] = true;
    auto out_node = std::make_shared<Node>();
    out_node->name = "checkpoint_output";
    out_node->next = {node};
    out_node->sequence_nr = detail::take_sequence_nr();
    out_node->out_shape = o.sizes();
    out_node->out_dtype = o.dtype();
    out_node->out_device = o.device();
    std::weak_ptr<Region> weak = region;
    out_node->fn = [weak, i, token](const Tensor& g) {
      if (auto r = weak.lock()) r->out_grads[i] = g;
      return std::vector<Tensor>{token};
    };
    Tensor alias = o.alias();
    alias.impl().shard_meta = o.impl().shard_meta;
    auto meta = std::make_shared<AutogradMeta>();
    meta->requires_grad = true;
    meta->grad_fn = std::move(out_node);
    alias.impl().autograd_meta = std::move(meta);
    o = alias;  // drops the region's own nodes, and what they saved
  }
  // What outlives the region's nodes among what they saved: read by the
  // forward, so it must be unchanged when the recompute reads it again.
  for (auto& [weak, v] : saved)
    if (!weak.expired()) region->read.emplace_back(std::move(weak), v);
  return outs;
}

Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& x, const CheckpointOptions& options) {
  EMBER_CHECK(fn != nullptr, options.name, ": no function to checkpoint");
  auto outs = checkpoint([fn](const std::vector<Tensor>& in) { return std::vector<Tensor>{fn(in[0])}; }, {x}, options);
  return outs[0];
}

}  // namespace ember::autograd
