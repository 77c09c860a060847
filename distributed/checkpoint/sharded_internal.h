// Names both halves of the sharded checkpoint (sharded.cc: save and load;
// consolidate.cc: one-process output) agree on. Not part of the API.
#pragma once

#include <cstring>
#include <string>

namespace ember::distributed::sharded_internal {

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

}  // namespace ember::distributed::sharded_internal
