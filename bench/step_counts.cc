// step_counts: kernel launches and host synchronisations of one training
// step, counted by the CUDA emulation (no GPU needed; the counts are those a
// GPU would see, since the same host code issues the same CUDA calls):
//
//   bazel run //bench:step_counts
//   resnet50: L launches, S host syncs per step
//   gpt: L launches, S host syncs per step
//   resnet50_bf16: L launches, S host syncs per step
//   gpt_bf16: L launches, S host syncs per step
//   llama_bf16: L launches, S host syncs per step
//   moe_bf16: L launches, S host syncs per step
//   moe_capacity_bf16: L launches, S host syncs per step
//   resnet50 layout copies: C per step  (and one such line per channels-last step)
//
// ResNet-50 (torchvision's, 1000 classes) on 2 images of 32x32, channels-
// last, SGD with momentum and weight decay; the GPT of gpt_fsdp's defaults
// (4 layers x 128 dims, 4 heads, context 64) on 2 sequences, AdamW; the
// ResNet-50 step and the GPT's again under bfloat16 autocast (the GPT's
// attention then takes the fused kernels: head dim 32). Each counts the second step
// (the first creates algorithm caches and optimizer state), which ends with
// the loss read: the one synchronisation a step needs. The ResNet-50 steps
// are channels-last throughout (input, activations, OHWI weights), so they
// should issue no layout copies (core/device.h's cuda_layout_copies). The
// counts do not depend on the batch or image size. step_counts_test holds them to their
// budgets.
#include "bench/step_counts.h"

#include <cstdio>
#include <optional>

#include "bench/train_step.h"
#include "core/device.h"
#include "nn/functional.h"
#include "nn/models.h"
#include "nn/transformer.h"
#include "optim/optimizer.h"
#include "third_party/cuda_emu/emu_runtime.h"

namespace ember::bench {
namespace {

template <typename Step>
StepCount count(Step&& step) {
  step();  // warm-up: algorithm caches, optimizer state
  const emu::LaunchStats before = emu::launch_stats();
  const uint64_t copies_before = cuda_layout_copies();
  step();
  const emu::LaunchStats after = emu::launch_stats();
  return {after.launches - before.launches, after.host_syncs - before.host_syncs, cuda_layout_copies() - copies_before};
}

StepCount resnet50_step(bool bf16) {
  manual_seed(0);
  auto model = nn::resnet50({.num_classes = 1000, .memory_format = MemoryFormat::ChannelsLast});
  model->to(cuda_device(0));
  model->train();
  optim::SGD opt(model->parameters(), optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-4});
  Tensor x = randn({2, 3, 32, 32}).cuda().contiguous(MemoryFormat::ChannelsLast);
  Tensor y = randint(0, 1000, {2}).cuda();
  const std::optional<DType> amp = bf16 ? std::optional<DType>(DType::BFloat16) : std::nullopt;
  return count([&] { return train_step_autocast(*model, opt, x, y, amp); });
}

}  // namespace

StepCount resnet50_counts() { return resnet50_step(false); }
StepCount resnet50_bf16_counts() { return resnet50_step(true); }

namespace {
StepCount gpt_step(bool bf16) {
  manual_seed(0);
  auto gpt = std::make_shared<nn::GPT>(
      nn::GPTOptions{.vocab_size = 96, .block_size = 64, .n_layer = 4, .n_head = 4, .n_embd = 128});
  gpt->to(cuda_device(0));
  gpt->train();
  optim::AdamW opt(gpt->parameters(), optim::AdamWOptions{.lr = 3e-4});
  Tensor x = randint(0, 96, {2, 64}).cuda(), y = randint(0, 96, {2 * 64}).cuda();
  return count([&] {
    opt.zero_grad();
    Tensor loss;
    {
      std::optional<AutocastGuard> guard;
      if (bf16) guard.emplace(DeviceType::CUDA, DType::BFloat16);
      Tensor logits = (*gpt)(x);
      loss = nn::functional::cross_entropy(logits.reshape({-1, logits.size(2)}), y);
    }
    loss.backward();
    opt.step();
    return loss.item();
  });
}
}  // namespace

StepCount gpt_counts() { return gpt_step(false); }
StepCount gpt_bf16_counts() { return gpt_step(true); }

// The LLaMA arrangement of the same size (RMSNorm, rotary grouped-query
// attention with 2 key/value heads, SwiGLU) with bfloat16 parameters and
// no autocast, as FSDP's mixed precision runs a block (AdamW keeps
// float32 masters): the norms, rotary embeddings and the SwiGLU gate read
// and write bfloat16 as it is.
namespace {
StepCount llama_bf16_step(const nn::MoEOptions& moe) {
  manual_seed(0);
  auto m = std::make_shared<nn::GPT>(nn::GPTOptions{.vocab_size = 96,
                                                    .block_size = 64,
                                                    .n_layer = 4,
                                                    .n_head = 4,
                                                    .n_embd = 128,
                                                    .arch = nn::Arch::Llama,
                                                    .n_kv_head = 2,
                                                    .moe = moe});
  m->to(cuda_device(0));
  m->to(DType::BFloat16);
  m->train();
  optim::AdamW opt(m->parameters(), optim::AdamWOptions{.lr = 3e-4});
  Tensor x = randint(0, 96, {2, 64}).cuda(), y = randint(0, 96, {2 * 64}).cuda();
  return count([&] {
    opt.zero_grad();
    Tensor logits = (*m)(x);
    Tensor loss = nn::functional::cross_entropy(logits.reshape({-1, logits.size(2)}), y);
    loss.backward();
    opt.step();
    return loss.item();
  });
}
}  // namespace

StepCount llama_bf16_counts() { return llama_bf16_step({}); }

// Every block's feed-forward a mixture of 8 SwiGLU experts, top 2, with
// both router losses: routing, the dropless dispatch, the grouped GEMMs.
StepCount moe_bf16_counts() {
  return llama_bf16_step({.num_experts = 8, .top_k = 2, .hidden = 128, .z_loss_coef = 1e-3});
}

// The same experts with a capacity of 1.25 times the even share: padded
// groups, batched GEMMs, the later choices dropped.
StepCount moe_capacity_bf16_counts() {
  return llama_bf16_step({.num_experts = 8, .top_k = 2, .hidden = 128, .z_loss_coef = 1e-3, .capacity_factor = 1.25});
}

}  // namespace ember::bench
