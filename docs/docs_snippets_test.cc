// The C++ blocks of docs/*.md, verbatim (docs/snippets_match_test.sh checks
// every block of every page appears here or in runtime_example.cc line for
// line), compiled; those that run in one process (models, mixed precision,
// data parallelism, FSDP, checkpoints, profiling) run in a world of one.
// The mesh block needs 8 ranks: compiled only. clang-format is off: the
// blocks keep the pages' layout, comment columns included.
// clang-format off
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "autograd/autograd.h"
#include "autograd/checkpoint.h"
#include "core/cuda_graph.h"
#include "core/ops.h"
#include "core/profiler.h"
#include "data/loader.h"
#include "data/dataset.h"
#include "distributed/checkpoint/sharded.h"
#include "distributed/device_mesh.h"
#include "distributed/init.h"
#include "distributed/job_profile.h"
#include "distributed/parallel_dims.h"
#include "distributed/parallel/cp/load_balance.h"
#include "distributed/parallel/ddp.h"
#include "distributed/parallel/fsdp/fsdp.h"
#include "distributed/parallel/fsdp/fsdp_state_dict.h"
#include "distributed/parallel/recipes/gpt.h"
#include "distributed/parallel/recipes/parallelize.h"
#include "distributed/parallel/tp/gpt_plan.h"
#include "distributed/parallel/tp/loss_parallel.h"
#include "distributed/parallel/zero.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "nn/models.h"
#include "nn/moe.h"
#include "nn/checkpoint.h"
#include "nn/float8.h"
#include "nn/transformer.h"
#include "optim/clip_grad.h"
#include "optim/grad_scaler.h"
#include "optim/graphed_step.h"
#include "optim/lr_scheduler.h"
#include "optim/optimizer.h"

namespace {
using namespace ember;

// docs/models.md
class SmallCnn : public nn::Module {
 public:
  SmallCnn() : Module("SmallCnn") {
    conv1 = register_module("conv1", std::make_shared<nn::Conv2d>(1, 32, 3, /*stride=*/1, /*padding=*/1));
    bn1 = register_module("bn1", std::make_shared<nn::BatchNorm2d>(32));
    fc = register_module("fc", std::make_shared<nn::Linear>(32 * 14 * 14, 10));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = max_pool2d(relu((*bn1)((*conv1)(x))), {2, 2}, {2, 2});
    return (*fc)(h.flatten(1));
  }
  std::shared_ptr<nn::Conv2d> conv1;
  std::shared_ptr<nn::BatchNorm2d> bn1;
  std::shared_ptr<nn::Linear> fc;
};

std::vector<std::pair<Tensor, Tensor>> image_batches() {
  return {{randn({2, 1, 28, 28}), Tensor::from_vector({3, 7}, {2}, DType::Int64)}};
}
Tensor loss_fn(const Tensor& out, const Tensor& y) { return nn::functional::cross_entropy(out, y); }

TEST(Docs, Models) {
  Tensor x = randn({4, 784}), y = Tensor::from_vector({1, 2, 3, 4}, {4}, DType::Int64);
Tensor w = randn({784, 10}).requires_grad_();
Tensor loss = nn::functional::cross_entropy(matmul(x, w), y);
loss.backward();
w.grad();                                       // d loss / d w
{ NoGradGuard g; w -= w.grad() * 0.1; }         // updates outside the graph
autograd::register_post_accumulate_grad_hook(w, [](const Tensor& p) { /* p.grad() is final */ });

  const auto batches = image_batches();
  {
SmallCnn model;
optim::Adam opt(model.parameters(), optim::AdamOptions{.lr = 1e-3});
nn::CrossEntropyLoss criterion;
for (auto [x, y] : batches) {
  opt.zero_grad();
  Tensor loss = criterion(model(x), y);
  loss.backward();
  opt.step();
}
model.state_dict();   // "conv1.weight", "bn1.running_mean", ... as PyTorch names them

nn::HookHandle h = model.register_forward_pre_hook([](nn::Module& m, const Tensor& x) { return Tensor(); });  // {}: keep x
model.register_forward_hook([](nn::Module& m, const Tensor& in, const Tensor& out) { return out; });        // may replace out
model.register_full_backward_pre_hook([](nn::Module& m, const Tensor& grad_out) { return Tensor(); });      // before m's backward
h.remove();
    EXPECT_NE(model.state_dict().find("bn1.running_mean"), nullptr);
  }
}

// docs/gpu.md (on the CPU here: the layout is the same on any device)
TEST(Docs, ChannelsLast) {
  const Device device = kCPU;
auto net = nn::resnet50({.num_classes = 1000, .memory_format = MemoryFormat::ChannelsLast});
// or any module: net->to(MemoryFormat::ChannelsLast), as module.to(memory_format=...)
net->to(device);  // cuda_device(0)
  const Tensor& w = net->conv1->weight;
  EXPECT_TRUE(w.is_contiguous(MemoryFormat::ChannelsLast) && !w.is_contiguous()) << shape_str(w.strides());
}

// docs/gpu.md's CUDA graph: compiled here, run where there is a GPU (the
// emulated runs of the same recipe are //optim:cuda_graph_step_test's).
TEST(Docs, CudaGraph) {
  if (!cuda_is_available()) GTEST_SKIP() << "no GPU: " << cuda_unavailable_reason();
  nn::Linear lin(4, 3);
  lin.to(cuda_device(0));
  auto model = [&](const Tensor& x) { return lin(x); };
  optim::SGD optimizer(lin.parameters(), {.lr = 0.1, .momentum = 0.9});
  auto loss_fn = [](const Tensor& logits, const Tensor& y) { return nn::functional::cross_entropy(logits, y); };
  const Tensor x0 = randn({2, 4}).cuda(), y0 = Tensor::from_vector({0, 2}, {2}, DType::Int64).cuda();
  std::vector<std::pair<Tensor, Tensor>> batches{{x0 * 2.0, y0}, {x0 * 3.0, y0}};
  std::vector<double> logged;
  auto log = [&](double v) { logged.push_back(v); };
optimizer.zero_grad();                      // warm-up: one eager step makes the optimizer's state
loss_fn(model(x0), y0).backward();
optimizer.step();
Tensor static_x = x0.clone(), static_y = y0.clone(), loss;
CudaGraph graph(0);
graph.capture([&] {                         // records, runs nothing
  optimizer.zero_grad();
  loss = loss_fn(model(static_x), static_y);
  loss.backward();
  optimizer.step();
});
for (auto& [x, y] : batches) {
  static_x.copy_(x);                        // new inputs into the tensors the graph reads
  static_y.copy_(y);
  graph.replay();                           // forward, backward and step: one launch
  log(loss.item());                         // read results after the replay
}
  EXPECT_EQ(logged.size(), 2u);
}

// docs/gpu.md's GraphedStep: compiled here, run where there is a GPU (and
// under the emulation by //optim:graphed_step_test's own steps).
TEST(Docs, GraphedStep) {
  if (!cuda_is_available()) GTEST_SKIP() << "no GPU: " << cuda_unavailable_reason();
  nn::Linear lin(4, 3);
  lin.to(cuda_device(0));
  auto model = [&](const Tensor& x) { return lin(x); };
  const std::vector<Tensor> parameters = lin.parameters();
  optim::AdamW optimizer(parameters, {.lr = 0.1});
  optim::StepLR schedule(optimizer, 1, 0.5);
  auto loss_fn = [](const Tensor& logits, const Tensor& y) { return nn::functional::cross_entropy(logits, y); };
  const Tensor x0 = randn({2, 4}), y0 = Tensor::from_vector({0, 2}, {2}, DType::Int64);
  std::vector<std::pair<Tensor, Tensor>> batches{{x0, y0}, {x0 * 2.0, y0}, {x0 * 3.0, y0}};
  std::vector<double> logged;
  auto log = [&](double v) { logged.push_back(v); };
optim::GraphedStep step(
    [&](const std::vector<Tensor>& in) {
      optimizer.zero_grad();
      Tensor loss = loss_fn(model(in[0]), in[1]);
      loss.backward();
      Tensor norm = optim::clip_grad_norm_async_(parameters, 1.0);  // stays on the device
      optimizer.step();
      return std::vector<Tensor>{loss.detach(), norm};
    },
    {.device = 0, .warmup = 1, .optimizers = {&optimizer}});
for (auto& [x, y] : batches) {
  std::vector<Tensor> out = step({x, y});   // eager, then captured, then replayed
  schedule.step();                          // the learning rate is on the device: the replays see it
  log(out[0].item());                       // the step's one wait, when wanted
}
  EXPECT_EQ(logged.size(), 3u);
  EXPECT_TRUE(step.captured());
}

// docs/mixed-precision.md
TEST(Docs, LossScaling) {
  SmallCnn model;
  optim::SGD opt(model.parameters(), {.lr = 0.1});
  Tensor loss = loss_fn(model(image_batches()[0].first), image_batches()[0].second);
optim::GradScaler scaler;                 // {.enabled = false}: a pass-through (bfloat16 needs none)
scaler.scale(loss).backward();
scaler.unscale_(opt);                     // optional, e.g. before clip_grad_norm_
scaler.step(opt);                         // skipped when a gradient is inf or NaN
scaler.update();
}

TEST(Docs, Float8Training) {
nn::GPT model(nn::GPTOptions::llama({.vocab_size = 256, .n_layer = 2, .n_head = 4, .n_embd = 64}));
std::vector<std::string> converted = nn::convert_to_float8_training(model);  // every projection, not lm_head
  EXPECT_EQ(converted.size(), 14u);  // q, k, v, o and the three SwiGLU projections, twice
  EXPECT_EQ(converted.back(), "h.1.mlp.down_proj");
}

// A world of one, as torchrun's variables would give it, in a fresh
// directory (the checkpoint blocks write relative paths).
class WorldOfOne : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("RANK", "0", 1);
    setenv("WORLD_SIZE", "1", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", "0", 1);
    const char* tmp = std::getenv("TEST_TMPDIR");
    dir_ = std::string(tmp ? tmp : "/tmp") + "/docs_" + std::to_string(getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::create_directories(dir_);
    ASSERT_EQ(chdir(dir_.c_str()), 0);
  }
  void TearDown() override { distributed::destroy_process_group(); }
  std::string dir_;
};

// docs/ddp.md
TEST_F(WorldOfOne, DataParallel) {
  auto model = std::make_shared<SmallCnn>();
  auto dataset = std::make_shared<data::TensorDataset>(randn({8, 1, 28, 28}), Tensor::from_vector({0, 1, 2, 3, 4, 5, 6, 7}, {8}, DType::Int64));
  data::DataLoader loader(dataset, {.batch_size = 2});
  {
auto pg = distributed::init_process_group({.backend = "gloo"});   // or "nccl"
auto ddp = std::make_shared<distributed::DistributedDataParallel>(model);
optim::SGD opt(ddp->parameters(), {.lr = 0.1, .momentum = 0.9});
distributed::GradientAccumulator acc(*ddp, /*steps=*/4);          // optional
for (data::Batch& b : loader) {                                   // DistributedSampler inside
  if (!acc.backward(nn::functional::cross_entropy((*ddp)(b.data), b.target))) continue;
  opt.step();
  opt.zero_grad();
}
    auto train_step = [&](data::Batch& b) {
      nn::functional::cross_entropy((*ddp)(b.data), b.target).backward();
      opt.step();
      opt.zero_grad();
    };
int64_t shadowed = distributed::join_uneven_inputs(*ddp, [&] {
  for (data::Batch& b : loader) train_step(b);  // forward, backward, step
});
    EXPECT_EQ(shadowed, 0);
  }
}

TEST_F(WorldOfOne, Zero) {
  auto model = std::make_shared<SmallCnn>();
  const auto batches = image_batches();
  distributed::init_process_group();
  const int rank = distributed::get_rank();
  optim::OptimizerStateDict saved;
  auto save = [&](const optim::OptimizerStateDict& sd) { saved = sd; };
  {
auto ddp = std::make_shared<distributed::DistributedDataParallel>(model);
distributed::ZeroRedundancyOptimizer opt(ddp->parameters(), [](std::vector<optim::ParamGroup> g) {
  return std::make_unique<optim::Adam>(std::move(g), optim::AdamOptions{.lr = 1e-3});
});
for (auto [x, y] : batches) { opt.zero_grad(); loss_fn((*ddp)(x), y).backward(); opt.step(); }
opt.consolidate_state_dict(0);                  // every rank
if (rank == 0) save(opt.state_dict());          // plain Adam's format and values
    const optim::OptimizerStateDict full_state_dict = saved;
opt.load_state_dict(full_state_dict);           // every rank keeps its shard
  }
  EXPECT_FALSE(saved.state.empty());
}

// docs/fsdp.md and docs/checkpoints.md
TEST_F(WorldOfOne, FullyShardedAndCheckpoints) {
  std::vector<std::pair<Tensor, Tensor>> batches = {
      {randint(0, 96, {2, 8}, DType::Int64), randint(0, 96, {16}, DType::Int64)}};
distributed::init_process_group();
auto gpt = std::make_shared<nn::GPT>(nn::GPTOptions{.vocab_size = 96, .n_layer = 6, .n_embd = 512});
distributed::FSDPOptions opts{.strategy = distributed::ShardingStrategy::FULL_SHARD};
opts.mp_policy = {.param_dtype = DType::BFloat16, .reduce_dtype = DType::Float32, .output_dtype = DType::Float32};
auto fsdp = distributed::fully_shard_auto(gpt, {.types = {"TransformerBlock"}}, opts);
//   (by hand: for (auto& [n, b] : gpt->h->named_children()) fully_shard(b, opts); fully_shard(gpt, opts);)
optim::AdamW opt(gpt->parameters(), {.lr = 3e-3});      // the local shards, original names
for (auto [x, y] : batches) {
  opt.zero_grad();
  nn::functional::cross_entropy((*gpt)(x).reshape({-1, 96}), y).backward();
  fsdp->clip_grad_norm_(1.0);                           // global norm over the shards
  opt.step();
}
nn::StateDict full = distributed::full_state_dict(*fsdp);               // rank 0, CPU, "h.0.attn.in_proj_weight", ...
auto full_opt = distributed::full_optim_state_dict(*fsdp, opt);         // as plain AdamW would save it
distributed::load_full_state_dict(*fsdp, full);                         // every rank keeps its shard
distributed::load_full_optim_state_dict(*fsdp, opt, full_opt);

  auto model = gpt;
  optim::StepLR sched(opt, 10);
  distributed::TrainingState state;
  state.step = 1;
  const std::string dir = "ckpt";
  auto pg = distributed::default_group();
  const std::vector<int> all_ranks = {0};
// every rank, model wrapped by fully_shard (or not), its optimizer and scheduler:
absl::Status s = distributed::save_sharded_checkpoint(dir, *model, &opt, &sched, state, *pg);
auto st = distributed::load_sharded_checkpoint(dir, *model, &opt, &sched, *pg);  // StatusOr<TrainingState>
// asynchronous: save() copies to host memory and returns; a thread writes and commits
distributed::AsyncCheckpointer ckpt(distributed::new_group(all_ranks, "gloo"));  // Gloo also in NCCL jobs
absl::Status started = ckpt.save(dir, *model, &opt, &sched, state, *pg);     // training goes on meanwhile
absl::Status written = ckpt.wait();                                          // the last save's outcome
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(started.ok() && written.ok()) << written;
}

// docs/profiling.md
TEST_F(WorldOfOne, Profiling) {
  auto pg = distributed::init_process_group();
  SmallCnn model;
  optim::SGD opt(model.parameters(), {.lr = 0.1});
  auto [x, y] = image_batches()[0];
  Tensor loss;
profiler::start();
{
  EMBER_PROFILE_RANGE("my step");           // a user range until the end of the block
  loss = loss_fn(model(x), y);
  loss.backward();
  opt.step();
}
profiler::stop();
std::cout << profiler::summary_table(profiler::events());          // torch's key_averages().table()
auto files = distributed::write_profile("prof", pg.get());          // every rank: prof/trace-rank<N>.json,
                                                                    // summary-rank<N>.txt, ops-rank<N>.json;
                                                                    // rank 0: prof/trace.json (all ranks)
  EXPECT_TRUE(files.ok()) << files.status();
}

// docs/distributed.md's mesh block: 8 ranks, compiled only.
[[maybe_unused]] void mesh_block(std::shared_ptr<distributed::ProcessGroup> pg) {
auto mesh = distributed::DeviceMesh::create({2, 2, 2}, {"pp", "dp", "tp"});  // every rank, collectively
mesh->group("tp");            // the ranks that differ from this one only in "tp"
mesh->coordinate("pp");       // this rank's place along "pp"
auto dp_tp = mesh->submesh({"dp", "tp"});   // this rank's 2x2 slice, the same groups
auto flat = distributed::DeviceMesh::from_group(pg, "dp");  // a 1-D mesh of an existing group
}

// docs/tensor-parallel.md's blocks: 2 and 4 ranks, compiled only (the
// same code runs on real ranks in //distributed/parallel/tp's tests).
[[maybe_unused]] void tensor_parallel_blocks(const Tensor& weight, std::shared_ptr<nn::TransformerBlock> block,
                                             const Tensor& tokens, const Tensor& targets) {
{
auto tp = distributed::DeviceMesh::create({2}, {"tp"});
distributed::DTensor w = distributed::distribute_tensor(weight, tp, {distributed::Shard(0)});
distributed::DTensor r = w.redistribute({distributed::Replicate()});   // an all-gather
Tensor whole = w.full_tensor();                                        // every rank: the global tensor
distributed::parallelize_module(*block, tp, {
    {"attn", distributed::ColwiseParallel{}},                  // q, k, v split by heads
    {"attn.out_proj", distributed::RowwiseParallel{}},
    {"mlp.c_fc", distributed::ColwiseParallel{}},
    {"mlp.c_proj", distributed::RowwiseParallel{}},
});
}
auto mesh = distributed::DeviceMesh::create({2, 2}, {"dp_shard", "tp"});   // 4 ranks
auto gpt = std::make_shared<nn::GPT>(nn::GPTOptions{.vocab_size = 8192, .n_layer = 6, .n_head = 8, .n_embd = 512});
distributed::parallelize_module(*gpt, mesh->submesh({"tp"}), distributed::gpt_tp_plan(*gpt, /*sequence_parallel=*/true));
for (auto& [name, block] : gpt->h->named_children()) distributed::fully_shard(block, {.mesh = mesh->submesh({"dp_shard"})});
distributed::fully_shard(gpt, {.mesh = mesh->submesh({"dp_shard"})});
optim::AdamW opt(gpt->parameters(), {.lr = 3e-4});
Tensor loss = distributed::parallel_cross_entropy((*gpt)(tokens), targets);   // logits stay vocab-sharded
loss.backward();
optim::clip_grad_norm_(gpt->parameters(), 1.0);   // the norm of the global gradients
opt.step();
}

// docs/mesh.md's block: 8 ranks, compiled only (the same calls run on 8
// real ranks in //distributed/parallel/recipes:parallelize_test).
[[maybe_unused]] void mesh_recipe_block(const std::function<std::shared_ptr<nn::Module>()>& make_my_transformer,
                                        const Tensor& x, const Tensor& y) {
auto dims = distributed::ParallelDims{.dp_replicate = 2, .dp_shard = 2, .tp = 2}.resolved(8);
auto mesh = dims.build_mesh();   // DeviceMesh(dp_replicate=2, dp_shard=2, tp=2), with its "dp" view
auto model = make_my_transformer();   // blocks of type "MyBlock" under "blocks"
distributed::ParallelizeOptions options{
    .tp_plan = {{"blocks.*.attn", distributed::ColwiseParallel{}},      // heads split over tp
                {"blocks.*.attn.out_proj", distributed::RowwiseParallel{}},
                {"blocks.*.ff.up", distributed::ColwiseParallel{}},
                {"blocks.*.ff.down", distributed::RowwiseParallel{}}},
    .block_types = {"MyBlock"},
    .ac = "selective"};
distributed::Parallelized par = distributed::parallelize(model, dims, mesh, options);   // TP, AC, HSDP
optim::AdamW opt(model->parameters(), {.lr = 3e-4});
const int64_t rows = x.size(0) / dims.dp(), first = dims.dp_rank(*mesh) * rows;   // this rank's share
Tensor loss = nn::functional::mse_loss((*model)(x.narrow(0, first, rows)), y.narrow(0, first, rows));
loss.backward();
par.clip_grad_norm_(1.0);
opt.step();
}

// docs/language-models.md's block: compiled only (the LLaMA family runs on
// 2 x 2 x 2 meshes in //examples:examples_test).
[[maybe_unused]] void language_models_block(const distributed::ParallelDims& dims,
                                            const std::shared_ptr<distributed::DeviceMesh>& mesh) {
auto llama = std::make_shared<nn::GPT>(nn::GPTOptions::llama(
    {.vocab_size = 32000, .block_size = 2048, .n_layer = 16, .n_head = 16, .n_embd = 2048, .n_kv_head = 4}));
distributed::Parallelized par = distributed::parallelize_gpt(llama, dims, mesh, {.sequence_parallel = true});
}

// docs/context-parallel.md's block: compiled only (the same calls run on 4
// ranks in //distributed/parallel/recipes:gpt_cp_test).
[[maybe_unused]] void context_parallel_block(const std::shared_ptr<nn::GPT>& gpt, const Tensor& tokens,
                                             const Tensor& targets) {
auto dims = distributed::ParallelDims{.dp_shard = 2, .cp = 2}.resolved(4);
auto mesh = dims.build_mesh();   // DeviceMesh(dp_shard=2, cp=2), with its dp_shard_cp view for FSDP
distributed::Parallelized par = distributed::parallelize_gpt(
    gpt, dims, mesh, {.cp = {.exchange = distributed::cp::Exchange::Ring, .seq = tokens.size(1)}});
const int cp = dims.cp, cp_rank = mesh->coordinate("cp");
const int64_t rows = tokens.size(0) / dims.dp(), first = dims.dp_rank(*mesh) * rows;
Tensor x = distributed::cp::shard(tokens.narrow(0, first, rows), 1, cp, cp_rank);   // this rank's two chunks
Tensor y = distributed::cp::shard(targets.narrow(0, first, rows), 1, cp, cp_rank);
Tensor loss = distributed::parallel_cross_entropy((*gpt)(x), y);   // its tokens' mean; FSDP averages over dp_shard x cp
loss.backward();
par.clip_grad_norm_(1.0);
}

// docs/moe.md's blocks: compiled only (the layer runs in //nn:moe_test,
// expert parallelism in //distributed/parallel/ep:expert_parallel_test and
// //examples:moe_test).
[[maybe_unused]] void moe_blocks(const Tensor& x, const std::shared_ptr<nn::GPT>& gpt) {
nn::MoE moe(64, {.num_experts = 8, .top_k = 2, .hidden = 128, .aux_loss_coef = 0.01, .z_loss_coef = 0.001});
Tensor y = moe(x);                                        // [B, T, 64] -> [B, T, 64]
const nn::MoEStats st = moe.stats();                      // tokens per expert, router losses
auto dims = distributed::ParallelDims{.dp_shard = 2, .ep = 2}.resolved(2);
auto mesh = dims.build_mesh();       // its "ep" view: the dp_shard ranks
distributed::Parallelized par = distributed::parallelize_gpt(gpt, dims, mesh, {});   // EP, then FSDP
(void)y, (void)st, (void)par;
}

// docs/activation-checkpointing.md's block: compiled only (the same calls
// run in //autograd:checkpoint_test and //nn:checkpoint_test).
[[maybe_unused]] void activation_checkpointing_blocks(const std::shared_ptr<nn::GPT>& gpt, nn::Module& block,
                                                      const Tensor& x, const Tensor& a, const Tensor& b,
                                                      const Tensor& c, const autograd::RegionFn& fn) {
Tensor y = autograd::checkpoint([&](const Tensor& in) { return block(in); }, x);
std::vector<Tensor> outs = autograd::checkpoint(fn, {a, b, c});   // several inputs and outputs
nn::checkpoint_wrapper(*gpt->h->named_children()[0].second);     // one module: every call is a region
nn::apply_activation_checkpointing(gpt->h->named_children(), nn::ActivationCheckpointing::parse("every:2"));
}

}  // namespace
// clang-format on
