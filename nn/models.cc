// ResNet (torchvision's v1.5: stride on the 3x3 conv of a bottleneck) and MLP.
#include "nn/models.h"

#include "nn/init.h"

namespace ember::nn {

namespace {
std::shared_ptr<Conv2d> conv3x3(int64_t in, int64_t out, int64_t stride) {
  return std::make_shared<Conv2d>(in, out, 3, stride, 1, /*bias=*/false);
}
std::shared_ptr<Conv2d> conv1x1(int64_t in, int64_t out, int64_t stride) {
  return std::make_shared<Conv2d>(in, out, 1, stride, 0, /*bias=*/false);
}
}  // namespace

BasicBlock::BasicBlock(int64_t in, int64_t planes, int64_t stride, std::shared_ptr<Sequential> ds)
    : Module("BasicBlock") {
  conv1 = register_module("conv1", conv3x3(in, planes, stride));
  bn1 = register_module("bn1", std::make_shared<BatchNorm2d>(planes));
  bn1->fused_relu = true;  // relu(bn1(...)) as one op
  conv2 = register_module("conv2", conv3x3(planes, planes, 1));
  bn2 = register_module("bn2", std::make_shared<BatchNorm2d>(planes));
  if (ds) downsample = register_module("downsample", ds);
}

Tensor BasicBlock::forward(const Tensor& x) {
  Tensor out = (*bn1)((*conv1)(x));                                        // with its ReLU
  return bn2->add_relu((*conv2)(out), downsample ? (*downsample)(x) : x);  // relu(bn2(...) + identity)
}

Bottleneck::Bottleneck(int64_t in, int64_t planes, int64_t stride, std::shared_ptr<Sequential> ds)
    : Module("Bottleneck") {
  conv1 = register_module("conv1", conv1x1(in, planes, 1));
  bn1 = register_module("bn1", std::make_shared<BatchNorm2d>(planes));
  conv2 = register_module("conv2", conv3x3(planes, planes, stride));
  bn2 = register_module("bn2", std::make_shared<BatchNorm2d>(planes));
  bn1->fused_relu = bn2->fused_relu = true;  // relu(bn(...)) as one op
  conv3 = register_module("conv3", conv1x1(planes, planes * kExpansion, 1));
  bn3 = register_module("bn3", std::make_shared<BatchNorm2d>(planes * kExpansion));
  if (ds) downsample = register_module("downsample", ds);
}

Tensor Bottleneck::forward(const Tensor& x) {
  Tensor out = (*bn1)((*conv1)(x));  // bn1 and bn2 with their ReLUs
  out = (*bn2)((*conv2)(out));
  return bn3->add_relu((*conv3)(out), downsample ? (*downsample)(x) : x);  // relu(bn3(...) + identity), one op
}

ResNet::ResNet(Block block, std::vector<int64_t> layers, ResNetOptions opts)
    : Module("ResNet"), options(opts), inplanes_(opts.width) {
  EMBER_CHECK(layers.size() == 4, "ResNet: expected 4 stage depths, got ", layers.size());
  EMBER_CHECK(opts.width > 0 && opts.num_classes > 0 && opts.in_channels > 0, "ResNet: width ", opts.width,
              ", num_classes ", opts.num_classes, " and in_channels ", opts.in_channels, " must be positive");
  if (opts.small_stem) {
    conv1 = register_module("conv1", std::make_shared<Conv2d>(opts.in_channels, opts.width, 3, 1, 1, false));
  } else {
    conv1 = register_module("conv1", std::make_shared<Conv2d>(opts.in_channels, opts.width, 7, 2, 3, false));
  }
  bn1 = register_module("bn1", std::make_shared<BatchNorm2d>(opts.width));
  bn1->fused_relu = true;                                                // relu(bn1(...)) as one op
  if (!opts.small_stem) maxpool = std::make_shared<MaxPool2d>(3, 2, 1);  // no parameters: not registered
  const int64_t w = opts.width;
  layer1 = register_module("layer1", make_layer(block, w, layers[0], 1));
  layer2 = register_module("layer2", make_layer(block, w * 2, layers[1], 2));
  layer3 = register_module("layer3", make_layer(block, w * 4, layers[2], 2));
  layer4 = register_module("layer4", make_layer(block, w * 8, layers[3], 2));
  const int64_t expansion = block == Block::Basic ? BasicBlock::kExpansion : Bottleneck::kExpansion;
  fc = register_module("fc", std::make_shared<Linear>(w * 8 * expansion, opts.num_classes));

  // torchvision: kaiming_normal_(fan_out, relu) convs, BN weight 1 / bias 0.
  apply([](Module& m) {
    if (auto* c = dynamic_cast<Conv2d*>(&m)) init::kaiming_normal_(c->weight, 0, init::FanMode::FanOut, "relu");
  });
  if (opts.zero_init_residual) {
    apply([](Module& m) {
      if (auto* b = dynamic_cast<BasicBlock*>(&m)) init::zeros_(b->bn2->weight);
      if (auto* b = dynamic_cast<Bottleneck*>(&m)) init::zeros_(b->bn3->weight);
    });
  }
  // Initialised in OIHW (the same values as a contiguous model from the
  // same seed), then laid out once as the activations are.
  if (options.memory_format == MemoryFormat::ChannelsLast) to(MemoryFormat::ChannelsLast);
}

std::shared_ptr<Sequential> ResNet::make_layer(Block block, int64_t planes, int64_t blocks, int64_t stride) {
  const int64_t expansion = block == Block::Basic ? BasicBlock::kExpansion : Bottleneck::kExpansion;
  std::shared_ptr<Sequential> ds;
  if (stride != 1 || inplanes_ != planes * expansion) {
    ds = std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
        conv1x1(inplanes_, planes * expansion, stride), std::make_shared<BatchNorm2d>(planes * expansion)});
  }
  auto seq = std::make_shared<Sequential>();
  for (int64_t i = 0; i < blocks; ++i) {
    std::shared_ptr<Module> b;
    if (block == Block::Basic) b = std::make_shared<BasicBlock>(inplanes_, planes, i == 0 ? stride : 1, i == 0 ? ds : nullptr);
    else b = std::make_shared<Bottleneck>(inplanes_, planes, i == 0 ? stride : 1, i == 0 ? ds : nullptr);
    seq->push_back(b);
    inplanes_ = planes * expansion;
  }
  return seq;
}

Tensor ResNet::forward(const Tensor& x) {
  EMBER_CHECK(x.dim() == 4 && x.size(1) == options.in_channels, "ResNet: expected input [N, ", options.in_channels,
              ", H, W], got ", shape_str(x.sizes()));
  const Tensor in = options.memory_format == MemoryFormat::ChannelsLast ? x.contiguous(MemoryFormat::ChannelsLast) : x;
  Tensor h = (*bn1)((*conv1)(in));  // with its ReLU
  if (maxpool) h = (*maxpool)(h);
  h = (*layer4)((*layer3)((*layer2)((*layer1)(h))));
  h = mean(h, {2, 3});  // adaptive average pool to 1x1, then flatten
  return (*fc)(h);
}

std::shared_ptr<ResNet> resnet18(ResNetOptions o) {
  return std::make_shared<ResNet>(ResNet::Block::Basic, std::vector<int64_t>{2, 2, 2, 2}, o);
}
std::shared_ptr<ResNet> resnet34(ResNetOptions o) {
  return std::make_shared<ResNet>(ResNet::Block::Basic, std::vector<int64_t>{3, 4, 6, 3}, o);
}
std::shared_ptr<ResNet> resnet50(ResNetOptions o) {
  return std::make_shared<ResNet>(ResNet::Block::Bottleneck, std::vector<int64_t>{3, 4, 6, 3}, o);
}

std::shared_ptr<Sequential> mlp(const std::vector<int64_t>& sizes) {
  EMBER_CHECK(sizes.size() >= 2, "mlp: need at least input and output sizes, got ", sizes.size());
  auto seq = std::make_shared<Sequential>();
  seq->push_back(std::make_shared<Flatten>());
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    seq->push_back(std::make_shared<Linear>(sizes[i], sizes[i + 1]));
    if (i + 2 < sizes.size()) seq->push_back(std::make_shared<ReLU>());
  }
  return seq;
}

}  // namespace ember::nn
