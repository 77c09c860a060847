// Context-parallel attention (attention.h): the three exchanges over the
// head-tail layout. Partial results are (out, lse) pairs from
// scaled_dot_product_attention_lse, merged with differentiable ops, so
// autograd gives the backward of every exchange: the all-gather's is a
// reduce-scatter, the all-to-alls' the reverse all-to-alls, and the ring's
// shifts send the gradients back the other way.
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

Tensor allgather_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                           const std::shared_ptr<ProcessGroup>& pg, std::optional<double> scale) {
  const int cp = pg->size(), rank = pg->rank();
  const int64_t dim = q.dim() - 2, c = q.size(dim) / 2;
  const Tensor kk = gather_sequence(k, dim, pg), vv = gather_sequence(v, dim, pg);
  std::vector<Tensor> outs;
  for (int h = 0; h < 2; ++h) {
    const Tensor qc = q.narrow(dim, h * c, c);
    if (!causal) {
      outs.push_back(scaled_dot_product_attention(qc, kk, vv, false, 0.0, nullptr, scale));
      continue;
    }
    // The keys before the chunk (all visible), then the chunk's own (causal).
    const int64_t s = chunk_of(h, rank, cp) * c;
    Partial p = attend(qc, kk.narrow(dim, s, c), vv.narrow(dim, s, c), true, scale);
    if (s > 0) p = merge(attend(qc, kk.narrow(dim, 0, s), vv.narrow(dim, 0, s), false, scale), p);
    outs.push_back(p.out.to(q.dtype()));
  }
  return cat(outs, dim);
}

// A transfer posted by ring_shift_start: its output is written once wait()
// returns.
struct Pending {
  std::shared_ptr<Work> send, recv;
  void wait() {
    if (send) send->wait();
    if (recv) recv->wait();
  }
};

// Posts the send of x to rank + 1 and the receive of rank − 1's into the
// returned tensor (valid after pending.wait()). Differentiable: the
// gradient goes back to rank − 1 (its backward shifts the other way,
// synchronously).
Tensor ring_shift_start(const Tensor& x, const std::shared_ptr<ProcessGroup>& pg, int step, Pending& pending,
                        int direction = 1) {
  const int cp = pg->size(), rank = pg->rank();
  const int to = (rank + direction + cp) % cp, from = (rank - direction + cp) % cp;
  const Tensor src = x.contiguous();
  return differentiable(
      "cp_ring_shift", {x},
      [&] {
        Tensor y = Tensor::empty(src.sizes(), src.options());
        pending.send = pg->send(src, to, step);
        pending.recv = pg->recv(y, from, step);
        return y;
      },
      [&](const Tensor&) {
        auto group = pg;
        BackwardFn fn = [group, step, direction](const Tensor& g) {
          Pending back;
          Tensor gx = ring_shift_start(g, group, step, back, -direction);
          back.wait();
          return std::vector<Tensor>{gx};
        };
        return Recorded{std::move(fn), {}};
      });
}

Tensor ring_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                      const std::shared_ptr<ProcessGroup>& pg, std::optional<double> scale) {
  const int cp = pg->size(), rank = pg->rank();
  const int64_t dim = q.dim() - 2, c = q.size(dim) / 2;
  // k and v travel together: one message a step.
  Tensor kv = cat({k, v}, -1);
  const int64_t d = k.size(-1), dv = v.size(-1);
  Partial acc[2];
  for (int t = 0; t < cp; ++t) {
    Pending pending;
    Tensor next;
    if (t + 1 < cp) next = ring_shift_start(kv, pg, t, pending);  // in flight during this step's attention
    const int src = (rank - t + cp) % cp;                         // whose slice kv is
    for (int h = 0; h < 2; ++h) {
      const int64_t qi = chunk_of(h, rank, cp);
      const Tensor qc = q.narrow(dim, h * c, c);
      for (int hk = 0; hk < 2; ++hk) {
        const int64_t ki = chunk_of(hk, src, cp);
        if (causal && ki > qi) continue;  // every key of that chunk follows every query of this one
        const Tensor kc = kv.narrow(dim, hk * c, c).narrow(-1, 0, d);
        const Tensor vc = kv.narrow(dim, hk * c, c).narrow(-1, d, dv);
        acc[h] = merge(acc[h], attend(qc, kc, vc, causal && ki == qi, scale));
      }
    }
    if (t + 1 < cp) {
      pending.wait();
      kv = next;
    }
  }
  return cat({acc[0].out.to(q.dtype()), acc[1].out.to(q.dtype())}, dim);
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
