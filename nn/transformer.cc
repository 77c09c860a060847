// Multi-head and grouped-query attention, the feed-forwards, the pre-norm
// block and the GPT / LLaMA model (see transformer.h). Attention runs as
// one fused op over views of the projections' heads (no copies on the
// fused CUDA kernels).
#include "nn/transformer.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

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

namespace {
// Attention over the heads of the in-projection's output qkv [B, T, 3E]:
// [B, T, H, D]. The packed op reads q, k and v where they lie in qkv (the
// fused kernels; the others copy them out) and writes one gradient for qkv.
// Taken as three views of qkv (narrow), each view's backward copied its
// gradient out of the heads' layout, built a zero-filled gradient of qkv's
// whole size and copied into it, and the engine added the three: 13 passes
// of qkv's size a layer (a 352 M GPT-2's bf16 step about 15 GB of memory
// traffic), where PyTorch's split is one node whose backward is a cat. An
// attention function of the module's own (context parallelism's) takes
// three copies.
Tensor attend_qkv(const AttentionFn& fn, const Tensor& qkv, int64_t H, bool causal, double p, Generator* gen) {
  if (!fn) return scaled_dot_product_attention_qkvpacked(qkv, H, causal, p, gen);
  return fn(qkv_heads(qkv, 0, H).contiguous(), qkv_heads(qkv, 1, H).contiguous(), qkv_heads(qkv, 2, H).contiguous(),
            causal, p, gen)
      .permute({0, 2, 1, 3});
}

}  // namespace

Tensor MultiheadAttention::forward(const Tensor& x) {
  EMBER_CHECK(x.dim() == 3 && x.size(2) == embed_dim, "MultiheadAttention: expected input [batch, seq, ", embed_dim,
              "], got ", shape_str(x.sizes()));
  // The heads held here: all of them, or this rank's under tensor parallelism.
  // B and T from the projection: a sequence-parallel kernel gathers x's
  // sequence shard inside it.
  Tensor qkv = apply_linear(in_proj_kernel, x, in_proj_weight, in_proj_bias);  // [B, T, 3E]
  const int64_t E = in_proj_weight.size(0) / 3, D = embed_dim / num_heads, B = qkv.size(0), T = qkv.size(1), H = E / D;
  // One fused op: the [T, T] probabilities are neither stored for backward
  // nor a separate softmax / dropout / mask pass (core/ops/attention.cc).
  Generator own;
  Generator* gen = attn_drop->generator(own);
  Tensor out = attend_qkv(attention, qkv, H, causal, gen ? attn_drop->p : 0.0, gen).reshape({B, T, E});
  return (*out_proj)(out);
}

namespace {

// The positions as values: `positions`' (int64 [T]) or 0..length-1.
std::vector<int64_t> position_values(const Tensor& positions, int64_t length) {
  std::vector<int64_t> pos;
  if (positions.defined()) {
    EMBER_CHECK(positions.dim() == 1 && positions.dtype() == DType::Int64,
                "rotary embeddings: positions must be int64 [T], got ", positions.dtype(), " ",
                shape_str(positions.sizes()));
    const Tensor p = positions.to(kCPU).contiguous();
    pos.assign(p.data<int64_t>(), p.data<int64_t>() + p.numel());
  } else {
    for (int64_t t = 0; t < length; ++t) pos.push_back(t);
  }
  return pos;
}

RotaryTables tables_at(int64_t head_dim, double theta, const std::vector<int64_t>& pos, Device device) {
  EMBER_CHECK(head_dim > 0 && head_dim % 2 == 0, "rotary embeddings: head_dim ", head_dim, " must be even");
  EMBER_CHECK(theta > 0, "rotary embeddings: rope_theta must be positive, got ", theta);
  const int64_t half = head_dim / 2;
  // Hugging Face's float32 arithmetic: inv_freq = 1 / theta^(float(2i) /
  // float(D)), angle = float(pos) * inv_freq, then cos and sin.
  std::vector<float> inv(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    inv[i] = 1.0f / std::pow(static_cast<float>(theta), static_cast<float>(2 * i) / static_cast<float>(head_dim));
  const int64_t T = static_cast<int64_t>(pos.size());
  Tensor c = Tensor::empty({T, half}, {DType::Float32}), s = Tensor::empty({T, half}, {DType::Float32});
  float *cp = c.data<float>(), *sp = s.data<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const float a = static_cast<float>(pos[t]) * inv[i];
      cp[t * half + i] = std::cos(a);
      sp[t * half + i] = std::sin(a);
    }
  return {c.to(device), s.to(device)};
}

}  // namespace

RotaryTables rotary_tables(int64_t head_dim, double theta, int64_t length, const Tensor& positions, Device device) {
  return tables_at(head_dim, theta, position_values(positions, length), device);
}

GroupedQueryAttention::GroupedQueryAttention(int64_t embed_dim_, int64_t n_head_, AttentionOptions opts)
    : Module("GroupedQueryAttention"),
      embed_dim(embed_dim_),
      n_head(n_head_),
      n_kv_head(opts.n_kv_head > 0 ? opts.n_kv_head : n_head_),
      head_dim(0),
      options(opts) {
  EMBER_CHECK(embed_dim > 0 && n_head > 0 && embed_dim % n_head == 0, "GroupedQueryAttention: embed_dim ", embed_dim,
              " must be a positive multiple of n_head ", n_head);
  EMBER_CHECK(n_kv_head <= n_head && n_head % n_kv_head == 0, "GroupedQueryAttention: n_head ", n_head,
              " must be a multiple of n_kv_head ", n_kv_head, " (each k/v head serves a group of q heads)");
  EMBER_CHECK(opts.dropout >= 0.0 && opts.dropout < 1.0, "GroupedQueryAttention: dropout must be in [0, 1), got ",
              opts.dropout);
  head_dim = embed_dim / n_head;
  EMBER_CHECK(opts.rope_theta <= 0 || head_dim % 2 == 0,
              "GroupedQueryAttention: rotary embeddings need an even head_dim, got ", head_dim, " (embed_dim ",
              embed_dim, " / n_head ", n_head, ")");
  q_proj = register_module("q_proj", std::make_shared<Linear>(embed_dim, n_head * head_dim, opts.bias));
  k_proj = register_module("k_proj", std::make_shared<Linear>(embed_dim, n_kv_head * head_dim, opts.bias));
  v_proj = register_module("v_proj", std::make_shared<Linear>(embed_dim, n_kv_head * head_dim, opts.bias));
  o_proj = register_module("o_proj", std::make_shared<Linear>(n_head * head_dim, embed_dim, opts.bias));
  attn_drop = register_module("attn_drop", std::make_shared<Dropout>(opts.dropout));
}

Tensor GroupedQueryAttention::forward(const Tensor& x) {
  EMBER_CHECK(x.dim() == 3 && x.size(2) == embed_dim, "GroupedQueryAttention: expected input [batch, seq, ", embed_dim,
              "], got ", shape_str(x.sizes()));
  Tensor q = (*q_proj)(x), k = (*k_proj)(x), v = (*v_proj)(x);
  // The heads held here: all, or this rank's under tensor parallelism.
  const int64_t B = q.size(0), T = q.size(1), D = head_dim, Hq = q.size(2) / D, Hkv = k.size(2) / D;
  EMBER_CHECK(Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv == n_head / n_kv_head, "GroupedQueryAttention: holds ", Hq,
              " q heads and ", Hkv, " k/v heads; they must keep the model's ratio ", n_head, ":", n_kv_head);
  q = q.reshape({B, T, Hq, D});
  k = k.reshape({B, T, Hkv, D});
  if (options.rope_theta > 0) {
    // Keyed by what the tables depend on: the positions' values (not the
    // tensor, which may be changed in place), theta and the device.
    std::vector<int64_t> pos = position_values(positions, T);
    EMBER_CHECK(static_cast<int64_t>(pos.size()) == T, "GroupedQueryAttention: ", pos.size(),
                " positions for a sequence of ", T);
    if (pos != tables_positions_ || options.rope_theta != tables_theta_ || tables_.cos.device() != x.device()) {
      tables_ = tables_at(D, options.rope_theta, pos, x.device());
      tables_positions_ = std::move(pos);
      tables_theta_ = options.rope_theta;
    }
    q = rotary_embedding(q, tables_.cos, tables_.sin);
    k = rotary_embedding(k, tables_.cos, tables_.sin);
  }
  Generator own;
  Generator* gen = attn_drop->generator(own);
  const double p = gen ? attn_drop->p : 0.0;
  Tensor out;
  if (!attention) {
    // [B, Hkv, groups, T, D] views: q's heads split by the k/v head they
    // share, k and v expanded over their groups (a zero stride), which the
    // fused kernels read where they lie (no copy of q, no repeats of k and
    // v; the other kernels copy them).
    const int64_t G = Hq / Hkv;
    const auto kv = [&](const Tensor& t) {
      return t.reshape({B, T, Hkv, D}).permute({0, 2, 1, 3}).unsqueeze(2).expand({B, Hkv, G, T, D});
    };
    out = scaled_dot_product_attention(q.reshape({B, T, Hkv, G, D}).permute({0, 2, 3, 1, 4}), kv(k), kv(v),
                                       options.causal, p, gen);
  } else {
    // [B, T, H, D] -> [B, Hq, T, D] copies, each k/v head repeated for its q
    // heads: what an attention function of the module's own takes.
    auto four = [&](const Tensor& t, int64_t h) {
      Tensor r = t.reshape({B, T, h, D}).permute({0, 2, 1, 3});
      if (h != Hq) r = r.unsqueeze(2).expand({B, h, Hq / h, T, D});
      return r.reshape({B * Hq, T, D}).reshape({B, Hq, T, D});
    };
    out = attention(four(q, Hq), four(k, Hkv), four(v, Hkv), options.causal, p, gen);
  }
  out = out.reshape({B, Hq, T, D}).permute({0, 2, 1, 3}).reshape({B, T, Hq * D});
  return (*o_proj)(out);
}

SwiGLU::SwiGLU(int64_t n_embd, int64_t hidden, double dropout) : Module("SwiGLU") {
  EMBER_CHECK(n_embd > 0 && hidden > 0, "SwiGLU: n_embd ", n_embd, " and hidden ", hidden, " must be positive");
  gate_proj = register_module("gate_proj", std::make_shared<Linear>(n_embd, hidden, /*bias=*/false));
  up_proj = register_module("up_proj", std::make_shared<Linear>(n_embd, hidden, /*bias=*/false));
  down_proj = register_module("down_proj", std::make_shared<Linear>(hidden, n_embd, /*bias=*/false));
  drop = register_module("dropout", std::make_shared<Dropout>(dropout));
}

Tensor SwiGLU::forward(const Tensor& x) { return (*drop)((*down_proj)(swiglu((*gate_proj)(x), (*up_proj)(x)))); }

TransformerMLP::TransformerMLP(int64_t n_embd, double dropout) : Module("TransformerMLP") {
  c_fc = register_module("c_fc", std::make_shared<Linear>(n_embd, 4 * n_embd));
  c_fc->activation = LinearActivation::GeluTanh;
  c_proj = register_module("c_proj", std::make_shared<Linear>(4 * n_embd, n_embd));
  drop = register_module("dropout", std::make_shared<Dropout>(dropout));
}

// c_fc's bias and GPT-2's tanh GELU are one op each way (bias_gelu).
Tensor TransformerMLP::forward(const Tensor& x) { return (*drop)((*c_proj)((*c_fc)(x))); }

TransformerBlock::TransformerBlock(int64_t n_embd, int64_t n_head, double dropout)
    : TransformerBlock(GPTOptions{.n_head = n_head, .n_embd = n_embd, .dropout = dropout}) {}

TransformerBlock::TransformerBlock(const GPTOptions& o, int64_t layer) : Module("TransformerBlock") {
  const std::vector<int64_t> shape{o.n_embd};
  const bool moe = o.is_moe_block(layer);
  MoEOptions mo = o.moe;
  if (mo.hidden == 0) mo.hidden = o.ffn_width();
  if (o.arch == Arch::GPT2) {
    ln_1 = register_module("ln_1", std::make_shared<LayerNorm>(shape, o.norm_eps));
    attn = register_module("attn", std::make_shared<MultiheadAttention>(o.n_embd, o.n_head, o.dropout, true));
    ln_2 = register_module("ln_2", std::make_shared<LayerNorm>(shape, o.norm_eps));
    if (moe)
      mlp = register_module("mlp", std::make_shared<MoE>(o.n_embd, mo));
    else
      mlp = register_module("mlp", std::make_shared<TransformerMLP>(o.n_embd, o.dropout));
    return;
  }
  ln_1 = register_module("ln_1", std::make_shared<RMSNorm>(shape, o.norm_eps));
  attn = register_module("attn", std::make_shared<GroupedQueryAttention>(o.n_embd, o.n_head,
                                                                         AttentionOptions{.n_kv_head = o.kv_heads(),
                                                                                          .rope_theta = o.rope_theta,
                                                                                          .bias = false,
                                                                                          .dropout = o.dropout,
                                                                                          .causal = true}));
  ln_2 = register_module("ln_2", std::make_shared<RMSNorm>(shape, o.norm_eps));
  if (moe)
    mlp = register_module("mlp", std::make_shared<MoE>(o.n_embd, mo));
  else
    mlp = register_module("mlp", std::make_shared<SwiGLU>(o.n_embd, o.ffn_width(), o.dropout));
}

Tensor TransformerBlock::forward(const Tensor& x) {
  Tensor y = x + (*attn)((*ln_1)(x));
  return y + (*mlp)((*ln_2)(y));
}

const char* arch_name(Arch arch) { return arch == Arch::GPT2 ? "gpt2" : "llama"; }

int64_t GPTOptions::ffn_width() const {
  if (arch == Arch::GPT2) return 4 * n_embd;
  if (ffn_hidden > 0) return ffn_hidden;
  // LLaMA's rule: 2/3 of 4 n_embd, rounded up to a multiple of ffn_multiple_of.
  const int64_t m = std::max<int64_t>(ffn_multiple_of, 1), h = 2 * (4 * n_embd) / 3;
  return m * ((h + m - 1) / m);
}

GPT::GPT(GPTOptions opts) : Module("GPT"), options(opts) {
  EMBER_CHECK(opts.vocab_size > 0 && opts.block_size > 0 && opts.n_layer >= 0, "GPT: vocab_size ", opts.vocab_size,
              ", block_size ", opts.block_size, " and n_layer ", opts.n_layer, " must be positive");
  EMBER_CHECK(opts.n_head > 0 && opts.n_embd % opts.n_head == 0, "GPT: n_embd ", opts.n_embd,
              " must be a multiple of n_head ", opts.n_head);
  EMBER_CHECK(opts.arch == Arch::Llama || opts.n_kv_head == 0 || opts.n_kv_head == opts.n_head, "GPT: n_kv_head ",
              opts.n_kv_head, " (grouped-query attention) needs arch llama");
  EMBER_CHECK(opts.kv_heads() <= opts.n_head && opts.n_head % opts.kv_heads() == 0, "GPT: n_head ", opts.n_head,
              " must be a multiple of n_kv_head ", opts.kv_heads());
  const bool llama = opts.arch == Arch::Llama;
  wte = register_module("wte", std::make_shared<Embedding>(opts.vocab_size, opts.n_embd));
  if (!llama) wpe = register_module("wpe", std::make_shared<Embedding>(opts.block_size, opts.n_embd));
  drop = register_module("drop", std::make_shared<Dropout>(opts.dropout));
  h = register_module("h", std::make_shared<Sequential>());
  for (int64_t i = 0; i < opts.n_layer; ++i) h->push_back(std::make_shared<TransformerBlock>(opts, i));
  EMBER_CHECK(opts.moe.num_experts == 0 || opts.moe.every >= 1, "GPT: moe.every ", opts.moe.every, " (at least 1)");
  const std::vector<int64_t> shape{opts.n_embd};
  if (llama)
    ln_f = register_module("ln_f", std::make_shared<RMSNorm>(shape, opts.norm_eps));
  else
    ln_f = register_module("ln_f", std::make_shared<LayerNorm>(shape, opts.norm_eps));
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

Tensor SequencePositions::positions_for(int64_t T, Device device) const {
  if (!positions.defined()) return arange(0, static_cast<double>(T), 1.0, {DType::Int64, device});
  EMBER_CHECK(positions.dim() == 1 && positions.size(0) == T && positions.dtype() == DType::Int64,
              "positions: ", shape_str(positions.sizes()), " ", positions.dtype(), " for a sequence of ", T,
              " (int64 [", T, "])");
  if (positions.device() == device) return positions;
  if (!copy_.defined() || !copied_from_.is_same(positions) || copy_.device() != device) {
    copy_ = positions.to(device);
    copied_from_ = positions;
  }
  return copy_;
}

Tensor GPT::forward(const Tensor& tokens) {
  EMBER_CHECK(tokens.dim() == 2, "GPT: expected token ids [batch, seq], got ", shape_str(tokens.sizes()));
  const int64_t T = tokens.size(1);
  EMBER_CHECK(T <= options.block_size, "GPT: sequence length ", T, " exceeds block_size ", options.block_size);
  Tensor x = (*wte)(tokens);
  if (wpe) x = x + (*wpe)(positions_for(T, tokens.device()));  // + [T, E]
  x = (*drop)(x);
  x = (*h)(x);
  return (*lm_head)((*ln_f)(x));
}

}  // namespace ember::nn
