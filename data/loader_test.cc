// DataLoader: identical batches for any worker count, collation, epochs,
// early stop without hangs or leaked threads, exceptions from workers,
// the prefetch bound, distributed sharding, and the device options.
#include "data/loader.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <set>
#include <stdexcept>
#include <thread>

#include "core/ops.h"
#include "core/testing/error_of.h"
#include "data/batch_memory.h"
#include "data/readers.h"

namespace ember::data {
namespace {

int thread_count() {
  int n = 0;
  for ([[maybe_unused]] auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

struct Epoch {
  std::vector<std::vector<double>> data, target;
  std::vector<std::vector<int64_t>> indices;
  bool operator==(const Epoch&) const = default;
};

Epoch run_epoch(DataLoader& loader) {
  Epoch e;
  for (Batch& b : loader) {
    e.data.push_back(b.data.to_vector());
    e.target.push_back(b.target.to_vector());
    e.indices.push_back(b.indices);
  }
  return e;
}

TransformPtr standard_transform() {
  return compose({random_crop(12, 2), random_horizontal_flip(), to_float(), normalize({0.5, 0.4, 0.3}, {0.2, 0.25, 0.3})});
}

TEST(DataLoader, SameBatchesForAnyNumberOfWorkers) {
  auto ds = std::make_shared<SyntheticImages>(300, Shape{3, 12, 12}, 10, /*seed=*/5);
  for (TransformPtr tf : std::vector<TransformPtr>{standard_transform(), compose({random_crop(10, 1), lambda([](const Tensor& x, RandomStream& r) {
                                                            return x.to(DType::Float32) + static_cast<double>(r.uniform_int(100));
                                                          })})}) {
    std::vector<std::vector<Epoch>> runs;
    for (int workers : {0, 1, 4}) {
      DataLoader loader(ds, {.batch_size = 32, .shuffle = true, .num_workers = workers, .transform = tf, .seed = 9});
      EXPECT_EQ(loader.size(), 10);
      runs.push_back({run_epoch(loader), run_epoch(loader)});
    }
    ASSERT_EQ(runs[0][0].data.size(), 10u);
    EXPECT_EQ(runs[0][0].data.back().size(), 12 * (runs[0][0].data[0].size() / 32));  // 300 = 9 * 32 + 12
    EXPECT_NE(runs[0][0], runs[0][1]);  // the second epoch: new order, new crops
    EXPECT_EQ(runs[0], runs[1]);
    EXPECT_EQ(runs[0], runs[2]);
  }
}

TEST(DataLoader, CollatesIntoBatchTensors) {
  Tensor x = arange(60).view({10, 2, 3});
  Tensor y = arange(10, DType::Int64) * 3.0;
  auto ds = std::make_shared<TensorDataset>(x, y.to(DType::Int64));
  DataLoader loader(ds, {.batch_size = 4});
  EXPECT_EQ(loader.size(), 3);
  int64_t k = 0;
  for (Batch& b : loader) {
    int64_t n = std::min<int64_t>(4, 10 - 4 * k);
    ASSERT_EQ(b.data.sizes(), (Shape{n, 2, 3}));
    EXPECT_EQ(b.data.dtype(), DType::Float32);
    EXPECT_EQ(b.data.to_vector(), x.slice(0, 4 * k, 4 * k + n).contiguous().to_vector());
    ASSERT_EQ(b.target.sizes(), (Shape{n}));
    EXPECT_EQ(b.target.dtype(), DType::Int64);
    EXPECT_EQ(b.target.to_vector(), y.slice(0, 4 * k, 4 * k + n).to_vector());
    ++k;
  }
  EXPECT_EQ(k, 3);
  DataLoader dropping(ds, {.batch_size = 4, .drop_last = true});
  EXPECT_EQ(dropping.size(), 2);
  EXPECT_EQ(run_epoch(dropping).data.size(), 2u);
  // Tensor targets are stacked too.
  auto reg = std::make_shared<TensorDataset>(x, x.select(2, 0).contiguous());
  DataLoader tl(reg, {.batch_size = 5, .num_workers = 2});
  for (Batch& b : tl) EXPECT_EQ(b.target.sizes(), (Shape{5, 2}));
}

TEST(DataLoader, EpochsAdvanceAndCanBeSet) {
  auto ds = std::make_shared<SyntheticImages>(64, Shape{1, 4, 4}, 3);
  DataLoader loader(ds, {.batch_size = 16, .shuffle = true, .num_workers = 2,
                         .transform = compose({random_horizontal_flip(), to_float()}), .seed = 1});
  Epoch e0 = run_epoch(loader);
  EXPECT_EQ(loader.epoch(), 1);
  EXPECT_EQ(loader.sampler().epoch(), 0);
  Epoch e1 = run_epoch(loader);
  EXPECT_NE(e0, e1);
  loader.set_epoch(0);
  EXPECT_EQ(run_epoch(loader), e0);
  EXPECT_EQ(run_epoch(loader), e1);
}

// Resuming mid-epoch: the rest of the epoch's batches, the same as an
// uninterrupted epoch's, for any worker count; the next epoch whole.
TEST(DataLoader, StartBatchContinuesAnEpochInTheMiddle) {
  auto ds = std::make_shared<SyntheticImages>(100, Shape{1, 4, 4}, 3);
  for (int workers : {0, 2}) {
    DataLoaderOptions o{.batch_size = 16,
                        .shuffle = true,
                        .num_workers = workers,
                        .transform = compose({random_horizontal_flip(), to_float()}),
                        .seed = 4};
    DataLoader whole(ds, o);
    const Epoch e0 = run_epoch(whole), e1 = run_epoch(whole);
    DataLoader resumed(ds, o);
    resumed.set_epoch(0);
    resumed.set_start_batch(5);
    Epoch tail = run_epoch(resumed);
    ASSERT_EQ(tail.indices.size(), 2u) << workers;  // batches 5 and 6 of 7
    EXPECT_EQ(tail.indices[0], e0.indices[5]);
    EXPECT_EQ(tail.data[1], e0.data[6]);
    EXPECT_EQ(run_epoch(resumed), e1);
    resumed.set_start_batch(99);  // past the end: an empty epoch
    EXPECT_TRUE(run_epoch(resumed).indices.empty());
  }
  DataLoader bad(ds, {.batch_size = 4});
  EXPECT_THROW(bad.set_start_batch(-1), Error);
}

// Slow examples keep the workers busy when the consumer walks away.
class SlowDataset : public Dataset {
 public:
  explicit SlowDataset(int64_t n, int64_t fail_at = -1, bool std_error = false)
      : n_(n), fail_at_(fail_at), std_error_(std_error) {}
  int64_t size() const override { return n_; }
  Example get(int64_t i) const override {
    max_index = std::max<int64_t>(max_index.load(), i);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (i == fail_at_) {
      if (std_error_) throw std::out_of_range("custom failure at " + std::to_string(i));
      EMBER_CHECK(false, "boom: cannot decode");
    }
    return {full({2}, static_cast<double>(i)), i % 3, Tensor()};
  }
  mutable std::atomic<int64_t> max_index{-1};

 private:
  int64_t n_, fail_at_;
  bool std_error_;
};

TEST(DataLoader, EarlyStopDoesNotHangOrLeakThreads) {
  const int before = thread_count();
  for (int round = 0; round < 20; ++round) {
    auto ds = std::make_shared<SlowDataset>(10000);
    auto t0 = std::chrono::steady_clock::now();
    {
      DataLoader loader(ds, {.batch_size = 8, .num_workers = 4, .prefetch_factor = 2});
      int seen = 0;
      for (Batch& b : loader) {
        EXPECT_EQ(b.size(), 8);
        if (++seen == 2) break;
      }
      if (round % 2 == 1) {  // restarting mid-epoch stops the old workers first
        auto it = loader.begin();
        EXPECT_EQ(it->indices.front(), 0);
      }
    }
    // Joining waits for at most one batch per worker (8 x 200 us).
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  }
  EXPECT_EQ(thread_count(), before);
}

TEST(DataLoader, PrefetchIsBounded) {
  auto ds = std::make_shared<SlowDataset>(1000);
  DataLoader loader(ds, {.batch_size = 10, .num_workers = 2, .prefetch_factor = 1});
  auto it = loader.begin();  // holds batch 0
  // Batch 0 taken: workers may build batches 1 and 2, no further.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (ds->max_index.load() < 20 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_GE(ds->max_index.load(), 20);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // time to overshoot, if they could
  EXPECT_LT(ds->max_index.load(), 30);
  ++it;
  EXPECT_EQ(it->indices.front(), 10);
}

TEST(DataLoader, WorkerExceptionReachesTheConsumer) {
  for (int workers : {0, 1, 4}) {
    SCOPED_TRACE(workers);
    auto ds = std::make_shared<SlowDataset>(40, /*fail_at=*/13);
    DataLoader loader(ds, {.batch_size = 4, .num_workers = workers});
    int delivered = 0;
    const std::string m = ::ember::testing::error_of([&] {
      for (Batch& b : loader) {
        EXPECT_EQ(b.indices.front(), 4 * delivered);
        ++delivered;
      }
    });
    EXPECT_NE(m.find("example 13"), std::string::npos) << m;
    EXPECT_NE(m.find("boom: cannot decode"), std::string::npos) << m;
    EXPECT_EQ(delivered, 3);  // batches 0-2, then batch 3 (indices 12-15) fails when due
    // Other exception types arrive as they are.
    auto other = std::make_shared<SlowDataset>(40, 0, /*std_error=*/true);
    DataLoader failing(other, {.batch_size = 4, .num_workers = workers});
    EXPECT_THROW(failing.begin(), std::out_of_range);
    EXPECT_THROW(failing.begin(), std::out_of_range);  // and again: the loader stays usable
  }
}

class RaggedDataset : public Dataset {
 public:
  int64_t size() const override { return 8; }
  Example get(int64_t i) const override { return {zeros({i == 5 ? 3 : 2}), 0, Tensor()}; }
};

TEST(DataLoader, MismatchedExamplesNameTheExample) {
  DataLoader loader(std::make_shared<RaggedDataset>(), {.batch_size = 4, .num_workers = 2});
  auto it = loader.begin();
  const std::string m = ::ember::testing::error_of([&] { ++it; });
  EXPECT_NE(m.find("example 5"), std::string::npos) << m;
  EXPECT_NE(m.find("float32 [3] but the batch's first example's is float32 [2]"), std::string::npos) << m;
  EXPECT_TRUE(it == loader.end());
}

TEST(DataLoader, DistributedShardsAreDisjointAndCover) {
  auto ds = std::make_shared<SyntheticImages>(103, Shape{1, 2, 2}, 4);
  std::multiset<int64_t> all;
  for (int64_t rank = 0; rank < 3; ++rank) {
    auto sampler = std::make_shared<DistributedSampler>(ds->size(), 3, rank, true, 7);
    DataLoader loader(ds, {.batch_size = 5, .sampler = sampler, .num_workers = 1});
    EXPECT_EQ(loader.size(), 7);  // ceil(35 / 5)
    loader.set_epoch(2);
    for (Batch& b : loader) all.insert(b.indices.begin(), b.indices.end());
    EXPECT_EQ(sampler->epoch(), 2);
  }
  EXPECT_EQ(all.size(), 105u);
  std::set<int64_t> distinct(all.begin(), all.end());
  EXPECT_EQ(distinct.size(), 103u);
}

TEST(DataLoader, BadOptions) {
  auto ds = std::make_shared<SyntheticImages>(10, Shape{1, 2, 2}, 2);
  EXPECT_THROW(DataLoader(ds, {.batch_size = 0}), Error);
  EXPECT_THROW(DataLoader(ds, {.shuffle = true, .sampler = std::make_shared<SequentialSampler>(10)}), Error);
  EXPECT_THROW(DataLoader(nullptr, {}), Error);
}

TEST(DataLoader, DeviceOptions) {
  auto ds = std::make_shared<SyntheticImages>(50, Shape{3, 8, 8}, 10);
  DataLoaderOptions opts{.batch_size = 8, .shuffle = true, .num_workers = 2,
                         .transform = compose({random_crop(8, 1), to_float()}), .seed = 3};
  DataLoader cpu(ds, opts);
  Epoch ref = run_epoch(cpu);
  opts.pin_memory = true;  // ignored without CUDA, as in PyTorch
  DataLoader pinned(ds, opts);
  EXPECT_EQ(run_epoch(pinned), ref);
  opts.device = cuda_device(0);
  if (!cuda_is_available()) {
    try {
      DataLoader gpu(ds, opts);
      FAIL() << "no exception";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("CUDA is unavailable"), std::string::npos) << e.what();
    }
    GTEST_SKIP() << "no CUDA device: " << cuda_unavailable_reason();
  }
  for (int workers : {0, 2}) {
    opts.num_workers = workers;
    DataLoader gpu(ds, opts);
    Epoch got;
    for (Batch& b : gpu) {
      EXPECT_TRUE(b.data.is_cuda());
      EXPECT_TRUE(b.target.is_cuda());
      got.data.push_back(b.data.to_vector());
      got.target.push_back(b.target.to_vector());
      got.indices.push_back(b.indices);
    }
    EXPECT_EQ(got, ref);
  }
}

TEST(BufferPool, RecyclesBuffersAndBoundsTheCache) {
  auto pool = BufferPool::create(cpu_allocator(), /*max_cached=*/2);
  void* first;
  {
    Tensor a = pool->empty({100}, DType::Float32);
    first = a.raw_data();
  }
  EXPECT_EQ(pool->cached_buffers(), 1u);
  Tensor b = pool->empty({90}, DType::Float32);  // a smaller last batch reuses a full one's buffer
  EXPECT_EQ(b.raw_data(), first);
  EXPECT_EQ(b.sizes(), (Shape{90}));
  EXPECT_EQ(pool->cached_buffers(), 0u);
  {
    std::vector<Tensor> hoard;
    for (int i = 0; i < 5; ++i) hoard.push_back(pool->empty({100}, DType::Float32));
  }
  EXPECT_EQ(pool->cached_buffers(), 2u);
  std::weak_ptr<BufferPool> weak = pool;
  pool.reset();
  EXPECT_FALSE(weak.expired());  // b still uses its memory
  b = Tensor();
  EXPECT_TRUE(weak.expired());
}

TEST(DataLoader, FashionMnistEpoch) {
  if (!std::filesystem::is_directory(kFashionMnistRoot)) GTEST_SKIP() << kFashionMnistRoot << " is absent";
  auto test = std::make_shared<FashionMNIST>(kFashionMnistRoot, /*train=*/false);
  DataLoader loader(test, {.batch_size = 128, .shuffle = true, .num_workers = 2,
                           .transform = compose({random_crop(28, 2), random_horizontal_flip(), to_float(),
                                                 normalize({0.2860}, {0.3530})})});
  EXPECT_EQ(loader.size(), 79);
  int64_t n = 0;
  double sum = 0;
  std::vector<int64_t> per_class(10, 0);
  for (Batch& b : loader) {
    ASSERT_EQ(b.data.sizes(), (Shape{b.size(), 1, 28, 28}));
    n += b.size();
    sum += ember::sum(b.data).item();
    for (double t : b.target.to_vector()) per_class[static_cast<int64_t>(t)]++;
  }
  EXPECT_EQ(n, 10000);
  EXPECT_EQ(per_class, std::vector<int64_t>(10, 1000));
  // Normalised with the training set's statistics: mean ~0 (-0.015 here;
  // raw /255 data would average 0.29, unnormalised 73).
  EXPECT_NEAR(sum / (n * 784.0), 0.0, 0.05);
}

}  // namespace
}  // namespace ember::data
