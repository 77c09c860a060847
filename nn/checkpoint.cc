// Module-level activation checkpointing (checkpoint.h): the wrap is state on
// the module (transform_state "activation_checkpoint"), read by
// Module::operator(), which runs forward() through autograd::checkpoint.
#include "nn/checkpoint.h"

#include <algorithm>
#include <cstdlib>

#include "core/exception.h"

namespace ember::nn {
namespace {

constexpr const char* kKey = "activation_checkpoint";

struct Wrap {
  autograd::SavePolicy save;
  std::string name;
};

}  // namespace

void checkpoint_wrapper(Module& module, autograd::SavePolicy save, std::string name) {
  if (name.empty()) name = module.type_name();
  module.set_transform_state(kKey, std::make_shared<Wrap>(Wrap{std::move(save), "checkpoint_wrapper(" + name + ")"}));
}

void remove_checkpoint_wrapper(Module& module) { module.set_transform_state(kKey, nullptr); }

bool is_checkpointed(const Module& module) { return module.transform_state(kKey) != nullptr; }

ActivationCheckpointing ActivationCheckpointing::parse(const std::string& s) {
  ActivationCheckpointing ac;
  if (s == "none") return ac;
  if (s == "full") {
    ac.mode = Mode::Full;
    return ac;
  }
  if (s == "selective") {
    ac.mode = Mode::Selective;
    return ac;
  }
  if (s.rfind("every:", 0) == 0) {
    const std::string k = s.substr(6);
    char* end = nullptr;
    const long v = k.empty() ? 0 : std::strtol(k.c_str(), &end, 10);
    EMBER_CHECK(!k.empty() && end != nullptr && *end == '\0' && v >= 1 && v <= 1000000, "activation checkpointing: '",
                s, "' needs a whole number of blocks K >= 1 after 'every:'");
    ac.mode = Mode::EveryK;
    ac.every = static_cast<int>(v);
    return ac;
  }
  EMBER_CHECK(false, "activation checkpointing: unknown policy '", s, "'; expected none, full, selective or every:K");
  return ac;
}

std::string ActivationCheckpointing::str() const {
  switch (mode) {
    case Mode::None:
      return "none";
    case Mode::Full:
      return "full";
    case Mode::Selective:
      return "selective";
    case Mode::EveryK:
      return "every:" + std::to_string(every);
  }
  return "none";
}

namespace {
int apply_to(const std::vector<std::pair<std::string, Module*>>& blocks, const ActivationCheckpointing& ac) {
  int wrapped = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const auto& [name, block] = blocks[i];
    bool wrap = false;
    autograd::SavePolicy save;
    switch (ac.mode) {
      case ActivationCheckpointing::Mode::None:
        break;
      case ActivationCheckpointing::Mode::Full:
        wrap = true;
        break;
      case ActivationCheckpointing::Mode::Selective:
        wrap = true;
        save = autograd::save_compute_intensive();
        break;
      case ActivationCheckpointing::Mode::EveryK:
        wrap = (i + 1) % static_cast<size_t>(ac.every) == 0;
        break;
    }
    if (!wrap) continue;
    checkpoint_wrapper(*block, save, name);
    ++wrapped;
  }
  return wrapped;
}
}  // namespace

int apply_activation_checkpointing(const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& blocks,
                                   const ActivationCheckpointing& ac) {
  std::vector<std::pair<std::string, Module*>> raw;
  for (const auto& [n, m] : blocks) raw.emplace_back(n, m.get());
  return apply_to(raw, ac);
}

int apply_activation_checkpointing(Module& root, const std::vector<std::string>& block_types,
                                   const ActivationCheckpointing& ac) {
  std::vector<std::pair<std::string, Module*>> blocks;
  for (auto& [n, m] : root.named_modules())
    if (std::find(block_types.begin(), block_types.end(), m->type_name()) != block_types.end())
      blocks.emplace_back(n, m);
  return apply_to(blocks, ac);
}

namespace detail {

Tensor checkpointed_forward(Module& module, const Tensor& x) {
  auto wrap = module.transform_state_as<Wrap>(kKey);
  autograd::CheckpointOptions opts;
  opts.name = wrap->name;
  opts.save = wrap->save;
  opts.watch = module.named_buffers();
  // The first run's train/eval modes, for the recompute.
  std::vector<std::pair<Module*, bool>> modes;
  for (auto& [n, m] : module.named_modules()) modes.emplace_back(m, m->is_training());
  Module* self = &module;
  return autograd::checkpoint(
      [self, modes](const Tensor& in) {
        if (!autograd::in_checkpoint_recompute()) return self->forward(in);
        std::vector<std::pair<Module*, bool>> now;
        for (auto& [m, t] : modes) now.emplace_back(m, m->is_training());
        auto set = [](const std::vector<std::pair<Module*, bool>>& ms) {
          // named_modules is parents first: each train() sets its subtree,
          // the children after it then their own.
          for (auto& [m, t] : ms)
            if (m->is_training() != t) m->train(t);
        };
        set(modes);
        struct Restore {
          std::function<void()> f;
          ~Restore() { f(); }
        } restore{[&] { set(now); }};
        return self->forward(in);
      },
      x, opts);
}

}  // namespace detail
}  // namespace ember::nn
