// gpt_tp_plan (gpt_plan.h): the plan as data, one entry per module kind.
#include "distributed/parallel/tp/gpt_plan.h"

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
    for (const char* col : llama ? std::vector<const char*>{"h.*.mlp.gate_proj", "h.*.mlp.up_proj"}
                                 : std::vector<const char*>{"h.*.mlp.c_fc"})
      plan.push_back({col, ColwiseParallel{.input_layouts = act}});
    plan.push_back({llama ? "h.*.mlp.down_proj" : "h.*.mlp.c_proj", RowwiseParallel{.output_layouts = act}});
    if (sp) plan.push_back({"h.*.mlp.dropout", SequenceParallel{}});
  }
  if (sp) plan.push_back({"ln_f", SequenceParallel{}});
  plan.push_back({"lm_head", ColwiseParallel{.input_layouts = act, .use_local_output = false}});
  return plan;
}

}  // namespace ember::distributed
