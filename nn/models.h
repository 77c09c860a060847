// Models users expect, with torchvision's layer names, shapes and default
// initialisation: ResNet-18/34/50 (plus a small-image stem for 28x28 and
// 32x32 inputs: a 3x3/1 first conv and no max-pool) and an MLP.
//
//   auto net = nn::resnet18({.num_classes = 10, .in_channels = 1, .small_stem = true});
//   Tensor logits = (*net)(images);   // [N, 10]
#pragma once

#include <memory>
#include <vector>

#include "nn/layers.h"

namespace ember::nn {

struct ResNetOptions {
  int64_t num_classes = 1000;
  int64_t in_channels = 3;
  bool small_stem = false;       // 3x3 stride-1 conv1, no max-pool
  int64_t width = 64;            // channels of layer1 (64 in torchvision; smaller = narrow ResNet)
  bool zero_init_residual = false;
  // Layout of the activations. ChannelsLast (NHWC) is what cuDNN's tensor
  // core convolutions want; forward() converts the input and convolutions,
  // batch norm, pooling and elementwise ops keep it. The convolution weights
  // are stored channels-last too (OHWI memory, Module::to(MemoryFormat)), so
  // a step converts neither. On CPU the oneDNN convolutions read and return
  // NCHW, so it only costs copies there.
  MemoryFormat memory_format = MemoryFormat::Contiguous;
};

class BasicBlock : public Module {
 public:
  static constexpr int64_t kExpansion = 1;
  BasicBlock(int64_t in, int64_t planes, int64_t stride, std::shared_ptr<Sequential> downsample);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Conv2d> conv1, conv2;
  std::shared_ptr<BatchNorm2d> bn1, bn2;
  std::shared_ptr<Sequential> downsample;
};

class Bottleneck : public Module {
 public:
  static constexpr int64_t kExpansion = 4;
  Bottleneck(int64_t in, int64_t planes, int64_t stride, std::shared_ptr<Sequential> downsample);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Conv2d> conv1, conv2, conv3;
  std::shared_ptr<BatchNorm2d> bn1, bn2, bn3;
  std::shared_ptr<Sequential> downsample;
};

class ResNet : public Module {
 public:
  enum class Block { Basic, Bottleneck };
  ResNet(Block block, std::vector<int64_t> layers, ResNetOptions opts);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Conv2d> conv1;
  std::shared_ptr<BatchNorm2d> bn1;
  std::shared_ptr<MaxPool2d> maxpool;  // null with the small stem
  std::shared_ptr<Sequential> layer1, layer2, layer3, layer4;
  std::shared_ptr<Linear> fc;
  ResNetOptions options;

 private:
  std::shared_ptr<Sequential> make_layer(Block block, int64_t planes, int64_t blocks, int64_t stride);
  int64_t inplanes_;
};

std::shared_ptr<ResNet> resnet18(ResNetOptions opts = {});
std::shared_ptr<ResNet> resnet34(ResNetOptions opts = {});
std::shared_ptr<ResNet> resnet50(ResNetOptions opts = {});

// Flatten, then Linear+ReLU pairs, a final Linear: torch's
// nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), ...), same names.
std::shared_ptr<Sequential> mlp(const std::vector<int64_t>& sizes);

}  // namespace ember::nn
