// Datasets: random access to examples by index, as torch.utils.data.Dataset.
//
//   auto ds = std::make_shared<data::TensorDataset>(images, labels);  // [N,...], int64 [N]
//   data::Example e = ds->get(3);  // e.data: a view of images[3]; e.label: labels[3]
//
// get() must be safe to call from several threads at once (the DataLoader's
// workers do). In-memory datasets return views, never copies: the loader
// reads the bytes straight into the batch.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"

namespace ember::data {

// One example. A classification target is `label`; any other target (a box,
// a mask, a regression value) is `target`, and `label` is then unused.
struct Example {
  Tensor data;
  int64_t label = 0;
  Tensor target;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  // Example `index` in [0, size()). Throws ember::Error when out of range.
  virtual Example get(int64_t index) const = 0;
};

// Examples are slices along dim 0 of in-memory CPU tensors. `targets` is
// int64 [N] (class labels), any other [N, ...] tensor (tensor targets), or
// undefined (no targets: every label is 0).
class TensorDataset : public Dataset {
 public:
  explicit TensorDataset(Tensor data, Tensor targets = Tensor());
  int64_t size() const override { return data_.size(0); }
  Example get(int64_t index) const override;
  const Tensor& data() const { return data_; }
  const Tensor& targets() const { return targets_; }

 private:
  Tensor data_, targets_;
  const int64_t* labels_ = nullptr;  // targets_ as class labels, if they are
};

// Images of any shape and class count, generated on the fly and
// deterministic for a seed: example i's class is drawn from (seed, i) and its
// pixels are a class-specific stripe pattern (orientation and frequency set
// by the class) plus per-example noise, so a model can learn it. uint8
// [C,H,W], like decoded real images; for throughput benchmarks.
class SyntheticImages : public Dataset {
 public:
  SyntheticImages(int64_t size, Shape image_shape, int64_t num_classes, uint64_t seed = 0, int noise = 48);
  int64_t size() const override { return size_; }
  Example get(int64_t index) const override;
  int64_t label(int64_t index) const;
  int64_t num_classes() const { return num_classes_; }

 private:
  int64_t size_, num_classes_;
  Shape shape_;
  uint64_t seed_;
  int noise_;
  std::vector<uint8_t> templates_;  // [num_classes, C*H*W]
};

}  // namespace ember::data
