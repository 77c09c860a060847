// The Gloo process group: collectives on CPU tensors over TCP.
//
// One worker thread per group runs the queued operations in call order, so
// every rank issues Gloo's collectives in the same order with the same tags
// (Gloo matches messages by slot = op prefix + tag, and our tag is the
// collective's sequence number). Each operation gets a deadline of
// options.timeout from when it starts running; the signature check and the
// Gloo call share it, and Gloo's own timeout errors are translated into an
// ember::Error naming the op, its sequence number, the group and the timeout.
//
// Point-to-point ops are posted by the worker thread (so they stay ordered
// with the collectives around them) but waited for by a second thread: a
// Gloo send completes only once the peer has posted the matching recv, and
// two ranks that each send before they recv must not deadlock on one queue.
//
// After any failure the group is unusable (Gloo closes every connection of a
// context when one operation times out), and later operations fail at once
// with a message that names the first failure.
//
// Dead peers. Gloo notices a dead peer when a socket it reads or writes
// reports it, but not in every state: a send still waiting for a dead peer
// to post its receive waits out the whole timeout (the signature checks,
// now opt-in, used to find the dead rank first, at the store). So while an
// operation has run for over a second, a liveness thread asks the store
// four times a second whether a rank left the job without its goodbye
// since this group was made (even if a replacement took its place since:
// live recovery's replacement says hello within 0.2 s), or
// whether the store itself is gone with rank 0: not on the hot path, one
// store round trip per second of a long operation. If so it fails the
// operation at once, naming the rank, and the group is broken. Gloo itself
// still blocks until its timeout or until the connections close, so a group
// destroyed in that state closes them first and is freed once its threads
// return; one whose threads stay blocked past a grace period is left to
// them (a deliberate leak) instead of joining them for minutes.
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "core/tensor.h"
#include "distributed/comm/backends.h"
#include "distributed/comm/pg_common.h"
#include "distributed/store/store_internal.h"

namespace ember::distributed {
namespace {

using detail::CompletionWork;
using detail::OpInfo;
using detail::PgClock;
using GlooFn = std::function<void(void*, const void*, const void*, size_t)>;

// ---- Element-wise reductions handed to Gloo (which only moves bytes). ----
// 16-bit floats compute in float; bool is "any" for sum/max and "all" for
// product/min.
struct SumF {
  template <class A>
  static A apply(A a, A b) {
    if constexpr (std::is_same_v<A, bool>)
      return a || b;
    else
      return a + b;
  }
};
struct ProdF {
  template <class A>
  static A apply(A a, A b) {
    if constexpr (std::is_same_v<A, bool>)
      return a && b;
    else
      return a * b;
  }
};
struct MaxF {
  template <class A>
  static A apply(A a, A b) {
    return a < b ? b : a;
  }
};
struct MinF {
  template <class A>
  static A apply(A a, A b) {
    return b < a ? b : a;
  }
};

template <typename T, typename F>
void reduce_loop(void* c, const void* a, const void* b, size_t n) {
  using A = acc_t<T>;
  T* out = static_cast<T*>(c);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<T>(F::apply(static_cast<A>(x[i]), static_cast<A>(y[i])));
}

GlooFn reduce_fn(DType dtype, ReduceOp op) {
  GlooFn fn;
  EMBER_DISPATCH_ALL(dtype, "gloo reduce", [&] {
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg:
        fn = &reduce_loop<scalar_t, SumF>;
        break;
      case ReduceOp::Product:
        fn = &reduce_loop<scalar_t, ProdF>;
        break;
      case ReduceOp::Max:
        fn = &reduce_loop<scalar_t, MaxF>;
        break;
      case ReduceOp::Min:
        fn = &reduce_loop<scalar_t, MinF>;
        break;
    }
  });
  return fn;
}

// Avg = sum, then this. Integers divide with truncation (as NCCL's ncclAvg).
void divide_by(const Tensor& t, int size) {
  EMBER_DISPATCH_ALL(t.dtype(), "gloo avg", [&] {
    using A = acc_t<scalar_t>;
    scalar_t* p = static_cast<scalar_t*>(t.raw_data());
    const int64_t n = t.numel();
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<scalar_t>(static_cast<A>(p[i]) / static_cast<A>(size));
  });
}

// Gloo sizes its work in elements of sizeof(T); any type of the right width
// will do since our reduce_fn knows the real one.
template <typename F>
void with_word(size_t element_size, F&& f) {
  switch (element_size) {
    case 1:
      f(uint8_t{});
      break;
    case 2:
      f(uint16_t{});
      break;
    case 4:
      f(uint32_t{});
      break;
    case 8:
      f(uint64_t{});
      break;
    default:
      EMBER_INTERNAL_ASSERT(false, "element size ", element_size);
  }
}

// Contiguous tensors are used in place; others go through a dense copy
// (read when the op runs, written back after it).
Tensor dense(const Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }
void write_back(const Tensor& dst, const Tensor& buf) {
  if (buf.is_same(dst)) return;
  Tensor d = dst;
  d.copy_(buf);
}

Millis left(PgClock::time_point deadline) {
  auto l = std::chrono::duration_cast<Millis>(deadline - PgClock::now());
  return std::max(l, Millis{1});
}

// Gloo waits with wait_for(timeout); a "forever" Millis::max() would overflow.
Millis capped(Millis t) { return std::min(t, Millis{365LL * 24 * 3600 * 1000}); }

uint32_t tag_of(const OpInfo& info) { return static_cast<uint32_t>(info.seq); }
// Our own slot spaces, above Gloo's prefixes (0x01..0x08 in the top byte).
uint64_t reduce_scatter_slot(int64_t seq, int step) {
  return (0xE0ull << 56) | ((static_cast<uint64_t>(seq) & 0xffffffffull) << 20) |
         (static_cast<uint64_t>(step) & 0xfffff);
}
uint64_t p2p_slot(int tag) { return (0xE1ull << 56) | static_cast<uint32_t>(tag); }

// The address peers reach this process at: GLOO_SOCKET_IFNAME (as torch)
// picks an interface; EMBER_GLOO_HOSTNAME a name; otherwise the hostname
// when it resolves to an address we can bind, else loopback (single node).
std::shared_ptr<gloo::transport::Device> make_device() {
  gloo::transport::tcp::attr attr;
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    attr.iface = ifname;
    return gloo::transport::tcp::CreateDevice(attr);
  }
  if (const char* host = std::getenv("EMBER_GLOO_HOSTNAME"); host && *host) {
    attr.hostname = host;
    return gloo::transport::tcp::CreateDevice(attr);
  }
  attr.hostname = "127.0.0.1";
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) == 0 && name[0]) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (getaddrinfo(name, nullptr, &hints, &res) == 0) {
      bool bindable = false;
      for (addrinfo* p = res; p && !bindable; p = p->ai_next) {
        int fd = socket(p->ai_family, p->ai_socktype, p->ai_protocol);
        if (fd < 0) continue;
        bindable = bind(fd, p->ai_addr, p->ai_addrlen) == 0;
        close(fd);
      }
      freeaddrinfo(res);
      if (bindable) attr.hostname = name;
    }
  }
  return gloo::transport::tcp::CreateDevice(attr);
}

// Gloo writes to its sockets with writev(2), which raises SIGPIPE when the
// peer is gone, and SIGPIPE's default action kills the process: a dead peer
// would take every other rank down with it instead of failing their ops
// with an error. Python ignores SIGPIPE at startup, which is why this never
// shows under torch; a C++ program must do it itself. A handler the program
// installed is left alone.
void ignore_sigpipe_unless_handled() {
  struct sigaction old {};
  if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL && !(old.sa_flags & SA_SIGINFO))
    signal(SIGPIPE, SIG_IGN);
}

class GlooGroup : public ProcessGroup {
 public:
  GlooGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options)
      : ProcessGroup(rank, size), store_(std::move(store)), options_(options) {
    static std::atomic<int> groups{0};  // creation order: the same on every rank that makes the same groups
    group_label_ = "gloo group " + std::to_string(groups.fetch_add(1)) + ", rank " + std::to_string(rank) + " of " +
                   std::to_string(size);
    options_.check_signatures = detail::signature_checks_enabled(options);
    if (size > 1) {
      ignore_sigpipe_unless_handled();
      try {
        device_ = make_device();
        context_ = std::make_shared<gloo::rendezvous::Context>(rank, size);
        context_->setTimeout(capped(options_.timeout));
        auto gloo_store = make_gloo_store(std::make_shared<PrefixStore>("gloo", store_));
        context_->connectFullMesh(*gloo_store, device_);
        // Born once connected: a rank lost (and replaced) while the group
        // formed is not one of its peers.
        born_ = PgClock::now();
      } catch (const std::exception& e) {
        throw Error(::ember::detail::str_cat("make_gloo_group: rank ", rank, " of ", size,
                                             " could not connect to its peers within ", options_.timeout.count(),
                                             " ms: ", e.what()));
      }
    }
    worker_ = std::thread([this] { worker_loop(); });
    p2p_send_thread_ = std::thread([this] { p2p_loop(true); });
    p2p_recv_thread_ = std::thread([this] { p2p_loop(false); });
    if (context_) liveness_ = std::thread([this] { liveness_loop(); });
  }

  // Connections closed: a peer blocked on us fails now (its socket reports
  // the close); ours fail too, and the threads are left to end by
  // themselves (an operation blocked in Gloo may still wait out its
  // deadline), as for a group abandoned on a dead peer.
  void abort() override {
    mark_broken(std::make_exception_ptr(Error("the group was aborted (ProcessGroup::abort)")));
    aborted_.store(true);
    if (context_) context_->closeConnections();
  }

  // The deleter make_gloo_group gives its shared_ptr (see "Dead peers").
  // An aborted group, or one failed by the liveness check while Gloo still
  // blocks, has its connections closed, which fails whatever Gloo blocks
  // in: its threads are normally idle within milliseconds, and it is freed
  // like any other (threads joined, sockets closed: live recovery makes a
  // set of groups per recovery). Only one whose threads are still blocked
  // after a grace period is left to them.
  static void destroy(GlooGroup* g) {
    if (g->aborted_.load() || (g->abandoned_.load() && g->running_since_.load() != 0)) {
      if (!g->aborted_.exchange(true) && g->context_) g->context_->closeConnections();
      if (!g->settles(std::chrono::seconds(2))) {
        g->abandon();
        return;
      }
    }
    delete g;
  }

  // Whether no operation runs in the worker or the p2p threads within `grace`.
  bool settles(Millis grace) {
    const auto until = PgClock::now() + grace;
    for (;;) {
      bool queued = false;
      {
        std::lock_guard<std::mutex> lock(p2p_mu_);
        queued = !p2p_sends_.empty() || !p2p_recvs_.empty();
      }
      if (running_since_.load() == 0 && p2p_busy_.load() == 0 && !queued) return true;
      if (PgClock::now() >= until) return false;
      std::this_thread::sleep_for(Millis{5});
    }
  }

  ~GlooGroup() override {
    // Drain: queued operations still run (each bounded by its timeout, or
    // failing at once if the group is broken), then the threads exit.
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
    {
      std::lock_guard<std::mutex> lock(p2p_mu_);
      p2p_stop_ = true;
    }
    p2p_cv_.notify_all();
    p2p_send_thread_.join();
    p2p_recv_thread_.join();
    stop_liveness();
  }

  std::string backend_name() const override { return "gloo"; }
  Device device() const override { return kCPU; }

 protected:
  void check_tensor(const Tensor& t, const std::string& where, const char* name) const override {
    EMBER_CHECK(t.device().is_cpu(), where, ": ", name, " is on ", t.device(),
                "; gloo handles CPU tensors; use the nccl backend for CUDA tensors");
  }

  std::shared_ptr<Work> do_allreduce(const Tensor& tensor, ReduceOp op) override {
    Tensor t = tensor.alias();
    return enqueue("allreduce", true, detail::make_signature("allreduce", &t, t.numel(), -1, &op),
                   [this, t, op](const std::shared_ptr<CompletionWork>& work, PgClock::time_point deadline) {
                     if (t.numel() == 0 || size_ == 1) return true;
                     Tensor buf = dense(t);
                     gloo::AllreduceOptions o(context_);
                     o.setTag(tag_of(work->info()));
                     o.setTimeout(left(deadline));
                     with_word(t.element_size(), [&](auto word) {
                       using W = decltype(word);
                       o.setOutput<W>(static_cast<W*>(buf.raw_data()), static_cast<size_t>(t.numel()));
                     });
                     o.setReduceFunction(reduce_fn(t.dtype(), op));
                     gloo::allreduce(o);
                     if (op == ReduceOp::Avg) divide_by(buf, size_);
                     write_back(t, buf);
                     return true;
                   });
  }

  std::shared_ptr<Work> do_broadcast(const Tensor& tensor, int root) override {
    Tensor t = tensor.alias();
    return enqueue("broadcast", true, detail::make_signature("broadcast", &t, t.numel(), root, nullptr),
                   [this, t, root](const std::shared_ptr<CompletionWork>& work, PgClock::time_point deadline) {
                     if (t.numel() == 0 || size_ == 1) return true;
                     Tensor buf = dense(t);
                     gloo::BroadcastOptions o(context_);
                     o.setTag(tag_of(work->info()));
                     o.setTimeout(left(deadline));
                     o.setRoot(root);
                     with_word(t.element_size(), [&](auto word) {
                       using W = decltype(word);
                       o.setOutput<W>(static_cast<W*>(buf.raw_data()), static_cast<size_t>(t.numel()));
                     });
                     gloo::broadcast(o);
                     if (rank_ != root) write_back(t, buf);
                     return true;
                   });
  }

  std::shared_ptr<Work> do_reduce(const Tensor& tensor, int root, ReduceOp op) override {
    Tensor t = tensor.alias();
    return enqueue("reduce", true, detail::make_signature("reduce", &t, t.numel(), root, &op),
                   [this, t, root, op](const std::shared_ptr<CompletionWork>& work, PgClock::time_point deadline) {
                     if (t.numel() == 0 || size_ == 1) return true;
                     // Gloo's ring writes partial sums into the output on every
                     // rank; non-roots reduce into scratch so their tensor is
                     // left as it was.
                     Tensor in = dense(t);
                     Tensor out = rank_ == root ? in : Tensor::empty({t.numel()}, t.dtype());
                     gloo::ReduceOptions o(context_);
                     o.setTag(tag_of(work->info()));
                     o.setTimeout(left(deadline));
                     o.setRoot(root);
                     with_word(t.element_size(), [&](auto word) {
                       using W = decltype(word);
                       const size_t n = static_cast<size_t>(t.numel());
                       if (!out.is_same(in)) o.setInput<W>(static_cast<W*>(in.raw_data()), n);
                       o.setOutput<W>(static_cast<W*>(out.raw_data()), n);
                     });
                     o.setReduceFunction(reduce_fn(t.dtype(), op));
                     gloo::reduce(o);
                     if (rank_ == root) {
                       if (op == ReduceOp::Avg) divide_by(out, size_);
                       write_back(t, out);
                     }
                     return true;
                   });
  }

  std::shared_ptr<Work> do_allgather(const std::vector<Tensor>& outputs, const Tensor& input) override {
    std::vector<Tensor> outs;
    for (const Tensor& o : outputs) outs.push_back(o.alias());
    Tensor in = input.alias();
    return enqueue("allgather", true, detail::make_signature("allgather", &in, in.numel(), -1, nullptr),
                   [this, outs, in](const std::shared_ptr<CompletionWork>& work, PgClock::time_point deadline) {
                     const int64_t n = in.numel();
                     if (n == 0) return true;
                     Tensor flat = Tensor::empty({size_ * n}, in.dtype());
                     gather_flat(flat, in, work->info(), deadline);
                     for (int r = 0; r < size_; ++r) {
                       Tensor dst = outs[r];
                       dst.copy_(flat.narrow(0, r * n, n).view(outs[r].sizes()));
                     }
                     return true;
                   });
  }

  std::shared_ptr<Work> do_allgather_into_tensor(const Tensor& output, const Tensor& input) override {
    Tensor out = output.alias(), in = input.alias();
    return enqueue("allgather_into_tensor", true,
                   detail::make_signature("allgather_into_tensor", &in, in.numel(), -1, nullptr),
                   [this, out, in](const std::shared_ptr<CompletionWork>& work, PgClock::time_point deadline) {
                     if (in.numel() == 0) return true;
                     Tensor flat = out.is_contiguous() ? out : Tensor::empty({out.numel()}, out.dtype());
                     gather_flat(flat, in, work->info(), deadline);
                     write_back(out, flat.is_same(out) ? out : flat.view(out.sizes()));
                     return true;
                   });
  }

  std::shared_ptr<Work> do_reduce_scatter_tensor(const Tensor& output, const Tensor& input, ReduceOp op,
                                                 bool consume_input) override {
    Tensor out = output.alias(), in = input.alias();
    return enqueue(
        "reduce_scatter_tensor", true, detail::make_signature("reduce_scatter_tensor", &in, in.numel(), -1, &op),
        [this, out, in, op, consume_input](const std::shared_ptr<CompletionWork>& work, PgClock::time_point deadline) {
          if (out.numel() == 0) return true;
          ring_reduce_scatter(out, in, op, consume_input, work->info(), deadline);
          return true;
        });
  }

  std::shared_ptr<Work> do_all_to_all_single(const Tensor& output, const Tensor& input) override {
    Tensor out = output.alias(), in = input.alias();
    return enqueue("all_to_all_single", true, detail::make_signature("all_to_all_single", &in, in.numel(), -1, nullptr),
                   [this, out, in](const std::shared_ptr<CompletionWork>& work, PgClock::time_point deadline) {
                     if (in.numel() == 0) return true;
                     // Gloo reads the input while writing the output: they must not overlap.
                     Tensor src = out.shares_storage(in) ? in.contiguous().clone() : dense(in);
                     Tensor dst = out.is_contiguous() ? out : Tensor::empty(out.sizes(), out.dtype());
                     if (size_ == 1) {
                       std::memcpy(dst.raw_data(), src.raw_data(), src.nbytes());
                     } else {
                       gloo::AlltoallOptions o(context_);
                       o.setTag(tag_of(work->info()));
                       o.setTimeout(left(deadline));
                       with_word(in.element_size(), [&](auto word) {
                         using W = decltype(word);
                         const size_t n = static_cast<size_t>(in.numel());
                         o.setInput<W>(static_cast<W*>(src.raw_data()), n);
                         o.setOutput<W>(static_cast<W*>(dst.raw_data()), n);
                       });
                       gloo::alltoall(o);
                     }
                     write_back(out, dst);
                     return true;
                   });
  }

  std::shared_ptr<Work> do_all_to_all_v(const Tensor& output, const Tensor& input,
                                        const std::vector<int64_t>& out_elems,
                                        const std::vector<int64_t>& in_elems) override {
    Tensor out = output.alias(), in = input.alias();
    detail::Signature sig = detail::make_uneven_signature("all_to_all_v", in);
    return enqueue("all_to_all_v", true, sig,
                   [this, out, in, out_elems, in_elems](const std::shared_ptr<CompletionWork>& work,
                                                        PgClock::time_point deadline) {
                     Tensor src = out.shares_storage(in) ? in.clone() : in;
                     if (size_ == 1) {
                       if (src.numel()) std::memcpy(out.raw_data(), src.raw_data(), src.nbytes());
                       return true;
                     }
                     // Gloo wants a buffer even where this rank sends or receives nothing.
                     Tensor in_buf = src.numel() ? src : Tensor::empty({1}, in.dtype());
                     Tensor out_buf = out.numel() ? out : Tensor::empty({1}, out.dtype());
                     gloo::AlltoallvOptions o(context_);
                     o.setTag(tag_of(work->info()));
                     o.setTimeout(left(deadline));
                     with_word(in.element_size(), [&](auto word) {
                       using W = decltype(word);
                       o.setInput<W>(static_cast<W*>(in_buf.raw_data()), in_elems);
                       o.setOutput<W>(static_cast<W*>(out_buf.raw_data()), out_elems);
                     });
                     gloo::alltoallv(o);
                     return true;
                   });
  }

  std::shared_ptr<Work> do_barrier() override {
    return enqueue("barrier", true, detail::make_signature("barrier", nullptr, 0, -1, nullptr),
                   [this](const std::shared_ptr<CompletionWork>& work, PgClock::time_point deadline) {
                     if (size_ == 1) return true;
                     gloo::BarrierOptions o(context_);
                     o.setTag(tag_of(work->info()));
                     o.setTimeout(left(deadline));
                     gloo::barrier(o);
                     return true;
                   });
  }

  std::shared_ptr<Work> do_send(const Tensor& tensor, int dst, int tag) override {
    Tensor t = tensor.alias();
    return enqueue(
        "send", false, "",
        [this, t, dst, tag](const std::shared_ptr<CompletionWork>& work, PgClock::time_point deadline) {
          if (t.numel() == 0) return true;
          Tensor buf = dense(t);
          Pending p{work, context_->createUnboundBuffer(buf.raw_data(), buf.nbytes()), true, deadline, buf, Tensor()};
          p.buffer->send(dst, p2p_slot(tag));
          hand_to_p2p(std::move(p));
          return false;
        });
  }

  std::shared_ptr<Work> do_recv(const Tensor& tensor, int src, int tag) override {
    Tensor t = tensor.alias();
    return enqueue("recv", false, "",
                   [this, t, src, tag](const std::shared_ptr<CompletionWork>& work, PgClock::time_point deadline) {
                     if (t.numel() == 0) return true;
                     Tensor buf = t.is_contiguous() ? t : Tensor::empty(t.sizes(), t.dtype());
                     Pending p{work, context_->createUnboundBuffer(buf.raw_data(), buf.nbytes()), false, deadline, buf,
                               t};
                     p.buffer->recv(src, p2p_slot(tag));
                     hand_to_p2p(std::move(p));
                     return false;
                   });
  }

 private:
  // Runs on the worker thread; returns true when the op is complete, false
  // when it was handed to the p2p thread.
  using Body = std::function<bool(const std::shared_ptr<CompletionWork>&, PgClock::time_point deadline)>;
  struct Queued {
    std::shared_ptr<CompletionWork> work;
    Body body;
  };
  struct Pending {
    std::shared_ptr<CompletionWork> work;
    std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
    bool is_send;
    PgClock::time_point deadline;
    Tensor buf;     // the memory Gloo reads or writes
    Tensor target;  // recv into a non-contiguous tensor: copied from buf at the end
  };

  std::shared_ptr<Work> enqueue(const char* op, bool collective, detail::Signature signature, Body body) {
    std::lock_guard<std::mutex> lock(mu_);
    OpInfo info =
        detail::next_op_info(counters_, op, collective, "gloo", rank_, size_, options_.timeout, std::move(signature));
    // The op waits in the queue for the worker thread: the profiler's
    // queued time counts from here.
    info.enqueued = PgClock::now();
    auto work = std::make_shared<CompletionWork>(std::move(info));
    queue_.push_back({work, std::move(body)});
    cv_.notify_one();
    return work;
  }

  void worker_loop() {
    profiler::set_thread_name("gloo worker (" + group_label_ + ")");
    for (;;) {
      Queued q;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        q = std::move(queue_.front());
        queue_.pop_front();
      }
      run(q);
    }
  }

  void run(Queued& q) {
    const OpInfo& info = q.work->info();
    const auto start = PgClock::now();
    const auto deadline = detail::deadline_after(options_.timeout);
    {
      std::lock_guard<std::mutex> lock(running_mu_);
      running_ = q.work;
      running_since_.store(start.time_since_epoch().count());
    }
    try {
      detail::CollectiveEvent prof(info, group_label_);
      fr::FlightRecorder::get().started(info.fr_id);
      throw_if_broken(info);
      if (info.collective && options_.check_signatures) detail::check_signature(*store_, info, deadline);
      prof.transfer_started();
      const bool done = q.body(q.work, deadline);
      prof.end();  // before finish(): the waiter it wakes may stop the profiler and read the events
      // The tensors the body holds go back before the waiter wakes: a caller
      // that drops its buffer after wait() (FSDP's full-size gradients) and
      // allocates the next one must not find this one still alive here.
      q.body = nullptr;
      if (done) q.work->finish();
    } catch (...) {
      q.body = nullptr;
      fail(q.work, std::current_exception(), start);
    }
    std::lock_guard<std::mutex> lock(running_mu_);
    running_.reset();
    running_since_.store(0);
  }

  // See "Dead peers" at the top.
  void liveness_loop() {
    std::unique_lock<std::mutex> lock(live_mu_);
    while (!live_stop_) {
      live_cv_.wait_for(lock, std::chrono::milliseconds(250));
      if (live_stop_) return;
      const int64_t since = running_since_.load();
      const auto started = PgClock::time_point(PgClock::duration(since));
      if (since == 0 || PgClock::now() - started < std::chrono::seconds(1)) continue;
      lock.unlock();
      std::vector<LostRank> lost;
      std::string store_error;
      try {
        // Since this group was made: a peer's replacement may have said
        // hello already (live recovery), which takes it off lost_ranks().
        lost = store_->lost_ranks_since(std::chrono::duration_cast<Millis>(PgClock::now() - born_));
      } catch (const std::exception& e) {
        store_error = e.what();
      }
      lock.lock();
      if (lost.empty() && store_error.empty()) continue;
      std::shared_ptr<CompletionWork> work;
      {
        std::lock_guard<std::mutex> rl(running_mu_);
        if (running_since_.load() == since) work = running_;
      }
      if (!work) continue;  // that operation ended meanwhile; look again
      auto elapsed = std::chrono::duration_cast<Millis>(PgClock::now() - started);
      std::exception_ptr err = detail::op_error(
          work->info(),
          std::make_exception_ptr(Error("a peer's connection closed while Gloo still waited on it (found by the "
                                        "liveness check)")),
          elapsed, lost, store_error);
      mark_broken(err);
      abandoned_.store(true);
      work->finish(err);
      return;  // the group is finished
    }
  }

  void stop_liveness() {
    if (!liveness_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(live_mu_);
      live_stop_ = true;
    }
    live_cv_.notify_all();
    liveness_.join();
  }

  // A group whose worker is still blocked in Gloo on a dead peer: stop what
  // can stop, detach the threads and leave this object to them.
  void abandon() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    {
      std::lock_guard<std::mutex> lock(p2p_mu_);
      p2p_stop_ = true;
    }
    p2p_cv_.notify_all();
    stop_liveness();
    worker_.detach();
    p2p_send_thread_.detach();
    p2p_recv_thread_.detach();
  }

  void fail(const std::shared_ptr<CompletionWork>& work, std::exception_ptr cause, PgClock::time_point start) {
    auto elapsed = std::chrono::duration_cast<Millis>(PgClock::now() - start);
    // A broken connection usually means a dead peer; the store can say which
    // (asked once, for the first failure: later ones repeat its message).
    std::vector<LostRank> lost;
    bool first;
    {
      std::lock_guard<std::mutex> lock(broken_mu_);
      first = broken_.empty();
    }
    std::string store_error;
    if (first && detail::is_connection_loss(cause))
      lost = detail::lost_ranks_within(*store_, Millis{1000}, &store_error, born_);
    std::exception_ptr err = detail::op_error(work->info(), cause, elapsed, lost, store_error);
    mark_broken(err);
    work->finish(err);
  }

  // Records the group's first failure; later operations fail naming it.
  void mark_broken(std::exception_ptr err) {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (!broken_.empty()) return;
    try {
      std::rethrow_exception(err);
    } catch (const std::exception& e) {
      broken_ = e.what();
    }
  }

  void throw_if_broken(const OpInfo& info) {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (!broken_.empty()) throw detail::unusable_group_error(info.describe(), broken_);
  }

  // Allgather `in` into the contiguous `flat` (size * numel elements).
  void gather_flat(const Tensor& flat, const Tensor& in, const OpInfo& info, PgClock::time_point deadline) {
    const size_t block = in.nbytes();
    char* base = static_cast<char*>(flat.raw_data());
    if (size_ == 1) {
      write_back(flat.view(in.sizes()), in.is_contiguous() ? in : in.contiguous());
      return;
    }
    // Gloo copies the input into the output's own block first; the input
    // may be exactly that block (in place), but any other overlap needs a copy.
    const bool in_place = in.is_contiguous() && in.raw_data() == base + rank_ * block;
    Tensor src = in_place ? in : (in.shares_storage(flat) ? in.contiguous().clone() : dense(in));
    gloo::AllgatherOptions o(context_);
    o.setTag(tag_of(info));
    o.setTimeout(left(deadline));
    with_word(in.element_size(), [&](auto word) {
      using W = decltype(word);
      const size_t n = static_cast<size_t>(in.numel());
      if (!in_place) o.setInput<W>(static_cast<W*>(src.raw_data()), n);
      o.setOutput<W>(reinterpret_cast<W*>(base), n * size_);
    });
    gloo::allgather(o);
  }

  // Gloo's ReduceScatterHalvingDoubling is the old bound-buffer API (int
  // counts, no per-op timeout), so reduce-scatter is a ring of our own over
  // Gloo's unbound buffers: n-1 steps, each sending one block to the right
  // neighbour while receiving one from the left and reducing it in; rank r
  // ends with block r reduced over all ranks. Each rank moves (n-1)/n of
  // the input, half of what an allreduce would.
  void ring_reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, bool consume_input, const OpInfo& info,
                           PgClock::time_point deadline) {
    const int64_t m = out.numel();
    const size_t es = in.element_size();
    const size_t block = static_cast<size_t>(m) * es;
    // The ring reduces in place: in a private copy, unless the caller gave
    // the input up (a contiguous one is then the work buffer itself).
    Tensor work;
    if (consume_input && in.is_contiguous()) {
      work = in.reshape({in.numel()});
    } else {
      work = Tensor::empty({in.numel()}, in.dtype());
      write_back(work.view(in.sizes()), in);
    }
    char* w = static_cast<char*>(work.raw_data());
    if (size_ > 1 && block > 0) {
      // Each step's block travels in pieces of at most kGlooRingPieceBytes, so
      // the receive buffer is one piece, not one block: FSDP reduce-scatters
      // a unit's whole gradient, and a block-sized buffer was half a unit
      // more at the backward's peak. Pieces of a step share its slot and
      // arrive in order (one sender, one receiver, each waited).
      const int64_t piece_elems = std::min<int64_t>(m, std::max<int64_t>(1, kGlooRingPieceBytes / es));
      const size_t piece = static_cast<size_t>(piece_elems) * es;
      Tensor tmp = Tensor::empty({piece_elems}, in.dtype());
      auto wbuf = context_->createUnboundBuffer(w, work.nbytes());
      auto tbuf = context_->createUnboundBuffer(tmp.raw_data(), tmp.nbytes());
      GlooFn fn = reduce_fn(in.dtype(), op);
      const int right = (rank_ + 1) % size_, left_rank = (rank_ + size_ - 1) % size_;
      for (int s = 0; s < size_ - 1; ++s) {
        const int send_block = ((rank_ - 1 - s) % size_ + size_) % size_;
        const int recv_block = ((rank_ - 2 - s) % size_ + size_) % size_;
        const uint64_t slot = reduce_scatter_slot(info.seq, s);
        for (size_t off = 0; off < block; off += piece) {
          const size_t len = std::min(piece, block - off);
          tbuf->recv(left_rank, slot, 0, len);
          wbuf->send(right, slot, send_block * block + off, len);
          tbuf->waitRecv(left(deadline));
          char* acc = w + recv_block * block + off;
          fn(acc, acc, tmp.raw_data(), len / es);
          wbuf->waitSend(left(deadline));
        }
      }
    }
    Tensor mine = work.narrow(0, rank_ * m, m);
    if (op == ReduceOp::Avg) divide_by(mine, size_);
    write_back(out, mine.view(out.sizes()));
  }

  void hand_to_p2p(Pending p) {
    {
      std::lock_guard<std::mutex> lock(p2p_mu_);
      (p.is_send ? p2p_sends_ : p2p_recvs_).push_back(std::move(p));
    }
    p2p_cv_.notify_all();
  }

  // Waits for posted sends (or receives) in the order they were posted.
  // Sends and receives complete on threads of their own: a receive must not
  // wait behind an earlier send, which completes only once the peer posts
  // its receive — a pipeline stage that sent an activation and now waits
  // for a gradient would otherwise wait on its peer's progress, which may
  // itself wait on this receive (a deadlock no schedule could rule out).
  void p2p_loop(bool sends) {
    std::deque<Pending>& queue = sends ? p2p_sends_ : p2p_recvs_;
    for (;;) {
      Pending p;
      {
        std::unique_lock<std::mutex> lock(p2p_mu_);
        p2p_cv_.wait(lock, [&] { return p2p_stop_ || !queue.empty(); });
        if (queue.empty()) return;
        p = std::move(queue.front());
        queue.pop_front();
        p2p_busy_.fetch_add(1);
      }
      const auto start = p.deadline - capped(options_.timeout);
      try {
        if (p.is_send) {
          p.buffer->waitSend(left(p.deadline));
        } else {
          p.buffer->waitRecv(left(p.deadline));
          if (p.target.defined()) write_back(p.target, p.buf);
        }
        p.work->finish();
      } catch (...) {
        fail(p.work, std::current_exception(), start);
      }
      p2p_busy_.fetch_sub(1);
    }
  }

  std::shared_ptr<Store> store_;
  ProcessGroupOptions options_;
  std::string group_label_;  // names the group in profiler events
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::atomic<bool> aborted_{false};  // abort(): never joined, see destroy

  std::mutex mu_;  // queue_, stop_, sequence counters
  std::condition_variable cv_;
  std::deque<Queued> queue_;
  bool stop_ = false;
  detail::OpCounters counters_;

  std::mutex broken_mu_;
  std::string broken_;  // the first failure's message; empty while healthy

  std::mutex p2p_mu_;
  std::condition_variable p2p_cv_;
  std::deque<Pending> p2p_sends_, p2p_recvs_;
  bool p2p_stop_ = false;
  std::atomic<int> p2p_busy_{0};  // transfers a p2p thread is waiting on

  std::thread worker_, p2p_send_thread_, p2p_recv_thread_;

  // The running operation and its start (steady clock ticks; 0 when idle).
  std::mutex running_mu_;
  std::shared_ptr<CompletionWork> running_;
  std::atomic<int64_t> running_since_{0};
  std::mutex live_mu_;
  std::condition_variable live_cv_;
  bool live_stop_ = false;
  PgClock::time_point born_ = PgClock::now();  // losses before it are not this group's (lost_ranks_since)
  std::thread liveness_;
  std::atomic<bool> abandoned_{false};  // the liveness check failed an operation Gloo still blocks in
};

}  // namespace

std::shared_ptr<ProcessGroup> make_gloo_group(std::shared_ptr<Store> store, int rank, int size,
                                              ProcessGroupOptions options) {
  detail::check_group_args("make_gloo_group", store.get(), rank, size, options);
  return std::shared_ptr<GlooGroup>(new GlooGroup(std::move(store), rank, size, options), &GlooGroup::destroy);
}

}  // namespace ember::distributed
