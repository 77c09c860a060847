// The elastic agent (elastic.h): rendezvous rounds over a TCP store, the
// workers of each round started through the launcher's run_workers, and the
// monitoring that ends a round (a failure here, a new round asked for
// elsewhere, a member's heartbeat gone, a late node waiting).
//
// Store keys, under "rdzv/<id>/":
//   job                 the job's signature (program and node range): a second
//                       job with the same id and endpoint is refused
//   round               the running round's number; a new round is asked for
//                       by compare_set(round, R, R + 1), so one request wins
//   failures            worker failures so far (against max_restarts): one per
//                       round at most (r<R>/failure), however many nodes'
//                       workers went down with it
//   failed              set when the job gave up: why
//   agents              a counter that names each agent
//   hb/<agent>          each agent's heartbeat counter
//   exited/<agent>      the agent is done with the job (the one serving the
//                       store waits for its last round's members)
//   alive/<token>       etcd only: each agent's key under its own lease; a
//                       job whose keys exist with none alive is a crashed
//                       job's leftovers, taken over by the next one
//   done                set when the job ended well
//   r<R>/joined         arrivals in round R (node index = arrival order)
//   r<R>/node/<i>       node i's "addr nproc agent"
//   r<R>/closed         the round's node count, once it closed
//   r<R>/late[/<agent>] agents that came after round R closed (scale up)
//   r<R>/master         node 0's "addr port token" for the workers' store
//   r<R>/failure        the agent whose workers' failure ended round R
//   r<R>/finished[/<agent>]  a member's workers all succeeded
#include "distributed/launch/elastic.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "core/exception.h"
#include "distributed/launch/launch.h"
#include "distributed/launch/launch_internal.h"
#include "distributed/store/etcd_store.h"
#include "distributed/store/store.h"

namespace ember::distributed {
namespace {

using namespace launch_detail;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr milliseconds kPoll{100};     // rendezvous waits
constexpr milliseconds kMonitor{500};  // store checks while workers run
using Millis = std::chrono::milliseconds;

// Raised inside the agent to end it with a status (after saying why).
struct AgentExit {
  int status;
};

// The IPv4 addresses `host` resolves to (none if it does not).
std::vector<in_addr_t> ipv4_addresses(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* res = nullptr;
  std::vector<in_addr_t> out;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return out;
  for (addrinfo* a = res; a; a = a->ai_next) out.push_back(reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr.s_addr);
  ::freeaddrinfo(res);
  return out;
}
bool loopback(in_addr_t a) { return (ntohl(a) >> 24) == 127; }

bool is_loopback(const std::string& host) {
  const std::vector<in_addr_t> a = ipv4_addresses(host);
  return !a.empty() && loopback(a.front());
}

// Whether `host` names this machine: loopback, or one of its interfaces'
// addresses (what the first agent on the endpoint's host must serve).
bool is_local_host(const std::string& host) {
  const std::vector<in_addr_t> want = ipv4_addresses(host);
  if (std::any_of(want.begin(), want.end(), loopback)) return true;
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) return false;
  bool local = false;
  for (ifaddrs* i = ifs; i && !local; i = i->ifa_next)
    if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET)
      local = std::count(want.begin(), want.end(), reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr) > 0;
  ::freeifaddrs(ifs);
  return local;
}

std::string join_words(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : " ") + s;
  return out;
}

// The address this host uses to reach `host` (a UDP socket "connected" to
// it, read back: no packet is sent). The default for other hosts to reach
// this one: a host's own name often resolves to a loopback address.
std::string address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return {};
  std::string out;
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_in me{};
  socklen_t len = sizeof me;
  if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len) == 0) {
    char buf[INET_ADDRSTRLEN] = {};
    if (::inet_ntop(AF_INET, &me.sin_addr, buf, sizeof buf)) out = buf;
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(res);
  return out;
}

class Agent {
 public:
  Agent(const ElasticOptions& o, const std::vector<std::string>& argv)
      : o_(o), argv_(argv), path_(resolve_program(argv[0])) {
    prefix_ = "rdzv/" + o.rdzv_id + "/";
    etcd_backend_ = o.rdzv_backend == "etcd";
    local_ = is_local_host(o.endpoint_host);
    addr_ = o.local_addr;
    if (addr_.empty()) addr_ = local_ ? o.endpoint_host : address_towards(o.endpoint_host, o.endpoint_port);
    if (addr_.empty()) addr_ = hostname();
    token_ = std::getenv("EMBER_STORE_TOKEN") ? std::getenv("EMBER_STORE_TOKEN") : "";
  }

  // Reaches the store and checks the job: before the agent takes over the
  // signals, so Ctrl-C works while it waits for the store to come up.
  // Returns an exit status when that fails, else -1.
  int open() {
    if (token_.empty() && !is_loopback(o_.endpoint_host))
      say("EMBER_STORE_TOKEN is not set, so the rendezvous store at " + endpoint() +
          " serves any client that reaches it; export the same secret on every host to keep others out");
    return guarded([&] {
      connect();
      check_job();
      return -1;
    });
  }

  int run() {
    return guarded([&] {
      R_ = get_int("round");
      for (;;) {
        const std::vector<Node> nodes = rendezvous();
        const int status = run_round(nodes);
        if (status >= 0) return status;
      }
    });
  }

 private:
  struct Node {
    std::string addr;
    int nproc = 0;
    int64_t agent = -1;
  };

  template <typename F>
  int guarded(F&& f) {
    try {
      return f();
    } catch (const AgentExit& e) {
      return e.status;
    } catch (const Error& e) {
      if (woken_after_the_end(e.what())) return 0;
      say("rendezvous " + o_.rdzv_id + " at " + endpoint() + ": " + e.what());
      return 1;
    }
  }

  // An agent woken after the others went on without it (its heartbeat had
  // stopped while it was frozen) that finds the TCP store gone: the store
  // went with the job's end (its agent leaves once every live member has),
  // or with that agent's host; either way nothing is left for this node,
  // as for a node that waits past a round that finished (exit 0, saying
  // so). Under etcd the store outlives the agents: the job's end is read.
  bool woken_after_the_end(const std::string& why) {
    if (frozen_for_.count() == 0 || serving_ || etcd_) return false;
    // Only the store's loss: any other error is reported as such.
    const bool store_gone = why.find("store server closed the connection") != std::string::npos ||
                            why.find("could not connect to the store") != std::string::npos ||
                            why.find("connection to the store is gone") != std::string::npos ||
                            why.find("lost the connection to the store server") != std::string::npos;
    if (!store_gone) return false;
    say("this agent was stopped for " + std::to_string(frozen_for_.count() / 1000) +
        " s (SIGSTOP, a debugger, or starved) and the rendezvous store at " + endpoint() + " is gone meanwhile (" +
        why + "): the job finished or went on without this node; nothing left to do here");
    return true;
  }

  static std::string hostname() {
    char buf[256] = {};
    ::gethostname(buf, sizeof buf - 1);
    return buf;
  }
  std::string endpoint() const {
    if (!etcd_backend_) return o_.endpoint_host + ":" + std::to_string(o_.endpoint_port);
    std::string all;
    for (const auto& e : o_.etcd_endpoints) all += (all.empty() ? "" : ",") + e;
    return "etcd " + all;
  }
  std::string key(const std::string& k) const { return prefix_ + k; }
  std::string rkey(int64_t r, const std::string& k) const { return key("r" + std::to_string(r) + "/" + k); }
  int64_t get_int(const std::string& k) { return store_->add(key(k), 0); }
  std::string get_or(const std::string& full, const std::string& dflt = "") {
    return store_->check({full}) ? store_->get_string(full) : dflt;
  }
  std::string me() const { return std::to_string(agent_); }
  // How long one store call may block.
  Millis store_call_timeout() const { return std::max<Millis>(o_.heartbeat_timeout, std::chrono::seconds(1)); }

  // Serves the store when this is the endpoint's host and nobody serves it
  // yet (the port is taken: somebody does); otherwise connects, waiting up to
  // join_timeout for it to come up.
  void connect() {
    // Every call gives up after the heartbeat timeout: an agent cut off from
    // the store learns it then, not at the default timeout.
    const Millis timeout = store_call_timeout();
    if (etcd_backend_) {
      // No agent serves anything: the job's keys live in etcd under
      // /ember/rdzv/<id>/, the agent's liveness under its own lease.
      auto etcd = std::make_unique<EtcdStore>(EtcdStoreOptions{.endpoints = o_.etcd_endpoints,
                                                               .prefix = "/ember/" + prefix_,
                                                               .timeout = timeout,
                                                               .connect_timeout = o_.join_timeout,
                                                               .lease_ttl = o_.heartbeat_timeout});
      prefix_.clear();  // the store's prefix holds the job's
      etcd_ = etcd.get();
      store_ = std::move(etcd);
      return;
    }
    if (local_) {
      const char* all = std::getenv("EMBER_STORE_LISTEN_ALL");
      try {
        store_ = std::make_unique<TCPStore>(o_.endpoint_host, o_.endpoint_port,
                                            TCPStoreOptions{.is_server = true,
                                                            .wait_for_workers = false,
                                                            .timeout = timeout,
                                                            .token = token_,
                                                            .listen_on_all = all && std::string(all) == "1"});
        serving_ = true;
        say("rendezvous " + o_.rdzv_id + ": serving the rendezvous store at " + endpoint());
        return;
      } catch (const Error& e) {
        // In use: another agent on this host serves it. Anything else is
        // this agent's problem to report.
        if (std::string(e.what()).find("in use") == std::string::npos) throw;
      }
    }
    TCPStoreOptions c;
    c.timeout = timeout;
    c.connect_timeout = o_.join_timeout;
    c.token = token_;  // the user's EMBER_STORE_TOKEN: only this job's agents get in
    c.server = "the agent serving the rendezvous store on " + o_.endpoint_host + " (the job's first agent there)";
    store_ = std::make_unique<TCPStore>(o_.endpoint_host, o_.endpoint_port, c);
  }

  // One job per id: the first agent records what it runs; an agent of
  // another program or worker count, or one arriving after the job ended, is
  // refused. Under etcd a crashed job's keys outlive it: a job whose agents'
  // leased keys are all gone is taken over (its keys deleted) instead.
  void check_job() {
    const std::string sig = "nodes " + std::to_string(o_.min_nodes) + ":" + std::to_string(o_.max_nodes) + " x " +
                            std::to_string(o_.nproc_per_node) + " workers, program " + join_words(argv_);
    // Alive before it counts as an agent: a job with agents and no live key is a dead one.
    if (etcd_) {
      alive_key_ = "alive/" + random_token();
      etcd_->set_leased(alive_key_, addr_);
    }
    for (;;) {
      const Bytes got = store_->compare_set(key("job"), {}, Bytes(sig.begin(), sig.end()));
      const std::string have(got.begin(), got.end());
      const bool ended = store_->check({key("done")});
      if (have == sig && !ended) {
        if (etcd_ && etcd_->count_prefix("alive/") == 1 && get_int("agents") > 0 && take_over_stale(have)) continue;
        break;
      }
      if (etcd_ && !ended && take_over_stale(have)) continue;
      if (ended) {
        say("rendezvous id '" + o_.rdzv_id + "' at " + endpoint() + " is a job that already ended (" +
            get_or(key("done")) + "): give a new job a new --rdzv-id");
      } else {
        say("rendezvous id '" + o_.rdzv_id + "' at " + endpoint() + " belongs to another job (" + have +
            "); this one is (" + sig + "): give each job its own --rdzv-id");
      }
      throw AgentExit{1};
    }
    agent_ = store_->add(key("agents"), 1) - 1;
  }

  // etcd: the job at this id (`what`) has no live agent but this one, or
  // none left within a lease's TTL: a crashed job's leftovers (a stale
  // round). Deletes them, unless another agent changed the job meanwhile,
  // and says so; false when the job is alive.
  bool take_over_stale(const std::string& what) {
    // Read before the count: an agent of the new job that registers (or
    // counts itself an agent) after it makes the delete below fail.
    const int64_t rev = etcd_->revision(key("job")), agents_rev = etcd_->revision(key("agents"));
    const auto until = Clock::now() + o_.heartbeat_timeout + milliseconds(500);
    while (etcd_->count_prefix("alive/") > 1) {  // others than this agent: wait out their leases
      if (Clock::now() >= until) return false;
      std::this_thread::sleep_for(kPoll);
    }
    const std::string round = get_or(key("round"), "0");
    if (!etcd_->delete_prefix_if("", {{key("job"), rev}, {key("agents"), agents_rev}}))
      return true;  // changed meanwhile: look again
    say("rendezvous id '" + o_.rdzv_id + "' at " + endpoint() + ": took over the keys a crashed job left (" + what +
        ", at round " + round + "; no agent of it alive)");
    etcd_->set_leased(alive_key_, addr_);  // deleted with the rest
    return true;
  }

  void heartbeat() { store_->add(key("hb/" + me()), 1); }

  // Asks for the round after R (one request wins; the others see it).
  void next_round_from(int64_t R) {
    const std::string from = std::to_string(R), to = std::to_string(R + 1);
    store_->compare_set(key("round"), Bytes(from.begin(), from.end()), Bytes(to.begin(), to.end()));
  }
  int64_t current_round() { return std::strtoll(get_or(key("round"), "0").c_str(), nullptr, 10); }
  bool round_moved() { return current_round() != R_; }

  void check_failed() {
    if (store_->check({key("failed")})) {
      say("the job gave up on another node: " + get_or(key("failed")));
      leave();
      throw AgentExit{1};
    }
  }
  // Before joining a round: a job that ended (well) while this agent was
  // away (frozen, cut off) is over for it too, as for a waiting node.
  void check_done() {
    if (store_->check({key("done")})) {
      say("the job finished without this node (" + get_or(key("done")) + "); nothing left to do here");
      leave();
      throw AgentExit{0};
    }
  }
  // A signal while no worker runs: leave, moving the round on so that this
  // agent's arrival does not hold the others' round open.
  void check_signal(int64_t R) {
    if (const int sig = take_signal(); sig != 0) {
      say("received signal " + std::to_string(sig) + " while waiting for a rendezvous round; leaving");
      try {
        next_round_from(R);
      } catch (const Error&) {
      }
      throw AgentExit{128 + sig};
    }
  }

  // Joins the running round (or a later one when it moves on meanwhile) and
  // returns its members once it closes with this agent among them.
  std::vector<Node> rendezvous() {
    for (;;) {
      check_failed();
      check_done();
      R_ = current_round();
      const int64_t R = R_;
      const auto start = Clock::now();
      const int64_t idx = store_->add(rkey(R, "joined"), 1) - 1;
      store_->set(rkey(R, "node/" + std::to_string(idx)), addr_ + " " + std::to_string(o_.nproc_per_node) + " " + me());
      Clock::time_point min_seen{};
      bool late = false;
      for (;;) {
        check_signal(R);
        check_failed();
        heartbeat();
        if (store_->check({rkey(R, "closed")})) {
          const int64_t n = std::strtoll(get_or(rkey(R, "closed")).c_str(), nullptr, 10);
          if (idx < n) return members(R, n);
          late = true;
          break;
        }
        if (round_moved()) break;  // a newer round: join that one
        const int64_t joined = store_->add(rkey(R, "joined"), 0);
        const auto now = Clock::now();
        if (joined >= o_.min_nodes && min_seen == Clock::time_point{}) min_seen = now;
        if (joined >= o_.max_nodes || (joined >= o_.min_nodes && now - min_seen >= o_.last_call)) {
          const std::string n = std::to_string(std::min<int64_t>(joined, o_.max_nodes));
          store_->compare_set(rkey(R, "closed"), {}, Bytes(n.begin(), n.end()));
          continue;
        }
        if (joined < o_.min_nodes && now - start >= o_.join_timeout) {
          say("rendezvous round " + std::to_string(R) + ": " + std::to_string(joined) + " of at least " +
              std::to_string(o_.min_nodes) + " nodes joined within " +
              std::to_string(std::chrono::duration_cast<std::chrono::seconds>(o_.join_timeout).count()) +
              " s (--nnodes " + std::to_string(o_.min_nodes) + ":" + std::to_string(o_.max_nodes) +
              "); giving up, no worker was started");
          next_round_from(R);  // the others (if any come) start afresh, without this agent's arrival
          throw AgentExit{1};
        }
        std::this_thread::sleep_for(kPoll);
      }
      if (!late) continue;
      // The round closed without us: wait for the next (its members start
      // one when they see us, if they have room), or for its end.
      store_->add(rkey(R, "late"), 1);
      store_->set(rkey(R, "late/" + me()), "1");  // the serving agent waits for it to learn the outcome too
      say("rendezvous round " + std::to_string(R) + " is running without this node; waiting for the next");
      // The round's members, to see whether any is still there: a round
      // whose members all stopped beating (a crashed job's, under etcd) is
      // moved on by the one waiting, or it would wait forever.
      std::map<int64_t, std::pair<int64_t, Clock::time_point>> beats;
      const int64_t closed = std::strtoll(get_or(rkey(R, "closed"), "0").c_str(), nullptr, 10);
      for (int64_t i = 0; i < closed; ++i) {
        std::istringstream in(get_or(rkey(R, "node/" + std::to_string(i))));
        Node m;
        in >> m.addr >> m.nproc >> m.agent;
        beats[m.agent] = {-1, Clock::now()};
      }
      while (!round_moved()) {
        check_signal(R);
        check_failed();
        heartbeat();
        if (store_->check({rkey(R, "finished")})) {
          say("the job finished in rendezvous round " + std::to_string(R) + " without this node");
          leave();
          throw AgentExit{0};
        }
        const auto now = Clock::now();
        bool any_alive = beats.empty();
        for (auto& [agent, beat] : beats) {
          const int64_t v = get_int("hb/" + std::to_string(agent));
          if (v != beat.first) beat = {v, now};
          any_alive = any_alive || now - beat.second < o_.heartbeat_timeout;
        }
        if (!any_alive) {
          say("rendezvous round " + std::to_string(R) + ": none of its " + std::to_string(beats.size()) +
              " members has beaten for " + std::to_string(o_.heartbeat_timeout.count() / 1000.0).substr(0, 4) +
              " s (a crashed job's round); starting the next");
          next_round_from(R);
        }
        std::this_thread::sleep_for(kPoll);
      }
    }
  }

  std::vector<Node> members(int64_t R, int64_t n) {
    std::vector<Node> nodes(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      // Written right after the arrival it follows: wait a moment for it.
      try {
        store_->wait({rkey(R, "node/" + std::to_string(i))}, std::chrono::seconds(5));
      } catch (const Error&) {
        // Left empty: run_round names it and starts a new round.
      }
      std::istringstream in(get_or(rkey(R, "node/" + std::to_string(i))));
      in >> nodes[i].addr >> nodes[i].nproc >> nodes[i].agent;
      if (nodes[i].agent == agent_) my_index_ = static_cast<int>(i);
    }
    return nodes;
  }

  // Runs this node's workers for round R_. Returns the agent's exit status
  // when the job is over for it, or -1 to go on with the next round.
  int run_round(const std::vector<Node>& nodes) {
    const int64_t R = R_;
    frozen_for_ = milliseconds{0};  // a stop counts for the round it happened in
    last_nodes_ = nodes;
    int world = 0, first_rank = 0;
    if (!place_nodes(R, nodes, &world, &first_rank)) return -1;
    // Held for the whole round: with live recovery, this agent serves the
    // workers' store, which must outlive them; without, the port its rank 0
    // will listen on stays reserved for it.
    std::unique_ptr<TCPStore> worker_store;
    std::optional<ReservedPort> worker_port;
    if (my_index_ == 0) worker_store = publish_worker_store(R, &worker_port);
    WorkerStore master;
    if (!read_worker_store(R, nodes, &master)) return -1;
    std::vector<WorkerSpec> specs = worker_specs(R, nodes, world, first_rank, master);

    // Every other member's heartbeat: last value and when it last changed.
    // A member whose workers finished is not beating for this round.
    std::map<int64_t, std::pair<int64_t, Clock::time_point>> beats;
    for (const Node& n : nodes)
      if (n.agent != agent_) beats[n.agent] = {-1, Clock::now()};
    // The store is watched from a thread of its own, so a store that stops
    // answering (a call blocks up to the heartbeat timeout) never stalls the
    // worker loop: output, reaping, signals and the grace SIGKILL go on.
    // The worker loop only reads the verdict.
    std::string why;  // why this agent stopped its workers (written before `verdict`)
    std::atomic<bool> verdict{false}, workers_done{false};
    std::thread monitor([&] {
      // A gap between two wake-ups far past their period: this process was
      // stopped (SIGSTOP, a debugger) or starved, and the others saw its
      // heartbeat stop. Seen at the first wake-up, before the worker loop
      // (which joins this thread) goes on. A stop can also land inside the
      // store checks, whose first call after the wake-up finds the store
      // gone: that span is measured too, allowing it the one call that may
      // block up to its timeout (a store that stops answering is not a
      // stopped agent).
      auto last = Clock::now();
      auto frozen = [&](Clock::duration allowed) {
        if (const auto gap = Clock::now() - last; gap > o_.heartbeat_timeout + allowed)
          frozen_for_ = std::max(frozen_for_, std::chrono::duration_cast<milliseconds>(gap));
        last = Clock::now();
      };
      while (!workers_done.load()) {
        frozen(Clock::duration::zero());
        const bool stop_now = round_should_stop(R, nodes, beats, &why);
        frozen(store_call_timeout());
        if (stop_now) {
          verdict.store(true);
          return;
        }
        for (auto t = Clock::now(); Clock::now() - t < kMonitor && !workers_done.load();) {
          std::this_thread::sleep_for(milliseconds(20));
          frozen(Clock::duration::zero());
        }
      }
    });
    const std::function<bool()> stop = [&] { return verdict.load(); };
    ReplaceWorker replace;
    if (o_.live_recovery)
      replace = [&](const WorkerSpec& failed, const std::string& failure, int status) {
        return replace_in_place(failed, failure, status, verdict.load());
      };
    WorkersResult r;
    try {
      r = run_workers(path_, argv_, std::move(specs), o_.prefix_output, o_.grace, stop, replace);
    } catch (...) {
      // A worker that could not be started (again): the monitor goes first.
      workers_done.store(true);
      monitor.join();
      throw;
    }
    workers_done.store(true);
    monitor.join();  // before the store is used here again: one thread at a time
    return round_outcome(R, r, why);
  }

  // The round's world from its members: this node's first rank, the world
  // size, announced. False (a new round asked for) when a member left no
  // details: an agent that died between the two writes of its arrival
  // cannot be run with.
  bool place_nodes(int64_t R, const std::vector<Node>& nodes, int* world, int* first_rank) {
    std::string names;
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (nodes[i].nproc <= 0) {
        say("rendezvous round " + std::to_string(R) + ": node " + std::to_string(i) + " left no details; a new round");
        next_round_from(R);
        return false;
      }
      if (static_cast<int>(i) == my_index_) *first_rank = *world;
      *world += nodes[i].nproc;
      names += (names.empty() ? "" : ", ") + nodes[i].addr + " x" + std::to_string(nodes[i].nproc);
    }
    say("rendezvous round " + std::to_string(R) + ": world size " + std::to_string(*world) + " (" +
        std::to_string(nodes.size()) + " node" + (nodes.size() == 1 ? "" : "s") + ": " + names + "; this is node " +
        std::to_string(my_index_) + ")");
    return true;
  }

  // Where the workers of a round find their store ("master" of the round).
  struct WorkerStore {
    std::string addr, port, token;
  };

  // Node 0 hosts the workers' store of this round on a fresh port: its
  // worker of rank 0 does (the port is reserved here, in `reserved`), or,
  // with live recovery, the agent itself (returned). Both are held for the
  // round.
  std::unique_ptr<TCPStore> publish_worker_store(int64_t R, std::optional<ReservedPort>* reserved) {
    std::unique_ptr<TCPStore> worker_store;
    const std::string tok = token_.empty() ? random_token() : token_;
    int port = 0;
    if (o_.live_recovery) {
      worker_store = std::make_unique<TCPStore>(
          addr_, 0, TCPStoreOptions{.is_server = true, .wait_for_workers = false, .token = tok});
      port = worker_store->port();
    } else {
      port = reserved->emplace().port();
    }
    store_->set(rkey(R, "master"), addr_ + " " + std::to_string(port) + " " + tok);
    return worker_store;
  }

  // Node 0's published worker store; false (a new round asked for) when it
  // never says.
  bool read_worker_store(int64_t R, const std::vector<Node>& nodes, WorkerStore* out) {
    try {
      store_->wait({rkey(R, "master")});
      std::istringstream master(store_->get_string(rkey(R, "master")));
      master >> out->addr >> out->port >> out->token;
    } catch (const Error& e) {
      say("rendezvous round " + std::to_string(R) + ": node 0 (" + nodes[0].addr +
          ") never said where its workers' store is (" + e.what() + "); a new round");
      next_round_from(R);
      return false;
    }
    return true;
  }

  // Each local worker's rank and environment (torchrun's variables).
  std::vector<WorkerSpec> worker_specs(int64_t R, const std::vector<Node>& nodes, int world, int first_rank,
                                       const WorkerStore& master) {
    const int nproc = o_.nproc_per_node;
    const bool set_omp = nproc > 1 && std::getenv("OMP_NUM_THREADS") == nullptr;
    std::vector<WorkerSpec> specs(nproc);
    for (int local = 0; local < nproc; ++local) {
      std::vector<std::pair<std::string, std::string>> set = {
          {"RANK", std::to_string(first_rank + local)},
          {"WORLD_SIZE", std::to_string(world)},
          {"LOCAL_RANK", std::to_string(local)},
          {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
          {"GROUP_RANK", std::to_string(my_index_)},
          {"GROUP_WORLD_SIZE", std::to_string(nodes.size())},
          {"MASTER_ADDR", master.addr},
          {"MASTER_PORT", master.port},
          {"EMBER_STORE_TOKEN", master.token},
          {"EMBER_RESTART_COUNT", std::to_string(R)},
          {"TORCHELASTIC_RESTART_COUNT", std::to_string(R)},
          {"TORCHELASTIC_MAX_RESTARTS", std::to_string(o_.max_restarts)},
          {"TORCHELASTIC_RUN_ID", o_.rdzv_id},
      };
      if (set_omp) set.emplace_back("OMP_NUM_THREADS", "1");
      if (o_.live_recovery) {
        set.emplace_back("EMBER_LIVE_RECOVERY", "1");
        set.emplace_back("TORCHELASTIC_USE_AGENT_STORE", "True");
      }
      specs[local] = {first_rank + local, local, worker_env(set)};
    }
    return specs;
  }

  // The monitor thread's check: whether this node's workers must stop (the
  // round moved on, a node waits to join, a member's heartbeat stopped, the
  // store is gone), with the reason in `why`.
  bool round_should_stop(int64_t R, const std::vector<Node>& nodes,
                         std::map<int64_t, std::pair<int64_t, Clock::time_point>>& beats, std::string* why) {
    const auto now = Clock::now();
    try {
      heartbeat();
      if (round_moved()) {
        *why = "another node started rendezvous round " + get_or(key("round"));
        return true;
      }
      if (static_cast<int>(nodes.size()) < o_.max_nodes && store_->add(rkey(R, "late"), 0) > 0) {
        *why = "a node is waiting to join";
        next_round_from(R);
        return true;
      }
      for (auto& [agent, beat] : beats) {
        const int64_t v = get_int("hb/" + std::to_string(agent));
        if (v != beat.first) {
          beat = {v, now};
        } else if (now - beat.second >= o_.heartbeat_timeout &&
                   !store_->check({rkey(R, "finished/" + std::to_string(agent))})) {
          *why = "agent " + std::to_string(agent) + "'s heartbeat stopped " +
                 std::to_string(std::chrono::duration_cast<milliseconds>(now - beat.second).count()) + " ms ago";
          next_round_from(R);
          return true;
        }
      }
    } catch (const Error& e) {
      *why = std::string("the rendezvous store is gone (") + e.what() + ")";
      store_lost_ = true;
      return true;
    }
    return false;
  }

  // Live recovery: a worker killed by a signal (a lost process: the OOM
  // killer, a fault, a crash) is replaced in place while restarts remain
  // (each counts); the others are not stopped. Its environment says it is
  // a replacement, so it takes its state from a replica. A worker that
  // exits with an error it reported (a bug, bad data, a recovery that
  // could not be made), or aborts (SIGABRT: an uncaught error, a failed
  // assertion), ends the round as without live recovery. Returns the
  // replacement's environment, or {} for no replacement.
  std::vector<std::string> replace_in_place(const WorkerSpec& failed, const std::string& failure, int status,
                                            bool round_ending) {
    // The round is ending anyway, or the worker gave up by itself.
    if (round_ending || !WIFSIGNALED(status) || WTERMSIG(status) == SIGABRT) return {};
    int64_t used = 0;
    try {
      // Counted and checked in one step: failures on two nodes at once
      // cannot both take the last restart.
      used = store_->add(key("failures"), 1);
      if (used > o_.max_restarts) {
        store_->add(key("failures"), -1);  // the round's failure path counts it and gives up
        return {};
      }
    } catch (const Error&) {
      return {};
    }
    say(failure + "; replacing it in place (live recovery; restart " + std::to_string(used) + " of " +
        std::to_string(o_.max_restarts) + ")");
    std::vector<std::string> env;
    for (const std::string& kv : failed.env)
      if (kv.rfind("EMBER_LIVE_RECOVERY_REPLACEMENT=", 0) != 0) env.push_back(kv);
    env.push_back("EMBER_LIVE_RECOVERY_REPLACEMENT=1");
    return env;
  }

  // What the workers' end means for this agent: its exit status when the
  // job is over for it, or -1 for the next round. A failure counts against
  // the restarts once per round.
  int round_outcome(int64_t R, const WorkersResult& r, const std::string& why) {
    if (store_lost_ && woken_after_the_end(why)) return 0;
    if (store_lost_) {
      say("lost the rendezvous store at " + endpoint() +
          (etcd_ ? " (the cluster did not serve this agent within the heartbeat timeout)"
                 : " (the agent serving it ended, or its host is unreachable)") +
          ": " + why + "; the job cannot go on here");
      return 1;
    }
    if (r.by_signal) {
      say("stopped by signal " + std::to_string(r.status - 128) +
          (serving_ ? "; this agent served the rendezvous store, so the job ends"
                    : "; the other nodes go on without this one"));
      try {
        next_round_from(R);
      } catch (const Error&) {
      }
      return r.status;
    }
    if (r.stopped) {
      say("stopped the workers of round " + std::to_string(R) + ": " + why);
      check_failed();
      return -1;
    }
    if (r.status == 0) return finish(R);
    // One failure per round counts: the first to report it. Workers that
    // went down with it (their peer gone) or after the round moved on do not.
    const std::string id = me();
    const Bytes won = store_->compare_set(rkey(R, "failure"), {}, Bytes(id.begin(), id.end()));
    if (round_moved() || std::string(won.begin(), won.end()) != id) {
      check_failed();
      say("workers of round " + std::to_string(R) + " stopped after the round's failure elsewhere; joining the next");
      return -1;
    }
    const int64_t failures = store_->add(key("failures"), 1);
    if (failures > o_.max_restarts) {
      const std::string msg = r.failure + " on node " + addr_ + " (" + std::to_string(failures - 1) + " restart" +
                              (failures - 1 == 1 ? "" : "s") + " used of " + std::to_string(o_.max_restarts) + ")";
      store_->set(key("failed"), msg);
      next_round_from(R);
      say("giving up after " + std::to_string(o_.max_restarts) + " restart" + (o_.max_restarts == 1 ? "" : "s") +
          ": the last failure is above");
      leave();
      return r.status;
    }
    next_round_from(R);
    say("asking for a new rendezvous round after the failure (restart " + std::to_string(failures) + " of " +
        std::to_string(o_.max_restarts) + ")");
    return -1;
  }

  // This node's workers succeeded: the job is over here.
  int finish(int64_t R) {
    store_->set(rkey(R, "finished/" + me()), "1");
    store_->set(rkey(R, "finished"), "1");
    leave();
    // The job's end outlives the agents (so a late or woken agent learns
    // it): the serving agent says it, or under etcd whoever finishes.
    if (serving_ || etcd_) store_->set(key("done"), "round " + std::to_string(R) + " finished");
    return left_by_signal_ ? 128 + left_by_signal_ : 0;
  }

  // This agent is done with the job. The one serving the store stays until
  // each other member of its last round has said so (exited/<agent>) or
  // stopped beating, beating itself meanwhile; the others say so and go.
  void leave() {
    if (!serving_) {
      try {
        store_->set(key("exited/" + me()), "1");
      } catch (const Error&) {
        // The store is gone already: nothing left to tell.
      }
      return;
    }
    // The last round's members, and the agents waiting to join it.
    std::vector<int64_t> others;
    for (const Node& m : last_nodes_)
      if (m.agent != agent_) others.push_back(m.agent);
    std::map<int64_t, std::pair<int64_t, Clock::time_point>> beats;
    for (;;) {
      if (const int sig = take_signal(); sig != 0) {
        left_by_signal_ = sig;
        return;
      }
      heartbeat();
      for (int64_t a = 0, n = get_int("agents"); a < n; ++a)
        if (a != agent_ && std::find(others.begin(), others.end(), a) == others.end() &&
            store_->check({rkey(R_, "late/" + std::to_string(a))}))
          others.push_back(a);
      bool waiting_for_someone = false;
      const auto now = Clock::now();
      for (const int64_t a : others) {
        if (store_->check({key("exited/" + std::to_string(a))})) continue;
        const int64_t v = get_int("hb/" + std::to_string(a));
        auto& b = beats.try_emplace(a, v, now).first->second;
        if (v != b.first) b = {v, now};
        waiting_for_someone = waiting_for_someone || now - b.second < o_.heartbeat_timeout;
      }
      if (!waiting_for_someone) return;
      std::this_thread::sleep_for(kPoll);
    }
  }

  ElasticOptions o_;
  std::vector<std::string> argv_;
  std::string path_, prefix_, addr_, token_;
  bool local_ = false, serving_ = false, store_lost_ = false;
  milliseconds frozen_for_{0};  // the longest this agent was found stopped while its workers ran
  std::unique_ptr<Store> store_;
  EtcdStore* etcd_ = nullptr;  // store_, when the backend is etcd
  std::string alive_key_;      // this agent's leased key (etcd)
  bool etcd_backend_ = false;
  std::vector<Node> last_nodes_;  // the members of the last round this agent ran
  int64_t agent_ = -1, R_ = 0;
  int my_index_ = -1;
  int left_by_signal_ = 0;
};

}  // namespace

int elastic_launch(const ElasticOptions& o, const std::vector<std::string>& argv) {
  EMBER_CHECK(o.min_nodes >= 1 && o.max_nodes >= o.min_nodes, "launch: --nnodes ", o.min_nodes, ":", o.max_nodes,
              " needs 1 <= MIN <= MAX");
  EMBER_CHECK(o.nproc_per_node >= 1, "launch: nproc_per_node must be >= 1, got ", o.nproc_per_node);
  EMBER_CHECK(o.endpoint_port > 0 && o.endpoint_port <= 65535, "launch: --rdzv-endpoint port ", o.endpoint_port,
              " is outside [1, 65535]");
  EMBER_CHECK(!o.endpoint_host.empty(), "launch: --rdzv-endpoint has no host");
  EMBER_CHECK(!o.rdzv_id.empty(), "launch: --rdzv-id is empty");
  EMBER_CHECK(o.max_restarts >= 0, "launch: max_restarts must be >= 0, got ", o.max_restarts);
  EMBER_CHECK(!argv.empty(), "launch: no program given");
  // Below these the monitor (every 500 ms) would call live agents dead.
  EMBER_CHECK(o.heartbeat_timeout >= std::chrono::milliseconds(1500), "launch: --rdzv-conf heartbeat_timeout ",
              o.heartbeat_timeout.count() / 1000.0, " s is below 1.5 s (agents beat every 0.5 s)");
  EMBER_CHECK(o.join_timeout >= std::chrono::seconds(1), "launch: --rdzv-conf join_timeout ",
              o.join_timeout.count() / 1000.0, " s is below 1 s");
  std::fflush(stdout);
  std::fflush(stderr);
  Agent agent(o, argv);
  if (const int status = agent.open(); status >= 0) return status;
  SignalScope signals;
  return agent.run();
}

}  // namespace ember::distributed
