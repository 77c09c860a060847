// The kernel layer under core/ops.h: strided iteration metadata and the
// CPU/CUDA launcher pairs each op file defines (foo.cc: *_cpu, foo.cu:
// *_cuda). Launchers assume operands were checked, broadcast and cast by the
// op layer; they only compute.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace ember {

// A tensor's data, or null where the tensor (or the pointer to it) is
// undefined: the optional operands of kernels (bias, weight, gradients not
// asked for).
template <typename T>
T* data_or_null(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}
template <typename T>
T* data_or_null(const Tensor* t) {
  return t != nullptr && t->defined() ? t->data<T>() : nullptr;
}

constexpr int kMaxDims = 8;
constexpr int kMaxOperands = 4;

// Operand 0 is the output. Inputs are broadcast to its shape (stride 0) and
// adjacent dims are merged where every operand allows it, so a contiguous
// elementwise op sees ndim == 1.
struct StridedIter {
  int ndim = 0;
  int nops = 0;
  int64_t numel = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxOperands][kMaxDims] = {};  // in elements, innermost last
  char* data[kMaxOperands] = {};
  DType dtypes[kMaxOperands] = {};
  // Operands (bit o) that are host scalars: the value of a 0-dim CPU tensor
  // in a CUDA op, passed to the kernel as an argument (no copy to the
  // device, no synchronisation); their data[o] is null and strides are 0.
  // scalar_i keeps integer values exactly (a double holds 53 bits).
  uint32_t host_scalars = 0;
  double scalar_f[kMaxOperands] = {};
  int64_t scalar_i[kMaxOperands] = {};
  bool is_host_scalar(int op) const { return (host_scalars >> op) & 1u; }

  bool is_contiguous(int op) const { return ndim == 1 && strides[op][0] == 1; }
  bool all_contiguous() const {
    for (int i = 0; i < nops; ++i) if (!is_contiguous(i)) return false;
    return true;
  }
};

StridedIter make_iter(const Tensor& out, std::initializer_list<Tensor> inputs, const char* op);

enum class UnaryOp {
  Neg,
  Abs,
  Exp,
  Log,
  Sqrt,
  Rsqrt,
  Relu,
  Sigmoid,
  Tanh,
  Gelu,
  GeluTanh,
  PowScalar,
  Clamp,
  Erf,
  Silu
};
// ReluGrad: a where b > 0, else 0 (relu's backward in one pass, a = grad, b = output).
// GeluGrad, GeluTanhGrad: a * gelu'(b) (gelu's backward in one pass, a = grad, b = input).
// SiluGrad: a * silu'(b), likewise.
enum class BinaryOp {
  Add,
  Sub,
  Mul,
  Div,
  Pow,
  Maximum,
  Minimum,
  ReluGrad,
  GeluGrad,
  GeluTanhGrad,
  SiluGrad,
  Eq,
  Ne,
  Lt,
  Le,
  Gt,
  Ge
};
enum class ReduceOp { Sum, Max, Min, ArgMax, ArgMin };
enum class RandomKind { Uniform, Normal, Bernoulli, Bernoulli_Tensor };

inline bool is_comparison(BinaryOp op) { return op >= BinaryOp::Eq; }

// Unary: out = f(in; p0, p1). Same dtype in and out.
void unary_cpu(UnaryOp op, const StridedIter& it, double p0, double p1);
void unary_cuda(UnaryOp op, const StridedIter& it, double p0, double p1);
// Binary: out = a (op) b, with alpha scaling b for Add/Sub. Inputs share a
// dtype; out is that dtype, or bool for comparisons.
void binary_cpu(BinaryOp op, const StridedIter& it, double alpha);
void binary_cuda(BinaryOp op, const StridedIter& it, double alpha);
// where: operands (out, cond[bool], a, b).
void where_cpu(const StridedIter& it);
void where_cuda(const StridedIter& it);
// Copy with cast: operands (out, in), any dtypes.
void copy_cpu(const StridedIter& it);
void copy_cuda(const StridedIter& it);
// Operand (out) only.
void fill_cpu(const StridedIter& it, double value);
void fill_cuda(const StridedIter& it, double value);
// out contiguous: out[i] = start + i * step.
void arange_cpu(Tensor& out, double start, double step);
void arange_cuda(Tensor& out, double start, double step);

// Reduce the middle axis of a contiguous [outer, r, inner] input into a
// contiguous [outer, inner] output (int64 for Arg*; input dtype otherwise).
void reduce_cpu(ReduceOp op, const Tensor& in, Tensor& out, int64_t outer, int64_t r, int64_t inner);
void reduce_cuda(ReduceOp op, const Tensor& in, Tensor& out, int64_t outer, int64_t r, int64_t inner);

// Softmax over the middle axis of contiguous [outer, r, inner].
void softmax_cpu(const Tensor& in, Tensor& out, int64_t outer, int64_t r, int64_t inner, bool log);
void softmax_cuda(const Tensor& in, Tensor& out, int64_t outer, int64_t r, int64_t inner, bool log);

// Fused attention over contiguous q [n, tq, d], k [n, tk, d], v [n, tk, dv]
// (float32 or float64): out = dropout(softmax(q k^T * scale, causal: key j
// seen by query i only when j <= i)) v. Dropout keeps element (b, i, j) when
// Philox's Bernoulli(1 - p) draw at index (b * tq + i) * tk + j (seed,
// offset) is 1, as bernoulli() fills [n, tq, tk]. The backward recomputes
// the probabilities from q and k; dq, dk, dv are overwritten.
struct AttentionArgs {
  int64_t n = 0, tq = 0, tk = 0, d = 0, dv = 0;
  double scale = 1.0;
  bool causal = false;
  double dropout_p = 0.0;
  uint64_t seed = 0, offset = 0;
  // Inside a CUDA graph (cuda_graph_rng): {seed, offset base} on the device,
  // written before each replay; the draw is then (rng[0], rng[1] + offset).
  const uint64_t* rng = nullptr;
};
// q, k, v, out contiguous [n, t, d] in float32 or float64. lse, when given
// ([n, tq], the dtype's): each row's log-sum-exp of its scaled scores. dlse,
// when given: the gradient of that output too (the backward's delta_i =
// dO_i . O_i - dlse_i).
void attention_forward_cpu(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                           Tensor* lse = nullptr);
void attention_forward_cuda(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                            Tensor* lse = nullptr);
void attention_backward_cpu(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& out, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                            const Tensor* dlse = nullptr);
void attention_backward_cuda(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                             const Tensor* dlse = nullptr);
// The fused (flash) CUDA kernels for 16-bit or float32 q, k, v of one head
// dim (32, 64 or 128, q's equal to v's; float32 on TF32 tensor cores in
// 3xTF32, nearly float32's accuracy): out in q's dtype and lse [n, tq] float32 (the
// log-sum-exp of each row's scaled scores); the backward takes them (out and
// dout in q's dtype) and writes dq, dk, dv in float32 or in q's dtype (dk and
// dv one of the two). Float32's backward runs the blocked kernels under
// deterministic_algorithms() and where a block's shared memory does not fit. Every tensor is [..., t, d] with the n
// heads its leading dims in order, read and written where it lies when its rows are dense and its strides 16-byte
// multiples (the heads of a packed [B, T, 3, H, D] projection, of a [B, T, H, D] output, keys expanded over groups of
// query heads), else through a contiguous copy. supports() is false without CUDA, for other
// shapes and dtypes, for a scale that is not positive (the kernels take
// the maximum of the unscaled scores), and after
// set_attention_cuda_flash(false) (or EMBER_FLASH_ATTENTION=0), which leave
// the blocked-GEMM kernels above.
bool attention_flash_cuda_supports(const AttentionArgs& a, DType dt);
void attention_flash_forward_cuda(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v,
                                  Tensor& out, Tensor& lse);
void attention_flash_backward_cuda(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& out, const Tensor& dout, const Tensor& lse, Tensor& dq, Tensor& dk,
                                   Tensor& dv, const Tensor* dlse = nullptr);
void set_attention_cuda_flash(bool on);
int64_t attention_cuda_flash_launches();  // kernels launched so far (tests)
// The fused kernels' key tiles, for measuring and tests (0: the default,
// EMBER_FLASH_KEYS / EMBER_FLASH_BWD_KEYS if set, else FlashAttention-2's
// 128; other values are refused): keys a forward tile holds (64 or 128;
// head dim 128 always takes 64, and dropout 64 unless set) and keys a
// backward block owns (64 or 128, 4 or 8 warps); and the query tiles the
// backward stages in shared memory (0: EMBER_FLASH_BWD_STAGES if set, else
// 2 where the device has room; 1: the next tile loads only behind dQ's
// products; 2: behind all of a tile's products, as FlashAttention-2's
// double-buffered q).
struct FlashTiles {
  int fwd_keys = 0, bwd_keys = 0, bwd_stages = 0;
};
void set_attention_cuda_flash_tiles(FlashTiles tiles);
// Tests: the CUDA kernels' score scratch in elements (0: the default, 2^23),
// small enough to split a small problem into several query blocks.
void set_attention_cuda_scratch(int64_t elements);

// layer_norm over the rows of contiguous float32/float64 x ([rows, n], rows =
// mean.numel()); w and b (n elements) may be undefined. Backward writes any
// of dx ([rows, n]), dw and db (n) that is given. The CUDA kernels also take
// 16-bit x, w, b, y, dy and the gradients (one dtype) with float32 mean and
// rstd.
void layer_norm_forward_cpu(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                            Tensor& rstd);
void layer_norm_forward_cuda(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                             Tensor& rstd);
void layer_norm_backward_cpu(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& w,
                             Tensor* dx, Tensor* dw, Tensor* db);
void layer_norm_backward_cuda(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                              const Tensor& w, Tensor* dx, Tensor* dw, Tensor* db);
// The weight's and the bias's gradients of layer_norm (mean given) and
// rms_norm (mean null: xhat = x rstd): dw = sum over rows of dy xhat, db =
// sum of dy, either may be null (layer_norm.cu).
void norm_weight_grads_cuda(const Tensor& dy, const Tensor& x, const Tensor* mean, const Tensor& rstd, Tensor* dw,
                            Tensor* db);

// What a normalisation over the last `ndim` dims of x works on (layer_norm,
// rms_norm), after checking x and its affine parameters (named, may be
// undefined) against them: the normalised shape, the rows and their width,
// and the compute dtype (float32, or float64 for float64).
struct NormRows {
  Shape norm_shape;
  int64_t rows = 0, n = 0;
  DType compute = DType::Float32;
  // The dtype the kernels read and write x, the parameters, y and the
  // gradients in: x's own when x is 16-bit on a GPU and every parameter
  // has its dtype (the CUDA kernels compute in float32 inside, so no
  // float32 copies are made around them), else `compute`. Statistics are
  // always `compute`.
  DType io = DType::Float32;
  // t in the io dtype, contiguous (undefined stays undefined).
  Tensor prep(const Tensor& t) const;
};
NormRows norm_rows(const char* op, const Tensor& x, int64_t ndim,
                   std::initializer_list<std::pair<const char*, const Tensor*>> params);

// rms_norm over the rows of contiguous float32/float64 x ([rows, n], rows =
// rstd.numel()); w (n elements) may be undefined. Backward writes dx
// ([rows, n]) and dw (n) where given. The CUDA kernels also take 16-bit x,
// w, y, dy, dx and dw (one dtype) with float32 rstd.
void rms_norm_forward_cpu(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd);
void rms_norm_forward_cuda(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd);
void rms_norm_backward_cpu(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& w, Tensor* dx,
                           Tensor* dw);
void rms_norm_backward_cuda(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& w, Tensor* dx,
                            Tensor* dw);

// cross_entropy over the rows of contiguous logits [rows, classes] (any
// float dtype) against contiguous int64/int32 target [rows]: loss and lse
// [rows] in float32 (float64 for float64 logits), and where given counted
// (float32 [rows]): 1 for a row whose target is not ignore_index, else 0.
// Backward writes grad [rows, classes] in the logits' dtype from grad_loss
// (the loss's dtype).
struct CrossEntropyArgs {
  int64_t rows = 0, classes = 0;
  double label_smoothing = 0;
  int64_t ignore_index = -100;
};
void cross_entropy_forward_cpu(const CrossEntropyArgs& a, const Tensor& logits, const Tensor& target, Tensor& loss,
                               Tensor& lse, Tensor* counted);
void cross_entropy_forward_cuda(const CrossEntropyArgs& a, const Tensor& logits, const Tensor& target, Tensor& loss,
                                Tensor& lse, Tensor* counted);
void cross_entropy_backward_cpu(const CrossEntropyArgs& a, const Tensor& grad_loss, const Tensor& logits,
                                const Tensor& target, const Tensor& lse, Tensor& grad);
void cross_entropy_backward_cuda(const CrossEntropyArgs& a, const Tensor& grad_loss, const Tensor& logits,
                                 const Tensor& target, const Tensor& lse, Tensor& grad);

// Float8 (ops_float8.h). float8_scale: x contiguous float32/bf16/fp16, out
// float32 [3] = {scale, 1/scale, amax}. to_float8: x contiguous, scale a
// float32 scalar, out contiguous float8 of x's shape. scaled_mm: checked by
// the op (a row-major, b column-major, k and n multiples of 16), out [m, n].
void float8_scale_cpu(const Tensor& x, DType fp8, Tensor& out);
void float8_scale_cuda(const Tensor& x, DType fp8, Tensor& out);
void to_float8_cpu(const Tensor& x, const Tensor& scale, Tensor& out);
void to_float8_cuda(const Tensor& x, const Tensor& scale, Tensor& out);
void scaled_mm_cuda(const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b, bool fast_accum,
                    Tensor& out);
// scaled_mm_cuda keeps, per thread, the cuBLASLt descriptors and the
// algorithm it chose for each problem (shapes, dtypes, fast accumulation,
// the operands' alignments): a repeated matmul skips the heuristic query
// and the descriptors' setup. How many calls found their plan, and how
// many made one (zeros without CUDA).
struct ScaledMmPlanStats {
  uint64_t hits = 0, misses = 0;
};
ScaledMmPlanStats scaled_mm_plan_stats();
// max_fp8 / max(amax, 1e-12) in float64, rounded to float32 (torchao's
// amax_to_scale); a NaN amax gives a NaN scale. Both backends use it.
EMBER_HD float float8_scale_of(float amax, float max_fp8) {
  const double a = static_cast<double>(amax);
  return static_cast<float>(static_cast<double>(max_fp8) / (a < 1e-12 ? 1e-12 : a));
}

// bias_gelu: x contiguous [rows, cols] (any leading shape), bias [cols] of
// x's dtype; y = gelu(x + bias), and backward dx = g gelu'(x + bias).
void bias_gelu_forward_cpu(const Tensor& x, const Tensor& bias, bool tanh_approx, Tensor& y);
void bias_gelu_forward_cuda(const Tensor& x, const Tensor& bias, bool tanh_approx, Tensor& y);
void bias_gelu_backward_cpu(const Tensor& g, const Tensor& x, const Tensor& bias, bool tanh_approx, Tensor& dx);
void bias_gelu_backward_cuda(const Tensor& g, const Tensor& x, const Tensor& bias, bool tanh_approx, Tensor& dx);

// swiglu (silu(a) * b) over contiguous a, b of one shape and float dtype:
// y, and where given da and db from the output gradient g.
void swiglu_forward_cpu(const Tensor& a, const Tensor& b, Tensor& y);
void swiglu_forward_cuda(const Tensor& a, const Tensor& b, Tensor& y);
void swiglu_backward_cpu(const Tensor& g, const Tensor& a, const Tensor& b, Tensor* da, Tensor* db);
void swiglu_backward_cuda(const Tensor& g, const Tensor& a, const Tensor& b, Tensor* da, Tensor* db);

// rotary_embedding of contiguous x [outer, seq, heads, head_dim] with
// cos/sin tables [seq, head_dim/2], all float32 or all float64; inverse
// turns the other way (the backward). The CUDA kernel also takes 16-bit x
// and y with float32 tables.
struct RopeGeom {
  int64_t outer = 0, seq = 0, heads = 0, head_dim = 0;
};
void rope_cpu(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse, const RopeGeom& g, Tensor& y);
void rope_cuda(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse, const RopeGeom& g, Tensor& y);

// A list of tensors cut into chunks (core/ops/foreach.cc): chunk c is
// elements [chunks[c].second, + kChunk) of tensor chunks[c].first; tensor t's
// chunks are first_chunk[t] .. first_chunk[t + 1].
struct ForeachTable {
  static constexpr int64_t kChunk = 16384;
  std::vector<void*> ptrs;
  std::vector<int64_t> numel, first_chunk;
  std::vector<std::pair<int64_t, int64_t>> chunks;
};
ForeachTable foreach_table(const std::vector<Tensor>& ts);
// out: float64 [tensors], each tensor's sum of squares.
void foreach_sum_squares_cpu(const ForeachTable& tab, DType dt, Tensor& out);
void foreach_sum_squares_cuda(const ForeachTable& tab, DType dt, Tensor& out);
void foreach_mul_cpu(const ForeachTable& tab, DType dt, double factor);
// device_factor: null, or the float64 factor on the device (then `factor` is unused).
void foreach_mul_cuda(const ForeachTable& tab, DType dt, double factor, const double* device_factor, int device);

// Row-major batched GEMM: C[b] = op(A[b]) @ op(B[b]), C contiguous [batch, m, n].
struct GemmArgs {
  DType dtype;
  int64_t batch, m, n, k;
  bool trans_a, trans_b;  // A is stored [k, m] (resp. B [n, k]) when set
  const void* a; int64_t lda, stride_a;
  const void* b; int64_t ldb, stride_b;
  void* c; int64_t ldc, stride_c;
  double alpha = 1.0, beta = 0.0;  // C = alpha op(A) op(B) + beta C (float32/float64)
};
// float32 GEMM with BLAS's row-major arguments (C = alpha op(A) op(B) +
// beta C) on oneDNN's sgemm: its AVX-512 kernels ran this machine's
// transformer GEMMs at 1.8x OpenBLAS's as the environment pins it
// (OPENBLAS_CORETYPE=Haswell) and 1.08x its AVX-512 kernels, and small
// ones (attention's 64-row blocks) at 2-6x (bench/README.md). Nothing to do
// when m, n or k is 0 (C is scaled by beta when k is 0).
void sgemm_cpu(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm_cpu(const GemmArgs& g);
// bfloat16/float16 on oneDNN's native kernels; false where the CPU has none
// (the caller widens to float32 instead).
bool gemm_cpu_native_16bit(const GemmArgs& g);
void gemm_cuda(const GemmArgs& g, int device);
// A GEMM with what follows it fused into cuBLASLt's epilogue (matmul.cc's
// linear and linear_gelu; row-major terms, batch 1, alpha 1, beta 0):
//   Bias:         C[i, j] = (A B)[i, j] + vec[j], vec [n] of C's dtype;
//   GeluTanhAux:  aux = (A B) + vec as Bias's C, C = gelu_tanh(aux), aux
//                 contiguous like C (n a multiple of 8); a null aux (a
//                 forward nothing will differentiate) keeps no aux: C alone
//                 (cuBLASLt's GELU_BIAS);
//   BiasGradA:    C = A B, and vec [m] = the sum of op(A)'s rows over k
//                 (linear's weight gradient g^T x gives the bias's too).
// The bias is added and GELU applied to the float32 sum before the one
// rounding to C's dtype. Returns false where cuBLASLt offers no algorithm
// for the problem (the caller runs the unfused ops); float32, float16 and
// bfloat16 only.
enum class GemmEpilogue { Bias, GeluTanhAux, BiasGradA };
bool gemm_epilogue_cuda(const GemmArgs& g, GemmEpilogue e, void* vec, void* aux, int device);
struct GemmEpilogueStats {
  uint64_t fused;     // calls that ran with their epilogue
  uint64_t declined;  // calls cuBLASLt had no algorithm for (run unfused)
};
GemmEpilogueStats gemm_epilogue_stats();
// grouped_mm with its groups as cumulative row ends on the device (offsets
// int64 [G]): product 0 Forward, 1 Input, 2 Weight (grouped_matmul.cc);
// contiguous 16-bit a, b and out, rows multiples of 8 elements, 16-byte
// aligned. out needs no zeroing (an empty group's weight block is written 0).
void grouped_gemm_offsets_cuda(int product, const Tensor& a, const Tensor& b, const Tensor& offsets, Tensor& out);
// group_order's counting sort (ops_nn.h): ids int64 [N, K] contiguous;
// rows [N K], positions [N, K] and offsets [G] written.
void group_order_cuda(const Tensor& ids, int64_t groups, Tensor& rows, Tensor& positions, Tensor& offsets);

// index_select on contiguous [outer, src_size, inner] -> [outer, n_index, inner].
void index_select_cpu(const Tensor& in, const Tensor& index, Tensor& out, int64_t outer, int64_t src_size, int64_t inner);
void index_select_cuda(const Tensor& in, const Tensor& index, Tensor& out, int64_t outer, int64_t src_size, int64_t inner);
// gather: out[p] = in[p with coordinate `dim` replaced by index[p]]; all contiguous.
void gather_cpu(const Tensor& in, const Tensor& index, Tensor& out, int64_t dim);
void gather_cuda(const Tensor& in, const Tensor& index, Tensor& out, int64_t dim);
// Records (does not raise) an index outside [lo, hi) in the device's error slot.
void check_index_range_cuda(const Tensor& index, int64_t lo, int64_t hi, const char* op);
// The adjoints, accumulating (float32/float64; indices already validated):
// out[outer, index[j], inner] += src[outer, j, inner], out contiguous.
void index_add_cpu(Tensor& out, const Tensor& index, const Tensor& src, int64_t outer, int64_t dst_size, int64_t inner);
void index_add_cuda(Tensor& out, const Tensor& index, const Tensor& src, int64_t outer, int64_t dst_size, int64_t inner);
// out[p with coordinate `dim` replaced by index[p]] += src[p]; all contiguous.
void scatter_add_cpu(Tensor& out, const Tensor& index, const Tensor& src, int64_t dim);
void scatter_add_cuda(Tensor& out, const Tensor& index, const Tensor& src, int64_t dim);

// Random fill of contiguous `out`. Element i draws from Philox(seed, counter
// = (i, offset)), identically on CPU and CUDA. For Bernoulli_Tensor, `p`
// holds per-element probabilities (same numel, contiguous, float dtype).
void random_cpu(RandomKind kind, Tensor& out, double a, double b, uint64_t seed, uint64_t offset, const Tensor& p);
// rng: null, or (inside a CUDA graph) the device's {seed, offset base}: the
// draw is then (rng[0], rng[1] + offset) and `seed` is unused.
void random_cuda(RandomKind kind, Tensor& out, double a, double b, uint64_t seed, uint64_t offset, const Tensor& p,
                 const uint64_t* rng = nullptr);
// Writes {seed, offset} to a graph's device state (two uint64), in a kernel
// on the device's current stream: no copy from the host to wait for.
void write_rng_state_cuda(uint64_t* state, uint64_t seed, uint64_t offset, int device);

// ---- Neural-network ops (conv.cc/.cu, batch_norm.cc/.cu, pool.cc/.cu) ----
// One 2-D convolution; the op layer has checked it and computed oh, ow.
struct ConvGeom {
  int64_t n, c, h, w;  // input [n, c, h, w]
  int64_t o, kh, kw;   // weight [o, c / groups, kh, kw]
  int64_t sh, sw, ph, pw, dh, dw, groups;
  int64_t oh, ow;      // output [n, o, oh, ow]
};
// CPU: every operand contiguous NCHW / OIHW, all of one dtype (16-bit floats
// run in float32). CUDA: x, y, dy, dx either all contiguous NCHW or all
// NHWC-strided (channels-last), w contiguous in the matching layout (OIHW or
// OHWI), bias contiguous. bias may be undefined.
void conv2d_forward_cpu(const ConvGeom& g, const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y);
void conv2d_forward_cuda(const ConvGeom& g, const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y);
// Writes the gradients whose pointers are non-null; each is preallocated in
// its operand's layout.
void conv2d_backward_cpu(const ConvGeom& g, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx,
                         Tensor* dw, Tensor* db);
// CUDA: dx and dw (the bias gradient is a reduction, done by the op layer).
void conv2d_backward_cuda(const ConvGeom& g, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx,
                          Tensor* dw);
// How many convolution plans (one per pass and geometry) this process made
// through cuDNN's graph API and through its legacy API (device.h's
// cudnn_graph_api): what a test reads to know which path ran.
struct ConvPlanCounts {
  int64_t graph = 0, legacy = 0;
};
ConvPlanCounts conv_plan_counts_cuda();

// Batch norm of contiguous x [N, C, H, W]. Per-channel tensors (mean, var,
// invstd, w, b, dw, db) are contiguous [C] in the statistics dtype: float64
// for float64 x, float32 otherwise. w and b may be undefined (1 and 0).
// Mean and biased variance of each channel.
void batch_norm_stats_cpu(const Tensor& x, Tensor& mean, Tensor& var);
// CUDA: mean and invstd = 1 / sqrt(var + eps) on the device, and, when
// running_mean is non-null, the running statistics updated in place
// (running = (1 - momentum) * running + momentum * batch, unbiased variance),
// so that a training step's batch norms never synchronise with the host.
// running_mean and running_var: contiguous [C] in the statistics dtype.
void batch_norm_stats_cuda(const Tensor& x, Tensor& mean, Tensor& invstd, double eps, Tensor* running_mean,
                           Tensor* running_var, double momentum, Tensor* num_batches_tracked = nullptr);
// y = (x - mean) * invstd * w + b, y contiguous like x; relu: then
// max(y, 0) in the same pass (NaN kept, as relu keeps it). residual (a
// residual block's tail, which implies relu): y = relu(bn + residual), bn
// rounded to x's dtype before the add, so the values are those of the three
// ops batch_norm, add, relu; residual is laid out as x.
void batch_norm_apply_cpu(const Tensor& x, const Tensor& mean, const Tensor& invstd, const Tensor& w, const Tensor& b,
                          Tensor& y, bool relu = false, const Tensor* residual = nullptr);
void batch_norm_apply_cuda(const Tensor& x, const Tensor& mean, const Tensor& invstd, const Tensor& w, const Tensor& b,
                           Tensor& y, bool relu = false, const Tensor* residual = nullptr);
// dw = sum(dy * xhat), db = sum(dy); dx through the batch statistics when
// train, else dy * w * invstd. Non-null outputs are preallocated and fully
// written (their contents on entry do not matter). relu_out (batch norm
// fused with ReLU): the fused op's output, and dy counts only where it is
// > 0 (relu's backward folded into the reads: the same values as
// relu_backward then batch norm's backward). dres (with relu_out; the
// residual's gradient when the op added one): that masked dy, written by
// the pass that reads it, and on CUDA read back by the dx pass in place of
// dy and the mask.
void batch_norm_backward_cpu(const Tensor& x, const Tensor& dy, const Tensor& mean, const Tensor& invstd,
                             const Tensor& w, bool train, Tensor* dx, Tensor* dw, Tensor* db,
                             const Tensor* relu_out = nullptr, Tensor* dres = nullptr);
void batch_norm_backward_cuda(const Tensor& x, const Tensor& dy, const Tensor& mean, const Tensor& invstd,
                              const Tensor& w, bool train, Tensor* dx, Tensor* dw, Tensor* db,
                              const Tensor* relu_out = nullptr, Tensor* dres = nullptr);

// Pooling over `planes` = N * C [h, w] planes into [oh, ow]. x, y, dy, dx
// and indices are dense in one layout: NCHW (planes contiguous) or, with
// nhwc, channels-last (the c channels interleaved), which the kernels read
// natively so a channels-last network pools without layout copies.
struct PoolGeom {
  int64_t planes, h, w, oh, ow, kh, kw, sh, sw, ph, pw;
  bool count_include_pad;  // avg only
  bool nhwc = false;
  int64_t c = 1;  // channels (planes = N * c); used by nhwc
};
// Max pooling also writes indices (laid out as y; pool_index_dtype): each
// argmax's place in its window; backward routes dy there. The bodies the
// kernels run are pool.h's.
void max_pool2d_cpu(const PoolGeom& g, const Tensor& x, Tensor& y, Tensor& indices);
void max_pool2d_cuda(const PoolGeom& g, const Tensor& x, Tensor& y, Tensor& indices);
// dx is fully written (not accumulated into).
void max_pool2d_backward_cpu(const PoolGeom& g, const Tensor& dy, const Tensor& indices, Tensor& dx);
void max_pool2d_backward_cuda(const PoolGeom& g, const Tensor& dy, const Tensor& indices, Tensor& dx);
void avg_pool2d_cpu(const PoolGeom& g, const Tensor& x, Tensor& y);
void avg_pool2d_cuda(const PoolGeom& g, const Tensor& x, Tensor& y);
void avg_pool2d_backward_cpu(const PoolGeom& g, const Tensor& dy, Tensor& dx);
void avg_pool2d_backward_cuda(const PoolGeom& g, const Tensor& dy, Tensor& dx);
// Max pooling's indices: an argmax's place (row * kw + column) in its
// kh x kw window, in one byte where the window has at most 256 places
// (PyTorch stores the position in the plane in 8 bytes: the pool's
// backward reads them all again), in four otherwise.
inline DType pool_index_dtype(const PoolGeom& g) { return g.kh * g.kw <= 256 ? DType::UInt8 : DType::Int32; }

}  // namespace ember
