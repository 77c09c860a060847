// The NCCL process group. On one GPU (a group of one): every collective on
// CUDA tensors of several dtypes and sizes, non-contiguous tensors, stream
// ordering behind the caller's stream, argument errors, and the watchdog
// aborting a collective that cannot finish. Across 2 and 3 processes, one
// device each (GPUs, or each process's emulated device with the emulated
// NCCL, third_party/cuda_emu/nccl_emu.cc): every collective's values
// against what each rank contributed, point-to-point on the group and on
// connected pairs, a peer that dies, collectives that do not match, and
// collectives captured in a CUDA graph and replayed. Skips without a GPU,
// and the multi-process cases with fewer GPUs than ranks.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <thread>

#include "core/allocator.h"
#include "core/cuda_graph.h"
#include "core/ops.h"
#include "core/testing/error_of.h"
#include "distributed/comm/backends.h"
#include "distributed/comm/process_group.h"
#include "distributed/init.h"
#include "distributed/store/store.h"
#include "distributed/testing/collective_checks.h"
#include "distributed/testing/multiprocess.h"

namespace ember::distributed {
namespace {

using Clock = std::chrono::steady_clock;

using ::ember::testing::error_of;
bool has(const std::string& s, const std::string& n) { return s.find(n) != std::string::npos; }

Tensor seq_tensor(const Shape& shape, DType dt) {
  const int64_t n = shape_numel(shape);
  std::vector<double> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<double>(i % 7 + 1);
  return Tensor::from_vector(v, shape, TensorOptions(dt, cuda_device(0)));
}

void expect_same(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  EXPECT_EQ(got.cpu().to_vector(), want.cpu().to_vector()) << what;
}

class NcclSingle : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_is_available()) GTEST_SKIP() << "no GPU: " << cuda_unavailable_reason();
    TCPStoreOptions so;
    so.is_server = true;
    so.wait_for_workers = false;
    store_ = std::make_shared<TCPStore>("127.0.0.1", 0, so);
    ProcessGroupOptions o;
    o.timeout = std::chrono::milliseconds(1000);
    pg_ = make_nccl_group(store_, 0, 1, o);
  }
  std::shared_ptr<Store> store_;
  std::shared_ptr<ProcessGroup> pg_;
};

TEST_F(NcclSingle, EveryCollectiveIsTheIdentityOnOneRank) {
  EXPECT_EQ(pg_->backend_name(), "nccl");
  for (DType dt :
       {DType::Float32, DType::Float16, DType::BFloat16, DType::Float64, DType::Int32, DType::Int64, DType::UInt8}) {
    for (int64_t n : {0, 1, 1001}) {
      const std::string tag = std::string(dtype_name(dt)) + " n=" + std::to_string(n);
      Tensor ref = seq_tensor({n}, dt);
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product}) {
        Tensor x = ref.clone();
        pg_->allreduce(x, op)->wait();
        expect_same(x, ref, "allreduce " + std::string(reduce_op_name(op)) + " " + tag);
      }
      Tensor x = ref.clone();
      pg_->broadcast(x, 0)->wait();
      expect_same(x, ref, "broadcast " + tag);
      pg_->reduce(x, 0)->wait();
      expect_same(x, ref, "reduce " + tag);
      std::vector<Tensor> outs = {zeros({n}, TensorOptions(dt, cuda_device(0)))};
      pg_->allgather(outs, ref)->wait();
      expect_same(outs[0], ref, "allgather " + tag);
      Tensor flat = zeros({n}, TensorOptions(dt, cuda_device(0)));
      pg_->allgather_into_tensor(flat, ref)->wait();
      expect_same(flat, ref, "allgather_into_tensor " + tag);
      Tensor rs = zeros({n}, TensorOptions(dt, cuda_device(0)));
      pg_->reduce_scatter_tensor(rs, ref)->wait();
      expect_same(rs, ref, "reduce_scatter_tensor " + tag);
      Tensor a2a = zeros({n}, TensorOptions(dt, cuda_device(0)));
      pg_->all_to_all_single(a2a, ref)->wait();
      expect_same(a2a, ref, "all_to_all_single " + tag);
    }
  }
  pg_->barrier()->wait();
}

TEST_F(NcclSingle, NonContiguousAndBehindTheCallersStream) {
  // A transposed view, written on a side stream just before the collective:
  // the comm stream must wait for that write.
  cudaStream_t side;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  Tensor base = zeros({64, 33}, cuda_device(0));
  cuda_synchronize();  // the side stream does not wait for the default one
  Stream::set_current({0, side});
  Tensor x = base.t();
  x.copy_(seq_tensor({33, 64}, DType::Float32));
  auto w = pg_->allreduce(x, ReduceOp::Sum);
  Stream::set_current({0, nullptr});
  w->wait();
  expect_same(x.contiguous(), seq_tensor({33, 64}, DType::Float32), "allreduce of a transposed view");
  cudaStreamSynchronize(side);
  cudaStreamDestroy(side);
}

TEST_F(NcclSingle, SynchronizeOrdersTheCurrentStreamNotTheHost) {
  // The output starts as zeros and only the collective fills it: a consumer
  // on a side stream that read it before the collective finished would see
  // zeros. The side stream waits through synchronize(); the host never
  // waits on the work before reading through that stream.
  cudaStream_t side;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  const int64_t n = int64_t{1} << 24;
  Tensor in = seq_tensor({n}, DType::Float32);
  Tensor out = zeros({n}, cuda_device(0));
  auto w = pg_->allgather_into_tensor(out, in);
  Stream::set_current({0, side});
  w->synchronize();
  Tensor y = out * 2.0;  // queued on `side`, after the collective
  Stream::set_current({0, nullptr});
  ASSERT_EQ(cudaStreamSynchronize(side), cudaSuccess);
  expect_same(y, seq_tensor({n}, DType::Float32) * 2.0, "consumer ordered after the collective");
  w->wait();
  EXPECT_TRUE(w->is_success());
  cudaStreamDestroy(side);
}

TEST_F(NcclSingle, ArgumentErrors) {
  EXPECT_TRUE(has(error_of([&] { pg_->allreduce(zeros({3})); }), "use the gloo backend"));
  Tensor in = zeros({3}, cuda_device(0));
  EXPECT_TRUE(has(error_of([&] { pg_->allgather_into_tensor(zeros({4}, cuda_device(0)), in); }),
                  "nccl allgather_into_tensor (rank 0 of 1)"));
  EXPECT_TRUE(has(error_of([&] { pg_->allgather({in, in}, in); }), "2 output tensors"));
  // Point-to-point matches in call order; a pair needs two ranks.
  EXPECT_TRUE(pg_->p2p_in_order());
  pg_->connect_p2p({});
  EXPECT_TRUE(has(error_of([&] { pg_->connect_p2p({{0, 0}}); }), "is not a pair of two ranks of a group of 1"));
  pg_->allreduce(in)->wait();  // still usable
}

// A collective whose input is produced behind a host callback that never
// returns (until we let it) cannot finish: the watchdog must fail it at the
// timeout, abort the communicator, and the group must refuse further work.
TEST_F(NcclSingle, WatchdogAbortsACollectivePastItsTimeout) {
  // The emulation runs a process's stream work one piece at a time on the
  // thread that waits for it, so the blocked callback would hold the
  // watchdog too: only a GPU runs it beside the host.
  if (cuda_device_name() == "CUDA emulation") GTEST_SKIP() << "a GPU's concurrency: not emulated";
  cudaStream_t producer;
  ASSERT_EQ(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking), cudaSuccess);
  Tensor x = ones({1024}, cuda_device(0));
  cuda_synchronize();
  static std::atomic<bool> release{false};
  release = false;
  ASSERT_EQ(cudaLaunchHostFunc(
                producer,
                [](void*) {
                  while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
                },
                nullptr),
            cudaSuccess);
  // Whatever happens below, the callback returns in 5 s.
  std::thread releaser([] {
    std::this_thread::sleep_for(std::chrono::seconds(5));
    release = true;
  });
  Stream::set_current({0, producer});
  auto w = pg_->allreduce(x);
  Stream::set_current({0, nullptr});
  auto t0 = Clock::now();
  std::string msg = error_of([&] { w->wait(); });
  auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  EXPECT_TRUE(has(msg, "allreduce") && has(msg, "collective #0") && has(msg, "timed out") &&
              has(msg, "timeout 1000 ms") && has(msg, "ncclCommAbort"))
      << msg;
  EXPECT_LT(took.count(), 3000) << msg;
  EXPECT_TRUE(has(error_of([&] { pg_->barrier()->wait(); }), "no longer be used"));
  release = true;
  releaser.join();
  cudaStreamSynchronize(producer);
  cudaStreamDestroy(producer);
}

// ---------------------------------------------------------------------------
// Several processes, one device each. Rank r contributes val(r, i), so every
// rank knows what each collective must give.

using testing::expect_values;
using testing::Fn;
using testing::val;
using testing::WorkerEnv;
using Millis = std::chrono::milliseconds;

// n elements f(0), f(1), ... on this rank's device.
Tensor make(int64_t n, DType dt, const Fn& f) { return testing::make({n}, dt, f, cuda_device(0)); }

std::shared_ptr<ProcessGroup> nccl_group(const WorkerEnv& env, bool check_signatures = false,
                                         Millis timeout = Millis{60000}) {
  ProcessGroupOptions o;
  o.timeout = timeout;
  o.check_signatures = check_signatures;
  return make_nccl_group(env.store(), env.rank, env.world_size, o);
}

// The checks the Gloo group's test makes, on CUDA tensors.
EMBER_WORKER(nccl_collectives) {
  auto pg = nccl_group(env);
  for (DType dt :
       {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16, DType::Int32, DType::Int64, DType::UInt8}) {
    for (int64_t n : {0, 1, 1001}) testing::check_collectives(*pg, dt, n);
  }
}

TEST(NcclRanks, EveryCollectiveAcrossRanks) {
  if (!cuda_is_available()) GTEST_SKIP() << "no GPU: " << cuda_unavailable_reason();
  for (int ws : {2, 3}) {
    if (!testing::nccl_ranks_runnable(ws)) continue;
    EMBER_EXPECT_RANKS("nccl_collectives", ws) << ws << " ranks";
  }
}

EMBER_WORKER(nccl_p2p) {
  auto pg = nccl_group(env);
  const int r = pg->rank(), ws = pg->size();
  const int next = (r + 1) % ws, prev = (r + ws - 1) % ws;
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Int64}) {
    for (int64_t n : {1, 1001}) {
      Tensor out = make(n, dt, [&](int64_t i) { return val(r, i); });
      Tensor in = zeros({n}, TensorOptions(dt, cuda_device(0)));
      // NCCL matches in call order per pair: even ranks send first, odd ranks receive first.
      std::shared_ptr<Work> s, q;
      if (r % 2 == 0) {
        s = pg->send(out, next, 0);
        q = pg->recv(in, prev, 0);
      } else {
        q = pg->recv(in, prev, 0);
        s = pg->send(out, next, 0);
      }
      s->wait();
      q->wait();
      expect_values(
          in, [&](int64_t i) { return val(prev, i); }, "ring send/recv");
    }
  }
  // Uneven all-to-all: rank r sends q + 1 elements to rank q.
  std::vector<int64_t> in_elems(ws), out_elems(ws, r + 1);
  int64_t total_in = 0;
  for (int q = 0; q < ws; ++q) total_in += in_elems[q] = q + 1;
  Tensor src = make(total_in, DType::Float32, [&](int64_t j) { return r * 100 + j; });
  Tensor dst = zeros({ws * (r + 1)}, cuda_device(0));
  pg->all_to_all_single(dst, src, out_elems, in_elems)->wait();
  // From rank q: its elements at offset 0 + 1 + ... + r, r + 1 of them.
  expect_values(
      dst, [&](int64_t j) { return (j / (r + 1)) * 100 + r * (r + 1) / 2 + j % (r + 1); }, "all_to_all_v");
  // A connected pair has its own communicator and stream.
  pg->connect_p2p({{0, 1}, {1, 0}});
  if (r < 2) {
    Tensor mine = make(64, DType::Float32, [&](int64_t i) { return val(r, i); });
    Tensor got = zeros({64}, cuda_device(0));
    std::shared_ptr<Work> s, q;
    if (r == 0) {
      s = pg->send(mine, 1, 0);
      q = pg->recv(got, 1, 0);
    } else {
      q = pg->recv(got, 0, 0);
      s = pg->send(mine, 0, 0);
    }
    s->wait();
    q->wait();
    expect_values(
        got, [&](int64_t i) { return val(1 - r, i); }, "send/recv on a connected pair");
  }
  pg->barrier()->wait();
}

TEST(NcclRanks, PointToPoint) {
  if (!cuda_is_available()) GTEST_SKIP() << "no GPU: " << cuda_unavailable_reason();
  for (int ws : {2, 3}) {
    if (!testing::nccl_ranks_runnable(ws)) continue;
    EMBER_EXPECT_RANKS("nccl_p2p", ws) << ws << " ranks";
  }
}

// Rank 1 exits after a first collective; rank 0's next one fails naming
// NCCL's asynchronous error instead of returning garbage or hanging, and
// the group refuses later ops. (Signature checks off: they would see the
// missing rank in the store first.)
EMBER_WORKER(nccl_peer_dies) {
  auto pg = nccl_group(env, /*check_signatures=*/false, Millis{5000});
  Tensor warm = ones({10}, cuda_device(0));
  pg->allreduce(warm)->wait();
  if (pg->rank() == 1) {
    std::fflush(stdout);
    _exit(42);
  }
  Tensor x = ones({1000}, cuda_device(0));
  const auto t0 = Clock::now();
  std::string msg = error_of([&] { pg->allreduce(x)->wait(); });
  const auto took = std::chrono::duration_cast<Millis>(Clock::now() - t0);
  WCHECK(has(msg, "allreduce") && has(msg, "asynchronous error"), "the error names the op and NCCL's report: ", msg);
  WCHECK(took < Millis{5000 + 3000}, "failed after ", took.count(), " ms");
  WCHECK(has(error_of([&] { pg->barrier()->wait(); }), "no longer be used"), "later ops are refused");
}

TEST(NcclRanks, APeerThatDiesFailsTheCollective) {
  if (!testing::nccl_ranks_runnable(2)) GTEST_SKIP() << "needs 2 GPUs (or the emulation)";
  EMBER_EXPECT_RANKS("nccl_peer_dies", 2, {.expect_exit = {{1, 42}}});
}

// Ranks that call different collectives: NCCL would hang or write garbage;
// the emulation fails both ranks' op naming the two calls (a GPU run only
// checks that the test's ranks agree on the failure, so it skips).
EMBER_WORKER(nccl_mismatch) {
  auto pg = nccl_group(env, /*check_signatures=*/false, Millis{5000});
  Tensor x = ones({env.rank == 0 ? 10 : 12}, cuda_device(0));
  std::string msg = error_of([&] { pg->allreduce(x)->wait(); });
  WCHECK(has(msg, "mismatched collectives") && has(msg, "count 10") && has(msg, "count 12"),
         "the error names both calls: ", msg);
}

TEST(NcclRanks, MismatchedCollectivesAreNamedUnderTheEmulation) {
  if (!cuda_is_available()) GTEST_SKIP() << "no GPU: " << cuda_unavailable_reason();
  if (cuda_device_name() != "CUDA emulation") GTEST_SKIP() << "NCCL itself does not check (it hangs)";
  EMBER_EXPECT_RANKS("nccl_mismatch", 2);
}

// A collective captured in a CUDA graph runs in every replay: y = allreduce(2 x) + 1,
// replayed on new x, equals the same step run eagerly. The waits inside the
// capture order the capturing stream, not the host.
EMBER_WORKER(nccl_captured) {
  auto pg = nccl_group(env);
  const int r = pg->rank(), ws = pg->size();
  Tensor x = zeros({257}, cuda_device(0));
  auto step = [&](Tensor& y) {
    Tensor t = x * 2.0;
    auto w = pg->allreduce(t);
    w->wait();
    y = t + 1.0;
  };
  Tensor out;  // the graph's output
  CudaGraph graph(0);
  graph.capture([&] { step(out); });
  WCHECK(graph.captured(), "captured");
  for (int k = 0; k < 3; ++k) {
    x.copy_(make(257, DType::Float32, [&](int64_t i) { return val(r, i) + k; }));
    graph.replay();
    Tensor replayed = out.clone();
    Tensor y;
    step(y);  // the same step, eagerly
    expect_values(
        replayed, [&](int64_t i) { return 2 * (ws * (k + 1) + (ws * (ws - 1) / 2) + ws * (i % 7)) + 1; },
        "replay " + std::to_string(k));
    expect_values(
        y, [&](int64_t i) { return 2 * (ws * (k + 1) + (ws * (ws - 1) / 2) + ws * (i % 7)) + 1; },
        "eager " + std::to_string(k));
  }
  // Its Work belongs to the graph: waiting outside a capture is refused by name.
  std::shared_ptr<Work> captured;
  CudaGraph g2(0);
  g2.capture([&] {
    captured = pg->allreduce(x);
    captured->wait();  // joins the comm stream back into the capture
  });
  WCHECK(has(error_of([&] { captured->wait(); }), "captured in a CUDA graph"), "wait outside the capture");
  g2.replay();
  pg->barrier()->wait();
}

TEST(NcclRanks, CollectivesCapturedInAGraph) {
  if (!testing::nccl_ranks_runnable(2)) GTEST_SKIP() << "needs 2 GPUs (or the emulation)";
  if (!cuda_allocator_caching(0)) GTEST_SKIP() << "EMBER_NO_CUDA_MEMORY_CACHING is set: graphs need the caching";
  EMBER_EXPECT_RANKS("nccl_captured", 2);
}

}  // namespace
}  // namespace ember::distributed
