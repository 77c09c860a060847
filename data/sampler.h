// Samplers: which dataset indices an epoch visits, in what order.
//
//   data::DistributedSampler s(dataset->size(), world_size, rank, /*shuffle=*/true, /*seed=*/0);
//   s.set_epoch(epoch);                   // a new order each epoch
//   std::vector<int64_t> mine = s.indices();
//
// Orders are pure functions of (seed, epoch): no hidden generator state, so
// state() (seed and epoch) is all a checkpoint needs to resume the same
// sequence. A DataLoader owns the epoch of the sampler it is given: it calls
// set_epoch() before each pass (see DataLoader::set_epoch).
#pragma once

#include <cstdint>
#include <vector>

namespace ember::data {

struct SamplerState {
  uint64_t seed = 0;
  int64_t epoch = 0;
  bool operator==(const SamplerState&) const = default;
};

class Sampler {
 public:
  virtual ~Sampler() = default;
  // This epoch's indices, in visiting order.
  virtual std::vector<int64_t> indices() const = 0;
  // How many indices() returns.
  virtual int64_t size() const = 0;

  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }
  uint64_t seed() const { return seed_; }
  SamplerState state() const { return {seed_, epoch_}; }
  void load_state(const SamplerState& s) {
    seed_ = s.seed;
    epoch_ = s.epoch;
  }

 protected:
  explicit Sampler(uint64_t seed = 0) : seed_(seed) {}
  uint64_t seed_ = 0;
  int64_t epoch_ = 0;
};

// 0, 1, ..., n-1 every epoch.
class SequentialSampler : public Sampler {
 public:
  explicit SequentialSampler(int64_t n);
  std::vector<int64_t> indices() const override;
  int64_t size() const override { return n_; }

 private:
  int64_t n_;
};

// A permutation of 0..n-1 drawn from seed + epoch (so each epoch differs and
// a seed reproduces the run).
class RandomSampler : public Sampler {
 public:
  explicit RandomSampler(int64_t n, uint64_t seed = 0);
  std::vector<int64_t> indices() const override;
  int64_t size() const override { return n_; }

 private:
  int64_t n_;
};

// torch.utils.data.DistributedSampler's semantics, rule for rule:
//  - shuffle: a permutation seeded by seed + epoch, the same on every rank
//    (all ranks must use the same seed); otherwise 0..n-1;
//  - drop_last = false: num_samples = ceil(n / R); the list is padded to
//    total_size = num_samples * R by repeating it from its start;
//  - drop_last = true: num_samples = floor(n / R); the tail is dropped;
//  - rank r takes list[r], list[r + R], ..., list[total_size - R + r].
// So within an epoch the ranks' indices are disjoint (but for the padding
// repeats) and together cover the dataset (minus the dropped tail), and every
// rank gets exactly num_samples. The permutation itself differs from
// PyTorch's, which comes from torch.randperm's generator.
class DistributedSampler : public Sampler {
 public:
  DistributedSampler(int64_t n, int64_t num_replicas, int64_t rank, bool shuffle = true, uint64_t seed = 0,
                     bool drop_last = false);
  std::vector<int64_t> indices() const override;
  int64_t size() const override { return num_samples_; }
  int64_t num_replicas() const { return num_replicas_; }
  int64_t rank() const { return rank_; }
  int64_t total_size() const { return num_samples_ * num_replicas_; }

 private:
  int64_t n_, num_replicas_, rank_;
  bool shuffle_, drop_last_;
  int64_t num_samples_;
};

}  // namespace ember::data
