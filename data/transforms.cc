// Transforms and the fused crop/flip/convert/normalize kernel.
//
// A chain of geometric steps composes into one AxisMap per axis plus the
// range of output coordinates that land inside every step's input (outside
// it, the pixel is the fill value); a chain of pointwise steps composes into
// one per-channel a*x + b. The kernel then walks each output row once:
// fill on the left, a contiguous (or, flipped, reversed) run of source
// pixels, fill on the right. That is the whole per-example cost.
#include "data/transforms.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "core/ops.h"

namespace ember::data {
namespace {

// The composed geometry of a chain, from output coords to source coords.
struct Geometry {
  int64_t C = 0, H = 0, W = 0;    // source
  int64_t OH = 0, OW = 0;         // output
  AxisMap y, x;                   // source coord = sign * out + offset
  int64_t y_lo = 0, y_hi = 0, x_lo = 0, x_hi = 0;  // valid output range
};

struct Stage {
  const GeometricTransform* t = nullptr;
  int64_t in_h = 0, in_w = 0;
  AxisMap y, x;
};

// Stage k's maps are drawn in chain order (the draw order apply() uses);
// then composed from the last stage back to the source.
Geometry compose_geometry(int64_t C, int64_t H, int64_t W, const Stage* stages, size_t n, int64_t OH, int64_t OW) {
  Geometry g{C, H, W, OH, OW, {}, {}, 0, OH, 0, OW};
  auto narrow = [](AxisMap& m, const AxisMap& step, int64_t in_size, int64_t& lo, int64_t& hi) {
    m = {step.sign * m.sign, step.sign * m.offset + step.offset};
    // Keep the outputs o with 0 <= m.sign * o + m.offset < in_size.
    if (m.sign == 1) {
      lo = std::max(lo, -m.offset);
      hi = std::min(hi, in_size - m.offset);
    } else {
      lo = std::max(lo, m.offset - in_size + 1);
      hi = std::min(hi, m.offset + 1);
    }
  };
  for (size_t k = n; k-- > 0;) {
    narrow(g.y, stages[k].y, stages[k].in_h, g.y_lo, g.y_hi);
    narrow(g.x, stages[k].x, stages[k].in_w, g.x_lo, g.x_hi);
  }
  g.y_hi = std::max(g.y_lo, g.y_hi);
  g.x_hi = std::max(g.x_lo, g.x_hi);
  return g;
}

// Affine per channel, or none (a pure copy); `fill` per channel.
struct Pointwise {
  bool identity = true;
  std::vector<float> scale, shift, fill;
};

template <typename In, typename Out>
void remap(const Geometry& g, const Pointwise& pw, const In* src, Out* dst) {
  for (int64_t c = 0; c < g.C; ++c) {
    const float a = pw.identity ? 1.f : pw.scale[c], b = pw.identity ? 0.f : pw.shift[c];
    const Out fill = static_cast<Out>(pw.fill[c]);
    for (int64_t oy = 0; oy < g.OH; ++oy) {
      Out* row = dst + (c * g.OH + oy) * g.OW;
      if (oy < g.y_lo || oy >= g.y_hi) {
        std::fill(row, row + g.OW, fill);
        continue;
      }
      const In* srow = src + (c * g.H + g.y.sign * oy + g.y.offset) * g.W + g.x.offset;
      std::fill(row, row + g.x_lo, fill);
      std::fill(row + g.x_hi, row + g.OW, fill);
      if (pw.identity) {
        if constexpr (std::is_same_v<In, Out>) {
          if (g.x.sign == 1) {
            std::memcpy(row + g.x_lo, srow + g.x_lo, (g.x_hi - g.x_lo) * sizeof(Out));
          } else {
            for (int64_t ox = g.x_lo; ox < g.x_hi; ++ox) row[ox] = srow[-ox];
          }
        }
      } else if constexpr (std::is_same_v<Out, float>) {
        if (g.x.sign == 1) {
          for (int64_t ox = g.x_lo; ox < g.x_hi; ++ox) row[ox] = static_cast<float>(srow[ox]) * a + b;
        } else {
          for (int64_t ox = g.x_lo; ox < g.x_hi; ++ox) row[ox] = static_cast<float>(srow[-ox]) * a + b;
        }
      }
    }
  }
}

void check_image(const Transform& t, const TensorSpec& in) {
  EMBER_CHECK(in.shape.size() == 3, t.name(), ": expected a [C,H,W] image, got shape ", shape_str(in.shape));
}

Tensor contiguous_cpu(const Tensor& x, const Transform& t) {
  EMBER_CHECK(x.defined() && x.device().is_cpu(), t.name(), ": expected a CPU tensor");
  return x.contiguous();
}

}  // namespace

void Transform::apply_into(const Tensor& x, RandomStream& rng, Tensor& out) const {
  Tensor y = apply(x, rng);
  EMBER_CHECK(y.sizes() == out.sizes() && y.dtype() == out.dtype(), name(), ": produced ", dtype_name(y.dtype()),
              " ", shape_str(y.sizes()), " where ", dtype_name(out.dtype()), " ", shape_str(out.sizes()),
              " was expected");
  if (y.is_contiguous() && y.device().is_cpu()) {
    std::memcpy(out.raw_data(), y.raw_data(), y.nbytes());
  } else {
    out.copy_(y);
  }
}

// ---- Geometric ----

std::optional<TensorSpec> GeometricTransform::output_spec(const TensorSpec& in) const {
  check_image(*this, in);
  auto [h, w] = output_hw(in.shape[1], in.shape[2]);
  return TensorSpec{{in.shape[0], h, w}, in.dtype};
}

Tensor GeometricTransform::apply(const Tensor& x_in, RandomStream& rng) const {
  Tensor x = contiguous_cpu(x_in, *this);
  TensorSpec out_spec = *output_spec({x.sizes(), x.dtype()});
  const int64_t C = x.size(0), H = x.size(1), W = x.size(2);
  Stage s{this, H, W, {}, {}};
  draw(H, W, rng, s.y, s.x);
  Geometry g = compose_geometry(C, H, W, &s, 1, out_spec.shape[1], out_spec.shape[2]);
  Pointwise pw;
  pw.fill.assign(C, fill());
  Tensor out = Tensor::empty(out_spec.shape, x.dtype());
  EMBER_DISPATCH_ALL(x.dtype(), name(), [&] { remap<scalar_t, scalar_t>(g, pw, x.data<scalar_t>(), out.data<scalar_t>()); });
  return out;
}

RandomCrop::RandomCrop(int64_t height, int64_t width, int64_t padding, double fill)
    : height_(height), width_(width), padding_(padding), fill_(fill) {
  EMBER_CHECK(height > 0 && width > 0, "RandomCrop: size must be positive, got ", height, "x", width);
  EMBER_CHECK(padding >= 0, "RandomCrop: padding must be non-negative, got ", padding);
}

std::pair<int64_t, int64_t> RandomCrop::output_hw(int64_t h, int64_t w) const {
  EMBER_CHECK(h + 2 * padding_ >= height_ && w + 2 * padding_ >= width_, "RandomCrop: crop ", height_, "x", width_,
              " is larger than the padded input ", h + 2 * padding_, "x", w + 2 * padding_, " (input ", h, "x", w,
              ", padding ", padding_, ")");
  return {height_, width_};
}

void RandomCrop::draw(int64_t h, int64_t w, RandomStream& rng, AxisMap& y, AxisMap& x) const {
  // The window's corner in the padded image, shifted back into the input's
  // coordinates; torchvision draws the top before the left too.
  int64_t top = static_cast<int64_t>(rng.uniform_int(h + 2 * padding_ - height_ + 1));
  int64_t left = static_cast<int64_t>(rng.uniform_int(w + 2 * padding_ - width_ + 1));
  y = {1, top - padding_};
  x = {1, left - padding_};
}

std::pair<int64_t, int64_t> CenterCrop::output_hw(int64_t h, int64_t w) const {
  EMBER_CHECK(height_ > 0 && width_ > 0 && height_ <= h && width_ <= w, "CenterCrop: crop ", height_, "x", width_,
              " does not fit in the input ", h, "x", w);
  return {height_, width_};
}

void CenterCrop::draw(int64_t h, int64_t w, RandomStream&, AxisMap& y, AxisMap& x) const {
  // Python's round() (half to even), as torchvision.
  y = {1, static_cast<int64_t>(std::nearbyint((h - height_) / 2.0))};
  x = {1, static_cast<int64_t>(std::nearbyint((w - width_) / 2.0))};
}

void RandomHorizontalFlip::draw(int64_t h, int64_t w, RandomStream& rng, AxisMap& y, AxisMap& x) const {
  bool flip = rng.uniform01() < p_;
  y = {1, 0};
  x = flip ? AxisMap{-1, w - 1} : AxisMap{1, 0};
}

// ---- Pointwise ----

std::optional<TensorSpec> PointwiseTransform::output_spec(const TensorSpec& in) const {
  check_image(*this, in);
  return TensorSpec{in.shape, output_dtype(in)};
}

Tensor PointwiseTransform::apply(const Tensor& x_in, RandomStream&) const {
  Tensor x = contiguous_cpu(x_in, *this);
  TensorSpec spec = *output_spec({x.sizes(), x.dtype()});
  EMBER_INTERNAL_ASSERT(spec.dtype == DType::Float32);
  const int64_t C = x.size(0), n = x.size(1) * x.size(2);
  std::vector<float> scale, shift;
  affine(C, scale, shift);
  Tensor out = Tensor::empty(spec.shape, spec.dtype);
  float* o = out.data<float>();
  auto run = [&](auto* src) {
    for (int64_t c = 0; c < C; ++c)
      for (int64_t i = 0; i < n; ++i) o[c * n + i] = static_cast<float>(src[c * n + i]) * scale[c] + shift[c];
  };
  if (x.dtype() == DType::UInt8) run(x.data<uint8_t>()); else run(x.data<float>());
  return out;
}

DType ToFloat::output_dtype(const TensorSpec& in) const {
  EMBER_CHECK(in.dtype == DType::UInt8, "ToFloat: expected a uint8 image, got ", dtype_name(in.dtype));
  return DType::Float32;
}

void ToFloat::affine(int64_t channels, std::vector<float>& scale, std::vector<float>& shift) const {
  scale.assign(channels, 1.f / 255.f);
  shift.assign(channels, 0.f);
}

Normalize::Normalize(std::vector<double> mean, std::vector<double> std) : mean_(std::move(mean)), std_(std::move(std)) {
  EMBER_CHECK(!mean_.empty() && mean_.size() == std_.size(), "Normalize: mean and std need the same, non-zero ",
              "number of values, got ", mean_.size(), " and ", std_.size());
  for (double s : std_) EMBER_CHECK(s != 0.0 && std::isfinite(s), "Normalize: std must be finite and non-zero, got ", s);
}

DType Normalize::output_dtype(const TensorSpec& in) const {
  EMBER_CHECK(in.dtype == DType::Float32, "Normalize: expected a float32 image, got ", dtype_name(in.dtype),
              " (put to_float() before normalize())");
  EMBER_CHECK(mean_.size() == 1 || static_cast<int64_t>(mean_.size()) == in.shape[0], "Normalize: ", mean_.size(),
              " mean/std values for an image with ", in.shape[0], " channels");
  return DType::Float32;
}

void Normalize::affine(int64_t channels, std::vector<float>& scale, std::vector<float>& shift) const {
  scale.resize(channels);
  shift.resize(channels);
  for (int64_t c = 0; c < channels; ++c) {
    double m = mean_[mean_.size() == 1 ? 0 : c], s = std_[std_.size() == 1 ? 0 : c];
    scale[c] = static_cast<float>(1.0 / s);
    shift[c] = static_cast<float>(-m / s);
  }
}

// ---- Compose ----

namespace {
constexpr size_t kMaxFusedGeometric = 8;
std::atomic<uint64_t> next_compose_id{1};
}  // namespace

// Everything about a fused pass that does not depend on the example's draws,
// for one input spec: the geometric steps' input sizes, the output spec and
// the composed pointwise map.
struct Compose::Plan {
  Shape in_shape;
  DType in_dtype;
  TensorSpec out;
  std::vector<Stage> stages;
  Pointwise pw;
};

Compose::Compose(std::vector<TransformPtr> steps) : id_(next_compose_id.fetch_add(1)) {
  for (TransformPtr& s : steps) {
    EMBER_CHECK(s != nullptr, "Compose: step ", steps_.size(), " is null");
    if (auto c = std::dynamic_pointer_cast<const Compose>(s)) {
      steps_.insert(steps_.end(), c->steps().begin(), c->steps().end());
    } else {
      steps_.push_back(std::move(s));
    }
  }
  // Fusable: only geometric and pointwise steps, at most one of which pads
  // (so every out-of-range pixel gets the same value). The casts happen
  // here once, not per example.
  fused_ = true;
  size_t filling = 0, geometric = 0;
  for (const TransformPtr& s : steps_) {
    geometric_.push_back(dynamic_cast<const GeometricTransform*>(s.get()));
    pointwise_.push_back(dynamic_cast<const PointwiseTransform*>(s.get()));
    if (geometric_.back() != nullptr) {
      ++geometric;
      filling += geometric_.back()->can_fill();
    }
    fused_ = fused_ && (geometric_.back() != nullptr || pointwise_.back() != nullptr);
  }
  fused_ = fused_ && filling <= 1 && geometric <= kMaxFusedGeometric;
}

Tensor Compose::apply(const Tensor& x, RandomStream& rng) const {
  Tensor y = x;
  for (const TransformPtr& s : steps_) y = s->apply(y, rng);
  return y;
}

std::optional<TensorSpec> Compose::output_spec(const TensorSpec& in) const {
  TensorSpec spec = in;
  for (const TransformPtr& s : steps_) {
    std::optional<TensorSpec> next = s->output_spec(spec);
    if (!next) return std::nullopt;
    spec = *next;
  }
  return spec;
}

const Compose::Plan& Compose::plan_for(const Tensor& x) const {
  // One cached plan per thread: workers never contend for it, and a loader
  // feeds one Compose examples of one spec.
  thread_local uint64_t cached_id = 0;
  thread_local std::unique_ptr<Plan> cached;
  if (cached && cached_id == id_ && cached->in_shape == x.sizes() && cached->in_dtype == x.dtype()) return *cached;
  auto p = std::make_unique<Plan>();
  p->in_shape = x.sizes();
  p->in_dtype = x.dtype();
  TensorSpec spec{x.sizes(), x.dtype()};
  check_image(*this, spec);
  const int64_t C = spec.shape[0];
  Pointwise& pw = p->pw;
  pw.fill.assign(C, 0.f);
  std::vector<float> scale, shift;
  bool filled = false;
  // Walk the chain as apply() would, with the same checks.
  for (size_t i = 0; i < steps_.size(); ++i) {
    if (const GeometricTransform* g = geometric_[i]) {
      TensorSpec next = *g->output_spec(spec);
      p->stages.push_back(Stage{g, spec.shape[1], spec.shape[2], {}, {}});
      if (g->can_fill()) {
        filled = true;
        std::fill(pw.fill.begin(), pw.fill.end(), static_cast<float>(g->fill()));
      }
      spec = next;
      continue;
    }
    const PointwiseTransform* t = pointwise_[i];
    spec.dtype = t->output_dtype(spec);
    t->affine(C, scale, shift);
    if (pw.identity) {
      pw.scale = scale;
      pw.shift = shift;
      pw.identity = false;
    } else {
      for (int64_t c = 0; c < C; ++c) {
        pw.scale[c] *= scale[c];
        pw.shift[c] = pw.shift[c] * scale[c] + shift[c];
      }
    }
    // The fill goes through the pointwise steps after the padding step.
    if (filled)
      for (int64_t c = 0; c < C; ++c) pw.fill[c] = pw.fill[c] * scale[c] + shift[c];
  }
  p->out = spec;
  cached = std::move(p);
  cached_id = id_;
  return *cached;
}

void Compose::apply_into(const Tensor& x_in, RandomStream& rng, Tensor& out) const {
  const bool fast_dtypes = x_in.defined() && (x_in.dtype() == DType::UInt8 || x_in.dtype() == DType::Float32);
  if (!fused_ || !fast_dtypes) return Transform::apply_into(x_in, rng, out);
  Tensor x = contiguous_cpu(x_in, *this);
  const Plan& p = plan_for(x);
  EMBER_CHECK(out.sizes() == p.out.shape && out.dtype() == p.out.dtype && out.is_contiguous(), name(),
              ": output is ", dtype_name(out.dtype()), " ", shape_str(out.sizes()), " but the chain produces ",
              dtype_name(p.out.dtype), " ", shape_str(p.out.shape));
  // This example's draws, in chain order: the draws apply() makes.
  Stage stages[kMaxFusedGeometric];
  for (size_t k = 0; k < p.stages.size(); ++k) {
    stages[k] = p.stages[k];
    stages[k].t->draw(stages[k].in_h, stages[k].in_w, rng, stages[k].y, stages[k].x);
  }
  Geometry g = compose_geometry(p.in_shape[0], p.in_shape[1], p.in_shape[2], stages, p.stages.size(),
                                p.out.shape[1], p.out.shape[2]);
  if (p.out.dtype == DType::Float32) {
    if (x.dtype() == DType::UInt8) remap<uint8_t, float>(g, p.pw, x.data<uint8_t>(), out.data<float>());
    else remap<float, float>(g, p.pw, x.data<float>(), out.data<float>());
  } else {
    EMBER_INTERNAL_ASSERT(p.pw.identity && p.out.dtype == x.dtype());
    remap<uint8_t, uint8_t>(g, p.pw, x.data<uint8_t>(), out.data<uint8_t>());
  }
}

TransformPtr random_crop(int64_t size, int64_t padding, double fill) {
  return std::make_shared<RandomCrop>(size, size, padding, fill);
}
TransformPtr center_crop(int64_t size) { return std::make_shared<CenterCrop>(size, size); }
TransformPtr random_horizontal_flip(double p) { return std::make_shared<RandomHorizontalFlip>(p); }
TransformPtr to_float() { return std::make_shared<ToFloat>(); }
TransformPtr normalize(std::vector<double> mean, std::vector<double> std) {
  return std::make_shared<Normalize>(std::move(mean), std::move(std));
}
TransformPtr lambda(Lambda::Fn fn) { return std::make_shared<Lambda>(std::move(fn)); }
std::shared_ptr<const Compose> compose(std::vector<TransformPtr> steps) {
  return std::make_shared<Compose>(std::move(steps));
}

}  // namespace ember::data
