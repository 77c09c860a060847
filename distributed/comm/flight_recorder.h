// The flight recorder (PyTorch's NCCL Flight Recorder): a fixed-size ring,
// one per process, of the last operations every process group of the
// process was asked to run (Gloo and NCCL, collectives and the
// point-to-point transfers of pipelines), each with its group, sequence
// number, sizes and dtypes, state and timestamps. Cheap enough to leave on
// (one short critical section per operation and state change; no copy of
// any tensor), it is what makes a hang in a many-rank job explainable: every
// rank dumps its ring, and //tools:fr_trace (fr_trace.h) lines the ranks'
// rings up and names the first collective they disagree on and the ranks
// that never joined it.
//
// Settings:
//   EMBER_FR_BUFFER   entries in the ring (default 2000; 0 turns recording off)
//   EMBER_FR_DUMP_DIR where dumps go (default: ember_fr/ in the working
//                     directory; the launcher points its workers at a
//                     directory of the job's own)
//
// A dump is one JSON file per rank, <dir>/ember_fr_rank<R>.json (the format
// is documented in docs/reliability.md), written
//   * when an operation of any group fails (a watchdog timeout, a lost peer,
//     a signature mismatch): once per process, at the first failure;
//   * when the process dies of an uncaught exception (std::terminate);
//   * on SIGUSR1 (installed by init_process_group when the program has not
//     handled SIGUSR1 itself; the launcher forwards its own SIGUSR1 to the
//     workers, and sends one to the survivors before it tears a failed job
//     down);
//   * through dump_flight_recorder() below.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace ember::distributed::fr {

// What a group is, as its entries name it. Made by the group (ProcessGroup::
// fr_group); entries share it.
struct GroupDesc {
  std::string name;        // "default", a mesh dimension ("dp_shard"), "group_3"
  std::vector<int> ranks;  // the default group's ranks of its members
  std::string backend;     // "gloo" / "nccl"
  int rank = 0;            // this process's rank in the group
};

struct TensorMeta {
  Shape sizes;
  DType dtype = DType::Float32;
};

enum class State { Scheduled, Started, Completed, Failed };
const char* state_name(State s);

struct Entry {
  int64_t id = -1;  // record id: the recorder's count, in order of scheduling
  std::shared_ptr<const GroupDesc> group;
  int64_t seq = 0;   // collective sequence id (p2p: the group's p2p count on this rank)
  bool p2p = false;  // send / recv
  const char* op = "";
  int peer = -1;  // p2p: the other side, a rank of the default group
  int tag = 0;    // p2p tag
  // p2p: this message's number among this rank's messages of its kind
  // (send or recv) with `peer` and `tag` in the group, from 0: a send and
  // the receive it meets have the same, however far the rings have wrapped.
  int64_t msg = -1;
  std::vector<TensorMeta> inputs, outputs;
  State state = State::Scheduled;
  int64_t created_ns = 0, started_ns = 0, completed_ns = 0;  // system clock, so ranks compare
  int64_t timeout_ms = 0;
  std::string error;            // a failed op's message
  const char* caller = "";      // CallerTag in force when it was issued
  const void* frame = nullptr;  // the return address of the ProcessGroup call
};

// A label for the operations the calling thread issues while it lives
// ("ddp bucket", "fsdp all_gather", "pp send activation"): the recorder's
// "caller". The string must outlive the recorder (a literal).
class CallerTag {
 public:
  explicit CallerTag(const char* tag);
  ~CallerTag();
  CallerTag(const CallerTag&) = delete;
  CallerTag& operator=(const CallerTag&) = delete;

 private:
  const char* prev_;
};

// What the ProcessGroup front knows about the call it hands the backend:
// the group, the tensors, the peer. Set on the calling thread for the
// duration of the backend's do_* (which records the entry once it has the
// sequence number); see record_op.
class PendingCall {
 public:
  PendingCall(std::shared_ptr<const GroupDesc> group, std::vector<TensorMeta> inputs, std::vector<TensorMeta> outputs,
              int peer, int tag, const void* frame);
  ~PendingCall();
  PendingCall(const PendingCall&) = delete;
  PendingCall& operator=(const PendingCall&) = delete;

  std::shared_ptr<const GroupDesc> group;
  std::vector<TensorMeta> inputs, outputs;
  int peer, tag;
  const void* frame;

 private:
  PendingCall* prev_;
};
TensorMeta meta(const Tensor& t);
// The calling thread's PendingCall, or null.
const PendingCall* current_call();

class FlightRecorder {
 public:
  // The process's recorder (sized from EMBER_FR_BUFFER on first use).
  static FlightRecorder& get();
  explicit FlightRecorder(int64_t capacity);
  ~FlightRecorder();

  bool enabled() const { return capacity_ > 0; }
  // Operations recorded since the start (or clear()).
  int64_t recorded() const {
    std::lock_guard<std::mutex> lock(mu_);
    return next_id_;
  }
  int64_t capacity() const { return capacity_; }
  // Records an operation as scheduled, with what the calling thread's
  // PendingCall knows; returns its record id (-1 when off).
  int64_t record_op(const char* op, bool p2p, int64_t seq, int64_t timeout_ms);
  void started(int64_t id);
  // Completed, or failed with `error`.
  void finished(int64_t id, const std::string& error = "");

  // The entries still in the ring, oldest first.
  std::vector<Entry> entries() const;
  // Seconds from issue to completion summed over every operation that has
  // completed since the recorder started, by op ("allreduce", "send", ...);
  // kept beside the ring (the straggler detector's collective times).
  std::map<std::string, double> op_seconds() const;
  // The whole dump as JSON text (docs/reliability.md), `reason` in it.
  std::string dump_json(const std::string& reason) const;
  // Writes the dump to <dir>/ember_fr_rank<rank>.json (atomically: a temp
  // file renamed) and returns the path; dir "": dump_dir(). Errors throw.
  std::string dump(const std::string& reason, const std::string& dir = "") const;
  // The first failure's dump: writes once per process, later calls do
  // nothing; never throws (a failure to write is printed). `reason`: what
  // failed ("operation failed: ...", "uncaught exception: ...").
  void dump_on_failure(const std::string& reason);

  // Rank and world for the dump's header (init_process_group sets them).
  void set_identity(int rank, int world_size);
  int rank() const { return rank_; }
  void clear();  // tests

 private:
  struct GroupProgress;
  mutable std::mutex mu_;
  mutable std::mutex dump_mu_;  // one dump at a time (a failure's and SIGUSR1's may meet)
  mutable int64_t dumps_ = 0;   // temp file names
  int64_t capacity_;
  std::vector<Entry> ring_;
  int64_t next_id_ = 0;
  int rank_ = -1, world_size_ = -1;
  bool failure_dumped_ = false;
  std::vector<std::unique_ptr<GroupProgress>> progress_;
  std::map<const char*, int64_t> op_ns_;  // by the op's name (string literals)
  // p2p message counts by (group, peer, tag, is a send).
  std::map<std::tuple<const GroupDesc*, int, int, bool>, int64_t> p2p_msgs_;
  GroupProgress& progress_of(const std::shared_ptr<const GroupDesc>& g);
  Entry* find(int64_t id);
};

// EMBER_FR_DUMP_DIR, else "ember_fr" (relative to the working directory).
std::string dump_dir();
// The file a rank's dump goes to in `dir`.
std::string dump_path(const std::string& dir, int rank);
// The API: dumps this process's ring now; returns the file written.
std::string dump_flight_recorder(const std::string& reason = "dump_flight_recorder() called");
// Makes SIGUSR1 dump the ring (from a thread of its own: the handler only
// wakes it), unless the program handles SIGUSR1 itself, and std::terminate
// dump it before the previous terminate handler runs (an uncaught
// exception: Gloo's transport threads abort the process that way when a
// peer sends a message of another size than it expects). Idempotent.
void install_dump_handlers();

}  // namespace ember::distributed::fr
