// The emulator's own tests: each misuse it exists to catch (barrier and
// shuffle misuse, bad launch configurations, host pointers, copy directions,
// races exposed by thread order, missing stream waits, reads of uninitialised
// shared memory, out-of-bounds accesses under ASan) must be caught, and its
// execution model (deferred streams, the worker pool) must give CUDA's
// results. Compiled like the project's .cu files: cu2emu.py, then g++ with
// -include cuda_emu.h; kernels and tests share this file.
#include <cublas_v2.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "third_party/cuda_emu/emu_runtime.h"

extern "C" void ember_emu_write_launches();  // cuda_emu.cc: the launch record now

namespace {

// ---- Kernels ----
__global__ void fill(int* out, int n, int v) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = v + i;
}
__global__ void copy(const int* in, int* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i];
}
struct Coeffs {
  int v[4];
};
__global__ void fill_struct(int* out, Coeffs c) {
  out[threadIdx.x] = c.v[threadIdx.x % 4];
}
__global__ void divergent_barrier(int* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}
__global__ void shuffle_outside_mask(int* out) {
  if (threadIdx.x < 16) out[threadIdx.x] = __shfl_sync(0x0000ffffu, int(threadIdx.x), 20);
}
// emu::warp_gather, what the emulated tensor-core primitives use: three
// gathers in a row (both halves of the double buffer, a shuffle between)
// give every lane every other lane's 24 bytes; out[t] counts the lanes
// whose values arrived intact.
__global__ void gather_rounds(int* out) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int ok = 0;
  for (int round = 0; round < 3; ++round) {
    const int mine[6] = {lane, warp, round, lane * 7, -lane, round + lane};
    const unsigned char* all = ::emu::warp_gather(0xffffffffu, mine, sizeof mine, EMU_SITE);
    for (int src = 0; src < 32; ++src) {
      int v[6];
      memcpy(v, all + src * ::emu::kGatherBytes, sizeof v);
      ok += v[0] == src && v[1] == warp && v[2] == round && v[3] == src * 7 && v[4] == -src && v[5] == round + src;
    }
    ok += __shfl_sync(0xffffffffu, lane, (lane + 1) % 32) == (lane + 1) % 32;
  }
  out[threadIdx.x] = ok;
}
__global__ void divergent_gather(int* out) {
  const int v = threadIdx.x;
  const unsigned char* all = nullptr;
  if (threadIdx.x < 16) {
    all = ::emu::warp_gather(0xffffffffu, &v, sizeof v, EMU_SITE);
  } else {
    all = ::emu::warp_gather(0xffffffffu, &v, sizeof v, EMU_SITE);
  }
  out[threadIdx.x] = all[0];
}
// Each thread reads its left neighbour's value: correct only with the barrier.
__global__ void neighbour(int* out, bool barrier) {
  __shared__ int s[64];
  s[threadIdx.x] = threadIdx.x + 1;
  if (barrier) __syncthreads();
  out[threadIdx.x] = threadIdx.x ? s[threadIdx.x - 1] : 0;
}
__global__ void read_shared_first(float* f, int* i) {
  __shared__ float sf[32];
  __shared__ int si;
  f[blockIdx.x * 32 + threadIdx.x] = sf[threadIdx.x];  // before any write: poison
  if (threadIdx.x == 0) i[blockIdx.x] = si;
  __syncthreads();
  sf[threadIdx.x] = 1.0f;  // the next block must not see these
  si = 7;
}
__global__ void reverse_dynamic(const float* in, float* out, float* before) {
  extern __shared__ float dyn[];
  const int t = threadIdx.x, n = blockDim.x;
  before[blockIdx.x * n + t] = dyn[t];
  dyn[t] = in[blockIdx.x * n + t];
  __syncthreads();
  out[blockIdx.x * n + t] = dyn[n - 1 - t];
}
// cp.async as cuda_utils.cuh issues it: each thread copies 4 floats of `in`
// into shared memory in two groups (floats 0-1, then 2-3) and one copy it
// never commits (float 4 of a 5-float row: stays in flight). `out` gets
// what the thread sees of its row after wait_group `n` (n < 0: before any
// wait), then, after wait_group 0 and a barrier, its neighbour's row.
__global__ void async_rows(const float* in, float* out, int n) {
  extern __shared__ float rows[];  // [32][8], 16-byte aligned
  const int t = threadIdx.x;
  float* mine = rows + t * 8;
  for (int k = 0; k < 8; ++k) mine[k] = -1.0f;  // not poison: a NaN below is the copy's
  ::emu::cp_async(mine, in + t * 8, 8, true, EMU_SITE);
  ::emu::cp_async_commit();
  ::emu::cp_async(mine + 2, in + t * 8 + 2, 8, true, EMU_SITE);
  ::emu::cp_async(mine + 4, in, 4, false, EMU_SITE);  // zeros
  ::emu::cp_async_commit();
  ::emu::cp_async(mine + 5, in + t * 8 + 5, 4, true, EMU_SITE);  // never committed
  if (n >= 0) ::emu::cp_async_wait(n);
  for (int k = 0; k < 6; ++k) out[t * 12 + k] = mine[k];
  ::emu::cp_async_wait(0);
  __syncthreads();
  for (int k = 0; k < 6; ++k) out[t * 12 + 6 + k] = rows[(t + 1) % 32 * 8 + k];
}
// Two stages of a pipeline: step s + 1's tile loads into the stage step
// s - 1 read. Issued after the step's barrier, every warp is done with it;
// issued before (`barrier_first` false), warp 0 overwrites the stage while
// warp 1 still reads step s - 1 from it.
__global__ void async_stages(const float* in, float* out, int steps, bool barrier_first) {
  __shared__ float stage[2][64];
  const int t = threadIdx.x;
  const auto load = [&](int s) {
    ::emu::cp_async(&stage[s % 2][t], in + s * 64 + t, 4, true, EMU_SITE);
    ::emu::cp_async_commit();
  };
  load(0);
  float acc = 0;
  for (int s = 0; s < steps; ++s) {
    ::emu::cp_async_wait(0);
    if (!barrier_first && s + 1 < steps) load(s + 1);
    __syncthreads();  // step s is in; every warp is done with step s - 1
    if (barrier_first && s + 1 < steps) load(s + 1);
    acc += stage[s % 2][63 - t];  // another warp's element
  }
  out[t] = acc;
}
// Two groups copying to the same bytes: after wait_group 1 the first has
// landed but the second is in flight, so the bytes are undefined (NaN);
// after wait_group 0, the second's.
__global__ void async_overlap(const float* in, float* out) {
  extern __shared__ float x[];
  ::emu::cp_async(x, in, 16, true, EMU_SITE);
  ::emu::cp_async_commit();
  ::emu::cp_async(x, in + 4, 16, true, EMU_SITE);
  ::emu::cp_async_commit();
  ::emu::cp_async_wait(1);
  for (int k = 0; k < 4; ++k) out[k] = x[k];
  ::emu::cp_async_wait(0);
  for (int k = 0; k < 4; ++k) out[4 + k] = x[k];
}
// what: 0 a misaligned shared address, 1 a misaligned global one, 2 a zero
// fill from an address outside the device's memory.
__global__ void async_misused(const float* in, int what) {
  extern __shared__ float tile[];
  if (what == 0) ::emu::cp_async(tile + 1, in, 16, true, EMU_SITE);
  if (what == 1) ::emu::cp_async(tile, in + 1, 16, true, EMU_SITE);
  if (what == 2) ::emu::cp_async(tile, in + 64, 16, false, EMU_SITE);
}
// Per-block tree sum in shared memory, plus which OS thread ran the block.
__global__ void block_sums(const float* in, float* sums, size_t* os_thread) {
  __shared__ float s[128];
  const int t = threadIdx.x;
  s[t] = in[blockIdx.x * 128 + t];
  __syncthreads();
  for (int w = 64; w > 0; w /= 2) {
    if (t < w) s[t] += s[t + w];
    __syncthreads();
  }
  if (t == 0) {
    sums[blockIdx.x] = s[0];
    os_thread[blockIdx.x] = std::hash<std::thread::id>()(std::this_thread::get_id());
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // lets the other workers take blocks
  }
}
__device__ int recurse(int d) {
  volatile char pad[1024];
  pad[0] = static_cast<char>(d);
  return d > 1000000 ? pad[0] : recurse(d + 1) + pad[0];
}
__global__ void overflow_stack(int* out) { out[0] = recurse(0); }
#if defined(__SANITIZE_ADDRESS__)
__global__ void write_past_end(int* p, int n) { p[n + threadIdx.x] = 1; }
// Locals with redzones around them, on stacks earlier fibers left.
__global__ void stack_locals(int* out, int n) {
  volatile int a[8];
  for (int i = 0; i < 8; ++i) a[i] = i + n;
  out[threadIdx.x] = a[(n + threadIdx.x) % 8];
}
__global__ void stack_past_end(int* out, int n) {
  volatile int a[8] = {};
  a[n] = 1;
  out[0] = a[0];
}
#endif

// ---- Helpers ----
class Emu : public ::testing::Test {
 protected:
  // The worker pool's threads make fork-based death tests unsafe.
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
  void TearDown() override {
    for (void* p : dev_) cudaFree(p);
  }
  template <typename T>
  T* dev(size_t n) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, 0, n * sizeof(T)), cudaSuccess);
    dev_.push_back(p);
    return static_cast<T*>(p);
  }
  // Device memory is host memory here: a test may look without a copy (and
  // without the synchronisation a copy would imply).
  static std::vector<int> peek(const int* p, int n) { return std::vector<int>(p, p + n); }
  static std::vector<int> iota(int n, int v) {
    std::vector<int> r(n);
    for (int i = 0; i < n; ++i) r[i] = v + i;
    return r;
  }
  std::vector<void*> dev_;
};

// ---- The launch record (tools/emu_coverage.py reads it) ----
// Under bazel test: after launches of `fill` (once rejected, so not
// counted), this process's record names it with its count, this file, and
// an object and offset that nm resolves to `fill` itself, as the checker's
// --instances reads them.
TEST_F(Emu, LaunchRecordNamesTheKernelWhereNmFindsIt) {
  const char* dir = std::getenv("TEST_UNDECLARED_OUTPUTS_DIR");
  if (!dir || !*dir) GTEST_SKIP() << "TEST_UNDECLARED_OUTPUTS_DIR is not set (not under bazel test)";
  int* out = dev<int>(4);
  for (int i = 0; i < 3; ++i) fill<<<1, 4>>>(out, 4, i);
  fill<<<1, 2048>>>(out, 4, 0);
  ASSERT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  cudaDeviceSynchronize();
  ember_emu_write_launches();
  const std::string path = std::string(dir) + "/emu_launches." + std::to_string(getpid()) + ".txt";
  FILE* f = std::fopen(path.c_str(), "r");
  ASSERT_NE(f, nullptr) << path;
  std::string line, found;
  for (int c; (c = std::fgetc(f)) != EOF;) {
    if (c != '\n') {
      line += static_cast<char>(c);
      continue;
    }
    if (line.size() >= 5 && line.compare(line.size() - 5, 5, "\tfill") == 0) found = line;
    line.clear();
  }
  std::fclose(f);
  ASSERT_FALSE(found.empty()) << "no line for fill in " << path;
  // count, file, object+offset, name
  const size_t t1 = found.find('\t'), t2 = found.find('\t', t1 + 1), t3 = found.find('\t', t2 + 1);
  ASSERT_NE(t3, std::string::npos) << found;
  EXPECT_GE(std::stoll(found.substr(0, t1)), 3) << found;  // this test's 3 and the file's other tests'
  EXPECT_EQ(found.substr(t1 + 1, t2 - t1 - 1), "third_party/cuda_emu/emu_selftest.cu") << found;
  const std::string where = found.substr(t2 + 1, t3 - t2 - 1);
  const size_t plus = where.rfind('+');
  ASSERT_NE(plus, std::string::npos) << found;
  const unsigned long long offset = std::stoull(where.substr(plus + 1), nullptr, 16);
  const std::string nm = "nm -C --defined-only '" + where.substr(0, plus) + "'";
  FILE* p = popen(nm.c_str(), "r");
  ASSERT_NE(p, nullptr) << nm;
  char buf[4096];
  std::string at_offset;
  while (std::fgets(buf, sizeof(buf), p)) {
    unsigned long long a = 0;
    char kind = 0;
    int used = 0;
    if (std::sscanf(buf, "%llx %c %n", &a, &kind, &used) >= 2 && a == offset && (kind == 't' || kind == 'T'))
      at_offset = buf + used;
  }
  pclose(p);
  EXPECT_NE(at_offset.find("fill(int*, int, int)"), std::string::npos)
      << "nm names '" << at_offset << "' at " << where << ", not fill";
}

// ---- Misuse the emulator must report ----
TEST_F(Emu, OversizedBlockIsInvalidConfiguration) {
  int* out = dev<int>(1);
  fill<<<1, 2048>>>(out, 1, 5);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  fill<<<1, dim3(32, 64)>>>(out, 1, 5);  // each dimension within its limit, 2048 threads in all
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  fill<<<dim3(1, 70000), 32>>>(out, 1, 5);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  cudaDeviceSynchronize();
  EXPECT_EQ(out[0], 0) << "a rejected launch must not run";
  fill<<<1, 1024>>>(out, 1, 5);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST_F(Emu, DivergentSyncthreadsDies) {
  int* out = dev<int>(32);
  EXPECT_DEATH(
      {
        divergent_barrier<<<1, 32>>>(out);
        cudaDeviceSynchronize();
      },
      "divergent_barrier: divergent __syncthreads: .* at .*emu_selftest.cu:[0-9]+, other threads at "
      ".*emu_selftest.cu:[0-9]+");
}

TEST_F(Emu, ShuffleOutsideMaskDies) {
  int* out = dev<int>(32);
  EXPECT_DEATH(
      {
        shuffle_outside_mask<<<1, 32>>>(out);
        cudaDeviceSynchronize();
      },
      "shuffle at .*emu_selftest.cu:[0-9]+ reads lane 20 outside its mask");
}

TEST_F(Emu, WarpGatherGivesEveryLanesBytesAndDiesOnDivergence) {
  int* out = dev<int>(64);
  gather_rounds<<<1, 64>>>(out);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(peek(out, 64), std::vector<int>(64, 3 * 33));
  EXPECT_DEATH(
      {
        divergent_gather<<<1, 32>>>(out);
        cudaDeviceSynchronize();
      },
      "divergent_gather: warp gather at .*emu_selftest.cu:[0-9]+: .*divergent: other lanes wait at "
      ".*emu_selftest.cu:[0-9]+");
}

TEST_F(Emu, HostPointerPassedToKernelDies) {
  int host[4];
  EXPECT_DEATH(fill<<<1, 4>>>(host, 4, 0), "fill: pointer argument 0 is not device memory");
}

TEST_F(Emu, MemcpyDirectionMismatchIsInvalidValue) {
  int* d = dev<int>(4);
  int h[4] = {};
  EXPECT_EQ(cudaMemcpy(h, d, sizeof h, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(d, h, sizeof h, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(d, h, sizeof h + 4, cudaMemcpyHostToDevice), cudaErrorInvalidValue) << "past the allocation";
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(d, h, sizeof h, cudaMemcpyHostToDevice), cudaSuccess);
}

TEST_F(Emu, MissingSyncthreadsShowsUnderReverseOrder) {
  const emu::Order prev = emu::set_order(emu::Order::kForward);
  int* out = dev<int>(64);
  const std::vector<int> want = iota(64, 0);
  for (emu::Order o : {emu::Order::kForward, emu::Order::kReverse, emu::Order::kShuffle}) {
    emu::set_order(o);
    neighbour<<<1, 64>>>(out, true);
    cudaDeviceSynchronize();
    EXPECT_EQ(peek(out, 64), want) << "with the barrier, order " << int(o);
  }
  emu::set_order(emu::Order::kForward);  // each thread runs to the end before the next: the race hides
  neighbour<<<1, 64>>>(out, false);
  cudaDeviceSynchronize();
  EXPECT_EQ(peek(out, 64), want);
  emu::set_order(emu::Order::kReverse);
  neighbour<<<1, 64>>>(out, false);
  cudaDeviceSynchronize();
  EXPECT_NE(peek(out, 64), want) << "reverse order must expose the missing __syncthreads";
  emu::set_order(prev);
}

// ---- Deferred stream semantics ----
TEST_F(Emu, KernelRunsAtSynchronisationNotAtLaunch) {
  int* out = dev<int>(64);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  fill<<<2, 32, 0, s>>>(out, 64, 1);
  EXPECT_EQ(peek(out, 64), std::vector<int>(64, 0)) << "the launch ran before any synchronisation";
  cudaStreamSynchronize(s);
  EXPECT_EQ(peek(out, 64), iota(64, 1));
  cudaStreamDestroy(s);
}

TEST_F(Emu, SecondStreamNeedsAnEventToSeeTheFirst) {
  int* buf = dev<int>(64);
  int* out = dev<int>(64);
  cudaStream_t s1, s2;
  cudaStreamCreate(&s1);
  cudaStreamCreate(&s2);
  // Without a wait, s2 may run first: here it does.
  fill<<<2, 32, 0, s1>>>(buf, 64, 1);
  copy<<<2, 32, 0, s2>>>(buf, out, 64);
  cudaStreamSynchronize(s2);
  EXPECT_EQ(peek(out, 64), std::vector<int>(64, 0)) << "s2 saw s1's write without waiting for it";
  cudaStreamSynchronize(s1);
  // With the event, s2 runs s1 up to the record first.
  cudaEvent_t e;
  cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  fill<<<2, 32, 0, s1>>>(buf, 64, 100);
  cudaEventRecord(e, s1);
  fill<<<2, 32, 0, s1>>>(buf, 64, 200);  // after the record: s2 must not see it
  cudaStreamWaitEvent(s2, e, 0);
  cudaEventDestroy(e);  // the queued wait keeps its record
  copy<<<2, 32, 0, s2>>>(buf, out, 64);
  cudaStreamSynchronize(s2);
  EXPECT_EQ(peek(out, 64), iota(64, 100));
  EXPECT_EQ(peek(buf, 64), iota(64, 100)) << "s1's work after the record ran too early";
  cudaStreamDestroy(s1);  // runs its pending work
  EXPECT_EQ(peek(buf, 64), iota(64, 200));
  cudaStreamDestroy(s2);
}

TEST_F(Emu, LegacyDefaultStreamSyncsWithBlockingStreamsOnly) {
  int* buf = dev<int>(32);
  int* out = dev<int>(32);
  cudaStream_t blocking, nonblocking;
  cudaStreamCreate(&blocking);
  cudaStreamCreateWithFlags(&nonblocking, cudaStreamNonBlocking);
  fill<<<1, 32, 0, blocking>>>(buf, 32, 1);
  copy<<<1, 32>>>(buf, out, 32);
  cudaStreamSynchronize(nullptr);
  EXPECT_EQ(peek(out, 32), iota(32, 1)) << "the default stream did not wait for a blocking stream";

  fill<<<1, 32>>>(buf, 32, 50);
  copy<<<1, 32, 0, blocking>>>(buf, out, 32);
  cudaStreamSynchronize(blocking);
  EXPECT_EQ(peek(out, 32), iota(32, 50)) << "a blocking stream did not wait for the default stream";

  fill<<<1, 32, 0, nonblocking>>>(buf, 32, 70);
  copy<<<1, 32>>>(buf, out, 32);
  cudaStreamSynchronize(nullptr);
  EXPECT_EQ(peek(out, 32), iota(32, 50)) << "the default stream waited for a non-blocking stream";
  cudaStreamDestroy(blocking);
  cudaStreamDestroy(nonblocking);
}

TEST_F(Emu, SynchronousCallsAndFreeRunQueuedWork) {
  int* buf = dev<int>(32);
  std::vector<int> h(32);
  fill<<<1, 32>>>(buf, 32, 3);
  ASSERT_EQ(cudaMemcpy(h.data(), buf, 32 * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(h, iota(32, 3));

  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  fill<<<1, 32, 0, s>>>(buf, 32, 9);
  int* other = nullptr;
  cudaMalloc(reinterpret_cast<void**>(&other), 4);
  cudaFree(other);  // synchronizes the device, as CUDA's does
  EXPECT_EQ(peek(buf, 32), iota(32, 9));
  cudaStreamDestroy(s);
}

TEST_F(Emu, AsyncCopyAndMemsetAreDeferred) {
  int* d = dev<int>(32);
  int* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&pinned), 32 * sizeof(int), cudaHostAllocDefault), cudaSuccess);
  std::fill(pinned, pinned + 32, -5);
  cudaStream_t s;
  cudaStreamCreate(&s);
  fill<<<1, 32, 0, s>>>(d, 32, 4);
  cudaMemcpyAsync(pinned, d, 32 * sizeof(int), cudaMemcpyDeviceToHost, s);
  EXPECT_EQ(pinned[0], -5) << "the copy landed before a synchronisation";
  cudaStreamSynchronize(s);
  EXPECT_EQ(std::vector<int>(pinned, pinned + 32), iota(32, 4));
  cudaMemsetAsync(d, 0, 32 * sizeof(int), s);
  EXPECT_EQ(d[0], 4);
  cudaStreamSynchronize(s);
  EXPECT_EQ(d[0], 0);
  cudaStreamDestroy(s);
  cudaFreeHost(pinned);
}

TEST_F(Emu, ParametersAreCopiedAtLaunch) {
  int* out = dev<int>(4);
  Coeffs c{{1, 2, 3, 4}};
  fill_struct<<<1, 4>>>(out, c);
  c.v[0] = 99;
  cudaDeviceSynchronize();
  EXPECT_EQ(peek(out, 4), (std::vector<int>{1, 2, 3, 4}));
}

TEST_F(Emu, EventQueryRunsNothingButEndsAPollingLoop) {
  int* out = dev<int>(32);
  cudaStream_t s;
  cudaEvent_t e;
  cudaStreamCreate(&s);
  cudaEventCreate(&e);
  EXPECT_EQ(cudaEventQuery(e), cudaSuccess) << "never recorded";
  fill<<<1, 32, 0, s>>>(out, 32, 1);
  cudaEventRecord(e, s);
  int polls = 1;
  for (; cudaEventQuery(e) == cudaErrorNotReady; ++polls) EXPECT_EQ(out[0], 0) << "a query ran the kernel";
  EXPECT_GT(polls, 8);
  EXPECT_LT(polls, 1000);
  EXPECT_EQ(out[0], 1);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "not-ready is not an error";
  fill<<<1, 32, 0, s>>>(out, 32, 2);
  cudaEventRecord(e, s);
  cudaEventSynchronize(e);
  EXPECT_EQ(out[0], 2);
  cudaEventDestroy(e);
  cudaStreamDestroy(s);
}

TEST_F(Emu, HostFunctionRunsInStreamOrder) {
  int* out = dev<int>(32);
  cudaStream_t s;
  cudaStreamCreate(&s);
  struct Seen {
    int* out;
    int value = -1;
  } seen{out};
  fill<<<1, 32, 0, s>>>(out, 32, 8);
  cudaLaunchHostFunc(s, [](void* p) { static_cast<Seen*>(p)->value = static_cast<Seen*>(p)->out[0]; }, &seen);
  EXPECT_EQ(seen.value, -1);
  cudaStreamSynchronize(s);
  EXPECT_EQ(seen.value, 8);
  cudaStreamDestroy(s);
  EXPECT_DEATH(
      {
        cudaLaunchHostFunc(nullptr, [](void*) { cudaDeviceSynchronize(); }, nullptr);
        cudaStreamSynchronize(nullptr);
      },
      "cudaDeviceSynchronize called from queued work \\(cudaLaunchHostFunc\\)");
}

TEST_F(Emu, CublasGemmRunsOnItsHandlesStream) {
  // C (2x2) = A (2x3) * B (3x2), column-major.
  float* a = dev<float>(6);
  float* b = dev<float>(6);
  float* c = dev<float>(4);
  for (int i = 0; i < 6; ++i) a[i] = float(i + 1), b[i] = float(i % 2);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cublasHandle_t h;
  cublasCreate(&h);
  cublasSetStream(h, s);
  const float one = 1, zero = 0;
  ASSERT_EQ(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 3, &one, a, CUDA_R_32F, 2, 0, b, CUDA_R_32F, 3,
                                       0, &zero, c, CUDA_R_32F, 2, 0, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  cudaStreamSynchronize(nullptr);
  EXPECT_EQ(c[0], 0.0f) << "ran on the default stream, not the handle's non-blocking one";
  cudaStreamSynchronize(s);
  // b = [[0,1],[0,1],[0,1]] per column: col0 = (0,1,0), col1 = (1,0,1).
  EXPECT_EQ(std::vector<float>(c, c + 4), (std::vector<float>{3, 4, 6, 8}));
  // A second batch entry of A would start past its allocation.
  EXPECT_DEATH(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 3, &one, a, CUDA_R_32F, 2, 6, b,
                                          CUDA_R_32F, 3, 0, &zero, c, CUDA_R_32F, 2, 0, 2, CUBLAS_COMPUTE_32F,
                                          CUBLAS_GEMM_DEFAULT),
               "cublasGemmStridedBatchedEx: .* not inside one device allocation");
  cublasDestroy(h);
  cudaStreamDestroy(s);
}

// ---- Poison: uninitialised memory must not read as plausible values ----
TEST_F(Emu, NewDeviceMemoryIsPoisoned) {
  int* p = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), 8 * sizeof(int)), cudaSuccess);
  EXPECT_EQ(peek(p, 8), std::vector<int>(8, -1));
  cudaFree(p);
}

TEST_F(Emu, SharedMemoryIsPoisonedPerBlock) {
  float* f = dev<float>(3 * 32);
  int* i = dev<int>(3);
  for (int launch = 0; launch < 2; ++launch) {  // the second launch follows blocks that wrote it
    read_shared_first<<<3, 32>>>(f, i);
    cudaDeviceSynchronize();
    for (int k = 0; k < 3 * 32; ++k) EXPECT_TRUE(std::isnan(f[k])) << "launch " << launch << " element " << k;
    EXPECT_EQ(peek(i, 3), std::vector<int>(3, -1)) << "launch " << launch;
  }
}

TEST_F(Emu, DynamicSharedMemoryIsPerBlockAndPoisoned) {
  const int n = 64, blocks = 3;
  float* in = dev<float>(n * blocks);
  float* out = dev<float>(n * blocks);
  float* before = dev<float>(n * blocks);
  for (int k = 0; k < n * blocks; ++k) in[k] = float(k);
  reverse_dynamic<<<blocks, n, n * sizeof(float)>>>(in, out, before);
  cudaDeviceSynchronize();
  for (int b = 0; b < blocks; ++b)
    for (int t = 0; t < n; ++t) {
      EXPECT_EQ(out[b * n + t], float(b * n + n - 1 - t));
      EXPECT_TRUE(std::isnan(before[b * n + t]));
    }
  reverse_dynamic<<<1, n, 64 * 1024>>>(in, out, before);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue) << "over the 48 KiB default limit";
}

TEST_F(Emu, AsyncCopiesLandAtTheirThreadsWait) {
  float* in = dev<float>(32 * 8);
  float* out = dev<float>(32 * 12);
  for (int k = 0; k < 32 * 8; ++k) in[k] = float(k + 1);
  // What thread t sees of its own row [f0, f1, f2, f3, 0, f5] after each wait.
  for (int n : {-1, 3, 2, 1, 0}) {  // 3: more than the groups committed, nothing to wait for
    async_rows<<<1, 32, 32 * 8 * sizeof(float)>>>(in, out, n);
    cudaDeviceSynchronize();
    for (int t = 0; t < 32; ++t) {
      const float* row = in + t * 8;
      for (int k = 0; k < 6; ++k) {
        const float seen = out[t * 12 + k];
        const bool landed = k < 2 ? n >= 0 && n <= 1 : k < 5 ? n == 0 : false;
        if (!landed)
          EXPECT_TRUE(std::isnan(seen)) << "wait_group " << n << " thread " << t << " float " << k;
        else
          EXPECT_EQ(seen, k == 4 ? 0.0f : row[k]) << "wait_group " << n << " thread " << t << " float " << k;
      }
      // After wait_group 0 and the barrier: the neighbour's committed copies,
      // not its uncommitted one.
      const float* next = in + (t + 1) % 32 * 8;
      for (int k = 0; k < 5; ++k) EXPECT_EQ(out[t * 12 + 6 + k], k == 4 ? 0.0f : next[k]) << t << " " << k;
      EXPECT_TRUE(std::isnan(out[t * 12 + 11])) << t;
    }
  }
}

TEST_F(Emu, AsyncCopyOverAStageStillReadShows) {
  const int steps = 5;
  float* in = dev<float>(steps * 64);
  float* out = dev<float>(64);
  for (int k = 0; k < steps * 64; ++k) in[k] = float(k % 7);
  async_stages<<<1, 64>>>(in, out, steps, true);
  cudaDeviceSynchronize();
  for (int t = 0; t < 64; ++t) {
    float want = 0;
    for (int s = 0; s < steps; ++s) want += in[s * 64 + 63 - t];
    EXPECT_EQ(out[t], want) << t;
  }
  // The load before the barrier: warp 0 reaches step s + 1's load before
  // warp 1 has read step s - 1's stage.
  async_stages<<<1, 64>>>(in, out, steps, false);
  cudaDeviceSynchronize();
  int poisoned = 0;
  for (int t = 0; t < 64; ++t) poisoned += std::isnan(out[t]);
  EXPECT_GT(poisoned, 0);
}

TEST_F(Emu, AsyncCopyInFlightOverALandedOneLeavesItsBytesUndefined) {
  float* in = dev<float>(8);
  float* out = dev<float>(8);
  for (int k = 0; k < 8; ++k) in[k] = float(k + 1);
  async_overlap<<<1, 1, 16>>>(in, out);
  cudaDeviceSynchronize();
  for (int k = 0; k < 4; ++k) {
    EXPECT_TRUE(std::isnan(out[k])) << k;
    EXPECT_EQ(out[4 + k], float(k + 5)) << k;
  }
}

TEST_F(Emu, MisusedAsyncCopyDies) {
  float* in = dev<float>(64);
  const char* at =
      "async_misused: cp.async of 16 bytes at .*emu_selftest.cu:[0-9]+: block \\(0,0,0\\) thread \\(0,0,0\\): ";
  EXPECT_DEATH(
      {
        async_misused<<<1, 1, 32>>>(in, 0);
        cudaDeviceSynchronize();
      },
      std::string(at) + "shared address not aligned to 16 bytes");
  EXPECT_DEATH(
      {
        async_misused<<<1, 1, 32>>>(in, 1);
        cudaDeviceSynchronize();
      },
      std::string(at) + "global address not aligned to 16 bytes");
  EXPECT_DEATH(
      {
        async_misused<<<1, 1, 32>>>(in, 2);
        cudaDeviceSynchronize();
      },
      "async_misused: cp.async's zero fill at .*emu_selftest.cu:[0-9]+: source: 16 bytes at .* are not inside one "
      "device allocation");
}

// ---- Worker pool ----
TEST_F(Emu, PoolGivesTheSameResultsOnSeveralThreads) {
  const int blocks = 64;
  float* in = dev<float>(blocks * 128);
  for (int k = 0; k < blocks * 128; ++k) in[k] = 1.0f / float(k + 1);
  std::vector<std::vector<float>> results;
  std::set<size_t> threads_used;
  const emu::Order prev_order = emu::set_order(emu::Order::kForward);
  for (int threads : {1, 4}) {
    for (emu::Order o : {emu::Order::kForward, emu::Order::kShuffle}) {
      const int prev = emu::set_threads(threads);
      emu::set_order(o);
      float* sums = dev<float>(blocks);
      size_t* who = dev<size_t>(blocks);
      block_sums<<<blocks, 128>>>(in, sums, who);
      cudaDeviceSynchronize();
      emu::set_threads(prev);
      results.emplace_back(sums, sums + blocks);
      if (threads == 4) threads_used.insert(who, who + blocks);
    }
  }
  emu::set_order(prev_order);
  for (size_t r = 1; r < results.size(); ++r) EXPECT_EQ(results[r], results[0]) << "run " << r;
  EXPECT_GT(threads_used.size(), 1u) << "EMU_THREADS=4 ran every block on one OS thread";
}

// ---- Memory errors ----
TEST_F(Emu, StackOverflowIsReported) {
  int* out = dev<int>(1);
#if defined(__SANITIZE_ADDRESS__)
  const char* expected = "stack-overflow";
#else
  const char* expected = "overflow_stack: fiber stack overflow \\(EMU_STACK_KB=[0-9]+ is too small\\) in block";
#endif
  EXPECT_DEATH(
      {
        overflow_stack<<<1, 1>>>(out);
        cudaDeviceSynchronize();
      },
      expected);
}

#if defined(__SANITIZE_ADDRESS__)
TEST_F(Emu, OutOfBoundsAccessIsCaughtByAsan) {
  int* p = dev<int>(10);
  EXPECT_DEATH(
      {
        write_past_end<<<1, 1>>>(p, 10);
        cudaDeviceSynchronize();
      },
      "heap-buffer-overflow.*write_past_end.*emu_selftest.cu:[0-9]+.*"
      "\\[cuda-emu\\] in kernel write_past_end, block \\(0,0,0\\) thread \\(0,0,0\\)");
}

// A fiber stack's shadow is cleared only where its last fiber's frames
// were still live (init_fiber): reused stacks give no false report, and an
// overflow of a local on one is still caught.
TEST_F(Emu, StackOutOfBoundsIsCaughtByAsanOnAReusedStack) {
  int* out = dev<int>(64);
  for (int n = 0; n < 3; ++n) stack_locals<<<2, 64>>>(out, n);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<int> host(64);
  cudaMemcpy(host.data(), out, 64 * sizeof(int), cudaMemcpyDeviceToHost);
  for (int t = 0; t < 64; ++t) EXPECT_EQ(host[t], (2 + t) % 8 + 2) << t;
  EXPECT_DEATH(
      {
        stack_locals<<<1, 64>>>(out, 0);
        stack_past_end<<<1, 1>>>(out, 8);
        cudaDeviceSynchronize();
      },
      "stack-buffer-overflow.*stack_past_end.*emu_selftest.cu:[0-9]+");
}
#endif

TEST_F(Emu, LaunchStatsCountKernels) {
  int* out = dev<int>(1);
  const emu::LaunchStats before = emu::launch_stats();
  fill<<<1, 1>>>(out, 1, 0);
  const emu::LaunchStats after = emu::launch_stats();
  EXPECT_EQ(after.launches, before.launches + 1);
  EXPECT_TRUE(std::count(after.kernels.begin(), after.kernels.end(), "fill"));
  std::printf("[cuda-emu] so far: %llu launches of %zu kernels\n", static_cast<unsigned long long>(after.launches),
              after.kernels.size());
}

}  // namespace
