// fr_trace (PyTorch's torchfrtrace): reads the flight recorder dumps of a
// job's ranks (flight_recorder.h, one ember_fr_rank<R>.json per rank) and
// says, for each process group, the first operation the ranks disagree on:
//
//   collective 247 (allreduce, group dp_shard [0,2]) joined by ranks 0; missing: 2
//   collective 12 (allgather_into_tensor, group default [0,1,2,3]) mismatched sizes: ranks 0,2,3 input [4] ...; rank 1
//   input [8] ... p2p recv by rank 1 from rank 0 (group pp [0,1], tag 0, message 3) never matched: rank 0 posted 2
//   sends to rank 1
//
// with each rank's last completed sequence id, and the ranks without a
// dump (frozen, killed, never started). Collectives are matched by their
// group's sequence id (the same on every member), transfers by their order
// between a pair of ranks. //tools:fr_trace prints it; the launcher runs it
// on its job's dumps when it tears a failed job down.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ember::distributed::fr {

struct TraceReport {
  // 0: every group's ranks agree (no hang found in the dumps); 1: a
  // mismatch, a missing rank or an unmatched transfer was found; 2: nothing
  // to read (no dump, or a file that is not a dump).
  int status = 0;
  std::vector<std::string> lines;  // the verdict, a finding a line
  std::vector<int> suspects;       // the ranks named missing or mismatched, ascending
  std::vector<int> without_dump;   // members of a recorded group with no dump
  int dumps = 0;
};

// Reads every ember_fr_rank*.json in `dir`; dumps written before
// `since_ns` (system clock, ns) are another job's and are skipped. `here`:
// the ranks whose dumps belong in `dir` (one node's, when each node dumps
// locally); the others' absence is no finding. Empty: every rank's.
TraceReport analyze_dumps(const std::string& dir, int64_t since_ns = 0, const std::vector<int>& here = {});

}  // namespace ember::distributed::fr
