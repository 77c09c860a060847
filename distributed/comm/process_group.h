// ProcessGroup: collectives over a fixed set of ranks, run by a real engine
// (Gloo for CPU tensors over TCP, NCCL for CUDA tensors). Every call returns
// a Work handle at once; the collective runs asynchronously and in call
// order. Tensors are updated in place (the Tensor handle is shared).
//
//   auto pg = init_process_group({.backend = "gloo"});   // env: RANK, WORLD_SIZE, MASTER_ADDR, ...
//   pg->allreduce(grad, ReduceOp::Avg)->wait();
//
// Safety nets, so a bug or a dead peer is an error and never a hang: every
// operation has a timeout (ProcessGroupOptions::timeout, 10 minutes by
// default) after which wait() throws naming the op, the group and the
// timeout; every collective carries a sequence number and a signature (op,
// dtype, numel, root) that, with debug checks on (check_signatures or
// EMBER_DISTRIBUTED_DEBUG=DETAIL), is checked across ranks through the store,
// so ranks that call different collectives get an error naming both sides.
#pragma once

#include <chrono>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "distributed/comm/flight_recorder.h"
#include "distributed/store/store.h"

namespace ember::distributed {

enum class ReduceOp { Sum, Avg, Max, Min, Product };
const char* reduce_op_name(ReduceOp op);

// One asynchronous operation.
class Work {
 public:
  virtual ~Work() = default;
  // True once the operation finished, successfully or not.
  virtual bool is_completed() = 0;
  // True when it finished without error.
  virtual bool is_success() = 0;
  // Blocks until done; rethrows the operation's error (ember::Error).
  virtual void wait() = 0;
  // Blocks at most `timeout`; returns false if still running (the operation
  // keeps running, and its own timeout still applies); throws on error.
  virtual bool wait(Millis timeout) = 0;
  // The error, if it finished with one.
  virtual std::exception_ptr exception() = 0;
  // Orders the caller's current CUDA stream after this operation without
  // blocking the host (torch's Work::synchronize / wait on the current
  // stream): kernels queued there afterwards see its result, so the host can
  // go on queueing work (the next layer's all-gather, say) while it runs. An
  // error still surfaces at wait() or, once the group is broken, at the next
  // collective. Work on CPU tensors has no stream to order: the host itself
  // consumes the result, so this waits.
  virtual void synchronize() { wait(); }
};

// Seconds the calling thread has spent blocked in Work::wait (any group,
// any backend) since it started: what a section timer subtracts to get the
// thread's own compute (the straggler detector: a fast rank waits for a
// slow one inside its collectives, and that wait is not its work).
double thread_wait_seconds();

struct ProcessGroupOptions {
  Millis timeout = kDefaultTimeout;
  // Check each collective's signature (op, dtype, numel, root) against the
  // other ranks before it runs, so ranks that call different collectives
  // get an error naming both sides, and a rank that never arrives is named.
  // Each check is a store round trip on the hot path (see docs/ddp.md for
  // its cost per DDP step), so it is opt-in, as torch's: this option, or
  // EMBER_DISTRIBUTED_DEBUG=DETAIL (torch's TORCH_DISTRIBUTED_DEBUG=DETAIL
  // is honoured too) for every group of the process. Without it a mismatch
  // fails when the transport notices (differing sizes) or at the timeout,
  // and a dead peer is named once a connection to it breaks.
  bool check_signatures = false;
  // The rank's place on its node, which fixes the GPU an NCCL group uses
  // (local_rank % GPU count; one decision for the whole job: init_process_group
  // passes its resolved LOCAL_RANK). -1: $LOCAL_RANK, else the rank.
  int local_rank = -1;
};

namespace detail {
// The CUDA device index an NCCL group of `rank` uses (see local_rank).
int local_device_index(const ProcessGroupOptions& options, int rank, int device_count);
// Whether a group checks signatures: the option, or the environment's debug
// level (EMBER_DISTRIBUTED_DEBUG, else TORCH_DISTRIBUTED_DEBUG) is DETAIL.
bool signature_checks_enabled(const ProcessGroupOptions& options);
}  // namespace detail

class ProcessGroup {
 public:
  ProcessGroup(int rank, int size) : rank_(rank), size_(size) {
    for (int r = 0; r < size; ++r) global_ranks_.push_back(r);
  }
  virtual ~ProcessGroup() = default;
  int rank() const { return rank_; }
  int size() const { return size_; }
  // The default group's ranks of this group's members, by group rank
  // (ascending): what a pipeline stage needs to name its peer, and what
  // errors print. The identity for the default group and for groups made
  // directly by a backend factory; new_group sets it.
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  int global_rank(int group_rank) const;
  // This group's rank of the default group's `global_rank`, or -1 when that
  // rank is not a member.
  int group_rank_of(int global_rank) const;
  // Set once, by whoever made the group from a larger one (new_group):
  // `ranks` has size() entries, ascending.
  void set_global_ranks(std::vector<int> ranks);
  // The group's name in the flight recorder's entries and fr_trace's
  // verdicts: "default" (init_process_group), "group_<k>" (new_group's k-th
  // call), a mesh dimension ("dp_shard") or view ("dp_shard_cp") for the
  // groups a DeviceMesh makes. Set before the group's first operation.
  const std::string& name() const { return name_; }
  void set_name(std::string name);
  // What the flight recorder's entries of this group share.
  std::shared_ptr<const fr::GroupDesc> fr_group() const;
  virtual std::string backend_name() const = 0;
  // Where this group's tensors live: the CPU for Gloo, this rank's GPU for
  // NCCL. Small control tensors of a collective go here.
  virtual Device device() const = 0;

  // The operations. Each validates its arguments here, once for every
  // backend (tensors defined and on this group's device, dtypes, sizes,
  // roots, peers; errors name the op, the shapes and the rank), marks its
  // outputs written for autograd, then hands over to the backend's do_*.
  // In place on `tensor` (every rank passes the same shape and dtype).
  std::shared_ptr<Work> allreduce(const Tensor& tensor, ReduceOp op = ReduceOp::Sum);
  std::shared_ptr<Work> broadcast(const Tensor& tensor, int root);
  // The result lands in `tensor` on `root` only.
  std::shared_ptr<Work> reduce(const Tensor& tensor, int root, ReduceOp op = ReduceOp::Sum);
  // outputs[r] receives rank r's input (size() tensors shaped like input).
  std::shared_ptr<Work> allgather(const std::vector<Tensor>& outputs, const Tensor& input);
  // output is size() * input.numel() elements, rank r's block at r * numel.
  std::shared_ptr<Work> allgather_into_tensor(const Tensor& output, const Tensor& input);
  // input is size() * output.numel() elements; rank r gets the reduced block r.
  std::shared_ptr<Work> reduce_scatter_tensor(const Tensor& output, const Tensor& input, ReduceOp op = ReduceOp::Sum);
  // The same, but `input` is scratch afterwards (its contents undefined):
  // a backend that reduces in a work buffer (Gloo's ring) uses it instead of
  // a private copy, saving a copy of the whole input (FSDP's gradient
  // buffer, which nothing reads after its reduction).
  std::shared_ptr<Work> reduce_scatter_tensor_consuming_input(const Tensor& output, const Tensor& input,
                                                              ReduceOp op = ReduceOp::Sum);
  // Equal splits: block r of input goes to rank r, block r of output comes from rank r.
  std::shared_ptr<Work> all_to_all_single(const Tensor& output, const Tensor& input);
  // Uneven splits along dim 0 (torch's all_to_all_single with
  // output_split_sizes and input_split_sizes): the first
  // input_split_sizes[0] rows of input go to rank 0, the next
  // input_split_sizes[1] to rank 1, ...; output's rows are those from rank
  // 0, 1, ... in output_split_sizes. Each list has size() entries summing to
  // its tensor's dim 0, and rank r's input_split_sizes[q] must be rank q's
  // output_split_sizes[r] (exchange the counts first: expert parallelism's
  // dispatch). Counted under "all_to_all" with the input's bytes.
  std::shared_ptr<Work> all_to_all_single(const Tensor& output, const Tensor& input,
                                          const std::vector<int64_t>& output_split_sizes,
                                          const std::vector<int64_t>& input_split_sizes);
  std::shared_ptr<Work> barrier();
  std::shared_ptr<Work> send(const Tensor& tensor, int dst, int tag = 0);
  std::shared_ptr<Work> recv(const Tensor& tensor, int src, int tag = 0);
  // Whether sends and receives between two ranks match in the order they
  // are posted (NCCL, which has no tags) rather than by tag (Gloo).
  virtual bool p2p_in_order() const { return false; }
  // Makes the transfers of each (sender, receiver) pair in `edges` (ranks
  // of this group) complete independently of the group's other operations
  // and of the other pairs, each pair's in the order posted. Collective:
  // every rank passes the same list (a pipeline's, from its schedule).
  // Gloo's transfers already do (tags, threads of their own); an NCCL
  // group runs all its operations on one stream in call order, where a
  // send waits for its receive, so it gives each pair a communicator and
  // stream of its own (ncclCommSplit) and their transfers use them.
  void connect_p2p(const std::vector<std::pair<int, int>>& edges);

  // Breaks the group on purpose (torch's ProcessGroup.abort): its
  // connections close, so a peer blocked on this rank fails at once instead
  // of at its timeout, and every operation here, queued or later, fails.
  // What a survivor does before it rebuilds its groups after a peer died
  // (live recovery, init.h). Gloo closes its sockets; NCCL aborts its
  // communicators (ncclCommAbort). The group cannot be used again.
  virtual void abort() {}

  // What this group has been asked to move since it was made or last
  // reset, per operation ("allreduce", "allgather", "reduce_scatter",
  // "all_to_all", "broadcast", "reduce", "send", "recv"): calls, and the
  // bytes of the whole tensor the operation is about (allreduce and
  // broadcast: the tensor; all-gather: the output; reduce-scatter and
  // all-to-all: the input; send and recv: the message), so that an
  // all-reduce and the reduce-scatter plus all-gather that replace it
  // count the same bytes each. How a tensor-parallel block's traffic is
  // checked against Megatron's formulas.
  struct OpCount {
    int64_t calls = 0, bytes = 0;
  };
  std::map<std::string, OpCount> counters() const;
  OpCount counter(const std::string& op) const;
  void reset_counters();

 protected:
  // Whether `t` is a tensor this backend moves (defined already checked):
  // by default, on device(). Backends override it to say what to use instead.
  virtual void check_tensor(const Tensor& t, const std::string& where, const char* name) const;
  // The backend's part, called with validated arguments.
  virtual std::shared_ptr<Work> do_allreduce(const Tensor& tensor, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> do_broadcast(const Tensor& tensor, int root) = 0;
  virtual std::shared_ptr<Work> do_reduce(const Tensor& tensor, int root, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> do_allgather(const std::vector<Tensor>& outputs, const Tensor& input) = 0;
  virtual std::shared_ptr<Work> do_allgather_into_tensor(const Tensor& output, const Tensor& input) = 0;
  virtual std::shared_ptr<Work> do_reduce_scatter_tensor(const Tensor& output, const Tensor& input, ReduceOp op,
                                                         bool consume_input) = 0;
  virtual std::shared_ptr<Work> do_all_to_all_single(const Tensor& output, const Tensor& input) = 0;
  // Contiguous output and input; the splits in elements.
  virtual std::shared_ptr<Work> do_all_to_all_v(const Tensor& output, const Tensor& input,
                                                const std::vector<int64_t>& output_elems,
                                                const std::vector<int64_t>& input_elems) = 0;
  virtual std::shared_ptr<Work> do_barrier() = 0;
  virtual std::shared_ptr<Work> do_send(const Tensor& tensor, int dst, int tag) = 0;
  virtual std::shared_ptr<Work> do_recv(const Tensor& tensor, int src, int tag) = 0;
  virtual void do_connect_p2p(const std::vector<std::pair<int, int>>& edges) { (void)edges; }

  int rank_, size_;
  std::vector<int> global_ranks_;
  std::string name_ = "unnamed";

 private:
  void count(const char* op, int64_t bytes);
  mutable std::mutex fr_mu_;
  mutable std::shared_ptr<const fr::GroupDesc> fr_group_;  // made on first use, remade after a rename
  mutable std::mutex counters_mu_;  // ops may start from several threads (DDP's hooks, FSDP's prefetch)
  std::map<std::string, OpCount> counters_;
  std::shared_ptr<Work> reduce_scatter_front(const Tensor& output, const Tensor& input, ReduceOp op,
                                             bool consume_input);
};

}  // namespace ember::distributed
