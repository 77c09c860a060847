// DistributedDataParallel: the reducer (gradient buckets, each a FlatBuffer
// of its parameters' gradients; readiness tracking, allreduce launch order,
// end-of-backward finalisation), the
// cross-rank parameter check and the coalesced broadcasts of parameters and
// buffers. See ddp.h for the contract; sync_batch_norm.cc has SyncBatchNorm.
//
// Life of one synchronized step:
//   forward()   broadcasts buffers, then prepare(): every parameter unready.
//   backward    leaf pre-hook: make .grad() the parameter's bucket view
//               (zeroed if it was released), so the engine's in-place
//               accumulation writes straight into the bucket;
//               post-accumulate hook: mark ready; a bucket whose parameters
//               are all ready is launched once every earlier bucket was, so
//               all ranks issue the same collectives in the same order.
//   callback    (autograd::queue_callback, end of the pass) handles unused
//               parameters, launches what is left, waits for every bucket.
#include "distributed/parallel/ddp.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>
#include <utility>

#include "autograd/autograd.h"
#include "core/autograd_hook.h"
#include "core/ops.h"
#include "distributed/comm/object_collectives.h"
#include "distributed/init.h"
#include "distributed/parallel/flat_buffer.h"

namespace ember::distributed {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// Name, shape, dtype, and the layout: gradient buckets are laid out as the
// parameters, so ranks that disagree on a weight's layout would add
// unrelated elements (PyTorch checks strides across ranks for this too).
std::string param_description(const std::string& name, const Tensor& p) {
  std::ostringstream os;
  os << "'" << name << "' " << shape_str(p.sizes()) << " " << dtype_name(p.dtype());
  if (p.suggest_memory_format() == MemoryFormat::ChannelsLast) os << " channels-last";
  return os.str();
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::string line;
  std::istringstream is(s);
  while (std::getline(is, line)) out.push_back(line);
  return out;
}

// Device for the small control tensors of a collective: where the model
// lives (NCCL needs CUDA tensors).
Device comm_device(const std::vector<Tensor>& params, const std::vector<Tensor>& buffers) {
  if (!params.empty()) return params.front().device();
  if (!buffers.empty()) return buffers.front().device();
  return kCPU;
}

// Throws on every rank, naming the first parameter that differs and the
// ranks on each side, unless all ranks describe the same parameters.
void check_same_parameters(ProcessGroup& pg, const std::vector<std::pair<std::string, Tensor>>& named) {
  std::string mine;
  for (auto& [name, p] : named) mine += param_description(name, p) + "\n";
  std::vector<std::string> all = allgather_strings(pg, mine);
  std::vector<std::vector<std::string>> lines;
  size_t most = 0;
  for (auto& s : all) {
    lines.push_back(split_lines(s));
    most = std::max(most, lines.back().size());
  }
  auto at = [&](int r, size_t i) { return i < lines[r].size() ? lines[r][i] : std::string(); };
  for (size_t i = 0; i < most; ++i) {
    const std::string ref = at(0, i);
    std::vector<int> same{0}, differ;
    for (int r = 1; r < pg.size(); ++r) (at(r, i) == ref ? same : differ).push_back(r);
    if (differ.empty()) continue;
    std::ostringstream os;
    os << "DistributedDataParallel: the ranks hold different parameters (every rank must wrap the same model); "
       << "first difference at parameter #" << i << ": ";
    auto describe = [&](int r) {
      std::string d = at(r, i);
      os << "rank " << r << " has " << (d.empty() ? "no such parameter (" + std::to_string(lines[r].size()) +
                                                        " parameters in all)"
                                                  : d);
    };
    describe(0);
    for (int r : differ) {
      os << "; ";
      describe(r);
    }
    os << ". Ranks agreeing with rank 0: [";
    for (size_t k = 0; k < same.size(); ++k) os << (k ? ", " : "") << same[k];
    os << "], differing: [";
    for (size_t k = 0; k < differ.size(); ++k) os << (k ? ", " : "") << differ[k];
    os << "]";
    throw Error(os.str());
  }
}

// Broadcasts `tensors` from `root` in one collective per (dtype, device)
// instead of one per tensor (a ResNet has hundreds of buffers).
void broadcast_coalesced(ProcessGroup& pg, const std::vector<Tensor>& tensors, int root) {
  if (tensors.empty() || pg.size() == 1) return;
  NoGradGuard no_grad;
  std::map<std::tuple<int, int, int>, std::vector<Tensor>> groups;
  for (const Tensor& t : tensors) {
    if (t.numel() == 0) continue;
    Device d = t.device();
    groups[{static_cast<int>(t.dtype()), static_cast<int>(d.type), d.index}].push_back(t.detach());
  }
  std::vector<std::pair<Tensor, std::vector<Tensor>*>> flats;
  std::vector<std::shared_ptr<Work>> works;
  for (auto& [key, members] : groups) {
    std::vector<Tensor> parts;
    for (auto& t : members) parts.push_back(t.reshape({-1}));
    Tensor flat = parts.size() == 1 ? parts[0].contiguous().clone() : cat(parts, 0);
    works.push_back(pg.broadcast(flat, root));
    flats.emplace_back(flat, &members);
  }
  for (auto& w : works) w->wait();
  if (pg.rank() == root) return;
  for (auto& [flat, members] : flats) {
    int64_t off = 0;
    for (Tensor& t : *members) {
      t.copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  }
}

// A Work that runs `then` once after `inner` completed (torch's
// Future.then), e.g. to cast a compressed bucket back.
class ThenWork : public Work {
 public:
  ThenWork(std::shared_ptr<Work> inner, std::function<void()> then) : inner_(std::move(inner)), then_(std::move(then)) {}
  bool is_completed() override { return inner_->is_completed(); }
  bool is_success() override { return inner_->is_success(); }
  void wait() override {
    inner_->wait();
    run_then();
  }
  bool wait(Millis timeout) override {
    if (!inner_->wait(timeout)) return false;
    run_then();
    return true;
  }
  std::exception_ptr exception() override { return inner_->exception(); }

 private:
  void run_then() {
    if (!then_) return;
    auto f = std::move(then_);
    then_ = nullptr;
    f();
  }
  std::shared_ptr<Work> inner_;
  std::function<void()> then_;
};

CommHook compress_hook(DType low) {
  return [low](ProcessGroup& pg, const GradBucket& b, bool average) -> std::shared_ptr<Work> {
    const Tensor& bucket = b.buffer;
    if (bucket.dtype() == low) return pg.allreduce(bucket, average ? ReduceOp::Avg : ReduceOp::Sum);
    NoGradGuard no_grad;
    Tensor compressed = average ? (bucket * (1.0 / pg.size())).to(low) : bucket.to(low);
    std::shared_ptr<Work> w = pg.allreduce(compressed, ReduceOp::Sum);
    return std::make_shared<ThenWork>(w, [dst = Tensor(bucket), compressed]() mutable {
      NoGradGuard ng;
      dst.copy_(compressed);
    });
  };
}

}  // namespace

// A Work done before it is returned.
class DoneWork : public Work {
 public:
  bool is_completed() override { return true; }
  bool is_success() override { return true; }
  void wait() override {}
  bool wait(Millis) override { return true; }
  std::exception_ptr exception() override { return nullptr; }
};

CommHook allreduce_hook() {
  return [](ProcessGroup& pg, const GradBucket& bucket, bool average) -> std::shared_ptr<Work> {
    // The sum or average over one rank is the bucket itself: no collective
    // (none for a one-process step's CUDA graph to capture either).
    if (pg.size() == 1) return std::make_shared<DoneWork>();
    return pg.allreduce(bucket.buffer, average ? ReduceOp::Avg : ReduceOp::Sum);
  };
}
CommHook fp16_compress_hook() { return compress_hook(DType::Float16); }
CommHook bf16_compress_hook() { return compress_hook(DType::BFloat16); }

struct Replicated::Impl {
  struct Bucket {
    FlatBuffer grads;              // the members' gradients, in order; view(s) is member s's .grad()
    std::vector<int> members;      // local parameter slots, in buffer order
    int pending = 0;               // members not yet ready this pass
    std::shared_ptr<Work> work;    // the in-flight allreduce
  };

  DDPOptions opts;
  std::shared_ptr<ProcessGroup> pg_owner;
  ProcessGroup* pg = nullptr;
  // Weak: the module owns this state (its transform slot), and a handle
  // that outlives the module must not reach through a dangling pointer.
  std::weak_ptr<nn::Module> module;
  nn::HookHandle forward_hook;
  // Parameters that require grad, in registration order.
  std::vector<std::string> names;
  std::vector<Tensor> params;
  std::vector<int64_t> module_index;  // index in module.parameters()
  std::vector<Bucket> buckets;
  std::vector<int> bucket_of, slot_in_bucket;
  std::vector<Tensor> buffers;

  Device device;                // where the collectives' small tensors live
  bool joining = false;         // inside join_uneven_inputs
  std::vector<GradBucket> shadow;  // per bucket: zeros a joined rank contributes

  // Per-pass state.
  bool require_sync = true;     // false inside no_sync()
  bool armed = false;           // a forward outside no_sync prepared the next backward
  bool finalize_queued = false;
  size_t next_launch = 0;       // buckets [0, next_launch) have been launched
  std::vector<char> ready;
  std::vector<char> zero_attached;  // unused this pass and given a zero grad by finalize

  // Hooks outlive a DDP that is destroyed before its model: they reach it
  // through this, which the destructor nulls.
  std::shared_ptr<Impl*> handle = std::make_shared<Impl*>(this);
  ~Impl() { *handle = nullptr; }

  void build_buckets();
  void install_hooks();
  void prepare();
  void attach_grad(int i);
  void mark_ready(int i);
  void launch_ready_buckets();
  void launch(size_t b);
  void finalize();

  // One round of the join protocol (every rank, once per forward of a rank
  // still training): allreduce-max of [this rank if active else -1, 1 if
  // this step synchronizes gradients]. Returns {highest active rank or -1
  // when all have joined, whether some active rank synchronizes}.
  std::pair<int, bool> join_round(bool active, bool sync);
  // A joined rank's part of the active ranks' backward: the same bucket
  // allreduces (and unused-parameter count), with zeros.
  void shadow_backward();
};

std::pair<int, bool> Replicated::Impl::join_round(bool active, bool sync) {
  Tensor t = Tensor::from_vector({active ? double(pg->rank()) : -1.0, active && sync ? 1.0 : 0.0}, {2},
                                 {DType::Int32, device});
  pg->allreduce(t, ReduceOp::Max)->wait();
  std::vector<double> v = t.to_vector();
  return {static_cast<int>(v[0]), v[1] > 0};
}

void Replicated::Impl::shadow_backward() {
  if (shadow.empty())
    for (size_t b = 0; b < buckets.size(); ++b) {
      const FlatBuffer& g = buckets[b].grads;
      GradBucket z{static_cast<int>(b), zeros_like(g.flat()), {}, b + 1 == buckets.size()};
      for (size_t s = 0; s < g.size(); ++s) z.gradients.push_back(g.view_in(z.buffer, s));
      shadow.push_back(std::move(z));
    }
  std::vector<std::shared_ptr<Work>> works;
  for (GradBucket& z : shadow) {
    z.buffer.zero_();
    works.push_back(opts.comm_hook(*pg, z, opts.average));
  }
  if (opts.find_unused_parameters && !params.empty())
    works.push_back(pg->allreduce(zeros({static_cast<int64_t>(params.size())}, {DType::Int32, device}),
                                  ReduceOp::Sum));
  for (auto& w : works) w->wait();
}

void Replicated::Impl::build_buckets() {
  // Reverse registration order: roughly the order backward produces grads.
  // Per (dtype, device) an open bucket; it closes once it reaches its cap
  // (first_bucket_cap_mb for the first of its kind, then bucket_cap_mb).
  struct Open {
    std::vector<int> members;
    int64_t bytes = 0;
  };
  std::map<std::tuple<int, int, int>, Open> open;
  std::map<std::tuple<int, int, int>, int> closed_count;
  std::vector<std::vector<int>> assigned;
  auto cap_bytes = [&](int closed) {
    return (closed == 0 ? opts.first_bucket_cap_mb : opts.bucket_cap_mb) * kMiB;
  };
  for (int i = static_cast<int>(params.size()) - 1; i >= 0; --i) {
    const Tensor& p = params[i];
    Device d = p.device();
    std::tuple<int, int, int> key{static_cast<int>(p.dtype()), static_cast<int>(d.type), d.index};
    Open& b = open[key];
    b.members.push_back(i);
    b.bytes += static_cast<int64_t>(p.nbytes());
    if (static_cast<double>(b.bytes) >= cap_bytes(closed_count[key])) {
      assigned.push_back(std::move(b.members));
      open.erase(key);
      ++closed_count[key];
    }
  }
  for (auto& [key, b] : open)
    if (!b.members.empty()) assigned.push_back(std::move(b.members));
  // Buckets become ready in the order of their first member (the members
  // are in descending index order): highest first.
  std::stable_sort(assigned.begin(), assigned.end(),
                   [](const std::vector<int>& a, const std::vector<int>& b) { return a.front() > b.front(); });

  bucket_of.assign(params.size(), -1);
  slot_in_bucket.assign(params.size(), -1);
  for (auto& members : assigned) {
    Bucket bucket;
    bucket.members = members;
    std::vector<std::pair<std::string, Shape>> layout;
    std::vector<MemoryFormat> formats;  // each view laid out as its parameter (PyTorch's gradient layout contract)
    for (size_t s = 0; s < members.size(); ++s) {
      layout.emplace_back(names[members[s]], params[members[s]].sizes());
      formats.push_back(params[members[s]].suggest_memory_format());
      bucket_of[members[s]] = static_cast<int>(buckets.size());
      slot_in_bucket[members[s]] = static_cast<int>(s);
    }
    // One rank's whole gradients: no padding (allreduce needs none).
    bucket.grads = FlatBuffer(layout, params[members.front()].options(), 1, formats);
    set_memory_kind(bucket.grads.flat(), MemoryKind::Gradients);  // the .grad()s are its views
    buckets.push_back(std::move(bucket));
  }
  ready.assign(params.size(), 0);
  zero_attached.assign(params.size(), 0);
}

void Replicated::Impl::install_hooks() {
  std::shared_ptr<Impl*> h = handle;
  for (int i = 0; i < static_cast<int>(params.size()); ++i) {
    autograd::register_hook(params[i], [h, i](const Tensor&) {
      if (Impl* self = *h) self->attach_grad(i);
      return Tensor();
    });
    autograd::register_post_accumulate_grad_hook(params[i], [h, i](const Tensor&) {
      if (Impl* self = *h) self->mark_ready(i);
    });
  }
}

void Replicated::Impl::prepare() {
  armed = true;
  finalize_queued = false;
  next_launch = 0;
  std::fill(ready.begin(), ready.end(), 0);
  std::fill(zero_attached.begin(), zero_attached.end(), 0);
  for (auto& b : buckets) {
    b.pending = static_cast<int>(b.members.size());
    b.work.reset();
  }
}

// Makes parameter i's .grad() its bucket view, keeping the current value
// (zero when it was released), so accumulation lands in the bucket.
void Replicated::Impl::attach_grad(int i) {
  Tensor view = buckets[bucket_of[i]].grads.view(slot_in_bucket[i]);
  Tensor cur = params[i].grad();
  if (cur.defined() && cur.shares_storage(view) && cur.storage_offset() == view.storage_offset() &&
      cur.sizes() == view.sizes() && cur.strides() == view.strides())
    return;
  NoGradGuard no_grad;
  if (cur.defined()) view.copy_(cur);
  else view.zero_();
  params[i].set_grad(view);
}

void Replicated::Impl::mark_ready(int i) {
  // Joined ranks learned at forward time that this backward synchronizes
  // and are waiting for its buckets: skipping them now would leave them
  // one collective ahead of us.
  EMBER_CHECK(!(joining && armed && !require_sync), "DistributedDataParallel (rank ", pg->rank(),
              "): inside join_uneven_inputs, this backward runs inside no_sync() but its forward ran outside it, "
              "and the ranks that have joined were told at that forward that gradients would be synchronized; run "
              "the forward inside no_sync() too (with GradientAccumulator, pass the loss as a function: "
              "acc.backward([&] { return loss_fn((*ddp)(x), y); }))");
  if (!armed || !require_sync) return;  // no DDP forward, or inside no_sync: local accumulation only
  if (!finalize_queued) {
    std::shared_ptr<Impl*> h = handle;
    autograd::queue_callback([h] {
      if (Impl* self = *h) self->finalize();
    });
    finalize_queued = true;
  }
  EMBER_CHECK(!ready[i], "DistributedDataParallel: parameter '", names[i],
              "' was marked ready twice in one backward pass; each synchronized backward needs its own forward "
              "(a second backward over a retained graph is not supported)");
  ready[i] = 1;
  Bucket& b = buckets[bucket_of[i]];
  if (--b.pending == 0) launch_ready_buckets();
}

// Launches ready buckets in index order, so every rank issues the same
// sequence of allreduces whatever order its gradients arrived in.
void Replicated::Impl::launch_ready_buckets() {
  if (!opts.overlap) return;  // finalize launches them all
  while (next_launch < buckets.size() && buckets[next_launch].pending == 0) launch(next_launch++);
}

void Replicated::Impl::launch(size_t b) {
  const FlatBuffer& g = buckets[b].grads;
  fr::CallerTag caller("DDP gradient bucket");
  buckets[b].work =
      opts.comm_hook(*pg, GradBucket{static_cast<int>(b), g.flat(), g.views(), b + 1 == buckets.size()}, opts.average);
}

void Replicated::Impl::finalize() {
  armed = false;
  finalize_queued = false;
  std::vector<int> unused;
  for (int i = 0; i < static_cast<int>(params.size()); ++i)
    if (!ready[i]) unused.push_back(i);
  if (!unused.empty() && !opts.find_unused_parameters) {
    std::ostringstream os;
    os << "DistributedDataParallel (rank " << pg->rank() << "): " << unused.size()
       << " parameter(s) received no gradient in this backward pass, so their buckets cannot be reduced: ";
    for (size_t k = 0; k < unused.size(); ++k) os << (k ? ", " : "") << names[unused[k]];
    os << ". Make every parameter contribute to the loss, or construct DDP with "
       << "find_unused_parameters=true (DDPOptions) to reduce them with zero gradients.";
    throw Error(os.str());
  }
  // Unused parameters count as ready with whatever their bucket view holds
  // (zero, unless no_sync steps accumulated into it).
  for (int i : unused) {
    zero_attached[i] = !params[i].grad().defined();
    attach_grad(i);
    ready[i] = 1;
    --buckets[bucket_of[i]].pending;
  }
  if (opts.overlap) {
    launch_ready_buckets();
  } else {
    while (next_launch < buckets.size()) launch(next_launch++);
  }
  EMBER_INTERNAL_ASSERT(next_launch == buckets.size(), "DDP: ", buckets.size() - next_launch,
                        " buckets were not launched");
  // Which parameters some rank used: the globally unused keep no .grad(),
  // as they would without DDP. Launched after the buckets, in the same order
  // on every rank.
  Tensor used;
  std::shared_ptr<Work> used_work;
  if (opts.find_unused_parameters && !params.empty()) {
    std::vector<double> flags(params.size(), 1.0);
    for (int i : unused) flags[i] = 0.0;
    used = Tensor::from_vector(flags, {static_cast<int64_t>(flags.size())},
                               {DType::Int32, params.front().device()});
    used_work = pg->allreduce(used, ReduceOp::Sum);
  }
  for (auto& b : buckets) b.work->wait();
  if (used_work) {
    used_work->wait();
    std::vector<double> counts = used.to_vector();
    for (int i : unused)
      if (zero_attached[i] && counts[i] == 0) params[i].set_grad(Tensor());
  }
  // Under live recovery the step a rank commits must be the same on every
  // rank, buffers included. Each rank's forward updated its own (batch
  // norm's running statistics from its own batch) and only the next
  // forward's broadcast makes rank 0's everyone's: were rank 0 lost in
  // between, a survivor would hand on its own statistics. So rank 0's go
  // out now too (the same values the next forward sends again: nothing
  // changes buffers between a backward and the next forward).
  if (opts.broadcast_buffers && !buffers.empty() && pg->size() > 1 && !joining && live_recovery_enabled())
    broadcast_coalesced(*pg, buffers, 0);
}

namespace {
constexpr const char* kStateKey = "replicate";
}  // namespace

std::shared_ptr<Replicated> replicate(const std::shared_ptr<nn::Module>& module, const DDPOptions& options,
                                      std::shared_ptr<DeviceMesh> mesh) {
  EMBER_CHECK(module != nullptr, "replicate: the module is null");
  EMBER_CHECK(replicated_of(*module) == nullptr, "replicate(", module->type_name(), "): already replicated");
  EMBER_CHECK(options.bucket_cap_mb > 0 && options.first_bucket_cap_mb > 0,
              "replicate: bucket_cap_mb and first_bucket_cap_mb must be positive, got ", options.bucket_cap_mb, " and ",
              options.first_bucket_cap_mb);
  EMBER_CHECK(!(mesh && options.process_group), "replicate: give a mesh or DDPOptions::process_group, not both");
  if (mesh)
    EMBER_CHECK(mesh->ndim() == 1, "replicate: a 1-D mesh, got ", mesh->to_string(),
                " (replicate over one of its dimensions: mesh->submesh({\"dp\"}))");
  auto impl = std::make_shared<Replicated::Impl>();
  impl->pg_owner = mesh ? mesh->group() : options.process_group ? options.process_group : default_group();
  impl->pg = impl->pg_owner.get();
  impl->module = module;
  impl->opts = options;
  if (!impl->opts.comm_hook) impl->opts.comm_hook = allreduce_hook();
  ProcessGroup& pg = *impl->pg;

  auto named = module->named_parameters();
  std::vector<Tensor> all_params;
  for (size_t k = 0; k < named.size(); ++k) {
    all_params.push_back(named[k].second);
    if (!named[k].second.requires_grad()) continue;
    impl->names.push_back(named[k].first);
    impl->params.push_back(named[k].second);
    impl->module_index.push_back(static_cast<int64_t>(k));
  }
  impl->buffers = module->buffers();
  impl->device = comm_device(all_params, impl->buffers);
  if (pg.size() > 1) {
    check_same_parameters(pg, named);
    std::vector<Tensor> state = all_params;
    state.insert(state.end(), impl->buffers.begin(), impl->buffers.end());
    broadcast_coalesced(pg, state, 0);
  }
  impl->build_buckets();
  impl->install_hooks();
  // Before each forward: buffers from rank 0 (or, inside join_uneven_inputs,
  // from a rank still training), and the next backward armed unless inside
  // no_sync or without grad.
  std::shared_ptr<Replicated::Impl*> h = impl->handle;
  impl->forward_hook = module->register_forward_pre_hook([h](nn::Module&, const Tensor&) {
    Replicated::Impl* self = *h;
    if (!self) return Tensor();
    const bool sync = GradMode::is_enabled() && self->require_sync;
    int buffer_root = 0;
    // Joined ranks shadow this step: tell them whether gradients follow, and
    // take buffers from a rank still training (rank 0 may have joined).
    if (self->joining && self->pg->size() > 1) buffer_root = self->join_round(true, sync).first;
    if (self->opts.broadcast_buffers) broadcast_coalesced(*self->pg, self->buffers, buffer_root);
    if (sync)
      self->prepare();
    else
      self->armed = false;
    return Tensor();
  });
  module->set_transform_state(kStateKey, impl);
  return std::make_shared<Replicated>(impl);
}

std::shared_ptr<Replicated> replicated_of(const nn::Module& module) {
  auto impl = module.transform_state_as<Replicated::Impl>(kStateKey);
  return impl ? std::make_shared<Replicated>(impl) : nullptr;
}

ProcessGroup& Replicated::process_group() const { return *impl_->pg; }
nn::Module& Replicated::module() const {
  auto m = impl_->module.lock();
  EMBER_CHECK(m != nullptr, "Replicated::module: the module is gone");
  return *m;
}

void Replicated::remove() {
  if (*impl_->handle == nullptr) return;
  impl_->forward_hook.remove();
  *impl_->handle = nullptr;
  if (auto m = impl_->module.lock(); m && m->transform_state(kStateKey) == impl_)
    m->set_transform_state(kStateKey, nullptr);
}

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<nn::Module> module, DDPOptions options)
    : nn::Module("DistributedDataParallel"), module_(std::move(module)) {
  EMBER_CHECK(module_ != nullptr, "DistributedDataParallel: the module is null");
  register_module("module", module_);
  rep_ = replicate(module_, options);
}

DistributedDataParallel::~DistributedDataParallel() {
  if (rep_) rep_->remove();
}

int64_t join_uneven_inputs(Replicated& rep, const std::function<void()>& body) {
  auto& impl = *rep.impl_;
  EMBER_CHECK(!impl.joining, "join_uneven_inputs: already inside join_uneven_inputs for this module");
  impl.joining = true;
  int64_t shadowed = 0;
  try {
    body();
    // This rank's data is done: shadow the others until every rank is.
    while (impl.pg->size() > 1) {
      auto [root, sync] = impl.join_round(false, false);
      if (root < 0) break;
      if (impl.opts.broadcast_buffers) broadcast_coalesced(*impl.pg, impl.buffers, root);
      if (sync) impl.shadow_backward();
      ++shadowed;
    }
  } catch (...) {
    impl.joining = false;
    throw;
  }
  impl.joining = false;
  return shadowed;
}

std::vector<std::vector<int64_t>> Replicated::bucket_indices() const {
  std::vector<std::vector<int64_t>> out;
  for (auto& b : impl_->buckets) {
    std::vector<int64_t> idx;
    for (int i : b.members) idx.push_back(impl_->module_index[i]);
    out.push_back(std::move(idx));
  }
  return out;
}

Replicated::NoSync::NoSync(Replicated& rep) : impl_(rep.impl_), previous_(rep.impl_->require_sync) {
  impl_->require_sync = false;
}

Replicated::NoSync::~NoSync() { impl_->require_sync = previous_; }

GradientAccumulator::GradientAccumulator(Replicated& rep, int steps) : rep_(rep), steps_(steps) {
  EMBER_CHECK(steps >= 1, "GradientAccumulator: steps must be at least 1, got ", steps);
}

bool GradientAccumulator::backward(const std::function<Tensor()>& loss_fn) {
  const bool last = done_ + 1 == steps_;
  if (last) {
    Tensor loss = loss_fn();
    (steps_ == 1 ? loss : loss * (1.0 / steps_)).backward();
  } else {
    auto guard = rep_.no_sync();
    (loss_fn() * (1.0 / steps_)).backward();
  }
  done_ = last ? 0 : done_ + 1;
  return last;
}

bool GradientAccumulator::backward(const Tensor& loss) {
  Tensor scaled = steps_ == 1 ? loss : loss * (1.0 / steps_);
  const bool last = done_ + 1 == steps_;
  if (last) {
    scaled.backward();
  } else {
    auto guard = rep_.no_sync();
    scaled.backward();
  }
  done_ = last ? 0 : done_ + 1;
  return last;
}

}  // namespace ember::distributed
