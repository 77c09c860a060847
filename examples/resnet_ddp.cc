// Data-parallel ResNet training on Fashion-MNIST: the whole distributed
// stack in one program. It launches its own workers (one per GPU, else 2 on
// the CPU with 1 OpenMP thread each), shards the data with a
// DistributedSampler, synchronizes gradients with DistributedDataParallel
// (optionally accumulating them over micro-batches), evaluates on every
// rank's shard of the test set, and checkpoints after each epoch so that
// --resume continues exactly where a run stopped.
//
//   bazel run -c opt //examples:resnet_ddp                      # 2 CPU workers, narrow ResNet-18
//   bazel run -c opt //examples:resnet_ddp -- --resume          # continue from the newest checkpoint
//   bazel run //tools:launch -- --nproc_per_node=2 -- bazel-bin/examples/resnet_ddp
//   srun -n 4 bazel-bin/examples/resnet_ddp --model resnet18    # the environment names the ranks
//
// The default run (narrow ResNet-18, 2 epochs, batch 64 per rank, lr 0.1)
// took 177 s on the 2-core CI machine (~750 img/s, -c opt, 2026-11-23) and
// reached 0.9227 test accuracy (0.8737 after the first epoch).
//
// Flags: --help lists them. The learning rate follows the linear scaling
// rule: --lr is the rate for kBaseBatch images per step, multiplied by
// (per-rank batch * ranks * accumulation steps) / kBaseBatch, reached after a
// linear warmup and then decayed along a cosine.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/autocast.h"
#include "core/ops.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "data/readers.h"
#include "data/sampler.h"
#include "data/transforms.h"
#include "distributed/checkpoint/checkpoint.h"
#include "distributed/checkpoint/live_recovery.h"
#include "distributed/checkpoint/sharded.h"
#include "distributed/config_check.h"
#include "distributed/init.h"
#include "distributed/launch/launch.h"
#include "distributed/logging/logging.h"
#include "distributed/parallel/ddp.h"
#include "distributed/parallel/powersgd.h"
#include "examples/flags.h"
#include "examples/profiling.h"
#include "examples/training.h"
#include "nn/checkpoint.h"
#include "nn/functional.h"
#include "nn/models.h"
#include "optim/grad_scaler.h"
#include "optim/graphed_step.h"
#include "optim/lr_scheduler.h"
#include "optim/optimizer.h"

namespace ember {
namespace {

namespace fs = std::filesystem;
using examples::Clock;
using examples::seconds;

// --lr is the rate for this many images per optimizer step (the linear
// scaling rule's reference batch; 0.05 at 64 is what resnet_fashion uses).
constexpr int64_t kBaseBatch = 64;
constexpr double kMean = 0.2860, kStd = 0.3530;  // Fashion-MNIST train-set pixel statistics

struct Flags {
  examples::CommonFlags common{
      .batch_size = 64, .lr = 0.05, .checkpoint_dir = "/tmp/ember_resnet_ddp", .data = data::kFashionMnistRoot};
  std::string model;  // empty: "narrow" on the CPU, "resnet18" on GPUs
  int64_t epochs = 2;
  bool sync_bn = false;
  int workers = 1;
  bool resume_fallback = false;  // a damaged newest checkpoint: use the previous one (warned)
  int64_t max_steps = -1;        // optimizer steps per epoch; -1: the whole epoch (for smoke tests)
  int64_t eval_size = -1;        // test examples evaluated; -1: all
  std::string grad_compress = "off";  // off | bf16 | fp16 | powersgd (DDP's gradient-compression hook)
  int powersgd_rank = 2;              // PowerSGD's matrix approximation rank
  int64_t powersgd_start = -1;        // steps before PowerSGD starts; -1: the learning-rate warm-up's
  int cuda_graph = 0;                 // 1: the step as one CUDA graph (optim/graphed_step.h)
  bool data_given = false;
};

// Every flag once: name, value, help, validation (examples/flags.h).
void declare(examples::FlagTable& t, Flags& f) {
  examples::add_common_flags(t, f.common, "images",
                             "learning rate for 64 images per step, scaled linearly to the global batch");
  t.add({"--model", "NAME",
         "narrow (ResNet-18, width 16) | resnet18 | resnet34 | resnet50 (small 3x3 stem;\n"
         "default: narrow on the CPU, resnet18 on GPUs)",
         [&t, &f](const std::string& v) {
           if (v != "narrow" && v != "resnet18" && v != "resnet34" && v != "resnet50")
             t.error("--model must be narrow, resnet18, resnet34 or resnet50, got '" + v + "'");
           f.model = v;
         },
         [&f] { return f.model; }});
  t.integer("--epochs", &f.epochs, 1, "N", "epochs in total, counting those already done when resuming");
  t.toggle("--sync-bn", &f.sync_bn, "batch-norm statistics over all ranks' batches (SyncBatchNorm)");
  t.integer("--workers", &f.workers, 0, "N", "data-loading threads per rank", false);
  t.toggle("--resume-fallback", &f.resume_fallback,
           "with --resume: if the newest checkpoint is damaged, warn and use the previous one");
  t.integer("--max-steps", &f.max_steps, 1, "N",
            "stop each epoch after N optimizer steps (smoke tests; default: the whole epoch)");
  t.integer("--eval-size", &f.eval_size, 1, "N",
            "evaluate on the first N test images only (smoke tests; default: all)");
  t.choice("--grad-compress", &f.grad_compress, {"off", "bf16", "fp16", "powersgd"},
           "allreduce gradients in bfloat16 / float16 (DDP's compression hook: half the bytes),\n"
           "or compress each weight matrix to rank R with PowerSGD");
  t.integer("--powersgd-rank", &f.powersgd_rank, 1, "R", "PowerSGD's rank: an n x m gradient sends R (n + m) numbers");
  t.integer("--powersgd-start", &f.powersgd_start, 0, "N",
            "steps of plain allreduce before PowerSGD (default: the warm-up's steps)");
  t.integer("--cuda-graph", &f.cuda_graph, 0, "0|1",
            "1: after three eager warm-up steps, the training step (forward, backward, the optimizer, the\n"
            "loss scaler's checks) is captured as one CUDA graph and replayed, one launch a step; one\n"
            "process on a GPU (--nproc 1), one micro-batch a step; each epoch prints the host's share");
}

// --resume found nothing to load: no checkpoint at all, or (with
// --resume-fallback) only damaged ones, each named with its cause.
std::string no_checkpoint_message(const std::string& root, const std::vector<std::string>& skipped) {
  if (skipped.empty()) return "--resume: no checkpoint (epoch_<N>/) in --checkpoint-dir " + root;
  std::string msg = "--resume: no usable checkpoint in --checkpoint-dir " + root + ": every one is damaged: ";
  for (size_t i = 0; i < skipped.size(); ++i) msg += (i ? "; " : "") + skipped[i];
  return msg;
}

// Runs in the launching process before any worker starts, so a typo is
// reported once, not once per rank; checks what one row cannot see.
void parse_flags(examples::FlagTable& t, Flags& f, int argc, char** argv) {
  t.parse(argc, argv);
  auto usage_error = [&t](const std::string& msg) { t.error(msg); };
  const examples::CommonFlags& c = f.common;
  f.data_given = t.given("--data");
  if (c.checkpoint_dir.empty()) usage_error("--checkpoint-dir must not be empty");
  if (f.resume_fallback && !c.resume) usage_error("--resume-fallback goes with --resume");
  if ((t.given("--powersgd-rank") || t.given("--powersgd-start")) && f.grad_compress != "powersgd")
    usage_error("--powersgd-rank and --powersgd-start go with --grad-compress powersgd");
  // An overflowing float16 step (which loss scaling makes now and then, on
  // purpose) would leave inf in PowerSGD's error and Q memories for good.
  if (f.grad_compress == "powersgd" && c.amp == "fp16")
    usage_error(
        "--grad-compress powersgd does not go with --amp fp16 (an overflowed step would poison its "
        "error feedback); use --amp bf16");
  if (f.cuda_graph > 1) usage_error("--cuda-graph " + std::to_string(f.cuda_graph) + ": give 0 or 1");
  if (f.cuda_graph == 1) {
    // Host code inside every step, which a replayed graph would skip: a
    // compression hook's state, the profiler's op scopes; and steps of
    // several micro-batches. DDP's bucket allreduces and buffer broadcasts
    // and SyncBatchNorm's statistics are captured (NCCL), so any --nproc
    // goes, with or without --sync-bn.
    if (f.grad_compress != "off")
      usage_error("--grad-compress " + f.grad_compress + " with --cuda-graph 1: its hook keeps host state per step");
    if (t.given("--profile")) usage_error("--profile with --cuda-graph 1: a replayed step runs no op scopes to time");
    if (c.accum_steps > 1)
      usage_error("--accum-steps " + std::to_string(c.accum_steps) +
                  " with --cuda-graph 1: a captured step is one micro-batch here");
  }
  // The default directory is scratch that a fresh run replaces; one the user names is kept.
  examples::refuse_overwrite(c.checkpoint_dir, "epoch_",
                             c.resume || c.overwrite || c.checkpoint_dir == Flags{}.common.checkpoint_dir);
  if (c.resume) {
    std::vector<std::string> skipped;
    auto latest = distributed::latest_checkpoint(c.checkpoint_dir, "epoch_", f.resume_fallback, &skipped);
    if (!latest.ok())
      usage_error("--resume: " + std::string(latest.status().message()) + "; --resume-fallback uses the previous one");
    if (!latest->has_value()) usage_error(no_checkpoint_message(c.checkpoint_dir, skipped));
  }
  if (c.data != "synthetic" && f.data_given && !fs::is_directory(c.data))
    usage_error("--data " + c.data + ": no such directory (give the Fashion-MNIST directory or 'synthetic')");
}

// Examples [offset, offset + size) of another dataset: the synthetic set is
// one generator split into train and test, so both share its class patterns;
// each rank evaluates its contiguous slice of the test set.
class Slice : public data::Dataset {
 public:
  Slice(std::shared_ptr<const data::Dataset> base, int64_t offset, int64_t size)
      : base_(std::move(base)), offset_(offset), size_(size) {}
  int64_t size() const override { return size_; }
  data::Example get(int64_t index) const override {
    EMBER_CHECK(index >= 0 && index < size_, "Slice: index ", index, " out of range [0, ", size_, ")");
    return base_->get(offset_ + index);
  }

 private:
  std::shared_ptr<const data::Dataset> base_;
  int64_t offset_, size_;
};

struct Datasets {
  std::shared_ptr<const data::Dataset> train, test;
  std::string description;
};

Datasets load_data(const Flags& f) {
  bool synthetic = f.common.data == "synthetic";
  if (!synthetic) {
    auto train = data::load_mnist(f.common.data, true);
    if (!train.ok() && !f.data_given) {
      // The default location is only a guess; say loudly that the numbers
      // below are not Fashion-MNIST's.
      LOG0("WARNING: Fashion-MNIST not found (", train.status().message(),
           ").\nWARNING: training on SYNTHETIC images instead; accuracies are not Fashion-MNIST's. "
           "Install it with `apt-get install dataset-fashion-mnist` or pass --data DIR.");
      synthetic = true;
    } else {
      EMBER_CHECK(train.ok(), "--data ", f.common.data, ": ", train.status().message());
      auto test = data::load_mnist(f.common.data, false);
      EMBER_CHECK(test.ok(), "--data ", f.common.data, ": ", test.status().message());
      return {std::make_shared<data::ImageDataset>(*train), std::make_shared<data::ImageDataset>(*test),
              "Fashion-MNIST from " + f.common.data};
    }
  }
  // Fashion-MNIST's shapes and sizes, so timings carry over.
  auto all = std::make_shared<data::SyntheticImages>(70000, Shape{1, 28, 28}, 10, f.common.seed);
  return {std::make_shared<Slice>(all, 0, 60000), std::make_shared<Slice>(all, 60000, 10000),
          "synthetic images (60000 train, 10000 test)"};
}

std::shared_ptr<nn::Module> make_model(const std::string& name) {
  nn::ResNetOptions o{.num_classes = 10, .in_channels = 1, .small_stem = true};
  if (name == "narrow") return nn::resnet18({.num_classes = 10, .in_channels = 1, .small_stem = true, .width = 16});
  if (name == "resnet18") return nn::resnet18(o);
  if (name == "resnet34") return nn::resnet34(o);
  return nn::resnet50(o);
}

// Fraction of this rank's test shard classified correctly, summed over ranks
// with one allreduce of (correct, total), so every rank returns the same
// accuracy over the whole (or --eval-size) test set.
double evaluate(nn::Module& model, data::DataLoader& loader, distributed::ProcessGroup& pg, Device device) {
  model.eval();
  NoGradGuard no_grad;
  int64_t correct = 0, total = 0;
  for (data::Batch& b : loader) {
    Tensor pred = argmax(model(b.data), 1);
    correct += static_cast<int64_t>(sum(eq(pred, b.target)).item());
    total += b.size();
  }
  Tensor counts = Tensor::empty({2}, DType::Int64);
  counts.data<int64_t>()[0] = correct;
  counts.data<int64_t>()[1] = total;
  if (device != kCPU) counts = counts.to(device);  // NCCL reduces device tensors
  pg.allreduce(counts, distributed::ReduceOp::Sum)->wait();
  counts = counts.to(kCPU);
  model.train();
  return static_cast<double>(counts.data<int64_t>()[0]) / std::max<int64_t>(counts.data<int64_t>()[1], 1);
}

// ---- Setup: everything a run trains with, the same on every rank ----

struct Setup {
  std::string model_name;
  Datasets ds;
  uint64_t data_seed = 0;
  std::shared_ptr<nn::Module> model;
  int64_t global_batch = 0, steps_per_epoch = 0, warmup = 0;
  double lr = 0;
  std::unique_ptr<optim::SGD> opt;
  std::unique_ptr<optim::SequentialLR> sched;
  std::unique_ptr<optim::GradScaler> scaler;
  data::TransformPtr normalize;
  std::unique_ptr<data::DataLoader> train_loader, test_loader;
  int64_t test_n = 0, start_epoch = 0, step = 0;
  int64_t start_in_epoch = 0;   // steps of start_epoch already done (a live recovery mid-epoch)
  bool redo_epoch_end = false;  // a live recovery at the end of epoch start_epoch - 1
  std::shared_ptr<distributed::DistributedDataParallel> ddp;
  distributed::StepStartBuffers step_start;              // live recovery: batch norm's statistics as each step began
  std::shared_ptr<distributed::PowerSGDState> powersgd;  // --grad-compress powersgd
  std::unique_ptr<distributed::GradientAccumulator> accumulator;
  // --cuda-graph 1: the step as one CUDA graph; the host's time (the
  // inputs' copies and the replay's launch) and the step's, per replay.
  std::unique_ptr<optim::GraphedStep> graphed;
  examples::GraphTimes graph_times;

  // drop_last: every rank sees the same number of full batches, so all of
  // them run the same number of synchronizing backward passes. The seed
  // fixes the data order (the sampler) and the random transforms.
  std::unique_ptr<data::DataLoader> make_train_loader(const Flags& flags, const examples::Job& job,
                                                      uint64_t seed) const {
    auto sampler = std::make_shared<data::DistributedSampler>(ds.train->size(), job.world, job.rank,
                                                              /*shuffle=*/true, seed, /*drop_last=*/true);
    return std::make_unique<data::DataLoader>(ds.train, data::DataLoaderOptions{.batch_size = flags.common.batch_size,
                                                                                .sampler = sampler,
                                                                                .drop_last = true,
                                                                                .num_workers = flags.workers,
                                                                                .transform = normalize,
                                                                                .seed = seed,
                                                                                .device = job.device});
  }
};

// Resume on every rank: each one needs the optimizer state and counters;
// the parameters would come from rank 0's broadcast anyway.
void resume(const Flags& flags, const examples::Job& job, Setup& s) {
  // Falling back (asked for, or a launcher's restart: unattended), the
  // newest checkpoint that verifies completely, every piece against its
  // checksum (rank 0 reads them); else the newest, its damage an error.
  std::vector<std::string> skipped;
  auto latest = flags.resume_fallback || examples::restarted()
                    ? distributed::newest_verified_checkpoint(flags.common.checkpoint_dir, "epoch_", *job.pg, &skipped)
                    : distributed::latest_checkpoint(flags.common.checkpoint_dir, "epoch_", false, &skipped);
  EMBER_CHECK(latest.ok(), "--resume: ", latest.status().message());
  for (const std::string& d : skipped) LOG0("warning: skipping the damaged checkpoint ", d, "; trying an older one");
  const std::optional<std::string>& dir = *latest;
  if (!dir.has_value() && !flags.common.resume) {
    LOG0("restart: no checkpoint in ", flags.common.checkpoint_dir, " yet; starting from epoch 0");
    return;
  }
  EMBER_CHECK(dir.has_value(), no_checkpoint_message(flags.common.checkpoint_dir, skipped));
  // Sharded (each rank wrote its part; any number of ranks loads it), or
  // the one-file checkpoints of earlier versions.
  std::string saved_by;
  absl::StatusOr<distributed::TrainingState> st = absl::UnknownError("");
  if (distributed::is_sharded_checkpoint(*dir)) {
    auto index = distributed::read_checkpoint_index(*dir);
    EMBER_CHECK(index.ok(), "--resume: ", index.status().message());
    saved_by = "saved by " + std::to_string(index->world_size) + " rank" + (index->world_size == 1 ? "" : "s") + " (" +
               index->layout + "), loading on " + std::to_string(job.world) + " rank" + (job.world == 1 ? "" : "s") +
               " (" + (job.world > 1 ? "replicated" : "single") + "); ";
    st = distributed::load_sharded_checkpoint(*dir, *s.model, s.opt.get(), s.sched.get(), *job.pg);
  } else {
    st = distributed::load_checkpoint(*dir, *s.model, s.opt.get(), s.sched.get());
  }
  EMBER_CHECK(st.ok(), "--resume: ", st.status().message(),
              " (was it written with a different --model, or a different --accum-steps/--epochs schedule?)");
  s.start_epoch = st->epoch;
  s.step = st->step;  // the load restored the random generator (each rank's own, where it can)
  const auto extra = nlohmann::json::parse(st->extra_json);
  // Our own fields in the checkpoint's "extra": a wrong type names the file
  // and the field (nlohmann's value() would throw a bare type error).
  auto extra_count = [&](const char* key, uint64_t fallback) -> uint64_t {
    auto it = extra.find(key);
    if (it == extra.end()) return fallback;
    EMBER_CHECK(it->is_number_unsigned(), "--resume: ", *dir, "/trainer.json: \"extra\".\"", key, "\" is ", it->dump(),
                ", expected a non-negative integer");
    return it->get<uint64_t>();
  };
  s.data_seed = extra_count("sampler_seed", s.data_seed);
  examples::restore_scaler(*s.scaler, extra, *dir);
  if (auto g = static_cast<int64_t>(extra_count("global_batch", s.global_batch)); g != s.global_batch)
    LOG0("note: the checkpoint was trained with a global batch of ", g, ", now ", s.global_batch,
         ": the data order and learning rate differ from an uninterrupted run");
  // The checkpoint's data order wins: that is what "continue exactly" means.
  if (s.data_seed != flags.common.seed) s.train_loader = s.make_train_loader(flags, job, s.data_seed);
  LOG0("resumed from ", *dir, ": ", saved_by, s.start_epoch, " epoch(s), ", s.step, " step(s) done");
  if (s.start_epoch >= flags.epochs)
    LOG0("nothing to do: the checkpoint has ", s.start_epoch, " epoch(s) and --epochs is ", flags.epochs);
}

// Live recovery (launch --live-recovery, init.h): every DDP rank is a
// replica, so a replacement takes its state from the lowest survivor; every
// rank then continues the epoch at the step it stood at (the loader skips
// the batches before it).
void recover(const Flags& flags, const examples::Job& job, Setup& s, const distributed::LiveState* kept) {
  std::vector<int> all(job.world);
  for (int r = 0; r < job.world; ++r) all[r] = r;
  const auto r = distributed::recover_live_state(kept, *s.model, *s.opt, s.sched.get(), s.scaler.get(), *job.pg,
                                                 [all](int) { return all; });
  s.step = r.step;
  s.start_epoch = r.step / s.steps_per_epoch;
  s.start_in_epoch = r.step % s.steps_per_epoch;
  const auto extra = nlohmann::json::parse(r.extra);
  if (const uint64_t seed = extra.value("sampler_seed", s.data_seed); seed != s.data_seed) {
    s.data_seed = seed;
    s.train_loader = s.make_train_loader(flags, job, s.data_seed);
  }
  s.train_loader->set_start_batch(s.start_in_epoch * flags.common.accum_steps);
  s.redo_epoch_end = r.step > 0 && s.start_in_epoch == 0;
  if (r.source >= 0)
    LOG_ALL("live recovery: received ", r.bytes_received, " bytes of training state (step ", r.step, ") from rank ",
            r.source, ", a live replica, in ", r.seconds, " s");
  LOG0("live recovery: generation ", distributed::recovery_generation(), ", continuing from step ", r.step, " (epoch ",
       s.start_epoch + 1, ", step ", s.start_in_epoch, " of ", s.steps_per_epoch, ")");
}

Setup setup(const Flags& flags, const examples::Job& job, bool from_disk = true) {
  Setup s;
  s.model_name = !flags.model.empty() ? flags.model : job.cuda ? "resnet18" : "narrow";
  s.ds = load_data(flags);
  s.data_seed = flags.common.seed;

  // Model, optimizer and schedule, identical on every rank (DDP then
  // broadcasts rank 0's parameters anyway).
  manual_seed(flags.common.seed);
  s.model = make_model(s.model_name);
  s.model->to(job.device);
  s.global_batch = flags.common.batch_size * job.world * flags.common.accum_steps;
  s.lr = optim::scaled_lr(flags.common.lr, s.global_batch, kBaseBatch);
  s.opt = std::make_unique<optim::SGD>(
      s.model->parameters(), optim::SGDOptions{.lr = s.lr, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true});

  s.normalize = data::compose({data::to_float(), data::normalize({kMean}, {kStd})});
  s.train_loader = s.make_train_loader(flags, job, s.data_seed);
  const int64_t micro_per_epoch = s.train_loader->size();
  s.steps_per_epoch = micro_per_epoch / flags.common.accum_steps;
  EMBER_CHECK(s.steps_per_epoch >= 1, "an epoch has ", micro_per_epoch, " batches of ", flags.common.batch_size,
              " per rank: fewer than --accum-steps ", flags.common.accum_steps,
              "; lower --batch-size or --accum-steps");
  if (flags.max_steps > 0) s.steps_per_epoch = std::min(s.steps_per_epoch, flags.max_steps);
  const int64_t total_steps = flags.epochs * s.steps_per_epoch;
  s.warmup = std::min<int64_t>(200, total_steps / 10 + 1);
  auto warm = std::make_shared<optim::LinearLR>(*s.opt, 0.1, 1.0, s.warmup);
  auto cosine = std::make_shared<optim::CosineAnnealingLR>(*s.opt, std::max<int64_t>(total_steps - s.warmup, 1), 0.0);
  s.sched = std::make_unique<optim::SequentialLR>(
      *s.opt, std::vector<std::shared_ptr<optim::LRScheduler>>{warm, cosine}, std::vector<int64_t>{s.warmup});
  // fp16 needs loss scaling; bf16 has float32's range and needs none.
  s.scaler = std::make_unique<optim::GradScaler>(optim::GradScalerOptions{.enabled = flags.common.amp == "fp16"});
  // A launcher's restart (--max-restarts) resumes by itself.
  if (from_disk && (flags.common.resume || examples::restarted())) resume(flags, job, s);

  if (flags.sync_bn) distributed::convert_sync_batchnorm(*s.model, job.pg);
  const auto ac = nn::ActivationCheckpointing::parse(flags.common.ac);
  const int wrapped = nn::apply_activation_checkpointing(*s.model, {"BasicBlock", "Bottleneck"}, ac);
  if (ac.mode != nn::ActivationCheckpointing::Mode::None)
    LOG0("activation checkpointing ", ac.str(), ": ", wrapped, " residual blocks");
  distributed::DDPOptions ddp_options;
  if (flags.grad_compress == "powersgd") {
    // PowerSGD's state (the error feedback, the warm-start Qs) is not
    // checkpointed: a resumed run starts it afresh, uncompressed at first.
    s.powersgd = std::make_shared<distributed::PowerSGDState>(distributed::PowerSGDOptions{
        .matrix_approximation_rank = flags.powersgd_rank,
        .start_powerSGD_iter = flags.powersgd_start >= 0 ? flags.powersgd_start : s.warmup});
    ddp_options.comm_hook = distributed::powerSGD_hook(s.powersgd);
  } else if (flags.grad_compress != "off") {
    ddp_options.comm_hook = flags.grad_compress == "bf16" ? distributed::bf16_compress_hook()
                                                          : distributed::fp16_compress_hook();
  }
  s.ddp = std::make_shared<distributed::DistributedDataParallel>(s.model, ddp_options);
  s.accumulator =
      std::make_unique<distributed::GradientAccumulator>(*s.ddp, static_cast<int>(flags.common.accum_steps));

  s.test_n = flags.eval_size > 0 ? std::min(flags.eval_size, s.ds.test->size()) : s.ds.test->size();
  // Each rank's contiguous share, without the padding DistributedSampler
  // adds: accuracy counts every test image exactly once.
  const int64_t test_lo = s.test_n * job.rank / job.world, test_hi = s.test_n * (job.rank + 1) / job.world;
  s.test_loader = std::make_unique<data::DataLoader>(
      std::make_shared<Slice>(s.ds.test, test_lo, test_hi - test_lo),
      data::DataLoaderOptions{.batch_size = 500, .transform = s.normalize, .device = job.device});

  LOG0(s.model_name == "narrow" ? "narrow ResNet-18 (width 16)" : s.model_name,
       ", small stem: ", s.model->num_parameters() / 1e6, " M parameters; ", s.ds.description, "\n", job.world,
       " rank(s) on ", job.cuda ? "GPUs (NCCL)" : "the CPU (Gloo)", ", batch ", flags.common.batch_size, " per rank x ",
       job.world, " rank(s) x ", flags.common.accum_steps, " accumulation step(s) = ", s.global_batch, " per step; lr ",
       s.lr, " (", flags.common.lr, " x ", s.global_batch, "/", kBaseBatch, "), ", s.warmup,
       " warmup steps then cosine; ", s.steps_per_epoch, " steps per epoch; ", flags.sync_bn ? "SyncBatchNorm; " : "",
       flags.common.amp == "off"
           ? ""
           : "mixed precision " + flags.common.amp + (s.scaler->is_enabled() ? " with loss scaling; " : "; "),
       flags.grad_compress == "off" ? ""
       : flags.grad_compress == "powersgd"
           ? "gradients compressed by PowerSGD (rank " + std::to_string(flags.powersgd_rank) + ", from step " +
                 std::to_string(s.powersgd->options().start_powerSGD_iter) + "); "
           : "gradients allreduced in " + flags.grad_compress + "; ",
       "checkpoints in ", flags.common.checkpoint_dir);
  return s;
}

// ---- The loop: epochs of steps, an evaluation and a checkpoint each ----

// --cuda-graph 1: the loop's step (forward under autocast, backward through
// DDP, whose NCCL allreduces the graph holds, the scaler's step_async and
// update) as one function of the batch, run eagerly for three warm-up steps
// (the momentum buffers, the scale, cuDNN's plans) and then captured and
// replayed by GraphedStep; the schedule reaches it through the learning
// rate on the device.
void make_graphed_step(const Flags& flags, const examples::Job& job, Setup& s) {
  EMBER_CHECK(job.cuda, "--cuda-graph 1 needs a GPU: ", cuda_unavailable_reason());
  EMBER_CHECK(!distributed::live_recovery_enabled(),
              "--cuda-graph 1 under live recovery: its per-step hook (batch norm's statistics as the step began) "
              "is host code a replayed graph would skip");
  const std::string amp = flags.common.amp;
  const Device device = job.device;
  auto fn = [&s, amp, device](const std::vector<Tensor>& in) {
    s.opt->zero_grad();
    Tensor loss;
    {
      std::optional<AutocastGuard> cast;
      if (amp != "off") cast.emplace(device.type, amp == "bf16" ? DType::BFloat16 : DType::Float16);
      loss = nn::functional::cross_entropy((*s.ddp)(in[0]), in[1]);
    }
    s.accumulator->backward(s.scaler->scale(loss));
    s.scaler->step_async(*s.opt);
    s.scaler->update();
    return std::vector<Tensor>{loss.detach()};
  };
  // Under float16 the first steps may overflow and be skipped before SGD
  // has made its momentum buffers, which a capture cannot make: eager
  // until they exist.
  optim::SGD* opt = s.opt.get();
  s.graphed = std::make_unique<optim::GraphedStep>(
      fn, optim::GraphedStepOptions{.device = device.index, .warmup = 3, .optimizers = {opt}, .ready = [opt] {
                                      return opt->momentum_buffers_made();
                                    }});
}

int loop(const Flags& flags, const examples::Job& job, Setup& s) {
  examples::Progress progress(job.rank == 0);
  double train_seconds = 0, eval_seconds = -1;
  int64_t images_done = 0;  // global, this process's run
  optim::GradScaler& scaler = *s.scaler;
  if (flags.cuda_graph == 1) make_graphed_step(flags, job, s);
  examples::StepProfiler profile(flags.common.profile_dir, (flags.epochs - s.start_epoch) * s.steps_per_epoch,
                                 job.pg.get());
  // The end of an epoch: its train loss averaged over the ranks, the test
  // accuracy over every rank's shard, a checkpoint. Also run again by a
  // live recovery that resumes exactly at an epoch's end (the fault may have
  // come in this part; its train loss is then unknown).
  auto end_of_epoch = [&](int64_t epoch, double train_loss) {
    // Train loss averaged over ranks, test accuracy over every rank's shard.
    Tensor loss_t = full({1}, train_loss).to(job.device);
    job.pg->allreduce(loss_t, distributed::ReduceOp::Avg)->wait();
    auto t_eval = Clock::now();
    double acc = evaluate(*s.model, *s.test_loader, *job.pg, job.device);
    eval_seconds = seconds(t_eval, Clock::now());
    std::ostringstream mean;
    mean << loss_t.to(kCPU).item();
    LOG0("epoch ", epoch + 1, "/", flags.epochs, ": train loss ",
         std::isnan(train_loss) ? std::string("unknown (lost with a fault)") : mean.str(), ", test accuracy ", acc,
         " (", s.test_n, " images, ", job.world, " shards), ",
         scaler.is_enabled() ? "scale " + std::to_string(static_cast<int64_t>(scaler.get_scale())) + ", " : "",
         static_cast<int64_t>(seconds(job.started, Clock::now())), " s elapsed");

    // Every rank writes its part (sharded.h): here, a share of the replicated tensors.
    distributed::TrainingState st;
    st.epoch = epoch + 1;
    st.step = s.step;
    st.rng_seed = default_generator().seed();
    st.rng_offset = default_generator().offset();
    const std::string dir = flags.common.checkpoint_dir + "/epoch_" + std::to_string(epoch + 1);
    examples::save_step_checkpoint(dir, *s.model, *s.opt, *s.sched, st,
                                   {{"sampler_seed", s.data_seed},
                                    {"global_batch", s.global_batch},
                                    {"world_size", job.world},
                                    {"model", s.model_name}},
                                   scaler, *job.pg);
    LOG0("saved checkpoint ", dir);
  };
  if (s.redo_epoch_end) end_of_epoch(s.start_epoch - 1, std::nan(""));
  for (int64_t epoch = s.start_epoch; epoch < flags.epochs; ++epoch) {
    s.train_loader->set_epoch(epoch);  // the loader hands its epoch to the sampler and keys transforms
    s.model->train();
    double loss_sum = 0;
    int64_t micro = 0, epoch_steps = epoch == s.start_epoch ? s.start_in_epoch : 0;
    auto t_epoch = Clock::now();
    job.pg->reset_counters();  // the epoch's gradient traffic, reported at its end
    const int64_t steps_before = epoch_steps;
    std::vector<double> step_seconds;  // each optimizer step's wall time, loading its batches included
    auto t_step = Clock::now();
    s.opt->zero_grad();
    for (data::Batch& b : *s.train_loader) {
      if (epoch_steps >= s.steps_per_epoch) break;
      if (s.graphed) {
        // The graph's step (the eager one's work, below, with the scaler's
        // skip on the device), then its one wait: the loss.
        distributed::commit_point(s.step);
        const auto host_start = Clock::now();
        const bool replay = s.graphed->captured();
        const std::vector<Tensor> out = (*s.graphed)({b.data, b.target});
        const double host_s = seconds(host_start, Clock::now());
        if (!replay && s.graphed->captured()) s.graph_times.captured_step = s.step + 1;  // as the log numbers steps
        loss_sum += out[0].item();
        if (replay) {
          s.graph_times.host_s.push_back(host_s);
          s.graph_times.step_s.push_back(seconds(host_start, Clock::now()));
        }
        ++micro;
      } else {
        Tensor loss;
        {
          std::optional<AutocastGuard> amp;
          if (flags.common.amp != "off")
            amp.emplace(job.device.type, flags.common.amp == "bf16" ? DType::BFloat16 : DType::Float16);
          loss = nn::functional::cross_entropy((*s.ddp)(b.data), b.target);  // float32 under autocast too
        }
        loss_sum += loss.item();
        ++micro;
        if (!s.accumulator->backward(scaler.scale(loss))) continue;
        distributed::commit_point(s.step);  // live recovery: every rank steps, or none
        scaler.step(*s.opt);                // skipped when a float16 gradient overflowed; the scale then backs off
        scaler.update();
      }
      s.sched->step();
      s.opt->zero_grad();
      ++epoch_steps;
      ++s.step;
      step_seconds.push_back(seconds(t_step, Clock::now()));
      t_step = Clock::now();
      profile.step();
      images_done += s.global_batch;
      double elapsed = train_seconds + seconds(t_epoch, Clock::now());
      double rate = images_done / std::max(elapsed, 1e-9);
      int64_t left_images = ((flags.epochs - epoch) * s.steps_per_epoch - epoch_steps) * s.global_batch;
      double left = left_images / rate + (flags.epochs - epoch) * std::max(eval_seconds, 0.0);
      progress.update("epoch " + std::to_string(epoch + 1) + "/" + std::to_string(flags.epochs), epoch_steps,
                      s.steps_per_epoch, loss_sum / micro, rate, "img/s", left, epoch_steps == s.steps_per_epoch,
                      scaler.is_enabled() ? "  scale " + std::to_string(static_cast<int64_t>(scaler.get_scale())) : "");
    }
    train_seconds += seconds(t_epoch, Clock::now());
    progress.close_line();

    if (const auto ar = job.pg->counter("allreduce"); epoch_steps > steps_before)
      LOG0("gradient traffic: ", ar.bytes / (epoch_steps - steps_before), " bytes allreduced per step and rank (",
           ar.calls / (epoch_steps - steps_before), " allreduces)",
           s.powersgd ? ", PowerSGD compression rate " + std::to_string(s.powersgd->stats().rate()) + " so far" : "");
    if (s.graphed && !s.graph_times.host_s.empty()) {  // this epoch's replays
      LOG0(s.graph_times.line());
      s.graph_times.host_s.clear();
      s.graph_times.step_s.clear();
    }
    // The median step after 3 warm-up steps (bench/step_predict.py reads it).
    if (step_seconds.size() > 3) {
      const std::vector<double> t(step_seconds.begin() + 3, step_seconds.end());
      LOG0("step time: median ", examples::median(t) * 1e3, " ms over ", t.size(), " steps after 3 warm-up steps");
    }
    end_of_epoch(epoch, loss_sum / std::max<int64_t>(micro, 1));
  }
  return examples::finish_job(job);
}

// ---- The run: config (the flags), setup, loop ----

int train(const Flags& flags, const examples::FlagTable& table) {
  return examples::train_recovering<Setup>(
      flags.common.timeout_sec,
      [&](const examples::Job& job, bool from_disk) {
        const std::string model_name = !flags.model.empty() ? flags.model : job.cuda ? "resnet18" : "narrow";
        // Ranks started with other flags would train diverging replicas without a
        // word (a different batch size changes the learning-rate scaling too).
        // (paths, --nproc and --workers may differ by host; the model as resolved)
        auto config = table.agreed_values();
        for (auto& [flag, value] : config)
          if (flag == "--model") value = model_name;
        distributed::check_same_config(*job.pg, config);
        if (flags.common.nproc > 0 && flags.common.nproc != job.env.local_world_size)
          LOG0("note: --nproc ", flags.common.nproc, " ignored: the launcher started ", job.env.local_world_size,
               " processes per node");
        return setup(flags, job, from_disk);
      },
      [&](const examples::Job& job, Setup& s, const distributed::LiveState* kept) { recover(flags, job, s, kept); },
      [&](const examples::Job& job, Setup& s) {
        // After DDP's own pre-hook (which broadcasts rank 0's buffers), so
        // every rank keeps the same statistics for the step it is in.
        if (distributed::live_recovery_enabled())
          s.model->register_forward_pre_hook([&s](nn::Module& m, const Tensor&) {
            if (m.is_training()) s.step_start.take(m, s.step);
            return Tensor();
          });
        return loop(flags, job, s);
      },
      [](Setup& s) {
        return distributed::capture_live_state(*s.model, *s.opt, s.sched.get(), s.scaler.get(), s.step,
                                               nlohmann::json{{"sampler_seed", s.data_seed}}.dump(), &s.step_start);
      });
}

}  // namespace
}  // namespace ember

int main(int argc, char** argv) {
  using namespace ember;
  return examples::flags_main<Flags>("resnet_ddp", "usage: resnet_ddp [flags]", argc, argv, train);
}
