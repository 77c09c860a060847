// Pipeline stages: a model cut into consecutive parts, each a module that
// holds its layers under their original names, so a stage's state dict is
// the whole model's entries for those layers ("h.5.attn.in_proj_weight"
// stays h.5 on whichever stage holds it) and checkpoints stay
// interchangeable with the unsplit model.
//
//   auto stages = pp::split_gpt(*gpt, /*num_stages=*/4);          // balanced by parameter count
//   auto stages = pp::split_gpt(*gpt, 4, {2, 3, 3, 2});             // blocks per stage, given
//   for (int s : schedule.stages_of(rank)) mine.push_back(stages[s]);
//
// Every layer lands in exactly one stage: a split that does not add up to
// the model's layers is an error naming the counts (Megatron-LM#468 is a
// split that silently dropped some). The first stage of a GPT also holds
// the embeddings, the last the final norm and the LM head; with tied
// weights the last stage holds the token embedding's weight too (under its
// own name, "wte.weight"), and the pipeline sums its two gradients.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/module.h"
#include "nn/transformer.h"

namespace ember::distributed::pp {

// A stage embeds positions itself when it holds GPT-2's wpe (the first);
// context parallelism sets them as on the whole GPT.
class PipelineStage : public nn::Module, public nn::SequencePositions {
 public:
  using ForwardFn = std::function<Tensor(PipelineStage& self, const Tensor& x)>;
  PipelineStage(int index, int num_stages, std::string description, ForwardFn fn);
  Tensor forward(const Tensor& x) override { return fn_(*this, x); }
  int index() const { return index_; }
  int num_stages() const { return num_stages_; }
  bool is_first() const { return index_ == 0; }
  bool is_last() const { return index_ == num_stages_ - 1; }
  // "stage 1 of 4: h.2-h.4" (errors and logs).
  const std::string& description() const { return description_; }
  // Registers `m` under `name` (a path: "h.5" makes or reuses the child "h").
  void hold(const std::string& name, std::shared_ptr<nn::Module> m);
  // Parameters this stage shares with other stages (tied weights), by name,
  // and the stages that hold them: the pipeline sums their gradients.
  struct Tied {
    std::string name;
    std::vector<int> stages;
  };
  std::vector<Tied> tied;

 private:
  int index_, num_stages_;
  std::string description_;
  ForwardFn fn_;
};

// Contiguous parts of `unit_params.size()` units (each with its parameter
// count) over `stages` stages, every stage at least one unit, minimising the
// largest stage's count (ties: earlier stages get fewer, as the first and
// last carry extra layers). Errors when there are fewer units than stages.
std::vector<int> balance_by_params(const std::vector<int64_t>& unit_params, int stages);

// This rank's part of the model: every module its stages hold, under the
// same names, in one module — for state dicts, optimizers and sharded
// checkpoints (a pipeline's ranks hold different tensors; the checkpoint
// records which). Not callable.
std::shared_ptr<nn::Module> rank_part(const std::vector<std::shared_ptr<PipelineStage>>& stages);

// A GPT's stages: blocks_per_stage given (one count per stage, each >= 1,
// adding up to n_layer), or empty to balance by parameter count with the
// embeddings counted on the first stage and the final norm and head on the
// last. The stages share the model's modules (no copies).
std::vector<std::shared_ptr<PipelineStage>> split_gpt(nn::GPT& gpt, int num_stages,
                                                      std::vector<int> blocks_per_stage = {});

// A Sequential's stages, by layers per stage (given or balanced); layer i
// keeps the name "i".
std::vector<std::shared_ptr<PipelineStage>> split_sequential(nn::Sequential& seq, int num_stages,
                                                             std::vector<int> layers_per_stage = {});

}  // namespace ember::distributed::pp
