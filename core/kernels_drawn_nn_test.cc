// The nn kernels on drawn cases (core/testing/draw.h): pooling, convolution,
// batch and layer norm and attention, their geometries, dtypes, layouts and
// values drawn from seeded generators rather than listed, each case run on
// the CPU against float64 and on CUDA (a GPU, or the emulation in
// kernels_drawn_nn_emu_test) against the CPU, forward and backward. The
// tolerances are the measured errors of docs/design.md, Note [numerics],
// with headroom. EMBER_TEST_DRAWS=N draws N cases per family (the default
// is CI's budget); a failure prints the seed that replays it.
#include <gtest/gtest.h>

#include <array>
#include <limits>
#include <string>
#include <tuple>

#include "core/ops.h"
#include "core/ops/int_div.h"
#include "core/ops/kernels.h"
#include "core/ops_nn.h"
#include "core/testing/draw.h"
#include "core/testing/drawn_case.h"

namespace ember {
namespace {

using testing::CaseInput;
using testing::check_case;
using testing::Draw;
using testing::for_each_draw;
using testing::Specials;
using testing::tol_for;

const std::vector<DType>& kFloats = testing::kFloatDtypes;

class Drawn : public ::testing::Test {
 protected:
  // float32 CUDA results are compared at float32's tolerance: TF32 off
  // (cuDNN's default, as PyTorch's) except in the draws that turn it on.
  void SetUp() override {
    if (cuda_is_available()) set_cudnn_allow_tf32(false);
  }
  void TearDown() override {
    if (!cuda_is_available()) return;
    set_cudnn_allow_tf32(true);
    set_attention_cuda_flash_tiles({});  // a failed draw may leave its tiles
  }
};

// max_pool2d and avg_pool2d: windows of any shape (height and width drawn
// apart, so a kernel that takes one for the other fails), strides, padding
// up to half the window, ceil mode, both divisors, every dtype and layout,
// and NaN, infinities, ties and denormals in the input (NaN wins a max
// window; the first of tied maxima takes the gradient).
TEST_F(Drawn, Pooling) {
  for_each_draw("pooling", 300, [&](Draw& d) {
    const int64_t kh = d.integer(1, 4), kw = d.integer(1, 4), sh = d.integer(1, 3), sw = d.integer(1, 3);
    const int64_t ph = d.integer(0, kh / 2), pw = d.integer(0, kw / 2);
    const bool ceil = d.chance(0.5), max_pool = d.chance(0.5), include_pad = d.chance(0.5);
    const int64_t h = d.integer(std::max<int64_t>(1, kh - 2 * ph), kh + 9);
    const int64_t w = d.integer(std::max<int64_t>(1, kw - 2 * pw), kw + 9);
    const Shape xs = {d.size(1, 3, true), d.size(1, 5), h, w};
    const DType dt = d.pick(kFloats);
    Tensor x = d.values(xs, dt, Specials::all());
    const std::string what = detail::str_cat(max_pool ? "max_pool2d" : "avg_pool2d", " x", shape_str(xs), " k", kh, "x",
                                             kw, " s", sh, "x", sw, " p", ph, "x", pw, ceil ? " ceil" : "",
                                             !max_pool && !include_pad ? " count_include_pad=false" : "");
    check_case(
        what,
        [=](const std::vector<Tensor>& v) {
          return max_pool ? max_pool2d(v[0], {kh, kw}, {sh, sw}, {ph, pw}, ceil)
                          : avg_pool2d(v[0], {kh, kw}, {sh, sw}, {ph, pw}, ceil, include_pad);
        },
        {{x, true}}, d, tol_for(dt, 1e-6), tol_for(dt, 1e-6));
  });
}

// conv2d: channels, groups (depthwise among them), kernels of any shape,
// strides, padding and dilation drawn; every dtype and layout; the weight's
// layout drawn too (a channels-last weight takes cuDNN's NHWC path). One
// draw in four is a Winograd-eligible layer (3x3, stride 1, >= 8 channels),
// the CPU's default algorithm for float32 there. Some float32 draws allow
// TF32 on CUDA, compared at TF32's tolerance.
TEST_F(Drawn, Conv2d) {
  for_each_draw("conv2d", 150, [&](Draw& d) {
    const bool wino = d.chance(0.25);
    const int64_t groups = wino ? 1 : d.pick<int64_t>({1, 1, 2, 3});
    const int64_t cg = wino ? d.integer(8, 16) : d.integer(1, 3), og = wino ? d.integer(8, 16) : d.integer(1, 3);
    const bool depthwise = !wino && groups > 1 && d.chance(0.3);
    const int64_t c = groups * (depthwise ? 1 : cg), o = groups * og;
    const int64_t kh = wino ? 3 : d.integer(1, 4), kw = wino ? 3 : d.integer(1, 4);
    const int64_t sh = wino ? 1 : d.integer(1, 3), sw = wino ? 1 : d.integer(1, 3);
    const int64_t dh = wino ? 1 : d.pick<int64_t>({1, 1, 2}), dw = wino ? 1 : d.pick<int64_t>({1, 1, 2});
    const int64_t ph = d.integer(0, 2), pw = d.integer(0, 2);
    const int64_t h = d.integer(std::max<int64_t>(1, dh * (kh - 1) + 1 - 2 * ph), dh * (kh - 1) + 8);
    const int64_t w = d.integer(std::max<int64_t>(1, dw * (kw - 1) + 1 - 2 * pw), dw * (kw - 1) + 8);
    const DType dt = d.pick(kFloats);
    const bool bias = d.chance(0.5), tf32 = dt == DType::Float32 && d.chance(0.2);
    // cuDNN's ways in: the graph API (the default), the legacy API, and
    // benchmark mode (cudnnFind*, legacy descriptors).
    const int api = static_cast<int>(d.integer(0, 5));  // 0-2 graph, 3-4 legacy, 5 benchmark
    const Shape xs = {d.size(1, 3), c, h, w}, ws = {o, c / groups, kh, kw};
    Tensor x = d.values(xs, dt, Specials::finite(), 0.5), wt = d.values(ws, dt, Specials::finite(), 0.5);
    Tensor b = bias ? d.values({o}, dt) : Tensor();
    const std::string what =
        detail::str_cat("conv2d x", shape_str(xs), " w", shape_str(ws), " s", sh, "x", sw, " p", ph, "x", pw, " d", dh,
                        "x", dw, " groups ", groups, bias ? " bias" : "", tf32 ? " TF32" : "",
                        api < 3   ? ""
                        : api < 5 ? " (cuDNN legacy API)"
                                  : " (cuDNN benchmark mode)");
    if (cuda_is_available()) {
      set_cudnn_allow_tf32(tf32);
      set_cudnn_graph_api(api < 3);
      set_cudnn_benchmark(api == 5);
    }
    // float32: Winograd's rounding (Note [numerics]) and the direct sum's
    // over up to 16*3*3 products; 16-bit: the inputs' rounding carried
    // through the sum.
    const double f32 = 2e-5;
    check_case(
        what,
        [=](const std::vector<Tensor>& v) {
          return conv2d(v[0], v[1], v[2], {sh, sw}, {ph, pw}, {dh, dw}, groups);
        },
        {{x, true}, {wt, true}, {b, true, false}}, d, tol_for(dt, f32), tf32 ? 5e-3 : tol_for(dt, f32));
    if (cuda_is_available()) {
      set_cudnn_allow_tf32(false);
      set_cudnn_graph_api(true);
      set_cudnn_benchmark(false);
    }
  });
}

// batch_norm: channel counts around the CUDA kernels' vector and tile
// widths, planes from 1x1 up, training (batch statistics, running stats
// updated and compared) and eval, with and without affine parameters, a
// mean drawn far from zero (a one-pass variance would cancel), constant
// planes (zero variance), every dtype and layout.
TEST_F(Drawn, BatchNorm) {
  for_each_draw("batch_norm", 100, [&](Draw& d) {
    const int64_t c = d.pick<int64_t>({1, 3, 8, 64, 65, d.integer(1, 40)});
    const Shape xs = {d.integer(1, 5), c, d.size(1, 9), d.size(1, 9)};
    if (xs[0] * xs[2] * xs[3] < 2) return;  // training needs more than one value per channel
    const DType dt = d.pick(kFloats), pt = dt == DType::Float64 ? DType::Float64 : DType::Float32;
    const bool training = d.chance(0.6), affine = d.chance(0.7);
    // A mean of 100 is a condition number of 100 / std for x - mean: only
    // with enough values per channel that the std is not tiny by chance,
    // and 10x the tolerance (x's float32 rounding at 100 is 100x its
    // rounding at 1; a 40,000-draw soak saw CUDA's dw 1e-4 from the CPU's).
    const double shift = xs[0] * xs[2] * xs[3] >= 8 ? d.pick<double>({0.0, 3.0, 100.0}) : 0.0;
    Tensor x = (d.values(xs, DType::Float64, Specials::finite()) + shift).to(dt);
    Tensor wt = affine ? d.values({c}, pt) : Tensor(), b = affine ? d.values({c}, pt) : Tensor();
    Tensor rm = d.values({c}, pt), rv = d.values({c}, pt, {}, 0.1) + 1.0;
    const std::string what = detail::str_cat("batch_norm x", shape_str(xs), training ? " train" : " eval",
                                             affine ? " affine" : "", " mean ", shift);
    // The running statistics are outputs too: returned beside y (cat of
    // flattened tensors), so check_case compares them on every backend.
    check_case(
        what,
        [=](const std::vector<Tensor>& v) {
          Tensor m = v[3].clone(), s = v[4].clone();
          // eps 1e-3, as layer_norm's below: a constant channel (a row of
          // equal values where N = H = 1) has variance 0 and a float32
          // mean's rounding, multiplied by 1/sqrt(eps).
          Tensor y = batch_norm(v[0], v[1], v[2], m, s, training, 0.2, 1e-3);
          return training ? cat({y.flatten().to(DType::Float64), m.to(DType::Float64), s.to(DType::Float64)}) : y;
        },
        {{x, true}, {wt, true, false}, {b, true, false}, {rm, false, false}, {rv, false, false}}, d,
        tol_for(dt, 2e-5) * (shift > 10 ? 10 : 1), tol_for(dt, 2e-5) * (shift > 10 ? 10 : 1));
  });
}

// batch_norm_relu against the two ops it fuses, relu(batch_norm(...)), and
// batch_norm_add_relu against its three, relu(batch_norm(...) + residual),
// on each backend: the same values bit for bit, forward, running statistics
// and every gradient (the fused kernels add the ReLU, and the residual, to
// the normalising pass and the mask to the backward's reads; the residual's
// gradient is written by the sums pass), over batch_norm's draws of
// channels, planes, dtypes, training and eval, affine or not, a
// channels-last input, and a residual in its own layout (copied to x's).
// (Against float64 a ReLU's kink flips where the dtype's rounding crosses
// 0, which bit equality with the unfused ops, themselves checked against
// float64 above, does not need.)
TEST_F(Drawn, BatchNormRelu) {
  for_each_draw("batch_norm_relu", 80, [&](Draw& d) {
    const int64_t c = d.pick<int64_t>({1, 3, 8, 64, 65, d.integer(1, 40)});
    const Shape xs = {d.integer(1, 5), c, d.size(1, 9), d.size(1, 9)};
    if (xs[0] * xs[2] * xs[3] < 2) return;
    const DType dt = d.pick(kFloats), pt = dt == DType::Float64 ? DType::Float64 : DType::Float32;
    const bool training = d.chance(0.6), affine = d.chance(0.7), cl = d.chance(0.5);
    const bool add = d.chance(0.5), r_cl = d.chance(0.5), r_grad = d.chance(0.8);
    Tensor x = d.values(xs, dt, Specials::finite());
    Tensor wt = affine ? d.values({c}, pt) : Tensor(), b = affine ? d.values({c}, pt) : Tensor();
    Tensor rm = d.values({c}, pt), rv = d.values({c}, pt, {}, 0.1) + 1.0, proj = d.values(xs, dt);
    Tensor res = add ? d.values(xs, dt, Specials::finite()) : Tensor();
    const std::string what = detail::str_cat(
        add ? "batch_norm_add_relu x" : "batch_norm_relu x", shape_str(xs), " ", dtype_name(dt),
        training ? " train" : " eval", affine ? " affine" : "", cl ? " channels-last" : "",
        add ? (r_cl ? ", residual channels-last" : ", residual NCHW") : "", add && !r_grad ? " (no grad)" : "");
    auto same = [](const Tensor& a, const Tensor& e) {
      if (a.defined() != e.defined()) return false;
      if (!a.defined()) return true;
      const std::vector<double> u = a.cpu().to_vector(), v = e.cpu().to_vector();
      for (size_t i = 0; i < u.size(); ++i)
        if (!(u[i] == v[i] || (u[i] != u[i] && v[i] != v[i]))) return false;
      return u.size() == v.size();
    };
    for (bool cuda : {false, true}) {
      if (cuda && !cuda_is_available()) continue;
      auto on = [cuda](const Tensor& t) { return !t.defined() ? t : cuda ? t.cuda() : t.clone(); };
      std::vector<Tensor> y(2), grads(8), stats(4);
      for (int fused = 0; fused < 2; ++fused) {
        Tensor xi = on(x);
        if (cl) xi = xi.contiguous(MemoryFormat::ChannelsLast);
        xi = xi.detach().requires_grad_();
        Tensor wi = affine ? on(wt).requires_grad_() : Tensor(), bi = affine ? on(b).requires_grad_() : Tensor();
        Tensor rmi = on(rm), rvi = on(rv), ri;
        if (add) {
          ri = on(res);
          if (r_cl) ri = ri.contiguous(MemoryFormat::ChannelsLast);
          ri = ri.detach().requires_grad_(r_grad);
        }
        if (fused)
          y[1] = add ? batch_norm_add_relu(xi, ri, wi, bi, rmi, rvi, training, 0.2, 1e-3)
                     : batch_norm_relu(xi, wi, bi, rmi, rvi, training, 0.2, 1e-3);
        else {
          Tensor z = batch_norm(xi, wi, bi, rmi, rvi, training, 0.2, 1e-3);
          y[0] = relu(add ? z + ri : z);
        }
        sum(y[fused] * on(proj)).backward();
        grads[4 * fused] = xi.grad();
        grads[4 * fused + 1] = affine ? wi.grad() : Tensor();
        grads[4 * fused + 2] = affine ? bi.grad() : Tensor();
        grads[4 * fused + 3] = add && r_grad ? ri.grad() : Tensor();
        stats[2 * fused] = rmi;
        stats[2 * fused + 1] = rvi;
      }
      const std::string w = detail::str_cat(what, cuda ? " (cuda)" : " (cpu)");
      EXPECT_TRUE(same(y[1], y[0])) << w << ": forward";
      EXPECT_TRUE(same(stats[2], stats[0]) && same(stats[3], stats[1])) << w << ": running statistics";
      for (int i = 0; i < 4; ++i) EXPECT_TRUE(same(grads[4 + i], grads[i])) << w << ": gradient " << i;
    }
  });
}

// A normalisation's input: the last one or two dims normalised, widths
// below, at and above a warp, sometimes more rows than one weight-gradient
// tile, sometimes rows wider than the CUDA kernels' register chunk (1,024
// columns, 512 for float64, 256 one element at a time), in whole 16-byte
// vectors or not. Returns (dims normalised, x's shape, the normalised shape).
std::tuple<int64_t, Shape, Shape> draw_norm_shape(Draw& d) {
  const int64_t nd = d.integer(1, 2);
  const double kind = d.uniform();
  const Shape xs = kind < 0.15 ? Shape{d.size(1, 3), nd, d.chance(0.5) ? 8 * d.integer(60, 160) : d.integer(500, 1300)}
                   : kind < 0.35 ? Shape{d.integer(100, 300), d.integer(1, 70)}
                                 : Shape{d.size(1, 4), d.size(1, 6), d.integer(1, 70)};
  return {nd, xs, Shape(xs.end() - nd, xs.end())};
}

// layer_norm over the last one or two dims: widths below, at and above a
// warp, more rows than one weight-gradient tile, with and without weight
// and bias, constant rows, float32/float64/bfloat16/float16.
TEST_F(Drawn, LayerNorm) {
  for_each_draw("layer_norm", 200, [&](Draw& d) {
    const auto [nd, xs, ns] = draw_norm_shape(d);
    const DType dt = d.pick(kFloats);
    Tensor x = d.values(xs, dt, Specials::finite(), 2.0);
    Tensor wt = d.chance(0.7) ? d.values(ns, dt) : Tensor(), b = d.chance(0.7) ? d.values(ns, dt) : Tensor();
    check_case(
        detail::str_cat("layer_norm x", shape_str(xs), " over ", nd, wt.defined() ? " weight" : "",
                        b.defined() ? " bias" : ""),
        // eps 1e-3: a row of one value (or of width 1) has variance 0 in
        // exact arithmetic and a rounding error e in float32, which the
        // normalisation multiplies by 1/sqrt(eps): 300x at 1e-5.
        [=](const std::vector<Tensor>& v) { return layer_norm(v[0], nd, v[1], v[2], 1e-3); },
        {{x, true}, {wt, true, false}, {b, true, false}}, d, tol_for(dt, 2e-5), tol_for(dt, 2e-5));
  });
}

// rms_norm over the last one or two dims: widths below, at and above a
// warp, more rows than one weight-gradient tile, with and without weight,
// constant and zero rows (eps keeps them finite), every float dtype.
TEST_F(Drawn, RmsNorm) {
  for_each_draw("rms_norm", 200, [&](Draw& d) {
    const auto [nd, xs, ns] = draw_norm_shape(d);
    const DType dt = d.pick(kFloats);
    Tensor x = d.values(xs, dt, Specials::finite(), 2.0);
    Tensor wt = d.chance(0.7) ? d.values(ns, dt) : Tensor();
    check_case(
        detail::str_cat("rms_norm x", shape_str(xs), " over ", nd, wt.defined() ? " weight" : ""),
        // eps 1e-3 as layer_norm's: a row of zeros (or tiny values)
        // is scaled by 1/sqrt(eps).
        [=](const std::vector<Tensor>& v) { return rms_norm(v[0], nd, v[1], 1e-3); }, {{x, true}, {wt, true, false}}, d,
        tol_for(dt, 2e-5), tol_for(dt, 2e-5));
  });
}

// cross_entropy_rows: class counts below a warp, across warps and the
// multi-warp rows of a larger vocabulary (up to 3000), rows whose target is
// ignore_index, label smoothing, int32 and int64 targets, masked (-inf)
// logits, every float dtype. The float64 reference is the composition the
// op replaced (log_softmax, gather, the smoothing mean, a where for the
// ignored rows); on CUDA the fused kernels are compared with the CPU's.
TEST_F(Drawn, CrossEntropy) {
  for_each_draw("cross_entropy", 200, [&](Draw& d) {
    const int64_t n = d.size(1, 40, true), c = d.chance(0.3) ? d.integer(500, 3000) : d.integer(1, 70);
    const double ls = d.chance(0.4) ? 0.5 * d.uniform() : 0.0;
    const int64_t ignore = d.pick<int64_t>({-100, -1, 0});
    const bool some_ignored = d.chance(0.4), masked = ls == 0 && c > 1 && d.chance(0.4);
    std::vector<double> tv(static_cast<size_t>(n)), keep(static_cast<size_t>(n)), safe(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      int64_t t = d.integer(0, c - 1);
      if (t == ignore || (some_ignored && d.chance(0.3))) t = ignore;
      tv[i] = static_cast<double>(t);
      keep[i] = t == ignore ? 0.0 : 1.0;
      safe[i] = t == ignore ? 0.0 : static_cast<double>(t);
    }
    const DType tdt = d.chance(0.5) ? DType::Int64 : DType::Int32;
    const DType dt = d.pick(kFloats);
    Tensor x = d.values({n, c}, dt, Specials::finite(), 4.0);
    if (masked) {  // a few non-target logits at -inf, as a masked vocabulary
      std::vector<double> m(static_cast<size_t>(n * c), 0.0);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t k = 0; k < 1 + c / 8; ++k) {
          const int64_t j = d.integer(0, c - 1);
          if (j != static_cast<int64_t>(tv[i])) m[i * c + j] = -std::numeric_limits<double>::infinity();
        }
      x = (x.to(DType::Float64) + Tensor::from_vector(m, {n, c}, DType::Float64)).to(dt);
    }
    const Tensor target = Tensor::from_vector(tv, {n}, tdt);
    const Tensor keep_t = Tensor::from_vector(keep, {n}, DType::Float64);
    const Tensor safe_t = Tensor::from_vector(safe, {n, 1}, DType::Int64);
    check_case(
        detail::str_cat("cross_entropy x", shape_str(x.sizes()), " label_smoothing ", ls, " ignore_index ", ignore,
                        some_ignored ? " (some rows)" : "", masked ? " masked" : "", " target ", dtype_name(tdt)),
        [=](const std::vector<Tensor>& v) {
          if (v[0].dtype() != DType::Float64 || v[0].is_cuda()) return cross_entropy_rows(v[0], v[1], ls, ignore);
          Tensor logp = log_softmax(v[0], 1);
          Tensor rows = neg(gather(logp, 1, safe_t).squeeze(1));
          if (ls > 0) rows = rows * (1.0 - ls) + neg(mean(logp, {1})) * ls;
          return where(keep_t.to(DType::Bool), rows, zeros_like(rows));
        },
        {{x, true}, {target, false, false}}, d, tol_for(dt, 2e-5), tol_for(dt, 2e-5));
  });
}

// swiglu: one to four dims (a LLaMA block's [batch, seq, hidden] and the
// experts' flat rows), sizes across the vector width and its tails, every
// float dtype, values wide enough to saturate the sigmoid. The float64
// reference is the composition silu(a) * b the op replaces; on CUDA the
// fused kernels are compared with the CPU's.
TEST_F(Drawn, Swiglu) {
  for_each_draw("swiglu", 200, [&](Draw& d) {
    const Shape s = d.shape(d.integer(1, 4), 1, 37, true);
    const DType dt = d.pick(kFloats);
    Tensor a = d.values(s, dt, Specials::finite(), 8.0), b = d.values(s, dt, Specials::finite(), 2.0);
    check_case(
        detail::str_cat("swiglu ", shape_str(s)),
        [](const std::vector<Tensor>& v) {
          if (v[0].dtype() == DType::Float64 && !v[0].is_cuda()) return silu(v[0]) * v[1];
          return swiglu(v[0], v[1]);
        },
        {{a, true}, {b, true}}, d, tol_for(dt, 1e-5), tol_for(dt, 1e-5));
  });
}

// bias_gelu: x of one to four dims with a bias over the last, widths across
// the vector width and its tails (so the bias's column in a vector wraps
// nowhere), both GELU forms, every float dtype, values wide enough for both
// tails of GELU. The float64 reference is gelu(x + bias), the composition
// the op replaces; on CUDA the fused kernels are compared with the CPU's.
TEST_F(Drawn, BiasGelu) {
  for_each_draw("bias_gelu", 200, [&](Draw& d) {
    const Shape s = d.shape(d.integer(1, 4), 1, 37, true);
    const DType dt = d.pick(kFloats);
    const bool tanh_approx = d.chance(0.5);
    Tensor x = d.values(s, dt, Specials::finite(), 6.0), b = d.values({s.back()}, dt, Specials::finite(), 2.0);
    check_case(
        detail::str_cat("bias_gelu ", shape_str(s), tanh_approx ? " tanh" : " erf"),
        [=](const std::vector<Tensor>& v) {
          if (v[0].dtype() == DType::Float64 && !v[0].is_cuda()) return gelu(v[0] + v[1], tanh_approx);
          return bias_gelu(v[0], v[1], tanh_approx);
        },
        {{x, true}, {b, true}}, d, tol_for(dt, 1e-5), tol_for(dt, 1e-5));
  });
}

// rotary_embedding: x [batch..., seq, heads, head_dim] with zero to two
// leading dims, head dims from 2 up (halves that take the CUDA kernel's
// vectors and halves that do not), angles of any size (positions far out,
// as a context-parallel rank's chunk has), every float dtype; the tables
// random rather than cos/sin so a kernel that mixes them up fails. On CUDA
// the 64-bit index path is drawn too.
TEST_F(Drawn, RotaryEmbedding) {
  for_each_draw("rotary_embedding", 200, [&](Draw& d) {
    const int64_t t = d.integer(1, 12), h = d.integer(1, 5), hd = 2 * d.integer(1, 40);
    const bool index64 = d.chance(0.3);
    Shape xs;
    for (int64_t i = d.integer(0, 2); i > 0; --i) xs.push_back(d.size(1, 3));
    for (int64_t v : {t, h, hd}) xs.push_back(v);
    const DType dt = d.pick(kFloats);
    Tensor x = d.values(xs, dt, Specials::finite(), 2.0);
    Tensor c = d.values({t, hd / 2}, dt), s = d.values({t, hd / 2}, dt);
    const IntDiv32LimitScope index_path(index64 ? 0 : INT64_MAX);
    check_case(
        detail::str_cat("rotary_embedding x", shape_str(xs), index64 ? ", 64-bit index" : ""),
        [=](const std::vector<Tensor>& v) { return rotary_embedding(v[0], v[1], v[2]); },
        {{x, true}, {c, false, true}, {s, false, true}}, d, tol_for(dt, 1e-5), tol_for(dt, 1e-5));
  });
}

// scaled_dot_product_attention: batch and heads, query and key lengths
// drawn apart (causal with more or fewer keys than queries), head dims of q
// and v apart, dropout from one seed on every backend, an explicit scale;
// on CUDA, a drawn scratch size splits the queries into blocks.
TEST_F(Drawn, Attention) {
  for_each_draw("attention", 150, [&](Draw& d) {
    const int64_t b = d.integer(1, 2), hd = d.integer(1, 3), tq = d.integer(1, 20), tk = d.integer(1, 20);
    const int64_t e = d.integer(1, 16), ev = d.integer(1, 16);
    const bool causal = d.chance(0.5);
    const double p = d.chance(0.3) ? 0.25 : 0.0;
    const DType dt = d.pick<DType>({DType::Float32, DType::Float64, DType::Float32, DType::BFloat16});
    std::optional<double> scale;
    if (d.chance(0.3)) scale = d.uniform() + 0.1;
    Tensor q = d.values({b, hd, tq, e}, dt), k = d.values({b, hd, tk, e}, dt), v = d.values({b, hd, tk, ev}, dt);
    const int64_t scratch = d.chance(0.5) ? b * hd * tk * d.integer(1, 4) : 0;
    const uint64_t gseed = d.bits();
    if (cuda_is_available()) set_attention_cuda_scratch(scratch);
    check_case(
        detail::str_cat("attention q", shape_str(q.sizes()), " k", shape_str(k.sizes()), " v", shape_str(v.sizes()),
                        causal ? " causal" : "", " dropout ", p, scale ? " scale " : "", scale ? *scale : 0.0,
                        " cuda scratch ", scratch),
        [=](const std::vector<Tensor>& in) {
          Generator g(gseed);
          return scaled_dot_product_attention(in[0], in[1], in[2], causal, p, &g, scale);
        },
        // bfloat16 x 3: the backward's delta = rowsum(dO * O) reads O rounded
        // to bfloat16 (as FlashAttention's does), so a gradient that is zero
        // in exact arithmetic (one key) is O's rounding times |dO| |V|.
        {{q, true}, {k, true}, {v, true}}, d, tol_for(dt, 1e-4) * (dt == DType::BFloat16 ? 3 : 1),
        tol_for(dt, 1e-4) * (dt == DType::BFloat16 ? 3 : 1));
    if (cuda_is_available()) set_attention_cuda_scratch(0);
  });
}

// The fused (flash) CUDA kernels' domain: 16-bit and float32 (3xTF32) q,
// k, v with one head dim
// of 32, 64 or 128; query and key lengths across tile edges (1 to 150, the
// tiles are 64 and 128), causal with fewer or more keys, dropout, a scale,
// inputs in drawn layouts (strided views reach the kernels as copies). On
// the CPU these check the blocked kernel against float64; under CUDA the
// fused kernels against the CPU, with key tiles of 64 or 128 drawn for the
// forward and the backward apart, and the backward's query-tile stages.
TEST_F(Drawn, FlashAttention) {
  const int64_t launches = attention_cuda_flash_launches();
  for_each_draw("flash_attention", 24, [&](Draw& d) {
    const int64_t b = d.integer(1, 2), hd = d.integer(1, 2), tq = d.integer(1, 150), tk = d.integer(1, 150);
    const int64_t e = d.pick<int64_t>({32, 64, 128});
    const bool causal = d.chance(0.5);
    const double p = d.chance(0.25) ? 0.2 : 0.0;
    const DType dt = d.pick<DType>({DType::BFloat16, DType::Float16, DType::Float32});
    std::optional<double> scale;
    if (d.chance(0.25)) scale = d.uniform() + 0.05;
    Tensor q = d.values({b, hd, tq, e}, dt), k = d.values({b, hd, tk, e}, dt), v = d.values({b, hd, tk, e}, dt);
    const uint64_t gseed = d.bits();
    const FlashTiles tiles{d.pick<int>({64, 128}), d.pick<int>({64, 128}), d.pick<int>({1, 2})};
    if (cuda_is_available()) set_attention_cuda_flash_tiles(tiles);
    check_case(
        detail::str_cat("flash attention q", shape_str(q.sizes()), " k", shape_str(k.sizes()), causal ? " causal" : "",
                        " dropout ", p, scale ? " scale " : "", scale ? *scale : 0.0, " key tiles ", tiles.fwd_keys,
                        "/", tiles.bwd_keys, " stages ", tiles.bwd_stages),
        [=](const std::vector<Tensor>& in) {
          Generator g(gseed);
          return scaled_dot_product_attention(in[0], in[1], in[2], causal, p, &g, scale);
        },
        {{q, true}, {k, true}, {v, true}}, d, tol_for(dt, 1e-4) * 3, tol_for(dt, 1e-4) * 3);
  });
  if (cuda_is_available()) EXPECT_GT(attention_cuda_flash_launches(), launches) << "the fused kernels never ran";
}

}  // namespace
}  // namespace ember
