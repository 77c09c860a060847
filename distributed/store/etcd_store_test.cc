// EtcdStore against a real 3-member etcd cluster on localhost
// (distributed/testing/etcd_cluster.sh): the Store semantics TCPStore has
// (checked the same way), atomic counters under contention from threads and
// processes, failover when a member dies, the named errors of a cluster that
// lost its quorum and of endpoints that do not answer, and leased keys that
// vanish with their process. Skips, saying so, where etcd is not installed.
#include "distributed/store/etcd_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <thread>

#include "core/exception.h"

namespace ember::distributed {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

int64_t ms_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

std::string script() {
  const char* src = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  return std::string(src ? src : ".") + "/" + (ws ? ws : "ember") + "/distributed/testing/etcd_cluster.sh";
}

// A cluster of 3 members for one test (or the suite), stopped at the end.
class Cluster {
 public:
  Cluster() {
    static std::atomic<int> n{0};
    const char* tmp = std::getenv("TEST_TMPDIR");
    dir_ = std::string(tmp ? tmp : "/tmp") + "/etcd" + std::to_string(getpid()) + "_" + std::to_string(n++);
    prefix_ = "/test" + std::to_string(getpid()) + "_" + std::to_string(n) + "/";
    const int rc = std::system((script() + " start " + dir_ + " 3 > " + dir_ + ".out 2>&1").c_str());
    status_ = WIFEXITED(rc) ? WEXITSTATUS(rc) : 1;
    if (status_ == 0) std::getline(std::ifstream(dir_ + "/endpoints"), endpoints_);
  }
  ~Cluster() { std::system((script() + " stop " + dir_).c_str()); }
  bool missing() const { return status_ == 3; }
  std::string failure() const {
    std::ifstream in(dir_ + ".out");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  bool up() const { return status_ == 0; }
  std::vector<std::string> endpoints() const { return parse_etcd_endpoints(endpoints_); }
  void signal_member(int i, int sig) {
    std::ifstream in(dir_ + "/m" + std::to_string(i) + "/pid");
    pid_t pid = 0;
    in >> pid;
    ASSERT_GT(pid, 0);
    ::kill(pid, sig);
  }
  void restart_member(int i) {
    ASSERT_EQ(std::system((script() + " restart " + dir_ + " " + std::to_string(i)).c_str()), 0);
  }
  EtcdStoreOptions options(Millis timeout = 5s) const {
    EtcdStoreOptions o;
    o.endpoints = endpoints();
    o.prefix = prefix_;
    o.timeout = timeout;
    return o;
  }

 private:
  std::string dir_, endpoints_, prefix_;
  int status_ = 1;
};

#define NEED_CLUSTER(c)                                                                           \
  if ((c).missing()) GTEST_SKIP() << "etcd is not installed (tools/setup.sh --etcd installs it)"; \
  ASSERT_TRUE((c).up()) << (c).failure()

Cluster* shared = nullptr;
class EtcdStoreTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { shared = new Cluster(); }
  static void TearDownTestSuite() {
    delete shared;
    shared = nullptr;
  }
};

TEST(EtcdEndpoints, ParsedAndNamedWhenMalformed) {
  EXPECT_EQ(parse_etcd_endpoints("h1:2379,http://h2:2380/,10.0.0.3:1"),
            (std::vector<std::string>{"h1:2379", "h2:2380", "10.0.0.3:1"}));
  EXPECT_THAT(error_of([] { parse_etcd_endpoints("h1:2379,,h2:2379"); }), HasSubstr("an empty item"));
  EXPECT_THAT(error_of([] { parse_etcd_endpoints("h1"); }), HasSubstr("'h1' is not host:port"));
  EXPECT_THAT(error_of([] { parse_etcd_endpoints("h1:99999"); }), HasSubstr("port '99999' of 'h1:99999'"));
}

// The semantics TCPStore's tests check, through etcd.
TEST_F(EtcdStoreTest, StoreSemantics) {
  NEED_CLUSTER(*shared);
  EtcdStoreOptions o = shared->options();
  o.prefix += "semantics/";
  EtcdStore s(o);
  s.set("a", std::string("1"));
  EXPECT_EQ(s.get_string("a"), "1");
  EXPECT_EQ(s.add("n", 5), 5);
  EXPECT_EQ(s.add("n", -2), 3);
  EXPECT_EQ(s.add("n", 0), 3);
  const int64_t rev = s.revision("n");
  EXPECT_EQ(s.add("n", 0), 3);
  EXPECT_EQ(s.revision("n"), rev) << "add(k, 0) is a read: the agents poll counters so";
  EXPECT_EQ(s.add("zero", 0), 0);  // ...but creates a missing key, as TCPStore does
  EXPECT_EQ(s.get_string("zero"), "0");
  EXPECT_THAT(error_of([&] { s.add("a2", 0), s.set("a2", std::string("x")), s.add("a2", 1); }),
              HasSubstr("add(a2): the value stored is not an integer: 'x'"));
  // compare_set: "" expected creates; a mismatch returns what is there.
  auto str = [](const Bytes& b) { return std::string(b.begin(), b.end()); };
  auto bytes = [](const std::string& v) { return Bytes(v.begin(), v.end()); };
  EXPECT_EQ(str(s.compare_set("c", {}, bytes("x"))), "x");
  EXPECT_EQ(str(s.compare_set("c", {}, bytes("y"))), "x");
  EXPECT_EQ(str(s.compare_set("c", bytes("x"), bytes("z"))), "z");
  EXPECT_EQ(str(s.compare_set("c", bytes("nope"), bytes("w"))), "z");
  EXPECT_EQ(str(s.compare_set("absent", bytes("q"), bytes("w"))), "");
  EXPECT_FALSE(s.check({"absent"}));
  // Binary values survive the base64 trip.
  const Bytes bin = {0, 255, 10, 13, 0x80, '=', 0};
  s.set("bin", bin);
  EXPECT_EQ(s.get("bin"), bin);
  EXPECT_TRUE(s.check({"a", "n", "c"}));
  EXPECT_FALSE(s.check({"a", "missing"}));
  // wait: returns when the key appears (set from another thread), times out naming it otherwise.
  std::thread later([&] {
    std::this_thread::sleep_for(200ms);
    EtcdStore(o).set("late", std::string("v"));
  });
  auto t0 = Clock::now();
  s.wait({"late"}, 5s);
  later.join();
  EXPECT_GE(ms_since(t0), 150);
  EXPECT_THAT(error_of([&] { s.wait({"never"}, 300ms); }), HasSubstr("wait(never) timed out after 300 ms"));
  EXPECT_TRUE(s.delete_key("a"));
  EXPECT_FALSE(s.delete_key("a"));
  EXPECT_EQ(s.num_keys(), 6);  // n, zero, a2, c, bin, late: nothing of another prefix (nor add's marks)
  EXPECT_EQ(s.count_prefix("l"), 1);
}

// Counters are transactions: concurrent adds from threads and processes
// (as agents on several hosts) lose none.
TEST_F(EtcdStoreTest, ConcurrentAddsLoseNothing) {
  NEED_CLUSTER(*shared);
  constexpr int kProcs = 3, kThreads = 3, kEach = 15;
  std::vector<pid_t> kids;
  for (int p = 0; p < kProcs; ++p) {
    const pid_t pid = fork();
    if (pid == 0) {
      std::vector<std::thread> ts;
      for (int t = 0; t < kThreads; ++t)
        ts.emplace_back([] {
          EtcdStore s(shared->options());
          for (int i = 0; i < kEach; ++i) s.add("counter", 1);
        });
      for (auto& t : ts) t.join();
      _exit(0);
    }
    kids.push_back(pid);
  }
  for (pid_t k : kids) {
    int st = 0;
    waitpid(k, &st, 0);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  EXPECT_EQ(EtcdStore(shared->options()).add("counter", 0), kProcs * kThreads * kEach);
}

// A leased key lives while its store lives (renewed past its TTL), and is
// gone when the store is destroyed (revoked) or its process dies (expired).
TEST_F(EtcdStoreTest, LeasedKeysVanishWithTheirProcess) {
  NEED_CLUSTER(*shared);
  EtcdStore watcher(shared->options());
  {
    EtcdStoreOptions o = shared->options();
    o.lease_ttl = 1s;
    EtcdStore holder(o);
    holder.set_leased("alive/0", "me");
    std::this_thread::sleep_for(2500ms);  // two TTLs: renewed by the keeper
    EXPECT_TRUE(watcher.check({"alive/0"}));
  }
  EXPECT_FALSE(watcher.check({"alive/0"})) << "revoked with the store";
  const pid_t pid = fork();
  if (pid == 0) {
    EtcdStoreOptions o = shared->options();
    o.lease_ttl = 1s;
    auto* holder = new EtcdStore(o);
    holder->set_leased("alive/1", "child");
    _exit(0);  // dies without revoking, as under SIGKILL
  }
  int st = 0;
  waitpid(pid, &st, 0);
  EXPECT_TRUE(watcher.check({"alive/1"}));
  auto t0 = Clock::now();
  while (watcher.check({"alive/1"}) && ms_since(t0) < 5000) std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(watcher.check({"alive/1"}));
  EXPECT_LT(ms_since(t0), 3000) << "the TTL is 1 s";
  // delete_prefix_if: only while the guard key is at the revision seen.
  watcher.set("job/x", std::string("1"));
  watcher.set("job/guard", std::string("a"));
  const int64_t rev = watcher.revision("job/guard");
  EXPECT_GT(rev, 0);
  watcher.set("job/guard", std::string("b"));
  EXPECT_FALSE(watcher.delete_prefix_if("job/", {{"job/guard", rev}}));
  EXPECT_TRUE(watcher.check({"job/x"}));
  EXPECT_FALSE(watcher.delete_prefix_if("job/", {{"job/guard", watcher.revision("job/guard")}, {"job/none", 5}}));
  EXPECT_TRUE(watcher.delete_prefix_if("job/", {{"job/guard", watcher.revision("job/guard")}, {"job/none", 0}}));
  EXPECT_EQ(watcher.count_prefix("job/"), 0);
  EXPECT_EQ(watcher.revision("job/guard"), 0);
}

// One member killed (the one the store talks to): the next call fails over.
TEST(EtcdStoreFaults, AMemberLostIsFailedOver) {
  Cluster c;
  NEED_CLUSTER(c);
  EtcdStore s(c.options());
  s.set("k", std::string("1"));
  c.signal_member(0, SIGKILL);
  auto t0 = Clock::now();
  EXPECT_EQ(s.add("n", 1), 1);
  EXPECT_EQ(s.get_string("k"), "1");
  EXPECT_LT(ms_since(t0), 4000);
  // Member 0 back (same data), then another frozen (SIGSTOP: it accepts
  // connections and never answers): failed over too.
  c.restart_member(0);
  std::this_thread::sleep_for(1500ms);  // it catches up with the log
  c.signal_member(1, SIGSTOP);
  t0 = Clock::now();
  EXPECT_EQ(s.add("n", 1), 2);
  EXPECT_LT(ms_since(t0), 5000);
  c.signal_member(1, SIGCONT);
}

// Two of three members gone: the one left answers but cannot commit; the
// call fails within its timeout naming the lost quorum, never hangs.
TEST(EtcdStoreFaults, ALostQuorumIsNamed) {
  Cluster c;
  NEED_CLUSTER(c);
  EtcdStore s(c.options(3s));
  s.set("k", std::string("1"));
  c.signal_member(1, SIGKILL);
  c.signal_member(2, SIGKILL);
  auto t0 = Clock::now();
  const std::string err = error_of([&] { s.add("n", 1); });
  EXPECT_LT(ms_since(t0), 6000);
  EXPECT_THAT(err, HasSubstr("failed within 3000 ms"));
  EXPECT_THAT(err, HasSubstr("lost its quorum"));
  EXPECT_THAT(err, HasSubstr(c.endpoints()[1] + ": connection refused"));
}

// The same with a long timeout (a join timeout is 600 s by default): the
// members that answer say they have no leader, so the call gives up after
// the leaderless grace (5 s) past etcd's own request timeout (~6 s a try),
// not at its timeout; a new store against that cluster too.
TEST(EtcdStoreFaults, ALostQuorumIsNamedBeforeALongTimeout) {
  Cluster c;
  NEED_CLUSTER(c);
  EtcdStore s(c.options(120s));
  s.set("k", std::string("1"));
  c.signal_member(1, SIGKILL);
  c.signal_member(2, SIGKILL);
  auto t0 = Clock::now();
  std::string err = error_of([&] { s.add("n", 1); });
  EXPECT_LT(ms_since(t0), 30000);
  EXPECT_THAT(err, HasSubstr("add(n) failed: the members that answer have had no leader for"));
  EXPECT_THAT(err, HasSubstr("lost its quorum"));
  EXPECT_THAT(err, HasSubstr(c.endpoints()[0] + ": etcdserver: request timed out"));
  EXPECT_THAT(err, HasSubstr(c.endpoints()[1] + ": connection refused"));
  t0 = Clock::now();
  err = error_of([&] { EtcdStore late(c.options(120s)); });
  EXPECT_LT(ms_since(t0), 30000);
  EXPECT_THAT(err, HasSubstr("reaching the cluster failed: the members that answer have had no leader"));
}

// Nothing listening: each endpoint named, within the connect timeout.
TEST(EtcdStoreFaults, EndpointsThatDoNotAnswerAreNamed) {
  EtcdStoreOptions o;
  o.endpoints = {"127.0.0.1:1", "127.0.0.1:2"};
  o.timeout = 800ms;
  auto t0 = Clock::now();
  const std::string err = error_of([&] { EtcdStore s(o); });
  EXPECT_LT(ms_since(t0), 3000);
  EXPECT_THAT(err, HasSubstr("etcd cluster 127.0.0.1:1,127.0.0.1:2: reaching the cluster failed within 800 ms"));
  EXPECT_THAT(err, HasSubstr("127.0.0.1:2: connection refused"));
  EXPECT_THAT(err, HasSubstr("is etcd running there?"));
}

}  // namespace
}  // namespace ember::distributed
