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
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <iostream>
#include <mutex>
#include <string_view>
#include <thread>
#include <unordered_map>

#include "core/exception.h"
#include "distributed/store.h"
#include "distributed/store_internal.h"

namespace ember::distributed {
namespace {

using detail::Clock;
using detail::deadline_after;
using detail::quote_key;
using detail::quote_keys;
using detail::remaining;

constexpr char kMagic[8] = {'E', 'M', 'B', 'R', 'S', 'T', 'O', '1'};
// How long a listener on the store's port may take to answer the handshake.
constexpr Millis kHandshakeReply{5000};
// Rendezvous payloads are addresses and ids; a frame this large is a bug or
// garbage, and refusing it keeps a bad client from exhausting the server.
constexpr uint32_t kMaxFrame = 1u << 30;
// The server answers a blocking request at its deadline; the client waits
// this much longer before concluding that the server itself is gone.
constexpr Millis kReplyGrace{5000};

enum class Cmd : uint8_t { Set = 1, Get, Add, CompareSet, Check, Wait, Delete, NumKeys, WaitWorkers, Hello, Bye, Lost };
enum class Status : uint8_t { Ok = 0, Timeout = 1, Error = 2, RankLost = 3 };
// A token is a short secret; a longer first frame is not one of our clients.
constexpr uint32_t kMaxToken = 4096;

struct ProtocolError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string errno_text(int err) { return std::strerror(err); }

// Builds one frame; the length prefix is patched in by finish().
class Writer {
 public:
  Writer() : buf_(4, '\0') {}
  Writer& u8(uint8_t v) {
    buf_.push_back(static_cast<char>(v));
    return *this;
  }
  Writer& u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) buf_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return *this;
  }
  Writer& i64(int64_t v) {
    uint64_t u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) buf_.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
    return *this;
  }
  Writer& bytes(const void* p, size_t n) {
    u32(static_cast<uint32_t>(n));
    buf_.append(static_cast<const char*>(p), n);
    return *this;
  }
  Writer& str(std::string_view s) { return bytes(s.data(), s.size()); }
  std::string finish() {
    uint32_t n = static_cast<uint32_t>(buf_.size() - 4);
    for (int i = 0; i < 4; ++i) buf_[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return std::move(buf_);
  }
  size_t size() const { return buf_.size() - 4; }

 private:
  std::string buf_;
};

uint32_t load_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<unsigned char>(p[i])} << (8 * i);
  return v;
}

class Reader {
 public:
  explicit Reader(std::string_view s) : s_(s) {}
  uint8_t u8() {
    need(1);
    return static_cast<uint8_t>(s_[pos_++]);
  }
  uint32_t u32() {
    need(4);
    uint32_t v = load_u32(s_.data() + pos_);
    pos_ += 4;
    return v;
  }
  int64_t i64() {
    need(8);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t{static_cast<unsigned char>(s_[pos_ + i])} << (8 * i);
    pos_ += 8;
    return static_cast<int64_t>(v);
  }
  std::string str() {
    uint32_t n = u32();
    need(n);
    std::string out(s_.substr(pos_, n));
    pos_ += n;
    return out;
  }
  std::vector<std::string> strs() {
    const uint32_t n = count(4);  // each key costs at least its 4-byte length
    std::vector<std::string> out;
    out.reserve(n);
    for (uint32_t i = 0; i < n; ++i) out.push_back(str());
    return out;
  }
  // A count of records of at least `min_bytes` each, checked against what
  // the frame holds before anything is allocated for them.
  uint32_t count(size_t min_bytes) {
    uint32_t n = u32();
    if (n > (s_.size() - pos_) / min_bytes) throw ProtocolError("record count exceeds the frame");
    return n;
  }
  void done() const {
    if (pos_ != s_.size()) throw ProtocolError("trailing bytes in frame");
  }

 private:
  void need(size_t n) const {
    if (s_.size() - pos_ < n) throw ProtocolError("truncated frame");
  }
  std::string_view s_;
  size_t pos_ = 0;
};

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// Values are decimal text so that get() of a counter reads like c10d's.
bool parse_int(const std::string& s, int64_t* out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size() && !s.empty();
}

// ---------------------------------------------------------------------------
// Server

class StoreServer {
 public:
  StoreServer(const std::string& host, int port, bool listen_on_all, std::string token)
      : token_(std::move(token)) {
    listen_fds_ = listen_on_all ? std::vector<int>{open_any_listener(port)} : open_host_listeners(host, port);
    port_ = bound_port(listen_fds_[0]);
    wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    if (wake_fd_ < 0 || epoll_fd_ < 0) {
      int err = errno;
      close_fds();
      throw Error("TCPStore: cannot create the server's event loop: " + errno_text(err));
    }
    for (int fd : listen_fds_) watch(fd, EPOLLIN);
    watch(wake_fd_, EPOLLIN);
    thread_ = std::thread([this] { run(); });
  }

  ~StoreServer() {
    uint64_t one = 1;
    ssize_t w = write(wake_fd_, &one, sizeof one);
    (void)w;
    if (thread_.joinable()) thread_.join();
    for (auto& [fd, conn] : conns_) close(fd);
    close_fds();
  }

  int port() const { return port_; }

 private:
  struct Conn {
    std::string in;
    std::string out;
    std::string peer;         // "address:port", for logs and lost-rank reports
    int rank = -1;            // the rank it speaks for (Hello), -1 for none
    bool said_bye = false;
    bool greeted = false;
    bool blocked = false;     // a parked request; later frames wait behind it
    bool writing = false;     // EPOLLOUT registered
    bool closing = false;
  };
  struct Waiter {
    int fd;
    Cmd cmd;
    std::vector<std::string> keys;
    int64_t workers = 0;
    Clock::time_point deadline;
  };

  static int bound_port(int fd) {
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    return ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  }

  static std::string numeric(const sockaddr* a, socklen_t len, bool with_port) {
    char host[NI_MAXHOST] = "?", serv[NI_MAXSERV] = "?";
    getnameinfo(a, len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV);
    if (!with_port) return host;
    bool v6 = std::strchr(host, ':') != nullptr;
    return (v6 ? "[" + std::string(host) + "]" : std::string(host)) + ":" + serv;
  }

  [[noreturn]] static void throw_listen_error(const std::string& where, int port, int err) {
    throw Error("TCPStore: cannot listen on port " + std::to_string(port) + " " + where + ": " + errno_text(err) +
                (err == EADDRINUSE ? " (another job or a previous run holds it; pick another "
                                     "MASTER_PORT, or port 0 for a free one)"
                                   : ""));
  }

  // Listens on each address `host` resolves to, and nowhere else: a store
  // for MASTER_ADDR=127.0.0.1 cannot be reached from another machine. The
  // first address fixes the port (port 0 picks one) for the others.
  static std::vector<int> open_host_listeners(const std::string& host, int port) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
    if (rc != 0) throw Error("TCPStore: cannot resolve the store's host '" + host + "': " + gai_strerror(rc));
    std::vector<int> fds;
    std::vector<std::string> tried;
    int last_err = 0;
    for (addrinfo* ai = res; ai; ai = ai->ai_next) {
      std::string addr = numeric(ai->ai_addr, ai->ai_addrlen, false);
      if (std::find(tried.begin(), tried.end(), addr) != tried.end()) continue;
      tried.push_back(addr);
      int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) {
        last_err = errno;
        continue;
      }
      int one = 1;
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (ai->ai_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
      sockaddr_storage a{};
      std::memcpy(&a, ai->ai_addr, ai->ai_addrlen);
      const int want = fds.empty() ? port : bound_port(fds[0]);
      if (a.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&a)->sin6_port = htons(uint16_t(want));
      else reinterpret_cast<sockaddr_in*>(&a)->sin_port = htons(uint16_t(want));
      if (bind(fd, reinterpret_cast<sockaddr*>(&a), ai->ai_addrlen) == 0 && listen(fd, SOMAXCONN) == 0) {
        fds.push_back(fd);
        continue;
      }
      int err = errno;
      close(fd);
      // The port taken on the first address is an error of its own; on a
      // later one (port 0 chose a port free on the first only) it is not.
      if (err == EADDRINUSE && fds.empty()) {
        freeaddrinfo(res);
        throw_listen_error("at " + host + " (" + addr + ")", port, err);
      }
      last_err = err;
    }
    freeaddrinfo(res);
    if (fds.empty()) {
      std::string list;
      for (const auto& a : tried) list += (list.empty() ? "" : ", ") + a;
      throw Error("TCPStore: cannot listen at '" + host + "' port " + std::to_string(port) + ": it resolves to " +
                  list + ", none of which this machine can listen on (" + errno_text(last_err) +
                  "); the process hosting the store (rank 0) must run on the host MASTER_ADDR names, or set "
                  "EMBER_STORE_LISTEN_ALL=1 to listen on every interface");
    }
    return fds;
  }

  // Listens on every interface, as c10d does (listen_on_all). Dual-stack
  // IPv6 first so "localhost" resolving to ::1 works; plain IPv4 where IPv6
  // is disabled.
  static int open_any_listener(int port) {
    int last_err = 0;
    for (int family : {AF_INET6, AF_INET}) {
      int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) {
        last_err = errno;
        continue;
      }
      int one = 1, zero = 0;
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      int rc;
      if (family == AF_INET6) {
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
        sockaddr_in6 a{};
        a.sin6_family = AF_INET6;
        a.sin6_addr = in6addr_any;
        a.sin6_port = htons(static_cast<uint16_t>(port));
        rc = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
      } else {
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_ANY);
        a.sin_port = htons(static_cast<uint16_t>(port));
        rc = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
      }
      if (rc == 0 && listen(fd, SOMAXCONN) == 0) return fd;
      last_err = errno;
      close(fd);
      // A port already taken is taken for both families; do not hide that
      // error behind the IPv4 retry.
      if (last_err == EADDRINUSE) break;
    }
    throw_listen_error("on every interface", port, last_err);
  }

  void close_fds() {
    for (int fd : listen_fds_) close(fd);
    listen_fds_.clear();
    if (wake_fd_ >= 0) close(wake_fd_);
    if (epoll_fd_ >= 0) close(epoll_fd_);
    wake_fd_ = epoll_fd_ = -1;
  }

  void watch(int fd, uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.fd = fd;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
  }

  void run() {
    epoll_event events[64];
    for (;;) {
      int n = epoll_wait(epoll_fd_, events, 64, next_timeout_ms());
      if (n < 0) {
        if (errno == EINTR) continue;
        std::cerr << "TCPStore server on port " << port_ << ": epoll_wait failed: " << errno_text(errno)
                  << "; the store stops serving\n";
        return;
      }
      for (int i = 0; i < n; ++i) {
        int fd = events[i].data.fd;
        if (fd == wake_fd_) return;
        if (std::find(listen_fds_.begin(), listen_fds_.end(), fd) != listen_fds_.end()) {
          accept_all(fd);
          continue;
        }
        auto it = conns_.find(fd);
        if (it == conns_.end() || it->second.closing) continue;
        if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) read_from(fd, it->second);
        if (!it->second.closing) process(fd, it->second);
        if (!it->second.closing) flush(fd, it->second);
      }
      expire_waiters();
      fail_waiters_if_lost();
      drain_ready();
      reap();
    }
  }

  int next_timeout_ms() const {
    if (waiters_.empty()) return -1;
    auto first = std::min_element(waiters_.begin(), waiters_.end(),
                                  [](const Waiter& a, const Waiter& b) { return a.deadline < b.deadline; })
                     ->deadline;
    auto left = std::chrono::duration_cast<std::chrono::microseconds>(first - Clock::now()).count();
    if (left <= 0) return 0;
    // Round up: waking a hair early would only spin once more.
    return static_cast<int>(std::min<int64_t>((left + 999) / 1000, 1 << 30));
  }

  void accept_all(int listen_fd) {
    for (;;) {
      sockaddr_storage addr{};
      socklen_t len = sizeof addr;
      int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
      // EAGAIN: the backlog is drained. EMFILE and friends leave the
      // connection queued, and epoll reports it again.
      if (fd < 0) return;
      set_nodelay(fd);
      Conn c;
      c.peer = numeric(reinterpret_cast<sockaddr*>(&addr), len, true);
      conns_[fd] = std::move(c);
      watch(fd, EPOLLIN);
    }
  }

  void read_from(int fd, Conn& c) {
    char buf[64 * 1024];
    for (;;) {
      ssize_t r = recv(fd, buf, sizeof buf, 0);
      if (r > 0) {
        c.in.append(buf, static_cast<size_t>(r));
        continue;
      }
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      drop(fd, c);  // EOF or a reset: the client is gone
      return;
    }
  }

  void drop(int fd, Conn& c) {
    if (c.closing) return;
    c.closing = true;
    std::erase_if(waiters_, [fd](const Waiter& w) { return w.fd == fd; });
    if (c.rank >= 0 && !c.said_bye) {
      // One entry per rank however often it reconnects and drops.
      std::erase_if(lost_, [&](const Lost& l) { return l.rank == c.rank; });
      lost_.push_back({c.rank, c.peer, Clock::now()});
      std::cerr << "TCPStore server on port " << port_ << ": rank " << c.rank << " (connection from " << c.peer
                << ") closed its connection without saying goodbye: its process exited, crashed or was killed; "
                   "failing every request that waits\n";
    }
  }

  // Refused clients are logged, but a scanner hammering the port must not
  // flood the log: the first few, then every 100th.
  void log_refused(const Conn& c, const std::string& why) {
    ++refused_;
    if (refused_ <= 10 || refused_ % 100 == 0)
      std::cerr << "TCPStore server on port " << port_ << ": refused a client from " << c.peer << ": " << why
                << " (" << refused_ << " refused so far)\n";
  }

  void reap() {
    for (auto it = conns_.begin(); it != conns_.end();) {
      if (it->second.closing) {
        epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, it->first, nullptr);
        close(it->first);
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void flush(int fd, Conn& c) {
    size_t sent = 0;
    while (sent < c.out.size()) {
      ssize_t w = send(fd, c.out.data() + sent, c.out.size() - sent, MSG_NOSIGNAL);
      if (w > 0) {
        sent += static_cast<size_t>(w);
        continue;
      }
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      drop(fd, c);
      return;
    }
    c.out.erase(0, sent);
    bool want = !c.out.empty();
    if (want != c.writing) {
      epoll_event ev{};
      ev.events = EPOLLIN | (want ? EPOLLOUT : 0u);
      ev.data.fd = fd;
      epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, fd, &ev);
      c.writing = want;
    }
  }

  // The opening: magic, then a frame with the client's token. False while
  // it is incomplete or when the client was refused.
  bool greet(int fd, Conn& c) {
    if (c.in.size() < sizeof kMagic) return false;
    if (std::memcmp(c.in.data(), kMagic, sizeof kMagic) != 0) {
      log_refused(c, "it did not open with the store's handshake (not an ember store client)");
      drop(fd, c);
      return false;
    }
    if (c.in.size() < sizeof kMagic + 4) return false;
    const uint32_t len = load_u32(c.in.data() + sizeof kMagic);
    if (len > kMaxToken) {
      log_refused(c, "malformed handshake");
      drop(fd, c);
      return false;
    }
    if (c.in.size() < sizeof kMagic + 4 + len) return false;
    std::string token;
    try {
      Reader r(std::string_view(c.in).substr(sizeof kMagic + 4, len));
      token = r.str();
      r.done();
    } catch (const ProtocolError&) {
      log_refused(c, "malformed handshake");
      drop(fd, c);
      return false;
    }
    c.in.erase(0, sizeof kMagic + 4 + len);
    // Answer in kind, so a client can tell a store from any other program
    // that happens to listen on the port.
    c.out.append(kMagic, sizeof kMagic);
    Writer w;
    if (!tokens_match(token)) {
      const char* why = token.empty() ? "it presented no job token (EMBER_STORE_TOKEN)"
                                      : "it presented a wrong job token (EMBER_STORE_TOKEN)";
      log_refused(c, why);
      c.out += w.u8(uint8_t(Status::Error)).str(std::string("refused: ") + why).finish();
      flush(fd, c);
      drop(fd, c);
      return false;
    }
    c.out += w.u8(uint8_t(Status::Ok)).finish();
    flush(fd, c);
    c.greeted = true;
    ++workers_seen_;
    wake_waiters();
    return true;
  }

  // Every byte compared whatever the first difference, so the time taken
  // does not tell a guesser how much of the token was right.
  bool tokens_match(const std::string& given) const {
    if (token_.empty()) return true;
    unsigned diff = given.size() != token_.size();
    for (size_t i = 0; i < token_.size(); ++i) diff |= uint8_t(token_[i]) ^ uint8_t(i < given.size() ? given[i] : 0);
    return diff == 0;
  }

  // Parses and answers the complete frames buffered on one connection.
  void process(int fd, Conn& c) {
    if (!c.greeted && !greet(fd, c)) return;
    size_t pos = 0;
    while (!c.blocked && !c.closing && c.in.size() - pos >= 4) {
      uint32_t len = load_u32(c.in.data() + pos);
      if (len > kMaxFrame) {
        drop(fd, c);
        break;
      }
      if (c.in.size() - pos - 4 < len) break;
      std::string_view body(c.in.data() + pos + 4, len);
      pos += 4 + len;
      try {
        handle(fd, c, body);
      } catch (const std::exception&) {
        // ProtocolError, or bad_alloc from a hostile size: drop the client,
        // keep serving the others.
        drop(fd, c);
      }
    }
    c.in.erase(0, pos);
  }

  void reply(int fd, Conn& c, Writer& w) {
    c.out += w.finish();
    flush(fd, c);
  }

  void handle(int fd, Conn& c, std::string_view body) {
    Reader r(body);
    Cmd cmd = static_cast<Cmd>(r.u8());
    Writer w;
    switch (cmd) {
      case Cmd::Set: {
        std::string key = r.str(), value = r.str();
        r.done();
        data_[std::move(key)] = std::move(value);
        reply(fd, c, w.u8(uint8_t(Status::Ok)));
        wake_waiters();
        return;
      }
      case Cmd::Get:
      case Cmd::Wait: {
        std::vector<std::string> keys;
        if (cmd == Cmd::Get) {
          keys.push_back(r.str());
        } else {
          keys = r.strs();
        }
        int64_t timeout_ms = r.i64();
        r.done();
        park(fd, c, Waiter{fd, cmd, std::move(keys), 0, deadline_after(Millis{timeout_ms})});
        return;
      }
      case Cmd::WaitWorkers: {
        int64_t n = r.i64(), timeout_ms = r.i64();
        r.done();
        park(fd, c, Waiter{fd, cmd, {}, n, deadline_after(Millis{timeout_ms})});
        return;
      }
      case Cmd::Add: {
        std::string key = r.str();
        int64_t delta = r.i64();
        r.done();
        int64_t current = 0;
        auto it = data_.find(key);
        if (it != data_.end() && !parse_int(it->second, &current)) {
          reply(fd, c, w.u8(uint8_t(Status::Error)).str("the value stored at " + quote_key(key) +
                                                        " is not an integer: " + quote_key(it->second)));
          return;
        }
        int64_t result = current + delta;
        data_[key] = std::to_string(result);
        reply(fd, c, w.u8(uint8_t(Status::Ok)).i64(result));
        wake_waiters();
        return;
      }
      case Cmd::CompareSet: {
        std::string key = r.str(), expected = r.str(), desired = r.str();
        r.done();
        auto it = data_.find(key);
        if (it == data_.end()) {
          if (!expected.empty()) {
            reply(fd, c, w.u8(uint8_t(Status::Ok)).str(""));
            return;
          }
          it = data_.emplace(key, std::move(desired)).first;
          reply(fd, c, w.u8(uint8_t(Status::Ok)).str(it->second));
          wake_waiters();
          return;
        }
        if (it->second == expected) it->second = std::move(desired);
        reply(fd, c, w.u8(uint8_t(Status::Ok)).str(it->second));
        wake_waiters();
        return;
      }
      case Cmd::Check: {
        std::vector<std::string> keys = r.strs();
        r.done();
        bool all = std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data_.count(k); });
        reply(fd, c, w.u8(uint8_t(Status::Ok)).u8(all));
        return;
      }
      case Cmd::Delete: {
        std::string key = r.str();
        r.done();
        bool existed = data_.erase(key) > 0;
        reply(fd, c, w.u8(uint8_t(Status::Ok)).u8(existed));
        return;
      }
      case Cmd::NumKeys: {
        r.done();
        reply(fd, c, w.u8(uint8_t(Status::Ok)).i64(static_cast<int64_t>(data_.size())));
        return;
      }
      case Cmd::Hello: {
        int64_t rank = r.i64();
        r.done();
        if (rank < 0 || rank > INT32_MAX) throw ProtocolError("bad rank");
        c.rank = static_cast<int>(rank);
        // A live client reconnecting (its own socket timed out) is not lost.
        std::erase_if(lost_, [&](const Lost& l) { return l.rank == c.rank; });
        reply(fd, c, w.u8(uint8_t(Status::Ok)));
        return;
      }
      case Cmd::Bye: {
        r.done();
        c.said_bye = true;
        reply(fd, c, w.u8(uint8_t(Status::Ok)));
        return;
      }
      case Cmd::Lost: {
        r.done();
        w.u8(uint8_t(Status::Ok));
        write_lost(w);
        reply(fd, c, w);
        return;
      }
    }
    throw ProtocolError("unknown command");
  }

  bool satisfied(const Waiter& w) const {
    if (w.cmd == Cmd::WaitWorkers) return workers_seen_ >= w.workers;
    return std::all_of(w.keys.begin(), w.keys.end(), [&](const std::string& k) { return data_.count(k); });
  }

  void write_lost(Writer& w) const {
    const auto now = Clock::now();
    w.u32(static_cast<uint32_t>(lost_.size()));
    for (const Lost& l : lost_)
      w.i64(l.rank).str(l.peer).i64(std::chrono::duration_cast<Millis>(now - l.when).count());
  }

  enum class Outcome { Satisfied, TimedOut, RankLost };

  void answer(Conn& c, int fd, const Waiter& w, bool timed_out) {
    answer(c, fd, w, timed_out ? Outcome::TimedOut : Outcome::Satisfied);
  }

  void answer(Conn& c, int fd, const Waiter& w, Outcome outcome) {
    const bool timed_out = outcome != Outcome::Satisfied;
    Writer out;
    if (outcome == Outcome::RankLost) {
      out.u8(uint8_t(Status::RankLost));
      write_lost(out);
    } else if (!timed_out) {
      out.u8(uint8_t(Status::Ok));
      if (w.cmd == Cmd::Get) out.str(data_.at(w.keys[0]));
    } else {
      out.u8(uint8_t(Status::Timeout));
      if (w.cmd == Cmd::WaitWorkers) {
        out.i64(workers_seen_);
      } else {
        uint32_t missing = 0;
        for (const auto& k : w.keys) missing += data_.count(k) == 0;
        out.u32(missing);
        for (const auto& k : w.keys)
          if (!data_.count(k)) out.str(k);
      }
    }
    c.blocked = false;
    c.out += out.finish();
    flush(fd, c);
    ready_.push_back(fd);
  }

  void park(int fd, Conn& c, Waiter w) {
    if (satisfied(w)) {
      answer(c, fd, w, false);
      return;
    }
    if (!lost_.empty()) {
      answer(c, fd, w, Outcome::RankLost);
      return;
    }
    if (Clock::now() >= w.deadline) {
      answer(c, fd, w, true);
      return;
    }
    c.blocked = true;
    waiters_.push_back(std::move(w));
  }

  void wake_waiters() {
    for (size_t i = 0; i < waiters_.size();) {
      if (satisfied(waiters_[i])) {
        Waiter w = std::move(waiters_[i]);
        waiters_.erase(waiters_.begin() + static_cast<std::ptrdiff_t>(i));
        answer(conns_.at(w.fd), w.fd, w, false);
      } else {
        ++i;
      }
    }
  }

  void expire_waiters() {
    auto now = Clock::now();
    for (size_t i = 0; i < waiters_.size();) {
      if (waiters_[i].deadline <= now) {
        Waiter w = std::move(waiters_[i]);
        waiters_.erase(waiters_.begin() + static_cast<std::ptrdiff_t>(i));
        answer(conns_.at(w.fd), w.fd, w, true);
      } else {
        ++i;
      }
    }
  }

  void fail_waiters_if_lost() {
    if (lost_.empty()) return;
    std::vector<Waiter> parked;
    parked.swap(waiters_);
    for (const Waiter& w : parked) {
      auto it = conns_.find(w.fd);
      if (it != conns_.end() && !it->second.closing) answer(it->second, w.fd, w, Outcome::RankLost);
    }
  }

  // A connection whose parked request was just answered may have further
  // requests buffered behind it; serve them now, not on its next packet.
  void drain_ready() {
    while (!ready_.empty()) {
      int fd = ready_.back();
      ready_.pop_back();
      auto it = conns_.find(fd);
      if (it != conns_.end() && !it->second.closing && !it->second.blocked) process(fd, it->second);
    }
  }

  struct Lost {
    int rank;
    std::string peer;
    Clock::time_point when;
  };

  std::vector<int> listen_fds_;
  int wake_fd_ = -1, epoll_fd_ = -1;
  int port_ = 0;
  const std::string token_;
  std::thread thread_;
  // Everything below is touched by the server thread only.
  std::unordered_map<int, Conn> conns_;
  std::unordered_map<std::string, std::string> data_;
  std::vector<Waiter> waiters_;
  std::vector<int> ready_;
  int64_t workers_seen_ = 0;
  std::vector<Lost> lost_;
  int64_t refused_ = 0;
};

}  // namespace

// ---------------------------------------------------------------------------
// Client

struct TCPStore::Impl {
  std::string host;
  int port = 0;
  TCPStoreOptions options;
  std::unique_ptr<StoreServer> server;
  std::mutex mu;  // one request in flight per socket
  int fd = -1;

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
    if (fd >= 0) close(fd);
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
          w.u8(uint8_t(Cmd::Hello)).i64(options.rank);
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
        std::fprintf(stderr, "TCPStore: still waiting for the store at %s (%lld s of %lld s; last error: %s)\n",
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
                std::to_string(timeout.count()) + " ms (last error: " + last_error +
                "); is the server process (rank 0, is_server=true) running and reachable at that address?");
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
        close(s);
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
          throw Error("TCPStore: the program listening at " + address() + " did not answer the store handshake within " +
                      std::to_string(kHandshakeReply.count()) + " ms: it is not an ember store (is the port used by "
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
    throw Error("TCPStore: the store at " + address() + " " + why + (options.token.empty()
                    ? "; this process has none: set EMBER_STORE_TOKEN to the job's token (the launcher sets it for "
                      "the workers it starts)"
                    : "; this process's EMBER_STORE_TOKEN differs from the job's (is it another job's store?)"));
  }

  bool send_all(const char* p, size_t n, Clock::time_point deadline) {
    while (n > 0) {
      ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
      if (w > 0) {
        p += w;
        n -= static_cast<size_t>(w);
        continue;
      }
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (!wait_fd(POLLOUT, deadline)) return false;
        continue;
      }
      return false;
    }
    return true;
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
  RecvResult recv_all(char* p, size_t n, Clock::time_point deadline) {
    while (n > 0) {
      ssize_t r = recv(fd, p, n, 0);
      if (r > 0) {
        p += r;
        n -= static_cast<size_t>(r);
        continue;
      }
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (!wait_fd(POLLIN, deadline)) return RecvResult::Timeout;
        continue;
      }
      return RecvResult::Closed;
    }
    return RecvResult::Ok;
  }

  // Sends one request and returns the reply body. Any transport failure
  // drops the socket (a half-read reply would desynchronise the stream); the
  // next call reconnects.
  std::string roundtrip(Writer& request, Millis reply_within, const std::string& what) {
    EMBER_CHECK(request.size() <= kMaxFrame, "TCPStore ", address(), ": ", what, ": request of ", request.size(),
                " bytes exceeds the store's limit of ", kMaxFrame, " bytes");
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
                  std::to_string(reply_within.count()) + " ms");
    }
    if (rr == RecvResult::Closed) {
      disconnect();
      throw Error("TCPStore " + address() + ": " + what +
                  ": the store server closed the connection (did the rank hosting it, usually rank 0, exit?)");
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

// The server's answer to a blocking request once a rank is lost.
[[noreturn]] void throw_rank_lost(Reader& r, const std::string& where) {
  std::vector<LostRank> lost = read_lost(r);
  std::string who;
  for (const LostRank& l : lost) who += (who.empty() ? "" : ", ") + l.describe();
  throw RankLostError(where + " stopped waiting: " + who + (lost.size() == 1 ? " has" : " have") +
                          " left the job without saying goodbye (the process exited, crashed or was killed), so what "
                          "this call waits for may never come",
                      std::move(lost));
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
  EMBER_CHECK(!host.empty(), "TCPStore: empty host name (pass the address of the rank hosting the store, e.g. "
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
    impl_->server = std::make_unique<StoreServer>(impl_->host, port, options.listen_on_all, options.token);
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
    w.u8(uint8_t(Cmd::CompareSet)).str(key).bytes(expected.data(), expected.size()).bytes(desired.data(),
                                                                                           desired.size());
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
    // not spend the whole timeout reconnecting to say nothing.
    if (impl_->fd < 0) return {};
    Writer w;
    w.u8(uint8_t(Cmd::Lost));
    std::string body = impl_->roundtrip(w, timeout_, "lost_ranks()");
    Reader r(body);
    expect_ok(r, "TCPStore " + impl_->address() + ": lost_ranks()");
    return read_lost(r);
  });
}

}  // namespace ember::distributed
