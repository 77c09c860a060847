// The NCCL process group on one GPU (a group of one): every collective on
// CUDA tensors of several dtypes and sizes, non-contiguous tensors, stream
// ordering behind the caller's stream, argument errors, and the watchdog
// aborting a collective that cannot finish. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>

#include "core/ops.h"
#include "core/testing/error_of.h"
#include "distributed/comm/backends.h"
#include "distributed/comm/process_group.h"
#include "distributed/init.h"
#include "distributed/store/store.h"

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

}  // namespace
}  // namespace ember::distributed
