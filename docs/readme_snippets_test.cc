// The README's C++ blocks, verbatim (docs/snippets_match_test.sh checks that
// every block of README.md appears here line for line), compiled and run:
// the tensor screen and the custom model on a tiny batch in one process; the
// data-parallel and fully sharded blocks in a world of one. clang-format is
// off: the blocks keep the README's layout, comment columns included.
// clang-format off
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "core/ops.h"
#include "data/sampler.h"
#include "distributed/checkpoint/sharded.h"
#include "distributed/init.h"
#include "distributed/parallel/ddp.h"
#include "distributed/parallel/fsdp/fsdp.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "nn/transformer.h"
#include "optim/optimizer.h"

namespace {
using namespace ember;

class SmallCnn : public nn::Module {
 public:
  SmallCnn() : Module("SmallCnn") {
    conv = register_module("conv", std::make_shared<nn::Conv2d>(1, 32, 3, /*stride=*/1, /*padding=*/1));
    fc = register_module("fc", std::make_shared<nn::Linear>(32 * 14 * 14, 10));
  }
  Tensor forward(const Tensor& x) override {
    return (*fc)(max_pool2d(relu((*conv)(x)), {2, 2}, {2, 2}).flatten(1));
  }
  std::shared_ptr<nn::Conv2d> conv;
  std::shared_ptr<nn::Linear> fc;
};

std::vector<std::pair<Tensor, Tensor>> image_batches() {
  return {{randn({2, 1, 28, 28}), Tensor::from_vector({3, 7}, {2}, DType::Int64)}};
}

TEST(Readme, TensorScreen) {
  Tensor x = arange(6).view({2, 3});            // float32 on CPU
  Tensor y = x.t();                             // a view: strides {1, 3}, no copy
  Tensor z = matmul(x, y) + 1.0;                // oneDNN's sgemm; broadcasting scalar
  Tensor p = softmax(z, /*dim=*/1);
  Tensor m = mean(x, {0}, /*keepdim=*/true);    // reductions over any dims
  if (cuda_is_available()) {
  Tensor g = x.to(cuda_device(0), DType::BFloat16);  // cuBLAS/CUDA kernels
  }
  std::cout << z;                               // values, shape, dtype, device
  EXPECT_EQ(z.to_vector(), (std::vector<double>{6, 15, 15, 51}));
  EXPECT_EQ(m.to_vector(), (std::vector<double>{1.5, 2.5, 3.5}));
  EXPECT_NEAR(p.to_vector()[0] + p.to_vector()[1], 1.0, 1e-6);
}

TEST(Readme, CustomModel) {
  const auto batches = image_batches();
auto model = std::make_shared<SmallCnn>();
optim::Adam opt(model->parameters(), optim::AdamOptions{.lr = 1e-3});
for (auto [x, y] : batches) {
  opt.zero_grad();
  nn::functional::cross_entropy((*model)(x), y).backward();
  opt.step();
}
  EXPECT_TRUE(model->fc->weight.grad().defined());
}

// A world of one, as torchrun's variables would give it.
class WorldOfOne : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("RANK", "0", 1);
    setenv("WORLD_SIZE", "1", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", "0", 1);
  }
  void TearDown() override { distributed::destroy_process_group(); }
};

TEST_F(WorldOfOne, DataParallel) {
  auto model = std::make_shared<SmallCnn>();
  struct {
    int64_t size() const { return 4; }
  } dataset;
  const auto loader = image_batches();
auto pg = distributed::init_process_group();                 // RANK, WORLD_SIZE, MASTER_ADDR... as torchrun sets them
distributed::replicate(model);                               // in place: gradients averaged over the ranks in backward
optim::SGD opt(model->parameters(), {.lr = 0.1, .momentum = 0.9});
data::DistributedSampler sampler(dataset.size(), pg->size(), pg->rank());
for (auto [x, y] : loader) {                                 // each rank its part of every batch
  opt.zero_grad();
  nn::functional::cross_entropy((*model)(x), y).backward();  // buckets allreduced as gradients become ready
  opt.step();
}
  EXPECT_NE(distributed::replicated_of(*model), nullptr);
}

TEST_F(WorldOfOne, FullySharded) {
  std::vector<std::pair<Tensor, Tensor>> batches = {
      {randint(0, 96, {2, 8}, DType::Int64), randint(0, 96, {16}, DType::Int64)}};
  const std::string dir = std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") + "/readme_" +
                          std::to_string(getpid());
  std::error_code ec;
  const bool made = std::filesystem::create_directories(dir, ec) || !ec;
  ASSERT_TRUE(made);
  ASSERT_EQ(chdir(dir.c_str()), 0);
distributed::init_process_group();
auto gpt = std::make_shared<nn::GPT>(nn::GPTOptions{.vocab_size = 96, .n_layer = 6, .n_embd = 512});
distributed::FSDPOptions opts;                               // FULL_SHARD over every rank
opts.mp_policy = {.param_dtype = DType::BFloat16, .reduce_dtype = DType::Float32};
auto fsdp = distributed::fully_shard_auto(gpt, {.types = {"TransformerBlock"}}, opts);
optim::AdamW opt(gpt->parameters(), {.lr = 3e-3});           // each rank steps its shards
for (auto [x, y] : batches) {
  opt.zero_grad();
  nn::functional::cross_entropy((*gpt)(x).reshape({-1, 96}), y).backward();
  fsdp->clip_grad_norm_(1.0);
  opt.step();
}
distributed::save_sharded_checkpoint("ckpt/step_100", *gpt, &opt, nullptr, {.step = 100}, *distributed::default_group());
  EXPECT_TRUE(distributed::is_sharded_checkpoint("ckpt/step_100"));
}

}  // namespace
// clang-format on
