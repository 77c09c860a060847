// Reductions over any set of dims with keepdim: sum, mean, max, min, var,
// argmax, argmin. The op layer views the input as [outer, r, inner] (free
// when the reduced dims form one block of the order its dims lie in memory,
// else one permuting copy), so the CPU and CUDA kernels only ever reduce a
// middle axis.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/autocast.h"
#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops/elementwise_fns.h"

namespace ember {

// ---- CPU kernel ----
namespace {

template <typename T> using sum_t = std::conditional_t<std::is_integral_v<T>, int64_t, acc_t<T>>;

template <ReduceOp OP, typename C>
inline C red_init() {
  if constexpr (OP == ReduceOp::Sum) return C(0);
  else if constexpr (OP == ReduceOp::Max) {
    if constexpr (std::is_floating_point_v<C>) return -std::numeric_limits<C>::infinity();
    else return std::numeric_limits<C>::lowest();
  } else {
    if constexpr (std::is_floating_point_v<C>) return std::numeric_limits<C>::infinity();
    else return std::numeric_limits<C>::max();
  }
}

template <ReduceOp OP, typename C>
inline C red_combine(C acc, C x) {
  if constexpr (OP == ReduceOp::Sum) return acc + x;
  else if constexpr (OP == ReduceOp::Max) return (m_isnan(x) || x > acc) ? x : acc;
  else return (m_isnan(x) || x < acc) ? x : acc;
}

// Sum/Max/Min of one contiguous run; OpenMP's simd reduction lets the
// compiler keep several partial accumulators (reassociation is fine here).
template <ReduceOp OP, typename T, typename C>
C reduce_run(const T* p, int64_t n) {
  C acc = red_init<OP, C>();
  if constexpr (OP == ReduceOp::Sum && std::is_same_v<C, float>) {  // kSumBlock (cpu_loop.h)
    double total = 0;
    for (int64_t b = 0; b < n; b += kSumBlock) {
      const int64_t e = std::min(n, b + kSumBlock);
      C block = 0;
#pragma omp simd reduction(+ : block)
      for (int64_t i = b; i < e; ++i) block += static_cast<C>(p[i]);
      total += block;
    }
    acc = static_cast<C>(total);
  } else if constexpr (OP == ReduceOp::Sum) {
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += static_cast<C>(p[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) acc = red_combine<OP, C>(acc, static_cast<C>(p[i]));
  }
  return acc;
}

template <ReduceOp OP, typename T>
void reduce_value_cpu(const T* in, void* out_raw, int64_t outer, int64_t r, int64_t inner) {
  using C = std::conditional_t<OP == ReduceOp::Sum, sum_t<T>, acc_t<T>>;
  using O = std::conditional_t<OP == ReduceOp::Sum && std::is_integral_v<T>, int64_t, T>;
  O* out = static_cast<O*>(out_raw);
  if (inner == 1) {
    if (outer == 1 && r >= 2 * kParallelGrain) {  // one long row: split it across threads
      int nt = threads_for(r);
      std::vector<C> part(nt, red_init<OP, C>());
      parallel_for(r, r / nt, [&](int64_t b, int64_t e) {
        part[omp_get_thread_num()] = reduce_run<OP, T, C>(in + b, e - b);
      });
      C acc = red_init<OP, C>();
      for (C v : part) acc = red_combine<OP, C>(acc, v);
      out[0] = static_cast<O>(acc);
      return;
    }
    parallel_for(outer, std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(r, 1)), [&](int64_t b, int64_t e) {
      for (int64_t o = b; o < e; ++o) out[o] = static_cast<O>(reduce_run<OP, T, C>(in + o * r, r));
    });
    return;
  }
  // inner > 1: accumulate rows of length `inner` (vectorizes along inner).
  parallel_for(outer * inner, kParallelGrain / std::max<int64_t>(r, 1) + 1, [&](int64_t b, int64_t e) {
    std::vector<C> acc;
    std::vector<double> total;
    while (b < e) {
      int64_t o = b / inner, i0 = b % inner, i1 = std::min(inner, i0 + (e - b));
      int64_t w = i1 - i0;
      acc.assign(w, red_init<OP, C>());
      const T* base = in + o * r * inner + i0;
      if constexpr (OP == ReduceOp::Sum && std::is_same_v<C, float>) {
        // Blocks of kSumBlock rows in float, carried into double (cpu_loop.h).
        total.assign(w, 0.0);
        for (int64_t k0 = 0; k0 < r; k0 += kSumBlock) {
          const int64_t k1 = std::min(r, k0 + kSumBlock);
          std::fill(acc.begin(), acc.end(), C(0));
          for (int64_t k = k0; k < k1; ++k) {
            const T* row = base + k * inner;
            for (int64_t i = 0; i < w; ++i) acc[i] += static_cast<C>(row[i]);
          }
          for (int64_t i = 0; i < w; ++i) total[i] += acc[i];
        }
        for (int64_t i = 0; i < w; ++i) acc[i] = static_cast<C>(total[i]);
      } else {
        for (int64_t k = 0; k < r; ++k) {
          const T* row = base + k * inner;
          for (int64_t i = 0; i < w; ++i) acc[i] = red_combine<OP, C>(acc[i], static_cast<C>(row[i]));
        }
      }
      for (int64_t i = 0; i < w; ++i) out[o * inner + i0 + i] = static_cast<O>(acc[i]);
      b += w;
    }
  });
}

template <bool IS_MAX, typename T>
void arg_reduce_cpu(const T* in, int64_t* out, int64_t outer, int64_t r, int64_t inner) {
  using C = acc_t<T>;
  parallel_for(outer * inner, kParallelGrain / std::max<int64_t>(r, 1) + 1, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      int64_t o = j / inner, i = j % inner;
      const T* p = in + o * r * inner + i;
      C best = static_cast<C>(p[0]);
      int64_t idx = 0;
      for (int64_t k = 1; k < r && !m_isnan(best); ++k) {
        C v = static_cast<C>(p[k * inner]);
        if (m_isnan(v) || (IS_MAX ? v > best : v < best)) {
          best = v;
          idx = k;
        }
      }
      out[j] = idx;
    }
  });
}

}  // namespace

void reduce_cpu(ReduceOp op, const Tensor& in, Tensor& out, int64_t outer, int64_t r, int64_t inner) {
  EMBER_DISPATCH_NUMERIC(in.dtype(), "reduce", [&] {
    using T = scalar_t;
    const T* p = static_cast<const T*>(in.raw_data());
    switch (op) {
      case ReduceOp::Sum: reduce_value_cpu<ReduceOp::Sum, T>(p, out.raw_data(), outer, r, inner); break;
      case ReduceOp::Max: reduce_value_cpu<ReduceOp::Max, T>(p, out.raw_data(), outer, r, inner); break;
      case ReduceOp::Min: reduce_value_cpu<ReduceOp::Min, T>(p, out.raw_data(), outer, r, inner); break;
      case ReduceOp::ArgMax: arg_reduce_cpu<true, T>(p, out.data<int64_t>(), outer, r, inner); break;
      case ReduceOp::ArgMin: arg_reduce_cpu<false, T>(p, out.data<int64_t>(), outer, r, inner); break;
    }
  });
}

// ---- Op layer ----
namespace {

struct ReducePlan {
  Tensor input;  // viewed as [outer, r, inner] in memory
  int64_t outer = 1, r = 1, inner = 1;
  Shape out_shape;
  // The output as the kernels write it (contiguous, `lying`), and the
  // permutation that makes it out_shape: the kept dims in the order they
  // lie in the input.
  Shape lying;
  std::vector<int64_t> back;
};

// The dims of a dense input (its elements fill one block of memory with
// its dims in some order: contiguous, channels-last, a transposed or
// permuted view) outermost first; empty when it is not dense (a gap, an
// expanded dim). A size-1 dim lies nowhere in particular: it sorts where a
// contiguous layout would put it, so a contiguous input's order is its own.
std::vector<int64_t> memory_order(const Tensor& x) {
  const int64_t nd = x.dim();
  std::vector<int64_t> key(static_cast<size_t>(nd)), order(static_cast<size_t>(nd));
  for (int64_t d = nd - 1; d >= 0; --d)
    key[d] = x.sizes()[d] != 1 ? x.strides()[d] : d + 1 < nd ? key[d + 1] * x.sizes()[d + 1] : 1;
  for (int64_t d = 0; d < nd; ++d) order[d] = d;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return key[a] > key[b]; });
  int64_t expected = 1;
  for (int64_t i = nd - 1; i >= 0; --i) {
    const int64_t d = order[i];
    if (x.sizes()[d] == 1) continue;
    if (x.strides()[d] != expected) return {};
    expected *= x.sizes()[d];
  }
  return order;
}

ReducePlan plan_reduce(const Tensor& x, std::vector<int64_t> dims, bool keepdim, const char* op) {
  EMBER_CHECK(x.defined(), op, ": input is undefined");
  const int64_t nd = x.dim();
  std::vector<bool> red(nd, dims.empty());
  for (int64_t d : dims) {
    int64_t w = wrap_dim(d, nd, op);
    if (nd == 0) continue;
    EMBER_CHECK(!red[w] || dims.empty(), op, ": dim ", w, " appears twice in ", shape_str(dims));
    red[w] = true;
  }
  ReducePlan p;
  for (int64_t d = 0; d < nd; ++d) {
    if (!red[d]) p.out_shape.push_back(x.sizes()[d]);
    else if (keepdim) p.out_shape.push_back(1);
  }
  p.lying = p.out_shape;
  for (size_t i = 0; i < p.out_shape.size(); ++i) p.back.push_back(static_cast<int64_t>(i));
  if (nd == 0) {  // 0-d input
    p.input = x.contiguous();
    return p;
  }
  // A dense input is reduced where it lies when its reduced dims (of more
  // than one element) are one block of its memory order: a channels-last
  // mean over H and W is [N, H*W, C] in place, a sum over a transposed
  // view's middle dim [outer, r, inner] as it lies. The output is laid out
  // as the kept dims lie in the input (PyTorch's reductions keep their
  // input's layout too), so it is contiguous when they lie in their logical
  // order, and a permuted input's reduction leaves no copy behind.
  const std::vector<int64_t> order = memory_order(x);
  if (!order.empty()) {
    int64_t first = -1, last = -1;
    for (int64_t i = 0; i < nd; ++i) {
      if (!red[order[i]] || x.sizes()[order[i]] == 1) continue;
      if (first < 0) first = i;
      last = i;
    }
    bool in_place = true;
    for (int64_t i = first; i >= 0 && i <= last; ++i)
      in_place = in_place && (red[order[i]] || x.sizes()[order[i]] == 1);
    if (in_place) {
      p.input = x;
      // Reduced size-1 dims sit anywhere: outside the block they multiply
      // nothing. With no reduced dim of more than one element, r is 1.
      for (int64_t i = 0; i < nd; ++i) {
        const int64_t d = order[i], size = x.sizes()[d];
        if (red[d])
          p.r *= size;
        else
          (first >= 0 && i > last ? p.inner : p.outer) *= size;
      }
      // The output's dims (those kept, or all with keepdim) in memory order.
      std::vector<int64_t> out_index(static_cast<size_t>(nd), -1);
      for (int64_t d = 0, k = 0; d < nd; ++d)
        if (!red[d] || keepdim) out_index[d] = k++;
      p.lying.clear();
      for (int64_t i = 0; i < nd; ++i) {
        const int64_t d = order[i];
        if (out_index[d] < 0) continue;
        p.back[out_index[d]] = static_cast<int64_t>(p.lying.size());
        p.lying.push_back(p.out_shape[out_index[d]]);
      }
      return p;
    }
  }
  Shape perm;
  for (int64_t d = 0; d < nd; ++d) if (!red[d]) { perm.push_back(d); p.outer *= x.sizes()[d]; }
  for (int64_t d = 0; d < nd; ++d) if (red[d]) { perm.push_back(d); p.r *= x.sizes()[d]; }
  p.input = x.permute(perm).contiguous();
  return p;
}

Tensor run_reduce(ReduceOp op, const char* name, const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  EMBER_CHECK(x.dtype() != DType::Bool || op == ReduceOp::Sum, name, ": not supported for bool tensors");
  Tensor src = x.dtype() == DType::Bool ? x.to(DType::Int64) : x;
  ReducePlan p = plan_reduce(src, dims, keepdim, name);
  DType out_t = (op == ReduceOp::ArgMax || op == ReduceOp::ArgMin) ? DType::Int64
                : (op == ReduceOp::Sum && !is_floating(src.dtype())) ? DType::Int64
                                                                       : src.dtype();
  Tensor lying = Tensor::empty(p.lying, {out_t, x.device()});
  Tensor out = lying.permute(p.back);
  if (out.numel() == 0) return out;
  if (p.r == 0) {
    EMBER_CHECK(op == ReduceOp::Sum, name, ": cannot reduce over a zero-size dimension of ", shape_str(x.sizes()),
                " (no identity)");
    return out.fill_(0.0);
  }
  if (x.is_cuda())
    reduce_cuda(op, p.input, lying, p.outer, p.r, p.inner);
  else
    reduce_cpu(op, p.input, lying, p.outer, p.r, p.inner);
  return out;
}

int64_t reduced_count(const Tensor& x, const std::vector<int64_t>& dims) {
  if (dims.empty()) return x.numel();
  int64_t n = 1;
  for (int64_t d : dims) n *= x.dim() == 0 ? 1 : x.sizes()[wrap_dim(d, x.dim(), "reduce")];
  return n;
}

}  // namespace

namespace {
// Re-inserts reduced dims as size 1 so a reduced gradient broadcasts back.
Tensor unreduce(const Tensor& g, const Shape& x, const std::vector<int64_t>& dims, bool keepdim) {
  const int64_t nd = static_cast<int64_t>(x.size());
  if (keepdim || nd == 0) return g;
  if (dims.empty()) return g.reshape(Shape(nd, 1));
  std::vector<bool> red(nd, false);
  for (int64_t d : dims) red[wrap_dim(d, nd, "reduce")] = true;
  Shape s;
  int64_t k = 0;
  for (int64_t d = 0; d < nd; ++d) s.push_back(red[d] ? 1 : g.sizes()[k++]);
  return g.reshape(s);
}

// max/min: the gradient goes to the extreme elements, shared among ties.
Tensor extreme_diff(ReduceOp op, const char* name, const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return differentiable(name, {x}, [&] { return run_reduce(op, name, x, dims, keepdim); }, [&](const Tensor& out) {
    Tensor xs = x;
    BackwardFn fn = [=](const Tensor& g) {
      Tensor mask = cast(eq(xs, unreduce(out, xs.sizes(), dims, keepdim)), g.dtype());
      Tensor count = sum(mask, dims, true);
      return std::vector<Tensor>{mask * unreduce(g, xs.sizes(), dims, keepdim) / count};
    };
    return Recorded{fn, {xs, out}};
  });
}
}  // namespace

// sum and mean run in float32 under autocast (autocast.h).
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  if (Tensor c = autocast::fp32(x); !c.is_same(x)) return sum(c, dims, keepdim);
  return differentiable("sum", {x}, [&] { return run_reduce(ReduceOp::Sum, "sum", x, dims, keepdim); },
                        [&](const Tensor&) {
                          Shape xs = x.sizes();
                          BackwardFn fn = [=](const Tensor& g) {
                            return std::vector<Tensor>{unreduce(g, xs, dims, keepdim).expand(xs)};
                          };
                          return Recorded{fn, {}};
                        });
}
Tensor max(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return extreme_diff(ReduceOp::Max, "max", x, dims, keepdim);
}
Tensor min(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return extreme_diff(ReduceOp::Min, "min", x, dims, keepdim);
}

Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  if (Tensor c = autocast::fp32(x); !c.is_same(x)) return mean(c, dims, keepdim);
  EMBER_CHECK(x.defined(), "mean: input is undefined");
  EMBER_CHECK(is_floating(x.dtype()), "mean: expected a floating dtype, got ", x.dtype(),
              " (cast first, as torch requires)");
  int64_t n = reduced_count(x, dims);
  // 16-bit inputs: divide in fp32 before rounding, or a large sum overflows
  // fp16 even though the mean is representable (torch does the same).
  bool narrow = x.dtype() == DType::Float16 || x.dtype() == DType::BFloat16;
  Tensor s = sum(narrow ? x.to(DType::Float32) : x, dims, keepdim);
  Tensor m = s * (n == 0 ? std::nan("") : 1.0 / static_cast<double>(n));
  return m.to(x.dtype());
}

Tensor var(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim, int64_t correction) {
  EMBER_CHECK(x.defined(), "var: input is undefined");
  EMBER_CHECK(is_floating(x.dtype()), "var: expected a floating dtype, got ", x.dtype());
  // Two passes (mean, then squared deviations) in at least fp32: stable
  // where the one-pass E[x^2]-E[x]^2 cancels catastrophically.
  Tensor xf = (x.dtype() == DType::Float64) ? x : x.to(DType::Float32);
  int64_t n = reduced_count(x, dims);
  Tensor d = xf - mean(xf, dims, true);
  Tensor ss = sum(d * d, dims, keepdim);
  double denom = static_cast<double>(n - correction);
  Tensor v = denom > 0 ? ss * (1.0 / denom) : ss * std::numeric_limits<double>::quiet_NaN();
  return v.to(x.dtype());
}

namespace {
Tensor arg_reduce(ReduceOp op, const char* name, const Tensor& x, std::optional<int64_t> dim, bool keepdim) {
  EMBER_CHECK(x.numel() > 0, name, ": cannot take the ", name, " of an empty tensor ", shape_str(x.sizes()));
  if (!dim) {
    Tensor r = run_reduce(op, name, x.reshape({-1}), {0}, false);
    return keepdim ? r.reshape(Shape(x.dim(), 1)) : r;
  }
  return run_reduce(op, name, x, {*dim}, keepdim);
}
}  // namespace

Tensor argmax(const Tensor& x, std::optional<int64_t> dim, bool keepdim) {
  return arg_reduce(ReduceOp::ArgMax, "argmax", x, dim, keepdim);
}
Tensor argmin(const Tensor& x, std::optional<int64_t> dim, bool keepdim) {
  return arg_reduce(ReduceOp::ArgMin, "argmin", x, dim, keepdim);
}

}  // namespace ember
