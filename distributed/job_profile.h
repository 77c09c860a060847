// Writes a profiling session's results for a whole job: each rank's Chrome
// trace and key_averages table, and on rank 0 one merged timeline with a
// track (process) per rank, all on rank 0's clock.
//
//   profiler::start();  ... a few steps ...  profiler::stop();
//   auto out = distributed::write_profile("prof", pg.get());   // every rank calls it
//   // prof/trace.json (rank 0: every rank), prof/trace-rank<N>.json, prof/summary-rank<N>.txt
//
// Clocks: ranks meet at a barrier and each notes its steady clock there;
// rank N's events are shifted by (rank 0's note - its own), so hosts whose
// clocks differ still line up (to the barrier's skew, tens of µs on a LAN).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "distributed/comm/process_group.h"

namespace ember::distributed {

struct ProfileFiles {
  std::string merged;   // rank 0 only: every rank's events ("" elsewhere)
  std::string trace;    // this rank's
  std::string summary;  // this rank's key_averages table (also returned in `table`)
  std::string table;
  size_t events = 0;
};

// The events profiler::events() holds now. `pg` may be null (one process).
// Collective when `pg` is given: every rank of it must call it. The
// exchanges happen before any file is written, so a rank whose directory
// cannot be written fails alone, with the path, instead of stalling others.
absl::StatusOr<ProfileFiles> write_profile(const std::string& dir, ProcessGroup* pg, int top = 25);

}  // namespace ember::distributed
