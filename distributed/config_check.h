// One training configuration on every rank. Replicas started with another
// per-rank batch size, learning-rate scaling or accumulation count still
// exchange gradients without complaint and silently drift apart; this check,
// run once at start, turns that into an error naming the setting and both
// values.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "distributed/comm/process_group.h"

namespace ember::distributed {

// (name, value as text) pairs, in the same order on every rank. Collective:
// every rank of `pg` must call it. Compares each rank's settings with rank
// 0's; if any rank differs, every rank throws: a differing rank names each
// setting with its value and rank 0's, the others name the differing ranks.
void check_same_config(ProcessGroup& pg, const std::vector<std::pair<std::string, std::string>>& settings);

}  // namespace ember::distributed
