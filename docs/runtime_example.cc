// docs/distributed.md's first program, verbatim (docs/snippets_match_test.sh
// checks it): two local workers sum their ranks. //docs:runtime_example_test
// runs it.
// clang-format off
#include "core/ops.h"
#include "distributed/init.h"
#include "distributed/launch/launch.h"
#include "distributed/logging/logging.h"
using namespace ember::distributed;

int main(int argc, char** argv) {
  // Run with no launcher: re-runs itself as 2 local workers and waits.
  // Under //tools:launch, torchrun or srun this returns -1 at once.
  if (int rc = spawn_local_workers(2, argc, argv); rc >= 0) return rc;
  auto pg = init_process_group({.backend = "gloo"});   // RANK, WORLD_SIZE, MASTER_ADDR, ... or SLURM_*
  ember::Tensor t = ember::full({4}, float(pg->rank()));
  pg->allreduce(t, ReduceOp::Sum)->wait();             // async Work: wait(), wait(timeout), is_completed()
  log_rank0("sum of ranks: ", t.select(0, 0).item());  // printed once, by rank 0
}
// clang-format on
