// GraphedStep (graphed_step.h): warm-up calls eager, one capture, then
// replays on static inputs.
#include "optim/graphed_step.h"

#include <string>
#include <utility>

#include "core/device.h"
#include "core/exception.h"
#include "core/ops.h"

namespace ember::optim {

GraphedStep::GraphedStep(Fn fn, GraphedStepOptions options) : fn_(std::move(fn)), options_(std::move(options)) {
  EMBER_CHECK(fn_ != nullptr, "GraphedStep: no step function");
  EMBER_CHECK(options_.warmup >= 0, "GraphedStep: warmup must be >= 0, got ", options_.warmup);
  const Device device(DeviceType::CUDA, options_.device);
  for (Optimizer* opt : options_.optimizers) {
    EMBER_CHECK(opt != nullptr, "GraphedStep: a null optimizer");
    for (ParamGroup& g : opt->param_groups())
      if (!g.lr_tensor.defined()) g.lr_tensor = full({}, g.lr(), {DType::Float32, device});
  }
}

std::vector<Tensor> GraphedStep::operator()(const std::vector<Tensor>& inputs) {
  const Device device(DeviceType::CUDA, options_.device);
  ++calls_;
  if (captured()) {
    EMBER_CHECK(inputs.size() == inputs_.size(), "GraphedStep: ", inputs.size(), " inputs; the captured step took ",
                inputs_.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      EMBER_CHECK(inputs[i].defined(), "GraphedStep: input ", i, " is undefined");
      EMBER_CHECK(inputs[i].sizes() == inputs_[i].sizes() && inputs[i].dtype() == inputs_[i].dtype(),
                  "GraphedStep: input ", i, " is ", inputs[i].dtype(), " ", shape_str(inputs[i].sizes()),
                  "; the captured step's was ", inputs_[i].dtype(), " ", shape_str(inputs_[i].sizes()),
                  " (a graph replays its shapes: capture another for these)");
      inputs_[i].copy_(inputs[i]);
    }
    graph_->replay();
    return outputs_;
  }
  std::vector<Tensor> on_device;
  for (const Tensor& t : inputs) on_device.push_back(t.defined() ? t.to(device) : t);
  if (!options_.enabled || calls_ <= options_.warmup || (options_.ready && !options_.ready())) return fn_(on_device);
  // The static inputs: this call's, in memory of their own made before the
  // capture (they outlive it, as the graph reads them at every replay).
  for (const Tensor& t : on_device) {
    EMBER_CHECK(t.defined(), "GraphedStep: an input of the step to capture is undefined");
    inputs_.push_back(t.contiguous().clone());
  }
  auto graph = std::make_unique<CudaGraph>(options_.device);
  try {
    graph->capture([&] { outputs_ = fn_(inputs_); });
  } catch (...) {
    inputs_.clear();
    outputs_.clear();
    throw;
  }
  graph_ = std::move(graph);
  captured_at_ = calls_;
  graph_->replay();  // the capture ran nothing: this call's step
  return outputs_;
}

}  // namespace ember::optim
