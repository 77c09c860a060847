// Context-parallel attention (attention.h): the three exchanges over the
// head-tail layout. Partial results are (out, lse) pairs from
// scaled_dot_product_attention_lse, merged by log-sum-exp. The all-gather's
// and the all-to-alls' merges are differentiable ops, so autograd gives
// their backwards (a reduce-scatter, the reverse all-to-alls); the ring is
// one autograd node with its own backward, which sends k and v round again
// rather than keep every slice it received.
#include "distributed/parallel/cp/attention.h"

#include <vector>

#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/ops_nn.h"
#include "distributed/comm/functional_collectives.h"
#include "distributed/parallel/cp/load_balance.h"

namespace ember::distributed::cp {

Exchange parse_exchange(const std::string& name) {
  if (name == "ring") return Exchange::Ring;
  if (name == "allgather") return Exchange::AllGather;
  if (name == "alltoall") return Exchange::AllToAll;
  EMBER_CHECK(false, "context parallelism: unknown exchange '", name, "' (ring, allgather, alltoall)");
  return Exchange::Ring;
}

const char* exchange_name(Exchange e) {
  switch (e) {
    case Exchange::Ring:
      return "ring";
    case Exchange::AllGather:
      return "allgather";
    case Exchange::AllToAll:
      return "alltoall";
  }
  return "?";
}

namespace {

// One block's attention and its rows' log-sum-exps, in the compute dtype.
struct Partial {
  Tensor out, lse;
};

Partial attend(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, std::optional<double> scale) {
  const Tensor packed = scaled_dot_product_attention_lse(q, k, v, causal, scale);
  const int64_t dv = v.size(-1);
  return {packed.narrow(-1, 0, dv), packed.select(-1, dv)};
}

// Attention over the union of two key sets from the attention over each:
// lse = log(e^a + e^b), out = (e^a out_a + e^b out_b) / e^lse. The shift m
// only keeps exp in range; its gradient cancels, so it is detached.
Partial merge(const Partial& a, const Partial& b) {
  if (!a.out.defined()) return b;
  const Tensor m = maximum(a.lse, b.lse).detach();
  const Tensor ea = exp(a.lse - m), eb = exp(b.lse - m), s = ea + eb;
  return {a.out * (ea / s).unsqueeze(-1) + b.out * (eb / s).unsqueeze(-1), m + log(s)};
}

// The global chunk index of local chunk h (0: head, 1: tail) on `rank`.
int64_t chunk_of(int h, int rank, int cp) { return h == 0 ? rank : 2 * cp - 1 - rank; }

// Natural sequence order from the rank-slice order along `dim` (cp slices
// of equal length, rank order), and back.
Tensor slices_to_sequence(const Tensor& x, int64_t dim, int cp) {
  const int64_t s = x.size(dim) / cp;
  std::vector<Tensor> parts;
  for (int r = 0; r < cp; ++r) parts.push_back(x.narrow(dim, r * s, s));
  return unshard(parts, dim, cp);
}
Tensor sequence_to_slices(const Tensor& x, int64_t dim, int cp) {
  std::vector<Tensor> parts;
  for (int r = 0; r < cp; ++r) parts.push_back(shard(x, dim, cp, r));
  return cat(parts, dim);
}

// A whole sequence's k or v in order from every rank's slice, gathered.
Tensor gather_sequence(const Tensor& x, int64_t dim, const std::shared_ptr<ProcessGroup>& pg) {
  return slices_to_sequence(functional::all_gather(x, dim, pg), dim, pg->size());
}

// A transfer posted by shift_start: its output is written once wait()
// returns.
struct Pending {
  std::shared_ptr<Work> send, recv;
  void wait() {
    if (send) send->wait();
    if (recv) recv->wait();
  }
};

// Posts the send of x to rank + 1 and the receive of rank - 1's into the
// returned tensor (valid after pending.wait()).
Tensor shift_start(const Tensor& x, ProcessGroup& pg, int tag, Pending& pending) {
  const int cp = pg.size(), rank = pg.rank();
  Tensor y = Tensor::empty(x.sizes(), x.options());
  pending.send = pg.send(x, (rank + 1) % cp, tag);
  pending.recv = pg.recv(y, (rank - 1 + cp) % cp, tag);
  return y;
}

// One block of keys a rank attends to: its query chunk h (0 head, 1 tail)
// against positions [k0, k0 + len) of the k, v in hand at `step` (the
// ring's steps; the all-gather has one).
struct KeyBlock {
  int step, h;
  int64_t k0, len;
  bool diagonal;  // the query chunk's own keys: causal within them
};

// The ring's and the all-gather's attention as one autograd node
// (FlashAttention-2's blocks, ring flash attention's schedule). Forward: the
// blocks' (out, lse) merged by log-sum-exp. It keeps q, k, v, the merged
// output and log-sum-exp and each block's log-sum-exp: the blocks' outputs
// and the k, v received are dropped, so a layer's activations are its own
// slice's. Backward: the k, v come again (the ring sends them round again,
// the all-gather gathers them again) and each block's gradients come from
// the merged output (scaled_dot_product_attention_block_grads).
class BlockAttention {
 public:
  BlockAttention(const Tensor& q, const Tensor& k, const Tensor& v, std::vector<KeyBlock> blocks,
                 std::optional<double> scale)
      : blocks_(std::move(blocks)),
        scale_(scale),
        dtype_(q.dtype()),
        dim_(q.dim() - 2),
        c_(q.size(dim_) / 2),
        d_(k.size(-1)),
        dv_(v.size(-1)) {}

  // Forward: the blocks of `step` against kv (k and v concatenated on the last dim).
  void attend_step(const Tensor& q, const Tensor& kv, int step) {
    for (; next_ < blocks_.size() && blocks_[next_].step == step; ++next_) {
      const KeyBlock& x = blocks_[next_];
      const Partial p = attend(q.narrow(dim_, x.h * c_, c_), keys(kv, x), values(kv, x), x.diagonal, scale_);
      block_lse_.push_back(p.lse.contiguous());  // a copy: the view would keep the block's output
      acc_[x.h] = merge(acc_[x.h], p);
    }
  }
  // The merged output in q's dtype (as FlashAttention keeps it; the
  // log-sum-exps stay in the compute dtype), then the backward's state.
  // An alias: the node keeps out_, so it must not be the output autograd
  // records (the recorded node would own itself through it).
  Tensor finish() {
    out_ = cat({acc_[0].out, acc_[1].out}, dim_).to(dtype_);
    lse_ = cat({acc_[0].lse, acc_[1].lse}, dim_);
    acc_[0] = acc_[1] = Partial{};
    next_ = 0;
    return out_.alias();
  }
  // Before each backward (a retained graph may run it twice): from the first block.
  void rewind() { next_ = 0; }
  // Backward: adds the blocks of `step` to dq and to dkv, the gradient of kv.
  void grads_step(const Tensor& q, const Tensor& kv, const Tensor& g, int step, Tensor& dq, Tensor& dkv) {
    for (; next_ < blocks_.size() && blocks_[next_].step == step; ++next_) {
      const KeyBlock& x = blocks_[next_];
      const auto rows = [&](const Tensor& z) { return z.narrow(dim_, x.h * c_, c_); };
      auto [gq, gk, gv] = scaled_dot_product_attention_block_grads(
          rows(q), keys(kv, x), values(kv, x), rows(out_), rows(g), rows(lse_), block_lse_[next_], x.diagonal, scale_);
      Tensor dq_rows = rows(dq), dk_rows = keys(dkv, x), dv_rows = values(dkv, x);
      add_(dq_rows, gq), add_(dk_rows, gk), add_(dv_rows, gv);
    }
  }
  TensorOptions acc_options() const { return lse_.options(); }  // the compute dtype

 private:
  Tensor keys(const Tensor& kv, const KeyBlock& x) const { return kv.narrow(dim_, x.k0, x.len).narrow(-1, 0, d_); }
  Tensor values(const Tensor& kv, const KeyBlock& x) const { return kv.narrow(dim_, x.k0, x.len).narrow(-1, d_, dv_); }

  const std::vector<KeyBlock> blocks_;
  const std::optional<double> scale_;
  const DType dtype_;
  const int64_t dim_, c_, d_, dv_;
  Partial acc_[2];
  size_t next_ = 0;
  Tensor out_, lse_;
  std::vector<Tensor> block_lse_;
};

// Runs `node`'s forward through forward(node) and records backward(node, g)
// -> {dq, dkv} (dkv the gradient of this rank's k and v, concatenated).
template <typename Fwd, typename Bwd>
Tensor block_attention(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, std::vector<KeyBlock> blocks,
                       std::optional<double> scale, Fwd forward, Bwd backward) {
  auto node = std::make_shared<BlockAttention>(q, k, v, std::move(blocks), scale);
  const int64_t d = k.size(-1), dv = v.size(-1);
  return differentiable(
      op, {q, k, v}, [&] { return forward(*node).to(q.dtype()); },
      [&](const Tensor&) {
        const Tensor sq = q, sk = k, sv = v;
        BackwardFn fn = [=](const Tensor& g) {
          NoGradGuard no_grad;
          node->rewind();
          auto [dq, dkv] = backward(*node, g.to(node->acc_options().dtype));
          return std::vector<Tensor>{dq.to(sq.dtype()), dkv.narrow(-1, 0, d).to(sk.dtype()),
                                     dkv.narrow(-1, d, dv).to(sv.dtype())};
        };
        return Recorded{std::move(fn), {sq, sk, sv}};
      });
}

Tensor allgather_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                           const std::shared_ptr<ProcessGroup>& pg, std::optional<double> scale) {
  const int cp = pg->size(), rank = pg->rank();
  const int64_t dim = q.dim() - 2, c = q.size(dim) / 2, seq = 2 * c * cp;
  std::vector<KeyBlock> blocks;
  for (int h = 0; h < 2; ++h) {
    // The keys before the chunk (all visible), then the chunk's own (causal).
    const int64_t s = chunk_of(h, rank, cp) * c;
    if (!causal) {
      blocks.push_back({0, h, 0, seq, false});
      continue;
    }
    if (s > 0) blocks.push_back({0, h, 0, s, false});
    blocks.push_back({0, h, s, c, true});
  }
  // k and v concatenated: one all-gather for both.
  const auto gather = [dim, pg](const Tensor& k, const Tensor& v) {
    return gather_sequence(cat({k, v}, -1).contiguous(), dim, pg);
  };
  return block_attention(
      "cp_allgather_attention", q, k, v, std::move(blocks), scale,
      [&](BlockAttention& node) {
        node.attend_step(q, gather(k, v), 0);
        return node.finish();
      },
      [=](BlockAttention& node, const Tensor& g) {
        // Gathered again rather than kept: the layer's activations stay its slice's.
        const Tensor whole = gather(k, v);
        Tensor dq = zeros(q.sizes(), node.acc_options()), dkv = zeros(whole.sizes(), node.acc_options());
        node.grads_step(q, whole, g, 0, dq, dkv);
        // Every rank's contribution to each slice, summed onto its owner.
        Tensor mine = functional::reduce_scatter(sequence_to_slices(dkv, dim, cp).contiguous(), dim, ReduceOp::Sum, pg);
        return std::pair<Tensor, Tensor>{dq, mine};
      });
}

// The ring: k and v travel round it, the next shift in flight during each
// step's blocks. In the backward they travel round again, and each slice's
// dk, dv travel with it, one step behind, back to the rank that owns it.
Tensor ring_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                      const std::shared_ptr<ProcessGroup>& pg, std::optional<double> scale) {
  const int cp = pg->size(), rank = pg->rank();
  const int64_t c = q.size(q.dim() - 2) / 2;
  std::vector<KeyBlock> blocks;
  for (int t = 0; t < cp; ++t) {
    const int src = (rank - t + cp) % cp;  // whose slice is in hand
    for (int h = 0; h < 2; ++h)
      for (int hk = 0; hk < 2; ++hk) {
        const int64_t qi = chunk_of(h, rank, cp), ki = chunk_of(hk, src, cp);
        if (causal && ki > qi) continue;  // every key of that chunk follows every query of this one
        blocks.push_back({t, h, hk * c, c, causal && ki == qi});
      }
  }
  // Tags: the forward's shifts, then the backward's k, v and dk, dv.
  const int fwd_tag = 0, bwd_kv_tag = cp, bwd_grad_tag = 2 * cp;
  return block_attention(
      "cp_ring_attention", q, k, v, std::move(blocks), scale,
      [&](BlockAttention& node) {
        Tensor kv = cat({k, v}, -1).contiguous();  // k and v travel together: one message a step
        for (int t = 0; t < cp; ++t) {
          Pending pending;
          Tensor next;
          if (t + 1 < cp) next = shift_start(kv, *pg, fwd_tag + t, pending);
          node.attend_step(q, kv, t);
          if (t + 1 < cp) pending.wait(), kv = next;
        }
        return node.finish();
      },
      [=](BlockAttention& node, const Tensor& g) {
        Tensor dq = zeros(q.sizes(), node.acc_options()), kv = cat({k, v}, -1).contiguous(), arriving;
        Pending grads_in;
        for (int t = 0; t < cp; ++t) {
          Pending pending;
          Tensor next;
          if (t + 1 < cp) next = shift_start(kv, *pg, bwd_kv_tag + t, pending);
          Tensor mine = zeros(kv.sizes(), node.acc_options());
          node.grads_step(q, kv, g, t, dq, mine);
          // What the ranks before added to this slice arrived during the blocks.
          if (t > 0) grads_in.wait(), add_(mine, arriving);
          grads_in = Pending{};
          arriving = shift_start(mine, *pg, bwd_grad_tag + t, grads_in);
          if (t + 1 < cp) pending.wait(), kv = next;
        }
        grads_in.wait();  // this rank's own slice's gradient, from every rank
        return std::pair<Tensor, Tensor>{dq, arriving};
      });
}

Tensor alltoall_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                          const std::shared_ptr<ProcessGroup>& pg, std::optional<double> scale) {
  const int cp = pg->size();
  const int64_t dim = q.dim() - 2, heads = q.dim() - 3;
  const auto to_heads = [&](const Tensor& x) {
    return slices_to_sequence(functional::all_to_all(x.contiguous(), heads, dim, pg), dim, cp);
  };
  const Tensor out = scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), causal, 0.0, nullptr, scale);
  return functional::all_to_all(sequence_to_slices(out, dim, cp).contiguous(), dim, heads, pg);
}

}  // namespace

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, Exchange exchange,
                 const std::shared_ptr<ProcessGroup>& pg, std::optional<double> scale) {
  const char* op = "context-parallel attention";
  EMBER_CHECK(pg != nullptr, op, ": no process group");
  EMBER_CHECK(q.defined() && k.defined() && v.defined() && q.dim() >= 3 && k.dim() == q.dim() && v.dim() == q.dim(), op,
              ": q, k and v must be [..., heads, seq, dim] tensors of one rank, got q ", shape_str(q.sizes()), ", k ",
              shape_str(k.sizes()), ", v ", shape_str(v.sizes()));
  const int64_t dim = q.dim() - 2;
  for (int64_t i = 0; i <= dim; ++i)
    EMBER_CHECK(q.size(i) == k.size(i) && q.size(i) == v.size(i), op, " (", exchange_name(exchange), "): q ",
                shape_str(q.sizes()), ", k ", shape_str(k.sizes()), " and v ", shape_str(v.sizes()),
                " must share every dim but the last (repeat grouped k/v heads first)");
  EMBER_CHECK(q.size(dim) % 2 == 0 && q.size(dim) > 0, op, ": rank ", pg->rank(), " holds ", q.size(dim),
              " positions; the head-tail layout gives each rank two equal chunks, so an even number");
  const int cp = pg->size();
  if (cp == 1) return scaled_dot_product_attention(q, k, v, causal, 0.0, nullptr, scale);
  switch (exchange) {
    case Exchange::Ring:
      return ring_attention(q, k, v, causal, pg, scale);
    case Exchange::AllGather:
      return allgather_attention(q, k, v, causal, pg, scale);
    case Exchange::AllToAll:
      EMBER_CHECK(q.size(dim - 1) % cp == 0, op, " (alltoall): cp ", cp, " must divide the ", q.size(dim - 1),
                  " heads of q ", shape_str(q.sizes()), " (Ulysses splits heads over the cp ranks)");
      return alltoall_attention(q, k, v, causal, pg, scale);
  }
  return Tensor();
}

}  // namespace ember::distributed::cp
