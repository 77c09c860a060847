// Sharded checkpoints, as PyTorch's distributed checkpoint (DCP): every rank
// writes the part of the training state it holds, in parallel, and a job of
// any world size and any layout (fully_shard with any strategy, DDP, ZeRO-1's
// replicated parameters, one process) loads it, each rank reading only the
// pieces that overlap what it holds now.
//
// A checkpoint directory:
//   rank-00000.safetensors ...  each rank's pieces (a valid safetensors file;
//                               a piece is named "<tensor>@<box offsets>+<run begin>")
//   trainer.json                optimizer groups, scheduler, epoch, step, RNG,
//                               user JSON (checkpoint.h's format)
//   index.json                  written last, by rank 0:
//     {"format": "ember-sharded-checkpoint", "version": 2, "world_size": N,
//      "layout": "fsdp:full_shard",          (what saved it, for messages)
//      "files": ["rank-00000.safetensors", ...],
//      "tensors": {"layers.0.attn.qkv.weight": {"shape": [384, 128], "dtype": "F32",
//         "pieces": [{"file": "rank-00000.safetensors", "offsets": [0, 0], "sizes": [192, 128],
//                     "begin": 0, "numel": 24576, "bytes": [80, 98384], "xxh64": "9c1e..."}, ...]}, ...}}
// A piece is a Region (distributed/sharding/shard_spec.h): the box
// `offsets` + `sizes` of the tensor (DCP's chunk metadata) and the run
// [`begin`, `begin` + `numel`) of that box's row-major flattening it holds,
// so a column shard (a box) and a flat FSDP shard (a run of rows) are both
// one piece. `bytes` is its byte range in the file (absolute), `xxh64` the
// xxHash64 (seed 0) of those bytes. What each rank holds comes from each
// tensor's ShardSpec, whichever parallelism attached it; a tensor without
// one is held whole. Version 1 indexes (a piece is "offset" + "numel" of
// the whole tensor's flattening) still load. Names are
// PyTorch's: model tensors as in state_dict(), optimizer state as
// "optim.state.<parameter name>.<state name>" (exp_avg, exp_avg_sq,
// momentum_buffer, step); each rank's random generator is "rng.<rank>"
// (int64 seed and offset), restored when the world size is the saver's
// (otherwise every rank takes rank 0's, from trainer.json). A parameter
// every rank holds whole (DDP) is
// written once, by one rank chosen by its name, so the writes spread over
// the ranks; a buffer every rank holds (batch norm's running statistics,
// which differ between DDP ranks) is rank 0's, as DDP broadcasts rank 0's.
//
// Commit: ranks write into "<dir>.tmp-<nonce>"; an agreement then checks that
// every rank wrote its file; only then does rank 0 write trainer.json and
// index.json and rename the directory into place (checkpoint.h's atomic
// replacement). A failing or dying rank leaves the previous checkpoint.
//
// Load checks the index (format, version, every tensor's pieces covering it
// exactly once, shapes and dtypes against the model) and reads and verifies
// every piece it needs before it changes the model or the optimizer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "distributed/checkpoint/checkpoint.h"
#include "distributed/comm/process_group.h"
#include "distributed/sharding/shard_spec.h"

namespace ember::distributed {

struct ShardedSaveOptions {
  // Pieces are split at this size: a reader over-reads at most one piece
  // per tensor end, and a corrupted byte is located to within a piece.
  int64_t max_piece_bytes = int64_t{16} << 20;
  // The job's mesh as it names it (DeviceMesh::to_string()), recorded in
  // the index for //tools:ckpt inspect; empty: not recorded.
  std::string mesh;
};

// Every rank of `pg` calls it, with its model (wrapped by fully_shard or
// not), its optimizer (may be null; each rank writes the state it holds,
// ZeroRedundancyOptimizer's shards too) and scheduler (may be null). Returns the same status on every rank: an error
// names the rank that failed.
absl::Status save_sharded_checkpoint(const std::string& dir, nn::Module& model, optim::Optimizer* optimizer,
                                     const optim::LRScheduler* scheduler, const TrainingState& state,
                                     ProcessGroup& pg, const ShardedSaveOptions& options = {});

// Asynchronous saves: save() copies this rank's pieces to host memory (the
// only time the training loop waits) and returns; a background thread
// writes them and commits over its own process group, so training's
// collectives go on undisturbed. One save at a time: the next save() first
// waits for the previous one, and a previous failure is its error (naming
// the checkpoint; that call saves nothing); wait() returns the last save's outcome (call it before
// exiting; the destructor waits too and reports a failure on stderr).
//
//   AsyncCheckpointer ckpt(distributed::new_group(all_ranks, "gloo"));  // every rank
//   ... if (auto s = ckpt.save(dir, model, &opt, &sched, state, *pg); !s.ok()) ...
//   ... at the end: EMBER_CHECK(ckpt.wait().ok(), ...)
class AsyncCheckpointer {
 public:
  // `group`: the background thread's group, the same ranks as the training
  // group but used by nothing else (new_group on every rank). Make it Gloo
  // also in an NCCL job, as PyTorch's async_save advises: the staged pieces
  // are host memory, and two NCCL communicators in use at once on one GPU
  // can deadlock when ranks order their work differently.
  explicit AsyncCheckpointer(std::shared_ptr<ProcessGroup> group, ShardedSaveOptions options = {});
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;
  // Every rank calls it with the training group `pg` (its rank and size
  // decide who writes what; staging itself runs no collective).
  absl::Status save(const std::string& dir, nn::Module& model, optim::Optimizer* optimizer,
                    const optim::LRScheduler* scheduler, const TrainingState& state, ProcessGroup& pg);
  absl::Status wait();
  // How long the last save() blocked the caller (staging), in seconds.
  double last_staging_seconds() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Every rank of `pg` calls it. The model, optimizer and scheduler change only
// if everything needed was read and verified; errors name the file, the
// tensor and what was wrong.
absl::StatusOr<TrainingState> load_sharded_checkpoint(const std::string& dir, nn::Module& model,
                                                      optim::Optimizer* optimizer, optim::LRScheduler* scheduler,
                                                      ProcessGroup& pg);

// ---- The index, for tools (//tools:ckpt) and tests ----

struct CheckpointPiece {
  std::string file;
  Region region;  // a box of the tensor and a run of its flattening (version 1: the whole box)
  int64_t byte_begin = 0, byte_end = 0;
  uint64_t xxh64 = 0;
};
struct CheckpointTensor {
  std::string name;
  Shape shape;
  DType dtype = DType::Float32;
  std::vector<CheckpointPiece> pieces;  // by box offsets, then run begin
  std::string placement;                // how it was laid out when saved, if recorded
};
struct CheckpointIndex {
  int version = 0;
  int world_size = 0;
  std::string layout;
  std::string mesh;  // the saving job's mesh, if recorded
  std::vector<std::string> files;
  std::vector<CheckpointTensor> tensors;  // by name
  const CheckpointTensor* find(const std::string& name) const;
};

// index.json read and checked (format, version, fields, and every tensor's
// pieces covering it exactly once, in files the index lists).
absl::StatusOr<CheckpointIndex> read_checkpoint_index(const std::string& dir);
// Every piece read and its checksum compared: an error names the file, the
// tensor and the byte range of the first mismatch.
absl::Status verify_checkpoint(const std::string& dir);

// What an unattended resume (an elastic restart) loads: the newest
// "<prefix><N>" checkpoint under `root` that verifies completely —
// trainer.json, and for a sharded checkpoint index.json and every piece
// read against its checksum (verify_checkpoint); a single-file one by
// latest_checkpoint's checks. Every newer one that does not is named with
// its reason in `skipped`; nothing is deleted or modified. nullopt when
// `root` holds no checkpoint at all; an error naming each checkpoint and
// its damage when none verifies.
absl::StatusOr<std::optional<std::string>> newest_verified_checkpoint(const std::string& root,
                                                                      const std::string& prefix,
                                                                      std::vector<std::string>* skipped = nullptr);
// The same, decided once by rank 0 of `pg` and given to every rank (the
// answer, its error and the skipped list alike), so every rank loads the
// same checkpoint and only one reads every piece. Collective.
absl::StatusOr<std::optional<std::string>> newest_verified_checkpoint(const std::string& root,
                                                                      const std::string& prefix, ProcessGroup& pg,
                                                                      std::vector<std::string>* skipped = nullptr);
// Whether `dir` holds a sharded checkpoint (an index.json).
bool is_sharded_checkpoint(const std::string& dir);
// One tensor whole (a CPU tensor of its shape), its pieces verified.
absl::StatusOr<Tensor> read_checkpoint_tensor(const std::string& dir, const CheckpointTensor& t);
// Writes the checkpoint as one process's (checkpoint.h's format) into
// `out_dir`: model.safetensors with the model's (PyTorch's) names, which
// load_checkpoint and PyTorch's load_state_dict take, optimizer.safetensors
// keyed "state.<index>.<name>" as torch's optimizer state_dict, and
// trainer.json. Written atomically, as save_checkpoint does.
absl::Status consolidate_checkpoint(const std::string& dir, const std::string& out_dir);

}  // namespace ember::distributed
