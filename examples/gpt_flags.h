// //examples:gpt's flags: every flag once, a row of the table
// (examples/flags.h) with its value, help and check, the trainer's common
// rows and the mesh's shared with the other examples; parse_flags checks
// what one row cannot see (flags that go together or exclude each other).
#pragma once

#include <cstdio>
#include <filesystem>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "distributed/checkpoint/checkpoint.h"
#include "distributed/parallel/pp/schedule/schedule.h"
#include "distributed/parallel_dims.h"
#include "examples/flags.h"
#include "examples/training.h"
#include "nn/hf.h"

namespace ember::examples {

struct Flags {
  CommonFlags common{
      .batch_size = 16, .lr = 3e-3, .checkpoint_dir = "/tmp/ember_gpt_fsdp", .data = "/usr/share/games/fortunes"};
  std::string strategy = "full";
  int shard_size = 0;              // hybrid: ranks per shard group (0: ranks per node)
  distributed::ParallelDims mesh;  // --pp --dp-replicate --dp-shard --tp; -1: the rest
  std::string pp_schedule = "1f1b";
  int pp_virtual = 1;
  std::string pp_split;
  std::vector<int> blocks_per_stage;  // --pp-split parsed
  int64_t microbatches = 0;           // 0: --accum-steps (pp 1) or the pp size
  std::string sp = "auto";
  std::string cp_exchange = "ring";  // ring | allgather | alltoall (distributed/parallel/cp)
  int64_t global_batch = 0;          // 0: batch size x dp x accum
  std::string metrics;
  int64_t straggler_every = 0;  // 0: off (distributed/straggler.h)
  double straggler_threshold = 1.2;
  bool detect_anomaly = false, nan_rerun = false;  // distributed/anomaly.h
  std::string inject_nan;                          // testing: "R:S" or "R:S:once"
  int inject_nan_rank = -1;
  int64_t inject_nan_step = -1;
  bool inject_nan_once = false;
  int64_t layers = 2, dim = 128, heads = 4, seq = 64;
  std::string arch = "gpt2";  // gpt2 | llama (nn::Arch)
  int64_t kv_heads = 0;       // llama: k/v heads (0: --heads)
  int64_t ffn = 0;            // llama: SwiGLU width (0: LLaMA's rule)
  double rope_theta = 10000.0;
  // Mixture of experts (nn/moe.h): 0 experts is a dense model.
  int64_t moe_experts = 0, moe_top_k = 2, moe_every = 1, moe_hidden = 0, moe_shared = 0;
  std::string moe_score = "softmax";
  double moe_aux_coef = 0.01, moe_z_coef = 0.0, moe_capacity_factor = 0.0;
  std::string tokenizer;             // "", a tokenizer.json, or bpe:N
  std::string init_from_hf;          // a Hugging Face GPT-2 / LLaMA directory (nn/hf.h)
  std::optional<nn::GPTOptions> hf;  // its config.json's model, when given
  int64_t max_steps = 1000, save_every = 0, eval_every = 250;
  int64_t sample_len = 240, top_k = 20;
  double temperature = 0.8;
  int cuda_graph = 0;         // 1: the step as one CUDA graph (optim/graphed_step.h)
  int float8 = 0;             // 1: the blocks' linear layers in float8 (nn/float8.h)
  int float8_all_gather = 0;  // 1: FSDP gathers their weights in float8
};

// Every flag once: name, value, help, validation (examples/flags.h).
inline void declare(FlagTable& t, Flags& f) {
  add_common_flags(t, f.common, "sequences", "peak AdamW learning rate (warmup, then cosine to a tenth)");
  t.choice("--strategy", &f.strategy, {"full", "grad_op", "no_shard", "hybrid"}, "FSDP sharding strategy");
  t.integer("--shard-size", &f.shard_size, 1, "N",
            "hybrid: shard within groups of N ranks, replicate across them (default: ranks per node)");
  add_mesh_flags(t, f.mesh);
  t.choice("--sp", &f.sp, {"on", "off", "auto"}, "sequence parallelism inside tp (auto: on when --tp > 1)");
  t.choice("--cp-exchange", &f.cp_exchange, {"ring", "allgather", "alltoall"},
           "how context parallelism (--cp > 1) exchanges keys and values");
  t.choice("--pp-schedule", &f.pp_schedule, distributed::pp::schedule_names(), "pipeline schedule");
  t.integer("--pp-virtual", &f.pp_virtual, 1, "V", "stages per pp rank (interleaved)");
  t.text("--pp-split", &f.pp_split, "A,B,...", "transformer blocks per stage (default: balanced by parameter count)");
  t.integer("--microbatches", &f.microbatches, 1, "M",
            "micro-batches per optimizer step: through the pipeline with --pp, else accumulated\n"
            "(default: --accum-steps, or P with --pp)");
  t.integer("--global-batch", &f.global_batch, 1, "N",
            "sequences per optimizer step over the job; the per-rank micro-batch is N / (data-parallel\n"
            "ranks x accum) (default: --batch-size x data-parallel ranks x --accum-steps)");
  t.text("--metrics", &f.metrics, "PATH",
         "one JSON line per optimizer step (rank 0): step, loss, lr, grad_norm, tokens_per_s,\n"
         "step_s, mem_peak_mib and its parts mem_{params,grads,optimizer,gathered,activations,\n"
         "other}_mib (the rank with the largest peak), batch_digest (a hash of the global batch);\n"
         "with --moe-experts, expert_tokens_{min,max,mean} (tokens per expert over every MoE layer)\n"
         "and moe_aux_loss (the load-balancing loss, the mean over the MoE layers), with\n"
         "--moe-capacity-factor moe_dropped_frac (the share of expert choices dropped); with\n"
         "--straggler-every, straggler_rank, straggler_score and straggler_self_score on each window's step",
         false);
  t.integer("--straggler-every", &f.straggler_every, 0, "N",
            "straggler detection: every N steps each rank's forward, backward and optimizer time (less its\n"
            "waits in collectives) and its time in each collective kind are gathered, and each rank is\n"
            "scored against the median rank and its own best; a rank over --straggler-threshold is named\n"
            "in the log (0: off)");
  t.positive("--straggler-threshold", &f.straggler_threshold, "X",
             "a rank whose compute per step is over X times the median rank's is a straggler");
  t.toggle("--detect-anomaly", &f.detect_anomaly,
           "check every module's output and the gradient into it for NaN/Inf (a host sync each: slow);\n"
           "a step with a non-finite gradient norm names the first module, its rank and the step, and\n"
           "stops the job (unless --nan-rerun finds it transient)");
  t.toggle("--nan-rerun", &f.nan_rerun,
           "a step whose gradient norm is not finite is run again on the same batch: the same again is\n"
           "'persistent (data or model)' and stops the job, gone is 'transient (hardware or race)' and\n"
           "training goes on with the re-run's gradients");
  t.text("--inject-nan", &f.inject_nan, "R:S[:once]",
         "testing: rank R's token embeddings come out NaN at step S (numbered from 1, as --metrics),\n"
         "on every try of the step, or only the first with :once (exercises --detect-anomaly and\n"
         "--nan-rerun)");
  t.integer("--layers", &f.layers, 1, "N", "transformer blocks");
  t.integer("--dim", &f.dim, 1, "N", "model width");
  t.integer("--heads", &f.heads, 1, "N", "attention heads");
  t.choice("--arch", &f.arch, {"gpt2", "llama"},
           "model family: gpt2 (LayerNorm, learned positions, GELU MLP, biases) or llama (RMSNorm,\n"
           "rotary embeddings, grouped-query attention, SwiGLU, no biases)");
  t.integer("--kv-heads", &f.kv_heads, 1, "N", "llama: key/value heads, dividing --heads (default: --heads)");
  t.integer("--ffn", &f.ffn, 1, "N", "llama: SwiGLU hidden width (default: 2/3 of 4 x --dim, a multiple of 256)");
  t.positive("--rope-theta", &f.rope_theta, "X", "llama: the rotary embeddings' base");
  t.integer("--moe-experts", &f.moe_experts, 0, "E",
            "mixture of experts: E SwiGLU experts per MoE block, a top-k router, dropless dispatch\n"
            "(0: dense feed-forwards; --ep splits them over ranks)");
  t.integer("--moe-top-k", &f.moe_top_k, 1, "K", "experts each token visits");
  t.integer("--moe-every", &f.moe_every, 1, "N", "block i is an MoE block when i % N == 0 (Megatron's moe_layer_freq)");
  t.integer("--moe-hidden", &f.moe_hidden, 1, "H", "each expert's SwiGLU width (default: the dense feed-forward's)");
  t.integer("--moe-shared", &f.moe_shared, 0, "S", "DeepSeek's shared experts: S always-on experts' width added");
  t.choice("--moe-score", &f.moe_score, {"softmax", "sigmoid"}, "the router's scores");
  t.nonnegative("--moe-aux-coef", &f.moe_aux_coef, "X", "the load-balancing loss's coefficient (Switch/Mixtral)");
  t.nonnegative("--moe-z-coef", &f.moe_z_coef, "X", "the router z-loss's coefficient (ST-MoE)");
  t.nonnegative("--moe-capacity-factor", &f.moe_capacity_factor, "F",
                "each expert takes at most ceil(F x tokens x K / E) choices per forward, the later ones\n"
                "dropped, every expert's group padded to that (Megatron's capacity factor; 0: dropless)");
  t.text("--tokenizer", &f.tokenizer, "T.json|bpe:N",
         "tokens of the text: a Hugging Face tokenizer.json (byte-level BPE), or bpe:N, a BPE of N tokens\n"
         "trained on the training text at start (saved as <checkpoint-dir>/tokenizer.json); with --data\n"
         "of token shards, the tokenizer that wrote them (default: index.json's). Default: characters",
         false);
  t.integer("--seq", &f.seq, 2, "N", "context length");
  t.text("--init-from-hf", &f.init_from_hf, "DIR",
         "start from a Hugging Face GPT-2 or LLaMA directory (config.json + safetensors): the model\n"
         "is config.json's (--arch/--layers/--dim/--heads/--kv-heads/--ffn/--rope-theta may be left\n"
         "out or must agree) and its vocab_size must be the run's vocabulary's",
         false);
  t.integer("--max-steps", &f.max_steps, 1, "N", "optimizer steps in total, counting those before a resume");
  t.integer("--eval-every", &f.eval_every, 1, "N", "validation every N steps and at the end");
  t.integer("--save-every", &f.save_every, 1, "N", "checkpoint every N steps (default: only at the end)");
  t.integer("--sample-len", &f.sample_len, 0, "N", "characters sampled at the end");
  t.integer("--cuda-graph", &f.cuda_graph, 0, "0|1",
            "1: after three eager warm-up steps, the training step (forwards, backwards, clipping, the\n"
            "optimizer, the loss scaler's checks) is captured as one CUDA graph and replayed, one launch a\n"
            "step; one process on a GPU (--nproc 1); the end of the run prints the host's share of a step");
  t.integer("--float8", &f.float8, 0, "0|1",
            "1: the transformer blocks' linear layers train in float8 (tensorwise dynamic scaling: e4m3\n"
            "forward, e5m2 gradients, as torchao's float8 training); the LM head stays in high precision;\n"
            "under --tp the scales of split operands are the whole tensors' (as one process); fastest\n"
            "on H100/H200 with --amp bf16");
  t.integer("--float8-all-gather", &f.float8_all_gather, 0, "0|1",
            "1 (with --float8 1): FSDP gathers those layers' weights already cast to float8, a byte per\n"
            "element (torchao's enable_fsdp_float8_all_gather), scaled from the float32 master weights,\n"
            "their scales precomputed before each step's forward in one all-reduce");
  t.positive("--temperature", &f.temperature, "X", "the sample's temperature");
  t.integer("--top-k", &f.top_k, 1, "N", "the sample's top-k");
}

// --init-from-hf DIR: the model is config.json's. The model flags take its
// values; one given explicitly that disagrees is an error naming both, and
// so is a --tp (when given) that does not divide the key/value heads (the
// rest of the mesh is checked again once resolved, in setup). Checked here,
// in the launching process, before any worker starts.
inline void take_hf_model(const FlagTable& t, Flags& f) {
  const std::string dir = f.init_from_hf;
  auto o = nn::read_hf_config(dir);
  if (!o.ok()) t.error("--init-from-hf: " + std::string(o.status().message()));
  const bool llama = o->arch == nn::Arch::Llama;
  const std::string from = "--init-from-hf " + dir + ": config.json";
  auto agree = [&](const char* flag, const std::string& field, const std::string& given, const std::string& theirs) {
    if (t.given(flag) && given != theirs)
      t.error(std::string(flag) + " " + given + " disagrees with " + from + "'s " + field + " " + theirs + " (leave " +
              flag + " out)");
  };
  auto num = [](double x) {
    char b[32];
    std::snprintf(b, sizeof b, "%g", x);
    return std::string(b);
  };
  agree("--arch", "model_type", f.arch, nn::arch_name(o->arch));
  agree("--layers", llama ? "num_hidden_layers" : "n_layer", std::to_string(f.layers), std::to_string(o->n_layer));
  agree("--dim", llama ? "hidden_size" : "n_embd", std::to_string(f.dim), std::to_string(o->n_embd));
  agree("--heads", llama ? "num_attention_heads" : "n_head", std::to_string(f.heads), std::to_string(o->n_head));
  if (llama) {
    agree("--kv-heads", "num_key_value_heads", std::to_string(f.kv_heads), std::to_string(o->kv_heads()));
    agree("--ffn", "intermediate_size", std::to_string(f.ffn), std::to_string(o->ffn_width()));
    agree("--rope-theta", "rope_theta", num(f.rope_theta), num(o->rope_theta));
  }
  if (f.seq > o->block_size)
    t.error("--seq " + std::to_string(f.seq) + " is longer than " + from + "'s " +
            (llama ? "max_position_embeddings " : "n_positions ") + std::to_string(o->block_size));
  if (f.mesh.tp > 0 && o->kv_heads() % f.mesh.tp != 0)
    t.error("--tp " + std::to_string(f.mesh.tp) + " does not divide the " + std::to_string(o->kv_heads()) +
            " key/value heads of " + from + " (" + (llama ? "num_key_value_heads" : "n_head") +
            "): tensor parallelism splits attention by heads");
  f.arch = nn::arch_name(o->arch);
  f.layers = o->n_layer, f.dim = o->n_embd, f.heads = o->n_head;
  if (llama) f.kv_heads = o->kv_heads(), f.ffn = o->ffn_width(), f.rope_theta = o->rope_theta;
  f.hf = *o;
}

// Parses and checks the flags together (what one flag's row cannot see).
inline void parse_flags(FlagTable& t, Flags& f, int argc, char** argv) {
  t.parse(argc, argv);
  auto error = [&t](const std::string& msg) { t.error(msg); };
  const auto& c = f.common;
  if (f.shard_size > 0 && f.strategy != "hybrid") error("--shard-size goes with --strategy hybrid");
  if (f.microbatches > 0 && c.accum_steps > 1 && f.microbatches != c.accum_steps)
    error("--microbatches " + std::to_string(f.microbatches) + " and --accum-steps " + std::to_string(c.accum_steps) +
          " disagree (one is enough)");
  if (f.mesh.pp > 1 && c.accum_steps > 1)
    error("--pp " + std::to_string(f.mesh.pp) + ": the pipeline accumulates its micro-batches; give --microbatches " +
          std::to_string(c.accum_steps) + " instead of --accum-steps");
  // One process with --microbatches M is the reference for any pipeline
  // run: the same micro-batches, accumulated.
  if (f.mesh.pp == 1 && f.microbatches > 0) f.common.accum_steps = f.microbatches;
  if (f.mesh.pp > 1 && f.microbatches == 0) f.microbatches = f.mesh.pp;
  for (std::stringstream in(f.pp_split); in.good();) {
    std::string item;
    std::getline(in, item, ',');
    if (!item.empty()) f.blocks_per_stage.push_back(static_cast<int>(t.parse_int("--pp-split", item, 1)));
  }
  if (f.pp_virtual > 1 && f.mesh.pp == 1) error("--pp-virtual " + std::to_string(f.pp_virtual) + " needs --pp > 1");
  try {
    f.mesh.check_degrees();  // each positive or -1, at most one -1
  } catch (const Error& e) {
    error(e.what());
  }
  if (f.strategy == "hybrid" && f.mesh.dp_replicate != 1)
    error("--strategy hybrid makes the replicas itself (--shard-size); leave --dp-replicate out");
  if (!f.init_from_hf.empty()) take_hf_model(t, f);
  if (f.dim % f.heads != 0)
    error("--dim " + std::to_string(f.dim) + " must be a multiple of --heads " + std::to_string(f.heads));
  if (f.tokenizer.rfind("bpe:", 0) == 0) {
    t.parse_int("--tokenizer bpe:N", f.tokenizer.substr(4), 258);  // 256 bytes, <|endoftext|>, a merge
  } else if (!f.tokenizer.empty() && !std::filesystem::is_regular_file(f.tokenizer)) {
    error("--tokenizer " + f.tokenizer + ": no such file (give a tokenizer.json or bpe:N)");
  }
  for (const char* flag : {"--nan-rerun", "--detect-anomaly"})
    if (t.given(flag) && c.amp == "fp16")
      error(std::string(flag) +
            ": with --amp fp16 a non-finite gradient is the loss scaler's to handle (it skips "
            "the step and lowers the scale); use --amp bf16 or off");
  if (!f.inject_nan.empty()) {
    std::vector<std::string> parts;
    for (std::stringstream in(f.inject_nan); in.good();) {
      std::string p;
      std::getline(in, p, ':');
      parts.push_back(p);
    }
    if (parts.size() < 2 || parts.size() > 3 || (parts.size() == 3 && parts[2] != "once"))
      error("--inject-nan " + f.inject_nan + ": give RANK:STEP or RANK:STEP:once");
    f.inject_nan_rank = static_cast<int>(t.parse_int("--inject-nan RANK", parts[0], 0));
    f.inject_nan_step = t.parse_int("--inject-nan STEP", parts[1], 1);
    f.inject_nan_once = parts.size() == 3;
  }
  if (f.arch != "llama")
    for (const char* name : {"--kv-heads", "--ffn", "--rope-theta"})
      if (t.given(name)) error(std::string(name) + " goes with --arch llama");
  if (f.moe_experts == 0) {
    for (const char* name : {"--moe-top-k", "--moe-every", "--moe-hidden", "--moe-shared", "--moe-score",
                             "--moe-aux-coef", "--moe-z-coef", "--moe-capacity-factor"})
      if (t.given(name)) error(std::string(name) + " goes with --moe-experts");
  } else if (f.moe_top_k > f.moe_experts) {
    error("--moe-top-k " + std::to_string(f.moe_top_k) + " exceeds --moe-experts " + std::to_string(f.moe_experts));
  }
  if (f.mesh.ep > 1 && f.moe_experts == 0)
    error("--ep " + std::to_string(f.mesh.ep) + " splits experts; give --moe-experts");
  if (f.mesh.ep > 1 && f.moe_experts % f.mesh.ep != 0)
    error("--ep " + std::to_string(f.mesh.ep) + " does not divide --moe-experts " + std::to_string(f.moe_experts));
  if (f.moe_experts > 0 && !f.init_from_hf.empty())
    error("--moe-experts with --init-from-hf: a Hugging Face dense model has no experts to load");
  if (f.kv_heads > 0 && f.heads % f.kv_heads != 0)
    error("--heads " + std::to_string(f.heads) + " must be a multiple of --kv-heads " + std::to_string(f.kv_heads));
  if (f.arch == "llama" && (f.dim / f.heads) % 2 != 0)
    error("--arch llama: the head width --dim / --heads = " + std::to_string(f.dim / f.heads) +
          " must be even (rotary embeddings turn pairs)");
  if (f.cuda_graph > 1) error("--cuda-graph " + std::to_string(f.cuda_graph) + ": give 0 or 1");
  if (f.float8 > 1) error("--float8 " + std::to_string(f.float8) + ": give 0 or 1");
  if (f.float8_all_gather > 1) error("--float8-all-gather " + std::to_string(f.float8_all_gather) + ": give 0 or 1");
  if (f.float8_all_gather == 1 && f.float8 != 1) error("--float8-all-gather 1 needs --float8 1");
  if (f.float8 == 1 && f.moe_experts > 0 && f.moe_capacity_factor == 0)
    error("--float8 1 with dropless --moe-experts: float8 experts run on padded groups; give --moe-capacity-factor");
  if (f.cuda_graph == 1) {
    // Each of these runs host code inside the step every time (a check
    // that reads the GPU's numbers, a hook, a host-side statistic, the
    // profiler's op scopes and their events), which a replayed graph would
    // skip.
    for (const char* flag : {"--detect-anomaly", "--nan-rerun", "--inject-nan", "--straggler-every", "--profile"})
      if (t.given(flag))
        error(std::string(flag) + " with --cuda-graph 1: it runs host code inside every step, which a replayed " +
              "graph skips; use one or the other");
    // MoE routes on the device (group_order). Dropless, it runs its experts
    // there in 16 bits (grouped_mm's offsets); float32 experts read their
    // groups on the host, and expert parallelism its splits. With a
    // capacity every shape is fixed: any dtype, and --ep.
    if (f.moe_experts > 0 && f.moe_capacity_factor == 0) {
      if (c.amp != "bf16" && c.amp != "fp16")
        error("--moe-experts with --cuda-graph 1 needs --amp bf16, fp16 or --moe-capacity-factor (got --amp " + c.amp +
              "): dropless float32 experts read their token counts on the host");
      if (f.dim % 8 != 0 || f.moe_hidden % 8 != 0)
        error("--moe-experts with --cuda-graph 1: --dim " + std::to_string(f.dim) + " and --moe-hidden " +
              std::to_string(f.moe_hidden) +
              " must be multiples of 8 (the experts' grouped kernels copy 16 bytes at a time; other widths read "
              "their token counts on the host), or give --moe-capacity-factor");
      if (f.mesh.ep > 1)
        error(
            "--ep with --cuda-graph 1: dropless expert parallelism sizes its token exchange on the host every "
            "step; give --moe-capacity-factor (even splits)");
    }
    if (f.mesh.pp > 1) error("--pp with --cuda-graph 1: a pipeline's schedule runs on the host between its stages");
    // Every other dimension's collectives are captured with the step:
    // FSDP's all-gathers and reduce-scatters, HSDP's allreduces, tensor
    // parallelism's activations and loss, context parallelism's exchanges.
  }
  if (c.checkpoint_dir.empty()) error("--checkpoint-dir must not be empty");
  refuse_overwrite(c.checkpoint_dir, "step_",
                   c.resume || c.overwrite || c.checkpoint_dir == Flags{}.common.checkpoint_dir);
  if (c.resume) {
    auto latest = distributed::latest_checkpoint(c.checkpoint_dir, "step_");
    if (!latest.ok()) error("--resume: " + std::string(latest.status().message()));
    if (!latest->has_value()) error("--resume: no checkpoint (step_<N>/) in --checkpoint-dir " + c.checkpoint_dir);
  }
  if (c.data != "synthetic" && t.given("--data") && !std::filesystem::exists(c.data))
    error("--data " + c.data + ": no such file or directory (give a fortunes directory, a text file or 'synthetic')");
}

}  // namespace ember::examples
