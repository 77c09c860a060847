// Collectives over small host objects (strings), built from tensor
// collectives on the group's device: what ranks use to agree on metadata
// (DDP's parameter lists, sharded checkpoints' piece records).
#pragma once

#include <string>
#include <vector>

#include "distributed/comm/process_group.h"

namespace ember::distributed {

// Every rank's string, in rank order (allgather of lengths, then of the
// bytes padded to the longest). Every rank of `pg` must call it.
std::vector<std::string> allgather_strings(ProcessGroup& pg, const std::string& mine);

}  // namespace ember::distributed
