// The mixture-of-experts layer (moe.h): routing, the dispatch by sorting
// (dropless, or padded to a capacity), the grouped SwiGLU experts, the
// weighted combine and the router losses fed back through the backward.
#include "nn/moe.h"

#include <cmath>
#include <limits>
#include <utility>

#include "autograd/checkpoint.h"
#include "core/autograd_hook.h"
#include "core/exception.h"
#include "core/ops.h"
#include "core/ops_nn.h"
#include "nn/transformer.h"

namespace ember::nn {

const char* router_score_name(RouterScore s) { return s == RouterScore::Softmax ? "softmax" : "sigmoid"; }

RouterScore parse_router_score(const std::string& s) {
  if (s == "softmax") return RouterScore::Softmax;
  if (s == "sigmoid") return RouterScore::Sigmoid;
  EMBER_CHECK(false, "MoE router score '", s, "': expected softmax or sigmoid");
  return RouterScore::Softmax;
}

namespace {

void check_options(const MoEOptions& o, int64_t dim) {
  EMBER_CHECK(o.num_experts >= 1, "MoE: num_experts ", o.num_experts, " (at least 1)");
  EMBER_CHECK(o.top_k >= 1 && o.top_k <= o.num_experts, "MoE: top_k ", o.top_k,
              " must be in [1, num_experts=", o.num_experts, "]");
  EMBER_CHECK(o.hidden >= 1 && dim >= 1, "MoE: dim ", dim, " and hidden ", o.hidden, " must be positive");
  EMBER_CHECK(o.shared_experts >= 0, "MoE: shared_experts ", o.shared_experts, " (0 or more)");
  EMBER_CHECK(o.aux_loss_coef >= 0 && o.z_loss_coef >= 0, "MoE: aux_loss_coef ", o.aux_loss_coef, " and z_loss_coef ",
              o.z_loss_coef, " must be >= 0");
  EMBER_CHECK(std::isfinite(o.capacity_factor) && o.capacity_factor >= 0, "MoE: capacity_factor ", o.capacity_factor,
              " must be finite and >= 0 (0: dropless)");
}

// The router losses' gradient enters here: y passes through unchanged and
// the scalar `aux` (the coefficients applied) receives 1 as its gradient whenever y's gradient
// arrives, so a backward from any loss of y trains the router's balance.
Tensor attach_aux_loss(const Tensor& y, const Tensor& aux) {
  if (!aux.requires_grad()) return y;
  return differentiable(
      "moe_aux_loss", {y, aux}, [&] { return y.alias(); },
      [&](const Tensor&) {
        const TensorOptions opts = aux.options();
        BackwardFn fn = [opts](const Tensor& g) { return std::vector<Tensor>{g, ones({}, opts)}; };
        return Recorded{fn, {}, true};
      });
}

}  // namespace

int64_t expert_capacity(const MoEOptions& o, int64_t tokens, int64_t multiple) {
  EMBER_CHECK(o.capacity_factor > 0, "expert_capacity: a dropless MoE (capacity_factor 0) has no capacity");
  EMBER_CHECK(multiple >= 1, "expert_capacity: multiple ", multiple);
  // (1 - 1e-12): a product that is a whole number in exact arithmetic may
  // land just above it in double (1.1 x 100 / 2 is 55.000000000000014).
  const double q = o.capacity_factor * static_cast<double>(tokens * o.top_k) / static_cast<double>(o.num_experts);
  const auto c = static_cast<int64_t>(std::ceil(q * (1 - 1e-12)));
  return (c + multiple - 1) / multiple * multiple;
}

TopKRouter::TopKRouter(int64_t dim, const MoEOptions& o) : Module("TopKRouter"), options(o) {
  gate = register_module("gate", std::make_shared<Linear>(dim, o.num_experts, /*bias=*/false));
}

Tensor TopKRouter::forward(const Tensor& x) { return (*gate)(x); }

Routing TopKRouter::route(const Tensor& x) {
  Routing r;
  r.logits = (*gate)(x);
  // Scores in float32 at least (16-bit logits round the softmax's ties away).
  const DType sdt = r.logits.dtype() == DType::Float64 ? DType::Float64 : DType::Float32;
  Tensor l = r.logits.to(sdt);
  r.scores = options.score == RouterScore::Softmax ? softmax(l, -1) : sigmoid(l);
  // Top k by k argmaxes (the first maximum: ties go to the lower index),
  // each choice masked out before the next.
  const int64_t E = options.num_experts;
  Tensor pick = r.scores.detach();
  std::vector<Tensor> chosen;
  const Tensor ninf = full({}, -std::numeric_limits<double>::infinity(), pick.options());
  for (int64_t j = 0; j < options.top_k && pick.size(0) > 0; ++j) {
    Tensor idx = argmax(pick, -1, /*keepdim=*/true);  // [N, 1]
    chosen.push_back(idx);
    if (j + 1 < options.top_k)
      pick = where(eq(one_hot(idx.squeeze(-1), E), ones({}, {DType::Int64, pick.device()})), ninf, pick);
  }
  r.experts = chosen.empty()       ? empty({0, options.top_k}, {DType::Int64, pick.device()})
              : chosen.size() == 1 ? chosen[0]
                                   : cat(chosen, -1);
  r.weights = gather(r.scores, -1, r.experts);
  if (options.normalize_top_k && options.top_k > 1) r.weights = r.weights / sum(r.weights, {-1}, true);
  return r;
}

GroupedExperts::GroupedExperts(int64_t E, int64_t dim, int64_t hidden) : Module("GroupedExperts"), num_experts(E) {
  // N(0, 0.02) from the default generator, as the GPT initialises every matrix.
  w1 = register_parameter("w1", randn({E, hidden, dim}) * 0.02);
  w2 = register_parameter("w2", randn({E, dim, hidden}) * 0.02);
  w3 = register_parameter("w3", randn({E, hidden, dim}) * 0.02);
}

namespace {
// Identity forward; the gradient times `s` (expert parallelism's 1/ep on
// the experts' weights).
Tensor scale_grad(const Tensor& t, double s) {
  if (s == 1.0) return t;
  return differentiable(
      "moe_weight_grad_scale", {t}, [&] { return t.alias(); },
      [&](const Tensor&) {
        BackwardFn fn = [s](const Tensor& g) { return std::vector<Tensor>{g * s}; };
        return Recorded{fn, {}, true};
      });
}
}  // namespace

Tensor GroupedExperts::operator()(const Tensor& x, const std::vector<int64_t>& counts) {
  counts_ = counts;
  return call(x);
}

Tensor GroupedExperts::operator()(const Tensor& x, const Tensor& offsets) {
  offsets_ = offsets;
  return call(x);
}

Tensor GroupedExperts::padded(const Tensor& x, int64_t capacity) {
  EMBER_CHECK(capacity >= 0, "GroupedExperts: capacity ", capacity);
  capacity_ = capacity;
  return call(x);
}

Tensor GroupedExperts::call(const Tensor& x) {
  called_ = true;
  struct Done {
    GroupedExperts* e;
    ~Done() { e->called_ = false, e->counts_.clear(), e->offsets_ = Tensor(), e->capacity_ = -1; }
  } done{this};  // also when the call throws
  return Module::operator()(x);
}

Tensor GroupedExperts::forward(const Tensor& x) {
  EMBER_CHECK(called_,
              "GroupedExperts: call experts(rows, counts or offsets) or experts.padded(rows, capacity): the rows' "
              "groups are needed");
  const int64_t G = w1.size(0);
  if (capacity_ >= 0) {
    EMBER_CHECK(x.dim() == 2 && x.size(0) == G * capacity_, "GroupedExperts: rows ", shape_str(x.sizes()), " for ", G,
                " experts of ", capacity_, " rows each");
  } else {
    const int64_t groups = offsets_.defined() ? offsets_.numel() : static_cast<int64_t>(counts_.size());
    EMBER_CHECK(groups == G, "GroupedExperts: ", groups, " groups for the ", G, " experts held here");
  }
  // Weights a data-parallel wrapper left in float32 (FSDP's ignored
  // parameters) compute in the tokens' dtype, as the gathered ones would.
  const Tensor a = scale_grad(w1, weight_grad_scale).to(x.dtype());
  const Tensor b = scale_grad(w2, weight_grad_scale).to(x.dtype());
  const Tensor c = scale_grad(w3, weight_grad_scale).to(x.dtype());
  if (capacity_ >= 0) {  // [G, C, dim] x [G, dim, hidden]: cuBLAS's strided batches
    const auto bmm = [&](const Tensor& in, const Tensor& w) {
      if (!kernel || capacity_ == 0) return matmul(in, w.transpose(1, 2));
      std::vector<Tensor> each;  // the kernel (float8_linear) expert by expert
      for (int64_t e = 0; e < G; ++e) each.push_back(kernel(in.select(0, e), w.select(0, e), Tensor()));
      return stack(each, 0);
    };
    const Tensor xb = x.view({G, capacity_, x.size(1)});
    return bmm(swiglu(bmm(xb, a), bmm(xb, c)), b).reshape({G * capacity_, x.size(1)});
  }
  EMBER_CHECK(!kernel,
              "GroupedExperts: experts with a kernel of their own (float8 training's) need padded groups: "
              "give the MoE a capacity_factor (dropless groups have sizes only the device knows)");
  const auto mm = [&](const Tensor& in, const Tensor& w) {
    return offsets_.defined() ? grouped_mm(in, w, offsets_) : grouped_mm(in, w, counts_);
  };
  return mm(swiglu(mm(x, a), mm(x, c)), b);
}

MoE::MoE(int64_t dim_, MoEOptions o) : Module("MoE"), options(o), dim(dim_) {
  check_options(o, dim_);
  router = register_module("router", std::make_shared<TopKRouter>(dim_, o));
  experts = register_module("experts", std::make_shared<GroupedExperts>(o.num_experts, dim_, o.hidden));
  if (o.shared_experts > 0)
    shared_experts = register_module("shared_experts", std::make_shared<SwiGLU>(dim_, o.shared_experts * o.hidden));
}

Tensor MoE::forward(const Tensor& input) {
  EMBER_CHECK(input.dim() >= 1 && input.size(-1) == dim, "MoE: input ", shape_str(input.sizes()), " must end in dim ",
              dim);
  const Tensor x = input.reshape({-1, dim});
  Routing r = router->route(x);
  // The router's own options decide (they are the constructor's).
  const int64_t N = x.size(0), K = r.experts.size(1), E = router->options.num_experts;

  // The (token, choice) pairs sorted by expert where they are (group_order:
  // a counting sort, ties in token order), so nothing waits for the device
  // unless a dropless expert parallelism needs the counts on the host for
  // its splits.
  const GroupOrder order = group_order(r.experts, E);
  const bool padded = router->options.capacity_factor > 0;
  // Tokens per expert, on the device (the load balance's, the capacity's
  // and expert parallelism's), made only when one of them needs them.
  Tensor counts;
  if (dispatch || padded || GradMode::is_enabled()) {
    const Tensor& ends = order.offsets;
    counts = E > 1 ? ends - cat({zeros({1}, ends.options()), ends.narrow(0, 0, E - 1)}) : ends;
  }
  // What the dispatch (or the experts) gave back: `rows` rows of dim.
  const auto check_out = [&](const Tensor& out, int64_t rows) {
    EMBER_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == dim, "MoE: the dispatch",
                dispatch ? " installed on the layer" : "", " returned ", shape_str(out.sizes()), " for ", rows,
                " rows of ", dim);
  };
  Tensor out, dropped;
  if (padded) {
    // Expert e's slot j (of C) takes the j-th choice routed to e, or a zero
    // row (index N of x with a zero row appended) past its count; a choice
    // whose rank within its expert reaches C reads the zero row appended to
    // the experts' output instead (dropped).
    const int64_t C = expert_capacity(router->options, N, experts->kernel ? 16 : 1);
    const TensorOptions io = counts.options();
    const Tensor c_t = full({}, static_cast<double>(C), io);
    const Tensor starts = order.offsets - counts;
    const Tensor j = arange(static_cast<double>(C), io).unsqueeze(0);  // [1, C]
    const Tensor at =
        minimum(starts.unsqueeze(1) + j, full({}, static_cast<double>(std::max<int64_t>(N * K - 1, 0)), io));
    const Tensor src = where(lt(j, counts.unsqueeze(1)), index_select(order.rows, 0, at.reshape({E * C})).view({E, C}),
                             full({}, static_cast<double>(N), io));
    const Tensor rows = index_select(cat({x, zeros({1, dim}, x.options())}), 0, src.reshape({E * C}));
    out = dispatch ? dispatch(*experts, rows, ExpertGroups{.capacity = C}) : experts->padded(rows, C);
    check_out(out, E * C);
    const Tensor e_of = r.experts.reshape({N * K});
    const Tensor within = order.positions.reshape({N * K}) - index_select(starts, 0, e_of);
    const Tensor kept = lt(within, c_t);
    const Tensor slot = where(kept, e_of * c_t + within, full({}, static_cast<double>(E * C), io));
    out = index_select(cat({out, zeros({1, dim}, out.options())}), 0, slot).view({N, K, dim});
    dropped = sum(cast(ge(within, c_t), DType::Float64));
  } else {
    const Tensor rows = index_select(x, 0, order.rows);
    if (dispatch) {
      const Tensor host = counts.cpu().contiguous();
      out = dispatch(*experts, rows,
                     ExpertGroups{.counts = std::vector<int64_t>(host.data<int64_t>(), host.data<int64_t>() + E)});
    } else {
      out = (*experts)(rows, order.offsets);
    }
    check_out(out, N * K);
    // Back to (token, choice) order.
    out = index_select(out, 0, order.positions.reshape({N * K})).view({N, K, dim});
  }
  // Weighted, summed over the k choices.
  Tensor y = sum(out * r.weights.to(out.dtype()).unsqueeze(-1), {1});
  if (shared_experts) y = y + (*shared_experts)(x);

  // The router losses and the statistics are the training forward's: an
  // evaluation (no grad) skips them and the balance all-reduce (every rank
  // evaluates alike). A checkpointed region's recompute builds the losses
  // again (the same counts, so the all-reduce again) without counting its
  // statistics twice. A rank with no token still takes part in the sum.
  if (!GradMode::is_enabled()) return y.view(input.sizes());
  const bool recompute = autograd::in_checkpoint_recompute();
  // Over the batch's counts when balance_sum sums them (total = tokens x k,
  // so f_e = E count_e / tokens). Kept on the device from here on: reading
  // the sum or the losses back would cost a wait per layer.
  Tensor c = cast(counts, DType::Float64);
  if (balance_sum) c = balance_sum(c);
  if (!recompute) {
    tokens_sum_ = tokens_sum_.defined() ? tokens_sum_ + c : c;  // c is this forward's own
    ++forwards_;
    routed_ += N * K;
    if (dropped.defined()) dropped_sum_ = dropped_sum_.defined() ? dropped_sum_ + dropped : dropped;
  }
  if (N == 0) return y.view(input.sizes());  // no token: no loss of this rank's
  Tensor p = r.scores;
  if (router->options.score == RouterScore::Sigmoid) p = p / sum(p, {-1}, true);
  const Tensor share = full({}, static_cast<double>(E * K), c.options()) / clamp(sum(c), 1.0, std::nullopt);
  const Tensor f = (c * share).to(p.dtype());
  const Tensor aux = sum(mean(p, {0}) * f);
  Tensor l = r.logits.to(p.dtype());
  const Tensor m = max(l, {-1}, true).detach();
  const Tensor lse = log(sum(exp(l - m), {-1})) + m.squeeze(-1);
  const Tensor z = mean(lse * lse);
  if (!recompute) {
    aux_sum_ = aux_sum_.defined() ? aux_sum_ + aux.detach() : aux.detach();
    z_sum_ = z_sum_.defined() ? z_sum_ + z.detach() : z.detach();
  }
  const double ca = options.aux_loss_coef * aux_grad_scale, cz = options.z_loss_coef * aux_grad_scale;
  if (ca != 0 || cz != 0) {
    Tensor term = aux * ca + z * cz;
    if (aux_grad_scale_tensor.defined())
      term = term * aux_grad_scale_tensor.detach().to(term.device(), term.dtype()).reshape({});
    y = attach_aux_loss(y, term);
  }
  return y.view(input.sizes());
}

MoEStats MoE::stats() const {
  MoEStats st;
  st.forwards = forwards_;
  if (tokens_sum_.defined()) {
    const Tensor t = tokens_sum_.cpu().contiguous();
    for (int64_t e = 0; e < t.numel(); ++e) st.tokens_per_expert.push_back(std::llround(t.data<double>()[e]));
  }
  if (aux_sum_.defined()) st.aux_loss = aux_sum_.item(), st.z_loss = z_sum_.item();
  st.routed = routed_;
  if (dropped_sum_.defined()) st.dropped = std::llround(dropped_sum_.item());
  return st;
}

void MoE::reset_stats() {
  tokens_sum_ = aux_sum_ = z_sum_ = dropped_sum_ = Tensor();
  forwards_ = routed_ = 0;
}

std::vector<MoE*> moe_layers(Module& model) {
  std::vector<MoE*> out;
  for (auto& [name, m] : model.named_modules())
    if (auto* moe = dynamic_cast<MoE*>(m)) out.push_back(moe);
  return out;
}

void set_moe_aux_grad_scale(Module& model, double scale, const Tensor& device_scale) {
  for (MoE* m : moe_layers(model)) m->aux_grad_scale = scale, m->aux_grad_scale_tensor = device_scale;
}

void reset_moe_stats(Module& model) {
  for (MoE* m : moe_layers(model)) m->reset_stats();
}

}  // namespace ember::nn
