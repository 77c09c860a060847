// Attention on CUDA against the CPU kernels, forward and gradients: the
// blocked kernels (float64, and float32 where the fused ones decline) and
// the fused ones (16-bit and float32 q, k, v),
// with q, k, v, the output and the gradients where they lie (strided views,
// a packed projection's heads, keys expanded over groups of query heads),
// the deterministic dQ pass, and the log-sum-exp variants of context
// parallelism. Skips (with the reason) when no GPU is present.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "autograd/autograd.h"
#include "core/ops.h"
#include "core/ops/kernels.h"
#include "core/ops_nn.h"
#include "core/testing/bitwise.h"
#include "core/testing/cuda_compare.h"

namespace ember {
namespace {

using namespace testing::cuda_compare;

class CudaAttention : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_is_available()) GTEST_SKIP() << cuda_unavailable_reason();
  }
  void TearDown() override {
    set_deterministic_algorithms(false);
    set_attention_cuda_flash_tiles({});
    set_attention_cuda_scratch(0);
  }
};

// Fused attention: causal and not, more keys than queries, dropout (the
// same Philox mask on both backends), forward and the three gradients.
TEST_F(CudaAttention, AttentionMatchesCpu) {
  uint64_t seed = 300;
  for (bool causal : {false, true})
    for (double p : {0.0, 0.3})
      for (DType dt : {DType::Float32, DType::Float64}) {
        const int64_t tk = causal ? 9 : 13;
        std::vector<Tensor> in = {rnd({2, 3, 9, 8}, seed++, dt), rnd({2, 3, tk, 8}, seed++, dt),
                                  rnd({2, 3, tk, 5}, seed++, dt)};
        Fn f = [causal, p](const std::vector<Tensor>& v) {
          Generator g(17);
          return scaled_dot_product_attention(v[0], v[1], v[2], causal, p, &g);
        };
        compare(f, in, tol(dt), cat("attention causal ", causal, " p ", p, " ", dt));
        // A scratch of 4 query rows per head splits the 9 rows into blocks
        // of 4, 4 and 1: dK and dV sum over blocks, a causal block stops early.
        set_attention_cuda_scratch(6 * tk * 4);
        compare(f, in, tol(dt), cat("attention in blocks causal ", causal, " p ", p, " ", dt));
        set_attention_cuda_scratch(0);
      }
}

// The fused (flash) kernels for 16-bit q, k, v (flash_forward_kernel,
// delta_kernel, flash_backward_kernel): head dims 32, 64 and 128,
// several query blocks and key tiles with partial last ones (65, 70, 129
// rows; 64, 150 keys), causal with fewer and more keys than queries, an
// explicit scale, dropout (the CPU's Philox mask); against the CPU kernel in
// float32 (P and dS are rounded to the 16-bit type before their products,
// as FlashAttention does, which the tolerance covers). The launch counter
// shows the fused path ran (forward and backward), not the blocked one.
// Every case runs with both key tiles: 64 (forward tiles, 4-warp backward
// blocks, whose query tiles load in one stage, behind dQ's products) and
// the default 128 (8-warp backward blocks whose dQ products split the
// columns in two, query tiles in two stages that alternate: 129 and 140
// rows are three tiles; the 140 x 200 causal case leaves warps of the last
// key block idle, past the causal edge or past the last key). The
// forwards that interleave P v with the softmax (head dim 64 with 128-key
// tiles, 128; without dropout) and those that do not both run.
TEST_F(CudaAttention, FlashAttentionMatchesCpu) {
  uint64_t seed = 900;
  struct Case {
    int64_t tq, tk, d;
    bool causal;
    double p;
    DType dt;
    std::optional<double> scale;
  };
  for (const int keys : {64, 0})
    for (const Case& c : std::vector<Case>{{70, 70, 64, true, 0.0, DType::BFloat16, {}},
                                           {129, 150, 32, false, 0.0, DType::Float16, 0.3},
                                           {70, 150, 128, true, 0.3, DType::BFloat16, {}},
                                           {129, 64, 64, true, 0.0, DType::Float16, {}},
                                           {65, 65, 64, false, 0.2, DType::Float16, {}},
                                           {140, 200, 32, true, 0.0, DType::BFloat16, {}},
                                           {130, 150, 128, false, 0.0, DType::Float16, {}},
                                           {150, 130, 128, true, 0.0, DType::BFloat16, {}}}) {
      set_attention_cuda_flash_tiles({keys, keys, keys ? 1 : 0});
      std::vector<Tensor> in = {rnd({2, 2, c.tq, c.d}, seed++, c.dt), rnd({2, 2, c.tk, c.d}, seed++, c.dt),
                                rnd({2, 2, c.tk, c.d}, seed++, c.dt)};
      Fn f = [c](const std::vector<Tensor>& v) {
        Generator g(23);
        return scaled_dot_product_attention(v[0], v[1], v[2], c.causal, c.p, &g, c.scale);
      };
      const int64_t before = attention_cuda_flash_launches();
      compare(f, in, tol(c.dt),
              cat("flash attention tq ", c.tq, " tk ", c.tk, " d ", c.d, " causal ", c.causal, " p ", c.p, " ", c.dt,
                  " key tiles ", keys ? keys : 128, " stages ", keys ? 1 : 2));
      EXPECT_EQ(attention_cuda_flash_launches() - before, 2) << "the fused forward and backward should have run";
    }
  set_attention_cuda_flash_tiles({});
  // A negative scale, and one that is 0 in float: the fused kernels take
  // the maximum of the unscaled scores, so they decline both and the
  // blocked kernels answer.
  std::vector<Tensor> in = {rnd({1, 2, 40, 64}, seed++, DType::BFloat16), rnd({1, 2, 50, 64}, seed++, DType::BFloat16),
                            rnd({1, 2, 50, 64}, seed++, DType::BFloat16)};
  int64_t before = attention_cuda_flash_launches();
  compare(
      [](const std::vector<Tensor>& v) {
        return scaled_dot_product_attention(v[0], v[1], v[2], false, 0.0, nullptr, 1e-50);
      },
      in, tol(DType::BFloat16), "attention with a scale of 1e-50");
  EXPECT_EQ(attention_cuda_flash_launches(), before) << "a scale that is 0 in float should not reach the fused kernels";
  before = attention_cuda_flash_launches();
  compare(
      [](const std::vector<Tensor>& v) {
        return scaled_dot_product_attention(v[0], v[1], v[2], true, 0.0, nullptr, -0.4);
      },
      in, tol(DType::BFloat16), "attention with a negative scale");
  EXPECT_EQ(attention_cuda_flash_launches(), before) << "a negative scale should not reach the fused kernels";
}

// One backward kernel launched with one stage (137 KiB of shared memory at
// head dim 128) and then two (171 KiB): its opt-in follows the larger size
// (the emulation refuses a launch past it, as a GPU does). float16 with
// dropout at head dim 128 is a kernel no other case here launches, so the
// one-stage launch is its first.
TEST_F(CudaAttention, FlashBackwardOptsInToTheLargerStages) {
  uint64_t seed = 1500;
  std::vector<Tensor> in = {rnd({1, 2, 70, 128}, seed++, DType::Float16), rnd({1, 2, 70, 128}, seed++, DType::Float16),
                            rnd({1, 2, 70, 128}, seed++, DType::Float16)};
  Fn f = [](const std::vector<Tensor>& v) {
    Generator g(23);
    return scaled_dot_product_attention(v[0], v[1], v[2], false, 0.2, &g);
  };
  for (const int stages : {1, 2}) {
    set_attention_cuda_flash_tiles({0, 0, stages});
    compare(f, in, tol(DType::Float16), cat("flash attention d 128 float16 dropout, stages ", stages));
  }
}

// Dropout's mask in the fused kernels, element by element: v = [I | 0]
// makes the output the dropped probabilities themselves (out[i][j] = P_ij
// kept / (1 - p), exactly 0 where dropped) and dO = [I | 0] makes dV their
// transpose (dV[j][i] = the same), so the zeros of each must be those of
// bernoulli(1 - p) drawn from the same generator ([heads, tq, tk], as the
// kernels index it), where a kernel that draws a wrong key's or row's bit
// moves an element that a tolerance could miss. Keys a multiple of 4 (a
// row's four keys from one Philox call, halves traded between lanes) and
// not (a call an element); the 16-bit kernels (rows and keys as they lie)
// and the float32 ones (the backward's S^T: keys as rows); several key
// tiles and query blocks; causal and not.
TEST_F(CudaAttention, FlashDropoutMaskIsBernoullis) {
  uint64_t seed = 2500;
  struct Case {
    int64_t tq, tk, d;
    bool causal;
  };
  // [2, 1, rows, d] with ones on the diagonal of each head.
  const auto eye = [](int64_t rows, int64_t d, DType dt) {
    std::vector<double> e(static_cast<size_t>(2 * rows * d), 0.0);
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t r = 0; r < std::min(rows, d); ++r) e[static_cast<size_t>((h * rows + r) * d + r)] = 1.0;
    return Tensor::from_vector(e, {2, 1, rows, d}).to(dt);
  };
  for (const DType dt : {DType::BFloat16, DType::Float32})
    for (const Case& c : std::vector<Case>{{64, 64, 64, false},
                                           {64, 62, 64, true},
                                           {100, 128, 128, false},
                                           {128, 124, 128, true},
                                           {60, 66, 64, false}}) {
      const std::string what = cat("dropout mask ", dt, " tq ", c.tq, " tk ", c.tk, " d ", c.d, " causal ", c.causal);
      const double p = 0.4;
      Generator mask_gen(31);
      const Tensor want = bernoulli({2, c.tq, c.tk}, 1.0 - p, {DType::Float32}, &mask_gen);
      Tensor q = rnd({2, 1, c.tq, c.d}, seed++, dt, 0.3).cuda().requires_grad_();
      Tensor k = rnd({2, 1, c.tk, c.d}, seed++, dt, 0.3).cuda();
      Tensor v = eye(c.tk, c.d, dt).cuda().requires_grad_();
      const int64_t before = attention_cuda_flash_launches();
      Generator g(31);
      Tensor out = scaled_dot_product_attention(q, k, v, c.causal, p, &g);
      out.backward(eye(c.tq, c.d, dt).cuda());
      EXPECT_GE(attention_cuda_flash_launches() - before, 1) << what << ": the fused forward";
      const std::vector<double> m = want.to_vector(), o = out.cpu().to(DType::Float64).to_vector(),
                                dv = v.grad().cpu().to(DType::Float64).to_vector();
      int64_t wrong_out = 0, wrong_dv = 0;
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t i = 0; i < c.tq; ++i)
          for (int64_t j = 0; j < c.tk; ++j) {
            if (j >= c.d || (c.causal && j > i)) continue;
            const bool keep = m[static_cast<size_t>((h * c.tq + i) * c.tk + j)] != 0;
            wrong_out += keep != (o[static_cast<size_t>((h * c.tq + i) * c.d + j)] != 0);
            if (i < c.d) wrong_dv += keep != (dv[static_cast<size_t>((h * c.tk + j) * c.d + i)] != 0);
          }
      EXPECT_EQ(wrong_out, 0) << what << ": output elements whose drop differs from bernoulli's";
      EXPECT_EQ(wrong_dv, 0) << what << ": dV elements whose drop differs from bernoulli's";
    }
}

// The fused kernels for float32 (attention_tf32.cu, 3xTF32): the
// 16-bit test's shapes (head dims 32, 64, 128; partial tiles; causal with
// fewer and more keys than queries; an explicit scale; dropout) against the
// CPU kernel in float32, and the output and gradients against the CPU in
// float64 within 2e-5 of their largest value: nearly float32's accuracy, which one
// TF32 product a product (10 mantissa bits) misses by two orders (the small
// parts' products dropped fail it). Two launches: the fused forward and
// backward. Under deterministic_algorithms() the backward runs the blocked
// kernels (no float32 twin of the dQ pass): one launch, the same values.
// Then the log-sum-exp variant (delta's dlse), fused and through that
// fallback.
TEST_F(CudaAttention, FlashFloat32MatchesFloat64) {
  uint64_t seed = 1700;
  struct Case {
    int64_t tq, tk, d;
    bool causal;
    double p;
    std::optional<double> scale;
  };
  const auto close = [](const Tensor& want, const Tensor& got, const std::string& what) {
    const double top = std::max(1.0, max(abs(want)).item<double>());
    const double err = max(abs(got.cpu().to(DType::Float64) - want)).item<double>();
    EXPECT_LE(err, 2e-5 * top) << what << ": largest error " << err << " of values up to " << top;
  };
  for (const bool det : {false, true})
    for (const Case& c : std::vector<Case>{{70, 70, 64, true, 0.0, {}},
                                           {129, 150, 32, false, 0.0, 0.3},
                                           {70, 148, 128, true, 0.3, {}},
                                           {129, 64, 64, true, 0.0, {}},
                                           {65, 65, 64, false, 0.2, {}},
                                           {140, 200, 32, true, 0.0, {}}}) {
      if (det && c.d != 64) continue;  // the blocked backward: two cases
      set_deterministic_algorithms(det);
      std::vector<Tensor> in = {rnd({2, 2, c.tq, c.d}, seed++, DType::Float32),
                                rnd({2, 2, c.tk, c.d}, seed++, DType::Float32),
                                rnd({2, 2, c.tk, c.d}, seed++, DType::Float32)};
      Fn f = [c](const std::vector<Tensor>& v) {
        Generator g(23);
        return scaled_dot_product_attention(v[0], v[1], v[2], c.causal, c.p, &g, c.scale);
      };
      const std::string what = cat("float32 flash attention tq ", c.tq, " tk ", c.tk, " d ", c.d, " causal ", c.causal,
                                   " p ", c.p, " deterministic ", det);
      const int64_t before = attention_cuda_flash_launches();
      compare(f, in, tol(DType::Float32), what);
      // A device that gives a block less than the backward's 109 KiB at head
      // dim 128 (sm_86, sm_89, sm_120: 99) runs it on the blocked kernels too.
      const int64_t ran = attention_cuda_flash_launches() - before;
      if (det || c.d < 128)
        EXPECT_EQ(ran, det ? 1 : 2) << what << ": the fused forward and backward";
      else
        EXPECT_TRUE(ran == 2 || ran == 1) << what << ": " << ran << " fused launches";
      std::vector<Tensor> wide;
      for (const Tensor& t : in) wide.push_back(t.to(DType::Float64));
      const Outcome want = run(f, wide, false), got = run(f, in, true);
      close(want.y, got.y, what + " forward");
      for (int i = 0; i < 3; ++i) close(want.grads[i], got.grads[i], cat(what, " grad ", i));
    }
  // The log-sum-exp variant (a gradient through lse too: delta's dlse), fused
  // and, deterministic, the backward's blocked fallback with its dlse.
  for (const bool det : {false, true}) {
    set_deterministic_algorithms(det);
    std::vector<Tensor> in = {rnd({2, 2, 70, 64}, seed++, DType::Float32), rnd({2, 2, 75, 64}, seed++, DType::Float32),
                              rnd({2, 2, 75, 64}, seed++, DType::Float32)};
    const int64_t before = attention_cuda_flash_launches();
    compare([](const std::vector<Tensor>& v) { return scaled_dot_product_attention_lse(v[0], v[1], v[2], true); }, in,
            tol(DType::Float32), cat("float32 flash attention lse, deterministic ", det));
    EXPECT_EQ(attention_cuda_flash_launches() - before, det ? 1 : 2) << "lse, deterministic " << det;
  }
}

// The fused kernels keep a head's row offsets in 32 bits: sequences whose
// rows (with a 128-row tile past the last) times the head dim reach 2^31
// elements are left to the blocked kernels (asked of the check itself:
// such tensors take 4 GiB each).
TEST_F(CudaAttention, FlashAttentionRowOffsetsFitIn32Bits) {
  AttentionArgs a;
  a.n = 1, a.d = a.dv = 128, a.scale = 0.125, a.tq = 16, a.tk = (int64_t{1} << 24) - 129;
  EXPECT_TRUE(attention_flash_cuda_supports(a, DType::BFloat16));
  a.tk += 1;
  EXPECT_FALSE(attention_flash_cuda_supports(a, DType::BFloat16)) << "(keys + 128) x head dim = 2^31";
  a.tk = 16, a.tq = (int64_t{1} << 24) - 128;
  EXPECT_FALSE(attention_flash_cuda_supports(a, DType::BFloat16)) << "(queries + 128) x head dim = 2^31";
  a.tq = (int64_t{1} << 25) - 129, a.d = a.dv = 64;
  EXPECT_TRUE(attention_flash_cuda_supports(a, DType::BFloat16));
  // float32's rows are addressed as twice as many 16-bit elements.
  a.tq = 16, a.d = a.dv = 128, a.tk = (int64_t{1} << 23) - 129;
  EXPECT_TRUE(attention_flash_cuda_supports(a, DType::Float32));
  a.tk += 1;
  EXPECT_FALSE(attention_flash_cuda_supports(a, DType::Float32)) << "(keys + 128) x head dim x 2 = 2^31";
  EXPECT_TRUE(attention_flash_cuda_supports(a, DType::BFloat16));
}

// Under deterministic_algorithms() the fused backward leaves dQ to a pass of
// its own (flash_dq_kernel: each block sums its rows' parts in key order
// instead of the key blocks adding theirs with atomics): the same cases
// against the CPU, three launches (forward, backward, dQ pass), and two runs
// bit for bit the same (on a GPU the atomic path's last bits vary from run
// to run). The log-sum-exp variant (a gradient through lse too) takes the
// same pass. Every other case runs the backward with 64-key blocks in two
// stages (its dQ pass keeps 64-key tiles either way), the others with
// 128-key blocks in one stage: with the other test's, every pair of key
// blocks and stages, with and without the atomics.
TEST_F(CudaAttention, FlashAttentionDeterministicDqMatchesCpu) {
  struct Case {
    int64_t tq, tk, d;
    bool causal;
    double p;
    DType dt;
  };
  uint64_t seed = 1900;
  int index = 0;
  for (const Case& c : std::vector<Case>{{70, 70, 64, true, 0.0, DType::BFloat16},
                                         {129, 150, 32, false, 0.0, DType::Float16},
                                         {70, 150, 128, true, 0.3, DType::BFloat16},
                                         {129, 64, 64, true, 0.0, DType::Float16},
                                         {200, 132, 64, false, 0.2, DType::BFloat16}}) {
    const int keys = index++ % 2 ? 64 : 0;
    set_attention_cuda_flash_tiles({keys, keys, keys ? 2 : 1});
    const std::string what = cat("deterministic flash attention tq ", c.tq, " tk ", c.tk, " d ", c.d, " causal ",
                                 c.causal, " p ", c.p, " key tiles ", keys ? keys : 128, " stages ", keys ? 2 : 1);
    // Three heads: blockIdx.y past one, fewer than the other test's four (five runs a case here).
    std::vector<Tensor> in = {rnd({1, 3, c.tq, c.d}, seed++, c.dt), rnd({1, 3, c.tk, c.d}, seed++, c.dt),
                              rnd({1, 3, c.tk, c.d}, seed++, c.dt)};
    Fn f = [c](const std::vector<Tensor>& v) {
      Generator g(23);
      return scaled_dot_product_attention(v[0], v[1], v[2], c.causal, c.p, &g);
    };
    const Outcome cpu = run(f, in, false);
    set_deterministic_algorithms(true);
    const int64_t before = attention_cuda_flash_launches();
    const Outcome first = run(f, in, true);
    EXPECT_EQ(attention_cuda_flash_launches() - before, 3) << what << ": forward, backward and the dQ pass";
    const Outcome second = run(f, in, true);
    set_deterministic_algorithms(false);
    expect_same(cpu.y, first.y, tol(c.dt), what + " forward");
    for (size_t i = 0; i < 3; ++i) {
      expect_same(cpu.grads[i], first.grads[i], tol(c.dt), cat(what, " grad ", i));
      EXPECT_TRUE(bitwise_equal(first.grads[i], second.grads[i])) << what << ": grad " << i << " changed between runs";
    }
  }
  set_attention_cuda_flash_tiles({});
  set_deterministic_algorithms(true);
  for (bool causal : {false, true}) {
    std::vector<Tensor> in = {rnd({2, 2, 70, 64}, seed++, DType::BFloat16),
                              rnd({2, 2, 75, 64}, seed++, DType::BFloat16),
                              rnd({2, 2, 75, 64}, seed++, DType::BFloat16)};
    const int64_t before = attention_cuda_flash_launches();
    compare(
        [causal](const std::vector<Tensor>& v) { return scaled_dot_product_attention_lse(v[0], v[1], v[2], causal); },
        in, tol(DType::BFloat16), cat("deterministic attention lse causal ", causal));
    EXPECT_EQ(attention_cuda_flash_launches() - before, 3) << "lse causal " << causal;
  }
  set_deterministic_algorithms(false);
}

// Every variant of the 16-bit fused kernels that the launchers can pick,
// each on a small case against the CPU: both 16-bit types, head dims 32,
// 64 and 128, key tiles of 64 and 128 (the forward's too, up to head dim
// 64), dropout or not, the dQ by atomics or by its deterministic pass, the
// backward's query tiles in one or two stages by turns. The other tests
// pick a handful of these combinations for what each shows; this one
// leaves no instantiation of flash_forward_kernel, flash_backward_kernel or
// flash_dq_kernel unrun (tools/emu_coverage.py --instances found 21 of the
// 48 backward ones, 3 of 20 forward and 7 of 12 dQ passes run by no test).
TEST_F(CudaAttention, FlashEveryVariantMatchesCpu) {
  uint64_t seed = 2500;
  int index = 0;
  for (const DType dt : {DType::BFloat16, DType::Float16})
    for (const int64_t d : {32, 64, 128})
      for (const int keys : {64, 128})
        for (const double p : {0.0, 0.25})
          for (const bool det : {false, true}) {
            // Stages by the parity of the last three loops' indices: both
            // stages with each of dropout, key tiles and the dQ's two ways.
            const int stages = 1 + (index + index / 2 + index / 4) % 2;
            const bool causal = ++index % 3 == 0;
            const int64_t tq = 70, tk = causal ? 70 : 90;
            set_attention_cuda_flash_tiles({keys, keys, stages});
            set_deterministic_algorithms(det);
            const std::string what = cat("flash attention ", dt, " d ", d, " key tiles ", keys, " p ", p,
                                         " deterministic ", det, " stages ", stages, " causal ", causal);
            std::vector<Tensor> in = {rnd({1, 2, tq, d}, seed++, dt), rnd({1, 2, tk, d}, seed++, dt),
                                      rnd({1, 2, tk, d}, seed++, dt)};
            Fn f = [causal, p](const std::vector<Tensor>& v) {
              Generator g(29);
              return scaled_dot_product_attention(v[0], v[1], v[2], causal, p, &g);
            };
            const int64_t before = attention_cuda_flash_launches();
            compare(f, in, tol(dt), what);
            EXPECT_EQ(attention_cuda_flash_launches() - before, det ? 3 : 2) << what << ": the fused kernels";
          }
  set_deterministic_algorithms(false);
  set_attention_cuda_flash_tiles({});
}

// The log-sum-exp variant (context parallelism's merge): the blocked
// kernels (float32, float64: probs_kernel's lse, delta_kernel's dlse) and
// the fused ones (bfloat16, head dim 64: delta_kernel's dlse) against
// the CPU, forward and gradients through both the output and the lse.
TEST_F(CudaAttention, AttentionLogSumExpMatchesCpu) {
  uint64_t seed = 950;
  for (DType dt : {DType::Float32, DType::Float64, DType::BFloat16})
    for (bool causal : {false, true}) {
      const int64_t d = dt == DType::BFloat16 ? 64 : 8;
      std::vector<Tensor> in = {rnd({2, 2, 70, d}, seed++, dt), rnd({2, 2, 75, d}, seed++, dt),
                                rnd({2, 2, 75, d}, seed++, dt)};
      Fn f = [causal](const std::vector<Tensor>& v) {
        return scaled_dot_product_attention_lse(v[0], v[1], v[2], causal);
      };
      compare(f, in, tol(dt), cat("attention lse causal ", causal, " ", dt));
    }
  // Context parallelism's views, which the fused kernels read where they
  // lie: a block of q's rows, k and v the two halves of one kv.
  for (bool causal : {false, true}) {
    std::vector<Tensor> in = {rnd({2, 2, 140, 64}, seed++, DType::BFloat16),
                              rnd({2, 2, 75, 128}, seed++, DType::BFloat16)};
    Fn f = [causal](const std::vector<Tensor>& v) {
      return scaled_dot_product_attention_lse(v[0].narrow(2, 70, 70), v[1].narrow(-1, 0, 64), v[1].narrow(-1, 64, 64),
                                              causal);
    };
    const int64_t before = attention_cuda_flash_launches();
    compare(f, in, tol(DType::BFloat16), cat("attention lse on views causal ", causal));
    EXPECT_EQ(attention_cuda_flash_launches() - before, 2) << "the fused forward and backward";
  }
}

// One key block's gradients of a merged attention (context parallelism's
// ring backward): the blocked kernels and the fused ones (bfloat16, head dim
// 64, which take the block's log-sum-exp instead of recomputing it) against
// the CPU. block_lse is the block's own (the CPU's), lse that of a merge
// with other blocks (larger).
TEST_F(CudaAttention, AttentionBlockGradsMatchCpu) {
  uint64_t seed = 970;
  for (DType dt : {DType::Float32, DType::Float64, DType::BFloat16})
    for (bool causal : {false, true}) {
      const int64_t d = dt == DType::BFloat16 ? 64 : 8;
      const Tensor q = rnd({2, 2, 70, d}, seed++, dt), k = rnd({2, 2, 75, d}, seed++, dt),
                   v = rnd({2, 2, 75, d}, seed++, dt);
      const Tensor packed = scaled_dot_product_attention_lse(q, k, v, causal);
      const DType compute = packed.dtype();
      const Tensor block_lse = packed.select(-1, d).contiguous();
      const Tensor lse = block_lse + abs(rnd(block_lse.sizes(), seed++, compute));
      const Tensor out = rnd({2, 2, 70, d}, seed++, compute), dout = rnd({2, 2, 70, d}, seed++, compute);
      const auto want = scaled_dot_product_attention_block_grads(q, k, v, out, dout, lse, block_lse, causal);
      const auto got = scaled_dot_product_attention_block_grads(q.cuda(), k.cuda(), v.cuda(), out.cuda(), dout.cuda(),
                                                                lse.cuda(), block_lse.cuda(), causal);
      for (int i = 0; i < 3; ++i)
        expect_same(want[i], got[i], tol(dt), cat("block grads ", i, " causal ", causal, " ", dt));
    }
}

// The packed projection's op (MultiheadAttention's): qkv [B, T, 3 E] with
// H heads of head dim 32, 64 or 128, against the CPU kernels (float32 from
// the same 16-bit values), causal and not, dropout, rows across the tiles'
// edges; the fused kernels read the heads where they lie in qkv, write the
// output [B, T, H, D] and dk, dv into qkv's gradient (the launch counter
// shows the fused forward and backward ran), float32 included (head dim
// 32); head dim 8 takes the blocked kernels on copies of the heads.
TEST_F(CudaAttention, PackedQkvMatchesCpu) {
  uint64_t seed = 1200;
  struct Case {
    int64_t b, t, h, d;
    bool causal;
    double p;
    DType dt;
  };
  for (const Case& c : std::vector<Case>{{2, 70, 3, 64, true, 0.0, DType::BFloat16},
                                         {1, 129, 2, 32, false, 0.0, DType::Float16},
                                         {2, 65, 2, 128, true, 0.2, DType::BFloat16},
                                         {1, 40, 2, 64, false, 0.3, DType::Float16},
                                         {2, 33, 2, 8, true, 0.0, DType::Float32},
                                         {2, 40, 2, 32, true, 0.2, DType::Float32}}) {
    const std::vector<Tensor> in = {rnd({c.b, c.t, 3 * c.h * c.d}, seed++, c.dt)};
    const Fn f = [c](const std::vector<Tensor>& v) {
      Generator g(41);
      return scaled_dot_product_attention_qkvpacked(v[0], c.h, c.causal, c.p, &g);
    };
    const int64_t before = attention_cuda_flash_launches();
    compare(f, in, tol(c.dt),
            cat("packed attention B ", c.b, " T ", c.t, " H ", c.h, " D ", c.d, " causal ", c.causal, " p ", c.p, " ",
                c.dt));
    EXPECT_EQ(attention_cuda_flash_launches() - before, c.d == 8 ? 0 : 2)
        << "the fused kernels or (head dim 8) the blocked ones should have run, D " << c.d;
  }
}

// The fused kernels read q, k and v where they lie: heads of a [B, T, H, D]
// tensor (rows H D apart), keys and values expanded over groups of query
// heads ([B, Hkv, groups, T, D], a zero stride; queries a 5-D view of
// [B, T, Hkv groups, D]), a view whose rows have padding past the head dim,
// and one that starts off 16-byte alignment (copied first). Each f builds
// the views from contiguous leaves on both devices, so the gradients come
// back through the views to the leaves; the launch counter shows the fused
// kernels ran, not the blocked ones on copies. bfloat16 and float32.
TEST_F(CudaAttention, FlashAttentionReadsViewsWhereTheyLie) {
  uint64_t seed = 1300;
  const int64_t B = 2, T = 70, D = 64;
  struct Case {
    const char* what;
    std::vector<Tensor> in;
    Fn f;
  };
  for (const DType dt : {DType::BFloat16, DType::Float32}) {  // float32: attention_tf32.cu's kernels
    const std::vector<Case> cases = {
        {"heads of [B, T, H, D]",
         {rnd({B, T, 3, D}, seed++, dt), rnd({B, T, 3, D}, seed++, dt), rnd({B, T, 3, D}, seed++, dt)},
         [](const std::vector<Tensor>& v) {
           return scaled_dot_product_attention(v[0].permute({0, 2, 1, 3}), v[1].permute({0, 2, 1, 3}),
                                               v[2].permute({0, 2, 1, 3}), true);
         }},
        {"keys expanded over 3 query heads each",
         {rnd({B, T, 6, D}, seed++, dt), rnd({B, 2, T, D}, seed++, dt), rnd({B, 2, T, D}, seed++, dt)},
         [B, T, D](const std::vector<Tensor>& v) {
           const Tensor q = v[0].view({B, T, 2, 3, D}).permute({0, 2, 3, 1, 4});
           const auto expanded = [B, T, D](const Tensor& x) { return x.unsqueeze(2).expand({B, 2, 3, T, D}); };
           return scaled_dot_product_attention(q, expanded(v[1]), expanded(v[2]), true);
         }},
        {"rows padded past the head dim",
         {rnd({B, 2, T, D + 16}, seed++, dt), rnd({B, 2, T, D + 8}, seed++, dt), rnd({B, 2, T, D + 8}, seed++, dt)},
         [D](const std::vector<Tensor>& v) {
           return scaled_dot_product_attention(v[0].narrow(-1, 16, D), v[1].narrow(-1, 8, D), v[2].narrow(-1, 0, D),
                                               false);
         }},
        {"a view off 16-byte alignment",
         {rnd({B, 2, T, D + 1}, seed++, dt), rnd({B, 2, T, D}, seed++, dt), rnd({B, 2, T, D}, seed++, dt)},
         [D](const std::vector<Tensor>& v) {
           return scaled_dot_product_attention(v[0].narrow(-1, 1, D), v[1], v[2], true);
         }},
    };
    for (const Case& c : cases) {
      const int64_t before = attention_cuda_flash_launches();
      compare(c.f, c.in, tol(dt), cat("flash attention on ", c.what, " ", dt));
      EXPECT_EQ(attention_cuda_flash_launches() - before, 2)
          << c.what << " " << dt << ": the fused forward and backward";
    }
  }
}

// The fused path lays its output out as q lies and each gradient as its
// input lies (PyTorch's flash SDPA allocates its output as q's [B, T, H, D]):
// heads of [B, T, H, D] give an output whose transpose back is contiguous,
// and gradients that are [B, T, H, D] too, with the values of contiguous
// inputs bit for bit (the kernels do the same work wherever the operands lie).
TEST_F(CudaAttention, FlashOutputAndGradientsLieAsTheirInputs) {
  const int64_t B = 2, T = 70, H = 3, D = 64;
  const DType dt = DType::BFloat16;
  const auto heads = [&](uint64_t seed) {
    return rnd({B, T, H, D}, seed, dt).cuda().permute({0, 2, 1, 3}).detach().requires_grad_();
  };
  const Tensor q = heads(1500), k = heads(1501), v = heads(1502);
  const Tensor qc = q.detach().contiguous().requires_grad_(), kc = k.detach().contiguous().requires_grad_();
  const Tensor vc = v.detach().contiguous().requires_grad_();
  ASSERT_FALSE(q.is_contiguous());
  const Tensor dout = rnd({B, H, T, D}, 1503, dt).cuda();
  const Tensor out = scaled_dot_product_attention(q, k, v, true), outc = scaled_dot_product_attention(qc, kc, vc, true);
  EXPECT_TRUE(out.permute({0, 2, 1, 3}).is_contiguous()) << "out strides " << shape_str(out.strides());
  EXPECT_TRUE(outc.is_contiguous());
  testing::expect_bitwise(out.contiguous(), outc, "out");
  const std::vector<Tensor> g = autograd::grad(out, {q, k, v}, dout);
  const std::vector<Tensor> gc = autograd::grad(outc, {qc, kc, vc}, dout);
  const char* names[] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(g[i].permute({0, 2, 1, 3}).is_contiguous()) << names[i] << " strides " << shape_str(g[i].strides());
    testing::expect_bitwise(g[i].contiguous(), gc[i], names[i]);
  }
  // GroupedQueryAttention's arrangement: q's heads grouped by the key/value
  // head they share, k and v expanded over the groups (a zero stride). The
  // keys' and values' gradients are the sums over the groups, taken where
  // the kernels laid them out ([B, T, Hkv, G, D]), so they land in
  // [B, T, Hkv, D] as k and v lie.
  const int64_t Hkv = 2, G = 3;
  const auto grouped = [&](uint64_t seed, int64_t h) {
    return rnd({B, T, h, D}, seed, dt).cuda().permute({0, 2, 1, 3}).detach().requires_grad_();
  };
  const Tensor q5 = rnd({B, T, Hkv, G, D}, 1510, dt).cuda().permute({0, 2, 3, 1, 4}).detach().requires_grad_();
  const Tensor k4 = grouped(1511, Hkv), v4 = grouped(1512, Hkv);
  const auto expanded = [&](const Tensor& x) { return x.unsqueeze(2).expand({B, Hkv, G, T, D}); };
  const Tensor q5c = q5.detach().contiguous().requires_grad_(), k4c = k4.detach().contiguous().requires_grad_();
  const Tensor v4c = v4.detach().contiguous().requires_grad_();
  const Tensor o5 = scaled_dot_product_attention(q5, expanded(k4), expanded(v4), true);
  const Tensor o5c = scaled_dot_product_attention(q5c, expanded(k4c), expanded(v4c), true);
  EXPECT_TRUE(o5.permute({0, 3, 1, 2, 4}).is_contiguous()) << "grouped out strides " << shape_str(o5.strides());
  const Tensor dout5 = rnd({B, Hkv, G, T, D}, 1513, dt).cuda();
  const std::vector<Tensor> g5 = autograd::grad(o5, {q5, k4, v4}, dout5);
  const std::vector<Tensor> g5c = autograd::grad(o5c, {q5c, k4c, v4c}, dout5);
  EXPECT_TRUE(g5[0].permute({0, 3, 1, 2, 4}).is_contiguous()) << "grouped dq strides " << shape_str(g5[0].strides());
  testing::expect_bitwise(g5[0].contiguous(), g5c[0], "grouped dq");
  for (int i = 1; i < 3; ++i) {
    EXPECT_TRUE(g5[i].permute({0, 2, 1, 3}).is_contiguous())
        << "grouped " << names[i] << " strides " << shape_str(g5[i].strides());
    expect_same(g5c[i].cpu(), g5[i].contiguous(), tol(dt), cat("grouped ", names[i]));
  }
}

// Outputs the kernels cannot write where they lie (a view off 16-byte
// alignment) are written to a contiguous stand-in and copied: the same bits
// as a contiguous output, forward (out) and backward (dk, dv from the
// registers in 16 bits; dq through its float32 sum).
TEST_F(CudaAttention, FlashOutputsOffAlignmentAreCopiedIn) {
  AttentionArgs a;
  a.n = 2, a.tq = 70, a.tk = 90, a.d = a.dv = 64, a.scale = 0.125, a.causal = true;
  const DType dt = DType::BFloat16;
  const auto dev = [&](uint64_t seed) { return rnd({a.n, a.tk, a.d}, seed, dt).cuda(); };
  const Tensor q = rnd({a.n, a.tq, a.d}, 1400, dt).cuda(), k = dev(1401), v = dev(1402);
  const Tensor dout = rnd({a.n, a.tq, a.d}, 1403, dt).cuda();
  const auto off = [&](int64_t t) {  // a [n, t, d] view one element into its buffer
    return Tensor::empty({a.n, t, a.d + 1}, {dt, q.device()}).narrow(-1, 1, a.d);
  };
  ASSERT_TRUE(attention_flash_cuda_supports(a, dt));
  Tensor out = Tensor::empty({a.n, a.tq, a.d}, q.options()), out_off = off(a.tq);
  Tensor lse = Tensor::empty({a.n, a.tq}, {DType::Float32, q.device()}), lse2 = empty_like(lse);
  attention_flash_forward_cuda(a, q, k, v, out, lse);
  attention_flash_forward_cuda(a, q, k, v, out_off, lse2);
  testing::expect_bitwise(out, out_off, "out written through a stand-in");
  const auto grads = [&](Tensor& dq, Tensor& dk, Tensor& dv) {
    attention_flash_backward_cuda(a, q, k, v, out, dout, lse, dq, dk, dv);
  };
  Tensor dq = Tensor::empty(q.sizes(), q.options()), dk = Tensor::empty(k.sizes(), k.options());
  Tensor dv = Tensor::empty(v.sizes(), v.options());
  Tensor dq_off = off(a.tq), dk_off = off(a.tk), dv_off = off(a.tk);
  grads(dq, dk, dv);
  grads(dq_off, dk_off, dv_off);
  testing::expect_bitwise(dk, dk_off, "dk");
  testing::expect_bitwise(dv, dv_off, "dv");
  expect_same(dq.cpu().to(DType::Float32), dq_off.to(DType::Float32), tol(dt), "dq");
  // A float32 dq that is dense but 4 bytes off the 8 the atomics' float2s
  // need: summed apart and copied in.
  Tensor dq_odd =
      Tensor::empty({dq.numel() + 1}, {DType::Float32, q.device()}).narrow(0, 1, dq.numel()).view(dq.sizes());
  Tensor dk_f = Tensor::empty(k.sizes(), {DType::Float32, q.device()}), dv_f = empty_like(dk_f);
  grads(dq_odd, dk_f, dv_f);
  expect_same(dq.cpu().to(DType::Float32), dq_odd, tol(dt), "dq in float32 off 8-byte alignment");
  // float32 gradients (context parallelism's block sums) are written as they are.
  Tensor dq32 = Tensor::empty(q.sizes(), {DType::Float32, q.device()});
  Tensor dk32 = Tensor::empty(k.sizes(), {DType::Float32, q.device()});
  Tensor dv32 = Tensor::empty(v.sizes(), {DType::Float32, q.device()});
  grads(dq32, dk32, dv32);
  expect_same(dk.cpu().to(DType::Float32), dk32, tol(dt), "dk in float32");
  expect_same(dv.cpu().to(DType::Float32), dv32, tol(dt), "dv in float32");
}

}  // namespace
}  // namespace ember
