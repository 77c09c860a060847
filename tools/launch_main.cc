// //tools:launch, ember's torchrun: runs a program as N local worker
// processes of a distributed job (see distributed/launch/launch.h for what the
// workers get and how failures and signals are handled).
//
//   bazel run //tools:launch -- --nproc_per_node=4 -- bazel-bin/examples/ddp_mnist --epochs=1
//
// Flags take "--flag=value" or "--flag value", with '_' or '-' inside the
// name (torchrun spells them both ways). The program starts at "--" or at
// the first argument that is not a flag.
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/exception.h"
#include "distributed/launch/elastic.h"
#include "distributed/launch/launch.h"
#include "distributed/store/etcd_store.h"

namespace {

constexpr int kUsageExit = 2;

const char* kUsage =
    "usage: launch [--nproc_per_node=N] [--nnodes=M --node_rank=K] [--master_addr=HOST]\n"
    "              [--master_port=PORT] [--grace_ms=MS] [--max_restarts=K] [--no-prefix] [--]\n"
    "              PROGRAM [ARGS...]\n"
    "       launch --nnodes=MIN:MAX --rdzv_endpoint=HOST:PORT --rdzv_id=JOB [--nproc_per_node=N]\n"
    "              [--max_restarts=K] [--rdzv_conf=KEY=S,...] [--local_addr=HOST] [--live-recovery]\n"
    "              [--] PROGRAM [ARGS...]\n"
    "\n"
    "Runs PROGRAM as N worker processes with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,\n"
    "GROUP_RANK, MASTER_ADDR and MASTER_PORT set (as torchrun does).\n"
    "\n"
    "  --nproc_per_node=N  workers on this node (default 1)\n"
    "  --nnodes=M          nodes in the job (default 1); run the launcher once on each\n"
    "  --node_rank=K       this node's index in [0, M) (default 0)\n"
    "  --master_addr=HOST  where rank 0's store listens (default 127.0.0.1)\n"
    "  --master_port=PORT  its port (default 29500; 0 picks a free one, single node only)\n"
    "  --grace_ms=MS       after a failure, SIGKILL workers still alive MS ms after\n"
    "                      SIGTERM (default 5000)\n"
    "  --max_restarts=K    after a worker fails, start every worker again, up to K times, with\n"
    "                      EMBER_RESTART_COUNT set (default 0; one node only)\n"
    "  --no-prefix         do not start worker output lines with \"[rank N]: \"\n"
    "Elastic (one agent per host, meeting in rendezvous rounds; see distributed/launch/elastic.h):\n"
    "  --nnodes=MIN:MAX    a round starts with MAX nodes, or MIN once no other came for last_call\n"
    "  --rdzv_endpoint=HOST:PORT  the rendezvous store (c10d: served by the first agent on HOST;\n"
    "                      etcd: the cluster's members, HOST:2379,HOST2:2379,...)\n"
    "  --rdzv_id=JOB       the job's name; every agent of the job gives the same\n"
    "  --rdzv_backend=B    c10d (default: a TCP store in the first agent on the endpoint's host) or\n"
    "                      etcd (an etcd cluster: the job survives the loss of any host)\n"
    "  --rdzv_conf=K=S,..  last_call_timeout (default 30), join_timeout (600),\n"
    "                      heartbeat_timeout (30), in seconds\n"
    "  --local_addr=HOST   how other hosts reach this one (default: this host's name)\n"
    "  --max_restarts=K    worker failures the job survives, over all nodes (default 0)\n"
    "  --live-recovery     replace a worker killed by a signal in place (same rank) while the others keep\n"
    "                      running; it takes the training state from a live replica\n"
    "                      (EMBER_LIVE_RECOVERY=1 for the workers; a lost node still starts a round)\n"
    "Flags may be spelled with - or _ (--max-restarts, --nproc-per-node).\n"
    "\n"
    "Exit status: 0 when every worker succeeds, else the first failing worker's exit code\n"
    "(128 + signal if it was killed), 2 for a bad command line.\n";

// Reported by the parser; main prints it with the usage.
struct UsageError {
  std::string message;
};

int parse_int(const std::string& flag, const std::string& value, int lo, int hi) {
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || errno == ERANGE)
    throw UsageError{"--" + flag + ": '" + value + "' is not an integer"};
  if (v < lo || v > hi)
    throw UsageError{"--" + flag + ": " + value + " is outside [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]"};
  return static_cast<int>(v);
}

struct Parsed {
  ember::distributed::LaunchOptions options;
  ember::distributed::ElasticOptions elastic;
  bool is_elastic = false;
  std::string endpoint;  // --rdzv_endpoint as given
  std::vector<std::string> program;
  bool help = false;
};

// torchrun's --rdzv-conf: comma-separated key=seconds.
void parse_rdzv_conf(const std::string& value, ember::distributed::ElasticOptions& e) {
  size_t start = 0;
  while (start < value.size()) {
    size_t end = value.find(',', start);
    if (end == std::string::npos) end = value.size();
    const std::string item = value.substr(start, end - start);
    const size_t eq = item.find('=');
    if (eq == std::string::npos) throw UsageError{"--rdzv_conf: '" + item + "' is not key=value"};
    const std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    char* stop = nullptr;
    const double secs = std::strtod(v.c_str(), &stop);
    if (v.empty() || *stop != '\0' || !(secs >= 0) || secs > 1e7)
      throw UsageError{"--rdzv_conf " + k + ": '" + v + "' is not a number of seconds"};
    const auto ms = std::chrono::milliseconds(static_cast<long long>(secs * 1000));
    if (k == "last_call_timeout")
      e.last_call = ms;
    else if (k == "join_timeout")
      e.join_timeout = ms;
    else if (k == "heartbeat_timeout")
      e.heartbeat_timeout = ms;
    else
      throw UsageError{"--rdzv_conf: unknown key '" + k + "' (last_call_timeout, join_timeout, heartbeat_timeout)"};
    start = end + 1;
  }
}

// Which flags the command line gave, for the checks of how they combine.
struct Given {
  bool node_rank = false, elastic_range = false, rdzv = false, master = false, live = false;
};

// One flag that takes a value (`name` with dashes as underscores), applied
// to `p`.
void apply_flag(const std::string& name, const std::string& value, Parsed& p, Given& given) {
  auto& o = p.options;
  if (name == "nproc_per_node") o.nproc_per_node = parse_int(name, value, 1, 1 << 16);
  auto& e = p.elastic;
  if (name == "master_addr" || name == "master_port") given.master = true;
  if (name == "rdzv_id" || name == "rdzv_conf" || name == "rdzv_backend" || name == "local_addr") given.rdzv = true;
  if (name == "nnodes") {
    if (size_t colon = value.find(':'); colon != std::string::npos) {
      e.min_nodes = parse_int(name, value.substr(0, colon), 1, 1 << 20);
      e.max_nodes = parse_int(name, value.substr(colon + 1), 1, 1 << 20);
      if (e.max_nodes < e.min_nodes) throw UsageError{"--nnodes " + value + ": MAX is less than MIN"};
      o.nnodes = e.max_nodes;
      given.elastic_range = true;
    } else {
      o.nnodes = parse_int(name, value, 1, 1 << 20);
      e.min_nodes = e.max_nodes = o.nnodes;
    }
  }
  if (name == "rdzv_endpoint") {
    p.endpoint = value;  // parsed once the backend is known
    p.is_elastic = true;
  }
  if (name == "rdzv_id") {
    if (value.empty()) throw UsageError{"--rdzv_id is empty"};
    e.rdzv_id = value;
  }
  if (name == "rdzv_backend") {
    if (value != "c10d" && value != "etcd" && value != "etcd-v2")
      throw UsageError{"--rdzv_backend " + value +
                       ": known are c10d (the store the first agent serves) and etcd (an etcd cluster; etcd-v2 "
                       "is accepted for torchrun's name)"};
    e.rdzv_backend = value == "c10d" ? "c10d" : "etcd";
  }
  if (name == "local_addr") e.local_addr = value;
  if (name == "rdzv_conf") parse_rdzv_conf(value, e);
  if (name == "node_rank") {
    o.node_rank = parse_int(name, value, 0, 1 << 20);
    given.node_rank = true;
  }
  if (name == "master_port") o.master_port = parse_int(name, value, 0, 65535);
  if (name == "grace_ms") o.grace = std::chrono::milliseconds(parse_int(name, value, 0, 1 << 30));
  if (name == "max_restarts") o.max_restarts = parse_int(name, value, 0, 1 << 20);
  if (name == "master_addr") {
    if (value.empty()) throw UsageError{"--master_addr is empty"};
    o.master_addr = value;
  }
}

// The checks of how the flags combine, once all are read; an elastic
// launch also takes the per-node options into its own.
void check_combination(Parsed& p, const Given& given) {
  if (p.program.empty()) throw UsageError{"no program given"};
  if (given.elastic_range && !p.is_elastic)
    throw UsageError{"--nnodes MIN:MAX needs --rdzv_endpoint HOST:PORT (where the agents meet)"};
  if (!p.is_elastic && given.live)
    throw UsageError{"--live-recovery needs --rdzv_endpoint HOST:PORT and --rdzv_id JOB (elastic agents)"};
  if (!p.is_elastic && given.rdzv)
    throw UsageError{"--rdzv_id, --rdzv_conf, --rdzv_backend and --local_addr need --rdzv_endpoint HOST:PORT"};
  if (p.is_elastic) {
    if (given.node_rank)
      throw UsageError{"--node_rank does not go with --rdzv_endpoint: ranks come from the rendezvous"};
    if (given.master)
      throw UsageError{
          "--master_addr/--master_port do not go with --rdzv_endpoint: each round picks the workers' store"};
    auto& e = p.elastic;
    if (e.rdzv_backend == "etcd") {
      try {
        e.etcd_endpoints = ember::distributed::parse_etcd_endpoints(p.endpoint);
      } catch (const ember::Error& err) {
        throw UsageError{std::string("--rdzv_endpoint: ") + err.what()};
      }
      const std::string& first = e.etcd_endpoints.front();
      e.endpoint_host = first.substr(0, first.rfind(':'));
      e.endpoint_port = std::stoi(first.substr(first.rfind(':') + 1));
    } else {
      const std::string& v = p.endpoint;
      const size_t colon = v.rfind(':');
      if (v.find(',') != std::string::npos)
        throw UsageError{"--rdzv_endpoint " + v + ": a list of endpoints needs --rdzv_backend etcd"};
      if (colon == std::string::npos || colon == 0) throw UsageError{"--rdzv_endpoint " + v + ": expected HOST:PORT"};
      e.endpoint_host = v.substr(0, colon);
      e.endpoint_port = parse_int("rdzv_endpoint", v.substr(colon + 1), 1, 65535);
    }
    e.nproc_per_node = p.options.nproc_per_node;
    e.max_restarts = p.options.max_restarts;
    e.grace = p.options.grace;
    e.prefix_output = p.options.prefix_output;
    return;
  }
  const auto& o = p.options;
  if (o.node_rank >= o.nnodes)
    throw UsageError{"--node_rank " + std::to_string(o.node_rank) +
                     " is outside [0, --nnodes=" + std::to_string(o.nnodes) + ")"};
  if (o.nnodes > 1 && !given.node_rank)
    throw UsageError{"--nnodes=" + std::to_string(o.nnodes) + " needs --node_rank on every node"};
  if (o.nnodes > 1 && o.master_port == 0) throw UsageError{"--master_port=0 (a free port) only works with --nnodes=1"};
  if (o.nnodes > 1 && o.max_restarts > 0)
    throw UsageError{"--max_restarts with --nnodes=" + std::to_string(o.nnodes) +
                     " needs elastic agents: add --rdzv_endpoint HOST:PORT --rdzv_id JOB"};
}

Parsed parse(int argc, char** argv) {
  Parsed p;
  Given given;
  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "-h" || arg == "--help") {
      p.help = true;
      return p;
    }
    if (arg.rfind("--", 0) != 0) break;  // the program
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    for (char& c : name)
      if (c == '-') c = '_';
    if (name == "no_prefix") {
      if (has_value) throw UsageError{"--no-prefix takes no value"};
      p.options.prefix_output = false;
      continue;
    }
    if (name == "live_recovery") {
      if (has_value) throw UsageError{"--live-recovery takes no value"};
      p.elastic.live_recovery = true;
      given.live = true;
      continue;
    }
    const bool known = name == "nproc_per_node" || name == "nnodes" || name == "node_rank" || name == "master_addr" ||
                       name == "master_port" || name == "grace_ms" || name == "max_restarts" ||
                       name == "rdzv_endpoint" || name == "rdzv_id" || name == "rdzv_conf" || name == "rdzv_backend" ||
                       name == "local_addr";
    if (!known) throw UsageError{"unknown flag " + arg.substr(0, arg.find('='))};
    if (!has_value) {
      if (i + 1 >= argc) throw UsageError{"--" + name + " needs a value"};
      value = argv[++i];
    }
    apply_flag(name, value, p, given);
  }
  for (; i < argc; ++i) p.program.emplace_back(argv[i]);
  check_combination(p, given);
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  Parsed p;
  try {
    p = parse(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "launch: %s\n\n%s", e.message.c_str(), kUsage);
    return kUsageExit;
  }
  if (p.help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  // `bazel run` starts us in our runfiles directory; the user meant paths
  // (PROGRAM, and whatever the workers open) relative to where they typed it.
  if (const char* wd = std::getenv("BUILD_WORKING_DIRECTORY"); wd && *wd) {
    if (::chdir(wd) != 0) {
      std::fprintf(stderr, "launch: cannot enter BUILD_WORKING_DIRECTORY '%s': %s\n", wd,
                   std::strerror(errno));
      return kUsageExit;
    }
  }
  try {
    if (p.is_elastic) return ember::distributed::elastic_launch(p.elastic, p.program);
    return ember::distributed::launch(p.options, p.program);
  } catch (const ember::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());  // messages already start with "launch: "
    return kUsageExit;
  }
}
