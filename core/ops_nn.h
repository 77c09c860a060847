// Neural-network ops over 4-D NCHW tensors: convolution, batch normalisation
// and pooling, on CPU and CUDA, differentiable with dedicated backward
// kernels (oneDNN / cuDNN convolutions, our own loops and kernels for the
// rest). Output sizes follow PyTorch's formulas exactly, so models and
// checkpoints carry over shape for shape.
#pragma once

#include <array>
#include <cstdint>
#include <optional>

#include "core/ops.h"
#include "core/tensor.h"

namespace ember {

// x [N, C, H, W], weight [O, C/groups, KH, KW], optional bias [O].
// Output [N, O, (H + 2p - d(K-1) - 1) / s + 1, ...].
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
              std::array<int64_t, 2> stride = {1, 1}, std::array<int64_t, 2> padding = {0, 0},
              std::array<int64_t, 2> dilation = {1, 1}, int64_t groups = 1);

// How CPU convolutions compute (oneDNN). Auto (the default): Winograd's
// F(4x4, 3x3) for 3x3, stride-1, undilated, ungrouped float32 convolutions
// where oneDNN has it (AVX-512 CPUs), the direct algorithm elsewhere; about
// 2.25x fewer multiplies and 1.3-2.4x faster per pass on ResNet's 3x3
// layers, with a larger rounding error than the direct sum (relative
// differences around 1e-6 to 1e-5 of the output's scale; ops_nn_test
// measures it). Direct: always the direct algorithm, as PyTorch's CPU
// convolutions. The environment variable EMBER_CONV_ALGO=direct|auto sets
// the initial value. GPU convolutions follow cuDNN's choices regardless.
enum class ConvAlgorithm { Auto, Direct };
void set_cpu_conv_algorithm(ConvAlgorithm algorithm);
ConvAlgorithm cpu_conv_algorithm();

// Layer normalisation over the last `normalized_ndim` dims (torch's
// F.layer_norm): (x - mean) / sqrt(var + eps) * weight + bias per row, the
// biased variance; weight and bias (either may be undefined) have the
// normalised shape. One op with its own derivative (core/ops/layer_norm.cc);
// runs in float32 under autocast, 16-bit inputs are computed in float32.
Tensor layer_norm(const Tensor& x, int64_t normalized_ndim, const Tensor& weight, const Tensor& bias, double eps);

// RMS normalisation over the last `normalized_ndim` dims (torch's
// F.rms_norm, Hugging Face's LlamaRMSNorm): x / sqrt(mean(x^2) + eps) *
// weight per row; weight (may be undefined) has the normalised shape. One
// op with its own derivative (core/ops/rms_norm.cc); float32 under autocast.
Tensor rms_norm(const Tensor& x, int64_t normalized_ndim, const Tensor& weight, double eps);

// The cross-entropy of each row of logits [N, C] against class indices
// target [N] (int64 or int32), as F.cross_entropy(reduction="none"): the
// row's log-sum-exp minus its target's logit, with label smoothing (the
// mean over classes of -log_softmax mixed in at label_smoothing) and 0 for
// a row whose target is ignore_index. One op with its own derivative
// (core/ops/cross_entropy.cc): it keeps the logits and one float per row,
// never a softmax the size of the logits, and reads 16-bit logits as they
// are. Returns float32 [N] (float64 for float64 logits); `counted`, when
// given, receives float32 [N], 1 where the row counts (the denominator of
// the mean). A target out of [0, C) that is not ignore_index is an error
// naming it (on a GPU at the next synchronisation, as index errors are).
Tensor cross_entropy_rows(const Tensor& logits, const Tensor& target, double label_smoothing = 0.0,
                          int64_t ignore_index = -100, Tensor* counted = nullptr);

// Rotary position embedding, Hugging Face LLaMA's "rotate half" convention:
// x [..., seq, heads, head_dim] (head_dim even), cos/sin [seq, head_dim/2]
// the angles of each row's position (rotary_tables in nn makes them). Per
// head vector, y[:D/2] = x1 cos - x2 sin and y[D/2:] = x2 cos + x1 sin. One
// op (core/ops/rope.cc); float32 under autocast.
Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin);

// Scaled-dot-product attention (torch.nn.functional.scaled_dot_product_attention):
// q [..., Tq, D], k [..., Tk, D], v [..., Tk, Dv] -> [..., Tq, Dv] =
// dropout(softmax(q k^T * scale [+ causal mask]), dropout_p) v, with scale
// 1/sqrt(D) by default and torch's top-left causal mask (query i sees keys
// j <= i). One op (core/ops/attention.cc): the [Tq, Tk] probabilities are
// never stored; backward recomputes them block by block. Dropout draws from
// `gen` (the default generator if null) the mask dropout() would. A
// low-precision op under autocast; 16-bit inputs are computed in float32.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool is_causal = false,
                                    double dropout_p = 0.0, Generator* gen = nullptr,
                                    std::optional<double> scale = std::nullopt);
// Attention over a packed projection, FlashAttention's qkvpacked layout:
// qkv [B, T, 3 E] holds q, k and v as its three column blocks of `heads`
// heads each ([B, T, 3, heads, E / heads]), as an in-projection writes them.
// Returns [B, T, heads, E / heads]: scaled_dot_product_attention of the three
// [B, heads, T, D] heads, transposed back, with one gradient for qkv. The
// fused CUDA kernels read q, k and v where they lie, write the output in this
// layout and the gradients into qkv's; elsewhere the heads are copied out
// and their gradients copied in.
Tensor scaled_dot_product_attention_qkvpacked(const Tensor& qkv, int64_t heads, bool is_causal = false,
                                              double dropout_p = 0.0, Generator* gen = nullptr,
                                              std::optional<double> scale = std::nullopt);
// The heads of column block `which` (0 q, 1 k, 2 v) of such a qkv: a
// [B, heads, T, E / heads] view.
Tensor qkv_heads(const Tensor& qkv, int64_t which, int64_t heads);
// The same attention without dropout, with each row's log-sum-exp of its
// scaled scores beside the output: [..., Tq, Dv + 1], the output in
// [..., :Dv] and the log-sum-exp in [..., Dv], in the compute dtype (float32
// for 16-bit inputs, as FlashAttention's logsumexp). Both are
// differentiable, which is what merging attention over blocks of keys needs
// (context parallelism: out = sum_b exp(lse_b - lse) out_b, lse = logsumexp
// of the lse_b). Needs at least one key.
Tensor scaled_dot_product_attention_lse(const Tensor& q, const Tensor& k, const Tensor& v, bool is_causal = false,
                                        std::optional<double> scale = std::nullopt);
// The gradients of q, k and v through one block of keys of an attention
// merged over blocks (as above): out and lse the merged rows' output and
// log-sum-exp, dout the gradient of out, block_lse this block's rows'
// log-sum-exp (the [..., Dv] entry of its _lse call). FlashAttention-2's
// backward by blocks: the block's probabilities are exp(s - lse), so no
// block's own output is kept. Not recorded by autograd; [..., T, D] results
// in the compute dtype, to sum over blocks. Context parallelism's ring
// backward calls it once per block as k and v travel round again.
std::array<Tensor, 3> scaled_dot_product_attention_block_grads(const Tensor& q, const Tensor& k, const Tensor& v,
                                                               const Tensor& out, const Tensor& dout, const Tensor& lse,
                                                               const Tensor& block_lse, bool is_causal = false,
                                                               std::optional<double> scale = std::nullopt);

// Grouped matrix multiply over variable-size groups of rows (the dropless
// mixture-of-experts GEMM, torch._grouped_mm's job): x [N, K] holds G
// consecutive groups of group_sizes[g] rows (sum N, a size may be 0), w
// [G, M, K] one [M, K] weight per group in nn::Linear's layout, and row i of
// group g gives y_i = x_i w[g]^T, y [N, M]. One op with its own
// derivative (dx_g = dy_g w[g], dw[g] = dy_g^T x_g; an empty group's weight
// gets a zero gradient). Each group is one GEMM of the matmul backends
// (oneDNN / OpenBLAS on the CPU, cuBLAS on CUDA); a low-precision op under
// autocast. group_sizes live on the host: the caller has them already
// (expert parallelism exchanges them before any token moves).
Tensor grouped_mm(const Tensor& x, const Tensor& w, const std::vector<int64_t>& group_sizes);
// The same with the groups as `offsets`, int64 [G] on x's device: group g's
// rows end at offsets[g] (cumulative, non-decreasing, the last N: torch's
// _grouped_mm `offs`). 16-bit CUDA operands with K and M multiples of 8 run
// on the device (grouped_matmul.cu: no wait, so a CUDA graph can capture
// it; bad offsets are named at the next synchronisation); anything else
// reads the offsets (a wait on CUDA) and takes the loop above.
Tensor grouped_mm(const Tensor& x, const Tensor& w, const Tensor& offsets);

// The dropless mixture-of-experts dispatch's stable counting sort: ids
// int64 [N, K] (row n's K choices, each in [0, groups)) put in group order,
// ties in (row, choice) order. rows [N K]: the row each position in that
// order holds; positions [N, K]: where each choice went; offsets [groups]:
// each group's end (cumulative), grouped_mm's offsets. All int64 on ids'
// device, made there (no wait); an id out of range is named (on CUDA at
// the next synchronisation). Not differentiable.
struct GroupOrder {
  Tensor rows, positions, offsets;
};
GroupOrder group_order(const Tensor& ids, int64_t groups);

// Normalises each channel of x [N, C, H, W]. training: by the batch
// statistics, and, when running_mean/var are defined, updates them in place
// as PyTorch does (running = (1 - momentum) * running + momentum * batch, the
// variance unbiased). Otherwise by running_mean/var, which must be defined.
// weight and bias ([C]) are optional (1 and 0). num_batches_tracked
// (BatchNorm2d's counter: one int64 element on x's device), when given, is
// incremented with each update of the running statistics: on a GPU by the
// statistics kernel itself, where a separate add was a launch a layer.
Tensor batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                  const Tensor& running_var, bool training, double momentum = 0.1, double eps = 1e-5,
                  const Tensor& num_batches_tracked = Tensor());
// relu(batch_norm(...)) as one op (cuDNN's BN_ACTIVATION, which PyTorch's
// eager step runs as two): the ReLU in the normalising pass, its backward
// folded into batch norm's reads of the gradient. The same values bit for
// bit as the two ops, one pass over the activation fewer each way.
Tensor batch_norm_relu(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                       const Tensor& running_var, bool training, double momentum = 0.1, double eps = 1e-5,
                       const Tensor& num_batches_tracked = Tensor());
// relu(batch_norm(x, ...) + residual) as one op: a residual block's tail
// (cuDNN's BN_ADD_ACTIVATION, three ops in PyTorch's eager step). The add
// and the ReLU in the normalising pass, which reads x and the residual and
// writes the output (the three ops read 5 tensors and write 3); the
// backward writes the residual's gradient, the masked dy, in a pass that
// reads it anyway (on CUDA the sums pass, whose dx pass then reads it in
// place of dy and the mask; on the CPU the dx loop). The same values bit for
// bit as the three ops (batch norm's output rounded to x's dtype before the
// add) where the gradient lies as x does (a misaligned one can change the
// CUDA sums' vector width, and so their order, as for batch_norm_relu).
// residual: x's shape, dtype and device, any layout (copied to x's where it
// differs); the output is laid out as x, where the add would have taken a
// channels-last residual's layout (BatchNorm2d::add_relu fuses only where
// the two agree).
Tensor batch_norm_add_relu(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
                           const Tensor& running_mean, const Tensor& running_var, bool training, double momentum = 0.1,
                           double eps = 1e-5, const Tensor& num_batches_tracked = Tensor());

// Padding counts as -inf; padding must be at most half the kernel.
Tensor max_pool2d(const Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride,
                  std::array<int64_t, 2> padding = {0, 0}, bool ceil_mode = false);
// count_include_pad: padded zeros count in the divisor (PyTorch's default).
Tensor avg_pool2d(const Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride,
                  std::array<int64_t, 2> padding = {0, 0}, bool ceil_mode = false, bool count_include_pad = true);

// PyTorch's pooling output size along one dim: ceil_mode rounds up, but the
// last window must still start inside the input or its left padding.
int64_t pool_output_size(int64_t in, int64_t kernel, int64_t stride, int64_t pad, int64_t dilation, bool ceil_mode);

}  // namespace ember
