// The NCCL process group: collectives on CUDA tensors of one GPU per rank.
//
// Ordering. Each group owns a CUDA stream for its communication. A
// collective records an event on the caller's current stream (the
// producer, Stream::current (core/stream.h); the legacy default stream unless
// the caller set one) and makes the comm stream wait on it, so NCCL reads the
// tensor only after the kernels that wrote it. Dense copies of non-contiguous
// tensors and copy-backs run on the comm stream too (the current stream is
// switched to it while they are enqueued). A second event, recorded on the
// comm stream after the op, tells when it is done.
//
// Work. wait() blocks the host until that event completes (or the watchdog
// fails the op) and then rethrows any error: the same contract as the Gloo
// group. synchronize() is torch's "block the current stream": the caller's
// current stream waits on the event and the host goes on, so prefetching
// collectives overlap compute (FSDP).
//
// Safety nets. A watchdog thread polls every pending op's event and
// ncclCommGetAsyncError. A Work whose event fired checks its communicator's
// asynchronous error too (as PyTorch's WorkNCCL::isCompleted checks it), so
// a collective that a peer's failure ended early never reads as a success.
// An op still running past options.timeout, or an asynchronous NCCL error (a peer died, a network failure), aborts the
// communicator (ncclCommAbort, which also kills kernels stuck waiting for
// peers) and fails every pending op with an error naming the op, its
// sequence number and the timeout; the group is unusable afterwards.
// Tensors an op uses stay referenced until its event completes, so the
// caching allocator cannot hand their memory out while NCCL still uses it.
//
// CUDA graphs. A collective issued while this thread captures a graph
// (core/cuda_graph.h) is recorded into it: the comm stream joins the capture
// through the ready event, and the caller's wait() or synchronize() joins it
// back (the current stream waits for the done event; the host cannot wait
// for work that only the replays run). Such an op is not the watchdog's:
// querying an event recorded in a capture would invalidate it, and a replay
// runs the collective again without a new Work.
//
// Compiled wherever CUDA is built; only runs where a GPU is present (or
// under the emulation, third_party/cuda_emu/nccl_emu.cc). The
// CPU-only configuration keeps make_nccl_group, as an error naming the cause.
#include "core/device.h"
#include "distributed/comm/backends.h"

#if EMBER_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "core/cuda_check.h"
#include "core/cuda_graph.h"
#include "core/device.h"
#include "core/tensor.h"
#include "distributed/comm/pg_common.h"
#include "distributed/store/store_internal.h"
#endif  // EMBER_WITH_CUDA

namespace ember::distributed {
#if EMBER_WITH_CUDA
namespace {

using detail::CompletionWork;
using detail::OpInfo;
using detail::PgClock;

ncclDataType_t nccl_dtype(DType t) {
  switch (t) {
    case DType::Float32:
      return ncclFloat32;
    case DType::Float16:
      return ncclFloat16;
    case DType::BFloat16:
      return ncclBfloat16;
    case DType::Float64:
      return ncclFloat64;
    case DType::Int32:
      return ncclInt32;
    case DType::Int64:
      return ncclInt64;
    case DType::UInt8:
      return ncclUint8;
    case DType::Bool:
      return ncclUint8;  // 0/1 bytes; reductions mapped below
    case DType::Float8E4M3:
    case DType::Float8E5M2:
      return ncclUint8;  // moved as bytes (all-gather, broadcast); reductions refused below
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(ReduceOp op, DType t) {
  EMBER_CHECK(!is_float8(t), "ProcessGroupNCCL: reductions of ", t,
              " are not supported (all-gather and broadcast move it as bytes)");
  if (t == DType::Bool) {
    // any / all over 0-1 bytes.
    return (op == ReduceOp::Sum || op == ReduceOp::Max) ? ncclMax : ncclMin;
  }
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Avg:
      return ncclAvg;
    case ReduceOp::Max:
      return ncclMax;
    case ReduceOp::Min:
      return ncclMin;
    case ReduceOp::Product:
      return ncclProd;
  }
  return ncclSum;
}

// cudaSetDevice for a scope (the current device is per thread).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    EMBER_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) EMBER_CUDA_CHECK(cudaSetDevice(device));
    device_ = device;
  }
  ~DeviceGuard() {
    if (prev_ != device_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0, device_ = 0;
};

Tensor dense(const Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }
void write_back(const Tensor& dst, const Tensor& buf) {
  if (buf.is_same(dst)) return;
  Tensor d = dst;
  d.copy_(buf);
}

// A communicator as the Works of its ops see it: the watchdog marks it
// aborted (under mu) before ncclCommAbort frees it, so a Work polling from
// another thread never reads a freed communicator.
struct CommRef {
  explicit CommRef(ncclComm_t c) : comm(c) {}
  std::mutex mu;
  ncclComm_t comm;
  bool aborted = false;
  // "" or the communicator's asynchronous error, described.
  std::string async_error() {
    std::lock_guard<std::mutex> lock(mu);
    if (aborted || comm == nullptr) return "";
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm, &async);
    if (r != ncclSuccess) async = r;
    if (async == ncclSuccess || async == ncclInProgress) return "";
    return std::string("NCCL reported an asynchronous error: ") + ncclGetErrorString(async) + " (" +
           ncclGetLastError(comm) + ")";
  }
  void abort() {
    std::lock_guard<std::mutex> lock(mu);
    if (aborted) return;
    aborted = true;
    ncclCommAbort(comm);
  }
  // Before ncclCommDestroy: a Work that outlives its group asks nothing.
  void forget() {
    std::lock_guard<std::mutex> lock(mu);
    aborted = true;
  }
};

class NcclWork : public CompletionWork {
 public:
  NcclWork(OpInfo info, int device, std::shared_ptr<CommRef> comm, std::unique_ptr<Event> done,
           std::vector<Tensor> keep)
      : CompletionWork(std::move(info)),
        device_(device),
        comm_(std::move(comm)),
        done_event_(std::move(done)),
        keep_(std::move(keep)),
        start_(PgClock::now()) {}

  bool is_completed() override {
    poll();
    return CompletionWork::is_completed();
  }
  bool is_success() override {
    poll();
    return CompletionWork::is_success();
  }
  void wait() override { wait(Millis::max()); }
  bool wait(Millis timeout) override {
    detail::WaitClock blocked;
    const auto until = detail::deadline_after(timeout);
    // Spin briefly (short collectives), then back off: the watchdog bounds
    // the op itself, so this loop ends when it completes or is failed.
    for (int i = 0; !poll(); ++i) {
      if (PgClock::now() >= until) return false;
      if (i > 200) std::this_thread::sleep_for(std::chrono::microseconds(i > 2000 ? 1000 : 50));
    }
    if (auto e = exception()) std::rethrow_exception(e);
    return true;
  }

  // The caller's current stream waits for the done event on the device;
  // the host does not. A work that already failed rethrows at once.
  void synchronize() override {
    if (CompletionWork::is_completed()) {
      if (auto e = exception()) std::rethrow_exception(e);
    }
    done_event_->block(Stream::current(device_));
  }

  // True once done; completes the work when its event has fired, failed if
  // its communicator reports an asynchronous error by then (an op that a
  // peer's failure ended early fires its event with its output unwritten).
  // An op whose event has not fired is the watchdog's to fail: it drops the
  // tensors only once the abort has stopped NCCL's kernels.
  bool poll() {
    if (CompletionWork::is_completed()) return true;
    try {
      if (!done_event_->query()) return false;
      if (std::string async = comm_->async_error(); !async.empty())
        finish(std::make_exception_ptr(Error(info_.describe() + ": " + async)));
      else
        finish();
    } catch (const Error& e) {
      cudaGetLastError();
      finish(std::make_exception_ptr(Error(info_.describe() + ": CUDA error while running: " + e.what())));
    }
    release();
    return true;
  }
  void release() {
    std::lock_guard<std::mutex> lock(keep_mu_);
    keep_.clear();
  }
  PgClock::time_point start() const { return start_; }

 private:
  int device_;
  std::shared_ptr<CommRef> comm_;
  std::unique_ptr<Event> done_event_;
  std::mutex keep_mu_;
  std::vector<Tensor> keep_;
  PgClock::time_point start_;
};

// A collective recorded into a CUDA graph: done as far as the host is
// concerned; waiting for it orders the capturing stream after it.
class CapturedWork : public CompletionWork {
 public:
  CapturedWork(OpInfo info, int device, std::unique_ptr<Event> done)
      : CompletionWork(std::move(info)), device_(device), done_event_(std::move(done)) {
    finish();
  }
  void wait() override { synchronize(); }
  bool wait(Millis) override {
    synchronize();
    return true;
  }
  void synchronize() override {
    EMBER_CHECK(cuda_graph_capturing(), info_.describe(),
                " was captured in a CUDA graph: it runs in the graph's replays, and only work captured with it "
                "can wait for it");
    done_event_->block(Stream::current(device_));
  }

 private:
  int device_;
  std::unique_ptr<Event> done_event_;
};

class NcclGroup : public ProcessGroup {
 public:
  NcclGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options)
      : ProcessGroup(rank, size),
        store_(std::move(store)),
        options_(options),
        group_label_("nccl rank " + std::to_string(rank) + " of " + std::to_string(size)) {
    options_.check_signatures = detail::signature_checks_enabled(options);
    EMBER_CHECK(cuda_is_available(), "make_nccl_group: the nccl backend needs a CUDA GPU, and none is usable (",
                cuda_unavailable_reason(), "); use the gloo backend for CPU tensors");
    device_ = detail::local_device_index(options_, rank, cuda_device_count());
    DeviceGuard g(device_);

    // Rank 0 makes the unique id; everyone reads it from the store. Each rank
    // then announces itself and waits for the others, so the (blocking) NCCL
    // init below starts only once every rank is known to be alive.
    ncclUniqueId id;
    const Millis timeout = options_.timeout;
    if (rank == 0) {
      EMBER_NCCL_CHECK(ncclGetUniqueId(&id));
      store_->set("nccl/unique_id",
                  Bytes(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof id));
    }
    std::vector<std::string> joined;
    for (int r = 0; r < size; ++r) joined.push_back("nccl/joined/" + std::to_string(r));
    try {
      store_->wait({"nccl/unique_id"}, timeout);
      Bytes b = store_->get("nccl/unique_id");
      EMBER_CHECK(b.size() == sizeof id, "make_nccl_group: the store holds a ", b.size(),
                  "-byte nccl/unique_id, expected ", sizeof id);
      std::memcpy(&id, b.data(), sizeof id);
      store_->set(joined[rank], std::string("1"));
      store_->wait(joined, timeout);
    } catch (const Error& e) {
      throw Error(::ember::detail::str_cat("make_nccl_group: rank ", rank, " of ", size,
                                           " did not meet its peers within ", timeout.count(), " ms: ", e.what()));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    EMBER_NCCL_CHECK(ncclCommInitRankConfig(&comm_, size, id, rank, &config));
    comm_ref_ = std::make_shared<CommRef>(comm_);
    comm_stream_ = new_stream(device_);
    stream_ = static_cast<cudaStream_t>(comm_stream_->handle);
    ready_event_ = std::make_unique<Event>(device_);
    barrier_buf_ = Tensor::empty({1}, TensorOptions(DType::Int32, cuda_device(device_)));
    watchdog_ = std::thread([this] { watchdog_loop(); });
  }

  ~NcclGroup() override {
    try {
      // Let pending ops finish (the watchdog fails them at their timeout).
      {
        std::unique_lock<std::mutex> lock(mu_);
        drained_cv_.wait(lock, [&] { return pending_.empty(); });
        stop_ = true;
      }
      watchdog_.join();
      DeviceGuard g(device_);
      comm_ref_->forget();
      for (auto& [key, e] : edges_) e.ref->forget();
      if (!aborted_) {
        ncclCommFinalize(comm_);
        ncclCommDestroy(comm_);
      }
      for (auto& [key, e] : edges_) {
        if (aborted_) continue;
        ncclCommFinalize(e.comm);
        ncclCommDestroy(e.comm);
      }
      edges_.clear();
      ready_event_.reset();
      comm_stream_.reset();
    } catch (...) {
      // Destructors must not throw; the process is shutting the group down.
    }
  }

  std::string backend_name() const override { return "nccl"; }
  Device device() const override { return cuda_device(device_); }

  std::shared_ptr<Work> do_allreduce(const Tensor& tensor, ReduceOp op) override {
    Tensor t = tensor.alias();
    return launch("allreduce", detail::make_signature("allreduce", &t, t.numel(), -1, &op), {t},
                  [&](std::vector<Tensor>& keep) {
                    Tensor buf = dense(t);
                    keep.push_back(buf);
                    EMBER_NCCL_CHECK(ncclAllReduce(buf.raw_data(), buf.raw_data(), t.numel(), nccl_dtype(t.dtype()),
                                                   nccl_op(op, t.dtype()), comm_, stream_));
                    write_back(t, buf);
                  });
  }

  std::shared_ptr<Work> do_broadcast(const Tensor& tensor, int root) override {
    Tensor t = tensor.alias();
    return launch("broadcast", detail::make_signature("broadcast", &t, t.numel(), root, nullptr), {t},
                  [&](std::vector<Tensor>& keep) {
                    Tensor buf = dense(t);
                    keep.push_back(buf);
                    EMBER_NCCL_CHECK(ncclBroadcast(buf.raw_data(), buf.raw_data(), t.numel(), nccl_dtype(t.dtype()),
                                                   root, comm_, stream_));
                    if (rank_ != root) write_back(t, buf);
                  });
  }

  std::shared_ptr<Work> do_reduce(const Tensor& tensor, int root, ReduceOp op) override {
    Tensor t = tensor.alias();
    return launch("reduce", detail::make_signature("reduce", &t, t.numel(), root, &op), {t},
                  [&](std::vector<Tensor>& keep) {
                    // recvbuff is only written on the root; other ranks keep their tensor.
                    Tensor buf = dense(t);
                    keep.push_back(buf);
                    EMBER_NCCL_CHECK(ncclReduce(buf.raw_data(), buf.raw_data(), t.numel(), nccl_dtype(t.dtype()),
                                                nccl_op(op, t.dtype()), root, comm_, stream_));
                    if (rank_ == root) write_back(t, buf);
                  });
  }

  std::shared_ptr<Work> do_allgather(const std::vector<Tensor>& outputs, const Tensor& input) override {
    std::vector<Tensor> keep{input.alias()};
    for (const Tensor& o : outputs) keep.push_back(o.alias());
    Tensor in = keep[0];
    return launch(
        "allgather", detail::make_signature("allgather", &in, in.numel(), -1, nullptr), keep,
        [&](std::vector<Tensor>& k) {
          const int64_t n = in.numel();
          Tensor src = dense(in);
          Tensor flat = Tensor::empty({size_ * n}, in.options());
          k.push_back(src);
          k.push_back(flat);
          EMBER_NCCL_CHECK(ncclAllGather(src.raw_data(), flat.raw_data(), n, nccl_dtype(in.dtype()), comm_, stream_));
          for (int r = 0; r < size_; ++r) write_back(keep[r + 1], flat.narrow(0, r * n, n).view(keep[r + 1].sizes()));
        });
  }

  std::shared_ptr<Work> do_allgather_into_tensor(const Tensor& output, const Tensor& input) override {
    Tensor out = output.alias(), in = input.alias();
    return launch("allgather_into_tensor",
                  detail::make_signature("allgather_into_tensor", &in, in.numel(), -1, nullptr), {out, in},
                  [&](std::vector<Tensor>& keep) {
                    Tensor dst = out.is_contiguous() ? out : Tensor::empty({out.numel()}, out.options());
                    // NCCL allows the input to be exactly this rank's block of
                    // the output; any other overlap needs a copy.
                    const bool in_place =
                        in.is_contiguous() && in.raw_data() == static_cast<char*>(dst.raw_data()) + rank_ * in.nbytes();
                    Tensor src = in_place ? in : (in.shares_storage(dst) ? in.contiguous().clone() : dense(in));
                    keep.push_back(dst);
                    keep.push_back(src);
                    EMBER_NCCL_CHECK(ncclAllGather(src.raw_data(), dst.raw_data(), in.numel(), nccl_dtype(in.dtype()),
                                                   comm_, stream_));
                    if (!dst.is_same(out)) write_back(out, dst.view(out.sizes()));
                  });
  }

  // NCCL reduces out of the input without a private copy: consuming it changes nothing.
  std::shared_ptr<Work> do_reduce_scatter_tensor(const Tensor& output, const Tensor& input, ReduceOp op,
                                                 bool /*consume_input*/) override {
    Tensor out = output.alias(), in = input.alias();
    return launch(
        "reduce_scatter_tensor", detail::make_signature("reduce_scatter_tensor", &in, in.numel(), -1, &op), {out, in},
        [&](std::vector<Tensor>& keep) {
          Tensor src = dense(in);
          Tensor dst = out.is_contiguous() ? out : Tensor::empty({out.numel()}, out.options());
          // In place only when the output is this rank's block of the input.
          const bool in_place = dst.raw_data() == static_cast<char*>(src.raw_data()) + rank_ * dst.nbytes();
          if (!in_place && dst.shares_storage(src)) src = src.clone();
          keep.push_back(src);
          keep.push_back(dst);
          EMBER_NCCL_CHECK(ncclReduceScatter(src.raw_data(), dst.raw_data(), out.numel(), nccl_dtype(in.dtype()),
                                             nccl_op(op, in.dtype()), comm_, stream_));
          if (!dst.is_same(out)) write_back(out, dst.view(out.sizes()));
        });
  }

  std::shared_ptr<Work> do_all_to_all_single(const Tensor& output, const Tensor& input) override {
    Tensor out = output.alias(), in = input.alias();
    return launch(
        "all_to_all_single", detail::make_signature("all_to_all_single", &in, in.numel(), -1, nullptr), {out, in},
        [&](std::vector<Tensor>& keep) {
          Tensor src = out.shares_storage(in) ? in.contiguous().clone() : dense(in);
          Tensor dst = out.is_contiguous() ? out : Tensor::empty(out.sizes(), out.options());
          keep.push_back(src);
          keep.push_back(dst);
          const size_t count = static_cast<size_t>(in.numel() / size_);
          const size_t bytes = count * in.element_size();
          const ncclDataType_t dt = nccl_dtype(in.dtype());
          EMBER_NCCL_CHECK(ncclGroupStart());
          for (int r = 0; r < size_; ++r) {
            EMBER_NCCL_CHECK(ncclSend(static_cast<char*>(src.raw_data()) + r * bytes, count, dt, r, comm_, stream_));
            EMBER_NCCL_CHECK(ncclRecv(static_cast<char*>(dst.raw_data()) + r * bytes, count, dt, r, comm_, stream_));
          }
          EMBER_NCCL_CHECK(ncclGroupEnd());
          write_back(out, dst);
        });
  }

  std::shared_ptr<Work> do_all_to_all_v(const Tensor& output, const Tensor& input,
                                        const std::vector<int64_t>& out_elems,
                                        const std::vector<int64_t>& in_elems) override {
    Tensor out = output.alias(), in = input.alias();
    detail::Signature sig = detail::make_uneven_signature("all_to_all_v", in);
    return launch("all_to_all_v", sig, {out, in}, [&](std::vector<Tensor>& keep) {
      Tensor src = out.shares_storage(in) ? in.clone() : in;
      keep.push_back(src);
      keep.push_back(out);
      const ncclDataType_t dt = nccl_dtype(in.dtype());
      const size_t es = in.element_size();
      size_t in_off = 0, out_off = 0;
      EMBER_NCCL_CHECK(ncclGroupStart());
      for (int r = 0; r < size_; ++r) {
        const size_t ni = static_cast<size_t>(in_elems[r]), no = static_cast<size_t>(out_elems[r]);
        if (ni) EMBER_NCCL_CHECK(ncclSend(static_cast<char*>(src.raw_data()) + in_off * es, ni, dt, r, comm_, stream_));
        if (no)
          EMBER_NCCL_CHECK(ncclRecv(static_cast<char*>(out.raw_data()) + out_off * es, no, dt, r, comm_, stream_));
        in_off += ni;
        out_off += no;
      }
      EMBER_NCCL_CHECK(ncclGroupEnd());
    });
  }

  // A one-element allreduce; wait() blocks the host, which makes it a barrier.
  std::shared_ptr<Work> do_barrier() override {
    Tensor b = barrier_buf_;
    return launch("barrier", detail::make_signature("barrier", nullptr, 0, -1, nullptr), {b},
                  [&](std::vector<Tensor>&) {
                    EMBER_NCCL_CHECK(ncclAllReduce(b.raw_data(), b.raw_data(), 1, ncclInt32, ncclSum, comm_, stream_));
                  });
  }

  // NCCL has no tags: sends and recvs between two ranks match in call
  // order, on the group's stream, or on the pair's own communicator and
  // stream once connect_p2p made one.
  bool p2p_in_order() const override { return true; }

  std::shared_ptr<Work> do_send(const Tensor& tensor, int dst, int /*tag*/) override {
    Tensor t = tensor.alias();
    const Edge* e = edge(rank_, dst);
    ncclComm_t comm = e ? e->comm : comm_;
    const int peer = e ? e->peer : dst;
    return launch_op(
        "send", false, "", {t},
        [&](std::vector<Tensor>& keep) {
          Tensor buf = dense(t);
          keep.push_back(buf);
          EMBER_NCCL_CHECK(ncclSend(buf.raw_data(), t.numel(), nccl_dtype(t.dtype()), peer, comm, current_stream()));
        },
        e);
  }

  std::shared_ptr<Work> do_recv(const Tensor& tensor, int src, int /*tag*/) override {
    Tensor t = tensor.alias();
    const Edge* e = edge(src, rank_);
    ncclComm_t comm = e ? e->comm : comm_;
    const int peer = e ? e->peer : src;
    return launch_op(
        "recv", false, "", {t},
        [&](std::vector<Tensor>& keep) {
          Tensor buf = t.is_contiguous() ? t : Tensor::empty(t.sizes(), t.options());
          keep.push_back(buf);
          EMBER_NCCL_CHECK(ncclRecv(buf.raw_data(), t.numel(), nccl_dtype(t.dtype()), peer, comm, current_stream()));
          write_back(t, buf);
        },
        e);
  }

  // One ncclCommSplit of the group's communicator per edge, in the list's
  // order on every rank (a split is collective over the group); the two
  // ranks of an edge get a 2-rank communicator (ranks in group order) and
  // a stream, the others nothing. An edge already connected is skipped
  // alike everywhere.
  void do_connect_p2p(const std::vector<std::pair<int, int>>& edges) override {
    std::lock_guard<std::mutex> launch_lock(launch_mu_);
    if (std::string b = broken(); !b.empty()) throw detail::unusable_group_error(group_label_ + ": connect_p2p", b);
    DeviceGuard g(device_);
    for (size_t i = 0; i < edges.size(); ++i) {
      const auto [src, dst] = edges[i];
      bool known = false;  // connected before, or listed twice
      {
        std::lock_guard<std::mutex> lock(mu_);
        known = connected_.count({src, dst}) != 0;
      }
      if (known) continue;
      const bool mine = rank_ == src || rank_ == dst;
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 1;
      ncclComm_t c = nullptr;
      EMBER_NCCL_CHECK(ncclCommSplit(comm_, mine ? static_cast<int>(i) : NCCL_SPLIT_NOCOLOR, rank_, &c, &config));
      std::lock_guard<std::mutex> lock(mu_);
      connected_.insert({src, dst});
      if (!mine) continue;
      const int other = rank_ == src ? dst : src;
      Edge e;
      e.comm = c;
      e.ref = std::make_shared<CommRef>(c);
      e.stream = new_stream(device_);
      e.peer = other > rank_ ? 1 : 0;
      edges_.emplace(std::make_pair(src, dst), std::move(e));
    }
  }

 private:
  using Enqueue = std::function<void(std::vector<Tensor>& keep)>;

  void check_tensor(const Tensor& t, const std::string& where, const char* name) const override {
    EMBER_CHECK(t.device().is_cuda(), where, ": ", name, " is on ", t.device(),
                "; the nccl backend handles CUDA tensors; use the gloo backend for CPU tensors");
    EMBER_CHECK(t.device().index == device_, where, ": ", name, " is on ", t.device(), " but this rank's group uses ",
                cuda_device(device_), " (LOCAL_RANK or rank modulo the GPU count)");
  }

  std::shared_ptr<Work> launch(const char* op, detail::Signature signature, std::vector<Tensor> keep,
                               const Enqueue& body) {
    return launch_op(op, true, std::move(signature), std::move(keep), body);
  }

  // A connected pair's communicator and stream (connect_p2p).
  struct Edge {
    ncclComm_t comm = nullptr;
    std::shared_ptr<CommRef> ref;
    std::shared_ptr<const Stream> stream;
    int peer = 0;  // the other rank in the pair's communicator
  };
  const Edge* edge(int src, int dst) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = edges_.find({src, dst});
    return it == edges_.end() ? nullptr : &it->second;
  }
  // The stream an op is being enqueued on (launch_op makes it current).
  cudaStream_t current_stream() const { return static_cast<cudaStream_t>(Stream::current(device_).handle); }

  // Runs on the calling thread: signature check, stream ordering, NCCL
  // enqueue, completion event; the watchdog takes it from there.
  std::shared_ptr<Work> launch_op(const char* op, bool collective, detail::Signature signature,
                                  std::vector<Tensor> keep, const Enqueue& body, const Edge* on = nullptr) {
    // launch_mu_ keeps launches (sequence numbers, stream order) in call
    // order; mu_ is taken only briefly, so the store round trips of the
    // signature check never stall the watchdog.
    std::lock_guard<std::mutex> launch_lock(launch_mu_);
    OpInfo info =
        detail::next_op_info(counters_, op, collective, "nccl", rank_, size_, options_.timeout, std::move(signature));
    // The host side of the op (signature check, enqueue on the stream); the
    // GPU's transfer time is Nsight's to show, under the same NVTX name.
    detail::CollectiveEvent prof(info, group_label_);
    // An asynchronous error the watchdog has not acted on yet breaks the
    // group now: an op queued behind it would not run.
    if (std::string a = (on ? on->ref : comm_ref_)->async_error(); !a.empty()) set_broken(a);
    if (std::string b = broken(); !b.empty()) {
      Error e = detail::unusable_group_error(info.describe(), b);
      fr::FlightRecorder::get().finished(info.fr_id, e.what());  // not left "scheduled"
      throw e;
    }
    const bool empty = std::all_of(keep.begin(), keep.end(), [](const Tensor& t) { return t.numel() == 0; });
    if (collective && options_.check_signatures) {
      // A mismatch (or a rank that never arrives) fails this op through its
      // Work, as in the Gloo group, and leaves the group unusable.
      try {
        detail::check_signature(*store_, info, detail::deadline_after(options_.timeout));
      } catch (const std::exception& e) {
        set_broken(e.what());
        auto failed = std::make_shared<CompletionWork>(std::move(info));
        failed->finish(std::make_exception_ptr(Error(e.what())));
        return failed;
      }
    }
    prof.transfer_started();

    DeviceGuard g(device_);
    const Stream comm = on ? *on->stream : Stream{device_, stream_};
    ready_event_->record(Stream::current(device_));
    ready_event_->block(comm);
    if (!empty) {
      StreamGuard sg(comm);
      try {
        body(keep);
      } catch (const std::exception& e) {
        // A failed enqueue leaves the communicator in an unknown state.
        std::string msg = info.describe() + " failed to launch: " + e.what();
        set_broken(msg);
        fr::FlightRecorder::get().finished(info.fr_id, msg);
        throw Error(msg);
      }
    }
    // Started = on the stream (no start event: the GPU's own start is
    // Nsight's to show, as torch without TORCH_NCCL_ENABLE_TIMING).
    fr::FlightRecorder::get().started(info.fr_id);
    auto done = std::make_unique<Event>(device_);
    done->record(comm);
    if (cuda_graph_capturing()) {
      // The graph's memory pool keeps the tensors; no watchdog (see the top).
      return std::make_shared<CapturedWork>(std::move(info), device_, std::move(done));
    }
    auto work = std::make_shared<NcclWork>(std::move(info), device_, on ? on->ref : comm_ref_, std::move(done),
                                           std::move(keep));
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(work);
    return work;
  }

  std::string broken() {
    std::lock_guard<std::mutex> lock(mu_);
    return broken_;
  }
  void set_broken(const std::string& msg) {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.empty()) broken_ = msg;
  }

  // The watchdog aborts the communicators as for an asynchronous error.
  void abort() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (abort_requested_.empty()) abort_requested_ = "the group was aborted (ProcessGroup::abort)";
    if (broken_.empty()) broken_ = abort_requested_;
  }

  void watchdog_loop() {
    cudaSetDevice(device_);
    for (;;) {
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_) return;
      // Completed ops leave the list (and drop their tensors).
      pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                    [](const std::shared_ptr<NcclWork>& w) { return w->poll(); }),
                     pending_.end());
      std::string failure;
      std::shared_ptr<NcclWork> culprit;
      if (!aborted_) {
        std::vector<CommRef*> comms{comm_ref_.get()};
        for (auto& [key, e] : edges_) comms.push_back(e.ref.get());
        for (CommRef* c : comms)
          if (failure.empty()) failure = c->async_error();
        for (auto& w : pending_) {
          if (!failure.empty()) break;
          auto ran = std::chrono::duration_cast<Millis>(PgClock::now() - w->start());
          if (ran > options_.timeout) {
            culprit = w;
            failure = ::ember::detail::str_cat(w->info().describe(), " timed out after ", ran.count(),
                                               " ms; the communicator was aborted (ncclCommAbort)");
          }
        }
      }
      if (!aborted_ && failure.empty() && !abort_requested_.empty()) failure = abort_requested_;
      if (!failure.empty()) {
        // Fail the waiters first: ncclCommAbort can take a while (it waits
        // for what it kills), and nobody should wait longer than the timeout.
        // The tensors are dropped only after the abort, when no kernel can
        // touch them any more.
        if (broken_.empty()) broken_ = failure;
        for (auto& w : pending_) {
          std::string msg = w == culprit ? failure : w->info().describe() + ": aborted: " + failure;
          w->finish(std::make_exception_ptr(Error(msg)));
        }
        comm_ref_->abort();
        for (auto& [key, e] : edges_) e.ref->abort();
        aborted_ = true;
        for (auto& w : pending_) w->release();
        pending_.clear();
      }
      if (pending_.empty()) drained_cv_.notify_all();
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(pending_poll_ms_));
    }
  }

  std::shared_ptr<Store> store_;
  ProcessGroupOptions options_;
  int device_ = 0;
  ncclComm_t comm_ = nullptr;
  std::shared_ptr<CommRef> comm_ref_;          // comm_ as its Works see it
  std::string abort_requested_;                // abort() was called (under mu_)
  std::shared_ptr<const Stream> comm_stream_;  // owns stream_
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<Event> ready_event_;
  Tensor barrier_buf_;

  std::mutex launch_mu_;  // held through a launch; sequence counters
  std::mutex mu_;         // pending_, broken_, aborted_, stop_
  std::condition_variable drained_cv_;
  std::vector<std::shared_ptr<NcclWork>> pending_;
  // connect_p2p's pairs: this rank's (by (src, dst), stable addresses: a
  // std::map's nodes do not move), and every pair split so far.
  std::map<std::pair<int, int>, Edge> edges_;
  std::set<std::pair<int, int>> connected_;
  detail::OpCounters counters_;
  std::string group_label_;  // names the group in profiler events
  std::string broken_;
  bool aborted_ = false;
  bool stop_ = false;
  static constexpr int pending_poll_ms_ = 20;
  std::thread watchdog_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_nccl_group(std::shared_ptr<Store> store, int rank, int size,
                                              ProcessGroupOptions options) {
  detail::check_group_args("make_nccl_group", store.get(), rank, size, options);
  return std::make_shared<NcclGroup>(std::move(store), rank, size, options);
}
#else
std::shared_ptr<ProcessGroup> make_nccl_group(std::shared_ptr<Store>, int, int, ProcessGroupOptions) {
  EMBER_CHECK(false,
              "make_nccl_group: the nccl backend needs CUDA, and ember was built without it (the CPU-only "
              "configuration); use the gloo backend");
  return nullptr;
}
#endif  // EMBER_WITH_CUDA

}  // namespace ember::distributed
