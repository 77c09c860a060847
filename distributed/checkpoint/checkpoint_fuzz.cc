// Fuzz target: a checkpoint's trainer.json (untrusted: it may come from a
// damaged disk or someone else). Setup saves a real checkpoint of a small
// model with an SGD-momentum optimizer and a StepLR scheduler; each input
// replaces its trainer.json, then load_checkpoint and latest_checkpoint run.
// Beyond not crashing: a failed load names trainer.json and leaves the
// model's parameters exactly as they were; a successful one has a
// non-negative epoch and step.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "distributed/checkpoint/checkpoint.h"
#include "nn/layers.h"
#include "optim/lr_scheduler.h"
#include "optim/optimizer.h"

namespace {

namespace fs = std::filesystem;
using namespace ember;

void require(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "checkpoint_fuzz: invariant broken: %s\n", what.c_str());
    std::abort();
  }
}

struct Fixture {
  std::string root, dir;
  std::shared_ptr<nn::Sequential> model;
  std::unique_ptr<optim::SGD> opt;
  std::unique_ptr<optim::StepLR> sched;
  std::vector<std::vector<double>> params;  // as saved

  Fixture() {
    const char* shm = fs::is_directory("/dev/shm") ? "/dev/shm" : "/tmp";
    root = std::string(shm) + "/ember_checkpoint_fuzz_" + std::to_string(getpid());
    dir = root + "/epoch_3";
    fs::remove_all(root);
    fs::create_directories(root);
    model = std::make_shared<nn::Sequential>(
        std::vector<std::shared_ptr<nn::Module>>{std::make_shared<nn::Linear>(3, 4), std::make_shared<nn::Linear>(4, 2)});
    opt = std::make_unique<optim::SGD>(model->parameters(), optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
    sched = std::make_unique<optim::StepLR>(*opt, 2, 0.5);
    // One step so that the optimizer has momentum buffers to save.
    for (auto& p : model->parameters()) p.set_grad(ember::full(p.sizes(), 0.5));
    opt->step();
    sched->step();
    distributed::TrainingState st;
    st.epoch = 3;
    st.step = 30;
    auto saved = distributed::save_checkpoint(dir, *model, opt.get(), sched.get(), st);
    require(saved.ok(), "setup: " + std::string(saved.message()));
    for (auto& p : model->parameters()) params.push_back(p.to_vector());
    // The seed corpus's good.json is this file (tools/fuzz/make_seeds.py).
    if (std::getenv("EMBER_FUZZ_PRINT_SEED")) {
      std::ifstream in(dir + "/trainer.json");
      std::fprintf(stderr, "%s\n", std::string(std::istreambuf_iterator<char>(in), {}).c_str());
    }
    // At exit the fixture may already be destroyed: keep the path apart.
    static char root_copy[512];
    std::snprintf(root_copy, sizeof root_copy, "%s", root.c_str());
    std::atexit([] { std::error_code ec; fs::remove_all(root_copy, ec); });
  }

  static Fixture& instance() {
    static Fixture f;
    return f;
  }
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  Fixture::instance();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Fixture& f = Fixture::instance();
  {
    std::ofstream out(f.dir + "/trainer.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  auto st = distributed::load_checkpoint(f.dir, *f.model, f.opt.get(), f.sched.get());
  if (st.ok()) {
    require(st->epoch >= 0 && st->step >= 0, "a negative epoch or step loaded");
  } else {
    require(std::string(st.status().message()).find("trainer.json") != std::string::npos ||
                std::string(st.status().message()).find(f.dir) != std::string::npos,
            "an error that names neither the file nor the checkpoint: " + std::string(st.status().message()));
    auto ps = f.model->parameters();
    for (size_t i = 0; i < ps.size(); ++i) require(ps[i].to_vector() == f.params[i], "a failed load changed the model");
  }
  auto latest = distributed::latest_checkpoint(f.root);
  // latest_checkpoint checks less than a load, but never calls a loadable
  // checkpoint damaged.
  if (st.ok()) require(latest.ok() && latest->has_value(), "latest_checkpoint rejects a loadable checkpoint");
  std::vector<std::string> skipped;
  auto fallback = distributed::latest_checkpoint(f.root, "epoch_", true, &skipped);
  require(fallback.ok(), "fall_back with one checkpoint must not fail");
  return 0;
}
