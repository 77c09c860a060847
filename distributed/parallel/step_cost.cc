// The step-time prediction (step_cost.h): the rank's compute from the
// profile, each collective of the step by the link model, summed into the
// critical path.
#include "distributed/parallel/step_cost.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/exception.h"

namespace ember::distributed {
namespace {

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

std::string size_text(double bytes) {
  if (bytes >= (1 << 20)) return fmt("%.2f MiB", bytes / (1 << 20));
  if (bytes >= 1024) return fmt("%.1f KiB", bytes / 1024);
  return fmt("%.0f B", bytes);
}

std::string secs(double s) { return s >= 1 ? fmt("%.3f s", s) : fmt("%.3f ms", s * 1e3); }

}  // namespace

ComputeProfile ComputeProfile::from_hardware(const Hardware& hw) {
  ComputeProfile p;
  p.block_flops_per_s = p.head_flops_per_s = hw.peak_flops * hw.efficiency;
  p.host_bw = hw.host_bw;
  p.source = fmt("%.0f TFLOPS peak", hw.peak_flops / 1e12) + " x " + fmt("%.2f", hw.efficiency) + " efficiency";
  return p;
}

absl::StatusOr<ComputeProfile> ComputeProfile::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError("compute profile: cannot read " + path);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError("compute profile " + path + ": not JSON");
  ComputeProfile p;
  p.source = path;
  auto field = [&](const char* part, const char* name, double* out, bool positive) -> absl::Status {
    if (!j.contains(part) || !j[part].contains(name) || !j[part][name].is_number())
      return absl::InvalidArgumentError("compute profile " + path + ": no number at " + part + "." + name);
    *out = j[part][name].get<double>();
    if (!(*out >= 0) || (positive && *out == 0))
      return absl::InvalidArgumentError("compute profile " + path + ": " + part + "." + name + " is " +
                                        std::to_string(*out) + (positive ? ", not positive" : ", negative"));
    return absl::OkStatus();
  };
  for (auto s :
       {field("block", "flops_per_s", &p.block_flops_per_s, true),
        field("block", "overhead_s", &p.block_overhead_s, false),
        field("head", "flops_per_s", &p.head_flops_per_s, true), field("head", "overhead_s", &p.head_overhead_s, false),
        field("optimizer", "s_per_param", &p.optimizer_s_per_param, false),
        field("optimizer", "overhead_s", &p.optimizer_overhead_s, false)})
    if (!s.ok()) return s;
  double cores = 0;
  if (auto s = field("machine", "cores", &cores, true); !s.ok()) return s;
  p.cores = static_cast<int>(cores);
  // Optional: "models": {"<name>": {"overhead_s", "s_per_sample", "optimizer_s"}}.
  if (j.contains("models")) {
    if (!j["models"].is_object())
      return absl::InvalidArgumentError("compute profile " + path + ": models is not an object");
    for (const auto& [name, m] : j["models"].items()) {
      ModelRate r;
      for (auto [key, out] : {std::pair<const char*, double*>{"overhead_s", &r.overhead_s},
                              {"s_per_sample", &r.s_per_sample},
                              {"optimizer_s", &r.optimizer_s}}) {
        if (!m.contains(key) || !m[key].is_number() || !(m[key].get<double>() >= 0))
          return absl::InvalidArgumentError("compute profile " + path + ": no non-negative number at models." + name +
                                            "." + key);
        *out = m[key].get<double>();
      }
      p.models[name] = r;
    }
  }
  p.overlap = 0;  // the cores compute; nothing runs beside them
  return p;
}

Links Links::analytic(const Hardware& hw) {
  Links l;
  l.hw_ = &hw;
  return l;
}

Links Links::measured(const CommCostModel& fits, int job_ranks, int cores, double inter_host_bw, int ranks_per_host) {
  EMBER_CHECK(job_ranks >= 1 && cores >= 1, "Links::measured: ", job_ranks, " ranks on ", cores, " cores");
  EMBER_CHECK(inter_host_bw <= 0 || ranks_per_host >= 1, "Links::measured: a link between hosts of ", ranks_per_host,
              " ranks");
  Links l;
  l.inter_host_bw_ = inter_host_bw;
  l.ranks_per_host_ = ranks_per_host;
  l.fits_ = &fits;
  l.job_ranks_ = job_ranks;
  l.cores_ = cores;
  return l;
}

std::string Links::source() const {
  if (hw_)
    return "ring collectives at " + fmt("%.0f", hw_->intra_host_bw / 1e9) + " GB/s within a host, " +
           fmt("%.0f", hw_->inter_host_bw / 1e9) + " GB/s across";
  return "measured fits, " + std::to_string(job_ranks_) + " processes on " + std::to_string(cores_) + " cores" +
         (inter_host_bw_ > 0 ? ", hosts of " + std::to_string(ranks_per_host_) + " ranks joined at " +
                                   fmt("%.4g", inter_host_bw_ * 8 / 1e9) + " Gbit/s"
                             : "");
}

double Links::seconds(const std::string& op, double bytes, int size, int stride) const {
  if (size <= 1 || bytes <= 0) return 0;
  if (fits_) {
    // The fit was measured with the group's processes alone on the cores;
    // here all the job's share them.
    const double slow =
        std::max(1.0, static_cast<double>(job_ranks_) / cores_) / std::max(1.0, static_cast<double>(size) / cores_);
    const double local = slow * fits_->seconds(op, static_cast<int64_t>(bytes), size);
    if (inter_host_bw_ <= 0 || static_cast<int64_t>(stride) * size <= ranks_per_host_) return local;
    // Hosts the group spans, and the groups of its dimension with a member
    // on one host: each sends its ring's share over that host's link.
    const double p = size;
    const double hosts = std::min(p, static_cast<double>(stride) * size / ranks_per_host_);
    const double groups = ranks_per_host_ * hosts / p;
    const double share = op == "allreduce"                          ? 2 * (p - 1) / p
                         : (op == "broadcast" || op == "send_recv") ? 1.0
                                                                    : (p - 1) / p;
    const double wire = groups * share * bytes / inter_host_bw_;
    return std::max(local, fits_->fit(op, size).latency_s + wire);
  }
  EMBER_CHECK(hw_ != nullptr, "Links: neither hardware nor fits");
  const bool across = static_cast<int64_t>(stride) * size > hw_->gpus_per_host;
  const double bw = across ? hw_->inter_host_bw : hw_->intra_host_bw;
  const double lat = across ? hw_->inter_latency : hw_->intra_latency;
  const double p = size;
  // Ring: all-reduce 2(p-1)/p of the bytes, all-gather and reduce-scatter
  // (p-1)/p of the whole buffer, a message once.
  if (op == "allreduce") return 2 * (p - 1) / p * bytes / bw + 2 * (p - 1) * lat;
  if (op == "allgather" || op == "reduce_scatter" || op == "all_to_all")
    return (p - 1) / p * bytes / bw + (p - 1) * lat;
  if (op == "broadcast") return bytes / bw + (p - 1) * lat;
  if (op == "send_recv") return bytes / bw + lat;
  EMBER_CHECK(false, "Links: unknown collective '", op, "'");
}

namespace {

// One prediction's inputs, the figures every term derives from them, and
// the StepTime the terms add to: one function per mesh dimension below.
struct Terms {
  const ModelSpec& model;
  const MeshCandidate& c;
  const PlanOptions& o;
  const ComputeProfile& cp;
  const Links& links;
  StepTime& t;
  int R, S, C, T, P, V, N;
  int F;  // FSDP's group: dp_shard x cp (its ranks T apart)
  int64_t M;
  double mb, elem;
  bool full_ac;
  double stretch;  // ranks beyond the cores share them
  std::string strategy;
  double stage_layers;  // the last stage's blocks
  double span = 0;      // compute and bubble
  int E;                // ep: the experts' split (over dp_shard x cp)
  // Per block on average, a tp rank's: what FSDP shards (the experts too
  // unless ep splits them; an MoE feed-forward whole on every tp rank), and
  // the experts ep holds instead.
  double fsdp_layer_params() const {
    const double moe = model.mean_moe_ffn_params();
    return (model.mean_layer_params() - moe) / T + moe - expert_layer_params();
  }
  double expert_layer_params() const { return E > 1 ? model.mean_expert_params() : 0; }

  Terms(const ModelSpec& m, const MeshCandidate& k, const PlanOptions& opt, const ComputeProfile& p, const Links& l,
        StepTime& out)
      : model(m), c(k), o(opt), cp(p), links(l), t(out) {
    R = c.dims.dp_replicate, S = c.dims.dp_shard, C = c.dims.cp, T = c.dims.tp, P = c.dims.pp, V = c.virtual_stages;
    N = R * S * C * T * P;
    F = S * C;
    M = c.microbatches;
    mb = static_cast<double>(c.micro_batch);
    elem = o.mixed_precision ? 2 : 4;
    full_ac = c.ac == "full";
    stretch = cp.cores > 0 ? std::max(1.0, static_cast<double>(N) / cp.cores) : 1.0;
    strategy = !c.strategy.empty() ? c.strategy : F > 1 ? "full" : "ddp";
    stage_layers = model.transformer() ? std::ceil(static_cast<double>(model.layers) / P) : 0;
    E = c.dims.ep;
  }
  void add(const std::string& part, const std::string& what, double s, double* sum) {
    t.terms.push_back({part, what, s});
    if (sum) *sum += s;
  }
  // One collective, `times` times.
  void coll(const std::string& part, const std::string& op, double bytes, int size, int stride, double times,
            double* sum) {
    if (size <= 1 || times <= 0) return;
    const double s = times * links.seconds(op, bytes, size, stride);
    add(part, op + " " + size_text(bytes) + " over " + std::to_string(size) + " ranks x " + fmt("%g", times), s, sum);
  }
};

// The last stage's compute (its blocks and the head, every micro-batch)
// and the pipeline's bubble around it.
void compute_terms(Terms& k, double bubble) {
  // Under cp a rank holds 1/cp of each sequence's tokens; its queries still
  // see the whole sequence's keys (the 12·dim·seq attention term).
  const double tokens_mb = k.model.transformer() ? k.model.seq * k.mb / k.C : k.mb;
  double per_mb = 0;
  if (k.model.transformer()) {
    const double recompute = k.full_ac ? 4.0 / 3 : 1.0;  // every forward twice: 4/3 of forward + backward
    // Tensor parallelism splits a block but not its MoE feed-forward (replicated over tp).
    const double moe = k.model.mean_moe_ffn_active_params();
    const double block_flops =
        recompute *
        ((6.0 * (k.model.mean_active_layer_params() - moe) + 12.0 * k.model.dim * k.model.seq) / k.T + 6.0 * moe) *
        tokens_mb;
    const double head_flops = 6.0 * k.model.vocab * k.model.dim * tokens_mb / k.T;
    const double block = k.cp.block_overhead_s + block_flops / k.cp.block_flops_per_s;
    const double head = k.cp.head_overhead_s + head_flops / k.cp.head_flops_per_s;
    per_mb = k.stage_layers * block + head;
    k.add("compute",
          fmt("%g blocks", k.stage_layers) + " (" + secs(block) + " each: " + fmt("%.3g", block_flops) +
              " FLOPs) + head (" + secs(head) + ": " + fmt("%.3g", head_flops) + " FLOPs) x " + std::to_string(k.M) +
              " micro-batches" + (k.stretch > 1 ? " x " + fmt("%.2g", k.stretch) + " (ranks per core)" : ""),
          per_mb * k.M * k.stretch, &k.t.compute);
  } else {
    const auto measured = k.cp.models.find(k.model.name);
    per_mb = measured != k.cp.models.end()
                 ? measured->second.overhead_s + k.mb * measured->second.s_per_sample
                 : k.cp.head_overhead_s + k.model.flops_per_sample * k.mb / k.cp.head_flops_per_s;
    k.add("compute",
          "forward + backward of " + fmt("%g", k.mb) + " samples (" + secs(per_mb) + ") x " + std::to_string(k.M) +
              (k.stretch > 1 ? " x " + fmt("%.2g", k.stretch) + " (ranks per core)" : ""),
          per_mb * k.M * k.stretch, &k.t.compute);
  }
  k.t.bubble = bubble;
  k.span = k.t.compute / (1 - bubble);
  if (bubble > 0) k.add("bubble", "pipeline idle " + fmt("%.1f%%", 100 * bubble), k.span - k.t.compute, nullptr);
}

// Tensor parallelism: exposed.
void tp_terms(Terms& k) {
  if (k.model.transformer() && k.T > 1) {
    const double sbh = k.model.seq / k.C * k.mb * k.model.dim * k.elem;
    const double layers = k.stage_layers * k.M;
    if (k.c.sequence_parallel) {
      // Per block: the forward's 2 gathers and 2 scatters, their 4
      // transposes in the backward, and 2 gathers again there for the
      // weights' gradients (the gathered inputs are not kept: Megatron-SP's
      // memory saving); recompute repeats the forward's 4. The embedding's
      // scatter, the head's gather (twice) and scatter.
      k.coll("tp", "allgather", sbh, k.T, 1, layers * (k.full_ac ? 8 : 6) + 2 * k.M + (k.P == 1 ? k.M : 0),
             &k.t.tp_comm);
      k.coll("tp", "reduce_scatter", sbh, k.T, 1, layers * (k.full_ac ? 6 : 4) + k.M + (k.P == 1 ? k.M : 0),
             &k.t.tp_comm);
      // The norms' and the row-parallel biases' gradients, replicated over
      // the sequence shards: 6 per block (and the final norm's 2), once.
      k.coll("tp", "allreduce", k.model.dim * k.elem, k.T, 1, 6 * k.stage_layers + 2, &k.t.tp_comm);
    } else {
      // 2 all-reduces per block forward, 2 backward (3 and 3 with
      // recompute's forward again); the embedding's and the head input's.
      k.coll("tp", "allreduce", sbh, k.T, 1, layers * (k.full_ac ? 6 : 4) + k.M + (k.P == 1 ? k.M : 0), &k.t.tp_comm);
    }
    k.coll("tp", "allreduce", k.model.seq / k.C * k.mb * 4, k.T, 1, 3 * k.M,
           &k.t.tp_comm);  // the parallel loss's max, sum, target
  }
}

// Data parallelism: per FSDP unit (each block; the root with the
// embeddings and head), or DDP's buckets; what the backward hides. Returns
// the root unit's bytes (the optimizer's share of it).
double dp_terms(Terms& k) {
  std::vector<std::pair<double, double>> units;  // (bytes, how many)
  if (k.model.transformer()) {
    units.push_back({k.elem * k.fsdp_layer_params(), k.stage_layers});
    const double root = k.P == 1 ? k.model.embedding_params() + (k.model.tied ? 0 : k.model.vocab * k.model.dim)
                                 : static_cast<double>(k.model.vocab) * k.model.dim;
    units.push_back({k.elem * root / k.T, 1});
  } else {
    // DDP's buckets of 25 MiB. Its first bucket of 1 MiB adds one more
    // all-reduce's latency, left out: the analytic ring charges it 2(p-1)
    // hops, which NCCL's tree for small messages does not pay (with it DDP
    // would lose ResNet-50 on 8 GPUs to HSDP by 0.1 ms); on CPU ranks it
    // is about 2 % of resnet_ddp's step.
    const double bucket = 25.0 * (1 << 20), grads = k.elem * k.model.num_params();
    const double n = std::ceil(grads / bucket);
    units.push_back({grads / n, n});
  }
  double dp_overlappable = 0, dp_after = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    const auto [bytes, count] = units[u];
    const bool block = k.model.transformer() && u == 0;
    if (k.strategy == "full" || k.strategy == "hybrid") {
      // Forward and (blocks) backward per micro-batch; once per step under a pipeline.
      const double gathers = k.P > 1 ? 1 : k.M * (block ? 2 : 1);
      k.coll("dp", "allgather", bytes, k.F, k.T, count * gathers, &dp_overlappable);
      k.coll("dp", "reduce_scatter", bytes, k.F, k.T, count, &dp_overlappable);
    } else if (k.strategy == "grad_op") {
      k.coll("dp", "allgather", bytes, k.F, k.T, count * (k.P > 1 ? 1 : k.M), &dp_overlappable);
      k.coll("dp", "reduce_scatter", bytes, k.F, k.T, count, &dp_overlappable);
    } else if (k.strategy == "no_shard" || k.strategy == "ddp") {
      k.coll("dp", "allreduce", bytes, k.F, k.T, count, &dp_overlappable);
    } else if (k.strategy == "zero1") {
      k.coll("dp", "allreduce", bytes, k.F, k.T, count, &dp_overlappable);
      k.coll("dp", "allgather", bytes, k.F, k.T, count, &dp_after);  // the updated parameters, after the step
    } else {
      EMBER_CHECK(false, "predict_step: unknown strategy '", k.c.strategy,
                  "' (full, hybrid, grad_op, no_shard, ddp, zero1)");
    }
    // The replicas' all-reduce: of each shard under HSDP, of the whole unit under DDP.
    k.coll("dp", "allreduce", k.F > 1 && k.strategy != "no_shard" ? bytes / k.F : bytes, k.R, k.T * k.F, count,
           &dp_overlappable);
  }
  k.t.dp_comm = dp_overlappable + dp_after;
  // Without a pipeline the collectives run beside the backward (two thirds
  // of the compute) as far as the profile lets them; under one, the
  // reductions wait for the last backward.
  const double hidden = k.P > 1 ? 0 : std::min(dp_overlappable, k.cp.overlap * k.span * 2 / 3);
  k.t.dp_exposed = k.t.dp_comm - hidden;
  if (hidden > 0) k.add("dp", "hidden behind the backward", -hidden, nullptr);

  return units.back().first;
}

// Context parallelism's exchanges per block and micro-batch (the forward
// again under full recompute). kv: one rank's k and v, 2·(s/cp)·b·h/tp
// elements; the backward's dk, dv are in float32. The ring hides its
// shifts behind the blocks' attention of all steps but the last (the
// 12·dim·seq FLOPs per token, a third forward), so only what exceeds it
// shows; the all-gather's and the all-to-alls' wait for their results.
void cp_terms(Terms& k) {
  if (!k.model.transformer() || k.C == 1) return;
  const double local = k.model.seq / k.C * k.mb * k.model.dim / k.T;  // one of q, k, v, out: elements
  const double kv = 2 * local * k.elem, dkv = 2 * local * 4;
  const double blocks = k.stage_layers * k.M, forwards = k.full_ac ? 2 : 1;
  const std::string& ex = k.c.cp_exchange;
  if (ex == "ring") {
    // Each shift runs beside a step's blocks, but the backward's last hop
    // (the dk, dv of a slice to its owner) has nothing left to hide behind.
    double ring = 0, last_hop = 0;
    k.coll("cp", "send_recv", kv, k.C, k.T, blocks * (k.C - 1) * (forwards + 1), &ring);
    k.coll("cp", "send_recv", dkv, k.C, k.T, blocks * (k.C - 1), &ring);
    k.coll("cp", "send_recv", dkv, k.C, k.T, blocks, &last_hop);
    const double attention_flops =
        12.0 * k.model.dim * k.model.seq * k.model.seq / k.C * k.mb / k.T * blocks * (forwards + 2) / 3;
    // The last of the cp steps has no shift beside it.
    const double hidden = std::min(ring, attention_flops / k.cp.block_flops_per_s * k.stretch * (k.C - 1) / k.C);
    k.add("cp", "hidden behind the blocks' attention", -hidden, nullptr);
    k.t.cp_comm = ring - hidden + last_hop;
  } else if (ex == "allgather") {
    // The gathered k, v (the output, cp x kv), again in the backward; dk, dv reduce-scattered.
    k.coll("cp", "allgather", k.C * kv, k.C, k.T, blocks * (forwards + 1), &k.t.cp_comm);
    k.coll("cp", "reduce_scatter", k.C * dkv, k.C, k.T, blocks, &k.t.cp_comm);
  } else if (ex == "alltoall") {
    // q, k, v to heads and the output back; their transposes in the backward.
    k.coll("cp", "all_to_all", local * k.elem, k.C, k.T, blocks * 4 * (forwards + 1), &k.t.cp_comm);
  } else {
    EMBER_CHECK(false, "predict_step: unknown cp exchange '", ex, "' (ring, allgather, alltoall)");
  }
}

// Expert parallelism per MoE block and micro-batch: the tokens' k copies
// to their experts' ranks and back, forward (again under full recompute)
// and backward; the counts' exchange is a few bytes. Nothing computes
// beside them (each waits for its tokens).
void ep_terms(Terms& k) {
  if (!k.model.transformer() || k.E == 1) return;
  const double rows = k.model.seq / k.C * k.mb * k.model.top_k;  // this rank's (token, choice) pairs
  const double moe_blocks = k.stage_layers * k.model.moe_layers() / k.model.layers * k.M;
  const double forwards = k.full_ac ? 2 : 1;
  k.coll("ep", "all_to_all", rows * k.model.dim * k.elem, k.E, k.T, moe_blocks * 2 * (forwards + 1), &k.t.ep_comm);
}

// Pipeline transfers: a send and its gradient's receive per micro-batch and virtual stage.
void pp_terms(Terms& k) {
  if (k.P > 1) {
    const double bytes = k.model.transformer()
                             ? k.model.seq / k.C * k.mb * k.model.dim * k.elem / (k.c.sequence_parallel ? k.T : 1)
                             : k.model.activation_bytes_per_sample * k.mb * k.elem / 2;
    k.coll("pp", "send_recv", bytes, 2, k.T * k.C * k.S * k.R, 2.0 * k.M * k.V, &k.t.pp_comm);
  }
}

// The loop's scalar all-reduces, the optimizer over the rank's parameters,
// offload's traffic; the step's total.
void step_terms(Terms& k, double root_bytes) {
  // The loop's scalar all-reduces over the job.
  k.coll("sync", "allreduce", 8, k.N, 1, static_cast<double>(k.o.step_allreduces), &k.t.sync);

  // The optimizer over the rank's parameters.
  const bool sharded =
      k.strategy == "full" || k.strategy == "hybrid" || k.strategy == "grad_op" || k.strategy == "zero1";
  const double params = (k.model.transformer() ? k.stage_layers * k.fsdp_layer_params() + root_bytes / k.elem
                                               : static_cast<double>(k.model.num_params())) /
                            (sharded ? k.F : 1) +
                        k.stage_layers * k.expert_layer_params() / k.E;
  if (const auto m = k.cp.models.find(k.model.name); !k.model.transformer() && m != k.cp.models.end())
    k.add("optimizer", fmt("%.3g", params) + " parameters, measured", m->second.optimizer_s * k.stretch,
          &k.t.optimizer);
  else if (k.cp.optimizer_s_per_param > 0 || k.cp.optimizer_overhead_s > 0)
    k.add("optimizer", fmt("%.3g", params) + " parameters",
          (k.cp.optimizer_overhead_s + params * k.cp.optimizer_s_per_param) * k.stretch, &k.t.optimizer);
  if (k.c.offload) {
    // The sharded state lives on the host: 16-bit parameters down, float32 gradients up.
    EMBER_CHECK(k.cp.host_bw > 0, "predict_step: CPU offload needs the host link's bandwidth");
    k.add("offload", size_text(2.0 * params * k.elem + 4.0 * params) + " over the host link",
          (2.0 * params * k.elem + 4.0 * params) / k.cp.host_bw, &k.t.offload_io);
  }
  k.t.step = k.span + k.t.tp_comm + k.t.cp_comm + k.t.ep_comm + k.t.dp_exposed + k.t.pp_comm + k.t.sync +
             k.t.optimizer + k.t.offload_io;
}

}  // namespace

StepTime predict_step(const ModelSpec& model, const MeshCandidate& c, const PlanOptions& o, const ComputeProfile& cp,
                      const Links& links, double bubble) {
  StepTime t;
  Terms k(model, c, o, cp, links, t);
  compute_terms(k, bubble);
  tp_terms(k);
  cp_terms(k);
  ep_terms(k);
  const double root_bytes = dp_terms(k);
  pp_terms(k);
  step_terms(k, root_bytes);
  return t;
}

std::string StepTime::explain() const {
  std::ostringstream os;
  os << "| part | what | seconds |\n|---|---|---|\n";
  for (const StepTerm& term : terms)
    os << "| " << term.part << " | " << term.what << " | " << secs(term.seconds) << " |\n";
  os << "| step | compute / (1 - bubble) + tp + cp + ep + dp exposed + pp + sync + optimizer + offload | " << secs(step)
     << " |\n";
  return os.str();
}

}  // namespace ember::distributed
