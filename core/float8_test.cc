// Float8: the e4m3fn/e5m2 conversions against a nearest-even search over
// every code (computed in double, another way than the bit arithmetic of
// dtype.h), the scale and scaled cast against their formulas, scaled_mm
// against float64 on the widened operands, float8_linear against float32
// (torchao's SQNR bounds) and against its own three GEMMs recomputed in
// float64; then every CUDA kernel against the CPU one (on a GPU, and under
// the emulation as float8_emu_test: bit for bit for the scales and casts).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "autograd/autograd.h"
#include "core/autocast.h"
#include "core/ops.h"
#include "core/ops/kernels.h"
#include "core/ops_float8.h"
#include "core/testing/error_of.h"

namespace ember {
namespace {

using ember::testing::error_of;

// ---- The formats, from their definitions ----

// The value of a code by the OCP formulas, in double.
template <int E, int M>
double decode(uint8_t b) {
  constexpr int bias = (1 << (E - 1)) - 1;
  const int sign = b & 0x80 ? -1 : 1;
  const int exp = (b >> M) & ((1 << E) - 1), mant = b & ((1 << M) - 1);
  if (E == 4 && (b & 0x7f) == 0x7f) return std::numeric_limits<double>::quiet_NaN();
  if (E == 5 && exp == 31) return mant ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (exp == 0) return sign * std::ldexp(mant, 1 - bias - M);
  return sign * std::ldexp(1.0 + std::ldexp(mant, -M), exp - bias);
}

// Nearest code to f, ties to the even code, by a search over the finite
// codes of f's sign plus the one step past the largest (which means
// overflow: the largest when saturating, else NaN / infinity).
template <int E, int M>
uint8_t nearest(float f, bool saturate) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  if (std::isnan(f)) return sign | 0x7f;
  const uint8_t max_code = E == 4 ? 0x7e : 0x7b;
  const double a = std::fabs(static_cast<double>(f));
  const double past = decode<E, M>(max_code) + (decode<E, M>(max_code) - decode<E, M>(max_code - 1));
  int best = -1;
  double best_d = INFINITY;
  for (int c = 0; c <= max_code + 1; ++c) {
    const double v = c <= max_code ? decode<E, M>(static_cast<uint8_t>(c)) : past;
    const double d = std::fabs(v - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) best = c, best_d = d;
  }
  if (best > max_code || a > past) return sign | (saturate ? max_code : (E == 4 ? 0x7f : 0x7c));
  return static_cast<uint8_t>(sign | best);
}

template <typename F8, int E, int M>
void check_format(const char* name) {
  using Format = typename F8::format;
  // Every code reads as its formula's value.
  for (int c = 0; c < 256; ++c) {
    const double want = decode<E, M>(static_cast<uint8_t>(c));
    const float got = Format::to_float(static_cast<uint8_t>(c));
    if (std::isnan(want))
      EXPECT_TRUE(std::isnan(got)) << name << " code " << c;
    else
      EXPECT_EQ(static_cast<double>(got), want) << name << " code " << c;
  }
  // Floats on and around every code and every midpoint, both signs, and
  // random floats over the whole range, both modes.
  std::vector<float> probes{0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-30f, 1e30f, 3.4e38f};
  for (int c = 0; c < 0x7f; ++c) {
    const double v = decode<E, M>(static_cast<uint8_t>(c)), next = decode<E, M>(static_cast<uint8_t>(c + 1));
    if (std::isnan(v)) continue;
    const float mid = static_cast<float>((v + (std::isfinite(next) && !std::isnan(next) ? next : 2 * v)) / 2);
    for (float p : {static_cast<float>(v), mid})
      for (float q : {p, std::nextafter(p, 0.0f), std::nextafter(p, INFINITY)}) probes.insert(probes.end(), {q, -q});
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> expo(-30.0f, 20.0f), mant(1.0f, 2.0f);
  for (int i = 0; i < 20000; ++i)
    probes.push_back((i % 2 ? -1 : 1) * std::ldexp(mant(rng), static_cast<int>(expo(rng))));
  for (float f : probes)
    for (bool sat : {false, true})
      ASSERT_EQ(static_cast<int>(Format::from_float(f, sat)), static_cast<int>(nearest<E, M>(f, sat)))
          << name << " from " << f << (sat ? " saturating" : "");
}

TEST(Float8, E4M3MatchesTheFormatBitForBit) { check_format<Float8E4M3, 4, 3>("e4m3fn"); }
TEST(Float8, E5M2MatchesTheFormatBitForBit) { check_format<Float8E5M2, 5, 2>("e5m2"); }

TEST(Float8, CastsAndRefusals) {
  const Tensor x = Tensor::from_vector({0.1f, -3.0f, 448.0f, 500.0f, 1e-3f, NAN}, {6});
  const Tensor e4 = x.to(DType::Float8E4M3);
  EXPECT_EQ(e4.dtype(), DType::Float8E4M3);
  EXPECT_EQ(e4.nbytes(), 6u);
  const std::vector<double> back = e4.to(DType::Float32).to_vector();
  for (int i = 0; i < 6; ++i) {
    const float want =
        Float8E4M3::format::to_float(Float8E4M3::format::from_float(static_cast<float>(x.to_vector()[i])));
    if (std::isnan(want))
      EXPECT_TRUE(std::isnan(back[i])) << i;
    else
      EXPECT_EQ(back[i], want) << i;
  }
  EXPECT_TRUE(std::isnan(back[3]));    // 500 is past e4m3fn's range: NaN unless saturating (c10's cast)
  EXPECT_EQ(e4.to_vector()[1], -3.0);  // read directly, as item() and printing do
  // A float8 view copies as bytes, and transposes.
  const Tensor m = randn({4, 6}).to(DType::Float8E5M2);
  EXPECT_TRUE(allclose(m.t().contiguous().to(DType::Float32), m.to(DType::Float32).t(), 0, 0));
  // Arithmetic and promotion refuse float8 by name.
  EXPECT_NE(error_of([&] { (void)(e4 + e4); }).find("float8_e4m3fn"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)(e4 + x); }).find("type promotion of float8_e4m3fn with float32"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)sum(e4); }).find("float8_e4m3fn"), std::string::npos);
}

// ---- The scale and the scaled cast ----

TEST(Float8, ScaleIsTheFormula) {
  manual_seed(3);
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16})
    for (DType f8 : {DType::Float8E4M3, DType::Float8E5M2}) {
      const Tensor x = (randn({33, 17}) * 7.0).to(dt);
      const std::vector<double> s = float8_scale(x, f8).to_vector();
      double amax = 0;
      for (float v : x.to(DType::Float32).to_vector()) amax = std::max(amax, std::fabs(double(v)));
      const double fmax = f8 == DType::Float8E4M3 ? 448.0 : 57344.0;
      EXPECT_EQ(s[2], static_cast<float>(amax)) << dt;
      EXPECT_EQ(s[0], static_cast<float>(fmax / amax)) << dt;
      EXPECT_EQ(s[1], 1.0f / static_cast<float>(s[0])) << dt;
    }
  // All zeros: amax clamped at 1e-12; a NaN anywhere: NaN scale.
  EXPECT_EQ(float8_scale(zeros({5}), DType::Float8E4M3).to_vector()[0], static_cast<float>(448.0 / 1e-12));
  const Tensor with_nan = Tensor::from_vector({1.0f, NAN, 2.0f}, {3});
  EXPECT_TRUE(std::isnan(float8_scale(with_nan, DType::Float8E4M3).to_vector()[0]));
}

TEST(Float8, ScaledCastSaturates) {
  manual_seed(4);
  const Tensor x = randn({64}) * 3.0;
  const Tensor s = float8_scale(x, DType::Float8E4M3);
  const Tensor q = to_float8(x, s.select(0, 0), DType::Float8E4M3);
  const std::vector<double> xs = x.to_vector();
  const std::vector<double> qs = q.to(DType::Float32).to_vector();
  const float scale = s.to_vector()[0];
  double qmax = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const float scaled = static_cast<float>(xs[i]) * scale;
    EXPECT_EQ(qs[i], Float8E4M3::format::to_float(Float8E4M3::format::from_float(scaled, true))) << i;
    qmax = std::max(qmax, std::fabs(qs[i]));
  }
  EXPECT_EQ(qmax, 448.0);  // the amax lands on the format's largest value
  // Past the range it saturates (a doubled scale), where a plain cast is NaN.
  const Tensor twice = to_float8(x, s.select(0, 0) * 2.0, DType::Float8E4M3).to(DType::Float32);
  EXPECT_EQ(max(abs(twice)).item<float>(), 448.0f);
  EXPECT_NE(error_of([&] { (void)to_float8(x, s, DType::Float8E4M3); }).find("scale must be a float32 scalar"),
            std::string::npos);
  EXPECT_NE(error_of([&] { (void)to_float8(x, s.select(0, 0), DType::BFloat16); }).find("float8_e4m3fn or"),
            std::string::npos);
}

// ---- scaled_mm ----

// (a * sa) @ (b * sb) in float64 from the widened operands.
std::vector<double> reference_mm(const Tensor& a, const Tensor& b, float sa, float sb) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  const std::vector<double> av = a.to(DType::Float32).contiguous().to_vector();
  const std::vector<double> bv = b.to(DType::Float32).contiguous().to_vector();
  std::vector<double> out(m * n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p) acc += double(av[i * k + p]) * bv[p * n + j];
      out[i * n + j] = acc * double(sa) * double(sb);
    }
  return out;
}

// a [m, k] e4m3 row-major, b [k, n] column-major of `bt`, and their scales.
struct MmCase {
  Tensor a, b, sa, sb;
};
MmCase mm_case(int64_t m, int64_t k, int64_t n, DType at, DType bt, Device dev = Device(DeviceType::CPU)) {
  const Tensor x = randn({m, k}) * 2.0, w = randn({n, k}) * 0.05;
  const Tensor xs = float8_scale(x, at), ws = float8_scale(w, bt);
  MmCase c;
  c.a = to_float8(x, xs.select(0, 0), at).to(dev);
  c.b = to_float8(w, ws.select(0, 0), bt).to(dev).t();
  c.sa = xs.select(0, 1).to(dev);
  c.sb = ws.select(0, 1).to(dev);
  return c;
}

void expect_near_reference(const Tensor& out, const MmCase& c, double rel, const std::string& what) {
  const std::vector<double> ref =
      reference_mm(c.a.cpu(), c.b.cpu(), c.sa.cpu().item<float>(), c.sb.cpu().item<float>());
  const std::vector<double> got = out.to(DType::Float32).cpu().to_vector();
  double scale = 0;
  for (double r : ref) scale = std::max(scale, std::fabs(r));
  for (size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(got[i], ref[i], rel * scale + 1e-30) << what << " element " << i;
}

TEST(Float8, ScaledMmIsTheWidenedProduct) {
  manual_seed(5);
  for (DType out : {DType::Float32, DType::BFloat16, DType::Float16}) {
    const MmCase c = mm_case(7, 48, 32, DType::Float8E4M3, DType::Float8E4M3);
    const Tensor y = scaled_mm(c.a, c.b, c.sa, c.sb, out);
    EXPECT_EQ(y.dtype(), out);
    EXPECT_EQ(y.sizes(), (Shape{7, 32}));
    expect_near_reference(y, c, out == DType::Float32 ? 1e-6 : out == DType::Float16 ? 1e-3 : 8e-3, "cpu");
  }
  const MmCase g = mm_case(5, 32, 16, DType::Float8E5M2, DType::Float8E4M3);
  expect_near_reference(scaled_mm(g.a, g.b, g.sa, g.sb, DType::Float32), g, 1e-6, "e5m2 x e4m3");
}

TEST(Float8, ScaledMmRefusesLayoutsByName) {
  manual_seed(6);
  const MmCase c = mm_case(4, 32, 16, DType::Float8E4M3, DType::Float8E4M3);
  auto err = [&](auto&& f) { return error_of(f); };
  EXPECT_NE(err([&] { (void)scaled_mm(c.a, c.b.contiguous(), c.sa, c.sb, DType::Float32); }).find("column-major"),
            std::string::npos);
  EXPECT_NE(err([&] { (void)scaled_mm(c.a.t().contiguous().t(), c.b, c.sa, c.sb, DType::Float32); }).find("row-major"),
            std::string::npos);
  const MmCase odd = mm_case(4, 24, 16, DType::Float8E4M3, DType::Float8E4M3);
  EXPECT_NE(err([&] { (void)scaled_mm(odd.a, odd.b, odd.sa, odd.sb, DType::Float32); }).find("multiples of 16"),
            std::string::npos);
  const MmCase both = mm_case(4, 32, 16, DType::Float8E5M2, DType::Float8E5M2);
  EXPECT_NE(err([&] { (void)scaled_mm(both.a, both.b, both.sa, both.sb, DType::Float32); }).find("both be float8_e5m2"),
            std::string::npos);
  EXPECT_NE(
      err([&] { (void)scaled_mm(c.a.to(DType::Float32), c.b, c.sa, c.sb, DType::Float32); }).find("must be float8"),
      std::string::npos);
  EXPECT_NE(err([&] { (void)scaled_mm(c.a, c.b, c.sa, c.sb, DType::Float64); }).find("out_dtype"), std::string::npos);
  // One row of a that is a column of a wider matrix: strides [1, 2].
  const Tensor wide = to_float8(randn({32, 2}), c.sa * 0.0 + 1.0, DType::Float8E4M3);
  EXPECT_NE(err([&] { (void)scaled_mm(wide.narrow(1, 0, 1).t(), c.b, c.sa, c.sb, DType::Float32); }).find("row-major"),
            std::string::npos);
  // An empty sum is zeros.
  const Tensor a0 = Tensor::empty({2, 0}, DType::Float8E4M3), b0 = Tensor::empty({16, 0}, DType::Float8E4M3).t();
  const Tensor z = scaled_mm(a0, b0, c.sa, c.sb, DType::Float32);
  EXPECT_EQ(z.sizes(), (Shape{2, 16}));
  EXPECT_EQ(sum(abs(z)).item(), 0.0);
}

// ---- float8_linear ----

// torchao's compute_error: 20 log10(|ref| / |ref - x|).
double sqnr(const Tensor& ref, const Tensor& x) {
  const Tensor r = ref.to(DType::Float64), d = r - x.to(DType::Float64);
  return 20 * std::log10(std::sqrt(sum(r * r).item<double>()) / std::sqrt(sum(d * d).item<double>()));
}

struct LinearRun {
  Tensor y, dx, dw, db;
};
LinearRun run_linear(bool fp8, const Tensor& x0, const Tensor& w0, const Tensor& b0, const Tensor& g) {
  Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
  Tensor y = fp8 ? float8_linear(x, w, b) : linear(x, w, b);
  y.backward(g);
  return {y.detach(), x.grad(), w.grad(), b.grad()};
}

void check_linear_against_float32(Device dev) {
  manual_seed(8);
  const Tensor x = randn({4, 8, 64}).to(dev), w = (randn({48, 64}) * 0.1).to(dev), b = randn({48}).to(dev);
  const Tensor g = randn({4, 8, 48}).to(dev);
  const LinearRun ref = run_linear(false, x, w, b, g), f8 = run_linear(true, x, w, b, g);
  // torchao's bounds for its float8 linear: output 18 dB, weight gradient
  // 17 dB; the input gradient (e5m2 x e4m3) 12 dB as its MX test's.
  std::printf("float8_linear SQNR against float32: y %.1f dB, dw %.1f dB, dx %.1f dB\n", sqnr(ref.y, f8.y),
              sqnr(ref.dw, f8.dw), sqnr(ref.dx, f8.dx));
  EXPECT_GE(sqnr(ref.y, f8.y), 18.0);
  EXPECT_GE(sqnr(ref.dw, f8.dw), 17.0);
  EXPECT_GE(sqnr(ref.dx, f8.dx), 12.0);
  EXPECT_TRUE(allclose(f8.db, ref.db, 1e-5, 1e-5));  // the bias gradient is the float32 sum
  // And it is not float32's: the casts did happen.
  EXPECT_LT(sqnr(ref.y, f8.y), 60.0);
}

TEST(Float8, LinearIsWithinTorchaosBoundsOfFloat32) { check_linear_against_float32(Device(DeviceType::CPU)); }

// The three GEMMs recomputed from the casts float8_linear makes: a wrong
// scale or a swapped operand shows here at float32 precision.
TEST(Float8, LinearIsItsThreeScaledGemms) {
  manual_seed(9);
  const Tensor x0 = randn({32, 32}), w0 = randn({16, 32}) * 0.2, g = randn({32, 16});
  Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_();
  Tensor y = float8_linear(x, w);
  y.backward(g);
  const DType e4 = DType::Float8E4M3, e5 = DType::Float8E5M2;
  const Tensor xs = float8_scale(x0, e4), ws = float8_scale(w0, e4), gs = float8_scale(g, e5);
  const Tensor xq = to_float8(x0, xs.select(0, 0), e4), wq = to_float8(w0, ws.select(0, 0), e4);
  const Tensor gq = to_float8(g, gs.select(0, 0), e5);
  const float sx = xs.to_vector()[1], sw = ws.to_vector()[1], sg = gs.to_vector()[1];
  auto close = [](const Tensor& got, const std::vector<double>& ref, const char* what) {
    const std::vector<double> v = got.contiguous().to_vector();
    ASSERT_EQ(v.size(), ref.size()) << what;
    for (size_t i = 0; i < v.size(); ++i) ASSERT_NEAR(v[i], ref[i], 1e-5 * (1 + std::fabs(ref[i]))) << what << " " << i;
  };
  close(y, reference_mm(xq, wq.t(), sx, sw), "y = x w^T");
  close(x.grad(), reference_mm(gq, wq, sg, sw), "dx = g w");
  close(w.grad(), reference_mm(gq.t(), xq, sg, sx), "dw = g^T x");
}

TEST(Float8, LinearRefusals) {
  const Tensor w = randn({24, 32}, DType::Float32).requires_grad_();
  EXPECT_NE(error_of([&] { (void)float8_linear(randn({16, 32}), w); }).find("multiples of 16"), std::string::npos);
  const Tensor w2 = randn({16, 32}).requires_grad_();
  EXPECT_NE(error_of([&] { (void)float8_linear(randn({3, 32}), w2); }).find("3 rows"), std::string::npos);
  {
    NoGradGuard no_grad;  // no weight gradient: any number of rows
    EXPECT_EQ(float8_linear(randn({3, 32}), w2).sizes(), (Shape{3, 16}));
  }
  EXPECT_NE(error_of([&] {
              (void)float8_linear(randn({16, 32}, DType::Float64), w2.to(DType::Float64));
            }).find("float32, bfloat16 or float16"),
            std::string::npos);
}

TEST(Float8, LinearUnderAutocastIsBfloat16) {
  manual_seed(10);
  const Tensor x = randn({16, 32}).requires_grad_(), w = randn({16, 32}).requires_grad_();
  Tensor y;
  {
    AutocastGuard amp(DeviceType::CPU, DType::BFloat16);
    y = float8_linear(x, w);
  }
  EXPECT_EQ(y.dtype(), DType::BFloat16);
  sum(y).backward();
  EXPECT_EQ(w.grad().dtype(), DType::Float32);  // through autocast's cast back to the leaf
}

// ---- CUDA against the CPU ----

class Float8Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_is_available()) GTEST_SKIP() << "no GPU: " << cuda_unavailable_reason();
  }
};

void expect_bits_equal(const Tensor& cpu, const Tensor& gpu, const std::string& what) {
  ASSERT_EQ(cpu.dtype(), gpu.dtype()) << what;
  ASSERT_EQ(cpu.nbytes(), gpu.nbytes()) << what;
  const Tensor g = gpu.cpu().contiguous(), c = cpu.contiguous();
  ASSERT_EQ(std::memcmp(c.raw_data(), g.raw_data(), c.nbytes()), 0) << what;
}

TEST_F(Float8Cuda, ScaleAndCastAreTheCpusBitForBit) {
  manual_seed(12);
  for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{4099}, int64_t{70000}})
    for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16})
      for (DType f8 : {DType::Float8E4M3, DType::Float8E5M2}) {
        const Tensor whole = (randn({n + 1}) * 100.0).to(dt);
        // Off the vector alignment on both sides (a copy to the device of
        // the CPU's view would be aligned there: the kernels' scalar paths,
        // amax_kernel<T, 1> and to_float8_kernel<T, F8, 1>, went unrun).
        const Tensor x = whole.narrow(0, 1, n), xg = whole.cuda().narrow(0, 1, n);
        const std::string what = std::to_string(n) + " " + dtype_name(dt) + " -> " + dtype_name(f8);
        const Tensor s = float8_scale(x, f8), sg = float8_scale(xg, f8);
        expect_bits_equal(s, sg, what + " scale");
        // Aligned, and with the largest magnitude last: in the vector loop's
        // tail, and in a warp and block other than the first.
        Tensor spiked = x.clone();                  // (x.contiguous() would be x itself, spiked too)
        spiked.narrow(0, n - 1, 1).fill_(-8192.0);  // exact in every input dtype
        expect_bits_equal(float8_scale(spiked, f8), float8_scale(spiked.cuda(), f8), what + " spiked scale");
        EXPECT_EQ(float8_scale(spiked.cuda(), f8).cpu().to_vector()[2], 8192.0) << what;
        expect_bits_equal(to_float8(x, s.select(0, 0), f8), to_float8(xg, sg.select(0, 0), f8), what);
        const Tensor aligned = x.clone();  // (x.contiguous() is x, one element in)
        expect_bits_equal(to_float8(aligned, s.select(0, 0) * 3.0, f8),
                          to_float8(aligned.cuda(), sg.select(0, 0) * 3.0, f8), what + " saturating");
        // Plain casts both ways.
        expect_bits_equal(aligned.to(f8), aligned.cuda().to(f8), what + " cast");
        expect_bits_equal(aligned.to(f8).to(dt), aligned.to(f8).cuda().to(dt), what + " cast back");
      }
  const Tensor with_nan = Tensor::from_vector({1.0f, NAN, 2.0f}, {3});
  EXPECT_TRUE(std::isnan(float8_scale(with_nan.cuda(), DType::Float8E4M3).cpu().to_vector()[0]));
}

TEST_F(Float8Cuda, ScaledMmMatchesTheReference) {
  manual_seed(13);
  struct Shape3 {
    int64_t m, k, n;
  };
  for (Shape3 s : {Shape3{1, 16, 16}, Shape3{33, 48, 32}, Shape3{64, 32, 80}})
    for (auto [at, bt] :
         {std::pair{DType::Float8E4M3, DType::Float8E4M3}, std::pair{DType::Float8E5M2, DType::Float8E4M3},
          std::pair{DType::Float8E4M3, DType::Float8E5M2}})
      for (DType out : {DType::Float32, DType::BFloat16, DType::Float16})
        for (bool fast : {false, true}) {
          const MmCase c = mm_case(s.m, s.k, s.n, at, bt, cuda_device(0));
          const Tensor y = scaled_mm(c.a, c.b, c.sa, c.sb, out, fast);
          ASSERT_TRUE(y.is_cuda());
          // Hopper's float8 tensor cores keep fewer bits in their sums than
          // float32 (and the emulation sums in double): 2e-3 of the largest
          // output still fails any operand or scale mapped wrongly.
          expect_near_reference(y, c, out == DType::BFloat16 ? 8e-3 : 2e-3,
                                std::to_string(s.m) + "x" + std::to_string(s.k) + "x" + std::to_string(s.n) + " " +
                                    dtype_name(at) + " x " + dtype_name(bt) + " -> " + dtype_name(out));
        }
}

// float8_linear with the weight's cast given (FSDP's float8 all-gather
// hands the layer one) is float8_linear casting the weight itself, bit for
// bit, and never reads the weight's data: here a placeholder whose memory
// is freed, whose gradient it still fills.
void check_given_cast(Device dev) {
  manual_seed(15);
  const DType e4 = DType::Float8E4M3;
  const Tensor x0 = randn({2, 16, 48}).to(dev), w0 = (randn({32, 48}) * 0.1).to(dev), b0 = randn({32}).to(dev);
  const Tensor g = randn({2, 16, 32}).to(dev);
  Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
  const Tensor y = float8_linear(x, w, b);
  y.backward(g);
  const Tensor s = float8_scale(w0, e4);
  const Float8Weight cast{to_float8(w0, s.select(0, 0), e4), s};
  Tensor ghost = Tensor::empty({32, 48}, TensorOptions(DType::Float32, dev));
  ghost.free_storage("a placeholder");
  ghost.requires_grad_();
  Tensor x2 = x0.clone().requires_grad_(), b2 = b0.clone().requires_grad_();
  const Tensor y2 = float8_linear(x2, ghost, b2, cast);
  y2.backward(g);
  expect_bits_equal(y, y2, "y");
  expect_bits_equal(x.grad(), x2.grad(), "dx");
  expect_bits_equal(w.grad(), ghost.grad(), "dw");
  expect_bits_equal(b.grad(), b2.grad(), "db");
  EXPECT_NE(error_of([&] { (void)ghost.to_vector(); }).find("freed: a placeholder"), std::string::npos);
  // Under autocast the cast stands for the float32 weight: bfloat16 out,
  // its gradient float32, the same forward as the cast of the same bytes.
  Tensor y3;
  {
    AutocastGuard amp(dev.type, DType::BFloat16);
    y3 = float8_linear(x0, ghost, b0, cast);
  }
  EXPECT_EQ(y3.dtype(), DType::BFloat16);
  sum(y3).backward();
  EXPECT_EQ(ghost.grad().dtype(), DType::Float32);
  // A cast that is not the weight's is refused by name.
  const Float8Weight wrong{to_float8(w0.t().contiguous(), s.select(0, 0), e4), s};
  EXPECT_NE(error_of([&] { (void)float8_linear(x0, ghost, b0, wrong); }).find("the weight's cast must be"),
            std::string::npos);
  const Float8Weight bad_scales{cast.q, s.narrow(0, 0, 2)};
  EXPECT_NE(error_of([&] { (void)float8_linear(x0, ghost, b0, bad_scales); }).find("scales must be float32 [3]"),
            std::string::npos);
}

TEST(Float8, LinearWithTheWeightsCastGivenIsItsOwnBitForBit) { check_given_cast(Device(DeviceType::CPU)); }
TEST_F(Float8Cuda, LinearWithTheWeightsCastGivenIsItsOwnBitForBit) { check_given_cast(cuda_device(0)); }

// scaled_mm keeps each problem's cuBLASLt plan: the same problem again
// finds it and reads this call's scales, not the first call's; another
// alignment of an operand is another problem.
TEST_F(Float8Cuda, ScaledMmReusesItsPlanWithEachCallsScales) {
  const Device dev = cuda_device(0);
  const DType e4 = DType::Float8E4M3;
  manual_seed(16);
  const Tensor a32 = randn({32, 64}).to(dev), w32 = randn({48, 64}).to(dev);
  const Tensor sa = float8_scale(a32, e4), sw = float8_scale(w32, e4);
  Tensor aq = to_float8(a32, sa.select(0, 0), e4);
  const Tensor wq = to_float8(w32, sw.select(0, 0), e4);
  const ScaledMmPlanStats s0 = scaled_mm_plan_stats();
  const Tensor y1 = scaled_mm(aq, wq.t(), sa.select(0, 1), sw.select(0, 1), DType::Float32);
  const ScaledMmPlanStats s1 = scaled_mm_plan_stats();
  EXPECT_EQ(s1.hits + s1.misses, s0.hits + s0.misses + 1);
  // Both scales new (cuBLASLt's A scale is w's, its B scale a's).
  const Tensor twice = sa.select(0, 1) * 2.0, four = sw.select(0, 1) * 4.0;
  const Tensor y2 = scaled_mm(aq, wq.t(), twice, four, DType::Float32);
  const ScaledMmPlanStats s2 = scaled_mm_plan_stats();
  EXPECT_EQ(s2.hits, s1.hits + 1);
  EXPECT_EQ(s2.misses, s1.misses);
  EXPECT_TRUE(allclose(y2.cpu(), y1.cpu() * 8.0, 1e-6, 1e-6)) << "the cached plan read a first call's scale";
  // a at a 64-byte offset: a plan for that alignment, the same product.
  Tensor big = zeros({34, 64}, TensorOptions(e4, dev));
  big.narrow(0, 1, 32).copy_(aq);
  const Tensor y3 = scaled_mm(big.narrow(0, 1, 32), wq.t(), sa.select(0, 1), sw.select(0, 1), DType::Float32);
  const ScaledMmPlanStats s3 = scaled_mm_plan_stats();
  EXPECT_EQ(s3.misses, s2.misses + 1);
  EXPECT_TRUE(allclose(y3.cpu(), y1.cpu(), 1e-5, 1e-5));
  // The same operand rewritten in place (same address, same plan): the
  // matmul reads the new values (negated exactly in e4m3).
  aq.copy_(to_float8(a32 * -1.0, sa.select(0, 0), e4));
  const Tensor y4 = scaled_mm(aq, wq.t(), sa.select(0, 1), sw.select(0, 1), DType::Float32);
  EXPECT_EQ(scaled_mm_plan_stats().hits, s3.hits + 1);
  EXPECT_TRUE(allclose(y4.cpu(), y1.cpu() * -1.0, 1e-6, 1e-6));
}

TEST_F(Float8Cuda, LinearMatchesTheCpu) {
  check_linear_against_float32(cuda_device(0));
  manual_seed(14);
  const Tensor x = randn({2, 16, 64}), w = randn({32, 64}) * 0.1, b = randn({32}), g = randn({2, 16, 32});
  const LinearRun cpu = run_linear(true, x, w, b, g);
  const LinearRun gpu = run_linear(true, x.cuda(), w.cuda(), b.cuda(), g.cuda());
  // The casts are bit-equal (above), so only the sums differ: their order,
  // and on Hopper the tensor cores' narrower float8 accumulation.
  EXPECT_TRUE(allclose(gpu.y.cpu(), cpu.y, 2e-3, 2e-3));
  EXPECT_TRUE(allclose(gpu.dx.cpu(), cpu.dx, 2e-3, 2e-3));
  EXPECT_TRUE(allclose(gpu.dw.cpu(), cpu.dw, 2e-3, 2e-3));
  EXPECT_TRUE(allclose(gpu.db.cpu(), cpu.db, 1e-5, 1e-5));
}

}  // namespace
}  // namespace ember
