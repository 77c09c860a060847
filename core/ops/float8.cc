// Float8 training's ops (ops_float8.h): the scale of a tensor, its scaled
// cast to e4m3/e5m2, the scaled matmul, and float8_linear built on them.
// The CPU kernels are the reference for float8.cu's; the CPU scaled_mm
// widens its float8 operands to float32 (exactly) and runs the float32 GEMM,
// so its products are the exact ones the tensor cores form and only the
// order of the float32 sum differs from cuBLASLt's.
#include <cmath>
#include <cstdint>
#include <mutex>

#include "core/autocast.h"
#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops/kernels.h"
#include "core/ops_float8.h"

namespace ember {

// ---- CPU kernels ----
namespace {

// max that keeps a NaN from either side (torch.max's rule).
inline float nan_max(float a, float b) { return a != a ? a : (b != b || b > a) ? b : a; }

template <typename T>
float amax_cpu(const T* x, int64_t n) {
  float result = 0;
  std::mutex mu;
  parallel_for(n, kParallelGrain, [&](int64_t b, int64_t e) {
    float m = 0;
    bool nan = false;
    for (int64_t i = b; i < e; ++i) {
      const float a = std::fabs(load_as<float>(x + i));
      m = a > m ? a : m;
      nan |= a != a;
    }
    std::lock_guard<std::mutex> lock(mu);
    result = nan_max(result, nan ? NAN : m);
  });
  return result;
}

float max_of(DType fp8) { return fp8 == DType::Float8E4M3 ? Float8E4M3::format::kMax : Float8E5M2::format::kMax; }

template <typename T, typename F8>
void to_float8_cpu_t(const T* x, float scale, F8* out, int64_t n) {
  parallel_for(n, kParallelGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[i].x = F8::format::from_float(load_as<float>(x + i) * scale, true);
  });
}

}  // namespace

void float8_scale_cpu(const Tensor& x, DType fp8, Tensor& out) {
  float amax = 0;
  EMBER_DISPATCH_FLOAT(x.dtype(), "float8_scale", [&] { amax = amax_cpu(x.data<scalar_t>(), x.numel()); });
  float* o = out.data<float>();
  o[0] = float8_scale_of(amax, max_of(fp8));
  o[1] = 1.0f / o[0];
  o[2] = amax;
}

void to_float8_cpu(const Tensor& x, const Tensor& scale, Tensor& out) {
  const float s = *scale.data<float>();
  EMBER_DISPATCH_FLOAT(x.dtype(), "to_float8", [&] {
    using T = scalar_t;
    if (out.dtype() == DType::Float8E4M3)
      to_float8_cpu_t(x.data<T>(), s, out.data<Float8E4M3>(), x.numel());
    else
      to_float8_cpu_t(x.data<T>(), s, out.data<Float8E5M2>(), x.numel());
  });
}

// ---- Ops ----
namespace {

// What float8_scale and to_float8 take: a defined float32/bf16/fp16 input
// and a float8 target.
void check_cast(const Tensor& x, DType fp8, const char* op) {
  EMBER_CHECK(x.defined(), op, ": undefined input");
  EMBER_CHECK(is_float8(fp8), op, ": the target dtype must be float8_e4m3fn or float8_e5m2, got ", fp8);
  EMBER_CHECK(is_floating(x.dtype()) && x.dtype() != DType::Float64, op, ": input must be float32, ",
              "bfloat16 or float16, got ", x.dtype());
}

void check_scale(const Tensor& scale, const Tensor& like, const char* op, const char* name) {
  EMBER_CHECK(scale.defined() && scale.dim() == 0 && scale.dtype() == DType::Float32, op, ": ", name,
              " must be a float32 scalar tensor, got ", scale.defined() ? shape_str(scale.sizes()) : "undefined", " ",
              scale.defined() ? dtype_name(scale.dtype()) : "");
  EMBER_CHECK(scale.device() == like.device(), op, ": ", name, " is on ", scale.device(), " but the input on ",
              like.device());
}

}  // namespace

Tensor float8_scale(const Tensor& x, DType fp8) {
  check_cast(x, fp8, "float8_scale");
  NoGradGuard no_grad;
  const Tensor xc = x.contiguous();
  Tensor out = Tensor::empty({3}, TensorOptions(DType::Float32, x.device()));
  if (x.is_cuda())
    float8_scale_cuda(xc, fp8, out);
  else
    float8_scale_cpu(xc, fp8, out);
  return out;
}

Tensor to_float8(const Tensor& x, const Tensor& scale, DType fp8) {
  check_cast(x, fp8, "to_float8");
  check_scale(scale, x, "to_float8", "scale");
  NoGradGuard no_grad;
  const Tensor xc = x.contiguous(), sc = scale.contiguous();
  Tensor out = Tensor::empty(x.sizes(), TensorOptions(fp8, x.device()));
  if (out.numel() == 0) return out;
  if (x.is_cuda())
    to_float8_cuda(xc, sc, out);
  else
    to_float8_cpu(xc, sc, out);
  return out;
}

Tensor scaled_mm(const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b, DType out_dtype,
                 bool fast_accum) {
  const char* op = "scaled_mm";
  EMBER_CHECK(a.defined() && b.defined(), op, ": an input is undefined");
  EMBER_CHECK(a.dim() == 2 && b.dim() == 2, op, ": a and b must be 2-D, got ", shape_str(a.sizes()), " and ",
              shape_str(b.sizes()));
  EMBER_CHECK(is_float8(a.dtype()) && is_float8(b.dtype()), op, ": a and b must be float8, got ", a.dtype(), " and ",
              b.dtype());
  EMBER_CHECK(!(a.dtype() == DType::Float8E5M2 && b.dtype() == DType::Float8E5M2), op,
              ": a and b cannot both be float8_e5m2 (cuBLASLt has no e5m2 x e5m2 matmul)");
  EMBER_CHECK(a.device() == b.device(), op, ": a is on ", a.device(), " and b on ", b.device());
  const int64_t m = a.sizes()[0], k = a.sizes()[1], n = b.sizes()[1];
  EMBER_CHECK(b.sizes()[0] == k, op, ": ", shape_str(a.sizes()), " x ", shape_str(b.sizes()),
              ": inner dimensions differ");
  EMBER_CHECK(k % 16 == 0 && n % 16 == 0, op, ": ", shape_str(a.sizes()), " x ", shape_str(b.sizes()),
              ": k and n must be multiples of 16 (float8 matmul layouts)");
  EMBER_CHECK(out_dtype == DType::Float32 || out_dtype == DType::BFloat16 || out_dtype == DType::Float16, op,
              ": out_dtype must be float32, bfloat16 or float16, got ", out_dtype);
  check_scale(scale_a, a, op, "scale_a");
  check_scale(scale_b, b, op, "scale_b");
  // An empty sum is zeros, whatever the strides of the empty operands (and
  // cuBLASLt has no layout of zero rows).
  if (k == 0) return zeros({m, n}, TensorOptions(out_dtype, a.device()));
  EMBER_CHECK(a.strides()[1] == 1 || k <= 1, op, ": a ", shape_str(a.sizes()), " must be row-major (stride [k, 1]), ",
              "got strides ", shape_str(a.strides()));
  EMBER_CHECK(a.strides()[0] == k || m <= 1, op, ": a ", shape_str(a.sizes()), " must be row-major, got strides ",
              shape_str(a.strides()));
  EMBER_CHECK(b.strides()[0] == 1 && (b.strides()[1] == k || n <= 1), op, ": b ", shape_str(b.sizes()),
              " must be column-major (b.t() contiguous, strides [1, k]), got strides ", shape_str(b.strides()));
  NoGradGuard no_grad;
  if (a.is_cuda()) {
    Tensor out = Tensor::empty({m, n}, TensorOptions(out_dtype, a.device()));
    if (m == 0 || n == 0) return out;
    for (const Tensor* t : {&a, &b})
      EMBER_CHECK(reinterpret_cast<uintptr_t>(t->raw_data()) % 16 == 0, op, ": ", t == &a ? "a" : "b", " ",
                  shape_str(t->sizes()), " must start on a 16-byte boundary on CUDA (float8 matmuls); copy the view");
    scaled_mm_cuda(a, b, scale_a.contiguous(), scale_b.contiguous(), fast_accum, out);
    return out;
  }
  autocast::DisabledScope no_autocast;
  // Widening is exact, and so is each product of two float8 values in float32.
  const Tensor sum = matmul(a.to(DType::Float32), b.to(DType::Float32));
  return (sum * (scale_a * scale_b)).to(out_dtype);
}

Tensor float8_linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  return float8_linear(x, weight, bias, Float8Weight{});
}

namespace {

// float8_scale of `t`, one rank's part of a tensor when `sync` is set: the
// part's amax becomes the whole's (a max over the ranks) before the scale
// is made from it.
Tensor part_scales(const Tensor& t, DType fp8, const std::function<void(Tensor&)>& sync) {
  Tensor s = float8_scale(t, fp8);
  if (!sync) return s;
  Tensor amax = s.narrow(0, 2, 1).clone();
  sync(amax);
  return float8_scale(amax, fp8);
}

}  // namespace

Tensor float8_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Float8Weight& cast,
                     const Float8AmaxSync& sync) {
  const char* op = "float8_linear";
  const bool precast = cast.q.defined();
  // A given cast stands for the weight: the weight itself is not cast (its
  // data may be absent), only x and the bias.
  if (Tensor lx = autocast::low(x), lw = precast ? weight : autocast::low(weight), lb = autocast::low(bias);
      !lx.is_same(x) || !lw.is_same(weight) || (bias.defined() && !lb.is_same(bias)))
    return float8_linear(lx, lw, lb, cast, sync);
  EMBER_CHECK(x.defined() && weight.defined(), op, ": an input is undefined");
  EMBER_CHECK(weight.dim() == 2, op, ": weight must be [out, in], got ", shape_str(weight.sizes()));
  EMBER_CHECK(x.device() == weight.device() && (precast || x.dtype() == weight.dtype()), op, ": input ",
              shape_str(x.sizes()), " ", x.dtype(), " on ", x.device(), " and weight ", shape_str(weight.sizes()), " ",
              weight.dtype(), " on ", weight.device(), " must share dtype and device");
  for (DType t : {x.dtype(), weight.dtype()})
    EMBER_CHECK(t == DType::Float32 || t == DType::BFloat16 || t == DType::Float16, op,
                ": input and weight must be float32, bfloat16 or float16, got ", x.dtype(), " and ", weight.dtype());
  if (precast) {
    EMBER_CHECK(cast.q.dtype() == DType::Float8E4M3 && cast.q.sizes() == weight.sizes() && cast.q.is_contiguous() &&
                    cast.q.device() == weight.device(),
                op, ": the weight's cast must be a contiguous float8_e4m3fn ", shape_str(weight.sizes()), " on ",
                weight.device(), " (the weight's shape), got ", shape_str(cast.q.sizes()), " ", cast.q.dtype(), " on ",
                cast.q.device());
    EMBER_CHECK(cast.scales.defined() && cast.scales.dtype() == DType::Float32 && cast.scales.sizes() == Shape{3} &&
                    cast.scales.device() == weight.device(),
                op, ": the weight's cast scales must be float32 [3] on ", weight.device(),
                " ({scale, 1/scale, amax}), got ",
                cast.scales.defined() ? shape_str(cast.scales.sizes()) : "undefined");
  }
  const int64_t in = weight.sizes()[1], out_features = weight.sizes()[0];
  EMBER_CHECK(x.dim() >= 1 && x.size(-1) == in, op, ": input ", shape_str(x.sizes()), " has last dim ",
              (x.dim() ? x.size(-1) : 0), " but weight ", shape_str(weight.sizes()), " expects ", in);
  EMBER_CHECK(in % 16 == 0 && out_features % 16 == 0, op, ": weight ", shape_str(weight.sizes()),
              ": in and out features must be multiples of 16 for float8 matmuls (keep this layer in high precision)");
  if (bias.defined())
    EMBER_CHECK(
        bias.dim() == 1 && bias.sizes()[0] == out_features && bias.dtype() == x.dtype() && bias.device() == x.device(),
        op, ": bias ", shape_str(bias.sizes()), " ", bias.dtype(), " does not match the output ", out_features, " ",
        x.dtype());
  Shape out_shape(x.sizes().begin(), x.sizes().end() - 1);
  const int64_t rows = shape_numel(out_shape);
  out_shape.push_back(out_features);
  EMBER_CHECK(!weight.requires_grad() || !GradMode::is_enabled() || rows % 16 == 0, op, ": input ",
              shape_str(x.sizes()), " has ", rows, " rows; the weight gradient's float8 matmul needs a multiple of 16");
  std::vector<Tensor> inputs{x, weight};
  if (bias.defined()) inputs.push_back(bias);
  constexpr DType kE4M3 = DType::Float8E4M3, kE5M2 = DType::Float8E5M2;
  // The casts forward, kept for backward (the weight's in its [out, in]
  // layout, which is column-major as the forward's b).
  Tensor xq, x_scales, wq, w_scales;
  return differentiable(
      op, inputs,
      [&] {
        const Tensor x2 = x.reshape({rows, in});
        x_scales = part_scales(x2, kE4M3, sync.input);
        xq = to_float8(x2, x_scales.select(0, 0), kE4M3);
        if (precast) {
          w_scales = cast.scales, wq = cast.q;
        } else {
          w_scales = part_scales(weight, kE4M3, sync.weight);
          wq = to_float8(weight, w_scales.select(0, 0), kE4M3);
        }
        Tensor out = scaled_mm(xq, wq.t(), x_scales.select(0, 1), w_scales.select(0, 1), x.dtype(),
                               /*fast_accum=*/true);
        if (bias.defined()) add_(out, bias);
        return out.view(out_shape);
      },
      [&](const Tensor&) {
        const bool gx_ = x.requires_grad(), gw_ = weight.requires_grad(), gb_ = bias.defined() && bias.requires_grad();
        const bool has_bias = bias.defined();
        const Shape x_shape = x.sizes();
        const DType dt = x.dtype(), wdt = weight.dtype();
        const std::function<void(Tensor&)> sync_g = sync.grad_output;
        BackwardFn fn = [=](const Tensor& g) {
          std::vector<Tensor> grads(has_bias ? 3 : 2);
          const bool gx = gx_ && grad_wanted(0), gw = gw_ && grad_wanted(1), gb = gb_ && grad_wanted(2);
          const Tensor g2 = g.to(dt).reshape({rows, out_features});
          if (gx || gw) {
            const Tensor g_scales = part_scales(g2, kE5M2, sync_g);
            const Tensor gq = to_float8(g2, g_scales.select(0, 0), kE5M2);
            // dx [rows, in] = g [rows, out] @ w [out, in]: w as column-major.
            if (gx)
              grads[0] = scaled_mm(gq, wq.t().contiguous().t(), g_scales.select(0, 1), w_scales.select(0, 1), dt)
                             .view(x_shape);
            // dw [out, in] = g^T [out, rows] @ x [rows, in]: x as column-major.
            if (gw)
              grads[1] = scaled_mm(gq.t().contiguous(), xq.t().contiguous().t(), g_scales.select(0, 1),
                                   x_scales.select(0, 1), wdt);
          }
          if (gb) grads[2] = sum(g2, {0});
          return grads;
        };
        return Recorded{fn, {}};
      });
}

}  // namespace ember
