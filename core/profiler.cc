// The profiler's recording (per-thread buffers, sessions) and its outputs
// (Chrome trace JSON, the key_averages table). See profiler.h.
#include "core/profiler.h"

#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <utility>

#include "core/device.h"
#include "core/exception.h"
#include "core/stream.h"

#if EMBER_WITH_CUDA
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>
#endif

namespace ember::profiler {

namespace detail {
std::atomic<bool> g_on{false};

// A scope's GPU time: events recorded at its open and close on the stream
// that was current then; resolved (waited for) in events().
struct CudaSpan {
  explicit CudaSpan(int device) : start(device, /*timing=*/true), end(device, /*timing=*/true) {}
  ember::Event start, end;
  Stream stream;
};

struct Frame {
  std::string name;
  Kind kind;
  int64_t start_ns;
  int64_t child_ns = 0;
  uint64_t generation;
  bool nested_in_same = false;
  bool nvtx = false;
  std::string args;
  std::shared_ptr<CudaSpan> cuda;
};
}  // namespace detail

namespace {
using detail::Frame;

struct ThreadBuf {
  std::mutex mu;               // guards events and name against events()/start()
  std::vector<Event> events;
  std::deque<Frame> stack;     // only the owning thread touches it (deque: frames stay put)
  uint32_t tid = 0;
  std::string name;
};

struct Registry {
  std::mutex mu;
  std::vector<std::shared_ptr<ThreadBuf>> bufs;  // kept after their thread exits: its events stay readable
  std::atomic<uint64_t> generation{0};
  bool running = false;
  Options options;
  int cuda_device = -1;  // the device GPU time is taken on this session (-1: none)
  // The thread that started the session: the one whose scopes get GPU time
  // (the training thread, where ops, backward and optimizer steps run);
  // loader and communication threads' scopes would bracket its kernels.
  std::atomic<const ThreadBuf*> cuda_thread{nullptr};
};
Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: threads may record during exit
  return *r;
}

ThreadBuf& this_thread_buf() {
  thread_local std::shared_ptr<ThreadBuf> buf = [] {
    auto b = std::make_shared<ThreadBuf>();
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    b->tid = static_cast<uint32_t>(r.bufs.size());
    const bool main = static_cast<pid_t>(syscall(SYS_gettid)) == getpid();
    b->name = main ? "main" : "thread " + std::to_string(b->tid);
    r.bufs.push_back(b);
    return b;
  }();
  return *buf;
}

void json_escape(std::ostringstream& os, const std::string& s) {
  for (char c : s) {
    switch (c) {
      case '"': os << "\\\""; break;
      case '\\': os << "\\\\"; break;
      case '\n': os << "\\n"; break;
      case '\t': os << "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char b[8];
          std::snprintf(b, sizeof b, "\\u%04x", c);
          os << b;
        } else {
          os << c;
        }
    }
  }
}

std::string quoted(const std::string& s) {
  std::ostringstream os;
  os << '"';
  json_escape(os, s);
  os << '"';
  return os.str();
}

void add_arg(std::string& args, const char* key, const std::string& json_value) {
  if (!args.empty()) args += ',';
  args += quoted(key);
  args += ':';
  args += json_value;
}

std::string fmt_us(int64_t ns) {  // Chrome traces count microseconds
  char b[32];
  std::snprintf(b, sizeof b, "%.3f", static_cast<double>(ns) / 1e3);
  return b;
}

std::string fmt_time(int64_t ns) {
  char b[32];
  if (ns >= 1000000000)
    std::snprintf(b, sizeof b, "%.3fs", ns / 1e9);
  else if (ns >= 1000000)
    std::snprintf(b, sizeof b, "%.3fms", ns / 1e6);
  else
    std::snprintf(b, sizeof b, "%.3fus", ns / 1e3);
  return b;
}
}  // namespace

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Op: return "op";
    case Kind::Backward: return "backward";
    case Kind::Collective: return "collective";
    case Kind::Wait: return "wait";
    case Kind::Data: return "data";
    case Kind::Optimizer: return "optimizer";
    case Kind::Checkpoint: return "checkpoint";
    case Kind::User: return "user";
  }
  return "?";
}

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void start(Options options) {
  const ThreadBuf* me = &this_thread_buf();  // before taking r.mu: a thread's first call registers under it
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  EMBER_CHECK(!r.running, "profiler::start: a profiling session is already running (call profiler::stop() first)");
  for (auto& b : r.bufs) {
    std::lock_guard<std::mutex> bl(b->mu);
    b->events.clear();
  }
  r.options = options;
  r.cuda_device = -1;
  r.cuda_thread = me;
#if EMBER_WITH_CUDA
  if (options.cuda_time && cuda_is_available()) {
    int d = 0;
    if (cudaGetDevice(&d) == cudaSuccess) r.cuda_device = d;
  }
#endif
  r.generation.fetch_add(1);
  r.running = true;
  detail::g_on.store(true, std::memory_order_relaxed);
}

void stop() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  detail::g_on.store(false, std::memory_order_relaxed);
  r.running = false;
}

bool running() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.running;
}

namespace {
// GPU time of each event with an event pair (the host waits for them here,
// once per read), and self time: minus the GPU time of the events nested
// directly inside it on its thread (events are ordered by start, parents
// before children).
void resolve_cuda_times(std::vector<Event>& out) {
  bool any = false;
  for (Event& e : out) {
    if (!e.cuda_span) continue;
    e.cuda_ns = static_cast<int64_t>(e.cuda_span->start.elapsed_ms(e.cuda_span->end) * 1e6);
    e.cuda_self_ns = e.cuda_ns;
    any = true;
  }
  if (!any) return;
  // Per thread, the chain of events enclosing the current one in time; a
  // GPU-timed event's time leaves the self time of the nearest enclosing
  // event that has GPU time (user ranges and waits in between have none).
  std::map<uint32_t, std::vector<size_t>> open;
  std::map<uint32_t, size_t> last_outer;  // per thread: the previous outermost GPU-timed event
  for (size_t i = 0; i < out.size(); ++i) {
    Event& e = out[i];
    std::vector<size_t>& chain = open[e.tid];
    while (!chain.empty()) {
      const Event& p = out[chain.back()];
      if (p.depth < e.depth && p.start_ns <= e.start_ns && e.start_ns + e.dur_ns <= p.start_ns + p.dur_ns) break;
      chain.pop_back();
    }
    bool outer = e.cuda_ns >= 0;
    if (e.cuda_ns >= 0)
      for (size_t k = chain.size(); k-- > 0;)
        if (out[chain[k]].cuda_ns >= 0) {
          out[chain[k]].cuda_self_ns -= e.cuda_ns;
          outer = false;
          break;
        }
    if (outer) {
      auto it = last_outer.find(e.tid);
      if (it != last_outer.end())
        e.cuda_gap_ns = std::max<int64_t>(
            0, static_cast<int64_t>(out[it->second].cuda_span->end.elapsed_ms(e.cuda_span->start) * 1e6));
      last_outer[e.tid] = i;
    }
    chain.push_back(i);
  }
  for (Event& e : out)
    if (e.cuda_self_ns < 0 && e.cuda_ns >= 0) e.cuda_self_ns = 0;  // clock rounding between the pairs
}
}  // namespace

std::vector<Event> events() {
  Registry& r = registry();
  std::vector<Event> out;
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto& b : r.bufs) {
    std::lock_guard<std::mutex> bl(b->mu);
    out.insert(out.end(), b->events.begin(), b->events.end());
  }
  std::stable_sort(out.begin(), out.end(), [](const Event& a, const Event& b) {
    return a.start_ns != b.start_ns ? a.start_ns < b.start_ns : a.depth < b.depth;
  });
  resolve_cuda_times(out);
  return out;
}

void set_thread_name(const std::string& name) {
  ThreadBuf& b = this_thread_buf();
  std::lock_guard<std::mutex> lock(b.mu);
  b.name = name;
}

bool Scope::record_shapes() { return registry().options.record_shapes; }

void Scope::begin(Kind kind, const char* name) {
  ThreadBuf& b = this_thread_buf();
  Frame f{name, kind, 0};
  f.generation = registry().generation.load(std::memory_order_relaxed);
  for (const Frame& outer : b.stack)
    if (outer.name == f.name) f.nested_in_same = true;
#if EMBER_WITH_CUDA
  if (registry().options.nvtx) {
    nvtxRangePushA(name);
    f.nvtx = true;
  }
#endif
  const int dev = registry().cuda_device;
  if (dev >= 0 && (kind == Kind::Op || kind == Kind::Backward || kind == Kind::Optimizer) &&
      registry().cuda_thread.load(std::memory_order_relaxed) == &b) {
    f.cuda = std::make_shared<detail::CudaSpan>(dev);
    f.cuda->stream = Stream::current(dev);
    f.cuda->start.record(f.cuda->stream);
  }
  b.stack.push_back(std::move(f));
  frame_ = &b.stack.back();
  frame_->start_ns = now_ns();  // last, so the bookkeeping above is not timed
}

void Scope::end() {
  const int64_t t = now_ns();
  ThreadBuf& b = this_thread_buf();
  EMBER_INTERNAL_ASSERT(!b.stack.empty() && &b.stack.back() == frame_,
                        "profiler scopes must close in reverse order of opening on their thread");
  Frame& f = b.stack.back();
#if EMBER_WITH_CUDA
  if (f.nvtx) nvtxRangePop();
#endif
  // On the stream current at the open: an op that switched streams inside
  // (a StreamGuard) has restored it by now.
  if (f.cuda) f.cuda->end.record(f.cuda->stream);
  Event e;
  e.cuda_span = std::move(f.cuda);
  e.dur_ns = t - f.start_ns;
  e.self_ns = e.dur_ns - f.child_ns;
  e.start_ns = f.start_ns;
  e.kind = f.kind;
  e.name = std::move(f.name);
  e.args = std::move(f.args);
  e.tid = b.tid;
  e.depth = static_cast<uint32_t>(b.stack.size() - 1);
  e.nested_in_same = f.nested_in_same;
  const bool current = f.generation == registry().generation.load(std::memory_order_relaxed);
  b.stack.pop_back();
  frame_ = nullptr;
  if (!b.stack.empty()) b.stack.back().child_ns += e.dur_ns;
  if (!current) return;  // opened in an earlier session
  std::lock_guard<std::mutex> lock(b.mu);
  b.events.push_back(std::move(e));
}

void Scope::arg(const char* key, int64_t value) {
  if (frame_ != nullptr) add_arg(frame_->args, key, std::to_string(value));
}

void Scope::arg(const char* key, const std::string& value) {
  if (frame_ != nullptr) add_arg(frame_->args, key, quoted(value));
}

void Scope::inputs(const std::vector<Tensor>& ts) {
  if (frame_ == nullptr || !record_shapes()) return;
  std::string shapes = "[", dtypes = "[", devices = "[";
  for (size_t i = 0; i < ts.size(); ++i) {
    const char* sep = i ? "," : "";
    shapes += sep;
    dtypes += sep;
    devices += sep;
    if (!ts[i].defined()) {
      shapes += "[]";
      dtypes += "null";
      devices += "null";
      continue;
    }
    shapes += '[';
    for (size_t d = 0; d < ts[i].sizes().size(); ++d) shapes += (d ? "," : "") + std::to_string(ts[i].sizes()[d]);
    shapes += ']';
    dtypes += quoted(dtype_name(ts[i].dtype()));
    devices += quoted(ts[i].device().str());
  }
  add_arg(frame_->args, "input_shapes", shapes + "]");
  add_arg(frame_->args, "input_dtypes", dtypes + "]");
  add_arg(frame_->args, "input_devices", devices + "]");
}

std::string chrome_trace_events(const std::vector<Event>& events, int pid, const std::string& process_name,
                                int64_t offset_ns) {
  std::ostringstream os;
  os << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << pid << ",\"tid\":0,\"args\":{\"name\":"
     << quoted(process_name) << "}},\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" << pid
     << ",\"tid\":0,\"args\":{\"sort_index\":" << pid << "}}";
  std::map<uint32_t, std::string> names;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (auto& b : r.bufs) {
      std::lock_guard<std::mutex> bl(b->mu);
      names[b->tid] = b->name;
    }
  }
  std::map<uint32_t, bool> seen;
  for (const Event& e : events) seen[e.tid] = true;
  for (const auto& [tid, unused] : seen) {
    (void)unused;
    const auto it = names.find(tid);
    os << ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << pid << ",\"tid\":" << tid
       << ",\"args\":{\"name\":" << quoted(it != names.end() ? it->second : "thread " + std::to_string(tid))
       << "}}";
  }
  for (const Event& e : events) {
    os << ",\n{\"name\":" << quoted(e.name) << ",\"cat\":\"" << kind_name(e.kind) << "\",\"ph\":\"X\",\"ts\":"
       << fmt_us(e.start_ns + offset_ns) << ",\"dur\":" << fmt_us(e.dur_ns) << ",\"pid\":" << pid
       << ",\"tid\":" << e.tid << ",\"args\":{\"self_us\":" << fmt_us(e.self_ns);
    if (e.cuda_ns >= 0) os << ",\"cuda_us\":" << fmt_us(e.cuda_ns) << ",\"cuda_self_us\":" << fmt_us(e.cuda_self_ns);
    if (e.cuda_gap_ns >= 0) os << ",\"cuda_gap_us\":" << fmt_us(e.cuda_gap_ns);
    if (!e.args.empty()) os << ',' << e.args;
    os << "}}";
  }
  return os.str();
}

std::string chrome_trace(const std::vector<std::string>& bodies) {
  std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  bool first = true;
  for (const std::string& b : bodies) {
    if (b.empty()) continue;
    if (!first) out += ",\n";
    out += b;
    first = false;
  }
  out += "\n]}\n";
  return out;
}

std::vector<Average> key_averages(const std::vector<Event>& events) {
  std::map<std::pair<std::string, Kind>, Average> by;
  for (const Event& e : events) {
    Average& a = by[{e.name, e.kind}];
    a.name = e.name;
    a.kind = e.kind;
    a.calls += 1;
    a.self_ns += e.self_ns;
    if (!e.nested_in_same) a.total_ns += e.dur_ns;
    if (e.cuda_ns >= 0) {
      a.cuda_self_ns += e.cuda_self_ns;
      if (!e.nested_in_same) a.cuda_total_ns += e.cuda_ns;
    }
    if (e.cuda_gap_ns > 0) a.cuda_gap_ns += e.cuda_gap_ns;
  }
  std::vector<Average> out;
  for (auto& [k, a] : by) out.push_back(std::move(a));
  std::stable_sort(out.begin(), out.end(), [](const Average& a, const Average& b) { return a.self_ns > b.self_ns; });
  return out;
}

std::string summary_table(const std::vector<Event>& events, int top) {
  const std::vector<Average> avgs = key_averages(events);
  int64_t all_self = 0, all_cuda = 0;
  bool cuda = false;
  for (const Event& e : events) cuda = cuda || e.cuda_ns >= 0;
  for (const Average& a : avgs) all_self += a.self_ns, all_cuda += a.cuda_self_ns;
  std::ostringstream os;
  char line[320];
  const std::string rule = std::string(116, '-') + (cuda ? std::string(26, '-') : std::string()) + "\n";
  std::snprintf(line, sizeof line, "%-44s %-10s %8s %12s %8s %12s %12s %8s", "Name", "Kind", "Self %", "Self",
                "Total %", "Total", "Avg total", "Calls");
  os << rule << line;
  if (cuda) {
    std::snprintf(line, sizeof line, " %12s %12s", "CUDA self", "CUDA total");
    os << line;
  }
  os << "\n" << rule;
  int n = 0;
  for (const Average& a : avgs) {
    if (top > 0 && n++ >= top) break;
    std::string name = a.name.size() > 44 ? a.name.substr(0, 41) + "..." : a.name;
    const double self_pct = all_self ? 100.0 * a.self_ns / all_self : 0.0;
    const double tot_pct = all_self ? 100.0 * a.total_ns / all_self : 0.0;
    std::snprintf(line, sizeof line, "%-44s %-10s %7.2f%% %12s %7.2f%% %12s %12s %8lld", name.c_str(),
                  kind_name(a.kind), self_pct, fmt_time(a.self_ns).c_str(), tot_pct, fmt_time(a.total_ns).c_str(),
                  fmt_time(a.calls ? a.total_ns / a.calls : 0).c_str(), static_cast<long long>(a.calls));
    os << line;
    if (cuda) {
      std::snprintf(line, sizeof line, " %12s %12s", fmt_time(a.cuda_self_ns).c_str(),
                    fmt_time(a.cuda_total_ns).c_str());
      os << line;
    }
    os << "\n";
  }
  os << rule << "Self time total: " << fmt_time(all_self) << " (all threads; " << events.size() << " events)";
  if (cuda) os << "; CUDA self time total: " << fmt_time(all_cuda);
  os << "\n";
  return os.str();
}

}  // namespace ember::profiler
