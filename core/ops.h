// The public op API: free functions over Tensors. Every op runs on CPU and
// CUDA, checks its operands (naming the op and their shapes/dtypes/devices
// on error) and works on non-contiguous views. Binary ops broadcast
// NumPy-style and promote dtypes as PyTorch does.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "core/tensor.h"

namespace ember {

// ---- Factories ----
Tensor empty(const Shape& sizes, TensorOptions opts = {});
Tensor zeros(const Shape& sizes, TensorOptions opts = {});
Tensor ones(const Shape& sizes, TensorOptions opts = {});
Tensor full(const Shape& sizes, double value, TensorOptions opts = {});
// In t's layout: a channels-last t gives a channels-last result.
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor empty_like(const Tensor& t);
Tensor full_like(const Tensor& t, double value);
Tensor arange(double end, TensorOptions opts = {});
Tensor arange(double start, double end, double step = 1.0, TensorOptions opts = {});
Tensor scalar_tensor(double value, TensorOptions opts = {});

// ---- Elementwise, unary ----
Tensor neg(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor relu(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor gelu(const Tensor& x, bool tanh_approx = false);
// gelu(x + bias) with bias [x.size(-1)], as one op (core/ops/bias_gelu.cc):
// a linear layer's bias and GELU in one pass each way, equal to the
// composition bit for bit (GPT-2's MLP: Linear::activation).
Tensor bias_gelu(const Tensor& x, const Tensor& bias, bool tanh_approx = false);
// x * sigmoid(x) (torch's F.silu; SwiGLU's gate).
Tensor silu(const Tensor& x);
// silu(a) * b, LLaMA's gated feed-forward, as one op (one kernel each way,
// a and b kept for the backward, not silu(a)); core/ops/swiglu.cc. Inputs
// of different shapes or dtypes take the composition.
Tensor swiglu(const Tensor& a, const Tensor& b);
Tensor erf(const Tensor& x);
Tensor pow(const Tensor& x, double exponent);
Tensor clamp(const Tensor& x, std::optional<double> min, std::optional<double> max);
Tensor cast(const Tensor& x, DType dtype);

// ---- Elementwise, binary (broadcasting) ----
Tensor add(const Tensor& a, const Tensor& b, double alpha = 1.0);
Tensor sub(const Tensor& a, const Tensor& b, double alpha = 1.0);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
// relu's backward in one pass: grad where out > 0, else 0 (no autograd record).
Tensor relu_backward(const Tensor& grad, const Tensor& out);
// grad * gelu'(x) in one pass (gelu's backward; not itself differentiable).
Tensor gelu_backward(const Tensor& grad, const Tensor& x, bool tanh_approx = false);
// grad * silu'(x) in one pass (silu's backward; not itself differentiable).
Tensor silu_backward(const Tensor& grad, const Tensor& x);
// In place: out = out (op) b, b broadcast to out's shape, no dtype change.
Tensor& add_(Tensor& out, const Tensor& b, double alpha = 1.0);
Tensor& mul_(Tensor& out, const Tensor& b);

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, double s);
Tensor operator-(const Tensor& a, double s);
Tensor operator*(const Tensor& a, double s);
Tensor operator/(const Tensor& a, double s);
Tensor operator+(double s, const Tensor& a);
Tensor operator-(double s, const Tensor& a);
Tensor operator*(double s, const Tensor& a);
Tensor operator/(double s, const Tensor& a);

// ---- Reductions: over `dims` (empty = all), keepdim as in PyTorch ----
// The output is laid out as the kept dims lie in the input when the input
// is dense and its reduced dims are one block of its memory order (as
// PyTorch's reductions keep their input's layout): a permuted input's sum
// may be a permuted (dense) output; view() it only after contiguous().
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor max(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor min(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
// Unbiased by default (correction = 1), as torch.var.
Tensor var(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false, int64_t correction = 1);
// Index of the first maximum along `dim` (int64); no dim = over the flattened tensor.
Tensor argmax(const Tensor& x, std::optional<int64_t> dim = std::nullopt, bool keepdim = false);
Tensor argmin(const Tensor& x, std::optional<int64_t> dim = std::nullopt, bool keepdim = false);

Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);

// ---- Linear algebra ----
// torch.matmul semantics: 1-D dot, 2-D mm, N-D batched with broadcasting.
Tensor matmul(const Tensor& a, const Tensor& b);
Tensor mm(const Tensor& a, const Tensor& b);
Tensor bmm(const Tensor& a, const Tensor& b);
// x @ weight^T + bias, weight [out, in]. On CUDA the bias is added in the
// GEMM's epilogue (cuBLASLt, as torch's addmm; cublaslt_epilogues()).
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());
// gelu(linear(x, weight, bias)) as one op: on CUDA with the tanh
// approximation one cuBLASLt GEMM whose epilogue adds the bias and applies
// GELU (torch's _addmm_activation with use_gelu); otherwise linear without
// the bias, then bias_gelu. bias is required.
Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias, bool tanh_approx = false);

// ---- Over lists of tensors (torch's _foreach_*) ----
// One dtype (float32 or float64) and device per call, a few kernels for the
// whole list: each tensor's sum of squares as a float64 [n] tensor on the
// tensors' device, and an in-place multiply of every (contiguous) tensor,
// by a number or by a one-element tensor on the tensors' device (read
// there: nothing waits for the GPU, and a CUDA graph can capture it).
// Not differentiable (gradient clipping's building blocks).
Tensor foreach_sum_squares(const std::vector<Tensor>& tensors);
void foreach_mul_(const std::vector<Tensor>& tensors, double factor);
void foreach_mul_(const std::vector<Tensor>& tensors, const Tensor& factor);

// ---- Joining and indexing ----
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
// In place, torch's scatter_add_: out[index[p] along dim, the rest of p] +=
// src[p]; index (int64, values in range) and src have one shape, out is
// contiguous float32/float64 of src's dtype. Not differentiable (a
// backward's building block).
Tensor& scatter_add_(Tensor& out, int64_t dim, const Tensor& index, const Tensor& src);
// Every value of integer `indices` in [lo, hi), else an error naming `op`:
// at once on the CPU; on CUDA without a host synchronisation, raised at the
// next one (device.h, "Errors found on the device").
void check_index_range(const Tensor& indices, int64_t lo, int64_t hi, const char* op);
// int64 [..., num_classes]; num_classes = -1 infers max + 1.
Tensor one_hot(const Tensor& indices, int64_t num_classes = -1);

// ---- Random (counter-based Philox: same seed, same values on CPU and CUDA) ----
class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : seed_(seed) {}
  void manual_seed(uint64_t seed) { seed_ = seed; offset_ = 0; }
  uint64_t seed() const { return seed_; }
  // Reserves a fresh counter range for one op; safe across threads.
  uint64_t next_offset() { return offset_.fetch_add(1); }
  uint64_t offset() const { return offset_.load(); }
  void set_offset(uint64_t o) { offset_ = o; }

 private:
  uint64_t seed_;
  std::atomic<uint64_t> offset_{0};
};
Generator& default_generator();
void manual_seed(uint64_t seed);

Tensor rand(const Shape& sizes, TensorOptions opts = {}, Generator* gen = nullptr);   // U[0,1)
Tensor randn(const Shape& sizes, TensorOptions opts = {}, Generator* gen = nullptr);  // N(0,1)
Tensor& uniform_(Tensor& t, double low = 0.0, double high = 1.0, Generator* gen = nullptr);
Tensor& normal_(Tensor& t, double mean = 0.0, double std = 1.0, Generator* gen = nullptr);
// 1 with probability p (per element of `p`, or a scalar), else 0; dtype of p / opts.
Tensor bernoulli(const Tensor& p, Generator* gen = nullptr);
Tensor bernoulli(const Shape& sizes, double p, TensorOptions opts = {}, Generator* gen = nullptr);
Tensor randint(int64_t low, int64_t high, const Shape& sizes, TensorOptions opts = DType::Int64,
               Generator* gen = nullptr);

// ---- Comparisons of whole tensors (tests) ----
bool allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8);

}  // namespace ember
