// The language-model example every parallelism extends: a character-level
// GPT on the quotes of Debian's `fortunes` package, on a ParallelDims mesh
// of (pp, dp_replicate, dp_shard, tp) ranks, parallelized by the library's
// recipe (distributed/parallel/recipes/gpt.h). It launches its own workers
// (one per GPU, else 2), evaluates against a unigram baseline, writes
// sharded checkpoints any other mesh loads, and ends with a sample. Step k's
// data depends on (seed, k) only: every mesh with the same --global-batch
// trains on the same sequences. The step is train_step; what is reported
// around it is examples/gpt_report.h; the flags are declare()'s table.
//
//   bazel run -c opt //examples:gpt                                      # 2 CPU workers, FSDP FULL_SHARD
//   bazel run -c opt //examples:gpt -- --nproc 4 --dp-shard 2 --tp 2     # FSDP x TP (+SP)
//   bazel run -c opt //examples:gpt -- --pp 2 --pp-schedule zb-h1 --microbatches 8 --layers 4
//   bazel run -c opt //examples:gpt -- --nproc 8 --pp 2 --dp-shard 2 --tp 2
//   bazel run -c opt //examples:gpt -- --nproc 4 --strategy hybrid --shard-size 2 --amp bf16
//   bazel run -c opt //examples:gpt -- --max-steps 900 --resume --nproc 3   # resharded onto 3 ranks
// Under `//tools:launch --live-recovery` a lost worker is replaced in place
// and takes its state from a replica (docs/elastic.md). //examples:gpt_fsdp
// is the same program. The default run took 102 s on the 2-core CI machine
// (2026-11-24) and reached 1.954 nats per character against the unigram's
// 3.379; docs/fsdp.md ("Sharded training") shows its output.
#include "distributed/parallel/recipes/gpt.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/autocast.h"
#include "distributed/anomaly.h"
#include "distributed/checkpoint/checkpoint.h"
#include "distributed/checkpoint/live_recovery.h"
#include "distributed/checkpoint/sharded.h"
#include "distributed/comm/functional_collectives.h"
#include "distributed/config_check.h"
#include "distributed/init.h"
#include "distributed/parallel/rank_agreement.h"
#include "distributed/straggler.h"
#include "examples/gpt_flags.h"
#include "examples/gpt_report.h"
#include "examples/profiling.h"
#include "examples/training.h"
#include "nn/float8.h"
#include "optim/grad_scaler.h"
#include "optim/graphed_step.h"
#include "optim/lr_scheduler.h"
#include "optim/optimizer.h"

namespace ember {
namespace {

using examples::Clock;
using examples::Corpus;
using examples::Flags;

// The model: the flags', or with --init-from-hf config.json's (whose
// vocab_size setup has checked against the run's).
nn::GPTOptions model_options(const Flags& f, int64_t vocab) {
  if (f.hf) return *f.hf;
  nn::GPTOptions o{.vocab_size = vocab, .block_size = f.seq, .n_layer = f.layers, .n_head = f.heads, .n_embd = f.dim};
  if (f.arch == "llama") {
    o.arch = nn::Arch::Llama;
    o.n_kv_head = f.kv_heads;
    o.ffn_hidden = f.ffn;
    o.rope_theta = f.rope_theta;
  }
  if (f.moe_experts > 0)
    o.moe = {.num_experts = f.moe_experts,
             .top_k = f.moe_top_k,
             .hidden = f.moe_hidden,
             .score = nn::parse_router_score(f.moe_score),
             .shared_experts = f.moe_shared,
             .aux_loss_coef = f.moe_aux_coef,
             .z_loss_coef = f.moe_z_coef,
             .every = f.moe_every,
             .capacity_factor = f.moe_capacity_factor};
  return o;
}

// The flags' mesh as ParallelDims: --strategy hybrid makes shard groups of
// --shard-size ranks (default: a node's over tp) and replicas of the rest.
distributed::ParallelDims parallel_dims(const Flags& f, int world, int local_world) {
  distributed::ParallelDims d = f.mesh;
  if (f.strategy == "hybrid") {
    d.dp_shard = f.shard_size > 0 ? f.shard_size : std::max(1, local_world / (f.mesh.tp > 0 ? f.mesh.tp : 1));
    d.dp_replicate = -1;
  }
  return d.resolved(world);
}

// ---- Setup: the model parallelized, its optimizer, schedule and scaler ----

struct Setup {
  Corpus corpus;
  int64_t vocab = 0, n_params = 0, step = 0;
  distributed::ParallelDims dims;
  bool sp = false;
  std::shared_ptr<distributed::DeviceMesh> mesh;
  int dp_rank = 0;
  int cp_rank = 0;                            // this rank's head-tail chunks of every sequence (cp > 1)
  int64_t global_batch = 0, micro_batch = 0;  // sequences per step over the job, per rank per micro-batch
  int64_t micro_steps = 1;                    // micro-batches per optimizer step: the pipeline's, or accumulated
  std::shared_ptr<nn::GPT> gpt;               // the whole model; null under a pipeline (each rank keeps its stages)
  distributed::Parallelized par;              // without a pipeline
  distributed::PipelineParallel pp;           // with one: this rank's stages, its part, the pipeline
  std::unique_ptr<distributed::pp::Pipeline> eval_pipe;
  distributed::FSDPOptions fsdp_options;
  nn::Module& model() { return pp.part ? *pp.part : *gpt; }
  std::unique_ptr<optim::AdamW> opt;
  std::unique_ptr<optim::SequentialLR> sched;
  std::unique_ptr<optim::GradScaler> scaler;
  // --straggler-every: the step's sections are timed into it (null: off).
  distributed::StragglerDetector* straggler = nullptr;
  // --detect-anomaly (null: off), --nan-rerun, and the job's world for
  // their reports.
  distributed::AnomalyDetector* anomaly = nullptr;
  bool nan_rerun = false;
  // --float8-all-gather 1: each step's float8 scales precomputed before its
  // forward, one all-reduce (torchtitan's precompute).
  bool precompute_float8 = false;
  distributed::ProcessGroup* world = nullptr;
  // --cuda-graph 1: the step as one CUDA graph, and the host's time (input
  // copies and the replay's launch) and the whole step's, per replayed step.
  std::unique_ptr<optim::GraphedStep> graphed;
  examples::GraphTimes graph_times;
  // --inject-nan (testing): at `step`, on every try or only the first.
  struct {
    int64_t step = -1;
    bool once = false, armed = false;
    int tries = 0;
  } inject;
};

// A section of the step timed for the straggler detector, when it is on.
struct Section {
  Section(distributed::StragglerDetector* d, const char* name) {
    if (d) timer.emplace(d, name);
  }
  std::optional<distributed::StragglerDetector::Timer> timer;
};

// Sharded checkpoints: every rank writes its own shards, and a run with
// another number of ranks or another strategy loads them.
void resume(const Flags& flags, const examples::Job& job, Setup& s, bool required) {
  // The newest checkpoint that verifies completely; the newer ones skipped
  // are named, none is touched. A restart before the first save starts afresh.
  const std::string& dir = flags.common.checkpoint_dir;
  std::vector<std::string> skipped;
  auto found = distributed::newest_verified_checkpoint(dir, "step_", *job.pg, &skipped);
  for (const auto& sk : skipped) LOG0("--resume: skipping ", sk);
  EMBER_CHECK(found.ok(), "--resume: ", found.status().message());
  if (!found->has_value() && !required) {
    LOG0("restart: no checkpoint in ", dir, " yet; starting from step 0");
    return;
  }
  EMBER_CHECK(found->has_value(), "--resume: no checkpoint in ", dir);
  const std::string path = **found;
  auto index = distributed::read_checkpoint_index(path);
  EMBER_CHECK(index.ok(), "--resume: ", index.status().message());
  auto st = distributed::load_sharded_checkpoint(path, s.model(), s.opt.get(), s.sched.get(), *job.pg);
  EMBER_CHECK(st.ok(), "--resume: ", st.status().message(),
              " (was it written with other --layers/--dim/--heads/--seq or another corpus?)");
  s.step = st->step;
  examples::restore_scaler(*s.scaler, nlohmann::json::parse(st->extra_json), path);
  std::string now = distributed::strategy_name(s.fsdp_options.strategy);  // as the index names it: "full_shard"
  for (char& c : now) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s.dims.tp > 1) now += "+tensor_parallel";
  if (s.dims.pp > 1) now += "+pipeline";
  const std::string then = index->layout.rfind("fsdp:", 0) == 0 ? index->layout.substr(5) : index->layout;
  LOG0("resumed from ", path, ": saved by ", index->world_size, " rank", index->world_size == 1 ? "" : "s", " (", then,
       "), loading on ", job.world, " rank", job.world == 1 ? "" : "s", " (", now, "); ", s.step, " step(s) done");
}

// Live recovery (launch --live-recovery, init.h): the state this rank
// rebuilt its objects without comes from a replica (the replacement) or
// from what it kept (a survivor); ranks a step behind catch up.
void recover(const examples::Job& job, Setup& s, const distributed::LiveState* kept) {
  const auto r = distributed::recover_live_state(kept, s.model(), *s.opt, s.sched.get(), s.scaler.get(), *job.pg,
                                                 distributed::replicas_along(*s.mesh, "dp_replicate"));
  s.step = r.step;
  if (r.source >= 0)
    LOG_ALL("live recovery: received ", r.bytes_received, " bytes of training state (step ", r.step, ") from rank ",
            r.source, ", a live replica, in ", r.seconds, " s");
  LOG0("live recovery: generation ", distributed::recovery_generation(), ", continuing from step ", r.step,
       " on the same mesh");
}

Setup setup(const Flags& flags, const examples::Job& job, bool from_disk = true) {
  Setup s;
  s.corpus = examples::load_corpus(flags.common.data, flags.tokenizer, flags.common.checkpoint_dir + "/tokenizer.json",
                                   job.rank == 0);
  s.vocab = s.corpus.vocab;
  EMBER_CHECK(s.corpus.train.size() > flags.seq + 1, "the training data (", s.corpus.train.size(), " ", s.corpus.unit,
              ") is shorter than --seq ", flags.seq);
  EMBER_CHECK(!flags.hf || flags.hf->vocab_size == s.vocab, "--init-from-hf ", flags.init_from_hf,
              ": config.json's vocab_size ", flags.hf ? flags.hf->vocab_size : 0, " and the run's vocabulary of ",
              s.vocab, " tokens (", s.corpus.description, ") differ: train on data in the model's own vocabulary");
  const distributed::ParallelDims& d = s.dims = parallel_dims(flags, job.world, job.env.local_world_size);
  s.sp = flags.sp == "on" || (flags.sp == "auto" && d.tp > 1);
  EMBER_CHECK(!flags.hf || flags.hf->kv_heads() % d.tp == 0, "--init-from-hf ", flags.init_from_hf, ": the model's ",
              flags.hf ? flags.hf->kv_heads() : 0, " key/value heads (config.json) do not split over --tp ", d.tp,
              " (tensor parallelism splits attention by heads)");
  EMBER_CHECK(flags.heads % d.tp == 0, "--heads ", flags.heads, " do not split over --tp ", d.tp,
              " (attention is split by heads)");
  EMBER_CHECK(flags.kv_heads == 0 || flags.kv_heads % d.tp == 0, "--kv-heads ", flags.kv_heads,
              " do not split over --tp ", d.tp, " (grouped-query attention splits its key/value heads)");
  EMBER_CHECK(!s.sp || flags.seq % d.tp == 0, "--seq ", flags.seq, " must be a multiple of --tp ", d.tp,
              " with sequence parallelism (or --sp off)");
  s.micro_steps = d.pp > 1 ? flags.microbatches : flags.common.accum_steps;
  s.global_batch = flags.global_batch > 0 ? flags.global_batch : flags.common.batch_size * d.dp() * s.micro_steps;
  EMBER_CHECK(s.global_batch % (d.dp() * s.micro_steps) == 0, "--global-batch ", s.global_batch,
              " does not split over ", d.dp(), " data-parallel rank(s) x ", s.micro_steps, " micro-batch(es)");
  s.micro_batch = s.global_batch / (d.dp() * s.micro_steps);
  s.mesh = d.build_mesh();
  s.dp_rank = d.dp_rank(*s.mesh);
  s.cp_rank = d.cp > 1 ? s.mesh->coordinate("cp") : 0;
  LOG0(d.line());

  manual_seed(flags.common.seed);
  s.gpt = std::make_shared<nn::GPT>(model_options(flags, s.vocab));
  if (flags.hf) {
    // Into the whole model on every rank, before any parallelization
    // shards it (each rank then keeps its part, as with a random init).
    const absl::Status loaded = nn::load_hf_into(*s.gpt, flags.init_from_hf);
    EMBER_CHECK(loaded.ok(), "--init-from-hf: ", loaded.message());
    LOG0("initialised from ", flags.init_from_hf, " (", nn::arch_name(flags.hf->arch), ", ", s.gpt->num_parameters(),
         " parameters)");
  }
  s.gpt->to(job.device);
  s.n_params = s.gpt->num_parameters();
  distributed::GPTParallelOptions po{.sequence_parallel = s.sp, .ac = flags.common.ac};
  po.float8 = flags.float8 == 1;
  po.float8_all_gather = flags.float8_all_gather == 1;
  s.precompute_float8 = po.float8_all_gather;
  po.cp = {.exchange = distributed::cp::parse_exchange(flags.cp_exchange), .seq = flags.seq};
  po.fsdp.strategy = distributed::parse_strategy(flags.strategy);
  if (d.dp_replicate > 1)
    EMBER_CHECK(flags.strategy == "full" || flags.strategy == "hybrid", "--dp-replicate ", d.dp_replicate,
                " replicates FULL_SHARD units (HSDP); --strategy ", flags.strategy, " does not combine with it");
  if (flags.common.amp != "off") {
    po.fsdp.mp_policy.param_dtype = flags.common.amp == "bf16" ? DType::BFloat16 : DType::Float16;
    po.fsdp.mp_policy.reduce_dtype = DType::Float32;
    po.fsdp.mp_policy.output_dtype = DType::Float32;
  }
  s.fsdp_options = distributed::fsdp_options(d, *s.mesh, po.fsdp);
  optim::GradScalerOptions so;
  so.enabled = flags.common.amp == "fp16";
  // Every rank agrees on a skipped step: tp ranks hold different gradients.
  if (job.world > 1) so.sync_found_inf = distributed::found_inf_allreduce(job.pg);
  s.scaler = std::make_unique<optim::GradScaler>(so);
  int wrapped = 0;
  if (d.pp > 1) {
    po.blocks_per_stage = flags.blocks_per_stage;
    const auto schedule = distributed::pp::make_schedule(flags.pp_schedule, d.pp, flags.pp_virtual, flags.microbatches);
    auto loss = [](const Tensor& logits, const Tensor& y) { return distributed::parallel_cross_entropy(logits, y); };
    optim::GradScaler* scaler = s.scaler.get();
    s.pp =
        distributed::pipeline_gpt(s.gpt, d, s.mesh, schedule, po,
                                  {.loss = loss, .scale_loss = [scaler](const Tensor& l) { return scaler->scale(l); }});
    for (const auto& [stage, rank] : s.pp.layout) LOG0("pipeline ", stage, " on pp rank ", rank);
    s.eval_pipe = std::make_unique<distributed::pp::Pipeline>(
        distributed::pp::forward_schedule(d.pp, flags.pp_virtual, 1), s.pp.stages, s.mesh->group("pp"),
        distributed::pp::PipelineOptions{.loss = loss});
    // Each stage checkpoints its own blocks (every:K counts within a stage,
    // as torchtitan's per-model-part AC does); the log counts all stages.
    Tensor n = Tensor::from_vector({static_cast<double>(s.pp.ac_blocks)}, {1}, DType::Float64).to(job.device);
    s.mesh->group("pp")->allreduce(n, distributed::ReduceOp::Sum)->wait();
    wrapped = static_cast<int>(n.to(kCPU).item());
    s.gpt = nullptr;  // the other ranks' stages go with it
  } else {
    s.par = distributed::parallelize_gpt(s.gpt, d, s.mesh, po);
    wrapped = s.par.ac_blocks;
  }
  if (po.float8) {
    // Counted on the model as converted: under tp the recipe keeps a layer
    // whose features are not multiples of 16 x tp in high precision.
    int converted = 0, experts = 0;
    for (const auto& [fqn, m] : s.model().named_modules()) {
      converted += m->transform_state(nn::kFloat8StateKey) != nullptr;
      if (auto* ex = dynamic_cast<nn::GroupedExperts*>(m)) experts += static_cast<bool>(ex->kernel);
    }
    LOG0("float8: the blocks' linear layers train in float8 (", converted, " layers",
         experts > 0 ? ", " + std::to_string(experts) + " MoE layers' experts on padded groups" : std::string(),
         d.pp > 1 ? " in rank 0's stage" : "", d.tp > 1 ? ", those whose features are multiples of 16 x tp" : "",
         "; e4m3 forward, e5m2 gradients, tensorwise dynamic scales); the LM head does not",
         po.float8_all_gather ? "; FSDP gathers their weights in float8" : "");
  }
  if (flags.common.ac != "none")
    LOG0("activation checkpointing ", nn::ActivationCheckpointing::parse(flags.common.ac).str(), ": ", wrapped, " of ",
         flags.layers, " blocks");

  s.opt = std::make_unique<optim::AdamW>(
      s.model().parameters(),
      optim::AdamWOptions{.lr = flags.common.lr, .beta1 = 0.9, .beta2 = 0.99, .weight_decay = 0.1});
  const int64_t warmup = std::min<int64_t>(100, flags.max_steps / 10 + 1);
  auto warm = std::make_shared<optim::LinearLR>(*s.opt, 0.1, 1.0, warmup);
  auto cosine = std::make_shared<optim::CosineAnnealingLR>(*s.opt, std::max<int64_t>(flags.max_steps - warmup, 1),
                                                           flags.common.lr * 0.1);
  s.sched = std::make_unique<optim::SequentialLR>(
      *s.opt, std::vector<std::shared_ptr<optim::LRScheduler>>{warm, cosine}, std::vector<int64_t>{warmup});
  // A restart by the launcher (--max-restarts) resumes by itself, from the
  // newest checkpoint if there is one yet.
  if (from_disk && (flags.common.resume || examples::restarted()))
    resume(flags, job, s, /*required=*/flags.common.resume);
  return s;
}

// ---- The training step ----

// One optimizer step on the step's micro-batches (`batch(m)`: inputs and
// targets on the host): forwards and backwards through the pipeline or accumulated
// (gradients reduced on the last), the gradients clipped to norm 1, the
// optimizer and the schedule stepped. Returns the mean loss over the
// micro-batches (this rank's; the pipeline's from its last stage) and the
// gradient norm.
// The step's forwards and backwards: through the pipeline, or accumulated
// over the micro-batches (gradients reduced on the last). Returns the sum
// of the micro-batches' losses (this rank's; the pipeline's from its last
// stage, shared over pp).
double forward_backward(Setup& s, const std::function<std::pair<Tensor, Tensor>(int64_t)>& batch,
                        const std::string& amp, Device device) {
  optim::GradScaler& scaler = *s.scaler;
  // The router losses' gradient enters in the backward, scaled as the loss
  // is (per micro-batch, by the loss scale); their statistics are the step's.
  nn::set_moe_aux_grad_scale(s.model(), 1.0 / static_cast<double>(s.micro_steps), scaler.scale_tensor(device));
  nn::reset_moe_stats(s.model());
  ++s.inject.tries;
  double loss_sum = 0;
  if (s.pp.pipe) {
    std::vector<Tensor> xs, ys;
    for (int64_t m = 0; m < s.micro_steps; ++m) {
      auto [x, y] = batch(m);
      xs.push_back(x.to(device)), ys.push_back(y.to(device));
    }
    MemoryKindScope activations(MemoryKind::Activations);
    // --amp without FSDP: autocast around the stages' forwards (their
    // backwards run in the forwards' dtypes); float32 parameters.
    AutocastGuard cast(device.type, amp == "fp16" ? DType::Float16 : DType::BFloat16,
                       amp != "off" && s.pp.fsdp.empty());
    Section timed(s.straggler, "pipeline");  // forwards and backwards interleaved
    for (const Tensor& l : s.pp.pipe->step(xs, ys)) loss_sum += l.item();
    // The last stage's ranks hold the losses; shared over pp for the log.
    Tensor lt = Tensor::from_vector({loss_sum}, {1}, DType::Float64).to(device);
    s.mesh->group("pp")->allreduce(lt, distributed::ReduceOp::Sum)->wait();
    loss_sum = lt.to(kCPU).item();
  }
  for (int64_t m = 0; m < (s.pp.pipe ? 0 : s.micro_steps); ++m) {
    s.par.set_requires_gradient_sync(m == s.micro_steps - 1);
    auto [x, y] = batch(m);
    Tensor loss;
    {
      // What the forward allocates and backward still holds is activations
      // (the micro-batch's copy on the device too).
      MemoryKindScope activations(MemoryKind::Activations);
      Section timed(s.straggler, "forward");
      // Vocab-sharded logits under tensor parallelism: the loss is parallel.
      loss = distributed::parallel_cross_entropy((*s.gpt)(x.to(device)), y.to(device));
    }
    loss_sum += loss.item();
    Section timed(s.straggler, "backward");
    scaler.scale(loss * (1.0 / s.micro_steps)).backward();
  }
  return loss_sum;
}

// The ranks whose `x` is not finite (collective over the world).
std::vector<int> nonfinite_ranks(double x, distributed::ProcessGroup& world) {
  Tensor mine = Tensor::from_vector({x}, {1}, DType::Float64).to(world.device());
  Tensor all = Tensor::empty({world.size()}, {DType::Float64, world.device()});
  world.allgather_into_tensor(all, mine)->wait();
  std::vector<int> out;
  const std::vector<double> v = all.to(kCPU).to_vector();
  for (int r = 0; r < world.size(); ++r)
    if (!std::isfinite(v[static_cast<size_t>(r)])) out.push_back(r);
  return out;
}

// What a step with a non-finite gradient norm found (collective): the
// ranks whose loss was not finite, and with --detect-anomaly each rank's
// first module.
std::string nonfinite_report(Setup& s, double loss_sum) {
  std::string msg = "the gradient norm is not finite";
  const std::vector<int> ranks = nonfinite_ranks(loss_sum, *s.world);
  if (!ranks.empty()) {
    msg += "; the loss is not finite on rank";
    msg += ranks.size() == 1 ? " " : "s ";
    for (size_t i = 0; i < ranks.size(); ++i) msg += (i ? "," : "") + std::to_string(ranks[i]);
  }
  if (s.anomaly)
    for (const distributed::NonFinite& f : distributed::gather_findings(s.anomaly->first(), *s.world))
      msg += "; " + f.describe();
  return msg;
}

// One optimizer step on the step's micro-batches (`batch(m)`: inputs and
// targets on the host): forward_backward, the gradients clipped to norm 1,
// the optimizer and the schedule stepped. A non-finite gradient norm under
// --detect-anomaly or --nan-rerun is reported (rank, module, step); with
// --nan-rerun the step runs again on the same batch, and a second
// non-finite norm stops the job as persistent. Returns the mean loss over
// the micro-batches (this rank's; the pipeline's from its last stage) and
// the gradient norm.
std::pair<double, double> train_step(Setup& s, const std::function<std::pair<Tensor, Tensor>(int64_t)>& batch,
                                     const std::string& amp, Device device) {
  optim::GradScaler& scaler = *s.scaler;
  const int64_t step = s.step + 1;  // as --metrics numbers it
  s.opt->zero_grad();
  s.inject.armed = step == s.inject.step;
  s.inject.tries = 0;
  if (s.anomaly) s.anomaly->begin_step(step);
  if (s.precompute_float8) {
    // Just before the forward, so nothing (a resume, a live recovery's
    // restore) writes the parameters between the scales and their use.
    if (s.par.fsdp) s.par.fsdp->precompute_float8_dynamic_scale_for_fsdp();
    for (const auto& f : s.pp.fsdp) f->precompute_float8_dynamic_scale_for_fsdp();
  }
  double loss_sum = forward_backward(s, batch, amp, device);
  std::optional<Section> optimizer(std::in_place, s.straggler, "optimizer");
  scaler.unscale_(*s.opt);
  auto clip = [&] { return s.pp.pipe ? s.pp.pipe->clip_grad_norm_(1.0) : s.par.clip_grad_norm_(1.0); };
  double grad_norm = clip();
  // The norm is the job's (every rank has the same): every rank decides alike.
  if (!std::isfinite(grad_norm) && (s.anomaly || s.nan_rerun)) {
    const std::string at = "step " + std::to_string(step) + ": ";
    const std::string first = nonfinite_report(s, loss_sum);
    if (!s.nan_rerun) throw Error(at + first + "; stopping (--detect-anomaly)");
    // Megatron's rerun: the same batch, the same state (the optimizer has
    // not stepped); the same non-finite values again are the data's or the
    // model's, none is a fault of the hardware or a race.
    optimizer.reset();
    s.opt->zero_grad();
    if (s.anomaly) s.anomaly->begin_step(step);
    loss_sum = forward_backward(s, batch, amp, device);
    optimizer.emplace(s.straggler, "optimizer");
    grad_norm = clip();
    if (!std::isfinite(grad_norm))
      throw Error(at + nonfinite_report(s, loss_sum) + " (and so on the first try: the step re-run on the same batch " +
                  "reproduced it): " + distributed::kNanPersistent + "; stopping (--nan-rerun)");
    LOG0(at, first, "; gone when the step was re-run on the same batch: ", distributed::kNanTransient,
         "; training goes on with the re-run's gradients");
  }
  s.inject.armed = false;
  distributed::commit_point(s.step);  // live recovery: every rank steps, or none
  scaler.step(*s.opt);
  scaler.update();
  s.sched->step();
  ++s.step;
  return {loss_sum / s.micro_steps, grad_norm};
}

// --cuda-graph 1: train_step's work (forwards and backwards over the
// micro-batches, the loss scaler's unscale, clipping to norm 1, the
// optimizer, the scaler's update) as one function of the micro-batches'
// inputs and targets (the recipe's gpt_step_on_device), which GraphedStep
// runs eagerly for three warm-up steps (FSDP's lazy setup, the optimizer's
// and the scaler's state) and then captures and replays. Nothing in it waits for the GPU: the losses
// add up on the device, the norm stays there (clip_grad_norm_async_), the
// scaler skips an overflowing step there (step_async), the learning rate
// is read there (the schedule writes it between steps).
void make_graphed_step(Setup& s, int device) {
  auto fn = [&s](const std::vector<Tensor>& in) {
    return distributed::gpt_step_on_device(*s.gpt, s.par, *s.opt, *s.scaler, in, 1.0);
  };
  s.graphed = std::make_unique<optim::GraphedStep>(
      fn, optim::GraphedStepOptions{.device = device, .warmup = 3, .optimizers = {s.opt.get()}});
}

// train_step through the graph: the micro-batches' inputs copied into the
// graph's, one replay, then the step's one wait (its loss and norm, for
// the log), the schedule stepped.
std::pair<double, double> graphed_train_step(Setup& s, const std::function<std::pair<Tensor, Tensor>(int64_t)>& batch) {
  std::vector<Tensor> in;
  for (int64_t m = 0; m < s.micro_steps; ++m) {
    auto [x, y] = batch(m);
    in.push_back(x), in.push_back(y);
  }
  distributed::commit_point(s.step);
  const auto start = Clock::now();  // the host's part: the inputs' copies and the launch
  const bool replay = s.graphed->captured();
  const std::vector<Tensor> out = (*s.graphed)(in);
  const double host_s = examples::seconds(start, Clock::now());
  const double loss_sum = out[0].to(kCPU).item(), grad_norm = out[1].to(kCPU).item();
  if (replay) {
    s.graph_times.host_s.push_back(host_s);
    s.graph_times.step_s.push_back(examples::seconds(start, Clock::now()));
  } else if (s.graphed->captured()) {
    s.graph_times.captured_step = s.step + 1;  // as --metrics numbers it
  }
  s.sched->step();
  ++s.step;
  return {loss_sum / s.micro_steps, grad_norm};
}

// ---- The loop: steps, evaluations, checkpoints, a sample at the end ----

int loop(const Flags& flags, const examples::Job& job, Setup& s) {
  const Corpus& corpus = s.corpus;
  const distributed::ParallelDims& d = s.dims;
  const Device device = job.device;
  auto save = [&](int64_t at) {
    distributed::TrainingState st;
    st.step = at;
    const std::string dir = flags.common.checkpoint_dir + "/step_" + std::to_string(at);
    examples::save_step_checkpoint(
        dir, s.model(), *s.opt, *s.sched, st,
        {{"world_size", job.world},
         {"strategy", flags.strategy},
         {"vocab", s.vocab},
         // What `ckpt export-hf` rebuilds config.json from.
         {"model", nlohmann::json::parse(nn::gpt_options_to_json(model_options(flags, s.vocab)))},
         {"tokenizer", s.corpus.tokenizer_path.empty() ? nlohmann::json() : nlohmann::json(s.corpus.tokenizer_path)}},
        *s.scaler, *job.pg, s.mesh->to_string());
    LOG0("saved checkpoint ", dir, " (", job.world, " rank file", job.world == 1 ? "" : "s", ")");
  };
  const examples::Eval eval = examples::make_eval(corpus, flags.seq, d.dp());
  const int64_t tokens_per_step = s.global_batch * flags.seq;
  const examples::RunInfo info{.model = model_options(flags, s.vocab),
                               .dims = d,
                               .sp = s.sp,
                               .amp = flags.common.amp,
                               .strategy = flags.strategy,
                               .fsdp_strategy = distributed::strategy_name(s.fsdp_options.strategy),
                               .ac = flags.common.ac,
                               .pp_schedule = flags.pp_schedule,
                               .cp_exchange = flags.cp_exchange,
                               .pp_virtual = flags.pp_virtual,
                               .micro_batch = s.micro_batch,
                               .micro_steps = s.micro_steps,
                               .global_batch = s.global_batch,
                               .max_steps = flags.max_steps,
                               .n_params = s.n_params,
                               .world = job.world,
                               .gpus_per_host = std::max(1, job.env.local_world_size),
                               .cuda = job.cuda,
                               .checkpoint_dir = flags.common.checkpoint_dir};
  LOG0(examples::describe_run(info, s.corpus, s.par.fsdp.get(), s.pp));

  // The global batch of step `at`: a function of (seed, step) only, never
  // of the mesh, so a run resumes on another mesh and any mesh computes the
  // same steps. Data-parallel rank d's micro-batch m is its slice m*dp+d
  // (Megatron's order): the ranks' m-th micro-batches together are the m-th
  // of one process accumulating the same step, so statistics taken per
  // micro-batch over the data ranks (the MoE load balance's counts) are
  // that process's too.
  auto global_starts = [&](int64_t at) {
    return corpus.train.batch_starts(flags.common.seed, at, s.global_batch, flags.seq);
  };
  auto digest = [&](int64_t at) { return examples::batch_digest(corpus, global_starts(at), flags.seq); };
  examples::MetricsLog metrics(flags.metrics, job.rank == 0, s.step, digest);
  Allocator* alloc = get_allocator(device);
  examples::Progress progress(job.rank == 0);
  const auto t0 = Clock::now();
  double loss_ema = -1;
  const int64_t first = s.step;
  auto report_eval = [&] {
    progress.close_line();
    const double v = examples::evaluate(s.model(), s.eval_pipe.get(), corpus, eval, flags.seq, *job.pg, device, d.dp(),
                                        s.dp_rank, d.tp, d.cp, s.cp_rank);
    LOG0("step ", s.step, ": validation loss ", v, " (unigram ", eval.unigram, ")");
    return v;
  };
  examples::StepProfiler profile(flags.common.profile_dir, flags.max_steps - s.step, job.pg.get());
  s.world = job.pg.get();
  s.nan_rerun = flags.nan_rerun;
  // --inject-nan: rank R's token embeddings NaN while the step is armed
  // (before --detect-anomaly's hooks, so they see the NaN leave wte).
  if (job.rank == flags.inject_nan_rank) {
    nn::Module* wte = nullptr;
    for (auto& [name, m] : s.model().named_modules())
      if (name == "wte" || (name.size() > 4 && name.compare(name.size() - 4, 4, ".wte") == 0)) wte = m;
    EMBER_CHECK(wte != nullptr, "--inject-nan: rank ", job.rank, " holds no token embedding (wte) to poison");
    s.inject.step = flags.inject_nan_step;
    s.inject.once = flags.inject_nan_once;
    wte->register_forward_hook([&s](nn::Module&, const Tensor&, const Tensor& out) {
      if (!s.inject.armed || (s.inject.once && s.inject.tries > 1)) return Tensor();
      return out * std::numeric_limits<double>::quiet_NaN();
    });
  }
  std::optional<distributed::AnomalyDetector> anomaly;
  if (flags.detect_anomaly) {
    anomaly.emplace(s.model(), job.rank);
    s.anomaly = &*anomaly;
  }
  std::optional<distributed::StragglerDetector> straggler;
  if (flags.straggler_every > 0) {
    straggler.emplace(
        job.pg, distributed::StragglerOptions{.every = flags.straggler_every, .threshold = flags.straggler_threshold});
    s.straggler = &*straggler;
  }
  // A save that a live recovery cut short (the fault came during step
  // `first`'s save, and the survivors kept that step's state): made now, or
  // that step's checkpoint would be missing for good. Decided together: the
  // save is collective, and a rank that sees it missing is enough.
  if (flags.save_every > 0 && first > 0 && first % flags.save_every == 0 && first < flags.max_steps) {
    const bool here = std::filesystem::exists(flags.common.checkpoint_dir + "/step_" + std::to_string(first));
    Tensor missing = Tensor::from_vector({here ? 0.0 : 1.0}, {1}, DType::Float64).to(device);
    job.pg->allreduce(missing, distributed::ReduceOp::Max)->wait();
    if (missing.to(kCPU).item() > 0) {
      LOG0("step ", first, "'s checkpoint is missing (its save was cut short); saving it now");
      save(first);
    }
  }
  if (flags.cuda_graph == 1) {
    EMBER_CHECK(job.cuda, "--cuda-graph 1 needs a GPU: ", cuda_unavailable_reason());
    make_graphed_step(s, device.index);
  }
  while (s.step < flags.max_steps) {
    const auto step_start = Clock::now();
    alloc->reset_peak_stats();
    const std::vector<int64_t> all = global_starts(s.step);
    const double lr = s.opt->param_groups()[0].lr();
    auto batch = [&](int64_t m) {
      const int64_t from = (m * d.dp() + s.dp_rank) * s.micro_batch;
      auto [x, y] =
          corpus.train.windows(std::vector<int64_t>(all.begin() + from, all.begin() + from + s.micro_batch), flags.seq);
      // Under context parallelism this rank's chunks of every sequence,
      // inputs and targets alike (the loss is a mean over tokens).
      return std::pair<Tensor, Tensor>{examples::cp_slice(x, d.cp, s.cp_rank),
                                       examples::cp_slice(y.reshape({x.size(0), flags.seq}), d.cp, s.cp_rank)};
    };
    auto [loss, grad_norm] = s.graphed ? graphed_train_step(s, batch) : train_step(s, batch, flags.common.amp, device);
    const double train_s = examples::seconds(step_start, Clock::now());  // this rank's, before the reports' collectives
    profile.step();
    const int64_t step = s.step;
    // Collective on each window's last step: every rank, before the reports.
    const std::optional<distributed::StragglerReport> slow = straggler ? straggler->step_end(step) : std::nullopt;
    if (slow && !slow->stragglers.empty()) {
      progress.close_line();
      LOG0(slow->line());
    }
    // Once, after warm-up steps: the pipeline's bubble beside the simulator's.
    if (s.pp.pipe && step - first == std::min<int64_t>(3, flags.max_steps - first)) {
      const std::string bubble = examples::bubble_line(*s.pp.pipe);  // collective: every rank, not only LOG0's
      LOG0(bubble);
    }
    // The step's memory by part, at the largest peak over the ranks; printed
    // once, after the second step (the first creates the optimizer state).
    const distributed::StepMemory mem =
        distributed::largest_over_ranks(*job.pg, distributed::measured_step_memory(alloc->stats()), device);
    if (step - first == std::min<int64_t>(2, flags.max_steps - first)) {
      LOG0(mem.line("memory peak"));
      LOG0(examples::memory_plan_line(info));
    }
    if (!flags.metrics.empty()) {
      // The mean over the global batch (tp ranks hold the same loss: the
      // world's mean is the data-parallel ranks').
      Tensor lt = Tensor::from_vector({loss}, {1}, DType::Float64).to(device);
      job.pg->allreduce(lt, distributed::ReduceOp::Avg)->wait();
      loss = lt.to(kCPU).item();
      // Every rank's own time in the training step, by global rank (its
      // collectives keep them close: bench/cp_compare.py times each rank's
      // attention kernels to see a context-parallel imbalance).
      const Tensor secs = distributed::functional::all_gather(
          Tensor::from_vector({train_s}, {1}, DType::Float64).to(device), 0, job.pg);
      nlohmann::json moe =
          flags.moe_experts > 0 ? examples::moe_metrics(s.model(), *job.pg, device) : nlohmann::json::object();
      if (slow) {
        moe["straggler_rank"] = slow->slowest;
        moe["straggler_score"] = slow->score;
        moe["straggler_self_score"] = slow->self_score;
      }
      if (metrics.is_open())
        metrics.write(step, loss, lr, grad_norm, tokens_per_step, examples::seconds(step_start, Clock::now()), mem,
                      examples::batch_digest(corpus, all, flags.seq), secs.to(kCPU).to_vector(), moe);
    }
    loss_ema = loss_ema < 0 ? loss : 0.9 * loss_ema + 0.1 * loss;
    const double rate = (step - first) * tokens_per_step / std::max(examples::seconds(t0, Clock::now()), 1e-9);
    progress.update("", step, flags.max_steps, loss_ema, rate, "tok/s",
                    (flags.max_steps - step) * tokens_per_step / rate, step == flags.max_steps);
    if (step % flags.eval_every == 0 && step < flags.max_steps) report_eval();
    if (flags.save_every > 0 && step % flags.save_every == 0 && step < flags.max_steps) save(step);
  }
  progress.close_line();
  if (s.graphed) LOG0(s.graph_times.line());
  const double val = report_eval();
  save(s.step);
  if (flags.sample_len > 0 && job.rank == 0)  // from the checkpoint just written, whatever mesh wrote it
    LOG0("sample (temperature ", flags.temperature, ", top-k ", flags.top_k, "):\n",
         examples::sample_from_checkpoint(flags.common.checkpoint_dir + "/step_" + std::to_string(s.step),
                                          model_options(flags, s.vocab), corpus, flags.common.seed, flags.sample_len,
                                          flags.temperature, flags.top_k));
  LOG0("validation loss ", val, " = ", val / eval.unigram, " x the unigram baseline");
  return examples::finish_job(job);
}

int train(const Flags& flags, const examples::FlagTable& table) {
  return examples::train_recovering<Setup>(
      flags.common.timeout_sec,
      [&](const examples::Job& job, bool from_disk) {
        auto config = table.agreed_values();
        // Paths may differ by host, but whether there is one may not: the
        // metrics' loss is averaged over every rank.
        config.emplace_back("--metrics given", flags.metrics.empty() ? "no" : "yes");
        distributed::check_same_config(*job.pg, config);
        return setup(flags, job, from_disk);
      },
      [](const examples::Job& job, Setup& s, const distributed::LiveState* kept) { recover(job, s, kept); },
      [&](const examples::Job& job, Setup& s) { return loop(flags, job, s); },
      [](Setup& s) {
        return distributed::capture_live_state(s.model(), *s.opt, s.sched.get(), s.scaler.get(), s.step);
      });
}

}  // namespace
}  // namespace ember

int main(int argc, char** argv) {
  using namespace ember;
  return examples::flags_main<Flags>("gpt", "usage: gpt [flags]   (also gpt_fsdp)", argc, argv, train);
}
