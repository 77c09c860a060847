// AdamW over 16-bit parameters with float32 masters, for ops_bench (CPU)
// and ops_cuda_bench (GPU): fused, the masters' re-seed, the gradients'
// read and the parameters' write in the step's one pass (adam_step_'s
// model_params, as optim::AdamW runs it), or op by op as optim::AdamW did
// before: the re-seed as where(ne(...)), the gradients cast to float32, a
// float32 step, the masters copied back rounded.
#pragma once

#include <vector>

#include "core/ops.h"
#include "core/ops_optim.h"

namespace ember::bench {

struct MasterStep {
  std::vector<Tensor> low, master, grads, m, v;
  int64_t step = 0;
};

inline MasterStep make_master_step(int64_t tensors, int64_t numel, DType low_dtype, Device d) {
  MasterStep s;
  Generator gen(7);
  for (int64_t i = 0; i < tensors; ++i) {
    s.master.push_back(randn({numel}, {DType::Float32, d}, &gen));
    s.low.push_back(s.master.back().to(low_dtype));
    s.grads.push_back(randn({numel}, {DType::Float32, d}, &gen).to(low_dtype));
    s.m.push_back(zeros({numel}, {DType::Float32, d}));
    s.v.push_back(zeros({numel}, {DType::Float32, d}));
  }
  return s;
}

inline void master_step(MasterStep& s, bool fused) {
  AdamArgs a{.lr = 1e-4, .weight_decay = 0.1, .decoupled = true};
  a.step = ++s.step;
  std::vector<Tensor> none;
  if (fused) {
    a.model_params = s.low;
    adam_step_(s.master, s.grads, s.m, s.v, none, a);
    return;
  }
  std::vector<Tensor> g;
  for (size_t i = 0; i < s.low.size(); ++i) {
    Tensor& master = s.master[i];
    master.copy_(where(ne(s.low[i], master.to(s.low[i].dtype())), s.low[i].to(DType::Float32), master));
    g.push_back(s.grads[i].to(DType::Float32));
  }
  adam_step_(s.master, g, s.m, s.v, none, a);
  for (size_t i = 0; i < s.low.size(); ++i) s.low[i].copy_(s.master[i]);
}

// Bytes an element of the fused pass moves: the master, its moments and
// the 16-bit parameter read and written, the 16-bit gradient read.
constexpr int64_t kMasterStepBytes = 3 * 4 * 2 + 2 * 2 + 2;

}  // namespace ember::bench
