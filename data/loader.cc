// DataLoader: the epoch state machine, the workers, collation and the
// device stage.
//
// Workers claim batch numbers in order from a shared counter (so claims are
// contiguous) and park finished batches, or the exception that stopped them,
// in a map keyed by batch number; the consumer takes batch k when it appears.
// A worker never waits while holding a claimed batch, so joining after a
// stop always finishes, and the consumer can never wait for a batch nobody
// will build: claims may run up to max_ahead past the consumer.
#include "data/loader.h"

#include <condition_variable>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "core/profiler.h"
#include "data/batch_memory.h"
#include "data/random.h"

namespace ember::data {
namespace {

// A built batch, or why it could not be built.
struct Ready {
  Batch batch;
  std::exception_ptr error;
};

// Asks for a contiguous CPU tensor's first 64 KiB to be brought into cache.
void prefetch(const Tensor& t) {
  if (!t.device().is_cpu() || !t.is_contiguous()) return;
  const char* p = static_cast<const char*>(t.raw_data());
  const size_t n = std::min<size_t>(t.nbytes(), 64 << 10);
  for (size_t off = 0; off < n; off += 64) __builtin_prefetch(p + off);
}

void copy_into(const Tensor& src, Tensor& dst) {
  if (src.is_contiguous() && src.device().is_cpu()) {
    std::memcpy(dst.raw_data(), src.raw_data(), src.nbytes());
  } else {
    dst.copy_(src);
  }
}

}  // namespace

struct DataLoader::Epoch {
  int64_t epoch = 0;
  std::vector<int64_t> indices;
  int64_t num_batches = 0;
  int64_t max_ahead = 1;

  std::mutex mu;
  std::condition_variable work_cv;   // workers: a claim became possible, or stop
  std::condition_variable ready_cv;  // consumer: a batch was parked
  int64_t next_claim = 0;            // guarded by mu
  int64_t next_fetch = 0;            // guarded by mu: the batch fetch() returns next
  std::map<int64_t, Ready> ready;    // guarded by mu
  bool stop = false;                 // guarded by mu
  std::vector<std::thread> workers;

  int64_t next_deliver = 0;  // consumer only
  int64_t current = -1;      // the batch in `batch`, -1 when none
  Batch batch;

  std::vector<int64_t> batch_indices(int64_t b, int64_t batch_size) const {
    const int64_t lo = b * batch_size, hi = std::min<int64_t>(lo + batch_size, indices.size());
    return std::vector<int64_t>(indices.begin() + lo, indices.begin() + hi);
  }
};

struct DataLoader::DeviceStage {
  explicit DeviceStage(Device d) : copier(d) {}
  struct Staged {
    int64_t index;
    Ready host;  // error, or the host batch whose copy is queued
    AsyncCopier::Copy copy;
  };
  AsyncCopier copier;
  std::optional<Staged> staged;
};

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, DataLoaderOptions options)
    : dataset_(std::move(dataset)), options_(std::move(options)) {
  EMBER_CHECK(dataset_ != nullptr, "DataLoader: dataset is null");
  EMBER_CHECK(options_.batch_size >= 1, "DataLoader: batch_size must be at least 1, got ", options_.batch_size);
  EMBER_CHECK(options_.num_workers >= 0, "DataLoader: num_workers must be non-negative, got ", options_.num_workers);
  EMBER_CHECK(options_.prefetch_factor >= 1, "DataLoader: prefetch_factor must be at least 1, got ",
              options_.prefetch_factor);
  EMBER_CHECK(!(options_.shuffle && options_.sampler), "DataLoader: shuffle and sampler are mutually exclusive ",
              "(a sampler decides the order; give it shuffle=true instead)");
  if (options_.device.is_cuda())
    EMBER_CHECK(cuda_is_available(), "DataLoader: device ", options_.device,
                " requested but CUDA is unavailable: ", cuda_unavailable_reason());
  sampler_ = options_.sampler;
  if (!sampler_) {
    if (options_.shuffle) sampler_ = std::make_shared<RandomSampler>(dataset_->size(), options_.seed);
    else sampler_ = std::make_shared<SequentialSampler>(dataset_->size());
  }
  pin_ = (options_.pin_memory || options_.device.is_cuda()) && cuda_is_available();
  // Enough for every batch in flight (two buffers each), plus slack for
  // batches the consumer still holds.
  const size_t in_flight = static_cast<size_t>(options_.num_workers) * options_.prefetch_factor + 2;
  buffers_ = BufferPool::create(pin_ ? pinned_allocator() : cpu_allocator(), 2 * in_flight + 8);
  if (options_.device.is_cuda()) device_ = std::make_unique<DeviceStage>(options_.device);
}

DataLoader::~DataLoader() {
  stop_epoch();
  device_.reset();  // waits for copies in flight before their buffers go
}

int64_t DataLoader::size() const {
  const int64_t n = sampler_->size(), bs = options_.batch_size;
  return options_.drop_last ? n / bs : (n + bs - 1) / bs;
}

Tensor DataLoader::allocate(const Shape& shape, DType dtype) const { return buffers_->empty(shape, dtype); }

Batch DataLoader::make_batch(const std::vector<int64_t>& indices, int64_t epoch) const {
  profiler::Scope prof(profiler::Kind::Data, "DataLoader.make_batch");
  prof.arg("batch_size", static_cast<int64_t>(indices.size()));
  const int64_t B = static_cast<int64_t>(indices.size());
  EMBER_CHECK(B > 0, "DataLoader: empty batch");
  auto with_context = [&](const Error& err, int64_t j) {
    // Say which example failed: the message alone rarely can.
    return Error(detail::str_cat("DataLoader: example ", indices[j], " (epoch ", epoch, ", position ", j,
                                 " in its batch): ", err.what()));
  };
  // Examples are fetched one ahead and their bytes prefetched, so that the
  // next (randomly placed) image is on its way from memory while this one
  // is transformed: random access made this loop memory-latency bound. A
  // failed fetch is kept and thrown in its turn.
  Example next;
  std::exception_ptr next_error;
  auto fetch = [&](int64_t j) {
    try {
      next = dataset_->get(indices[j]);
      EMBER_CHECK(next.data.defined(), "the dataset returned an example without data");
      prefetch(next.data);
    } catch (const Error& err) {
      next_error = std::make_exception_ptr(with_context(err, j));
    } catch (...) {
      next_error = std::current_exception();
    }
  };
  Batch out;
  out.indices = indices;
  TensorSpec spec, target_spec;
  bool tensor_targets = false;
  fetch(0);
  for (int64_t j = 0; j < B; ++j) {
    if (next_error) std::rethrow_exception(next_error);
    Example ex = std::move(next);
    if (j + 1 < B) fetch(j + 1);
    const int64_t idx = indices[j];
    try {
      RandomStream rng(options_.seed, StreamKind::Transform, static_cast<uint64_t>(epoch), static_cast<uint64_t>(idx));
      Tensor first;  // example 0's result when only running the transform gives the spec
      if (j == 0) {
        TensorSpec in{ex.data.sizes(), ex.data.dtype()};
        std::optional<TensorSpec> s = options_.transform ? options_.transform->output_spec(in) : in;
        if (!s) {
          first = options_.transform->apply(ex.data, rng);
          s = TensorSpec{first.sizes(), first.dtype()};
        }
        spec = *s;
        Shape shape{B};
        shape.insert(shape.end(), spec.shape.begin(), spec.shape.end());
        out.data = allocate(shape, spec.dtype);
        tensor_targets = ex.target.defined();
        if (tensor_targets) {
          target_spec = {ex.target.sizes(), ex.target.dtype()};
          Shape tshape{B};
          tshape.insert(tshape.end(), target_spec.shape.begin(), target_spec.shape.end());
          out.target = allocate(tshape, target_spec.dtype);
        } else {
          out.target = allocate({B}, DType::Int64);
        }
      }
      Tensor slot = out.data.select(0, j);
      if (first.defined()) {
        copy_into(first, slot);
      } else if (options_.transform) {
        options_.transform->apply_into(ex.data, rng, slot);
      } else {
        EMBER_CHECK(ex.data.sizes() == spec.shape && ex.data.dtype() == spec.dtype, "its data is ",
                    dtype_name(ex.data.dtype()), " ", shape_str(ex.data.sizes()), " but the batch's first example's is ",
                    dtype_name(spec.dtype), " ", shape_str(spec.shape), " (examples must agree to be stacked)");
        copy_into(ex.data, slot);
      }
      EMBER_CHECK(ex.target.defined() == tensor_targets, "its target is ",
                  ex.target.defined() ? "a tensor" : "a class label", " but the batch's first example's is ",
                  tensor_targets ? "a tensor" : "a class label");
      if (tensor_targets) {
        const bool same = ex.target.sizes() == target_spec.shape && ex.target.dtype() == target_spec.dtype;
        EMBER_CHECK(same, "its target is ", dtype_name(ex.target.dtype()), " ", shape_str(ex.target.sizes()),
                    " but the first example's is ", dtype_name(target_spec.dtype), " ",
                    shape_str(target_spec.shape));
        Tensor tslot = out.target.select(0, j);
        copy_into(ex.target, tslot);
      } else {
        out.target.data<int64_t>()[j] = ex.label;
      }
    } catch (const Error& err) {
      throw with_context(err, j);
    }
  }
  return out;
}

void DataLoader::worker_loop(Epoch* e) {
  profiler::set_thread_name("data loader worker");
  for (;;) {
    int64_t b;
    {
      std::unique_lock<std::mutex> lk(e->mu);
      e->work_cv.wait(lk, [&] {
        return e->stop || e->next_claim >= e->num_batches || e->next_claim < e->next_fetch + e->max_ahead;
      });
      if (e->stop || e->next_claim >= e->num_batches) return;
      b = e->next_claim++;
    }
    Ready r;
    try {
      r.batch = make_batch(e->batch_indices(b, options_.batch_size), e->epoch);
    } catch (...) {
      r.error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(e->mu);
      e->ready.emplace(b, std::move(r));
    }
    e->ready_cv.notify_one();
  }
}

void DataLoader::set_start_batch(int64_t batch) {
  EMBER_CHECK(batch >= 0, "DataLoader::set_start_batch: batch ", batch, " is negative");
  next_start_ = batch;
}

DataLoader::Iterator DataLoader::begin() {
  stop_epoch();
  ++generation_;
  auto e = std::make_unique<Epoch>();
  e->epoch = next_epoch_++;
  sampler_->set_epoch(e->epoch);
  e->indices = sampler_->indices();
  // From the indices, not sampler_->size(): a custom sampler may disagree.
  const int64_t n = static_cast<int64_t>(e->indices.size()), bs = options_.batch_size;
  e->num_batches = options_.drop_last ? n / bs : (n + bs - 1) / bs;
  e->max_ahead = static_cast<int64_t>(options_.num_workers) * options_.prefetch_factor;
  e->next_claim = e->next_fetch = e->next_deliver = std::min(next_start_, e->num_batches);
  next_start_ = 0;
  epoch_ = std::move(e);
  try {
    for (int w = 0; w < options_.num_workers && w < epoch_->num_batches; ++w)
      epoch_->workers.emplace_back(&DataLoader::worker_loop, this, epoch_.get());
    advance();
  } catch (...) {
    stop_epoch();
    throw;
  }
  return Iterator(this, generation_);
}

// Stops the workers (each finishes the batch in hand) and drops what they built.
void DataLoader::stop_epoch() {
  if (!epoch_) return;
  {
    std::lock_guard<std::mutex> lk(epoch_->mu);
    epoch_->stop = true;
  }
  epoch_->work_cv.notify_all();
  for (std::thread& t : epoch_->workers) t.join();
  epoch_->workers.clear();
  epoch_->ready.clear();
  epoch_->current = -1;
  epoch_->batch = Batch();
  if (device_ && device_->staged) {
    // Its device memory belongs to our stream while the side stream may
    // still be writing it: order the copy before the memory's next use.
    try {
      if (device_->staged->copy.done) device_->copier.finish(std::move(device_->staged->copy));
    } catch (const Error&) {
      // The device failed; nothing is left to order. (Also: we may be in a destructor.)
    }
    device_->staged.reset();
  }
}

Batch DataLoader::fetch(int64_t k) {
  // On the training thread: the time it waits for (or makes) batch k.
  profiler::Scope prof(profiler::Kind::Data, "DataLoader.next");
  Epoch& e = *epoch_;
  Ready r;
  if (options_.num_workers == 0) {
    e.next_fetch = k + 1;
    try {
      r.batch = make_batch(e.batch_indices(k, options_.batch_size), e.epoch);
    } catch (...) {
      r.error = std::current_exception();
    }
  } else {
    std::unique_lock<std::mutex> lk(e.mu);
    e.ready_cv.wait(lk, [&] { return e.ready.count(k) > 0; });
    auto it = e.ready.find(k);
    r = std::move(it->second);
    e.ready.erase(it);
    e.next_fetch = k + 1;
    lk.unlock();
    e.work_cv.notify_all();
  }
  if (r.error) std::rethrow_exception(r.error);
  return std::move(r.batch);
}

void DataLoader::advance() {
  Epoch& e = *epoch_;
  e.current = -1;
  e.batch = Batch();
  const int64_t k = e.next_deliver;
  if (k >= e.num_batches) {
    stop_epoch();  // all built and taken: the workers have returned
    return;
  }
  try {
    if (!device_) {
      e.batch = fetch(k);
    } else {
      // Queues the copy of batch i, or keeps the error it failed with for
      // when it is due.
      auto stage = [&](int64_t i) {
        DeviceStage::Staged s{i, {}, {}};
        try {
          s.host.batch = fetch(i);
          s.copy = device_->copier.start({s.host.batch.data, s.host.batch.target});
        } catch (...) {
          s.host.error = std::current_exception();
        }
        return s;
      };
      std::optional<DeviceStage::Staged>& staged = device_->staged;
      DeviceStage::Staged now = staged && staged->index == k ? std::move(*staged) : stage(k);
      staged.reset();
      // Start the next batch's copy before handing this one over, so it runs
      // while the caller computes on this one. With workers, only if it is
      // already built: waiting for it would delay this batch.
      if (k + 1 < e.num_batches) {
        bool built = options_.num_workers == 0;
        if (!built) {
          std::lock_guard<std::mutex> lk(e.mu);
          built = e.ready.count(k + 1) > 0;
        }
        if (built) staged = stage(k + 1);
      }
      if (now.host.error) std::rethrow_exception(now.host.error);
      std::vector<Tensor> on_device = device_->copier.finish(std::move(now.copy));
      e.batch.indices = std::move(now.host.batch.indices);
      e.batch.data = on_device[0];
      e.batch.target = on_device[1];
    }
  } catch (...) {
    stop_epoch();  // a failed batch ends the epoch
    throw;
  }
  e.current = k;
  e.next_deliver = k + 1;
}

Batch& DataLoader::Iterator::operator*() const {
  EMBER_CHECK(position() >= 0, "DataLoader::Iterator: dereferencing the end of an epoch (or of an epoch that a ",
              "later begin() replaced)");
  return loader_->epoch_->batch;
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  EMBER_CHECK(position() >= 0, "DataLoader::Iterator: incrementing past the end of an epoch");
  loader_->advance();
  return *this;
}

int64_t DataLoader::Iterator::position() const {
  if (loader_ == nullptr || loader_->generation_ != generation_ || !loader_->epoch_) return -1;
  return loader_->epoch_->current;
}

}  // namespace ember::data
