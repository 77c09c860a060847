// Training checkpoints: tensors in safetensors files (core/safetensors.h), the
// rest (optimizer groups, scheduler counters, epoch, sampler and RNG state,
// user metadata) in JSON beside them. Nothing executes code on load.
//
// Layout of a checkpoint directory (one per save, e.g. ckpt/epoch_3/):
//   model.safetensors       model state_dict, PyTorch names
//   optimizer.safetensors   optimizer state ("state.<index>.<name>")
//   trainer.json            {"format": "ember-checkpoint", "version": 1,
//                            "optimizer": {"param_groups": [...]},
//                            "scheduler": {...}, "epoch": N, "step": N,
//                            "rng": {"seed": S, "offset": O},
//                            "extra": {...user JSON...}}
// save_checkpoint writes into "<dir>.tmp-<pid>", fsyncs, then renames it to
// <dir> (replacing an older one only after the new one is complete), so a
// crash mid-save never destroys the previous checkpoint. The sharded
// checkpoints that come later add one file per rank and an index.
//
// Replacing an existing <dir> (saving to "latest/" every epoch): the two
// directories are swapped atomically with renameat2(RENAME_EXCHANGE), so
// <dir> always names a complete checkpoint. Where the filesystem lacks it,
// <dir> is renamed to "<dir>.old-<pid>" and the new one renamed into place;
// a crash between those two renames leaves no <dir>, but both the previous
// checkpoint ("<dir>.old-<pid>") and the new complete one ("<dir>.tmp-<pid>",
// with its trainer.json) intact on disk. Leftover .tmp-/.old- directories are
// never mistaken for checkpoints by latest_checkpoint.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nn/module.h"
#include "optim/lr_scheduler.h"
#include "optim/optimizer.h"

namespace ember::distributed {

struct TrainingState {
  int64_t epoch = 0;  // epochs completed
  int64_t step = 0;   // optimizer steps taken
  // The default generator's state (seed, offset): restoring it makes
  // dropout, shuffles seeded from it and init draws continue exactly.
  uint64_t rng_seed = 0;
  uint64_t rng_offset = 0;
  // Free-form JSON object text for the caller (sampler seed, flags, ...).
  std::string extra_json = "{}";
};

// Writes model, optimizer (may be null), scheduler (may be null) and state
// to `dir` atomically. Only call it on one rank (rank 0) for replicated
// (DDP) training. The RNG state written is default_generator()'s at the
// time of the call (state.rng_seed/rng_offset are ignored: load fills them);
// extra_json must be a JSON object.
absl::Status save_checkpoint(const std::string& dir, const nn::Module& model, const optim::Optimizer* optimizer,
                             const optim::LRScheduler* scheduler, const TrainingState& state);

// Loads what save_checkpoint wrote into existing objects (same architecture
// and parameter groups). Errors name the file and the problem (missing file,
// bad header, missing or mis-shaped tensor, wrong format/version).
// Everything is read and checked before the model, optimizer, scheduler or
// default generator change, so a failed load leaves them as they were.
absl::StatusOr<TrainingState> load_checkpoint(const std::string& dir, nn::Module& model, optim::Optimizer* optimizer,
                                              optim::LRScheduler* scheduler);

// The newest checkpoint under `root` named "<prefix><N>" (largest N), or
// nullopt when there is none. Saves are atomic, so a "<prefix><N>" directory
// that does not hold a loadable checkpoint (trainer.json missing, invalid or
// of another version, a tensor file it needs missing, or with a bad header
// or cut short: checked without reading the tensors; for a sharded
// checkpoint (sharded.h), every rank file its index.json names) is damage,
// never skipped silently:
// an error names the directory, the file and the cause. With `fall_back`, a
// damaged one is left as it is, named with its cause in `skipped` (if given,
// for the caller to report), and the next older one is tried; training from
// an older checkpoint will later save over the damaged one, which is what
// asking for the fallback means. ".tmp-"/".old-" leftovers and other names
// are not checkpoints and are ignored. `verify`, when given, is a further
// check of a checkpoint that passed these (sharded.h's
// newest_verified_checkpoint reads every piece against its checksum): its
// error is damage like theirs.
absl::StatusOr<std::optional<std::string>> latest_checkpoint(
    const std::string& root, const std::string& prefix = "epoch_", bool fall_back = false,
    std::vector<std::string>* skipped = nullptr,
    const std::function<absl::Status(const std::string& dir)>& verify = nullptr);

namespace testing {
// Test seam for crash-safety tests and the fault-injection harness
// (tools/fault_hooks.cc): save_checkpoint calls `at_stage` at each point a
// crash could happen ("model_written", "tmp_complete", "exchanged",
// "old_moved_aside", "renamed"; the sharded save's "sharded_*" stages), with
// the checkpoint directory being saved; a hook that throws leaves the disk
// exactly as a crash there would (nothing is cleaned up).
// no_rename_exchange forces the two-rename fallback. Reset with {}.
struct CheckpointSaveHooks {
  std::function<void(const std::string& stage, const std::string& dir)> at_stage;
  bool no_rename_exchange = false;
};
void set_checkpoint_save_hooks(CheckpointSaveHooks hooks);
}  // namespace testing

}  // namespace ember::distributed
