// What the single-file and the sharded checkpoints share (checkpoint.cc):
// trainer.json (optimizer groups, scheduler, epoch, step, RNG, user JSON),
// synced writes, and the atomic commit of a finished temporary directory.
// Internal to distributed/checkpoint/.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "distributed/checkpoint/checkpoint.h"

namespace ember::distributed::checkpoint_internal {

constexpr const char* kTrainerFile = "trainer.json";

// "a/b/" -> "a/b": suffixes such as ".tmp-<pid>" attach to the name.
std::string normalize_dir(std::string d);
// The crash-test seam (testing::CheckpointSaveHooks): `dir` is the
// checkpoint being saved.
void stage(const char* name, const std::string& dir);

// trainer.json's text; optimizer state names come from model's parameters,
// or, given `group_names`, each group lists those (every rank's, when ranks
// hold different parameters: pipeline stages). Errors: a bad epoch/step or
// extra_json.
absl::StatusOr<std::string> trainer_text(const nn::Module& model, const optim::Optimizer* optimizer,
                                         const optim::LRScheduler* scheduler, const TrainingState& state,
                                         const std::vector<std::vector<std::string>>* group_names = nullptr);

// trainer.json read and checked, nothing applied. `optimizer_groups` holds
// the parameter groups (names included) without state tensors; set when an
// optimizer is given, as `scheduler_state` is when a scheduler is.
struct TrainerFile {
  TrainingState state;
  std::optional<optim::OptimizerStateDict> optimizer_groups;
  std::optional<optim::LRSchedulerState> scheduler_state;
};
absl::StatusOr<TrainerFile> read_trainer_file(const std::string& path, const optim::Optimizer* optimizer,
                                              const optim::LRScheduler* scheduler);
// The scheduler's state and the default generator's (seed, offset).
void apply_trainer_file(const TrainerFile& t, optim::LRScheduler* scheduler);

// A JSON file ember writes (trainer.json, index.json), read and parsed with
// the checks untrusted input needs: a file over `max_bytes` is refused before
// it is read, deep nesting before parsing. Errors name the path; a missing
// file is NotFound with `missing_hint` appended.
absl::StatusOr<nlohmann::ordered_json> read_json_file(const std::string& path, uintmax_t max_bytes,
                                                      const std::string& missing_hint = "");

absl::Status write_file_synced(const std::string& path, const std::string& content);
absl::Status fsync_dir(const std::string& dir);
// Makes the complete directory `tmp` the checkpoint `dir`, atomically
// (replacing an older `dir`; see checkpoint.h). On failure `tmp` is removed
// unless the failure left it the only complete copy.
absl::Status commit_dir(const std::string& tmp, const std::string& dir);

// tmp_dirs.cc. A save's temporary directory records its owner (this
// process) when made, and drops the record before it is committed; once a
// save is committed (and, sharded, agreed), its saver removes the sibling
// temporary directories that killed saves left (their owner on this host,
// in this pid namespace, and gone), returning their paths.
void claim_tmp_dir(const std::string& tmp);
void unclaim_tmp_dir(const std::string& tmp);
std::vector<std::string> remove_dead_tmp_dirs(const std::string& dir);

}  // namespace ember::distributed::checkpoint_internal
