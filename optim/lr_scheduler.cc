// Learning-rate schedules: the counter and group bookkeeping shared by all
// schedulers, and each schedule's closed form, written in the same operation
// order as torch's _get_closed_form_lr so the doubles agree.
#include "optim/lr_scheduler.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace ember::optim {

double scaled_lr(double base_lr, int64_t global_batch, int64_t base_batch) {
  EMBER_CHECK(global_batch > 0 && base_batch > 0, "scaled_lr: batch sizes must be positive, got global_batch ",
              global_batch, " and base_batch ", base_batch);
  return base_lr * static_cast<double>(global_batch) / static_cast<double>(base_batch);
}

// ---- LRScheduler ----
LRScheduler::LRScheduler(Optimizer& opt) : opt_(&opt) {
  for (auto& g : opt.param_groups()) {
    g.options.emplace("initial_lr", g.lr());  // setdefault: an earlier scheduler's base wins
    base_lrs_.push_back(g.options.at("initial_lr"));
  }
}

void LRScheduler::step() {
  auto& groups = opt_->param_groups();
  EMBER_CHECK(groups.size() == base_lrs_.size(), "LRScheduler::step: the optimizer has ", groups.size(),
              " parameter groups but the scheduler was created for ", base_lrs_.size(),
              "; add groups before creating the scheduler");
  ++last_epoch_;
  last_lr_.resize(groups.size());
  for (size_t i = 0; i < groups.size(); ++i) {
    last_lr_[i] = lr_at(base_lrs_[i], last_epoch_);
    set_lr(groups[i], last_lr_[i]);
  }
}

void LRScheduler::load_state_dict(const LRSchedulerState& s) {
  const size_t n = opt_->param_groups().size();
  EMBER_CHECK(s.base_lrs.size() == n && s.last_lr.size() == n, "LRScheduler::load_state_dict: the state has ",
              s.base_lrs.size(), " base_lrs and ", s.last_lr.size(), " last_lr entries, the optimizer has ", n,
              " parameter groups");
  EMBER_CHECK(s.last_epoch >= 0, "LRScheduler::load_state_dict: last_epoch must be >= 0, got ", s.last_epoch);
  last_epoch_ = s.last_epoch;
  base_lrs_ = s.base_lrs;
  last_lr_ = s.last_lr;
}

// ---- StepLR ----
StepLR::StepLR(Optimizer& opt, int64_t step_size, double gamma)
    : LRScheduler(opt), step_size_(step_size), gamma_(gamma) {
  EMBER_CHECK(step_size > 0, "StepLR: step_size must be positive, got ", step_size);
  initial_step();
}

double StepLR::lr_at(double base_lr, int64_t epoch) const {
  return base_lr * std::pow(gamma_, static_cast<double>(epoch / step_size_));
}

// ---- MultiStepLR ----
MultiStepLR::MultiStepLR(Optimizer& opt, std::vector<int64_t> milestones, double gamma)
    : LRScheduler(opt), milestones_(std::move(milestones)), gamma_(gamma) {
  std::sort(milestones_.begin(), milestones_.end());
  initial_step();
}

double MultiStepLR::lr_at(double base_lr, int64_t epoch) const {
  const auto passed = std::upper_bound(milestones_.begin(), milestones_.end(), epoch) - milestones_.begin();
  return base_lr * std::pow(gamma_, static_cast<double>(passed));
}

// ---- CosineAnnealingLR ----
CosineAnnealingLR::CosineAnnealingLR(Optimizer& opt, int64_t T_max, double eta_min)
    : LRScheduler(opt), t_max_(T_max), eta_min_(eta_min) {
  EMBER_CHECK(T_max > 0, "CosineAnnealingLR: T_max must be positive, got ", T_max);
  initial_step();
}

double CosineAnnealingLR::lr_at(double base_lr, int64_t epoch) const {
  return eta_min_ + (base_lr - eta_min_) *
                        (1.0 + std::cos(std::numbers::pi * static_cast<double>(epoch) / static_cast<double>(t_max_))) /
                        2.0;
}

// ---- LinearLR ----
LinearLR::LinearLR(Optimizer& opt, double start_factor, double end_factor, int64_t total_iters)
    : LRScheduler(opt), start_(start_factor), end_(end_factor), total_iters_(total_iters) {
  EMBER_CHECK(start_factor > 0.0 && start_factor <= 1.0,
              "LinearLR: starting multiplicative factor expected to be greater than 0 and less or equal to 1, got ",
              start_factor);
  EMBER_CHECK(end_factor >= 0.0 && end_factor <= 1.0,
              "LinearLR: ending multiplicative factor expected to be between 0 and 1, got ", end_factor);
  EMBER_CHECK(total_iters > 0, "LinearLR: total_iters must be positive, got ", total_iters);
  initial_step();
}

double LinearLR::lr_at(double base_lr, int64_t epoch) const {
  return base_lr * (start_ + (end_ - start_) * static_cast<double>(std::min(total_iters_, epoch)) /
                                 static_cast<double>(total_iters_));
}

// ---- SequentialLR ----
SequentialLR::SequentialLR(Optimizer& opt, std::vector<std::shared_ptr<LRScheduler>> schedulers,
                           std::vector<int64_t> milestones)
    : LRScheduler(opt), schedulers_(std::move(schedulers)), milestones_(std::move(milestones)) {
  EMBER_CHECK(!schedulers_.empty(), "SequentialLR: expects at least one scheduler");
  EMBER_CHECK(milestones_.size() + 1 == schedulers_.size(),
              "SequentialLR: expects one more scheduler than milestones, got ", schedulers_.size(),
              " schedulers and ", milestones_.size(), " milestones");
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    EMBER_CHECK(schedulers_[i] != nullptr, "SequentialLR: scheduler ", i, " is null");
    EMBER_CHECK(&schedulers_[i]->optimizer() == &opt, "SequentialLR: scheduler ", i,
                " belongs to a different optimizer than the SequentialLR");
  }
  for (size_t i = 1; i < milestones_.size(); ++i)
    EMBER_CHECK(milestones_[i - 1] < milestones_[i], "SequentialLR: milestones must increase, got ",
                milestones_[i - 1], " then ", milestones_[i]);
  // The children's constructors each applied their own epoch 0; torch resets
  // to the first scheduler's, which is what this step does.
  initial_step();
}

double SequentialLR::lr_at(double base_lr, int64_t epoch) const {
  const size_t idx = std::upper_bound(milestones_.begin(), milestones_.end(), epoch) - milestones_.begin();
  const int64_t local = idx == 0 ? epoch : epoch - milestones_[idx - 1];
  return schedulers_[idx]->lr_at(base_lr, local);
}

}  // namespace ember::optim
