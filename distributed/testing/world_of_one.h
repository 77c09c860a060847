// A process group of one rank in the test process itself, as torchrun's
// variables would describe it (RANK 0, WORLD_SIZE 1, a free port): for tests
// of a parallelism's one-rank case, where FSDP drops its groups and DDP
// reduces nothing, so CUDA tensors need no collective (the CUDA graph
// tests run their steps so under the emulation, which has no NCCL).
#pragma once

#include <cstdlib>
#include <memory>

#include "distributed/init.h"

namespace ember::distributed::testing {

inline std::shared_ptr<ProcessGroup> init_world_of_one() {
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "0", 1);
  InitOptions o;
  o.backend = "gloo";
  return init_process_group(o);
}

}  // namespace ember::distributed::testing
