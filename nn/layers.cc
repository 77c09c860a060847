// Layer construction (PyTorch's default initialisation) and forward passes.
#include "nn/layers.h"

#include <cmath>

#include "autograd/checkpoint.h"
#include "core/autograd_hook.h"
#include "core/cuda_graph.h"
#include "core/ops_nn.h"
#include "nn/init.h"

namespace ember::nn {

// ---- Linear: kaiming_uniform(a=sqrt(5)) weight, U(+-1/sqrt(fan_in)) bias ----
Linear::Linear(int64_t in, int64_t out, bool with_bias) : Module("Linear"), in_features(in), out_features(out) {
  EMBER_CHECK(in > 0 && out > 0, "Linear: features must be positive, got in=", in, " out=", out);
  weight = register_parameter("weight", empty({out, in}));
  if (with_bias) bias = register_parameter("bias", empty({out}));
  reset_parameters();
}

void Linear::reset_parameters() {
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
    init::uniform_(bias, -bound, bound);
  }
}

Tensor Linear::forward(const Tensor& x) {
  if (activation == LinearActivation::None) return apply_linear(kernel, x, weight, bias);
  const bool tanh_approx = activation == LinearActivation::GeluTanh;
  // A layer of the default kernel takes the fused op (one cuBLASLt GEMM on
  // CUDA); a parallelism's or float8's kernel runs its own product first.
  if (!kernel && bias.defined()) return linear_gelu(x, weight, bias, tanh_approx);
  const Tensor h = apply_linear(kernel, x, weight, Tensor());
  return bias.defined() ? bias_gelu(h, bias, tanh_approx) : gelu(h, tanh_approx);
}

// ---- Conv2d: same rule as Linear over fan_in = in/groups * kh * kw ----
Conv2d::Conv2d(int64_t in, int64_t out, std::array<int64_t, 2> k, Conv2dOptions opts)
    : Module("Conv2d"), in_channels(in), out_channels(out), kernel_size(k), options(opts) {
  EMBER_CHECK(opts.groups > 0 && in % opts.groups == 0 && out % opts.groups == 0, "Conv2d: in_channels ", in,
              " and out_channels ", out, " must be divisible by groups ", opts.groups);
  EMBER_CHECK(k[0] > 0 && k[1] > 0, "Conv2d: kernel size must be positive, got [", k[0], ",", k[1], "]");
  weight = register_parameter("weight", empty({out, in / opts.groups, k[0], k[1]}));
  if (opts.bias) bias = register_parameter("bias", empty({out}));
  reset_parameters();
}

Conv2d::Conv2d(int64_t in, int64_t out, int64_t k, int64_t stride, int64_t padding, bool with_bias)
    : Conv2d(in, out, {k, k}, Conv2dOptions{{stride, stride}, {padding, padding}, {1, 1}, 1, with_bias}) {}

void Conv2d::reset_parameters() {
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    double bound = 1.0 / std::sqrt(static_cast<double>(init::fans(weight).first));
    init::uniform_(bias, -bound, bound);
  }
}

Tensor Conv2d::forward(const Tensor& x) {
  EMBER_CHECK(x.dim() == 4 && x.size(1) == in_channels, "Conv2d: expected input [N, ", in_channels,
              ", H, W], got ", shape_str(x.sizes()));
  return conv2d(x, weight, bias, options.stride, options.padding, options.dilation, options.groups);
}

// ---- BatchNorm2d ----
BatchNorm2d::BatchNorm2d(int64_t c, double eps, double momentum, bool affine, bool track)
    : Module("BatchNorm2d"), num_features(c), eps(eps), momentum(momentum) {
  if (affine) {
    weight = register_parameter("weight", ones({c}));
    bias = register_parameter("bias", zeros({c}));
  }
  if (track) {
    running_mean = register_buffer("running_mean", zeros({c}));
    running_var = register_buffer("running_var", ones({c}));
    num_batches_tracked = register_buffer("num_batches_tracked", zeros({}, DType::Int64));
  }
}

Tensor BatchNorm2d::add_relu(const Tensor& x, const Tensor& residual) {
  EMBER_CHECK(!fused_relu,
              "BatchNorm2d::add_relu: fused_relu is set, so the ReLU would come before the residual's add");
  EMBER_CHECK(residual.defined(), "BatchNorm2d::add_relu: the residual is undefined");
  // The op lays its output out as x; the add would take a channels-last
  // residual's layout, so a residual laid out otherwise takes the three ops.
  const bool fusable = plain_call() && (!cross_replica_sum || !is_training()) && x.defined() &&
                       residual.sizes() == x.sizes() && residual.dtype() == x.dtype() &&
                       residual.device() == x.device() && residual.suggest_memory_format() == x.suggest_memory_format();
  if (!fusable) return relu((*this)(x) + residual);
  return normalize(x, residual);
}

Tensor BatchNorm2d::forward(const Tensor& x) { return normalize(x, Tensor()); }

Tensor BatchNorm2d::normalize(const Tensor& x, const Tensor& residual) {
  EMBER_CHECK(x.dim() == 4 && x.size(1) == num_features, "BatchNorm2d: expected input [N, ", num_features,
              ", H, W], got ", shape_str(x.sizes()));
  bool use_batch_stats = is_training() || !running_mean.defined();
  // The op: batch norm, with the ReLU (fused_relu), or with the residual's
  // add and the ReLU (add_relu, which never reaches the sync path).
  auto bn = [&](const Tensor& rm, const Tensor& rv, bool train, const Tensor& counter) {
    if (residual.defined())
      return batch_norm_add_relu(x, residual, weight, bias, rm, rv, train, momentum, eps, counter);
    return (fused_relu ? &batch_norm_relu : &batch_norm)(x, weight, bias, rm, rv, train, momentum, eps, counter);
  };
  auto sync = [&](bool update_running) {
    Tensor y = sync_forward(x, update_running);
    return fused_relu ? relu(y) : y;
  };
  // A checkpointed region's recompute (nn/checkpoint.h): the forward already
  // updated the running statistics; the recompute normalises with the same
  // batch statistics and leaves them alone.
  if (is_training() && autograd::in_checkpoint_recompute()) {
    if (cross_replica_sum) return sync(false);
    return bn(Tensor(), Tensor(), true, Tensor());
  }
  if (is_training() && cross_replica_sum) {
    if (num_batches_tracked.defined()) {
      NoGradGuard g;
      Tensor n = num_batches_tracked.detach();
      n += ones({}, DType::Int64);
    }
    return sync(true);
  }
  // Training, the op counts the batch with its running statistics' update
  // (on a GPU inside the statistics kernel: a launch fewer a layer).
  return bn(running_mean, running_var, use_batch_stats, is_training() ? num_batches_tracked : Tensor());
}

// Batch statistics over all replicas from one cross-replica sum of
// [sum(x), sum(x^2), count] per channel: mean = S1/N, var = S2/N - mean^2.
// The sums are taken in float64 so the E[x^2] - E[x]^2 form (one collective
// instead of two) keeps its low bits. Built from differentiable ops, so the
// gradient is that of batch norm over the global batch.
Tensor BatchNorm2d::sync_forward(const Tensor& x, bool update_running) {
  const int64_t c = num_features;
  const double local_count = static_cast<double>(x.size(0) * x.size(2) * x.size(3));
  Tensor xd = x.to(DType::Float64);
  Tensor packed = cat({sum(xd, {0, 2, 3}), sum(xd * xd, {0, 2, 3}), full({1}, local_count, {DType::Float64, x.device()})});
  Tensor total = cross_replica_sum(packed);
  EMBER_CHECK(total.defined() && total.sizes() == packed.sizes(), "BatchNorm2d: cross_replica_sum returned ",
              total.defined() ? shape_str(total.sizes()) : "an undefined tensor", ", expected ",
              shape_str(packed.sizes()));
  // The global count stays on the device: reading it would cost every
  // layer a wait for the GPU and keep the step out of a CUDA graph. Only a
  // replica with at most one value per channel reads it, for the check
  // (as PyTorch's SyncBatchNorm checks only when it cannot know).
  const Tensor n = total.narrow(0, 2 * c, 1).detach();
  if (local_count <= 1) {
    const double all = n.item();
    EMBER_CHECK(all > 1, "BatchNorm2d: expected more than 1 value per channel across replicas when training, got ", all,
                " (input ", shape_str(x.sizes()), ")");
  }
  Tensor mean = total.narrow(0, 0, c) / n;
  Tensor var = clamp(total.narrow(0, c, c) / n - mean * mean, 0.0, std::nullopt);
  if (running_mean.defined() && update_running) {
    NoGradGuard g;
    Tensor rm = running_mean.detach(), rv = running_var.detach();
    const Tensor unbiased = (n * momentum) / (n - 1.0);  // momentum * n / (n - 1), on the device
    rm.copy_(rm * (1.0 - momentum) + mean.detach().to(rm.dtype()) * momentum);
    rv.copy_(rv * (1.0 - momentum) + var.detach().to(rv.dtype()) * unbiased.to(rv.dtype()));
  }
  const DType dt = x.dtype();
  Tensor y = (x - mean.to(dt).view({1, c, 1, 1})) * rsqrt(var + eps).to(dt).view({1, c, 1, 1});
  if (weight.defined()) y = y * weight.view({1, c, 1, 1});
  if (bias.defined()) y = y + bias.view({1, c, 1, 1});
  return y;
}

// ---- LayerNorm, RMSNorm ----
namespace {
// How many trailing dims of x the norm covers, after checking they are its
// normalized_shape.
int64_t normalized_dims(const char* layer, const Tensor& x, const std::vector<int64_t>& shape) {
  const int64_t k = static_cast<int64_t>(shape.size());
  bool match = x.dim() >= k;
  for (int64_t i = 0; match && i < k; ++i) match = x.size(x.dim() - k + i) == shape[i];
  EMBER_CHECK(match, layer, ": input ", shape_str(x.sizes()), " does not end with normalized_shape ", shape_str(shape));
  return k;
}
}  // namespace

LayerNorm::LayerNorm(std::vector<int64_t> shape, double eps, bool affine)
    : Module("LayerNorm"), normalized_shape(std::move(shape)), eps(eps) {
  EMBER_CHECK(!normalized_shape.empty(), "LayerNorm: normalized_shape is empty");
  if (affine) {
    weight = register_parameter("weight", ones(normalized_shape));
    bias = register_parameter("bias", zeros(normalized_shape));
  }
}

Tensor LayerNorm::forward(const Tensor& x) {
  return functional::layer_norm(x, normalized_dims("LayerNorm", x, normalized_shape), weight, bias, eps);
}

RMSNorm::RMSNorm(std::vector<int64_t> shape, double eps, bool affine)
    : Module("RMSNorm"), normalized_shape(std::move(shape)), eps(eps) {
  EMBER_CHECK(!normalized_shape.empty(), "RMSNorm: normalized_shape is empty");
  if (affine) weight = register_parameter("weight", ones(normalized_shape));
}

Tensor RMSNorm::forward(const Tensor& x) {
  return rms_norm(x, normalized_dims("RMSNorm", x, normalized_shape), weight, eps);
}

// ---- Embedding: N(0, 1) init, as torch ----
Embedding::Embedding(int64_t num, int64_t dim) : Module("Embedding"), num_embeddings(num), embedding_dim(dim) {
  weight = register_parameter("weight", empty({num, dim}));
  init::normal_(weight, 0.0, 1.0);
}

Tensor Embedding::forward(const Tensor& indices) {
  EMBER_CHECK(indices.dtype() == DType::Int64 || indices.dtype() == DType::Int32,
              "Embedding: indices must be int64, got ", indices.dtype());
  if (indices.is_cuda()) {
    check_index_range(indices, 0, num_embeddings, "Embedding");  // on the device: no host synchronisation
  } else if (indices.numel() > 0) {
    int64_t lo = static_cast<int64_t>(min(indices).item()), hi = static_cast<int64_t>(max(indices).item());
    EMBER_CHECK(lo >= 0 && hi < num_embeddings, "Embedding: index out of range: indices span [", lo, ", ", hi,
                "] but there are ", num_embeddings, " embeddings");
  }
  Shape out = indices.sizes();
  out.push_back(embedding_dim);
  return index_select(weight, 0, indices.reshape({-1})).view(out);
}

Dropout::Dropout(double p) : Module("Dropout"), p(p) {
  EMBER_CHECK(p >= 0 && p <= 1, "Dropout: probability has to be between 0 and 1, but got ", p);
}

Generator* Dropout::generator(Generator& own) const {
  if (!is_training() || p == 0) return nullptr;
  Generator& g = default_generator();
  if (stream == 0) return &g;
  // `own` lives for this call only, and its offset is a host number: a
  // CUDA graph would freeze it and keep a pointer to it.
  check_not_capturing("Dropout with a stream of its own (tensor parallelism's shards)",
                      "its per-call generator starts at a host offset the graph would freeze");
  own.manual_seed(g.seed() ^ (0x9E3779B97F4A7C15ULL * stream));
  own.set_offset(g.next_offset());
  return &own;
}

Tensor Dropout::forward(const Tensor& x) {
  if (stream == 0 || !is_training() || p == 0) return functional::dropout(x, p, is_training());
  Generator own;
  return functional::dropout(x, p, true, generator(own));
}

MaxPool2d::MaxPool2d(std::array<int64_t, 2> k, std::array<int64_t, 2> s, std::array<int64_t, 2> p, bool ceil)
    : Module("MaxPool2d"), kernel(k), stride(s), padding(p), ceil_mode(ceil) {}
MaxPool2d::MaxPool2d(int64_t k, int64_t s, int64_t p)
    : MaxPool2d({k, k}, {s < 0 ? k : s, s < 0 ? k : s}, {p, p}) {}

AvgPool2d::AvgPool2d(std::array<int64_t, 2> k, std::array<int64_t, 2> s, std::array<int64_t, 2> p, bool ceil,
                     bool include_pad)
    : Module("AvgPool2d"), kernel(k), stride(s), padding(p), ceil_mode(ceil), count_include_pad(include_pad) {}
AvgPool2d::AvgPool2d(int64_t k, int64_t s, int64_t p) : AvgPool2d({k, k}, {s < 0 ? k : s, s < 0 ? k : s}, {p, p}) {}

Sequential::Sequential(std::vector<std::shared_ptr<Module>> layers) : Module("Sequential") {
  for (auto& l : layers) push_back(std::move(l));
}

void Sequential::push_back(std::shared_ptr<Module> layer) {
  layers_.push_back(register_module(std::to_string(layers_.size()), std::move(layer)));
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor h = x;
  for (auto& l : layers_) h = (*l)(h);
  return h;
}

}  // namespace ember::nn
