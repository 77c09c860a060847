// The memory planner against the ZeRO paper's worked example (Figure 1:
// 7.5B parameters, Adam with mixed precision, K = 12, on 64 devices), a 7B
// model on 4 x 80 GB with and without room for activations, a model's units,
// and the errors.
#include "distributed/parallel/memory_plan.h"

#include <gtest/gtest.h>

#include "nn/layers.h"
#include "nn/transformer.h"

namespace ember::distributed {
namespace {

TEST(MemoryPlan, ReproducesTheZeroPapersFigure1) {
  const int64_t psi = 7'500'000'000;
  auto plan = plan_memory(psi, 0, {.optimizer = "adam", .world_size = 64, .mixed_precision = true});
  // (2 + 2 + K) Psi = 120 GB; 2 Psi + 2 Psi + K Psi / N = 31.4 GB;
  // 2 Psi + (2 + K) Psi / N = 16.6 GB; (2 + 2 + K) Psi / N = 1.9 GB.
  EXPECT_EQ(plan.row("DDP").total(), 120'000'000'000);
  EXPECT_EQ(plan.row("ZeRO-1").total(), 31'406'250'000);
  EXPECT_EQ(plan.row("SHARD_GRAD_OP").total(), 16'640'625'000);
  EXPECT_EQ(plan.row("FULL_SHARD").total(), 1'875'000'000);
  EXPECT_EQ(plan.row("ZeRO-1").optimizer_state, 12 * psi / 64);
}

TEST(MemoryPlan, SevenBillionOnFourEightyGigabyteDevices) {
  const int64_t psi = 7'000'000'000, unit = 200'000'000;
  MemoryPlanOptions o{.optimizer = "adamw", .world_size = 4, .mixed_precision = true};
  auto plan = plan_memory(psi, unit, o);
  EXPECT_EQ(plan.row("DDP").total(), 112'000'000'000);        // 16 bytes per parameter: does not fit
  EXPECT_FALSE(plan.row("DDP").fits);
  EXPECT_EQ(plan.row("ZeRO-1").total(), 49'000'000'000);      // 14 + 14 + 84 / 4
  EXPECT_EQ(plan.row("SHARD_GRAD_OP").total(), 38'500'000'000);  // 14 + 3.5 + 21
  EXPECT_EQ(plan.row("FULL_SHARD").total(), 28'000'000'000 + 4 * unit);
  EXPECT_EQ(plan.recommendation, "ZeRO-1");
  // 40 GB of activations: ZeRO-1 no longer fits, SHARD_GRAD_OP does.
  o.activation_bytes = 40'000'000'000;
  EXPECT_EQ(plan_memory(psi, unit, o).recommendation, "SHARD_GRAD_OP");
  // On one device nothing fits: offload.
  o.world_size = 1;
  auto one = plan_memory(psi, unit, o);
  EXPECT_EQ(one.recommendation, "FULL_SHARD + CPU offload");
  EXPECT_NE(one.table().find("| DDP | 14.00 | 14.00 | 84.00 | 0.00 | 112.00 | no |"), std::string::npos)
      << one.table();
}

TEST(MemoryPlan, FromAModelWithItsChildrenAsUnits) {
  nn::Sequential model({std::make_shared<nn::Linear>(100, 200), std::make_shared<nn::ReLU>(),
                        std::make_shared<nn::Linear>(200, 10)});
  auto plan = plan_memory(model, {.optimizer = "sgd", .world_size = 1, .device_bytes = 1'000'000});
  EXPECT_EQ(plan.num_params, 100 * 200 + 200 + 200 * 10 + 10);
  EXPECT_EQ(plan.largest_unit_params, 100 * 200 + 200);
  EXPECT_EQ(plan.row("DDP").total(), plan.num_params * (4 + 4 + 4));  // float32 params, grads, momentum
  EXPECT_EQ(plan.recommendation, "single device");
  // Shards round up to whole bytes per rank.
  auto three = plan_memory(10, 5, {.optimizer = "sgd_plain", .world_size = 3});
  EXPECT_EQ(three.row("FULL_SHARD").params, 14);  // ceil(40 / 3)
}

// Units by type, as fully_shard_auto wraps: each block, and the root's rest
// (embeddings, final norm and head: here larger than a block).
TEST(MemoryPlan, FromAModelWithUnitsByType) {
  nn::GPT gpt({.vocab_size = 37, .block_size = 16, .n_layer = 3, .n_head = 2, .n_embd = 30});
  const int64_t block = gpt.h->named_children()[0].second->num_parameters();
  const int64_t root = gpt.num_parameters() - 3 * block;
  EXPECT_EQ(block, 30 * 90 + 90 + 30 * 30 + 30 + 30 * 120 + 120 + 120 * 30 + 30 + 4 * 30);
  EXPECT_EQ(root, 37 * 30 + 16 * 30 + 2 * 30 + 30 * 37);
  auto plan = distributed::plan_memory(gpt, {.world_size = 2}, {"TransformerBlock"});
  EXPECT_EQ(plan.num_params, gpt.num_parameters());
  EXPECT_EQ(plan.largest_unit_params, std::max(block, root));
  nn::GPT wide({.vocab_size = 5, .block_size = 4, .n_layer = 2, .n_head = 2, .n_embd = 30});
  EXPECT_EQ(distributed::plan_memory(wide, {.world_size = 2}, {"TransformerBlock"}).largest_unit_params, block);
}

TEST(MemoryPlan, ErrorsNameTheArgument) {
  EXPECT_THROW(plan_memory(10, 5, {.optimizer = "lamb"}), Error);
  EXPECT_THROW(plan_memory(10, 20, {}), Error);
  EXPECT_THROW(plan_memory(10, 5, {.world_size = 0}), Error);
}

}  // namespace
}  // namespace ember::distributed
