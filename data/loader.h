// DataLoader: batches from a Dataset, built by worker threads ahead of the
// consumer and, on CUDA, copied to the device while the previous step runs.
//
//   data::DataLoader loader(std::make_shared<data::FashionMNIST>(), {
//       .batch_size = 64, .shuffle = true, .num_workers = 2,
//       .transform = data::compose({data::random_crop(28, 2), data::random_horizontal_flip(),
//                                   data::to_float(), data::normalize({0.2860}, {0.3530})}),
//       .seed = 42, .device = cuda_device(0)});
//   for (int epoch = 0; epoch < 10; ++epoch) {
//     loader.set_epoch(epoch);                // optional: epochs also advance by themselves
//     for (data::Batch& b : loader) train_step(b.data, b.target);  // [64,1,28,28] float32, int64 [64]
//   }
//
// Guarantees:
//  - the batches of an epoch are the same, in the same order, for any
//    num_workers (0 loads in the calling thread): the order comes from the
//    sampler, and each example's random transform draws from its own stream
//    keyed by (seed, epoch, dataset index);
//  - at most num_workers * prefetch_factor batches are built ahead;
//  - an exception thrown while building batch k (by the dataset, a transform
//    or collation) is rethrown by the iterator when batch k is due, and ends
//    the epoch;
//  - stopping early is safe: starting another epoch, or destroying the
//    loader, stops and joins the workers.
//
// Collation writes each example straight into the batch tensor (through the
// transform's apply_into, fused for standard chains), never stacking small
// tensors. With a CUDA `device`, batches are built in pinned host memory and
// copied on a side stream; the stream current on the consumer's thread waits
// for the copy (no host block), so the copy of batch k+1 overlaps the compute
// of batch k.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "data/dataset.h"
#include "data/sampler.h"
#include "data/transforms.h"

namespace ember::data {

class BufferPool;

struct Batch {
  Tensor data;             // [B, ...]: the transformed examples, stacked
  Tensor target;           // int64 [B] labels, or the examples' tensor targets stacked [B, ...]
  std::vector<int64_t> indices;  // the dataset indices, in batch order
  int64_t size() const { return static_cast<int64_t>(indices.size()); }
};

struct DataLoaderOptions {
  int64_t batch_size = 1;
  // Visit the dataset in a new random order each epoch (a RandomSampler
  // seeded with `seed`). Mutually exclusive with `sampler`.
  bool shuffle = false;
  // Which indices an epoch visits (e.g. a DistributedSampler). Default:
  // sequential, or random with `shuffle`.
  std::shared_ptr<Sampler> sampler = nullptr;
  // Drop the last batch when it would be smaller than batch_size.
  bool drop_last = false;
  // Threads that build batches; 0 builds them in the calling thread.
  int num_workers = 0;
  // Batches built ahead per worker (PyTorch's prefetch_factor).
  int prefetch_factor = 2;
  // Applied to each example's data; null keeps the data as it is.
  TransformPtr transform = nullptr;
  // Seeds the shuffle and the random transforms.
  uint64_t seed = 0;
  // Build batches in page-locked memory (ignored without a CUDA device, as
  // PyTorch does); implied by a CUDA `device`.
  bool pin_memory = false;
  // Where batches are delivered. CUDA: copied asynchronously (see above).
  Device device = kCPU;
};

class DataLoader {
 public:
  DataLoader(std::shared_ptr<const Dataset> dataset, DataLoaderOptions options);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  class Iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    Iterator() = default;
    Batch& operator*() const;
    Batch* operator->() const { return &**this; }
    Iterator& operator++();
    bool operator==(const Iterator& o) const { return position() == o.position(); }

   private:
    friend class DataLoader;
    Iterator(DataLoader* loader, uint64_t generation) : loader_(loader), generation_(generation) {}
    int64_t position() const;  // the batch index, or -1 at the end
    DataLoader* loader_ = nullptr;
    uint64_t generation_ = 0;
  };

  // Starts an epoch (stopping one still running) and loads its first batch.
  // Uses epoch(), then advances it.
  Iterator begin();
  Iterator end() { return Iterator(); }

  // Batches per epoch.
  int64_t size() const;
  // The epoch the next begin() runs; it is handed to the sampler
  // (Sampler::set_epoch) and keys the random transforms.
  int64_t epoch() const { return next_epoch_; }
  void set_epoch(int64_t epoch) { next_epoch_ = epoch; }
  // The next begin() starts its epoch at batch `batch` (the same batches
  // from there on, the ones before never built): a run resumed in the
  // middle of an epoch continues where it stopped, as torchdata's
  // StatefulDataLoader does. Later epochs start at 0 again.
  void set_start_batch(int64_t batch);
  const Sampler& sampler() const { return *sampler_; }
  const DataLoaderOptions& options() const { return options_; }

  // Builds the batch of dataset `indices` for `epoch` (which keys the random
  // transforms), on the CPU, as a worker does; for callers that want one
  // batch without threads.
  Batch make_batch(const std::vector<int64_t>& indices, int64_t epoch) const;

 private:
  struct Epoch;
  struct DeviceStage;
  void stop_epoch();
  void advance();
  Batch fetch(int64_t batch);
  void worker_loop(Epoch* e);
  Tensor allocate(const Shape& shape, DType dtype) const;

  std::shared_ptr<const Dataset> dataset_;
  DataLoaderOptions options_;
  std::shared_ptr<Sampler> sampler_;
  bool pin_ = false;
  int64_t next_epoch_ = 0;
  int64_t next_start_ = 0;  // set_start_batch
  uint64_t generation_ = 0;
  std::unique_ptr<Epoch> epoch_;
  std::unique_ptr<DeviceStage> device_;
  std::shared_ptr<BufferPool> buffers_;
};

}  // namespace ember::data
