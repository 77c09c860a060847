// Hugging Face checkpoints (nn/hf.h) against transformers itself: the
// committed fixture (nn/testdata/hf/, made by make_fixture.py) holds a tiny
// random GPT2LMHeadModel and LlamaForCausalLM (4 heads over 2 kv heads,
// vocab 37) as save_pretrained wrote them and the logits transformers
// computed; ember loads both and must give those logits (float32, relative
// error <= 1e-5). Then: the export round trip gives the very tensors
// transformers wrote, sharded directories load, and each kind of bad input
// is a named error that changes nothing. The full comparison, both ways,
// against a live transformers is tools/hf_compare.py (//tools:hf_compare_test).
#include "nn/hf.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "core/ops.h"
#include "core/safetensors.h"
#include "nn/transformer.h"

namespace ember::nn {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

const std::string kFixture = "nn/testdata/hf";

std::string tmp_dir(const std::string& name) {
  const char* t = std::getenv("TEST_TMPDIR");
  const fs::path d = fs::path(t ? t : "/tmp") / ("hf_test_" + name);
  fs::remove_all(d);
  return d.string();
}

// A writable copy of one fixture model.
std::string copy_fixture(const std::string& model, const std::string& name) {
  const std::string d = tmp_dir(name);
  fs::copy(kFixture + "/" + model, d, fs::copy_options::recursive);
  for (auto& e : fs::directory_iterator(d)) fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add);
  return d;
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}
void write_json(const std::string& path, const json& j) { std::ofstream(path) << j.dump(2); }

// max |a - b| / max |b|: the error relative to the logits' scale.
double rel_error(const Tensor& a, const Tensor& b) {
  const Tensor d = abs(a.to(DType::Float64) - b.to(DType::Float64));
  return max(d).item() / max(abs(b.to(DType::Float64))).item();
}

// Bit for bit.
bool equal(const Tensor& a, const Tensor& b) {
  return a.sizes() == b.sizes() && a.dtype() == b.dtype() && allclose(a, b, 0.0, 0.0);
}

Tensor expected(const std::string& name) {
  auto f = load_safetensors(kFixture + "/expected.safetensors");
  EXPECT_TRUE(f.ok()) << f.status().message();
  const Tensor* t = f->find(name);
  EXPECT_NE(t, nullptr) << name;
  return *t;
}

TEST(HF, LogitsEqualTransformers) {
  const Tensor ids = expected("ids");
  for (const std::string model : {"gpt2", "llama"}) {
    auto hf = load_hf_pretrained(kFixture + "/" + model);
    ASSERT_TRUE(hf.ok()) << hf.status().message();
    GPT gpt(hf->options);
    gpt.load_state_dict(hf->state);
    gpt.eval();
    const Tensor want = expected(model + ".logits");
    const Tensor got = gpt(ids);
    ASSERT_EQ(got.sizes(), want.sizes());
    const double rel = rel_error(got, want);
    std::printf("%s: logits %s, max relative error vs transformers %.3g\n", model.c_str(),
                shape_str(got.sizes()).c_str(), rel);
    EXPECT_LE(rel, 1e-5) << model;
    EXPECT_TRUE(allclose(got, want, 1e-4, 1e-5)) << model;
  }
}

TEST(HF, ConfigGivesTheOptions) {
  auto g = read_hf_config(kFixture + "/gpt2");
  ASSERT_TRUE(g.ok()) << g.status().message();
  EXPECT_EQ(g->arch, Arch::GPT2);
  EXPECT_EQ(g->vocab_size, 37);
  EXPECT_EQ(g->block_size, 24);
  EXPECT_EQ(g->n_embd, 32);
  EXPECT_TRUE(g->tie_weights);
  auto l = read_hf_config(kFixture + "/llama");
  ASSERT_TRUE(l.ok()) << l.status().message();
  EXPECT_EQ(l->arch, Arch::Llama);
  EXPECT_EQ(l->n_head, 4);
  EXPECT_EQ(l->kv_heads(), 2);
  EXPECT_EQ(l->ffn_width(), 44);
  EXPECT_EQ(l->rope_theta, 5000.0);
  EXPECT_EQ(l->norm_eps, 1e-6);
  EXPECT_EQ(l->block_size, 32);
  EXPECT_FALSE(l->tie_weights);
}

// The loaded state is GPT::state_dict() name for name, shape for shape, in order.
TEST(HF, StateHasTheModelsNamesInOrder) {
  for (const std::string model : {"gpt2", "llama"}) {
    auto hf = load_hf_pretrained(kFixture + "/" + model);
    ASSERT_TRUE(hf.ok()) << hf.status().message();
    const StateDict mine = GPT(hf->options).state_dict();
    ASSERT_EQ(mine.size(), hf->state.size()) << model;
    for (size_t i = 0; i < mine.size(); ++i) {
      EXPECT_EQ(mine.items()[i].first, hf->state.items()[i].first);
      EXPECT_EQ(mine.items()[i].second.sizes(), hf->state.items()[i].second.sizes()) << mine.items()[i].first;
    }
  }
}

// Export gives back the very tensors transformers wrote, under its names.
TEST(HF, ExportRoundTripIsExact) {
  for (const std::string model : {"gpt2", "llama"}) {
    auto hf = load_hf_pretrained(kFixture + "/" + model);
    ASSERT_TRUE(hf.ok());
    GPT gpt(hf->options);
    gpt.load_state_dict(hf->state);
    const std::string out = tmp_dir("export_" + model);
    ASSERT_TRUE(save_hf_pretrained(gpt, out).ok());
    auto theirs = load_safetensors(kFixture + "/" + model + "/model.safetensors");
    auto ours = load_safetensors(out + "/model.safetensors");
    ASSERT_TRUE(theirs.ok() && ours.ok());
    EXPECT_EQ(ours->metadata.at("format"), "pt");
    ASSERT_EQ(ours->tensors.size(), theirs->tensors.size()) << model;
    for (const auto& [name, t] : theirs->tensors) {
      const Tensor* o = ours->find(name);
      ASSERT_NE(o, nullptr) << name;
      EXPECT_EQ(o->sizes(), t.sizes()) << name;
      EXPECT_TRUE(equal(*o, t)) << name;
    }
    auto back = read_hf_config(out);
    ASSERT_TRUE(back.ok()) << back.status().message();
    EXPECT_EQ(gpt_options_to_json(*back), gpt_options_to_json(hf->options));
    // Into a directory that exists and is not empty: refused, nothing written.
    const auto s = save_hf_pretrained(gpt, out);
    EXPECT_NE(std::string(s.message()).find("exists and is not an empty directory"), std::string::npos) << s.message();
  }
}

TEST(HF, ShardedDirectoriesLoad) {
  auto hf = load_hf_pretrained(kFixture + "/llama");
  ASSERT_TRUE(hf.ok());
  const std::string out = tmp_dir("sharded");
  const std::string tok = tmp_dir("tokenizer.json");
  std::ofstream(tok) << "{\"model\": {}}";
  ASSERT_TRUE(save_hf_pretrained(hf->state, hf->options, out,
                                 {.max_shard_bytes = 20000, .extra_files = {{"tokenizer.json", tok}}})
                  .ok());
  EXPECT_FALSE(fs::exists(out + "/model.safetensors"));
  EXPECT_TRUE(fs::exists(out + "/tokenizer.json"));
  const json index = read_json(out + "/model.safetensors.index.json");
  EXPECT_TRUE(index["weight_map"].contains("model.layers.1.mlp.down_proj.weight"));
  int shards = 0;
  for (auto& e : fs::directory_iterator(out)) shards += e.path().filename().string().rfind("model-", 0) == 0;
  EXPECT_GE(shards, 3);
  auto back = load_hf_pretrained(out);
  ASSERT_TRUE(back.ok()) << back.status().message();
  ASSERT_EQ(back->state.size(), hf->state.size());
  for (const auto& [name, t] : hf->state) EXPECT_TRUE(equal(*back->state.find(name), t)) << name;
  // A shard the index names, gone: the missing file is named.
  fs::remove(out + "/model-00002-of-0000" + std::to_string(shards) + ".safetensors");
  auto gone = load_hf_pretrained(out);
  ASSERT_FALSE(gone.ok());
  EXPECT_NE(std::string(gone.status().message()).find("model-00002-of-"), std::string::npos) << gone.status().message();
}

// Into an existing model: another model's options are named, field by
// field, and the model keeps its weights.
TEST(HF, LoadIntoChecksTheModel) {
  auto opts = read_hf_config(kFixture + "/llama");
  ASSERT_TRUE(opts.ok());
  GPT same(*opts);
  EXPECT_TRUE(load_hf_into(same, kFixture + "/llama").ok());
  GPTOptions other = *opts;
  other.n_kv_head = 4;
  other.vocab_size = 40;
  GPT gpt(other);
  const StateDict before = gpt.state_dict();
  std::vector<Tensor> copies;
  for (const auto& [n, t] : before) copies.push_back(t.clone());
  const auto s = load_hf_into(gpt, kFixture + "/llama");
  ASSERT_FALSE(s.ok());
  const std::string m(s.message());
  EXPECT_NE(m.find("config.json describes another model"), std::string::npos) << m;
  EXPECT_NE(m.find("vocab_size 37 (the model's: 40)"), std::string::npos) << m;
  EXPECT_NE(m.find("kv heads 2 (the model's: 4)"), std::string::npos) << m;
  size_t i = 0;
  for (const auto& [n, t] : gpt.state_dict()) EXPECT_TRUE(equal(t, copies[i++])) << n;
}

// Each kind of bad input: the message names the file, the field or
// tensor, and what is supported.
struct BadCase {
  std::string model, what;
  std::function<void(const std::string& dir)> damage;
  std::vector<std::string> says;
};

void edit_config(const std::string& dir, const std::function<void(json&)>& f) {
  json j = read_json(dir + "/config.json");
  f(j);
  write_json(dir + "/config.json", j);
}

void edit_weights(const std::string& dir, const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& f) {
  auto w = load_safetensors(dir + "/model.safetensors");
  ASSERT_TRUE(w.ok());
  f(w->tensors);
  ASSERT_TRUE(save_safetensors(dir + "/model.safetensors", w->tensors, {{"format", "pt"}}).ok());
}

TEST(HF, BadInputIsANamedError) {
  const std::vector<BadCase> cases = {
      {"llama",
       "rope_scaling",
       [](const std::string& d) {
         edit_config(d, [](json& j) {
           j.erase("rope_parameters");
           j["rope_theta"] = 10000.0;
           j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
         });
       },
       {"config.json", "rope_scaling rope_type 'llama3' is not supported", "rope_type 'default'"}},
      {"llama",
       "rope_parameters",
       [](const std::string& d) {
         edit_config(d, [](json& j) { j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 5000.0}}; });
       },
       {"config.json", "rope_parameters rope_type 'yarn' is not supported"}},
      {"llama",
       "sliding_window",
       [](const std::string& d) { edit_config(d, [](json& j) { j["sliding_window"] = 4096; }); },
       {"config.json", "sliding_window 4096 is not supported", "must be null or absent"}},
      {"llama",
       "model_type",
       [](const std::string& d) { edit_config(d, [](json& j) { j["model_type"] = "mistral"; }); },
       {"config.json", "model_type 'mistral' is not supported", "'gpt2'", "'llama'"}},
      {"llama",
       "head_dim",
       [](const std::string& d) { edit_config(d, [](json& j) { j["head_dim"] = 16; }); },
       {"config.json", "head_dim 16 is not supported", "= 8"}},
      {"llama",
       "attention_bias",
       [](const std::string& d) { edit_config(d, [](json& j) { j["attention_bias"] = true; }); },
       {"config.json", "attention_bias true is not supported"}},
      {"llama",
       "hidden_act",
       [](const std::string& d) { edit_config(d, [](json& j) { j["hidden_act"] = "gelu"; }); },
       {"config.json", "hidden_act 'gelu' is not supported", "'silu'"}},
      {"gpt2",
       "activation_function",
       [](const std::string& d) { edit_config(d, [](json& j) { j["activation_function"] = "relu"; }); },
       {"config.json", "activation_function 'relu' is not supported", "'gelu_new'"}},
      {"llama",
       "missing weight",
       [](const std::string& d) {
         edit_weights(d, [](auto& w) {
           std::erase_if(w, [](const auto& p) { return p.first == "model.layers.1.mlp.up_proj.weight"; });
         });
       },
       {"model.safetensors: missing weight 'model.layers.1.mlp.up_proj.weight'", "intermediate_size 44"}},
      {"gpt2",
       "bad shape (config)",
       [](const std::string& d) { edit_config(d, [](json& j) { j["n_positions"] = 32; }); },
       {"model.safetensors: 'transformer.wpe.weight' has shape [24,32] but", "config.json (n_positions 32, n_embd 32)",
        "gives [32,32]"}},
      {"llama",
       "bad shape (kv heads)",
       [](const std::string& d) { edit_config(d, [](json& j) { j["num_key_value_heads"] = 4; }); },
       {"'model.layers.0.self_attn.k_proj.weight' has shape [16,32]", "num_key_value_heads 4 x head_dim 8",
        "gives [32,32]"}},
      {"llama",
       "unexpected tensor",
       [](const std::string& d) {
         edit_weights(d, [](auto& w) { w.push_back({"model.layers.0.self_attn.q_proj.bias", zeros({32})}); });
       },
       {"model.safetensors: unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"}},
      {"llama",
       "no weights",
       [](const std::string& d) { fs::remove(d + "/model.safetensors"); },
       {"no model.safetensors or model.safetensors.index.json"}},
      {"llama",
       "invalid JSON",
       [](const std::string& d) { std::ofstream(d + "/config.json") << "{\"model_type\": "; },
       {"config.json: invalid JSON"}},
  };
  int n = 0;
  for (const BadCase& c : cases) {
    const std::string dir = copy_fixture(c.model, "bad" + std::to_string(n++));
    c.damage(dir);
    auto r = load_hf_pretrained(dir);
    ASSERT_FALSE(r.ok()) << c.what;
    const std::string m(r.status().message());
    std::printf("%s: %s\n", c.what.c_str(), m.c_str());
    for (const std::string& s : c.says) EXPECT_NE(m.find(s), std::string::npos) << c.what << ": " << m;
    // load_hf_into: the same error, the model unchanged.
    auto opts = read_hf_config(kFixture + "/" + c.model);
    GPT gpt(*opts);
    const Tensor w = gpt.state_dict().items()[0].second.clone();
    EXPECT_FALSE(load_hf_into(gpt, dir).ok()) << c.what;
    EXPECT_TRUE(equal(gpt.state_dict().items()[0].second, w)) << c.what;
  }
}

// Other spellings of the same models: GPT-2 saved from GPT2Model (no
// "transformer." prefix, the causal-mask buffers older transformers kept,
// as the original openai-community/gpt2 files) and a LLaMA config.json as
// transformers 4 writes it (rope_theta and rope_scaling null, no
// rope_parameters): the same logits.
TEST(HF, OlderSpellingsLoadAlike) {
  const Tensor ids = expected("ids");
  const std::string g = copy_fixture("gpt2", "unprefixed");
  edit_weights(g, [](auto& w) {
    for (auto& [name, t] : w) name = name.substr(std::string("transformer.").size());
    w.push_back({"h.0.attn.bias", ones({1, 1, 24, 24})});
    w.push_back({"h.1.attn.masked_bias", full({}, -1e4)});
  });
  const std::string l = copy_fixture("llama", "transformers4");
  edit_config(l, [](json& j) {
    j.erase("rope_parameters");
    j["rope_theta"] = 5000.0;
    j["rope_scaling"] = nullptr;
    j.erase("head_dim");
  });
  for (const auto& [dir, model] : {std::pair{g, "gpt2"}, std::pair{l, "llama"}}) {
    auto hf = load_hf_pretrained(dir);
    ASSERT_TRUE(hf.ok()) << hf.status().message();
    GPT gpt(hf->options);
    gpt.load_state_dict(hf->state);
    EXPECT_LE(rel_error(gpt(ids), expected(std::string(model) + ".logits")), 1e-5) << model;
  }
}

TEST(HF, OptionsJsonRoundTrip) {
  GPTOptions o = GPTOptions::llama({.vocab_size = 91, .block_size = 48, .n_layer = 3, .n_head = 6, .n_embd = 48});
  o.n_kv_head = 2;
  o.ffn_hidden = 100;
  o.rope_theta = 500000.0;
  o.norm_eps = 1e-6;
  o.tie_weights = true;
  auto back = gpt_options_from_json(gpt_options_to_json(o), "test");
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(gpt_options_to_json(*back), gpt_options_to_json(o));
  EXPECT_EQ(back->ffn_width(), 100);
  auto bad = gpt_options_from_json(R"({"arch": "gpt3", "vocab_size": 3})", "trainer.json extra.model");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("trainer.json extra.model: arch 'gpt3'"), std::string::npos);
}

// Tied and untied heads of both families survive export and load; the
// tied head is not written (transformers ties it on load).
TEST(HF, TyingBothWays) {
  for (bool llama : {false, true})
    for (bool tie : {false, true}) {
      GPTOptions o{.vocab_size = 29, .block_size = 12, .n_layer = 1, .n_head = 2, .n_embd = 16, .tie_weights = tie};
      if (llama) o = GPTOptions::llama(o), o.n_kv_head = 1, o.ffn_hidden = 24;
      manual_seed(5);
      GPT gpt(o);
      const std::string out = tmp_dir(std::string("tie_") + (llama ? "l" : "g") + (tie ? "1" : "0"));
      ASSERT_TRUE(save_hf_pretrained(gpt, out).ok());
      auto f = load_safetensors(out + "/model.safetensors");
      ASSERT_TRUE(f.ok());
      EXPECT_EQ(f->find("lm_head.weight") != nullptr, !tie);
      auto back = load_hf_pretrained(out);
      ASSERT_TRUE(back.ok()) << back.status().message();
      EXPECT_EQ(back->options.tie_weights, tie);
      GPT again(back->options);
      again.load_state_dict(back->state);
      const Tensor ids = Tensor::from_vector({1, 5, 28, 0, 7}, {1, 5}, DType::Int64);
      EXPECT_TRUE(equal(again(ids), gpt(ids)));
    }
}

}  // namespace
}  // namespace ember::nn
