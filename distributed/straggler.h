// Straggler detection (Megatron's StragglerDetector, NVIDIA's resiliency
// extension's per-rank scores): one slow host holds every step of a
// synchronous job, and from any rank's log it only looks like a slow job.
// Each rank times its sections (forward, backward, optimizer, a pipeline's
// step) and, from the flight recorder (comm/flight_recorder.h), its time in
// each collective kind; every `every` steps one small all-gather brings
// every rank's window to every rank, and each rank is scored against the
// median rank and against its own best window:
//
//   StragglerDetector straggler(world, {.every = 10, .threshold = 1.2});
//   { auto t = straggler.time("forward"); loss = model(x); }
//   { auto t = straggler.time("backward"); loss.backward(); }
//   ...
//   if (auto r = straggler.step_end(step); r && !r->stragglers.empty()) LOG0(r->line());
//
// A straggler's compute is long and its collectives short (the others wait
// for it inside theirs), so the score is the compute's: a rank's section
// time per step, less the time the thread spent blocked in Work::wait
// inside the section (thread_wait_seconds: DDP's and FSDP's waits happen
// inside backward and forward), over the median rank's.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "distributed/comm/process_group.h"

namespace ember::distributed {

struct StragglerOptions {
  int64_t every = 10;      // steps per window (a report at each window's last step)
  double threshold = 1.2;  // a rank whose compute is over this many times the median's is named
};

struct RankScore {
  int rank = 0;
  double compute_s = 0;                       // the sections' time per step in the window
  double score = 1;                           // compute_s / the median rank's
  double self_score = 1;                      // compute_s / this rank's best window so far
  std::map<std::string, double> sections;     // per step, by section
  std::map<std::string, double> collectives;  // per step, by collective kind (issue to completion)
};

struct StragglerReport {
  int64_t step = 0;                  // the window's last step
  int64_t steps = 0;                 // steps in the window
  std::vector<RankScore> ranks;      // by rank of the group
  int slowest = 0;                   // the rank with the highest score
  double score = 1, self_score = 1;  // the slowest rank's
  double median_s = 0;               // the median rank's compute per step
  std::vector<int> stragglers;       // ranks with score > threshold, slowest first
  double threshold = 1.2;
  // "straggler: rank 2 at 5.01x the median rank's compute per step (0.062 s vs 0.012 s: forward 0.055, backward
  // 0.005, optimizer 0.002; 1.00x its own best); the others wait in allreduce 0.048 s per step" or, with no
  // straggler, "stragglers: none (slowest rank 1 at 1.03x the median)".
  std::string line() const;
};

class StragglerDetector {
 public:
  // The sections a step is timed in, in the gathered vector's order.
  static const std::vector<std::string>& section_names();
  // Collective kinds, and which flight recorder ops count under each.
  static const std::vector<std::string>& collective_kinds();

  StragglerDetector(std::shared_ptr<ProcessGroup> group, StragglerOptions options);

  // Adds `seconds` to this step's `section` (one of section_names()).
  void add(const std::string& section, double seconds);
  // Times a scope into `section`.
  class Timer {
   public:
    Timer(StragglerDetector* d, const std::string& section);
    ~Timer();
    Timer(Timer&& o) noexcept;
    Timer(const Timer&) = delete;

   private:
    StragglerDetector* d_;
    std::string section_;
    std::chrono::steady_clock::time_point start_;
    double waited_ = 0;  // thread_wait_seconds() at the start
  };
  Timer time(const std::string& section) { return Timer(this, section); }

  // Ends step `step`. Collective over the group on every window's last step
  // (every rank calls it every step): returns the window's report on every
  // rank then, nothing otherwise.
  std::optional<StragglerReport> step_end(int64_t step);

 private:
  std::shared_ptr<ProcessGroup> group_;
  StragglerOptions options_;
  std::vector<double> sections_;           // this window's, by section_names()
  std::map<std::string, double> op_base_;  // the flight recorder's op times at the window's start
  int64_t steps_ = 0;
  std::vector<double> best_;  // each rank's best compute per step so far (0: none yet)
};

}  // namespace ember::distributed
