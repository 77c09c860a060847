// The flight recorder's ring, its JSON dump and the SIGUSR1 dumper (see
// flight_recorder.h; the format is in docs/reliability.md).
#include "distributed/comm/flight_recorder.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/exception.h"

namespace ember::distributed::fr {

namespace {
thread_local const char* t_caller = "";
thread_local PendingCall* t_call = nullptr;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int64_t env_capacity() {
  const char* v = std::getenv("EMBER_FR_BUFFER");
  if (!v || !*v) return 2000;
  char* end = nullptr;
  errno = 0;
  long long n = std::strtoll(v, &end, 10);
  EMBER_CHECK(errno == 0 && end && *end == '\0' && n >= 0 && n <= (1LL << 24), "EMBER_FR_BUFFER=", v,
              " is not a number of entries in [0, 16777216] (0 turns the flight recorder off)");
  return n;
}

// "libfoo.so+0x1a2b (symbol)" or "0x..." when nothing is known.
std::string describe_frame(const void* frame) {
  if (!frame) return "";
  char buf[64];
  Dl_info info{};
  if (dladdr(frame, &info) && info.dli_fname) {
    const auto off = reinterpret_cast<uintptr_t>(frame) - reinterpret_cast<uintptr_t>(info.dli_fbase);
    std::snprintf(buf, sizeof buf, "+0x%zx", static_cast<size_t>(off));
    std::string s = std::filesystem::path(info.dli_fname).filename().string() + buf;
    if (info.dli_sname) s += std::string(" (") + info.dli_sname + ")";
    return s;
  }
  std::snprintf(buf, sizeof buf, "%p", frame);
  return buf;
}

nlohmann::json metas_json(const std::vector<TensorMeta>& ms, bool sizes) {
  nlohmann::json a = nlohmann::json::array();
  for (const TensorMeta& m : ms) {
    if (sizes)
      a.push_back(m.sizes);
    else
      a.push_back(dtype_name(m.dtype));
  }
  return a;
}
}  // namespace

const char* state_name(State s) {
  switch (s) {
    case State::Scheduled:
      return "scheduled";
    case State::Started:
      return "started";
    case State::Completed:
      return "completed";
    case State::Failed:
      return "failed";
  }
  return "?";
}

CallerTag::CallerTag(const char* tag) : prev_(t_caller) { t_caller = tag ? tag : ""; }
CallerTag::~CallerTag() { t_caller = prev_; }

PendingCall::PendingCall(std::shared_ptr<const GroupDesc> g, std::vector<TensorMeta> in, std::vector<TensorMeta> out,
                         int p, int t, const void* f)
    : group(std::move(g)), inputs(std::move(in)), outputs(std::move(out)), peer(p), tag(t), frame(f), prev_(t_call) {
  t_call = this;
}
PendingCall::~PendingCall() { t_call = prev_; }
const PendingCall* current_call() { return t_call; }

TensorMeta meta(const Tensor& t) { return {t.sizes(), t.dtype()}; }

// Where a group stands, kept beside the ring so a dump says it even after
// the ring has wrapped past the group's entries.
struct FlightRecorder::GroupProgress {
  std::shared_ptr<const GroupDesc> group;
  int64_t scheduled = -1, started = -1, completed = -1;  // collective sequence ids
  int64_t p2p_scheduled = 0, p2p_completed = 0;          // counts
};

FlightRecorder& FlightRecorder::get() {
  static FlightRecorder* recorder = new FlightRecorder(env_capacity());  // never destroyed: threads record at exit
  return *recorder;
}

FlightRecorder::FlightRecorder(int64_t capacity) : capacity_(capacity) {
  EMBER_CHECK(capacity >= 0, "FlightRecorder: capacity ", capacity, " must be >= 0");
  ring_.resize(static_cast<size_t>(capacity));
}

FlightRecorder::~FlightRecorder() = default;

FlightRecorder::GroupProgress& FlightRecorder::progress_of(const std::shared_ptr<const GroupDesc>& g) {
  for (auto& p : progress_)
    if (p->group == g) return *p;
  progress_.push_back(std::make_unique<GroupProgress>());
  progress_.back()->group = g;
  return *progress_.back();
}

Entry* FlightRecorder::find(int64_t id) {
  if (id < 0 || capacity_ == 0) return nullptr;
  Entry& e = ring_[static_cast<size_t>(id % capacity_)];
  return e.id == id ? &e : nullptr;
}

int64_t FlightRecorder::record_op(const char* op, bool p2p, int64_t seq, int64_t timeout_ms) {
  if (capacity_ == 0) return -1;
  const int64_t t = now_ns();
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t id = next_id_++;
  Entry& e = ring_[static_cast<size_t>(id % capacity_)];
  e = Entry{};
  e.id = id;
  e.seq = seq;
  e.p2p = p2p;
  e.op = op;
  e.created_ns = t;
  e.timeout_ms = timeout_ms;
  e.caller = t_caller;
  if (PendingCall* c = t_call) {
    e.group = c->group;
    e.inputs = c->inputs;
    e.outputs = c->outputs;
    e.peer = c->peer;
    e.tag = c->tag;
    e.frame = c->frame;
  }
  if (e.group) {
    GroupProgress& g = progress_of(e.group);
    if (p2p) {
      ++g.p2p_scheduled;
      e.msg = p2p_msgs_[{e.group.get(), e.peer, e.tag, std::strcmp(op, "send") == 0}]++;
    } else {
      g.scheduled = std::max(g.scheduled, seq);
    }
  }
  return id;
}

void FlightRecorder::started(int64_t id) {
  if (id < 0) return;
  const int64_t t = now_ns();
  std::lock_guard<std::mutex> lock(mu_);
  Entry* e = find(id);
  if (!e || e->state != State::Scheduled) return;
  e->state = State::Started;
  e->started_ns = t;
  if (e->group && !e->p2p) {
    GroupProgress& g = progress_of(e->group);
    g.started = std::max(g.started, e->seq);
  }
}

void FlightRecorder::finished(int64_t id, const std::string& error) {
  if (id < 0) return;
  const int64_t t = now_ns();
  std::lock_guard<std::mutex> lock(mu_);
  Entry* e = find(id);
  if (!e || e->state == State::Completed || e->state == State::Failed) return;
  if (e->started_ns == 0) e->started_ns = t;
  e->completed_ns = t;
  e->state = error.empty() ? State::Completed : State::Failed;
  e->error = error;
  if (error.empty()) op_ns_[e->op] += t - e->created_ns;
  if (e->group && error.empty()) {
    GroupProgress& g = progress_of(e->group);
    if (e->p2p)
      ++g.p2p_completed;
    else
      g.completed = std::max(g.completed, e->seq);
  }
}

std::vector<Entry> FlightRecorder::entries() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Entry> out;
  const int64_t first = std::max<int64_t>(0, next_id_ - capacity_);
  for (int64_t id = first; id < next_id_; ++id) out.push_back(ring_[static_cast<size_t>(id % capacity_)]);
  return out;
}

std::map<std::string, double> FlightRecorder::op_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, double> out;
  for (const auto& [op, ns] : op_ns_) out[op] += static_cast<double>(ns) * 1e-9;
  return out;
}

void FlightRecorder::set_identity(int rank, int world_size) {
  std::lock_guard<std::mutex> lock(mu_);
  rank_ = rank;
  world_size_ = world_size;
}

void FlightRecorder::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Entry& e : ring_) e = Entry{};
  next_id_ = 0;
  progress_.clear();
  op_ns_.clear();
  p2p_msgs_.clear();
  failure_dumped_ = false;
}

std::string FlightRecorder::dump_json(const std::string& reason) const {
  using nlohmann::ordered_json;
  std::vector<Entry> es = entries();
  ordered_json j;
  std::string groups_text;
  std::vector<const GroupDesc*> group_order;
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  {
    std::lock_guard<std::mutex> lock(mu_);
    j["format"] = "ember_flight_recorder";
    j["version"] = 1;
    j["rank"] = rank_;
    j["world_size"] = world_size_;
    j["host"] = host;
    j["pid"] = static_cast<int64_t>(getpid());
    j["reason"] = reason;
    j["dumped_at_ns"] = now_ns();
    j["buffer_size"] = capacity_;
    j["recorded"] = next_id_;
    groups_text = "[";
    for (size_t i = 0; i < progress_.size(); ++i) {
      const GroupProgress& p = *progress_[i];
      group_order.push_back(p.group.get());
      ordered_json g;
      g["id"] = static_cast<int64_t>(i);
      g["name"] = p.group->name;
      g["ranks"] = p.group->ranks;
      g["backend"] = p.group->backend;
      g["group_rank"] = p.group->rank;
      g["last_scheduled_seq"] = p.scheduled;
      g["last_started_seq"] = p.started;
      g["last_completed_seq"] = p.completed;
      g["p2p_scheduled"] = p.p2p_scheduled;
      g["p2p_completed"] = p.p2p_completed;
      groups_text += (i ? ",\n  " : "\n  ") + g.dump();
    }
    groups_text += "\n ]";
  }
  // The header's fields a line each, then one group and one entry a line:
  // readable with grep and less, and a third the size of pretty-printed
  // entries for fr_trace to parse.
  // Entries name their group by its index in "groups" (a 64-rank group's
  // member list on every entry would be most of the file).
  auto group_id = [&](const GroupDesc* g) -> int64_t {
    for (size_t i = 0; i < group_order.size(); ++i)
      if (group_order[i] == g) return static_cast<int64_t>(i);
    return -1;
  };
  std::string text = j.dump(1);
  text.resize(text.size() - 2);  // the header's closing "\n}"
  text += ",\n \"groups\": " + groups_text;
  text += ",\n \"entries\": [";
  bool first = true;
  for (const Entry& e : es) {
    ordered_json x;
    x["record_id"] = e.id;
    x["group"] = e.group ? e.group->name : "";
    x["group_id"] = group_id(e.group.get());
    x["seq"] = e.seq;
    x["p2p"] = e.p2p;
    x["op"] = e.op;
    if (e.p2p) {
      x["peer"] = e.peer;
      x["tag"] = e.tag;
      x["msg"] = e.msg;
    }
    x["input_sizes"] = metas_json(e.inputs, true);
    x["input_dtypes"] = metas_json(e.inputs, false);
    x["output_sizes"] = metas_json(e.outputs, true);
    x["output_dtypes"] = metas_json(e.outputs, false);
    x["state"] = state_name(e.state);
    x["time_created_ns"] = e.created_ns;
    x["time_started_ns"] = e.started_ns;
    x["time_completed_ns"] = e.completed_ns;
    x["timeout_ms"] = e.timeout_ms;
    x["caller"] = e.caller;
    x["frame"] = describe_frame(e.frame);
    if (!e.error.empty()) x["error"] = e.error;
    text += (first ? "\n  " : ",\n  ") + x.dump();
    first = false;
  }
  text += "\n ]\n}";
  return text;
}

std::string dump_dir() {
  const char* d = std::getenv("EMBER_FR_DUMP_DIR");
  return d && *d ? std::string(d) : std::string("ember_fr");
}

std::string dump_path(const std::string& dir, int rank) {
  return (std::filesystem::path(dir) / ("ember_fr_rank" + std::to_string(rank) + ".json")).string();
}

std::string FlightRecorder::dump(const std::string& reason, const std::string& dir_in) const {
  const std::string dir = dir_in.empty() ? dump_dir() : dir_in;
  const std::string text = dump_json(reason);
  int rank;
  {
    std::lock_guard<std::mutex> lock(mu_);
    rank = rank_ < 0 ? 0 : rank_;
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  EMBER_CHECK(!ec, "flight recorder: cannot create the dump directory '", dir, "' (EMBER_FR_DUMP_DIR): ", ec.message());
  const std::string path = dump_path(dir, rank);
  // Written whole, then renamed: a reader (fr_trace, the launcher) never
  // sees half a file, and a dump interrupted by the process's death leaves
  // the previous one.
  std::lock_guard<std::mutex> one_at_a_time(dump_mu_);
  const std::string tmp = path + ".tmp" + std::to_string(getpid()) + "." + std::to_string(dumps_++);
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    EMBER_CHECK(f.good(), "flight recorder: cannot write '", tmp, "': ", std::strerror(errno));
    f << text << "\n";
    f.flush();
    EMBER_CHECK(f.good(), "flight recorder: writing '", tmp, "' failed: ", std::strerror(errno));
  }
  std::filesystem::rename(tmp, path, ec);
  EMBER_CHECK(!ec, "flight recorder: cannot rename '", tmp, "' to '", path, "': ", ec.message());
  return path;
}

void FlightRecorder::dump_on_failure(const std::string& reason) {
  if (capacity_ == 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_dumped_) return;
    failure_dumped_ = true;
  }
  try {
    const std::string path = dump(reason);
    std::fprintf(stderr, "flight recorder: rank %d dumped its last operations to %s\n", rank_ < 0 ? 0 : rank_,
                 path.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flight recorder: could not dump: %s\n", e.what());
  }
}

std::string dump_flight_recorder(const std::string& reason) {
  FlightRecorder& r = FlightRecorder::get();
  EMBER_CHECK(r.enabled(), "dump_flight_recorder: the flight recorder is off (EMBER_FR_BUFFER=0)");
  return r.dump(reason);
}

// ---- SIGUSR1 ----

namespace {
int g_signal_pipe[2] = {-1, -1};

void on_sigusr1(int) {
  const int saved = errno;
  const char c = 1;
  (void)!::write(g_signal_pipe[1], &c, 1);  // async-signal-safe; the dumper thread does the rest
  errno = saved;
}

void dumper_loop() {
  for (;;) {
    char c;
    const ssize_t n = ::read(g_signal_pipe[0], &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    FlightRecorder& r = FlightRecorder::get();
    if (!r.enabled()) continue;
    try {
      const std::string path = r.dump("SIGUSR1");
      std::fprintf(stderr, "flight recorder: rank %d dumped its last operations to %s (SIGUSR1)\n",
                   r.rank() < 0 ? 0 : r.rank(), path.c_str());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "flight recorder: could not dump on SIGUSR1: %s\n", e.what());
    }
  }
}
}  // namespace

namespace {
std::terminate_handler g_prev_terminate = nullptr;

void on_terminate() {
  std::string what = "std::terminate called";
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      what = std::string("uncaught exception: ") + ex.what();
    } catch (...) {
      what = "uncaught exception of an unknown type";
    }
  }
  // On a thread of its own, waited for at most 2 s: a thread that dies
  // holding the recorder's lock must still end in abort, not a hang.
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread([what, done] {
    FlightRecorder::get().dump_on_failure(what);
    done->store(true);
  }).detach();
  for (int i = 0; i < 200 && !done->load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (g_prev_terminate) g_prev_terminate();
  std::abort();
}
}  // namespace

void install_dump_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_prev_terminate = std::set_terminate(on_terminate);
    struct sigaction old {};
    if (sigaction(SIGUSR1, nullptr, &old) != 0) return;
    if (old.sa_handler != SIG_DFL || (old.sa_flags & SA_SIGINFO)) return;  // the program's own
    if (::pipe2(g_signal_pipe, O_CLOEXEC) != 0) return;
    std::thread(dumper_loop).detach();
    struct sigaction sa {};
    sa.sa_handler = on_sigusr1;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &sa, nullptr);
  });
}

}  // namespace ember::distributed::fr
