// rotary_embedding as one op: rotary position embeddings (RoPE) in Hugging
// Face LLaMA's "rotate half" convention. A head vector x of D elements is
// split into halves x1 = x[:D/2], x2 = x[D/2:], and at position t, pair i
// turns by the angle t * inv_freq[i]:
//   y1 = x1 * cos - x2 * sin,   y2 = x2 * cos + x1 * sin
// (HF's q * cos + rotate_half(q) * sin with cos/sin = cat(freqs, freqs)).
// The op takes the cos/sin tables per position, [T, D/2], so the caller
// decides which positions a row has (a context-parallel rank's chunks, a
// generation step's offset). A rotation's derivative is the rotation back:
// dx is the same kernel with the sine negated, so backward keeps nothing
// but the tables. The CPU kernel is the reference for the CUDA one
// (rope.cu); both compute in float32 (float64 for float64).
#include <vector>

#include "core/autocast.h"
#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops/kernels.h"
#include "core/ops_nn.h"

namespace ember {

// ---- CPU kernel ----
namespace {

template <typename T>
void rotate_cpu(const T* x, const T* cos, const T* sin, T sign, const RopeGeom& g, T* y) {
  const int64_t half = g.head_dim / 2, vectors = g.outer * g.seq * g.heads;
  parallel_for(vectors, std::max<int64_t>(1, 8192 / std::max<int64_t>(g.head_dim, 1)), [&](int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; ++v) {
      const int64_t t = (v / g.heads) % g.seq;
      const T *c = cos + t * half, *s = sin + t * half, *xv = x + v * g.head_dim;
      T* yv = y + v * g.head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const T x1 = xv[i], x2 = xv[i + half], si = sign * s[i];
        yv[i] = x1 * c[i] - x2 * si;
        yv[i + half] = x2 * c[i] + x1 * si;
      }
    }
  });
}

}  // namespace

void rope_cpu(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse, const RopeGeom& g, Tensor& y) {
  auto run = [&](auto tag) {
    using T = decltype(tag);
    rotate_cpu<T>(x.data<T>(), cos.data<T>(), sin.data<T>(), inverse ? T(-1) : T(1), g, y.data<T>());
  };
  if (x.dtype() == DType::Float64)
    run(double{});
  else
    run(float{});
}

// ---- Op ----

Tensor rotary_embedding(const Tensor& x_in, const Tensor& cos, const Tensor& sin) {
  if (Tensor c = autocast::fp32(x_in); !c.is_same(x_in)) return rotary_embedding(c, cos, sin);
  const Tensor& x = x_in;
  EMBER_CHECK(x.defined() && cos.defined() && sin.defined(), "rotary_embedding: x, cos and sin must be defined");
  EMBER_CHECK(x.dim() >= 3, "rotary_embedding: expected x [..., seq, heads, head_dim], got ", shape_str(x.sizes()));
  EMBER_CHECK(is_floating(x.dtype()), "rotary_embedding: expected a floating input, got ", x.dtype());
  RopeGeom g;
  g.seq = x.size(-3);
  g.heads = x.size(-2);
  g.head_dim = x.size(-1);
  const int64_t inner = g.seq * g.heads * g.head_dim;
  g.outer = inner > 0 ? x.numel() / inner : 0;
  EMBER_CHECK(g.head_dim % 2 == 0, "rotary_embedding: head_dim ", g.head_dim, " of x ", shape_str(x.sizes()),
              " must be even (pairs of halves turn together)");
  const Shape table{g.seq, g.head_dim / 2};
  for (const Tensor* t : {&cos, &sin}) {
    const char* name = t == &cos ? "cos" : "sin";
    EMBER_CHECK(t->sizes() == table, "rotary_embedding: ", name, " ", shape_str(t->sizes()),
                " must be [seq, head_dim/2] = ", shape_str(table), " for x ", shape_str(x.sizes()));
    EMBER_CHECK(t->device() == x.device(), "rotary_embedding: x is on ", x.device(), " but ", name, " is on ",
                t->device());
    EMBER_CHECK(!t->requires_grad(), "rotary_embedding: ", name, " is a table of constants and takes no gradient");
  }
  const DType compute = x.dtype() == DType::Float64 ? DType::Float64 : DType::Float32;
  auto prep = [compute](const Tensor& t) { return (t.dtype() == compute ? t : t.to(compute)).contiguous(); };
  const Tensor c = prep(cos), s = prep(sin);
  auto rotate = [g, c, s, compute](const Tensor& in, bool inverse, DType out_dtype) {
    // 16-bit on a GPU: the kernel reads and writes it as it is (no float32
    // copies around it); elsewhere a float32 copy.
    const bool native = in.is_cuda() && (in.dtype() == DType::BFloat16 || in.dtype() == DType::Float16);
    const DType io = native ? in.dtype() : compute;
    const Tensor xc = (in.dtype() == io ? in : in.to(io)).contiguous();
    Tensor y = Tensor::empty(in.sizes(), {io, in.device()});
    if (y.numel() > 0) {
      if (in.is_cuda())
        rope_cuda(xc, c, s, inverse, g, y);
      else
        rope_cpu(xc, c, s, inverse, g, y);
    }
    return y.dtype() == out_dtype ? y : y.to(out_dtype);
  };
  return differentiable(
      "rotary_embedding", {x}, [&] { return rotate(x, false, x.dtype()); },
      [&](const Tensor&) {
        const DType xdt = x.dtype();
        BackwardFn fn = [rotate, xdt](const Tensor& grad) { return std::vector<Tensor>{rotate(grad, true, xdt)}; };
        return Recorded{fn, {c, s}};
      });
}

}  // namespace ember
