// resolve_env: torchrun's and SLURM's variables, explicit options winning
// over both, and an error naming the variable and its value for each kind of
// bad setting. Also the process-group accessors before initialisation. The
// environment is cleared around every test so the machine's own variables
// (a CI runner inside a Slurm job, say) cannot leak in.
#include "distributed/init.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "core/exception.h"
#include "core/testing/error_of.h"
#include "distributed/comm/backends.h"
#include "distributed/comm/process_group.h"
#include "distributed/store/store.h"

namespace ember::distributed {
namespace {

using ::testing::HasSubstr;

const char* const kVars[] = {
    "RANK",          "WORLD_SIZE",       "LOCAL_RANK",     "LOCAL_WORLD_SIZE",      "MASTER_ADDR",
    "MASTER_PORT",   "SLURM_PROCID",     "SLURM_NTASKS",   "SLURM_LOCALID",         "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "EMBER_DIST_TIMEOUT_SEC",
    "EMBER_RDZV_TIMEOUT_SEC",
};

class ResolveEnv : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : kVars) {
      if (const char* old = std::getenv(v)) saved_[v] = old;
      unsetenv(v);
    }
  }
  void TearDown() override {
    for (const char* v : kVars) unsetenv(v);
    for (const auto& [k, v] : saved_) setenv(k.c_str(), v.c_str(), 1);
  }
  static void set(const char* name, const std::string& value) { setenv(name, value.c_str(), 1); }

  static std::string error_of(const InitOptions& o) {
    try {
      resolve_env(o);
    } catch (const Error& e) {
      return e.what();
    }
    return "<no ember::Error thrown>";
  }

 private:
  std::map<std::string, std::string> saved_;
};

// The one place a rank's GPU is decided (NCCL groups): the option that
// init_process_group fills from the resolved LOCAL_RANK, else $LOCAL_RANK,
// else the rank, modulo the GPU count. A Gloo group lives on the CPU.
TEST_F(ResolveEnv, AGroupsDeviceComesFromTheLocalRank) {
  ProcessGroupOptions o;
  EXPECT_EQ(detail::local_device_index(o, 5, 4), 1) << "no LOCAL_RANK: the rank";
  set("LOCAL_RANK", "2");
  EXPECT_EQ(detail::local_device_index(o, 5, 4), 2);
  o.local_rank = 3;
  EXPECT_EQ(detail::local_device_index(o, 5, 4), 3) << "the option wins over the variable";
  o.local_rank = 6;
  EXPECT_EQ(detail::local_device_index(o, 0, 4), 2);
  EXPECT_THAT(::ember::testing::error_of([&] { detail::local_device_index(o, 0, 0); }), HasSubstr("no GPU"));
  auto store = std::make_shared<FileStore>(std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR")
                                                                                  : "/tmp") + "/device_store", 1);
  EXPECT_EQ(make_gloo_group(store, 0, 1)->device(), kCPU);
}

TEST_F(ResolveEnv, NothingSetIsOneProcess) {
  ResolvedEnv r = resolve_env({});
  EXPECT_EQ(r.rank, 0);
  EXPECT_EQ(r.world_size, 1);
  EXPECT_EQ(r.local_rank, 0);
  EXPECT_EQ(r.local_world_size, 1);
  EXPECT_EQ(r.master_addr, "127.0.0.1");
  EXPECT_EQ(r.master_port, 0);  // a free port: nobody else needs to find it
  EXPECT_EQ(r.source, "default");
}

TEST_F(ResolveEnv, TorchrunVariables) {
  set("RANK", "6");
  set("WORLD_SIZE", "8");
  set("LOCAL_RANK", "2");
  set("LOCAL_WORLD_SIZE", "4");
  set("MASTER_ADDR", "10.1.2.3");
  set("MASTER_PORT", "29555");
  ResolvedEnv r = resolve_env({});
  EXPECT_EQ(r.rank, 6);
  EXPECT_EQ(r.world_size, 8);
  EXPECT_EQ(r.local_rank, 2);
  EXPECT_EQ(r.local_world_size, 4);
  EXPECT_EQ(r.master_addr, "10.1.2.3");
  EXPECT_EQ(r.master_port, 29555);
  EXPECT_EQ(r.source, "torchrun env");
}

TEST_F(ResolveEnv, SlurmVariables) {
  set("SLURM_PROCID", "5");
  set("SLURM_NTASKS", "8");
  set("SLURM_LOCALID", "1");
  set("SLURM_NTASKS_PER_NODE", "4");
  set("SLURM_JOB_NODELIST", "gpu[07-08]");
  ResolvedEnv r = resolve_env({});
  EXPECT_EQ(r.rank, 5);
  EXPECT_EQ(r.world_size, 8);
  EXPECT_EQ(r.local_rank, 1);
  EXPECT_EQ(r.local_world_size, 4);
  EXPECT_EQ(r.master_addr, "gpu07");  // first host, zero padding kept
  EXPECT_EQ(r.master_port, 29500);
  EXPECT_EQ(r.source, "slurm");

  // MASTER_ADDR / MASTER_PORT exported by the job script beat the node list.
  set("MASTER_ADDR", "login-node");
  set("MASTER_PORT", "12345");
  r = resolve_env({});
  EXPECT_EQ(r.master_addr, "login-node");
  EXPECT_EQ(r.master_port, 12345);
}

TEST_F(ResolveEnv, SlurmNodeListsAndTasksPerNode) {
  set("SLURM_PROCID", "0");
  set("SLURM_NTASKS", "7");
  const std::pair<const char*, const char*> lists[] = {
      {"node01,node02", "node01"},
      {"node[3,5-6]", "node3"},
      {"rack[1-2]-gpu[01-08],other", "rack1-gpu01"},
      {"single", "single"},
  };
  for (auto [list, first] : lists) {
    set("SLURM_JOB_NODELIST", list);
    EXPECT_EQ(resolve_env({}).master_addr, first) << list;
  }
  unsetenv("SLURM_JOB_NODELIST");
  set("SLURM_NODELIST", "old[9-10]");  // the older name
  EXPECT_EQ(resolve_env({}).master_addr, "old9");

  // srun always sets SLURM_TASKS_PER_NODE, per node: "2(x3),1" is 2,2,2,1.
  set("SLURM_TASKS_PER_NODE", "2(x3),1");
  set("SLURM_NODEID", "3");
  EXPECT_EQ(resolve_env({}).local_world_size, 1);
  set("SLURM_NODEID", "2");
  EXPECT_EQ(resolve_env({}).local_world_size, 2);
  // --ntasks-per-node's variable wins when present.
  set("SLURM_NTASKS_PER_NODE", "3");
  EXPECT_EQ(resolve_env({}).local_world_size, 3);
}

TEST_F(ResolveEnv, TorchrunWinsOverSlurm) {
  // srun launching torchrun: SLURM's describe the launcher, torchrun's the worker.
  set("SLURM_PROCID", "1");
  set("SLURM_NTASKS", "2");
  set("SLURM_LOCALID", "0");
  set("SLURM_JOB_NODELIST", "n[1-2]");
  set("RANK", "9");
  set("WORLD_SIZE", "16");
  set("LOCAL_RANK", "1");
  set("LOCAL_WORLD_SIZE", "8");
  set("MASTER_ADDR", "n1");
  set("MASTER_PORT", "29400");
  ResolvedEnv r = resolve_env({});
  EXPECT_EQ(r.rank, 9);
  EXPECT_EQ(r.world_size, 16);
  EXPECT_EQ(r.local_rank, 1);
  EXPECT_EQ(r.local_world_size, 8);
  EXPECT_EQ(r.master_addr, "n1");
  EXPECT_EQ(r.source, "torchrun env");
}

TEST_F(ResolveEnv, ExplicitOptionsWin) {
  set("RANK", "3");
  set("WORLD_SIZE", "4");
  set("LOCAL_RANK", "3");
  set("MASTER_ADDR", "env-host");
  set("MASTER_PORT", "1111");
  InitOptions o;
  o.rank = 1;
  o.world_size = 2;
  o.local_rank = 0;
  o.master_addr = "explicit-host";
  o.master_port = 2222;
  ResolvedEnv r = resolve_env(o);
  EXPECT_EQ(r.rank, 1);
  EXPECT_EQ(r.world_size, 2);
  EXPECT_EQ(r.local_rank, 0);
  EXPECT_EQ(r.master_addr, "explicit-host");
  EXPECT_EQ(r.master_port, 2222);
  EXPECT_EQ(r.source, "explicit");

  // Options and variables mix per field.
  InitOptions partial;
  partial.master_port = 3333;
  r = resolve_env(partial);
  EXPECT_EQ(r.rank, 3);
  EXPECT_EQ(r.master_addr, "env-host");
  EXPECT_EQ(r.master_port, 3333);
}

// The timeout: the option, else EMBER_DIST_TIMEOUT_SEC, else 10 minutes
// (before, only code could set it, so users of the examples could not).
TEST_F(ResolveEnv, TimeoutFromOptionVariableOrDefault) {
  ResolvedEnv r = resolve_env({});
  EXPECT_EQ(r.timeout, Millis{600000});
  EXPECT_EQ(r.timeout_from, "the default");
  set("EMBER_DIST_TIMEOUT_SEC", "2.5");
  r = resolve_env({});
  EXPECT_EQ(r.timeout, Millis{2500});
  EXPECT_EQ(r.timeout_from, "EMBER_DIST_TIMEOUT_SEC");
  InitOptions o;
  o.timeout = Millis{700};
  r = resolve_env(o);
  EXPECT_EQ(r.timeout, Millis{700});
  EXPECT_EQ(r.timeout_from, "InitOptions::timeout");
  for (const char* bad : {"abc", "0", "-5", "10s", "1e9"}) {
    set("EMBER_DIST_TIMEOUT_SEC", bad);
    EXPECT_THAT(error_of({}), HasSubstr(std::string("EMBER_DIST_TIMEOUT_SEC=") + bad + " is not a timeout"));
  }
  o.timeout = Millis{-1};
  EXPECT_THAT(error_of(o), HasSubstr("InitOptions::timeout=-1 ms is invalid"));
}

// The rendezvous gives up sooner than a collective: the option, else
// EMBER_RDZV_TIMEOUT_SEC, else min(timeout, 2 minutes).
TEST_F(ResolveEnv, RendezvousTimeoutIsShortByDefault) {
  ResolvedEnv r = resolve_env({});
  EXPECT_EQ(r.rendezvous_timeout, Millis{120000});
  EXPECT_EQ(r.rendezvous_timeout_from, "the default");
  InitOptions o;
  o.timeout = Millis{30000};
  EXPECT_EQ(resolve_env(o).rendezvous_timeout, Millis{30000});  // never longer than the timeout
  set("EMBER_RDZV_TIMEOUT_SEC", "7");
  r = resolve_env({});
  EXPECT_EQ(r.rendezvous_timeout, Millis{7000});
  EXPECT_EQ(r.rendezvous_timeout_from, "EMBER_RDZV_TIMEOUT_SEC");
  o.rendezvous_timeout = Millis{900};
  EXPECT_EQ(resolve_env(o).rendezvous_timeout, Millis{900});
  set("EMBER_RDZV_TIMEOUT_SEC", "never");
  EXPECT_THAT(error_of({}), HasSubstr("EMBER_RDZV_TIMEOUT_SEC=never is not a timeout"));
}

TEST_F(ResolveEnv, AGivenStoreNeedsNoAddress) {
  set("RANK", "1");
  set("WORLD_SIZE", "2");
  InitOptions o;
  o.store = std::make_shared<PrefixStore>("unused", std::make_shared<FileStore>(::testing::TempDir() + "/init_test_store"));
  ResolvedEnv r = resolve_env(o);
  EXPECT_EQ(r.rank, 1);
  EXPECT_EQ(r.world_size, 2);
}

TEST_F(ResolveEnv, ErrorsNameTheVariableAndValue) {
  set("RANK", "5");
  set("WORLD_SIZE", "4");
  set("MASTER_ADDR", "h");
  set("MASTER_PORT", "1234");
  EXPECT_THAT(error_of({}), HasSubstr("RANK=5 must be below WORLD_SIZE=4"));
  set("RANK", "-1");
  EXPECT_THAT(error_of({}), HasSubstr("RANK=-1 must be at least 0"));
  set("RANK", "abc");
  EXPECT_THAT(error_of({}), HasSubstr("RANK=abc is not an integer"));
  set("RANK", "1x");
  EXPECT_THAT(error_of({}), HasSubstr("RANK=1x is not an integer"));
  set("RANK", "0");
  set("WORLD_SIZE", "0");
  EXPECT_THAT(error_of({}), HasSubstr("WORLD_SIZE=0 must be at least 1"));
  set("WORLD_SIZE", "4");
  set("MASTER_PORT", "70000");
  EXPECT_THAT(error_of({}), HasSubstr("MASTER_PORT=70000 is not a port"));
  set("MASTER_PORT", "0");
  EXPECT_THAT(error_of({}), HasSubstr("MASTER_PORT=0 cannot be used with WORLD_SIZE=4"));
  set("MASTER_PORT", "1234");
  set("LOCAL_RANK", "3");
  set("LOCAL_WORLD_SIZE", "2");
  EXPECT_THAT(error_of({}), HasSubstr("LOCAL_RANK=3 must be below LOCAL_WORLD_SIZE=2"));
}

TEST_F(ResolveEnv, MissingVariablesAreNamed) {
  set("RANK", "1");
  EXPECT_THAT(error_of({}), HasSubstr("RANK=1 is set but the world size is not"));
  unsetenv("RANK");
  set("WORLD_SIZE", "4");
  EXPECT_THAT(error_of({}), HasSubstr("WORLD_SIZE=4 is set but the rank is not"));
  set("RANK", "1");
  set("MASTER_PORT", "1234");
  std::string err = error_of({});
  EXPECT_THAT(err, HasSubstr("MASTER_ADDR is not set"));
  EXPECT_THAT(err, HasSubstr("rank 1 of WORLD_SIZE=4"));
  set("MASTER_ADDR", "h");
  unsetenv("MASTER_PORT");
  EXPECT_THAT(error_of({}), HasSubstr("MASTER_PORT is not set"));
  // An empty variable is as good as unset.
  set("MASTER_PORT", "");
  EXPECT_THAT(error_of({}), HasSubstr("MASTER_PORT is not set"));
  // A world of one needs no rendezvous address.
  set("WORLD_SIZE", "1");
  set("RANK", "0");
  unsetenv("MASTER_ADDR");
  ResolvedEnv r = resolve_env({});
  EXPECT_EQ(r.world_size, 1);
  EXPECT_EQ(r.master_addr, "127.0.0.1");
}

TEST_F(ResolveEnv, SlurmErrorsNameSlurmVariables) {
  set("SLURM_PROCID", "3");
  set("SLURM_NTASKS", "2");
  EXPECT_THAT(error_of({}), HasSubstr("SLURM_PROCID=3 must be below SLURM_NTASKS=2"));
  set("SLURM_PROCID", "1");
  set("SLURM_JOB_NODELIST", "node[01-04");
  EXPECT_THAT(error_of({}), HasSubstr("SLURM_JOB_NODELIST=node[01-04 is not a valid Slurm host list"));
  set("SLURM_JOB_NODELIST", "node1");
  set("SLURM_TASKS_PER_NODE", "2(x2)");
  set("SLURM_NODEID", "5");
  EXPECT_THAT(error_of({}), HasSubstr("SLURM_TASKS_PER_NODE=2(x2) lists 2 nodes but SLURM_NODEID=5"));
  unsetenv("SLURM_TASKS_PER_NODE");
  unsetenv("SLURM_JOB_NODELIST");
  std::string err = error_of({});
  EXPECT_THAT(err, HasSubstr("MASTER_ADDR is not set"));
  EXPECT_THAT(err, HasSubstr("SLURM_NTASKS=2"));
}

TEST_F(ResolveEnv, BadOptionsAreNamed) {
  InitOptions o;
  o.rank = -2;
  EXPECT_THAT(error_of(o), HasSubstr("InitOptions::rank=-2 is invalid"));
  o = {};
  o.world_size = 0;
  EXPECT_THAT(error_of(o), HasSubstr("InitOptions::world_size=0 is invalid"));
  o = {};
  o.rank = 4;
  o.world_size = 4;
  EXPECT_THAT(error_of(o), HasSubstr("InitOptions::rank=4 must be below InitOptions::world_size=4"));
  o = {};
  o.master_port = 65536;
  EXPECT_THAT(error_of(o), HasSubstr("InitOptions::master_port=65536"));
  o = {};
  o.rank = 1;
  EXPECT_THAT(error_of(o), HasSubstr("InitOptions::rank=1 is set but the world size is not"));
  o = {};
  o.world_size = 3;
  EXPECT_THAT(error_of(o), HasSubstr("InitOptions::world_size=3 is set but the rank is not"));
}

// The accessors before init_process_group fail by name rather than crash.
TEST_F(ResolveEnv, GroupAccessorsBeforeInit) {
  EXPECT_FALSE(is_initialized());
  auto msg = [](auto f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "<no ember::Error thrown>";
  };
  EXPECT_THAT(msg([] { default_group(); }), HasSubstr("not initialized"));
  EXPECT_THAT(msg([] { get_rank(); }), HasSubstr("not initialized"));
  EXPECT_THAT(msg([] { get_world_size(); }), HasSubstr("not initialized"));
  EXPECT_THAT(msg([] { new_group({0}); }), HasSubstr("not initialized"));
  destroy_process_group();  // a no-op, not an error
  InitOptions o;
  o.backend = "mpi";
  EXPECT_THAT(msg([&] { init_process_group(o); }), HasSubstr("unknown backend \"mpi\""));
  EXPECT_FALSE(is_initialized());
}

}  // namespace
}  // namespace ember::distributed
