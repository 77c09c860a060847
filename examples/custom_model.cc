// Build your own model: a user-defined Module with its own layers and
// forward, trained with the framework's optimizer and loss. This is the
// pattern docs/models.md ("Build your own model") walks through.
//
//   bazel run -c opt //examples:custom_model [-- --steps N]
//
// The model is a small CNN for Fashion-MNIST: two conv/batch-norm/ReLU
// stages with max-pooling, dropout and a linear classifier.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "examples/fashion.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "optim/optimizer.h"

using namespace ember;

// 1. Derive from nn::Module; register every parameterised child under the
//    name it will have in state_dict() ("conv1.weight", "bn1.running_mean").
class SmallCnn : public nn::Module {
 public:
  explicit SmallCnn(int64_t classes = 10) : Module("SmallCnn") {
    conv1 = register_module("conv1", std::make_shared<nn::Conv2d>(1, 32, 3, /*stride=*/1, /*padding=*/1));
    bn1 = register_module("bn1", std::make_shared<nn::BatchNorm2d>(32));
    conv2 = register_module("conv2", std::make_shared<nn::Conv2d>(32, 64, 3, 1, 1));
    bn2 = register_module("bn2", std::make_shared<nn::BatchNorm2d>(64));
    fc = register_module("fc", std::make_shared<nn::Linear>(64 * 7 * 7, classes));
    // A raw parameter works too: a learnable temperature on the logits.
    log_temperature = register_parameter("log_temperature", zeros({1}));
  }

  // 2. forward() composes differentiable ops; autograd records them.
  Tensor forward(const Tensor& x) override {
    Tensor h = max_pool2d(relu((*bn1)((*conv1)(x))), {2, 2}, {2, 2});   // [N, 32, 14, 14]
    h = max_pool2d(relu((*bn2)((*conv2)(h))), {2, 2}, {2, 2});          // [N, 64, 7, 7]
    h = nn::functional::dropout(h.flatten(1), 0.25, is_training());
    return (*fc)(h) * exp(neg(log_temperature));
  }

  std::shared_ptr<nn::Conv2d> conv1, conv2;
  std::shared_ptr<nn::BatchNorm2d> bn1, bn2;
  std::shared_ptr<nn::Linear> fc;
  Tensor log_temperature;
};

int main(int argc, char** argv) {
  int64_t max_steps = 300;
  std::string root = data::kFashionMnistRoot;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--steps") max_steps = std::atoll(argv[i + 1]);
    else if (k == "--data") root = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown flag %s (flags: --steps --data)\n", k.c_str());
      return 2;
    }
  }
  try {
    examples::Split train = examples::load_fashion(true, root), test = examples::load_fashion(false, root);
    manual_seed(0);
    SmallCnn model;
    std::printf("SmallCnn: %lld parameters\n", static_cast<long long>(model.num_parameters()));
    for (auto& [name, p] : model.named_parameters()) std::printf("  %-20s %s\n", name.c_str(), shape_str(p.sizes()).c_str());
    // 3. The framework's optimizer and loss.
    optim::Adam opt(model.parameters(), optim::AdamOptions{.lr = 2e-3});
    nn::CrossEntropyLoss criterion(/*label_smoothing=*/0.05);
    int64_t step = 0;
    auto t0 = std::chrono::steady_clock::now();
    model.train();
    examples::for_each_batch(train, 128, /*seed=*/0, /*epoch=*/0, [&](const Tensor& x, const Tensor& y, int64_t) {
      if (step >= max_steps) return;
      opt.zero_grad();
      Tensor loss = criterion(model(x), y);
      loss.backward();
      opt.step();
      if (step % 50 == 0) std::printf("step %4lld  loss %.4f\n", static_cast<long long>(step), loss.item());
      ++step;
    });
    model.eval();
    std::printf("%lld steps in %.1f s; test accuracy %.4f\n", static_cast<long long>(step),
                examples::seconds_since(t0), examples::accuracy(model, test, 500));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "custom_model: %s\n", e.what());
    return 1;
  }
  return 0;
}
