// Pieces both process-group backends (process_group_gloo.cc,
// process_group_nccl.cc) share, kept out of the public headers:
//   * OpInfo: what an operation is, so every error names the op, its
//     sequence number, the backend, the rank and the timeout the same way
//     (next_op_info builds it for both backends);
//   * CompletionWork: a Work that the backend's thread completes;
//   * the cross-rank signature check through the store;
//   * argument validation, identical for both engines, done on the calling
//     thread so a wrong size throws at the call site, not from wait().
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "core/exception.h"
#include "core/profiler.h"
#include "core/tensor.h"
#include "distributed/comm/process_group.h"
#include "distributed/store/store.h"

namespace ember::distributed::detail {

using PgClock = std::chrono::steady_clock;

struct OpInfo {
  std::string op;   // "allreduce", "send", ...
  int64_t seq = 0;  // collective number (same on every rank); p2p ops count separately
  bool collective = true;
  std::string backend;  // "gloo" / "nccl"
  std::string group;    // the group's name (ProcessGroup::name), when the flight recorder is on
  int rank = 0, size = 1;
  Millis timeout{0};
  std::string signature;           // "op=allreduce dtype=float32 numel=1000 root=-1 reduce=sum"
  int64_t bytes = 0;               // payload per rank (the input), for the profiler
  PgClock::time_point enqueued{};  // when the caller issued it
  int64_t fr_id = -1;              // its flight recorder entry (-1: none)

  // "allreduce (collective #5, gloo group dp_shard rank 1 of 3, timeout 1500 ms)"
  std::string describe() const;
};

// The signature ranks compare before a collective, with the payload's size
// (bytes of `numel` elements of `tensor`'s dtype) for the profiler.
// `tensor` may be null (barrier); `reduce` may be null for non-reducing ops.
struct Signature {
  Signature(const char* t = "") : text(t) {}  // p2p ops compare none
  Signature(std::string t, int64_t b) : text(std::move(t)), bytes(b) {}
  std::string text;
  int64_t bytes = 0;
};
Signature make_signature(const std::string& op, const Tensor* tensor, int64_t numel, int root, const ReduceOp* reduce);
// An op whose sizes differ by rank (the uneven all-to-all): the ranks
// compare its name and dtype; the payload is `input`'s bytes.
Signature make_uneven_signature(const std::string& op, const Tensor& input);

// The numbers a group gives its operations: collectives count in one
// sequence (the same on every rank: signature keys and transport tags are
// keyed by it), point-to-point ops in their own (only the pair takes part).
// Not synchronized: a backend numbers its ops under the lock that keeps
// them in call order.
struct OpCounters {
  int64_t collectives = 0, p2p = 0;
};

// The OpInfo of a group's next operation, for both backends alike: the
// op's name and number (taken from `counters`), the group's backend, rank,
// size and timeout, and the signature and payload the ranks compare. Every
// error and profiler event of the op reads it, so both backends describe
// their ops the same way.
OpInfo next_op_info(OpCounters& counters, const char* op, bool collective, const std::string& backend, int rank,
                    int size, Millis timeout, Signature signature);

// Records the profiler event of a collective (Kind::Collective) on the
// thread that runs it: bytes, sequence number, group, and where its time
// went: queued behind earlier ops, waiting for peers to arrive (the
// signature check, when on), transferring. Begin before the work, call
// transfer_started() once peers have arrived.
class CollectiveEvent {
 public:
  CollectiveEvent(const OpInfo& info, const std::string& group);
  void transfer_started();
  void end() { scope_.close(); }

 private:
  profiler::Scope scope_;
  int64_t begin_ns_ = 0;
};

// Adds its scope's duration to the calling thread's thread_wait_seconds():
// around every blocking Work::wait of either backend.
class WaitClock {
 public:
  WaitClock() : start_(PgClock::now()) {}
  ~WaitClock();
  WaitClock(const WaitClock&) = delete;
  WaitClock& operator=(const WaitClock&) = delete;

 private:
  PgClock::time_point start_;
};

// A Work completed once, from whichever thread runs the operation.
class CompletionWork : public Work {
 public:
  explicit CompletionWork(OpInfo info) : info_(std::move(info)) {}
  bool is_completed() override;
  bool is_success() override;
  void wait() override;
  bool wait(Millis timeout) override;
  std::exception_ptr exception() override;

  // Marks the work done (with `error` if it failed) and wakes waiters. Only
  // the first call counts.
  void finish(std::exception_ptr error = nullptr);
  const OpInfo& info() const { return info_; }

 protected:
  OpInfo info_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool finishing_ = false;  // finish() has begun (recording, the failure's dump)
  bool done_ = false;
  std::exception_ptr error_;
};

// An ember::Error for `info` failing with `cause` (whatever the engine threw)
// after `elapsed`: "<describe()> timed out/failed after N ms: <cause>", plus a
// hint about dead or missing peers when the cause looks like one.
// `lost`: ranks the store knows to be gone (Store::lost_ranks), named in
// place of the generic hint; `store_error`: why the store itself could not
// be asked (its host, usually rank 0, is gone), named likewise.
std::exception_ptr op_error(const OpInfo& info, std::exception_ptr cause, Millis elapsed,
                            const std::vector<LostRank>& lost = {}, const std::string& store_error = "");

// The error of an op issued on a group that an earlier failure left
// unusable (both backends refuse every op after a group's first failure):
// "<what>: this group can no longer be used; an earlier operation failed:
// <first_failure>". `what` names the op (OpInfo::describe()).
Error unusable_group_error(const std::string& what, const std::string& first_failure);

// True when an engine's error says a connection to a peer broke.
bool is_connection_loss(std::exception_ptr cause);

// The ranks the store reports lost, polling for up to `within`: when a peer
// dies, the transport and the store server see its sockets close at about
// the same moment, in either order. Empty if none is reported in time or the
// store cannot tell. When the store cannot be reached, `store_error` (if
// given) gets its message. With `born` (when the asking group was made),
// ranks lost since then count even when a replacement has taken their
// place already (Store::lost_ranks_since): live recovery's replacement can
// say hello before a survivor asks.
std::vector<LostRank> lost_ranks_within(Store& store, Millis within, std::string* store_error = nullptr,
                                        PgClock::time_point born = {});

// Before collective info.seq runs: rank 0 reads every rank's signature from
// the store, compares it with its own and publishes a verdict that the other
// ranks wait for, so a mismatch fails every rank with one message naming both
// sides and the sequence number, and a rank that never arrives fails the
// others once `deadline` passes instead of hanging in the engine. Keys live
// under "sig/<seq>/" and are deleted once every rank is past them. No-op for
// a group of one.
void check_signature(Store& store, const OpInfo& info, PgClock::time_point deadline);

// ---- Argument checks (EMBER_CHECK naming the op, shapes and rank) ----
// `where` is e.g. "gloo allgather (rank 1 of 3)".
std::string where(const std::string& backend, const char* op, int rank, int size);
void check_defined(const Tensor& t, const std::string& where, const char* name);
void check_root(int root, int size, const std::string& where);
void check_peer(int peer, int rank, int size, const std::string& where);
void check_same_dtype(const Tensor& a, const char* a_name, const Tensor& b, const char* b_name,
                      const std::string& where);
// output.numel() == factor * input.numel() (allgather_into_tensor: output is
// size x input; reduce_scatter_tensor: input is size x output).
void check_flat_sizes(const Tensor& big, const char* big_name, const Tensor& small, const char* small_name, int factor,
                      const std::string& where);
void check_allgather_list(const std::vector<Tensor>& outputs, const Tensor& input, int size, const std::string& where);
void check_reduce_dtype(DType dtype, ReduceOp op, const std::string& where);
// A backend factory's arguments (`factory` is e.g. "make_gloo_group").
void check_group_args(const char* factory, const Store* store, int rank, int size, const ProcessGroupOptions& options);

// Marks an in-place write so autograd can tell a saved tensor was changed.
inline void bump_version(const Tensor& t) { t.impl().storage->bump_version("a collective's output"); }

}  // namespace ember::distributed::detail
