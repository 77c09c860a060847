// Measuring and reporting a step's memory by part (step_memory.h).
#include "distributed/parallel/step_memory.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include "core/ops.h"
#include "distributed/comm/backends.h"
#include "nn/checkpoint.h"

namespace ember::distributed {

double StepMemory::total() const {
  double t = 0;
  for (double v : mib) t += v;
  return t;
}

std::string StepMemory::line(const std::string& what) const {
  // The order of the line: params, grads, optimizer, gathered, activations, other.
  const MemoryKind order[] = {MemoryKind::Parameters, MemoryKind::Gradients,   MemoryKind::Optimizer,
                              MemoryKind::Gathered,   MemoryKind::Activations, MemoryKind::Other};
  char buf[64];
  std::snprintf(buf, sizeof buf, " %.1f MiB:", total());
  std::string out = what + buf;
  for (size_t i = 0; i < 6; ++i) {
    std::snprintf(buf, sizeof buf, "%s %s %.1f", i ? "," : "", memory_kind_name(order[i]), (*this)[order[i]]);
    out += buf;
  }
  return out;
}

StepMemory measured_step_memory(const AllocatorStats& stats) {
  StepMemory m;
  for (int k = 0; k < kMemoryKinds; ++k) m.mib[k] = static_cast<double>(stats.peak_by_kind[k]) / (1 << 20);
  return m;
}

StepMemory largest_over_ranks(ProcessGroup& pg, const StepMemory& mine, Device device) {
  const int n = pg.size(), r = pg.rank();
  // Every rank's row, summed into place; then the row with the largest total.
  Tensor all = zeros({n, kMemoryKinds}, {DType::Float64, kCPU});
  for (int k = 0; k < kMemoryKinds; ++k) all.narrow(0, r, 1).narrow(1, k, 1).fill_(mine.mib[k]);
  Tensor on = all.to(device);
  pg.allreduce(on, ReduceOp::Sum)->wait();
  const std::vector<double> v = on.to(kCPU).to_vector();
  int best = 0;
  double best_total = -1;
  for (int i = 0; i < n; ++i) {
    double t = 0;
    for (int k = 0; k < kMemoryKinds; ++k) t += v[i * kMemoryKinds + k];
    if (t > best_total) best_total = t, best = i;
  }
  StepMemory out;
  for (int k = 0; k < kMemoryKinds; ++k) out.mib[k] = v[best * kMemoryKinds + k];
  return out;
}

}  // namespace ember::distributed

// ---- The planner's timeline ----------------------------------------------

namespace ember::distributed {
namespace {

// Live bytes by kind, and the breakdown at the largest total.
class Timeline {
 public:
  int add(MemoryKind k, double bytes) {
    blocks_.push_back({k, bytes});
    live_[static_cast<int>(k)] += bytes;
    double total = 0;
    for (double v : live_) total += v;
    if (total > peak_total_) peak_total_ = total, peak_ = live_;
    return static_cast<int>(blocks_.size()) - 1;
  }
  void free(int id) {
    if (id < 0) return;
    auto& [kind, bytes] = blocks_[static_cast<size_t>(id)];
    live_[static_cast<int>(kind)] -= bytes;
    bytes = 0;
  }
  void retag(int id, MemoryKind k) {
    auto& [kind, bytes] = blocks_[static_cast<size_t>(id)];
    live_[static_cast<int>(kind)] -= bytes;
    live_[static_cast<int>(k)] += bytes;
    kind = k;
  }
  // Allocated and freed again at once: only the peak sees it.
  void touch(MemoryKind k, double bytes) { free(add(k, bytes)); }
  StepMemory peak() const {
    StepMemory m;
    for (int k = 0; k < kMemoryKinds; ++k) m.mib[k] = peak_[k] / (1 << 20);
    return m;
  }

 private:
  std::vector<std::pair<MemoryKind, double>> blocks_;
  std::array<double, kMemoryKinds> live_{}, peak_{};
  double peak_total_ = -1;
};

// Elements of one FSDP unit: its parameters and, for a block, what its
// forward keeps (its input included) under each policy.
struct UnitSpec {
  double numel = 0;      // parameters
  double tensors = 0;    // parameter tensors (AdamW keeps a step scalar each)
  double largest = 0;    // the largest weight: its gradient's temporary in backward
  double input = 0;      // the block's input (all a full checkpoint keeps)
  double saved = 0;      // kept without checkpointing
  double kept = 0;       // kept by a selective checkpoint
  double fwd_extra = 0;  // a forward transient beyond what is kept
  double bwd_extra = 0;  // a backward transient (activation gradients)
};

struct ModelSpec {
  UnitSpec root;                 // the root unit's parameters
  std::vector<UnitSpec> blocks;  // one FSDP unit each
  double inputs = 0;             // bytes the caller holds (tokens, targets)
  double head_saved = 0;         // elements the head and the loss keep
  double loss_saved = 0;         // of those, the loss's own (freed by its backward, before the head's)
  double head_fwd_extra = 0;     // the loss's forward transient (the logits)
  double loss_grad = 0;          // the loss's gradient buffer
  double head_bwd_extra = 0;     // the head's backward transient
};

double padded(double numel, int world) { return std::ceil(numel / world) * world; }

StepMemory simulate(const ModelSpec& m, const StepPlan& plan) {
  EMBER_CHECK(plan.world >= 1, "memory plan: world must be at least 1, got ", plan.world);
  EMBER_CHECK(plan.strategy == "full" || plan.strategy == "grad_op" || plan.strategy == "no_shard",
              "memory plan: strategy '", plan.strategy, "' is not modelled (full, grad_op, no_shard)");
  using Mode = nn::ActivationCheckpointing::Mode;
  const auto ac = nn::ActivationCheckpointing::parse(plan.ac);
  auto checkpointed = [&](size_t i) {
    return ac.mode == Mode::Full || ac.mode == Mode::Selective ||
           (ac.mode == Mode::EveryK && (i + 1) % static_cast<size_t>(ac.every) == 0);
  };
  const bool sharded = plan.world > 1 && plan.strategy != "no_shard";
  const int n = sharded ? plan.world : 1;
  const double f = 4;  // float32
  const size_t L = m.blocks.size();
  Timeline t;
  auto shard = [&](const UnitSpec& u) { return padded(u.numel, n) / n; };
  double params = shard(m.root), tensors = m.root.tensors;
  for (const auto& b : m.blocks) params += shard(b), tensors += b.tensors;
  t.add(MemoryKind::Parameters, params * f);
  t.add(MemoryKind::Optimizer, (2 * params + tensors) * f);
  t.add(MemoryKind::Other, m.inputs);

  // Forward. The root stays gathered to the end of backward; a block is
  // gathered with the next one prefetched, and freed after its forward
  // (full) or kept until its backward (grad_op).
  const int root_gather = sharded ? t.add(MemoryKind::Gathered, padded(m.root.numel, n) * f) : -1;
  std::vector<int> gathered(L, -1), acts(L, -1);
  auto gather = [&](size_t i) {
    if (sharded && i < L && gathered[i] < 0)
      gathered[i] = t.add(MemoryKind::Gathered, padded(m.blocks[i].numel, n) * f);
  };
  std::vector<int> inputs(L, -1);  // block i's input: the embedding's or block i-1's output
  for (size_t i = 0; i < L; ++i) {
    const UnitSpec& b = m.blocks[i];
    gather(i);
    gather(i + 1);
    inputs[i] = t.add(MemoryKind::Activations, b.input * f);
    const int whole = t.add(MemoryKind::Activations, (b.saved - b.input) * f);  // the input is the last block's
    t.touch(MemoryKind::Activations, b.fwd_extra * f);
    if (checkpointed(i)) {
      t.free(whole);
      acts[i] = ac.mode == Mode::Selective ? t.add(MemoryKind::Activations, (b.kept - b.input) * f) : -1;
    } else {
      acts[i] = whole;
    }
    if (sharded && plan.strategy == "full") t.free(gathered[i]), gathered[i] = -1;
  }
  // The last block's output, the head's and the loss's activations.
  const int head = t.add(MemoryKind::Activations,
                         (m.blocks.empty() ? 0 : m.blocks.back().input) * f + (m.head_saved - m.loss_saved) * f);
  const int loss_act = t.add(MemoryKind::Activations, m.loss_saved * f);
  t.touch(MemoryKind::Activations, m.head_fwd_extra * f);

  // Backward: the loss's gradient, the head (its weight's gradient into the
  // root's gradient buffer), then the blocks in reverse.
  const int lg = t.add(MemoryKind::Other, m.loss_grad * f);
  // The loss's backward has read its log-softmax by the time the head's
  // backward makes the root's gradient buffer.
  t.free(loss_act);
  const int root_grads = t.add(MemoryKind::Gradients, padded(m.root.numel, n) * f);
  t.touch(MemoryKind::Other, (m.root.largest + m.head_bwd_extra) * f);
  t.free(head);
  t.free(lg);
  int pending_in = -1, pending_out = -1, pending_tmp = -1;
  std::vector<int> shard_grads;
  auto finish_pending = [&] {
    t.free(pending_in);
    t.free(pending_tmp);
    if (pending_out >= 0) t.retag(pending_out, MemoryKind::Gradients), shard_grads.push_back(pending_out);
    pending_in = pending_out = pending_tmp = -1;
  };
  for (size_t k = L; k-- > 0;) {
    const UnitSpec& b = m.blocks[k];
    gather(k);
    if (k > 0) gather(k - 1);
    // A checkpointed block is recomputed from its input (a selective one
    // from what it kept too) before its backward.
    if (checkpointed(k)) {
      t.free(acts[k]);
      acts[k] = t.add(MemoryKind::Activations, (b.saved - b.input) * f);
    }
    // The last unit's reduction finishes before this unit's gradient buffer
    // is made (FSDP's ensure_grad_buffer); its weight gradient's temporary
    // comes first.
    t.touch(MemoryKind::Other, b.largest * f);
    finish_pending();
    const int grads = t.add(MemoryKind::Gradients, padded(b.numel, n) * f);
    t.touch(MemoryKind::Other, (b.largest + b.bwd_extra) * f);
    t.free(acts[k]);
    t.free(inputs[k]);
    if (sharded) {
      finish_pending();
      pending_in = grads;
      pending_out = t.add(MemoryKind::Other, shard(b) * f);
      // The ring's receive buffer: one piece of the block (Gloo's).
      pending_tmp = t.add(MemoryKind::Other, std::min(shard(b) * f, static_cast<double>(kGlooRingPieceBytes)));
      t.free(gathered[k]), gathered[k] = -1;  // both strategies reshard after the unit's backward
    } else {
      shard_grads.push_back(grads);
    }
  }
  finish_pending();
  t.free(root_gather);
  (void)root_grads;
  return t.peak();
}

}  // namespace

StepMemory predict_gpt_step_memory(const nn::GPTOptions& g, const StepPlan& plan) {
  EMBER_CHECK(g.dropout == 0, "memory plan: dropout ", g.dropout, " is not modelled (its masks); plan with 0");
  const double B = static_cast<double>(plan.micro_batch), T = static_cast<double>(plan.seq),
               C = static_cast<double>(g.n_embd), V = static_cast<double>(g.vocab_size);
  const double btc = B * T * C, bt = B * T;
  ModelSpec m;
  m.root.numel = V * C + static_cast<double>(g.block_size) * C + 2 * C + (g.tie_weights ? 0 : V * C);
  m.root.tensors = g.tie_weights ? 4 : 5;
  m.root.largest = V * C;
  for (int64_t i = 0; i < g.n_layer; ++i) {
    UnitSpec b;
    b.numel = 12 * C * C + 13 * C;
    b.tensors = 12;
    b.largest = 4 * C * C;
    b.input = btc;
    // ln_1 keeps x and 2 statistics; in_proj its input; attention q, k, v
    // and its output; out_proj the heads merged again; ln_2 the residual
    // sum; c_fc its input; gelu c_fc's output; c_proj gelu's output.
    b.saved = 17 * btc + 4 * bt;
    // Kept: the input, in_proj's, attention's, out_proj's, c_fc's and c_proj's outputs.
    b.kept = 11 * btc;
    b.fwd_extra = 3 * btc;  // in_proj's output while q, k, v are copied out
    b.bwd_extra = 8 * btc;  // gelu's input and output gradients
    m.blocks.push_back(b);
  }
  m.inputs = 2 * bt * 8 + T * 8;         // tokens, targets (int64), positions
  m.head_saved = 2 * bt + btc + bt * V;  // ln_f's statistics and output; the loss's log-softmax
  m.loss_saved = bt * V;
  m.head_fwd_extra = bt * V;  // the logits
  m.loss_grad = bt * V;
  m.head_bwd_extra = btc;
  return simulate(m, plan);
}

StepMemory predict_mlp_step_memory(int64_t dim, int64_t hidden, int64_t blocks, const StepPlan& plan) {
  const double R = static_cast<double>(plan.micro_batch), D = static_cast<double>(dim), H = static_cast<double>(hidden);
  ModelSpec m;
  for (int64_t i = 0; i < blocks; ++i) {
    UnitSpec b;
    b.numel = 2 * D * H + H + D + 2 * D;
    b.tensors = 6;
    b.largest = D * H;
    b.input = R * D;
    b.saved = 2 * R * D + 2 * R * H + 2 * R;  // x, LayerNorm's output and statistics, fc1's and gelu's outputs
    b.kept = R * D + R * H + R * D;           // x, fc1's and fc2's outputs
    b.fwd_extra = R * D;
    b.bwd_extra = 2 * R * H;
    m.blocks.push_back(b);
  }
  m.inputs = 2 * R * D * 4;  // the input and the target
  m.head_saved = R * D;      // the difference the squared error keeps
  m.head_fwd_extra = R * D;
  m.loss_grad = R * D;
  m.head_bwd_extra = R * D;
  return simulate(m, plan);
}

}  // namespace ember::distributed
