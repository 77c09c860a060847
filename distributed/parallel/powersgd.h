// PowerSGD gradient compression for DDP (Vogels, Karimireddy and Jaggi,
// "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
// Optimization", NeurIPS 2019), with PyTorch's powerSGD_hook semantics:
//
//   auto state = std::make_shared<distributed::PowerSGDState>(
//       distributed::PowerSGDOptions{.matrix_approximation_rank = 2, .start_powerSGD_iter = 100});
//   distributed::DDPOptions o;
//   o.comm_hook = distributed::powerSGD_hook(state);
//
// Per bucket, once start_powerSGD_iter steps have run uncompressed:
//  1. error feedback: the bucket gets the error the last compression left
//     (added before, kept as "what was meant minus what was sent" after);
//  2. each gradient is viewed as an n x m matrix (its first dimension by the
//     rest); it is compressed when (n + m) * r * min_compression_rate < n * m
//     with r = min(n, m, rank); the others (biases, small layers) are
//     allreduced whole, in one flat tensor;
//  3. for each compressed M: P = M Q (Q is m x r: random the first time, the
//     last step's Q after that: warm start), allreduce the Ps, orthogonalize
//     them (Gram-Schmidt), Q = M^T P, allreduce the Qs, M = P Q^T / world.
// So an n x m gradient costs r (n + m) numbers on the wire instead of n m.
// Q's random start comes from our generator (seeded with random_seed, the
// same on every rank), not torch's; everything else is PyTorch's
// arithmetic. The first allreduce (the uncompressed tensors and the Ps)
// overlaps the rest of backward; the Q allreduce runs when DDP waits for
// the bucket (the end of backward).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "core/ops.h"
#include "distributed/parallel/ddp.h"

namespace ember::distributed {

struct PowerSGDOptions {
  int matrix_approximation_rank = 1;  // r
  // Steps of plain allreduce first (torch's default; an accuracy safeguard:
  // compression from the first step hurts, Vogels et al. section 4).
  int64_t start_powerSGD_iter = 1000;
  // Compress a matrix only if that shrinks it by more than this factor.
  double min_compression_rate = 2;
  bool use_error_feedback = true;
  bool warm_start = true;
  // Added to each column's norm in Gram-Schmidt (0: none, torch's default).
  double orthogonalization_epsilon = 0;
  uint64_t random_seed = 0;
};

// The hook's state across steps (torch's PowerSGDState): per bucket index
// the error and the P and Q memories; the step count.
class PowerSGDState {
 public:
  explicit PowerSGDState(PowerSGDOptions options = {});
  const PowerSGDOptions& options() const { return options_; }
  // Steps whose last bucket has been reduced.
  int64_t iter() const;
  // Elements of the gradients seen so far, as they are and as sent
  // (torch's compression_stats): their ratio is the compression rate.
  struct Stats {
    int64_t numel_before = 0, numel_after = 0;
    double rate() const { return numel_after > 0 ? double(numel_before) / double(numel_after) : 1.0; }
  };
  Stats stats() const;
  // For tests: Q's first value for a compressed gradient of `n` x `m` in
  // bucket `bucket` (an m x r tensor) instead of a random one.
  std::function<Tensor(int bucket, int64_t n, int64_t m, int rank)> initial_q;

 private:
  friend struct PowerSGDStep;
  struct Bucket {
    Tensor error, p, q;
  };
  PowerSGDOptions options_;
  mutable std::mutex mu_;
  std::map<int, Bucket> buckets_;
  int64_t iter_ = 0;
  Stats stats_;
  Generator gen_;
};

CommHook powerSGD_hook(std::shared_ptr<PowerSGDState> state);

// Gram-Schmidt on the columns of `m` (n x r, n >= r), in place: each
// column divided by its norm (+ epsilon), then removed from the columns
// after it. torch's _orthogonalize_gram_schmidt.
void orthogonalize_columns(const Tensor& m, double epsilon = 0);

}  // namespace ember::distributed
