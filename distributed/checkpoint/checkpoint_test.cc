// Checkpoints: resuming gives bit-identical training to never stopping
// (SGD momentum, Adam, schedulers, dropout's RNG); a crash at any stage of a
// save leaves the previous checkpoint loadable and latest_checkpoint right;
// errors name the file and the tensor.
#include "distributed/checkpoint/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/ops.h"
#include "core/safetensors.h"
#include "nn/layers.h"
#include "optim/optimizer.h"

namespace ember::distributed {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string fresh_root(const std::string& name) {
  const char* d = std::getenv("TEST_TMPDIR");
  const std::string root = std::string(d ? d : "/tmp") + "/ckpt_" + name;
  fs::remove_all(root);
  fs::create_directories(root);
  return root;
}

struct Net : nn::Module {
  std::shared_ptr<nn::Linear> fc1, fc2;
  std::shared_ptr<nn::Dropout> drop;
  explicit Net(int64_t hidden = 8) : Module("Net") {
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(4, hidden));
    drop = register_module("drop", std::make_shared<nn::Dropout>(0.25));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(hidden, 3));
  }
  Tensor forward(const Tensor& x) override { return (*fc2)((*drop)(relu((*fc1)(x)))); }
};

// One training setup: model, optimizer and scheduler built the same way
// every time (only the RNG state at construction differs).
struct Trainer {
  std::unique_ptr<Net> model = std::make_unique<Net>();
  std::unique_ptr<optim::Optimizer> opt;
  std::unique_ptr<optim::LRScheduler> sched;
  std::vector<std::shared_ptr<optim::LRScheduler>> parts;

  explicit Trainer(const std::string& kind) {
    auto params = model->parameters();
    if (kind == "sgd") {
      opt = std::make_unique<optim::SGD>(params, optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-3,
                                                                   .nesterov = true});
      sched = std::make_unique<optim::StepLR>(*opt, 3, 0.5);
    } else {
      // Two groups, Adam with amsgrad, warmup then cosine.
      std::vector<optim::ParamGroup> groups = {{{params[0], params[1]}, {}}, {{params[2], params[3]}, {{"lr", 0.003}}}};
      opt = std::make_unique<optim::Adam>(groups, optim::AdamOptions{.lr = 0.01, .weight_decay = 1e-4, .amsgrad = true});
      parts = {std::make_shared<optim::LinearLR>(*opt, 0.1, 1.0, 3), std::make_shared<optim::CosineAnnealingLR>(*opt, 10)};
      sched = std::make_unique<optim::SequentialLR>(*opt, parts, std::vector<int64_t>{3});
    }
  }
  void steps(int n) {
    for (int i = 0; i < n; ++i) {
      Tensor x = randn({6, 4});  // data from the default generator, as dropout
      Tensor y = randn({6, 3});
      opt->zero_grad();
      Tensor loss = nn::functional::mse_loss((*model)(x), y);
      loss.backward();
      opt->step();
      sched->step();
    }
  }
};

std::string bytes_of(const Tensor& t) {
  Tensor c = t.detach().cpu().contiguous();
  return std::string(static_cast<const char*>(c.raw_data()), c.nbytes());
}

void expect_bit_identical(const Trainer& a, const Trainer& b) {
  auto pa = a.model->state_dict(), pb = b.model->state_dict();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa.items()[i].first, pb.items()[i].first);
    EXPECT_EQ(bytes_of(pa.items()[i].second), bytes_of(pb.items()[i].second)) << pa.items()[i].first;
  }
  auto sa = a.opt->state_dict(), sb = b.opt->state_dict();
  ASSERT_EQ(sa.state.size(), sb.state.size());
  for (size_t i = 0; i < sa.state.size(); ++i) {
    EXPECT_EQ(sa.state[i].first, sb.state[i].first);
    EXPECT_EQ(bytes_of(sa.state[i].second), bytes_of(sb.state[i].second)) << sa.state[i].first;
  }
  ASSERT_EQ(sa.param_groups.size(), sb.param_groups.size());
  for (size_t g = 0; g < sa.param_groups.size(); ++g) EXPECT_EQ(sa.param_groups[g].options, sb.param_groups[g].options);
  EXPECT_EQ(a.sched->last_epoch(), b.sched->last_epoch());
  EXPECT_EQ(a.sched->get_last_lr(), b.sched->get_last_lr());
}

// latest_checkpoint's answer, or its error message.
std::string latest(const std::string& root, const std::string& prefix = "epoch_", bool fall_back = false) {
  auto r = latest_checkpoint(root, prefix, fall_back);
  if (!r.ok()) return "error: " + std::string(r.status().message());
  return r->value_or("none");
}

void resume_is_exact(const std::string& kind) {
  const int n = 5, m = 4;
  const std::string root = fresh_root("resume_" + kind);

  manual_seed(1234);
  Trainer reference(kind);
  reference.steps(n + m);
  const uint64_t ref_offset = default_generator().offset();

  manual_seed(1234);
  {
    Trainer first(kind);
    first.steps(n);
    TrainingState st{.epoch = 2, .step = n, .extra_json = R"({"sampler_seed":7,"note":"x"})"};
    ASSERT_TRUE(save_checkpoint(root + "/epoch_2", *first.model, first.opt.get(), first.sched.get(), st).ok());
  }
  manual_seed(999);  // a different init and RNG stream: the load must undo both
  Trainer resumed(kind);
  auto st = load_checkpoint(root + "/epoch_2/", *resumed.model, resumed.opt.get(), resumed.sched.get());
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->epoch, 2);
  EXPECT_EQ(st->step, n);
  EXPECT_EQ(st->rng_seed, 1234u);
  EXPECT_EQ(st->rng_seed, default_generator().seed());
  EXPECT_EQ(st->rng_offset, default_generator().offset());
  EXPECT_EQ(st->extra_json, R"({"sampler_seed":7,"note":"x"})");
  resumed.steps(m);
  EXPECT_EQ(default_generator().offset(), ref_offset);
  expect_bit_identical(reference, resumed);
  EXPECT_EQ(latest(root), root + "/epoch_2");
}

TEST(Checkpoint, ResumeIsBitExactSGDMomentumStepLR) { resume_is_exact("sgd"); }
TEST(Checkpoint, ResumeIsBitExactAdamTwoGroupsSequentialLR) { resume_is_exact("adam"); }

TEST(Checkpoint, FilesFollowTheLayout) {
  const std::string root = fresh_root("layout");
  manual_seed(3);
  Trainer t("adam");
  t.steps(1);
  ASSERT_TRUE(save_checkpoint(root + "/epoch_0", *t.model, t.opt.get(), t.sched.get(), {.epoch = 0, .step = 1}).ok());
  auto model = load_safetensors(root + "/epoch_0/model.safetensors");
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<std::string> names;
  for (auto& [k, v] : model->tensors) names.push_back(k);
  EXPECT_EQ(names, (std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}));
  EXPECT_EQ(model->metadata.at("format"), "pt");
  auto opt = load_safetensors(root + "/epoch_0/optimizer.safetensors");
  ASSERT_TRUE(opt.ok()) << opt.status();
  ASSERT_NE(opt->find("state.0.exp_avg"), nullptr);
  ASSERT_NE(opt->find("state.3.step"), nullptr);
  EXPECT_EQ(opt->find("state.3.step")->item(), 1.0);
  std::ifstream in(root + "/epoch_0/trainer.json");
  std::string json((std::istreambuf_iterator<char>(in)), {});
  EXPECT_THAT(json, HasSubstr(R"("format": "ember-checkpoint")"));
  EXPECT_THAT(json, HasSubstr(R"("version": 1)"));
  EXPECT_THAT(json, HasSubstr(R"("name": "Adam")"));
  EXPECT_THAT(json, HasSubstr(R"("seed": 3)"));
  for (auto& e : fs::directory_iterator(root)) EXPECT_EQ(e.path().filename(), "epoch_0");  // no leftovers
}

TEST(Checkpoint, ModelOnlyAndNullOptimizer) {
  const std::string root = fresh_root("model_only");
  manual_seed(5);
  Net a;
  ASSERT_TRUE(save_checkpoint(root + "/m", a, nullptr, nullptr, {}).ok());
  EXPECT_FALSE(fs::exists(root + "/m/optimizer.safetensors"));
  manual_seed(6);
  Net b;
  ASSERT_TRUE(load_checkpoint(root + "/m", b, nullptr, nullptr).ok());
  EXPECT_EQ(bytes_of(a.fc1->weight), bytes_of(b.fc1->weight));
  // Asking for optimizer state the checkpoint does not have.
  optim::SGD opt(b.parameters(), {.lr = 0.1});
  auto s = load_checkpoint(root + "/m", b, &opt, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr("trainer.json: the checkpoint holds no optimizer state"));
  // extra_json must be an object.
  EXPECT_FALSE(save_checkpoint(root + "/x", a, nullptr, nullptr, {.extra_json = "[1]"}).ok());
  EXPECT_FALSE(save_checkpoint(root + "/x", a, nullptr, nullptr, {.extra_json = "{oops"}).ok());
  EXPECT_FALSE(fs::exists(root + "/x"));
}

TEST(Checkpoint, OptimizerStateFollowsParameterNames) {
  // The optimizer that loads lists the parameters in the opposite order:
  // by position every entry would land on the wrong (mis-shaped) tensor;
  // by the names trainer.json records each parameter gets its own state.
  const std::string root = fresh_root("by_name");
  manual_seed(7);
  Net a;
  optim::Adam opt_a(a.parameters(), {.lr = 0.01});
  for (const Tensor& p : a.parameters()) p.set_grad(randn(p.sizes()));
  opt_a.step();
  ASSERT_TRUE(save_checkpoint(root + "/c", a, &opt_a, nullptr, {}).ok());
  std::ifstream in(root + "/c/trainer.json");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("\"param_names\""));
  EXPECT_THAT(text, HasSubstr("\"fc2.bias\""));
  Net b;
  auto reversed = b.parameters();
  std::reverse(reversed.begin(), reversed.end());
  optim::Adam opt_b(reversed, {.lr = 0.01});
  auto st = load_checkpoint(root + "/c", b, &opt_b, nullptr);
  ASSERT_TRUE(st.ok()) << st.status();
  auto na = a.named_parameters(), nb = b.named_parameters();
  for (size_t i = 0; i < na.size(); ++i)
    for (const char* k : {"exp_avg", "exp_avg_sq", "step"})
      EXPECT_EQ(opt_b.state(nb[i].second).at(k).to_vector(), opt_a.state(na[i].second).at(k).to_vector())
          << na[i].first << " " << k;
  // A name the model does not have is named in the error.
  std::string edited = text;
  edited.replace(edited.find("\"fc1.weight\""), 12, "\"fc9.weight\"");
  std::ofstream(root + "/c/trainer.json") << edited;
  Net c;
  optim::Adam opt_c(c.parameters(), {.lr = 0.01});
  st = load_checkpoint(root + "/c", c, &opt_c, nullptr);
  ASSERT_FALSE(st.ok());
  EXPECT_THAT(st.status().message(), HasSubstr("no entry for parameter 'fc1.weight'"));
}

// ---- Crash safety ----

struct SimulatedCrash {
  std::string stage;
};

// Runs save_checkpoint with a "crash" (an exception nothing catches, so no
// cleanup runs) at `stage`; the disk is left as a real crash would leave it.
void save_crashing_at(const std::string& stage, const std::string& dir, const nn::Module& model, int64_t epoch,
                      bool no_exchange = false) {
  testing::set_checkpoint_save_hooks({[&](const std::string& s, const std::string&) {
                                        if (s == stage) throw SimulatedCrash{s};
                                      },
                                      no_exchange});
  bool crashed = false;
  try {
    (void)save_checkpoint(dir, model, nullptr, nullptr, {.epoch = epoch});
  } catch (const SimulatedCrash&) {
    crashed = true;
  }
  testing::set_checkpoint_save_hooks({});
  EXPECT_TRUE(crashed) << "stage " << stage << " never reached";
}

int64_t epoch_of(const std::string& dir) {
  Net n;
  auto st = load_checkpoint(dir, n, nullptr, nullptr);
  EXPECT_TRUE(st.ok()) << dir << ": " << st.status();
  return st.ok() ? st->epoch : -1;
}

TEST(CheckpointCrash, NewEpochDirectory) {
  for (const std::string stage : {"model_written", "tmp_complete"}) {
    SCOPED_TRACE(stage);
    const std::string root = fresh_root("crash_new_" + stage);
    Net net;
    ASSERT_TRUE(save_checkpoint(root + "/epoch_1", net, nullptr, nullptr, {.epoch = 1}).ok());
    save_crashing_at(stage, root + "/epoch_2", net, 2);
    EXPECT_FALSE(fs::exists(root + "/epoch_2"));
    EXPECT_TRUE(fs::exists(root + "/epoch_2.tmp-" + std::to_string(getpid())));
    EXPECT_EQ(latest(root), root + "/epoch_1");
    EXPECT_EQ(epoch_of(root + "/epoch_1"), 1);
    // The next save (same pid: the leftover is ours) succeeds.
    ASSERT_TRUE(save_checkpoint(root + "/epoch_2", net, nullptr, nullptr, {.epoch = 2}).ok());
    EXPECT_EQ(latest(root), root + "/epoch_2");
    EXPECT_FALSE(fs::exists(root + "/epoch_2.tmp-" + std::to_string(getpid())));
  }
}

TEST(CheckpointCrash, ReplacingADirectory) {
  const std::string pid = std::to_string(getpid());
  struct Case {
    std::string stage;
    bool no_exchange;
    int64_t epoch_at_dir;  // what "latest" holds after the crash (-1: absent)
  };
  for (const Case& c : {Case{"model_written", false, 1}, Case{"tmp_complete", false, 1}, Case{"exchanged", false, 2},
                        Case{"model_written", true, 1}, Case{"tmp_complete", true, 1},
                        Case{"old_moved_aside", true, -1}, Case{"renamed", true, 2}}) {
    SCOPED_TRACE(c.stage + (c.no_exchange ? " (two renames)" : " (exchange)"));
    const std::string root = fresh_root("crash_replace");
    const std::string dir = root + "/latest";
    Net net;
    ASSERT_TRUE(save_checkpoint(dir, net, nullptr, nullptr, {.epoch = 1}).ok());
    save_crashing_at(c.stage, dir, net, 2, c.no_exchange);
    if (c.epoch_at_dir >= 0) {
      EXPECT_EQ(epoch_of(dir), c.epoch_at_dir);
    } else {
      // The window of the fallback: no <dir>, but both checkpoints intact.
      EXPECT_FALSE(fs::exists(dir));
      EXPECT_EQ(epoch_of(dir + ".old-" + pid), 1);
      EXPECT_EQ(epoch_of(dir + ".tmp-" + pid), 2);
    }
    if (c.stage == "exchanged") {
      EXPECT_EQ(epoch_of(dir + ".tmp-" + pid), 1);  // the old one, not yet removed
    }
    // Saving again recovers whatever was left.
    testing::set_checkpoint_save_hooks({nullptr, c.no_exchange});
    ASSERT_TRUE(save_checkpoint(dir, net, nullptr, nullptr, {.epoch = 3}).ok());
    testing::set_checkpoint_save_hooks({});
    EXPECT_EQ(epoch_of(dir), 3);
  }
}

TEST(CheckpointCrash, LatestSkipsLeftoversAndForeignEntries) {
  const std::string root = fresh_root("latest");
  EXPECT_EQ(latest(root), "none");
  EXPECT_EQ(latest(root + "/missing"), "none");
  Net net;
  ASSERT_TRUE(save_checkpoint(root + "/epoch_3", net, nullptr, nullptr, {.epoch = 3}).ok());
  ASSERT_TRUE(save_checkpoint(root + "/epoch_10", net, nullptr, nullptr, {.epoch = 10}).ok());
  EXPECT_EQ(latest(root), root + "/epoch_10");  // numeric, not lexicographic order
  // Leftovers and look-alikes are not checkpoints.
  fs::copy(root + "/epoch_10", root + "/epoch_20.tmp-12345");
  fs::copy(root + "/epoch_10", root + "/epoch_21.old-12345");
  fs::copy(root + "/epoch_10", root + "/epoch_x");
  fs::copy(root + "/epoch_10", root + "/step_99");
  std::ofstream(root + "/epoch_30") << "a file";
  EXPECT_EQ(latest(root), root + "/epoch_10");
  EXPECT_EQ(latest(root, "step_"), root + "/step_99");
}

// Regression: a damaged newest checkpoint was skipped without a word (resume
// then continued from an older one and later overwrote the damaged one).
// Saves are atomic, so a damaged epoch_N is reported by name and cause, and
// only an explicit fallback moves on to the previous one.
TEST(CheckpointCrash, ADamagedNewestCheckpointIsReportedNotSkipped) {
  const std::string root = fresh_root("damaged");
  Net net;
  ASSERT_TRUE(save_checkpoint(root + "/epoch_10", net, nullptr, nullptr, {.epoch = 10}).ok());
  // epoch_11: no trainer.json.
  fs::create_directories(root + "/epoch_11");
  fs::copy_file(root + "/epoch_10/model.safetensors", root + "/epoch_11/model.safetensors");
  EXPECT_THAT(latest(root), HasSubstr("the newest checkpoint " + root + "/epoch_11 is damaged"));
  EXPECT_THAT(latest(root), HasSubstr(root + "/epoch_11/trainer.json: missing file"));
  // epoch_12: trainer.json cut short.
  fs::copy(root + "/epoch_10", root + "/epoch_12");
  fs::resize_file(root + "/epoch_12/trainer.json", 20);
  EXPECT_THAT(latest(root), HasSubstr(root + "/epoch_12/trainer.json: invalid JSON"));
  // epoch_13: no model file.
  fs::copy(root + "/epoch_10", root + "/epoch_13");
  fs::remove(root + "/epoch_13/model.safetensors");
  EXPECT_THAT(latest(root), HasSubstr(root + "/epoch_13/model.safetensors: missing file"));
  // epoch_14: another format version.
  fs::copy(root + "/epoch_10", root + "/epoch_14");
  {
    std::ifstream in(root + "/epoch_14/trainer.json");
    std::string t((std::istreambuf_iterator<char>(in)), {});
    const size_t at = t.find("\"version\": 1");
    ASSERT_NE(at, std::string::npos);
    t.replace(at, 12, "\"version\": 7");
    std::ofstream(root + "/epoch_14/trainer.json", std::ios::trunc) << t;
  }
  EXPECT_THAT(latest(root), HasSubstr("version 7 is not supported"));
  // Asked for, the fallback passes over all four to epoch_10, leaving them be.
  EXPECT_EQ(latest(root, "epoch_", true), root + "/epoch_10");
  EXPECT_TRUE(fs::exists(root + "/epoch_14/trainer.json"));
}

// Regression (found by tools/fault_suite.py): a newest checkpoint whose
// model file was cut short, or whose optimizer file is missing, passed
// latest_checkpoint, so --resume-fallback could not skip it and the load
// failed instead. Tensor files' headers and sizes are checked now (without
// reading the tensors).
TEST(CheckpointCrash, TruncatedOrMissingTensorFilesAreDamage) {
  const std::string root = fresh_root("tensorfiles");
  Net net;
  optim::SGD opt(net.parameters(), {.lr = 0.1, .momentum = 0.9});
  for (auto& p : net.parameters()) p.set_grad(ember::full(p.sizes(), 1.0));
  opt.step();
  ASSERT_TRUE(save_checkpoint(root + "/epoch_1", net, &opt, nullptr, {.epoch = 1}).ok());
  fs::copy(root + "/epoch_1", root + "/epoch_2");
  fs::resize_file(root + "/epoch_2/model.safetensors", fs::file_size(root + "/epoch_2/model.safetensors") - 4);
  EXPECT_THAT(latest(root), HasSubstr(root + "/epoch_2/model.safetensors"));
  EXPECT_THAT(latest(root), HasSubstr("is damaged"));
  fs::copy(root + "/epoch_1", root + "/epoch_3");
  fs::remove(root + "/epoch_3/optimizer.safetensors");
  EXPECT_THAT(latest(root), HasSubstr(root + "/epoch_3/optimizer.safetensors: missing file"));
  EXPECT_EQ(latest(root, "epoch_", true), root + "/epoch_1");
}

// ---- Errors name the file and the problem ----

class CheckpointErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fresh_root("errors");
    dir_ = root_ + "/epoch_1";
    manual_seed(11);
    Trainer t("sgd");
    t.steps(2);
    ASSERT_TRUE(save_checkpoint(dir_, *t.model, t.opt.get(), t.sched.get(), {.epoch = 1}).ok());
  }
  absl::Status load_into(nn::Module& m, optim::Optimizer* opt = nullptr) {
    return load_checkpoint(dir_, m, opt, nullptr).status();
  }
  void rewrite_trainer(const std::string& from, const std::string& to) {
    const std::string path = dir_ + "/trainer.json";
    std::ifstream in(path);
    std::string s((std::istreambuf_iterator<char>(in)), {});
    const size_t at = s.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    s.replace(at, from.size(), to);
    std::ofstream(path, std::ios::trunc) << s;
  }
  std::string root_, dir_;
};

TEST_F(CheckpointErrors, MissingDirectoryAndFiles) {
  Net net;
  auto s = load_checkpoint(root_ + "/epoch_9", net, nullptr, nullptr).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("epoch_9"));
  fs::remove(dir_ + "/model.safetensors");
  s = load_into(net);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr(dir_ + "/model.safetensors"));
  fs::remove(dir_ + "/trainer.json");
  s = load_into(net);
  EXPECT_THAT(s.message(), HasSubstr(dir_ + "/trainer.json: missing file"));
}

// Regression: a trainer.json of deeply nested JSON (a few hundred KB)
// overflowed the stack inside the JSON parser and crashed resume; a huge one
// was read whole. Both are now errors naming the file.
TEST_F(CheckpointErrors, CraftedTrainerJsonIsAnErrorNotACrash) {
  Net net;
  const std::string path = dir_ + "/trainer.json";
  std::ofstream(path, std::ios::trunc) << std::string(200000, '[') << std::string(200000, ']');
  auto s = load_into(net);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr(path));
  EXPECT_THAT(s.message(), HasSubstr("nested deeper than 128 levels"));
  { std::ofstream(path, std::ios::trunc) << "{}"; }
  fs::resize_file(path, (64 << 20) + 1);  // sparse
  s = load_into(net);
  EXPECT_THAT(s.message(), HasSubstr(path));
  EXPECT_THAT(s.message(), HasSubstr("more than the 67108864"));
  // And a user's extra JSON that nests too deep is refused at save.
  Trainer t("sgd");
  TrainingState st;
  st.extra_json = std::string(1000, '[') + std::string(1000, ']');
  s = save_checkpoint(root_ + "/epoch_2", *t.model, t.opt.get(), t.sched.get(), st);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("extra_json"));
}

// Regression: a negative epoch was accepted (training then resumed "before"
// the checkpoint and overwrote it).
TEST_F(CheckpointErrors, NegativeCountsAreRefusedNamingFileAndField) {
  Net net;
  rewrite_trainer("\"epoch\": 1", "\"epoch\": -3");
  auto s = load_into(net);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr(dir_ + "/trainer.json"));
  EXPECT_THAT(s.message(), HasSubstr("\"epoch\" is -3"));
  Trainer t("sgd");
  s = save_checkpoint(root_ + "/epoch_5", *t.model, t.opt.get(), t.sched.get(), {.epoch = -1});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("epoch -1"));
  EXPECT_FALSE(fs::exists(root_ + "/epoch_5"));
}

TEST_F(CheckpointErrors, MissingOptimizerFile) {
  Trainer t("sgd");
  fs::remove(dir_ + "/optimizer.safetensors");
  auto s = load_into(*t.model, t.opt.get());
  EXPECT_THAT(s.message(), HasSubstr(dir_ + "/optimizer.safetensors"));
}

TEST_F(CheckpointErrors, CorruptedFiles) {
  Net net;
  const std::string model = dir_ + "/model.safetensors";
  fs::resize_file(model, fs::file_size(model) - 5);
  auto s = load_into(net);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr(model));
  EXPECT_THAT(s.message(), HasSubstr("tensor 'fc2.bias'"));
  EXPECT_THAT(s.message(), HasSubstr("out of range"));

  fs::resize_file(dir_ + "/trainer.json", 30);
  s = load_into(net);
  EXPECT_THAT(s.message(), HasSubstr(dir_ + "/trainer.json: invalid JSON"));
}

TEST_F(CheckpointErrors, WrongFormatVersionAndFields) {
  Net net;
  rewrite_trainer(R"("version": 1)", R"("version": 2)");
  EXPECT_THAT(load_into(net).message(), HasSubstr("trainer.json: version 2 is not supported"));
  rewrite_trainer(R"("version": 2)", R"("version": 1)");
  rewrite_trainer(R"("epoch": 1)", R"("epoch": "one")");
  EXPECT_THAT(load_into(net).message(), HasSubstr("trainer.json: \"epoch\" is not an integer"));
  rewrite_trainer(R"("format": "ember-checkpoint")", R"("format": "other")");
  EXPECT_THAT(load_into(net).message(), HasSubstr("trainer.json: \"format\" is \"other\", expected"));
}

TEST_F(CheckpointErrors, MisShapedMissingAndUnexpectedTensors) {
  Net wider(9);
  auto s = load_into(wider);
  EXPECT_THAT(s.message(), HasSubstr(dir_ + "/model.safetensors: tensor 'fc1.weight' has shape [8,4] in the "
                                            "checkpoint, [9,4] in the model"));

  struct Bigger : Net {
    std::shared_ptr<nn::Linear> head;
    Bigger() { head = register_module("head", std::make_shared<nn::Linear>(3, 2)); }
  } bigger;
  EXPECT_THAT(load_into(bigger).message(), HasSubstr("model.safetensors: missing tensor 'head.weight'"));

  struct Smaller : nn::Module {
    std::shared_ptr<nn::Linear> fc1;
    Smaller() : Module("Smaller") { fc1 = register_module("fc1", std::make_shared<nn::Linear>(4, 8)); }
  } smaller;
  EXPECT_THAT(load_into(smaller).message(), HasSubstr("model.safetensors: unexpected tensor 'fc2.weight'"));
}

TEST_F(CheckpointErrors, OptimizerMismatchesAndFailedLoadChangesNothing) {
  manual_seed(77);
  Trainer t("sgd");
  t.steps(1);
  const std::string before = bytes_of(t.model->fc1->weight);
  const std::string state_before = bytes_of(t.opt->state_dict().state[0].second);
  const uint64_t offset_before = default_generator().offset();

  optim::Adam adam(t.model->parameters());
  EXPECT_THAT(load_into(*t.model, &adam).message(),
              HasSubstr("trainer.json: the checkpoint's optimizer is \"SGD\", the optimizer given is Adam"));

  // A mis-shaped optimizer state tensor, named with its file.
  const std::string opt_path = dir_ + "/optimizer.safetensors";
  auto f = load_safetensors(opt_path);
  ASSERT_TRUE(f.ok());
  for (auto& [k, v] : f->tensors)
    if (k == "state.0.momentum_buffer") v = zeros({2, 2});
  ASSERT_TRUE(save_safetensors(opt_path, f->tensors).ok());
  auto s = load_into(*t.model, t.opt.get());
  EXPECT_THAT(s.message(), HasSubstr(opt_path));
  EXPECT_THAT(s.message(), HasSubstr("state.0.momentum_buffer"));
  // Nothing changed: model, optimizer state, RNG.
  EXPECT_EQ(bytes_of(t.model->fc1->weight), before);
  EXPECT_EQ(bytes_of(t.opt->state_dict().state[0].second), state_before);
  EXPECT_EQ(default_generator().offset(), offset_before);

  // Param groups that do not fit.
  optim::SGD one_param({t.model->fc1->weight}, {.lr = 0.1, .momentum = 0.9});
  ASSERT_TRUE(save_safetensors(opt_path, {}).ok());
  EXPECT_THAT(load_into(*t.model, &one_param).message(), HasSubstr("parameters in the state dict"));
}

TEST_F(CheckpointErrors, SchedulerMismatch) {
  manual_seed(1);
  Trainer t("adam");  // two groups; the checkpoint's scheduler had one
  auto s = load_checkpoint(dir_, *t.model, nullptr, t.sched.get()).status();
  EXPECT_THAT(s.message(), HasSubstr("trainer.json: the scheduler state has 1 base_lrs"));
}

}  // namespace
}  // namespace ember::distributed
