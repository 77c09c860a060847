// //tools:plan_memory: prints the memory planner's table (bytes per rank of
// parameters, gradients, optimizer state and the largest gathered unit under
// DDP, ZeRO-1, SHARD_GRAD_OP and FULL_SHARD) and its recommendation.
//
//   bazel run //tools:plan_memory -- --params 7e9 --largest-unit 2e8 --world-size 4 --device-gb 80 \
//       --optimizer adamw --mixed-precision
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

#include "core/exception.h"
#include "distributed/memory_plan.h"

namespace {

const char* kUsage =
    "usage: plan_memory --params N [--largest-unit N] [--world-size N] [--device-gb G] [--activations-gb G]\n"
    "                   [--optimizer adam|adamw|sgd|sgd_plain] [--mixed-precision]\n";

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
  if (params < 0) {
    std::fprintf(stderr, "plan_memory: --params is required\n%s", kUsage);
    return 2;
  }
  try {
    std::cout << ember::distributed::plan_memory(static_cast<int64_t>(params), static_cast<int64_t>(unit), o).table();
  } catch (const ember::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  return 0;
}
