// Prints the launch and host-synchronisation counts of one training step
// (see step_counts.cc): one line per workload.
#include <cstdio>
#include <exception>

#include "bench/step_counts.h"

int main() {
  using namespace ember::bench;
  try {
    const struct {
      const char* name;
      StepCount (*fn)();
      bool channels_last;
    } rows[] = {{"resnet50", resnet50_counts, true},
                {"gpt", gpt_counts, false},
                {"resnet50_bf16", resnet50_bf16_counts, true},
                {"gpt_bf16", gpt_bf16_counts, false},
                {"llama_bf16", llama_bf16_counts, false},
                {"moe_bf16", moe_bf16_counts, false},
                {"moe_capacity_bf16", moe_capacity_bf16_counts, false}};
    for (const auto& r : rows) {
      const StepCount c = r.fn();
      std::printf("%s: %llu launches, %llu host syncs per step\n", r.name, static_cast<unsigned long long>(c.launches),
                  static_cast<unsigned long long>(c.host_syncs));
      if (r.channels_last)
        std::printf("%s layout copies: %llu per step\n", r.name, static_cast<unsigned long long>(c.layout_copies));
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "step_counts: %s\n", e.what());
    return 1;
  }
  return 0;
}
