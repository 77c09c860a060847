// Names both halves of the sharded checkpoint (sharded_save.cc: save;
// sharded.cc: the index, reading and load; consolidate.cc: one-process
// output) agree on: the index format and the helpers the save and the load
// both use. Not part of the API.
#pragma once

#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "distributed/checkpoint/sharded.h"
#include "distributed/comm/process_group.h"

namespace ember::distributed::sharded_internal {

constexpr const char* kIndexFormat = "ember-sharded-checkpoint";
// 2: a piece is a box ("offsets", "sizes") and a run of it ("begin",
// "numel"); 1: a run ("offset", "numel") of the whole tensor's flattening.
// Both load.
constexpr int64_t kIndexVersion = 2;
constexpr const char* kIndexFile = "index.json";

constexpr const char* kOptimPrefix = "optim.state.";
// Each rank's random generator (seed, offset) as "rng.<rank>", int64 [2]:
// dropout and other draws continue exactly when the world size is the same.
constexpr const char* kRngPrefix = "rng.";

// "optim.state.<parameter>.<state>" -> (parameter, state); false for any
// other name. The state's name has no dot; a parameter's may.
inline bool split_optim_name(const std::string& name, std::string* param, std::string* state) {
  if (name.rfind(kOptimPrefix, 0) != 0) return false;
  const std::string rest = name.substr(std::strlen(kOptimPrefix));
  const size_t dot = rest.rfind('.');
  if (dot == std::string::npos) return false;
  *param = rest.substr(0, dot);
  *state = rest.substr(dot + 1);
  return true;
}

// A checksum as the index writes it: 16 lower-case hex digits.
std::string hex64(uint64_t v);

// Checks an index (untrusted: every number before any use) and fills `out`;
// `path` names it in errors. The save checks the index it built with it too.
absl::Status checked_index(const nlohmann::ordered_json& j, const std::string& path, CheckpointIndex* out);

// Every rank's error, by rank (empty: none) -> one message naming the
// failed ranks (empty: none failed).
std::string name_failures(const std::vector<std::string>& errors);

// name_failures of every rank's `mine` (a collective over `pg`).
std::string agree_on_errors(ProcessGroup& pg, const std::string& mine);

}  // namespace ember::distributed::sharded_internal
