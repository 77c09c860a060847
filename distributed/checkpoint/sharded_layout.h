// What of the training state this rank holds and which of it it writes
// (sharded.cc's save and load): each tensor read off its ShardSpec, or
// whole when it has none; exactly one writer for every element. Not part
// of the API.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/tensor.h"
#include "distributed/comm/process_group.h"
#include "distributed/sharding/shard_spec.h"
#include "nn/module.h"
#include "optim/optimizer.h"

namespace ember::distributed::sharded_internal {

// One tensor of the state as this rank holds it.
struct Held {
  std::string name;
  Shape shape;  // the whole tensor's
  DType dtype = DType::Float32;
  Region region;        // what of it is held
  Tensor local;         // the held elements in order (any shape of that numel)
  bool writer = false;  // this rank writes them (exactly one holder does)
  // How the tensor is laid out over the ranks, for the index ("[Shard(0),
  // Shard(0)] on (dp_shard=2, tp=2), fsdp:full_shard+tensor_parallel").
  std::string placement = {};
};

// A parameter (or buffer) of the model: its name, whole shape, and what of
// it this rank holds.
struct Place {
  std::string name;
  Shape shape;
  std::vector<Region> regions;  // one, or a grouped shard's blocks (their elements in order)
  bool holds = false, writer = false;
  Tensor local;
  std::function<void()> before_load;
  std::string placement = {};  // as Held::placement
  int64_t numel() const {
    int64_t n = 0;
    for (const Region& r : regions) n += r.numel;
    return n;
  }
};

struct ModelLayout {
  std::vector<Held> held;
  std::unordered_map<const TensorImpl*, Place> by_impl;
  std::map<std::string, Place> by_name;
  std::string description;  // "fsdp:full_shard", "replicated", "single"
  // The names any rank's model holds (pipeline stages hold different ones).
  std::unordered_set<std::string> anywhere;
};

// The model's tensors on this rank; collective over `pg` (one all-gather
// of what each rank holds, to choose the writers).
ModelLayout model_layout(nn::Module& model, ProcessGroup& pg);

// The optimizer's state, as the pieces this rank writes: each value is
// held like its parameter, or as the part its ShardSpec describes when the
// optimizer keeps only part of it (ZeRO-1: a run of the parameter's
// elements, one per rank); a scalar (Adam's step) is written by the writer
// of the parameter's first element.
std::vector<Held> optimizer_held(const optim::Optimizer& opt, const ModelLayout& L);

}  // namespace ember::distributed::sharded_internal
