// write_profile: the clock agreement, the exchange of trace bodies and the
// files. See job_profile.h.
#include "distributed/job_profile.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/profiler.h"
#include "distributed/comm/object_collectives.h"

namespace ember::distributed {
namespace fs = std::filesystem;

namespace {
absl::Status write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("write_profile: cannot write '", path, "'"));
  return absl::OkStatus();
}
// key_averages as ops-rank<N>.json holds them (job_profile.h).
std::string ops_json(const std::vector<profiler::Event>& events, int rank) {
  bool cuda = false;
  for (const profiler::Event& e : events) cuda = cuda || e.cuda_ns >= 0;
  nlohmann::json ops = nlohmann::json::array();
  for (const profiler::Average& a : profiler::key_averages(events))
    ops.push_back({{"name", a.name},
                   {"kind", profiler::kind_name(a.kind)},
                   {"calls", a.calls},
                   {"self_ms", a.self_ns / 1e6},
                   {"total_ms", a.total_ns / 1e6},
                   {"cuda_self_ms", a.cuda_self_ns / 1e6},
                   {"cuda_total_ms", a.cuda_total_ns / 1e6},
                   {"cuda_gap_ms", a.cuda_gap_ns / 1e6}});
  // Names are the user's (ranges, module paths): replaced where not UTF-8,
  // not thrown on.
  return nlohmann::json{{"rank", rank}, {"events", events.size()}, {"cuda", cuda}, {"ops", ops}}.dump(
             1, ' ', false, nlohmann::json::error_handler_t::replace) +
         "\n";
}
}  // namespace

// Rounds of the clock agreement: the narrowest of them is taken.
constexpr int kClockRounds = 8;

absl::StatusOr<ProfileFiles> write_profile(const std::string& dir, ProcessGroup* pg, int top) {
  const std::vector<profiler::Event> events = profiler::events();
  const int rank = pg ? pg->rank() : 0;
  const int world = pg ? pg->size() : 1;
  int64_t offset = 0, error = 0;
  std::vector<std::string> bodies;
  std::string mine;
  try {
    // Each round: t0 on this rank's clock, a barrier, every rank reads its
    // clock, an allgather of the readings, t1. Rank 0 read its clock after
    // leaving the barrier (so after this rank entered it, at t0) and before
    // its allgather could finish here (at t1): on one clock its reading
    // lies in [t0, t1], and reading - (t0 + t1) / 2 is the offset within
    // (t1 - t0) / 2. One round's barrier skew is the error of taking the
    // readings as simultaneous: a rank descheduled there (a loaded host)
    // had its track shifted by the delay, milliseconds, where the steps
    // being compared may take one. The narrowest of the rounds is kept.
    if (world > 1) {
      for (int r = 0; r < kClockRounds; ++r) {
        const int64_t t0 = profiler::now_ns();
        pg->barrier()->wait();
        const int64_t here = profiler::now_ns();
        const std::vector<std::string> clocks = allgather_strings(*pg, std::to_string(here));
        const int64_t t1 = profiler::now_ns(), half = (t1 - t0 + 1) / 2;
        if (rank == 0) continue;  // its own clock: offset 0, exactly
        if (r == 0 || half < error) {
          offset = std::stoll(clocks[0]) - (t0 + half);
          error = half;
        }
      }
    }
    mine = profiler::chrome_trace_events(events, rank, "rank " + std::to_string(rank), offset);
    bodies = world > 1 ? allgather_strings(*pg, mine) : std::vector<std::string>{mine};
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("write_profile (rank ", rank, "): exchanging traces failed: ", e.what()));
  }
  ProfileFiles f;
  f.events = events.size();
  f.clock_offset_ns = offset;
  f.clock_error_ns = error;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("write_profile: cannot create '", dir, "': ", ec.message()));
  f.trace = absl::StrCat(dir, "/trace-rank", rank, ".json");
  f.summary = absl::StrCat(dir, "/summary-rank", rank, ".txt");
  f.ops = absl::StrCat(dir, "/ops-rank", rank, ".json");
  f.table = profiler::summary_table(events, top);
  if (auto s = write_text(f.trace, profiler::chrome_trace({mine})); !s.ok()) return s;
  if (auto s = write_text(f.summary, f.table); !s.ok()) return s;
  if (auto s = write_text(f.ops, ops_json(events, rank)); !s.ok()) return s;
  if (rank == 0) {
    f.merged = dir + "/trace.json";
    if (auto s = write_text(f.merged, profiler::chrome_trace(bodies)); !s.ok()) return s;
  }
  return f;
}

}  // namespace ember::distributed
