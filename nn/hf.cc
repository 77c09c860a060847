// Hugging Face GPT-2 / LLaMA directories to and from nn::GPT (see hf.h).
// One table (`layout`) lists every tensor of a model: its ember name, its
// Hugging Face name, ember's shape and whether the stored one is transposed
// (GPT-2's Conv1D); loading, saving and the error messages all read it, so
// the two directions cannot drift apart.
#include "nn/hf.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/safetensors.h"

namespace ember::nn {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

// A named error inside this file; the public functions turn it into a
// Status. (Exceptions keep the many checks below one line each.)
struct Bad {
  std::string msg;
};

template <typename... Args>
[[noreturn]] void bad(const Args&... args) {
  throw Bad{detail::str_cat(args...)};
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) bad(path, ": cannot read (missing file?)");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json parse_json(const std::string& text, const std::string& path) {
  try {
    json j = json::parse(text);
    if (!j.is_object()) bad(path, ": expected a JSON object");
    return j;
  } catch (const json::exception& e) {
    bad(path, ": invalid JSON: ", e.what());
  }
}

bool present(const json& j, const char* key) { return j.contains(key) && !j.at(key).is_null(); }

// Fields as transformers reads them: absent or null takes the config
// class's default (GPT2Config's, LlamaConfig's), as from_pretrained does.
int64_t integer(const json& j, const std::string& file, const char* key, int64_t def) {
  if (!present(j, key)) return def;
  const json& v = j.at(key);
  if (!v.is_number_integer() || v.get<int64_t>() <= 0)
    bad(file, ": ", key, " must be a positive integer, got ", v.dump());
  return v.get<int64_t>();
}
double number(const json& j, const std::string& file, const char* key, double def) {
  if (!present(j, key)) return def;
  const json& v = j.at(key);
  if (!v.is_number() || v.get<double>() < 0) bad(file, ": ", key, " must be a non-negative number, got ", v.dump());
  return v.get<double>();
}
bool boolean(const json& j, const std::string& file, const char* key, bool def) {
  if (!present(j, key)) return def;
  if (!j.at(key).is_boolean()) bad(file, ": ", key, " must be true or false, got ", j.at(key).dump());
  return j.at(key).get<bool>();
}
std::string text(const json& j, const std::string& file, const char* key, const std::string& def) {
  if (!present(j, key)) return def;
  if (!j.at(key).is_string()) bad(file, ": ", key, " must be a string, got ", j.at(key).dump());
  return j.at(key).get<std::string>();
}

GPTOptions gpt2_config(const json& j, const std::string& file) {
  GPTOptions o;
  o.arch = Arch::GPT2;
  o.vocab_size = integer(j, file, "vocab_size", 50257);
  o.block_size = integer(j, file, "n_positions", 1024);
  o.n_embd = integer(j, file, "n_embd", 768);
  o.n_layer = integer(j, file, "n_layer", 12);
  o.n_head = integer(j, file, "n_head", 12);
  o.norm_eps = number(j, file, "layer_norm_epsilon", 1e-5);
  o.tie_weights = boolean(j, file, "tie_word_embeddings", true);
  if (o.n_embd % o.n_head != 0)
    bad(file, ": n_embd ", o.n_embd, " is not a multiple of n_head ", o.n_head, " (heads of equal width)");
  if (present(j, "n_inner") && integer(j, file, "n_inner", 0) != 4 * o.n_embd)
    bad(file, ": n_inner ", j.at("n_inner").dump(),
        " is not supported (ember's GPT-2 MLP is 4 x n_embd = ", 4 * o.n_embd, "; n_inner must be null or that)");
  // gelu_new and gelu_pytorch_tanh are the same tanh approximation, which
  // TransformerMLP computes; the exact erf GELU would change every logit.
  const std::string act = text(j, file, "activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    bad(file, ": activation_function '", act,
        "' is not supported (ember's GPT-2 MLP uses the tanh GELU: 'gelu_new' or ", "'gelu_pytorch_tanh')");
  if (!boolean(j, file, "scale_attn_weights", true))
    bad(file, ": scale_attn_weights false is not supported (ember scales attention scores by 1/sqrt(head width))");
  if (boolean(j, file, "scale_attn_by_inverse_layer_idx", false))
    bad(file,
        ": scale_attn_by_inverse_layer_idx true is not supported (ember's attention scale is 1/sqrt(head width) in ",
        "every layer; it must be false)");
  if (boolean(j, file, "add_cross_attention", false))
    bad(file, ": add_cross_attention true is not supported (ember's GPT is decoder-only; it must be false)");
  return o;
}

// The kind of a rope_scaling / rope_parameters object: "rope_type", or
// the older "type"; neither means plain RoPE.
std::string rope_kind(const json& r) {
  if (r.contains("rope_type") && r.at("rope_type").is_string()) return r.at("rope_type").get<std::string>();
  if (r.contains("type") && r.at("type").is_string()) return r.at("type").get<std::string>();
  return "default";
}

GPTOptions llama_config(const json& j, const std::string& file) {
  GPTOptions o;
  o.arch = Arch::Llama;
  o.vocab_size = integer(j, file, "vocab_size", 32000);
  o.n_embd = integer(j, file, "hidden_size", 4096);
  o.ffn_hidden = integer(j, file, "intermediate_size", 11008);
  o.n_layer = integer(j, file, "num_hidden_layers", 32);
  o.n_head = integer(j, file, "num_attention_heads", 32);
  o.n_kv_head = integer(j, file, "num_key_value_heads", o.n_head);
  o.block_size = integer(j, file, "max_position_embeddings", 2048);
  o.norm_eps = number(j, file, "rms_norm_eps", 1e-6);
  o.tie_weights = boolean(j, file, "tie_word_embeddings", false);
  if (o.n_embd % o.n_head != 0)
    bad(file, ": hidden_size ", o.n_embd, " is not a multiple of num_attention_heads ", o.n_head,
        " (ember's head width is hidden_size / num_attention_heads)");
  const int64_t head_dim = o.n_embd / o.n_head;
  if (present(j, "head_dim") && integer(j, file, "head_dim", head_dim) != head_dim)
    bad(file, ": head_dim ", j.at("head_dim").dump(), " is not supported (ember's head width is hidden_size / ",
        "num_attention_heads = ", head_dim, "; head_dim must be that or absent)");
  if (head_dim % 2 != 0) bad(file, ": head width ", head_dim, " is odd (rotary embeddings turn pairs)");
  if (o.n_head % o.n_kv_head != 0)
    bad(file, ": num_attention_heads ", o.n_head, " is not a multiple of num_key_value_heads ", o.n_kv_head);
  const std::string act = text(j, file, "hidden_act", "silu");
  if (act != "silu")
    bad(file, ": hidden_act '", act, "' is not supported (ember's LLaMA feed-forward is SwiGLU: 'silu')");
  for (const char* key : {"attention_bias", "mlp_bias"})
    if (boolean(j, file, key, false))
      bad(file, ": ", key, " true is not supported (ember's LLaMA projections have no biases; it must be false)");
  if (present(j, "sliding_window"))
    bad(file, ": sliding_window ", j.at("sliding_window").dump(),
        " is not supported (ember's attention is full causal attention; sliding_window must be null or absent)");
  // RoPE: transformers 4 writes rope_theta and rope_scaling (null for
  // plain RoPE), transformers 5 rope_parameters {rope_type, rope_theta}.
  // Only plain RoPE is implemented: scaling (linear, dynamic, yarn, llama3,
  // ...) changes the angles.
  o.rope_theta = number(j, file, "rope_theta", 10000.0);
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!present(j, key)) continue;
    const json& r = j.at(key);
    if (!r.is_object()) bad(file, ": ", key, " must be an object or null, got ", r.dump());
    const std::string kind = rope_kind(r);
    if (kind != "default")
      bad(file, ": ", key, " rope_type '", kind, "' is not supported (ember implements plain RoPE: ", key,
          " null or rope_type 'default')");
    if (r.contains("rope_theta")) o.rope_theta = number(r, file + " " + key, "rope_theta", o.rope_theta);
  }
  if (o.rope_theta <= 0) bad(file, ": rope_theta must be positive, got ", o.rope_theta);
  return o;
}

GPTOptions parse_config(const json& j, const std::string& file) {
  if (!present(j, "model_type")) bad(file, ": no model_type (ember loads 'gpt2' and 'llama')");
  const std::string type = text(j, file, "model_type", "");
  if (type == "gpt2") return gpt2_config(j, file);
  if (type == "llama") return llama_config(j, file);
  bad(file, ": model_type '", type, "' is not supported (ember loads 'gpt2' (GPT2LMHeadModel) and 'llama' ",
      "(LlamaForCausalLM))");
}

GPTOptions config_of(const std::string& dir) {
  const std::string file = (fs::path(dir) / "config.json").string();
  return parse_config(parse_json(read_text(file), file), file);
}

// ---- The table of tensors ----

struct Entry {
  std::string ember, hf;
  Shape shape;      // ember's; Hugging Face's is its transpose when `transpose`
  bool transpose;   // GPT-2's Conv1D stores [in, out]
  std::string why;  // the config fields that give the shape, for messages
};

// Every tensor of the model, in GPT::state_dict()'s order. `prefix`: GPT-2's
// "transformer." (or "" for checkpoints saved from GPT2Model).
std::vector<Entry> layout(const GPTOptions& o, const std::string& prefix = "transformer.") {
  std::vector<Entry> t;
  const int64_t V = o.vocab_size, E = o.n_embd;
  if (o.arch == Arch::GPT2) {
    const std::string p = prefix;
    const std::string e = "n_embd " + std::to_string(E);
    t.push_back({"wte.weight", p + "wte.weight", {V, E}, false, "vocab_size " + std::to_string(V) + ", " + e});
    t.push_back({"wpe.weight",
                 p + "wpe.weight",
                 {o.block_size, E},
                 false,
                 "n_positions " + std::to_string(o.block_size) + ", " + e});
    for (int64_t i = 0; i < o.n_layer; ++i) {
      const std::string me = "h." + std::to_string(i) + ".", hf = p + me;
      t.push_back({me + "ln_1.weight", hf + "ln_1.weight", {E}, false, e});
      t.push_back({me + "ln_1.bias", hf + "ln_1.bias", {E}, false, e});
      t.push_back({me + "attn.in_proj_weight", hf + "attn.c_attn.weight", {3 * E, E}, true, e});
      t.push_back({me + "attn.in_proj_bias", hf + "attn.c_attn.bias", {3 * E}, false, e});
      t.push_back({me + "attn.out_proj.weight", hf + "attn.c_proj.weight", {E, E}, true, e});
      t.push_back({me + "attn.out_proj.bias", hf + "attn.c_proj.bias", {E}, false, e});
      t.push_back({me + "ln_2.weight", hf + "ln_2.weight", {E}, false, e});
      t.push_back({me + "ln_2.bias", hf + "ln_2.bias", {E}, false, e});
      t.push_back({me + "mlp.c_fc.weight", hf + "mlp.c_fc.weight", {4 * E, E}, true, e + ", n_inner 4 x n_embd"});
      t.push_back({me + "mlp.c_fc.bias", hf + "mlp.c_fc.bias", {4 * E}, false, e + ", n_inner 4 x n_embd"});
      t.push_back({me + "mlp.c_proj.weight", hf + "mlp.c_proj.weight", {E, 4 * E}, true, e + ", n_inner 4 x n_embd"});
      t.push_back({me + "mlp.c_proj.bias", hf + "mlp.c_proj.bias", {E}, false, e});
    }
    t.push_back({"ln_f.weight", p + "ln_f.weight", {E}, false, e});
    t.push_back({"ln_f.bias", p + "ln_f.bias", {E}, false, e});
  } else {
    const int64_t D = E / o.n_head, Hq = o.n_head * D, Hkv = o.kv_heads() * D, F = o.ffn_width();
    const std::string e = "hidden_size " + std::to_string(E);
    const std::string q = e + ", num_attention_heads " + std::to_string(o.n_head) + " x head_dim " + std::to_string(D);
    const std::string kv =
        e + ", num_key_value_heads " + std::to_string(o.kv_heads()) + " x head_dim " + std::to_string(D);
    const std::string f = e + ", intermediate_size " + std::to_string(F);
    t.push_back(
        {"wte.weight", "model.embed_tokens.weight", {V, E}, false, "vocab_size " + std::to_string(V) + ", " + e});
    for (int64_t i = 0; i < o.n_layer; ++i) {
      const std::string me = "h." + std::to_string(i) + ".", hf = "model.layers." + std::to_string(i) + ".";
      t.push_back({me + "ln_1.weight", hf + "input_layernorm.weight", {E}, false, e});
      t.push_back({me + "attn.q_proj.weight", hf + "self_attn.q_proj.weight", {Hq, E}, false, q});
      t.push_back({me + "attn.k_proj.weight", hf + "self_attn.k_proj.weight", {Hkv, E}, false, kv});
      t.push_back({me + "attn.v_proj.weight", hf + "self_attn.v_proj.weight", {Hkv, E}, false, kv});
      t.push_back({me + "attn.o_proj.weight", hf + "self_attn.o_proj.weight", {E, Hq}, false, q});
      t.push_back({me + "ln_2.weight", hf + "post_attention_layernorm.weight", {E}, false, e});
      t.push_back({me + "mlp.gate_proj.weight", hf + "mlp.gate_proj.weight", {F, E}, false, f});
      t.push_back({me + "mlp.up_proj.weight", hf + "mlp.up_proj.weight", {F, E}, false, f});
      t.push_back({me + "mlp.down_proj.weight", hf + "mlp.down_proj.weight", {E, F}, false, f});
    }
    t.push_back({"ln_f.weight", "model.norm.weight", {E}, false, e});
  }
  if (!o.tie_weights)
    t.push_back({"lm_head.weight",
                 "lm_head.weight",
                 {V, E},
                 false,
                 "vocab_size " + std::to_string(V) + ", " + (o.arch == Arch::GPT2 ? "n_embd " : "hidden_size ") +
                     std::to_string(E) + ", tie_word_embeddings false"});
  return t;
}

Shape stored_shape(const Entry& e) { return e.transpose ? Shape{e.shape[1], e.shape[0]} : e.shape; }

// Tensors transformers leaves in some checkpoints that are no weights:
// GPT-2's causal-mask buffers, LLaMA's rotary frequencies (older saves),
// and a tied lm_head that transformers ignores too (it ties it to the
// embedding after loading).
bool ignorable(const std::string& name, const GPTOptions& o) {
  auto ends = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  if (o.tie_weights && name == "lm_head.weight") return true;
  if (o.arch == Arch::GPT2) return ends(".attn.bias") || ends(".attn.masked_bias");
  return ends(".rotary_emb.inv_freq");
}

// The weights of `dir`: name -> (tensor, the file that held it).
struct Weights {
  std::vector<std::pair<std::string, std::pair<Tensor, std::string>>> items;
  std::string where;  // the file (or index) that names them, for a missing weight
};

Weights read_weights(const std::string& dir) {
  Weights w;
  const fs::path d(dir), single = d / "model.safetensors", index = d / "model.safetensors.index.json";
  auto load = [&](const fs::path& file, const std::map<std::string, std::string>* only) {
    auto f = load_safetensors(file.string());
    if (!f.ok()) bad(f.status().message());
    for (auto& [name, t] : f->tensors) {
      if (only && only->count(name) && only->at(name) != file.filename().string())
        bad(index.string(), ": '", name, "' is mapped to ", only->at(name), " but is also in ", file.string());
      w.items.push_back({name, {t, file.string()}});
    }
  };
  if (fs::exists(single)) {
    w.where = single.string();
    load(single, nullptr);
    return w;
  }
  if (!fs::exists(index)) {
    const bool bin = fs::exists(d / "pytorch_model.bin") || fs::exists(d / "pytorch_model.bin.index.json");
    bad(dir, ": no model.safetensors or model.safetensors.index.json",
        bin ? " (pytorch_model.bin is a pickle, which ember does not read: save with safe_serialization=True)" : "");
  }
  w.where = index.string();
  const json j = parse_json(read_text(index.string()), index.string());
  if (!j.contains("weight_map") || !j.at("weight_map").is_object())
    bad(index.string(), ": no weight_map object (transformers' sharded index)");
  std::map<std::string, std::string> map;
  std::set<std::string> files;
  for (const auto& [name, file] : j.at("weight_map").items()) {
    if (!file.is_string()) bad(index.string(), ": weight_map['", name, "'] must be a file name, got ", file.dump());
    const std::string f = file.get<std::string>();
    if (f.find('/') != std::string::npos || f == "..")
      bad(index.string(), ": weight_map['", name, "'] = '", f, "' is not a file beside the index");
    map[name] = f;
    files.insert(f);
  }
  for (const std::string& f : files) load(d / f, &map);
  std::set<std::string> have;
  for (const auto& [name, tf] : w.items)
    if (!have.insert(name).second) bad(index.string(), ": '", name, "' is stored in two shards");
  for (const auto& [name, f] : map)
    if (!have.count(name)) bad((d / f).string(), ": missing weight '", name, "' (", index.string(), " maps it here)");
  return w;
}

HFModel load_dir(const std::string& dir) {
  HFModel m;
  m.options = config_of(dir);
  const std::string cfg = (fs::path(dir) / "config.json").string();
  Weights w = read_weights(dir);
  std::map<std::string, size_t> at;
  for (size_t i = 0; i < w.items.size(); ++i) at[w.items[i].first] = i;
  // GPT-2 saved from GPT2Model has no "transformer." prefix (the original
  // openai-community/gpt2 files); one naming throughout.
  std::string prefix = "transformer.";
  if (m.options.arch == Arch::GPT2 && !at.count("transformer.wte.weight") && at.count("wte.weight")) prefix = "";
  std::vector<bool> used(w.items.size(), false);
  for (const Entry& e : layout(m.options, prefix)) {
    auto it = at.find(e.hf);
    if (it == at.end()) bad(w.where, ": missing weight '", e.hf, "' (", cfg, ": ", e.why, ")");
    used[it->second] = true;
    const auto& [t, file] = w.items[it->second].second;
    if (t.sizes() != stored_shape(e))
      bad(file, ": '", e.hf, "' has shape ", shape_str(t.sizes()), " but ", cfg, " (", e.why, ") gives ",
          shape_str(stored_shape(e)));
    if (!is_floating(t.dtype()))
      bad(file, ": '", e.hf, "' is ", dtype_name(t.dtype()), " (weights are float32, bfloat16 or float16)");
    Tensor v = t.to(DType::Float32);
    if (e.transpose) v = v.t();
    m.state.insert(e.ember, v.contiguous());
  }
  for (size_t i = 0; i < w.items.size(); ++i)
    if (!used[i] && !ignorable(w.items[i].first, m.options))
      bad(w.items[i].second.second, ": unexpected tensor '", w.items[i].first, "' (", cfg, " describes a ",
          arch_name(m.options.arch), " model without it)");
  return m;
}

// ---- Writing ----

json config_json(const GPTOptions& o) {
  if (o.n_head <= 0 || o.n_embd % o.n_head != 0)
    bad("config.json: n_embd ", o.n_embd, " is not a multiple of n_head ", o.n_head);
  json j;
  if (o.arch == Arch::GPT2) {
    if (o.n_kv_head != 0 && o.n_kv_head != o.n_head) bad("config.json: GPT-2 has no grouped-query attention");
    j["architectures"] = {"GPT2LMHeadModel"};
    j["model_type"] = "gpt2";
    j["vocab_size"] = o.vocab_size;
    j["n_positions"] = o.block_size;
    j["n_embd"] = o.n_embd;
    j["n_layer"] = o.n_layer;
    j["n_head"] = o.n_head;
    j["n_inner"] = nullptr;
    j["activation_function"] = "gelu_new";
    j["layer_norm_epsilon"] = o.norm_eps;
    j["attn_pdrop"] = o.dropout;
    j["embd_pdrop"] = o.dropout;
    j["resid_pdrop"] = o.dropout;
    j["scale_attn_weights"] = true;
    j["scale_attn_by_inverse_layer_idx"] = false;
    j["reorder_and_upcast_attn"] = false;
    j["add_cross_attention"] = false;
  } else {
    const int64_t D = o.n_embd / o.n_head;
    if (D % 2 != 0) bad("config.json: head width ", D, " is odd (rotary embeddings turn pairs)");
    j["architectures"] = {"LlamaForCausalLM"};
    j["model_type"] = "llama";
    j["vocab_size"] = o.vocab_size;
    j["hidden_size"] = o.n_embd;
    j["intermediate_size"] = o.ffn_width();
    j["num_hidden_layers"] = o.n_layer;
    j["num_attention_heads"] = o.n_head;
    j["num_key_value_heads"] = o.kv_heads();
    j["head_dim"] = D;
    j["hidden_act"] = "silu";
    j["max_position_embeddings"] = o.block_size;
    j["rms_norm_eps"] = o.norm_eps;
    // Both spellings: transformers 4 reads rope_theta / rope_scaling,
    // transformers 5 rope_parameters.
    j["rope_theta"] = o.rope_theta;
    j["rope_scaling"] = nullptr;
    j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", o.rope_theta}};
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
    j["attention_dropout"] = o.dropout;
    j["pretraining_tp"] = 1;
  }
  // No token ids of a tokenizer ember does not know: GPT2Config's default
  // 50256 would lie outside a smaller vocabulary.
  j["bos_token_id"] = nullptr;
  j["eos_token_id"] = nullptr;
  j["tie_word_embeddings"] = o.tie_weights;
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  j["dtype"] = "float32";
  j["torch_dtype"] = "float32";  // transformers 4's name of the field
  return j;
}

std::vector<std::pair<std::string, Tensor>> hf_items(const StateDict& state, const GPTOptions& o) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const Entry& e : layout(o)) {
    const Tensor* t = state.find(e.ember);
    if (!t) bad("state dict: missing '", e.ember, "' (a ", arch_name(o.arch), " model with ", e.why, ")");
    if (t->sizes() != e.shape)
      bad("state dict: '", e.ember, "' has shape ", shape_str(t->sizes()), ", the options (", e.why, ") give ",
          shape_str(e.shape));
    Tensor v = t->detach().to(kCPU);
    if (e.transpose) v = v.t();
    out.push_back({e.hf, v.contiguous()});
  }
  return out;
}

void write_text(const std::string& path, const std::string& content) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << content;
  out.flush();
  if (!out) bad(path, ": write failed");
}

void save_dir(const StateDict& state, const GPTOptions& o, const std::string& out_in, const HFSaveOptions& save) {
  std::string out = out_in;
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  // Everything that can be refused is refused before a byte is written.
  if (fs::exists(out) && (!fs::is_directory(out) || !fs::is_empty(out)))
    bad(out, ": exists and is not an empty directory (export into a new one)");
  const json config = config_json(o);
  const auto items = hf_items(state, o);
  for (const auto& [name, src] : save.extra_files)
    if (!fs::is_regular_file(src)) bad(src, ": no such file (to be copied as ", name, ")");
  const fs::path tmp = out + ".tmp-" + std::to_string(::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  try {
    const std::map<std::string, std::string> meta{{"format", "pt"}};  // from_pretrained requires it
    int64_t total = 0;
    for (const auto& [n, t] : items) total += t.numel() * static_cast<int64_t>(dtype_size(t.dtype()));
    if (save.max_shard_bytes <= 0 || total <= save.max_shard_bytes) {
      if (auto s = save_safetensors((tmp / "model.safetensors").string(), items, meta); !s.ok()) bad(s.message());
    } else {
      // transformers' sharding: tensors in order, a new shard when the next
      // one would pass the limit (a tensor larger than it gets its own).
      std::vector<std::vector<std::pair<std::string, Tensor>>> shards(1);
      int64_t in_shard = 0;
      for (const auto& it : items) {
        const int64_t b = it.second.numel() * static_cast<int64_t>(dtype_size(it.second.dtype()));
        if (!shards.back().empty() && in_shard + b > save.max_shard_bytes) shards.emplace_back(), in_shard = 0;
        shards.back().push_back(it);
        in_shard += b;
      }
      json index{{"metadata", {{"total_size", total}}}, {"weight_map", json::object()}};
      const size_t n = shards.size();
      for (size_t i = 0; i < n; ++i) {
        char name[64];
        std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, n);
        if (auto s = save_safetensors((tmp / name).string(), shards[i], meta); !s.ok()) bad(s.message());
        for (const auto& [tn, t] : shards[i]) index["weight_map"][tn] = name;
      }
      write_text((tmp / "model.safetensors.index.json").string(), index.dump(2) + "\n");
    }
    write_text((tmp / "config.json").string(), config.dump(2) + "\n");
    for (const auto& [name, src] : save.extra_files) fs::copy_file(src, tmp / name);
    if (fs::exists(out)) fs::remove(out);  // the empty directory checked above
    fs::rename(tmp, out);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
}

template <typename F>
auto guarded(F&& f) -> absl::StatusOr<decltype(f())> {
  try {
    return f();
  } catch (const Bad& b) {
    return absl::InvalidArgumentError(b.msg);
  } catch (const Error& e) {
    return absl::InvalidArgumentError(e.what());
  } catch (const fs::filesystem_error& e) {
    return absl::InternalError(e.what());
  }
}

}  // namespace

absl::StatusOr<GPTOptions> read_hf_config(const std::string& dir) {
  return guarded([&] { return config_of(dir); });
}

absl::StatusOr<HFModel> load_hf_pretrained(const std::string& dir) {
  return guarded([&] { return load_dir(dir); });
}

absl::Status load_hf_into(GPT& model, const std::string& dir) {
  auto hf = load_hf_pretrained(dir);
  if (!hf.ok()) return hf.status();
  const GPTOptions &a = hf->options, &b = model.options;
  // Everything the weights' shapes or the outputs depend on; block_size
  // only for GPT-2, whose position table it sizes (for LLaMA it only bounds
  // the sequence).
  std::vector<std::string> diff;
  auto cmp = [&](const char* what, auto x, auto y) {
    if (x != y) diff.push_back(detail::str_cat(what, " ", x, " (the model's: ", y, ")"));
  };
  cmp("arch", std::string(arch_name(a.arch)), std::string(arch_name(b.arch)));
  cmp("vocab_size", a.vocab_size, b.vocab_size);
  cmp("layers", a.n_layer, b.n_layer);
  cmp("hidden size", a.n_embd, b.n_embd);
  cmp("heads", a.n_head, b.n_head);
  cmp("kv heads", a.kv_heads(), b.kv_heads());
  cmp("ffn width", a.ffn_width(), b.ffn_width());
  cmp("tie_word_embeddings", a.tie_weights, b.tie_weights);
  cmp("norm eps", a.norm_eps, b.norm_eps);
  if (a.arch == Arch::GPT2) cmp("positions", a.block_size, b.block_size);
  if (a.arch == Arch::Llama) cmp("rope_theta", a.rope_theta, b.rope_theta);
  if (!diff.empty()) {
    std::string msg = dir + "/config.json describes another model:";
    for (const auto& d : diff) msg += " " + d + ";";
    msg.pop_back();
    return absl::InvalidArgumentError(msg);
  }
  try {
    model.load_state_dict(hf->state);  // checks every name and shape before copying
  } catch (const Error& e) {
    return absl::InvalidArgumentError(std::string(dir) + ": " + e.what());
  }
  return absl::OkStatus();
}

absl::Status save_hf_pretrained(const StateDict& state, const GPTOptions& options, const std::string& out_dir,
                                const HFSaveOptions& save) {
  return guarded([&] {
           save_dir(state, options, out_dir, save);
           return true;
         })
      .status();
}

absl::Status save_hf_pretrained(const GPT& model, const std::string& out_dir, const HFSaveOptions& save) {
  return save_hf_pretrained(model.state_dict(), model.options, out_dir, save);
}

absl::StatusOr<std::string> hf_config_json(const GPTOptions& options) {
  return guarded([&] { return config_json(options).dump(2) + "\n"; });
}

absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> to_hf_state(const StateDict& state,
                                                                        const GPTOptions& options) {
  return guarded([&] { return hf_items(state, options); });
}

std::string gpt_options_to_json(const GPTOptions& o) {
  json j{{"arch", arch_name(o.arch)},  {"vocab_size", o.vocab_size}, {"block_size", o.block_size},
         {"n_layer", o.n_layer},       {"n_head", o.n_head},         {"n_embd", o.n_embd},
         {"n_kv_head", o.n_kv_head},   {"ffn_hidden", o.ffn_hidden}, {"ffn_multiple_of", o.ffn_multiple_of},
         {"rope_theta", o.rope_theta}, {"norm_eps", o.norm_eps},     {"tie_weights", o.tie_weights},
         {"dropout", o.dropout}};
  return j.dump();
}

absl::StatusOr<GPTOptions> gpt_options_from_json(const std::string& text_in, const std::string& source) {
  return guarded([&] {
    const json j = parse_json(text_in, source);
    GPTOptions o;
    const std::string arch = text(j, source, "arch", "");
    if (arch == "llama")
      o.arch = Arch::Llama;
    else if (arch != "gpt2")
      bad(source, ": arch '", arch, "' (expected 'gpt2' or 'llama')");
    for (const char* key : {"vocab_size", "block_size", "n_layer", "n_head", "n_embd"})
      if (!present(j, key)) bad(source, ": missing ", key);
    o.vocab_size = integer(j, source, "vocab_size", 0);
    o.block_size = integer(j, source, "block_size", 0);
    o.n_layer = integer(j, source, "n_layer", 0);
    o.n_head = integer(j, source, "n_head", 0);
    o.n_embd = integer(j, source, "n_embd", 0);
    // 0 means "the default" for these three: not positive integers.
    auto count = [&](const char* key, int64_t def) {
      if (!present(j, key)) return def;
      if (!j.at(key).is_number_integer() || j.at(key).get<int64_t>() < 0)
        bad(source, ": ", key, " must be a non-negative integer, got ", j.at(key).dump());
      return j.at(key).get<int64_t>();
    };
    o.n_kv_head = count("n_kv_head", 0);
    o.ffn_hidden = count("ffn_hidden", 0);
    o.ffn_multiple_of = count("ffn_multiple_of", o.ffn_multiple_of);
    o.rope_theta = number(j, source, "rope_theta", o.rope_theta);
    o.norm_eps = number(j, source, "norm_eps", o.norm_eps);
    o.tie_weights = boolean(j, source, "tie_weights", false);
    o.dropout = number(j, source, "dropout", 0.0);
    return o;
  });
}

}  // namespace ember::nn
