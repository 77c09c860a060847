// The standard layers, with PyTorch's constructor arguments, parameter names
// ("weight", "bias", "running_mean", ...), shapes and default initialisation,
// so state_dicts line up name for name with torch.nn.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <vector>

#include "nn/functional.h"
#include "nn/module.h"

namespace ember::nn {

// How a layer computes x W^T + b: empty means functional linear. A
// parallelism may substitute its own op: sequence parallelism's gathers the
// input inside it, so backward gathers it again instead of keeping the
// gathered copy (Megatron-SP).
using LinearKernel = std::function<Tensor(const Tensor& x, const Tensor& weight, const Tensor& bias)>;
inline Tensor apply_linear(const LinearKernel& k, const Tensor& x, const Tensor& w, const Tensor& b) {
  return k ? k(x, w, b) : linear(x, w, b);
}

// What a Linear applies after its bias, fused with it (linear_gelu: on
// CUDA in the GEMM's epilogue; elsewhere bias_gelu, one pass over the
// output each way instead of the bias add's and GELU's). Set by
// the models that follow a layer with GELU (GPT-2's MLP sets GeluTanh on
// c_fc); the parameters and the values are those of linear then gelu, and
// the layer's forward hooks see the activation's output.
enum class LinearActivation { None, Gelu, GeluTanh };

class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true);
  Tensor forward(const Tensor& x) override;
  void reset_parameters();
  int64_t in_features, out_features;
  Tensor weight, bias;  // [out, in], [out]
  LinearKernel kernel;
  LinearActivation activation = LinearActivation::None;
};

struct Conv2dOptions {
  std::array<int64_t, 2> stride{1, 1};
  std::array<int64_t, 2> padding{0, 0};
  std::array<int64_t, 2> dilation{1, 1};
  int64_t groups = 1;
  bool bias = true;
};

class Conv2d : public Module {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, std::array<int64_t, 2> kernel_size, Conv2dOptions opts = {});
  Conv2d(int64_t in_channels, int64_t out_channels, int64_t kernel_size, int64_t stride = 1, int64_t padding = 0,
         bool bias = true);
  Tensor forward(const Tensor& x) override;
  void reset_parameters();
  int64_t in_channels, out_channels;
  std::array<int64_t, 2> kernel_size;
  Conv2dOptions options;
  Tensor weight, bias;  // [out, in/groups, kh, kw], [out]
};

class BatchNorm2d : public Module {
 public:
  explicit BatchNorm2d(int64_t num_features, double eps = 1e-5, double momentum = 0.1, bool affine = true,
                       bool track_running_stats = true);
  Tensor forward(const Tensor& x) override;
  int64_t num_features;
  double eps, momentum;
  Tensor weight, bias, running_mean, running_var, num_batches_tracked;
  // The module's output is relu(batch norm): one op (batch_norm_relu), the
  // ReLU inside batch norm's passes, the same values as the two. ResNet's
  // blocks set it where a ReLU follows (its forward hooks then see the
  // ReLU's output); the state dict is unchanged.
  bool fused_relu = false;
  // relu(this(x) + residual), a residual block's tail (ResNet's blocks call
  // it): one op, batch_norm_add_relu, the add and the ReLU inside batch
  // norm's passes, where this call is forward alone (plain_call(): no hooks,
  // not checkpointed by itself), no cross-replica sum runs (training with
  // one) and the residual is laid over x (shape, dtype, device, memory
  // format); else the three ops. The same values either way; fused_relu
  // must be off (its ReLU would come before the add).
  Tensor add_relu(const Tensor& x, const Tensor& residual);
  // SyncBatchNorm: when set, training-mode forward computes the batch
  // statistics over every replica. It receives this replica's per-channel
  // [sum(x), sum(x^2), count] packed as [2C + 1] (float64) and must return
  // their sum over all replicas, differentiably (backward: the same sum of
  // the gradient). nn stays free of distributed; convert_sync_batchnorm in
  // distributed/parallel/ddp.h installs a process-group allreduce here.
  std::function<Tensor(const Tensor&)> cross_replica_sum;

 private:
  Tensor sync_forward(const Tensor& x, bool update_running = true);
  Tensor normalize(const Tensor& x, const Tensor& residual);
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(std::vector<int64_t> normalized_shape, double eps = 1e-5, bool elementwise_affine = true);
  Tensor forward(const Tensor& x) override;
  std::vector<int64_t> normalized_shape;
  double eps;
  Tensor weight, bias;
};

// torch.nn.RMSNorm / Hugging Face's LlamaRMSNorm: x / sqrt(mean(x^2) + eps)
// * weight over normalized_shape; "weight" starts at ones, no bias.
class RMSNorm : public Module {
 public:
  explicit RMSNorm(std::vector<int64_t> normalized_shape, double eps = 1e-6, bool elementwise_affine = true);
  Tensor forward(const Tensor& x) override;
  std::vector<int64_t> normalized_shape;
  double eps;
  Tensor weight;
};

class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim);
  Tensor forward(const Tensor& indices) override;  // [...] int64 -> [..., dim]
  int64_t num_embeddings, embedding_dim;
  Tensor weight;
};

class ReLU : public Module {
 public:
  ReLU() : Module("ReLU") {}
  Tensor forward(const Tensor& x) override { return relu(x); }
};

class GELU : public Module {
 public:
  explicit GELU(bool tanh_approximation = false) : Module("GELU"), tanh_(tanh_approximation) {}
  Tensor forward(const Tensor& x) override { return gelu(x, tanh_); }

 private:
  bool tanh_;
};

class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5);
  Tensor forward(const Tensor& x) override;
  double p;
  // 0: masks come from the default generator, so ranks that draw in step
  // (same seed, same ops) draw the same masks, which replicated
  // activations need. Another value draws from a stream of its own, at the
  // same counter: ranks that hold different parts of one activation
  // (tensor parallelism's shards) set different streams and get
  // independent masks, and the default generator still advances alike.
  uint64_t stream = 0;
  // The generator this call's mask comes from (the default one, or `own`
  // set up for the stream, advancing the default one alike), or null when
  // this call drops nothing (eval, p = 0): for ops that drop inside
  // themselves (attention's probabilities).
  Generator* generator(Generator& own) const;
};

class MaxPool2d : public Module {
 public:
  MaxPool2d(std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride, std::array<int64_t, 2> padding = {0, 0},
            bool ceil_mode = false);
  explicit MaxPool2d(int64_t kernel, int64_t stride = -1, int64_t padding = 0);
  Tensor forward(const Tensor& x) override { return max_pool2d(x, kernel, stride, padding, ceil_mode); }
  std::array<int64_t, 2> kernel, stride, padding;
  bool ceil_mode;
};

class AvgPool2d : public Module {
 public:
  AvgPool2d(std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride, std::array<int64_t, 2> padding = {0, 0},
            bool ceil_mode = false, bool count_include_pad = true);
  explicit AvgPool2d(int64_t kernel, int64_t stride = -1, int64_t padding = 0);
  Tensor forward(const Tensor& x) override {
    return avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad);
  }
  std::array<int64_t, 2> kernel, stride, padding;
  bool ceil_mode, count_include_pad;
};

class AdaptiveAvgPool2d : public Module {
 public:
  explicit AdaptiveAvgPool2d(std::array<int64_t, 2> output_size) : Module("AdaptiveAvgPool2d"), output_size(output_size) {}
  Tensor forward(const Tensor& x) override { return functional::adaptive_avg_pool2d(x, output_size); }
  std::array<int64_t, 2> output_size;
};

class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1) : Module("Flatten"), start(start_dim), end(end_dim) {}
  Tensor forward(const Tensor& x) override { return x.flatten(start, end); }
  int64_t start, end;
};

class Identity : public Module {
 public:
  Identity() : Module("Identity") {}
  Tensor forward(const Tensor& x) override { return x; }
};

// Children are named "0", "1", ... as in torch.nn.Sequential.
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  explicit Sequential(std::vector<std::shared_ptr<Module>> layers);
  void push_back(std::shared_ptr<Module> layer);
  Tensor forward(const Tensor& x) override;
  size_t size() const { return layers_.size(); }
  Module& operator[](size_t i) { return *layers_.at(i); }

 private:
  std::vector<std::shared_ptr<Module>> layers_;
};

// ---- Losses ----
class CrossEntropyLoss : public Module {
 public:
  explicit CrossEntropyLoss(double label_smoothing = 0.0, functional::Reduction reduction = functional::Reduction::Mean,
                            int64_t ignore_index = -100)
      : Module("CrossEntropyLoss"),
        label_smoothing(label_smoothing),
        reduction(reduction),
        ignore_index(ignore_index) {}
  Tensor forward(const Tensor& logits, const Tensor& target) {
    return functional::cross_entropy(logits, target, label_smoothing, reduction, ignore_index);
  }
  Tensor operator()(const Tensor& logits, const Tensor& target) { return forward(logits, target); }
  double label_smoothing;
  functional::Reduction reduction;
  int64_t ignore_index;
};

class NLLLoss : public Module {
 public:
  explicit NLLLoss(functional::Reduction reduction = functional::Reduction::Mean)
      : Module("NLLLoss"), reduction(reduction) {}
  Tensor operator()(const Tensor& log_probs, const Tensor& target) {
    return functional::nll_loss(log_probs, target, reduction);
  }
  functional::Reduction reduction;
};

class MSELoss : public Module {
 public:
  explicit MSELoss(functional::Reduction reduction = functional::Reduction::Mean)
      : Module("MSELoss"), reduction(reduction) {}
  Tensor operator()(const Tensor& input, const Tensor& target) {
    return functional::mse_loss(input, target, reduction);
  }
  functional::Reduction reduction;
};

}  // namespace ember::nn
