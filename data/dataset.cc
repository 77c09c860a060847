// TensorDataset and SyntheticImages.
#include "data/dataset.h"

#include <algorithm>
#include <cmath>

#include "data/random.h"

namespace ember::data {

TensorDataset::TensorDataset(Tensor data, Tensor targets) {
  EMBER_CHECK(data.defined() && data.dim() >= 1, "TensorDataset: data must be a tensor of at least 1 dim [N, ...]");
  EMBER_CHECK(data.device().is_cpu(), "TensorDataset: data must be on the CPU, got ", data.device());
  // Contiguous, so each example is one run of bytes the loader can memcpy.
  data_ = data.contiguous();
  if (targets.defined()) {
    EMBER_CHECK(targets.dim() >= 1 && targets.size(0) == data.size(0), "TensorDataset: data has ", data.size(0),
                " examples but targets has shape ", shape_str(targets.sizes()));
    EMBER_CHECK(targets.device().is_cpu(), "TensorDataset: targets must be on the CPU, got ", targets.device());
    targets_ = targets.contiguous();
    if (targets_.dim() == 1 && targets_.dtype() == DType::Int64) labels_ = targets_.data<int64_t>();
  }
}

Example TensorDataset::get(int64_t index) const {
  EMBER_CHECK(index >= 0 && index < size(), "TensorDataset: index ", index, " out of range for ", size(),
              " examples");
  Example e;
  e.data = data_.select(0, index);
  if (labels_ != nullptr) {
    e.label = labels_[index];
  } else if (targets_.defined()) {
    e.target = targets_.select(0, index);
  }
  return e;
}

SyntheticImages::SyntheticImages(int64_t size, Shape image_shape, int64_t num_classes, uint64_t seed, int noise)
    : size_(size), num_classes_(num_classes), shape_(std::move(image_shape)), seed_(seed), noise_(noise) {
  EMBER_CHECK(size >= 0, "SyntheticImages: negative size ", size);
  EMBER_CHECK(num_classes >= 1, "SyntheticImages: need at least one class, got ", num_classes);
  EMBER_CHECK(shape_.size() == 3 && shape_[0] > 0 && shape_[1] > 0 && shape_[2] > 0,
              "SyntheticImages: image shape must be [C,H,W] with positive sizes, got ", shape_str(shape_));
  EMBER_CHECK(noise >= 0 && noise <= 127, "SyntheticImages: noise must be in [0, 127], got ", noise);
  const int64_t C = shape_[0], H = shape_[1], W = shape_[2];
  templates_.resize(num_classes * C * H * W);
  for (int64_t k = 0; k < num_classes; ++k) {
    // Each class gets its own stripe orientation and frequency; channels
    // differ in phase so colour carries signal too.
    const double theta = M_PI * static_cast<double>(k) / static_cast<double>(num_classes);
    const double freq = 2.0 + static_cast<double>(k % 3);
    uint8_t* t = templates_.data() + k * C * H * W;
    for (int64_t c = 0; c < C; ++c)
      for (int64_t y = 0; y < H; ++y)
        for (int64_t x = 0; x < W; ++x) {
          double u = (x * std::cos(theta) / W + y * std::sin(theta) / H) * freq;
          double v = 128.0 + 80.0 * std::sin(2.0 * M_PI * u + c * M_PI / 3.0);
          t[(c * H + y) * W + x] = static_cast<uint8_t>(std::lround(v));
        }
  }
}

int64_t SyntheticImages::label(int64_t index) const {
  RandomStream rng(seed_, StreamKind::Synthetic, static_cast<uint64_t>(index), 0);
  return static_cast<int64_t>(rng.uniform_int(static_cast<uint64_t>(num_classes_)));
}

Example SyntheticImages::get(int64_t index) const {
  EMBER_CHECK(index >= 0 && index < size_, "SyntheticImages: index ", index, " out of range for ", size_,
              " examples");
  Example e;
  e.label = label(index);
  e.data = Tensor::empty(shape_, DType::UInt8);
  const int64_t n = shape_numel(shape_);
  const uint8_t* t = templates_.data() + e.label * n;
  uint8_t* out = e.data.data<uint8_t>();
  RandomStream rng(seed_, StreamKind::Synthetic, static_cast<uint64_t>(index), 1);
  const int span = 2 * noise_ + 1;
  for (int64_t i = 0; i < n; i += 4) {
    uint32_t r = rng.next_u32();
    for (int64_t j = i; j < std::min(n, i + 4); ++j, r >>= 8) {
      // (r & 255) * span >> 8 is uniform enough for noise and avoids a divide.
      int v = t[j] + static_cast<int>(((r & 255u) * span) >> 8) - noise_;
      out[j] = static_cast<uint8_t>(std::clamp(v, 0, 255));
    }
  }
  return e;
}

}  // namespace ember::data
