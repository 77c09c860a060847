// Transforms: each one's values, the fused Compose pass against the
// step-by-step chain, reproducibility from the stream, and error messages.
#include "data/transforms.h"

#include <gtest/gtest.h>

#include <set>

#include "core/ops.h"

namespace ember::data {
namespace {

// A [C,H,W] uint8 image with distinct pixels (mod 256).
Tensor image(int64_t c, int64_t h, int64_t w, int64_t salt = 0) {
  Tensor t = Tensor::empty({c, h, w}, DType::UInt8);
  uint8_t* p = t.data<uint8_t>();
  for (int64_t i = 0; i < c * h * w; ++i) p[i] = static_cast<uint8_t>(i * 7 + salt * 13 + 1);
  return t;
}

RandomStream stream(uint64_t index, int64_t epoch = 0) { return RandomStream(42, StreamKind::Transform, epoch, index); }

double at(const Tensor& t, int64_t c, int64_t y, int64_t x) { return t.select(0, c).select(0, y).select(0, x).item(); }

TEST(Transforms, ToFloatAndNormalize) {
  Tensor x = image(2, 2, 2);
  RandomStream rng = stream(0);
  Tensor f = to_float()->apply(x, rng);
  EXPECT_EQ(f.dtype(), DType::Float32);
  EXPECT_TRUE(allclose(f, x.to(DType::Float32) / 255.0));
  Tensor n = normalize({0.5, 0.25}, {0.5, 2.0})->apply(f, rng);
  Tensor expect = f.clone();
  expect.select(0, 0).copy_((f.select(0, 0) - 0.5) / 0.5);
  expect.select(0, 1).copy_((f.select(0, 1) - 0.25) / 2.0);
  EXPECT_TRUE(allclose(n, expect, 1e-6, 1e-6));
}

TEST(Transforms, RandomCropIsAWindowOfThePaddedImage) {
  Tensor x = image(3, 5, 6);
  Tensor padded = zeros({3, 9, 10}, DType::UInt8);
  padded.slice(1, 2, 7).slice(2, 2, 8).copy_(x);
  std::set<std::pair<int, int>> corners;
  for (uint64_t i = 0; i < 200; ++i) {
    RandomStream rng = stream(i);
    Tensor y = random_crop(4, /*padding=*/2)->apply(x, rng);
    ASSERT_EQ(y.sizes(), (Shape{3, 4, 4}));
    bool found = false;
    for (int top = 0; top <= 5 && !found; ++top)
      for (int left = 0; left <= 6 && !found; ++left)
        if (y.to_vector() == padded.slice(1, top, top + 4).slice(2, left, left + 4).contiguous().to_vector()) {
          corners.insert({top, left});
          found = true;
        }
    ASSERT_TRUE(found) << "crop " << i << " is no window of the padded image";
  }
  EXPECT_GT(corners.size(), 30u);  // of 42 possible corners
}

TEST(Transforms, FlipAndCenterCrop) {
  Tensor x = image(2, 3, 4);
  RandomStream rng = stream(0);
  Tensor flipped = RandomHorizontalFlip(1.0).apply(x, rng);
  for (int64_t c = 0; c < 2; ++c)
    for (int64_t y = 0; y < 3; ++y)
      for (int64_t w = 0; w < 4; ++w) ASSERT_EQ(at(flipped, c, y, w), at(x, c, y, 3 - w));
  EXPECT_EQ(RandomHorizontalFlip(0.0).apply(x, rng).to_vector(), x.to_vector());
  int flips = 0;
  for (uint64_t i = 0; i < 1000; ++i) {
    RandomStream r = stream(i);
    flips += random_horizontal_flip()->apply(x, r).to_vector() != x.to_vector();
  }
  EXPECT_NEAR(flips, 500, 80);
  Tensor cc = center_crop(2)->apply(x, rng);
  EXPECT_EQ(cc.to_vector(), x.slice(1, 0, 2).slice(2, 1, 3).contiguous().to_vector());  // round(0.5) = 0, round(1) = 1
}

TEST(Transforms, SameStreamSameResult) {
  auto tf = compose({random_crop(4, 1), random_horizontal_flip(), to_float()});
  Tensor x = image(1, 5, 5);
  RandomStream a = stream(3, 1), b = stream(3, 1);
  Tensor ya = tf->apply(x, a);
  EXPECT_EQ(ya.to_vector(), tf->apply(x, b).to_vector());
  bool differs = false;
  for (uint64_t i = 0; i < 10 && !differs; ++i) {
    RandomStream r = stream(i, 2);
    differs = tf->apply(x, r).to_vector() != ya.to_vector();
  }
  EXPECT_TRUE(differs);
}

// The fused apply_into must match the chain run step by step, including the
// fill of padded pixels, in either order of geometric and pointwise steps.
TEST(Transforms, FusedComposeMatchesStepByStep) {
  struct Case {
    const char* what;
    std::shared_ptr<const Compose> tf;
    Tensor input;
  };
  std::vector<Case> cases = {
      {"standard", compose({random_crop(28, 2), random_horizontal_flip(), to_float(), normalize({0.2860}, {0.3530})}),
       image(1, 28, 28)},
      {"normalize first", compose({to_float(), normalize({0.1, 0.2, 0.3}, {0.5, 0.6, 0.7}), random_crop(6, 3),
                                   random_horizontal_flip(0.7)}),
       image(3, 8, 7)},
      {"pointwise between", compose({random_horizontal_flip(), to_float(), random_crop(5, 1, 0.25),
                                     normalize({0.5}, {0.2}), center_crop(4)}),
       image(2, 6, 6)},
      {"uint8 only", compose({random_crop(4, 2, 9.0), random_horizontal_flip()}), image(3, 5, 5)},
      {"float input", compose({random_crop(3, 1), normalize({1.0}, {2.0})}), image(2, 4, 4).to(DType::Float32)},
      {"nested", compose({compose({random_crop(5, 1)}), compose({to_float(), random_horizontal_flip()})}),
       image(1, 5, 5)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    EXPECT_TRUE(c.tf->fused());
    TensorSpec spec = *c.tf->output_spec({c.input.sizes(), c.input.dtype()});
    for (uint64_t i = 0; i < 50; ++i) {
      RandomStream r1 = stream(i), r2 = stream(i);
      Tensor ref = c.tf->apply(c.input, r1);
      Tensor out = Tensor::empty(spec.shape, spec.dtype);
      c.tf->apply_into(c.input, r2, out);
      ASSERT_EQ(ref.sizes(), out.sizes());
      ASSERT_EQ(ref.dtype(), out.dtype());
      ASSERT_TRUE(allclose(ref, out, 1e-5, 1e-6)) << "example " << i << "\n" << ref << "\n" << out;
      // Both consumed the same draws.
      ASSERT_EQ(r1.next_u64(), r2.next_u64());
    }
  }
}

TEST(Transforms, LambdaIsNotFusedButComposes) {
  auto tf = compose({random_crop(3), lambda([](const Tensor& x, RandomStream&) { return x.to(DType::Float32) * 2.0; })});
  EXPECT_FALSE(tf->fused());
  EXPECT_FALSE(tf->output_spec({{1, 4, 4}, DType::UInt8}).has_value());
  Tensor x = image(1, 4, 4);
  RandomStream r1 = stream(1), r2 = stream(1);
  Tensor ref = tf->apply(x, r1);
  Tensor out = Tensor::empty({1, 3, 3}, DType::Float32);
  tf->apply_into(x, r2, out);
  EXPECT_EQ(ref.to_vector(), out.to_vector());
  Tensor wrong = Tensor::empty({1, 4, 4}, DType::Float32);
  RandomStream r3 = stream(1);
  EXPECT_THROW(tf->apply_into(x, r3, wrong), Error);
  // Two padding crops with different fills cannot share one fill value.
  EXPECT_FALSE(compose({random_crop(4, 1, 0.0), random_crop(4, 1, 1.0)})->fused());
}

TEST(Transforms, ErrorsNameTheTransform) {
  RandomStream rng = stream(0);
  auto msg = [&](const TransformPtr& t, const Tensor& x) {
    try {
      t->apply(x, rng);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(msg(normalize({0.5}, {0.5}), image(1, 2, 2)).find("Normalize: expected a float32 image, got uint8"),
            std::string::npos);
  EXPECT_NE(msg(normalize({0.5, 0.5}, {1, 1}), image(3, 2, 2).to(DType::Float32)).find("2 mean/std values for an image with 3 channels"),
            std::string::npos);
  EXPECT_NE(msg(random_crop(9, 1), image(1, 5, 5)).find("RandomCrop: crop 9x9 is larger than the padded input 7x7"),
            std::string::npos);
  EXPECT_NE(msg(to_float(), image(1, 2, 2).to(DType::Float32)).find("ToFloat: expected a uint8 image"),
            std::string::npos);
  EXPECT_NE(msg(random_horizontal_flip(), Tensor::empty({4, 4}, DType::UInt8)).find("expected a [C,H,W] image"),
            std::string::npos);
  EXPECT_THROW(normalize({0.5}, {0.0}), Error);
  // The fused path runs the same checks.
  auto tf = compose({random_crop(2), normalize({0.5}, {0.5})});
  Tensor out = Tensor::empty({1, 2, 2});
  EXPECT_THROW(tf->apply_into(image(1, 3, 3), rng, out), Error);
}

}  // namespace
}  // namespace ember::data
