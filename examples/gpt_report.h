// What //examples:gpt reports around its training step, kept out of the
// program so that gpt.cc reads as a training script: the validation loss
// against a unigram baseline, a sample from the trained weights, one JSON
// line per step (--metrics), the step's memory by part beside the
// planner's prediction, and the pipeline's bubble beside the simulator's.
#pragma once

#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "distributed/checkpoint/sharded.h"
#include "distributed/logging/logging.h"
#include "distributed/parallel/cp/load_balance.h"
#include "distributed/parallel/mesh_plan.h"
#include "distributed/parallel/pp/pipeline.h"
#include "distributed/parallel/recipes/parallelize.h"
#include "distributed/parallel/step_memory.h"
#include "distributed/parallel/tp/loss_parallel.h"
#include "distributed/parallel_dims.h"
#include "examples/gpt_corpus.h"
#include "nn/moe.h"
#include "nn/transformer.h"

namespace ember::examples {

// Mean cross-entropy (nats per character) over fixed held-out windows,
// split evenly over the data-parallel ranks (every rank runs the same
// number of forwards: FSDP's gathers are collectives), and the same for a
// unigram model of the training text (add-one smoothed) on the same
// characters.
struct Eval {
  std::vector<int64_t> starts;  // all ranks' windows
  double unigram = 0;
};

inline Eval make_eval(const Corpus& c, int64_t seq, int world) {
  Eval e;
  const int64_t span = c.val.size() - seq - 1;
  EMBER_CHECK(span > 0, "the validation data (", c.val.size(), " ", c.unit, ") is shorter than --seq ", seq);
  const int64_t per_rank = (64 + world - 1) / world;  // world: the data-parallel ranks
  const int64_t n = per_rank * world;
  for (int64_t i = 0; i < n; ++i) e.starts.push_back(span * i / n);
  // Add-one smoothed counts over (the first 2^26 tokens of) the training data.
  const std::vector<int64_t> counted = c.train.counts(c.vocab, int64_t{1} << 26);
  std::vector<double> count(counted.size(), 1.0);
  for (size_t k = 0; k < count.size(); ++k) count[k] += static_cast<double>(counted[k]);
  double total = 0;
  for (double v : count) total += v;
  double nll = 0;
  int64_t m = 0;
  for (int64_t s : e.starts)
    for (int64_t t = 1; t <= seq; ++t, ++m) nll -= std::log(count[c.val[s + t]] / total);
  e.unigram = nll / m;
  return e;
}

// A batch's [B, T] rows cut to this rank's head-tail chunks under context
// parallelism (cp > 1); x itself otherwise.
inline Tensor cp_slice(const Tensor& x, int cp, int cp_rank) {
  return cp > 1 ? distributed::cp::shard(x, 1, cp, cp_rank).contiguous() : x;
}

// The windows are split over the data-parallel ranks; the tp ranks of one
// data-parallel rank evaluate the same windows together (each the same
// loss), its cp ranks each their chunks of them (the mean of theirs).
inline double evaluate(nn::Module& model, distributed::pp::Pipeline* pipe, const Corpus& c, const Eval& e, int64_t seq,
                       distributed::ProcessGroup& pg, Device device, int dp, int dp_rank, int tp, int cp = 1,
                       int cp_rank = 0) {
  model.eval();
  NoGradGuard ng;
  const int64_t per_rank = static_cast<int64_t>(e.starts.size()) / dp;
  std::vector<int64_t> mine(e.starts.begin() + dp_rank * per_rank, e.starts.begin() + (dp_rank + 1) * per_rank);
  double local = 0;
  // Parts of at most 16 windows; through a pipeline all of one size (its
  // stages agree on the activation's shape once).
  size_t chunk = 16;
  if (pipe != nullptr)
    while (chunk > 1 && mine.size() % chunk != 0) --chunk;
  for (size_t i = 0; i < mine.size(); i += chunk) {
    std::vector<int64_t> part(mine.begin() + i, mine.begin() + std::min(mine.size(), i + chunk));
    auto [xw, y] = c.val.windows(part, seq);
    const Tensor x = cp_slice(xw, cp, cp_rank);
    const Tensor yt = cp_slice(y.reshape({xw.size(0), seq}), cp, cp_rank).to(device);
    if (pipe != nullptr) {  // forwards through the stages; the last stage's ranks hold the loss
      const std::vector<Tensor> l = pipe->step({x.to(device)}, {yt});
      if (!l.empty()) local += l[0].item() * part.size();
      continue;
    }
    Tensor logits = model(x.to(device));
    local += distributed::parallel_cross_entropy(logits, yt).item() * part.size();
  }
  Tensor t = full({1}, local / static_cast<double>(e.starts.size()) / tp / cp).to(device);
  pg.allreduce(t, distributed::ReduceOp::Sum)->wait();
  model.train();
  return t.to(kCPU).item();
}

// Temperature and top-k sampling from a plain (unsharded) copy of the model.
inline std::string generate(nn::GPT& gpt, const Corpus& c, uint64_t seed, int64_t len, int64_t seq, double temperature,
                            int64_t top_k) {
  gpt.eval();
  NoGradGuard ng;
  std::mt19937_64 g(seed + 17);
  std::vector<uint32_t> ctx{c.start_token};
  std::string out;
  for (int64_t i = 0; i < len; ++i) {
    std::vector<double> ids;
    const size_t from = ctx.size() > static_cast<size_t>(seq) ? ctx.size() - seq : 0;
    for (size_t k = from; k < ctx.size(); ++k) ids.push_back(ctx[k]);
    Tensor x = Tensor::from_vector(ids, {1, static_cast<int64_t>(ids.size())}, DType::Int64);
    Tensor logits = gpt(x).to(DType::Float32);
    std::vector<double> l = logits.narrow(1, logits.size(1) - 1, 1).reshape({-1}).to_vector();
    std::vector<size_t> order(l.size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    const size_t keep = std::min<size_t>(static_cast<size_t>(top_k), order.size());
    std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                      [&](size_t a, size_t b) { return l[a] > l[b]; });
    std::vector<double> w(keep);
    for (size_t k = 0; k < keep; ++k) w[k] = std::exp((l[order[k]] - l[order[0]]) / temperature);
    std::discrete_distribution<size_t> pick(w.begin(), w.end());
    const auto next = static_cast<uint32_t>(order[pick(g)]);
    ctx.push_back(next);
    out += c.piece(next);
  }
  return out;
}

// A hash of a global batch (its token windows), so two runs can be shown to
// have seen the same data.
inline std::string batch_digest(const Corpus& c, const std::vector<int64_t>& starts, int64_t seq) {
  auto [x, y] = c.train.windows(starts, seq);
  const uint64_t h = XXH64(y.raw_data(), static_cast<size_t>(y.numel()) * 8, XXH64(x.raw_data(), x.numel() * 8, 0));
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

// --metrics: one JSON line per optimizer step, written by rank 0; after a
// restart or resume still one line per step, the run's that counts.
class MetricsLog {
 public:
  // Opens `path`. A fresh run starts it anew. A run that resumes at `step`
  // (--resume, a launcher's restart: EMBER_RESTART_COUNT > 0, a live
  // recovery) keeps the lines of steps up to `step` and drops those of the
  // steps after it, which it is about to redo (the file is rewritten whole,
  // then appended to), so no step has two lines; the lines it writes carry
  // "restart": R, marking where restarts took over, and a step trained again
  // "redone": true. Steps a live recovery
  // continues after without their line (the fault came between the
  // optimizer step and the line) get one with their batch's digest and a
  // null loss.
  MetricsLog(const std::string& path, bool writer, int64_t step,
             const std::function<std::string(int64_t step)>& digest_of) {
    if (path.empty() || !writer) return;
    const char* rc = std::getenv("EMBER_RESTART_COUNT");
    restart_ = rc ? std::atoi(rc) : 0;
    int64_t written = 0;
    if (step > 0 || restart_ > 0) {
      std::vector<std::string> kept;
      for (std::ifstream in(path); in;) {
        std::string line;
        if (!std::getline(in, line)) break;
        const auto j = nlohmann::json::parse(line, nullptr, false);
        if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) continue;
        const int64_t k = j["step"].get<int64_t>();
        if (k > step) {  // redone from here: the new line replaces it
          redone_.insert(k);
          continue;
        }
        written = std::max(written, k);
        kept.push_back(line);
      }
      const std::string tmp = path + ".tmp";
      {
        std::ofstream out(tmp, std::ios::trunc);
        for (const auto& l : kept) out << l << "\n";
        EMBER_CHECK(out.flush(), "--metrics: cannot write ", tmp);
      }
      EMBER_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "--metrics: cannot replace ", path, " with ", tmp, ": ",
                  std::strerror(errno));
    }
    out_.open(path, step > 0 || restart_ > 0 ? std::ios::app : std::ios::trunc);
    EMBER_CHECK(out_, "--metrics: cannot write ", path);
    for (int64_t k = written + 1; step > 0 && written > 0 && k <= step; ++k)
      out_ << nlohmann::json{{"step", k},
                             {"batch_digest", digest_of(k - 1)},
                             {"loss", nullptr},
                             {"note", "trained before a failure; its line was lost with it"}}
                  .dump()
           << "\n";
  }
  bool is_open() const { return out_.is_open(); }
  // The step's line: `mem` is the largest peak over the ranks, whose parts
  // add up to it; `rank_secs` each rank's own time in the training step.
  void write(int64_t step, double loss, double lr, double grad_norm, double tokens, double secs,
             const distributed::StepMemory& mem, const std::string& digest, const std::vector<double>& rank_secs,
             const nlohmann::json& extra = nlohmann::json::object()) {
    nlohmann::json line = {
        {"step", step},
        {"loss", loss},
        {"lr", lr},
        {"grad_norm", grad_norm},
        {"tokens_per_s", tokens / std::max(secs, 1e-9)},
        {"step_s", secs},               // the step's wall time, for the step-time prediction (bench/step_predict.py)
        {"step_s_by_rank", rank_secs},  // each rank's training step alone (no reports), by global rank
        {"mem_peak_mib", mem.total()},
        {"mem_params_mib", mem[MemoryKind::Parameters]},
        {"mem_grads_mib", mem[MemoryKind::Gradients]},
        {"mem_optimizer_mib", mem[MemoryKind::Optimizer]},
        {"mem_gathered_mib", mem[MemoryKind::Gathered]},
        {"mem_activations_mib", mem[MemoryKind::Activations]},
        {"mem_other_mib", mem[MemoryKind::Other]},
        {"batch_digest", digest},
        // wall clock: timelines of restarts across processes
        {"time", std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count()}};
    for (const auto& [k, v] : extra.items()) line[k] = v;
    if (restart_ > 0) line["restart"] = restart_;
    if (redone_.count(step)) line["redone"] = true;  // an earlier attempt had trained it too
    out_ << line.dump() << "\n" << std::flush;
  }

 private:
  std::ofstream out_;
  int restart_ = 0;           // EMBER_RESTART_COUNT: the launcher's attempt that writes
  std::set<int64_t> redone_;  // steps whose earlier line was dropped
};

// The step's expert load for --metrics, collective over `pg` (the world):
// tokens per expert over every MoE layer of every stage, already summed over
// the data ranks by each layer (its balance group), so min and max combine
// over the world and duplicates (tp ranks) weigh alike in the mean; the
// load-balancing loss, the mean over the layers of each layer's mean over
// the step's micro-batches, averaged over the ranks (each holds its own
// batch's share); with a capacity, the share of the (token, choice) pairs
// dropped, over every layer and rank.
inline nlohmann::json moe_metrics(nn::Module& part, distributed::ProcessGroup& pg, Device device) {
  double lo = std::numeric_limits<double>::infinity(), hi = -lo, sum = 0, experts = 0, aux = 0, layers = 0;
  double routed = 0, dropped = 0;
  bool capacity = false;
  for (nn::MoE* m : nn::moe_layers(part)) {
    const nn::MoEStats st = m->stats();                             // reads the layer's sums back
    capacity = capacity || m->router->options.capacity_factor > 0;  // the forward's copy
    routed += static_cast<double>(st.routed), dropped += static_cast<double>(st.dropped);
    for (int64_t c : st.tokens_per_expert) {
      lo = std::min(lo, static_cast<double>(c)), hi = std::max(hi, static_cast<double>(c));
      sum += static_cast<double>(c), experts += 1;
    }
    if (st.forwards > 0) aux += st.aux_loss / static_cast<double>(st.forwards), layers += 1;
  }
  Tensor mn = Tensor::from_vector({lo}, {1}, DType::Float64).to(device);
  Tensor mx = Tensor::from_vector({hi}, {1}, DType::Float64).to(device);
  Tensor sums = Tensor::from_vector({sum, experts, aux, layers, routed, dropped}, {6}, DType::Float64).to(device);
  pg.allreduce(mn, distributed::ReduceOp::Min)->wait();
  pg.allreduce(mx, distributed::ReduceOp::Max)->wait();
  pg.allreduce(sums, distributed::ReduceOp::Sum)->wait();
  const std::vector<double> v = sums.to(kCPU).to_vector();
  nlohmann::json out = {{"expert_tokens_min", mn.to(kCPU).item()},
                        {"expert_tokens_max", mx.to(kCPU).item()},
                        {"expert_tokens_mean", v[1] > 0 ? v[0] / v[1] : 0.0},
                        {"moe_aux_loss", v[3] > 0 ? v[2] / v[3] : 0.0}};
  if (capacity) out["moe_dropped_frac"] = v[4] > 0 ? v[5] / v[4] : 0.0;
  return out;
}

// A run's shape, for the lines that describe it and predict its memory.
struct RunInfo {
  nn::GPTOptions model;  // block_size: the context, --seq
  distributed::ParallelDims dims;
  bool sp = false;
  std::string amp, strategy, fsdp_strategy, ac, pp_schedule;  // strategy: the flag's; fsdp_strategy: "FULL_SHARD"
  std::string cp_exchange = "ring";
  int pp_virtual = 1;
  int64_t micro_batch = 0, micro_steps = 1, global_batch = 0, max_steps = 0, n_params = 0;
  int world = 1, gpus_per_host = 1;
  bool cuda = false;
  std::string checkpoint_dir;
};

// The planner's prediction of the step's memory, for the line beside the
// measured one: the memory planner's timeline where it models the run
// (FSDP alone, float32, no accumulation), else the mesh planner's ZeRO
// accounting of what a rank's stage and tensor-parallel part hold.
inline std::string memory_plan_line(const RunInfo& in) {
  const distributed::ParallelDims& d = in.dims;
  // The step-memory timeline knows GPT-2's modules (LayerNorm, GELU MLP);
  // the mesh planner's accounting covers both families, and cp.
  if (in.model.arch == nn::Arch::GPT2 && d.tp == 1 && d.pp == 1 && d.cp == 1 && d.dp_replicate == 1 &&
      in.amp == "off" && in.strategy != "hybrid" && in.micro_steps == 1) {
    distributed::StepPlan plan{.micro_batch = in.micro_batch,
                               .seq = in.model.block_size,
                               .world = d.dp_shard,
                               .strategy = in.strategy,
                               .ac = in.ac};
    return distributed::predict_gpt_step_memory(in.model, plan).line("memory plan");
  }
  if ((in.ac == "none" || in.ac == "full") && (in.strategy == "full" || in.strategy == "hybrid")) {
    // 17 s·b·h elements per block and live micro-batch.
    const distributed::ModelSpec spec = distributed::model_spec(in.model, in.model.block_size);
    const distributed::Hardware hw{
        .gpus = in.world, .gpus_per_host = in.gpus_per_host, .mem_per_gpu = int64_t{1} << 50};
    const distributed::PlanOptions po{.global_batch = in.global_batch, .mixed_precision = in.amp != "off"};
    distributed::MeshCandidate c;
    c.dims = d;
    c.cp_exchange = in.cp_exchange;
    c.schedule = d.pp > 1 ? in.pp_schedule : "";
    c.virtual_stages = d.pp > 1 ? in.pp_virtual : 1;
    c.microbatches = in.micro_steps;
    c.ac = in.ac;
    return distributed::evaluate_mesh(spec, hw, po, c).memory_line();
  }
  return "memory plan: --ac " + in.ac + " with --strategy " + in.strategy + " is not modelled with tensor or " +
         "pipeline parallelism, HSDP, --amp or accumulation";
}

// The pipeline's bubble, measured over the pp ranks beside the simulator's
// with the measured costs. Collective over pp: every rank calls it (not
// inside LOG0, which skips its arguments on the silent ranks).
inline std::string bubble_line(distributed::pp::Pipeline& pipe) {
  const auto meas = pipe.measure_last_step();
  const auto sim = distributed::pp::simulate(pipe.schedule(), meas.costs, meas.stage_costs);
  return ::ember::detail::str_cat("pipeline ", pipe.schedule().name, ": bubble fraction measured ",
                                  meas.bubble_fraction, ", simulated ", sim.bubble_fraction, " (measured F ",
                                  meas.costs.f * 1e3, " ms, B ", meas.costs.b * 1e3, " ms, W ", meas.costs.w * 1e3,
                                  " ms per stage and micro-batch on average, transfers ", meas.costs.comm * 1e3,
                                  " ms; step ", meas.makespan * 1e3, " ms, simulated ", sim.makespan * 1e3, " ms)");
}

// "GPT 2 layers x 128 dims, ...": the model, the data, the ranks and how
// the model is split over them, the batch; `fsdp` without a pipeline.
inline std::string describe_run(const RunInfo& r, const Corpus& c, distributed::FSDPModule* fsdp,
                                const distributed::PipelineParallel& pp) {
  const distributed::ParallelDims& d = r.dims;
  const std::string precision = r.amp == "off" ? "float32" : r.amp + " compute (float32 shards and reduction)";
  std::string sharding;
  if (fsdp != nullptr) {
    const auto mem = fsdp->memory();
    sharding = ", FSDP " + r.fsdp_strategy + ", " + std::to_string(fsdp->units().size()) + " units, " + precision +
               "; rank 0 holds " + std::to_string(mem.sharded_params) + " bytes of parameters (" +
               std::to_string(r.n_params * 4) + " unsharded), largest unit " + std::to_string(mem.largest_unit) +
               " bytes gathered";
  } else {
    sharding = ", pipeline " + pp.pipe->schedule().name + " over " + std::to_string(d.pp) + " ranks x " +
               std::to_string(pp.pipe->schedule().virtual_stages) + " stage(s), " + std::to_string(r.micro_steps) +
               " micro-batches, ";
    if (pp.fsdp.empty()) {
      sharding += r.amp == "off" ? "float32" : r.amp + " autocast (float32 parameters)";
    } else {
      int64_t units = 0, held = 0;
      for (auto& f : pp.fsdp) units += static_cast<int64_t>(f->units().size()), held += f->memory().sharded_params;
      sharding += "FSDP " + r.fsdp_strategy + " inside the stages (" + std::to_string(units) +
                  " units on this rank), " + precision + "; rank 0 holds " + std::to_string(held) +
                  " bytes of parameters";
    }
  }
  const int64_t seq = r.model.block_size;
  const bool llama = r.model.arch == nn::Arch::Llama;
  // The experts: which blocks, and under ep what a rank holds of them (FSDP
  // leaves them to expert parallelism).
  std::string moe;
  if (const nn::MoEOptions& m = r.model.moe; m.num_experts > 0) {
    const int64_t hidden = m.hidden > 0 ? m.hidden : r.model.ffn_width();
    const int64_t every = std::max<int64_t>(m.every, 1);
    int64_t blocks = 0;
    for (int64_t i = 0; i < r.model.n_layer; ++i) blocks += r.model.is_moe_block(i);
    moe = "; MoE in " + std::to_string(blocks) + " of " + std::to_string(r.model.n_layer) + " blocks (every " +
          std::to_string(every) + "): " + std::to_string(m.num_experts) + " experts of " + std::to_string(hidden) +
          ", top " + std::to_string(m.top_k) + " (" + nn::router_score_name(m.score) + ")";
    if (d.ep > 1)
      moe += ", split over ep=" + std::to_string(d.ep) + ": each rank holds " +
             std::to_string(m.num_experts / d.ep * 3 * r.model.n_embd * hidden * 4 * blocks) + " bytes of them" +
             (d.pp > 1 ? " over the whole model (a pipeline rank, its stages' part)" : "");
  }
  return ::ember::detail::str_cat(
      llama ? "LLaMA " : "GPT ", r.model.n_layer, " layers x ", r.model.n_embd, " dims, ", r.model.n_head, " heads",
      llama ? " (" + std::to_string(r.model.kv_heads()) + " key/value), SwiGLU " + std::to_string(r.model.ffn_width())
            : std::string(),
      ", context ", seq, ": ", r.n_params, " parameters, vocabulary ", r.model.vocab_size, "; ", c.description, " (",
      c.train.size(), " train / ", c.val.size(), " validation ", c.unit, ")\n", r.world, " rank(s) on ",
      r.cuda ? "GPUs (NCCL)" : "the CPU (Gloo)",
      d.tp > 1 ? ", tensor parallel over " + std::to_string(d.tp) + (r.sp ? " with sequence parallelism" : "")
               : std::string(),
      sharding, moe, "\n", "batch ", r.micro_batch, " x ", seq, " ", c.unit, " per rank x ", d.dp(),
      " data-parallel rank(s) x ", r.micro_steps, " micro-batch(es) = ", r.global_batch * seq, " tokens per step; ",
      r.max_steps, " steps; checkpoints in ", r.checkpoint_dir);
}

// A sample from one process's whole copy of the model, read from the
// checkpoint in `dir` (whatever mesh wrote it).
inline std::string sample_from_checkpoint(const std::string& dir, const nn::GPTOptions& options, const Corpus& c,
                                          uint64_t seed, int64_t len, double temperature, int64_t top_k) {
  auto index = distributed::read_checkpoint_index(dir);
  EMBER_CHECK(index.ok(), index.status().message());
  auto m = std::make_shared<nn::GPT>(options);
  nn::StateDict sd;
  for (const auto& [name, t] : m->state_dict()) {
    auto whole = distributed::read_checkpoint_tensor(dir, *index->find(name));
    EMBER_CHECK(whole.ok(), whole.status().message());
    sd.insert(name, *whole);
  }
  m->load_state_dict(sd);
  return generate(*m, c, seed, len, options.block_size, temperature, top_k);
}

}  // namespace ember::examples
