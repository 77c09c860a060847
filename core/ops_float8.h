// Float8 training's ops, as torchao's float8 training with tensorwise dynamic
// scaling (and torch._scaled_mm): a tensor is cast to an 8-bit float after
// multiplying it by scale = max_fp8 / amax(|x|), so its largest magnitude
// lands on the format's largest value; the matmul of two such tensors runs
// on float8 inputs and multiplies the float32 sum by both inverse scales.
// e4m3 (more mantissa) for activations and weights, e5m2 (more range) for
// gradients. Scales stay on the device: nothing here waits for the host, so
// a float8 step can be captured in a CUDA graph.
#pragma once

#include <functional>

#include "core/ops.h"
#include "core/tensor.h"

namespace ember {

// float32 [3] on x's device: {scale, 1 / scale, amax}, with amax =
// max(|x|) (NaN if x holds one) and scale = max_fp8 / max(amax, 1e-12),
// computed in float64 and rounded to float32, 1 / scale in float32 (torchao's
// amax_to_scale and its reciprocal). `fp8` is Float8E4M3 or Float8E5M2.
Tensor float8_scale(const Tensor& x, DType fp8);

// saturate(float32(x) * scale) rounded to `fp8` (to nearest even; past the
// largest finite value, the largest: torchao's to_fp8_saturated). x float32,
// bfloat16 or float16, any layout (the result is contiguous, of x's shape);
// scale a float32 scalar on x's device (float8_scale(x)[0]). Not
// differentiable.
Tensor to_float8(const Tensor& x, const Tensor& scale, DType fp8);

// torch._scaled_mm: (a * scale_a) @ (b * scale_b) as `out_dtype` (float32,
// bfloat16 or float16), the sum over k of float8 products in float32 (exact
// products; `fast_accum` lets the tensor cores' faster, less precise
// accumulation run, as torchao's forward does). a [m, k] row-major, b [k, n]
// column-major (b.t() contiguous: a weight [n, k] as w.t()), not both e5m2;
// k and n multiples of 16 (cuBLASLt's float8 layout rules, held on the CPU
// too, so a program that runs on one runs on the other). scale_a and
// scale_b: float32 scalars on the operands' device, the inverse scales. The
// CPU computes it in float32 (the reference); CUDA through cuBLASLt.
Tensor scaled_mm(const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b, DType out_dtype,
                 bool fast_accum = false);

// linear(x, weight, bias) with its three matmuls in float8 (torchao's
// Float8Linear, tensorwise dynamic scaling): forward x and weight in e4m3;
// backward the output gradient in e5m2, for x's gradient against the e4m3
// weight and the weight's against the e4m3 input. Dynamic: every call
// scales by the amax it sees now, so no amax history is kept. The result
// has x's dtype (the autocast dtype under autocast, as linear's). Keeps the
// float8 casts of x and the weight for backward (a quarter of float32's
// bytes). in_features and out_features must be multiples of 16, and so
// must the rows of x (x's elements / in_features) when the weight wants a
// gradient: each is the leading dimension of one of the three GEMMs.
Tensor float8_linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

// A weight already cast to e4m3, as float8_linear would cast it: `q` the
// e4m3 tensor of the weight's shape, `scales` float32 [3] on its device,
// float8_scale's {scale, 1 / scale, amax}. FSDP's float8 all-gather makes
// one from the sharded master weight (nn/float8.h).
struct Float8Weight {
  Tensor q, scales;
};

// How float8_linear's tensorwise scales see operands split across ranks
// (tensor parallelism): a set hook takes the float32 [1] amax of this
// rank's part and replaces it, in place, with the max over the ranks that
// hold the other parts, so every rank casts its part with the scale of the
// whole tensor, as one process would (torchao's float8 under DTensor). An
// operand whose hook is unset is whole on this rank. grad_output's runs in
// backward: every rank of the group must run that backward.
struct Float8AmaxSync {
  std::function<void(Tensor&amax)> input, weight, grad_output;
};

// float8_linear with the weight's cast given (when `cast.q` is undefined,
// the plain float8_linear): `weight` is where its gradient goes (its
// shape, dtype and device are checked) but its data is never read, so it
// may be a placeholder whose memory is freed. Under autocast x and the bias
// are cast, not the weight, and the weight's gradient comes out of its
// float8 matmul in the weight's dtype (float32 for a float32 weight, where
// the plain op's goes through bfloat16): with a cast of the float32 weight
// the two differ by bfloat16 rounding, and bit for bit without autocast.
// `sync` makes the scales of split operands the whole tensors' (a given
// cast's scales are used as they are).
Tensor float8_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Float8Weight& cast,
                     const Float8AmaxSync& sync = {});

}  // namespace ember
