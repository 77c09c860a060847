// Sharded checkpoints across real processes: a job trains two AdamW steps
// and saves; a job of another world size and layout (fully_shard with
// another strategy, DDP, one process) loads it, gets exactly the saved model
// (compared bitwise with the saver's full state dict), trains two more steps
// and ends where one process training all four steps on the same global
// batches ends (float32, reduction order aside). Also: the index's coverage
// and checksums, small pieces (many per tensor), a corrupted byte named
// with file, tensor and byte range, a missing rank file, a truncated file, a
// wrong index version, a model that does not match, and a failed save that
// leaves the previous checkpoint.
#include "distributed/checkpoint/sharded.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/safetensors.h"
#include "distributed/device_mesh.h"
#include "distributed/init.h"
#include "distributed/parallel/ddp.h"
#include "distributed/parallel/fsdp/fsdp.h"
#include "distributed/parallel/zero.h"
#include "distributed/sharding/shard_spec.h"
#include "distributed/testing/multiprocess.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "optim/optimizer.h"

namespace ember::distributed {
namespace {

namespace mp = ::ember::distributed::testing;
namespace fs = std::filesystem;

// One fully_shard unit: sizes no world size of 2-4 divides.
class Layer : public nn::Module {
 public:
  Layer(int in, int out) : nn::Module("Layer") {
    fc = register_module("fc", std::make_shared<nn::Linear>(in, out));
    ln = register_module("ln", std::make_shared<nn::LayerNorm>(std::vector<int64_t>{out}));
  }
  Tensor forward(const Tensor& x) override { return tanh((*ln)((*fc)(x))); }
  std::shared_ptr<nn::Linear> fc;
  std::shared_ptr<nn::LayerNorm> ln;
};

class Tower : public nn::Module {
 public:
  explicit Tower(uint64_t seed) : nn::Module("Tower") {
    manual_seed(seed);
    l0 = register_module("l0", std::make_shared<Layer>(5, 9));
    l1 = register_module("l1", std::make_shared<Layer>(9, 13));
    head = register_module("head", std::make_shared<nn::Linear>(13, 3));
    register_buffer("calls", zeros({2}));
  }
  Tensor forward(const Tensor& x) override { return (*head)((*l1)((*l0)(x))); }
  std::shared_ptr<Layer> l0, l1;
  std::shared_ptr<nn::Linear> head;
};

constexpr int kGlobal = 12;  // rows per step: every world size of 1-4 divides it

// Step s's global batch, and rank r of `world`'s rows of it.
std::pair<Tensor, Tensor> global_batch(int s) {
  std::vector<double> x, y;
  for (int k = 0; k < kGlobal * 5; ++k) x.push_back(std::sin(0.37 * k + 0.71 * s));
  for (int k = 0; k < kGlobal * 3; ++k) y.push_back(std::cos(0.23 * k + 0.31 * s));
  return {Tensor::from_vector(x, {kGlobal, 5}), Tensor::from_vector(y, {kGlobal, 3})};
}
std::pair<Tensor, Tensor> local_batch(int s, int r, int world) {
  auto [x, y] = global_batch(s);
  const int n = kGlobal / world;
  return {x.narrow(0, r * n, n).contiguous(), y.narrow(0, r * n, n).contiguous()};
}

std::unique_ptr<optim::Optimizer> make_opt(std::vector<Tensor> params) {
  return std::make_unique<optim::AdamW>(std::move(params), optim::AdamWOptions{.lr = 0.02});
}

// A training job in one layout: "fsdp:<strategy>", "fsdp:blocks" (FULL_SHARD
// on the two layers only, the model itself unwrapped), "ddp", "zero" (DDP
// with ZeRO-1) or "single".
struct Job {
  std::shared_ptr<Tower> net = std::make_shared<Tower>(3);
  std::shared_ptr<FSDPModule> fsdp;
  std::shared_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<optim::Optimizer> opt;
  int rank = 0, world = 1;

  Job(const std::string& layout, int rank_, int world_) : rank(rank_), world(world_) {
    if (layout.rfind("fsdp:", 0) == 0) {
      const bool blocks_only = layout == "fsdp:blocks";
      FSDPOptions o;
      o.strategy = parse_strategy(blocks_only ? "full" : layout.substr(5));
      if (o.strategy == ShardingStrategy::HYBRID_SHARD)
        o.mesh = DeviceMesh::create({world_ / 2, 2}, {"dp_replicate", "dp_shard"});
      fully_shard(net->l0, o);
      fully_shard(net->l1, o);
      if (!blocks_only) fsdp = fully_shard(net, o);
    } else if (layout == "ddp" || layout == "zero") {
      ddp = std::make_shared<DistributedDataParallel>(net);
    } else {
      WCHECK(layout == "single", "layout ", layout);
    }
    if (layout == "zero")  // ZeRO-1: AdamW's state sharded over the ranks
      opt = std::make_unique<ZeroRedundancyOptimizer>(net->parameters(), [](std::vector<optim::ParamGroup> g) {
        return std::make_unique<optim::AdamW>(std::move(g), optim::AdamWOptions{.lr = 0.02});
      });
    else
      opt = make_opt(net->parameters());
  }
  void step(int s) {
    auto [x, y] = local_batch(s, rank, world);
    opt->zero_grad();
    Tensor out = ddp ? (*ddp)(x) : (*net)(x);
    nn::functional::mse_loss(out, y).backward();
    opt->step();
  }
  // The whole model on every rank, float32 masters.
  nn::StateDict full() {
    if (fsdp) return full_state_dict(*fsdp, {.rank0_only = false});
    if (fsdp_of(*net->l0)) {  // blocks only: each layer's full state, the rest as it is
      nn::StateDict out;
      for (const auto& [prefix, layer] : {std::pair{"l0.", net->l0}, std::pair{"l1.", net->l1}}) {
        const nn::StateDict part = full_state_dict(*fsdp_of(*layer), {.rank0_only = false});
        for (const auto& [k, v] : part.items()) out.insert(prefix + k, v);
      }
      const nn::StateDict head = net->head->state_dict();
      for (const auto& [k, v] : head.items()) out.insert("head." + k, v.clone());
      out.insert("calls", net->state_dict().find("calls")->clone());
      return out;
    }
    nn::StateDict out;
    const nn::StateDict sd = net->state_dict();
    for (const auto& [k, v] : sd.items()) out.insert(k, v.clone());
    return out;
  }
};

using mp::init_world;

void expect_equal(const nn::StateDict& got, const nn::StateDict& want, double tol, const std::string& what) {
  WCHECK(got.size() == want.size(), what, ": ", got.size(), " tensors vs ", want.size());
  for (const auto& [k, w] : want.items()) {
    const Tensor* g = got.find(k);
    WCHECK(g, what, ": ", k, " missing");
    mp::check_close(*g, w, what + ": " + k, tol);
  }
}

// phase=save: two steps, then save to `dir` (and the full model beside it,
// for the loader's bitwise check). phase=load: load, check bitwise, two more
// steps, check against one process's four steps.
EMBER_WORKER(ckpt_job) {
  init_world(env);
  auto args = mp::parse_arg(env.arg);
  const std::string dir = args.at("dir");
  Job job(args.at("layout"), env.rank, env.world_size);
  auto pg = default_group();
  ShardedSaveOptions so;
  if (args.count("piece")) so.max_piece_bytes = std::stoll(args.at("piece"));
  if (args.at("phase") == "save_async") {
    // Saved in the background while two more steps change every tensor.
    std::vector<int> all;
    for (int r = 0; r < env.world_size; ++r) all.push_back(r);
    AsyncCheckpointer ckpt(new_group(all, "gloo"), so);
    for (int s = 0; s < 2; ++s) job.step(s);
    const nn::StateDict full = job.full();
    if (env.rank == 0) WCHECK(save_safetensors(dir + ".full.safetensors", full.items()).ok(), "full");
    manual_seed(500 + env.rank);  // each rank's own generator state, as phase=save
    randn({3 + env.rank});
    TrainingState st;
    st.step = 2;
    // The background write waits until the two steps are done, so that a
    // save without host copies would write their result.
    std::promise<void> trained;
    std::shared_future<void> gate = trained.get_future().share();
    testing::set_checkpoint_save_hooks({.at_stage = [gate](const std::string& at, const std::string&) {
      if (at == "sharded_dir_created") gate.wait();
    }});
    const absl::Status started = ckpt.save(dir, *job.net, job.opt.get(), nullptr, st, *pg);
    WCHECK(started.ok(), started.message());
    WCHECK(ckpt.last_staging_seconds() >= 0, ckpt.last_staging_seconds());
    for (int s = 2; s < 4; ++s) job.step(s);
    trained.set_value();
    const absl::Status done = ckpt.wait();
    testing::set_checkpoint_save_hooks({});
    WCHECK(done.ok(), done.message());
    // A save that cannot be written: save() returns at once, the failure
    // comes from wait() and names the checkpoint; the next save() reports
    // a failure it meets too.
    const std::string bad = dir + ".full.safetensors/sub";  // under a file
    WCHECK(ckpt.save(bad, *job.net, job.opt.get(), nullptr, st, *pg).ok(), "staging");
    const absl::Status failed = ckpt.wait();
    WCHECK(!failed.ok() && std::string(failed.message()).find(bad) != std::string::npos, failed.message());
    WCHECK(ckpt.save(bad, *job.net, job.opt.get(), nullptr, st, *pg).ok(), "staging");
    const absl::Status next = ckpt.save(dir + ".other", *job.net, job.opt.get(), nullptr, st, *pg);
    WCHECK(!next.ok() && std::string(next.message()).find(bad) != std::string::npos, next.message());
    return;
  }
  if (args.at("phase") == "save") {
    for (int s = 0; s < 2; ++s) job.step(s);
    // Saving changes nothing of the model's state: units gathered before
    // the save (in their compute dtype) are still gathered after it, and
    // what is written is the float32 shards (the loader checks bitwise).
    const bool gathered = args.count("gathered") && job.fsdp;
    if (gathered) job.fsdp->unshard();
    manual_seed(500 + env.rank);  // each rank's own generator state
    randn({3 + env.rank});
    TrainingState st;
    st.step = 2;
    const int64_t before = gathered ? job.fsdp->memory().unsharded_params : 0;
    const absl::Status saved = save_sharded_checkpoint(dir, *job.net, job.opt.get(), nullptr, st, *pg, so);
    WCHECK(saved.ok(), saved.message());
    if (gathered) {
      WCHECK(before > 0 && job.fsdp->memory().unsharded_params == before, "gathered bytes ", before,
             " before the save, ", job.fsdp->memory().unsharded_params, " after");
      job.fsdp->reshard();
    }
    const nn::StateDict full = job.full();
    if (env.rank == 0) WCHECK(save_safetensors(dir + ".full.safetensors", full.items()).ok(), "full");
    return;
  }
  auto st = load_sharded_checkpoint(dir, *job.net, job.opt.get(), nullptr, *pg);
  WCHECK(st.ok(), st.status().message());
  WCHECK(st->step == 2, st->step);
  // Each rank's generator where the world size is the saver's, else rank 0's.
  const int from = std::stoi(args.at("saved_world")) == env.world_size ? env.rank : 0;
  Generator want_gen(500 + from);
  randn({3 + from}, TensorOptions{}, &want_gen);
  WCHECK(default_generator().seed() == want_gen.seed() && default_generator().offset() == want_gen.offset(),
         "generator (", default_generator().seed(), ", ", default_generator().offset(), "), want rank ", from, "'s (",
         want_gen.seed(), ", ", want_gen.offset(), ")");
  auto saved = load_safetensors(dir + ".full.safetensors");
  WCHECK(saved.ok(), saved.status().message());
  nn::StateDict want;
  for (const auto& [k, v] : saved->tensors) want.insert(k, v);
  expect_equal(job.full(), want, 0.0, "right after the load");
  // Blocks only: nothing averages the unwrapped head's gradients, so that
  // job does not train as one process would; the load is what it checks.
  if (args.at("layout") == "fsdp:blocks") return;
  for (int s = 2; s < 4; ++s) job.step(s);
  // One process, the four global batches.
  Tower ref(3);
  auto ref_opt = make_opt(ref.parameters());
  for (int s = 0; s < 4; ++s) {
    auto [x, y] = global_batch(s);
    ref_opt->zero_grad();
    nn::functional::mse_loss(ref(x), y).backward();
    ref_opt->step();
  }
  expect_equal(job.full(), ref.state_dict(), 2e-5, "after two more steps");
}

// Box-sharded tensors (a tensor-parallel layout, set by hand through the
// sharding vocabulary): w [6, 8] laid out by `layout` over a DeviceMesh,
// b [8] replicated. The saver sets w = W - 0.1 G with SGD momentum's first
// step (momentum_buffer = G), so every element of the parameter and of its
// optimizer state is known in closed form; a loader in any layout checks
// what it holds against it.
//   layout: "tp2x2" (Shard(0), Shard(1)) over (dp=2, tp=2): 2-D boxes
//           "rep2x2" (Replicate(), Shard(1)) over (dp=2, tp=2): replicas
//           "tp2" Shard(1) over (tp=2); "rows3" Shard(0) over (tp=3)
//           "fsdp" fully_shard over every rank; "single" the whole tensor
double w_at(int64_t i) { return 1.0 + 0.25 * static_cast<double>(i); }
double g_at(int64_t i) { return std::sin(0.7 * static_cast<double>(i)); }

class BoxNet : public nn::Module {
 public:
  BoxNet() : nn::Module("BoxNet") {
    w = register_parameter("w", zeros({6, 8}));
    b = register_parameter("b", zeros({8}));
  }
  Tensor forward(const Tensor& x) override { return x; }
  Tensor w, b;
};

// The elements of `full` (a [6, 8] tensor's values, row-major) that `r` holds.
Tensor region_values(const std::vector<double>& full, const Region& r) {
  std::vector<float> f(full.begin(), full.end());
  Tensor out = Tensor::empty({r.numel}, DType::Float32);
  copy_overlap({6, 8}, whole_region({6, 8}), f.data(), r, out.raw_data(), sizeof(float));
  return out;
}

EMBER_WORKER(box_job) {
  init_world(env);
  auto args = mp::parse_arg(env.arg);
  const std::string layout = args.at("layout"), dir = args.at("dir");
  const bool saving = args.at("phase") == "save";
  auto net = std::make_shared<BoxNet>();
  std::vector<double> W, G, b(8);
  for (int64_t i = 0; i < 48; ++i) W.push_back(w_at(i)), G.push_back(g_at(i));
  for (int j = 0; j < 8; ++j) b[j] = 0.5 * j;
  std::shared_ptr<FSDPModule> fsdp;
  Region region = whole_region({6, 8});
  {
    NoGradGuard ng;
    net->b.copy_(Tensor::from_vector(saving ? b : std::vector<double>(8, 0.0), {8}));
  }
  if (layout == "fsdp" || layout == "single") {
    NoGradGuard ng;
    net->w.copy_(saving ? Tensor::from_vector(W, {6, 8}) : zeros({6, 8}));
    if (layout == "fsdp") {
      fsdp = fully_shard(net);
      region = shard_spec(net->w)->region;
    }
  } else {
    std::vector<int> shape;
    std::vector<std::string> names;
    std::vector<Placement> placements;
    if (layout == "tp2x2") shape = {2, 2}, names = {"dp", "tp"}, placements = {Shard(0), Shard(1)};
    if (layout == "rep2x2") shape = {2, 2}, names = {"dp", "tp"}, placements = {Replicate(), Shard(1)};
    if (layout == "tp2") shape = {2}, names = {"tp"}, placements = {Shard(1)};
    if (layout == "rows3") shape = {3}, names = {"tp"}, placements = {Shard(0)};
    WCHECK(!shape.empty(), "layout ", layout);
    auto mesh = DeviceMesh::create(shape, names);
    auto spec = std::make_shared<ShardSpec>();
    spec->global_shape = {6, 8};
    spec->mesh_dims = names;
    spec->mesh_shape = shape;
    spec->coord = mesh->coordinate();
    spec->placements = placements;
    spec->layout = "tp:" + layout;
    spec->region = chunk_region({6, 8}, shape, spec->coord, placements);
    for (size_t m = 0; m < placements.size(); ++m)
      if (placements[m].is_replicate() && spec->coord[m] != 0) spec->writes = false;
    region = spec->region;
    Tensor local = saving ? region_values(W, region).view(region.box.lengths) : zeros(region.box.lengths);
    net->w.set_data(local);
    set_shard_spec(net->w, spec);
  }
  optim::SGD opt(net->parameters(), optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
  auto pg = default_group();
  TrainingState st;
  st.step = 1;
  if (saving) {
    opt.zero_grad();
    // FSDP's parameter is its shard view while sharded: the region's data.
    net->w.set_grad(region_values(G, region).view(net->w.sizes()));
    net->b.set_grad(zeros(net->b.sizes()));
    opt.step();
    const absl::Status saved = save_sharded_checkpoint(dir, *net, &opt, nullptr, st, *pg);
    WCHECK(saved.ok(), saved.message());
    return;
  }
  auto loaded = load_sharded_checkpoint(dir, *net, &opt, nullptr, *pg);
  WCHECK(loaded.ok(), loaded.status().message());
  std::vector<double> want_w;
  for (int64_t i = 0; i < 48; ++i) want_w.push_back(static_cast<float>(W[i]) - 0.1f * static_cast<float>(G[i]));
  const auto got_w = local_shard(net->w).to(DType::Float64).to_vector();
  const auto exp_w = region_values(want_w, region).to(DType::Float64).to_vector();
  const auto exp_g = region_values(G, region).to(DType::Float64).to_vector();
  WCHECK(got_w.size() == exp_w.size(), got_w.size(), " vs ", exp_w.size());
  for (size_t k = 0; k < got_w.size(); ++k)
    WCHECK(std::abs(got_w[k] - exp_w[k]) <= 4e-6, layout, " w element ", k, " of ", region.to_string(), ": ", got_w[k],
           " vs ", exp_w[k]);
  // b is replicated, or (FSDP) sharded too: its whole value either way.
  const Tensor whole_b = fsdp ? *full_state_dict(*fsdp, {.rank0_only = false}).find("b") : net->b;
  const auto got_b = whole_b.to(DType::Float64).to_vector();
  WCHECK(got_b.size() == 8u, got_b.size());
  for (int j = 0; j < 8; ++j) WCHECK(got_b[j] == b[j], layout, " b[", j, "]: ", got_b[j]);
  const optim::OptimizerStateDict sd = opt.state_dict();
  const Tensor* buf = nullptr;
  for (const auto& [k, t] : sd.state)
    if (k == "state.0.momentum_buffer") buf = &t;
  WCHECK(buf != nullptr, "no momentum buffer for w");
  const auto got_g = buf->to(DType::Float64).to_vector();
  WCHECK(got_g.size() == exp_g.size(), got_g.size(), " vs ", exp_g.size());
  for (size_t k = 0; k < got_g.size(); ++k)
    WCHECK(std::abs(got_g[k] - exp_g[k]) <= 1e-6, layout, " momentum element ", k, ": ", got_g[k], " vs ", exp_g[k]);
}

// Crash safety: `victim` dies (SIGKILL) at `stage` of a save over an
// existing checkpoint (step 1); the others' saves fail. The parent then
// checks that the directory still holds the step-1 checkpoint, whole.
EMBER_WORKER(crash_job) {
  init_world(env, std::chrono::seconds(20));
  auto args = mp::parse_arg(env.arg);
  const std::string dir = args.at("dir"), stage = args.at("stage");
  const int victim = std::stoi(args.at("victim"));
  Job job(args.at("layout"), env.rank, env.world_size);
  auto pg = default_group();
  job.step(0);
  TrainingState st;
  st.step = 1;
  const absl::Status first = save_sharded_checkpoint(dir, *job.net, job.opt.get(), nullptr, st, *pg);
  WCHECK(first.ok(), first.message());
  job.step(1);
  st.step = 2;
  testing::set_checkpoint_save_hooks({.at_stage = [&](const std::string& at, const std::string&) {
    if (at != stage || env.rank != victim) return;
    if (at == "sharded_rank_mid_write")  // half a file, as a write cut short leaves it
      for (const auto& e : fs::directory_iterator(fs::path(dir).parent_path()))
        if (e.path().string().rfind(dir + ".tmp-", 0) == 0)
          std::ofstream(e.path() / ("rank-0000" + std::to_string(env.rank) + ".safetensors.tmp")) << "partial";
    ::kill(::getpid(), SIGKILL);
  }});
  const absl::Status second = save_sharded_checkpoint(dir, *job.net, job.opt.get(), nullptr, st, *pg);
  WCHECK(!second.ok(), "the save succeeded although rank ", victim, " died at ", stage);
}

class ShardedCheckpoint : public ::testing::Test {
 protected:
  // EMBER_SHARDED_TEST_DIR keeps the checkpoints there (tools/ckpt_test.sh).
  void SetUp() override {
    const char* keep = std::getenv("EMBER_SHARDED_TEST_DIR");
    keep_ = keep != nullptr;
    root_ = keep_ ? fs::path(keep) : fs::temp_directory_path() / ("ember_sharded_" + std::to_string(::getpid()));
    if (!keep_) fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override {
    if (!keep_) fs::remove_all(root_);
  }
  bool keep_ = false;
  // Saves with `save_layout` on `n` ranks, or reuses an earlier save.
  std::string save(const std::string& layout, int n, const std::string& extra = "") {
    const std::string dir = (root_ / ("ckpt_" + std::to_string(counter_++))).string();
    EMBER_EXPECT_RANKS("ckpt_job", n, {.arg = "phase=save,layout=" + layout + ",dir=" + dir + extra});
    return dir;
  }
  void load(const std::string& dir, const std::string& layout, int n) {
    mp::RunOptions o;
    auto index = read_checkpoint_index(dir);
    ASSERT_TRUE(index.ok()) << index.status();
    o.arg = "phase=load,layout=" + layout + ",dir=" + dir + ",saved_world=" + std::to_string(index->world_size);
    EMBER_EXPECT_RANKS("ckpt_job", n, o);
  }
  fs::path root_;
  int counter_ = 0;
};

// An unattended resume loads the newest checkpoint that verifies
// completely: every way each file of the newest can be damaged makes it
// skip to the one before, naming the damaged checkpoint and file, and
// leaves every file as it was; when none verifies the error names each.
TEST_F(ShardedCheckpoint, ResumeLoadsTheNewestThatVerifiesNamingEverySkippedOne) {
  const fs::path good = save("fsdp:full", 2);
  auto write = [](const fs::path& f, const std::string& text) {
    std::ofstream(f, std::ios::binary | std::ios::trunc) << text;
  };
  auto read = [](const fs::path& f) {
    std::ifstream in(f, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  auto flip = [&](const fs::path& f, std::streamoff at) {
    std::string b = read(f);
    const size_t i = at >= 0 ? static_cast<size_t>(at) : b.size() + static_cast<size_t>(at);
    b[i] = static_cast<char>(b[i] ^ 0x5a);
    write(f, b);
  };
  // Everything under a directory: names and contents.
  auto snapshot = [&](const fs::path& d) {
    std::map<std::string, std::string> out;
    for (const auto& e : fs::recursive_directory_iterator(d))
      out[e.path().string()] = e.is_regular_file() ? read(e.path()) : std::string("<dir>");
    return out;
  };
  struct Damage {
    std::string what, names;  // names: what the reason must mention
    std::function<void(const fs::path&)> apply;
  };
  const std::vector<Damage> damages = {
      {"index.json missing", "index.json: missing", [](const fs::path& d) { fs::remove(d / "index.json"); }},
      {"index.json not JSON", "index.json", [&](const fs::path& d) { write(d / "index.json", "{\"format\": "); }},
      {"index.json of another format", "index.json",
       [&](const fs::path& d) { write(d / "index.json", "{\"format\": \"other\", \"files\": []}"); }},
      {"index.json disagrees with a rank file (a piece's bytes moved)", "rank-0000",
       [&](const fs::path& d) {
         std::string j = read(d / "index.json");
         const size_t at = j.find("\"bytes\": [");
         ASSERT_NE(at, std::string::npos);
         // Both ends 4 bytes on: the same size, other bytes of the file.
         const size_t lo = at + std::strlen("\"bytes\": [");
         const size_t comma = j.find(',', lo), hi = j.find_first_not_of(' ', comma + 1), close = j.find(']', hi);
         const std::string moved = std::to_string(std::stoll(j.substr(lo, comma - lo)) + 4) + ", " +
                                   std::to_string(std::stoll(j.substr(hi, close - hi)) + 4);
         j.replace(lo, close - lo, moved);
         write(d / "index.json", j);
       }},
      {"trainer.json missing", "trainer.json", [](const fs::path& d) { fs::remove(d / "trainer.json"); }},
      {"trainer.json not JSON", "trainer.json", [&](const fs::path& d) { write(d / "trainer.json", "{"); }},
      {"a rank file missing", "rank-00001.safetensors",
       [](const fs::path& d) { fs::remove(d / "rank-00001.safetensors"); }},
      {"a rank file cut short", "rank-00001.safetensors",
       [&](const fs::path& d) {
         const auto n = fs::file_size(d / "rank-00001.safetensors");
         fs::resize_file(d / "rank-00001.safetensors", n / 2);
       }},
      {"a rank file's header damaged", "rank-00000.safetensors",
       [&](const fs::path& d) { flip(d / "rank-00000.safetensors", 12); }},
      {"a rank file's data damaged", "rank-00000.safetensors",
       [&](const fs::path& d) { flip(d / "rank-00000.safetensors", -3); }},
  };
  int i = 0;
  for (const Damage& dmg : damages) {
    const fs::path r = root_ / ("resume_" + std::to_string(i++));
    fs::create_directories(r);
    fs::copy(good, r / "step_1", fs::copy_options::recursive);
    fs::copy(good, r / "step_2", fs::copy_options::recursive);
    dmg.apply(r / "step_2");
    const auto before = snapshot(r);
    std::vector<std::string> skipped;
    auto found = newest_verified_checkpoint(r.string(), "step_", &skipped);
    ASSERT_TRUE(found.ok()) << dmg.what << ": " << found.status();
    ASSERT_TRUE(found->has_value()) << dmg.what;
    EXPECT_EQ(**found, (r / "step_1").string()) << dmg.what;
    ASSERT_EQ(skipped.size(), 1u) << dmg.what;
    EXPECT_NE(skipped[0].find((r / "step_2").string()), std::string::npos) << dmg.what << ": " << skipped[0];
    EXPECT_NE(skipped[0].find(dmg.names), std::string::npos) << dmg.what << ": " << skipped[0];
    EXPECT_EQ(snapshot(r), before) << dmg.what << ": a file was modified";
    // Both damaged: an error naming each, not "no checkpoint".
    dmg.apply(r / "step_1");
    skipped.clear();
    found = newest_verified_checkpoint(r.string(), "step_", &skipped);
    ASSERT_FALSE(found.ok()) << dmg.what;
    const std::string msg(found.status().message());
    EXPECT_NE(msg.find("no checkpoint under"), std::string::npos) << msg;
    EXPECT_NE(msg.find("step_2"), std::string::npos) << msg;
    EXPECT_NE(msg.find("step_1"), std::string::npos) << msg;
  }
  // Nothing at all: no checkpoint, not an error.
  const fs::path empty = root_ / "empty";
  fs::create_directories(empty);
  auto none = newest_verified_checkpoint(empty.string(), "step_");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->has_value());
}

// The matrix: FULL_SHARD on 2 ranks into 1, 3 and 4 ranks and into
// DDP and one process; and back from DDP and from one process into FSDP.
TEST_F(ShardedCheckpoint, FullShardOnTwoRanksLoadsAnywhere) {
  const std::string dir = save("fsdp:full", 2);
  auto index = read_checkpoint_index(dir);
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->world_size, 2);
  EXPECT_EQ(index->layout, "fsdp:full_shard");
  // Parameters split across both files; optimizer state under torch's names.
  const CheckpointTensor* w = index->find("l1.fc.weight");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->shape, (Shape{13, 9}));
  ASSERT_GE(w->pieces.size(), 1u);
  EXPECT_NE(index->find("optim.state.l1.fc.weight.exp_avg"), nullptr);
  EXPECT_NE(index->find("optim.state.l1.fc.weight.step"), nullptr);
  EXPECT_NE(index->find("calls"), nullptr);
  EXPECT_TRUE(verify_checkpoint(dir).ok());
  load(dir, "fsdp:full", 1);
  load(dir, "fsdp:full", 3);
  load(dir, "fsdp:grad_op", 4);
  load(dir, "fsdp:no_shard", 2);
  load(dir, "ddp", 3);
  load(dir, "zero", 2);
  load(dir, "single", 1);
  load(dir, "fsdp:blocks", 2);  // units below an unwrapped model hold shards too
}

TEST_F(ShardedCheckpoint, ReplicatedSavesLoadIntoShards) {
  const std::string ddp = save("ddp", 3);
  // A replicated tensor is written once: each piece in exactly one file.
  auto index = read_checkpoint_index(ddp);
  ASSERT_TRUE(index.ok()) << index.status();
  for (const auto& t : index->tensors) EXPECT_LE(t.pieces.size(), 1u) << t.name;
  load(ddp, "fsdp:full", 2);
  const std::string zero = save("zero", 2);
  // ZeRO-1's state is written where it lives: both ranks' files hold pieces
  // of the moments (no consolidation on rank 0).
  auto zindex = read_checkpoint_index(zero);
  ASSERT_TRUE(zindex.ok()) << zindex.status();
  std::set<std::string> files;
  for (const auto& t : zindex->tensors)
    if (t.name.find(".exp_avg") != std::string::npos)
      for (const auto& p : t.pieces) files.insert(p.file);
  EXPECT_EQ(files.size(), 2u);
  load(zero, "fsdp:grad_op", 3);
  load(zero, "zero", 4);
  const std::string single = save("single", 1);
  load(single, "fsdp:hybrid", 4);
}

// AsyncCheckpointer: the checkpoint holds the state of the moment save()
// was called, although training went on changing it during the write.
TEST_F(ShardedCheckpoint, AsyncSaveHoldsTheStateOfItsCall) {
  const std::string dir = (root_ / "async").string();
  EMBER_ASSERT_RANKS("ckpt_job", 2, {.arg = "phase=save_async,layout=fsdp:full,dir=" + dir});
  EXPECT_TRUE(verify_checkpoint(dir).ok());
  load(dir, "fsdp:full", 3);
  load(dir, "ddp", 2);
}

TEST_F(ShardedCheckpoint, SmallPiecesSplitTensors) {
  const std::string dir = save("fsdp:full", 2, ",piece=16");  // 4 float32 per piece
  auto index = read_checkpoint_index(dir);
  ASSERT_TRUE(index.ok()) << index.status();
  const CheckpointTensor* w = index->find("l1.fc.weight");
  ASSERT_NE(w, nullptr);
  EXPECT_GE(w->pieces.size(), 117u / 4);
  load(dir, "fsdp:full", 3);
}

// ckpt consolidate's output is a one-process checkpoint: load_checkpoint
// takes it into a plain model and optimizer, which then train on exactly as
// the sharded job would.
TEST_F(ShardedCheckpoint, ConsolidatedLoadsAsOneProcessCheckpoint) {
  const std::string dir = save("fsdp:full", 3);
  const std::string out = (root_ / "consolidated").string();
  ASSERT_TRUE(consolidate_checkpoint(dir, out).ok());
  auto m = load_safetensors(out + "/model.safetensors");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_NE(m->find("l1.fc.weight"), nullptr);
  EXPECT_EQ(m->metadata.at("format"), "pt");
  Tower net(99);
  auto opt = make_opt(net.parameters());
  auto st = load_checkpoint(out, net, opt.get(), nullptr);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->step, 2);
  auto saved = load_safetensors(dir + ".full.safetensors");
  ASSERT_TRUE(saved.ok());
  nn::StateDict want;
  for (const auto& [k, v] : saved->tensors) want.insert(k, v);
  EXPECT_NO_THROW(expect_equal(net.state_dict(), want, 0.0, "consolidated"));
  Tower ref(3);
  auto ref_opt = make_opt(ref.parameters());
  for (int s = 0; s < 4; ++s) {
    auto [x, y] = global_batch(s);
    for (auto* o : {ref_opt.get(), s >= 2 ? opt.get() : nullptr}) {
      if (!o) continue;
      nn::Module& model = o == opt.get() ? static_cast<nn::Module&>(net) : ref;
      o->zero_grad();
      nn::functional::mse_loss(model(x), y).backward();
      o->step();
    }
  }
  EXPECT_NO_THROW(expect_equal(net.state_dict(), ref.state_dict(), 2e-5, "consolidated, two more steps"));
}

// 20 randomized trials: a rank killed before writing, mid-write, after its
// shard, before the index, before the rename; the previous checkpoint is
// intact every time and a later save over it works.
TEST_F(ShardedCheckpoint, KilledRankLeavesThePreviousCheckpoint) {
  const std::vector<std::string> stages = {"sharded_dir_created", "sharded_rank_mid_write", "sharded_rank_written",
                                           "sharded_before_index", "sharded_before_rename"};
  std::mt19937 rng(19);
  for (int trial = 0; trial < 20; ++trial) {
    const std::string stage = stages[trial % stages.size()];
    const int world = 2 + static_cast<int>(rng() % 2);
    // The index and the rename are rank 0's.
    const int victim = stage.find("before_") != std::string::npos ? 0 : static_cast<int>(rng() % world);
    const std::string layout = rng() % 2 ? "fsdp:full" : "ddp";
    const std::string dir = (root_ / ("crash_" + std::to_string(trial))).string();
    const std::string what = "trial " + std::to_string(trial) + ": rank " + std::to_string(victim) + " of " +
                             std::to_string(world) + " (" + layout + ") killed at " + stage;
    mp::RunOptions o;
    o.arg = "layout=" + layout + ",dir=" + dir + ",stage=" + stage + ",victim=" + std::to_string(victim);
    o.deadline = std::chrono::seconds(60);
    auto r = mp::run_workers("crash_job", world, o);
    for (const auto& w : r) {
      if (w.rank == victim) EXPECT_EQ(w.signal, SIGKILL) << what << "\n" << mp::describe(r);
      else EXPECT_TRUE(w.ok()) << what << "\n" << mp::describe(r);
    }
    EXPECT_TRUE(verify_checkpoint(dir).ok()) << what << ": " << verify_checkpoint(dir);
    std::ifstream trainer(dir + "/trainer.json");
    const std::string text((std::istreambuf_iterator<char>(trainer)), {});
    EXPECT_NE(text.find("\"step\": 1"), std::string::npos) << what << ": " << text;
    if (trial % 5 == 4) {  // a new job saves over it
      EMBER_EXPECT_RANKS("ckpt_job", world, {.arg = "phase=save,layout=" + layout + ",dir=" + dir})
          << what << ", then saving again";
      EXPECT_TRUE(verify_checkpoint(dir).ok()) << what;
    }
  }
}

// Damage: each is a named error before anything changes.
TEST_F(ShardedCheckpoint, DamageIsNamed) {
  const std::string dir = save("fsdp:full", 2);
  auto index = read_checkpoint_index(dir);
  ASSERT_TRUE(index.ok()) << index.status();
  const CheckpointTensor* w = index->find("l0.fc.weight");
  ASSERT_NE(w, nullptr);
  const CheckpointPiece p = w->pieces.back();
  const std::string file = dir + "/" + p.file;
  {  // one flipped byte
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(p.byte_begin + 3);
    char c;
    f.get(c);
    f.seekp(p.byte_begin + 3);
    f.put(static_cast<char>(c ^ 0x20));
  }
  const absl::Status v = verify_checkpoint(dir);
  EXPECT_FALSE(v.ok());
  const std::string m(v.message());
  EXPECT_NE(m.find(p.file), std::string::npos) << m;
  EXPECT_NE(m.find("'l0.fc.weight'"), std::string::npos) << m;
  EXPECT_NE(m.find(std::to_string(p.byte_begin)), std::string::npos) << m;
  EXPECT_NE(m.find("checksum"), std::string::npos) << m;

  // Loading it fails on every rank, naming the tensor.
  {
    mp::RunOptions o;
    o.arg = "phase=load,layout=fsdp:full,saved_world=2,dir=" + dir;
    auto r = mp::run_workers("ckpt_job", 2, o);
    EXPECT_FALSE(r[0].ok());
    EXPECT_NE(r[0].output.find("checksum mismatch in tensor 'l0.fc.weight'"), std::string::npos) << r[0].output;
  }

  // A truncated file, a missing file, another index version.
  const std::string dir2 = save("fsdp:full", 2);
  auto idx2 = read_checkpoint_index(dir2);
  ASSERT_TRUE(idx2.ok());
  fs::resize_file(dir2 + "/rank-00001.safetensors", 100);
  const absl::Status t = verify_checkpoint(dir2);
  EXPECT_NE(std::string(t.message()).find("truncated"), std::string::npos) << t;
  fs::remove(dir2 + "/rank-00001.safetensors");
  const absl::Status mi = verify_checkpoint(dir2);
  EXPECT_NE(std::string(mi.message()).find("rank-00001.safetensors: missing file"), std::string::npos) << mi;

  const std::string dir3 = save("single", 1);
  std::string text;
  {
    std::ifstream in(dir3 + "/index.json");
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  const size_t at = text.find("\"version\": 2");
  ASSERT_NE(at, std::string::npos) << text.substr(0, 200);
  text.replace(at, 12, "\"version\": 7");
  std::ofstream(dir3 + "/index.json") << text;
  const absl::Status ver = read_checkpoint_index(dir3).status();
  EXPECT_NE(std::string(ver.message()).find("version 7 is not supported"), std::string::npos) << ver;
}

// Checkpoint v2's boxes: a tensor sharded in 2-D boxes over a 2x2 mesh
// loads into column shards, uneven row shards, FSDP's flat runs and one
// process, and each of those saves load back into boxes; replicas write
// once.
TEST_F(ShardedCheckpoint, BoxShardedTensorsLoadInEveryLayout) {
  auto run = [&](const std::string& phase, const std::string& layout, int n, const std::string& dir) {
    EMBER_EXPECT_RANKS("box_job", n, {.arg = "phase=" + phase + ",layout=" + layout + ",dir=" + dir});
  };
  const std::string boxes = (root_ / "boxes").string();
  run("save", "tp2x2", 4, boxes);
  auto index = read_checkpoint_index(boxes);
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->version, 2);
  EXPECT_EQ(index->layout, "tp:tp2x2");
  const CheckpointTensor* w = index->find("w");
  ASSERT_NE(w, nullptr);
  ASSERT_EQ(w->pieces.size(), 4u);
  EXPECT_EQ(w->pieces[1].region.to_string(), "[0:3, 4:8] elements 0..12");
  EXPECT_EQ(index->find("optim.state.w.momentum_buffer")->pieces.size(), 4u);
  for (const auto& [layout, n] : std::vector<std::pair<std::string, int>>{
           {"tp2", 2}, {"rows3", 3}, {"fsdp", 3}, {"single", 1}, {"rep2x2", 4}, {"tp2x2", 4}})
    run("load", layout, n, boxes);
  // The other way: saved by each layout, loaded into boxes.
  for (const auto& [layout, n] :
       std::vector<std::pair<std::string, int>>{{"rep2x2", 4}, {"rows3", 3}, {"fsdp", 2}, {"single", 1}}) {
    const std::string dir = (root_ / ("from_" + layout)).string();
    run("save", layout, n, dir);
    run("load", "tp2x2", 4, dir);
  }
  // Replicas (dp) write once: two pieces, one per tp column block.
  auto rep = read_checkpoint_index((root_ / "from_rep2x2").string());
  ASSERT_TRUE(rep.ok()) << rep.status();
  EXPECT_EQ(rep->find("w")->pieces.size(), 2u);
}

// A checkpoint written by the version-1 format (a piece = a run of the
// whole tensor) still loads, into any layout.
TEST_F(ShardedCheckpoint, VersionOneCheckpointsStillLoad) {
  const std::string dir = (root_ / "v1").string();
  fs::copy("distributed/checkpoint/testdata/ckpt_v1/fsdp_full_2ranks", dir, fs::copy_options::recursive);
  fs::copy_file("distributed/checkpoint/testdata/ckpt_v1/fsdp_full_2ranks.full.safetensors", dir + ".full.safetensors");
  auto index = read_checkpoint_index(dir);
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->version, 1);
  EXPECT_TRUE(verify_checkpoint(dir).ok());
  load(dir, "fsdp:full", 3);
  load(dir, "ddp", 2);
  load(dir, "single", 1);
}

TEST_F(ShardedCheckpoint, SavingLeavesGatheredUnitsGathered) {
  const std::string dir = save("fsdp:full", 2, ",gathered=1");
  load(dir, "single", 1);
  load(dir, "fsdp:grad_op", 3);
}

}  // namespace
}  // namespace ember::distributed
