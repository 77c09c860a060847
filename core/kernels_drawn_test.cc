// The tensor kernels on drawn cases (core/testing/draw.h): elementwise ops
// with broadcasting and strided and stride-0 views, reductions over drawn
// dims, softmax with masked (-inf) entries, matmul at drawn sizes (empty
// and unit ones among them) and transposes, the list ops and the fused
// optimizer steps. Each case runs on the CPU against float64 and on CUDA
// (a GPU, or the emulation in kernels_drawn_emu_test) against the CPU,
// with NaN, infinities, ties, denormals and constant rows in the values.
// Tolerances: docs/design.md, Note [numerics]. EMBER_TEST_DRAWS=N draws N
// cases per family; a failure prints the seed that replays it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "core/ops.h"
#include "core/ops/int_div.h"
#include "core/ops_optim.h"
#include "core/testing/draw.h"
#include "core/testing/drawn_case.h"

namespace ember {
namespace {

using testing::CaseInput;
using testing::check_case;
using testing::Draw;
using testing::for_each_draw;
using testing::Specials;
using testing::tol_for;

const std::vector<DType>& kFloats = testing::kFloatDtypes;

class DrawnOps : public ::testing::Test {
 protected:
  void TearDown() override {
    if (cuda_is_available()) set_matmul_allow_tf32(false);
  }
};

// Every special value; for an op with a pole, no denormals, and in 16-bit
// dtypes ordinary values at least 0.25 from zero (Specials::min_abs).
Specials pole_specials(bool pole, DType dt) {
  Specials sp = Specials::all();
  if (pole) {
    sp.denormals = false;
    if (dt == DType::Float16 || dt == DType::BFloat16) sp.min_abs = 0.25;
  }
  return sp;
}

// A shape of rank 0 to 4 with small (sometimes empty or unit) sizes, or now
// and then one long row, which takes the vectorised paths and their tails.
Shape draw_shape(Draw& d, bool allow_empty = true) {
  if (d.chance(0.15)) return {d.integer(1, 3), d.integer(500, 5000)};
  return d.shape(static_cast<int>(d.integer(0, 4)), 1, 9, allow_empty);
}

// `s` with some dims made 1 and some leading dims dropped: an operand that
// broadcasts against s.
Shape broadcast_from(Draw& d, const Shape& s) {
  Shape b(s.begin() + d.integer(0, static_cast<int64_t>(s.size())), s.end());
  for (int64_t& v : b)
    if (d.chance(0.3)) v = 1;
  return b;
}

TEST_F(DrawnOps, Unary) {
  struct Op {
    const char* name;
    std::function<Tensor(const Tensor&)> f;
    bool grad;
    bool pole = false;  // infinite at 0 (itself or its derivative)
  };
  const std::vector<Op> ops = {
      {"neg", [](const Tensor& x) { return neg(x); }, true},
      {"abs", [](const Tensor& x) { return abs(x); }, true},
      {"exp", [](const Tensor& x) { return exp(x); }, true},
      {"log", [](const Tensor& x) { return log(x); }, true, true},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, true, true},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, true, true},
      {"relu", [](const Tensor& x) { return relu(x); }, true},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, true},
      {"tanh", [](const Tensor& x) { return tanh(x); }, true},
      {"gelu", [](const Tensor& x) { return gelu(x); }, true},
      {"gelu_tanh", [](const Tensor& x) { return gelu(x, true); }, true},
      {"erf", [](const Tensor& x) { return erf(x); }, true},
      {"silu", [](const Tensor& x) { return silu(x); }, true},
      {"pow 3", [](const Tensor& x) { return pow(x, 3.0); }, true},
      {"pow -0.5", [](const Tensor& x) { return pow(x, -0.5); }, true, true},
      {"clamp", [](const Tensor& x) { return clamp(x, -0.5, 0.75); }, true},
      {"clamp min", [](const Tensor& x) { return clamp(x, 0.25, std::nullopt); }, true},
      {"cast int32",
       [](const Tensor& x) { return where(ne(x, x), zeros_like(x), clamp(x, -1e4, 1e4)).to(DType::Int32); }, false},
  };
  for_each_draw("unary", 300, [&](Draw& d) {
    const Op& op = ops[static_cast<size_t>(d.integer(0, static_cast<int64_t>(ops.size()) - 1))];
    const DType dt = d.pick(kFloats);
    const Shape s = draw_shape(d);
    // Now and then the input is a stride-0 view (x[:, None].expand(...)).
    const bool expand = !s.empty() && d.chance(0.2);
    const int64_t at = expand ? d.integer(0, static_cast<int64_t>(s.size())) : 0, times = d.integer(2, 3);
    Tensor x = d.values(s, dt, pole_specials(op.pole, dt));
    check_case(
        detail::str_cat(op.name, " x", shape_str(s), expand ? detail::str_cat(" expanded at ", at) : ""),
        [&](const std::vector<Tensor>& v) {
          Tensor in = v[0];
          if (expand) {
            Shape big = in.sizes();
            big.insert(big.begin() + at, times);
            in = in.unsqueeze(at).expand(big);
          }
          return op.f(in);
        },
        {{x, op.grad}}, d, tol_for(dt, expand ? 1e-5 : 1e-6), tol_for(dt, expand ? 1e-5 : 1e-6));
  });
}

TEST_F(DrawnOps, BinaryWithBroadcast) {
  struct Op {
    const char* name;
    std::function<Tensor(const Tensor&, const Tensor&)> f;
    bool grad;
    bool pole = false;
  };
  const std::vector<Op> ops = {
      {"add", [](const Tensor& a, const Tensor& b) { return add(a, b, -0.5); }, true},
      {"sub", [](const Tensor& a, const Tensor& b) { return a - b; }, true},
      {"mul", [](const Tensor& a, const Tensor& b) { return a * b; }, true},
      {"div", [](const Tensor& a, const Tensor& b) { return a / b; }, true, true},
      // A positive base: a negative one to a fractional power is NaN.
      {"pow", [](const Tensor& a, const Tensor& b) { return pow(abs(a) + 0.5, b); }, true, true},
      {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); }, true},
      {"minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); }, true},
      {"lt", [](const Tensor& a, const Tensor& b) { return lt(a, b); }, false},
      {"eq", [](const Tensor& a, const Tensor& b) { return eq(a, b); }, false},
      {"ge", [](const Tensor& a, const Tensor& b) { return ge(a, b); }, false},
      {"where", [](const Tensor& a, const Tensor& b) { return where(gt(a, b), a, b); }, true},
  };
  for_each_draw("binary", 300, [&](Draw& d) {
    const Op& op = ops[static_cast<size_t>(d.integer(0, static_cast<int64_t>(ops.size()) - 1))];
    const DType dt = d.pick(kFloats);
    const Shape s = draw_shape(d);
    Shape sa = s, sb = broadcast_from(d, s);
    if (d.chance(0.5)) std::swap(sa, sb);
    // b as x[:, None]: drawn without the dim, unsqueezed in the op.
    const bool unsq = !sb.empty() && sb.size() == s.size() && d.chance(0.2);
    const int64_t at = unsq ? d.integer(0, static_cast<int64_t>(sb.size()) - 1) : 0;
    if (unsq) sb.erase(sb.begin() + at);
    Specials sp_b = pole_specials(op.pole, dt);
    // No NaN or infinite exponent: pow(1, NaN) and pow(1, inf) are 1, and a
    // base that rounds to 1 in a 16-bit sum but not in float64 would flip
    // the result (seen in a 5,000-draw soak).
    if (std::string(op.name) == "pow") sp_b.nan = sp_b.inf = false;
    Tensor a = d.values(sa, dt, pole_specials(op.pole, dt)), b = d.values(sb, dt, sp_b);
    int64_t n_out = 1;
    for (int64_t v : s) n_out *= v;
    const double fan = static_cast<double>(n_out) / std::max<int64_t>(1, std::min(a.numel(), b.numel()));
    // A pole op's 16-bit derivative is several ops (div's -g * a / b^2: three
    // roundings) with b near 0.25: twice the dtype's tolerance (a 40,000-draw
    // soak saw 3.7% in bfloat16 against 3%).
    const bool pole16 = op.pole && (dt == DType::Float16 || dt == DType::BFloat16);
    const double grow = std::max(1.0, std::sqrt(fan) / 4) * (pole16 ? 2.0 : 1.0);
    check_case(
        detail::str_cat(op.name, " a", shape_str(sa), " b", shape_str(sb),
                        unsq ? detail::str_cat(" unsqueezed at ", at) : ""),
        [&](const std::vector<Tensor>& v) { return op.f(v[0], unsq ? v[1].unsqueeze(at) : v[1]); },
        // The gradient of a broadcast operand is a sum of `fan` terms: a
        // reduction's error, relative to the terms, which can cancel to a
        // result far smaller than their sum of magnitudes; the rounding of
        // n terms then grows as sqrt(n) against the result (seen in soaks:
        // bfloat16 over 9,884 terms, float32 over 11,931).
        {{a, op.grad}, {b, op.grad}}, d, tol_for(dt, 1e-5) * grow, tol_for(dt, 1e-5) * grow);
  });
}

// sum, mean, max, min and var over a drawn set of dims (or all), keepdim
// or not; argmax/argmin (ties: the first; NaN: its index); softmax and
// log_softmax along a drawn dim, with -inf (masked) entries and rows of one
// value.
TEST_F(DrawnOps, Reductions) {
  for_each_draw("reductions", 300, [&](Draw& d) {
    const DType dt = d.pick(kFloats);
    Shape s = draw_shape(d, true);
    if (s.empty()) s = {d.integer(1, 5)};
    const int64_t rank = static_cast<int64_t>(s.size());
    std::vector<int64_t> dims;
    if (d.chance(0.8))
      for (int64_t i = 0; i < rank; ++i)
        if (d.chance(0.5)) dims.push_back(d.chance(0.3) ? i - rank : i);
    const bool keep = d.chance(0.5);
    const int64_t dim = d.integer(-rank, rank - 1);
    const int64_t which = d.integer(0, 8);
    const bool arg_max = d.chance(0.5);
    const char* names[] = {"sum", "mean", "max", "min", "var", "var(correction=0)", "argmax", "softmax", "log_softmax"};
    // Softmax's specials are masks: -inf, not +inf or NaN, in most draws.
    const bool soft = which >= 7;
    Specials sp = Specials::all();
    if (soft && d.chance(0.7)) sp.nan = false;
    Tensor x = d.values(s, dt, sp);
    if (soft && !sp.nan) x = where(gt(x, full_like(x, 1e30)), full_like(x, -INFINITY), x);
    std::string dims_str;
    for (int64_t v : dims) dims_str += detail::str_cat(v, " ");
    check_case(
        detail::str_cat(names[which], " x", shape_str(s), " dims {", dims_str, "} keepdim ", keep, " dim ", dim),
        [&](const std::vector<Tensor>& v) {
          switch (which) {
            case 0:
              return sum(v[0], dims, keep);
            case 1:
              return mean(v[0], dims, keep);
            case 2:
              return max(v[0], dims, keep);
            case 3:
              return min(v[0], dims, keep);
            case 4:
              return var(v[0], dims, keep);
            case 5:
              return var(v[0], dims, keep, 0);
            case 6:
              return arg_max ? argmax(v[0], dim, keep) : argmin(v[0]);
            case 7:
              return softmax(v[0], dim);
            default:
              return log_softmax(v[0], dim);
          }
        },
        {{x, which != 6}}, d, tol_for(dt, 1e-5), tol_for(dt, 1e-5));
  });
}

// mm, bmm, matmul with broadcast batches and linear with bias, at sizes
// from 0 to 70 (an empty inner dimension gives zeros), operands transposed
// views; on CUDA some float32 draws allow TF32.
TEST_F(DrawnOps, Matmul) {
  for_each_draw("matmul", 150, [&](Draw& d) {
    const DType dt = d.pick(kFloats);
    const int64_t m = d.size(1, 70, true), n = d.size(1, 70, true), k = d.size(1, 70, true);
    const int64_t kind = d.integer(0, 2), batch = d.integer(1, 3);
    const bool ta = d.chance(0.4), tb = d.chance(0.4), bias = d.chance(0.5);
    const bool tf32 = dt == DType::Float32 && d.chance(0.2);
    Shape sa = ta ? Shape{k, m} : Shape{m, k}, sb = tb ? Shape{n, k} : Shape{k, n};
    if (kind == 1) {  // batched a, broadcast or batched b
      sa.insert(sa.begin(), batch);
      if (d.chance(0.5)) sb.insert(sb.begin(), batch);
    }
    if (kind == 2) sb = {n, k};  // linear's weight [out, in]
    Tensor a = d.values(sa, dt, Specials::finite()), b = d.values(sb, dt, Specials::finite());
    Tensor c = kind == 2 && bias ? d.values({n}, dt) : Tensor();
    if (cuda_is_available()) set_matmul_allow_tf32(tf32);
    auto tr = [](const Tensor& t, bool yes) { return yes ? t.transpose(-1, -2) : t; };
    check_case(
        detail::str_cat(kind == 2 ? "linear" : "matmul", " a", shape_str(sa), ta ? "^T" : "", " b", shape_str(sb),
                        tb && kind != 2 ? "^T" : "", c.defined() ? " bias" : "", tf32 ? " TF32" : ""),
        [&](const std::vector<Tensor>& v) {
          if (kind == 2) return linear(tr(v[0], ta), v[1], v[2]);
          return matmul(tr(v[0], ta), tr(v[1], tb));
        },
        {{a, true}, {b, true}, {c, true, false}}, d, tol_for(dt, 1e-5), tf32 ? 5e-3 : tol_for(dt, 1e-5));
    if (cuda_is_available()) set_matmul_allow_tf32(false);
  });
}

// foreach_sum_squares and foreach_mul_ over lists of drawn lengths (empty
// tensors, several chunks of the CUDA kernel's 16384).
TEST_F(DrawnOps, Foreach) {
  for_each_draw("foreach", 60, [&](Draw& d) {
    const DType dt = d.pick<DType>({DType::Float32, DType::Float64});
    const int64_t count = d.integer(1, 5);
    std::vector<CaseInput> in;
    std::string sizes;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t len = d.chance(0.3) ? d.integer(16000, 40000) : d.size(1, 300, true);
      in.push_back({d.values({len}, dt, Specials::finite()), false, false});
      sizes += detail::str_cat(len, " ");
    }
    const double factor = d.normal();
    check_case(
        detail::str_cat("foreach over {", sizes, "}"),
        [&](const std::vector<Tensor>& v) {
          std::vector<Tensor> mine;
          for (const Tensor& t : v) mine.push_back(t.clone());
          Tensor squares = foreach_sum_squares(mine);
          foreach_mul_(mine, factor);
          std::vector<Tensor> flat = {squares};
          for (const Tensor& t : mine) flat.push_back(t);
          return cat(flat);
        },
        in, d, tol_for(dt, 1e-6), tol_for(dt, 1e-6), false);
  });
}

// The fused SGD and Adam(W) steps: three steps with drawn hyperparameters
// (momentum, dampening, Nesterov, weight decay, maximize, amsgrad, decoupled
// decay) on lists of drawn tensors; the parameters and every state tensor
// after them.
TEST_F(DrawnOps, OptimizerSteps) {
  for_each_draw("optimizer", 100, [&](Draw& d) {
    const DType dt = d.pick<DType>({DType::Float32, DType::Float64});
    const bool adam = d.chance(0.5);
    const int64_t count = d.integer(1, 3);
    std::vector<CaseInput> in;
    for (int64_t i = 0; i < count; ++i) {
      const Shape s = {d.size(1, 40, true), d.size(1, 40)};
      in.push_back({d.values(s, dt), false, false});
      for (int step = 0; step < 3; ++step) in.push_back({d.values(s, dt, Specials::finite()), false, false});
    }
    SgdArgs sgd;
    sgd.lr = d.uniform() * 0.5;
    sgd.momentum = d.chance(0.7) ? d.uniform() : 0.0;
    sgd.nesterov = sgd.momentum > 0 && d.chance(0.5);
    sgd.dampening = sgd.nesterov || d.chance(0.5) ? 0.0 : d.uniform() * 0.5;
    sgd.weight_decay = d.chance(0.5) ? d.uniform() * 0.1 : 0.0;
    sgd.maximize = d.chance(0.3);
    AdamArgs ad;
    ad.lr = d.uniform() * 0.1;
    ad.beta1 = d.pick<double>({0.0, 0.5, 0.9});
    ad.beta2 = d.pick<double>({0.9, 0.999});
    ad.eps = d.pick<double>({1e-8, 1e-3});
    ad.weight_decay = d.chance(0.5) ? d.uniform() * 0.1 : 0.0;
    ad.decoupled = d.chance(0.5);
    ad.amsgrad = d.chance(0.5);
    ad.maximize = d.chance(0.3);
    const std::string what =
        adam ? detail::str_cat("adam lr ", ad.lr, " betas ", ad.beta1, " ", ad.beta2, " eps ", ad.eps, " wd ",
                               ad.weight_decay, ad.decoupled ? " decoupled" : "", ad.amsgrad ? " amsgrad" : "",
                               ad.maximize ? " maximize" : "")
             : detail::str_cat("sgd lr ", sgd.lr, " momentum ", sgd.momentum, " dampening ", sgd.dampening, " wd ",
                               sgd.weight_decay, sgd.nesterov ? " nesterov" : "", sgd.maximize ? " maximize" : "");
    check_case(
        detail::str_cat(what, ", ", count, " tensors"),
        [&](const std::vector<Tensor>& v) {
          std::vector<Tensor> params, m(adam ? 0 : count), s, vmax, out;
          for (int64_t i = 0; i < count; ++i) params.push_back(v[i * 4].clone());
          for (int step = 0; step < 3; ++step) {
            std::vector<Tensor> grads;
            for (int64_t i = 0; i < count; ++i) grads.push_back(v[i * 4 + 1 + step]);
            if (adam) {
              if (s.empty())
                for (const Tensor& p : params) {
                  m.push_back(zeros_like(p));
                  s.push_back(zeros_like(p));
                  vmax.push_back(zeros_like(p));
                }
              AdamArgs a = ad;
              a.step = step + 1;
              adam_step_(params, grads, m, s, vmax, a);
            } else {
              sgd_step_(params, grads, m, sgd);
            }
          }
          for (auto* list : {&params, &m, &s, &vmax})
            for (const Tensor& t : *list)
              if (t.defined()) out.push_back(t.flatten());
          return cat(out);
        },
        in, d, tol_for(dt, 2e-6), tol_for(dt, 2e-6), false);
  });
}

// index_select and gather along a drawn dim with drawn indices (repeats,
// which the backward's atomics add into one element; an empty index), and
// their backward (index_add, scatter_add).
TEST_F(DrawnOps, Indexing) {
  for_each_draw("indexing", 150, [&](Draw& d) {
    const DType dt = d.pick(kFloats);
    const Shape s = d.shape(static_cast<int>(d.integer(1, 3)), 1, 9);
    const int64_t dim = d.integer(0, static_cast<int64_t>(s.size()) - 1), n = s[dim];
    const bool use_gather = d.chance(0.5);
    Shape is = use_gather ? s : Shape{d.size(1, 12, true)};
    if (use_gather) is[dim] = d.size(1, 12, true);
    int64_t count = 1;
    for (int64_t v : is) count *= v;
    std::vector<double> idx(static_cast<size_t>(count));
    for (double& v : idx) v = static_cast<double>(d.integer(0, n - 1));
    const Tensor index = Tensor::from_vector(idx, is, DType::Int64);
    Tensor x = d.values(s, dt, Specials::all());
    check_case(
        detail::str_cat(use_gather ? "gather" : "index_select", " x", shape_str(s), " dim ", dim, " index ",
                        shape_str(is)),
        [&](const std::vector<Tensor>& v) {
          const Tensor i = v[0].is_cuda() ? index.cuda() : index;
          return use_gather ? gather(v[0], dim, i) : index_select(v[0], dim, i);
        },
        // Repeated indices add gradients: a sum's error.
        {{x, true}}, d, tol_for(dt, 1e-5), tol_for(dt, 1e-5));
  });
}

// GradScaler's unscale: every gradient times inv_scale, and found_inf set
// exactly when some element is NaN or infinite, over lists of drawn
// tensors in every dtype (16-bit gradients unscaled in float32).
TEST_F(DrawnOps, AmpUnscale) {
  for_each_draw("amp_unscale", 100, [&](Draw& d) {
    const DType dt = d.pick(kFloats);
    const int64_t count = d.integer(1, 4);
    Specials sp = Specials::finite();
    sp.nan = sp.inf = d.chance(0.5);
    std::vector<CaseInput> in;
    for (int64_t i = 0; i < count; ++i)
      in.push_back({d.values({d.chance(0.2) ? d.integer(1000, 70000) : d.size(1, 300, true)}, dt, sp), false, false});
    const double inv = d.pick<double>({1.0 / 65536, 0.5, 1.0});
    check_case(
        detail::str_cat("amp_unscale_ of ", count, " tensors, inv_scale ", inv, sp.nan ? " with NaN/inf" : ""),
        [&](const std::vector<Tensor>& v) {
          std::vector<Tensor> grads;
          for (const Tensor& t : v) grads.push_back(t.clone());
          const Device dev = v[0].device();
          Tensor found = zeros({1}, {DType::Float32, dev}), scale = full({1}, inv, {DType::Float32, dev});
          amp_unscale_(grads, found, scale);
          std::vector<Tensor> flat = {found.to(DType::Float64)};
          for (const Tensor& g : grads) flat.push_back(g.to(DType::Float64));
          return cat(flat);
        },
        in, d, tol_for(dt, 1e-6), tol_for(dt, 1e-6), false);
  });
}

// The copy kernels: casts between every pair of float dtypes (NaN,
// infinities, values beyond float16's range, denormals), a permuted view
// made contiguous, cat and stack along a drawn dim, and attention's
// transpose of heads ([B, H, T, D] to [B, T, H, D], cast or not), whose
// head dims (multiples of 8 among them) let the CUDA copy take its vectors
// along D; with gradients. On CUDA the 64-bit index path is drawn too.
TEST_F(DrawnOps, CopiesCastsAndJoins) {
  for_each_draw("copies", 150, [&](Draw& d) {
    const DType dt = d.pick(kFloats), to = d.pick(kFloats);
    const int kind = static_cast<int>(d.integer(0, 4));
    const bool index64 = d.chance(0.3);
    Shape s = kind == 4 ? Shape{d.size(1, 3), d.size(1, 4), d.size(1, 5), d.pick<int64_t>({2, 4, 8, 16, 24})}
                        : d.shape(static_cast<int>(d.integer(1, 4)), 1, 7, true);
    const int64_t rank = static_cast<int64_t>(s.size()), dim = d.integer(0, rank - 1);
    Specials sp = Specials::all();
    Tensor x = d.values(s, dt, sp, d.pick<double>({1.0, 3e4}));  // 3e4: some beyond float16's 65504
    Shape s2 = s;
    s2[dim] = d.size(1, 5, true);
    Tensor y = d.values(kind == 3 ? s : s2, dt, sp);
    Shape perm(rank);
    for (int64_t i = 0; i < rank; ++i) perm[i] = i;
    for (int64_t i = rank - 1; i > 0; --i) std::swap(perm[i], perm[d.integer(0, i)]);
    const char* names[] = {"cast", "permuted contiguous", "cat", "stack", "heads transposed"};
    const IntDiv32LimitScope index_path(index64 ? 0 : INT64_MAX);
    check_case(
        detail::str_cat(names[kind], " x", shape_str(s),
                        kind == 0 || kind == 4 ? detail::str_cat(" to ", dtype_name(to)) : "",
                        kind == 2 || kind == 3 ? detail::str_cat(" with ", shape_str(y.sizes()), " dim ", dim) : "",
                        index64 ? ", 64-bit index" : ""),
        [&](const std::vector<Tensor>& v) {
          switch (kind) {
            case 0:
              return v[0].to(to);
            case 1:
              return v[0].permute(perm).contiguous();
            case 2:
              return cat({v[0], v[1]}, dim);
            case 3:
              return stack({v[0], v[1]}, dim);
            default: {
              const Tensor heads = v[0].transpose(1, 2);
              return to == dt ? heads.contiguous() : heads.to(to);
            }
          }
        },
        {{x, true}, {y, kind == 2 || kind == 3}}, d,
        tol_for(kind == 0 || kind == 4 ? to : dt, 1e-7) + tol_for(dt, 1e-7),
        tol_for(kind == 0 || kind == 4 ? to : dt, 1e-7) + tol_for(dt, 1e-7));
  });
}

}  // namespace
}  // namespace ember
