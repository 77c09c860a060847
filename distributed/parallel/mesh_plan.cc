// The mesh planner's arithmetic (mesh_plan.h): every mesh, its memory by
// the memory planner and the schedules' simulator, its step time by the
// formulas there, fastest feasible first.
#include "distributed/parallel/mesh_plan.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>
#include <tuple>

#include "core/exception.h"
#include "distributed/parallel/memory_plan.h"
#include "distributed/parallel/pp/schedule/schedule.h"
#include "distributed/parallel/step_cost.h"

namespace ember::distributed {
namespace {

std::string gib(int64_t bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", static_cast<double>(bytes) / (1 << 30));
  return b;
}

std::string secs(double s) {
  char b[32];
  if (s >= 1)
    std::snprintf(b, sizeof b, "%.2f s", s);
  else
    std::snprintf(b, sizeof b, "%.1f ms", s * 1e3);
  return b;
}

std::vector<int> divisors(int64_t n) {
  std::vector<int> d;
  for (int64_t k = 1; k <= n; ++k)
    if (n % k == 0) d.push_back(static_cast<int>(k));
  return d;
}

}  // namespace

const MeshCandidate& MeshPlan::best() const {
  EMBER_CHECK(!feasible.empty(), "plan: no mesh fits ", model.name, " on ", hw.gpus, " GPUs of ", gib(hw.mem_per_gpu),
              " GiB");
  return feasible.front();
}

namespace {

// Why the mesh `k` cannot run at all (empty: it can): its shape against the
// hardware and the model, the global batch against its data-parallel ranks.
std::string infeasible(const ModelSpec& model, const Hardware& hw, const PlanOptions& o, const MeshCandidate& k) {
  EMBER_CHECK(hw.gpus >= 1 && hw.gpus_per_host >= 1, "plan: --gpus ", hw.gpus, " and --gpus-per-host ",
              hw.gpus_per_host, " must be positive");
  EMBER_CHECK(o.global_batch >= 1, "plan: --global-batch must be positive, got ", o.global_batch);
  EMBER_CHECK(!model.transformer() || (model.heads >= 1 && model.dim % model.heads == 0 && model.layers >= 1),
              "plan: --dim ", model.dim, " does not split into ", model.heads, " heads");
  const int R = k.dims.dp_replicate, S = k.dims.dp_shard, T = k.dims.tp, P = k.dims.pp, V = k.virtual_stages;
  const int C = k.dims.cp, N = k.dims.world(), G = hw.gpus_per_host;
  EMBER_CHECK(N == hw.gpus, "plan: the mesh ", k.mesh(), " has ", N, " ranks, not ", hw.gpus);
  const int E = k.dims.ep;
  if (E > 1 && model.experts == 0) return "ep " + std::to_string(E) + " splits experts; " + model.name + " has none";
  if (E > 1 && model.experts % E != 0)
    return "ep " + std::to_string(E) + " does not divide the " + std::to_string(model.experts) + " experts";
  if (E > 1 && ((S * C) % E != 0 || E % C != 0))
    return "ep " + std::to_string(E) + " must divide dp_shard x cp = " + std::to_string(S * C) +
           " and be a multiple of cp = " + std::to_string(C);
  if (E > 1 && T > 1 && E != S * C)
    return "ep " + std::to_string(E) + " below dp_shard x cp = " + std::to_string(S * C) +
           " with tp is not built (the experts' split and tp's meet on no one mesh)";
  if (E > 1 && k.ac != "none" && (E != S * C || R != 1))
    return "ep " + std::to_string(E) + " with AC " + k.ac +
           ": the experts' own FSDP unit cannot run inside a checkpointed block";
  if (E > 1 && R != 1 && E != S * C)
    return "ep " + std::to_string(E) + " below dp_shard x cp with dp_replicate " + std::to_string(R) +
           ": HSDP of the experts is not built yet";
  if (C > 1 && !model.transformer()) return "cp splits a transformer's sequence; " + model.name + " has none";
  if (model.transformer()) {
    const int64_t kv = model.kv_heads > 0 ? model.kv_heads : model.heads;
    if (T > G) return "tp " + std::to_string(T) + " spans hosts (" + std::to_string(G) + " GPUs each)";
    if (model.heads % T != 0 || kv % T != 0)
      return "tp " + std::to_string(T) + " does not divide the " + std::to_string(model.heads) + " heads (" +
             std::to_string(kv) + " key/value heads)";
    if (C > 1 && model.seq % (2 * C) != 0)
      return "seq " + std::to_string(model.seq) + " does not cut into 2 x cp = " + std::to_string(2 * C) +
             " head-tail chunks";
    if (C > 1 && k.cp_exchange == "alltoall" && (model.heads / T) % C != 0)
      return "alltoall: cp " + std::to_string(C) + " does not divide the " + std::to_string(model.heads / T) +
             " heads of a tp rank";
    if (model.layers < static_cast<int64_t>(P) * V)
      return std::to_string(model.layers) + " layers cannot fill " + std::to_string(P * V) + " stages";
  }
  const int dp = R * S;
  if (o.global_batch % (dp * k.microbatches) != 0)
    return "the global batch " + std::to_string(o.global_batch) + " does not split over " + std::to_string(dp) +
           " data-parallel ranks x " + std::to_string(k.microbatches) + " micro-batches";
  return "";
}

// The parameters, gradients, optimizer state and gathered units of the
// rank holding the most (ZeRO's accounting, memory_plan.h); returns that
// rank's stage and tensor-parallel share of the parameters.
int64_t state_memory(const ModelSpec& model, const PlanOptions& o, MeshCandidate& k) {
  const int S = k.dims.dp_shard_cp(), T = k.dims.tp, P = k.dims.pp;  // FSDP shards over dp_shard x cp
  const int64_t M = k.microbatches, psi = model.num_params();
  const double elem = o.mixed_precision ? 2 : 4;  // bytes of a parameter, gradient or activation
  // The first stage's share of the parameters (the embedding with its
  // blocks; the last stage has the head instead, the same size for these
  // models), its tensor-parallel part.
  double stage_params;
  int64_t unit_params;
  // Under expert parallelism the experts are EP's: each rank holds ep's
  // share (whole with its gradients and optimizer state when ep is all of
  // dp_shard x cp, else FSDP's shard of it over dp_shard_mod_ep), not split
  // by tp (a token's experts run on every tp rank).
  const bool ep = k.dims.ep > 1;
  double expert_local = 0;
  if (model.transformer()) {
    const double layers_here = std::ceil(static_cast<double>(model.layers) / P);
    const double head = (P == 1 && !model.tied) ? static_cast<double>(model.vocab) * model.dim : 0;
    // Tensor parallelism splits attention and dense feed-forwards; an MoE
    // feed-forward runs whole on every tp rank.
    const double moe = model.mean_moe_ffn_params();
    const double fsdp_moe = moe - (ep ? model.mean_expert_params() : 0);
    stage_params = (layers_here * (model.mean_layer_params() - moe) + model.embedding_params() + head) / T +
                   layers_here * fsdp_moe;
    // The largest unit: a dense block, an MoE block (its experts unless ep
    // took them) or the embedding.
    double largest = static_cast<double>(model.embedding_params()) / T;
    if (model.moe_layers() < model.layers) largest = std::max(largest, static_cast<double>(model.layer_params()) / T);
    if (model.moe_layers() > 0) {
      const double attention = static_cast<double>(model.attention_params());
      const double moe_ffn = static_cast<double>(model.moe_layer_params()) - attention;
      largest = std::max(largest, attention / T + moe_ffn - (ep ? static_cast<double>(model.expert_params()) : 0));
    }
    unit_params = static_cast<int64_t>(largest);
    if (ep) expert_local = layers_here * model.mean_expert_params() / k.dims.ep;
  } else {
    stage_params = static_cast<double>(psi);
    unit_params = psi;
  }
  const int64_t psi_r = static_cast<int64_t>(stage_params);
  MemoryPlanOptions mo;
  mo.optimizer = o.optimizer;
  mo.mixed_precision = o.mixed_precision;
  mo.world_size = S;
  const MemoryPlan mp = plan_memory(psi_r, std::min(unit_params, psi_r), mo);
  const std::string strategy = !k.strategy.empty() ? k.strategy : S > 1 ? "full" : "ddp";
  const MemoryPlanRow& row = mp.row(strategy == "full" || strategy == "hybrid" ? "FULL_SHARD"
                                    : strategy == "grad_op"                    ? "SHARD_GRAD_OP"
                                    : strategy == "zero1"                      ? "ZeRO-1"
                                                                               : "DDP");
  k.params = row.params, k.grads = row.grads, k.optimizer = row.optimizer_state, k.gathered = row.gathered;
  // Under a pipeline the units stay gathered through the step with whole
  // gradients (FSDPModule::begin_micro_batches).
  const bool fsdp = S > 1 && (strategy == "full" || strategy == "hybrid" || strategy == "grad_op");
  if (fsdp && P > 1) k.gathered = static_cast<int64_t>(2 * elem * psi_r);
  // Accumulating micro-batches without a pipeline, FSDP keeps whole
  // gradients until the last one (gradient sync off until then, as
  // //examples:gpt does).
  if (fsdp && P == 1 && M > 1) k.gathered += static_cast<int64_t>(elem * psi_r);
  // With whole gradients accumulated, the sharded ones do not exist at the
  // peak: zero_grad freed them, and the step's one reduction makes them
  // after the whole ones (and the activations) peaked.
  if (fsdp && M > 1) k.grads = 0;
  if (k.offload) k.params = k.grads = k.optimizer = 0;  // the sharded state lives on the host
  if (expert_local > 0) {
    // Whole on the rank when ep is all of dp_shard x cp; else FSDP's
    // shards over the ranks holding the same experts (dp_shard_mod_ep),
    // one MoE block's gathered at a time.
    const int mod = S / k.dims.ep;
    MemoryPlanOptions eo = mo;
    eo.world_size = mod;
    const int64_t n = static_cast<int64_t>(expert_local);
    const int64_t unit = std::min<int64_t>(n, model.expert_params() / k.dims.ep);
    const MemoryPlanRow& e = plan_memory(n, unit, eo).row(mod == 1 ? "DDP" : "FULL_SHARD");
    k.params += e.params, k.grads += e.grads, k.optimizer += e.optimizer_state;
    if (mod > 1) k.gathered += e.gathered;
  }
  return psi_r;
}

// What the schedules' simulator says of one pipeline: its bubble, the
// micro-batches alive on the first rank's stages at its peak (summed) and
// on stage 0, or why it cannot run.
struct PipelinePeak {
  double bubble = 0, live_stages = 0, live_first = 0;
  std::string error;
};

// Simulated once per (schedule, pp, virtual stages, micro-batches): the
// mesh search asks again for every tp, cp, dp, exchange and AC variant of
// a pipeline (1,024 GPUs: tens of thousands of candidates).
const PipelinePeak& pipeline_peak(const std::string& schedule, int P, int V, int64_t M) {
  thread_local std::map<std::tuple<std::string, int, int, int64_t>, PipelinePeak> memo;
  auto [it, fresh] = memo.try_emplace({schedule, P, V, M});
  PipelinePeak& peak = it->second;
  if (!fresh) return peak;
  try {
    const pp::Schedule sched = pp::make_schedule(schedule, P, V, static_cast<int>(M));
    pp::Costs costs;
    costs.f = 1, costs.b = schedule == "zb-h1" ? 1 : 2, costs.w = schedule == "zb-h1" ? 1 : 0;
    const pp::Simulation sim = pp::simulate(sched, costs);
    peak.bubble = sim.bubble_fraction;
    for (int st : sched.stages_of(0)) peak.live_stages += sim.peak_live[st];
    peak.live_first = sim.peak_live[0];
  } catch (const Error& e) {
    peak.error = e.what();
  }
  return peak;
}

// The activations of the micro-batches alive on the first rank (and a
// collective's buffers); the schedule's bubble in `bubble`. Returns why the
// schedule cannot run, or empty.
std::string activation_memory(const ModelSpec& model, const PlanOptions& o, MeshCandidate& k, double* bubble) {
  const int T = k.dims.tp, P = k.dims.pp, V = k.virtual_stages, C = k.dims.cp;
  const int64_t M = k.microbatches;
  const double elem = o.mixed_precision ? 2 : 4;
  if (model.transformer()) {
    const double layers_per_stage = static_cast<double>(model.layers) / (P * V);
    double live_layers = static_cast<double>(model.layers);  // layers' worth of micro-batch activations at the peak
    double live_first = 1;  // micro-batches alive on the first stage (its embedding's output each)
    if (P > 1) {
      const PipelinePeak& peak = pipeline_peak(k.schedule, P, V, M);
      if (!peak.error.empty()) return peak.error;
      *bubble = peak.bubble;
      live_layers = peak.live_stages * layers_per_stage;
      live_first = peak.live_first;
    }
    // A rank's tokens: 1/cp of each sequence under context parallelism.
    const double sbh = static_cast<double>(model.seq) / C * k.micro_batch * model.dim;
    // 34 s·b·h bytes in 16 bits (Korthikanti): 17 elements, ember's GPT
    // block keeps the same 17 (step_memory.cc).
    const double per_layer = (k.ac == "full" ? 2.0 : 34.0) * sbh / T * (elem / 2);
    const double recompute = k.ac == "full" ? 34.0 * sbh / T * (elem / 2) : 0;  // one layer rebuilt
    const double logits = static_cast<double>(model.seq) / C * k.micro_batch * model.vocab / T * 4 * 2;
    // The embedding's output (and the position sum) per live micro-batch;
    // zero-bubble's pending W keeps its layers' output gradients (9 s·b·h
    // elements per block: q, k, v, out, 4 of fc, proj) until it runs.
    const double embedding = k.ac == "full" ? 0 : live_first * 2 * sbh / T * elem;
    const double pending_w = k.schedule == "zb-h1" ? layers_per_stage * 9 * sbh / T * elem : 0;
    // An MoE block keeps its k copies of each token's rows (gathered by
    // expert, and under ep the rows received) and the experts' SwiGLU
    // inputs and products, whole on every tp rank, in place of the dense
    // MLP's tp-split part: k times the MLP's 10 of the 17 elements, not
    // divided by tp. Recompute keeps only the blocks' inputs.
    const double moe_extra =
        model.experts > 0 && k.ac != "full"
            ? static_cast<double>(model.moe_layers()) / model.layers * (10.0 * model.top_k - 10.0 / T) * sbh * elem
            : 0;
    k.activations = static_cast<int64_t>(live_layers * (per_layer + moe_extra) + recompute + embedding + pending_w +
                                         (P == 1 ? logits : 0));
    k.buffers = static_cast<int64_t>(T > 1 ? 2 * sbh * elem : 0);  // a collective's input and output
    // cp's exchange at its backward's peak (its attention keeps only its
    // own slice): the ring's k, v in hand and arriving and float32 dk, dv
    // accumulated and arriving; the all-gather's whole sequence of k, v
    // and its float32 dk, dv twice (accumulated, then in rank order for the
    // reduce-scatter); both with the float32 dq. Ulysses' q, k, v and
    // output split by heads.
    const double kv = 2 * sbh / T, dq = sbh / T * 4;
    if (C > 1)
      k.buffers += static_cast<int64_t>(k.cp_exchange == "ring"        ? 2 * kv * (elem + 4) + dq
                                        : k.cp_exchange == "allgather" ? C * kv * (elem + 8) + dq
                                                                       : 4 * sbh / T * elem);
  } else {
    k.activations = static_cast<int64_t>(model.activation_bytes_per_sample * k.micro_batch * (elem / 2));
  }
  return "";
}

}  // namespace

MeshCandidate evaluate_mesh(const ModelSpec& model, const Hardware& hw, const PlanOptions& o, MeshCandidate k) {
  auto reject = [&](const std::string& why) {
    k.rejected = why;
    return k;
  };
  if (std::string why = infeasible(model, hw, o, k); !why.empty()) return reject(why);
  k.micro_batch = o.global_batch / (k.dims.dp() * k.microbatches);
  const int N = k.dims.world();
  const int64_t psi = model.active_params();  // a token's FLOPs: top_k experts of an MoE block
  const double tokens = static_cast<double>(o.global_batch) * (model.transformer() ? model.seq : 1);
  state_memory(model, o, k);
  double bubble = 0;
  if (std::string why = activation_memory(model, o, k, &bubble); !why.empty()) return reject(why);
  // No data-parallel buffers beside these: DDP's gradients are views of
  // its buckets, FSDP's buffers are its gathered units, a pipeline's
  // replicas average after the backwards, when the activations are gone.
  if (k.total() > hw.mem_per_gpu)
    return reject("needs " + gib(k.total()) + " GiB per GPU (" + gib(hw.mem_per_gpu) + " available)");
  // Time.
  const ComputeProfile hw_compute = ComputeProfile::from_hardware(hw);
  const Links hw_links = Links::analytic(hw);
  const StepTime t =
      predict_step(model, k, o, o.compute ? *o.compute : hw_compute, o.links ? *o.links : hw_links, bubble);
  k.compute = t.compute, k.bubble = t.bubble, k.tp_comm = t.tp_comm, k.cp_comm = t.cp_comm, k.ep_comm = t.ep_comm,
  k.dp_comm = t.dp_comm;
  k.dp_exposed = t.dp_exposed, k.pp_comm = t.pp_comm, k.offload_io = t.offload_io, k.sync = t.sync;
  k.optimizer_step = t.optimizer, k.step = t.step;
  k.explain = t.explain();
  k.mfu = 6.0 * psi * tokens / (k.step * N * hw.peak_flops);
  return k;
}

MeshPlan plan_mesh(const ModelSpec& model, const Hardware& hw, const PlanOptions& o) {
  EMBER_CHECK(o.global_batch >= 1, "plan: --global-batch must be positive, got ", o.global_batch);
  MeshPlan plan;
  plan.model = model;
  plan.hw = hw;
  plan.options = o;
  const int N = hw.gpus;
  for (int P : divisors(N))
    for (int T : divisors(N / P))
      for (int C : divisors(N / P / T))
        for (int S : divisors(N / P / T / C)) {
          const int R = N / P / T / C / S;
          if (C > 1 && !model.transformer()) continue;
          const std::vector<std::string> exchanges =
              C > 1 ? std::vector<std::string>{"ring", "allgather", "alltoall"} : std::vector<std::string>{"ring"};
          for (const std::string& exchange : exchanges) {
            std::vector<std::pair<std::string, int>> schedules = {{"", 1}};
            if (P > 1) schedules = {{"1f1b", 1}, {"interleaved", 2}, {"zb-h1", 1}};
            for (const auto& [sched_name, V] : schedules)
              for (const std::string ac : {"none", "full"})
                for (bool offload : {false, true}) {
                  if (offload && S * C == 1) continue;  // offload is FSDP's (CPUOffloadPolicy)
                  if (!model.transformer() && (T > 1 || P > 1 || ac != "none")) continue;
                  MeshCandidate c;
                  c.dims = {.pp = P, .dp_replicate = R, .dp_shard = S, .cp = C, .tp = T};
                  // An MoE model's experts split over ep ranks of dp_shard x
                  // cp (sharded over the rest), or FSDP's like the rest.
                  std::vector<int> eps{1};
                  if (model.experts > 0)
                    for (int E : divisors(S * C))
                      if (E > 1 && E % C == 0 && model.experts % E == 0 && ((R == 1 && T == 1) || E == S * C))
                        eps.push_back(E);
                  for (int E : eps) {
                    c.dims.ep = E;
                    c.cp_exchange = exchange;
                    c.schedule = sched_name, c.virtual_stages = V, c.ac = ac, c.offload = offload;
                    // Micro-batches: a pipeline fills with one sequence each (the
                    // least bubble and activation per micro-batch); without one,
                    // the whole per-rank batch at once, or accumulated one
                    // sequence at a time when that is what fits.
                    const int64_t per_dp = o.global_batch % (R * S) == 0 ? o.global_batch / (R * S) : 1;
                    std::vector<int64_t> counts{per_dp};
                    if (P == 1 && per_dp > 1) counts = {1, per_dp};
                    for (int64_t M : counts) {
                      c.microbatches = M;
                      MeshCandidate k = evaluate_mesh(model, hw, o, c);
                      (k.rejected.empty() ? plan.feasible : plan.rejected).push_back(std::move(k));
                    }
                  }
                }
          }
        }
  // Fastest first; on a tie (communication hidden alike) the simplest,
  // fewest dimensions (FSDP before HSDP, no recompute before recompute),
  // then the least communication (DDP before FSDP for a model that fits).
  auto dims = [](const MeshCandidate& c) {
    return (c.dims.dp_shard > 1) + (c.dims.dp_replicate > 1) + (c.dims.cp > 1) + (c.dims.tp > 1) + (c.dims.pp > 1) +
           c.offload + (c.ac != "none");
  };
  std::stable_sort(plan.feasible.begin(), plan.feasible.end(), [&](const MeshCandidate& a, const MeshCandidate& b) {
    if (std::abs(a.step - b.step) > 1e-3 * std::max(a.step, b.step)) return a.step < b.step;
    if (dims(a) != dims(b)) return dims(a) < dims(b);
    return a.dp_comm < b.dp_comm;
  });
  return plan;
}

std::string MeshPlan::table() const {
  std::ostringstream os;
  os << model.name << ": " << model.num_params() << " parameters";
  if (model.transformer())
    os << " (" << model.layers << " layers, dim " << model.dim << ", " << model.heads << " heads, vocab " << model.vocab
       << ", seq " << model.seq << ")";
  os << "; " << hw.gpus << " GPUs (" << hw.gpus_per_host << " per host, " << gib(hw.mem_per_gpu)
     << " GiB each); global batch " << options.global_batch << ", "
     << (options.mixed_precision ? "16-bit with float32 master" : "float32") << ", " << options.optimizer << "\n";
  os << "| # | mesh | parallelism | GiB/rank (params+grads+optim, gathered, activations) | step | compute | bubble | "
        "tp | "
        "dp exposed | MFU |\n|---|---|---|---|---|---|---|---|---|---|\n";
  for (size_t i = 0; i < feasible.size() && static_cast<int>(i) < options.top; ++i) {
    const MeshCandidate& c = feasible[i];
    char bub[16], mfu[16];
    std::snprintf(bub, sizeof bub, "%.3f", c.bubble);
    std::snprintf(mfu, sizeof mfu, "%.0f%%", 100 * c.mfu);
    os << "| " << i + 1 << " | " << c.mesh() << " | " << c.describe() << " | " << gib(c.total()) << " ("
       << gib(c.params + c.grads + c.optimizer) << ", " << gib(c.gathered) << ", " << gib(c.activations) << ") | "
       << secs(c.step) << " | " << secs(c.compute) << " | " << bub << " | " << secs(c.tp_comm) << " | "
       << secs(c.dp_exposed) << " | " << mfu << " |\n";
  }
  if (feasible.empty())
    os << "no mesh fits\n";
  else
    os << "best: " << feasible.front().mesh() << " (" << feasible.front().describe() << ")\n";
  // Each reason once: how many, and one mesh it rejected.
  std::map<std::string, std::pair<int, std::string>> why;
  for (const MeshCandidate& c : rejected) {
    // One line per kind of reason: its numbers as N.
    std::string key;
    for (char ch : c.rejected)
      if (!std::isdigit(static_cast<unsigned char>(ch)) || key.empty() || key.back() != 'N')
        key += std::isdigit(static_cast<unsigned char>(ch)) ? 'N' : ch;
    if (key.rfind("needs ", 0) == 0) key = "does not fit in memory";
    auto& w = why[key];
    if (w.first++ == 0) w.second = c.mesh() + " (" + c.describe() + "): " + c.rejected;
  }
  os << feasible.size() << " configurations fit, " << rejected.size() << " rejected:\n";
  for (const auto& [reason, w] : why) os << "  " << w.first << " x " << reason << ", e.g. " << w.second << "\n";
  return os.str();
}

}  // namespace ember::distributed
