// matmul / mm / bmm / linear. CPU GEMM goes to oneDNN's sgemm for float32
// (sgemm_cpu: faster than OpenBLAS here, kernels.h says by how much) and to
// OpenBLAS for float64;
// bfloat16/float16 go to oneDNN's matmul where the CPU has a native kernel
// for them (AVX512-BF16 / AMX for bfloat16: float32 accumulation, one
// rounding of the result, as torch's CPU bf16 GEMM), and are widened to
// float32 around OpenBLAS otherwise; integers use a plain loop. CUDA GEMM
// goes to cuBLAS (matmul.cu). The op layer maps transposed views onto BLAS's
// transpose flags (oneDNN's strides), so x @ w.t() never copies w.
#include <cblas.h>
#include <dnnl.h>

#include <compare>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "core/autocast.h"
#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops/onednn.h"

namespace ember {

// ---- CPU kernel ----
void sgemm_cpu(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // oneDNN wants k >= 1: C = beta C
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.f ? 0.f : beta * c[i * ldc + j];
    return;
  }
  onednn::cap_isa();
  const dnnl_status_t st =
      dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  EMBER_INTERNAL_ASSERT(st == dnnl_success, "dnnl_sgemm failed (status ", static_cast<int>(st), ") for m ", m, " n ", n,
                        " k ", k, " lda ", lda, " ldb ", ldb, " ldc ", ldc);
}

void gemm_cpu(const GemmArgs& g) {
  auto ta = g.trans_a ? CblasTrans : CblasNoTrans, tb = g.trans_b ? CblasTrans : CblasNoTrans;
  if (g.dtype == DType::Float32) {
    for (int64_t i = 0; i < g.batch; ++i)
      sgemm_cpu(g.trans_a, g.trans_b, g.m, g.n, g.k, static_cast<float>(g.alpha),
                static_cast<const float*>(g.a) + i * g.stride_a, g.lda, static_cast<const float*>(g.b) + i * g.stride_b,
                g.ldb, static_cast<float>(g.beta), static_cast<float*>(g.c) + i * g.stride_c, g.ldc);
    return;
  }
  if (g.dtype == DType::Float64) {
    for (int64_t i = 0; i < g.batch; ++i)
      cblas_dgemm(CblasRowMajor, ta, tb, g.m, g.n, g.k, g.alpha, static_cast<const double*>(g.a) + i * g.stride_a,
                  g.lda, static_cast<const double*>(g.b) + i * g.stride_b, g.ldb, g.beta,
                  static_cast<double*>(g.c) + i * g.stride_c, g.ldc);
    return;
  }
  EMBER_INTERNAL_ASSERT(g.alpha == 1.0 && g.beta == 0.0);  // the scaled forms are float32/float64 only
  EMBER_DISPATCH_NUMERIC(g.dtype, "matmul", [&] {
    using T = scalar_t;
    if constexpr (std::is_integral_v<T>) {
      parallel_for(g.batch * g.m, 64, [&](int64_t b, int64_t e) {
        for (int64_t bm = b; bm < e; ++bm) {
          int64_t bi = bm / g.m, i = bm % g.m;
          const T* A = static_cast<const T*>(g.a) + bi * g.stride_a;
          const T* B = static_cast<const T*>(g.b) + bi * g.stride_b;
          T* C = static_cast<T*>(g.c) + bi * g.stride_c;
          for (int64_t j = 0; j < g.n; ++j) {
            int64_t acc = 0;
            for (int64_t p = 0; p < g.k; ++p) {
              T av = g.trans_a ? A[p * g.lda + i] : A[i * g.lda + p];
              T bv = g.trans_b ? B[j * g.ldb + p] : B[p * g.ldb + j];
              acc += static_cast<int64_t>(av) * static_cast<int64_t>(bv);
            }
            C[i * g.ldc + j] = static_cast<T>(acc);
          }
        }
      });
    } else {
      EMBER_INTERNAL_ASSERT(false, "gemm_cpu: 16-bit floats go to gemm_cpu_native_16bit or are widened");
    }
  });
}

// 16-bit GEMM on oneDNN. A plan per shape and layout, built once (a JIT
// compile) and cached, null where oneDNN has only its reference kernel.
namespace {
using dnnl::memory;

struct MatmulKey {
  DType dtype;
  int64_t batch, m, n, k;
  bool trans_a, trans_b, broadcast_a, broadcast_b;
  int64_t lda, stride_a, ldb, stride_b, ldc, stride_c;
  auto operator<=>(const MatmulKey&) const = default;
};

struct MatmulPlan {
  std::string impl;
  dnnl::matmul prim;
  memory::desc a, b, c, scratchpad;
};

// [rows, cols] stored with leading dimension ld, transposed when `trans`
// (element (i, j) at j * ld + i), batch `batch` apart; a broadcast operand
// is one matrix (batch dim 1) for every output batch.
memory::desc strided(DType t, bool broadcast, int64_t batch, int64_t rows, int64_t cols, bool trans, int64_t ld,
                     int64_t stride) {
  const int64_t nb = broadcast ? 1 : batch;
  const int64_t bs = nb == 1 ? ld * (trans ? cols : rows) : stride;
  return memory::desc({nb, rows, cols}, onednn::data_type(t), trans ? memory::dims{bs, 1, ld} : memory::dims{bs, ld, 1});
}

const MatmulPlan* matmul_plan(const MatmulKey& key) {
  static std::mutex mu;
  static std::map<MatmulKey, std::unique_ptr<MatmulPlan>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second.get();
  std::unique_ptr<MatmulPlan> plan = std::make_unique<MatmulPlan>();
  try {
    plan->a = strided(key.dtype, key.broadcast_a, key.batch, key.m, key.k, key.trans_a, key.lda, key.stride_a);
    plan->b = strided(key.dtype, key.broadcast_b, key.batch, key.k, key.n, key.trans_b, key.ldb, key.stride_b);
    plan->c = strided(key.dtype, false, key.batch, key.m, key.n, false, key.ldc, key.stride_c);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);  // per-call scratch: plans run concurrently
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(plan->a, plan->b, plan->c), attr, onednn::cpu_engine());
    plan->impl = pd.impl_info_str();
    plan->scratchpad = pd.scratchpad_desc();
    plan->prim = dnnl::matmul(pd);
    if (onednn::is_reference_impl(plan->impl.c_str())) plan.reset();
  } catch (const dnnl::error&) {
    plan.reset();
  }
  return cache.emplace(key, std::move(plan)).first->second.get();
}

}  // namespace

bool gemm_cpu_native_16bit(const GemmArgs& g) {
  EMBER_INTERNAL_ASSERT(g.alpha == 1.0 && g.beta == 0.0);  // the scaled forms are float32/float64 only
  const bool bc_a = g.batch > 1 && g.stride_a == 0, bc_b = g.batch > 1 && g.stride_b == 0;
  const MatmulPlan* p = matmul_plan({g.dtype, g.batch, g.m, g.n, g.k, g.trans_a, g.trans_b, bc_a, bc_b, g.lda,
                                     g.stride_a, g.ldb, g.stride_b, g.ldc, g.stride_c});
  if (p == nullptr) return false;
  auto& engine = onednn::cpu_engine();
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, memory(p->a, engine, const_cast<void*>(g.a))},
                                       {DNNL_ARG_WEIGHTS, memory(p->b, engine, const_cast<void*>(g.b))},
                                       {DNNL_ARG_DST, memory(p->c, engine, g.c)}};
  std::vector<Tensor> temps;
  if (p->scratchpad.get_size() > 0) args.emplace(DNNL_ARG_SCRATCHPAD, onednn::scratch_memory(p->scratchpad, temps));
  p->prim.execute(onednn::cpu_stream(), args);
  onednn::cpu_stream().wait();
  return true;
}

// ---- Op layer ----
namespace {

struct MatrixOperand {
  Tensor keep;  // owns the memory the pointer refers to
  const void* ptr;
  int64_t ld, batch_stride;
  bool trans;
};

// t is [B, rows, cols]; find a BLAS description without copying if possible.
MatrixOperand describe(const Tensor& t) {
  int64_t rows = t.sizes()[1], cols = t.sizes()[2];
  int64_t sb = t.sizes()[0] == 1 ? 0 : t.strides()[0], s0 = t.strides()[1], s1 = t.strides()[2];
  if ((cols == 1 || s1 == 1) && (rows == 1 || s0 >= cols) && s0 >= 1)
    return {t, t.raw_data(), rows == 1 ? std::max<int64_t>(cols, 1) : s0, sb, false};
  if ((rows == 1 || s0 == 1) && (cols == 1 || s1 >= rows) && s1 >= 1)
    return {t, t.raw_data(), cols == 1 ? std::max<int64_t>(rows, 1) : s1, sb, true};
  Tensor c = t.contiguous();
  return {c, c.raw_data(), std::max<int64_t>(cols, 1), t.sizes()[0] == 1 ? 0 : rows * cols, false};
}

// a [B, m, k] @ b [B, k, n] -> [B, m, n], B may be 1 on either side.
Tensor batched_gemm_impl(const Tensor& a, const Tensor& b) {
  const int64_t B = std::max(a.sizes()[0], b.sizes()[0]);
  const int64_t m = a.sizes()[1], k = a.sizes()[2], n = b.sizes()[2];
  Tensor out = Tensor::empty({B, m, n}, a.options());
  if (out.numel() == 0) return out;
  if (k == 0) return out.zero_();
  MatrixOperand A = describe(a), Bm = describe(b);
  GemmArgs g{a.dtype(), B, m, n, k, A.trans, Bm.trans, A.ptr, A.ld, A.batch_stride, Bm.ptr, Bm.ld,
             Bm.batch_stride, out.raw_data(), n, m * n};
  if (a.is_cuda()) {
    gemm_cuda(g, a.device().index);
  } else if (a.dtype() == DType::Float16 || a.dtype() == DType::BFloat16) {
    if (!gemm_cpu_native_16bit(g)) return batched_gemm_impl(a.to(DType::Float32), b.to(DType::Float32)).to(a.dtype());
  } else {
    gemm_cpu(g);
  }
  return out;
}

// The one differentiable GEMM every matmul variant reduces to: its views
// (unsqueeze, expand, reshape) record their own derivatives around it.
Tensor batched_gemm(const Tensor& a, const Tensor& b) {
  return differentiable("matmul", {a, b}, [&] { return batched_gemm_impl(a, b); }, [&](const Tensor&) {
    Tensor sa = a, sb = b;
    const bool ga_ = a.requires_grad(), gb_ = b.requires_grad();
    BackwardFn fn = [=](const Tensor& g) {
      Tensor da, db;
      const bool ga = ga_ && grad_wanted(0), gb = gb_ && grad_wanted(1);
      if (ga) {  // g [B,m,n] @ b^T [B,n,k]; sum a broadcast batch
        da = batched_gemm(g, sb.transpose(1, 2));
        if (sa.sizes()[0] == 1 && da.sizes()[0] != 1) da = sum(da, {0}, true);
      }
      if (gb) {
        db = batched_gemm(sa.transpose(1, 2), g);
        if (sb.sizes()[0] == 1 && db.sizes()[0] != 1) db = sum(db, {0}, true);
      }
      return std::vector<Tensor>{da, db};
    };
    return Recorded{fn, {sa, sb}};
  });
}

void check_pair(const Tensor& a, const Tensor& b, const char* op) {
  EMBER_CHECK(a.defined() && b.defined(), op, ": an input is undefined");
  EMBER_CHECK(a.device() == b.device(), op, ": ", shape_str(a.sizes()), " on ", a.device(), " x ",
              shape_str(b.sizes()), " on ", b.device(), ": tensors must be on the same device");
  EMBER_CHECK(a.dtype() == b.dtype(), op, ": ", shape_str(a.sizes()), " ", a.dtype(), " x ", shape_str(b.sizes()),
              " ", b.dtype(), ": dtypes differ");
  EMBER_CHECK(a.dtype() != DType::Bool, op, ": not supported for bool tensors");
}

void check_inner(const Tensor& a, const Tensor& b, int64_t ka, int64_t kb, const char* op) {
  EMBER_CHECK(ka == kb, op, ": ", shape_str(a.sizes()), " x ", shape_str(b.sizes()), ": inner dimensions ", ka,
              " and ", kb, " differ");
}

}  // namespace

// Under autocast, each op casts its inputs (autocast.h) and calls itself again.
Tensor mm(const Tensor& a, const Tensor& b) {
  if (Tensor la = autocast::low(a), lb = autocast::low(b); !la.is_same(a) || !lb.is_same(b)) return mm(la, lb);
  check_pair(a, b, "mm");
  EMBER_CHECK(a.dim() == 2 && b.dim() == 2, "mm: expected 2-d tensors, got ", shape_str(a.sizes()), " x ",
              shape_str(b.sizes()));
  check_inner(a, b, a.sizes()[1], b.sizes()[0], "mm");
  return batched_gemm(a.unsqueeze(0), b.unsqueeze(0)).squeeze(0);
}

Tensor bmm(const Tensor& a, const Tensor& b) {
  if (Tensor la = autocast::low(a), lb = autocast::low(b); !la.is_same(a) || !lb.is_same(b)) return bmm(la, lb);
  check_pair(a, b, "bmm");
  EMBER_CHECK(a.dim() == 3 && b.dim() == 3, "bmm: expected 3-d tensors, got ", shape_str(a.sizes()), " x ",
              shape_str(b.sizes()));
  EMBER_CHECK(a.sizes()[0] == b.sizes()[0], "bmm: ", shape_str(a.sizes()), " x ", shape_str(b.sizes()),
              ": batch sizes ", a.sizes()[0], " and ", b.sizes()[0], " differ");
  check_inner(a, b, a.sizes()[2], b.sizes()[1], "bmm");
  return batched_gemm(a, b);
}

Tensor matmul(const Tensor& a, const Tensor& b) {
  if (Tensor la = autocast::low(a), lb = autocast::low(b); !la.is_same(a) || !lb.is_same(b)) return matmul(la, lb);
  check_pair(a, b, "matmul");
  EMBER_CHECK(a.dim() >= 1 && b.dim() >= 1, "matmul: both arguments need at least 1 dim, got ",
              shape_str(a.sizes()), " x ", shape_str(b.sizes()));
  if (a.dim() == 1 && b.dim() == 1) {
    check_inner(a, b, a.sizes()[0], b.sizes()[0], "matmul");
    return mm(a.unsqueeze(0), b.unsqueeze(1)).reshape({});
  }
  if (a.dim() == 1) return matmul(a.unsqueeze(0), b).squeeze(-2);
  if (b.dim() == 1) return matmul(a, b.unsqueeze(1)).squeeze(-1);
  const int64_t m = a.size(-2), k = a.size(-1), kb = b.size(-2), n = b.size(-1);
  check_inner(a, b, k, kb, "matmul");
  if (b.dim() == 2) {  // fold a's batch dims into m: one big GEMM
    Shape out_shape(a.sizes().begin(), a.sizes().end() - 1);
    out_shape.push_back(n);
    const int64_t rows = shape_numel(Shape(a.sizes().begin(), a.sizes().end() - 1));
    return batched_gemm(a.reshape({1, rows, k}), b.unsqueeze(0)).view(out_shape);
  }
  Shape ba(a.sizes().begin(), a.sizes().end() - 2), bb(b.sizes().begin(), b.sizes().end() - 2);
  Shape batch = broadcast_shapes(ba, bb, "matmul");
  Shape ea = batch, eb = batch;
  ea.insert(ea.end(), {m, k});
  eb.insert(eb.end(), {k, n});
  const int64_t nb = shape_numel(batch);
  Tensor out = batched_gemm(a.expand(ea).reshape({nb, m, k}), b.expand(eb).reshape({nb, k, n}));
  Shape out_shape = batch;
  out_shape.insert(out_shape.end(), {m, n});
  return out.view(out_shape);
}

// ---- linear ----
namespace {

// Whether x's GEMMs may take cuBLASLt's epilogue at all: on CUDA, switched
// on (cublaslt_epilogues), float32, float16 or bfloat16. A call may still
// be declined (gemm_with_epilogue).
bool epilogue_eligible(const Tensor& x) {
  const DType t = x.dtype();
  return x.is_cuda() && cublaslt_epilogues() && (t == DType::Float32 || t == DType::Float16 || t == DType::BFloat16);
}

// a [1, m, k] @ b [1, k, n] into out [1, m, n] through one cuBLASLt call
// whose epilogue does `e` with vec (and aux): kernels.h's GemmEpilogue.
// False where it is not taken: not eligible, a problem the epilogue has no
// algorithm for; the caller then runs the separate ops.
bool gemm_with_epilogue(const Tensor& a, const Tensor& b, Tensor& out, GemmEpilogue e, const Tensor& vec,
                        Tensor* aux = nullptr) {
  if (!epilogue_eligible(a)) return false;
  const int64_t m = a.sizes()[1], k = a.sizes()[2], n = b.sizes()[2];
  if (m == 0 || n == 0 || k == 0 || !vec.is_contiguous() || vec.dtype() != a.dtype()) return false;
  if (aux != nullptr && n % 8 != 0) return false;  // cuBLASLt's aux leading dimension: a multiple of 8
  MatrixOperand A = describe(a), B = describe(b);
  GemmArgs g{a.dtype(), 1, m, n, k, A.trans, B.trans, A.ptr, A.ld, 0, B.ptr, B.ld, 0, out.raw_data(), n, m * n};
  return gemm_epilogue_cuda(g, e, vec.raw_data(), aux ? aux->raw_data() : nullptr, a.device().index);
}

// x [rows, in] W^T + bias into [1, rows, out]: the bias in the GEMM's
// epilogue where it can be, else added after.
Tensor linear_forward(const Tensor& x2, const Tensor& weight, const Tensor& bias) {
  const Tensor wt = weight.t().unsqueeze(0);
  if (bias.defined()) {
    Tensor out = Tensor::empty({1, x2.sizes()[1], weight.sizes()[0]}, x2.options());
    if (gemm_with_epilogue(x2, wt, out, GemmEpilogue::Bias, bias)) return out;
  }
  Tensor out = batched_gemm_impl(x2, wt);
  if (bias.defined()) add_(out, bias);
  return out;
}

// linear's gradients from g2 [1, rows, out] (the output's, or for
// linear_gelu the pre-activation's): dx = g W, dW = g^T x ([out, in],
// contiguous like the weight), dbias = g's column sums, the last through
// the weight gradient's epilogue where it can be.
std::vector<Tensor> linear_grads(const Tensor& g2, const Tensor& x2, const Tensor& weight, const Shape& x_shape,
                                 bool has_bias, bool gx, bool gw, bool gb) {
  std::vector<Tensor> grads(has_bias ? 3 : 2);
  if (gx) grads[0] = batched_gemm_impl(g2, weight.unsqueeze(0)).view(x_shape);
  const Tensor gt = g2.transpose(1, 2);
  if (gw && gb) {
    Tensor dw = Tensor::empty({1, weight.sizes()[0], weight.sizes()[1]}, g2.options());
    Tensor db = Tensor::empty({weight.sizes()[0]}, g2.options());
    if (gemm_with_epilogue(gt, x2, dw, GemmEpilogue::BiasGradA, db)) {
      grads[1] = dw.squeeze(0);
      grads[2] = db;
      return grads;
    }
  }
  if (gw) grads[1] = batched_gemm_impl(gt, x2).squeeze(0);
  if (gb) grads[2] = sum(g2, {0, 1});
  return grads;
}

// x [..., in] and W [out, in] as linear sees them: rows = the product of
// x's leading dims, the output [..., out].
struct LinearShape {
  int64_t in, out, rows;
  Shape out_shape;
};

LinearShape check_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const char* op) {
  check_pair(x, weight, op);
  EMBER_CHECK(weight.dim() == 2, op, ": weight must be [out, in], got ", shape_str(weight.sizes()));
  EMBER_CHECK(x.dim() >= 1 && x.size(-1) == weight.sizes()[1], op, ": input ", shape_str(x.sizes()), " has last dim ",
              (x.dim() ? x.size(-1) : 0), " but weight ", shape_str(weight.sizes()), " expects ", weight.sizes()[1]);
  if (bias.defined()) {
    check_pair(x, bias, op);
    EMBER_CHECK(bias.dim() == 1 && bias.sizes()[0] == weight.sizes()[0], op, ": bias ", shape_str(bias.sizes()),
                " does not match weight ", shape_str(weight.sizes()));
  }
  LinearShape s{weight.sizes()[1], weight.sizes()[0], 0, Shape(x.sizes().begin(), x.sizes().end() - 1)};
  s.rows = shape_numel(s.out_shape);
  s.out_shape.push_back(s.out);
  return s;
}

}  // namespace

// x [..., in] W^T [in, out] + b as one op with its own derivative: the
// weight's gradient comes out as g^T x, [out, in] and contiguous like the
// weight. Through matmul(x, W.t()) it would be a transposed view, which the
// engine then copies into .grad() element by element (a third of an MLP
// step went there).
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (Tensor lx = autocast::low(x), lw = autocast::low(weight), lb = autocast::low(bias);
      !lx.is_same(x) || !lw.is_same(weight) || (bias.defined() && !lb.is_same(bias)))
    return linear(lx, lw, lb);
  const LinearShape s = check_linear(x, weight, bias, "linear");
  std::vector<Tensor> inputs{x, weight};
  if (bias.defined()) inputs.push_back(bias);
  return differentiable(
      "linear", inputs,
      [&] {
        return linear_forward(x.reshape({1, s.rows, s.in}), weight, bias).view(s.out_shape);
      },
      [&](const Tensor&) {
        Tensor sx = x, sw = weight;
        const bool gx_ = x.requires_grad(), gw_ = weight.requires_grad(), gb_ = bias.defined() && bias.requires_grad();
        const bool has_bias = bias.defined();
        const Shape x_shape = x.sizes();
        const int64_t rows = s.rows, in = s.in, out = s.out;
        BackwardFn fn = [=](const Tensor& g) {
          return linear_grads(g.reshape({1, rows, out}), sx.reshape({1, rows, in}), sw, x_shape, has_bias,
                              gx_ && grad_wanted(0), gw_ && grad_wanted(1), has_bias && gb_ && grad_wanted(2));
        };
        return Recorded{fn, {sx, sw}};
      });
}

// gelu(x W^T + b) on CUDA with the tanh approximation: one GEMM whose
// epilogue adds the bias, keeps the sum (aux, rounded to x's dtype) and
// applies GELU; backward one gelu_backward pass over aux, then the two
// products, the bias's gradient in the weight product's epilogue. Where
// that cannot run (the CPU, erf's GELU, switched off, inside an activation
// checkpoint region, whose policies keep linear's output by name and
// would recompute this op's GEMM), the ops it fuses: linear, bias_gelu.
Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias, bool tanh_approx) {
  if (Tensor lx = autocast::low(x), lw = autocast::low(weight), lb = autocast::low(bias);
      !lx.is_same(x) || !lw.is_same(weight) || !lb.is_same(bias))
    return linear_gelu(lx, lw, lb, tanh_approx);
  EMBER_CHECK(bias.defined(), "linear_gelu: needs a bias (without one, gelu(linear(x, w)))");
  const LinearShape s = check_linear(x, weight, bias, "linear_gelu");
  const bool fused =
      tanh_approx && epilogue_eligible(x) && saved_op_outputs() == nullptr && s.rows > 0 && s.in > 0 && s.out % 8 == 0;
  if (!fused) return bias_gelu(linear(x, weight, Tensor()), bias, tanh_approx);
  // The sum before GELU is kept only for a backward to come.
  const bool keep = needs_grad_list({x, weight, bias});
  Tensor aux;
  return differentiable(
      "linear_gelu", {x, weight, bias},
      [&] {
        const Tensor x2 = x.reshape({1, s.rows, s.in}), wt = weight.t().unsqueeze(0);
        Tensor y = Tensor::empty({1, s.rows, s.out}, x.options());
        // Without an aux matrix: GELU_BIAS (matmul.cu).
        if (!keep && gemm_with_epilogue(x2, wt, y, GemmEpilogue::GeluTanhAux, bias)) return y.view(s.out_shape);
        aux = Tensor::empty({1, s.rows, s.out}, x.options());
        // cuBLASLt may still have no algorithm: the same values in steps.
        if (!gemm_with_epilogue(x2, wt, y, GemmEpilogue::GeluTanhAux, bias, &aux)) {
          aux = linear_forward(x2, weight, bias);
          y = gelu(aux, true);
        }
        return y.view(s.out_shape);
      },
      [&](const Tensor&) {
        // The three gradients start from GELU's, dh = gelu'(aux) g. A
        // zero-bubble split backward (grad_wanted) asks for dx now and for
        // dW, db later with the same g: the first call keeps dh for the
        // second and lets aux go, so the pass runs once and the memory held
        // between the calls stays one [rows, out] tensor. A split left
        // unfinished (its DeferredBackward dropped without run()) leaves
        // nothing to compute dh from for another g: a named error, not a
        // stale dh. aux is this op's own (nothing else can write it), so it
        // is not among the saved tensors whose versions backward checks.
        struct Between {
          Tensor aux, dh, g;  // g: the gradient dh was computed from
        };
        auto st = std::make_shared<Between>(Between{aux, Tensor(), Tensor()});
        Tensor sx = x, sw = weight;
        const bool gx_ = x.requires_grad(), gw_ = weight.requires_grad(), gb_ = bias.requires_grad();
        const Shape x_shape = x.sizes();
        const int64_t rows = s.rows, in = s.in, out = s.out;
        BackwardFn fn = [=](const Tensor& g) {
          const bool gx = gx_ && grad_wanted(0), gw = gw_ && grad_wanted(1), gb = gb_ && grad_wanted(2);
          Tensor dh = st->dh.defined() && g.is_same(st->g) ? st->dh : Tensor();
          st->dh = st->g = Tensor();
          if (!dh.defined()) {
            EMBER_CHECK(st->aux.defined(),
                        "linear_gelu: backward through a node whose split backward "
                        "(backward_input) was not finished: run() the DeferredBackward it returned first");
            dh = gelu_backward(g.reshape({1, rows, out}), st->aux, true);
            if (gx_ != gx || gw_ != gw || gb_ != gb) {  // asked again later for the rest
              st->dh = dh;
              st->g = g;
              st->aux = Tensor();
            }
          }
          return linear_grads(dh, sx.reshape({1, rows, in}), sw, x_shape, true, gx, gw, gb);
        };
        return Recorded{fn, {sx, sw}};
      });
}

}  // namespace ember
