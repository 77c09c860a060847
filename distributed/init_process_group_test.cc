// init_process_group end to end with the Gloo backend: worker processes
// (distributed/testing/multiprocess.h) read torchrun's variables, meet at
// the TCPStore rank 0 hosts, run collectives on the default group and on
// sub-groups from new_group, tear down and initialise again over a given
// store. In-process: a world of one, and the errors of misuse.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "core/exception.h"
#include "core/tensor.h"
#include "core/testing/error_of.h"
#include "distributed/config_check.h"
#include "distributed/init.h"
#include "distributed/testing/multiprocess.h"

namespace ember::distributed {
namespace {

namespace mp = ::ember::distributed::testing;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

using ::ember::testing::error_of;

// Rank r contributes r + 1; a group's sum is the sum over its members.
double allreduce_sum(ProcessGroup& pg, int global_rank) {
  Tensor t = Tensor::from_vector({double(global_rank + 1)}, {1});
  pg.allreduce(t)->wait();
  return t.to_vector()[0];
}

InitOptions gloo_with_timeout(Millis timeout) {
  InitOptions o;
  o.backend = "gloo";
  o.timeout = timeout;
  return o;
}

void set_torchrun_env(const mp::WorkerEnv& env) {
  setenv("RANK", std::to_string(env.rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(env.world_size).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(env.rank).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(env.world_size).c_str(), 1);
}

// Rank 0 hosts the default store: it must outlive the other ranks' use of it.
void all_done(const mp::WorkerEnv& env, const std::string& name) {
  auto store = env.store();
  store->set(name + "/" + std::to_string(env.rank), std::string("1"));
  std::vector<std::string> keys;
  for (int r = 0; r < env.world_size; ++r) keys.push_back(name + "/" + std::to_string(r));
  store->wait(keys);
}

EMBER_WORKER(init_from_env) {
  const int n = env.world_size, r = env.rank;
  set_torchrun_env(env);  // MASTER_ADDR / MASTER_PORT come from the parent
  WCHECK(!is_initialized(), "fresh process");
  auto pg = init_process_group(gloo_with_timeout(30s));
  WCHECK(is_initialized(), "after init");
  WCHECK(get_rank() == r && get_world_size() == n, get_rank(), " of ", get_world_size());
  WCHECK(default_group() == pg, "default_group() is the group init returned");
  WCHECK(pg->backend_name() == "gloo", pg->backend_name());
  double s = allreduce_sum(*pg, r);
  WCHECK(s == n * (n + 1) / 2.0, "default group sum ", s);

  // Unsorted on purpose: group ranks follow the sorted order, as in torch.
  auto ends = new_group({n - 1, 0});
  auto odd = new_group({1});
  if (r == 0 || r == n - 1) {
    WCHECK(ends != nullptr, "member of {0, n-1} got no group");
    WCHECK(ends->size() == 2 && ends->rank() == (r == 0 ? 0 : 1), ends->rank(), " of ", ends->size());
    s = allreduce_sum(*ends, r);
    WCHECK(s == 1 + n, "sub-group sum ", s);
  } else {
    WCHECK(ends == nullptr, "rank ", r, " is outside {0, n-1}");
  }
  if (r == 1) {
    WCHECK(odd != nullptr && odd->size() == 1 && odd->rank() == 0, "the group of rank 1 alone");
    WCHECK(allreduce_sum(*odd, r) == 2, "a group of one");
  } else {
    WCHECK(odd == nullptr, "rank ", r, " is outside {1}");
  }
  // The default group still works after sub-groups were made.
  s = allreduce_sum(*pg, r);
  WCHECK(s == n * (n + 1) / 2.0, "default group sum after new_group ", s);
  ends.reset();
  odd.reset();
  pg.reset();
  all_done(env, "first");
  destroy_process_group();
  WCHECK(!is_initialized(), "after destroy");

  // Again, over a store we bring (the parent's), with explicit rank/size.
  InitOptions o;
  o.rank = r;
  o.world_size = n;
  o.store = env.store();
  o.timeout = 30s;
  pg = init_process_group(o);
  s = allreduce_sum(*pg, r);
  WCHECK(s == n * (n + 1) / 2.0, "second init sum ", s);
  pg.reset();
  destroy_process_group();
}

EMBER_WORKER(new_group_mismatch) {
  set_torchrun_env(env);
  auto pg = init_process_group(gloo_with_timeout(5s));
  if (env.rank == 1) {
    std::string msg = error_of([] { new_group({0}); });
    WCHECK(msg.find("rank 1 passed ranks [0] but rank 0 passed [0,1]") != std::string::npos, msg);
  } else {
    // Rank 0's group waits for rank 1, which never joins: a timeout error.
    std::string msg = error_of([] { new_group({0, 1}); });
    WCHECK(!msg.empty(), "rank 0 built a group its peer never joined");
  }
  pg.reset();
  all_done(env, "mismatch");
  destroy_process_group();
}

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

// Rank 1 is launched with another WORLD_SIZE than rank 0 (2 and 3, or 3 and
// 2): both fail within seconds naming WORLD_SIZE and both values.
EMBER_WORKER(world_size_mismatch) {
  const bool rank0_bigger = env.arg == "rank0_bigger";
  const int mine = (env.rank == 0) == rank0_bigger ? 3 : 2;
  setenv("RANK", std::to_string(env.rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(mine).c_str(), 1);
  auto t0 = std::chrono::steady_clock::now();
  std::string msg;
  try {
    init_process_group(gloo_with_timeout(60s));
  } catch (const Error& e) {
    msg = e.what();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  WCHECK(msg.find("ranks disagree on the world size") != std::string::npos, "rank ", env.rank, ": ", msg);
  WCHECK(msg.find("WORLD_SIZE=" + std::to_string(mine)) != std::string::npos, msg);
  WCHECK(msg.find("has " + std::to_string(5 - mine)) != std::string::npos, msg);
  WCHECK(secs < 20, "took ", secs, " s: ", msg);
}

// check_same_config: equal settings pass; rank 1 with another batch size
// makes every rank fail, rank 1 naming the setting and both values.
EMBER_WORKER(config_check) {
  set_torchrun_env(env);
  auto pg = init_process_group(gloo_with_timeout(30s));
  check_same_config(*pg, {{"batch_size", "64"}, {"lr", "0.1"}});
  std::string msg;
  try {
    check_same_config(*pg, {{"batch_size", env.rank == 1 ? "32" : "64"}, {"lr", "0.1"}});
  } catch (const Error& e) {
    msg = e.what();
  }
  if (env.rank == 1)
    WCHECK(msg.find("batch_size is 32 here but 64 on rank 0") != std::string::npos, msg);
  else
    WCHECK(msg.find("the training configuration of rank(s) 1 differs") != std::string::npos, msg);
  pg.reset();
  all_done(env, "config");
  destroy_process_group();
}

// Regression: without a launcher to kill the job, the survivors of a dead
// rank waited in the signature check for the whole timeout (60 s here, 10
// minutes by default). Now they fail within seconds, naming the dead rank
// (rank 0, which hosts the store, always; the others while it is still up).
// arg "<when>:<victim>": "before" = the victim dies before the collective,
// "mid" = in the middle of a 64 MiB allreduce (the transport sees it).
EMBER_WORKER(rank_dies_untended) {
  set_torchrun_env(env);
  const std::string when = env.arg.substr(0, env.arg.find(':'));
  const int victim = std::stoi(env.arg.substr(env.arg.find(':') + 1));
  auto pg = init_process_group(gloo_with_timeout(60s));
  allreduce_sum(*pg, env.rank);
  Tensor x = Tensor::from_vector(std::vector<double>(when == "mid" ? 16 << 20 : 10, 1.0),
                                 {when == "mid" ? 16 << 20 : 10});
  if (env.rank == victim && when == "before") _exit(9);
  auto t0 = std::chrono::steady_clock::now();
  auto work = pg->allreduce(x);
  if (env.rank == victim) {
    std::this_thread::sleep_for(2ms);
    _exit(9);
  }
  std::string msg = error_of([&] { work->wait(); });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("rank %d: failed after %.2f s: %s\n", env.rank, secs, msg.c_str());
  WCHECK(secs < 10, "took ", secs, " s with a 60 s timeout: ", msg);
  const bool named = msg.find("rank " + std::to_string(victim) + " (connection from") != std::string::npos &&
                     msg.find("left the job without saying goodbye") != std::string::npos;
  const bool closed = msg.find("closed") != std::string::npos || msg.find("reset by peer") != std::string::npos;
  if (victim == 0) {
    WCHECK(msg.find("the store server closed the connection") != std::string::npos || closed, msg);
  } else if (env.rank == 0) {
    // The store lives in rank 0's process, so rank 0 always learns who died.
    WCHECK(named, msg);
  } else {
    // The others ask rank 0's store, which is gone once rank 0 has failed
    // and exited too: they name the rank when they asked first.
    WCHECK(named || closed, msg);
  }
  _exit(0);  // rank 0 hosts the store: nothing left to tear down in order
}

// A rank started with another job's EMBER_STORE_TOKEN is refused by rank 0's
// store at once, naming the variable; rank 0 gives up on it at the
// rendezvous timeout (3 s here) instead of serving a stranger.
EMBER_WORKER(wrong_token) {
  set_torchrun_env(env);
  setenv("EMBER_STORE_TOKEN", env.rank == 0 ? "the-jobs-secret" : "another-jobs-secret", 1);
  setenv("EMBER_RDZV_TIMEOUT_SEC", "3", 1);
  auto t0 = std::chrono::steady_clock::now();
  std::string msg = error_of([] { init_process_group(gloo_with_timeout(60s)); });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  WCHECK(secs < 15, "took ", secs, " s: ", msg);
  if (env.rank == 1) {
    WCHECK(msg.find("refused: it presented a wrong job token (EMBER_STORE_TOKEN)") != std::string::npos, msg);
  } else {
    WCHECK(msg.find("rank 1 of WORLD_SIZE=2 did not reach the rendezvous") != std::string::npos, msg);
  }
}

mp::RunOptions torchrun_options() {
  mp::RunOptions o;
  o.deadline = 90s;
  o.env = {"MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(free_port())};
  return o;
}

TEST(InitProcessGroup, FromTorchrunEnvWithSubGroupsWorldSize3) {
  EMBER_EXPECT_RANKS("init_from_env", 3, torchrun_options());
}

TEST(InitProcessGroup, FromTorchrunEnvWithSubGroupsWorldSize2) {
  EMBER_EXPECT_RANKS("init_from_env", 2, torchrun_options());
}

TEST(InitProcessGroup, MismatchedWorldSizeIsNamedAtRendezvous) {
  for (const char* which : {"rank0_bigger", "rank1_bigger"}) {
    mp::RunOptions o = torchrun_options();
    o.arg = which;
    EMBER_EXPECT_RANKS("world_size_mismatch", 2, o);
  }
}

TEST(InitProcessGroup, DifferentTrainingConfigurationsFailOnEveryRank) {
  EMBER_EXPECT_RANKS("config_check", 3, torchrun_options());
}

TEST(InitProcessGroup, ADeadRankIsNamedWithinSecondsWithoutALauncher) {
  for (const char* arg : {"before:2", "mid:2", "before:0"}) {
    SCOPED_TRACE(arg);
    mp::RunOptions o = torchrun_options();
    o.arg = arg;
    o.deadline = 45s;
    o.expect_exit = {{arg[std::string(arg).size() - 1] - '0', 9}};  // the victim, the arg's last digit
    EMBER_EXPECT_RANKS("rank_dies_untended", 3, o);
  }
}

TEST(InitProcessGroup, ARankWithAnotherJobsTokenIsRefused) { EMBER_EXPECT_RANKS("wrong_token", 2, torchrun_options()); }

TEST(InitProcessGroup, NewGroupWithDifferentListsFailsByName) {
  EMBER_EXPECT_RANKS("new_group_mismatch", 2, torchrun_options());
}

// In-process: a world of one needs no launcher and no address.
class SingleProcess : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                          "SLURM_PROCID", "SLURM_NTASKS"}) {
      if (const char* old = std::getenv(v)) saved_[v] = old;
      unsetenv(v);
    }
  }
  void TearDown() override {
    destroy_process_group();
    for (const auto& [k, v] : saved_) setenv(k.c_str(), v.c_str(), 1);
  }
  std::map<std::string, std::string> saved_;
};

TEST_F(SingleProcess, InitUseAndMisuse) {
  auto pg = init_process_group(gloo_with_timeout(10s));
  EXPECT_TRUE(is_initialized());
  EXPECT_EQ(get_rank(), 0);
  EXPECT_EQ(get_world_size(), 1);
  EXPECT_EQ(allreduce_sum(*pg, 0), 1.0);
  EXPECT_THAT(error_of([] { init_process_group(); }), HasSubstr("already initialized (rank 0 of 1"));
  auto solo = new_group({0});
  ASSERT_NE(solo, nullptr);
  EXPECT_EQ(solo->size(), 1);
  EXPECT_THAT(error_of([] { new_group({1}); }), HasSubstr("rank 1 is outside the default group's ranks [0, 1)"));
  EXPECT_THAT(error_of([] { new_group({0, 0}); }), HasSubstr("rank 0 is listed twice in [0,0]"));
  EXPECT_THAT(error_of([] { new_group({}); }), HasSubstr("empty"));
  solo.reset();
  pg.reset();
  destroy_process_group();
  EXPECT_FALSE(is_initialized());
  // And once more: destroy really released everything.
  pg = init_process_group(gloo_with_timeout(10s));
  EXPECT_EQ(allreduce_sum(*pg, 0), 1.0);
}

// Rank 1 of 2 whose master nobody listens on: an error within the timeout
// naming the variables that point at the store, not a hang.
TEST_F(SingleProcess, UnreachableMasterNamesTheVariablesWithinTheTimeout) {
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  const int port = free_port();
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  auto t0 = std::chrono::steady_clock::now();
  std::string msg = error_of([] { init_process_group(gloo_with_timeout(1500ms)); });
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_THAT(msg, HasSubstr("rank 1 of 2"));
  EXPECT_THAT(msg, HasSubstr("MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port)));
  EXPECT_THAT(msg, HasSubstr("timeout 1500 ms"));
  EXPECT_LT(s, 10.0) << msg;
  EXPECT_FALSE(is_initialized());
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) unsetenv(v);
}

// Regression: nothing listening at MASTER_ADDR:MASTER_PORT was retried
// silently for the whole timeout (10 minutes by default). The rendezvous
// timeout ends it sooner, naming itself, while collectives keep theirs.
TEST_F(SingleProcess, UnreachableMasterGivesUpAfterTheRendezvousTimeout) {
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(free_port()).c_str(), 1);
  setenv("EMBER_RDZV_TIMEOUT_SEC", "1", 1);
  auto t0 = std::chrono::steady_clock::now();
  std::string msg = error_of([] { init_process_group(gloo_with_timeout(600s)); });
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 10.0) << msg;
  EXPECT_THAT(msg, HasSubstr("rendezvous timeout 1000 ms (EMBER_RDZV_TIMEOUT_SEC)"));
  EXPECT_THAT(msg, HasSubstr("timeout 600000 ms (InitOptions::timeout)"));
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "EMBER_RDZV_TIMEOUT_SEC"}) unsetenv(v);
}

}  // namespace
}  // namespace ember::distributed
