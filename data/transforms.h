// Per-example transforms on [C,H,W] images, composable, reproducible.
//
//   auto tf = data::compose({data::random_crop(28, /*padding=*/2), data::random_horizontal_flip(),
//                            data::to_float(), data::normalize({0.2860}, {0.3530})});
//   Tensor y = tf->apply(image, rng);   // rng: the example's RandomStream
//
// Randomness comes only from the RandomStream passed in; the DataLoader
// derives it from (seed, epoch, dataset index), so a batch's contents do not
// depend on which worker built it.
//
// Two kinds of transform can be fused: geometric ones (crops, flips) map each
// output pixel to an input pixel or to a fill value; pointwise ones (to_float,
// normalize) are a per-channel y = a*x + b. A Compose whose filling steps
// agree on their fill runs its whole chain as one pass per example, from the
// uint8 source straight into the batch tensor (apply_into). Anything else
// (lambda) runs step by step, on tensors.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "core/tensor.h"
#include "data/random.h"

namespace ember::data {

// What a transform produces for a given input: shape and dtype.
struct TensorSpec {
  Shape shape;
  DType dtype = DType::Float32;
  bool operator==(const TensorSpec&) const = default;
};

class Transform {
 public:
  virtual ~Transform() = default;
  // For error messages.
  virtual const char* name() const = 0;
  // The transformed example; `x` is not modified.
  virtual Tensor apply(const Tensor& x, RandomStream& rng) const = 0;
  // The result's spec for an input spec, or nullopt when only running the
  // transform can tell (lambda). Throws if the input cannot be transformed.
  virtual std::optional<TensorSpec> output_spec(const TensorSpec& in) const = 0;
  // Writes apply(x, rng) into `out`, a contiguous CPU tensor of exactly the
  // result's spec. Compose overrides it to skip intermediate tensors.
  virtual void apply_into(const Tensor& x, RandomStream& rng, Tensor& out) const;
};
using TransformPtr = std::shared_ptr<const Transform>;

// Maps one output axis to the input axis: in = sign * out + offset, valid
// while 0 <= in < size. sign is +1 or -1.
struct AxisMap {
  int64_t sign = 1, offset = 0;
};

// Crops, flips: every output pixel comes from an input pixel of the same
// channel, or is `fill` where it falls outside the input (padding).
class GeometricTransform : public Transform {
 public:
  Tensor apply(const Tensor& x, RandomStream& rng) const override;
  std::optional<TensorSpec> output_spec(const TensorSpec& in) const override;
  // Output [H, W] for input [H, W] (checks that the transform applies).
  virtual std::pair<int64_t, int64_t> output_hw(int64_t h, int64_t w) const = 0;
  // This example's maps, drawing from `rng` (always the same number of draws).
  virtual void draw(int64_t h, int64_t w, RandomStream& rng, AxisMap& y, AxisMap& x) const = 0;
  // Whether some output pixels can fall outside the input, and what they get.
  virtual bool can_fill() const { return false; }
  virtual double fill() const { return 0.0; }
};

// y[c] = scale[c] * x[c] + shift[c], possibly changing dtype (to_float).
class PointwiseTransform : public Transform {
 public:
  Tensor apply(const Tensor& x, RandomStream& rng) const override;
  std::optional<TensorSpec> output_spec(const TensorSpec& in) const override;
  // Checks that an input of `in` is accepted; returns the output dtype.
  virtual DType output_dtype(const TensorSpec& in) const = 0;
  // The affine map for `channels` channels (float arithmetic).
  virtual void affine(int64_t channels, std::vector<float>& scale, std::vector<float>& shift) const = 0;
};

// Pads by `padding` on every side with `fill`, then crops a size x size (or
// height x width) window at a uniformly random position, as
// torchvision.transforms.RandomCrop(size, padding, fill=fill).
class RandomCrop : public GeometricTransform {
 public:
  const char* name() const override { return "RandomCrop"; }
  RandomCrop(int64_t height, int64_t width, int64_t padding = 0, double fill = 0.0);
  std::pair<int64_t, int64_t> output_hw(int64_t h, int64_t w) const override;
  void draw(int64_t h, int64_t w, RandomStream& rng, AxisMap& y, AxisMap& x) const override;
  bool can_fill() const override { return padding_ > 0; }
  double fill() const override { return fill_; }

 private:
  int64_t height_, width_, padding_;
  double fill_;
};

// The central height x width window (torchvision's rounding of the offset).
class CenterCrop : public GeometricTransform {
 public:
  const char* name() const override { return "CenterCrop"; }
  CenterCrop(int64_t height, int64_t width) : height_(height), width_(width) {}
  std::pair<int64_t, int64_t> output_hw(int64_t h, int64_t w) const override;
  void draw(int64_t h, int64_t w, RandomStream& rng, AxisMap& y, AxisMap& x) const override;

 private:
  int64_t height_, width_;
};

// Mirrors left-right with probability p.
class RandomHorizontalFlip : public GeometricTransform {
 public:
  const char* name() const override { return "RandomHorizontalFlip"; }
  explicit RandomHorizontalFlip(double p = 0.5) : p_(p) {}
  std::pair<int64_t, int64_t> output_hw(int64_t h, int64_t w) const override { return {h, w}; }
  void draw(int64_t h, int64_t w, RandomStream& rng, AxisMap& y, AxisMap& x) const override;

 private:
  double p_;
};

// uint8 [0, 255] -> float32 [0, 1] (torchvision's ToTensor scaling).
class ToFloat : public PointwiseTransform {
 public:
  const char* name() const override { return "ToFloat"; }
  DType output_dtype(const TensorSpec& in) const override;
  void affine(int64_t channels, std::vector<float>& scale, std::vector<float>& shift) const override;
};

// (x - mean[c]) / std[c] on float32; one mean/std value applies to every channel.
class Normalize : public PointwiseTransform {
 public:
  const char* name() const override { return "Normalize"; }
  Normalize(std::vector<double> mean, std::vector<double> std);
  DType output_dtype(const TensorSpec& in) const override;
  void affine(int64_t channels, std::vector<float>& scale, std::vector<float>& shift) const override;

 private:
  std::vector<double> mean_, std_;
};

// Any function of (example, rng); unfusable.
class Lambda : public Transform {
 public:
  const char* name() const override { return "Lambda"; }
  using Fn = std::function<Tensor(const Tensor&, RandomStream&)>;
  explicit Lambda(Fn fn) : fn_(std::move(fn)) {}
  Tensor apply(const Tensor& x, RandomStream& rng) const override { return fn_(x, rng); }
  std::optional<TensorSpec> output_spec(const TensorSpec&) const override { return std::nullopt; }

 private:
  Fn fn_;
};

// Runs its steps in order (nested Composes are flattened).
class Compose : public Transform {
 public:
  const char* name() const override { return "Compose"; }
  explicit Compose(std::vector<TransformPtr> steps);
  Tensor apply(const Tensor& x, RandomStream& rng) const override;
  std::optional<TensorSpec> output_spec(const TensorSpec& in) const override;
  void apply_into(const Tensor& x, RandomStream& rng, Tensor& out) const override;
  const std::vector<TransformPtr>& steps() const { return steps_; }
  // Whether apply_into runs as one fused pass.
  bool fused() const { return fused_; }

 private:
  struct Plan;
  const Plan& plan_for(const Tensor& x) const;
  std::vector<TransformPtr> steps_;
  // Step i as its fusable kind (one of the two non-null when fused_).
  std::vector<const GeometricTransform*> geometric_;
  std::vector<const PointwiseTransform*> pointwise_;
  bool fused_ = false;
  uint64_t id_;  // tells our cached plans from those of a Compose that lived at the same address
};

// Shorthands returning TransformPtr.
TransformPtr random_crop(int64_t size, int64_t padding = 0, double fill = 0.0);
TransformPtr center_crop(int64_t size);
TransformPtr random_horizontal_flip(double p = 0.5);
TransformPtr to_float();
TransformPtr normalize(std::vector<double> mean, std::vector<double> std);
TransformPtr lambda(Lambda::Fn fn);
std::shared_ptr<const Compose> compose(std::vector<TransformPtr> steps);

}  // namespace ember::data
