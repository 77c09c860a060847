// The language-model example every parallelism extends: a character-level
// GPT on the quotes of Debian's `fortunes` package, trained on a mesh of
// (pp, dp_replicate, dp_shard, tp) ranks: pipeline stages over pp (any
// schedule), tensor parallelism (and sequence parallelism) inside each tp
// group, FSDP over dp_shard (every transformer block a unit), replicas over
// dp_replicate. It launches its own workers
// (one per GPU, else 2 on the CPU), evaluates on held-out quotes against a
// unigram baseline, writes sharded checkpoints (each rank its shards; any
// other mesh loads them) and ends with a sample from the trained weights.
// The data of step k depends on (seed, k) only: every mesh with the same
// --global-batch trains on the same sequences.
//
//   bazel run -c opt //examples:gpt                                      # 2 CPU workers, FSDP FULL_SHARD
//   bazel run -c opt //examples:gpt -- --nproc 4 --dp-shard 2 --tp 2     # FSDP x TP (+SP) on a 2x2 mesh
//   bazel run -c opt //examples:gpt -- --tp 2 --sp off --metrics /tmp/m.jsonl
//   bazel run -c opt //examples:gpt -- --pp 2 --pp-schedule zb-h1 --microbatches 8 --layers 4
//   bazel run -c opt //examples:gpt -- --nproc 4 --pp 2 --tp 2 --pp-schedule interleaved --pp-virtual 2
//   bazel run -c opt //examples:gpt -- --nproc 8 --pp 2 --dp-shard 2 --tp 2    # FSDP x TP inside the stages
//   bazel run -c opt //examples:gpt -- --strategy grad_op --amp bf16
//   bazel run -c opt //examples:gpt -- --nproc 4 --strategy hybrid --shard-size 2
//   bazel run -c opt //examples:gpt -- --max-steps 600 --resume          # 300 more steps
//   bazel run -c opt //examples:gpt -- --max-steps 900 --resume --nproc 3   # resharded onto 3 ranks
// Under `//tools:launch --live-recovery` a worker lost on a mesh with
// replicas is replaced in place and takes its state from its replica
// (train(); docs/elastic.md).
// //examples:gpt_fsdp is the same program under its first name.
//
// The default run (2 layers, dim 128, seq 64, batch 16 per rank, 1000 steps)
// took 102 s on the 2-core CI machine (-c opt, 2026-11-24) and reached a
// validation loss of 1.954 nats per character against the unigram model's
// 3.379 (0.58x); docs/fsdp.md ("Sharded training") shows its output.
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/allocator.h"
#include "core/autocast.h"
#include "core/ops.h"
#include "distributed/checkpoint/checkpoint.h"
#include "distributed/checkpoint/live_recovery.h"
#include "distributed/checkpoint/sharded.h"
#include "distributed/config_check.h"
#include "distributed/init.h"
#include "distributed/launch/launch.h"
#include "distributed/logging/logging.h"
#include "distributed/parallel/fsdp/fsdp.h"
#include "distributed/parallel/fsdp/fsdp_state_dict.h"
#include "distributed/parallel/mesh_plan.h"
#include "distributed/parallel/pp/pipeline.h"
#include "distributed/parallel/pp/schedule.h"
#include "distributed/parallel/pp/stage.h"
#include "distributed/parallel/rank_agreement.h"
#include "distributed/parallel/step_memory.h"
#include "distributed/parallel/tp/gpt_plan.h"
#include "distributed/parallel/tp/loss_parallel.h"
#include "distributed/parallel/tp/tensor_parallel.h"
#include "examples/cli.h"
#include "examples/gpt_corpus.h"
#include "examples/profiling.h"
#include "examples/training.h"
#include "nn/checkpoint.h"
#include "nn/functional.h"
#include "nn/transformer.h"
#include "optim/grad_scaler.h"
#include "optim/lr_scheduler.h"
#include "optim/optimizer.h"

namespace ember {
namespace {

namespace fs = std::filesystem;
using examples::Clock;
using examples::Corpus;
using examples::load_corpus;
using examples::windows;
constexpr char kFortunes[] = "/usr/share/games/fortunes";

struct Flags {
  int nproc = 0;  // 0: one per GPU, else 2
  std::string strategy = "full";
  int shard_size = 0;  // hybrid: ranks per shard group (0: ranks per node)
  // The mesh: products equal to the world size, -1 for "the rest" (one of them).
  int dp_replicate = 1, dp_shard = -1, tp = 1;
  int pp = 1;                        // pipeline stages' ranks (never "the rest")
  std::string pp_schedule = "1f1b";  // gpipe | 1f1b | interleaved | zb-h1
  int pp_virtual = 1;                // stages per pp rank
  std::string pp_split;              // blocks per stage, "2,3,3"; empty: balanced
  int64_t microbatches = 0;          // per optimizer step; 0: --accum-steps (pp 1) or the pp size
  std::string sp = "auto";           // on | off | auto (on when tp > 1)
  std::string ac = "none";           // activation checkpointing: none | full | selective | every:K
  int64_t global_batch = 0;          // sequences per optimizer step over the job (0: batch size x dp x accum)
  std::string metrics;               // one JSON line per step, by rank 0
  std::string amp = "off";
  int64_t layers = 2, dim = 128, heads = 4, seq = 64;
  int64_t batch_size = 16;  // sequences per rank per micro-batch
  int64_t accum_steps = 1;
  int64_t max_steps = 1000;  // optimizer steps in total, counting those before a resume
  int64_t save_every = 0;    // 0: only at the end
  int64_t eval_every = 250;
  double lr = 3e-3;
  std::string checkpoint_dir = "/tmp/ember_gpt_fsdp";
  bool resume = false, overwrite = false;
  uint64_t seed = 0;
  std::string data = kFortunes;
  bool data_given = false;
  int64_t sample_len = 240;
  double temperature = 0.8;
  int64_t top_k = 20;
  double timeout_sec = 0;
  std::string profile_dir;  // --profile: a few steps after warm-up, Chrome traces there
};

constexpr char kUsage[] =
    "usage: gpt [flags]   (also gpt_fsdp)\n"
    "  --nproc N              local worker processes (default: one per GPU, else 2; ignored under a launcher)\n"
    "  --strategy S           full | grad_op | no_shard | hybrid (FSDP sharding strategy; default full)\n"
    "  --shard-size N         hybrid: shard within groups of N ranks, replicate across them (default: ranks per node)\n"
    "  --dp-replicate R --dp-shard S --tp T\n"
    "                         the mesh (R x S x T = the world size; -1 for one of them: the rest; default 1, -1, 1):\n"
    "                         tensor parallelism over tp, FSDP over dp_shard, replicas (HSDP) over dp_replicate\n"
    "  --sp on|off            sequence parallelism inside tp (default on when --tp > 1)\n"
    "  --pp P                 pipeline parallelism over P ranks (the mesh's outermost dimension; default 1)\n"
    "  --pp-schedule S        gpipe | 1f1b | interleaved | zb-h1 (default 1f1b)\n"
    "  --pp-virtual V         stages per pp rank (interleaved; default 1)\n"
    "  --pp-split A,B,...     transformer blocks per stage (default: balanced by parameter count)\n"
    "  --microbatches M       micro-batches per optimizer step: through the pipeline with --pp, else accumulated\n"
    "                         (--accum-steps M); default: --accum-steps, or P with --pp\n"
    "  --ac none|full|selective|every:K\n"
    "                         activation checkpointing of the transformer blocks: all, all keeping the matmuls'\n"
    "                         and collectives' outputs (selective), or every K-th block (default none)\n"
    "  --global-batch N       sequences per optimizer step over the whole job (default: --batch-size x data-parallel\n"
    "                         ranks x --accum-steps); the per-rank micro-batch is N / (data-parallel ranks x accum)\n"
    "  --metrics PATH         one JSON line per optimizer step (rank 0): step, loss, lr, grad_norm, tokens_per_s, "
    "step_s,\n"
    "                         mem_peak_mib (tensor bytes at the step's peak, the largest over ranks) and its parts\n"
    "                         mem_params_mib, mem_grads_mib, mem_optimizer_mib, mem_gathered_mib,\n"
    "                         mem_activations_mib, mem_other_mib (those of the rank with the largest peak),\n"
    "                         batch_digest (a hash of the global batch)\n"
    "  --amp off|bf16|fp16    FSDP mixed precision: gather and compute in bf16/fp16, reduce in float32, float32\n"
    "                         master shards; fp16 with a loss scaler agreed across ranks (default off)\n"
    "  --layers N --dim N --heads N --seq N\n"
    "                         transformer depth, width, attention heads, context length (default 2, 128, 4, 64)\n"
    "  --batch-size N         sequences per rank per micro-batch (default 16)\n"
    "  --accum-steps K        micro-batches per optimizer step (default 1)\n"
    "  --lr X                 peak AdamW learning rate (default 0.003; warmup, then cosine to a tenth)\n"
    "  --max-steps N          optimizer steps in total, counting those done before a resume (default 1000)\n"
    "  --eval-every N         validation every N steps and at the end (default 250)\n"
    "  --save-every N         checkpoint every N steps (default: only at the end; always at the end)\n"
    "  --profile DIR          profile 3 steps after 3 warm-up steps (fewer when fewer are left): Chrome traces\n"
    "                         per rank and merged (DIR/trace.json), and the top ops by self time\n"
    "  --checkpoint-dir D     where step_<N>/ checkpoints go (default /tmp/ember_gpt_fsdp)\n"
    "  --resume               continue from the newest checkpoint in --checkpoint-dir\n"
    "  --overwrite            a fresh run may replace the checkpoints in --checkpoint-dir (else an error)\n"
    "  --seed N               initialisation and data order (default 0)\n"
    "  --data PATH            a directory of fortune files (default /usr/share/games/fortunes), a text file,\n"
    "                         or 'synthetic'\n"
    "  --sample-len N --temperature X --top-k N\n"
    "                         the sample generated at the end (default 240, 0.8, 20)\n"
    "  --timeout SEC          rendezvous and collective timeout (default: $EMBER_DIST_TIMEOUT_SEC, else 600)\n";

const examples::Cli kCli{"gpt", kUsage};
[[noreturn]] void usage_error(const std::string& msg) { kCli.error(msg); }

Flags parse_flags(int argc, char** argv) {
  Flags f;
  for (examples::FlagReader r(kCli, argc, argv); r.next();) {
    const std::string arg = r.flag();
    auto next = [&] { return r.value(); };
    if (arg == "--resume" || arg == "--overwrite") {
      r.no_value();
      (arg == "--resume" ? f.resume : f.overwrite) = true;
      continue;
    }
    if (arg == "--nproc")
      f.nproc = static_cast<int>(kCli.parse_int(arg, next(), 1));
    else if (arg == "--strategy")
      f.strategy = next();
    else if (arg == "--shard-size")
      f.shard_size = static_cast<int>(kCli.parse_int(arg, next(), 1));
    else if (arg == "--dp-replicate")
      f.dp_replicate = static_cast<int>(kCli.parse_int(arg, next(), -1));
    else if (arg == "--dp-shard")
      f.dp_shard = static_cast<int>(kCli.parse_int(arg, next(), -1));
    else if (arg == "--tp")
      f.tp = static_cast<int>(kCli.parse_int(arg, next(), -1));
    else if (arg == "--sp")
      f.sp = next();
    else if (arg == "--pp")
      f.pp = static_cast<int>(kCli.parse_int(arg, next(), 1));
    else if (arg == "--pp-schedule")
      f.pp_schedule = next();
    else if (arg == "--pp-virtual")
      f.pp_virtual = static_cast<int>(kCli.parse_int(arg, next(), 1));
    else if (arg == "--pp-split")
      f.pp_split = next();
    else if (arg == "--microbatches")
      f.microbatches = kCli.parse_int(arg, next(), 1);
    else if (arg == "--ac")
      f.ac = next();
    else if (arg == "--global-batch")
      f.global_batch = kCli.parse_int(arg, next(), 1);
    else if (arg == "--metrics")
      f.metrics = next();
    else if (arg == "--amp")
      f.amp = next();
    else if (arg == "--layers")
      f.layers = kCli.parse_int(arg, next(), 1);
    else if (arg == "--dim")
      f.dim = kCli.parse_int(arg, next(), 1);
    else if (arg == "--heads")
      f.heads = kCli.parse_int(arg, next(), 1);
    else if (arg == "--seq")
      f.seq = kCli.parse_int(arg, next(), 2);
    else if (arg == "--batch-size")
      f.batch_size = kCli.parse_int(arg, next(), 1);
    else if (arg == "--accum-steps")
      f.accum_steps = kCli.parse_int(arg, next(), 1);
    else if (arg == "--lr")
      f.lr = kCli.parse_positive(arg, next());
    else if (arg == "--max-steps")
      f.max_steps = kCli.parse_int(arg, next(), 1);
    else if (arg == "--eval-every")
      f.eval_every = kCli.parse_int(arg, next(), 1);
    else if (arg == "--save-every")
      f.save_every = kCli.parse_int(arg, next(), 1);
    else if (arg == "--checkpoint-dir")
      f.checkpoint_dir = next();
    else if (arg == "--seed")
      f.seed = static_cast<uint64_t>(kCli.parse_int(arg, next(), 0));
    else if (arg == "--profile") {
      f.profile_dir = next();
      if (f.profile_dir.empty()) usage_error("--profile needs a directory");
    } else if (arg == "--data")
      f.data = next(), f.data_given = true;
    else if (arg == "--sample-len")
      f.sample_len = kCli.parse_int(arg, next(), 0);
    else if (arg == "--temperature")
      f.temperature = kCli.parse_positive(arg, next());
    else if (arg == "--top-k")
      f.top_k = kCli.parse_int(arg, next(), 1);
    else if (arg == "--timeout")
      f.timeout_sec = kCli.parse_positive(arg, next());
    else
      usage_error("unknown flag '" + arg + "'");
  }
  if (f.strategy != "full" && f.strategy != "grad_op" && f.strategy != "no_shard" && f.strategy != "hybrid")
    usage_error("--strategy takes full, grad_op, no_shard or hybrid, got '" + f.strategy + "'");
  if (f.amp != "off" && f.amp != "bf16" && f.amp != "fp16")
    usage_error("--amp takes off, bf16 or fp16, got '" + f.amp + "'");
  if (f.shard_size > 0 && f.strategy != "hybrid") usage_error("--shard-size goes with --strategy hybrid");
  if (f.sp != "on" && f.sp != "off" && f.sp != "auto") usage_error("--sp takes on or off, got '" + f.sp + "'");
  const auto& names = distributed::pp::schedule_names();
  if (std::find(names.begin(), names.end(), f.pp_schedule) == names.end())
    usage_error("--pp-schedule takes gpipe, 1f1b, interleaved or zb-h1, got '" + f.pp_schedule + "'");
  if (f.microbatches > 0 && f.accum_steps > 1 && f.microbatches != f.accum_steps)
    usage_error("--microbatches " + std::to_string(f.microbatches) + " and --accum-steps " +
                std::to_string(f.accum_steps) + " disagree (one is enough)");
  if (f.pp > 1 && f.accum_steps > 1)
    usage_error("--pp " + std::to_string(f.pp) + ": the pipeline accumulates its micro-batches; give --microbatches " +
                std::to_string(f.accum_steps) + " instead of --accum-steps");
  // One process with --microbatches M is the reference for any pipeline
  // run: the same micro-batches, accumulated.
  if (f.pp == 1 && f.microbatches > 0) f.accum_steps = f.microbatches;
  if (f.pp > 1 && f.microbatches == 0) f.microbatches = f.pp;
  if (f.pp_virtual > 1 && f.pp == 1) usage_error("--pp-virtual " + std::to_string(f.pp_virtual) + " needs --pp > 1");
  try {
    nn::ActivationCheckpointing::parse(f.ac);
  } catch (const Error& e) {
    usage_error(std::string("--ac: ") + e.what());
  }
  int rest = 0;
  for (int v : {f.dp_replicate, f.dp_shard, f.tp}) {
    if (v == 0) usage_error("--dp-replicate, --dp-shard and --tp take a positive size or -1 (the rest)");
    rest += v == -1;
  }
  if (rest > 1) usage_error("only one of --dp-replicate, --dp-shard and --tp may be -1 (the rest)");
  if (f.strategy == "hybrid" && f.dp_replicate != 1)
    usage_error("--strategy hybrid makes the replicas itself (--shard-size); leave --dp-replicate out");
  if (f.dim % f.heads != 0)
    usage_error("--dim " + std::to_string(f.dim) + " must be a multiple of --heads " + std::to_string(f.heads));
  if (f.checkpoint_dir.empty()) usage_error("--checkpoint-dir must not be empty");
  examples::refuse_overwrite(f.checkpoint_dir, "step_",
                             f.resume || f.overwrite || f.checkpoint_dir == Flags{}.checkpoint_dir);
  if (f.resume) {
    auto latest = distributed::latest_checkpoint(f.checkpoint_dir, "step_");
    if (!latest.ok()) usage_error("--resume: " + std::string(latest.status().message()));
    if (!latest->has_value())
      usage_error("--resume: no checkpoint (step_<N>/) in --checkpoint-dir " + f.checkpoint_dir);
  }
  if (f.data != "synthetic" && f.data_given && !fs::exists(f.data))
    usage_error("--data " + f.data +
                ": no such file or directory (give a fortunes directory, a text file or 'synthetic')");
  return f;
}

// ---- training ----------------------------------------------------------------

nn::GPTOptions model_options(const Flags& f, int64_t vocab) {
  return {.vocab_size = vocab, .block_size = f.seq, .n_layer = f.layers, .n_head = f.heads, .n_embd = f.dim};
}

// Mean cross-entropy (nats per character) over fixed held-out windows,
// split evenly over the ranks (every rank runs the same number of
// forwards: FSDP's gathers are collectives), and the same for a unigram
// model of the training text (add-one smoothed) on the same characters.
struct Eval {
  std::vector<int64_t> starts;  // all ranks' windows
  double unigram = 0;
};

Eval make_eval(const Corpus& c, int64_t seq, int world) {
  Eval e;
  const int64_t span = static_cast<int64_t>(c.val.size()) - seq - 1;
  EMBER_CHECK(span > 0, "the validation text (", c.val.size(), " characters) is shorter than --seq ", seq);
  const int64_t per_rank = (64 + world - 1) / world;  // world: the data-parallel ranks
  const int64_t n = per_rank * world;
  for (int64_t i = 0; i < n; ++i) e.starts.push_back(span * i / n);
  std::vector<double> count(c.chars.size(), 1.0);
  for (unsigned char ch : c.train) count[c.id[ch]] += 1;
  double total = 0;
  for (double v : count) total += v;
  double nll = 0;
  int64_t m = 0;
  for (int64_t s : e.starts)
    for (int64_t t = 1; t <= seq; ++t, ++m)
      nll -= std::log(count[c.id[static_cast<unsigned char>(c.val[s + t])]] / total);
  e.unigram = nll / m;
  return e;
}

// The windows are split over the data-parallel ranks; the tp ranks of one
// data-parallel rank evaluate the same windows together (each the same loss).
double evaluate(nn::Module& model, distributed::pp::Pipeline* pipe, const Corpus& c, const Eval& e, int64_t seq,
                distributed::ProcessGroup& pg, Device device, int dp, int dp_rank, int tp) {
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
    auto [x, y] = windows(c, c.val, part, seq);
    const Tensor yt = y.to(device).reshape({x.size(0), seq});
    if (pipe != nullptr) {  // forwards through the stages; the last stage's ranks hold the loss
      const std::vector<Tensor> l = pipe->step({x.to(device)}, {yt});
      if (!l.empty()) local += l[0].item() * part.size();
      continue;
    }
    Tensor logits = model(x.to(device));
    local += distributed::parallel_cross_entropy(logits, yt).item() * part.size();
  }
  Tensor t = full({1}, local / static_cast<double>(e.starts.size()) / tp).to(device);
  pg.allreduce(t, distributed::ReduceOp::Sum)->wait();
  model.train();
  return t.to(kCPU).item();
}

// Temperature and top-k sampling from a plain (unsharded) copy of the model.
std::string generate(nn::GPT& gpt, const Corpus& c, const Flags& f) {
  gpt.eval();
  NoGradGuard ng;
  std::mt19937_64 g(f.seed + 17);
  std::vector<int> ctx{c.id['\n']};
  std::string out;
  for (int64_t i = 0; i < f.sample_len; ++i) {
    std::vector<double> ids;
    const size_t from = ctx.size() > static_cast<size_t>(f.seq) ? ctx.size() - f.seq : 0;
    for (size_t k = from; k < ctx.size(); ++k) ids.push_back(ctx[k]);
    Tensor x = Tensor::from_vector(ids, {1, static_cast<int64_t>(ids.size())}, DType::Int64);
    Tensor logits = gpt(x).to(DType::Float32);
    std::vector<double> l = logits.narrow(1, logits.size(1) - 1, 1).reshape({-1}).to_vector();
    std::vector<size_t> order(l.size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    const size_t keep = std::min<size_t>(static_cast<size_t>(f.top_k), order.size());
    std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                      [&](size_t a, size_t b) { return l[a] > l[b]; });
    std::vector<double> w(keep);
    for (size_t k = 0; k < keep; ++k) w[k] = std::exp((l[order[k]] - l[order[0]]) / f.temperature);
    std::discrete_distribution<size_t> pick(w.begin(), w.end());
    const int next = static_cast<int>(order[pick(g)]);
    ctx.push_back(next);
    out += static_cast<char>(c.chars[next]);
  }
  return out;
}

// ---- Setup: the model sharded, its optimizer, schedule and scaler ----

// The mesh the flags ask for, resolved against the world size.
struct MeshShape {
  int pp = 1, dp_replicate = 1, dp_shard = 1, tp = 1;
  bool sp = false;
  int dp() const { return dp_replicate * dp_shard; }
};

MeshShape resolve_mesh(const Flags& f, int world, int local_world) {
  MeshShape m;
  int r = f.dp_replicate, s = f.dp_shard, t = f.tp;
  if (f.strategy == "hybrid") {  // --shard-size ranks per shard group (default: a node's), replicas the rest
    const int tp = t > 0 ? t : 1;
    s = f.shard_size > 0 ? f.shard_size : std::max(1, local_world / tp);
    r = -1;
  }
  m.pp = f.pp;
  int known = f.pp;
  for (int v : {r, s, t})
    if (v > 0) known *= v;
  const std::string pp = f.pp > 1 ? "pp=" + std::to_string(f.pp) + " " : "";
  EMBER_CHECK(world % known == 0, "the mesh ", pp, "dp_replicate=", r, " dp_shard=", s, " tp=", t,
              " does not divide the ", world, " ranks");
  const int rest = world / known;
  m.dp_replicate = r > 0 ? r : rest;
  m.dp_shard = s > 0 ? s : rest;
  m.tp = t > 0 ? t : rest;
  EMBER_CHECK(m.pp * m.dp_replicate * m.dp_shard * m.tp == world, "the mesh ", pp, "dp_replicate=", m.dp_replicate,
              " dp_shard=", m.dp_shard, " tp=", m.tp, " (", m.pp * m.dp_replicate * m.dp_shard * m.tp,
              " ranks) does not match the world size ", world);
  m.sp = f.sp == "on" || (f.sp == "auto" && m.tp > 1);
  return m;
}

// "mesh dp_shard=2 tp=2": the dimensions of more than one rank.
std::string mesh_line(const MeshShape& m) {
  std::string out = "mesh";
  if (m.pp > 1) out += " pp=" + std::to_string(m.pp);
  if (m.dp_replicate > 1) out += " dp_replicate=" + std::to_string(m.dp_replicate);
  if (m.dp_shard > 1 || (m.dp_replicate == 1 && m.tp == 1 && m.pp == 1))
    out += " dp_shard=" + std::to_string(m.dp_shard);
  if (m.tp > 1) out += " tp=" + std::to_string(m.tp);
  return out;
}

struct Setup {
  Corpus corpus;
  int64_t vocab = 0, n_params = 0, step = 0;
  MeshShape mesh_shape;
  std::shared_ptr<distributed::DeviceMesh> mesh;
  int dp_rank = 0;
  int64_t global_batch = 0, micro_batch = 0;  // sequences per step over the job, per rank per micro-batch
  int64_t micro_steps = 1;                    // micro-batches per optimizer step: the pipeline's, or accumulated
  std::shared_ptr<nn::GPT> gpt;               // the whole model; null under a pipeline (each rank keeps its stages)
  // Under a pipeline: this rank's stages, its part of the model (what the
  // optimizer and checkpoints see), the training and evaluation pipelines.
  std::vector<std::shared_ptr<distributed::pp::PipelineStage>> stages;
  std::shared_ptr<nn::Module> part;
  std::unique_ptr<distributed::pp::Pipeline> pipe, eval_pipe;
  distributed::FSDPOptions fsdp_options;
  std::shared_ptr<distributed::FSDPModule> fsdp;                     // null under a pipeline
  std::vector<std::shared_ptr<distributed::FSDPModule>> stage_fsdp;  // a pipeline's stages, with --dp-shard
  nn::Module& model() { return part ? *part : *gpt; }
  std::unique_ptr<optim::AdamW> opt;
  std::unique_ptr<optim::SequentialLR> sched;
  std::unique_ptr<optim::GradScaler> scaler;
};

// Sharded checkpoints: every rank writes its own shards in parallel, and a
// run with another number of ranks or another strategy loads them
// (distributed/checkpoint/sharded.h).
void resume(const Flags& flags, const examples::Job& job, Setup& s, bool required) {
  // The newest checkpoint that verifies completely (every piece against
  // its checksum, on rank 0); the newer ones skipped are named, none is
  // touched. A restart before the first save starts afresh.
  std::vector<std::string> skipped;
  auto found = distributed::newest_verified_checkpoint(flags.checkpoint_dir, "step_", *job.pg, &skipped);
  for (const auto& sk : skipped) LOG0("--resume: skipping ", sk);
  EMBER_CHECK(found.ok(), "--resume: ", found.status().message());
  if (!found->has_value() && !required) {
    LOG0("restart: no checkpoint in ", flags.checkpoint_dir, " yet; starting from step 0");
    return;
  }
  EMBER_CHECK(found->has_value(), "--resume: no checkpoint in ", flags.checkpoint_dir);
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
  if (s.mesh_shape.tp > 1) now += "+tensor_parallel";
  if (s.mesh_shape.pp > 1) now += "+pipeline";
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
  s.corpus = load_corpus(flags.data);
  s.vocab = static_cast<int64_t>(s.corpus.chars.size());
  EMBER_CHECK(static_cast<int64_t>(s.corpus.train.size()) > flags.seq + 1, "the training text is shorter than --seq");

  MeshShape& m = s.mesh_shape;
  m = resolve_mesh(flags, job.world, job.env.local_world_size);
  EMBER_CHECK(flags.heads % m.tp == 0, "--heads ", flags.heads, " do not split over --tp ", m.tp,
              " (attention is split by heads)");
  EMBER_CHECK(!m.sp || flags.seq % m.tp == 0, "--seq ", flags.seq, " must be a multiple of --tp ", m.tp,
              " with sequence parallelism (or --sp off)");
  s.micro_steps = m.pp > 1 ? flags.microbatches : flags.accum_steps;
  s.global_batch = flags.global_batch > 0 ? flags.global_batch : flags.batch_size * m.dp() * s.micro_steps;
  EMBER_CHECK(s.global_batch % (m.dp() * s.micro_steps) == 0, "--global-batch ", s.global_batch,
              " does not split over ", m.dp(), " data-parallel rank(s) x ", s.micro_steps, " micro-batch(es)");
  s.micro_batch = s.global_batch / (m.dp() * s.micro_steps);
  // pp outermost, tp innermost: a tp group is consecutive ranks (a host's).
  if (m.pp > 1)
    s.mesh = distributed::DeviceMesh::create({m.pp, m.dp_replicate, m.dp_shard, m.tp},
                                             {"pp", "dp_replicate", "dp_shard", "tp"});
  else
    s.mesh = distributed::DeviceMesh::create({m.dp_replicate, m.dp_shard, m.tp}, {"dp_replicate", "dp_shard", "tp"});
  s.dp_rank = s.mesh->coordinate("dp_replicate") * m.dp_shard + s.mesh->coordinate("dp_shard");
  LOG0(mesh_line(m));

  manual_seed(flags.seed);
  s.gpt = std::make_shared<nn::GPT>(model_options(flags, s.vocab));
  s.gpt->to(job.device);
  s.n_params = s.gpt->num_parameters();
  std::optional<distributed::pp::Schedule> schedule;
  if (m.pp > 1) {
    // Cut first (torchtitan's order): tensor parallelism, checkpointing and
    // FSDP then apply to each of this rank's stages.
    schedule = distributed::pp::make_schedule(flags.pp_schedule, m.pp, flags.pp_virtual, flags.microbatches);
    std::vector<int> split;
    for (std::stringstream in(flags.pp_split); in.good();) {
      std::string item;
      std::getline(in, item, ',');
      if (!item.empty()) split.push_back(static_cast<int>(kCli.parse_int("--pp-split", item, 1)));
    }
    const auto all = distributed::pp::split_gpt(*s.gpt, schedule->num_stages(), split);
    for (int st : schedule->stages_of(s.mesh->coordinate("pp"))) {
      s.stages.push_back(all[st]);
      if (m.tp > 1)
        distributed::parallelize_module(*all[st], s.mesh->submesh({"tp"}),
                                        distributed::plan_for(distributed::gpt_tp_plan(*s.gpt, m.sp), *all[st]));
    }
    for (auto& st : all) LOG0("pipeline ", st->description(), " on pp rank ", schedule->rank_of(st->index()));
  } else if (m.tp > 1) {
    distributed::parallelize_module(*s.gpt, s.mesh->submesh({"tp"}), distributed::gpt_tp_plan(*s.gpt, m.sp));
  }
  // Checkpointing before fully_shard: each block's hooks (its gather and
  // backward re-gather) stay outside its region (nn/checkpoint.h).
  const auto ac = nn::ActivationCheckpointing::parse(flags.ac);
  const int wrapped = nn::apply_activation_checkpointing(s.gpt->h->named_children(), ac);
  if (ac.mode != nn::ActivationCheckpointing::Mode::None)
    LOG0("activation checkpointing ", ac.str(), ": ", wrapped, " of ", flags.layers, " blocks");

  distributed::FSDPOptions& fo = s.fsdp_options;
  fo.strategy = distributed::parse_strategy(flags.strategy);
  if (m.dp_replicate > 1 || fo.strategy == distributed::ShardingStrategy::HYBRID_SHARD) {
    EMBER_CHECK(flags.strategy == "full" || flags.strategy == "hybrid", "--dp-replicate ", m.dp_replicate,
                " replicates FULL_SHARD units (HSDP); --strategy ", flags.strategy, " does not combine with it");
    fo.strategy = distributed::ShardingStrategy::HYBRID_SHARD;
    fo.mesh = s.mesh->submesh({"dp_replicate", "dp_shard"});
  } else {
    fo.mesh = s.mesh->submesh({"dp_shard"});
  }
  if (flags.amp != "off") {
    fo.mp_policy.param_dtype = flags.amp == "bf16" ? DType::BFloat16 : DType::Float16;
    fo.mp_policy.reduce_dtype = DType::Float32;
    fo.mp_policy.output_dtype = DType::Float32;
  }
  if (m.pp == 1) {
    s.fsdp = distributed::fully_shard_auto(s.gpt, {.types = {"TransformerBlock"}}, fo);
  } else {
    // FSDP inside the stages (torchtitan's order: after tensor parallelism
    // and checkpointing): each stage's blocks are units, the stage the
    // root; the pipeline keeps them gathered through a step and reduces
    // their gradients once at its end. Replicas without sharding are the
    // pipeline's own (PipelineOptions::dp_group).
    if (m.dp_shard > 1)
      for (auto& st : s.stages)
        s.stage_fsdp.push_back(distributed::fully_shard_auto(st, {.types = {"TransformerBlock"}}, fo));
    s.part = distributed::pp::rank_part(s.stages);
    s.gpt = nullptr;  // the other ranks' stages go with it
  }

  s.opt = std::make_unique<optim::AdamW>(
      s.model().parameters(), optim::AdamWOptions{.lr = flags.lr, .beta1 = 0.9, .beta2 = 0.99, .weight_decay = 0.1});
  const int64_t warmup = std::min<int64_t>(100, flags.max_steps / 10 + 1);
  auto warm = std::make_shared<optim::LinearLR>(*s.opt, 0.1, 1.0, warmup);
  auto cosine = std::make_shared<optim::CosineAnnealingLR>(*s.opt, std::max<int64_t>(flags.max_steps - warmup, 1),
                                                           flags.lr * 0.1);
  s.sched = std::make_unique<optim::SequentialLR>(
      *s.opt, std::vector<std::shared_ptr<optim::LRScheduler>>{warm, cosine}, std::vector<int64_t>{warmup});
  optim::GradScalerOptions so;
  so.enabled = flags.amp == "fp16";
  // Every rank agrees on a skipped step: tp ranks hold different gradients.
  if (job.world > 1) so.sync_found_inf = distributed::found_inf_allreduce(job.pg);
  s.scaler = std::make_unique<optim::GradScaler>(so);
  if (schedule) {
    optim::GradScaler* scaler = s.scaler.get();
    auto loss = [](const Tensor& logits, const Tensor& y) { return distributed::parallel_cross_entropy(logits, y); };
    s.pipe = std::make_unique<distributed::pp::Pipeline>(
        *schedule, s.stages, s.mesh->group("pp"),
        distributed::pp::PipelineOptions{
            .loss = loss,
            .scale_loss = [scaler](const Tensor& l) { return scaler->scale(l); },
            .dp_group = m.dp_replicate > 1 && s.stage_fsdp.empty() ? s.mesh->group("dp_replicate") : nullptr});
    s.eval_pipe = std::make_unique<distributed::pp::Pipeline>(
        distributed::pp::forward_schedule(m.pp, flags.pp_virtual, 1), s.stages, s.mesh->group("pp"),
        distributed::pp::PipelineOptions{.loss = loss});
  }
  // A restart by the launcher (--max-restarts) resumes by itself, from the
  // newest checkpoint if there is one yet.
  if (from_disk && (flags.resume || examples::restarted())) resume(flags, job, s, /*required=*/flags.resume);
  return s;
}

// ---- The loop: steps, evaluations, checkpoints, a sample at the end ----

int loop(const Flags& flags, const examples::Job& job, Setup& s) {
  const Corpus& corpus = s.corpus;
  const int64_t vocab = s.vocab;
  optim::GradScaler& scaler = *s.scaler;
  const Device device = job.device;
  auto save = [&](int64_t at) {
    distributed::TrainingState st;
    st.step = at;
    const std::string dir = flags.checkpoint_dir + "/step_" + std::to_string(at);
    examples::save_step_checkpoint(dir, s.model(), *s.opt, *s.sched, st,
                                   {{"world_size", job.world}, {"strategy", flags.strategy}, {"vocab", vocab}}, scaler,
                                   *job.pg, s.mesh->to_string());
    LOG0("saved checkpoint ", dir, " (", job.world, " rank file", job.world == 1 ? "" : "s", ")");
  };

  const MeshShape& ms = s.mesh_shape;
  const Eval eval = make_eval(corpus, flags.seq, ms.dp());
  const int64_t tokens_per_step = s.global_batch * flags.seq;
  std::string sharding;
  if (s.fsdp) {
    const auto mem = s.fsdp->memory();
    sharding = ", FSDP " + std::string(distributed::strategy_name(s.fsdp_options.strategy)) + ", " +
               std::to_string(s.fsdp->units().size()) + " units";
    sharding += std::string(", ") +
                (flags.amp == "off" ? "float32" : flags.amp + " compute (float32 shards and reduction)") +
                "; rank 0 holds " + std::to_string(mem.sharded_params) + " bytes of parameters (" +
                std::to_string(s.n_params * 4) + " unsharded), largest unit " + std::to_string(mem.largest_unit) +
                " bytes gathered";
  } else {
    sharding = ", pipeline " + s.pipe->schedule().name + " over " + std::to_string(ms.pp) + " ranks x " +
               std::to_string(s.pipe->schedule().virtual_stages) + " stage(s), " + std::to_string(s.micro_steps) +
               " micro-batches, ";
    if (s.stage_fsdp.empty()) {
      sharding += flags.amp == "off" ? "float32" : flags.amp + " autocast (float32 parameters)";
    } else {
      int64_t units = 0, held = 0;
      for (auto& f : s.stage_fsdp) units += static_cast<int64_t>(f->units().size()), held += f->memory().sharded_params;
      sharding += "FSDP " + std::string(distributed::strategy_name(s.fsdp_options.strategy)) + " inside the stages (" +
                  std::to_string(units) + " units on this rank), " +
                  (flags.amp == "off" ? "float32" : flags.amp + " compute (float32 shards and reduction)") +
                  "; rank 0 holds " + std::to_string(held) + " bytes of parameters";
    }
  }
  LOG0("GPT ", flags.layers, " layers x ", flags.dim, " dims, ", flags.heads, " heads, context ", flags.seq, ": ",
       s.n_params, " parameters, vocabulary ", vocab, "; ", corpus.description, " (", corpus.train.size(), " train / ",
       corpus.val.size(), " validation characters)\n", job.world, " rank(s) on ",
       job.cuda ? "GPUs (NCCL)" : "the CPU (Gloo)",
       ms.tp > 1 ? ", tensor parallel over " + std::to_string(ms.tp) + (ms.sp ? " with sequence parallelism" : "")
                 : std::string(),
       sharding, "\n", "batch ", s.micro_batch, " x ", flags.seq, " characters per rank x ", ms.dp(),
       " data-parallel rank(s) x ", s.micro_steps, " micro-batch(es) = ", tokens_per_step, " tokens per step; ",
       flags.max_steps, " steps; checkpoints in ", flags.checkpoint_dir);

  // The global batch of step `at`: a function of (seed, step) only, never
  // of the mesh, so a run resumes on another mesh and any mesh computes the
  // same steps. Data-parallel rank d's micro-batch m is its slice d*accum+m.
  auto global_starts = [&](int64_t at) {
    std::mt19937_64 g(flags.seed * 1000003ULL + static_cast<uint64_t>(at) * 7919ULL);
    std::uniform_int_distribution<int64_t> pick(0, static_cast<int64_t>(corpus.train.size()) - flags.seq - 2);
    std::vector<int64_t> starts;
    for (int64_t i = 0; i < s.global_batch; ++i) starts.push_back(pick(g));
    return starts;
  };
  auto batch_starts = [&](const std::vector<int64_t>& all, int64_t micro) {
    const int64_t from = (s.dp_rank * s.micro_steps + micro) * s.micro_batch;
    return std::vector<int64_t>(all.begin() + from, all.begin() + from + s.micro_batch);
  };
  // A hash of the step's whole global batch (its token windows), so two runs
  // can be shown to have seen the same data.
  auto batch_digest = [&](const std::vector<int64_t>& all) {
    auto [x, y] = windows(corpus, corpus.train, all, flags.seq);
    const uint64_t h = XXH64(y.raw_data(), static_cast<size_t>(y.numel()) * 8, XXH64(x.raw_data(), x.numel() * 8, 0));
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
    return std::string(buf);
  };
  std::ofstream metrics;
  if (!flags.metrics.empty() && job.rank == 0) {
    // Steps a live recovery continues after without their line (the fault
    // came between the optimizer step and the line): their batches, with
    // the loss that went with the failure unknown.
    int64_t written = 0;
    if (s.step > 0)
      for (std::ifstream in(flags.metrics); in;) {
        std::string line;
        const auto j = std::getline(in, line) ? nlohmann::json::parse(line, nullptr, false) : nlohmann::json();
        if (j.is_object() && j.contains("step") && j["step"].is_number_integer())
          written = std::max(written, j["step"].get<int64_t>());
      }
    metrics.open(flags.metrics, s.step > 0 ? std::ios::app : std::ios::trunc);
    EMBER_CHECK(metrics, "--metrics: cannot write ", flags.metrics);
    for (int64_t k = written + 1; s.step > 0 && written > 0 && k <= s.step; ++k)
      metrics << nlohmann::json{{"step", k},
                                {"batch_digest", batch_digest(global_starts(k - 1))},
                                {"loss", nullptr},
                                {"note", "trained before a failure; its line was lost with it"}}
                     .dump()
              << "\n";
  }
  Allocator* alloc = get_allocator(device);

  examples::Progress progress(job.rank == 0);
  const auto t0 = Clock::now();
  double loss_ema = -1;
  int64_t& step = s.step;
  const int64_t first = step;
  auto report_eval = [&] {
    progress.close_line();
    const double v =
        evaluate(s.model(), s.eval_pipe.get(), corpus, eval, flags.seq, *job.pg, device, ms.dp(), s.dp_rank, ms.tp);
    LOG0("step ", step, ": validation loss ", v, " (unigram ", eval.unigram, ")");
    return v;
  };
  examples::StepProfiler profile(flags.profile_dir, flags.max_steps - step, job.pg.get());
  while (step < flags.max_steps) {
    const auto step_start = Clock::now();
    alloc->reset_peak_stats();
    s.opt->zero_grad();
    const std::vector<int64_t> all = global_starts(step);
    const double lr = s.opt->param_groups()[0].lr();
    double loss_sum = 0;
    if (s.pipe) {
      // The step's micro-batches through the pipeline; its last stage's
      // ranks hold the losses, shared over pp for the log.
      std::vector<Tensor> xs, ys;
      for (int64_t m = 0; m < s.micro_steps; ++m) {
        auto [x, y] = windows(corpus, corpus.train, batch_starts(all, m), flags.seq);
        xs.push_back(x.to(device));
        ys.push_back(y.to(device).reshape({x.size(0), flags.seq}));
      }
      MemoryKindScope activations(MemoryKind::Activations);
      // --amp without FSDP: autocast around the stages' forwards (their
      // backwards run in the forwards' dtypes); float32 parameters.
      AutocastGuard amp(device.type, flags.amp == "fp16" ? DType::Float16 : DType::BFloat16,
                        flags.amp != "off" && s.stage_fsdp.empty());
      for (const Tensor& l : s.pipe->step(xs, ys)) loss_sum += l.item();
      Tensor lt = Tensor::from_vector({loss_sum}, {1}, DType::Float64).to(device);
      s.mesh->group("pp")->allreduce(lt, distributed::ReduceOp::Sum)->wait();
      loss_sum = lt.to(kCPU).item();
    }
    for (int64_t m = 0; m < (s.pipe ? 0 : s.micro_steps); ++m) {
      s.fsdp->set_requires_gradient_sync(m == s.micro_steps - 1);
      auto [x, y] = windows(corpus, corpus.train, batch_starts(all, m), flags.seq);
      Tensor loss;
      {
        // What the forward allocates and backward still holds is activations.
        MemoryKindScope activations(MemoryKind::Activations);
        // Vocab-sharded logits under tensor parallelism: the loss is parallel.
        Tensor logits = (*s.gpt)(x.to(device));
        loss = distributed::parallel_cross_entropy(logits, y.to(device).reshape({x.size(0), flags.seq}));
      }
      loss_sum += loss.item();
      scaler.scale(loss * (1.0 / s.micro_steps)).backward();
    }
    scaler.unscale_(*s.opt);
    const double grad_norm = s.pipe ? s.pipe->clip_grad_norm_(1.0) : s.fsdp->clip_grad_norm_(1.0);
    distributed::commit_point(step);  // live recovery: every rank steps, or none
    scaler.step(*s.opt);
    scaler.update();
    s.sched->step();
    ++step;
    profile.step();
    double loss = loss_sum / s.micro_steps;
    // The pipeline's bubble, measured over the pp ranks beside the
    // simulator's with the measured costs, once (after warm-up steps).
    if (s.pipe && step - first == std::min<int64_t>(3, flags.max_steps - first)) {
      const auto meas = s.pipe->measure_last_step();
      const auto sim = distributed::pp::simulate(s.pipe->schedule(), meas.costs, meas.stage_costs);
      LOG0("pipeline ", s.pipe->schedule().name, ": bubble fraction measured ", meas.bubble_fraction, ", simulated ",
           sim.bubble_fraction, " (measured F ", meas.costs.f * 1e3, " ms, B ", meas.costs.b * 1e3, " ms, W ",
           meas.costs.w * 1e3, " ms per stage and micro-batch on average, transfers ", meas.costs.comm * 1e3,
           " ms; step ", meas.makespan * 1e3, " ms, simulated ", sim.makespan * 1e3, " ms)");
    }
    // The step's memory by part, at the largest peak over the ranks; printed
    // once, after the second step (the first creates the optimizer state).
    const distributed::StepMemory mem =
        distributed::largest_over_ranks(*job.pg, distributed::measured_step_memory(alloc->stats()), device);
    if (step - first == std::min<int64_t>(2, flags.max_steps - first)) {
      LOG0(mem.line("memory peak"));
      // The planner's prediction beside it, where its timeline models the run.
      if (ms.tp == 1 && ms.pp == 1 && ms.dp_replicate == 1 && flags.amp == "off" && flags.strategy != "hybrid" &&
          s.micro_steps == 1) {
        distributed::StepPlan plan{.micro_batch = s.micro_batch,
                                   .seq = flags.seq,
                                   .world = ms.dp_shard,
                                   .strategy = flags.strategy,
                                   .ac = flags.ac};
        LOG0(distributed::predict_gpt_step_memory(model_options(flags, vocab), plan).line("memory plan"));
      } else if ((flags.ac == "none" || flags.ac == "full") &&
                 (flags.strategy == "full" || flags.strategy == "hybrid")) {
        // The mesh planner's arithmetic (//tools:plan) for this run's mesh:
        // the ZeRO accounting of what a rank's stage and tensor-parallel
        // part hold, 17 s·b·h elements per block and live micro-batch.
        const distributed::ModelSpec spec = distributed::model_spec(model_options(flags, vocab), flags.seq);
        const distributed::Hardware hw{
            .gpus = job.world, .gpus_per_host = std::max(1, job.env.local_world_size), .mem_per_gpu = int64_t{1} << 50};
        const distributed::PlanOptions po{.global_batch = s.global_batch, .mixed_precision = flags.amp != "off"};
        distributed::MeshCandidate c;
        c.dp_replicate = ms.dp_replicate, c.dp_shard = ms.dp_shard, c.tp = ms.tp, c.pp = ms.pp;
        c.schedule = ms.pp > 1 ? flags.pp_schedule : "";
        c.virtual_stages = ms.pp > 1 ? flags.pp_virtual : 1;
        c.microbatches = s.micro_steps;
        c.ac = flags.ac;
        LOG0(distributed::evaluate_mesh(spec, hw, po, c).memory_line());
      } else {
        LOG0("memory plan: --ac ", flags.ac, " with --strategy ", flags.strategy, " is not modelled with tensor or ",
             "pipeline parallelism, HSDP, --amp or accumulation");
      }
    }
    if (!flags.metrics.empty()) {
      // The mean over the global batch (tp ranks hold the same loss: the
      // world's mean is the data-parallel ranks'); the peak is `mem`'s, the
      // largest over the ranks, whose parts add up to it.
      Tensor lt = Tensor::from_vector({loss}, {1}, DType::Float64).to(device);
      job.pg->allreduce(lt, distributed::ReduceOp::Avg)->wait();
      loss = lt.to(kCPU).item();
      if (metrics.is_open()) {
        const double secs = examples::seconds(step_start, Clock::now());
        nlohmann::json line = {
            {"step", step},
            {"loss", loss},
            {"lr", lr},
            {"grad_norm", grad_norm},
            {"tokens_per_s", tokens_per_step / std::max(secs, 1e-9)},
            {"step_s", secs},  // the step's wall time, for the step-time prediction (bench/step_predict.py)
            {"mem_peak_mib", mem.total()},
            {"mem_params_mib", mem[MemoryKind::Parameters]},
            {"mem_grads_mib", mem[MemoryKind::Gradients]},
            {"mem_optimizer_mib", mem[MemoryKind::Optimizer]},
            {"mem_gathered_mib", mem[MemoryKind::Gathered]},
            {"mem_activations_mib", mem[MemoryKind::Activations]},
            {"mem_other_mib", mem[MemoryKind::Other]},
            {"batch_digest", batch_digest(all)},
            // wall clock: timelines of restarts across processes
            {"time", std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count()}};
        metrics << line.dump() << "\n" << std::flush;
      }
    }
    loss_ema = loss_ema < 0 ? loss : 0.9 * loss_ema + 0.1 * loss;
    const double el = examples::seconds(t0, Clock::now());
    const double rate = (step - first) * tokens_per_step / std::max(el, 1e-9);
    progress.update("", step, flags.max_steps, loss_ema, rate, "tok/s",
                    (flags.max_steps - step) * tokens_per_step / rate, step == flags.max_steps);
    if (step % flags.eval_every == 0 && step < flags.max_steps) report_eval();
    if (flags.save_every > 0 && step % flags.save_every == 0 && step < flags.max_steps) save(step);
  }
  progress.close_line();
  const double val = report_eval();
  save(step);
  if (flags.sample_len > 0 && job.rank == 0) {
    // One process's copy to sample from, read whole from the checkpoint
    // just written (whatever mesh wrote it).
    const std::string dir = flags.checkpoint_dir + "/step_" + std::to_string(step);
    auto index = distributed::read_checkpoint_index(dir);
    EMBER_CHECK(index.ok(), index.status().message());
    auto m = std::make_shared<nn::GPT>(model_options(flags, vocab));
    nn::StateDict sd;
    for (const auto& [name, t] : m->state_dict()) {
      auto whole = distributed::read_checkpoint_tensor(dir, *index->find(name));
      EMBER_CHECK(whole.ok(), whole.status().message());
      sd.insert(name, *whole);
    }
    m->load_state_dict(sd);
    LOG0("sample (temperature ", flags.temperature, ", top-k ", flags.top_k, "):\n", generate(*m, corpus, flags));
  }
  LOG0("validation loss ", val, " = ", val / eval.unigram, " x the unigram baseline");
  return examples::finish_job(job);
}

// ---- The run: config (the flags), setup, loop ----

int train(const Flags& flags) {
  return examples::train_recovering<Setup>(
      flags.timeout_sec,
      [&](const examples::Job& job, bool from_disk) {
        distributed::check_same_config(*job.pg, {{"--strategy", flags.strategy},
                                                 {"--shard-size", std::to_string(flags.shard_size)},
                                                 {"--dp-replicate", std::to_string(flags.dp_replicate)},
                                                 {"--dp-shard", std::to_string(flags.dp_shard)},
                                                 {"--tp", std::to_string(flags.tp)},
                                                 {"--pp", std::to_string(flags.pp)},
                                                 {"--pp-schedule", flags.pp_schedule},
                                                 {"--pp-virtual", std::to_string(flags.pp_virtual)},
                                                 {"--pp-split", flags.pp_split},
                                                 {"--microbatches", std::to_string(flags.microbatches)},
                                                 {"--sp", flags.sp},
                                                 {"--global-batch", std::to_string(flags.global_batch)},
                                                 {"--amp", flags.amp},
                                                 {"--layers", std::to_string(flags.layers)},
                                                 {"--dim", std::to_string(flags.dim)},
                                                 {"--heads", std::to_string(flags.heads)},
                                                 {"--seq", std::to_string(flags.seq)},
                                                 {"--batch-size", std::to_string(flags.batch_size)},
                                                 {"--accum-steps", std::to_string(flags.accum_steps)},
                                                 {"--lr", std::to_string(flags.lr)},
                                                 {"--max-steps", std::to_string(flags.max_steps)},
                                                 {"--seed", std::to_string(flags.seed)},
                                                 {"--resume", flags.resume ? "on" : "off"}});
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
  Flags flags = parse_flags(argc, argv);
  return examples::launch_and_train(kCli, flags.nproc, argc, argv, [&] { return train(flags); });
}
