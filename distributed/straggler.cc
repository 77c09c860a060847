// The straggler detector's windows, gather and scores (see straggler.h).
#include "distributed/straggler.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "core/exception.h"
#include "core/ops.h"
#include "distributed/comm/flight_recorder.h"

namespace ember::distributed {

namespace {
// The flight recorder's op names under each kind.
const std::map<std::string, std::string>& kind_of() {
  static const std::map<std::string, std::string> m = {
      {"allreduce", "allreduce"},
      {"allgather", "allgather"},
      {"allgather_into_tensor", "allgather"},
      {"reduce_scatter_tensor", "reduce_scatter"},
      {"all_to_all_single", "all_to_all"},
      {"all_to_all_v", "all_to_all"},
      {"broadcast", "broadcast"},
      {"reduce", "reduce"},
      {"barrier", "barrier"},
      {"send", "send"},
      {"recv", "recv"},
  };
  return m;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string fmt(double x, const char* f = "%.3f") {
  char b[32];
  std::snprintf(b, sizeof b, f, x);
  return b;
}
}  // namespace

const std::vector<std::string>& StragglerDetector::section_names() {
  static const std::vector<std::string> s = {"forward", "backward", "optimizer", "pipeline"};
  return s;
}

const std::vector<std::string>& StragglerDetector::collective_kinds() {
  static const std::vector<std::string> k = {"allreduce", "allgather", "reduce_scatter", "all_to_all", "broadcast",
                                             "reduce",    "barrier",   "send",           "recv"};
  return k;
}

StragglerDetector::StragglerDetector(std::shared_ptr<ProcessGroup> group, StragglerOptions options)
    : group_(std::move(group)), options_(options), sections_(section_names().size(), 0.0) {
  EMBER_CHECK(group_ != nullptr, "StragglerDetector: the group is null");
  EMBER_CHECK(options_.every >= 1, "StragglerDetector: every must be >= 1 step, got ", options_.every);
  EMBER_CHECK(options_.threshold > 1.0, "StragglerDetector: threshold ", options_.threshold,
              " must be above 1 (a rank's compute over the median rank's)");
  best_.assign(static_cast<size_t>(group_->size()), 0.0);
  op_base_ = fr::FlightRecorder::get().op_seconds();
}

void StragglerDetector::add(const std::string& section, double seconds) {
  const auto& names = section_names();
  auto it = std::find(names.begin(), names.end(), section);
  EMBER_CHECK(it != names.end(), "StragglerDetector: unknown section '", section,
              "' (forward, backward, optimizer or pipeline)");
  sections_[static_cast<size_t>(it - names.begin())] += seconds;
}

StragglerDetector::Timer::Timer(StragglerDetector* d, const std::string& section)
    : d_(d), section_(section), start_(std::chrono::steady_clock::now()), waited_(thread_wait_seconds()) {}
StragglerDetector::Timer::Timer(Timer&& o) noexcept
    : d_(o.d_), section_(std::move(o.section_)), start_(o.start_), waited_(o.waited_) {
  o.d_ = nullptr;
}
StragglerDetector::Timer::~Timer() {
  if (!d_) return;
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  d_->add(section_, std::max(0.0, wall - (thread_wait_seconds() - waited_)));
}

std::optional<StragglerReport> StragglerDetector::step_end(int64_t step) {
  ++steps_;
  if (steps_ < options_.every) return std::nullopt;
  // This rank's window: sections, then collective kinds, per step.
  const std::map<std::string, double> ops = fr::FlightRecorder::get().op_seconds();
  std::map<std::string, double> kinds;
  for (const auto& [op, secs] : ops) {
    auto k = kind_of().find(op);
    if (k == kind_of().end()) continue;
    auto b = op_base_.find(op);
    kinds[k->second] += secs - (b == op_base_.end() ? 0.0 : b->second);
  }
  std::vector<double> mine;
  for (double s : sections_) mine.push_back(s / static_cast<double>(steps_));
  for (const std::string& k : collective_kinds()) mine.push_back(kinds[k] / static_cast<double>(steps_));
  const int64_t width = static_cast<int64_t>(mine.size());
  Tensor local = Tensor::from_vector(mine, {width}, DType::Float64);
  Tensor all = Tensor::empty({width * group_->size()}, {DType::Float64, group_->device()});
  {
    fr::CallerTag caller("StragglerDetector window");
    group_->allgather_into_tensor(all, local.to(group_->device()))->wait();
  }
  // The next window starts after this gather: a fast rank's wait in it for
  // the slow one is not a collective of the training step.
  op_base_ = fr::FlightRecorder::get().op_seconds();
  const std::vector<double> v = all.to(kCPU).to_vector();

  StragglerReport r;
  r.step = step;
  r.steps = steps_;
  r.threshold = options_.threshold;
  const size_t ns = section_names().size();
  std::vector<double> computes;
  for (int q = 0; q < group_->size(); ++q) {
    RankScore s;
    s.rank = q;
    const double* row = v.data() + static_cast<size_t>(q) * static_cast<size_t>(width);
    for (size_t i = 0; i < ns; ++i) {
      if (row[i] > 0) s.sections[section_names()[i]] = row[i];
      s.compute_s += row[i];
    }
    for (size_t i = 0; i < collective_kinds().size(); ++i)
      if (row[ns + i] > 0) s.collectives[collective_kinds()[i]] = row[ns + i];
    computes.push_back(s.compute_s);
    r.ranks.push_back(std::move(s));
  }
  const double med = median(computes);
  r.median_s = med;
  for (RankScore& s : r.ranks) {
    s.score = med > 0 ? s.compute_s / med : 1.0;
    double& best = best_[static_cast<size_t>(s.rank)];
    if (s.compute_s > 0 && (best == 0 || s.compute_s < best)) best = s.compute_s;
    s.self_score = best > 0 ? s.compute_s / best : 1.0;
  }
  for (const RankScore& s : r.ranks)
    if (s.score > r.ranks[static_cast<size_t>(r.slowest)].score) r.slowest = s.rank;
  r.score = r.ranks[static_cast<size_t>(r.slowest)].score;
  r.self_score = r.ranks[static_cast<size_t>(r.slowest)].self_score;
  for (const RankScore& s : r.ranks)
    if (s.score > options_.threshold) r.stragglers.push_back(s.rank);
  std::sort(r.stragglers.begin(), r.stragglers.end(), [&](int a, int b) {
    return r.ranks[static_cast<size_t>(a)].score > r.ranks[static_cast<size_t>(b)].score;
  });

  std::fill(sections_.begin(), sections_.end(), 0.0);
  steps_ = 0;
  return r;
}

std::string StragglerReport::line() const {
  const double med = median_s;
  const RankScore& s = ranks.at(static_cast<size_t>(slowest));
  std::ostringstream os;
  if (stragglers.empty()) {
    os << "stragglers: none over " << fmt(threshold, "%.2f") << "x (slowest rank " << slowest << " at "
       << fmt(score, "%.2f") << "x the median rank's compute, steps " << step - steps + 1 << "-" << step << ")";
    return os.str();
  }
  os << "straggler" << (stragglers.size() > 1 ? "s" : "") << ": ";
  for (size_t i = 0; i < stragglers.size(); ++i) {
    const RankScore& q = ranks.at(static_cast<size_t>(stragglers[i]));
    os << (i ? "; " : "") << "rank " << q.rank << " at " << fmt(q.score, "%.2f")
       << "x the median rank's compute per step (" << fmt(q.compute_s) << " s vs " << fmt(med) << " s:";
    bool first = true;
    for (const auto& [name, secs] : q.sections) {
      os << (first ? " " : ", ") << name << " " << fmt(secs);
      first = false;
    }
    os << "; " << fmt(q.self_score, "%.2f") << "x its own best)";
  }
  // Where the others lose the time: the collective kind the median rank
  // spends most in, beside the slowest rank's.
  std::map<std::string, std::vector<double>> kinds;
  for (const RankScore& q : ranks)
    if (q.rank != s.rank)
      for (const auto& [k, secs] : q.collectives) kinds[k].push_back(secs);
  std::string top;
  double top_s = 0;
  for (auto& [k, xs] : kinds) {
    xs.resize(ranks.size() - 1, 0.0);
    const double m = median(xs);
    if (m > top_s) top = k, top_s = m;
  }
  if (!top.empty()) {
    auto mine = s.collectives.find(top);
    os << "; the others wait in " << top << " " << fmt(top_s) << " s per step (rank " << s.rank << " "
       << fmt(mine == s.collectives.end() ? 0.0 : mine->second) << " s)";
  }
  os << ", steps " << step - steps + 1 << "-" << step;
  return os.str();
}

}  // namespace ember::distributed
