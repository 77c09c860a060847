// The Gloo process group across real processes: the test binary re-runs
// itself as 1-4 workers on localhost (distributed/testing/multiprocess.h).
// Each worker checks every collective against values it computes alone:
// rank r contributes val(r, i), so any rank knows what every other rank
// sent. Then the failure modes: a peer that dies mid-allreduce, a peer that
// never shows up, ranks calling different collectives. Argument errors are
// checked in-process on a group of one.
#include "distributed/comm/process_group.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>

#include "core/ops.h"
#include "core/testing/error_of.h"
#include "distributed/comm/backends.h"
#include "distributed/init.h"
#include "distributed/store/store.h"
#include "distributed/testing/collective_checks.h"
#include "distributed/testing/multiprocess.h"

namespace ember::distributed {
namespace {

namespace mp = ::ember::distributed::testing;
using Clock = std::chrono::steady_clock;
using Fn = std::function<double(int64_t)>;

using testing::a2a;
using testing::check_collectives;
using testing::expect_values;
using testing::Fn;
using testing::make;
using testing::pval;
using testing::val;

std::shared_ptr<ProcessGroup> group(const mp::WorkerEnv& env, Millis timeout = std::chrono::seconds(60),
                                    bool check_signatures = true) {
  ProcessGroupOptions o;
  o.timeout = timeout;
  o.check_signatures = check_signatures;
  return make_gloo_group(env.store(), env.rank, env.world_size, o);
}

using ::ember::testing::error_of;

bool has(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

// ---------------------------------------------------------------------------
// Every collective, dtype and size (check_collectives).

EMBER_WORKER(collectives) {
  auto pg = group(env);
  for (DType dt :
       {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16, DType::Int32, DType::Int64, DType::UInt8}) {
    for (int64_t n : {0, 1, 1001}) check_collectives(*pg, dt, n);
  }
  // Several MiB: Gloo splits these into many segments.
  const int64_t big = (1 << 20) + 3;  // 4 MiB of float32, odd
  check_collectives(*pg, DType::Float32, big);

  // bool: sum/max are "any", min/product "all".
  const int r = pg->rank(), ws = pg->size();
  auto b = [](int q, int64_t i) { return static_cast<double>((i + q) % 2 == 0); };
  for (ReduceOp op : {ReduceOp::Max, ReduceOp::Min}) {
    const bool any = op == ReduceOp::Max;
    Tensor t = make({33}, DType::Bool, [&](int64_t i) { return b(r, i); });
    pg->allreduce(t, op)->wait();
    expect_values(
        t,
        [&](int64_t i) {
          double v = any ? 0 : 1;
          for (int q = 0; q < ws; ++q) v = any ? std::max(v, b(q, i)) : std::min(v, b(q, i));
          return v;
        },
        std::string("allreduce ") + reduce_op_name(op) + " bool");
  }
  Tensor t = make({33}, DType::Bool, [&](int64_t i) { return b(r, i); });
  pg->broadcast(t, ws - 1)->wait();
  expect_values(
      t, [&](int64_t i) { return b(ws - 1, i); }, "broadcast bool");
  // The counters: calls and the bytes of the whole tensor each op is about.
  pg->reset_counters();
  Tensor f = zeros({6 * ws});
  pg->allreduce(f)->wait();
  pg->allreduce(zeros({2}, DType::Float64))->wait();
  pg->allgather_into_tensor(f, zeros({6}))->wait();
  pg->reduce_scatter_tensor(zeros({6}), f)->wait();
  const auto ar = pg->counter("allreduce"), ag = pg->counter("allgather"), rs = pg->counter("reduce_scatter");
  if (ar.calls != 2 || ar.bytes != 24 * ws + 16 || ag.calls != 1 || ag.bytes != 24 * ws || rs.calls != 1 ||
      rs.bytes != 24 * ws || pg->counter("all_to_all").calls != 0 || pg->counters().size() != 3)
    throw Error("counters: allreduce " + std::to_string(ar.calls) + "/" + std::to_string(ar.bytes) + ", allgather " +
                std::to_string(ag.calls) + "/" + std::to_string(ag.bytes) + ", reduce_scatter " +
                std::to_string(rs.calls) + "/" + std::to_string(rs.bytes));
  pg.reset();
  std::printf("rank %d: all collectives matched\n", r);
}

// ---------------------------------------------------------------------------
// Non-contiguous tensors go through a dense copy and back.

EMBER_WORKER(noncontiguous) {
  auto pg = group(env);
  const int r = pg->rank(), ws = pg->size();
  auto sum = [&](int64_t i) {
    double s = 0;
    for (int q = 0; q < ws; ++q) s += val(q, i);
    return s;
  };
  for (DType dt : {DType::Float32, DType::Int64, DType::Float16}) {
    // A transposed view: logical [5, 7] over [7, 5] storage.
    Tensor x = Tensor::empty({7, 5}, dt).t();
    x.copy_(make({5, 7}, dt, [&](int64_t i) { return val(r, i); }));
    WCHECK(!x.is_contiguous(), "setup");
    pg->allreduce(x, ReduceOp::Sum)->wait();
    expect_values(x, sum, "allreduce of a transposed view");

    // Every other element of a buffer; the gaps must survive.
    Tensor base = full({2 * 9}, -5.0, dt);
    Tensor s = base.slice(0, 0, 18, 2);
    s.copy_(make({9}, dt, [&](int64_t i) { return val(r, i); }));
    pg->broadcast(s, 0)->wait();
    expect_values(
        s, [&](int64_t i) { return val(0, i); }, "broadcast into a strided slice");
    expect_values(
        base.slice(0, 1, 18, 2), [](int64_t) { return -5.0; }, "broadcast leaves the gaps alone");

    // allgather: strided input, transposed outputs.
    Tensor in = full({2 * 6}, 0.0, dt).slice(0, 0, 12, 2);
    in.copy_(make({6}, dt, [&](int64_t i) { return val(r, i); }));
    std::vector<Tensor> touts;
    for (int q = 0; q < ws; ++q) touts.push_back(Tensor::empty({3, 2}, dt).t());  // [2, 3], non-contiguous
    pg->allgather(touts, in)->wait();
    for (int q = 0; q < ws; ++q)
      expect_values(
          touts[q], [&](int64_t i) { return val(q, i); }, "allgather into transposed outputs");

    // allgather_into_tensor: the output is a transposed [ws, 6] view.
    Tensor flat = Tensor::empty({6, ws}, dt).t();
    pg->allgather_into_tensor(flat, in)->wait();
    expect_values(
        flat, [&](int64_t j) { return val(static_cast<int>(j / 6), j % 6); },
        "allgather_into_tensor into a transposed output");

    // In place: the input is this rank's block of the output.
    Tensor whole = full({ws * 6}, -1.0, dt);
    Tensor mine = whole.narrow(0, r * 6, 6);
    mine.copy_(make({6}, dt, [&](int64_t i) { return val(r, i); }));
    pg->allgather_into_tensor(whole, mine)->wait();
    expect_values(
        whole, [&](int64_t j) { return val(static_cast<int>(j / 6), j % 6); }, "allgather_into_tensor in place");

    // reduce_scatter: transposed input and output.
    Tensor rin = Tensor::empty({4, ws}, dt).t();  // logical [ws, 4]
    rin.copy_(make({ws, 4}, dt, [&](int64_t j) { return val(r, j); }));
    Tensor rout = Tensor::empty({2, 2}, dt).t();
    pg->reduce_scatter_tensor(rout, rin, ReduceOp::Sum)->wait();
    expect_values(
        rout, [&](int64_t i) { return sum(r * 4 + i); }, "reduce_scatter_tensor, transposed");

    // all_to_all: strided input, transposed output.
    Tensor a_in = full({2 * ws * 2}, 0.0, dt).slice(0, 0, 4 * ws, 2);
    a_in.copy_(make({ws * 2}, dt, [&](int64_t j) { return a2a(r, static_cast<int>(j / 2), j % 2); }));
    Tensor a_out = Tensor::empty({2, ws}, dt).t();
    pg->all_to_all_single(a_out, a_in)->wait();
    expect_values(
        a_out, [&](int64_t j) { return a2a(static_cast<int>(j / 2), r, j % 2); }, "all_to_all_single, strided");

    if (ws > 1) {
      // recv into a transposed view; send from one.
      Tensor src = Tensor::empty({3, 4}, dt).t();
      src.copy_(make({4, 3}, dt, [&](int64_t i) { return val(r, i); }));
      Tensor dst = Tensor::empty({3, 4}, dt).t();
      auto s_w = pg->send(src, (r + 1) % ws, 5);
      auto r_w = pg->recv(dst, (r + ws - 1) % ws, 5);
      s_w->wait();
      r_w->wait();
      expect_values(
          dst, [&](int64_t i) { return val((r + ws - 1) % ws, i); }, "recv into a transposed view");
    }
  }
  pg.reset();
}

// ---------------------------------------------------------------------------
// Point-to-point: a ring, tag matching, and p2p interleaved with collectives.

EMBER_WORKER(p2p) {
  auto pg = group(env);
  const int r = pg->rank(), ws = pg->size();
  const int next = (r + 1) % ws, prev = (r + ws - 1) % ws;
  for (DType dt : {DType::Float32, DType::Float16, DType::Int64, DType::UInt8}) {
    for (int64_t n : {0, 1, 1001, 1 << 20}) {
      Tensor out = make({n}, dt, [&](int64_t i) { return val(r, i); });
      Tensor in = full({n}, -1.0, dt);
      // Both posted before either is waited for: every rank sends first.
      auto s = pg->send(out, next, 7);
      auto q = pg->recv(in, prev, 7);
      s->wait();
      q->wait();
      expect_values(
          in, [&](int64_t i) { return val(prev, i); }, "ring send/recv");
    }
  }
  // Tags: the receiver posts tag 2 before tag 1; each lands in its own tensor.
  if (ws >= 2 && r < 2) {
    const int peer = 1 - r;
    if (r == 0) {
      Tensor a = full({10}, 1.0), b = full({10}, 2.0);
      auto w1 = pg->send(a, peer, 1);
      auto w2 = pg->send(b, peer, 2);
      w1->wait();
      w2->wait();
    } else {
      Tensor a = zeros({10}), b = zeros({10});
      auto w2 = pg->recv(b, peer, 2);
      auto w1 = pg->recv(a, peer, 1);
      w2->wait();
      w1->wait();
      expect_values(
          a, [](int64_t) { return 1.0; }, "recv tag 1");
      expect_values(
          b, [](int64_t) { return 2.0; }, "recv tag 2");
    }
  }
  // A send queued before a collective and a recv queued after it.
  if (ws >= 2) {
    Tensor y = full({100}, 1.0);
    std::shared_ptr<Work> p;
    Tensor msg = full({50}, static_cast<double>(r));
    Tensor got = zeros({50});
    if (r == 0) p = pg->send(msg, 1, 9);
    auto c = pg->allreduce(y);
    if (r == 1) p = pg->recv(got, 0, 9);
    c->wait();
    if (p) p->wait();
    expect_values(
        y, [&](int64_t) { return static_cast<double>(ws); }, "allreduce between p2p ops");
    if (r == 1)
      expect_values(
          got, [](int64_t) { return 0.0; }, "recv after a collective");
  }
  pg->barrier()->wait();
  pg.reset();
}

// ---------------------------------------------------------------------------
// Work handles: wait(timeout), is_completed, queued ops in order, and a
// group destroyed with work still queued.

EMBER_WORKER(work_api) {
  auto pg = group(env);
  const int r = pg->rank();
  Tensor x = full({1000}, 1.0);
  if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  auto w = pg->allreduce(x);
  if (r == 0) {
    WCHECK(!w->wait(Millis{50}), "wait(50 ms) should time out while rank 1 sleeps");
    WCHECK(!w->is_completed(), "not completed yet");
    WCHECK(!w->is_success(), "not successful yet");
  }
  w->wait();
  WCHECK(w->is_completed() && w->is_success() && w->exception() == nullptr, "completed");
  WCHECK(w->wait(Millis{0}), "a finished work returns true at once");
  expect_values(
      x, [&](int64_t) { return 2.0; }, "allreduce after the wait");
  // synchronize() on CPU tensors: the host is the consumer, so it waits.
  Tensor s = full({1000}, 1.0);
  if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  auto sw = pg->allreduce(s);
  sw->synchronize();
  WCHECK(sw->is_completed(), "synchronize() on a CPU work returns once it completed");
  expect_values(
      s, [&](int64_t) { return 2.0; }, "allreduce after synchronize");

  // Many queued without waiting; they complete in call order.
  std::vector<Tensor> ts;
  std::vector<std::shared_ptr<Work>> ws;
  for (int k = 0; k < 8; ++k) {
    ts.push_back(full({257}, static_cast<double>(k)));
    ws.push_back(pg->allreduce(ts.back()));
  }
  ws.back()->wait();
  for (int k = 0; k < 8; ++k) {
    WCHECK(ws[k]->is_completed(), "op ", k, " completed before the last one");
    expect_values(
        ts[k], [&](int64_t) { return 2.0 * k; }, "queued allreduce " + std::to_string(k));
  }
  // Destroyed with work queued: the destructor drains the queue.
  Tensor last = full({1 << 16}, 3.0);
  auto lw = pg->allreduce(last);
  pg.reset();
  WCHECK(lw->is_completed() && lw->is_success(), "queued op finished before the group went away");
  expect_values(
      last, [](int64_t) { return 6.0; }, "allreduce finished by the destructor");
}

// ---------------------------------------------------------------------------
// Failures. Timeouts are short (1.5 s); every error must name the op, its
// sequence number and the timeout, and arrive within about the timeout.

constexpr Millis kShort{1500};

void expect_op_error(const std::string& msg, const char* op, int64_t seq) {
  std::printf("rank error: %s\n", msg.c_str());
  WCHECK(has(msg, op), "error names the op: ", msg);
  WCHECK(has(msg, "collective #" + std::to_string(seq)), "error names the sequence number: ", msg);
  WCHECK(has(msg, "timeout 1500 ms"), "error names the timeout: ", msg);
  WCHECK(has(msg, "gloo group"), "error names the group: ", msg);
}

// arg "check": signature checks on; otherwise raw Gloo.
EMBER_WORKER(peer_dies) {
  auto pg = group(env, kShort, env.arg == "check");
  const int r = pg->rank(), victim = pg->size() - 1;
  Tensor warm = full({10}, 1.0);
  pg->allreduce(warm)->wait();
  // 64 MiB: a 2-rank localhost allreduce of 16 MiB can finish within
  // milliseconds, so the victim leaves as soon as its own part has started.
  Tensor big = full({16 << 20}, 1.0);
  auto start = Clock::now();
  auto w = pg->allreduce(big);
  if (r == victim) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::fflush(stdout);
    _exit(42);
  }
  std::string msg = error_of([&] { w->wait(); });
  auto took = std::chrono::duration_cast<Millis>(Clock::now() - start);
  WCHECK(!msg.empty(), "allreduce with a dead peer must fail");
  expect_op_error(msg, "allreduce", 1);
  WCHECK(took < kShort + Millis{3000}, "failed after ", took.count(), " ms, more than the timeout and slack");
  WCHECK(w->is_completed() && !w->is_success() && w->exception() != nullptr, "work state after failure");
  // The group is unusable now, and says so at once.
  auto t1 = Clock::now();
  std::string again = error_of([&] { pg->barrier()->wait(); });
  WCHECK(has(again, "no longer be used") && has(again, "allreduce"),
         "later ops fail naming the first failure: ", again);
  WCHECK(Clock::now() - t1 < Millis{1000}, "later ops fail fast");
  pg.reset();
}

// The last rank aborts its group instead of joining the allreduce (live
// recovery's first step): the others fail at once, long before their
// timeout, though it is alive; its own later operations fail naming the
// abort.
EMBER_WORKER(peer_aborts) {
  auto pg = group(env, std::chrono::seconds(60), /*check_signatures=*/false);
  const int r = pg->rank(), victim = pg->size() - 1;
  Tensor warm = full({10}, 1.0);
  pg->allreduce(warm)->wait();
  if (r == victim) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    pg->abort();
    std::string after = error_of([&] { pg->barrier()->wait(); });
    WCHECK(has(after, "aborted"), "an aborted group's operations fail naming the abort: ", after);
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // alive while the others fail
    pg.reset();
    return;
  }
  Tensor x = full({1000}, 1.0);
  auto start = Clock::now();
  std::string msg = error_of([&] { pg->allreduce(x)->wait(); });
  auto took = std::chrono::duration_cast<Millis>(Clock::now() - start);
  WCHECK(has(msg, "allreduce (collective #1"), "allreduce with an aborted peer must fail naming it: ", msg);
  WCHECK(took < Millis{5000}, "failed after ", took.count(), " ms: not at once (the timeout is 60 s)");
  pg.reset();
}

// Live recovery makes and aborts a set of groups per recovery: an aborted
// group, destroyed, releases its threads and sockets (they are counted in
// /proc before and after 20 rounds of: the last rank aborts, the others'
// allreduce fails and they abort too, as abort_for_recovery does).
int count_entries(const char* dir) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) n += e.path().filename() != "." ? 1 : 0;
  return n;
}

EMBER_WORKER(abort_cycles) {
  const int threads_before = count_entries("/proc/self/task"), fds_before = count_entries("/proc/self/fd");
  for (int i = 0; i < 20; ++i) {
    ProcessGroupOptions o;
    o.timeout = std::chrono::seconds(60);
    o.check_signatures = false;
    auto pg = make_gloo_group(std::make_shared<PrefixStore>("cycle" + std::to_string(i), env.store()), env.rank,
                              env.world_size, o);
    Tensor x = full({100}, 1.0);
    pg->allreduce(x)->wait();
    if (pg->rank() == pg->size() - 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      pg->abort();
    } else {
      std::string msg = error_of([&] { pg->allreduce(x)->wait(); });
      WCHECK(!msg.empty(), "cycle ", i, ": the allreduce with an aborted peer must fail");
      pg->abort();
    }
    pg.reset();
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const int threads_after = count_entries("/proc/self/task"), fds_after = count_entries("/proc/self/fd");
  WCHECK(threads_after <= threads_before + 1, "threads: ", threads_before, " before 20 aborted groups, ", threads_after,
         " after (each group has 4-5: they must be joined, not left)");
  WCHECK(fds_after <= fds_before + 2, "file descriptors: ", fds_before, " before 20 aborted groups, ", fds_after,
         " after (each group's connections must be closed)");
  std::cout << "rank " << env.rank << ": threads " << threads_before << " -> " << threads_after << ", fds "
            << fds_before << " -> " << fds_after << " over 20 aborted groups\n";
}

TEST(GlooProcessGroup, AbortedGroupsReleaseTheirThreadsAndSockets) {
  EMBER_EXPECT_RANKS("abort_cycles", 3, {.deadline = std::chrono::seconds(60)});
}

// The victim never calls the collective (it sleeps past the timeout).
EMBER_WORKER(peer_hangs) {
  const bool check = env.arg == "check";
  auto pg = group(env, kShort, check);
  const int r = pg->rank(), victim = pg->size() - 1;
  Tensor warm = full({10}, 1.0);
  pg->allreduce(warm)->wait();
  if (r == victim) {
    std::this_thread::sleep_for(kShort * 2 + Millis{1000});
    std::fflush(stdout);
    _exit(43);
  }
  Tensor x = full({1000}, 1.0);
  auto start = Clock::now();
  std::string msg = error_of([&] { pg->allreduce(x)->wait(); });
  auto took = std::chrono::duration_cast<Millis>(Clock::now() - start);
  WCHECK(!msg.empty(), "allreduce without one peer must fail");
  expect_op_error(msg, "allreduce", 1);
  if (check)
    WCHECK(has(msg, "did not reach collective #1") && has(msg, std::to_string(victim)),
           "names the missing rank: ", msg);
  WCHECK(took > kShort / 2, "failed after only ", took.count(), " ms: before the timeout?");
  WCHECK(took < kShort + Millis{3000}, "failed after ", took.count(), " ms, more than the timeout and slack");
  pg.reset();
}

// arg "numel": the last rank passes 999 elements instead of 1000.
// arg "op": rank 1 calls broadcast where rank 0 calls allreduce.
// arg "dtype": rank 1 reduces float64 where the others reduce float32.
// The "op" variant turns the checks on through the environment
// (EMBER_DISTRIBUTED_DEBUG=DETAIL), the others through the option.
EMBER_WORKER(signature_mismatch) {
  auto pg = group(env, std::chrono::seconds(20), /*check_signatures=*/env.arg != "op");
  const int r = pg->rank(), ws = pg->size();
  Tensor warm = full({10}, 1.0);
  pg->allreduce(warm)->wait();
  std::string msg;
  if (env.arg == "numel") {
    Tensor x = full({r == ws - 1 ? 999 : 1000}, 1.0);
    msg = error_of([&] { pg->allreduce(x)->wait(); });
    WCHECK(has(msg, "numel=1000") && has(msg, "numel=999") && has(msg, "rank " + std::to_string(ws - 1)),
           "names both sides: ", msg);
  } else if (env.arg == "dtype") {
    Tensor x = full({1000}, 1.0, r == 1 ? DType::Float64 : DType::Float32);
    msg = error_of([&] { pg->allreduce(x)->wait(); });
    WCHECK(has(msg, "dtype=float32") && has(msg, "dtype=float64"), "names both dtypes: ", msg);
  } else {
    Tensor x = full({1000}, 1.0);
    msg = error_of([&] { (r == 1 ? pg->broadcast(x, 0) : pg->allreduce(x))->wait(); });
    WCHECK(has(msg, "op=allreduce") && has(msg, "op=broadcast"), "names both ops: ", msg);
  }
  std::printf("rank %d error: %s\n", r, msg.c_str());
  WCHECK(has(msg, "signature mismatch at collective #1"), "names the mismatch and sequence number: ", msg);
  pg.reset();
}

// ---------------------------------------------------------------------------
// Parent-side tests.

class GlooWorlds : public ::testing::TestWithParam<int> {};

TEST_P(GlooWorlds, EveryCollectiveDtypeAndSize) {
  EMBER_EXPECT_RANKS("collectives", GetParam(), {.deadline = std::chrono::seconds(240)});
}

TEST_P(GlooWorlds, NonContiguousTensors) { EMBER_EXPECT_RANKS("noncontiguous", GetParam()); }

TEST_P(GlooWorlds, SendRecv) {
  if (GetParam() < 2) GTEST_SKIP() << "send/recv needs two ranks";
  EMBER_EXPECT_RANKS("p2p", GetParam());
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooWorlds, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& i) { return "world" + std::to_string(i.param); });

TEST(GlooProcessGroup, WorkHandles) { EMBER_EXPECT_RANKS("work_api", 2); }

// With `victim_code`: the last rank must exit with it (its own, 42/43),
// every other rank must pass.
mp::RunOptions failure_run(const std::string& arg, int world = 0, int victim_code = 0) {
  mp::RunOptions o;
  o.arg = arg;
  o.deadline = std::chrono::seconds(40);
  if (victim_code) o.expect_exit = {{world - 1, victim_code}};
  return o;
}

TEST(GlooProcessGroup, PeerDyingMidAllreduceFailsTheOthers) {
  for (int ws : {2, 3}) {
    for (const char* arg : {"check", "nocheck"}) {
      EMBER_EXPECT_RANKS("peer_dies", ws, failure_run(arg, ws, 42));
    }
  }
}

TEST(GlooProcessGroup, AbortedPeerFailsTheOthersAtOnce) {
  EMBER_EXPECT_RANKS("peer_aborts", 3, {.deadline = std::chrono::seconds(30)});
}

TEST(GlooProcessGroup, MissingPeerTimesOut) {
  for (const char* arg : {"check", "nocheck"}) {
    EMBER_EXPECT_RANKS("peer_hangs", 3, failure_run(arg, 3, 43));
  }
}

TEST(GlooProcessGroup, SignatureMismatchNamesBothSides) {
  EMBER_EXPECT_RANKS("signature_mismatch", 3, failure_run("numel"));
  mp::RunOptions by_env = failure_run("op");
  by_env.env = {"EMBER_DISTRIBUTED_DEBUG=DETAIL"};
  EMBER_EXPECT_RANKS("signature_mismatch", 2, by_env);
  EMBER_EXPECT_RANKS("signature_mismatch", 3, failure_run("dtype"));
}

TEST(GlooProcessGroup, SignatureChecksAreOptIn) {
  ::unsetenv("EMBER_DISTRIBUTED_DEBUG");
  ::unsetenv("TORCH_DISTRIBUTED_DEBUG");
  ProcessGroupOptions o;
  EXPECT_FALSE(detail::signature_checks_enabled(o));
  o.check_signatures = true;
  EXPECT_TRUE(detail::signature_checks_enabled(o));
  o.check_signatures = false;
  ::setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL", 1);
  EXPECT_TRUE(detail::signature_checks_enabled(o));
  ::setenv("EMBER_DISTRIBUTED_DEBUG", "INFO", 1);  // ours first
  EXPECT_FALSE(detail::signature_checks_enabled(o));
  ::setenv("EMBER_DISTRIBUTED_DEBUG", "detail", 1);  // any case, as torch
  EXPECT_TRUE(detail::signature_checks_enabled(o));
  ::setenv("EMBER_DISTRIBUTED_DEBUG", "verbose", 1);
  EXPECT_THROW(detail::signature_checks_enabled(o), Error);
  ::unsetenv("EMBER_DISTRIBUTED_DEBUG");
  ::unsetenv("TORCH_DISTRIBUTED_DEBUG");
}

// Argument errors are thrown by the call itself, on a group of one.
class GlooSingle : public ::testing::Test {
 protected:
  void SetUp() override {
    TCPStoreOptions so;
    so.is_server = true;
    so.wait_for_workers = false;
    store_ = std::make_shared<TCPStore>("127.0.0.1", 0, so);
    pg_ = make_gloo_group(store_, 0, 1);
  }
  std::shared_ptr<Store> store_;
  std::shared_ptr<ProcessGroup> pg_;
};

#define EXPECT_ERROR(stmt, ...)                                                                           \
  do {                                                                                                    \
    std::string m_ = error_of([&] { stmt; });                                                             \
    for (const char* s_ : {__VA_ARGS__}) EXPECT_TRUE(has(m_, s_)) << "missing '" << s_ << "' in: " << m_; \
  } while (0)

TEST_F(GlooSingle, WrongSizesAndDtypesNameOpShapesAndRank) {
  Tensor in = zeros({3});
  EXPECT_ERROR(pg_->allgather({zeros({3}), zeros({3})}, in), "gloo allgather (rank 0 of 1)", "2 output tensors");
  EXPECT_ERROR(pg_->allgather({zeros({4})}, in), "allgather", "outputs[0] has shape [4]", "input has shape [3]");
  EXPECT_ERROR(pg_->allgather({zeros({3}, DType::Float64)}, in), "allgather", "float64", "float32");
  EXPECT_ERROR(pg_->allgather_into_tensor(zeros({5}), in), "allgather_into_tensor (rank 0 of 1)",
               "output has shape [5]", "input shape [3]");
  EXPECT_ERROR(pg_->allgather_into_tensor(zeros({3}, DType::Int32), in), "allgather_into_tensor", "int32", "float32");
  EXPECT_ERROR(pg_->reduce_scatter_tensor(zeros({2}), in), "reduce_scatter_tensor", "input has shape [3]",
               "output shape [2]");
  EXPECT_ERROR(pg_->all_to_all_single(zeros({4}), in), "all_to_all_single", "[4]", "[3]");
  EXPECT_ERROR(pg_->broadcast(in, 1), "broadcast", "root 1");
  EXPECT_ERROR(pg_->reduce(in, -1), "reduce", "root -1");
  EXPECT_ERROR(pg_->send(in, 0), "send", "peer rank 0 is this rank");
  EXPECT_ERROR(pg_->recv(in, 3), "recv", "peer rank 3");
  EXPECT_ERROR(pg_->allreduce(zeros({3}, DType::Bool), ReduceOp::Avg), "allreduce", "avg", "bool");
  EXPECT_ERROR(pg_->allreduce(Tensor()), "allreduce", "undefined");
}

TEST_F(GlooSingle, GroupOfOneIsIdentityForEveryDtype) {
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16, DType::Int32, DType::UInt8, DType::Bool}) {
    Tensor x = make({17}, dt, [](int64_t i) { return static_cast<double>(i % 2); });
    pg_->allreduce(x, dt == DType::Bool ? ReduceOp::Max : ReduceOp::Avg)->wait();
    expect_values(
        x, [](int64_t i) { return static_cast<double>(i % 2); }, "allreduce on one rank");
    Tensor out = zeros({17}, dt);
    pg_->allgather_into_tensor(out, x)->wait();
    expect_values(
        out, [](int64_t i) { return static_cast<double>(i % 2); }, "allgather on one rank");
  }
  pg_->barrier()->wait();
}

TEST_F(GlooSingle, CudaTensorsPointToNccl) {
  if (!cuda_is_available()) GTEST_SKIP() << "no GPU to make a CUDA tensor: " << cuda_unavailable_reason();
  EXPECT_ERROR(pg_->allreduce(zeros({3}, cuda_device(0))), "gloo allreduce", "cuda:0", "use the nccl backend");
}

// Where the spawned workers start (see multiprocess.h).
}  // namespace
}  // namespace ember::distributed
