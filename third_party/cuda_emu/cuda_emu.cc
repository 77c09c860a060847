// cuda_emu.cc: runs the grids that cuda_emu.h launches. Each CUDA thread of
// a block is a fiber (x86-64 context switch below) on one OS thread; a
// persistent pool of OS threads takes the blocks of a grid. __syncthreads and
// warp shuffles are fiber barriers that die with file:line on divergence, bad
// masks or deadlock; __shared__ memory is poisoned per block; launch
// configurations are validated as CUDA does. The runtime API, streams and
// memory are in cuda_runtime_emu.cc.
//
// Environment (read at start-up):
//   EMU_ORDER=fwd|rev|shuffle  order in which a block's threads run between
//                              barriers (default fwd). fwd and rev run warp
//                              by warp (first to last, or last to first):
//                              each warp runs as far as it can, to a
//                              __syncthreads or its end, before the next
//                              starts, so a missing __syncthreads between
//                              warps that share memory shows. shuffle
//                              interleaves every thread at each barrier, a
//                              warp's included, in an order seeded per
//                              launch and block, so a run is reproducible.
//   EMU_THREADS=N              OS threads running the blocks of a grid
//                              (default min(hardware threads, 4)).
//   EMU_STACK_KB=N             stack of each CUDA thread (default 256).
//   EMU_VERBOSE=1              at exit, print "N launches of M kernels";
//                              EMU_VERBOSE=2 also prints each launch.
//   TEST_UNDECLARED_OUTPUTS_DIR (set by bazel test) at exit, write the
//                              kernels launched and how often, a line each
//                              (tab-separated: count, launching file,
//                              <object>+<offset> of the emulated kernel's
//                              instantiation, launch name), to
//                              emu_launches.<pid>.txt there (a process
//                              each: multi-process tests spawn several, whose
//                              workers write it before their _exit), so
//                              that tools/emu_coverage.py can find a kernel,
//                              or an instantiation, that no emulated test
//                              launches.
#include "third_party/cuda_emu/cuda_emu.h"

#include <dlfcn.h>
#include <link.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "third_party/cuda_emu/emu_runtime.h"

#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#endif
#ifdef EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

thread_local uint3 threadIdx EMU_TLS;
thread_local uint3 blockIdx EMU_TLS;
thread_local dim3 blockDim EMU_TLS;
thread_local dim3 gridDim EMU_TLS;

// Saves the callee-saved registers and the SSE/x87 control words on the
// current stack, stores its pointer in *save_sp and resumes load_sp.
extern "C" void emu_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.globl emu_switch
.type emu_switch,@function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size emu_switch,.-emu_switch
)");

namespace emu {
namespace {

constexpr size_t kGuard = 4096;

int env_int(const char* n, int d) {
  const char* v = std::getenv(n);
  return v && *v ? std::atoi(v) : d;
}
std::string where(Site s) { return std::string(s.file) + ":" + std::to_string(s.line); }
// (One site is one string literal nearly always: the pointers compare first.)
bool same(Site a, Site b) { return a.line == b.line && (a.file == b.file || std::strcmp(a.file, b.file) == 0); }

std::atomic<int> g_order{[] {
  const std::string o = std::getenv("EMU_ORDER") ? std::getenv("EMU_ORDER") : "fwd";
  if (o != "fwd" && o != "rev" && o != "shuffle") die("EMU_ORDER must be fwd, rev or shuffle, not " + o);
  return static_cast<int>(o == "rev" ? Order::kReverse : o == "shuffle" ? Order::kShuffle : Order::kForward);
}()};
std::atomic<int> g_threads{std::max(1, env_int("EMU_THREADS", static_cast<int>(std::min(4u, std::max(1u, std::thread::hardware_concurrency())))))};
const size_t g_stack = static_cast<size_t>(std::max(16, env_int("EMU_STACK_KB", 256))) * 1024;
const int g_verbose = env_int("EMU_VERBOSE", 0);

std::mutex g_stats_mu;
uint64_t g_launches = 0;
// Launches by launching file, launch name and the emulated kernel's
// instantiation (its function): the launch record, and the kernels'
// names. File and name are string literals (__builtin_FILE(), cu2emu's
// "K"), so a launch keys them by address, copying nothing; one text at
// two addresses makes two entries, which the readers add up.
struct LaunchedAt {
  const char* file;
  const char* name;
  const void* fn;
  bool operator<(const LaunchedAt& o) const { return std::tie(file, name, fn) < std::tie(o.file, o.name, o.fn); }
};
std::map<LaunchedAt, uint64_t> g_launched_at;
std::map<const void*, int> g_max_dynamic_smem;  // cudaFuncSetAttribute

// The kernels launched so far, by name (g_stats_mu held).
std::set<std::string> kernel_names() {
  std::set<std::string> names;
  for (const auto& kv : g_launched_at) names.insert(kv.first.name);
  return names;
}

void print_summary() {
  std::lock_guard<std::mutex> l(g_stats_mu);
  std::fprintf(stderr, "[cuda-emu] %llu launches of %zu kernels\n", static_cast<unsigned long long>(g_launches),
               kernel_names().size());
}
// At static initialisation, so that the summary prints after main returns.
const bool g_summary_registered = g_verbose > 0 && std::atexit(print_summary) == 0;

// The launch record of a test process (TEST_UNDECLARED_OUTPUTS_DIR above),
// its folder read once at start-up. A process that launched nothing writes
// nothing.
const std::string g_record_dir = [] {
  const char* d = std::getenv("TEST_UNDECLARED_OUTPUTS_DIR");
  return std::string(d ? d : "");
}();
// Where an emulated kernel's instantiation lies: its object (the
// executable's own path for the program, not argv[0]) and its address there
// (less the object's load bias, so what nm lists; -1 if unknown).
std::pair<std::string, int64_t> object_of(const void* fn) {
  Dl_info info{};
  link_map* lm = nullptr;
  if (!fn || !dladdr1(fn, &info, reinterpret_cast<void**>(&lm), RTLD_DL_LINKMAP) || !lm) return {"-", -1};
  std::string obj = lm->l_name ? lm->l_name : "";
  if (obj.empty()) {
    char buf[4096];
    const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
    obj = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "-";
  }
  return {obj, static_cast<int64_t>(reinterpret_cast<uintptr_t>(fn) - lm->l_addr)};
}
void write_launches() {
  std::lock_guard<std::mutex> l(g_stats_mu);
  if (g_record_dir.empty() || g_launched_at.empty()) return;
  const std::string path = g_record_dir + "/emu_launches." + std::to_string(getpid()) + ".txt";
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "[cuda-emu] cannot write the launch record %s\n", path.c_str());
    return;
  }
  // Tab-separated: a launch name has spaces ("k<T, 4>").
  for (const auto& [at, n] : g_launched_at) {
    const auto [obj, off] = object_of(at.fn);
    std::fprintf(f, "%llu\t%s\t%s+%llx\t%s\n", static_cast<unsigned long long>(n), *at.file ? at.file : "-",
                 obj.c_str(), static_cast<unsigned long long>(off), at.name);
  }
  std::fclose(f);
}
const bool g_record_registered = !g_record_dir.empty() && std::atexit(write_launches) == 0;

enum class St { Ready, WaitBlock, WaitWarp, Done };
// A cp.async in flight: its bytes, read at issue, land at its thread's wait.
struct AsyncCopy {
  void* dst;
  uint64_t group;  // the thread's commits before it: its group's number
  size_t bytes;
  unsigned char data[16];
};
struct Fiber {
  void* sp;
  char* stack_lo;
  void* asan_fake_stack;
  uint3 tid;
  int lin;
  St st;
  uint64_t wait_gen;
  std::vector<AsyncCopy> in_flight;  // issue order, so groups ascend
  uint64_t commits;
};
struct Warp {
  unsigned existing = 0, exited = 0, arrived = 0, mask = 0;
  uint64_t gen = 0;
  Site site{};
  alignas(16) unsigned char slot[2][32][kGatherBytes];
};
struct Block {
  std::vector<Fiber> f;
  std::vector<Warp> warps;
  int live = 0, arrived = 0;
  uint64_t gen = 0;
  Site site{};
  Thunk thunk;
  void* ctx;
  const char* name;
};

// Per OS thread: fiber stacks (a guard page below each, so an overflow
// faults), the scheduler's saved context, the block being run, and which
// block last poisoned each __shared__ variable of this thread.
struct Worker {
  std::vector<char*> stacks;
  // Per stack (ASan): the lowest address whose shadow its last fiber may
  // have left poisoned, the top when none.
  std::vector<char*> poisoned_from;
  void* sched_sp = nullptr;
  const void* sched_stack_lo = nullptr;
  size_t sched_stack_size = 0;
  Block* blk = nullptr;
  Fiber* cur = nullptr;
  uint64_t block_serial = 0;
  std::vector<std::pair<void*, uint64_t>> shared_seen;
  unsigned char* dynamic_smem = nullptr;
  bool signal_stack = false;
  ~Worker() {
    for (char* s : stacks) munmap(s, g_stack + kGuard);
  }
  char* stack_lo(size_t i) {
    while (stacks.size() <= i) {
      void* p = mmap(nullptr, g_stack + kGuard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) die("mmap of a fiber stack failed (lower EMU_STACK_KB?)");
      mprotect(p, kGuard, PROT_NONE);
      stacks.push_back(static_cast<char*>(p));
      poisoned_from.push_back(static_cast<char*>(p) + kGuard + g_stack);  // fresh: nothing poisoned
    }
    return stacks[i] + kGuard;
  }
};
thread_local Worker W;

std::string tid_str(const Fiber& f) {
  return "block (" + std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," + std::to_string(blockIdx.z) +
         ") thread (" + std::to_string(f.tid.x) + "," + std::to_string(f.tid.y) + "," + std::to_string(f.tid.z) + ")";
}

// Fault reports name the kernel, block and thread. Without ASan, a fault on
// a fiber stack would otherwise kill the process without a word (the handler
// needs its own stack, as the faulting one may be exhausted); ASan reports
// the fault with the kernel's stack trace and then calls on_asan_death.
#ifdef EMU_ASAN
void on_asan_death() {
  if (W.blk && W.cur)
    std::fprintf(stderr, "[cuda-emu] in kernel %s, block (%u,%u,%u) thread (%u,%u,%u)\n", W.blk->name, blockIdx.x,
                 blockIdx.y, blockIdx.z, W.cur->tid.x, W.cur->tid.y, W.cur->tid.z);
}
void install_fault_reporting() {
  static std::once_flag once;
  std::call_once(once, [] { __asan_set_death_callback(on_asan_death); });
}
#else
struct sigaction g_prev_segv;
void on_segv(int, siginfo_t* si, void*) {
  if (W.blk && W.cur) {
    const auto a = reinterpret_cast<uintptr_t>(si->si_addr);
    bool overflow = false;
    for (char* s : W.stacks) overflow |= a >= reinterpret_cast<uintptr_t>(s) && a < reinterpret_cast<uintptr_t>(s) + kGuard;
    char msg[512];
    const uint3 t = W.cur->tid;
    const int n =
        overflow ? std::snprintf(msg, sizeof msg, "[cuda-emu] ERROR: %s: fiber stack overflow (EMU_STACK_KB=%zu is too small)",
                                 W.blk->name, g_stack / 1024)
                 : std::snprintf(msg, sizeof msg, "[cuda-emu] ERROR: %s: invalid address %#lx", W.blk->name,
                                 static_cast<unsigned long>(a));
    const int m = std::snprintf(msg + n, sizeof msg - n, " in block (%u,%u,%u) thread (%u,%u,%u)\n", blockIdx.x,
                                blockIdx.y, blockIdx.z, t.x, t.y, t.z);
    if (write(2, msg, std::min<size_t>(n + m, sizeof msg - 1)) < 0) {}
  }
  sigaction(SIGSEGV, &g_prev_segv, nullptr);  // returning re-faults into the previous handler
}
void install_fault_reporting() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_prev_segv);
  });
  if (W.signal_stack) return;
  W.signal_stack = true;
  stack_t cur{};
  sigaltstack(nullptr, &cur);
  if (!(cur.ss_flags & SS_DISABLE)) return;
  stack_t ss{};
  ss.ss_size = 64 * 1024;
  ss.ss_sp = new char[ss.ss_size];  // lives as long as the thread
  sigaltstack(&ss, nullptr);
}
#endif

// Fiber switches, annotated for ASan so that it knows which stack is live.
void enter_fiber(Fiber& f) {
#ifdef EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack_lo, g_stack);
  emu_switch(&W.sched_sp, f.sp);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  emu_switch(&W.sched_sp, f.sp);
#endif
}
void leave_fiber(bool exiting) {
  Fiber& f = *W.cur;
#ifdef EMU_ASAN
  if (exiting) {
    // Every frame below this one has returned, clearing its own redzones'
    // shadow; only the frames still live here (fiber_main's, this one's)
    // stay poisoned for the stack's next fiber to clear (init_fiber).
    char* sp;
    asm volatile("mov %%rsp, %0" : "=r"(sp));
    W.poisoned_from[f.lin] = std::max(f.stack_lo, sp - 256);
  }
  __sanitizer_start_switch_fiber(exiting ? nullptr : &f.asan_fake_stack, W.sched_stack_lo, W.sched_stack_size);
  emu_switch(&f.sp, W.sched_sp);
  __sanitizer_finish_switch_fiber(f.asan_fake_stack, &W.sched_stack_lo, &W.sched_stack_size);
#else
  (void)exiting;
  emu_switch(&f.sp, W.sched_sp);
#endif
}

void on_exit() {
  Block& b = *W.blk;
  Fiber& f = *W.cur;
  f.st = St::Done;
  b.live--;
  Warp& w = b.warps[f.lin / 32];
  unsigned bit = 1u << (f.lin % 32);
  w.exited |= bit;
  if (w.arrived && (w.mask & bit))
    die(std::string(b.name) + ": " + tid_str(f) + " exited while its warp waits at a shuffle/syncwarp at " +
        where(w.site) + " whose mask names it");
  // Exited threads count as arrived at __syncthreads, as on the hardware.
  if (b.arrived > 0 && b.arrived == b.live) {
    b.gen++;
    b.arrived = 0;
  }
}

void fiber_main() {
#ifdef EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &W.sched_stack_lo, &W.sched_stack_size);
#endif
  try {
    W.blk->thunk(W.blk->ctx);
  } catch (const std::exception& e) {
    die(std::string(W.blk->name) + ": exception in kernel: " + e.what());
  } catch (...) {
    die(std::string(W.blk->name) + ": exception in kernel");
  }
  on_exit();
  leave_fiber(true);
  __builtin_unreachable();
}

void init_fiber(Fiber& f, char* lo) {
#ifdef EMU_ASAN
  // The previous fiber on this stack never returned: its last frames'
  // redzones are still poisoned. Only those are cleared: the whole stack's
  // shadow (32 KiB a thread at 256 KiB stacks) was a third of an ASan run.
  char*& from = W.poisoned_from[f.lin];
  __asan_unpoison_memory_region(from, lo + g_stack - from);
  from = lo + g_stack;
#endif
  f.stack_lo = lo;
  f.asan_fake_stack = nullptr;
  f.in_flight.clear();  // a previous block's copies never landed: its shared memory is gone
  f.commits = 0;
  auto* sp = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(lo + g_stack) & ~uintptr_t{15});
  *--sp = 0;                                        // fake return address of fiber_main
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);  // emu_switch's ret target
  for (int i = 0; i < 6; ++i) *--sp = 0;            // rbp rbx r12-r15
  *--sp = 0x1F80ull | (0x037Full << 32);            // mxcsr, x87 control word (defaults)
  f.sp = sp;
  f.st = St::Ready;
}

struct Grid {
  dim3 grid, block;
  size_t smem;
  Thunk thunk;
  void* ctx;
  const char* name;
  uint64_t id, nblocks;
  std::atomic<uint64_t> next{0};
};

void run_block(Block& b, const Grid& g, uint64_t block_linear) {
  const dim3 bd = g.block;
  const int n = static_cast<int>(bd.x * bd.y * bd.z);
  b.f.resize(n);
  b.warps.assign((n + 31) / 32, Warp{});
  for (int i = 0; i < n; ++i) {
    Fiber& f = b.f[i];
    f.lin = i;
    f.tid = uint3{static_cast<unsigned>(i % bd.x), static_cast<unsigned>(i / bd.x % bd.y),
                  static_cast<unsigned>(i / (bd.x * bd.y))};
    init_fiber(f, W.stack_lo(i));
    b.warps[i / 32].existing |= 1u << (i % 32);
  }
  b.live = n;
  b.arrived = 0;
  b.gen = 0;
  W.block_serial++;
  if (g.smem) std::memset(W.dynamic_smem, 0xFF, g.smem);
  const auto order = static_cast<Order>(g_order.load());
  std::mt19937_64 rng(g.id * 0x9E3779B97F4A7C15ull + block_linear);
  std::vector<int> idx(n);  // shuffle's order
  for (int i = 0; i < n; ++i) idx[i] = i;
  W.blk = &b;
  // Runs thread i until it waits or ends, if it can run; true if it ran.
  auto step = [&](int i) {
    Fiber& f = b.f[i];
    if (f.st == St::Done) return false;
    if (f.st == St::WaitBlock && b.gen == f.wait_gen) return false;
    if (f.st == St::WaitWarp && b.warps[i / 32].gen == f.wait_gen) return false;
    f.st = St::Ready;
    threadIdx = f.tid;
    W.cur = &f;
    enter_fiber(f);
    return true;
  };
  const int warps = (n + 31) / 32;
  while (b.live > 0) {
    bool progressed = false;
    if (order == Order::kShuffle) {
      std::shuffle(idx.begin(), idx.end(), rng);
      for (int i : idx) progressed |= step(i);
    } else {
      // A warp's lanes take turns until none of them can go on; then the
      // next warp (last to first, lanes too, under rev).
      const bool rev = order == Order::kReverse;
      for (int k = 0; k < warps; ++k) {
        const int w = rev ? warps - 1 - k : k, lo = w * 32, hi = std::min(n, lo + 32);
        for (bool again = true; again;) {
          again = false;
          for (int j = 0; j < hi - lo; ++j) again |= step(rev ? hi - 1 - j : lo + j);
          progressed |= again;
        }
      }
    }
    if (!progressed) {
      std::string m = std::string(b.name) + ": deadlock in block: ";
      for (auto& f : b.f)
        if (f.st == St::WaitBlock) { m += tid_str(f) + " waits at __syncthreads " + where(b.site) + "; "; break; }
      for (auto& w : b.warps)
        if (w.arrived) { m += "a warp waits at " + where(w.site) + " for lanes of mask " + std::to_string(w.mask); break; }
      die(m);
    }
  }
  W.blk = nullptr;
  W.cur = nullptr;
}

// The part of a grid one OS thread runs: blocks taken from a shared counter.
void run_blocks(Grid& g) {
  install_fault_reporting();
  gridDim = g.grid;
  blockDim = g.block;
  if (g.smem) {
    void* p = nullptr;
    // Exactly smem bytes, so that ASan catches an access past the end.
    if (posix_memalign(&p, 16, g.smem) != 0) die(std::string(g.name) + ": out of memory for dynamic shared memory");
    W.dynamic_smem = static_cast<unsigned char*>(p);
  }
  Block b;
  b.thunk = g.thunk;
  b.ctx = g.ctx;
  b.name = g.name;
  for (uint64_t i; (i = g.next.fetch_add(1)) < g.nblocks;) {
    blockIdx = uint3{static_cast<unsigned>(i % g.grid.x), static_cast<unsigned>(i / g.grid.x % g.grid.y),
                     static_cast<unsigned>(i / (uint64_t{g.grid.x} * g.grid.y))};
    run_block(b, g, i);
  }
  std::free(W.dynamic_smem);
  W.dynamic_smem = nullptr;
}

// Persistent helper threads (created on demand, never joined: they may still
// wait on the condition variable when the process exits, so the pool is
// leaked). The launching thread runs blocks too. One grid at a time: grids
// run under the runtime's execution lock.
class Pool {
 public:
  void run(Grid& g, int n) {
    std::unique_lock<std::mutex> l(mu_);
    for (; spawned_ < n - 1; ++spawned_) std::thread([this] { loop(); }).detach();
    job_ = &g;
    ++gen_;
    open_ = n - 1;
    l.unlock();
    cv_.notify_all();
    run_blocks(g);
    l.lock();
    open_ = 0;  // whoever has not joined yet would find no blocks left
    done_.wait(l, [&] { return busy_ == 0; });
    job_ = nullptr;
  }

 private:
  void loop() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      cv_.wait(l, [&] { return gen_ != seen && open_ > 0; });
      seen = gen_;
      --open_;
      ++busy_;
      Grid* g = job_;
      l.unlock();
      run_blocks(*g);
      l.lock();
      if (--busy_ == 0) done_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_, done_;
  Grid* job_ = nullptr;
  uint64_t gen_ = 0;
  int spawned_ = 0, open_ = 0, busy_ = 0;
};

void run_grid(Grid& g) {
  const int n = static_cast<int>(std::min<uint64_t>(g_threads.load(), g.nblocks));
  if (n <= 1) {
    run_blocks(g);
    return;
  }
  static Pool* pool = new Pool;
  pool->run(g, n);
}

}  // namespace

int lane_id() { return W.cur->lin % 32; }

void cp_async(void* dst, const void* src, size_t bytes, bool valid, Site s) {
  if (!W.blk) die("cp.async outside a kernel at " + where(s));
  Fiber& f = *W.cur;
  if (bytes == 0 || bytes > sizeof(AsyncCopy::data))
    die("cp.async of " + std::to_string(bytes) + " bytes at " + where(s));
  const auto misaligned = [&](const void* p) { return reinterpret_cast<uintptr_t>(p) % bytes != 0; };
  if (misaligned(dst) || misaligned(src))
    die(std::string(W.blk->name) + ": cp.async of " + std::to_string(bytes) + " bytes at " + where(s) + ": " +
        tid_str(f) + ": " + (misaligned(dst) ? "shared" : "global") + " address not aligned to " +
        std::to_string(bytes) + " bytes (misaligned address on a GPU)");
  // src-size 0 reads nothing, but PTX still wants a valid address (the
  // kernels pass a tile's base): one outside the device's memory dies.
  if (!valid)
    check_device_range(src, bytes,
                       (std::string(W.blk->name) + ": cp.async's zero fill at " + where(s) + ": source").c_str());
  AsyncCopy c{dst, f.commits, bytes, {}};
  if (valid) std::memcpy(c.data, src, bytes);
  std::memset(dst, 0xFF, bytes);
  f.in_flight.push_back(c);
}

void cp_async_commit() {
  if (!W.blk) die("cp.async.commit_group outside a kernel");
  W.cur->commits++;
}

void cp_async_wait(int n) {
  if (!W.blk) die("cp.async.wait_group outside a kernel");
  Fiber& f = *W.cur;
  // Groups [0, done) land: all committed ones but the n most recent.
  const uint64_t done = f.commits > static_cast<uint64_t>(n) ? f.commits - n : 0;
  size_t k = 0;
  for (; k < f.in_flight.size() && f.in_flight[k].group < done; ++k)
    std::memcpy(f.in_flight[k].dst, f.in_flight[k].data, f.in_flight[k].bytes);
  f.in_flight.erase(f.in_flight.begin(), f.in_flight.begin() + static_cast<std::ptrdiff_t>(k));
  // A copy still in flight over bytes one that landed wrote leaves them
  // undefined until it lands too (a ring of stages waited one short).
  if (k > 0)
    for (const AsyncCopy& c : f.in_flight) std::memset(c.dst, 0xFF, c.bytes);
}

void syncthreads(Site s) {
  if (!W.blk) die("__syncthreads outside a kernel at " + where(s));
  Block& b = *W.blk;
  if (b.arrived == 0) b.site = s;
  else if (!same(b.site, s))
    die(std::string(b.name) + ": divergent __syncthreads: " + tid_str(*W.cur) + " at " + where(s) +
        ", other threads at " + where(b.site));
  if (++b.arrived == b.live) {
    b.gen++;
    b.arrived = 0;
    return;
  }
  W.cur->st = St::WaitBlock;
  W.cur->wait_gen = b.gen;
  leave_fiber(false);
}

namespace {
// Warp barrier over `mask`; returns the generation it completed.
uint64_t warp_barrier(unsigned mask, Site s, const char* what) {
  Block& b = *W.blk;
  Fiber& f = *W.cur;
  Warp& w = b.warps[f.lin / 32];
  const unsigned bit = 1u << (f.lin % 32);
  auto fail = [&](const std::string& m) { die(std::string(b.name) + ": " + what + " at " + where(s) + ": " + tid_str(f) + ": " + m); };
  if (!(mask & bit)) fail("mask excludes the calling lane");
  if (mask & ~w.existing) fail("mask names lanes that do not exist (block size not a multiple of 32)");
  if (mask & w.exited) fail("mask names lanes that have exited");
  if (w.arrived == 0) {
    w.mask = mask;
    w.site = s;
  } else if (w.mask != mask || !same(w.site, s)) {
    fail("divergent: other lanes wait at " + where(w.site));
  }
  const uint64_t g = w.gen;
  w.arrived |= bit;
  if (w.arrived == mask) {
    w.gen++;
    w.arrived = 0;
    return g;
  }
  f.st = St::WaitWarp;
  f.wait_gen = g;
  leave_fiber(false);
  return g;
}
}  // namespace

void syncwarp(Site s, unsigned mask) {
  if (!W.blk) die("__syncwarp outside a kernel at " + where(s));
  warp_barrier(mask, s, "__syncwarp");
}

namespace {
// Every lane of `mask` leaves `bytes` of v in its slot; after the warp's
// barrier, the slots of that barrier's generation (lane i's at i).
const unsigned char* deposit_and_wait(unsigned mask, const void* v, size_t bytes, Site s, const char* what) {
  if (!W.blk) die(std::string(what) + " outside a kernel at " + where(s));
  if (bytes > kGatherBytes) die(std::string(what) + " of " + std::to_string(bytes) + " bytes at " + where(s));
  Warp& w = W.blk->warps[W.cur->lin / 32];
  std::memcpy(w.slot[w.gen & 1][W.cur->lin % 32], v, bytes);
  const uint64_t g = warp_barrier(mask, s, what);
  return w.slot[g & 1][0];
}
}  // namespace

const void* warp_exchange(unsigned mask, const void* v, size_t bytes, int src, Site s) {
  const unsigned char* all = deposit_and_wait(mask, v, bytes, s, "__shfl_*_sync");
  if (!(mask & (1u << src)))
    die(std::string(W.blk->name) + ": shuffle at " + where(s) + " reads lane " + std::to_string(src) +
        " outside its mask (undefined value)");
  return all + src * kGatherBytes;
}

const unsigned char* warp_gather(unsigned mask, const void* v, size_t bytes, Site s) {
  return deposit_and_wait(mask, v, bytes, s, "warp gather");
}

void shared_init(void* p, size_t bytes) {
  if (!W.blk) die("a __shared__ variable was reached outside a kernel");
  for (auto& [q, serial] : W.shared_seen)
    if (q == p) {
      if (serial != W.block_serial) std::memset(p, 0xFF, bytes);
      serial = W.block_serial;
      return;
    }
  W.shared_seen.emplace_back(p, W.block_serial);
  std::memset(p, 0xFF, bytes);
}

void* dynamic_shared() { return W.dynamic_smem; }

cudaError_t launch(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Thunk thunk, std::shared_ptr<void> ctx,
                   const char* name, const void* fn, const char* file) {
  const uint64_t nt = uint64_t{block.x} * block.y * block.z;
  if (nt == 0 || nt > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 ||
      grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    if (g_verbose > 1)
      std::fprintf(stderr, "[cuda-emu] %s: invalid configuration grid (%u,%u,%u) block (%u,%u,%u)\n", name, grid.x,
                   grid.y, grid.z, block.x, block.y, block.z);
    return set_error(cudaErrorInvalidConfiguration);
  }
  uint64_t id;
  {
    std::lock_guard<std::mutex> l(g_stats_mu);
    auto it = g_max_dynamic_smem.find(fn);
    if (smem > std::max<size_t>(48 * 1024, it == g_max_dynamic_smem.end() ? 0 : it->second))
      return set_error(cudaErrorInvalidValue);
    id = g_launches++;
    ++g_launched_at[{file, name, fn}];
  }
  if (g_verbose > 1)
    std::fprintf(stderr, "[cuda-emu] %s<<<(%u,%u,%u),(%u,%u,%u),%zu>>>\n", name, grid.x, grid.y, grid.z, block.x, block.y,
                 block.z, smem);
  enqueue(
      stream,
      [=, ctx = std::move(ctx)] {
        Grid g{grid, block, smem, thunk, ctx.get(), name, id, uint64_t{grid.x} * grid.y * grid.z};
        run_grid(g);
      },
      name);
  return cudaSuccess;
}

LaunchStats launch_stats() {
  std::lock_guard<std::mutex> l(g_stats_mu);
  const std::set<std::string> names = kernel_names();
  return LaunchStats{g_launches, std::vector<std::string>(names.begin(), names.end()), host_sync_count()};
}
Order set_order(Order order) { return static_cast<Order>(g_order.exchange(static_cast<int>(order))); }
int set_threads(int n) { return g_threads.exchange(std::max(1, n)); }

}  // namespace emu

// Kernel attributes belong to the launch checks above.
extern "C" cudaError_t cudaFuncSetAttribute(const void* fn, cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || value > 227 * 1024) return emu::set_error(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> l(emu::g_stats_mu);
    emu::g_max_dynamic_smem[fn] = value;
  }
  return cudaSuccess;
}

// The launch record now, for a process that ends by _exit (atexit's
// handlers do not run): the multi-process tests' workers
// (distributed/testing/multiprocess.cc) call it through a weak reference,
// which is null where the emulation is not linked.
extern "C" void ember_emu_write_launches() { emu::write_launches(); }
