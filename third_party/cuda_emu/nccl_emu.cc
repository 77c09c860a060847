// nccl_emu.cc: the NCCL calls ember makes, for the emulated tests: a
// communicator spans processes on this machine, and each collective or
// point-to-point transfer runs as work on the caller's stream, in stream
// order, as NCCL's kernels do. It is our code, not NCCL's.
//
// Transport. ncclGetUniqueId starts a hub in its process (a thread on a
// loopback TCP port that the id carries). Every rank of a communicator made
// from that id, or split from one, connects to it twice: a data connection
// that the stream work uses, and a control connection for the blocking host
// call (ncclCommSplit), so a split never waits behind a collective that is
// itself waiting for a peer. The hub gathers a
// collective's contributions, checks that every rank called the same one
// (kind, count, type, operation, root: NCCL would hang or corrupt memory),
// reduces them in rank order (16-bit and 8-bit floats through float,
// rounded to their type after each rank) and answers each rank its part.
// Sends are held at the hub until their receive takes them, in call order
// per pair.
//
// Order. A communicator numbers its collectives when they run, not when they
// are called, so a captured graph that replays a collective meets its
// peers' next one. A process runs one piece of stream work at a time (the
// emulator's rule), so a collective waiting for its peers holds the emulated
// device until they arrive: two ranks calling collectives of two
// communicators in opposite orders, which NCCL allows on different streams,
// wait for each other for ever here.
//
// Failures. A rank whose connection closes (its process died, or it called
// ncclCommAbort or ncclCommDestroy) fails every collective of that
// communicator that still needs it: the waiting ranks' work returns without
// writing its output, and ncclCommGetAsyncError answers ncclRemoteError,
// with ncclGetLastError naming the rank, as NCCL reports a peer's failure.
// Mismatched calls answer ncclInvalidUsage the same way.
#include <arpa/inet.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "third_party/cuda_emu/emu_runtime.h"

namespace emu_nccl {
namespace {

constexpr char kMagic[16] = "ember-nccl-emu";
struct IdBody {
  char magic[16];
  uint16_t port;
};
static_assert(sizeof(IdBody) <= NCCL_UNIQUE_ID_BYTES);

enum Kind : uint32_t { kHello = 1, kColl, kSend, kRecv, kSplit };
enum Coll : uint32_t { kAllReduce = 1, kBroadcast, kReduce, kAllGather, kReduceScatter };
const char* coll_name(uint32_t c) {
  static const char* names[] = {"?",          "ncclAllReduce", "ncclBroadcast",
                                "ncclReduce", "ncclAllGather", "ncclReduceScatter"};
  return c <= kReduceScatter ? names[c] : "?";
}

// One request; the same binary runs every rank, so plain bytes suffice.
struct Hdr {
  uint32_t kind = 0, coll = 0;
  uint64_t comm = 0;
  int64_t rank = 0, nranks = 0;
  uint64_t count = 0, dtype = 0, op = 0;
  int64_t root = 0, peer = 0, color = 0, key = 0;
  uint64_t bytes = 0;  // payload after the header
};
// The answer: a result, the split's new communicator, and a payload (the
// output, or the error's text).
struct Reply {
  int32_t result = ncclSuccess;
  uint32_t pad = 0;
  uint64_t comm = 0;
  int64_t rank = 0, nranks = 0;
  uint64_t bytes = 0;
};

bool write_all(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t k = ::send(fd, c, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    c += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}
bool read_all(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t k = ::recv(fd, c, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    c += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}
bool reply(int fd, Reply r, const std::string& payload) {
  r.bytes = payload.size();
  return write_all(fd, &r, sizeof r) && write_all(fd, payload.data(), payload.size());
}
bool reply_error(int fd, ncclResult_t e, const std::string& why) {
  Reply r;
  r.result = e;
  return reply(fd, r, why);
}

size_t elem_size(uint64_t dt) {
  switch (dt) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    default:
      return 8;
  }
}
const char* dtype_name(uint64_t dt) {
  static const char* names[] = {"int8",    "uint8",   "int32",   "uint32",   "int64",      "uint64",
                                "float16", "float32", "float64", "bfloat16", "float8e4m3", "float8e5m2"};
  return dt < 12 ? names[dt] : "?";
}
const char* op_name(uint64_t op) {
  static const char* names[] = {"sum", "prod", "max", "min", "avg"};
  return op < 5 ? names[op] : "?";
}

// ---- Reductions, in rank order ----
template <typename T>
T apply(uint64_t op, T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;  // wraps, as the GPU does
    switch (op) {
      case ncclProd:
        return static_cast<T>(static_cast<U>(a) * static_cast<U>(b));
      case ncclMax:
        return std::max(a, b);
      case ncclMin:
        return std::min(a, b);
      default:
        return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
    }
  } else if constexpr (std::is_floating_point_v<T>) {
    switch (op) {
      case ncclProd:
        return a * b;
      case ncclMax:
        return (a > b || a != a) ? a : b;  // NaN wins, from either side
      case ncclMin:
        return (a < b || a != a) ? a : b;
      default:
        return a + b;
    }
  } else {
    return T(apply<float>(op, static_cast<float>(a), static_cast<float>(b)));
  }
}
template <typename T>
void fold(uint64_t op, std::string& acc, const std::string& x) {
  const size_t n = acc.size() / sizeof(T);
  for (size_t i = 0; i < n; ++i) {
    T a, b;
    std::memcpy(&a, acc.data() + i * sizeof(T), sizeof(T));
    std::memcpy(&b, x.data() + i * sizeof(T), sizeof(T));
    a = apply<T>(op, a, b);
    std::memcpy(&acc[i * sizeof(T)], &a, sizeof(T));
  }
}
template <typename T>
void divide(std::string& acc, int n) {
  for (size_t i = 0; i < acc.size() / sizeof(T); ++i) {
    T a;
    std::memcpy(&a, acc.data() + i * sizeof(T), sizeof(T));
    if constexpr (std::is_arithmetic_v<T>)
      a = static_cast<T>(a / static_cast<T>(n));
    else
      a = T(static_cast<float>(a) / static_cast<float>(n));
    std::memcpy(&acc[i * sizeof(T)], &a, sizeof(T));
  }
}
template <typename T>
std::string reduce_as(uint64_t op, const std::vector<std::string>& in) {
  std::string acc = in[0];
  for (size_t r = 1; r < in.size(); ++r) fold<T>(op, acc, in[r]);
  if (op == ncclAvg) divide<T>(acc, static_cast<int>(in.size()));
  return acc;
}
std::string reduce(uint64_t dt, uint64_t op, const std::vector<std::string>& in) {
  switch (dt) {
    case ncclInt8:
      return reduce_as<int8_t>(op, in);
    case ncclUint8:
      return reduce_as<uint8_t>(op, in);
    case ncclInt32:
      return reduce_as<int32_t>(op, in);
    case ncclUint32:
      return reduce_as<uint32_t>(op, in);
    case ncclInt64:
      return reduce_as<int64_t>(op, in);
    case ncclUint64:
      return reduce_as<uint64_t>(op, in);
    case ncclFloat16:
      return reduce_as<ember::Half>(op, in);
    case ncclFloat32:
      return reduce_as<float>(op, in);
    case ncclFloat64:
      return reduce_as<double>(op, in);
    case ncclBfloat16:
      return reduce_as<ember::BFloat16>(op, in);
    case ncclFloat8e4m3:
      return reduce_as<ember::Float8E4M3>(op, in);
    default:
      return reduce_as<ember::Float8E5M2>(op, in);
  }
}

// ---- The hub ----
struct Round {
  std::vector<Hdr> hdr;
  std::vector<std::string> data, out;
  std::vector<bool> in;
  int arrived = 0, taken = 0;
  bool done = false;
  ncclResult_t result = ncclSuccess;
  std::string error;
};
struct HubComm {
  int nranks = 0;
  int joined = 0;
  std::vector<std::string> gone;  // per rank: why its connection closed ("" while open)
  std::map<uint64_t, Round> colls, splits;
  std::map<std::pair<int64_t, int64_t>, std::deque<std::string>> mail;  // (from, to)
};
struct Hub {
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, HubComm> comms;  // 1: the id's own communicator
  uint64_t next_comm = 2;
};

// A round's outcome once every rank has arrived: a mismatch, or each rank's output.
void finish_coll(Round& rd) {
  const int n = static_cast<int>(rd.hdr.size());
  const Hdr& h0 = rd.hdr[0];
  for (int r = 1; r < n && rd.result == ncclSuccess; ++r) {
    const Hdr& h = rd.hdr[r];
    const bool uses_op = h0.coll == kAllReduce || h0.coll == kReduce || h0.coll == kReduceScatter;
    const bool uses_root = h0.coll == kBroadcast || h0.coll == kReduce;
    if (h.coll != h0.coll || h.count != h0.count || h.dtype != h0.dtype || (uses_op && h.op != h0.op) ||
        (uses_root && h.root != h0.root)) {
      auto d = [](const Hdr& x) {
        return std::string(coll_name(x.coll)) + "(count " + std::to_string(x.count) + ", " + dtype_name(x.dtype) +
               ", " + op_name(x.op) + ", root " + std::to_string(x.root) + ")";
      };
      rd.result = ncclInvalidUsage;
      rd.error = "mismatched collectives: rank 0 called " + d(h0) + ", rank " + std::to_string(r) + " " + d(h);
    }
  }
  rd.out.assign(n, std::string());
  if (rd.result == ncclSuccess) {
    const size_t block = h0.count * elem_size(h0.dtype);
    switch (h0.coll) {
      case kAllReduce: {
        std::string res = reduce(h0.dtype, h0.op, rd.data);
        for (auto& o : rd.out) o = res;
        break;
      }
      case kBroadcast:
        for (auto& o : rd.out) o = rd.data[h0.root];
        break;
      case kReduce:
        rd.out[h0.root] = reduce(h0.dtype, h0.op, rd.data);
        break;
      case kAllGather: {
        std::string all;
        for (auto& d : rd.data) all += d;
        for (auto& o : rd.out) o = all;
        break;
      }
      case kReduceScatter: {
        std::string res = reduce(h0.dtype, h0.op, rd.data);
        for (int r = 0; r < n; ++r) rd.out[r] = res.substr(r * block, block);
        break;
      }
    }
  }
  rd.data.clear();
  rd.done = true;
}

// Why a round cannot complete: a rank it still needs is gone.
std::string missing(const HubComm& c, const Round& rd) {
  for (int r = 0; r < c.nranks; ++r)
    if (!rd.in[r] && !c.gone[r].empty()) return c.gone[r];
  return "";
}

Round& round_of(std::map<uint64_t, Round>& m, uint64_t seq, int n) {
  Round& rd = m[seq];
  if (rd.hdr.empty()) {
    rd.hdr.resize(n);
    rd.data.resize(n);
    rd.in.assign(n, false);
  }
  return rd;
}

void serve(Hub* hub, int fd) {
  Hdr hello;
  if (!read_all(fd, &hello, sizeof hello) || hello.kind != kHello) {
    ::close(fd);
    return;
  }
  const uint64_t id = hello.comm;
  const int rank = static_cast<int>(hello.rank);
  const bool data = hello.op == 0;
  std::unique_lock<std::mutex> lock(hub->mu);
  auto it = hub->comms.find(id);
  if (it == hub->comms.end() && id == 1) {
    it = hub->comms.emplace(1, HubComm{}).first;
    it->second.nranks = static_cast<int>(hello.nranks);
    it->second.gone.assign(hello.nranks, "");
  }
  if (it == hub->comms.end() || it->second.nranks != hello.nranks || rank < 0 || rank >= hello.nranks) {
    const std::string why = it == hub->comms.end()
                                ? "no such communicator"
                                : "rank " + std::to_string(rank) + " of " + std::to_string(hello.nranks) +
                                      " joins a communicator of " + std::to_string(it->second.nranks);
    lock.unlock();
    reply_error(fd, ncclInvalidArgument, "ncclCommInitRank: " + why);
    ::close(fd);
    return;
  }
  HubComm& c = it->second;
  if (data) {
    c.joined++;
    hub->cv.notify_all();
    // ncclCommInitRank returns once every rank has joined (the first communicator).
    hub->cv.wait(lock, [&] { return id != 1 || c.joined >= c.nranks; });
  }
  lock.unlock();
  if (!reply(fd, Reply{}, "")) return;

  const std::string left = "rank " + std::to_string(rank) +
                           " closed its connection (it called ncclCommAbort or ncclCommDestroy, or its process "
                           "exited)";
  for (;;) {
    Hdr h;
    if (!read_all(fd, &h, sizeof h)) break;
    std::string payload(h.kind == kRecv ? 0 : h.bytes, '\0');
    if (!read_all(fd, payload.data(), payload.size())) break;
    lock.lock();
    Reply rp;
    std::string out;
    if (h.kind == kColl || h.kind == kSplit) {
      const bool coll = h.kind == kColl;
      Round& rd = round_of(coll ? c.colls : c.splits, h.peer, c.nranks);  // peer carries the sequence number
      rd.hdr[rank] = h;
      rd.data[rank] = std::move(payload);
      rd.in[rank] = true;
      if (++rd.arrived == c.nranks) {
        if (coll) {
          finish_coll(rd);
        } else {
          // Members of each colour, ordered by key then rank, get a new communicator.
          rd.out.assign(c.nranks, std::string());
          std::map<int64_t, std::vector<std::pair<int64_t, int>>> colours;
          for (int r = 0; r < c.nranks; ++r)
            if (rd.hdr[r].color != NCCL_SPLIT_NOCOLOR) colours[rd.hdr[r].color].push_back({rd.hdr[r].key, r});
          for (auto& [colour, members] : colours) {
            std::sort(members.begin(), members.end());
            const uint64_t nid = hub->next_comm++;
            HubComm& nc = hub->comms[nid];
            nc.nranks = static_cast<int>(members.size());
            nc.gone.assign(members.size(), "");
            for (size_t i = 0; i < members.size(); ++i) {
              Reply s;
              s.comm = nid;
              s.rank = static_cast<int64_t>(i);
              s.nranks = nc.nranks;
              rd.out[members[i].second].assign(reinterpret_cast<const char*>(&s), sizeof s);
            }
          }
          rd.done = true;
        }
        hub->cv.notify_all();
      }
      Round* rdp = &rd;
      hub->cv.wait(lock, [&] { return rdp->done || !missing(c, *rdp).empty(); });
      if (!rdp->done) {
        rp.result = ncclRemoteError;
        out = std::string(coll ? coll_name(h.coll) : "ncclCommSplit") + ": " + missing(c, *rdp);
      } else if (rdp->result != ncclSuccess) {
        rp.result = rdp->result;
        out = rdp->error;
      } else {
        out = std::move(rdp->out[rank]);
      }
      if (rdp->done && ++rdp->taken == c.nranks) (coll ? c.colls : c.splits).erase(h.peer);
    } else if (h.kind == kSend) {
      c.mail[{rank, h.peer}].push_back(std::move(payload));
      hub->cv.notify_all();
    } else if (h.kind == kRecv) {
      auto& box = c.mail[{h.peer, rank}];
      hub->cv.wait(lock, [&] { return !box.empty() || !c.gone[h.peer].empty(); });
      if (box.empty()) {
        rp.result = ncclRemoteError;
        out = "ncclRecv from rank " + std::to_string(h.peer) + ": " + c.gone[h.peer];
      } else if (box.front().size() != h.bytes) {
        rp.result = ncclInvalidUsage;
        out = "ncclRecv: rank " + std::to_string(h.peer) + " sent " + std::to_string(box.front().size()) +
              " bytes, rank " + std::to_string(rank) + " receives " + std::to_string(h.bytes);
        box.pop_front();
      } else {
        out = std::move(box.front());
        box.pop_front();
      }
    }
    lock.unlock();
    if (!reply(fd, rp, out)) break;
  }
  ::close(fd);
  lock.lock();
  if (c.gone[rank].empty()) c.gone[rank] = left;
  hub->cv.notify_all();
}

// Listens on a loopback port; serves each connection on its own thread.
// Hubs live as long as the process.
uint16_t start_hub() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 128) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return 0;
  }
  auto* hub = new Hub;  // serves until the process exits
  std::thread([hub, fd] {
    for (;;) {
      const int c = ::accept(fd, nullptr, nullptr);
      if (c < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;
      }
      int one = 1;
      ::setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      std::thread(serve, hub, c).detach();
    }
  }).detach();
  return ntohs(a.sin_port);
}

// ---- The ranks' side ----
struct CommState {
  ~CommState() {
    if (data_fd >= 0) ::close(data_fd);
    if (ctl_fd >= 0) ::close(ctl_fd);
  }
  int data_fd = -1, ctl_fd = -1;
  uint16_t port = 0;
  uint64_t id = 0;
  int rank = 0, nranks = 0;
  std::mutex data_mu, ctl_mu;  // one request at a time on each connection
  uint64_t coll_seq = 0;       // under data_mu: collectives as they run
  uint64_t split_seq = 0;      // under ctl_mu
  std::atomic<bool> closed{false};
  std::atomic<int> async{ncclSuccess};
  std::mutex err_mu;
  std::string last_error;

  void fail(ncclResult_t e, const std::string& why) {
    std::lock_guard<std::mutex> l(err_mu);
    if (async.load() == ncclSuccess) {
      last_error = why;
      async = e;
    }
  }
};

thread_local std::string t_last_error;  // ncclGetLastError without a communicator
thread_local int t_group_depth = 0;
thread_local ncclResult_t t_group_error = ncclSuccess;  // the group's first failed call, for ncclGroupEnd
ncclResult_t error(ncclResult_t e, const std::string& why) {
  t_last_error = why;
  if (t_group_depth > 0 && t_group_error == ncclSuccess) t_group_error = e;
  return e;
}

int connect_hub(uint16_t port, const Hdr& hello, std::string* why) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    *why = "cannot reach the hub at 127.0.0.1:" + std::to_string(port) + ": " + std::strerror(errno);
    if (fd >= 0) ::close(fd);
    return -1;
  }
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  Reply r;
  if (!write_all(fd, &hello, sizeof hello) || !read_all(fd, &r, sizeof r)) {
    *why = "the hub closed the connection";
    ::close(fd);
    return -1;
  }
  std::string text(r.bytes, '\0');
  read_all(fd, text.data(), text.size());
  if (r.result != ncclSuccess) {
    *why = text;
    ::close(fd);
    return -1;
  }
  return fd;
}

ncclResult_t join(uint16_t port, uint64_t id, int nranks, int rank, std::shared_ptr<CommState>* out) {
  auto s = std::make_shared<CommState>();
  s->port = port;
  s->id = id;
  s->rank = rank;
  s->nranks = nranks;
  Hdr h;
  h.kind = kHello;
  h.comm = id;
  h.rank = rank;
  h.nranks = nranks;
  std::string why;
  h.op = 0;
  s->data_fd = connect_hub(port, h, &why);
  if (s->data_fd < 0) return error(ncclSystemError, "ncclCommInitRank: " + why);
  h.op = 1;
  s->ctl_fd = connect_hub(port, h, &why);
  if (s->ctl_fd < 0) return error(ncclSystemError, "ncclCommInitRank: " + why);
  *out = std::move(s);
  return ncclSuccess;
}

// One request and its answer on a connection whose mutex the caller holds.
ncclResult_t exchange(int fd, const Hdr& h, const void* payload, std::string* out, std::string* why) {
  Reply r;
  if (!write_all(fd, &h, sizeof h) || !write_all(fd, payload, h.kind == kRecv ? 0 : h.bytes) ||
      !read_all(fd, &r, sizeof r)) {
    *why =
        "the connection to the hub is closed (the communicator was aborted, or the process that made the "
        "unique id exited)";
    return ncclRemoteError;
  }
  out->assign(r.bytes, '\0');
  if (!read_all(fd, out->data(), out->size())) {
    *why = "the connection to the hub closed mid-answer";
    return ncclRemoteError;
  }
  if (r.result != ncclSuccess) *why = *out;
  return static_cast<ncclResult_t>(r.result);
}

// ---- Groups: ncclGroupStart .. ncclGroupEnd ----
// The calls between them run as one piece of work per stream, sends first
// and receives last, so pairs of sends and receives never wait for each
// other, as NCCL's fused group does.
struct Pending {
  cudaStream_t stream;
  int order;  // 0 sends, 1 collectives, 2 receives
  std::function<void()> fn;
};
thread_local std::vector<Pending> t_group;

void submit(cudaStream_t stream, int order, std::function<void()> fn, const char* what) {
  if (t_group_depth > 0) {
    t_group.push_back({stream, order, std::move(fn)});
    return;
  }
  emu::enqueue(stream, std::move(fn), what);
}

ncclResult_t check_buffer(const void* p, size_t bytes, const char* what, const char* fn) {
  if (bytes == 0) return ncclSuccess;
  cudaPointerAttributes a{}, b{};
  cudaPointerGetAttributes(&a, p);
  cudaPointerGetAttributes(&b, static_cast<const char*>(p) + bytes - 1);
  if (a.type != cudaMemoryTypeDevice || b.type != cudaMemoryTypeDevice)
    return error(ncclInvalidArgument,
                 std::string(fn) + ": " + what + " (" + std::to_string(bytes) + " bytes) is not device memory");
  return ncclSuccess;
}

ncclResult_t check_comm(ncclComm_t comm, const char* fn);

ncclResult_t collective(const char* fn, uint32_t kind, const void* send, void* recv, size_t count, ncclDataType_t dt,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream);

}  // namespace
}  // namespace emu_nccl

struct ncclComm {
  std::shared_ptr<emu_nccl::CommState> s;
};

namespace emu_nccl {
namespace {

ncclResult_t check_comm(ncclComm_t comm, const char* fn) {
  if (comm == nullptr || !comm->s) return error(ncclInvalidArgument, std::string(fn) + ": null communicator");
  return ncclSuccess;
}

ncclResult_t collective(const char* fn, uint32_t kind, const void* send, void* recv, size_t count, ncclDataType_t dt,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  if (ncclResult_t e = check_comm(comm, fn)) return e;
  auto s = comm->s;
  if (static_cast<unsigned>(dt) >= ncclNumTypes)
    return error(ncclInvalidArgument, std::string(fn) + ": invalid data type " + std::to_string(dt));
  if (static_cast<unsigned>(op) >= ncclNumOps)
    return error(ncclInvalidArgument, std::string(fn) + ": invalid reduction " + std::to_string(op));
  if ((kind == kBroadcast || kind == kReduce) && (root < 0 || root >= s->nranks))
    return error(ncclInvalidArgument, std::string(fn) + ": root " + std::to_string(root) + " of a communicator of " +
                                          std::to_string(s->nranks));
  const size_t es = elem_size(dt), n = static_cast<size_t>(s->nranks);
  size_t in = count * es, out = count * es;
  if (kind == kAllGather) out *= n;
  if (kind == kReduceScatter) in *= n;
  if (kind == kBroadcast && s->rank != root) in = 0;
  if (kind == kReduce && s->rank != root) out = 0;
  if (ncclResult_t e = check_buffer(send, in, "sendbuff", fn)) return e;
  if (ncclResult_t e = check_buffer(recv, out, "recvbuff", fn)) return e;
  Hdr h;
  h.kind = kColl;
  h.coll = kind;
  h.count = count;
  h.dtype = dt;
  h.op = op;
  h.root = root;
  h.bytes = in;
  submit(
      stream, 1,
      [s, h, send, recv, out, fn]() mutable {
        std::lock_guard<std::mutex> l(s->data_mu);
        if (s->closed || s->async != ncclSuccess) return;  // a failed communicator runs nothing
        h.peer = static_cast<int64_t>(s->coll_seq++);
        std::string res, why;
        ncclResult_t e = exchange(s->data_fd, h, send, &res, &why);
        if (e == ncclSuccess && res.size() != out) {
          e = ncclInternalError;
          why = std::string(fn) + ": the hub answered " + std::to_string(res.size()) + " bytes, expected " +
                std::to_string(out);
        }
        if (e != ncclSuccess) return s->fail(e, why);
        if (out) std::memcpy(recv, res.data(), out);
      },
      fn);
  return ncclSuccess;
}

ncclResult_t p2p(const char* fn, bool sending, void* buf, size_t count, ncclDataType_t dt, int peer, ncclComm_t comm,
                 cudaStream_t stream) {
  if (ncclResult_t e = check_comm(comm, fn)) return e;
  auto s = comm->s;
  if (static_cast<unsigned>(dt) >= ncclNumTypes)
    return error(ncclInvalidArgument, std::string(fn) + ": invalid data type " + std::to_string(dt));
  if (peer < 0 || peer >= s->nranks)
    return error(ncclInvalidArgument, std::string(fn) + ": peer " + std::to_string(peer) + " of a communicator of " +
                                          std::to_string(s->nranks));
  const size_t bytes = count * elem_size(dt);
  if (ncclResult_t e = check_buffer(buf, bytes, sending ? "sendbuff" : "recvbuff", fn)) return e;
  Hdr h;
  h.kind = sending ? kSend : kRecv;
  h.peer = peer;
  h.bytes = bytes;
  submit(
      stream, sending ? 0 : 2,
      [s, h, buf, bytes, sending]() {
        std::lock_guard<std::mutex> l(s->data_mu);
        if (s->closed || s->async != ncclSuccess) return;
        std::string res, why;
        ncclResult_t e = exchange(s->data_fd, h, buf, &res, &why);
        if (e != ncclSuccess) return s->fail(e, why);
        if (!sending && bytes) std::memcpy(buf, res.data(), bytes);
      },
      fn);
  return ncclSuccess;
}

}  // namespace
}  // namespace emu_nccl

using namespace emu_nccl;

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError:
      return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError:
      return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument:
      return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage:
      return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  if (comm != nullptr && comm->s) {
    std::lock_guard<std::mutex> l(comm->s->err_mu);
    if (!comm->s->last_error.empty()) t_last_error = comm->s->last_error;
  }
  return t_last_error.c_str();
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  const uint16_t port = start_hub();
  if (port == 0)
    return error(ncclSystemError, std::string("ncclGetUniqueId: cannot listen on loopback: ") + std::strerror(errno));
  std::memset(id, 0, sizeof *id);
  IdBody b{};
  std::memcpy(b.magic, kMagic, sizeof kMagic);
  b.port = port;
  std::memcpy(id->internal, &b, sizeof b);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t* /*config: always blocking here*/) {
  IdBody b;
  std::memcpy(&b, commId.internal, sizeof b);
  if (std::memcmp(b.magic, kMagic, sizeof kMagic) != 0)
    return error(ncclInvalidArgument, "ncclCommInitRank: the unique id was not made by ncclGetUniqueId");
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return error(ncclInvalidArgument,
                 "ncclCommInitRank: rank " + std::to_string(rank) + " of " + std::to_string(nranks));
  std::shared_ptr<CommState> s;
  if (ncclResult_t e = join(b.port, 1, nranks, rank, &s)) return e;
  *comm = new ncclComm{std::move(s)};
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  return ncclCommInitRankConfig(comm, nranks, commId, rank, nullptr);
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t*) {
  if (ncclResult_t e = check_comm(comm, "ncclCommSplit")) return e;
  auto s = comm->s;
  Hdr h;
  h.kind = kSplit;
  h.color = color < 0 ? NCCL_SPLIT_NOCOLOR : color;
  h.key = key;
  std::string res, why;
  ncclResult_t e;
  {
    std::lock_guard<std::mutex> l(s->ctl_mu);
    h.peer = static_cast<int64_t>(s->split_seq++);
    e = exchange(s->ctl_fd, h, nullptr, &res, &why);
  }
  if (e != ncclSuccess) return error(e, "ncclCommSplit: " + why);
  *newcomm = nullptr;
  if (res.empty()) return ncclSuccess;  // NCCL_SPLIT_NOCOLOR
  Reply r;
  std::memcpy(&r, res.data(), sizeof r);
  std::shared_ptr<CommState> ns;
  if ((e = join(s->port, r.comm, static_cast<int>(r.nranks), static_cast<int>(r.rank), &ns))) return e;
  *newcomm = new ncclComm{std::move(ns)};
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) { return check_comm(comm, "ncclCommFinalize"); }

// Destroy and abort both close the connections; work still queued that
// holds the state runs nothing.
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (ncclResult_t e = check_comm(comm, "ncclCommDestroy")) return e;
  auto s = comm->s;
  s->closed = true;
  ::shutdown(s->data_fd, SHUT_RDWR);
  ::shutdown(s->ctl_fd, SHUT_RDWR);
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (ncclResult_t e = check_comm(comm, "ncclCommAbort")) return e;
  auto s = comm->s;
  s->closed = true;
  ::shutdown(s->data_fd, SHUT_RDWR);  // wakes a collective waiting in this process
  ::shutdown(s->ctl_fd, SHUT_RDWR);
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  if (ncclResult_t e = check_comm(comm, "ncclCommGetAsyncError")) return e;
  *asyncError = static_cast<ncclResult_t>(comm->s->async.load());
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (ncclResult_t e = check_comm(comm, "ncclCommCount")) return e;
  *count = comm->s->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (ncclResult_t e = check_comm(comm, "ncclCommUserRank")) return e;
  *rank = comm->s->rank;
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  return collective("ncclAllReduce", kAllReduce, sendbuff, recvbuff, count, datatype, op, 0, comm, stream);
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  return collective("ncclBroadcast", kBroadcast, sendbuff, recvbuff, count, datatype, ncclSum, root, comm, stream);
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
  return collective("ncclReduce", kReduce, sendbuff, recvbuff, count, datatype, op, root, comm, stream);
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
  return collective("ncclAllGather", kAllGather, sendbuff, recvbuff, sendcount, datatype, ncclSum, 0, comm, stream);
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return collective("ncclReduceScatter", kReduceScatter, sendbuff, recvbuff, recvcount, datatype, op, 0, comm, stream);
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return p2p("ncclSend", true, const_cast<void*>(sendbuff), count, datatype, peer, comm, stream);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return p2p("ncclRecv", false, recvbuff, count, datatype, peer, comm, stream);
}

ncclResult_t ncclGroupStart() {
  if (t_group_depth++ == 0) t_group_error = ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (t_group_depth == 0) return error(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--t_group_depth > 0) return ncclSuccess;
  std::vector<Pending> ops;
  ops.swap(t_group);
  if (t_group_error != ncclSuccess) return t_group_error;
  // Streams in the order they first appear; within one, sends, collectives, receives.
  std::vector<cudaStream_t> streams;
  for (auto& p : ops)
    if (std::find(streams.begin(), streams.end(), p.stream) == streams.end()) streams.push_back(p.stream);
  for (cudaStream_t st : streams) {
    std::vector<std::function<void()>> fns;
    for (int order = 0; order < 3; ++order)
      for (auto& p : ops)
        if (p.stream == st && p.order == order) fns.push_back(std::move(p.fn));
    emu::enqueue(
        st,
        [fns = std::move(fns)]() {
          for (auto& f : fns) f();
        },
        "ncclGroupEnd");
  }
  return ncclSuccess;
}

}  // extern "C"
