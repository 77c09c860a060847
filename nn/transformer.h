// Transformer layers: multi-head self-attention, a pre-LayerNorm block and a
// GPT-style language model, the model FSDP is built to shard.
//
//   nn::GPT gpt({.vocab_size = 96, .block_size = 64, .n_layer = 2, .n_head = 2, .n_embd = 64});
//   Tensor logits = gpt(tokens);   // [B, T] int64 -> [B, T, vocab]
//
// Names follow torch.nn.MultiheadAttention ("in_proj_weight", "in_proj_bias",
// "out_proj.weight") and GPT-2 / nanoGPT for the rest ("wte", "wpe", "h.0.ln_1",
// "h.0.attn", "h.0.mlp.c_fc", "h.0.mlp.c_proj", "ln_f", "lm_head"), so
// state dicts line up with those models'.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>

#include "core/ops.h"
#include "nn/layers.h"
#include "nn/module.h"

namespace ember::nn {

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

// Pre-LayerNorm block: x + attn(ln_1(x)), then x + mlp(ln_2(x)).
class TransformerBlock : public Module {
 public:
  TransformerBlock(int64_t n_embd, int64_t n_head, double dropout = 0.0);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<LayerNorm> ln_1, ln_2;
  std::shared_ptr<MultiheadAttention> attn;
  std::shared_ptr<TransformerMLP> mlp;
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
};

// Token + position embeddings, n_layer blocks ("h.0", "h.1", ...), a final
// LayerNorm and a bias-free LM head (or the tied embedding). Linear and embedding weights start as
// N(0, 0.02) (GPT-2's initialisation), biases at zero.
class GPT : public Module {
 public:
  explicit GPT(GPTOptions options);
  // [B, T] int64 token ids (T <= block_size) -> [B, T, vocab] logits.
  Tensor forward(const Tensor& tokens) override;
  GPTOptions options;
  std::shared_ptr<Embedding> wte, wpe;
  std::shared_ptr<Dropout> drop;  // on the embeddings
  std::shared_ptr<Sequential> h;
  std::shared_ptr<LayerNorm> ln_f;
  std::shared_ptr<Module> lm_head;  // a Linear, or a TiedLinear with tie_weights
};

}  // namespace ember::nn
