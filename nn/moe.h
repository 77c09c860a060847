// Mixture of experts: a token-choice top-k router, stacked SwiGLU experts run
// as grouped GEMMs over variable-size groups (dropless by default: no token
// dropped; or with a capacity per expert, GShard's and Megatron's token
// dropping, every group padded to it), the combine weighted by the router's
// scores, optional DeepSeek-style shared experts, and the two router losses
// (Switch / Mixtral load balancing, ST-MoE's z-loss).
//
//   nn::MoE moe(64, {.num_experts = 8, .top_k = 2, .hidden = 128});
//   Tensor y = moe(x);                    // x, y [B, T, 64]
//   moe.stats().tokens_per_expert;        // what the forwards since reset_stats() routed
//
// Names follow torchtitan's MoE: "router.gate" (Linear [E, dim], no bias),
// "experts.w1" (gate) and "experts.w3" (up) [E, hidden, dim], "experts.w2"
// (down) [E, dim, hidden] — nn::Linear's [out, in] per expert, stacked, so a
// checkpoint holds one tensor per layer and expert parallelism shards dim 0
// — and "shared_experts" (an nn::SwiGLU of width shared_experts x hidden).
//
// Routing, per token t with router logits l = gate(x_t):
//   scores s = softmax(l) (or sigmoid(l)); the k largest, ties to the lower
//   expert index; weights w_j = s[e_j] (divided by their sum when
//   normalize_top_k, Mixtral's and DeepSeek's choice); y_t = sum_j w_j
//   expert_{e_j}(x_t) (+ shared(x_t)).
// Dispatch: the N k (token, choice) pairs sorted by expert (stable: token
// order within an expert), the tokens gathered in that order, one grouped
// GEMM per projection over the experts' groups (an expert with no token is
// an empty group), the results gathered back and combined.
// With a capacity (MoEOptions::capacity_factor), each expert takes at most
// C = ceil(capacity_factor N k / E) of the forward's N k choices, the first
// in that order (Megatron's "position" drop policy, GShard's); every group
// is padded to C rows with zeros, one batched GEMM per projection runs all
// of them, and a dropped choice adds nothing to its token's output (the
// block's residual carries the token) and its expert gets no gradient from
// it (its score still counts in normalize_top_k's sum). Every
// shape then follows from N alone: nothing is read on the host, and
// expert parallelism's exchange has even splits, so a captured step
// (CUDA graphs) holds the layer in every dtype, expert parallelism
// included. The load-balancing loss counts every routed choice, dropped or
// not (Megatron's).
//
// Router losses, added to the model's loss through the backward (the layer's
// output carries a node that feeds coef * their gradient into the router;
// Megatron's MoEAuxLossAutoScaler, DeepSeek's AddAuxiliaryLoss), so a
// pipeline stage or a caller that only sees the language-model loss trains
// them alike:
//   aux = E * sum_e f_e P_e      f_e = (tokens routed to e) / N (summed over
//                                 the k choices, Hugging Face Mixtral's
//                                 load_balancing_loss_func), P_e = mean of
//                                 s[e] over the tokens (s renormalised to sum
//                                 1 for sigmoid scores, as DeepSeek-V3)
//   z   = mean_t logsumexp(l_t)^2 (ST-MoE)
// The term fed back is aux_loss_coef * aux + z_loss_coef * z, times
// aux_grad_scale (set by a loop that scales its loss: 1/micro-batches for
// gradient accumulation, a loss scaler's scale). Under data parallelism the
// counts f_e are those of the whole batch when `balance_sum` sums them over
// the data-parallel ranks (what one process on the whole batch computes).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/layers.h"
#include "nn/module.h"

namespace ember::nn {

class SwiGLU;  // transformer.h, which holds MoEOptions in GPTOptions

enum class RouterScore { Softmax, Sigmoid };
const char* router_score_name(RouterScore s);  // "softmax", "sigmoid"
RouterScore parse_router_score(const std::string& s);

struct MoEOptions {
  int64_t num_experts = 0;  // 0: no MoE (GPTOptions::moe)
  int64_t top_k = 2;
  int64_t hidden = 0;  // each expert's SwiGLU width; 0: the model's ffn_width()
  RouterScore score = RouterScore::Softmax;
  bool normalize_top_k = true;
  int64_t shared_experts = 0;  // DeepSeek's always-on experts (one SwiGLU of this many times hidden)
  double aux_loss_coef = 0.01;
  double z_loss_coef = 0.0;
  // In a model (GPTOptions::moe): block i is an MoE block when i % every == 0
  // (Megatron's moe_layer_freq: 1 every block, 2 blocks 0, 2, 4, ...).
  int64_t every = 1;
  // > 0: each expert's capacity per forward, as a multiple of its even
  // share of the choices (Megatron's moe_expert_capacity_factor with
  // moe_pad_expert_input_to_capacity; 1.25 is common); 0: dropless.
  double capacity_factor = 0.0;
};

// An expert's rows per forward of `tokens` tokens under `o`'s capacity
// factor: ceil(capacity_factor tokens top_k / num_experts), rounded up to a
// multiple of `multiple`; 0 for no token.
int64_t expert_capacity(const MoEOptions& o, int64_t tokens, int64_t multiple = 1);

// The router: gate logits, scores, the top k and their weights.
struct Routing {
  Tensor logits;   // [N, E], the gate's dtype
  Tensor scores;   // [N, E] float32 (float64 for float64 inputs)
  Tensor experts;  // int64 [N, k], each row's choices in descending score
  Tensor weights;  // [N, k], scores' dtype, differentiable
};

class TopKRouter : public Module {
 public:
  TopKRouter(int64_t dim, const MoEOptions& options);
  Tensor forward(const Tensor& x) override;  // the logits, as Linear's
  Routing route(const Tensor& x);            // x [N, dim]
  MoEOptions options;
  std::shared_ptr<Linear> gate;
};

// The experts' weights, stacked, and their grouped SwiGLU: rows of x
// grouped by expert (counts[e] consecutive rows each, counts.size() = the
// experts held here) -> w2_e (silu(w1_e x) * w3_e x).
class GroupedExperts : public Module {
 public:
  GroupedExperts(int64_t num_experts, int64_t dim, int64_t hidden);
  // Through the module's call, so its hooks run (FSDP gathers the experts
  // around it when they are a unit of their own): forward() reads the
  // groups, as counts on the host or as cumulative row ends on x's device
  // (group_order's offsets: nothing read back, grouped_mm on the device).
  Tensor operator()(const Tensor& x, const std::vector<int64_t>& counts);
  Tensor operator()(const Tensor& x, const Tensor& offsets);
  // Every group exactly `capacity` rows (padding included): x [G capacity,
  // dim], one batched matmul per projection.
  Tensor padded(const Tensor& x, int64_t capacity);
  using Module::operator();
  Tensor forward(const Tensor& x) override;  // with the groups of the calls above
  int64_t num_experts;                       // the layer's (the weights may hold a slice: expert parallelism)
  Tensor w1, w2, w3;
  // The weights' gradient is multiplied by this (expert parallelism's 1/ep).
  double weight_grad_scale = 1.0;
  // Set: each expert's projection of padded groups runs through it (rows
  // [C, in], that expert's weight [out, in], no bias) instead of the batched
  // matmul: convert_to_float8_training sets float8_linear, and the layer
  // then rounds its capacity up to a multiple of 16 (float8 GEMMs' rows,
  // Megatron's moe_router_padding_for_fp8). Dropless groups, whose sizes
  // only the device knows, cannot take it: a named error.
  LinearKernel kernel;

 private:
  Tensor call(const Tensor& x);
  std::vector<int64_t> counts_;
  Tensor offsets_;
  int64_t capacity_ = -1;
  bool called_ = false;
};

// The groups of the rows a dispatch receives: dropless, each expert's count
// (read on the host); with a capacity, every expert's group that many rows.
struct ExpertGroups {
  std::vector<int64_t> counts;  // every expert of the layer (global ids); empty with a capacity
  int64_t capacity = -1;        // >= 0: padded groups of this many rows
};

// How the tokens sorted by expert reach the experts and come back: given
// the rows [R, dim] in expert order and their groups, the experts' outputs
// in the same order. Unset: this process's GroupedExperts runs them all,
// its groups never leaving the device. Expert parallelism
// (distributed/parallel/ep) installs one that exchanges tokens: its splits
// read on the host when dropless, even with a capacity.
using ExpertDispatchFn = std::function<Tensor(GroupedExperts& experts, const Tensor& rows, const ExpertGroups& groups)>;

// What the training forwards (grad on; a checkpoint's recompute not
// counted) since the last reset_stats() routed (read by metrics: a step's
// micro-batches): tokens per expert over the whole batch (summed
// over balance_sum's ranks), and the two router losses' values (this
// rank's), summed over the `forwards`; with a capacity, how many of this
// rank's `routed` (token, choice) pairs were `dropped`. The sums stay on
// the layer's device until stats() reads them, so a forward waits for
// nothing to keep them.
struct MoEStats {
  std::vector<int64_t> tokens_per_expert;
  double aux_loss = 0, z_loss = 0;
  int64_t forwards = 0;
  int64_t routed = 0, dropped = 0;
};

// No dropout inside (LLaMA's, Mixtral's and DeepSeek's experts have none):
// a GPT-2 model's MoE blocks leave GPTOptions::dropout to attention and the
// embeddings. `options` are the constructor's: the router keeps its own
// copy, so change neither afterwards.
class MoE : public Module {
 public:
  MoE(int64_t dim, MoEOptions options);
  Tensor forward(const Tensor& x) override;  // [..., dim] -> [..., dim]
  // The sums read back (a synchronisation with the device: a step's
  // metrics, not its forward).
  MoEStats stats() const;
  void reset_stats();
  MoEOptions options;
  int64_t dim;
  std::shared_ptr<TopKRouter> router;
  std::shared_ptr<GroupedExperts> experts;
  std::shared_ptr<SwiGLU> shared_experts;  // null without
  ExpertDispatchFn dispatch;
  // Sums a float64 [E] tensor of expert counts over the data-parallel ranks
  // (unset: this process's own); its result must be the same on every rank.
  std::function<Tensor(const Tensor&)> balance_sum;
  double aux_grad_scale = 1.0;
  // Multiplies aux_grad_scale on the device when defined (a loss scaler's
  // live scale, GradScaler::scale_tensor): read by nothing on the host, so
  // a captured float16 step scales the router losses as eagerly.
  Tensor aux_grad_scale_tensor;

 private:
  Tensor tokens_sum_;       // float64 [E], on the device, since reset_stats(); undefined: no forward
  Tensor aux_sum_, z_sum_;  // 0-dim in the scores' dtype, likewise; undefined: no loss computed
  Tensor dropped_sum_;      // float64 0-dim, likewise; undefined: no capacity or no forward
  int64_t forwards_ = 0, routed_ = 0;
};

// Every MoE layer of `model`, in module order.
std::vector<MoE*> moe_layers(Module& model);
// Sets aux_grad_scale (and aux_grad_scale_tensor: undefined for none) on
// every MoE layer of `model`.
void set_moe_aux_grad_scale(Module& model, double scale, const Tensor& device_scale = Tensor());
// reset_stats() on every MoE layer of `model`.
void reset_moe_stats(Module& model);

}  // namespace ember::nn
