// Hugging Face checkpoints: a GPT-2 (GPT2LMHeadModel) or LLaMA
// (LlamaForCausalLM) directory as transformers' save_pretrained writes it
// — config.json plus model.safetensors, or model-0000i-of-0000n.safetensors
// shards with model.safetensors.index.json — read into nn::GPT's options
// and state dict, and an nn::GPT written back in that layout, which
// from_pretrained loads.
//
//   auto hf = nn::load_hf_pretrained("gpt2-dir");      // StatusOr<HFModel>
//   nn::GPT model(hf->options);
//   model.load_state_dict(hf->state);
//   ... or into an existing model: nn::load_hf_into(model, "gpt2-dir");
//   nn::save_hf_pretrained(model, "out-dir");          // config.json + model.safetensors
//
// The mapping (ember name <- Hugging Face name):
//   GPT-2  wte, wpe, ln_f          <- transformer.wte, transformer.wpe, transformer.ln_f
//          h.N.ln_1, h.N.ln_2      <- transformer.h.N.ln_1, transformer.h.N.ln_2
//          h.N.attn.in_proj_*      <- transformer.h.N.attn.c_attn.*    (weight transposed)
//          h.N.attn.out_proj.*     <- transformer.h.N.attn.c_proj.*    (weight transposed)
//          h.N.mlp.c_fc/c_proj.*   <- transformer.h.N.mlp.c_fc/c_proj.* (weights transposed)
//          lm_head                 <- lm_head (absent when tied to wte)
//   GPT-2's Linear layers are Conv1D, which store [in, out]: each weight is
//   transposed both ways. c_attn's columns are q, k, v, so its transpose is
//   the stacked [3E, E] in_proj_weight as it is. The "transformer." prefix
//   is optional on load (checkpoints saved from GPT2Model have none).
//   LLaMA  wte                     <- model.embed_tokens
//          h.N.ln_1, h.N.ln_2      <- model.layers.N.input_layernorm, .post_attention_layernorm
//          h.N.attn.{q,k,v,o}_proj <- model.layers.N.self_attn.{q,k,v,o}_proj
//          h.N.mlp.{gate,up,down}_proj <- model.layers.N.mlp.{gate,up,down}_proj
//          ln_f, lm_head           <- model.norm, lm_head (absent when tied)
//   No q/k permutation: ember's rotary embedding is Hugging Face's
//   rotate-half applied to the rows as Hugging Face stores them. (The
//   permutation transformers' convert_llama_weights_to_hf.py applies turns
//   Meta's original interleaved-pair layout into that one; a checkpoint on
//   the Hub already has it.)
//
// What ember cannot represent is a named error naming the file, the field
// and what is supported: another model_type, rope scaling (rope_type other
// than "default"), sliding-window attention, biases in LLaMA's projections,
// another activation, a head_dim other than hidden_size / heads; a missing
// weight, a tensor of a shape config.json does not give, an unexpected
// tensor. Loading reads and checks everything before it returns (or, into
// a model, before it changes anything). Weights stored in bfloat16 or
// float16 are widened to float32.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nn/module.h"
#include "nn/transformer.h"

namespace ember::nn {

struct HFModel {
  GPTOptions options;
  StateDict state;  // ember's names, float32 CPU tensors, state_dict() order
};

// config.json of `dir` read and checked: the options of the model it
// describes. Dropout is 0 (Hugging Face's *_pdrop are training settings
// of the original run; set options.dropout to train with one).
absl::StatusOr<GPTOptions> read_hf_config(const std::string& dir);

// config.json and the weights (model.safetensors, or the shards
// model.safetensors.index.json names) read, checked and renamed.
absl::StatusOr<HFModel> load_hf_pretrained(const std::string& dir);

// Loads `dir` into `model`, whose options must describe the same model
// (family, sizes, heads, tying; an error names each field that differs).
// On error the model is unchanged. Call it on the whole model, before any
// parallelization transforms it.
absl::Status load_hf_into(GPT& model, const std::string& dir);

struct HFSaveOptions {
  // > 0: write model-0000i-of-0000n.safetensors files of at most about
  // this many bytes each plus model.safetensors.index.json (transformers'
  // max_shard_size); 0: one model.safetensors.
  int64_t max_shard_bytes = 0;
  // Files copied into the output as they are: output name -> source path
  // (a run's tokenizer.json).
  std::map<std::string, std::string> extra_files;
};

// Writes config.json and the weights of `state` (ember's names, as
// GPT::state_dict() gives them, on any device) for a GPT with `options`,
// in Hugging Face's names and layout, into `out_dir`. The directory is
// assembled beside it and renamed into place: `out_dir` must not exist or
// be empty, and an error leaves it as it was.
absl::Status save_hf_pretrained(const StateDict& state, const GPTOptions& options, const std::string& out_dir,
                                const HFSaveOptions& save = {});
absl::Status save_hf_pretrained(const GPT& model, const std::string& out_dir, const HFSaveOptions& save = {});

// The config.json describing `options` (GPT2LMHeadModel or
// LlamaForCausalLM). Every model nn::GPT builds has one (its GPT-2 is
// always the tanh-GELU 4x MLP with biases; its LLaMA has no biases); an
// error for options no GPT could be built from (n_embd not a multiple of
// n_head, an odd LLaMA head width).
absl::StatusOr<std::string> hf_config_json(const GPTOptions& options);

// The state dict in Hugging Face's names and layout (GPT-2's weights
// transposed, the tied lm_head left out), in transformers' order of keys
// as ember lists them. Errors name a missing or mis-shaped ember tensor.
absl::StatusOr<std::vector<std::pair<std::string, Tensor>>> to_hf_state(const StateDict& state,
                                                                        const GPTOptions& options);

// GPTOptions as a JSON object and back: what a training run records in its
// checkpoint so that a tool rebuilds the model (and config.json) from the
// checkpoint alone. `source` names the text in errors.
std::string gpt_options_to_json(const GPTOptions& options);
absl::StatusOr<GPTOptions> gpt_options_from_json(const std::string& json, const std::string& source);

}  // namespace ember::nn
