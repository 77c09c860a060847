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

StepTime predict_step(const ModelSpec& model, const MeshCandidate& c, const PlanOptions& o, const ComputeProfile& cp,
                      const Links& links, double bubble) {
  StepTime t;
  const int R = c.dims.dp_replicate, S = c.dims.dp_shard, T = c.dims.tp, P = c.dims.pp, V = c.virtual_stages;
  const int N = R * S * T * P;
  const int64_t M = c.microbatches;
  const double mb = static_cast<double>(c.micro_batch);
  const double elem = o.mixed_precision ? 2 : 4;
  const bool full_ac = c.ac == "full";
  // Ranks beyond the cores share them.
  const double stretch = cp.cores > 0 ? std::max(1.0, static_cast<double>(N) / cp.cores) : 1.0;
  const std::string strategy = !c.strategy.empty() ? c.strategy : S > 1 ? "full" : "ddp";
  auto add = [&](const std::string& part, const std::string& what, double s, double* sum) {
    t.terms.push_back({part, what, s});
    if (sum) *sum += s;
  };
  // One collective, `times` times.
  auto coll = [&](const std::string& part, const std::string& op, double bytes, int size, int stride, double times,
                  double* sum) {
    if (size <= 1 || times <= 0) return;
    const double s = times * links.seconds(op, bytes, size, stride);
    add(part, op + " " + size_text(bytes) + " over " + std::to_string(size) + " ranks x " + fmt("%g", times), s, sum);
  };

  // Compute: the rank with the most (the last stage: its blocks and the head).
  const double stage_layers = model.transformer() ? std::ceil(static_cast<double>(model.layers) / P) : 0;
  const double tokens_mb = model.transformer() ? model.seq * mb : mb;
  double per_mb = 0;
  if (model.transformer()) {
    const double recompute = full_ac ? 4.0 / 3 : 1.0;  // every forward twice: 4/3 of forward + backward
    const double block_flops = recompute * (6.0 * model.layer_params() + 12.0 * model.dim * model.seq) * tokens_mb / T;
    const double head_flops = 6.0 * model.vocab * model.dim * tokens_mb / T;
    const double block = cp.block_overhead_s + block_flops / cp.block_flops_per_s;
    const double head = cp.head_overhead_s + head_flops / cp.head_flops_per_s;
    per_mb = stage_layers * block + head;
    add("compute",
        fmt("%g blocks", stage_layers) + " (" + secs(block) + " each: " + fmt("%.3g", block_flops) +
            " FLOPs) + head (" + secs(head) + ": " + fmt("%.3g", head_flops) + " FLOPs) x " + std::to_string(M) +
            " micro-batches" + (stretch > 1 ? " x " + fmt("%.2g", stretch) + " (ranks per core)" : ""),
        per_mb * M * stretch, &t.compute);
  } else {
    const auto measured = cp.models.find(model.name);
    per_mb = measured != cp.models.end() ? measured->second.overhead_s + mb * measured->second.s_per_sample
                                         : cp.head_overhead_s + model.flops_per_sample * mb / cp.head_flops_per_s;
    add("compute",
        "forward + backward of " + fmt("%g", mb) + " samples (" + secs(per_mb) + ") x " + std::to_string(M) +
            (stretch > 1 ? " x " + fmt("%.2g", stretch) + " (ranks per core)" : ""),
        per_mb * M * stretch, &t.compute);
  }
  t.bubble = bubble;
  const double span = t.compute / (1 - bubble);
  if (bubble > 0) add("bubble", "pipeline idle " + fmt("%.1f%%", 100 * bubble), span - t.compute, nullptr);

  // Tensor parallelism: exposed.
  if (model.transformer() && T > 1) {
    const double sbh = model.seq * mb * model.dim * elem;
    const double layers = stage_layers * M;
    if (c.sequence_parallel) {
      // Per block: the forward's 2 gathers and 2 scatters, their 4
      // transposes in the backward, and 2 gathers again there for the
      // weights' gradients (the gathered inputs are not kept: Megatron-SP's
      // memory saving); recompute repeats the forward's 4. The embedding's
      // scatter, the head's gather (twice) and scatter.
      coll("tp", "allgather", sbh, T, 1, layers * (full_ac ? 8 : 6) + 2 * M + (P == 1 ? M : 0), &t.tp_comm);
      coll("tp", "reduce_scatter", sbh, T, 1, layers * (full_ac ? 6 : 4) + M + (P == 1 ? M : 0), &t.tp_comm);
      // The norms' and the row-parallel biases' gradients, replicated over
      // the sequence shards: 6 per block (and the final norm's 2), once.
      coll("tp", "allreduce", model.dim * elem, T, 1, 6 * stage_layers + 2, &t.tp_comm);
    } else {
      // 2 all-reduces per block forward, 2 backward (3 and 3 with
      // recompute's forward again); the embedding's and the head input's.
      coll("tp", "allreduce", sbh, T, 1, layers * (full_ac ? 6 : 4) + M + (P == 1 ? M : 0), &t.tp_comm);
    }
    coll("tp", "allreduce", model.seq * mb * 4, T, 1, 3 * M, &t.tp_comm);  // the parallel loss's max, sum, target
  }

  // Data parallelism: per FSDP unit (each block; the root with the
  // embeddings and head), or DDP's buckets.
  std::vector<std::pair<double, double>> units;  // (bytes, how many)
  if (model.transformer()) {
    units.push_back({elem * model.layer_params() / T, stage_layers});
    const double root = P == 1 ? model.embedding_params() + (model.tied ? 0 : model.vocab * model.dim)
                               : static_cast<double>(model.vocab) * model.dim;
    units.push_back({elem * root / T, 1});
  } else {
    // DDP's buckets of 25 MiB. Its first bucket of 1 MiB adds one more
    // all-reduce's latency, left out: the analytic ring charges it 2(p-1)
    // hops, which NCCL's tree for small messages does not pay (with it DDP
    // would lose ResNet-50 on 8 GPUs to HSDP by 0.1 ms); on CPU ranks it
    // is about 2 % of resnet_ddp's step.
    const double bucket = 25.0 * (1 << 20), grads = elem * model.num_params();
    const double n = std::ceil(grads / bucket);
    units.push_back({grads / n, n});
  }
  double dp_overlappable = 0, dp_after = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    const auto [bytes, count] = units[u];
    const bool block = model.transformer() && u == 0;
    if (strategy == "full" || strategy == "hybrid") {
      // Forward and (blocks) backward per micro-batch; once per step under a pipeline.
      const double gathers = P > 1 ? 1 : M * (block ? 2 : 1);
      coll("dp", "allgather", bytes, S, T, count * gathers, &dp_overlappable);
      coll("dp", "reduce_scatter", bytes, S, T, count, &dp_overlappable);
    } else if (strategy == "grad_op") {
      coll("dp", "allgather", bytes, S, T, count * (P > 1 ? 1 : M), &dp_overlappable);
      coll("dp", "reduce_scatter", bytes, S, T, count, &dp_overlappable);
    } else if (strategy == "no_shard" || strategy == "ddp") {
      coll("dp", "allreduce", bytes, S, T, count, &dp_overlappable);
    } else if (strategy == "zero1") {
      coll("dp", "allreduce", bytes, S, T, count, &dp_overlappable);
      coll("dp", "allgather", bytes, S, T, count, &dp_after);  // the updated parameters, after the step
    } else {
      EMBER_CHECK(false, "predict_step: unknown strategy '", c.strategy,
                  "' (full, hybrid, grad_op, no_shard, ddp, zero1)");
    }
    // The replicas' all-reduce: of each shard under HSDP, of the whole unit under DDP.
    coll("dp", "allreduce", S > 1 && strategy != "no_shard" ? bytes / S : bytes, R, T * S, count, &dp_overlappable);
  }
  t.dp_comm = dp_overlappable + dp_after;
  // Without a pipeline the collectives run beside the backward (two thirds
  // of the compute) as far as the profile lets them; under one, the
  // reductions wait for the last backward.
  const double hidden = P > 1 ? 0 : std::min(dp_overlappable, cp.overlap * span * 2 / 3);
  t.dp_exposed = t.dp_comm - hidden;
  if (hidden > 0) add("dp", "hidden behind the backward", -hidden, nullptr);

  // Pipeline transfers: a send and its gradient's receive per micro-batch and virtual stage.
  if (P > 1) {
    const double bytes = model.transformer() ? model.seq * mb * model.dim * elem / (c.sequence_parallel ? T : 1)
                                             : model.activation_bytes_per_sample * mb * elem / 2;
    coll("pp", "send_recv", bytes, 2, T * S * R, 2.0 * M * V, &t.pp_comm);
  }
  // The loop's scalar all-reduces over the job.
  coll("sync", "allreduce", 8, N, 1, static_cast<double>(o.step_allreduces), &t.sync);

  // The optimizer over the rank's parameters.
  const bool sharded = strategy == "full" || strategy == "hybrid" || strategy == "grad_op" || strategy == "zero1";
  const double params = (model.transformer() ? stage_layers * model.layer_params() + units.back().first / elem * T
                                             : static_cast<double>(model.num_params())) /
                        T / (sharded ? S : 1);
  if (const auto m = cp.models.find(model.name); !model.transformer() && m != cp.models.end())
    add("optimizer", fmt("%.3g", params) + " parameters, measured", m->second.optimizer_s * stretch, &t.optimizer);
  else if (cp.optimizer_s_per_param > 0 || cp.optimizer_overhead_s > 0)
    add("optimizer", fmt("%.3g", params) + " parameters",
        (cp.optimizer_overhead_s + params * cp.optimizer_s_per_param) * stretch, &t.optimizer);
  if (c.offload) {
    // The sharded state lives on the host: 16-bit parameters down, float32 gradients up.
    EMBER_CHECK(cp.host_bw > 0, "predict_step: CPU offload needs the host link's bandwidth");
    add("offload", size_text(2.0 * params * elem + 4.0 * params) + " over the host link",
        (2.0 * params * elem + 4.0 * params) / cp.host_bw, &t.offload_io);
  }
  t.step = span + t.tp_comm + t.dp_exposed + t.pp_comm + t.sync + t.optimizer + t.offload_io;
  return t;
}

std::string StepTime::explain() const {
  std::ostringstream os;
  os << "| part | what | seconds |\n|---|---|---|\n";
  for (const StepTerm& term : terms)
    os << "| " << term.part << " | " << term.what << " | " << secs(term.seconds) << " |\n";
  os << "| step | compute / (1 - bubble) + tp + dp exposed + pp + sync + optimizer + offload | " << secs(step)
     << " |\n";
  return os.str();
}

}  // namespace ember::distributed
