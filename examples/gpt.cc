// The language-model example every parallelism extends: a character-level
// GPT on the quotes of Debian's `fortunes` package, trained on a
// ParallelDims mesh of (pp, dp_replicate, dp_shard, tp) ranks by the
// library's recipes (distributed/parallel/recipes/gpt.h): pipeline stages
// over pp (any schedule), tensor and sequence parallelism inside each tp
// group, FSDP over dp_shard (every transformer block a unit), replicas over
// dp_replicate. It launches its own workers (one per GPU, else 2 on the
// CPU), evaluates on held-out quotes against a unigram baseline, writes
// sharded checkpoints (any other mesh loads them) and ends with a sample.
// The data of step k depends on (seed, k) only: every mesh with the same
// --global-batch trains on the same sequences. Reporting lives in
// examples/gpt_report.h; the step itself is train_step below.
//
//   bazel run -c opt //examples:gpt                                      # 2 CPU workers, FSDP FULL_SHARD
//   bazel run -c opt //examples:gpt -- --nproc 4 --dp-shard 2 --tp 2     # FSDP x TP (+SP) on a 2x2 mesh
//   bazel run -c opt //examples:gpt -- --tp 2 --sp off --metrics /tmp/m.jsonl
//   bazel run -c opt //examples:gpt -- --pp 2 --pp-schedule zb-h1 --microbatches 8 --layers 4
//   bazel run -c opt //examples:gpt -- --nproc 4 --pp 2 --tp 2 --pp-schedule interleaved --pp-virtual 2
//   bazel run -c opt //examples:gpt -- --nproc 8 --pp 2 --dp-shard 2 --tp 2    # FSDP x TP inside the stages
//   bazel run -c opt //examples:gpt -- --strategy grad_op --amp bf16
//   bazel run -c opt //examples:gpt -- --nproc 4 --strategy hybrid --shard-size 2
//   bazel run -c opt //examples:gpt -- --max-steps 900 --resume --nproc 3   # resharded onto 3 ranks
// Under `//tools:launch --live-recovery` a worker lost on a mesh with
// replicas is replaced in place and takes its state from its replica
// (docs/elastic.md). //examples:gpt_fsdp is the same program.
//
// The default run (2 layers, dim 128, seq 64, batch 16 per rank, 1000 steps)
// took 102 s on the 2-core CI machine (-c opt, 2026-11-24) and reached a
// validation loss of 1.954 nats per character against the unigram model's
// 3.379 (0.58x); docs/fsdp.md ("Sharded training") shows its output.
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/autocast.h"
#include "distributed/checkpoint/checkpoint.h"
#include "distributed/checkpoint/live_recovery.h"
#include "distributed/checkpoint/sharded.h"
#include "distributed/config_check.h"
#include "distributed/init.h"
#include "distributed/parallel/rank_agreement.h"
#include "distributed/parallel/recipes/gpt.h"
#include "examples/flags.h"
#include "examples/gpt_report.h"
#include "examples/profiling.h"
#include "examples/training.h"
#include "optim/grad_scaler.h"
#include "optim/lr_scheduler.h"
#include "optim/optimizer.h"

namespace ember {
namespace {

namespace fs = std::filesystem;
using examples::Clock;
using examples::Corpus;

struct Flags {
  examples::CommonFlags common{.batch_size = 16, .lr = 3e-3, .checkpoint_dir = "/tmp/ember_gpt_fsdp",
                               .data = "/usr/share/games/fortunes"};
  std::string strategy = "full";
  int shard_size = 0;                // hybrid: ranks per shard group (0: ranks per node)
  int dp_replicate = 1, dp_shard = -1, tp = 1, pp = 1;  // ParallelDims' degrees; -1: the rest
  std::string pp_schedule = "1f1b";
  int pp_virtual = 1;
  std::string pp_split;
  std::vector<int> blocks_per_stage;  // --pp-split parsed
  int64_t microbatches = 0;  // 0: --accum-steps (pp 1) or the pp size
  std::string sp = "auto";
  int64_t global_batch = 0;  // 0: batch size x dp x accum
  std::string metrics;
  int64_t layers = 2, dim = 128, heads = 4, seq = 64;
  int64_t max_steps = 1000, save_every = 0, eval_every = 250;
  int64_t sample_len = 240, top_k = 20;
  double temperature = 0.8;
};

// Every flag once: name, value, help, validation (examples/flags.h).
void declare(examples::FlagTable& t, Flags& f) {
  examples::add_common_flags(t, f.common, "sequences", "peak AdamW learning rate (warmup, then cosine to a tenth)");
  t.choice("--strategy", &f.strategy, {"full", "grad_op", "no_shard", "hybrid"}, "FSDP sharding strategy");
  t.integer("--shard-size", &f.shard_size, 1, "N",
            "hybrid: shard within groups of N ranks, replicate across them (0: ranks per node)");
  t.integer("--dp-replicate", &f.dp_replicate, -1, "R", "replicas (HSDP) over dp_replicate; -1: the rest");
  t.integer("--dp-shard", &f.dp_shard, -1, "S", "FSDP over dp_shard; -1: the rest");
  t.integer("--tp", &f.tp, -1, "T", "tensor parallelism over tp; -1: the rest");
  t.choice("--sp", &f.sp, {"on", "off", "auto"}, "sequence parallelism inside tp (auto: on when --tp > 1)");
  t.integer("--pp", &f.pp, 1, "P", "pipeline parallelism over P ranks (the mesh's outermost dimension)");
  t.choice("--pp-schedule", &f.pp_schedule, distributed::pp::schedule_names(), "pipeline schedule");
  t.integer("--pp-virtual", &f.pp_virtual, 1, "V", "stages per pp rank (interleaved)");
  t.text("--pp-split", &f.pp_split, "A,B,...", "transformer blocks per stage (empty: balanced by parameter count)");
  t.integer("--microbatches", &f.microbatches, 1, "M",
            "micro-batches per optimizer step: through the pipeline with --pp, else accumulated\n"
            "(0: --accum-steps, or P with --pp)");
  t.integer("--global-batch", &f.global_batch, 1, "N",
            "sequences per optimizer step over the job (0: --batch-size x data-parallel ranks x\n"
            "--accum-steps); the per-rank micro-batch is N / (data-parallel ranks x accum)");
  t.text("--metrics", &f.metrics, "PATH",
         "one JSON line per optimizer step (rank 0): step, loss, lr, grad_norm, tokens_per_s,\n"
         "step_s, mem_peak_mib and its parts mem_{params,grads,optimizer,gathered,activations,\n"
         "other}_mib (the rank with the largest peak), batch_digest (a hash of the global batch)",
         false);
  t.integer("--layers", &f.layers, 1, "N", "transformer blocks");
  t.integer("--dim", &f.dim, 1, "N", "model width");
  t.integer("--heads", &f.heads, 1, "N", "attention heads");
  t.integer("--seq", &f.seq, 2, "N", "context length");
  t.integer("--max-steps", &f.max_steps, 1, "N", "optimizer steps in total, counting those before a resume");
  t.integer("--eval-every", &f.eval_every, 1, "N", "validation every N steps and at the end");
  t.integer("--save-every", &f.save_every, 1, "N", "checkpoint every N steps (0: only at the end)");
  t.integer("--sample-len", &f.sample_len, 0, "N", "characters sampled at the end");
  t.positive("--temperature", &f.temperature, "X", "the sample's temperature");
  t.integer("--top-k", &f.top_k, 1, "N", "the sample's top-k");
}

// Parses and checks the flags together (what one flag's row cannot see).
void parse_flags(examples::FlagTable& t, Flags& f, int argc, char** argv) {
  t.parse(argc, argv);
  auto error = [&t](const std::string& msg) { t.error(msg); };
  const auto& c = f.common;
  if (f.shard_size > 0 && f.strategy != "hybrid") error("--shard-size goes with --strategy hybrid");
  if (f.microbatches > 0 && c.accum_steps > 1 && f.microbatches != c.accum_steps)
    error("--microbatches " + std::to_string(f.microbatches) + " and --accum-steps " + std::to_string(c.accum_steps) +
          " disagree (one is enough)");
  if (f.pp > 1 && c.accum_steps > 1)
    error("--pp " + std::to_string(f.pp) + ": the pipeline accumulates its micro-batches; give --microbatches " +
          std::to_string(c.accum_steps) + " instead of --accum-steps");
  // One process with --microbatches M is the reference for any pipeline
  // run: the same micro-batches, accumulated.
  if (f.pp == 1 && f.microbatches > 0) f.common.accum_steps = f.microbatches;
  if (f.pp > 1 && f.microbatches == 0) f.microbatches = f.pp;
  for (std::stringstream in(f.pp_split); in.good();) {
    std::string item;
    std::getline(in, item, ',');
    if (!item.empty()) f.blocks_per_stage.push_back(static_cast<int>(t.parse_int("--pp-split", item, 1)));
  }
  if (f.pp_virtual > 1 && f.pp == 1) error("--pp-virtual " + std::to_string(f.pp_virtual) + " needs --pp > 1");
  for (int v : {f.dp_replicate, f.dp_shard, f.tp})
    if (v == 0) error("--dp-replicate, --dp-shard and --tp take a positive size or -1 (the rest)");
  if ((f.dp_replicate == -1) + (f.dp_shard == -1) + (f.tp == -1) > 1)
    error("only one of --dp-replicate, --dp-shard and --tp may be -1 (the rest)");
  if (f.strategy == "hybrid" && f.dp_replicate != 1)
    error("--strategy hybrid makes the replicas itself (--shard-size); leave --dp-replicate out");
  if (f.dim % f.heads != 0)
    error("--dim " + std::to_string(f.dim) + " must be a multiple of --heads " + std::to_string(f.heads));
  if (c.checkpoint_dir.empty()) error("--checkpoint-dir must not be empty");
  examples::refuse_overwrite(c.checkpoint_dir, "step_",
                             c.resume || c.overwrite || c.checkpoint_dir == Flags{}.common.checkpoint_dir);
  if (c.resume) {
    auto latest = distributed::latest_checkpoint(c.checkpoint_dir, "step_");
    if (!latest.ok()) error("--resume: " + std::string(latest.status().message()));
    if (!latest->has_value()) error("--resume: no checkpoint (step_<N>/) in --checkpoint-dir " + c.checkpoint_dir);
  }
  if (c.data != "synthetic" && t.given("--data") && !fs::exists(c.data))
    error("--data " + c.data + ": no such file or directory (give a fortunes directory, a text file or 'synthetic')");
}

nn::GPTOptions model_options(const Flags& f, int64_t vocab) {
  return {.vocab_size = vocab, .block_size = f.seq, .n_layer = f.layers, .n_head = f.heads, .n_embd = f.dim};
}

// The flags' mesh as ParallelDims: --strategy hybrid makes shard groups of
// --shard-size ranks (default: a node's over tp) and replicas of the rest.
distributed::ParallelDims parallel_dims(const Flags& f, int world, int local_world) {
  distributed::ParallelDims d{.pp = f.pp, .dp_replicate = f.dp_replicate, .dp_shard = f.dp_shard, .tp = f.tp};
  if (f.strategy == "hybrid") {
    d.dp_shard = f.shard_size > 0 ? f.shard_size : std::max(1, local_world / (f.tp > 0 ? f.tp : 1));
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
  s.corpus = examples::load_corpus(flags.common.data);
  s.vocab = static_cast<int64_t>(s.corpus.chars.size());
  EMBER_CHECK(static_cast<int64_t>(s.corpus.train.size()) > flags.seq + 1, "the training text is shorter than --seq");
  const distributed::ParallelDims& d = s.dims = parallel_dims(flags, job.world, job.env.local_world_size);
  s.sp = flags.sp == "on" || (flags.sp == "auto" && d.tp > 1);
  EMBER_CHECK(flags.heads % d.tp == 0, "--heads ", flags.heads, " do not split over --tp ", d.tp,
              " (attention is split by heads)");
  EMBER_CHECK(!s.sp || flags.seq % d.tp == 0, "--seq ", flags.seq, " must be a multiple of --tp ", d.tp,
              " with sequence parallelism (or --sp off)");
  s.micro_steps = d.pp > 1 ? flags.microbatches : flags.common.accum_steps;
  s.global_batch = flags.global_batch > 0 ? flags.global_batch : flags.common.batch_size * d.dp() * s.micro_steps;
  EMBER_CHECK(s.global_batch % (d.dp() * s.micro_steps) == 0, "--global-batch ", s.global_batch,
              " does not split over ", d.dp(), " data-parallel rank(s) x ", s.micro_steps, " micro-batch(es)");
  s.micro_batch = s.global_batch / (d.dp() * s.micro_steps);
  s.mesh = d.build_mesh();
  s.dp_rank = d.dp_rank(*s.mesh);
  LOG0(d.line());

  manual_seed(flags.common.seed);
  s.gpt = std::make_shared<nn::GPT>(model_options(flags, s.vocab));
  s.gpt->to(job.device);
  s.n_params = s.gpt->num_parameters();
  distributed::GPTParallelOptions po{.sequence_parallel = s.sp, .ac = flags.common.ac};
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
    s.pp = distributed::pipeline_gpt(s.gpt, d, s.mesh, schedule, po,
                                     {.loss = loss, .scale_loss = [scaler](const Tensor& l) { return scaler->scale(l); }});
    for (const auto& [stage, rank] : s.pp.layout) LOG0("pipeline ", stage, " on pp rank ", rank);
    s.eval_pipe = std::make_unique<distributed::pp::Pipeline>(distributed::pp::forward_schedule(d.pp, flags.pp_virtual, 1),
                                                              s.pp.stages, s.mesh->group("pp"),
                                                              distributed::pp::PipelineOptions{.loss = loss});
    wrapped = s.pp.ac_blocks;
    s.gpt = nullptr;  // the other ranks' stages go with it
  } else {
    s.par = distributed::parallelize_gpt(s.gpt, d, s.mesh, po);
    wrapped = s.par.ac_blocks;
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
// targets): forwards and backwards through the pipeline or accumulated
// (gradients reduced on the last), the gradients clipped to norm 1, the
// optimizer and the schedule stepped. Returns the mean loss over the
// micro-batches (this rank's; the pipeline's from its last stage) and the
// gradient norm.
std::pair<double, double> train_step(Setup& s, const std::function<std::pair<Tensor, Tensor>(int64_t)>& batch,
                                     const std::string& amp) {
  optim::GradScaler& scaler = *s.scaler;
  s.opt->zero_grad();
  double loss_sum = 0;
  if (s.pp.pipe) {
    std::vector<Tensor> xs, ys;
    for (int64_t m = 0; m < s.micro_steps; ++m) {
      auto [x, y] = batch(m);
      xs.push_back(x), ys.push_back(y);
    }
    MemoryKindScope activations(MemoryKind::Activations);
    // --amp without FSDP: autocast around the stages' forwards (their
    // backwards run in the forwards' dtypes); float32 parameters.
    AutocastGuard cast(xs[0].device().type, amp == "fp16" ? DType::Float16 : DType::BFloat16,
                       amp != "off" && s.pp.fsdp.empty());
    for (const Tensor& l : s.pp.pipe->step(xs, ys)) loss_sum += l.item();
    // The last stage's ranks hold the losses; shared over pp for the log.
    Tensor lt = Tensor::from_vector({loss_sum}, {1}, DType::Float64).to(xs[0].device());
    s.mesh->group("pp")->allreduce(lt, distributed::ReduceOp::Sum)->wait();
    loss_sum = lt.to(kCPU).item();
  }
  for (int64_t m = 0; m < (s.pp.pipe ? 0 : s.micro_steps); ++m) {
    s.par.set_requires_gradient_sync(m == s.micro_steps - 1);
    auto [x, y] = batch(m);
    Tensor loss;
    {
      // What the forward allocates and backward still holds is activations.
      MemoryKindScope activations(MemoryKind::Activations);
      // Vocab-sharded logits under tensor parallelism: the loss is parallel.
      loss = distributed::parallel_cross_entropy((*s.gpt)(x), y);
    }
    loss_sum += loss.item();
    scaler.scale(loss * (1.0 / s.micro_steps)).backward();
  }
  scaler.unscale_(*s.opt);
  const double grad_norm = s.pp.pipe ? s.pp.pipe->clip_grad_norm_(1.0) : s.par.clip_grad_norm_(1.0);
  distributed::commit_point(s.step);  // live recovery: every rank steps, or none
  scaler.step(*s.opt);
  scaler.update();
  s.sched->step();
  ++s.step;
  return {loss_sum / s.micro_steps, grad_norm};
}

// ---- The loop: steps, evaluations, checkpoints, a sample at the end ----

// "GPT 2 layers x 128 dims, ...": the run described, once.
void describe(const Flags& flags, const examples::Job& job, Setup& s) {
  const distributed::ParallelDims& d = s.dims;
  const std::string amp = flags.common.amp;
  const std::string precision = amp == "off" ? "float32" : amp + " compute (float32 shards and reduction)";
  const std::string strategy = distributed::strategy_name(s.fsdp_options.strategy);
  std::string sharding;
  if (s.par.fsdp) {
    const auto mem = s.par.fsdp->memory();
    sharding = ", FSDP " + strategy + ", " + std::to_string(s.par.fsdp->units().size()) + " units, " + precision +
               "; rank 0 holds " + std::to_string(mem.sharded_params) + " bytes of parameters (" +
               std::to_string(s.n_params * 4) + " unsharded), largest unit " + std::to_string(mem.largest_unit) +
               " bytes gathered";
  } else {
    sharding = ", pipeline " + s.pp.pipe->schedule().name + " over " + std::to_string(d.pp) + " ranks x " +
               std::to_string(s.pp.pipe->schedule().virtual_stages) + " stage(s), " + std::to_string(s.micro_steps) +
               " micro-batches, ";
    if (s.pp.fsdp.empty()) {
      sharding += amp == "off" ? "float32" : amp + " autocast (float32 parameters)";
    } else {
      int64_t units = 0, held = 0;
      for (auto& f : s.pp.fsdp) units += static_cast<int64_t>(f->units().size()), held += f->memory().sharded_params;
      sharding += "FSDP " + strategy + " inside the stages (" + std::to_string(units) + " units on this rank), " +
                  precision + "; rank 0 holds " + std::to_string(held) + " bytes of parameters";
    }
  }
  const Corpus& c = s.corpus;
  LOG0("GPT ", flags.layers, " layers x ", flags.dim, " dims, ", flags.heads, " heads, context ", flags.seq, ": ",
       s.n_params, " parameters, vocabulary ", s.vocab, "; ", c.description, " (", c.train.size(), " train / ",
       c.val.size(), " validation characters)\n", job.world, " rank(s) on ",
       job.cuda ? "GPUs (NCCL)" : "the CPU (Gloo)",
       d.tp > 1 ? ", tensor parallel over " + std::to_string(d.tp) + (s.sp ? " with sequence parallelism" : "")
                : std::string(),
       sharding, "\n", "batch ", s.micro_batch, " x ", flags.seq, " characters per rank x ", d.dp(),
       " data-parallel rank(s) x ", s.micro_steps, " micro-batch(es) = ", s.global_batch * flags.seq,
       " tokens per step; ", flags.max_steps, " steps; checkpoints in ", flags.common.checkpoint_dir);
}

int loop(const Flags& flags, const examples::Job& job, Setup& s) {
  const Corpus& corpus = s.corpus;
  const distributed::ParallelDims& d = s.dims;
  const Device device = job.device;
  auto save = [&](int64_t at) {
    distributed::TrainingState st;
    st.step = at;
    const std::string dir = flags.common.checkpoint_dir + "/step_" + std::to_string(at);
    examples::save_step_checkpoint(dir, s.model(), *s.opt, *s.sched, st,
                                   {{"world_size", job.world}, {"strategy", flags.strategy}, {"vocab", s.vocab}},
                                   *s.scaler, *job.pg, s.mesh->to_string());
    LOG0("saved checkpoint ", dir, " (", job.world, " rank file", job.world == 1 ? "" : "s", ")");
  };
  const examples::Eval eval = examples::make_eval(corpus, flags.seq, d.dp());
  const int64_t tokens_per_step = s.global_batch * flags.seq;
  describe(flags, job, s);

  // The global batch of step `at`: a function of (seed, step) only, never
  // of the mesh, so a run resumes on another mesh and any mesh computes the
  // same steps. Data-parallel rank d's micro-batch m is its slice d*accum+m.
  auto global_starts = [&](int64_t at) {
    std::mt19937_64 g(flags.common.seed * 1000003ULL + static_cast<uint64_t>(at) * 7919ULL);
    std::uniform_int_distribution<int64_t> pick(0, static_cast<int64_t>(corpus.train.size()) - flags.seq - 2);
    std::vector<int64_t> starts;
    for (int64_t i = 0; i < s.global_batch; ++i) starts.push_back(pick(g));
    return starts;
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
                                        s.dp_rank, d.tp);
    LOG0("step ", s.step, ": validation loss ", v, " (unigram ", eval.unigram, ")");
    return v;
  };
  examples::StepProfiler profile(flags.common.profile_dir, flags.max_steps - s.step, job.pg.get());
  while (s.step < flags.max_steps) {
    const auto step_start = Clock::now();
    alloc->reset_peak_stats();
    const std::vector<int64_t> all = global_starts(s.step);
    const double lr = s.opt->param_groups()[0].lr();
    auto batch = [&](int64_t m) {
      const int64_t from = (s.dp_rank * s.micro_steps + m) * s.micro_batch;
      auto [x, y] = examples::windows(corpus, corpus.train,
                                      std::vector<int64_t>(all.begin() + from, all.begin() + from + s.micro_batch),
                                      flags.seq);
      return std::pair<Tensor, Tensor>{x.to(device), y.to(device).reshape({x.size(0), flags.seq})};
    };
    auto [loss, grad_norm] = train_step(s, batch, flags.common.amp);
    profile.step();
    const int64_t step = s.step;
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
      LOG0(examples::memory_plan_line({.model = model_options(flags, s.vocab),
                                       .dims = d,
                                       .strategy = flags.strategy,
                                       .ac = flags.common.ac,
                                       .amp = flags.common.amp,
                                       .pp_schedule = flags.pp_schedule,
                                       .pp_virtual = flags.pp_virtual,
                                       .micro_batch = s.micro_batch,
                                       .micro_steps = s.micro_steps,
                                       .global_batch = s.global_batch,
                                       .seq = flags.seq,
                                       .world = job.world,
                                       .gpus_per_host = std::max(1, job.env.local_world_size)}));
    }
    if (!flags.metrics.empty()) {
      // The mean over the global batch (tp ranks hold the same loss: the
      // world's mean is the data-parallel ranks').
      Tensor lt = Tensor::from_vector({loss}, {1}, DType::Float64).to(device);
      job.pg->allreduce(lt, distributed::ReduceOp::Avg)->wait();
      loss = lt.to(kCPU).item();
      if (metrics.is_open())
        metrics.write(step, loss, lr, grad_norm, tokens_per_step, examples::seconds(step_start, Clock::now()), mem,
                      examples::batch_digest(corpus, all, flags.seq));
    }
    loss_ema = loss_ema < 0 ? loss : 0.9 * loss_ema + 0.1 * loss;
    const double rate = (step - first) * tokens_per_step / std::max(examples::seconds(t0, Clock::now()), 1e-9);
    progress.update("", step, flags.max_steps, loss_ema, rate, "tok/s",
                    (flags.max_steps - step) * tokens_per_step / rate, step == flags.max_steps);
    if (step % flags.eval_every == 0 && step < flags.max_steps) report_eval();
    if (flags.save_every > 0 && step % flags.save_every == 0 && step < flags.max_steps) save(step);
  }
  progress.close_line();
  const double val = report_eval();
  save(s.step);
  if (flags.sample_len > 0 && job.rank == 0) {
    // One process's copy to sample from, read whole from the checkpoint
    // just written (whatever mesh wrote it).
    const std::string dir = flags.common.checkpoint_dir + "/step_" + std::to_string(s.step);
    auto index = distributed::read_checkpoint_index(dir);
    EMBER_CHECK(index.ok(), index.status().message());
    auto m = std::make_shared<nn::GPT>(model_options(flags, s.vocab));
    nn::StateDict sd;
    for (const auto& [name, t] : m->state_dict()) {
      auto whole = distributed::read_checkpoint_tensor(dir, *index->find(name));
      EMBER_CHECK(whole.ok(), whole.status().message());
      sd.insert(name, *whole);
    }
    m->load_state_dict(sd);
    LOG0("sample (temperature ", flags.temperature, ", top-k ", flags.top_k, "):\n",
         examples::generate(*m, corpus, flags.common.seed, flags.sample_len, flags.seq, flags.temperature,
                            flags.top_k));
  }
  LOG0("validation loss ", val, " = ", val / eval.unigram, " x the unigram baseline");
  return examples::finish_job(job);
}

int train(const Flags& flags, const examples::FlagTable& table) {
  return examples::train_recovering<Setup>(
      flags.common.timeout_sec,
      [&](const examples::Job& job, bool from_disk) {
        distributed::check_same_config(*job.pg, table.agreed_values());
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
  Flags flags;
  examples::FlagTable table("gpt", "usage: gpt [flags]   (also gpt_fsdp)");
  declare(table, flags);
  parse_flags(table, flags, argc, argv);
  return examples::launch_and_train(table.cli(), flags.common.nproc, argc, argv, [&] { return train(flags, table); });
}
