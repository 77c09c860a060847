// --profile DIR for the training examples: a few optimizer steps after a
// warm-up are profiled (as torch.profiler's schedule(wait, warmup, active)),
// then every rank's trace lands in DIR and rank 0 prints the table.
//
//   examples::StepProfiler prof(flags.profile_dir, flags.max_steps - step, pg.get());
//   while (...) { ...; opt.step(); prof.step(); }
//
// Steps are counted from this run's first (after a resume too). With few
// steps left the warm-up shrinks first, so `--max-steps 2 --profile D`
// still profiles both. Each profiled step is one "ProfilerStep#N" range; it
// runs from one step() call to the next, so it includes loading the next
// batch, as torch's does.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>

#include "core/profiler.h"
#include "distributed/job_profile.h"

namespace ember::examples {

class StepProfiler {
 public:
  static constexpr int64_t kWarmup = 3, kActive = 3;

  StepProfiler(std::string dir, int64_t steps_left, distributed::ProcessGroup* pg)
      : dir_(std::move(dir)), pg_(pg) {
    if (dir_.empty() || steps_left <= 0) return;
    active_ = std::min(kActive, steps_left);
    warmup_ = std::min(kWarmup, steps_left - active_);
    if (warmup_ == 0) begin();
  }
  // Unwinding from an error: no collectives (the other ranks may never join
  // them, and the error must surface now); what was recorded is dropped.
  ~StepProfiler() {
    if (std::uncaught_exceptions() > 0) {
      if (recording_) {
        range_.reset();
        profiler::stop();
      }
      return;
    }
    finish();
  }

  // After each optimizer step.
  void step() {
    if (active_ == 0) return;
    ++done_;
    if (recording_) {
      range_.reset();
      if (done_ == warmup_ + active_) return finish();
      open_range();
    } else if (done_ == warmup_) {
      begin();
    }
  }

  // Writes what was recorded (at the window's end, or earlier if training
  // stops first). Collective: every rank reaches it at the same step.
  void finish() {
    if (!recording_) return;
    range_.reset();
    profiler::stop();
    recording_ = false;
    const int64_t steps = done_ - warmup_;
    active_ = 0;
    auto files = distributed::write_profile(dir_, pg_, 15);
    if (!files.ok()) {
      std::fprintf(stderr, "profile: %s\n", std::string(files.status().message()).c_str());
      return;
    }
    if (!files->merged.empty()) {
      std::printf(
          "profile: %lld step(s) after %lld warm-up step(s); %zu events on rank 0; Chrome trace of every "
          "rank in %s (open in https://ui.perfetto.dev or chrome://tracing), one per rank beside it; "
          "per-op averages in %s\n%s",
          static_cast<long long>(steps), static_cast<long long>(warmup_), files->events, files->merged.c_str(),
          files->ops.c_str(), files->table.c_str());
      std::fflush(stdout);
    }
  }

 private:
  void begin() {
    profiler::start();
    recording_ = true;
    open_range();
  }
  void open_range() {
    range_ = std::make_unique<profiler::Scope>(profiler::Kind::User, "ProfilerStep#" + std::to_string(done_));
  }

  std::string dir_;
  distributed::ProcessGroup* pg_;
  int64_t warmup_ = 0, active_ = 0, done_ = 0;
  bool recording_ = false;
  std::unique_ptr<profiler::Scope> range_;
};

}  // namespace ember::examples
