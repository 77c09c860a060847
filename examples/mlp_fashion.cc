// An MLP 784-512-256-10 trained with Adam (lr 1e-3, batch 128) for one epoch
// on Fashion-MNIST, then its test accuracy: the recipe of the PyTorch peer
// (bench/peers/mlp_epoch.py), which reaches about 85%.
//
//   bazel run -c opt //examples:mlp_fashion [-- --epochs N --steps N --seed S --data DIR --profile DIR]
//
// --steps limits the number of training steps (the test runs a short one).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "examples/fashion.h"
#include "examples/profiling.h"
#include "nn/functional.h"
#include "nn/models.h"
#include "optim/optimizer.h"

using namespace ember;

int main(int argc, char** argv) {
  int64_t epochs = 1, max_steps = -1, batch = 128;
  uint64_t seed = 0;
  std::string root = data::kFashionMnistRoot;
  std::string profile_dir;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--epochs") epochs = std::atoll(argv[i + 1]);
    else if (k == "--steps") max_steps = std::atoll(argv[i + 1]);
    else if (k == "--seed") seed = std::strtoull(argv[i + 1], nullptr, 10);
    else if (k == "--batch-size") batch = std::atoll(argv[i + 1]);
    else if (k == "--data") root = argv[i + 1];
    else if (k == "--profile") profile_dir = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown flag %s (flags: --epochs --steps --seed --batch-size --data --profile)\n",
                   k.c_str());
      return 2;
    }
  }
  try {
    examples::Split train = examples::load_fashion(true, root), test = examples::load_fashion(false, root);
    manual_seed(seed);
    auto model = nn::mlp({784, 512, 256, 10});
    optim::Adam opt(model->parameters(), optim::AdamOptions{.lr = 1e-3});
    int64_t step = 0;
    double first_loss = 0, last_loss = 0;
    const int64_t steps_per_epoch = (train.images.size(0) + batch - 1) / batch;
    examples::StepProfiler profile(profile_dir,
                                   max_steps >= 0 ? std::min(max_steps, epochs * steps_per_epoch) : epochs * steps_per_epoch,
                                   nullptr);
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t epoch = 0; epoch < epochs; ++epoch) {
      const auto t_epoch = std::chrono::steady_clock::now();
      model->train();
      examples::for_each_batch(train, batch, seed, epoch, [&](const Tensor& x, const Tensor& y, int64_t) {
        if (max_steps >= 0 && step >= max_steps) return;
        opt.zero_grad();
        Tensor loss = nn::functional::cross_entropy((*model)(x), y);
        loss.backward();
        opt.step();
        last_loss = loss.item();
        if (step == 0) first_loss = last_loss;
        ++step;
        profile.step();
      });
      // The training loop alone (data already in memory), as the peer
      // bench/peers/mlp_epoch.py times it; bench/compare_peers.py mlp reads it.
      const double train_s = examples::seconds_since(t_epoch);
      model->eval();
      double acc = examples::accuracy(*model, test);
      std::printf("epoch %lld: %lld steps, %.1f s, train %.3f s, loss %.4f -> %.4f, test accuracy %.4f\n",
                  static_cast<long long>(epoch + 1), static_cast<long long>(step), examples::seconds_since(t0),
                  train_s, first_loss, last_loss, acc);
    }
    std::printf("first_loss %.6f last_loss %.6f\n", first_loss, last_loss);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mlp_fashion: %s\n", e.what());
    return 1;
  }
  return 0;
}
