// Sampler implementations.
#include "data/sampler.h"

#include <numeric>

#include "core/exception.h"
#include "data/random.h"

namespace ember::data {

SequentialSampler::SequentialSampler(int64_t n) : n_(n) {
  EMBER_CHECK(n >= 0, "SequentialSampler: negative dataset size ", n);
}

std::vector<int64_t> SequentialSampler::indices() const {
  std::vector<int64_t> v(n_);
  std::iota(v.begin(), v.end(), int64_t{0});
  return v;
}

RandomSampler::RandomSampler(int64_t n, uint64_t seed) : Sampler(seed), n_(n) {
  EMBER_CHECK(n >= 0, "RandomSampler: negative dataset size ", n);
}

// seed + epoch, as DistributedSampler: (seed 0, epoch 1) and (seed 1, epoch 0)
// give the same order, which is PyTorch's rule too.
std::vector<int64_t> RandomSampler::indices() const { return randperm(n_, seed_ + epoch_, 0); }

DistributedSampler::DistributedSampler(int64_t n, int64_t num_replicas, int64_t rank, bool shuffle, uint64_t seed,
                                       bool drop_last)
    : Sampler(seed), n_(n), num_replicas_(num_replicas), rank_(rank), shuffle_(shuffle), drop_last_(drop_last) {
  EMBER_CHECK(n >= 0, "DistributedSampler: negative dataset size ", n);
  EMBER_CHECK(num_replicas >= 1, "DistributedSampler: num_replicas must be at least 1, got ", num_replicas);
  EMBER_CHECK(rank >= 0 && rank < num_replicas, "DistributedSampler: invalid rank ", rank,
              ", rank should be in the interval [0, ", num_replicas - 1, "]");
  // PyTorch writes ceil((n - R) / R) for the drop_last case; for n not a
  // multiple of R that is floor(n / R), and for a multiple it is n / R too.
  num_samples_ = drop_last ? n / num_replicas : (n + num_replicas - 1) / num_replicas;
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> list;
  if (shuffle_) {
    list = randperm(n_, seed_ + epoch_, 0);
  } else {
    list.resize(n_);
    std::iota(list.begin(), list.end(), int64_t{0});
  }
  const int64_t total = total_size();
  // Padding repeats the list from its start, wrapping as often as needed
  // when n < R (PyTorch's `indices * ceil(padding / n)`).
  for (int64_t i = n_; i < total; ++i) list.push_back(list[i - n_]);
  std::vector<int64_t> mine;
  mine.reserve(num_samples_);
  for (int64_t i = rank_; i < total; i += num_replicas_) mine.push_back(list[i]);
  return mine;
}

}  // namespace ember::data
