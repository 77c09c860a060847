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
#include <utility>
#include <vector>

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
  using Vars = std::vector<std::pair<const char*, const char*>>;
  // Sets each variable, or unsets it where the value is nullptr.
  static void set(const Vars& vars) {
    for (const auto& [name, value] : vars) value ? set(name, value) : (void)unsetenv(name);
  }

  // The fields every source decides, checked together.
  struct Want {
    int rank, world_size, local_rank, local_world_size;
    std::string master_addr;
    int master_port;
    std::string source;
  };
  static void expect_resolved(const ResolvedEnv& r, const Want& w) {
    EXPECT_EQ(r.rank, w.rank);
    EXPECT_EQ(r.world_size, w.world_size);
    EXPECT_EQ(r.local_rank, w.local_rank);
    EXPECT_EQ(r.local_world_size, w.local_world_size);
    EXPECT_EQ(r.master_addr, w.master_addr);
    EXPECT_EQ(r.master_port, w.master_port);
    EXPECT_EQ(r.source, w.source);
  }
  // Exports `w` as torchrun does, so resolve_env should give `w` back.
  static void set_torchrun(const Want& w) {
    set("RANK", std::to_string(w.rank));
    set("WORLD_SIZE", std::to_string(w.world_size));
    set("LOCAL_RANK", std::to_string(w.local_rank));
    set("LOCAL_WORLD_SIZE", std::to_string(w.local_world_size));
    set("MASTER_ADDR", w.master_addr);
    set("MASTER_PORT", std::to_string(w.master_port));
  }

  // One step of a scenario: variables to set on top of the earlier steps',
  // then the substrings resolve_env's error must contain.
  struct Step {
    Vars vars;
    std::vector<std::string> errors;
  };
  static void expect_errors(const std::vector<Step>& steps) {
    for (const Step& step : steps) {
      set(step.vars);
      const std::string err = error_of({});
      for (const std::string& want : step.errors) EXPECT_THAT(err, HasSubstr(want));
    }
  }

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
  // Port 0: a free port, nobody else needs to find it.
  expect_resolved(resolve_env({}), {0, 1, 0, 1, "127.0.0.1", 0, "default"});
}

TEST_F(ResolveEnv, TorchrunVariables) {
  const Want torchrun{6, 8, 2, 4, "10.1.2.3", 29555, "torchrun env"};
  set_torchrun(torchrun);
  expect_resolved(resolve_env({}), torchrun);
}

TEST_F(ResolveEnv, SlurmVariables) {
  set({{"SLURM_PROCID", "5"},
       {"SLURM_NTASKS", "8"},
       {"SLURM_LOCALID", "1"},
       {"SLURM_NTASKS_PER_NODE", "4"},
       {"SLURM_JOB_NODELIST", "gpu[07-08]"}});
  // The address: the first host, zero padding kept.
  expect_resolved(resolve_env({}), {5, 8, 1, 4, "gpu07", 29500, "slurm"});

  // MASTER_ADDR / MASTER_PORT exported by the job script beat the node list.
  set("MASTER_ADDR", "login-node");
  set("MASTER_PORT", "12345");
  ResolvedEnv r = resolve_env({});
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
  set({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_JOB_NODELIST", "n[1-2]"}});
  const Want torchrun{9, 16, 1, 8, "n1", 29400, "torchrun env"};
  set_torchrun(torchrun);
  expect_resolved(resolve_env({}), torchrun);
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
  expect_errors({
      {{{"RANK", "5"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1234"}},
       {"RANK=5 must be below WORLD_SIZE=4"}},
      {{{"RANK", "-1"}}, {"RANK=-1 must be at least 0"}},
      {{{"RANK", "abc"}}, {"RANK=abc is not an integer"}},
      {{{"RANK", "1x"}}, {"RANK=1x is not an integer"}},
      {{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, {"WORLD_SIZE=0 must be at least 1"}},
      {{{"WORLD_SIZE", "4"}, {"MASTER_PORT", "70000"}}, {"MASTER_PORT=70000 is not a port"}},
      {{{"MASTER_PORT", "0"}}, {"MASTER_PORT=0 cannot be used with WORLD_SIZE=4"}},
      {{{"MASTER_PORT", "1234"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "2"}},
       {"LOCAL_RANK=3 must be below LOCAL_WORLD_SIZE=2"}},
  });
}

TEST_F(ResolveEnv, MissingVariablesAreNamed) {
  expect_errors({
      {{{"RANK", "1"}}, {"RANK=1 is set but the world size is not"}},
      {{{"RANK", nullptr}, {"WORLD_SIZE", "4"}}, {"WORLD_SIZE=4 is set but the rank is not"}},
      {{{"RANK", "1"}, {"MASTER_PORT", "1234"}}, {"MASTER_ADDR is not set", "rank 1 of WORLD_SIZE=4"}},
      {{{"MASTER_ADDR", "h"}, {"MASTER_PORT", nullptr}}, {"MASTER_PORT is not set"}},
      // An empty variable is as good as unset.
      {{{"MASTER_PORT", ""}}, {"MASTER_PORT is not set"}},
  });
  // A world of one needs no rendezvous address.
  set("WORLD_SIZE", "1");
  set("RANK", "0");
  unsetenv("MASTER_ADDR");
  ResolvedEnv r = resolve_env({});
  EXPECT_EQ(r.world_size, 1);
  EXPECT_EQ(r.master_addr, "127.0.0.1");
}

TEST_F(ResolveEnv, SlurmErrorsNameSlurmVariables) {
  expect_errors({
      {{{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "2"}}, {"SLURM_PROCID=3 must be below SLURM_NTASKS=2"}},
      {{{"SLURM_PROCID", "1"}, {"SLURM_JOB_NODELIST", "node[01-04"}},
       {"SLURM_JOB_NODELIST=node[01-04 is not a valid Slurm host list"}},
      {{{"SLURM_JOB_NODELIST", "node1"}, {"SLURM_TASKS_PER_NODE", "2(x2)"}, {"SLURM_NODEID", "5"}},
       {"SLURM_TASKS_PER_NODE=2(x2) lists 2 nodes but SLURM_NODEID=5"}},
      {{{"SLURM_TASKS_PER_NODE", nullptr}, {"SLURM_JOB_NODELIST", nullptr}},
       {"MASTER_ADDR is not set", "SLURM_NTASKS=2"}},
  });
}

TEST_F(ResolveEnv, BadOptionsAreNamed) {
  // Each case: bad settings on default options, and the error naming them.
  const std::pair<std::function<void(InitOptions&)>, const char*> cases[] = {
      {[](InitOptions& o) { o.rank = -2; }, "InitOptions::rank=-2 is invalid"},
      {[](InitOptions& o) { o.world_size = 0; }, "InitOptions::world_size=0 is invalid"},
      {[](InitOptions& o) { o.rank = 4, o.world_size = 4; },
       "InitOptions::rank=4 must be below InitOptions::world_size=4"},
      {[](InitOptions& o) { o.master_port = 65536; }, "InitOptions::master_port=65536"},
      {[](InitOptions& o) { o.rank = 1; }, "InitOptions::rank=1 is set but the world size is not"},
      {[](InitOptions& o) { o.world_size = 3; }, "InitOptions::world_size=3 is set but the rank is not"},
  };
  for (const auto& [bad, error] : cases) {
    InitOptions o;
    bad(o);
    EXPECT_THAT(error_of(o), HasSubstr(error));
  }
}

// The accessors before init_process_group fail by name rather than crash.
TEST_F(ResolveEnv, GroupAccessorsBeforeInit) {
  EXPECT_FALSE(is_initialized());
  const auto msg = ::ember::testing::error_of;
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
