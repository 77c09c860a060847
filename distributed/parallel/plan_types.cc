// The planners' vocabulary (plan_types.h): parameter counts, the presets,
// a candidate's description and memory line.
#include "distributed/parallel/plan_types.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <map>

#include "core/exception.h"
#include "nn/models.h"

namespace ember::distributed {

int64_t ModelSpec::attention_params() const {
  if (!transformer()) return 0;
  const int64_t kv = (kv_heads > 0 ? kv_heads : heads), head_dim = dim / heads;
  return dim * dim * 2 + 2 * dim * kv * head_dim;  // q and out; k and v (grouped)
}

int64_t ModelSpec::layer_params() const {
  if (!transformer()) return 0;
  const int64_t hidden = ffn > 0 ? ffn : 4 * dim;
  return attention_params() + (swiglu ? 3 : 2) * dim * hidden;
}

int64_t ModelSpec::embedding_params() const {
  if (!transformer()) return 0;
  return vocab * dim + (swiglu ? 0 : seq * dim);  // GPT learns its positions; LLaMA rotates them
}

int64_t ModelSpec::moe_layers() const {
  return transformer() && experts > 0 ? (layers + std::max<int64_t>(moe_every, 1) - 1) / std::max<int64_t>(moe_every, 1)
                                      : 0;
}

int64_t ModelSpec::expert_params() const { return experts > 0 ? experts * 3 * dim * moe_hidden : 0; }

int64_t ModelSpec::moe_layer_params() const {
  if (experts == 0) return layer_params();
  return attention_params() + dim * experts + expert_params() + 3 * dim * moe_shared * moe_hidden;
}

double ModelSpec::mean_layer_params() const {
  if (!transformer()) return 0;
  const int64_t m = moe_layers();
  return (static_cast<double>(layers - m) * layer_params() + static_cast<double>(m) * moe_layer_params()) / layers;
}

double ModelSpec::mean_expert_params() const {
  return transformer() ? static_cast<double>(moe_layers()) * expert_params() / layers : 0;
}

double ModelSpec::mean_active_layer_params() const {
  if (experts == 0) return mean_layer_params();
  return mean_layer_params() - mean_expert_params() * (1.0 - static_cast<double>(top_k) / experts);
}

double ModelSpec::mean_moe_ffn_params() const {
  if (!transformer() || experts == 0) return 0;
  return static_cast<double>(moe_layers()) * (moe_layer_params() - attention_params()) / layers;
}

double ModelSpec::mean_moe_ffn_active_params() const {
  if (experts == 0) return 0;
  return mean_moe_ffn_params() - mean_expert_params() * (1.0 - static_cast<double>(top_k) / experts);
}

int64_t ModelSpec::num_params() const {
  if (!transformer()) return params;
  return (layers - moe_layers()) * layer_params() + moe_layers() * moe_layer_params() + embedding_params() +
         (tied ? 0 : vocab * dim);
}

int64_t ModelSpec::active_params() const {
  if (!transformer() || experts == 0) return num_params();
  return num_params() -
         static_cast<int64_t>(moe_layers() * expert_params() * (1.0 - static_cast<double>(top_k) / experts));
}

std::vector<std::string> model_presets() {
  return {"gpt",      "gpt2",      "gpt2-medium", "gpt2-large", "gpt2-xl",
          "llama-7b", "llama-13b", "llama-70b",   "resnet50",   "resnet18-narrow"};
}

ModelSpec model_preset(const std::string& name) {
  ModelSpec m;
  m.name = name;
  auto gpt = [&](int64_t l, int64_t d, int64_t h) {
    m.layers = l, m.dim = d, m.heads = h, m.vocab = 50257, m.seq = 1024, m.tied = true;
  };
  auto llama = [&](int64_t l, int64_t d, int64_t h, int64_t kv, int64_t ffn) {
    m.layers = l, m.dim = d, m.heads = h, m.kv_heads = kv, m.ffn = ffn, m.vocab = 32000, m.seq = 4096;
    m.swiglu = true;
  };
  if (name == "gpt2" || name == "gpt")
    gpt(12, 768, 12);
  else if (name == "gpt2-medium")
    gpt(24, 1024, 16);
  else if (name == "gpt2-large")
    gpt(36, 1280, 20);
  else if (name == "gpt2-xl")
    gpt(48, 1600, 25);
  else if (name == "llama-7b")
    llama(32, 4096, 32, 32, 11008);
  else if (name == "llama-13b")
    llama(40, 5120, 40, 40, 13824);
  else if (name == "llama-70b")
    llama(80, 8192, 64, 8, 28672);
  else if (name == "resnet50") {
    // 25.6 M parameters, 4.1 GFLOPs forward per 224x224 image (x3 to
    // train), about 100 MB of 16-bit activations kept per image.
    m.params = 25'557'032;
    m.flops_per_sample = 3 * 4.1e9;
    m.activation_bytes_per_sample = 100e6;
  } else if (name == "resnet18-narrow") {
    // //examples:resnet_ddp's CPU model: ResNet-18 of width 16 with the
    // small stem on 1 x 28 x 28 images, 10 classes (nn::resnet18's
    // parameter count); 57.1 MFLOPs forward per image (the convolutions'
    // 2·k²·Cin·Cout·H·W summed, x3 to train); about 1.2 MB of 16-bit
    // activations kept per image (an estimate).
    m.params = 0;
    for (const Tensor& p :
         nn::resnet18({.num_classes = 10, .in_channels = 1, .small_stem = true, .width = 16})->parameters())
      m.params += p.numel();
    m.flops_per_sample = 3 * 57.1e6;
    m.activation_bytes_per_sample = 1.2e6;
  } else {
    std::string all;
    for (const auto& n : model_presets()) all += (all.empty() ? "" : ", ") + n;
    EMBER_CHECK(false, "plan: unknown model '", name, "' (known: ", all,
                "; or give --layers/--dim/--heads/--vocab/--seq)");
  }
  return m;
}

std::string MeshCandidate::describe() const {
  std::vector<std::string> parts;
  if (dims.dp_shard > 1)
    parts.push_back(dims.dp_replicate > 1 ? "HSDP" : "FSDP");
  else if (dims.dp_replicate > 1)
    parts.push_back("DDP");
  if (dims.cp > 1) parts.push_back("CP " + cp_exchange);
  if (dims.tp > 1) parts.push_back("TP");
  if (dims.pp > 1) parts.push_back("PP");
  if (dims.ep > 1) parts.push_back("EP");
  std::string s;
  for (const auto& p : parts) s += (s.empty() ? "" : " + ") + p;
  if (s.empty()) s = "one device";
  if (dims.pp > 1)
    s += " (" + schedule + (virtual_stages > 1 ? " v" + std::to_string(virtual_stages) : "") + ", " +
         std::to_string(microbatches) + " micro-batches)";
  if (ac != "none") s += ", AC " + ac;
  if (offload) s += ", CPU offload";
  return s;
}

std::string MeshCandidate::memory_line() const {
  if (!rejected.empty()) return "memory plan (mesh planner): " + rejected;
  auto mib = [](int64_t b) {
    char s[32];
    std::snprintf(s, sizeof s, "%.2f", static_cast<double>(b) / (1 << 20));
    return std::string(s);
  };
  return "memory plan (mesh planner, " + mesh() + "): " + mib(total()) + " MiB: params+grads+optimizer " +
         mib(params + grads + optimizer) + ", gathered " + mib(gathered) + ", activations " + mib(activations) +
         ", buffers " + mib(buffers);
}

ModelSpec model_spec(const nn::GPTOptions& g, int64_t seq) {
  ModelSpec m;
  m.name = nn::arch_name(g.arch);
  m.layers = g.n_layer, m.dim = g.n_embd, m.heads = g.n_head, m.vocab = g.vocab_size, m.seq = seq;
  m.tied = g.tie_weights;
  if (g.arch == nn::Arch::Llama) {
    m.swiglu = true;
    m.kv_heads = g.kv_heads();
    m.ffn = g.ffn_width();
  }
  if (g.moe.num_experts > 0) {
    m.experts = g.moe.num_experts, m.top_k = g.moe.top_k, m.moe_every = std::max<int64_t>(g.moe.every, 1);
    m.moe_hidden = g.moe.hidden > 0 ? g.moe.hidden : g.ffn_width();
    m.moe_shared = g.moe.shared_experts;
  }
  return m;
}

nn::GPTOptions gpt_options(const ModelSpec& m) {
  EMBER_CHECK(m.transformer(), "plan: ", m.name, " is not a transformer");
  nn::GPTOptions o{.vocab_size = m.vocab,
                   .block_size = m.seq,
                   .n_layer = m.layers,
                   .n_head = m.heads,
                   .n_embd = m.dim,
                   .tie_weights = m.tied};
  if (m.swiglu) {
    o.arch = nn::Arch::Llama;
    o.n_kv_head = m.kv_heads;
    o.ffn_hidden = m.ffn;
  }
  if (m.experts > 0)
    o.moe = {.num_experts = m.experts,
             .top_k = m.top_k,
             .hidden = m.moe_hidden,
             .shared_experts = m.moe_shared,
             .every = m.moe_every};
  return o;
}

}  // namespace ember::distributed
