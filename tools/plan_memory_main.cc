// //tools:plan_memory: prints the memory planner's table (bytes per rank of
// parameters, gradients, optimizer state and the largest gathered unit under
// DDP, ZeRO-1, SHARD_GRAD_OP and FULL_SHARD) and its recommendation.
//
//   bazel run //tools:plan_memory -- --params 7e9 --largest-unit 2e8 --world-size 4 --device-gb 80 \
//       --optimizer adamw --mixed-precision
//   bazel run //tools:plan_memory -- --gpt 12,768,12,50257,1024,tied --world-size 2 --device-gb 2  # GPT-2 small
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

#include <sstream>
#include <vector>

#include "core/exception.h"
#include "distributed/parallel/memory_plan.h"
#include "nn/transformer.h"

namespace {

const char* kUsage =
    "usage: plan_memory (--params N [--largest-unit N] | --gpt LAYERS,DIM,HEADS,VOCAB,SEQ[,tied])\n"
    "                   [--world-size N] [--device-gb G] [--activations-gb G]\n"
    "                   [--optimizer adam|adamw|sgd|sgd_plain] [--mixed-precision]\n"
    "  --gpt builds that nn::GPT and plans it with every TransformerBlock a unit\n";

// A count or size that may be written 7e9: whole, non-negative.
double number(const char* flag, const char* text) {
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(v >= 0)) {
    std::fprintf(stderr, "plan_memory: %s wants a non-negative number, got '%s'\n%s", flag, text, kUsage);
    std::exit(2);
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  ember::distributed::MemoryPlanOptions o;
  double params = -1, unit = 0;
  std::string gpt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "plan_memory: %s needs a value\n%s", a.c_str(), kUsage);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--params") params = number("--params", value());
    else if (a == "--gpt") gpt = value();
    else if (a == "--largest-unit") unit = number("--largest-unit", value());
    else if (a == "--world-size") o.world_size = static_cast<int>(number("--world-size", value()));
    else if (a == "--device-gb") o.device_bytes = static_cast<int64_t>(number("--device-gb", value()) * 1e9);
    else if (a == "--activations-gb") o.activation_bytes = static_cast<int64_t>(number("--activations-gb", value()) * 1e9);
    else if (a == "--optimizer") o.optimizer = value();
    else if (a == "--mixed-precision") o.mixed_precision = true;
    else if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else {
      std::fprintf(stderr, "plan_memory: unknown argument '%s'\n%s", a.c_str(), kUsage);
      return 2;
    }
  }
  if ((params < 0) == gpt.empty()) {
    std::fprintf(stderr, "plan_memory: give --params or --gpt (one of them)\n%s", kUsage);
    return 2;
  }
  try {
    if (!gpt.empty()) {
      std::vector<std::string> f;
      std::stringstream ss(gpt);
      for (std::string t; std::getline(ss, t, ',');) f.push_back(t);
      const bool tied = f.size() == 6 && f[5] == "tied";
      if (f.size() != 5 && !tied) {
        std::fprintf(stderr, "plan_memory: --gpt wants LAYERS,DIM,HEADS,VOCAB,SEQ[,tied], got '%s'\n%s", gpt.c_str(),
                     kUsage);
        return 2;
      }
      ember::nn::GPTOptions g{.vocab_size = static_cast<int64_t>(number("--gpt VOCAB", f[3].c_str())),
                              .block_size = static_cast<int64_t>(number("--gpt SEQ", f[4].c_str())),
                              .n_layer = static_cast<int64_t>(number("--gpt LAYERS", f[0].c_str())),
                              .n_head = static_cast<int64_t>(number("--gpt HEADS", f[2].c_str())),
                              .n_embd = static_cast<int64_t>(number("--gpt DIM", f[1].c_str())),
                              .tie_weights = tied};
      ember::nn::GPT model(g);
      std::cout << "GPT " << gpt << ": every TransformerBlock a unit, the embeddings, final norm and head the root's\n";
      std::cout << ember::distributed::plan_memory(model, o, {"TransformerBlock"}).table();
      return 0;
    }
    std::cout << ember::distributed::plan_memory(static_cast<int64_t>(params), static_cast<int64_t>(unit), o).table();
  } catch (const ember::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  return 0;
}
