// gpt_tp_plan (gpt_plan.h): the plan as data, one entry per module kind.
#include "distributed/parallel/tp/gpt_plan.h"

#include <algorithm>
#include <string>
#include <vector>

namespace ember::distributed {

ParallelizePlan gpt_tp_plan(const nn::GPT& model, bool sp) {
  // Where a TP region is entered from, and what a row-parallel layer leaves.
  const Placement act = sp ? Shard(1) : Replicate();
  // GPT-2 and LLaMA blocks differ only in names: attention's output
  // projection and the feed-forward's column- and row-parallel layers.
  const bool llama = model.options.arch == nn::Arch::Llama;
  ParallelizePlan plan = {{"wte", RowwiseParallel{.input_layouts = Replicate(), .output_layouts = act}}};
  if (sp) {
    if (!llama) plan.push_back({"wpe", SequenceParallel{.sequence_dim = 0, .input_layouts = Replicate()}});
    plan.push_back({"drop", SequenceParallel{}});
  }
  if (model.options.n_layer > 0) {
    if (sp) plan.push_back({"h.*.ln_1", SequenceParallel{}});
    plan.push_back({"h.*.attn", ColwiseParallel{.input_layouts = act}});
    plan.push_back({llama ? "h.*.attn.o_proj" : "h.*.attn.out_proj", RowwiseParallel{.output_layouts = act}});
    if (sp) plan.push_back({"h.*.ln_2", SequenceParallel{}});
    // The feed-forwards: Megatron's split for dense ones (every block's
    // when there are no experts); an MoE's runs replicated over tp (its
    // router and experts whole on every tp rank, experts split by ep
    // instead), entered from and left to the blocks' layout.
    std::vector<std::string> dense{"h.*"}, experts;
    if (model.options.moe.num_experts > 0) {
      dense.clear();
      for (int64_t i = 0; i < model.options.n_layer; ++i)
        (model.options.is_moe_block(i) ? experts : dense).push_back("h." + std::to_string(i));
    }
    for (const std::string& b : dense) {
      for (const char* col :
           llama ? std::vector<const char*>{".mlp.gate_proj", ".mlp.up_proj"} : std::vector<const char*>{".mlp.c_fc"})
        plan.push_back({b + col, ColwiseParallel{.input_layouts = act}});
      plan.push_back({b + (llama ? ".mlp.down_proj" : ".mlp.c_proj"), RowwiseParallel{.output_layouts = act}});
      if (sp) plan.push_back({b + ".mlp.dropout", SequenceParallel{}});
    }
    if (sp)
      for (const std::string& b : experts) {
        plan.push_back({b + ".mlp", PrepareModuleInput{.input_layouts = act, .desired_input_layouts = Replicate()}});
        plan.push_back({b + ".mlp", PrepareModuleOutput{.output_layouts = Replicate(), .desired_output_layouts = act}});
      }
  }
  if (sp) plan.push_back({"ln_f", SequenceParallel{}});
  plan.push_back({"lm_head", ColwiseParallel{.input_layouts = act, .use_local_output = false}});
  return plan;
}

}  // namespace ember::distributed
