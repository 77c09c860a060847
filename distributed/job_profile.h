// Writes a profiling session's results for a whole job: each rank's Chrome
// trace and key_averages table, and on rank 0 one merged timeline with a
// track (process) per rank, all on rank 0's clock.
//
//   profiler::start();  ... a few steps ...  profiler::stop();
//   auto out = distributed::write_profile("prof", pg.get());   // every rank calls it
//   // prof/trace.json (rank 0: every rank), prof/trace-rank<N>.json, prof/summary-rank<N>.txt,
//   // prof/ops-rank<N>.json
//
// ops-rank<N>.json is the summary's key_averages whole, for tools (as
// torch.profiler's key_averages() is to a script): {"rank": N, "events": E,
// "cuda": true where GPU times were recorded, "ops": [{"name", "kind",
// "calls", "self_ms", "total_ms", "cuda_self_ms", "cuda_total_ms",
// "cuda_gap_ms"}, ...]} by host self time, as the table.
//
// Clocks: rank N's events are shifted by its offset to rank 0's steady
// clock, so hosts whose clocks differ still line up. The offset comes from
// rounds of a barrier and an exchange of clock readings, each bounding rank
// 0's reading between two of this rank's; the narrowest round is kept
// (clock_error_ns: its half-width, tens of µs on a LAN; a single reading
// at a barrier was off by a descheduled rank's delay on a loaded host).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "distributed/comm/process_group.h"

namespace ember::distributed {

struct ProfileFiles {
  std::string merged;   // rank 0 only: every rank's events ("" elsewhere)
  std::string trace;    // this rank's
  std::string summary;  // this rank's key_averages table (also returned in `table`)
  std::string ops;      // this rank's key_averages as JSON
  std::string table;
  size_t events = 0;
  // Added to this rank's clock for rank 0's (0 on rank 0), and how far off
  // it can be: the true offset is within clock_error_ns of it.
  int64_t clock_offset_ns = 0, clock_error_ns = 0;
};

// The events profiler::events() holds now. `pg` may be null (one process).
// Collective when `pg` is given: every rank of it must call it. The
// exchanges happen before any file is written, so a rank whose directory
// cannot be written fails alone, with the path, instead of stalling others.
absl::StatusOr<ProfileFiles> write_profile(const std::string& dir, ProcessGroup* pg, int top = 25);

}  // namespace ember::distributed
