// Single-process ResNet-18 (small-image stem: 3x3/1 conv1, no max-pool) on
// Fashion-MNIST: SGD with momentum 0.9, nesterov, weight decay 5e-4, a linear
// warmup then cosine decay, batch 64, random-crop + flip augmentation off by
// default. Two epochs reach about 92% test accuracy.
//
//   bazel run -c opt //examples:resnet_fashion [-- --epochs 2 --width 64 --lr 0.05 --steps N]
#include <cstdio>
#include <cstdlib>
#include <string>

#include "examples/fashion.h"
#include "nn/functional.h"
#include "nn/models.h"
#include "optim/lr_scheduler.h"
#include "optim/optimizer.h"

using namespace ember;

int main(int argc, char** argv) {
  int64_t epochs = 2, max_steps = -1, batch = 64, width = 64;
  double lr = 0.05;
  uint64_t seed = 0;
  std::string root = data::kFashionMnistRoot;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--epochs") epochs = std::atoll(argv[i + 1]);
    else if (k == "--steps") max_steps = std::atoll(argv[i + 1]);
    else if (k == "--batch-size") batch = std::atoll(argv[i + 1]);
    else if (k == "--width") width = std::atoll(argv[i + 1]);
    else if (k == "--lr") lr = std::atof(argv[i + 1]);
    else if (k == "--seed") seed = std::strtoull(argv[i + 1], nullptr, 10);
    else if (k == "--data") root = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown flag %s (flags: --epochs --steps --batch-size --width --lr --seed --data)\n",
                   k.c_str());
      return 2;
    }
  }
  try {
    examples::Split train = examples::load_fashion(true, root), test = examples::load_fashion(false, root);
    manual_seed(seed);
    auto model = nn::resnet18({.num_classes = 10, .in_channels = 1, .small_stem = true, .width = width});
    std::printf("ResNet-18 (small stem, width %lld): %.2f M parameters\n", static_cast<long long>(width),
                model->num_parameters() / 1e6);
    optim::SGD opt(model->parameters(),
                   optim::SGDOptions{.lr = lr, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true});
    const int64_t steps_per_epoch = (train.images.size(0) + batch - 1) / batch;
    const int64_t total = max_steps >= 0 ? std::min(max_steps, epochs * steps_per_epoch) : epochs * steps_per_epoch;
    const int64_t warmup = std::min<int64_t>(200, total / 10 + 1);
    auto warm = std::make_shared<optim::LinearLR>(opt, 0.1, 1.0, warmup);
    auto cosine = std::make_shared<optim::CosineAnnealingLR>(opt, std::max<int64_t>(total - warmup, 1), 0.0);
    optim::SequentialLR sched(opt, {warm, cosine}, {warmup});
    int64_t step = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t epoch = 0; epoch < epochs && step < total; ++epoch) {
      model->train();
      double loss_sum = 0;
      int64_t seen = 0;
      examples::for_each_batch(train, batch, seed, epoch, [&](const Tensor& x, const Tensor& y, int64_t b) {
        if (step >= total) return;
        opt.zero_grad();
        Tensor loss = nn::functional::cross_entropy((*model)(x), y);
        loss.backward();
        opt.step();
        sched.step();
        loss_sum += loss.item();
        ++seen;
        ++step;
        if (b % 50 == 0) {
          double el = examples::seconds_since(t0);
          std::printf("epoch %lld step %lld/%lld loss %.4f  %.1f img/s\n", static_cast<long long>(epoch + 1),
                      static_cast<long long>(b), static_cast<long long>(steps_per_epoch), loss_sum / seen,
                      step * batch / el);
          std::fflush(stdout);
        }
      });
      model->eval();
      double acc = examples::accuracy(*model, test, 500);
      std::printf("epoch %lld done: train loss %.4f, test accuracy %.4f, %.0f s elapsed\n",
                  static_cast<long long>(epoch + 1), loss_sum / std::max<int64_t>(seen, 1), acc,
                  examples::seconds_since(t0));
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "resnet_fashion: %s\n", e.what());
    return 1;
  }
  return 0;
}
