// Transformer layers: multi-head and grouped-query self-attention, the
// GPT-2 and LLaMA feed-forwards, a pre-norm block and a decoder-only
// language model in either family (GPTOptions::arch), the model the
// parallelisms are built to split.
//
//   nn::GPT gpt({.vocab_size = 96, .block_size = 64, .n_layer = 2, .n_head = 2, .n_embd = 64});
//   nn::GPT llama(nn::GPTOptions::llama({.vocab_size = 96, .n_layer = 2, .n_head = 4, .n_embd = 64,
//                                        .n_kv_head = 2}));
//   Tensor logits = gpt(tokens);   // [B, T] int64 -> [B, T, vocab]
//
// Names: GPT-2's follow torch.nn.MultiheadAttention ("in_proj_weight",
// "in_proj_bias", "out_proj.weight") and GPT-2 / nanoGPT ("wte", "wpe",
// "h.0.ln_1", "h.0.attn", "h.0.mlp.c_fc", "h.0.mlp.c_proj", "ln_f",
// "lm_head"). The LLaMA family keeps the model's skeleton ("wte", "h.N.ln_1",
// "h.N.attn", "h.N.ln_2", "h.N.mlp", "ln_f", "lm_head", so recipes, plans and
// checkpoints address both alike) with Hugging Face LLaMA's names inside
// attention and the feed-forward ("q_proj", "k_proj", "v_proj", "o_proj",
// "gate_proj", "up_proj", "down_proj").
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "core/ops.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "nn/moe.h"

namespace ember::nn {

// How an attention module computes softmax(q k^T * scale [+ causal]) v once
// it has q, k, v as [B, H, T, D] (k/v heads repeated for grouped-query
// attention): the fused ops on views of the projections when unset. A transform that
// computes attention another way installs its function here (context
// parallelism: distributed/parallel/cp/context_parallel.h).
using AttentionFn = std::function<Tensor(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                         double dropout_p, Generator* gen)>;

// Self-attention over x [B, T, E]: softmax(q k^T / sqrt(E / heads)) v per
// head, with a causal mask (position t attends to positions <= t) when
// `causal`. Under tensor parallelism in_proj holds this rank's heads of q,
// k and v (its rows say how many) and out_proj their columns: forward
// works on whatever heads the parameters hold. The softmax is the numerically stable one (max subtracted); masked
// scores are -inf, so they get exactly zero weight.
class MultiheadAttention : public Module {
 public:
  MultiheadAttention(int64_t embed_dim, int64_t num_heads, double dropout = 0.0, bool causal = true, bool bias = true);
  Tensor forward(const Tensor& x) override;
  int64_t embed_dim, num_heads;
  double dropout;
  bool causal;
  Tensor in_proj_weight, in_proj_bias;  // [3E, E], [3E]: q, k, v stacked, as torch's
  LinearKernel in_proj_kernel;          // how in_proj is computed (layers.h)
  std::shared_ptr<Linear> out_proj;
  std::shared_ptr<Dropout> attn_drop;  // on the attention weights (inside the fused op)
  AttentionFn attention;               // unset: scaled_dot_product_attention_qkvpacked
};

// The angles of rotary position embeddings for head_dim-wide heads: cos and
// sin [T, head_dim/2] of position * inv_freq[i], inv_freq[i] =
// theta^(-2i/head_dim), computed in float32 the way Hugging Face's LLaMA
// does (so positions far out round as theirs do). positions: int64 [T]
// (undefined: 0..T-1 with T = `length`).
struct RotaryTables {
  Tensor cos, sin;
};
RotaryTables rotary_tables(int64_t head_dim, double theta, int64_t length, const Tensor& positions, Device device);

struct AttentionOptions {
  int64_t n_kv_head = 0;  // 0: n_head (multi-head); fewer: grouped-query
  double rope_theta = 0;  // > 0: rotary position embeddings on q and k
  bool bias = false;      // on the q/k/v/o projections
  double dropout = 0.0;   // on the attention weights
  bool causal = true;
};

// Self-attention with separate q/k/v projections, grouped-query when
// n_kv_head < n_head (each k/v head serves n_head / n_kv_head consecutive q
// heads, Hugging Face's repeat_kv) and rotary embeddings on q and k (HF
// LLaMA's rotate-half). Under tensor parallelism the projections hold this
// rank's heads (their rows say how many): forward works on whatever heads
// they hold, as MultiheadAttention's does.
class GroupedQueryAttention : public Module {
 public:
  GroupedQueryAttention(int64_t embed_dim, int64_t n_head, AttentionOptions options = {});
  Tensor forward(const Tensor& x) override;
  int64_t embed_dim, n_head, n_kv_head, head_dim;
  AttentionOptions options;
  std::shared_ptr<Linear> q_proj, k_proj, v_proj, o_proj;
  std::shared_ptr<Dropout> attn_drop;  // on the attention weights (inside the fused op)
  // Each row's position for the rotary embedding (int64 [T]); undefined:
  // 0..T-1. Context parallelism sets the positions of a rank's chunks.
  Tensor positions;
  AttentionFn attention;  // unset: scaled_dot_product_attention

 private:
  RotaryTables tables_;  // for the last call's positions, theta and device
  std::vector<int64_t> tables_positions_;
  double tables_theta_ = 0;
};

// The GPT MLP: c_fc (E -> 4E), GELU (tanh approximation, as GPT-2), c_proj
// (4E -> E), dropout.
class TransformerMLP : public Module {
 public:
  TransformerMLP(int64_t n_embd, double dropout);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Linear> c_fc, c_proj;
  std::shared_ptr<Dropout> drop;  // "dropout", as nanoGPT's
};

// LLaMA's feed-forward: down_proj(silu(gate_proj(x)) * up_proj(x)), no
// biases, then dropout (none in LLaMA's own setting).
class SwiGLU : public Module {
 public:
  SwiGLU(int64_t n_embd, int64_t hidden, double dropout = 0.0);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Linear> gate_proj, up_proj, down_proj;
  std::shared_ptr<Dropout> drop;  // "dropout", as TransformerMLP's
};

struct GPTOptions;

// Pre-norm block: x + attn(ln_1(x)), then x + mlp(ln_2(x)). GPT-2:
// LayerNorm, MultiheadAttention, TransformerMLP; LLaMA: RMSNorm,
// GroupedQueryAttention with rotary embeddings, SwiGLU. With options.moe
// (num_experts > 0) the feed-forward of block `layer` is an MoE (moe.h)
// when layer % moe.every == 0, still named "mlp".
class TransformerBlock : public Module {
 public:
  TransformerBlock(int64_t n_embd, int64_t n_head, double dropout = 0.0);
  explicit TransformerBlock(const GPTOptions& options, int64_t layer = 0);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Module> ln_1, ln_2, attn, mlp;
};

// The LM head of a model that ties it to its token embedding: logits =
// x weight^T with the embedding's weight, which it reads but does not
// register (the state dict holds it once, under the embedding's name).
class TiedLinear : public Module {
 public:
  explicit TiedLinear(Tensor weight) : Module("TiedLinear"), weight(std::move(weight)) {}
  Tensor forward(const Tensor& x) override { return apply_linear(kernel, x, weight, Tensor()); }
  Tensor weight;  // [out, in], the embedding's
  LinearKernel kernel;
};

// The two families of decoder the options describe (see GPT).
enum class Arch { GPT2, Llama };
const char* arch_name(Arch arch);  // "gpt2", "llama"

struct GPTOptions {
  int64_t vocab_size = 256;
  int64_t block_size = 128;  // the longest sequence (position embeddings)
  int64_t n_layer = 2;
  int64_t n_head = 2;
  int64_t n_embd = 64;
  double dropout = 0.0;
  // The LM head reuses the token embedding's weight (GPT-2's tying): the
  // logits are x wte.weight^T, lm_head is a TiedLinear holding no
  // parameter, and the state dict holds the shared tensor once, as
  // "wte.weight".
  bool tie_weights = false;
  // The LLaMA family (arch = Llama; GPTOptions::llama sets it): RMSNorm
  // (eps norm_eps), rotary embeddings (rope_theta) instead of wpe,
  // grouped-query attention with n_kv_head k/v heads (0: n_head), SwiGLU
  // with ffn_hidden units (0: LLaMA's rule, 2/3 of 4 n_embd rounded up to
  // ffn_multiple_of), no biases. block_size bounds the sequence as for
  // GPT-2 (no table depends on it).
  Arch arch = Arch::GPT2;
  int64_t n_kv_head = 0;
  int64_t ffn_hidden = 0;
  int64_t ffn_multiple_of = 256;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  // Mixture-of-experts feed-forwards (num_experts 0: none); hidden 0 takes
  // ffn_width(). The experts are SwiGLUs in either family.
  MoEOptions moe = {};

  // `o` with arch = Llama (so designated initialisers read as a LLaMA config).
  static GPTOptions llama(GPTOptions o) {
    o.arch = Arch::Llama;
    return o;
  }
  int64_t kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  // Whether block `layer`'s feed-forward is an MoE (moe.every's rule).
  bool is_moe_block(int64_t layer) const { return moe.num_experts > 0 && layer % (moe.every > 0 ? moe.every : 1) == 0; }
  // The feed-forward's width: 4 n_embd for GPT-2; LLaMA's rule otherwise.
  int64_t ffn_width() const;
};

// A module that embeds a sequence's positions itself (GPT-2's learned
// position embedding: nn::GPT, a pipeline's first stage): which positions
// its rows are (int64 [T]); undefined: 0..T-1. Context parallelism sets
// those of a rank's chunks.
struct SequencePositions {
  virtual ~SequencePositions() = default;
  Tensor positions;
  // positions on `device`, or 0..T-1; a named error when they are not T.
  // The copy on the device is kept for the next call: a step captured in a
  // CUDA graph cannot copy from the host, and the positions set once for
  // every step need not travel again (so give new positions by assigning
  // the member, not by writing into its tensor).
  Tensor positions_for(int64_t T, Device device) const;

 private:
  mutable Tensor copied_from_, copy_;  // positions (as set) and its copy on copy_'s device
};

// Token (+ position, GPT-2) embeddings, n_layer blocks ("h.0", "h.1", ...),
// a final norm and a bias-free LM head (or the tied embedding). Linear and
// embedding weights start as N(0, 0.02) (GPT-2's initialisation; LLaMA's
// initializer_range too), biases at zero, norms at one.
class GPT : public Module, public SequencePositions {
 public:
  explicit GPT(GPTOptions options);
  // [B, T] int64 token ids (T <= block_size) -> [B, T, vocab] logits.
  Tensor forward(const Tensor& tokens) override;
  GPTOptions options;
  std::shared_ptr<Embedding> wte, wpe;  // wpe: GPT-2 only (null for LLaMA)
  std::shared_ptr<Dropout> drop;        // on the embeddings
  std::shared_ptr<Sequential> h;
  std::shared_ptr<Module> ln_f;     // LayerNorm (GPT-2) or RMSNorm (LLaMA)
  std::shared_ptr<Module> lm_head;  // a Linear, or a TiedLinear with tie_weights
};

}  // namespace ember::nn
