// TCPStore: the rendezvous key-value store every rank reaches over TCP.
//
// The process with is_server runs one server thread (an epoll loop, so one
// thread serves any number of ranks); every TCPStore, the server's own
// included, talks to it through one client socket. Blocking requests (get,
// wait, waiting for workers) are parked on the server with a deadline and
// answered when the keys appear or the deadline passes, so a timed-out
// request never leaves a late reply on the wire.
//
// Wire format, both directions: frames of [u32 length][body], integers
// little-endian. A client opens with an 8-byte magic so that a stray
// connection (a port scanner, a misdirected Gloo pair) is dropped instead of
// being parsed as requests, followed by one frame holding the job's token;
// the server answers with the same magic, so a client that reached another
// program on the port says so at once, then a status frame: a client with
// the wrong token is told so (and logged by the server) and disconnected.
// Request body: [u8 command][arguments]; reply body: [u8 status][payload].
//
// Security model: the server listens only on the job's address (loopback for
// a single-node job), and with a token (EMBER_STORE_TOKEN) only clients that
// know it are served. The token travels in clear text and the store's
// traffic is not encrypted: it keeps out other users' programs and strays,
// not someone who can read the network.
//
// Liveness: a client that speaks for a rank says so (Hello) and says goodbye
// (Bye) from its destructor. A connection with a rank that closes without
// the goodbye marks the rank lost: every parked request is answered with
// RankLost at once, and so is every later one that cannot be answered
// straight away, since what it waits for may come from the lost rank.
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <random>
#include <string_view>
#include <thread>

#include "core/exception.h"
#include "distributed/store/store.h"
#include "distributed/store/store_internal.h"
#include "distributed/store/tcp_store_wire.h"

namespace ember::distributed {

using namespace wire;

// ---------------------------------------------------------------------------
// Client

namespace {
// Says which process a Hello comes from: a client of this process that
// reconnects (its socket timed out) is the same rank alive, not lost; a new
// process with the rank is a replacement, and the old one stays lost to the
// groups it belonged to (lost_ranks_since).
uint64_t process_incarnation() {
  // The pid is mixed in on every call: a child forked after a client of its
  // parent connected is another process (it shares the parent's seed).
  static const uint64_t seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  uint64_t z = seed ^ (static_cast<uint64_t>(getpid()) * 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;  // splitmix64's finaliser
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return z ? z : 1;
}
}  // namespace

struct TCPStore::Impl {
  std::string host;
  int port = 0;
  TCPStoreOptions options;
  std::unique_ptr<wire::Server> server;
  std::mutex mu;  // one request in flight per socket
  int fd = -1;
  bool closed = false;  // close(): no reconnection

  ~Impl() {
    // Leaving on purpose: the server must not report this rank as lost.
    if (fd >= 0 && options.rank >= 0) {
      try {
        Writer w;
        w.u8(uint8_t(Cmd::Bye));
        roundtrip(w, Millis{2000}, "goodbye");
      } catch (const std::exception&) {
        // The server is gone already: nobody is left to tell.
      }
    }
    disconnect();
    server.reset();
  }

  std::string address() const {
    bool v6 = host.find(':') != std::string::npos;
    return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
  }

  void disconnect() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }

  // Ranks start in any order, so a refused connection means "not up yet":
  // retry with backoff until the timeout, then report the last error, saying
  // every 10 s that it is still waiting (a silent wait of minutes looks like a
  // hang). What retrying cannot fix fails at once: a host name that does not
  // resolve, and a listener on the port that is not a store.
  void connect_to_server(Millis timeout) {
    auto deadline = deadline_after(timeout);
    const auto start = Clock::now();
    auto next_note = start + std::chrono::seconds(10);
    std::string last_error = "no attempt made";
    Millis backoff{10};
    for (;;) {
      if (try_connect(deadline, &last_error)) {
        if (options.rank >= 0) {
          Writer w;
          w.u8(uint8_t(Cmd::Hello)).i64(options.rank).i64(static_cast<int64_t>(process_incarnation()));
          const std::string body = roundtrip(w, remaining(deadline) + kReplyGrace, "hello");
          Reader r(body);
          if (static_cast<Status>(r.u8()) != Status::Ok)
            throw Error("TCPStore " + address() + ": the store did not accept rank " + std::to_string(options.rank));
        }
        return;
      }
      Millis left = remaining(deadline);
      if (left <= Millis{0}) break;
      if (Clock::now() >= next_note) {
        std::fprintf(
            stderr, "TCPStore: still waiting for the store at %s (%lld s of %lld s; last error: %s)\n",
            address().c_str(),
            static_cast<long long>(std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - start).count()),
            static_cast<long long>(std::chrono::duration_cast<std::chrono::seconds>(timeout).count()),
            last_error.c_str());
        next_note += std::chrono::seconds(10);
      }
      std::this_thread::sleep_for(std::min(backoff, left));
      backoff = std::min(backoff * 2, Millis{1000});
    }
    throw Error("TCPStore: could not connect to the store at " + address() + " within " +
                std::to_string(timeout.count()) + " ms (last error: " + last_error + "); is the store's server (" +
                options.server + ") running and reachable at that address?");
  }

  bool try_connect(Clock::time_point deadline, std::string* error) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (rc == EAI_NONAME || rc == EAI_FAIL)  // no such host: waiting will not make one
      throw Error("TCPStore: cannot resolve the store's host '" + host + "': " + gai_strerror(rc));
    if (rc != 0) {
      *error = std::string("cannot resolve host: ") + gai_strerror(rc);
      return false;
    }
    bool ok = false;
    for (addrinfo* ai = res; ai && !ok; ai = ai->ai_next) {
      int s = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
      if (s < 0) {
        *error = errno_text(errno);
        continue;
      }
      int r = ::connect(s, ai->ai_addr, ai->ai_addrlen);
      if (r < 0 && errno == EINPROGRESS) {
        pollfd p{s, POLLOUT, 0};
        int pr = poll(&p, 1, static_cast<int>(std::max<int64_t>(remaining(deadline).count(), 1)));
        int err = 0;
        socklen_t len = sizeof err;
        if (pr == 1 && getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0) {
          r = 0;
        } else {
          errno = pr == 0 ? ETIMEDOUT : (err ? err : errno);
        }
      }
      if (r == 0) {
        set_nodelay(s);
        fd = s;
        Writer opening;
        std::string hello = std::string(kMagic, sizeof kMagic) + opening.str(options.token).finish();
        ok = send_all(hello.data(), hello.size(), deadline) && handshake_reply(deadline, error);
        if (!ok) {
          if (error->empty()) *error = "connection closed during the handshake";
          disconnect();
        }
      } else {
        *error = errno_text(errno);
        ::close(s);
      }
    }
    freeaddrinfo(res);
    return ok;
  }

  // The server answers the magic with its own. Another program on the port
  // answers something else, or nothing: a named error, not minutes of retries.
  bool handshake_reply(Clock::time_point deadline, std::string* error) {
    error->clear();
    char reply[sizeof kMagic];
    const auto within = std::min(deadline, Clock::now() + kHandshakeReply);
    switch (recv_all(reply, sizeof reply, within)) {
      case RecvResult::Ok:
        if (std::memcmp(reply, kMagic, sizeof kMagic) == 0) return token_accepted(within, error);
        disconnect();
        throw Error("TCPStore: the program listening at " + address() +
                    " is not an ember store (it answered the handshake with other bytes); is the port used by "
                    "another program?");
      case RecvResult::Timeout:
        if (Clock::now() < deadline) {
          disconnect();
          throw Error("TCPStore: the program listening at " + address() +
                      " did not answer the store handshake within " + std::to_string(kHandshakeReply.count()) +
                      " ms: it is not an ember store (is the port used by "
                      "another program?)");
        }
        *error = "no handshake reply before the timeout";
        return false;
      case RecvResult::Closed:
        *error = "connection closed during the handshake";
        return false;
    }
    return false;
  }

  // After the magic, the server's verdict on our token: Ok, or Error with
  // its reason. A refusal is final (retrying will not change the token).
  bool token_accepted(Clock::time_point within, std::string* error) {
    char len_buf[4];
    std::string body;
    RecvResult rr = recv_all(len_buf, 4, within);
    if (rr == RecvResult::Ok) {
      uint32_t len = load_u32(len_buf);
      if (len == 0 || len > kMaxToken + 64) {
        disconnect();
        throw Error("TCPStore: the program listening at " + address() + " sent a malformed handshake");
      }
      body.resize(len);
      rr = recv_all(body.data(), len, within);
    }
    if (rr != RecvResult::Ok) {
      *error = "no verdict on the job token during the handshake";
      return false;
    }
    std::string why;
    try {
      Reader r(body);
      if (static_cast<Status>(r.u8()) == Status::Ok) return true;
      why = r.str();
    } catch (const ProtocolError&) {
      disconnect();
      throw Error("TCPStore: the program listening at " + address() + " sent a malformed handshake");
    }
    disconnect();
    throw Error("TCPStore: the store at " + address() + " " + why +
                (options.token.empty()
                     ? "; this process has none: set EMBER_STORE_TOKEN to the job's token (the launcher sets it for "
                       "the workers it starts)"
                     : "; this process's EMBER_STORE_TOKEN differs from the job's (is it another job's store?)"));
  }

  // False on timeout; true when the socket is ready (or has an error that
  // the next send/recv will report).
  bool wait_fd(short events, Clock::time_point deadline) {
    for (;;) {
      Millis left = remaining(deadline);
      if (left <= Millis{0}) return false;
      pollfd p{fd, events, 0};
      int pr = poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1 << 30)));
      if (pr > 0) return true;
      if (pr < 0 && errno != EINTR) return true;
    }
  }

  enum class RecvResult { Ok, Timeout, Closed };
  // Moves n bytes at p with io(p, n) (a send or a recv, returning the bytes
  // it moved), waiting for `events` while the socket would block: Ok, or
  // Timeout once `deadline` passes, or Closed on an error or end of stream.
  template <typename Char, typename Io>
  RecvResult transfer_all(Char* p, size_t n, short events, Clock::time_point deadline, Io io) {
    while (n > 0) {
      ssize_t r = io(p, n);
      if (r > 0) {
        p += r;
        n -= static_cast<size_t>(r);
        continue;
      }
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (!wait_fd(events, deadline)) return RecvResult::Timeout;
        continue;
      }
      return RecvResult::Closed;
    }
    return RecvResult::Ok;
  }
  bool send_all(const char* p, size_t n, Clock::time_point deadline) {
    return transfer_all(p, n, POLLOUT, deadline,
                        [&](const char* q, size_t m) { return send(fd, q, m, MSG_NOSIGNAL); }) == RecvResult::Ok;
  }
  RecvResult recv_all(char* p, size_t n, Clock::time_point deadline) {
    return transfer_all(p, n, POLLIN, deadline, [&](char* q, size_t m) { return recv(fd, q, m, 0); });
  }

  // Sends one request and returns the reply body. Any transport failure
  // drops the socket (a half-read reply would desynchronise the stream); the
  // next call reconnects.
  std::string roundtrip(Writer& request, Millis reply_within, const std::string& what) {
    EMBER_CHECK(request.size() <= kMaxFrame, "TCPStore ", address(), ": ", what, ": request of ", request.size(),
                " bytes exceeds the store's limit of ", kMaxFrame, " bytes");
    if (closed) throw Error("TCPStore " + address() + ": " + what + ": the store was closed (TCPStore::close)");
    if (fd < 0) connect_to_server(options.timeout);
    std::string frame = request.finish();
    auto deadline = deadline_after(reply_within);
    if (!send_all(frame.data(), frame.size(), deadline)) {
      disconnect();
      throw Error("TCPStore " + address() + ": " + what + ": lost the connection to the store server while sending");
    }
    char len_buf[4];
    RecvResult rr = recv_all(len_buf, 4, deadline);
    std::string body;
    if (rr == RecvResult::Ok) {
      uint32_t len = load_u32(len_buf);
      if (len == 0 || len > kMaxFrame) {
        disconnect();
        throw Error("TCPStore " + address() + ": " + what + ": malformed reply (is " + address() +
                    " an ember TCPStore?)");
      }
      // Grown as the bytes arrive: a corrupt length (up to kMaxFrame) must
      // not allocate and zero a gigabyte before the stream runs dry.
      while (rr == RecvResult::Ok && body.size() < len) {
        const size_t have = body.size(), chunk = std::min<size_t>(len - have, size_t{1} << 20);
        body.resize(have + chunk);
        rr = recv_all(body.data() + have, chunk, deadline);
      }
    }
    if (rr == RecvResult::Timeout) {
      disconnect();
      throw Error("TCPStore " + address() + ": " + what + ": no reply from the store server within " +
                  std::to_string(reply_within.count()) + " ms (" + options.server +
                  " is stopped or stuck, or its host is unreachable)");
    }
    if (rr == RecvResult::Closed) {
      disconnect();
      throw Error("TCPStore " + address() + ": " + what + ": the store server closed the connection (did " +
                  options.server + " exit?)");
    }
    return body;
  }

  // A parked request is answered by the server at its deadline; allow a
  // grace period on top before blaming the server.
  Millis parked_reply(Millis timeout) const {
    return timeout > Millis::max() - kReplyGrace ? Millis::max() : timeout + kReplyGrace;
  }
};

namespace {

std::vector<LostRank> read_lost(Reader& r) {
  std::vector<LostRank> lost(r.count(8 + 4 + 8));  // rank, peer's length, ms_ago
  for (LostRank& l : lost) {
    l.rank = static_cast<int>(r.i64());
    l.peer = r.str();
    l.ms_ago = r.i64();
  }
  return lost;
}

// LostSince's reply: Lost's entries, each followed by whether it was replaced.
std::vector<LostRank> read_lost_since(Reader& r) {
  std::vector<LostRank> lost(r.count(8 + 4 + 8 + 1));
  for (LostRank& l : lost) {
    l.rank = static_cast<int>(r.i64());
    l.peer = r.str();
    l.ms_ago = r.i64();
    l.replaced = r.u8() != 0;
  }
  return lost;
}

// The server's answer to a blocking request once a rank is lost.
[[noreturn]] void throw_rank_lost(Reader& r, const std::string& where) {
  std::vector<LostRank> lost = read_lost(r);
  std::string who;
  for (const LostRank& l : lost) who += (who.empty() ? "" : ", ") + l.describe();
  // Built before `lost` is moved into the exception (argument order is unspecified).
  std::string what = where + " stopped waiting: " + who + (lost.size() == 1 ? " has" : " have") +
                     " left the job without saying goodbye (the process exited, crashed or was killed), so what "
                     "this call waits for may never come";
  throw RankLostError(what, std::move(lost));
}

void expect_ok(Reader& r, const std::string& where) {
  Status s = static_cast<Status>(r.u8());
  if (s == Status::Ok) return;
  if (s == Status::RankLost) throw_rank_lost(r, where);
  if (s == Status::Error) throw Error(where + ": " + r.str());
  throw Error(where + ": unexpected reply status " + std::to_string(static_cast<int>(s)));
}

std::string op_name(const char* op, const std::string& key) { return std::string(op) + "(" + quote_key(key) + ")"; }

}  // namespace

// Replies are parsed through Reader, which throws ProtocolError on a
// malformed one; callers get an ember::Error naming the store instead, and
// the connection, now out of step, is dropped. Holds the client's lock.
template <typename Impl, typename F>
auto guarded(Impl& impl, const char* op, F&& f) -> decltype(f()) {
  std::lock_guard<std::mutex> lock(impl.mu);  // one request in flight per socket
  try {
    return f();
  } catch (const ProtocolError& e) {
    impl.disconnect();
    throw Error("TCPStore " + impl.address() + ": " + op + ": malformed reply from the store server (" + e.what() +
                "); is " + impl.address() + " an ember store of the same version?");
  }
}

TCPStore::TCPStore(std::string host, int port, TCPStoreOptions options)
    : Store(options.timeout), impl_(std::make_unique<Impl>()) {
  EMBER_CHECK(!host.empty(),
              "TCPStore: empty host name (pass the address of the rank hosting the store, e.g. "
              "MASTER_ADDR)");
  EMBER_CHECK(port >= 0 && port <= 65535, "TCPStore: port ", port, " is outside [0, 65535]");
  EMBER_CHECK(port != 0 || options.is_server, "TCPStore ", host,
              ":0: port 0 (pick a free port) only works on the server; clients need the port the server chose "
              "(TCPStore::port())");
  EMBER_CHECK(options.timeout > Millis{0}, "TCPStore ", host, ":", port, ": timeout must be positive, got ",
              options.timeout.count(), " ms");
  impl_->host = std::move(host);
  impl_->port = port;
  impl_->options = options;
  if (options.is_server) {
    impl_->server = wire::start_server(impl_->host, port, options.listen_on_all, options.token);
    impl_->port = impl_->server->port();
  }
  impl_->connect_to_server(options.connect_timeout > Millis{0} ? options.connect_timeout : options.timeout);
  if (options.is_server && options.num_workers > 0 && options.wait_for_workers) {
    Writer w;
    w.u8(uint8_t(Cmd::WaitWorkers)).i64(options.num_workers).i64(options.timeout.count());
    std::string where = "TCPStore " + impl_->address();
    std::string body = impl_->roundtrip(w, impl_->parked_reply(options.timeout), "waiting for workers");
    guarded(*impl_, "waiting for workers", [&] {
      Reader r(body);
      Status s = static_cast<Status>(r.u8());
      if (s == Status::RankLost) throw_rank_lost(r, where + ": waiting for workers");
      if (s == Status::Timeout) {
        int64_t seen = r.i64();
        throw Error(where + ": only " + std::to_string(seen) + " of " + std::to_string(options.num_workers) +
                    " workers (TCPStoreOptions::num_workers, the server's own connection included) connected within " +
                    std::to_string(options.timeout.count()) + " ms");
      }
    });
  }
}

TCPStore::~TCPStore() = default;

void TCPStore::close() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->fd >= 0 && impl_->options.rank >= 0) {
    try {
      Writer w;
      w.u8(uint8_t(Cmd::Bye));
      impl_->roundtrip(w, Millis{2000}, "goodbye");
    } catch (const std::exception&) {
      // The server is gone already: nobody is left to tell.
    }
  }
  impl_->disconnect();
  impl_->closed = true;
}

int TCPStore::port() const { return impl_->port; }
const std::string& TCPStore::host() const { return impl_->host; }

void TCPStore::set(const std::string& key, const Bytes& value) {
  guarded(*impl_, "set", [&] {
    Writer w;
    w.u8(uint8_t(Cmd::Set)).str(key).bytes(value.data(), value.size());
    std::string what = op_name("set", key);
    std::string body = impl_->roundtrip(w, timeout_, what);
    Reader r(body);
    expect_ok(r, "TCPStore " + impl_->address() + ": " + what);
  });
}

Bytes TCPStore::get(const std::string& key) {
  return guarded(*impl_, "get", [&] {
    Writer w;
    w.u8(uint8_t(Cmd::Get)).str(key).i64(timeout_.count());
    std::string what = op_name("get", key);
    std::string body = impl_->roundtrip(w, impl_->parked_reply(timeout_), what);
    Reader r(body);
    Status s = static_cast<Status>(r.u8());
    if (s == Status::RankLost) throw_rank_lost(r, "TCPStore " + impl_->address() + ": " + what);
    if (s == Status::Timeout) {
      throw Error("TCPStore " + impl_->address() + ": " + what + " timed out after " +
                  std::to_string(timeout_.count()) + " ms: no rank set key " + quote_key(key));
    }
    std::string v = r.str();
    return Bytes(v.begin(), v.end());
  });
}

int64_t TCPStore::add(const std::string& key, int64_t delta) {
  return guarded(*impl_, "add", [&] {
    Writer w;
    w.u8(uint8_t(Cmd::Add)).str(key).i64(delta);
    std::string what = "add(" + quote_key(key) + ", " + std::to_string(delta) + ")";
    std::string body = impl_->roundtrip(w, timeout_, what);
    Reader r(body);
    expect_ok(r, "TCPStore " + impl_->address() + ": " + what);
    return r.i64();
  });
}

Bytes TCPStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  return guarded(*impl_, "compare_set", [&] {
    Writer w;
    w.u8(uint8_t(Cmd::CompareSet))
        .str(key)
        .bytes(expected.data(), expected.size())
        .bytes(desired.data(), desired.size());
    std::string what = op_name("compare_set", key);
    std::string body = impl_->roundtrip(w, timeout_, what);
    Reader r(body);
    expect_ok(r, "TCPStore " + impl_->address() + ": " + what);
    std::string v = r.str();
    return Bytes(v.begin(), v.end());
  });
}

bool TCPStore::check(const std::vector<std::string>& keys) {
  return guarded(*impl_, "check", [&] {
    Writer w;
    w.u8(uint8_t(Cmd::Check)).u32(static_cast<uint32_t>(keys.size()));
    for (const auto& k : keys) w.str(k);
    std::string body = impl_->roundtrip(w, timeout_, "check(" + quote_keys(keys) + ")");
    Reader r(body);
    expect_ok(r, "TCPStore " + impl_->address() + ": check");
    return r.u8() != 0;
  });
}

void TCPStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  guarded(*impl_, "wait", [&] {
    Writer w;
    w.u8(uint8_t(Cmd::Wait)).u32(static_cast<uint32_t>(keys.size()));
    for (const auto& k : keys) w.str(k);
    w.i64(std::max<int64_t>(timeout.count(), 0));
    std::string what = "wait(" + quote_keys(keys) + ")";
    std::string body = impl_->roundtrip(w, impl_->parked_reply(timeout), what);
    Reader r(body);
    Status s = static_cast<Status>(r.u8());
    if (s == Status::RankLost) throw_rank_lost(r, "TCPStore " + impl_->address() + ": " + what);
    if (s == Status::Timeout) {
      std::vector<std::string> missing = r.strs();
      throw Error("TCPStore " + impl_->address() + ": " + what + " timed out after " + std::to_string(timeout.count()) +
                  " ms; still missing: " + quote_keys(missing));
    }
  });
}

bool TCPStore::delete_key(const std::string& key) {
  return guarded(*impl_, "delete_key", [&] {
    Writer w;
    w.u8(uint8_t(Cmd::Delete)).str(key);
    std::string what = op_name("delete_key", key);
    std::string body = impl_->roundtrip(w, timeout_, what);
    Reader r(body);
    expect_ok(r, "TCPStore " + impl_->address() + ": " + what);
    return r.u8() != 0;
  });
}

int64_t TCPStore::num_keys() {
  return guarded(*impl_, "num_keys", [&] {
    Writer w;
    w.u8(uint8_t(Cmd::NumKeys));
    std::string body = impl_->roundtrip(w, timeout_, "num_keys()");
    Reader r(body);
    expect_ok(r, "TCPStore " + impl_->address() + ": num_keys()");
    return r.i64();
  });
}

std::vector<LostRank> TCPStore::lost_ranks() {
  return guarded(*impl_, "lost_ranks", [&]() -> std::vector<LostRank> {
    // Asked after a failure: with the connection gone (the server died), do
    // not spend the whole timeout reconnecting; say at once that we cannot tell.
    if (impl_->fd < 0)
      throw Error("TCPStore " + impl_->address() + ": lost_ranks(): the connection to the store is gone");
    Writer w;
    w.u8(uint8_t(Cmd::Lost));
    std::string body = impl_->roundtrip(w, timeout_, "lost_ranks()");
    Reader r(body);
    expect_ok(r, "TCPStore " + impl_->address() + ": lost_ranks()");
    return read_lost(r);
  });
}

std::vector<LostRank> TCPStore::lost_ranks_since(Millis window) {
  return guarded(*impl_, "lost_ranks_since", [&]() -> std::vector<LostRank> {
    if (impl_->fd < 0)
      throw Error("TCPStore " + impl_->address() + ": lost_ranks_since(): the connection to the store is gone");
    Writer w;
    w.u8(uint8_t(Cmd::LostSince)).i64(window.count());
    std::string body = impl_->roundtrip(w, timeout_, "lost_ranks_since()");
    Reader r(body);
    expect_ok(r, "TCPStore " + impl_->address() + ": lost_ranks_since()");
    return read_lost_since(r);
  });
}

}  // namespace ember::distributed
