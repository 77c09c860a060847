// torch.optim.lr_scheduler for ember: StepLR, MultiStepLR, CosineAnnealingLR,
// LinearLR (warmup) and SequentialLR (compose, e.g. warmup then cosine).
//
//   optim::SGD opt(params, {.lr = optim::scaled_lr(0.1, 1024, 256)});
//   auto warmup = std::make_shared<optim::LinearLR>(opt, 0.01, 1.0, 5);
//   auto cosine = std::make_shared<optim::CosineAnnealingLR>(opt, 95);
//   optim::SequentialLR sched(opt, {warmup, cosine}, {5});
//   for (epoch...) { train(opt); sched.step(); }
//
// As in torch, constructing a scheduler records each group's "initial_lr"
// (if absent) as its base lr and applies the epoch-0 lr; step() advances the
// counter and sets every group's "lr". Each lr is computed from the counter
// in closed form (torch's _get_closed_form_lr), so a schedule is a pure
// function of last_epoch and resumes exactly from its state. torch's step()
// evaluates the chainable recursive form instead, which agrees up to
// rounding unless something else rewrites "lr" between steps.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "optim/optimizer.h"

namespace ember::optim {

// Linear scaling rule (Goyal et al.): lr * global_batch / base_batch.
double scaled_lr(double base_lr, int64_t global_batch, int64_t base_batch);

// Counters only; hyperparameters (gamma, T_max, ...) are constructor arguments.
struct LRSchedulerState {
  int64_t last_epoch = -1;
  std::vector<double> base_lrs;
  std::vector<double> last_lr;
};

class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  // Advances the epoch (or iteration) counter and sets each group's lr.
  void step();
  // The lr of each group as last set by this scheduler.
  const std::vector<double>& get_last_lr() const { return last_lr_; }
  int64_t last_epoch() const { return last_epoch_; }
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  Optimizer& optimizer() const { return *opt_; }

  // The lr for a group whose base lr is `base_lr`, at `epoch` (>= 0).
  virtual double lr_at(double base_lr, int64_t epoch) const = 0;

  LRSchedulerState state_dict() const { return {last_epoch_, base_lrs_, last_lr_}; }
  // Restores the counters; the optimizer's lrs come back with its own state
  // dict (as in torch, this does not touch them).
  void load_state_dict(const LRSchedulerState& s);

 protected:
  explicit LRScheduler(Optimizer& opt);
  // The constructor's first step (epoch 0); concrete schedulers call it last,
  // once lr_at dispatches to them.
  void initial_step() { step(); }

 private:
  Optimizer* opt_;
  int64_t last_epoch_ = -1;
  std::vector<double> base_lrs_;
  std::vector<double> last_lr_;
};

// base_lr * gamma^(epoch / step_size).
class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& opt, int64_t step_size, double gamma = 0.1);
  double lr_at(double base_lr, int64_t epoch) const override;

 private:
  int64_t step_size_;
  double gamma_;
};

// base_lr * gamma^(number of milestones <= epoch); a repeated milestone
// counts twice, as torch's Counter does.
class MultiStepLR : public LRScheduler {
 public:
  MultiStepLR(Optimizer& opt, std::vector<int64_t> milestones, double gamma = 0.1);
  double lr_at(double base_lr, int64_t epoch) const override;

 private:
  std::vector<int64_t> milestones_;  // sorted
  double gamma_;
};

// eta_min + (base_lr - eta_min) * (1 + cos(pi * epoch / T_max)) / 2; past
// T_max it keeps following the cosine, as torch's does.
class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& opt, int64_t T_max, double eta_min = 0.0);
  double lr_at(double base_lr, int64_t epoch) const override;

 private:
  int64_t t_max_;
  double eta_min_;
};

// base_lr * (start + (end - start) * min(total_iters, epoch) / total_iters).
class LinearLR : public LRScheduler {
 public:
  LinearLR(Optimizer& opt, double start_factor = 1.0 / 3.0, double end_factor = 1.0, int64_t total_iters = 5);
  double lr_at(double base_lr, int64_t epoch) const override;

 private:
  double start_, end_;
  int64_t total_iters_;
};

// Runs schedulers[i] between milestones[i-1] and milestones[i]; each one
// restarts from its own epoch 0 at its milestone, as torch's SequentialLR
// (which calls scheduler.step(0) there).
class SequentialLR : public LRScheduler {
 public:
  SequentialLR(Optimizer& opt, std::vector<std::shared_ptr<LRScheduler>> schedulers,
               std::vector<int64_t> milestones);
  double lr_at(double base_lr, int64_t epoch) const override;

 private:
  std::vector<std::shared_ptr<LRScheduler>> schedulers_;
  std::vector<int64_t> milestones_;
};

}  // namespace ember::optim
