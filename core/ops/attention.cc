// Fused scaled-dot-product attention (torch's F.scaled_dot_product_attention):
// softmax(q k^T * scale, causal mask) with dropout, times v, without the
// [T, T] score matrices ever living beyond one block. The CPU kernel works on
// blocks of 64 query rows: their scores against the keys they may see (a
// causal block stops at its last row), the softmax and the block's output,
// in a scratch of 64 x T; the backward recomputes each block's softmax from
// q and k (flash-attention's trade: no probabilities saved, so the op keeps
// only q, k, v and its output for backward) and forms dV, dP, dS, dQ and dK
// with GEMMs. Dropout's mask is drawn element by element from Philox at
// index (b * tq + i) * tk + j, exactly as bernoulli() fills a [n, tq, tk]
// tensor, so it is the mask dropout() would apply to the probabilities, and
// the backward redraws it instead of storing it.
#include <cblas.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

#include "core/autocast.h"
#include "core/autograd_hook.h"
#include "core/cuda_graph.h"
#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops/elementwise_fns.h"
#include "core/ops/kernels.h"
#include "core/ops/philox.h"
#include "core/ops_nn.h"
#include "core/profiler.h"

namespace ember {
namespace {

constexpr int64_t kBlock = 64;

template <typename T>
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb,
          T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if constexpr (std::is_same_v<T, float>) {
    sgemm_cpu(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    const auto TA = ta ? CblasTrans : CblasNoTrans, TB = tb ? CblasTrans : CblasNoTrans;
    cblas_dgemm(CblasRowMajor, TA, TB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

// The keys row i of a block may see: all, or j <= i.
inline int64_t keys_for(const AttentionArgs& a, int64_t i) { return a.causal ? std::min(i + 1, a.tk) : a.tk; }

// Dropout's mask as bernoulli(1 - p) fills [n, tq, tk], drawn in index
// order: one Philox call for each four keys (philox.h).
class Mask {
 public:
  explicit Mask(const AttentionArgs& a) : a_(a), draws_{a.seed, a.offset}, keep_(keep_threshold(1.0 - a.dropout_p)) {}
  bool kept(int64_t b, int64_t i, int64_t j) { return draws_.word((b * a_.tq + i) * a_.tk + j) < keep_; }

 private:
  const AttentionArgs& a_;
  BernoulliDraws draws_;
  uint64_t keep_;
};

// Scores of rows [i0, i1) of head b against keys [0, kmax) into s (ld kmax),
// turned into probabilities in place (zero where masked); returns nothing
// else: the backward calls it again.
template <typename T>
void block_probs(const AttentionArgs& a, const T* q, const T* k, int64_t i0, int64_t i1, int64_t kmax, T* s,
                 T* lse = nullptr) {
  const int64_t rows = i1 - i0;
  gemm<T>(false, true, rows, kmax, a.d, static_cast<T>(a.scale), q + i0 * a.d, a.d, k, a.d, T(0), s, kmax);
  for (int64_t r = 0; r < rows; ++r) {
    T* row = s + r * kmax;
    const int64_t lim = keys_for(a, i0 + r);
    // SIMD loops (float32's expf from libmvec, elementwise_fns.h): the
    // softmax was a third of the CPU attention's time with a scalar exp.
    T m = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < lim; ++j) m = std::max(m, row[j]);
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < lim; ++j) {
      row[j] = m_exp(row[j] - m);
      sum += row[j];
    }
    const T inv = T(1) / sum;
    if (lse) lse[r] = m + std::log(sum);
#pragma omp simd
    for (int64_t j = 0; j < lim; ++j) row[j] *= inv;
    for (int64_t j = lim; j < kmax; ++j) row[j] = T(0);
  }
}

// Applies the dropout mask and 1 / (1 - p) to rows [i0, i1) of head b.
template <typename T>
void block_dropout(const AttentionArgs& a, int64_t b, int64_t i0, int64_t i1, int64_t kmax, T* s) {
  if (a.dropout_p <= 0) return;
  const T scale = static_cast<T>(1.0 / (1.0 - a.dropout_p));
  Mask mask(a);
  for (int64_t r = 0; r < i1 - i0; ++r)
    for (int64_t j = 0; j < keys_for(a, i0 + r); ++j)
      s[r * kmax + j] = mask.kept(b, i0 + r, j) ? s[r * kmax + j] * scale : T(0);
}

template <typename T>
void forward_cpu(const AttentionArgs& a, const T* q, const T* k, const T* v, T* out, T* lse) {
  const int64_t blocks = (a.tq + kBlock - 1) / kBlock;
  parallel_for(a.n * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> s(static_cast<size_t>(kBlock * a.tk));
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / blocks, i0 = (w % blocks) * kBlock, i1 = std::min(i0 + kBlock, a.tq);
      const int64_t kmax = keys_for(a, i1 - 1);
      const T* qb = q + b * a.tq * a.d;
      const T* kb = k + b * a.tk * a.d;
      const T* vb = v + b * a.tk * a.dv;
      block_probs(a, qb, kb, i0, i1, kmax, s.data(), lse ? lse + b * a.tq + i0 : nullptr);
      block_dropout(a, b, i0, i1, kmax, s.data());
      gemm<T>(false, false, i1 - i0, a.dv, kmax, T(1), s.data(), kmax, vb, a.dv, T(0), out + (b * a.tq + i0) * a.dv,
              a.dv);
    }
  });
}

template <typename T>
void backward_cpu(const AttentionArgs& a, const T* q, const T* k, const T* v, const T* out, const T* dout, T* dq, T* dk,
                  T* dv, const T* dlse) {
  // One head per work item: dK and dV sum over the head's query blocks.
  parallel_for(a.n, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> p(static_cast<size_t>(kBlock * a.tk)), pd(p.size()), dp(p.size()), delta(kBlock);
    for (int64_t b = begin; b < end; ++b) {
      const T* qb = q + b * a.tq * a.d;
      const T* kb = k + b * a.tk * a.d;
      const T* vb = v + b * a.tk * a.dv;
      T* dkb = dk + b * a.tk * a.d;
      T* dvb = dv + b * a.tk * a.dv;
      std::fill(dkb, dkb + a.tk * a.d, T(0));
      std::fill(dvb, dvb + a.tk * a.dv, T(0));
      for (int64_t i0 = 0; i0 < a.tq; i0 += kBlock) {
        const int64_t i1 = std::min(i0 + kBlock, a.tq), rows = i1 - i0, kmax = keys_for(a, i1 - 1);
        const T* dob = dout + (b * a.tq + i0) * a.dv;
        const T* ob = out + (b * a.tq + i0) * a.dv;
        block_probs(a, qb, kb, i0, i1, kmax, p.data());
        const T* pdrop = p.data();
        if (a.dropout_p > 0) {
          std::copy(p.begin(), p.begin() + rows * kmax, pd.begin());
          block_dropout(a, b, i0, i1, kmax, pd.data());
          pdrop = pd.data();
        }
        // dV += P_drop^T dO; dP_drop = dO V^T.
        gemm<T>(true, false, kmax, a.dv, rows, T(1), pdrop, kmax, dob, a.dv, T(1), dvb, a.dv);
        gemm<T>(false, true, rows, kmax, a.dv, T(1), dob, a.dv, vb, a.dv, T(0), dp.data(), kmax);
        // delta_i = dO_i . O_i = sum_j P_ij dP_ij; dS = P (dP - delta) * scale.
        const T keep_scale = static_cast<T>(a.dropout_p > 0 ? 1.0 / (1.0 - a.dropout_p) : 1.0);
        for (int64_t r = 0; r < rows; ++r) {
          T dsum = 0;
#pragma omp simd reduction(+ : dsum)
          for (int64_t e = 0; e < a.dv; ++e) dsum += dob[r * a.dv + e] * ob[r * a.dv + e];
          if (dlse) dsum -= dlse[b * a.tq + i0 + r];  // d lse_i / d s_ij = P_ij
          T* dpr = dp.data() + r * kmax;
          const T* pr = p.data() + r * kmax;
          const int64_t lim = keys_for(a, i0 + r);
          Mask mask(a);
          for (int64_t j = 0; j < lim; ++j) {
            T g = dpr[j];
            if (a.dropout_p > 0) g = mask.kept(b, i0 + r, j) ? g * keep_scale : T(0);
            dpr[j] = pr[j] * (g - dsum) * static_cast<T>(a.scale);
          }
          for (int64_t j = lim; j < kmax; ++j) dpr[j] = T(0);
        }
        // dQ = dS K; dK += dS^T Q.
        gemm<T>(false, false, rows, a.d, kmax, T(1), dp.data(), kmax, kb, a.d, T(0), dq + (b * a.tq + i0) * a.d, a.d);
        gemm<T>(true, false, kmax, a.d, rows, T(1), dp.data(), kmax, qb + i0 * a.d, a.d, T(1), dkb, a.d);
      }
    }
  });
}

}  // namespace

void attention_forward_cpu(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                           Tensor* lse) {
  if (q.dtype() == DType::Float64)
    forward_cpu(a, q.data<double>(), k.data<double>(), v.data<double>(), out.data<double>(),
                lse ? lse->data<double>() : nullptr);
  else
    forward_cpu(a, q.data<float>(), k.data<float>(), v.data<float>(), out.data<float>(),
                lse ? lse->data<float>() : nullptr);
}

void attention_backward_cpu(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& out, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                            const Tensor* dlse) {
  if (q.dtype() == DType::Float64)
    backward_cpu(a, q.data<double>(), k.data<double>(), v.data<double>(), out.data<double>(), dout.data<double>(),
                 dq.data<double>(), dk.data<double>(), dv.data<double>(), dlse ? dlse->data<double>() : nullptr);
  else
    backward_cpu(a, q.data<float>(), k.data<float>(), v.data<float>(), out.data<float>(), dout.data<float>(),
                 dq.data<float>(), dk.data<float>(), dv.data<float>(), dlse ? dlse->data<float>() : nullptr);
}

namespace {

// [..., t, d] -> contiguous [n, t, d] in the compute dtype (float32 for
// 16-bit inputs; the kernels accumulate in it).
Tensor as_rows(const Tensor& x, DType compute) {
  Tensor c = x.dtype() == compute ? x : x.to(compute);
  return c.contiguous().reshape({-1, x.size(-2), x.size(-1)});
}

// The blocked kernels, CUDA's or the CPU's by q's device, on [n, t, d] rows
// in the compute dtype: every path the fused kernels do not take.
void blocked_forward(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                     Tensor* lse = nullptr) {
  if (q.is_cuda())
    attention_forward_cuda(a, q, k, v, out, lse);
  else
    attention_forward_cpu(a, q, k, v, out, lse);
}
void blocked_backward(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                      const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const Tensor* dlse = nullptr) {
  if (q.is_cuda())
    attention_backward_cuda(a, q, k, v, out, dout, dq, dk, dv, dlse);
  else
    attention_backward_cpu(a, q, k, v, out, dout, dq, dk, dv, dlse);
}

}  // namespace

namespace {

// The op's checks (named by `op`) and its kernel arguments; advances the
// generator when dropout is on.
AttentionArgs attention_args(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, bool is_causal,
                             double dropout_p, Generator* gen, std::optional<double> scale) {
  EMBER_CHECK(q.defined() && k.defined() && v.defined(), op, ": q, k and v must be defined");
  EMBER_CHECK(q.dim() >= 2 && q.dim() == k.dim() && q.dim() == v.dim(), op, ": q ", shape_str(q.sizes()), ", k ",
              shape_str(k.sizes()), " and v ", shape_str(v.sizes()), " must have the same number (>= 2) of dims");
  EMBER_CHECK(is_floating(q.dtype()) && q.dtype() == k.dtype() && q.dtype() == v.dtype(), op,
              ": q, k and v must share one floating dtype, got ", q.dtype(), ", ", k.dtype(), ", ", v.dtype());
  EMBER_CHECK(q.device() == k.device() && q.device() == v.device(), op, ": q, k and v must be on one device, got ",
              q.device(), ", ", k.device(), ", ", v.device());
  const int64_t nd = q.dim();
  for (int64_t i = 0; i < nd - 2; ++i)
    EMBER_CHECK(q.size(i) == k.size(i) && q.size(i) == v.size(i), op, ": batch dims differ: q ", shape_str(q.sizes()),
                ", k ", shape_str(k.sizes()), ", v ", shape_str(v.sizes()));
  EMBER_CHECK(q.size(-1) == k.size(-1), op, ": q ", shape_str(q.sizes()), " and k ", shape_str(k.sizes()),
              " must have the same last dim (the head size)");
  EMBER_CHECK(k.size(-2) == v.size(-2), op, ": k ", shape_str(k.sizes()), " and v ", shape_str(v.sizes()),
              " must have the same number of keys");
  EMBER_CHECK(dropout_p >= 0 && dropout_p < 1, op, ": dropout_p must be in [0, 1), got ", dropout_p);
  AttentionArgs a;
  a.tq = q.size(-2);
  a.tk = k.size(-2);
  a.d = q.size(-1);
  a.dv = v.size(-1);
  a.n = shape_numel(Shape(q.sizes().begin(), q.sizes().end() - 2));
  a.scale = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(a.d, 1)));
  a.causal = is_causal;
  a.dropout_p = dropout_p;
  // The generator is advanced here, outside the forward below, so that a
  // selective checkpoint's recompute, which takes the kept output instead
  // of running that forward, advances it the same.
  if (dropout_p > 0) {
    Generator& g = gen ? *gen : default_generator();
    a.seed = g.seed();
    // Inside a CUDA graph the kernels read the generator's state on the
    // device, which each replay writes (cuda_graph.h).
    if (const auto captured = q.is_cuda() ? cuda_graph_rng(g, q.device().index) : std::nullopt) {
      a.offset = captured->offset;
      a.rng = captured->state;
    } else {
      a.offset = g.next_offset();
    }
  }
  return a;
}

// An empty tensor of `sizes` whose dims lie in memory in the order of
// like's strides, the last innermost (stable: equal strides, as size-1 and
// expanded dims have, keep their order). The fused kernels write the output
// and the gradients where they lie, so, as PyTorch's flash SDPA allocates
// its output as q's [B, T, H, D] and hands it back transposed, a module's
// transpose back to [B, T, H * D] is a view, and the gradients reach the
// projections in their layout: no copy either way.
Tensor empty_ordered_as(const Tensor& like, const Shape& sizes, TensorOptions options) {
  const int64_t nd = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> order(static_cast<size_t>(nd - 1));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return like.stride(a) > like.stride(b); });
  order.push_back(nd - 1);
  Shape lying(static_cast<size_t>(nd));
  std::vector<int64_t> back(static_cast<size_t>(nd));
  for (int64_t i = 0; i < nd; ++i) {
    lying[i] = sizes[order[i]];
    back[order[i]] = i;
  }
  return Tensor::empty(lying, options).permute(back);
}

// The fused forward's log-sum-exps for the backward: those it kept, or, when
// a recompute took the op's output without running it, from the kernel again.
Tensor flash_lse(const AttentionArgs& a, const Tensor& kept, const Tensor& q, const Tensor& k, const Tensor& v) {
  if (kept.defined()) return kept;
  Tensor o = Tensor::empty({a.n, a.tq, a.dv}, q.options());
  Tensor l = Tensor::empty({a.n, a.tq}, {DType::Float32, q.device()});
  attention_flash_forward_cuda(a, q, k, v, o, l);
  return l;
}

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, bool is_causal,
                                    double dropout_p, Generator* gen, std::optional<double> scale) {
  const Tensor q = autocast::low(q_in), k = autocast::low(k_in), v = autocast::low(v_in);
  const char* op = "scaled_dot_product_attention";
  const AttentionArgs a = attention_args(op, q, k, v, is_causal, dropout_p, gen, scale);
  Shape out_shape = q.sizes();
  out_shape.back() = a.dv;
  const DType compute = q.dtype() == DType::Float64 ? DType::Float64 : DType::Float32;
  // 16-bit and float32 q, k, v on a GPU take the fused kernels, which read
  // them as they are and keep each row's log-sum-exp for the backward (a
  // recompute that skipped this forward finds none and runs the kernel
  // again for it).
  const bool flash = q.is_cuda() && attention_flash_cuda_supports(a, q.dtype());
  auto lse = std::make_shared<Tensor>();
  auto run_forward = [a, compute, out_shape, flash, lse](const Tensor& q, const Tensor& k, const Tensor& v) {
    if (flash) {
      Tensor out = empty_ordered_as(q, out_shape, q.options());
      *lse = Tensor::empty({a.n, a.tq}, {DType::Float32, q.device()});
      attention_flash_forward_cuda(a, q, k, v, out, *lse);
      return out;
    }
    Tensor out = Tensor::empty({a.n, a.tq, a.dv}, {compute, q.device()});
    if (out.numel() > 0) {
      const Tensor qr = as_rows(q, compute), kr = as_rows(k, compute), vr = as_rows(v, compute);
      if (a.tk == 0)
        out.zero_();
      else
        blocked_forward(a, qr, kr, vr, out);
    }
    return out.view(out_shape).to(q.dtype());
  };
  return differentiable(
      op, {q, k, v}, [&] { return run_forward(q, k, v); },
      [&](const Tensor& out) {
        const Tensor sq = q, sk = k, sv = v, so = out;
        BackwardFn fn = [a, compute, sq, sk, sv, so, flash, lse](const Tensor& g) {
          if (flash) {
            // The kernels read the tensors where they lie and write the
            // gradients in q's dtype (dk and dv from their registers), each
            // laid out as its input.
            Tensor dq = empty_ordered_as(sq, sq.sizes(), sq.options());
            Tensor dk = empty_ordered_as(sk, sk.sizes(), sk.options());
            Tensor dv = empty_ordered_as(sv, sv.sizes(), sv.options());
            attention_flash_backward_cuda(a, sq, sk, sv, so, g.to(sq.dtype()), flash_lse(a, *lse, sq, sk, sv), dq, dk,
                                          dv);
            return std::vector<Tensor>{dq, dk, dv};
          }
          Tensor dq = Tensor::empty({a.n, a.tq, a.d}, {compute, g.device()});
          Tensor dk = Tensor::empty({a.n, a.tk, a.d}, {compute, g.device()});
          Tensor dv = Tensor::empty({a.n, a.tk, a.dv}, {compute, g.device()});
          if (a.n > 0 && a.tq > 0 && a.tk > 0) {
            const Tensor qr = as_rows(sq, compute), kr = as_rows(sk, compute), vr = as_rows(sv, compute);
            const Tensor orr = as_rows(so, compute), gr = as_rows(g, compute);
            blocked_backward(a, qr, kr, vr, orr, gr, dq, dk, dv);
          } else {
            dq.zero_(), dk.zero_(), dv.zero_();
          }
          return std::vector<Tensor>{dq.view(sq.sizes()).to(sq.dtype()), dk.view(sk.sizes()).to(sk.dtype()),
                                     dv.view(sv.sizes()).to(sv.dtype())};
        };
        return Recorded{std::move(fn), {sq, sk, sv, so}};
      });
}

Tensor qkv_heads(const Tensor& qkv, int64_t which, int64_t heads) {
  const int64_t B = qkv.size(0), T = qkv.size(1), E = qkv.size(2) / 3;
  return qkv.narrow(2, which * E, E).view({B, T, heads, E / heads}).permute({0, 2, 1, 3});
}

Tensor scaled_dot_product_attention_qkvpacked(const Tensor& qkv_in, int64_t heads, bool is_causal, double dropout_p,
                                              Generator* gen, std::optional<double> scale) {
  const Tensor qkv = autocast::low(qkv_in);
  const char* op = "scaled_dot_product_attention_qkvpacked";
  EMBER_CHECK(qkv.defined() && qkv.dim() == 3 && heads > 0 && qkv.size(2) % (3 * heads) == 0, op,
              ": qkv must be [B, T, 3 E] with E a multiple of heads (", heads, "), got ",
              qkv.defined() ? shape_str(qkv.sizes()) : std::string("an undefined tensor"));
  const int64_t B = qkv.size(0), T = qkv.size(1), E = qkv.size(2) / 3, H = heads, D = E / H;
  const auto part = [H](const Tensor& x, int64_t i) { return qkv_heads(x, i, H); };
  const Tensor src = qkv.detach();
  const AttentionArgs a =
      attention_args(op, part(src, 0), part(src, 1), part(src, 2), is_causal, dropout_p, gen, scale);
  const DType compute = qkv.dtype() == DType::Float64 ? DType::Float64 : DType::Float32;
  const bool flash = qkv.is_cuda() && attention_flash_cuda_supports(a, qkv.dtype());
  const bool empty = B * T * E == 0;
  auto lse = std::make_shared<Tensor>();
  // The other kernels' [n, T, D] copies of q, k and v and their output, in
  // qkv's dtype (converted to the compute dtype where they are used), kept
  // for the backward instead of qkv.
  auto rows = std::make_shared<std::array<Tensor, 4>>();
  const auto run_forward = [&] {
    Tensor out = Tensor::empty({B, T, H, D}, qkv.options());
    if (empty) return out;
    if (flash) {
      // Read where they lie; the output written in [B, T, H, D].
      Tensor heads_view = out.permute({0, 2, 1, 3});
      *lse = Tensor::empty({a.n, a.tq}, {DType::Float32, qkv.device()});
      attention_flash_forward_cuda(a, part(src, 0), part(src, 1), part(src, 2), heads_view, *lse);
      return out;
    }
    auto& r = *rows;
    for (int64_t i = 0; i < 3; ++i) r[i] = as_rows(part(src, i), qkv.dtype());
    const Tensor qr = as_rows(r[0], compute), kr = as_rows(r[1], compute), vr = as_rows(r[2], compute);
    Tensor o = Tensor::empty({a.n, T, D}, {compute, qkv.device()});
    blocked_forward(a, qr, kr, vr, o);
    r[3] = o.to(qkv.dtype());
    out.copy_(r[3].view({B, H, T, D}).permute({0, 2, 1, 3}));
    return out;
  };
  return differentiable(op, {qkv}, run_forward, [&](const Tensor& out) {
    const Tensor so = out, kept_qkv = flash ? src : Tensor();
    const TensorOptions options = qkv.options();
    BackwardFn fn = [a, compute, flash, empty, kept_qkv, options, so, lse, rows, part, B, T, E](const Tensor& g) {
      // One gradient for qkv, each block's heads written into its columns.
      Tensor dqkv = Tensor::empty({B, T, 3 * E}, options);
      if (empty) return std::vector<Tensor>{dqkv};
      Tensor dq = part(dqkv, 0), dk = part(dqkv, 1), dv = part(dqkv, 2);
      if (flash) {
        const Tensor q = part(kept_qkv, 0), k = part(kept_qkv, 1), v = part(kept_qkv, 2);
        attention_flash_backward_cuda(a, q, k, v, so.permute({0, 2, 1, 3}), g.to(options.dtype).permute({0, 2, 1, 3}),
                                      flash_lse(a, *lse, q, k, v), dq, dk, dv);
        return std::vector<Tensor>{dqkv};
      }
      const auto& r = *rows;
      EMBER_INTERNAL_ASSERT(r[0].defined(), "scaled_dot_product_attention_qkvpacked: no kept q, k, v");
      std::array<Tensor, 4> c;
      for (int64_t i = 0; i < 4; ++i) c[i] = as_rows(r[i], compute);
      std::array<Tensor, 3> d;
      for (int64_t i = 0; i < 3; ++i) d[i] = Tensor::empty(c[i].sizes(), c[i].options());
      const Tensor gr = as_rows(g.permute({0, 2, 1, 3}), compute);
      blocked_backward(a, c[0], c[1], c[2], c[3], gr, d[0], d[1], d[2]);
      dq.copy_(d[0].view(dq.sizes())), dk.copy_(d[1].view(dk.sizes())), dv.copy_(d[2].view(dv.sizes()));
      return std::vector<Tensor>{dqkv};
    };
    std::vector<Tensor> saved{so};
    if (flash)
      saved.push_back(kept_qkv);
    else if (!empty)
      saved.insert(saved.end(), rows->begin(), rows->end());
    return Recorded{std::move(fn), std::move(saved)};
  });
}

namespace {

// dq, dk, dv (compute dtype, [n, t, d] rows) of one lse-attention call from
// its output o and dout (and dlse), whichever kernel served the forward:
// the fused one recomputes the probabilities from `lse`, the others from q
// and k.
void lse_backward(const AttentionArgs& a, DType compute, bool flash, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& o, const Tensor& go, const Tensor& lse, const Tensor* dlse, Tensor& dq, Tensor& dk,
                  Tensor& dv) {
  if (a.n * a.tq == 0) {
    dq.zero_(), dk.zero_(), dv.zero_();
  } else if (flash) {
    // o and go come in the compute dtype: the kernels read q's.
    attention_flash_backward_cuda(a, q, k, v, o.to(q.dtype()), go.to(q.dtype()), lse.contiguous(), dq, dk, dv, dlse);
  } else {
    const Tensor qr = as_rows(q, compute), kr = as_rows(k, compute), vr = as_rows(v, compute);
    const Tensor orr = as_rows(o, compute), gr = as_rows(go, compute);
    blocked_backward(a, qr, kr, vr, orr, gr, dq, dk, dv, dlse);
  }
}

}  // namespace

Tensor scaled_dot_product_attention_lse(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, bool is_causal,
                                        std::optional<double> scale) {
  const Tensor q = autocast::low(q_in), k = autocast::low(k_in), v = autocast::low(v_in);
  const char* op = "scaled_dot_product_attention_lse";
  const AttentionArgs a = attention_args(op, q, k, v, is_causal, 0.0, nullptr, scale);
  EMBER_CHECK(a.tk > 0, op, ": k ", shape_str(k.sizes()), " has no keys, so no log-sum-exp is defined");
  Shape packed_shape = q.sizes();
  packed_shape.back() = a.dv + 1;
  const DType compute = q.dtype() == DType::Float64 ? DType::Float64 : DType::Float32;
  const bool flash = q.is_cuda() && attention_flash_cuda_supports(a, q.dtype());
  // The fused kernels' output is in q's dtype; the blocked kernels' and the CPU's
  // the compute dtype. The fused kernels read q, k and v where they lie
  // (context parallelism's views: a block's rows of q, k and v as the two
  // halves of one concatenated kv); the others take [n, t, d] copies.
  auto run = [a, compute, flash](const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse) {
    const DType in = flash ? q.dtype() : compute;
    out = Tensor::empty({a.n, a.tq, a.dv}, {in, q.device()});
    lse = Tensor::empty({a.n, a.tq}, {compute, q.device()});
    if (a.n * a.tq == 0) return;
    if (flash) {
      attention_flash_forward_cuda(a, q, k, v, out, lse);
      return;
    }
    const Tensor qr = as_rows(q, in), kr = as_rows(k, in), vr = as_rows(v, in);
    blocked_forward(a, qr, kr, vr, out, &lse);
  };
  return differentiable(
      op, {q, k, v},
      [&] {
        Tensor out, lse;
        run(q, k, v, out, lse);
        return cat({out.to(compute), lse.unsqueeze(-1)}, -1).view(packed_shape);
      },
      [&](const Tensor& packed) {
        const Tensor sq = q, sk = k, sv = v, sp = packed;
        BackwardFn fn = [a, compute, flash, sq, sk, sv, sp, run](const Tensor& g) {
          Tensor dq = Tensor::empty({a.n, a.tq, a.d}, {compute, g.device()});
          Tensor dk = Tensor::empty({a.n, a.tk, a.d}, {compute, g.device()});
          Tensor dv = Tensor::empty({a.n, a.tk, a.dv}, {compute, g.device()});
          if (a.n * a.tq == 0) {
            dq.zero_(), dk.zero_(), dv.zero_();
          } else {
            const Tensor pr = sp.reshape({a.n, a.tq, a.dv + 1}), gr = g.to(compute).reshape({a.n, a.tq, a.dv + 1});
            const Tensor dlse = gr.select(-1, a.dv).contiguous();
            lse_backward(a, compute, flash, sq, sk, sv, pr.narrow(-1, 0, a.dv), gr.narrow(-1, 0, a.dv),
                         pr.select(-1, a.dv), &dlse, dq, dk, dv);
          }
          return std::vector<Tensor>{dq.view(sq.sizes()).to(sq.dtype()), dk.view(sk.sizes()).to(sk.dtype()),
                                     dv.view(sv.sizes()).to(sv.dtype())};
        };
        return Recorded{std::move(fn), {sq, sk, sv, sp}};
      });
}

std::array<Tensor, 3> scaled_dot_product_attention_block_grads(const Tensor& q_in, const Tensor& k_in,
                                                               const Tensor& v_in, const Tensor& out,
                                                               const Tensor& dout, const Tensor& lse,
                                                               const Tensor& block_lse, bool is_causal,
                                                               std::optional<double> scale) {
  const Tensor q = autocast::low(q_in), k = autocast::low(k_in), v = autocast::low(v_in);
  const char* op = "scaled_dot_product_attention_block_grads";
  profiler::Scope prof(profiler::Kind::Op, op);  // not recorded by autograd: its own event
  const AttentionArgs a = attention_args(op, q, k, v, is_causal, 0.0, nullptr, scale);
  Shape rows = q.sizes();
  rows.pop_back();
  Shape out_shape = q.sizes();
  out_shape.back() = a.dv;
  EMBER_CHECK(out.sizes() == out_shape && dout.sizes() == out_shape && lse.sizes() == rows && block_lse.sizes() == rows,
              op, ": for q ", shape_str(q.sizes()), " and v ", shape_str(v.sizes()), " out and dout must be ",
              shape_str(out_shape), " and lse, block_lse ", shape_str(rows), "; got out ", shape_str(out.sizes()),
              ", dout ", shape_str(dout.sizes()), ", lse ", shape_str(lse.sizes()), ", block_lse ",
              shape_str(block_lse.sizes()));
  const DType compute = q.dtype() == DType::Float64 ? DType::Float64 : DType::Float32;
  const bool flash = q.is_cuda() && attention_flash_cuda_supports(a, q.dtype());
  NoGradGuard no_grad;
  // The block's probabilities are its own softmax times w; the kernels
  // recompute the former, and take dO w as the output's gradient. Their
  // delta, rowsum(dout * out), with the merged output is w rowsum(dO O):
  // exactly the merged attention's (the block's own output cancels).
  const Tensor w = exp(block_lse.to(compute) - lse.to(compute)).unsqueeze(-1);
  const Tensor go = (dout.to(compute) * w).reshape({a.n, a.tq, a.dv});
  Tensor dq = Tensor::empty({a.n, a.tq, a.d}, {compute, q.device()});
  Tensor dk = Tensor::empty({a.n, a.tk, a.d}, {compute, q.device()});
  Tensor dv = Tensor::empty({a.n, a.tk, a.dv}, {compute, q.device()});
  lse_backward(a, compute, flash, q, k, v, out.reshape({a.n, a.tq, a.dv}), go,
               block_lse.to(compute).reshape({a.n, a.tq}), nullptr, dq, dk, dv);
  return {dq.view(q.sizes()), dk.view(k.sizes()), dv.view(v.sizes())};
}

}  // namespace ember
