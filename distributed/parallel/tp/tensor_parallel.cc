// Tensor-parallel styles (tensor_parallel.h): each shards the parameters of
// the module it is applied to and hooks the module's boundaries; every
// conversion of an activation is one DTensor redistribute on the tp mesh.
// The hooks and the few tensors a style keeps between its pre- and
// post-hook live in the module's transform state, nowhere else.
#include "distributed/parallel/tp/tensor_parallel.h"

#include <fnmatch.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <unordered_set>

#include "autograd/autograd.h"
#include "core/cuda_graph.h"
#include "core/exception.h"
#include "core/ops.h"
#include "nn/float8.h"
#include "nn/layers.h"
#include "nn/transformer.h"

namespace ember::distributed {

namespace {

constexpr char kKey[] = "tensor_parallel";

// What parallelize_module leaves on a module: the mesh, its hooks, and a
// style's per-forward scratch (the vocab-parallel embedding's mask).
struct TPState {
  std::shared_ptr<DeviceMesh> mesh;
  std::vector<nn::HookHandle> hooks;
  std::vector<std::string> styles;
  Tensor bias;  // a row-parallel Linear's bias, added after the reduction
  Tensor mask;  // a vocab-parallel embedding's: 1 where the token is this rank's
  std::unordered_set<const TensorImpl*> reduced_grads;
};

std::shared_ptr<TPState> state_of(nn::Module& m, const std::shared_ptr<DeviceMesh>& mesh) {
  auto s = m.transform_state_as<TPState>(kKey);
  if (!s) {
    s = std::make_shared<TPState>();
    s->mesh = mesh;
    m.set_transform_state(kKey, s);
  }
  return s;
}

bool check_replicated_enabled() {
  const char* v = std::getenv("EMBER_TP_CHECK_REPLICATED");
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

// EMBER_TP_CHECK_REPLICATED: the bytes of `x` hashed on every tp rank and
// compared; the first rank that differs from rank 0 is named.
void check_replicated(const Tensor& x, const DeviceMesh& mesh, const std::string& where) {
  if (!check_replicated_enabled()) return;
  EMBER_CHECK(!cuda_graph_capturing(), "tensor parallel check (EMBER_TP_CHECK_REPLICATED): ", where,
              " is being captured in a CUDA graph, and the check reads its hash back to the host; unset "
              "EMBER_TP_CHECK_REPLICATED or run the step uncaptured (without --cuda-graph)");
  const auto& pg = mesh.group();
  Tensor host = x.detach().contiguous().to(kCPU).contiguous();
  const uint64_t h = XXH64(host.raw_data(), static_cast<size_t>(host.numel()) * dtype_size(host.dtype()), 0);
  Tensor mine = Tensor::empty({1}, {DType::Int64, kCPU});
  std::memcpy(mine.raw_data(), &h, sizeof h);
  Tensor all = Tensor::empty({pg->size()}, {DType::Int64, pg->device()});
  pg->allgather_into_tensor(all, mine.to(pg->device()))->wait();
  const Tensor got = all.to(kCPU);
  const int64_t* v = got.data<int64_t>();
  for (int r = 1; r < pg->size(); ++r)
    EMBER_CHECK(v[r] == v[0], "tensor parallel check (EMBER_TP_CHECK_REPLICATED): ", where,
                " is declared Replicate but differs across the tp ranks (tp rank ", r,
                " holds other values than tp rank 0", "; global rank ", pg->global_rank(r), " vs ", pg->global_rank(0),
                "): each tp rank must see the same data and draw the same masks here");
}

Placement absolute(Placement p, int64_t ndim) {
  if (p.is_shard() && p.dim < 0) p.dim += static_cast<int>(ndim);
  return p;
}

// One activation from layout `from` to `to` on the 1-D tp mesh. Activation
// shards stay even (their global size is never sent around), so cutting a
// new one checks the size divides.
Tensor convert(const Tensor& x, const std::shared_ptr<DeviceMesh>& mesh, Placement from, Placement to,
               std::optional<Placement> grad, const std::string& where) {
  from = absolute(from, x.dim());
  to = absolute(to, x.dim());
  if (from.is_replicate()) check_replicated(x, *mesh, where);
  if (from == to && (!grad || absolute(*grad, x.dim()) == to)) return x;
  const int k = mesh->size();
  if (to.is_shard() && from != to)
    EMBER_CHECK(to.dim < x.dim() && x.size(to.dim) % k == 0, where, ": dimension ", to.dim, " of ",
                shape_str(x.sizes()), " does not split evenly over tp=", k,
                " (tensor parallelism keeps activation shards even: a sequence length divisible by the tp degree)");
  std::optional<std::vector<Placement>> g;
  if (grad) g = std::vector<Placement>{absolute(*grad, x.dim())};
  return from_local(x, mesh, {from}).redistribute({to}, g).to_local();
}

// The output of a style: local, or annotated with its layout (as_dtensor).
Tensor finish(const DTensor& d, bool use_local_output) {
  return use_local_output ? d.to_local() : d.as_annotated_tensor();
}
// The same for a local tensor laid out as `layout` (an even shard).
Tensor finish(const Tensor& local, const std::shared_ptr<DeviceMesh>& mesh, Placement layout, bool use_local_output) {
  return use_local_output ? local : from_local(local, mesh, {absolute(layout, local.dim())}).as_annotated_tensor();
}

void shard_param(const Tensor& p, const std::shared_ptr<DeviceMesh>& mesh, Placement placement,
                 const std::string& name) {
  if (const ShardSpec* have = shard_spec(p)) {
    // A tied weight the other module sharded already: fine if alike.
    EMBER_CHECK(have->placements.size() == 1 && have->placements[0] == absolute(placement, p.dim()) &&
                    have->layout == "tensor_parallel",
                "parallelize_module: ", name, " is already sharded (", have->to_string(), ", layout '", have->layout,
                "'); a parameter is sharded once");
    return;
  }
  DTensor d = distribute_tensor(p.detach(), mesh, {placement});
  p.set_data(d.to_local());
  set_shard_spec(p, make_dtensor_spec(mesh, {placement}, d.shape(), "tensor_parallel"));
}

// The gradients of replicated parameters that ran on sequence shards are
// parts, summed over tp. Summed once when backward ends, all of them in one
// all-reduce, rather than one collective per parameter as each arrives
// (39 a step for a 6-layer GPT): the hook hands autograd zeros and keeps
// this pass's gradient, the end-of-backward callback adds the sums. A
// parameter FSDP manages is summed as it arrives instead: FSDP reduces its
// gradient inside backward, before the end.
struct PartialGradReducer {
  std::shared_ptr<ProcessGroup> pg;
  std::vector<std::pair<std::weak_ptr<TensorImpl>, Tensor>> pending;  // (parameter, this pass's part)
  bool queued = false;

  void flush() {
    queued = false;
    std::map<DType, std::vector<size_t>> by_dtype;
    for (size_t i = 0; i < pending.size(); ++i) by_dtype[pending[i].second.dtype()].push_back(i);
    for (auto& [dtype, idx] : by_dtype) {
      std::vector<Tensor> flat;
      for (size_t i : idx) flat.push_back(pending[i].second.reshape({-1}));
      Tensor all = cat(flat, 0).to(pg->device()).contiguous();
      pg->allreduce(all)->wait();
      int64_t off = 0;
      for (size_t i : idx) {
        const Tensor& part = pending[i].second;
        Tensor sum = all.narrow(0, off, part.numel()).view(part.sizes()).to(part.device());
        off += part.numel();
        auto impl = pending[i].first.lock();
        if (!impl) continue;
        Tensor p(impl);
        Tensor have = p.grad();
        if (have.defined())
          add_(have, sum);
        else
          p.set_grad(sum.clone());
      }
    }
    pending.clear();
  }
};

struct Ctx {
  std::shared_ptr<DeviceMesh> mesh;
  std::shared_ptr<PartialGradReducer> reducer;
};

// A parameter kept whole on every tp rank. `partial_grad`: the module runs
// on a shard of the activations, so each rank's gradient is a part and
// they are summed over tp (torch: Partial -> Replicate).
void replicate_param(TPState& st, const Tensor& p, const Ctx& ctx, bool partial_grad, const std::string& name) {
  const std::shared_ptr<DeviceMesh>& mesh = ctx.mesh;
  if (const ShardSpec* have = shard_spec(p)) {
    EMBER_CHECK(have->placements.size() == 1 && have->placements[0].is_replicate(), "parallelize_module: ", name,
                " is already sharded (", have->to_string(), ")");
  } else {
    DTensor d = distribute_tensor(p.detach(), mesh, {Replicate()});
    p.set_data(d.to_local());
    set_shard_spec(p, make_dtensor_spec(mesh, {Replicate()}, p.sizes(), "tensor_parallel"));
  }
  if (!partial_grad || !p.requires_grad() || !st.reduced_grads.insert(p.impl_ptr().get()).second) return;
  std::shared_ptr<PartialGradReducer> reducer = ctx.reducer;
  std::weak_ptr<TensorImpl> weak = p.impl_ptr();
  autograd::register_hook(p, [reducer, weak](const Tensor& g) {
    auto impl = weak.lock();
    const ShardSpec* spec = impl ? shard_spec(Tensor(impl)) : nullptr;
    if (spec && spec->layout.rfind("fsdp:", 0) == 0) {
      Tensor r = g.contiguous().clone();
      reducer->pg->allreduce(r)->wait();
      return r;
    }
    reducer->pending.push_back({weak, g.detach().contiguous()});
    if (!reducer->queued) {
      reducer->queued = true;
      autograd::queue_callback([reducer] { reducer->flush(); });
    }
    return zeros_like(g);
  });
}

// Megatron-SP's column-parallel linear: the input arrives as a sequence
// shard and is all-gathered inside the op; backward keeps only the shard
// and gathers it again for the weight gradient (one more all-gather per
// region in backward, half the region's input activation less to keep),
// then reduce-scatters the input gradient back to the shard.
nn::LinearKernel gathered_linear(const std::shared_ptr<DeviceMesh>& mesh, int seq_dim) {
  return [mesh, seq_dim](const Tensor& x, const Tensor& w, const Tensor& b) {
    const int d = seq_dim < 0 ? seq_dim + static_cast<int>(x.dim()) : seq_dim;
    auto gather = [mesh, d](const Tensor& local) {
      NoGradGuard no_grad;
      return from_local(local, mesh, {Shard(d)}).redistribute({Replicate()}).to_local();
    };
    std::vector<Tensor> inputs{x, w};
    if (b.defined()) inputs.push_back(b);
    return differentiable(
        "sequence_parallel_linear", inputs, [&] { return linear(gather(x), w, b); },
        [&](const Tensor&) {
          const Tensor xs = x, ws = w;
          const bool has_b = b.defined(), gx = x.requires_grad(), gw = w.requires_grad(),
                     gb = has_b && b.requires_grad();
          const DType xd = x.dtype(), wd = w.dtype(), bd = has_b ? b.dtype() : w.dtype();
          BackwardFn fn = [=](const Tensor& g) {
            Tensor dx, dw, db;
            const Tensor g2 = g.reshape({-1, g.size(g.dim() - 1)});
            if (gx) {
              Tensor dX = matmul(g, ws.to(g.dtype()));
              dx = from_local(dX, mesh, {Partial()}).redistribute({Shard(d)}).to_local().to(xd);
            }
            if (gw) {
              const Tensor X = gather(xs);
              dw = mm(g2.t(), X.reshape({-1, X.size(X.dim() - 1)}).to(g.dtype())).to(wd);
            }
            if (gb) db = sum(g2, {0}).to(bd);
            std::vector<Tensor> grads{dx, dw};
            if (has_b) grads.push_back(db);
            return grads;
          };
          return Recorded{std::move(fn), {xs, ws}};
        });
  };
}

// A float8 layer (nn/float8.h) split over the mesh: the amaxes of the
// operands split are maxed over it, so each rank casts its part with the
// whole tensor's scale. Returns whether `m` is one. Its part must still
// meet float8 matmuls' multiples of 16, said here rather than mid-forward.
bool split_float8(nn::Module& m, const std::shared_ptr<DeviceMesh>& mesh, bool input, bool grad_output,
                  const std::string& where) {
  auto st = m.transform_state_as<nn::Float8LinearState>(nn::kFloat8StateKey);
  if (!st) return false;
  // Judged on the whole shape, so every rank decides alike (uneven chunks
  // would leave one rank's part fit and the others' not).
  const ShardSpec* spec = shard_spec(st->weight);
  const int k = mesh->size();
  bool fits = spec != nullptr;
  for (int64_t d = 0; fits && d < st->weight.dim(); ++d) {
    const int64_t whole = spec->global_shape[d], part = st->weight.size(d);
    fits = (part == whole || part * k == whole) && part % 16 == 0;
  }
  EMBER_CHECK(fits, where, ": a float8 layer's part ", shape_str(st->weight.sizes()), " of ",
              spec ? shape_str(spec->global_shape) : std::string("?"), " over tp=", k,
              " is not a float8 matmul's (an even split, in and out features multiples of 16); use fewer tp ranks "
              "or keep the layer in high precision (Float8Options::filter)");
  auto max_over = [pg = mesh->group()](Tensor& amax) { pg->allreduce(amax, ReduceOp::Max)->synchronize(); };
  st->sync.weight = max_over;
  if (input) st->sync.input = max_over;
  if (grad_output) st->sync.grad_output = max_over;
  return true;
}

std::string where_of(const std::string& fqn, const char* style, const char* what) {
  return std::string(style) + " on '" + fqn + "' (" + what + ")";
}

// ---- the styles ----

void apply(const ColwiseParallel& s, nn::Module& m, const std::string& fqn, const Ctx& ctx) {
  const std::shared_ptr<DeviceMesh>& mesh = ctx.mesh;
  auto st = state_of(m, mesh);
  st->styles.push_back("ColwiseParallel");
  const int k = mesh->size();
  int64_t out_features = -1;
  if (auto* lin = dynamic_cast<nn::Linear*>(&m)) {
    shard_param(lin->weight, mesh, Shard(0), fqn + ".weight");
    if (lin->bias.defined()) shard_param(lin->bias, mesh, Shard(0), fqn + ".bias");
    out_features = lin->out_features;
  } else if (auto* tied = dynamic_cast<nn::TiedLinear*>(&m)) {
    shard_param(tied->weight, mesh, Shard(0), fqn + ".weight (tied)");
    out_features = shard_spec(tied->weight)->global_shape[0];
  } else if (auto* emb = dynamic_cast<nn::Embedding*>(&m)) {
    shard_param(emb->weight, mesh, Shard(1), fqn + ".weight");
    out_features = emb->embedding_dim;
  } else if (auto* attn = dynamic_cast<nn::MultiheadAttention*>(&m)) {
    EMBER_CHECK(attn->num_heads % k == 0, "ColwiseParallel on '", fqn, "': ", attn->num_heads,
                " attention heads do not split over tp=", k, " (q, k and v are split by heads)");
    shard_param(attn->in_proj_weight, mesh, Shard(0, 3), fqn + ".in_proj_weight");
    if (attn->in_proj_bias.defined()) shard_param(attn->in_proj_bias, mesh, Shard(0, 3), fqn + ".in_proj_bias");
    attn->attn_drop->stream = static_cast<uint64_t>(mesh->coordinate()[0]) + 1;  // its heads are this rank's
  } else if (auto* gqa = dynamic_cast<nn::GroupedQueryAttention*>(&m)) {
    // q, k and v by heads: each rank keeps whole groups (its k/v heads and
    // the q heads they serve), so kv heads must split.
    EMBER_CHECK(gqa->n_kv_head % k == 0, "ColwiseParallel on '", fqn, "': ", gqa->n_kv_head,
                " key/value heads do not split over tp=", k, " (grouped-query attention splits q, k and v by heads; ",
                gqa->n_head, " q heads)");
    for (auto& [name, lin] : {std::pair{"q_proj", gqa->q_proj}, {"k_proj", gqa->k_proj}, {"v_proj", gqa->v_proj}}) {
      shard_param(lin->weight, mesh, Shard(0), fqn + "." + name + ".weight");
      if (lin->bias.defined()) shard_param(lin->bias, mesh, Shard(0), fqn + "." + name + ".bias");
      split_float8(*lin, mesh, /*input=*/false, /*grad_output=*/true, "ColwiseParallel on '" + fqn + "." + name + "'");
    }
    gqa->attn_drop->stream = static_cast<uint64_t>(mesh->coordinate()[0]) + 1;
  } else {
    EMBER_CHECK(false, "ColwiseParallel on '", fqn, "': a ", m.type_name(),
                "; it applies to Linear, Embedding, TiedLinear, MultiheadAttention and GroupedQueryAttention");
  }
  const Placement in = s.input_layouts;
  const std::string win = where_of(fqn, "ColwiseParallel", "input");
  // A sequence-sharded input is gathered inside the linear op itself; a
  // float8 layer keeps its kernel (its input gathered before it), its
  // weight and output gradient split: their scales are maxed over tp.
  const bool f8 = split_float8(m, mesh, /*input=*/false, /*grad_output=*/true, "ColwiseParallel on '" + fqn + "'");
  nn::LinearKernel* kernel = nullptr;
  if (auto* lin = dynamic_cast<nn::Linear*>(&m)) kernel = &lin->kernel;
  if (auto* tied = dynamic_cast<nn::TiedLinear*>(&m)) kernel = &tied->kernel;
  if (auto* attn = dynamic_cast<nn::MultiheadAttention*>(&m)) kernel = &attn->in_proj_kernel;
  if (in.is_shard() && kernel != nullptr && !f8) {
    *kernel = gathered_linear(mesh, in.dim);
  } else {
    st->hooks.push_back(m.register_forward_pre_hook(
        [mesh, in, win](nn::Module&, const Tensor& x) { return convert(x, mesh, in, Replicate(), Partial(), win); }));
  }
  if (out_features < 0) return;  // attention: out_proj's style handles the output
  const Placement out = s.output_layouts;
  const bool local = s.use_local_output;
  st->hooks.push_back(
      m.register_forward_hook([mesh, out, local, out_features](nn::Module&, const Tensor&, const Tensor& y) {
        Shape global = y.sizes();
        global.back() = out_features;
        DTensor d = from_local(y, mesh, {Shard(-1)}, global);
        if (absolute(out, y.dim()) != Shard(static_cast<int>(y.dim()) - 1)) d = d.redistribute({out});
        return finish(d, local);
      }));
}

void apply(const RowwiseParallel& s, nn::Module& m, const std::string& fqn, const Ctx& ctx) {
  const std::shared_ptr<DeviceMesh>& mesh = ctx.mesh;
  auto st = state_of(m, mesh);
  st->styles.push_back("RowwiseParallel");
  const int k = mesh->size();
  const Placement out = s.output_layouts;
  const bool local = s.use_local_output;
  const std::string wout = where_of(fqn, "RowwiseParallel", "output");
  if (auto* lin = dynamic_cast<nn::Linear*>(&m)) {
    // An activation fused after the bias would run on each rank's partial
    // sum, before the reduction: not the layer's function.
    EMBER_CHECK(lin->activation == nn::LinearActivation::None, "RowwiseParallel on '", fqn,
                "': a Linear with a fused activation (Linear::activation) cannot be split by rows; use "
                "ColwiseParallel for it or clear the activation");
    shard_param(lin->weight, mesh, Shard(1), fqn + ".weight");
    // Input and weight split by columns.
    split_float8(m, mesh, /*input=*/true, /*grad_output=*/false, "RowwiseParallel on '" + fqn + "'");
    if (lin->bias.defined()) {
      // Added once, after the partial sums are reduced: forward runs
      // without it (the parameter stays registered; the state dict is
      // unchanged).
      replicate_param(*st, lin->bias, ctx, out.is_shard(), fqn + ".bias");
      st->bias = lin->bias;
      lin->bias = Tensor();
    }
    const Placement in = s.input_layouts;
    const std::string win = where_of(fqn, "RowwiseParallel", "input");
    st->hooks.push_back(m.register_forward_pre_hook(
        [mesh, in, win](nn::Module&, const Tensor& x) { return convert(x, mesh, in, Shard(-1), std::nullopt, win); }));
    std::weak_ptr<TPState> weak = st;
    st->hooks.push_back(
        m.register_forward_hook([mesh, out, local, wout, weak](nn::Module&, const Tensor&, const Tensor& y) {
          Tensor r = convert(y, mesh, Partial(), out, std::nullopt, wout);
          if (auto s2 = weak.lock(); s2 && s2->bias.defined()) r = r + s2->bias;
          return finish(r, mesh, out, local);
        }));
    return;
  }
  auto* emb = dynamic_cast<nn::Embedding*>(&m);
  EMBER_CHECK(emb != nullptr, "RowwiseParallel on '", fqn, "': a ", m.type_name(),
              "; it applies to Linear and Embedding");
  EMBER_CHECK(s.input_layouts.is_replicate() || s.input_layouts == Shard(-1), "RowwiseParallel on '", fqn,
              "': an embedding's token ids are Replicate, not ", s.input_layouts.to_string());
  // Vocab-parallel: this rank holds rows [v0, v1) of the table; a token
  // outside them looks up row 0 and is zeroed, so the ranks' outputs are
  // addends of the whole lookup.
  EMBER_CHECK(emb->num_embeddings >= k, "RowwiseParallel on '", fqn, "': ", emb->num_embeddings,
              " embeddings cannot give each of tp=", k, " ranks a row");
  shard_param(emb->weight, mesh, Shard(0), fqn + ".weight");
  const ShardSpec* spec = shard_spec(emb->weight);
  const int64_t v0 = spec->region.box.offsets[0], v1 = v0 + spec->region.box.lengths[0];
  EMBER_CHECK(v1 > v0, "RowwiseParallel on '", fqn, "': ", emb->num_embeddings, " rows leave tp rank ",
              mesh->coordinate()[0], " none (the chunk rule); use fewer ranks or a larger vocabulary");
  std::weak_ptr<TPState> weak = st;
  const std::string win = where_of(fqn, "RowwiseParallel", "input");
  st->hooks.push_back(m.register_forward_pre_hook([mesh, weak, v0, v1, win](nn::Module&, const Tensor& tokens) {
    check_replicated(tokens, *mesh, win);
    NoGradGuard no_grad;
    Tensor lo = full_like(tokens, static_cast<double>(v0)), hi = full_like(tokens, static_cast<double>(v1));
    Tensor mine = cast(ge(tokens, lo), DType::Float32) * cast(lt(tokens, hi), DType::Float32);
    if (auto s2 = weak.lock()) s2->mask = mine;
    return where(gt(mine, zeros_like(mine)), tokens - lo, zeros_like(tokens));
  }));
  st->hooks.push_back(
      m.register_forward_hook([mesh, weak, out, local, wout](nn::Module&, const Tensor&, const Tensor& y) {
        auto s2 = weak.lock();
        Tensor mask = cast(s2->mask, y.dtype()).unsqueeze(-1);
        s2->mask = Tensor();
        Tensor r = convert(y * mask, mesh, Partial(), out, std::nullopt, wout);
        return finish(r, mesh, out, local);
      }));
}

void apply(const SequenceParallel& s, nn::Module& m, const std::string& fqn, const Ctx& ctx) {
  const std::shared_ptr<DeviceMesh>& mesh = ctx.mesh;
  auto st = state_of(m, mesh);
  st->styles.push_back("SequenceParallel");
  for (auto& [name, p] : m.named_parameters(/*recurse=*/true))
    replicate_param(*st, p, ctx, /*partial_grad=*/true, fqn + (fqn.empty() ? "" : ".") + name);
  // Ranks hold different positions: their dropout masks must differ.
  for (auto& [name, sub] : m.named_modules())
    if (auto* d = dynamic_cast<nn::Dropout*>(sub)) d->stream = static_cast<uint64_t>(mesh->coordinate()[0]) + 1;
  const int seq = s.sequence_dim;
  const Placement in = s.input_layouts.value_or(Shard(seq));
  const std::string win = where_of(fqn, "SequenceParallel", "input");
  st->hooks.push_back(m.register_forward_pre_hook([mesh, in, seq, win](nn::Module&, const Tensor& x) {
    return convert(x, mesh, in, Shard(seq), std::nullopt, win);
  }));
  if (!s.use_local_output)
    st->hooks.push_back(m.register_forward_hook(
        [mesh, seq](nn::Module&, const Tensor&, const Tensor& y) { return finish(y, mesh, Shard(seq), false); }));
}

void apply(const PrepareModuleInput& s, nn::Module& m, const std::string& fqn, const Ctx& ctx) {
  const std::shared_ptr<DeviceMesh>& mesh = ctx.mesh;
  auto st = state_of(m, mesh);
  st->styles.push_back("PrepareModuleInput");
  const std::string win = where_of(fqn, "PrepareModuleInput", "input");
  st->hooks.push_back(m.register_forward_pre_hook([mesh, s, win](nn::Module&, const Tensor& x) {
    return convert(x, mesh, s.input_layouts, s.desired_input_layouts, s.desired_grad_layouts, win);
  }));
}

void apply(const PrepareModuleOutput& s, nn::Module& m, const std::string& fqn, const Ctx& ctx) {
  const std::shared_ptr<DeviceMesh>& mesh = ctx.mesh;
  auto st = state_of(m, mesh);
  st->styles.push_back("PrepareModuleOutput");
  const std::string wout = where_of(fqn, "PrepareModuleOutput", "output");
  st->hooks.push_back(m.register_forward_hook([mesh, s, wout](nn::Module&, const Tensor&, const Tensor& y) {
    Tensor r = convert(y, mesh, s.output_layouts, s.desired_output_layouts, s.desired_grad_layouts, wout);
    return finish(r, mesh, s.desired_output_layouts, s.use_local_output);
  }));
}

bool matches(const std::string& pattern, const std::string& name) {
  std::string p = pattern, n = name;
  std::replace(p.begin(), p.end(), '.', '/');
  std::replace(n.begin(), n.end(), '.', '/');
  return fnmatch(p.c_str(), n.c_str(), FNM_PATHNAME) == 0;
}

}  // namespace

std::string style_string(const ParallelStyle& style) {
  std::ostringstream os;
  std::visit(
      [&](const auto& s) {
        using S = std::decay_t<decltype(s)>;
        if constexpr (std::is_same_v<S, ColwiseParallel>)
          os << "ColwiseParallel(input " << s.input_layouts.to_string() << ", output " << s.output_layouts.to_string()
             << ")";
        else if constexpr (std::is_same_v<S, RowwiseParallel>)
          os << "RowwiseParallel(input " << s.input_layouts.to_string() << ", output " << s.output_layouts.to_string()
             << ")";
        else if constexpr (std::is_same_v<S, SequenceParallel>)
          os << "SequenceParallel(dim " << s.sequence_dim << ")";
        else if constexpr (std::is_same_v<S, PrepareModuleInput>)
          os << "PrepareModuleInput(" << s.input_layouts.to_string() << " -> " << s.desired_input_layouts.to_string()
             << ")";
        else
          os << "PrepareModuleOutput(" << s.output_layouts.to_string() << " -> " << s.desired_output_layouts.to_string()
             << ")";
      },
      style);
  return os.str();
}

ParallelizePlan plan_for(const ParallelizePlan& plan, const nn::Module& module) {
  ParallelizePlan out;
  for (const auto& entry : plan) {
    const std::string head = entry.first.substr(0, entry.first.find('.'));
    bool present = head == "*" || entry.first.empty();
    for (const auto& [name, child] : module.named_children()) present = present || name == head;
    // An entry for one numbered block ("h.3.mlp") belongs to the stage that
    // holds that block.
    const size_t dot2 = entry.first.find('.', head.size() + 1);
    if (present && head != "*" && dot2 != std::string::npos && entry.first.find('*') == std::string::npos) {
      const std::string block = entry.first.substr(0, dot2);
      bool held = false;
      for (auto& [name, m] : const_cast<nn::Module&>(module).named_modules()) held = held || name == block;
      present = held;
    }
    if (present) out.push_back(entry);
  }
  return out;
}

void parallelize_module(nn::Module& module, const std::shared_ptr<DeviceMesh>& tp_mesh, const ParallelizePlan& plan) {
  EMBER_CHECK(tp_mesh != nullptr && tp_mesh->ndim() == 1, "parallelize_module: the tp mesh must be one-dimensional",
              tp_mesh ? ", got " + tp_mesh->to_string() : std::string(", got null"));
  // Resolve every entry first: a wrong name changes nothing.
  auto modules = module.named_modules();
  std::vector<std::pair<nn::Module*, std::pair<std::string, const ParallelStyle*>>> todo;
  for (const auto& [pattern, style] : plan) {
    size_t found = 0;
    for (auto& [name, m] : modules)
      if (matches(pattern, name)) {
        todo.push_back({m, {name, &style}});
        ++found;
      }
    if (found == 0) {
      std::string names;
      for (size_t i = 0; i < modules.size() && i < 40; ++i)
        names += (i ? ", " : "") + (modules[i].first.empty() ? std::string("\"\"") : modules[i].first);
      EMBER_CHECK(false, "parallelize_module: the plan's '", pattern, "' (", style_string(style),
                  ") names no module of this ", module.type_name(), "; its modules: ", names,
                  modules.size() > 40 ? ", ..." : "");
    }
  }
  Ctx ctx{tp_mesh, std::make_shared<PartialGradReducer>()};
  ctx.reducer->pg = tp_mesh->group();
  for (auto& [m, entry] : todo)
    std::visit([&, m = m](const auto& s) { apply(s, *m, entry.first, ctx); }, *entry.second);
  // What the plan does not shard stays whole on every tp rank: a Replicate
  // DTensor too, so norms and checkpoints see every parameter alike.
  auto st = state_of(module, tp_mesh);
  for (auto& [name, p] : module.named_parameters())
    if (shard_spec(p) == nullptr) replicate_param(*st, p, ctx, /*partial_grad=*/false, name);
}

std::shared_ptr<DeviceMesh> tensor_parallel_mesh(const nn::Module& module) {
  auto s = module.transform_state_as<TPState>(kKey);
  return s ? s->mesh : nullptr;
}

}  // namespace ember::distributed
