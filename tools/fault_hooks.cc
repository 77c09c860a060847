// The fault-injection harness of tools/fault_suite.py, linked into a test
// build of an example (//tools:resnet_ddp_faults) rather than living in the
// example or the library: EMBER_FAULT_CHECKPOINT=STAGE:EPOCH kills rank 0
// with SIGKILL (as a crash or a power cut would) when the save of
// ".../epoch_EPOCH" (STAGE:NAME: ".../NAME", as step_4 for //examples:gpt)
// reaches STAGE (sharded_rank_written,
// sharded_before_index, sharded_before_rename, exchanged, old_moved_aside or
// renamed; old_moved_aside also turns off the atomic rename exchange, so that
// path is taken); with EMBER_FAULT_ONCE=FILE only the first time. Installed
// before main() through the checkpoint's test seam
// (distributed::testing::CheckpointSaveHooks); inert without the variable.
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "core/exception.h"
#include "distributed/checkpoint/checkpoint.h"

namespace {

bool install() {
  const char* spec = std::getenv("EMBER_FAULT_CHECKPOINT");
  if (!spec || !*spec) return false;
  const std::string s = spec;
  const size_t colon = s.find(':');
  EMBER_CHECK(colon != std::string::npos, "EMBER_FAULT_CHECKPOINT=", s, " must be STAGE:EPOCH");
  const std::string stage = s.substr(0, colon), name = s.substr(colon + 1);
  const bool number = !name.empty() && name.find_first_not_of("0123456789") == std::string::npos;
  const std::string suffix = "/" + (number ? "epoch_" + name : name);
  ember::distributed::testing::CheckpointSaveHooks hooks;
  hooks.no_rename_exchange = stage == "old_moved_aside";
  hooks.at_stage = [stage, suffix](const std::string& at, const std::string& dir) {
    // Rank 0 (the launcher and spawn_local_workers set RANK), that epoch's save.
    const char* rank = std::getenv("RANK");
    const bool epoch =
        dir.size() >= suffix.size() && dir.compare(dir.size() - suffix.size(), suffix.size(), suffix) == 0;
    if (!(at == stage && epoch && rank && std::string(rank) == "0")) return;
    // EMBER_FAULT_ONCE=FILE: only the first time (a replacement that saves
    // the same checkpoint again must not die too); FILE marks it done.
    if (const char* once = std::getenv("EMBER_FAULT_ONCE"); once && *once) {
      if (::access(once, F_OK) == 0) return;
      std::ofstream(once) << "fired\n";
    }
    ::raise(SIGKILL);
  };
  ember::distributed::testing::set_checkpoint_save_hooks(std::move(hooks));
  return true;
}

[[maybe_unused]] const bool installed = install();

}  // namespace
