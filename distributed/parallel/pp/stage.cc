// Cutting models into pipeline stages (stage.h).
#include "distributed/parallel/pp/stage.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <unordered_set>

#include "core/exception.h"
#include "core/ops.h"

namespace ember::distributed::pp {
namespace {

// A named container whose children are held, not run in order: a stage's
// "h" (blocks 3, 4, 5 of the model's h) keeps the original numbering.
class ModuleDict : public nn::Module {
 public:
  ModuleDict() : Module("ModuleDict") {}
  Tensor forward(const Tensor&) override {
    EMBER_CHECK(false, "ModuleDict: a pipeline stage's container is not called; its stage runs its children");
    return Tensor();
  }
  void add(const std::string& name, std::shared_ptr<nn::Module> m) { register_module(name, std::move(m)); }
};

std::string range_text(const std::string& prefix, int from, int count) {
  if (count == 1) return prefix + std::to_string(from);
  return prefix + std::to_string(from) + "-" + prefix + std::to_string(from + count - 1);
}

// The given split checked, or a balanced one.
std::vector<int> resolve_split(std::vector<int> given, const std::vector<int64_t>& unit_params, int num_stages,
                               const char* what, const char* unit) {
  const int units = static_cast<int>(unit_params.size());
  EMBER_CHECK(num_stages >= 1, "pipeline split: the number of stages must be at least 1, got ", num_stages);
  if (given.empty()) return balance_by_params(unit_params, num_stages);
  EMBER_CHECK(static_cast<int>(given.size()) == num_stages, "pipeline split of ", what, ": ", given.size(),
              " counts given for ", num_stages, " stages");
  int total = 0;
  for (size_t s = 0; s < given.size(); ++s) {
    EMBER_CHECK(given[s] >= 1, "pipeline split of ", what, ": stage ", s, " gets ", given[s], " ", unit,
                "s; every stage needs at least one");
    total += given[s];
  }
  EMBER_CHECK(total == units, "pipeline split of ", what, ": the stages' counts add up to ", total, " ", unit,
              "s but the model has ", units, "; every ", unit, " must land in exactly one stage");
  return given;
}

}  // namespace

PipelineStage::PipelineStage(int index, int num_stages, std::string description, ForwardFn fn)
    : Module("PipelineStage"),
      index_(index),
      num_stages_(num_stages),
      description_("stage " + std::to_string(index) + " of " + std::to_string(num_stages) + ": " +
                   std::move(description)),
      fn_(std::move(fn)) {}

void PipelineStage::hold(const std::string& name, std::shared_ptr<nn::Module> m) {
  const auto dot = name.find('.');
  if (dot == std::string::npos) {
    register_module(name, std::move(m));
    return;
  }
  const std::string head = name.substr(0, dot);
  std::shared_ptr<ModuleDict> dict;
  for (auto& [n, child] : named_children())
    if (n == head) dict = std::dynamic_pointer_cast<ModuleDict>(child);
  if (!dict) dict = register_module(head, std::make_shared<ModuleDict>());
  dict->add(name.substr(dot + 1), std::move(m));
}

std::shared_ptr<nn::Module> rank_part(const std::vector<std::shared_ptr<PipelineStage>>& stages) {
  EMBER_CHECK(!stages.empty(), "rank_part: no stages");
  std::string desc;
  for (auto& st : stages) desc += (desc.empty() ? "" : " + ") + st->description();
  auto part = std::make_shared<PipelineStage>(
      stages.front()->index(), stages.front()->num_stages(), desc, [](PipelineStage& self, const Tensor&) -> Tensor {
        EMBER_CHECK(false, "pipeline: ", self.description(), " is a rank's part of the model, not a stage to run");
        return Tensor();
      });
  std::unordered_set<std::string> held;
  for (auto& st : stages)
    for (auto& [name, child] : st->named_children()) {
      if (auto dict = std::dynamic_pointer_cast<ModuleDict>(child)) {
        for (auto& [n, m] : dict->named_children())
          if (held.insert(name + "." + n).second) part->hold(name + "." + n, m);
      } else if (held.insert(name).second) {
        part->hold(name, child);
      }
    }
  return part;
}

std::vector<int> balance_by_params(const std::vector<int64_t>& unit_params, int stages) {
  const int n = static_cast<int>(unit_params.size());
  EMBER_CHECK(stages >= 1 && n >= stages, "pipeline split: ", n, " layer(s) cannot fill ", stages,
              " stages (every stage needs at least one)");
  std::vector<int64_t> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + unit_params[i];
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  // best[s][i]: the least largest stage over the first i units in s stages.
  std::vector<std::vector<int64_t>> best(stages + 1, std::vector<int64_t>(n + 1, kInf));
  std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s)
    for (int i = s; i <= n; ++i)
      for (int j = s - 1; j < i; ++j) {
        if (best[s - 1][j] == kInf) continue;
        const int64_t v = std::max(best[s - 1][j], prefix[i] - prefix[j]);
        if (v < best[s][i]) best[s][i] = v, cut[s][i] = j;
      }
  std::vector<int> counts(stages);
  for (int s = stages, i = n; s >= 1; --s) {
    counts[s - 1] = i - cut[s][i];
    i = cut[s][i];
  }
  return counts;
}

std::vector<std::shared_ptr<PipelineStage>> split_gpt(nn::GPT& gpt, int num_stages, std::vector<int> blocks_per_stage) {
  const auto& blocks = gpt.h->named_children();
  std::vector<int64_t> units;
  for (auto& [n, b] : blocks) units.push_back(b->num_parameters());
  if (!units.empty()) {
    units.front() += gpt.wte->num_parameters() + (gpt.wpe ? gpt.wpe->num_parameters() : 0);
    units.back() += gpt.ln_f->num_parameters() + (gpt.options.tie_weights ? 0 : gpt.lm_head->num_parameters());
  }
  const std::vector<int> split = resolve_split(std::move(blocks_per_stage), units, num_stages, "GPT", "block");
  std::vector<std::shared_ptr<PipelineStage>> out;
  int first = 0;
  for (int s = 0; s < num_stages; ++s) {
    const bool is_first = s == 0, is_last = s == num_stages - 1;
    const int from = first, n = split[s];
    first += n;
    std::string desc = range_text("h.", from, n);
    if (is_first) desc = (gpt.wpe ? "wte, wpe, " : "wte, ") + desc;
    if (is_last) desc += ", ln_f, lm_head";
    // The blocks run in order; the first stage embeds, the last normalises
    // and projects to the vocabulary (GPT::forward, cut).
    std::vector<std::shared_ptr<nn::Module>> mine;
    for (int i = from; i < from + n; ++i) mine.push_back(blocks[i].second);
    // Only what this stage runs: the other stages' modules must not stay
    // alive through it (a rank keeps its stages, not the whole model).
    auto wte = is_first ? gpt.wte : nullptr, wpe = is_first ? gpt.wpe : nullptr;
    auto drop = is_first ? gpt.drop : nullptr;
    auto ln_f = is_last ? gpt.ln_f : nullptr;
    auto head = is_last ? gpt.lm_head : nullptr;
    const int64_t block_size = gpt.options.block_size;
    auto fn = [=](PipelineStage& st, const Tensor& in) {
      Tensor x = in;
      if (is_first) {
        EMBER_CHECK(in.dim() == 2, "pipeline stage 0 (GPT embeddings): expected token ids [batch, seq], got ",
                    shape_str(in.sizes()));
        const int64_t T = in.size(1);
        EMBER_CHECK(T <= block_size, "GPT: sequence length ", T, " exceeds block_size ", block_size);
        x = (*wte)(in);
        if (wpe) x = x + (*wpe)(st.positions_for(T, in.device()));
        x = (*drop)(x);
      }
      for (auto& b : mine) x = (*b)(x);
      if (is_last) x = (*head)((*ln_f)(x));
      return x;
    };
    auto stage = std::make_shared<PipelineStage>(s, num_stages, desc, fn);
    if (is_first) {
      stage->hold("wte", gpt.wte);
      if (gpt.wpe) stage->hold("wpe", gpt.wpe);
      stage->hold("drop", gpt.drop);
    }
    for (int i = from; i < from + n; ++i) stage->hold("h." + blocks[i].first, blocks[i].second);
    if (is_last) {
      stage->hold("ln_f", gpt.ln_f);
      stage->hold("lm_head", gpt.lm_head);
      // The tied head reads the embedding's weight: this stage holds it too.
      if (gpt.options.tie_weights && !is_first) stage->hold("wte", gpt.wte);
    }
    if (gpt.options.tie_weights && num_stages > 1 && (is_first || is_last))
      stage->tied.push_back({"wte.weight", {0, num_stages - 1}});
    out.push_back(stage);
  }
  return out;
}

std::vector<std::shared_ptr<PipelineStage>> split_sequential(nn::Sequential& seq, int num_stages,
                                                             std::vector<int> layers_per_stage) {
  const auto& layers = seq.named_children();
  std::vector<int64_t> units;
  for (auto& [n, m] : layers) units.push_back(m->num_parameters());
  const std::vector<int> split = resolve_split(std::move(layers_per_stage), units, num_stages, "Sequential", "layer");
  std::vector<std::shared_ptr<PipelineStage>> out;
  int first = 0;
  for (int s = 0; s < num_stages; ++s) {
    std::vector<std::shared_ptr<nn::Module>> mine;
    for (int i = first; i < first + split[s]; ++i) mine.push_back(layers[i].second);
    auto stage = std::make_shared<PipelineStage>(s, num_stages, range_text("", first, split[s]),
                                                 [mine](PipelineStage&, const Tensor& in) {
                                                   Tensor x = in;
                                                   for (auto& m : mine) x = (*m)(x);
                                                   return x;
                                                 });
    for (int i = first; i < first + split[s]; ++i) stage->hold(layers[i].first, layers[i].second);
    first += split[s];
    out.push_back(stage);
  }
  return out;
}

}  // namespace ember::distributed::pp
