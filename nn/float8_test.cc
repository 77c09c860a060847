// convert_to_float8_training on the two model families: which layers
// convert (every projection, not the LM head, not a layer off the 16
// multiple), the state dict kept, the refusal of a layer that already has a
// kernel, the forward actually in float8, and a fit whose loss tracks the
// float32 model's step for step.
#include "nn/float8.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "nn/transformer.h"
#include "optim/optimizer.h"

namespace ember::nn {
namespace {

GPTOptions llama_options() {
  return GPTOptions::llama(
      {.vocab_size = 32, .block_size = 16, .n_layer = 2, .n_head = 4, .n_embd = 64, .n_kv_head = 2, .ffn_hidden = 128});
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(Float8Training, ConvertsTheProjectionsOfLlama) {
  manual_seed(1);
  GPT m(llama_options());
  std::vector<std::string> names_before;
  for (auto& [n, p] : m.named_parameters()) names_before.push_back(n);
  const std::vector<std::string> got = convert_to_float8_training(m);
  std::vector<std::string> want;
  for (int l = 0; l < 2; ++l)
    for (const char* p :
         {"attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
      want.push_back("h." + std::to_string(l) + "." + p);
  EXPECT_EQ(got, want);  // not lm_head
  std::vector<std::string> names_after;
  for (auto& [n, p] : m.named_parameters()) names_after.push_back(n);
  EXPECT_EQ(names_after, names_before);
  // A second conversion finds every layer taken.
  EXPECT_NE(error_of([&] { convert_to_float8_training(m); })
                .find("'h.0.attn.q_proj' (Linear) already has a linear "
                      "kernel"),
            std::string::npos);
}

TEST(Float8Training, ConvertsGpt2AndSkipsWhatIsAsked) {
  manual_seed(2);
  GPT m(GPTOptions{.vocab_size = 32, .block_size = 16, .n_layer = 1, .n_head = 2, .n_embd = 32});
  const std::vector<std::string> all = convert_to_float8_training(m);
  EXPECT_EQ(all, (std::vector<std::string>{"h.0.attn", "h.0.attn.out_proj", "h.0.mlp.c_fc", "h.0.mlp.c_proj"}));
  GPT m2(GPTOptions{.vocab_size = 32, .block_size = 16, .n_layer = 1, .n_head = 2, .n_embd = 32});
  Float8Options o;
  o.skip_fqns = {"lm_head", "c_proj"};
  o.filter = [](const std::string& fqn, const Module&) { return fqn != "h.0.attn"; };
  EXPECT_EQ(convert_to_float8_training(m2, o), (std::vector<std::string>{"h.0.attn.out_proj", "h.0.mlp.c_fc"}));
  // Off the multiple of 16: left in high precision.
  Linear odd(24, 32);
  EXPECT_TRUE(convert_to_float8_training(odd).empty());
}

// What conversion leaves on each layer for FSDP's float8 all-gather: the
// weight parameter itself, the flag (never on a tied layer, whose weight
// the embedding reads whole), and the cast the layer computes with once a
// gather sets it.
TEST(Float8Training, KeepsEachLayersStateForTheFloat8AllGather) {
  manual_seed(3);
  GPT m(GPTOptions{.vocab_size = 32, .block_size = 16, .n_layer = 1, .n_head = 2, .n_embd = 32, .tie_weights = true});
  Float8Options o;
  o.skip_fqns = {};  // the tied LM head too
  o.enable_fsdp_float8_all_gather = true;
  const std::vector<std::string> got = convert_to_float8_training(m, o);
  ASSERT_EQ(got.back(), "lm_head");
  for (auto& [fqn, mod] : m.named_modules()) {
    auto st = mod->transform_state_as<Float8LinearState>(kFloat8StateKey);
    if (std::find(got.begin(), got.end(), fqn) == got.end()) {
      EXPECT_EQ(st, nullptr) << fqn;
      continue;
    }
    ASSERT_NE(st, nullptr) << fqn;
    EXPECT_EQ(st->all_gather_in_float8, fqn != "lm_head") << fqn;
  }
  auto* fc = m.named_modules()[0].second;
  for (auto& [fqn, mod] : m.named_modules())
    if (fqn == "h.0.mlp.c_proj") fc = mod;
  auto& lin = dynamic_cast<Linear&>(*fc);
  auto st = lin.transform_state_as<Float8LinearState>(kFloat8StateKey);
  EXPECT_TRUE(st->weight.is_same(lin.weight));
  // With a cast set while the weight's data is absent (a gather's
  // placeholder), the layer computes with the cast: a cast of other values
  // (the weight doubled) doubles the matmul's part of the output. A real
  // weight is never shadowed by a cast left behind.
  const Tensor x = randn({16, 128});
  NoGradGuard ng;
  const Tensor plain = lin(x);
  const Tensor w = lin.weight.detach().clone();
  const Tensor s = float8_scale(w * 2.0, DType::Float8E4M3);
  st->cast = Float8Weight{to_float8(w * 2.0, s.select(0, 0), DType::Float8E4M3), s};
  EXPECT_TRUE(allclose(lin(x), plain, 0, 0));
  Tensor placeholder = Tensor::empty(w.sizes());
  placeholder.free_storage("the test's placeholder");
  lin.weight.set_data(placeholder);
  const Tensor doubled = lin(x);
  st->cast = Float8Weight{};
  lin.weight.set_data(w);
  EXPECT_TRUE(allclose(doubled - lin.bias, (plain - lin.bias) * 2.0, 1e-5, 1e-5));
  EXPECT_TRUE(allclose(lin(x), plain, 0, 0));
}

// The same weights, float32 and float8: close logits, not equal ones.
TEST(Float8Training, ForwardRunsInFloat8) {
  manual_seed(3);
  GPT ref(llama_options()), f8(llama_options());
  f8.load_state_dict(ref.state_dict());
  convert_to_float8_training(f8);
  const Tensor tokens = randint(0, 32, {2, 16}, DType::Int64);
  NoGradGuard no_grad;
  const Tensor a = ref(tokens), b = f8(tokens);
  const double err = std::sqrt(sum((a - b) * (a - b)).item() / sum(a * a).item());
  EXPECT_GT(err, 1e-4);  // the casts happened
  EXPECT_LT(err, 0.1);   // and stayed within float8's error
}

// Next token = (token + 1) mod 32 over 4 x 16 tokens, AdamW: the float8
// model's loss tracks the float32 model's from the same start.
TEST(Float8Training, FitTracksFloat32) {
  std::vector<double> ids, next;
  for (int b = 0; b < 4; ++b)
    for (int t = 0; t < 16; ++t) ids.push_back((5 * b + t) % 32);
  for (double v : ids) next.push_back(std::fmod(v + 1, 32));
  const Tensor tokens = Tensor::from_vector(ids, {4, 16}, DType::Int64);
  const Tensor targets = Tensor::from_vector(next, {64}, DType::Int64);
  auto fit = [&](bool fp8) {
    manual_seed(4);
    GPT m(llama_options());
    if (fp8) convert_to_float8_training(m);
    optim::AdamW opt(m.parameters(), {.lr = 3e-3});
    std::vector<double> losses;
    for (int s = 0; s < 30; ++s) {
      opt.zero_grad();
      Tensor loss = functional::cross_entropy(m(tokens).reshape({64, 32}), targets);
      loss.backward();
      opt.step();
      losses.push_back(loss.item());
    }
    return losses;
  };
  const std::vector<double> ref = fit(false), f8 = fit(true);
  EXPECT_LT(f8.back(), 0.3 * f8.front()) << f8.front() << " -> " << f8.back();
  for (size_t s = 0; s < ref.size(); ++s) EXPECT_NEAR(f8[s], ref[s], 0.05 * ref[s] + 0.02) << "step " << s;
  EXPECT_NE(f8[5], ref[5]);
}

}  // namespace
}  // namespace ember::nn
