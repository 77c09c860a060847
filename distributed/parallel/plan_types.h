// The planners' vocabulary: a model by its shape (ModelSpec and the
// presets), the hardware, the options of a plan, and one candidate mesh
// with its memory and time (MeshCandidate). Below both the step-time model
// (step_cost.h), which prices a candidate, and the mesh planner
// (mesh_plan.h), which enumerates and ranks them: each arrow goes one way.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "distributed/parallel_dims.h"
#include "nn/transformer.h"

namespace ember::distributed {

// A model: a decoder-only transformer by its shape, or any other model by
// its parameter count and per-sample costs (then only data parallelism).
struct ModelSpec {
  std::string name;
  int64_t layers = 0, dim = 0, heads = 0, kv_heads = 0, ffn = 0, vocab = 0, seq = 0;
  bool swiglu = false, tied = false;
  // Not a transformer: parameters, training FLOPs and 16-bit activation
  // bytes per sample.
  int64_t params = 0;
  double flops_per_sample = 0, activation_bytes_per_sample = 0;
  // Mixture of experts (experts > 0, nn/moe.h): block i is an MoE block
  // when i % moe_every == 0: a router Linear(dim, experts), `experts`
  // SwiGLU experts of moe_hidden (each token through top_k of them) and
  // moe_shared shared experts' width. Expert parallelism (ParallelDims::ep)
  // splits the experts; FSDP leaves them to it.
  int64_t experts = 0, top_k = 0, moe_every = 1, moe_hidden = 0, moe_shared = 0;
  bool transformer() const { return layers > 0; }
  int64_t attention_params() const;  // one block's attention: q and out; k and v (grouped)
  int64_t layer_params() const;      // one dense block: attention and MLP (norms are negligible)
  int64_t moe_layers() const;        // MoE blocks
  int64_t expert_params() const;     // one MoE block's routed experts, all of them
  int64_t moe_layer_params() const;  // one MoE block: attention, router, experts, shared experts
  // Per block on average (dense and MoE blocks mixed as the model has
  // them): every parameter; the routed experts' alone; what one token's
  // FLOPs see (top_k of the experts).
  double mean_layer_params() const;
  double mean_expert_params() const;
  double mean_active_layer_params() const;
  // The MoE feed-forwards' share of those (router, experts, shared
  // experts), which tensor parallelism does not split (they run replicated
  // over tp): every parameter, and what a token's FLOPs see.
  double mean_moe_ffn_params() const;
  double mean_moe_ffn_active_params() const;
  int64_t embedding_params() const;  // the token embedding (and a learned position table)
  int64_t num_params() const;        // the whole model, an untied head included (every expert)
  int64_t active_params() const;     // what one token's FLOPs see (top_k experts per MoE block)
};
// gpt (= gpt2), gpt2, gpt2-medium, gpt2-large, gpt2-xl (1.5B), llama-7b,
// llama-13b, llama-70b, resnet50, resnet18-narrow (//examples:resnet_ddp's
// CPU model); an error lists them otherwise.
ModelSpec model_preset(const std::string& name);
// An nn::GPT's shape (context `seq`), GPT-2 or LLaMA; and back: the
// nn::GPT a transformer preset describes (llama-* are GPTOptions::llama).
ModelSpec model_spec(const nn::GPTOptions& gpt, int64_t seq);
nn::GPTOptions gpt_options(const ModelSpec& spec);
std::vector<std::string> model_presets();

struct Hardware {
  int gpus = 8, gpus_per_host = 8;
  int64_t mem_per_gpu = int64_t{80} << 30;
  double peak_flops = 989e12;    // dense 16-bit (H100 SXM)
  double efficiency = 0.5;       // of the peak a large GEMM reaches
  double intra_host_bw = 450e9;  // bytes/s per GPU per direction (NVLink)
  double inter_host_bw = 50e9;   // bytes/s per GPU (400 Gb/s)
  double intra_latency = 10e-6, inter_latency = 20e-6;
  double host_bw = 25e9;  // host <-> device (PCIe), for offload
};

struct ComputeProfile;
class Links;

struct PlanOptions {
  int64_t global_batch = 0;     // sequences (or samples) per optimizer step
  bool mixed_precision = true;  // 16-bit compute, float32 master in the optimizer state
  std::string optimizer = "adamw";
  int top = 5;  // candidates printed
  // The training loop's own scalar all-reduces per step (the gradient
  // norm, the loss for the log): latency on a small model.
  int64_t step_allreduces = 0;
  // Where the step time comes from (step_cost.h); null: Hardware's peak
  // and efficiency, ring collectives over its links.
  const ComputeProfile* compute = nullptr;
  const Links* links = nullptr;
};

struct MeshCandidate {
  // The degrees (resolved). FSDP shards over dp_shard x cp; ep (an MoE
  // model's) splits the experts over dp_shard x cp, all of it (what the
  // recipes build).
  ParallelDims dims{.dp_shard = 1};
  std::string cp_exchange = "ring";  // under cp: ring | allgather | alltoall
  int virtual_stages = 1;
  std::string schedule;                       // "" without a pipeline
  int64_t microbatches = 1, micro_batch = 1;  // per data-parallel rank and step, sequences each
  std::string ac = "none";                    // none | full
  bool offload = false;
  // The data-parallel strategy: "" (FSDP's FULL_SHARD over dp_shard, HSDP
  // with dp_replicate, DDP without dp_shard), full, hybrid, grad_op
  // (SHARD_GRAD_OP), no_shard (gradients all-reduced over dp_shard), ddp,
  // zero1 (ZeRO-1 over dp_shard).
  std::string strategy;
  bool sequence_parallel = true;  // under tp (Megatron-SP)
  // Per rank, bytes (the rank holding the most: the first stage).
  int64_t params = 0, grads = 0, optimizer = 0, gathered = 0, activations = 0, buffers = 0;
  int64_t total() const { return params + grads + optimizer + gathered + activations + buffers; }
  // Seconds per step.
  double compute = 0, bubble = 0, tp_comm = 0, dp_comm = 0, dp_exposed = 0, pp_comm = 0, offload_io = 0, step = 0;
  double cp_comm = 0;  // context parallelism's exchanges, what the ring does not hide
  double ep_comm = 0;  // expert parallelism's all-to-alls
  double sync = 0, optimizer_step = 0;
  double mfu = 0;
  std::string explain;   // the prediction term by term (StepTime::explain)
  std::string rejected;  // why not, or empty
  // "dp_replicate=1 dp_shard=8 tp=1 pp=1" (ParallelDims::str)
  std::string mesh() const { return dims.str(); }
  // "FSDP", "DDP", "HSDP", "FSDP + TP + PP (1f1b, 16 micro-batches)", ...
  std::string describe() const;
  // "memory plan (mesh planner, <mesh>): X MiB: params+grads+optimizer A,
  // gathered B, activations C, buffers D" (MiB), or why it was rejected.
  std::string memory_line() const;
};

}  // namespace ember::distributed
