// The TCPStore server: one thread with an epoll loop serves every rank's
// connection (see tcp_store.cc for the protocol, the security model and the
// lost-rank rule). Blocking requests (get, wait, waiting for workers) are
// parked with a deadline and answered when the keys appear, the deadline
// passes, or a rank is lost, so a timed-out request never leaves a late
// reply on the wire.
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <iostream>
#include <thread>
#include <unordered_map>

#include "core/exception.h"
#include "distributed/store/tcp_store_wire.h"

namespace ember::distributed::wire {
namespace {

// ---------------------------------------------------------------------------
// Server

class StoreServer : public Server {
 public:
  StoreServer(const std::string& host, int port, bool listen_on_all, std::string token) : token_(std::move(token)) {
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

  ~StoreServer() override {
    uint64_t one = 1;
    ssize_t w = write(wake_fd_, &one, sizeof one);
    (void)w;
    if (thread_.joinable()) thread_.join();
    for (auto& [fd, conn] : conns_) close(fd);
    close_fds();
  }

  int port() const override { return port_; }

 private:
  struct Conn {
    std::string in;
    std::string out;
    std::string peer;         // "address:port", for logs and lost-rank reports
    int rank = -1;            // the rank it speaks for (Hello), -1 for none
    int64_t incarnation = 0;  // the client process's id (Hello), 0 if it sent none
    bool said_bye = false;
    bool greeted = false;
    bool blocked = false;  // a parked request; later frames wait behind it
    bool writing = false;  // EPOLLOUT registered
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
    std::string out;
    if (std::strchr(host, ':') != nullptr) {  // IPv6: [addr]:port
      out += '[';
      out += host;
      out += ']';
    } else {
      out += host;
    }
    out += ':';
    out += serv;
    return out;
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
      if (a.ss_family == AF_INET6)
        reinterpret_cast<sockaddr_in6*>(&a)->sin6_port = htons(uint16_t(want));
      else
        reinterpret_cast<sockaddr_in*>(&a)->sin_port = htons(uint16_t(want));
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
    auto first = std::min_element(waiters_.begin(), waiters_.end(), [](const Waiter& a, const Waiter& b) {
                   return a.deadline < b.deadline;
                 })->deadline;
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
      lost_.push_back({c.rank, c.peer, Clock::now(), c.incarnation});
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
      std::cerr << "TCPStore server on port " << port_ << ": refused a client from " << c.peer << ": " << why << " ("
                << refused_ << " refused so far)\n";
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
          reply(fd, c,
                w.u8(uint8_t(Status::Error))
                    .str("the value stored at " + quote_key(key) + " is not an integer: " + quote_key(it->second)));
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
        const int64_t incarnation = r.at_end() ? 0 : r.i64();
        r.done();
        if (rank < 0 || rank > INT32_MAX) throw ProtocolError("bad rank");
        c.rank = static_cast<int>(rank);
        c.incarnation = incarnation;
        // A live client reconnecting (its own socket timed out: the same
        // process) is not lost. Another process with the rank replaces a lost
        // one: the rank is no longer lost for what comes next, but the groups
        // that lived when it died still learn of it (LostSince).
        for (const Lost& l : lost_)
          if (l.rank == c.rank && (l.incarnation == 0 || l.incarnation != incarnation)) {
            replaced_.push_back(l);
            if (replaced_.size() > kReplacedKept) replaced_.pop_front();
          }
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
      case Cmd::LostSince: {
        const Millis window{r.i64()};
        r.done();
        const auto now = Clock::now();
        std::vector<std::pair<const Lost*, bool>> hits;
        for (const Lost& l : replaced_)
          if (now - l.when <= window) hits.push_back({&l, true});
        for (const Lost& l : lost_)
          if (now - l.when <= window) hits.push_back({&l, false});
        w.u8(uint8_t(Status::Ok)).u32(static_cast<uint32_t>(hits.size()));
        for (const auto& [l, replaced] : hits)
          w.i64(l->rank).str(l->peer).i64(std::chrono::duration_cast<Millis>(now - l->when).count()).u8(replaced);
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
    for (const Lost& l : lost_) w.i64(l.rank).str(l.peer).i64(std::chrono::duration_cast<Millis>(now - l.when).count());
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

  // Answers, and unparks, the waiters `done` picks: as timed out or not.
  template <typename Done>
  void answer_waiters(Done done, bool timed_out) {
    for (size_t i = 0; i < waiters_.size();) {
      if (done(waiters_[i])) {
        Waiter w = std::move(waiters_[i]);
        waiters_.erase(waiters_.begin() + static_cast<std::ptrdiff_t>(i));
        answer(conns_.at(w.fd), w.fd, w, timed_out);
      } else {
        ++i;
      }
    }
  }

  void wake_waiters() {
    answer_waiters([&](const Waiter& w) { return satisfied(w); }, false);
  }

  void expire_waiters() {
    const auto now = Clock::now();
    answer_waiters([&](const Waiter& w) { return w.deadline <= now; }, true);
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
    int64_t incarnation;
  };
  // Replaced losses kept for LostSince: a few recoveries' worth.
  static constexpr size_t kReplacedKept = 256;

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
  std::deque<Lost> replaced_;  // lost ranks a new process has since taken (oldest first)
  int64_t refused_ = 0;
};

}  // namespace

std::unique_ptr<Server> start_server(const std::string& host, int port, bool listen_on_all, std::string token) {
  return std::make_unique<StoreServer>(host, port, listen_on_all, std::move(token));
}

}  // namespace ember::distributed::wire
