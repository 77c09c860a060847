// Store tests with real processes: TCPStore over localhost with 1-4 forked
// ranks (rank 0 hosts the server), FileStore shared by forked processes,
// PrefixStore isolation, and Gloo's rendezvous and collectives over our
// adapter. Every blocking call runs under a short timeout and every child
// under a deadline, so a bug fails the test instead of hanging it.
#include "distributed/store/store.h"

#include <arpa/inet.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/exception.h"
#include "core/testing/error_of.h"

namespace ember::distributed {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

Bytes B(const std::string& s) { return Bytes(s.begin(), s.end()); }
std::string S(const Bytes& b) { return std::string(b.begin(), b.end()); }

using ::ember::testing::error_of;

int64_t ms_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

// Rank 0 learns its port only once its server listens (port 0); it passes
// the number to the other ranks through a pipe made before the fork.
class PortChannel {
 public:
  explicit PortChannel(int n) : n_(n) { EXPECT_EQ(pipe(fds_), 0); }
  ~PortChannel() {
    close(fds_[0]);
    close(fds_[1]);
  }
  void publish(int port) {
    std::vector<int> ports(n_ > 1 ? n_ - 1 : 0, port);
    if (ports.empty()) return;
    ssize_t w = write(fds_[1], ports.data(), ports.size() * sizeof(int));
    if (w != static_cast<ssize_t>(ports.size() * sizeof(int))) throw Error("PortChannel: short write");
  }
  int receive() {
    pollfd p{fds_[0], POLLIN, 0};
    if (poll(&p, 1, 20000) != 1) throw Error("PortChannel: rank 0 never published its port");
    int port = 0;
    if (read(fds_[0], &port, sizeof port) != sizeof port) throw Error("PortChannel: short read");
    return port;
  }

 private:
  int n_;
  int fds_[2];
};

// Runs body(rank) in n forked processes. A child reports an exception or a
// failed EXPECT through its exit status and a message pipe; the parent fails
// the test naming the rank, and kills children still running at the limit.
void run_ranks(int n, const std::function<void(int rank)>& body, std::chrono::milliseconds limit = 30s) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids(n);
  std::vector<int> msg_fds(n);
  for (int r = 0; r < n; ++r) {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(fds[0]);
      std::string msg;
      // Count only this child's failures, not ones the test had before forking.
      const ::testing::TestResult* result = ::testing::UnitTest::GetInstance()->current_test_info()->result();
      const int parts_before = result->total_part_count();
      try {
        body(r);
        if (result->total_part_count() > parts_before) msg = "an EXPECT failed (see this rank's output above)";
      } catch (const std::exception& e) {
        msg = std::string("exception: ") + e.what();
      } catch (...) {
        msg = "unknown exception";
      }
      if (!msg.empty()) {
        msg.resize(std::min<size_t>(msg.size(), 4000));
        ssize_t w = write(fds[1], msg.data(), msg.size());
        (void)w;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(msg.empty() ? 0 : 1);
    }
    close(fds[1]);
    pids[r] = pid;
    msg_fds[r] = fds[0];
  }
  // A child's pipe reaches EOF when it exits; poll them all until then.
  std::vector<std::string> msgs(n);
  std::vector<bool> done(n, false);
  auto deadline = Clock::now() + limit;
  int left = n;
  while (left > 0) {
    auto remaining = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (remaining <= 0) break;
    std::vector<pollfd> pfds;
    std::vector<int> ranks;
    for (int r = 0; r < n; ++r) {
      if (!done[r]) {
        pfds.push_back({msg_fds[r], POLLIN, 0});
        ranks.push_back(r);
      }
    }
    int pr = poll(pfds.data(), pfds.size(), static_cast<int>(remaining));
    if (pr <= 0) continue;
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (!pfds[i].revents) continue;
      char buf[1024];
      ssize_t got = read(pfds[i].fd, buf, sizeof buf);
      if (got > 0) {
        msgs[ranks[i]].append(buf, static_cast<size_t>(got));
      } else {
        done[ranks[i]] = true;
        --left;
      }
    }
  }
  for (int r = 0; r < n; ++r) {
    if (!done[r]) {
      kill(pids[r], SIGKILL);
      ADD_FAILURE() << "rank " << r << " of " << n << " did not finish within " << limit.count() << " ms";
    }
    int status = 0;
    waitpid(pids[r], &status, 0);
    close(msg_fds[r]);
    if (done[r] && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
      ADD_FAILURE() << "rank " << r << " of " << n
                    << " failed: " << (msgs[r].empty() ? "exit status " + std::to_string(status) : msgs[r]);
    }
  }
}

TCPStoreOptions server_opts(Millis timeout = 10s, int num_workers = -1) {
  TCPStoreOptions o;
  o.is_server = true;
  o.num_workers = num_workers;
  o.timeout = timeout;
  return o;
}
TCPStoreOptions client_opts(Millis timeout = 10s) {
  TCPStoreOptions o;
  o.timeout = timeout;
  return o;
}

// The semantics every store shares, checked on a fresh (empty) store.
void check_semantics(Store& store) {
  EXPECT_EQ(store.num_keys(), 0);
  store.set("a", B("alpha"));
  EXPECT_EQ(store.get_string("a"), "alpha");
  store.set("a", std::string("again"));  // overwrite
  EXPECT_EQ(S(store.get("a")), "again");
  store.set("empty", Bytes{});
  EXPECT_TRUE(store.get("empty").empty());
  Bytes binary = {0, 1, 255, 0, 7};
  store.set(std::string("bin\0key", 7), binary);
  EXPECT_EQ(store.get(std::string("bin\0key", 7)), binary);
  EXPECT_EQ(store.num_keys(), 3);

  EXPECT_EQ(store.add("n", 5), 5);  // absent counts as 0
  EXPECT_EQ(store.add("n", -7), -2);
  EXPECT_EQ(store.get_string("n"), "-2");  // decimal text, as c10d stores it
  EXPECT_THAT(error_of([&] { store.add("a", 1); }), HasSubstr("a\" is not an integer"));

  // compare_set: empty `expected` matches a missing key only.
  EXPECT_EQ(S(store.compare_set("cas", {}, B("one"))), "one");
  EXPECT_EQ(S(store.compare_set("cas", B("wrong"), B("two"))), "one");
  EXPECT_EQ(S(store.compare_set("cas", B("one"), B("two"))), "two");
  EXPECT_EQ(S(store.compare_set("cas", {}, B("three"))), "two");
  EXPECT_TRUE(store.compare_set("cas_missing", B("x"), B("y")).empty());
  EXPECT_FALSE(store.check({"cas_missing"}));

  EXPECT_TRUE(store.check({"a", "n", "cas"}));
  EXPECT_FALSE(store.check({"a", "nope"}));
  EXPECT_TRUE(store.check({}));
  store.wait({"a", "n"}, 100ms);  // present: returns at once

  EXPECT_EQ(store.num_keys(), 5);
  EXPECT_TRUE(store.delete_key("a"));
  EXPECT_FALSE(store.delete_key("a"));
  EXPECT_FALSE(store.check({"a"}));
  EXPECT_EQ(store.num_keys(), 4);
}

// ---------------------------------------------------------------------------
// TCPStore

TEST(TCPStore, SemanticsInOneProcess) {
  TCPStore server("127.0.0.1", 0, server_opts());
  EXPECT_GT(server.port(), 0);
  EXPECT_EQ(server.host(), "127.0.0.1");
  check_semantics(server);
  // A second client in the same process sees the same data.
  TCPStore client("127.0.0.1", server.port(), client_opts());
  EXPECT_EQ(client.get_string("n"), "-2");
  EXPECT_EQ(client.add("n", 2), 0);
  EXPECT_EQ(server.get_string("n"), "0");
}

TEST(TCPStore, LocalhostResolvesToTheServer) {
  TCPStore server("localhost", 0, server_opts());
  TCPStore client("localhost", server.port(), client_opts());
  client.set("k", std::string("v"));
  EXPECT_EQ(server.get_string("k"), "v");
}

// Rank 0 hosts a server on a free port and hands the port to the others.
std::shared_ptr<TCPStore> connect_rank(int rank, PortChannel& ports, Millis timeout = 10s) {
  if (rank == 0) {
    auto store = std::make_shared<TCPStore>("127.0.0.1", 0, server_opts(timeout));
    ports.publish(store->port());
    return store;
  }
  return std::make_shared<TCPStore>("127.0.0.1", ports.receive(), client_opts(timeout));
}

std::vector<std::string> keys_for(const std::string& prefix, int n) {
  std::vector<std::string> keys;
  for (int r = 0; r < n; ++r) keys.push_back(prefix + std::to_string(r));
  return keys;
}

// Every rank blocks until all n have arrived (a store-based barrier).
void barrier(Store& store, const std::string& name, int n) {
  if (store.add(name + "/count", 1) == n) store.set(name + "/open", std::string("1"));
  store.wait({name + "/open"});
}

// Rank 0 hosts the server: it stays until every rank is done with the store.
void finish(Store& store, int rank, int n) {
  store.set("finished/" + std::to_string(rank), std::string("1"));
  if (rank == 0) store.wait(keys_for("finished/", n));
}

// A port nobody listens on, held bound (not listening) so that no one can
// take it while the test runs: connecting to it is refused.
class DeadPort {
 public:
  DeadPort() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    socklen_t len = sizeof a;
    getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
  }
  ~DeadPort() { close(fd_); }
  int port() const { return port_; }

 private:
  int fd_, port_;
};

// A free port for tests where clients must know it before the server runs.
int free_port() {
  DeadPort p;
  return p.port();
}

TEST(TCPStore, RanksExchangeKeysForWorldSizes1To4) {
  for (int n = 1; n <= 4; ++n) {
    SCOPED_TRACE("world size " + std::to_string(n));
    PortChannel ports(n);
    run_ranks(n, [&](int rank) {
      auto store = connect_rank(rank, ports);
      store->set("rank/" + std::to_string(rank), "value " + std::to_string(rank));
      // get blocks until the other rank has set its key.
      for (int p = 0; p < n; ++p)
        EXPECT_EQ(store->get_string("rank/" + std::to_string(p)), "value " + std::to_string(p));
      store->wait(keys_for("rank/", n));
      EXPECT_TRUE(store->check(keys_for("rank/", n)));
      EXPECT_FALSE(store->check({"rank/" + std::to_string(n)}));
      barrier(*store, "b", n);
      // The first rank to swap wins; everyone sees the winner's value.
      Bytes winner = store->compare_set("leader", {}, B(std::to_string(rank)));
      int leader = std::stoi(S(winner));
      EXPECT_GE(leader, 0);
      EXPECT_LT(leader, n);
      EXPECT_EQ(store->get_string("leader"), std::to_string(leader));
      barrier(*store, "b2", n);
      if (rank == 0) {
        // rank/* (n), b/count, b/open, leader, b2/count, b2/open
        EXPECT_EQ(store->num_keys(), n + 5);
        EXPECT_TRUE(store->delete_key("leader"));
        store->set("deleted", std::string("1"));
      }
      store->wait({"deleted"});
      EXPECT_FALSE(store->check({"leader"}));
      finish(*store, rank, n);
    });
  }
}

TEST(TCPStore, ConcurrentAddFromFourProcessesIsExact) {
  constexpr int n = 4, kAdds = 250;
  PortChannel ports(n);
  run_ranks(n, [&](int rank) {
    auto store = connect_rank(rank, ports);
    barrier(*store, "start", n);  // all adding at once, not one after another
    int64_t last = 0;
    for (int i = 0; i < kAdds; ++i) {
      int64_t v = store->add("counter", rank + 1);
      EXPECT_GT(v, last);  // other ranks only add positive amounts
      last = v;
    }
    barrier(*store, "end", n);
    EXPECT_EQ(store->add("counter", 0), kAdds * (1 + 2 + 3 + 4));
    finish(*store, rank, n);
  });
}

TEST(TCPStore, ManyThreadsShareOneClient) {
  TCPStore store("127.0.0.1", 0, server_opts());
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 100; ++i) store.add("sum", t);
      store.set("thread/" + std::to_string(t), std::string("done"));
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(store.add("sum", 0), 100 * (0 + 1 + 2 + 3 + 4 + 5 + 6 + 7));
  EXPECT_TRUE(store.check(keys_for("thread/", 8)));
}

TEST(TCPStore, ServesManyClients) {
  TCPStore server("127.0.0.1", 0, server_opts());
  std::vector<std::unique_ptr<TCPStore>> clients;
  for (int i = 0; i < 100; ++i) {
    clients.push_back(std::make_unique<TCPStore>("127.0.0.1", server.port(), client_opts()));
    clients.back()->set("client/" + std::to_string(i), std::to_string(i));
  }
  // One client parked in a blocking get while the others keep working.
  std::thread parked([&] { EXPECT_EQ(clients[0]->get_string("late"), "here"); });
  for (int i = 1; i < 100; ++i)
    EXPECT_EQ(clients[i]->get_string("client/" + std::to_string(i - 1)), std::to_string(i - 1));
  clients[99]->set("late", std::string("here"));
  parked.join();
  EXPECT_EQ(server.num_keys(), 101);
}

TEST(TCPStore, BlockingCallsWakeWhenAnotherProcessSets) {
  PortChannel ports(2);
  run_ranks(2, [&](int rank) {
    auto store = connect_rank(rank, ports);
    if (rank == 1) {
      store->set("waiting", std::string("1"));
      store->wait({"late_a", "late_b"}, 10s);
      EXPECT_EQ(store->get_string("late_a"), "A");
      EXPECT_EQ(store->get_string("late_c"), "C");  // get blocks until rank 0 sets it
    } else {
      store->wait({"waiting"});
      store->set("late_a", std::string("A"));
      store->set("late_b", std::string("B"));
      store->set("late_c", std::string("C"));
    }
    finish(*store, rank, 2);
  });
}

TEST(TCPStore, GetOfAMissingKeyTimesOutNamingKeyAddressAndTimeout) {
  TCPStore store("127.0.0.1", 0, server_opts(300ms));
  const std::string addr = "127.0.0.1:" + std::to_string(store.port());
  auto t0 = Clock::now();
  std::string err = error_of([&] { store.get("missing/key"); });
  int64_t elapsed = ms_since(t0);
  EXPECT_GE(elapsed, 295);
  EXPECT_LT(elapsed, 3000);
  EXPECT_THAT(err, HasSubstr("\"missing/key\""));
  EXPECT_THAT(err, HasSubstr(addr));
  EXPECT_THAT(err, HasSubstr("300 ms"));

  // A timed-out request leaves nothing on the wire: the store still works.
  store.set("missing/key", std::string("now"));
  EXPECT_EQ(store.get_string("missing/key"), "now");

  // wait names the keys still missing, not the ones that arrived.
  t0 = Clock::now();
  err = error_of([&] { store.wait({"missing/key", "absent"}, 200ms); });
  elapsed = ms_since(t0);
  EXPECT_GE(elapsed, 195);
  EXPECT_LT(elapsed, 3000);
  EXPECT_THAT(err, HasSubstr("still missing: \"absent\""));
  EXPECT_THAT(err, Not(HasSubstr("still missing: \"missing/key\"")));
  EXPECT_THAT(err, HasSubstr("200 ms"));
  EXPECT_THAT(err, HasSubstr(addr));

  // The store-wide timeout can change after construction.
  store.set_timeout(100ms);
  EXPECT_THAT(error_of([&] { store.get("other"); }), HasSubstr("100 ms"));
}

TEST(TCPStore, ConnectingWithoutAServerFailsAfterTheTimeoutNamingHostPort) {
  DeadPort dead;
  auto t0 = Clock::now();
  std::string err = error_of([&] { TCPStore("127.0.0.1", dead.port(), client_opts(300ms)); });
  int64_t elapsed = ms_since(t0);
  EXPECT_GE(elapsed, 295);
  EXPECT_LT(elapsed, 3000);
  EXPECT_THAT(err, HasSubstr("127.0.0.1:" + std::to_string(dead.port())));
  EXPECT_THAT(err, HasSubstr("300 ms"));
  EXPECT_THAT(err, HasSubstr("refused"));
}

TEST(TCPStore, ClientsRetryUntilALateServerStartsAndTheServerWaitsForWorkers) {
  const int port = free_port();
  constexpr int n = 3;
  run_ranks(n, [&](int rank) {
    std::unique_ptr<TCPStore> store;
    if (rank == 0) {
      // Not synchronisation: the server starts late on purpose, so that the
      // clients' first connection attempts are refused and must be retried.
      std::this_thread::sleep_for(300ms);
      store = std::make_unique<TCPStore>("127.0.0.1", port, server_opts(10s, n));
      // The constructor returned, so every worker has connected.
      store->set("server_up", std::string("1"));
    } else {
      store = std::make_unique<TCPStore>("127.0.0.1", port, client_opts(10s));
      EXPECT_EQ(store->get_string("server_up"), "1");
    }
    finish(*store, rank, n);
  });
}

TEST(TCPStore, ServerGivesUpOnMissingWorkers) {
  auto t0 = Clock::now();
  std::string err = error_of([&] { TCPStore("127.0.0.1", 0, server_opts(300ms, 3)); });
  EXPECT_LT(ms_since(t0), 3000);
  EXPECT_THAT(err, HasSubstr("only 1 of 3 workers"));
  EXPECT_THAT(err, HasSubstr("300 ms"));
}

TEST(TCPStore, ServerExitFailsBlockedClientsPromptly) {
  PortChannel ports(2);
  run_ranks(2, [&](int rank) {
    auto store = connect_rank(rank, ports, 20s);
    if (rank == 1) {
      store->set("ready", std::string("1"));
      auto t0 = Clock::now();
      std::string err = error_of([&] { store->get("never_set"); });
      EXPECT_LT(ms_since(t0), 10000);
      EXPECT_THAT(err, HasSubstr("connection"));
      EXPECT_THAT(err, HasSubstr("127.0.0.1:"));
    } else {
      store->wait({"ready"});
      auto t0 = Clock::now();
      store.reset();  // the server shuts down with a client still connected
      EXPECT_LT(ms_since(t0), 2000);
    }
  });
}

TEST(TCPStore, RefusesABusyPortAndBadArguments) {
  TCPStore first("127.0.0.1", 0, server_opts());
  std::string err = error_of([&] { TCPStore("127.0.0.1", first.port(), server_opts()); });
  EXPECT_THAT(err, HasSubstr("cannot listen on port " + std::to_string(first.port())));
  EXPECT_THAT(err, HasSubstr("in use"));
  EXPECT_THAT(error_of([] { TCPStore("127.0.0.1", 0, client_opts()); }), HasSubstr("port 0"));
  EXPECT_THAT(error_of([] { TCPStore("127.0.0.1", 70000, client_opts()); }), HasSubstr("port 70000"));
  EXPECT_THAT(error_of([] { TCPStore("", 1234, client_opts()); }), HasSubstr("empty host"));
}

TEST(TCPStore, DropsAStrayConnectionAndKeepsServing) {
  TCPStore store("127.0.0.1", 0, server_opts());
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(store.port()));
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  const char http[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(write(fd, http, sizeof http - 1), static_cast<ssize_t>(sizeof http - 1));
  pollfd p{fd, POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 5000), 1) << "the server neither answered nor closed the stray connection";
  char buf[16];
  EXPECT_LE(read(fd, buf, sizeof buf), 0);  // closed, nothing sent
  close(fd);
  store.set("still", std::string("serving"));
  EXPECT_EQ(store.get_string("still"), "serving");
}

// Regressions: what waiting cannot fix fails at once, naming the cause
// (before, each retried silently for the whole timeout, 10 minutes by default).
TEST(TCPStore, AHostThatDoesNotResolveFailsAtOnce) {
  auto t0 = Clock::now();
  std::string err = error_of([&] { TCPStore("no-such-host.invalid", 29500, client_opts(60s)); });
  EXPECT_LT(ms_since(t0), 10000) << err;
  EXPECT_THAT(err, HasSubstr("cannot resolve the store's host 'no-such-host.invalid'"));
}

TEST(TCPStore, AListenerThatIsNotAStoreIsNamed) {
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(listen(lfd, 8), 0);
  socklen_t len = sizeof a;
  ASSERT_EQ(getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const int port = ntohs(a.sin_port);
  // A program that answers something else (an HTTP server, say).
  std::thread http([lfd] {
    int c = accept(lfd, nullptr, nullptr);
    const char reply[] = "HTTP/1.1 400 Bad Request\r\n\r\n";
    if (c >= 0 && write(c, reply, sizeof reply - 1) > 0) std::this_thread::sleep_for(2s);
    if (c >= 0) close(c);
  });
  auto t0 = Clock::now();
  std::string err = error_of([&] { TCPStore("127.0.0.1", port, client_opts(60s)); });
  http.join();
  EXPECT_LT(ms_since(t0), 10000) << err;
  EXPECT_THAT(err, HasSubstr("127.0.0.1:" + std::to_string(port) + " is not an ember store"));
  EXPECT_THAT(err, HasSubstr("answered the handshake with other bytes"));
  // A program that accepts (here: the kernel's backlog) and never answers.
  t0 = Clock::now();
  err = error_of([&] { TCPStore("127.0.0.1", port, client_opts(60s)); });
  EXPECT_LT(ms_since(t0), 15000) << err;
  EXPECT_THAT(err, HasSubstr("did not answer the store handshake within 5000 ms"));
  close(lfd);
}

// ---------------------------------------------------------------------------
// Who may use the store: only the job's address, only with the job's token.

// Regression: the server listened on every interface. 127.0.0.2 is another
// address of this machine (all of 127/8 is local on Linux): a store bound to
// 127.0.0.1 must not answer there, one listening on all interfaces does.
TEST(TCPStore, ListensOnlyOnTheJobsAddress) {
  auto reachable_at = [](const char* addr, int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    inet_pton(AF_INET, addr, &a.sin_addr);
    a.sin_port = htons(static_cast<uint16_t>(port));
    bool ok = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    close(fd);
    return ok;
  };
  TCPStore local("127.0.0.1", 0, server_opts());
  EXPECT_TRUE(reachable_at("127.0.0.1", local.port()));
  EXPECT_FALSE(reachable_at("127.0.0.2", local.port())) << "the store answers on an address it was not given";
  TCPStoreOptions all = server_opts();
  all.listen_on_all = true;
  TCPStore everywhere("127.0.0.1", 0, all);
  EXPECT_TRUE(reachable_at("127.0.0.2", everywhere.port()));
  // An address of another machine cannot be listened on: named, not a hang.
  std::string err = error_of([] { TCPStore("192.0.2.1", 0, server_opts()); });
  EXPECT_THAT(err, HasSubstr("cannot listen at '192.0.2.1'"));
  EXPECT_THAT(err, HasSubstr("MASTER_ADDR"));
}

// Regression: any client that knew the 8-byte magic was served.
TEST(TCPStore, RefusesClientsWithoutTheJobsToken) {
  TCPStoreOptions so = server_opts(60s);
  so.token = "job-secret-1";
  TCPStore server("127.0.0.1", 0, so);
  server.set("k", std::string("v"));
  TCPStoreOptions co = client_opts(60s);
  auto t0 = Clock::now();
  std::string err = error_of([&] { TCPStore("127.0.0.1", server.port(), co); });
  EXPECT_LT(ms_since(t0), 5000) << "a refusal is final, not retried until the timeout: " << err;
  EXPECT_THAT(err, HasSubstr("refused: it presented no job token"));
  EXPECT_THAT(err, HasSubstr("set EMBER_STORE_TOKEN"));
  co.token = "job-secret-2";
  err = error_of([&] { TCPStore("127.0.0.1", server.port(), co); });
  EXPECT_THAT(err, HasSubstr("refused: it presented a wrong job token"));
  co.token = "job-secret-1";
  TCPStore member("127.0.0.1", server.port(), co);
  EXPECT_EQ(member.get_string("k"), "v");
}

// ---------------------------------------------------------------------------
// Lost ranks: a client that speaks for a rank and disappears without its
// goodbye fails every waiting call at once, naming the rank.

// Runs body in a forked child that then ends by _exit (no destructors), and
// waits for it.
template <typename Body>
void in_child(Body body) {
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    body();
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
}

// Forks a process that connects as `rank` and then ends: by _exit, as a
// crash or kill -9 would (no goodbye), or after destroying its store.
void client_exits(int port, int rank, bool goodbye) {
  in_child([&] {
    TCPStoreOptions o = client_opts();
    o.rank = rank;
    auto* store = new TCPStore("127.0.0.1", port, o);
    store->set("arrived/" + std::to_string(rank), std::string("1"));
    if (goodbye) delete store;
  });
}

TEST(TCPStore, ARankThatDiesFailsEveryWaitAtOnceNamingIt) {
  TCPStore server("127.0.0.1", 0, server_opts(60s));
  TCPStore waiter("127.0.0.1", server.port(), client_opts(60s));
  std::thread dies([&] {
    std::this_thread::sleep_for(300ms);  // after `waiter` has parked its wait
    client_exits(server.port(), 2, /*goodbye=*/false);
  });
  auto t0 = Clock::now();
  std::string err;
  std::vector<LostRank> lost;
  try {
    waiter.wait({"never_set"});
  } catch (const RankLostError& e) {
    err = e.what();
    lost = e.lost();
  }
  dies.join();
  EXPECT_LT(ms_since(t0), 5000) << "a dead rank must not be found by the 60 s timeout: " << err;
  EXPECT_THAT(err, HasSubstr("rank 2 (connection from 127.0.0.1:"));
  EXPECT_THAT(err, HasSubstr(" ago) has left the job without saying goodbye"));
  EXPECT_THAT(err, HasSubstr("wait(\"never_set\")"));
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].rank, 2);
  // Later waits fail at once too; what is already there is still served.
  t0 = Clock::now();
  EXPECT_THAT(error_of([&] { waiter.get("also_never"); }), HasSubstr("rank 2"));
  EXPECT_LT(ms_since(t0), 2000);
  EXPECT_EQ(waiter.get_string("arrived/2"), "1");
  ASSERT_EQ(server.lost_ranks().size(), 1u);
  EXPECT_EQ(
      PrefixStore("p", std::make_shared<TCPStore>("127.0.0.1", server.port(), client_opts())).lost_ranks()[0].rank, 2);
}

TEST(TCPStore, ARankThatLeavesCleanlyIsNotLost) {
  TCPStore server("127.0.0.1", 0, server_opts(60s));
  client_exits(server.port(), 1, /*goodbye=*/true);
  EXPECT_TRUE(server.lost_ranks().empty());
  std::string err = error_of([&] { server.wait({"never_set"}, 500ms); });
  EXPECT_THAT(err, HasSubstr("timed out after 500 ms"));
  // A client without a rank (a tool, a test harness) is nobody's rank.
  client_exits(server.port(), -1, /*goodbye=*/false);
  EXPECT_TRUE(server.lost_ranks().empty());
}

// close(): the goodbye without the destructor (live recovery's survivors
// leave their aborted groups holding the store), and no reconnection.
TEST(TCPStore, ClosedIsAGoodbyeAndStaysClosed) {
  TCPStore server("127.0.0.1", 0, server_opts(60s));
  in_child([&] {
    TCPStoreOptions o = client_opts();
    o.rank = 3;
    auto* held = new std::shared_ptr<TCPStore>(std::make_shared<TCPStore>("127.0.0.1", server.port(), o));
    (*held)->set("arrived/3", std::string("1"));
    (*held)->close();  // never destroyed: `held` leaks, as an aborted group would
  });
  EXPECT_TRUE(server.lost_ranks().empty());
  TCPStoreOptions o = client_opts();
  o.rank = 4;
  TCPStore c("127.0.0.1", server.port(), o);
  c.close();
  EXPECT_THAT(error_of([&] { c.set("k", std::string("v")); }), HasSubstr("the store was closed"));
  EXPECT_TRUE(server.lost_ranks().empty());
}

// A replacement connecting with a lost rank (live recovery) clears it: waits
// block normally again instead of failing at once.
TEST(TCPStore, ARankThatComesBackIsNoLongerLost) {
  TCPStore server("127.0.0.1", 0, server_opts(60s));
  client_exits(server.port(), 2, /*goodbye=*/false);
  ASSERT_EQ(server.lost_ranks().size(), 1u);
  TCPStoreOptions o = client_opts();
  o.rank = 2;
  TCPStore replacement("127.0.0.1", server.port(), o);
  replacement.set("back", std::string("1"));
  EXPECT_TRUE(server.lost_ranks().empty());
  EXPECT_THAT(error_of([&] { server.wait({"never_set"}, 300ms); }), HasSubstr("timed out after 300 ms"));
}

// ...but a group that lived when the rank died still learns of it: the
// survivor blocked in a send to the dead rank must not miss it because the
// replacement said hello first (a live-recovery survivor waited out its timeout so).
TEST(TCPStore, ARankReplacedStaysLostToWhatLivedWhenItDied) {
  TCPStore server("127.0.0.1", 0, server_opts(60s));
  std::this_thread::sleep_for(200ms);
  const auto born = Clock::now();  // a group made before the loss
  std::this_thread::sleep_for(100ms);
  client_exits(server.port(), 2, /*goodbye=*/false);
  ASSERT_EQ(server.lost_ranks_since(60s).size(), 1u);
  EXPECT_FALSE(server.lost_ranks_since(60s)[0].replaced);
  TCPStoreOptions o = client_opts();
  o.rank = 2;
  TCPStore replacement("127.0.0.1", server.port(), o);
  replacement.set("back", std::string("1"));
  EXPECT_TRUE(server.lost_ranks().empty());
  const Millis age = std::chrono::duration_cast<Millis>(Clock::now() - born);
  std::vector<LostRank> lost =
      PrefixStore("p", std::make_shared<TCPStore>("127.0.0.1", server.port(), client_opts())).lost_ranks_since(age);
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].rank, 2);
  EXPECT_TRUE(lost[0].replaced);
  EXPECT_LT(lost[0].ms_ago, age.count());
  EXPECT_THAT(lost[0].describe(), HasSubstr("a replacement has connected since"));
  // A group made after the loss (the new generation's) is not told of it.
  std::this_thread::sleep_for(50ms);
  EXPECT_TRUE(server.lost_ranks_since(10ms).empty());
}

// ---------------------------------------------------------------------------
// FileStore

std::string temp_path(const std::string& name) {
  static std::atomic<int> counter{0};
  std::string path =
      ::testing::TempDir() + "/filestore_" + name + "_" + std::to_string(getpid()) + "_" + std::to_string(counter++);
  unlink(path.c_str());
  return path;
}

bool exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

TEST(FileStore, SemanticsInOneProcess) {
  std::string path = temp_path("semantics");
  FileStore store(path, -1, 2s);
  check_semantics(store);
  // A second instance (its own open file and lock) sees the same keys.
  FileStore other(path, -1, 2s);
  EXPECT_EQ(other.get_string("n"), "-2");
  other.set("from_other", std::string("x"));
  EXPECT_EQ(store.get_string("from_other"), "x");
  EXPECT_TRUE(store.delete_key("from_other"));
  EXPECT_FALSE(other.check({"from_other"}));
  unlink(path.c_str());
}

TEST(FileStore, ProcessesShareOneFile) {
  constexpr int n = 4, kAdds = 100;
  std::string path = temp_path("procs");
  run_ranks(n, [&](int rank) {
    FileStore store(path, -1, 10s);
    store.set("rank/" + std::to_string(rank), "value " + std::to_string(rank));
    for (int p = 0; p < n; ++p) EXPECT_EQ(store.get_string("rank/" + std::to_string(p)), "value " + std::to_string(p));
    for (int i = 0; i < kAdds; ++i) store.add("counter", rank + 1);
    barrier(store, "end", n);
    EXPECT_EQ(store.add("counter", 0), kAdds * (1 + 2 + 3 + 4));
  });
  FileStore after(path, -1, 1s);
  EXPECT_EQ(after.get_string("counter"), std::to_string(kAdds * 10));
  EXPECT_EQ(after.num_keys(), n + 3);  // rank/*, counter, end/count, end/open
  unlink(path.c_str());
}

TEST(FileStore, GetOfAMissingKeyTimesOutNamingFileKeyAndTimeout) {
  std::string path = temp_path("timeout");
  FileStore store(path, -1, 300ms);
  auto t0 = Clock::now();
  std::string err = error_of([&] { store.get("nobody/sets/this"); });
  int64_t elapsed = ms_since(t0);
  EXPECT_GE(elapsed, 295);
  EXPECT_LT(elapsed, 3000);
  EXPECT_THAT(err, HasSubstr(path));
  EXPECT_THAT(err, HasSubstr("\"nobody/sets/this\""));
  EXPECT_THAT(err, HasSubstr("300 ms"));
  store.set("present", std::string("1"));
  err = error_of([&] { store.wait({"present", "absent"}, 100ms); });
  EXPECT_THAT(err, HasSubstr("still missing: \"absent\""));
  unlink(path.c_str());
}

TEST(FileStore, LastOfNumWorkersRemovesTheFile) {
  std::string path = temp_path("cleanup");
  auto a = std::make_unique<FileStore>(path, 2, 1s);
  auto b = std::make_unique<FileStore>(path, 2, 1s);
  a->set("k", std::string("v"));
  a.reset();
  EXPECT_TRUE(exists(path));
  EXPECT_EQ(b->get_string("k"), "v");
  b.reset();
  EXPECT_FALSE(exists(path));
}

TEST(FileStore, ReportsACorruptFile) {
  std::string path = temp_path("corrupt");
  FILE* f = std::fopen(path.c_str(), "w");
  std::fputs("this is not a store", f);
  std::fclose(f);
  FileStore store(path, -1, 1s);
  std::string err = error_of([&] { store.num_keys(); });
  EXPECT_THAT(err, HasSubstr(path));
  EXPECT_THAT(err, HasSubstr("corrupt record at byte 0"));
  unlink(path.c_str());
}

// ---------------------------------------------------------------------------
// PrefixStore

TEST(PrefixStore, NamespacesDoNotCollide) {
  auto base = std::make_shared<TCPStore>("127.0.0.1", 0, server_opts(2s));
  PrefixStore a("a", base), b("b", base);
  a.set("k", std::string("from a"));
  b.set("k", std::string("from b"));
  EXPECT_EQ(a.get_string("k"), "from a");
  EXPECT_EQ(b.get_string("k"), "from b");
  EXPECT_EQ(base->get_string("a/k"), "from a");
  EXPECT_EQ(a.add("n", 3), 3);
  EXPECT_EQ(b.add("n", 10), 10);
  a.set("only_a", std::string("1"));
  EXPECT_TRUE(a.check({"k", "only_a"}));
  EXPECT_FALSE(b.check({"only_a"}));
  EXPECT_EQ(S(b.compare_set("only_a", {}, B("b's"))), "b's");  // missing in b: sets it
  EXPECT_EQ(a.get_string("only_a"), "1");
  EXPECT_TRUE(a.delete_key("k"));
  EXPECT_FALSE(a.check({"k"}));
  EXPECT_EQ(b.get_string("k"), "from b");
  // Errors name the full key in the base store.
  std::string err = error_of([&] { b.wait({"never"}, 100ms); });
  EXPECT_THAT(err, HasSubstr("\"b/never\""));
  // Nesting composes the prefixes.
  PrefixStore nested("inner", std::make_shared<PrefixStore>("outer", base));
  nested.set("x", std::string("deep"));
  EXPECT_EQ(base->get_string("outer/inner/x"), "deep");
  EXPECT_EQ(a.timeout(), 2000ms);
  EXPECT_THAT(error_of([] { PrefixStore("p", nullptr); }), HasSubstr("null"));
}

TEST(PrefixStore, SemanticsOverAFreshBase) {
  PrefixStore store("pfx", std::make_shared<TCPStore>("127.0.0.1", 0, server_opts(2s)));
  check_semantics(store);
}

// ---------------------------------------------------------------------------
// Gloo adapter

TEST(GlooStore, ForwardsSetGetAndWaitWithTimeouts) {
  auto base = std::make_shared<TCPStore>("127.0.0.1", 0, server_opts(300ms));
  auto gs = make_gloo_store(base);
  gs->set("k", std::vector<char>{1, 2, 3});
  EXPECT_EQ(gs->get("k"), (std::vector<char>{1, 2, 3}));
  EXPECT_EQ(base->get(std::string("k")), (Bytes{1, 2, 3}));
  gs->wait({"k"});
  gs->wait({"k"}, std::chrono::milliseconds(100));
  auto t0 = Clock::now();
  EXPECT_THAT(error_of([&] { gs->wait({"missing"}, std::chrono::milliseconds(100)); }), HasSubstr("100 ms"));
  EXPECT_LT(ms_since(t0), 2000);
  // Gloo's "no timeout" means the store's own.
  EXPECT_THAT(error_of([&] { gs->wait({"missing"}, gloo::kNoTimeout); }), HasSubstr("300 ms"));
  EXPECT_THAT(error_of([&] { gs->get("missing"); }), HasSubstr("\"missing\""));
  EXPECT_THAT(error_of([] { make_gloo_store(nullptr); }), HasSubstr("null"));
}

TEST(GlooStore, GlooRendezvousAllreduceAndBarrierAcrossProcesses) {
  for (int n : {2, 3}) {
    SCOPED_TRACE("world size " + std::to_string(n));
    PortChannel ports(n);
    run_ranks(n, [&](int rank) {
      std::shared_ptr<Store> store = connect_rank(rank, ports);
      auto gloo_store = make_gloo_store(std::make_shared<PrefixStore>("gloo", store));
      gloo::transport::tcp::attr attr;
      attr.hostname = "127.0.0.1";
      auto device = gloo::transport::tcp::CreateDevice(attr);
      auto context = std::make_shared<gloo::rendezvous::Context>(rank, n);
      context->setTimeout(std::chrono::seconds(10));
      context->connectFullMesh(*gloo_store, device);

      std::vector<float> data = {float(rank + 1), float(10 * (rank + 1)), -1.0f};
      gloo::AllreduceOptions opts(context);
      opts.setOutput(data.data(), data.size());
      opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      gloo::allreduce(opts);
      const float s = n * (n + 1) / 2.0f;
      EXPECT_EQ(data, (std::vector<float>{s, 10 * s, -1.0f * n}));

      gloo::BarrierOptions barrier_opts(context);
      barrier_opts.setTimeout(std::chrono::seconds(10));
      gloo::barrier(barrier_opts);
      finish(*store, rank, n);
    });
  }
}

}  // namespace
}  // namespace ember::distributed
