// Multi-head attention, the pre-LayerNorm block and the GPT model (see
// transformer.h). Attention runs as batched matmuls over [B * heads, T, D].
#include "nn/transformer.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/ops_nn.h"
#include "nn/functional.h"
#include "nn/init.h"

namespace ember::nn {

MultiheadAttention::MultiheadAttention(int64_t embed_dim_, int64_t num_heads_, double dropout_, bool causal_,
                                       bool bias)
    : Module("MultiheadAttention"), embed_dim(embed_dim_), num_heads(num_heads_), dropout(dropout_), causal(causal_) {
  EMBER_CHECK(embed_dim > 0 && num_heads > 0 && embed_dim % num_heads == 0, "MultiheadAttention: embed_dim ",
              embed_dim, " must be a positive multiple of num_heads ", num_heads);
  EMBER_CHECK(dropout >= 0.0 && dropout < 1.0, "MultiheadAttention: dropout must be in [0, 1), got ", dropout);
  // torch's init: xavier_uniform_ for the stacked projection, zero biases.
  in_proj_weight = register_parameter("in_proj_weight", empty({3 * embed_dim, embed_dim}));
  init::xavier_uniform_(in_proj_weight);
  if (bias) {
    in_proj_bias = register_parameter("in_proj_bias", empty({3 * embed_dim}));
    init::zeros_(in_proj_bias);
  }
  out_proj = register_module("out_proj", std::make_shared<Linear>(embed_dim, embed_dim, bias));
  if (bias) init::zeros_(out_proj->bias);
  attn_drop = register_module("attn_drop", std::make_shared<Dropout>(dropout));
}

Tensor MultiheadAttention::forward(const Tensor& x) {
  EMBER_CHECK(x.dim() == 3 && x.size(2) == embed_dim, "MultiheadAttention: expected input [batch, seq, ", embed_dim,
              "], got ", shape_str(x.sizes()));
  // The heads held here: all of them, or this rank's under tensor parallelism.
  // B and T from the projection: a sequence-parallel kernel gathers x's
  // sequence shard inside it.
  Tensor qkv = apply_linear(in_proj_kernel, x, in_proj_weight, in_proj_bias);  // [B, T, 3E]
  const int64_t E = in_proj_weight.size(0) / 3, D = embed_dim / num_heads, B = qkv.size(0), T = qkv.size(1), H = E / D;
  // [B, T, E] -> [B * H, T, D]
  auto heads = [&](int64_t which) {
    return qkv.narrow(2, which * E, E).reshape({B, T, H, D}).permute({0, 2, 1, 3}).reshape({B * H, T, D});
  };
  Tensor q = heads(0), k = heads(1), v = heads(2);
  // One fused op: the [T, T] probabilities are neither stored for backward
  // nor a separate softmax / dropout / mask pass (core/ops/attention.cc).
  Generator own;
  Generator* gen = attn_drop->generator(own);
  Tensor out = scaled_dot_product_attention(q, k, v, causal, gen ? attn_drop->p : 0.0, gen)
                   .reshape({B, H, T, D})
                   .permute({0, 2, 1, 3})
                   .reshape({B, T, E});
  return (*out_proj)(out);
}

TransformerMLP::TransformerMLP(int64_t n_embd, double dropout) : Module("TransformerMLP") {
  c_fc = register_module("c_fc", std::make_shared<Linear>(n_embd, 4 * n_embd));
  c_proj = register_module("c_proj", std::make_shared<Linear>(4 * n_embd, n_embd));
  drop = register_module("dropout", std::make_shared<Dropout>(dropout));
}

Tensor TransformerMLP::forward(const Tensor& x) { return (*drop)((*c_proj)(gelu((*c_fc)(x), /*tanh_approx=*/true))); }

TransformerBlock::TransformerBlock(int64_t n_embd, int64_t n_head, double dropout) : Module("TransformerBlock") {
  ln_1 = register_module("ln_1", std::make_shared<LayerNorm>(std::vector<int64_t>{n_embd}));
  attn = register_module("attn", std::make_shared<MultiheadAttention>(n_embd, n_head, dropout, /*causal=*/true));
  ln_2 = register_module("ln_2", std::make_shared<LayerNorm>(std::vector<int64_t>{n_embd}));
  mlp = register_module("mlp", std::make_shared<TransformerMLP>(n_embd, dropout));
}

Tensor TransformerBlock::forward(const Tensor& x) {
  Tensor y = x + (*attn)((*ln_1)(x));
  return y + (*mlp)((*ln_2)(y));
}

GPT::GPT(GPTOptions opts) : Module("GPT"), options(opts) {
  EMBER_CHECK(opts.vocab_size > 0 && opts.block_size > 0 && opts.n_layer >= 0, "GPT: vocab_size ", opts.vocab_size,
              ", block_size ", opts.block_size, " and n_layer ", opts.n_layer, " must be positive");
  wte = register_module("wte", std::make_shared<Embedding>(opts.vocab_size, opts.n_embd));
  wpe = register_module("wpe", std::make_shared<Embedding>(opts.block_size, opts.n_embd));
  drop = register_module("drop", std::make_shared<Dropout>(opts.dropout));
  h = register_module("h", std::make_shared<Sequential>());
  for (int64_t i = 0; i < opts.n_layer; ++i)
    h->push_back(std::make_shared<TransformerBlock>(opts.n_embd, opts.n_head, opts.dropout));
  ln_f = register_module("ln_f", std::make_shared<LayerNorm>(std::vector<int64_t>{opts.n_embd}));
  if (opts.tie_weights)
    lm_head = register_module("lm_head", std::make_shared<TiedLinear>(wte->weight));
  else
    lm_head = register_module("lm_head", std::make_shared<Linear>(opts.n_embd, opts.vocab_size, /*bias=*/false));
  // GPT-2's initialisation: N(0, 0.02) weights, zero biases; LayerNorms
  // keep ones and zeros.
  for (auto& [name, p] : named_parameters()) {
    if (name.find("ln_") != std::string::npos) continue;
    if (p.dim() >= 2) init::normal_(p, 0.0, 0.02);
    else init::zeros_(p);
  }
}

Tensor GPT::forward(const Tensor& tokens) {
  EMBER_CHECK(tokens.dim() == 2, "GPT: expected token ids [batch, seq], got ", shape_str(tokens.sizes()));
  const int64_t T = tokens.size(1);
  EMBER_CHECK(T <= options.block_size, "GPT: sequence length ", T, " exceeds block_size ", options.block_size);
  Tensor pos = arange(0, static_cast<double>(T), 1.0, {DType::Int64, tokens.device()});
  Tensor x = (*wte)(tokens) + (*wpe)(pos);  // [B, T, E] + [T, E]
  x = (*drop)(x);
  x = (*h)(x);
  return (*lm_head)((*ln_f)(x));
}

}  // namespace ember::nn
