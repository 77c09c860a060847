// Launches and host synchronisations of one training step under the CUDA
// emulation (step_counts.cc): the counting behind //bench:step_counts and
// its test.
#pragma once

#include <cstdint>

namespace ember::bench {

struct StepCount {
  uint64_t launches = 0;
  uint64_t host_syncs = 0;
  uint64_t layout_copies = 0;  // cuda_layout_copies(): NCHW <-> NHWC round trips
};

StepCount resnet50_counts();       // fp32, channels-last, SGD
StepCount resnet50_bf16_counts();  // the same under bfloat16 autocast
StepCount gpt_counts();            // gpt_fsdp's default model, AdamW
StepCount gpt_bf16_counts();       // the same under bfloat16 autocast (fused attention)
StepCount llama_bf16_counts();     // its LLaMA arrangement, bfloat16 parameters, AdamW
StepCount moe_bf16_counts();       // the same with mixture-of-experts feed-forwards
StepCount moe_capacity_bf16_counts();  // the same experts with a capacity (padded, dropping)

}  // namespace ember::bench
