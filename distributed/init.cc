// Process-group initialisation: resolving rank, world and rendezvous from
// options and the launcher's environment (torchrun or SLURM's srun), and the
// process-wide default group with its sub-groups.
#include "distributed/init.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <thread>

#include "core/exception.h"
#include "distributed/comm/backends.h"
#include "distributed/logging/logging.h"

namespace ember::distributed {

// How long a rendezvous waits by default (capped by the timeout): long enough
// for ranks started by a scheduler seconds apart, short enough that a wrong
// MASTER_ADDR/PORT is reported while the user is still watching.
constexpr Millis kDefaultRendezvousTimeout{2 * 60 * 1000};
namespace {

// An empty variable counts as unset: `export MASTER_ADDR=$UNSET_THING` in a
// job script should read as "not set", not as a host named "".
std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int parse_int(const std::string& name, const std::string& text) {
  int64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  EMBER_CHECK(ec == std::errc() && p == text.data() + text.size(), name, "=", text, " is not an integer");
  EMBER_CHECK(v >= INT32_MIN && v <= INT32_MAX, name, "=", text, " is out of range");
  return static_cast<int>(v);
}

// One resolved integer and the name to blame for it in messages: the
// variable it came from, or the option.
struct Field {
  int value = 0;
  std::string name;
  bool known = false;
};

Field from_option(int value, const char* option) { return {value, option, true}; }

Field from_env(const char* var) { return {parse_int(var, *env(var)), var, true}; }

// SLURM_JOB_NODELIST uses Slurm's hostlist syntax: "node01,node02",
// "node[01-04,07]", "rack[1-2]-gpu[01-08]". The first host takes the first
// entry and, inside each bracket, the first number (keeping its padding).
std::string first_host(const std::string& var, const std::string& list) {
  std::string host;
  size_t i = 0;
  while (i < list.size() && list[i] != ',') {
    if (list[i] == '[') {
      size_t close = list.find(']', i);
      EMBER_CHECK(close != std::string::npos, var, "=", list, " is not a valid Slurm host list (unclosed '[')");
      std::string inner = list.substr(i + 1, close - i - 1);
      inner = inner.substr(0, inner.find(','));
      inner = inner.substr(0, inner.find('-'));
      EMBER_CHECK(!inner.empty(), var, "=", list, " is not a valid Slurm host list (empty range)");
      host += inner;
      i = close + 1;
    } else {
      host += list[i++];
    }
  }
  EMBER_CHECK(!host.empty(), var, "=", list, " is not a valid Slurm host list (no first host)");
  return host;
}

// Slurm's tasks-per-node syntax: "4", or per node "2(x3),1" (three nodes of
// 2 then one of 1). `node` picks the entry; the first when unknown.
int tasks_on_node(const std::string& var, const std::string& text, int node) {
  // A bare number (--ntasks-per-node) holds for every node.
  if (text.find_first_of(",(") == std::string::npos) return parse_int(var, text);
  size_t i = 0;
  int index = 0;
  while (i < text.size()) {
    size_t end = text.find(',', i);
    std::string entry = text.substr(i, end == std::string::npos ? std::string::npos : end - i);
    int count = 1;
    size_t paren = entry.find("(x");
    if (paren != std::string::npos) {
      EMBER_CHECK(entry.back() == ')', var, "=", text, " is not a valid Slurm tasks-per-node list");
      count = parse_int(var, entry.substr(paren + 2, entry.size() - paren - 3));
      entry = entry.substr(0, paren);
    }
    int tasks = parse_int(var, entry);
    if (node < index + count) return tasks;
    index += count;
    if (end == std::string::npos) break;
    i = end + 1;
  }
  EMBER_CHECK(false, var, "=", text, " lists ", index, " nodes but SLURM_NODEID=", node);
  return 0;
}

// The options' own ranges, checked before any variable is read: a bad
// option is the caller's bug whatever the environment says.
void check_options(const InitOptions& o) {
  EMBER_CHECK(o.rank >= -1, "InitOptions::rank=", o.rank, " is invalid: pass a rank >= 0, or -1 to take RANK or "
              "SLURM_PROCID from the environment");
  EMBER_CHECK(o.world_size == -1 || o.world_size >= 1, "InitOptions::world_size=", o.world_size,
              " is invalid: pass a size >= 1, or -1 to take WORLD_SIZE or SLURM_NTASKS from the environment");
  EMBER_CHECK(o.local_rank >= -1, "InitOptions::local_rank=", o.local_rank,
              " is invalid: pass a local rank >= 0, or -1 to take LOCAL_RANK or SLURM_LOCALID from the environment");
  EMBER_CHECK(o.master_port >= -1 && o.master_port <= 65535, "InitOptions::master_port=", o.master_port,
              " is not a port (0-65535), or -1 to take MASTER_PORT from the environment");
  EMBER_CHECK(o.timeout >= Millis{0}, "InitOptions::timeout=", o.timeout.count(),
              " ms is invalid: pass a positive timeout, or 0 to take EMBER_DIST_TIMEOUT_SEC or the default");
}

// Which launcher speaks for the process.
struct Launcher {
  bool torchrun = false, slurm = false;
};

// Rank and world size, and where they came from (r.source). Returns the
// world size's field: later messages name the setting it came from.
Field resolve_rank_and_world(const InitOptions& o, const Launcher& l, ResolvedEnv& r) {
  Field rank, world;
  if (o.rank >= 0) {
    rank = from_option(o.rank, "InitOptions::rank");
  } else if (l.torchrun && env("RANK")) {
    rank = from_env("RANK");
  } else if (l.slurm) {
    rank = from_env("SLURM_PROCID");
  }
  if (o.world_size >= 1) {
    world = from_option(o.world_size, "InitOptions::world_size");
  } else if (l.torchrun && env("WORLD_SIZE")) {
    world = from_env("WORLD_SIZE");
  } else if (l.slurm && env("SLURM_NTASKS")) {
    world = from_env("SLURM_NTASKS");
  }

  if (!rank.known && !world.known) {
    // Nothing launched us: a single process, which needs no rendezvous.
    rank = from_option(0, "rank");
    world = from_option(1, "world size");
    r.source = "default";
  } else {
    EMBER_CHECK(world.known, rank.name, "=", rank.value,
                " is set but the world size is not: set WORLD_SIZE (torchrun) or SLURM_NTASKS (srun), or pass "
                "InitOptions::world_size");
    if (!rank.known && world.value == 1) rank = from_option(0, "rank");
    EMBER_CHECK(rank.known, world.name, "=", world.value,
                " is set but the rank is not: set RANK (torchrun) or SLURM_PROCID (srun), or pass InitOptions::rank");
    r.source = o.rank >= 0 && o.world_size >= 1 ? "explicit"
               : l.torchrun                     ? "torchrun env"
               : l.slurm                        ? "slurm"
                                                : "explicit";
  }
  EMBER_CHECK(world.value >= 1, world.name, "=", world.value, " must be at least 1");
  EMBER_CHECK(rank.value >= 0, rank.name, "=", rank.value, " must be at least 0");
  EMBER_CHECK(rank.value < world.value, rank.name, "=", rank.value, " must be below ", world.name, "=", world.value);
  r.rank = rank.value;
  r.world_size = world.value;
  r.world_size_from = world.name;
  return world;
}

// The local rank and the number of ranks on this node.
void resolve_local(const InitOptions& o, const Launcher& l, const Field& world, ResolvedEnv& r) {
  Field local_rank, local_world;
  if (o.local_rank >= 0) {
    local_rank = from_option(o.local_rank, "InitOptions::local_rank");
  } else if (env("LOCAL_RANK")) {
    local_rank = from_env("LOCAL_RANK");
  } else if (l.slurm && env("SLURM_LOCALID")) {
    local_rank = from_env("SLURM_LOCALID");
  }
  if (env("LOCAL_WORLD_SIZE")) {
    local_world = from_env("LOCAL_WORLD_SIZE");
  } else if (l.slurm) {
    // --ntasks-per-node sets the first; srun always sets the second.
    for (const char* var : {"SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
      if (!env(var)) continue;
      int node = env("SLURM_NODEID") ? parse_int("SLURM_NODEID", *env("SLURM_NODEID")) : 0;
      local_world = {tasks_on_node(var, *env(var), node), var, true};
      break;
    }
  }
  if (local_rank.known) {
    EMBER_CHECK(local_rank.value >= 0, local_rank.name, "=", local_rank.value, " must be at least 0");
    r.local_rank = local_rank.value;
  }
  if (local_world.known) {
    EMBER_CHECK(local_world.value >= 1, local_world.name, "=", local_world.value, " must be at least 1");
    EMBER_CHECK(local_world.value <= r.world_size, local_world.name, "=", local_world.value, " exceeds ",
                world.name, "=", world.value);
    EMBER_CHECK(r.local_rank < local_world.value, local_rank.known ? local_rank.name : "local rank", "=",
                r.local_rank, " must be below ", local_world.name, "=", local_world.value);
    r.local_world_size = local_world.value;
  } else {
    // Unknown: report the smallest size consistent with the local rank.
    r.local_world_size = r.local_rank + 1;
  }
}

// Rank 0's store address and port. They matter only when `needs_rendezvous`
// (someone to meet and no store handed to us): otherwise a missing one
// takes a default instead of an error.
void resolve_master(const InitOptions& o, const Launcher& l, const Field& world, bool needs_rendezvous,
                    ResolvedEnv& r) {
  if (!o.master_addr.empty()) {
    r.master_addr = o.master_addr;
    r.master_addr_from = "InitOptions::master_addr";
  } else if (env("MASTER_ADDR")) {
    r.master_addr = *env("MASTER_ADDR");
    r.master_addr_from = "MASTER_ADDR";
  } else if (l.slurm && (env("SLURM_JOB_NODELIST") || env("SLURM_NODELIST"))) {
    const char* var = env("SLURM_JOB_NODELIST") ? "SLURM_JOB_NODELIST" : "SLURM_NODELIST";
    r.master_addr = first_host(var, *env(var));
    r.master_addr_from = std::string("the first host of ") + var;
  } else {
    EMBER_CHECK(!needs_rendezvous, "MASTER_ADDR is not set: rank ", r.rank, " of ", world.name, "=", r.world_size,
                " needs the address of rank 0's store; set MASTER_ADDR (torchrun sets it), or pass "
                "InitOptions::master_addr or InitOptions::store");
    r.master_addr = "127.0.0.1";
    r.master_addr_from = "the default address";
  }

  Field port;
  if (o.master_port >= 0) {
    port = from_option(o.master_port, "InitOptions::master_port");
  } else if (env("MASTER_PORT")) {
    port = from_env("MASTER_PORT");
    EMBER_CHECK(port.value >= 0 && port.value <= 65535, "MASTER_PORT=", port.value, " is not a port (0-65535)");
  } else if (l.slurm) {
    // torchrun's and c10d's default port; srun exports none of its own.
    port = from_option(29500, "the default port");
  } else {
    EMBER_CHECK(!needs_rendezvous, "MASTER_PORT is not set: rank ", r.rank, " of ", world.name, "=", r.world_size,
                " needs the port of rank 0's store; set MASTER_PORT (torchrun sets it), or pass "
                "InitOptions::master_port or InitOptions::store");
    port = from_option(0, "port");  // one process: any free port
  }
  EMBER_CHECK(port.value != 0 || !needs_rendezvous, port.name, "=0 cannot be used with ", world.name, "=",
              r.world_size, ": port 0 picks a free port that the other ranks cannot know");
  r.master_port = port.value;
  r.master_port_from = port.name;
}

// One timeout: the option, else the variable (seconds), else the default.
void resolve_timeout(Millis option, const char* option_name, const char* var, Millis fallback, Millis* out,
                     std::string* from) {
  if (option > Millis{0}) {
    *out = option;
    *from = option_name;
  } else if (auto t = env(var)) {
    double sec = 0;
    auto [p, ec] = std::from_chars(t->data(), t->data() + t->size(), sec);
    EMBER_CHECK(ec == std::errc() && p == t->data() + t->size() && sec > 0 && sec <= 7 * 24 * 3600, var, "=", *t,
                " is not a timeout: give seconds, a number > 0 (at most a week)");
    *out = std::max(Millis{1}, Millis{static_cast<int64_t>(sec * 1000)});
    *from = var;
  } else {
    *out = fallback;
    *from = "the default";
  }
}

// The collectives' timeout and the rendezvous' (capped by the first).
void resolve_timeouts(const InitOptions& o, ResolvedEnv& r) {
  EMBER_CHECK(o.rendezvous_timeout >= Millis{0}, "InitOptions::rendezvous_timeout=", o.rendezvous_timeout.count(),
              " ms is invalid: pass a positive timeout, or 0 to take EMBER_RDZV_TIMEOUT_SEC or the default");
  resolve_timeout(o.timeout, "InitOptions::timeout", "EMBER_DIST_TIMEOUT_SEC", kDefaultTimeout, &r.timeout,
                  &r.timeout_from);
  resolve_timeout(o.rendezvous_timeout, "InitOptions::rendezvous_timeout", "EMBER_RDZV_TIMEOUT_SEC",
                  std::min(r.timeout, kDefaultRendezvousTimeout), &r.rendezvous_timeout, &r.rendezvous_timeout_from);
}

// The store's settings that only the environment gives.
void resolve_store_settings(ResolvedEnv& r) {
  if (auto t = env("EMBER_STORE_TOKEN")) r.store_token = *t;
  // torchrun's name: the launcher's agent hosts the store, not rank 0.
  if (auto a = env("TORCHELASTIC_USE_AGENT_STORE")) r.agent_store = *a == "True" || *a == "1";
  if (auto all = env("EMBER_STORE_LISTEN_ALL")) {
    EMBER_CHECK(*all == "0" || *all == "1", "EMBER_STORE_LISTEN_ALL=", *all, " must be 0 or 1");
    r.store_listen_all = *all == "1";
  }
}

}  // namespace

ResolvedEnv resolve_env(const InitOptions& o) {
  check_options(o);
  // One launcher speaks for the process. torchrun's variables win when
  // present: under `srun torchrun ...` SLURM's describe the launcher (one
  // task per node), torchrun's the worker processes it spawned.
  Launcher l;
  l.torchrun = env("RANK") || env("WORLD_SIZE");
  l.slurm = !l.torchrun && env("SLURM_PROCID").has_value();

  ResolvedEnv r;
  const Field world = resolve_rank_and_world(o, l, r);
  resolve_local(o, l, world, r);
  const bool needs_rendezvous = r.world_size > 1 && o.store == nullptr;
  resolve_master(o, l, world, needs_rendezvous, r);
  resolve_timeouts(o, r);
  resolve_store_settings(r);
  return r;
}

// ---------------------------------------------------------------------------
// The default group and sub-groups

namespace {

struct State {
  // Serialises init / new_group / destroy, which block on the store; the
  // accessors take only `mu`, so get_rank() from another thread never waits
  // behind a rendezvous.
  std::mutex setup_mu;
  std::mutex mu;
  std::shared_ptr<Store> store;  // the root store every group's PrefixStore wraps
  std::shared_ptr<ProcessGroup> default_pg;
  std::string backend;
  ProcessGroupOptions pg_options;
  ResolvedEnv env;  // what the default group was made from
  int groups_created = 0;
  // Every group made here (the default and new_group's), so a survivor of
  // a lost peer can abort them all (abort_for_recovery).
  std::vector<std::weak_ptr<ProcessGroup>> made;
  // Live recovery: the generation the groups belong to, the store
  // connection kept across generations, and the generation a survivor
  // waited for (the next init joins it); -1: none pending.
  int64_t generation = 0;
  std::shared_ptr<Store> kept_store;
  int64_t next_generation = -1;
  bool replacement = false;       // this process joined as a replacement and has not survived a loss since
  bool replacement_done = false;  // it did once: a later init is a survivor's

  // At exit: the store connection a survivor kept says goodbye, although
  // the aborted groups (never freed) still hold it.
  ~State() {
    default_pg.reset();
    store.reset();
    if (kept_store) kept_store->close();
  }
};

constexpr const char* kGenerationKey = "live_recovery/generation";
// Set once every rank of generation <g> has made its default group: a
// replacement opens the next generation only after the last one formed.
std::string formed_key(int64_t g) { return "live_recovery/formed/" + std::to_string(g); }

// The generation a replacement joins. Ranks lost together (two workers on
// two hosts at once) must all meet in one: the first replacement opens the
// next generation after the one that formed last, and a replacement that
// finds a generation still forming (opened by another, the survivors on
// their way) joins it instead of opening yet another, which would split
// the ranks over two generations that both wait for the whole world.
// A live-recovery generation's store while its ranks gather (the world-size
// check, the backend's address exchange). The store fails a blocking call
// at once while any rank is lost; here a rank that is lost is usually being
// replaced (two lost at once: the first replacement gathers before the
// second's agent has even noticed), so the call waits on, polling, until
// the rank's replacement connects or the call's own timeout passes (a host
// that is gone for good: its agent's heartbeat ends the round first).
// gathered() ends the patience once the default group stands: a loss later
// must fail fast again (the commit point, peer_lost).
class GatheringStore : public PrefixStore {
 public:
  using PrefixStore::PrefixStore;
  Bytes get(const std::string& key) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    return patiently(deadline, [&] { return PrefixStore::get(key); });
  }
  void wait(const std::vector<std::string>& keys, Millis timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    patiently(deadline, [&] {
      PrefixStore::wait(
          keys, std::max(Millis{1}, std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now())));
      return 0;
    });
  }
  using PrefixStore::wait;
  void gathered() { gathering_.store(false); }

 private:
  template <typename F>
  auto patiently(std::chrono::steady_clock::time_point deadline, F&& f) -> decltype(f()) {
    for (;;) {
      try {
        return f();
      } catch (const RankLostError&) {
        if (!gathering_.load() || std::chrono::steady_clock::now() >= deadline) throw;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  }
  std::atomic<bool> gathering_{true};
};

int64_t generation_to_join(Store& kept) {
  const int64_t g = kept.add(kGenerationKey, 0);
  if (!kept.check({formed_key(g)})) return g;
  const std::string from = std::to_string(g), to = std::to_string(g + 1);
  const Bytes now = kept.compare_set(kGenerationKey, Bytes(from.begin(), from.end()), Bytes(to.begin(), to.end()));
  return std::strtoll(std::string(now.begin(), now.end()).c_str(), nullptr, 10);
}

State& state() {
  static State s;
  return s;
}

std::shared_ptr<ProcessGroup> make_group(const std::string& backend, std::shared_ptr<Store> store, int rank,
                                         int size, const ProcessGroupOptions& options) {
  if (backend == "nccl") return make_nccl_group(std::move(store), rank, size, options);
  return make_gloo_group(std::move(store), rank, size, options);
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(ranks[i]);
  }
  return s + "]";
}

}  // namespace

// The rendezvous check on the store init made: every rank publishes the world
// size it was given, rank 0 reads every other rank's, and the others read
// rank 0's, so ranks launched with different WORLD_SIZEs fail at once naming
// both values (before, the backend failed later with a transport-internal
// message, or rank 0 waited the whole timeout for ranks that would never
// come). Rank 0 waiting for each rank's key also names the ranks that never
// arrive.
void check_world_size(Store& store, const ResolvedEnv& env) {
  const std::string mine = std::to_string(env.world_size);
  const std::string my_key = "init/world_size/" + std::to_string(env.rank);
  auto other = [&](int r) {
    const std::string key = "init/world_size/" + std::to_string(r);
    try {
      store.wait({key}, env.rendezvous_timeout);
      return store.get_string(key);
    } catch (const std::exception& e) {
      throw Error(::ember::detail::str_cat("rank ", r, " of ", env.world_size_from, "=", env.world_size,
                                           " did not reach the rendezvous: ", e.what()));
    }
  };
  auto mismatch = [&](int r, const std::string& theirs) {
    return ::ember::detail::str_cat("ranks disagree on the world size: rank ", env.rank, " has ", env.world_size_from,
                                    "=", mine, " but rank ", r, " has ", theirs,
                                    " (launch every rank with the same WORLD_SIZE)");
  };
  if (env.rank == 0) {
    store.set(my_key, mine);
    for (int r = 1; r < env.world_size; ++r) {
      const std::string theirs = other(r);
      EMBER_CHECK(theirs == mine, mismatch(r, theirs));
    }
  } else {
    // Read rank 0's size before publishing ours: rank 0 (which hosts the
    // store) may exit as soon as it sees ours, so we must have its already.
    const std::string zeros = other(0);
    store.set(my_key, mine);
    EMBER_CHECK(zeros == mine, mismatch(0, zeros));
  }
}

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options) {
  State& s = state();
  std::lock_guard<std::mutex> setup(s.setup_mu);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    EMBER_CHECK(s.default_pg == nullptr, "init_process_group: already initialized (rank ", s.default_pg->rank(),
                " of ", s.default_pg->size(), ", backend ", s.backend, "); call destroy_process_group() first");
  }
  EMBER_CHECK(options.backend == "gloo" || options.backend == "nccl", "init_process_group: unknown backend \"",
              options.backend, "\"; use \"gloo\" (CPU tensors) or \"nccl\" (CUDA tensors)");
  ResolvedEnv env = resolve_env(options);

  std::shared_ptr<Store> store = options.store;
  std::shared_ptr<ProcessGroup> pg;
  const bool live = live_recovery_enabled() && !options.store && env.world_size > 1;
  int64_t generation = 0;
  bool replacement = false;
  std::shared_ptr<Store> kept;
  std::shared_ptr<GatheringStore> gathering;  // a live-recovery generation's store (generation > 0)
  try {
    if (live && s.kept_store) {
      // A survivor rejoining: the same connection, the generation it waited for.
      kept = s.kept_store;
      generation = s.next_generation;
      gathering = std::make_shared<GatheringStore>("generation_" + std::to_string(generation), kept);
      store = gathering;
      check_world_size(*store, env);
    } else if (!store) {
      // Rank 0 hosts the store; check_world_size then has rank 0 wait for
      // every rank, which turns a missing rank into a timeout error here
      // rather than a hang in the first collective.
      store = std::make_shared<TCPStore>(env.master_addr, env.master_port,
                                         TCPStoreOptions{.is_server = env.rank == 0 && !env.agent_store,
                                                         .num_workers = env.world_size,
                                                         .wait_for_workers = false,
                                                         .timeout = env.timeout,
                                                         .connect_timeout = env.rendezvous_timeout,
                                                         .rank = env.rank,
                                                         .token = env.store_token,
                                                         .listen_on_all = env.store_listen_all});
      if (live) {
        // A replacement (connected: the store no longer counts its rank
        // lost) opens the next generation; the survivors wait for it.
        kept = store;
        const char* repl = std::getenv("EMBER_LIVE_RECOVERY_REPLACEMENT");
        replacement = repl && std::string(repl) == "1" && !s.replacement_done;
        generation = replacement ? generation_to_join(*kept) : kept->add(kGenerationKey, 0);
        if (generation > 0) {
          gathering = std::make_shared<GatheringStore>("generation_" + std::to_string(generation), kept);
          store = gathering;
        }
      }
      if (env.world_size > 1) check_world_size(*store, env);
    }
    ProcessGroupOptions pg_options{.timeout = env.timeout, .local_rank = env.local_rank};
    // The flight recorder's dumps carry the rank; SIGUSR1 and a crash by an
    // uncaught exception dump them.
    fr::FlightRecorder::get().set_identity(env.rank, env.world_size);
    fr::install_dump_handlers();
    pg = make_group(options.backend, std::make_shared<PrefixStore>("default_pg", store), env.rank, env.world_size,
                    pg_options);
    pg->set_name(generation > 0 ? "default@gen" + std::to_string(generation) : "default");
    if (kept) kept->set(formed_key(generation), std::string("1"));  // every rank says so: the last one counts
    if (gathering) gathering->gathered();
    std::lock_guard<std::mutex> lock(s.mu);
    s.store = store;
    s.default_pg = pg;
    s.backend = options.backend;
    s.pg_options = pg_options;
    s.env = env;
    s.groups_created = 0;
    s.made = {pg};
    s.generation = generation;
    s.kept_store = kept;
    s.next_generation = -1;
    s.replacement = replacement;
    s.replacement_done = s.replacement_done || replacement;
  } catch (const std::exception& e) {
    // Backend engines throw their own exception types; callers get ours,
    // naming the settings that locate rank 0's store when we made it.
    std::string where;
    if (!options.store && env.world_size > 1)
      where = ", store at " + env.master_addr_from + "=" + env.master_addr + " " + env.master_port_from + "=" +
              std::to_string(env.master_port) + ", rendezvous timeout " +
              std::to_string(env.rendezvous_timeout.count()) + " ms (" + env.rendezvous_timeout_from + "), timeout " +
              std::to_string(env.timeout.count()) + " ms (" + env.timeout_from + ")";
    throw Error("init_process_group (rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) +
                ", backend " + options.backend + ", from " + env.source + where + "): " + e.what());
  }
  // Logs name the rank the job resolved, even where RANK is not set (srun,
  // explicit options).
  set_log_rank(env.rank);
  return pg;
}

bool is_initialized() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.default_pg != nullptr;
}

std::shared_ptr<ProcessGroup> default_group() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  EMBER_CHECK(s.default_pg != nullptr,
              "the default process group is not initialized; call init_process_group() first");
  return s.default_pg;
}

int get_rank() { return default_group()->rank(); }

ResolvedEnv init_env() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  EMBER_CHECK(s.default_pg != nullptr, "the default process group is not initialized; call init_process_group() first");
  return s.env;
}

int get_world_size() { return default_group()->size(); }

std::string group_name(const std::string& base) {
  const int64_t g = recovery_generation();
  return g > 0 ? base + "@gen" + std::to_string(g) : base;
}

std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks, const std::string& backend_in) {
  State& s = state();
  std::lock_guard<std::mutex> setup(s.setup_mu);
  std::shared_ptr<Store> store;
  std::shared_ptr<ProcessGroup> world;
  std::string backend = backend_in;
  ProcessGroupOptions pg_options;
  int id;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    EMBER_CHECK(s.default_pg != nullptr,
                "new_group: the default process group is not initialized; call init_process_group() first");
    store = s.store;
    world = s.default_pg;
    if (backend.empty()) backend = s.backend;
    pg_options = s.pg_options;
    // Every rank calls new_group in the same order, so the counter agrees
    // across ranks and names the group's store namespace.
    id = ++s.groups_created;
  }
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  EMBER_CHECK(!sorted.empty(), "new_group: the rank list is empty");
  for (size_t i = 0; i < sorted.size(); ++i) {
    EMBER_CHECK(sorted[i] >= 0 && sorted[i] < world->size(), "new_group: rank ", sorted[i],
                " is outside the default group's ranks [0, ", world->size(), ")");
    EMBER_CHECK(i == 0 || sorted[i] != sorted[i - 1], "new_group: rank ", sorted[i], " is listed twice in ",
                rank_list(ranks));
  }
  // Ranks that disagree on the list would build groups that never connect;
  // compare with rank 0's list (one store round trip) to fail by name.
  std::string mine = rank_list(sorted);
  std::string key = "new_group/" + std::to_string(id) + "/ranks";
  if (world->rank() == 0) {
    store->set(key, mine);
  } else {
    std::string theirs = store->get_string(key);
    EMBER_CHECK(theirs == mine, "new_group #", id, ": rank ", world->rank(), " passed ranks ", mine,
                " but rank 0 passed ", theirs, "; every rank must make the same new_group calls in the same order");
  }
  auto it = std::find(sorted.begin(), sorted.end(), world->rank());
  if (it == sorted.end()) return nullptr;
  int group_rank = static_cast<int>(it - sorted.begin());
  auto group = make_group(backend, std::make_shared<PrefixStore>("group_" + std::to_string(id), store), group_rank,
                          static_cast<int>(sorted.size()), pg_options);
  group->set_global_ranks(sorted);
  group->set_name(group_name("group_" + std::to_string(id)));
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.made.push_back(group);
  }
  return group;
}

// A no-op when nothing is initialized, so cleanup paths can call it freely.
// Rank 0 hosts the store: the other ranks must be done with it (e.g. after
// a barrier) before rank 0 destroys its group.
void destroy_process_group() {
  State& s = state();
  std::lock_guard<std::mutex> setup(s.setup_mu);
  std::shared_ptr<ProcessGroup> pg;
  std::shared_ptr<Store> store, kept;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    pg = std::move(s.default_pg);
    store = std::move(s.store);
    s.default_pg = nullptr;
    s.store = nullptr;
    s.backend.clear();
    s.groups_created = 0;
    s.made.clear();
    kept = std::move(s.kept_store);
    s.kept_store = nullptr;
    s.generation = 0;
  }
  if (pg) set_log_rank(-1);
  // Released here, outside `mu`: a backend's destructor may join threads.
  pg.reset();
  store.reset();
  // A survivor's store connection, held on by its aborted groups too: it
  // says goodbye now (else the store would count the rank lost at exit).
  if (kept) kept->close();
}

// ---------------------------------------------------------------------------
// Live recovery

bool live_recovery_enabled() {
  const char* v = std::getenv("EMBER_LIVE_RECOVERY");
  return v && std::string(v) == "1";
}

bool is_live_replacement() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.default_pg != nullptr && s.replacement;
}

int64_t recovery_generation() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.generation;
}

void commit_point(int64_t step) {
  State& s = state();
  std::shared_ptr<Store> store;
  int rank = 0, world = 1;
  std::shared_ptr<Store> kept;
  int64_t generation = 0;
  Millis timeout{0};
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.default_pg || !s.kept_store) return;  // live recovery off
    store = s.store;
    kept = s.kept_store;
    generation = s.generation;
    timeout = s.env.timeout;
    rank = s.default_pg->rank();
    world = s.default_pg->size();
  }
  if (world == 1) return;
  const std::string k = "commit/" + std::to_string(step);
  if (store->add(k + "/arrived", 1) == world) store->set(k + "/all", "1");
  // In slices: a lost rank fails the wait at once, but only until its
  // replacement connects; after that the next generation having opened
  // says the same, and this rank must go and join it.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    try {
      store->wait({k + "/all"}, std::chrono::milliseconds(200));
      break;
    } catch (const RankLostError&) {
      throw;
    } catch (const Error& e) {
      if (kept->add(kGenerationKey, 0) > generation)
        throw Error("commit point of step " + std::to_string(step) +
                    ": a replacement opened the next generation while this rank waited (a rank was lost)");
      if (std::chrono::steady_clock::now() >= deadline) throw;
    }
  }
  // Everyone is past the previous step's point (they all reached this one).
  if (rank == 0 && step > 0) {
    const std::string prev = "commit/" + std::to_string(step - 1);
    store->delete_key(prev + "/arrived");
    store->delete_key(prev + "/all");
  }
}

bool peer_lost(Millis grace) {
  State& s = state();
  std::shared_ptr<Store> kept;
  int64_t from = 0;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    kept = s.kept_store;
    from = s.generation;
  }
  if (!live_recovery_enabled() || !kept) return false;
  const auto deadline = std::chrono::steady_clock::now() + grace;
  try {
    for (;;) {
      if (!kept->lost_ranks().empty() || kept->add(kGenerationKey, 0) > from) return true;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const Error&) {
    return false;  // the store itself is gone: nothing to recover with
  }
}

int64_t abort_for_recovery(Millis wait) {
  State& s = state();
  std::lock_guard<std::mutex> setup(s.setup_mu);
  std::vector<std::shared_ptr<ProcessGroup>> groups;
  std::shared_ptr<Store> kept;
  int64_t from = 0;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    EMBER_CHECK(s.default_pg != nullptr && s.kept_store != nullptr,
                "abort_for_recovery: no process group of a live-recovery job (EMBER_LIVE_RECOVERY=1, set by "
                "launch --live-recovery) is initialized");
    for (auto& w : s.made)
      if (auto g = w.lock()) groups.push_back(std::move(g));
    kept = s.kept_store;
    from = s.generation;
    s.default_pg = nullptr;
    s.store = nullptr;
    s.backend.clear();
    s.groups_created = 0;
    s.made.clear();
    s.replacement = false;
  }
  // Closed first, so every peer blocked on this rank fails now and comes
  // here too (within milliseconds, not at its timeout).
  for (auto& g : groups) g->abort();
  groups.clear();
  // The replacement advances the generation once it is connected (its rank
  // no longer counted lost, so the rendezvous's blocking calls work again).
  // Polled with add(0), answered at once even while a rank is lost.
  const auto deadline = std::chrono::steady_clock::now() + wait;
  for (;;) {
    const int64_t g = kept->add(kGenerationKey, 0);
    if (g > from) {
      std::lock_guard<std::mutex> lock(s.mu);
      s.next_generation = g;
      return g;
    }
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.kept_store = nullptr;  // nothing to rejoin: this process ends
  }
  throw Error("live recovery: no replacement joined generation " + std::to_string(from + 1) + " within " +
              std::to_string(wait.count()) + " ms (a whole node lost, or the launcher's restarts used up); the " +
              "launcher's next rendezvous round resumes from the newest checkpoint");
}

}  // namespace ember::distributed
