// The graph and the engine: records nodes for core's differentiable ops and
// runs backward over them. The engine is single-threaded; the ready queue is
// ordered by sequence number (the most recently recorded node first), with
// gradient accumulators first of all, so a parameter's .grad() is final as
// early as possible — what DDP's overlap of communication with backward needs.
#include <algorithm>
#include <atomic>
#include <cctype>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "autograd/autograd.h"
#include "core/autocast.h"
#include "core/profiler.h"
#include "core/ops.h"

namespace ember::autograd {
namespace {

std::atomic<uint64_t> g_next_sequence{0};
constexpr uint64_t kAccumulatorPriority = UINT64_MAX;

// Callbacks queued during the backward passes running on this thread,
// innermost last (a hook may run a nested backward).
thread_local std::vector<std::vector<std::function<void()>>*> t_callbacks;

// Runs `body` as one backward pass: callbacks queued meanwhile run once it
// finishes, in order (a callback may queue more). If the graph or a callback
// throws, the rest are dropped and the error propagates.
template <typename Body>
void with_backward_callbacks(Body&& body) {
  std::vector<std::function<void()>> callbacks;
  t_callbacks.push_back(&callbacks);
  struct Pop {
    ~Pop() { t_callbacks.pop_back(); }
  } pop;
  body();
  for (size_t i = 0; i < callbacks.size(); ++i) {
    auto cb = std::move(callbacks[i]);
    cb();
  }
}

AutogradMeta* meta_of(const Tensor& t) {
  return t.defined() ? dynamic_cast<AutogradMeta*>(t.impl().autograd_meta.get()) : nullptr;
}

AutogradMeta& ensure_meta(const Tensor& t) {
  auto& slot = t.impl().autograd_meta;
  if (!slot) slot = std::make_shared<AutogradMeta>();
  auto* m = dynamic_cast<AutogradMeta*>(slot.get());
  EMBER_INTERNAL_ASSERT(m != nullptr);
  return *m;
}

std::shared_ptr<Node> accumulator_for(const Tensor& leaf) {
  AutogradMeta& m = ensure_meta(leaf);
  if (auto acc = m.grad_accumulator.lock()) return acc;
  auto acc = std::make_shared<Node>();
  acc->name = "AccumulateGrad";
  acc->sequence_nr = kAccumulatorPriority;
  acc->leaf = leaf.impl_ptr();
  acc->out_shape = leaf.sizes();
  acc->out_dtype = leaf.dtype();
  acc->out_device = leaf.device();
  m.grad_accumulator = acc;
  return acc;
}

// torch's names for backward nodes: "conv2d" -> "Conv2dBackward",
// "batch_norm" -> "BatchNormBackward"; leaves' nodes are "AccumulateGrad".
std::string backward_event_name(const Node& n) {
  if (n.leaf) return "AccumulateGrad";
  std::string out;
  bool upper = true;
  for (char c : n.name) {
    if (c == '_') {
      upper = true;
      continue;
    }
    out += upper ? static_cast<char>(std::toupper(static_cast<unsigned char>(c))) : c;
    upper = false;
  }
  return out + "Backward";
}

// The node a gradient for `t` flows into: its grad_fn, or its accumulator.
std::shared_ptr<Node> gradient_edge(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return nullptr;
  AutogradMeta* m = meta_of(t);
  EMBER_INTERNAL_ASSERT(m != nullptr);
  return m->grad_fn ? m->grad_fn : accumulator_for(t);
}

// A gradient may alias other tensors (add passes one gradient to both
// inputs); .grad() gets its own storage unless nothing else can see it and
// it is laid out as the leaf is (PyTorch's layout contract: a channels-last
// weight's gradient is channels-last and is taken as it is, not copied).
Tensor owned_copy(const Tensor& g, const Tensor& leaf) {
  const bool sole = g.impl_ptr().use_count() == 1 && g.impl().storage.use_count() == 1;
  const bool laid_out = g.sizes() == leaf.sizes() &&
                        (g.is_contiguous() ? leaf.is_contiguous() || leaf.numel() <= 1 : g.strides() == leaf.strides());
  if (sole && laid_out && g.storage_offset() == 0) return g;
  Tensor c = empty_like(leaf);  // the leaf's layout (g already has its dtype and device)
  c.copy_(g);
  return c;
}

void accumulate_into_leaf(Node& acc, Tensor g) {
  Tensor leaf(acc.leaf);
  AutogradMeta& m = ensure_meta(leaf);
  for (auto& h : m.hooks) {
    Tensor r = h(g);
    if (r.defined()) g = r;
  }
  if (g.dtype() != leaf.dtype() || g.device() != leaf.device()) g = g.to(leaf.device(), leaf.dtype());
  if (!m.grad.defined()) {
    m.grad = owned_copy(g, leaf);
    g = Tensor();
    set_memory_kind(m.grad, MemoryKind::Gradients);
  } else {
    m.grad += g;
  }
  for (auto& h : m.post_accumulate_hooks) h(leaf);
}

void check_saved(const Node& n) {
  for (auto& [storage, version] : n.saved_versions) {
    EMBER_CHECK(!storage->freed, "backward: a tensor that '", n.name,
                "' saved for its gradient has had its storage freed (free_storage) since the forward pass; "
                "restore it (restore_storage, then refill it and set its version back) before backward");
    if (storage->version == version) continue;
    const std::string why = storage->last_change ? storage->last_change : "an in-place op";
    EMBER_CHECK(false, "backward: a tensor that '", n.name, "' saved for its gradient was changed after the forward ",
                "pass (version ", version, " -> ", storage->version, ", last by '", why, "')",
                why == "set_data" ? "; swap a parameter's data with set_data only between iterations, once "
                                    "backward has run"
                : why == "free_storage" || why == "restore_storage"
                    ? "; its storage was freed and restored, so its contents may differ from what the forward "
                      "used: refill it with those values and set the version back (unsafe_set_storage_version)"
                    : "; clone it before modifying, or run the in-place op after backward");
  }
}

// backward_input's split of one pass: the nodes that lead to the inputs run
// now; what flows to the other nodes is kept for DeferredBackward::run.
struct Split {
  std::unordered_set<Node*> reaching;
  // Gradients already computed for nodes off the input path.
  std::vector<std::pair<std::shared_ptr<Node>, Tensor>> ready;
  // Nodes on both paths, to be asked again for their other inputs' gradients.
  struct Again {
    std::shared_ptr<Node> node;
    Tensor grad;
    std::vector<bool> wanted;
  };
  std::vector<Again> again;
  int unsplit = 0;  // nodes that computed a deferred edge's gradient anyway
};

struct ReadyOrder {
  bool operator()(const Node* a, const Node* b) const { return a->sequence_nr < b->sequence_nr; }
};

// How many edges into each node come from the part of the graph this pass
// runs (not into a deferred node, not past a node outside it): a node is
// ready once that many gradients have reached it.
template <typename Outside, typename Deferred>
std::unordered_map<Node*, int> count_dependencies(Node* root, const Outside& outside, const Deferred& deferred) {
  std::unordered_map<Node*, int> deps;
  std::vector<Node*> stack{root};
  std::unordered_set<Node*> seen{root};
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (auto& nx : n->next) {
      if (!nx || deferred(nx.get())) continue;
      ++deps[nx.get()];
      if (seen.insert(nx.get()).second && !outside(nx.get())) stack.push_back(nx.get());
    }
  }
  return deps;
}

// An interior node's step of the pass: its backward function on `g` (none
// when `g` is undefined), returning its inputs' gradients, then its saved
// state freed unless the graph is retained or a split asks it again.
// `owner` holds the nodes run so far under a split.
template <typename Deferred>
std::vector<Tensor> run_node(Node* n, const Tensor& g, bool retain_graph, Split* split, const Deferred& deferred,
                             const std::unordered_map<Node*, std::shared_ptr<Node>>& owner) {
  std::vector<Tensor> grads;
  EMBER_CHECK(!n->released, "backward: trying to backward through the graph a second time (node '", n->name,
              "'); its saved tensors were freed by the first backward. Pass retain_graph=true to the first "
              "backward if you need to run it twice");
  // Under a split, a node with edges off the input path is asked for
  // the others' gradients only, and asked again at run() where it
  // returned none for an edge off the path (it skipped that GEMM).
  std::vector<bool> wanted;
  const auto off_path = [&](const std::shared_ptr<Node>& nx) { return nx && deferred(nx.get()); };
  if (split != nullptr && std::any_of(n->next.begin(), n->next.end(), off_path))
    for (const auto& nx : n->next) wanted.push_back(nx && !off_path(nx));
  bool asked_again = false;
  if (g.defined()) {
    check_saved(*n);
    {
      GradWantedScope scope(wanted.empty() ? nullptr : &wanted);
      grads = n->fn(g);
    }
    EMBER_INTERNAL_ASSERT(grads.size() == n->next.size(), "node '", n->name, "' returned ", grads.size(),
                          " gradients for ", n->next.size(), " inputs");
    if (!wanted.empty()) {
      Split::Again again{owner.at(n), g, std::vector<bool>(n->next.size(), false)};
      bool computed = false;
      for (size_t i = 0; i < n->next.size(); ++i) {
        if (!n->next[i] || wanted[i]) continue;
        if (grads[i].defined())
          split->ready.emplace_back(n->next[i], grads[i]), computed = true;
        else
          again.wanted[i] = asked_again = true;
      }
      if (asked_again) split->again.push_back(std::move(again));
      split->unsplit += computed;
    }
  }
  if (!retain_graph && !n->stateless && !asked_again) {
    n->fn = nullptr;
    n->released = true;
    n->saved_versions.clear();
  }
  return grads;
}

// Runs the graph under `root` with `root_grad`. When `capture` is non-empty,
// gradients reaching those nodes are stored there instead of accumulated.
// first_seq > 0 confines the pass to the nodes recorded from first_seq on
// (a checkpointed region's recompute): every other node it reaches, leaves'
// accumulators included, is neither run nor looked past, and the gradient
// reaching it lands in `capture`.
// With `split`, only the nodes in split->reaching run; see Split.
void run_backward(const std::shared_ptr<Node>& root, Tensor root_grad, bool retain_graph,
                  std::unordered_map<Node*, Tensor>* capture, uint64_t first_seq = 0, Split* split = nullptr) {
  auto outside = [&](const Node* n) {
    return first_seq > 0 && n != root.get() && (n->leaf || n->sequence_nr < first_seq);
  };
  auto deferred = [&](Node* n) { return split != nullptr && split->reaching.count(n) == 0; };
  std::unordered_map<Node*, int> deps = count_dependencies(root.get(), outside, deferred);
  NoGradGuard no_grad;
  std::unordered_map<Node*, Tensor> buffer;
  buffer[root.get()] = std::move(root_grad);
  std::priority_queue<Node*, std::vector<Node*>, ReadyOrder> ready;
  ready.push(root.get());
  // Keeps nodes alive while we run even if releasing closures drops the last owner.
  std::vector<std::shared_ptr<Node>> keep{root};
  std::unordered_map<Node*, std::shared_ptr<Node>> owner;  // under a split: the nodes run, to ask again
  if (split != nullptr) owner[root.get()] = root;
  while (!ready.empty()) {
    Node* n = ready.top();
    ready.pop();
    Tensor g = std::move(buffer[n]);
    buffer.erase(n);
    if (outside(n)) {
      if (g.defined()) {
        Tensor& slot = (*capture)[n];
        slot = slot.defined() ? slot + g : g;
      }
      continue;
    }
    std::vector<Tensor> grads;
    // One profiler event per node, hooks included (DDP's bucket allreduces
    // start from the accumulators' hooks).
    profiler::Scope prof(profiler::Kind::Backward, profiler::enabled() ? backward_event_name(*n) : std::string());
    if (prof.active()) prof.arg("sequence_nr", static_cast<int64_t>(n->sequence_nr));
    if (g.defined()) {
      for (auto& h : n->pre_hooks) {
        Tensor r = h(g);
        if (r.defined()) g = r;
      }
    }
    if (n->leaf) {
      if (g.defined()) {
        if (capture) {
          auto it = capture->find(n);
          if (it != capture->end()) it->second = it->second.defined() ? it->second + g : g;
        } else {
          accumulate_into_leaf(*n, std::move(g));  // moved: a gradient nothing else holds is kept, not copied
        }
      }
    } else if (capture && capture->count(n)) {
      // autograd::grad w.r.t. a non-leaf: stop here.
      auto& slot = (*capture)[n];
      if (g.defined()) slot = slot.defined() ? slot + g : g;
    } else {
      grads = run_node(n, g, retain_graph, split, deferred, owner);
    }
    for (size_t i = 0; i < n->next.size(); ++i) {
      const auto& nx = n->next[i];
      if (!nx || deferred(nx.get())) continue;
      if (i < grads.size() && grads[i].defined()) {
        Tensor gi = grads[i];
        EMBER_INTERNAL_ASSERT(gi.sizes() == nx->out_shape, "node '", n->name, "' produced a gradient of shape ",
                              shape_str(gi.sizes()), " for input ", i, " of shape ", shape_str(nx->out_shape));
        Tensor& slot = buffer[nx.get()];
        slot = slot.defined() ? slot + gi : gi;
      }
      if (--deps[nx.get()] == 0) {
        keep.push_back(nx);
        if (split != nullptr) owner[nx.get()] = nx;
        ready.push(nx.get());
      }
    }
  }
}

Tensor default_root_grad(const Tensor& root, const Tensor& grad, const char* op) {
  if (grad.defined()) {
    EMBER_CHECK(grad.sizes() == root.sizes(), op, ": gradient of shape ", shape_str(grad.sizes()),
                " does not match the output's shape ", shape_str(root.sizes()));
    return grad.to(root.device(), root.dtype());
  }
  EMBER_CHECK(root.numel() == 1, op, ": grad can be implicitly created only for a one-element output, got shape ",
              shape_str(root.sizes()), "; pass a gradient of that shape");
  return ones(root.sizes(), root.options());
}

class Recorder final : public AutogradRecorder {
 public:
  void record(const char* op, const std::vector<Tensor>& inputs, Tensor& output, BackwardFn fn,
              const std::vector<Tensor>& saved, bool stateless) override {
    auto node = std::make_shared<Node>();
    node->name = op;
    node->stateless = stateless;
    node->fn = std::move(fn);
    node->sequence_nr = g_next_sequence.fetch_add(1);
    node->next.reserve(inputs.size());
    for (const Tensor& t : inputs) {
      node->next.push_back(gradient_edge(t));
      // The output must be a new handle: tagging an input would rewrite its history.
      if (t.defined() && t.is_same(output)) output = output.alias();
    }
    for (const Tensor& t : saved)
      if (t.defined()) node->saved_versions.emplace_back(t.impl().storage, t.impl().storage->version);
    node->out_shape = output.sizes();
    node->out_dtype = output.dtype();
    node->out_device = output.device();
    auto m = std::make_shared<AutogradMeta>();
    m->requires_grad = true;
    m->grad_fn = std::move(node);
    output.impl().autograd_meta = std::move(m);
  }

  void set_requires_grad(const Tensor& t, bool enabled) override {
    AutogradMeta* m = meta_of(t);
    EMBER_CHECK(!(m && m->grad_fn), "requires_grad_: only leaves can change requires_grad; this tensor ",
                shape_str(t.sizes()), " was produced by '", m ? m->grad_fn->name : "", "' (use detach())");
    EMBER_CHECK(!enabled || is_floating(t.dtype()), "requires_grad_: only floating-point tensors can require ",
                "gradients, got ", t.dtype());
    ensure_meta(t).requires_grad = enabled;
  }

  bool is_leaf(const Tensor& t) override {
    AutogradMeta* m = meta_of(t);
    return !(m && m->grad_fn);
  }

  Tensor grad(const Tensor& t) override {
    AutogradMeta* m = meta_of(t);
    return m ? m->grad : Tensor();
  }

  void set_grad(const Tensor& t, const Tensor& g) override {
    EMBER_CHECK(!g.defined() || (g.sizes() == t.sizes() && g.dtype() == t.dtype() && g.device() == t.device()),
                "set_grad: gradient ", g.defined() ? shape_str(g.sizes()) : "", " does not match the tensor ",
                shape_str(t.sizes()), " ", t.dtype(), " on ", t.device());
    ensure_meta(t).grad = g;
  }

  void backward(const Tensor& root, const Tensor& grad, bool retain_graph) override {
    EMBER_CHECK(root.requires_grad(), "backward: the tensor ", shape_str(root.sizes()),
                " does not require grad and has no grad_fn (did every input come from detached data, or did the "
                "forward run under NoGradGuard?)");
    Tensor g = default_root_grad(root, grad, "backward");
    with_backward_callbacks([&] { run_backward(gradient_edge(root), g, retain_graph, nullptr); });
  }
};

Recorder g_recorder;
// Installs the recorder when the library loads: linking //autograd is
// what turns recording on.
const bool g_installed = [] {
  set_autograd_recorder(&g_recorder);
  return true;
}();

}  // namespace

namespace detail {
std::shared_ptr<Node> gradient_edge_of(const Tensor& t) { return gradient_edge(t); }
uint64_t peek_sequence_nr() { return g_next_sequence.load(); }
uint64_t take_sequence_nr() { return g_next_sequence.fetch_add(1); }
void run_backward_within(const std::shared_ptr<Node>& root, const Tensor& root_grad, uint64_t first_seq,
                         std::unordered_map<Node*, Tensor>& boundary) {
  EMBER_INTERNAL_ASSERT(first_seq > 0 && root->sequence_nr >= first_seq);
  run_backward(root, root_grad, false, &boundary, first_seq);
}
}  // namespace detail

DeferredBackward backward_input(const Tensor& root, const Tensor& grad, const std::vector<Tensor>& inputs) {
  autocast::DisabledScope no_autocast;  // backward runs in the forward's dtypes (core/autocast.h)
  EMBER_CHECK(root.requires_grad(), "backward_input: the tensor ", shape_str(root.sizes()),
              " does not require grad and has no grad_fn");
  std::unordered_set<Node*> targets;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& in = inputs[i];
    EMBER_CHECK(in.defined() && in.is_leaf(), "backward_input: input ", i,
                " must be a leaf (a stage's received activation, detached, requires_grad_), got ",
                in.defined() ? "a tensor produced by '" + grad_fn_name(in) + "'" : std::string("an undefined tensor"));
    if (in.requires_grad()) targets.insert(gradient_edge(in).get());
  }
  const Tensor g = default_root_grad(root, grad, "backward_input");
  const std::shared_ptr<Node> top = gradient_edge(root);
  // The nodes with a path to an input, by a depth-first walk (iterative:
  // a deep model's graph is thousands of nodes long).
  Split split;
  std::unordered_map<Node*, bool> done;  // node -> finished (its reach known)
  std::vector<std::pair<Node*, size_t>> stack{{top.get(), 0}};
  done[top.get()] = false;
  while (!stack.empty()) {
    auto& [n, i] = stack.back();
    if (i < n->next.size()) {
      Node* nx = n->next[i++].get();
      if (nx != nullptr && done.emplace(nx, false).second) stack.emplace_back(nx, 0);
      continue;
    }
    bool reach = targets.count(n) > 0;
    for (auto& nx : n->next) reach = reach || (nx && split.reaching.count(nx.get()) > 0);
    if (reach) split.reaching.insert(n);
    done[n] = true;
    stack.pop_back();
  }
  if (split.reaching.count(top.get()) > 0)
    with_backward_callbacks([&] { run_backward(top, g, false, nullptr, 0, &split); });
  else
    split.ready.emplace_back(top, g);
  DeferredBackward out;
  out.split_ops_ = static_cast<int>(split.again.size());
  out.unsplit_ops_ = split.unsplit;
  if (split.ready.empty() && split.again.empty()) return out;
  // One node whose edges carry every deferred gradient: run() is then one
  // ordinary pass from it (the deferred part's dependencies count right,
  // since every edge into it from the input path is one of these).
  auto w = std::make_shared<Node>();
  w->name = "weight_grads";
  w->sequence_nr = detail::take_sequence_nr();
  std::vector<Tensor> ready_grads;
  for (auto& [node, gr] : split.ready) {
    w->next.push_back(node);
    ready_grads.push_back(gr);
  }
  for (auto& a : split.again)
    for (size_t i = 0; i < a.wanted.size(); ++i)
      if (a.wanted[i]) w->next.push_back(a.node->next[i]);
  w->fn = [ready_grads = std::move(ready_grads), again = std::move(split.again)](const Tensor&) mutable {
    std::vector<Tensor> grads = std::move(ready_grads);
    for (auto& a : again) {
      check_saved(*a.node);
      std::vector<Tensor> gs;
      {
        GradWantedScope scope(&a.wanted);
        gs = a.node->fn(a.grad);
      }
      for (size_t i = 0; i < a.wanted.size(); ++i)
        if (a.wanted[i]) grads.push_back(gs[i]);
      if (!a.node->stateless) {
        a.node->fn = nullptr;
        a.node->released = true;
        a.node->saved_versions.clear();
      }
      a.grad = Tensor();
    }
    again.clear();
    return grads;
  };
  w->out_shape = {1};
  out.root_ = std::move(w);
  return out;
}

void DeferredBackward::run() {
  EMBER_CHECK(root_ != nullptr,
              "DeferredBackward::run: nothing left to run (it ran already, or "
              "backward_input deferred nothing: pending() is false)");
  autocast::DisabledScope no_autocast;
  std::shared_ptr<Node> root = std::move(root_);
  root_ = nullptr;
  with_backward_callbacks([&] { run_backward(root, zeros({1}), false, nullptr); });
}

void register_hook(const Tensor& t, TensorHook hook) {
  EMBER_CHECK(t.requires_grad(), "register_hook: the tensor ", shape_str(t.sizes()),
              " does not require grad, so no gradient will reach a hook");
  AutogradMeta& m = ensure_meta(t);
  if (m.grad_fn) m.grad_fn->pre_hooks.push_back(std::move(hook));
  else m.hooks.push_back(std::move(hook));
}

void register_post_accumulate_grad_hook(const Tensor& t, PostAccumulateHook hook) {
  EMBER_CHECK(t.requires_grad() && t.is_leaf(), "register_post_accumulate_grad_hook: expected a leaf that ",
              "requires grad, got ", shape_str(t.sizes()), t.is_leaf() ? " (requires_grad is false)" : " (a non-leaf)");
  ensure_meta(t).post_accumulate_hooks.push_back(std::move(hook));
}

void retain_grad(const Tensor& t) {
  EMBER_CHECK(t.requires_grad(), "retain_grad: the tensor ", shape_str(t.sizes()), " does not require grad");
  AutogradMeta& m = ensure_meta(t);
  if (!m.grad_fn) return;  // leaves keep .grad anyway
  std::weak_ptr<TensorImpl> weak = t.impl_ptr();
  m.grad_fn->pre_hooks.push_back([weak](const Tensor& g) {
    if (auto impl = weak.lock()) {
      AutogradMeta& mm = ensure_meta(Tensor(impl));
      mm.grad = mm.grad.defined() ? mm.grad + g : g.clone();
    }
    return Tensor();
  });
}

void queue_callback(std::function<void()> callback) {
  EMBER_CHECK(!t_callbacks.empty(), "queue_callback: no backward pass is running on this thread; call it from a "
              "hook during backward (it runs when that pass finishes)");
  t_callbacks.back()->push_back(std::move(callback));
}

bool in_backward() { return !t_callbacks.empty(); }

std::string grad_fn_name(const Tensor& t) {
  AutogradMeta* m = meta_of(t);
  return m && m->grad_fn ? m->grad_fn->name : "";
}

void zero_grad(const Tensor& t, bool set_to_none) {
  AutogradMeta* m = meta_of(t);
  if (!m || !m->grad.defined()) return;
  if (set_to_none) {
    m->grad = Tensor();
  } else {
    NoGradGuard g;
    m->grad.zero_();
  }
}

std::vector<Tensor> grad(const Tensor& output, const std::vector<Tensor>& inputs, const Tensor& grad_output,
                         bool retain_graph) {
  autocast::DisabledScope no_autocast;  // backward runs in the forward's dtypes (core/autocast.h)
  EMBER_CHECK(output.requires_grad(), "autograd::grad: the output ", shape_str(output.sizes()),
              " does not require grad");
  std::unordered_map<Node*, Tensor> capture;
  std::vector<std::shared_ptr<Node>> targets;
  for (size_t i = 0; i < inputs.size(); ++i) {
    EMBER_CHECK(inputs[i].requires_grad(), "autograd::grad: input ", i, " ", shape_str(inputs[i].sizes()),
                " does not require grad");
    targets.push_back(gradient_edge(inputs[i]));
    capture[targets.back().get()] = Tensor();
  }
  Tensor root_grad = default_root_grad(output, grad_output, "autograd::grad");
  with_backward_callbacks([&] { run_backward(gradient_edge(output), root_grad, retain_graph, &capture); });
  std::vector<Tensor> out;
  for (auto& t : targets) out.push_back(capture[t.get()]);
  return out;
}

}  // namespace ember::autograd
