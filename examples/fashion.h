// Shared by the single-process examples: Fashion-MNIST as normalised float
// tensors, shuffled mini-batches and test accuracy. (The multi-worker
// DataLoader in data/ is what distributed training uses; these examples keep
// the whole set in memory and slice batches with index_select.)
#pragma once

#include <chrono>
#include <cstdio>
#include <functional>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "data/random.h"
#include "data/readers.h"

namespace ember::examples {

inline constexpr double kFashionMean = 0.2860, kFashionStd = 0.3530;

struct Split {
  Tensor images;  // float32 [N, 1, 28, 28], normalised
  Tensor labels;  // int64 [N]
};

inline Split load_fashion(bool train, const std::string& root = data::kFashionMnistRoot) {
  data::FashionMNIST ds(root, train);
  Tensor x = ds.images().to(DType::Float32) * (1.0 / 255.0);
  return {(x - kFashionMean) / kFashionStd, ds.labels()};
}

// Calls step(x, y) for each shuffled batch of an epoch; the last partial
// batch is kept, as the PyTorch peer does.
// step(x, y, batch_index). Seeded by (seed, epoch): reruns are identical.
inline void for_each_batch(const Split& s, int64_t batch, uint64_t seed, uint64_t epoch,
                           const std::function<void(const Tensor&, const Tensor&, int64_t)>& step) {
  const int64_t n = s.images.size(0);
  Tensor perm = Tensor::empty({n}, DType::Int64);
  int64_t* p = perm.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) p[i] = i;
  data::RandomStream rs(seed, data::StreamKind::Shuffle, epoch, 0);
  for (int64_t i = n - 1; i > 0; --i) std::swap(p[i], p[rs.uniform_int(static_cast<uint64_t>(i + 1))]);
  for (int64_t i = 0, b = 0; i < n; i += batch, ++b) {
    Tensor idx = perm.narrow(0, i, std::min(batch, n - i));
    step(index_select(s.images, 0, idx), index_select(s.labels, 0, idx), b);
  }
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Fraction of `s` classified correctly, in eval mode, without autograd.
template <typename Model>
double accuracy(Model& model, const Split& s, int64_t batch = 1000) {
  NoGradGuard g;
  int64_t correct = 0, n = s.images.size(0);
  for (int64_t i = 0; i < n; i += batch) {
    int64_t len = std::min(batch, n - i);
    Tensor pred = argmax(model(s.images.narrow(0, i, len)), 1);
    correct += static_cast<int64_t>(sum(eq(pred, s.labels.narrow(0, i, len))).item());
  }
  return static_cast<double>(correct) / static_cast<double>(n);
}

}  // namespace ember::examples
