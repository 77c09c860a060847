// Binary elementwise ops with broadcasting and type promotion (add, sub, mul,
// div, pow, maximum, minimum, comparisons) and the ternary where: CPU
// kernels, then the op layer shared with binary.cu's launchers.
#include <cmath>

#include "core/autocast.h"
#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops/elementwise_fns.h"

namespace ember {

// ---- CPU kernels ----
namespace {
// GELU's (tanh form) gradient over contiguous float32, in a function of
// its own: gcc vectorizes this loop here, not inside binary_cpu's many
// instantiations (10x slower there).
__attribute__((noinline)) void gelu_tanh_grad_f32(float* __restrict out, const float* __restrict g,
                                                  const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = binary_fn<BinaryOp::GeluTanhGrad, float>(g[i], x[i], 1.f);
}
}  // namespace

void binary_cpu(BinaryOp op, const StridedIter& it, double alpha) {
  dispatch_binary_typed(op, it.dtypes[1], alpha, [&](auto op_c, auto tag, auto al) {
    constexpr BinaryOp OP = decltype(op_c)::value;
    using T = decltype(tag);
    using C = decltype(al);
    using O = std::conditional_t<OP >= BinaryOp::Eq, bool, T>;
    cpu_loop(it, [&](char** p, const int64_t* s, int64_t n) {
      O* out = reinterpret_cast<O*>(p[0]);
      const T* a = reinterpret_cast<const T*>(p[1]);
      const T* b = reinterpret_cast<const T*>(p[2]);
      if (s[0] == 1 && s[1] == 1 && s[2] == 1) {
        if constexpr (OP == BinaryOp::GeluTanhGrad && std::is_same_v<T, float>) {
          const bool apart = (out + n <= a || a + n <= out) && (out + n <= b || b + n <= out);
          if (apart)
            return gelu_tanh_grad_f32(reinterpret_cast<float*>(out), reinterpret_cast<const float*>(a),
                                      reinterpret_cast<const float*>(b), n);
        }
        for (int64_t i = 0; i < n; ++i)
          store_as(out + i, binary_fn<OP, C>(static_cast<C>(a[i]), static_cast<C>(b[i]), al));
      } else if (s[0] == 1 && s[1] == 1 && s[2] == 0) {  // tensor (op) scalar
        const C bv = static_cast<C>(b[0]);
        for (int64_t i = 0; i < n; ++i) store_as(out + i, binary_fn<OP, C>(static_cast<C>(a[i]), bv, al));
      } else {
        for (int64_t i = 0; i < n; ++i)
          out[i * s[0]] =
              static_cast<O>(binary_fn<OP, C>(static_cast<C>(a[i * s[1]]), static_cast<C>(b[i * s[2]]), al));
      }
    });
  });
}

void where_cpu(const StridedIter& it) {
  EMBER_DISPATCH_ALL(it.dtypes[0], "where", [&] {
    using T = scalar_t;
    cpu_loop(it, [&](char** p, const int64_t* s, int64_t n) {
      T* out = reinterpret_cast<T*>(p[0]);
      const bool* c = reinterpret_cast<const bool*>(p[1]);
      const T* a = reinterpret_cast<const T*>(p[2]);
      const T* b = reinterpret_cast<const T*>(p[3]);
      for (int64_t i = 0; i < n; ++i) out[i * s[0]] = c[i * s[1]] ? a[i * s[2]] : b[i * s[3]];
    });
  });
}

// ---- Op layer ----
namespace {

// torch's rule: a 0-dim operand only decides the dtype when its category
// (bool < integer < floating) is higher than the other operand's.
int category(DType t) { return t == DType::Bool ? 0 : is_floating(t) ? 2 : 1; }
DType result_type(const Tensor& a, const Tensor& b) {
  bool a0 = a.dim() == 0, b0 = b.dim() == 0;
  if (a0 != b0) {
    const Tensor& dim_t = a0 ? b : a;
    const Tensor& zero_t = a0 ? a : b;
    if (category(zero_t.dtype()) <= category(dim_t.dtype())) return dim_t.dtype();
  }
  return promote_types(a.dtype(), b.dtype());
}

void check_same_device(const Tensor& a, const Tensor& b, const char* name) {
  // A CPU 0-dim tensor may act as a scalar on any device, as in torch.
  EMBER_CHECK(a.device() == b.device() || (b.dim() == 0 && b.device().is_cpu()) ||
                  (a.dim() == 0 && a.device().is_cpu()),
              name, ": expected both tensors on the same device, got ", a.device(), " ", shape_str(a.sizes()),
              " and ", b.device(), " ", shape_str(b.sizes()));
}

Device pick_device(const Tensor& a, const Tensor& b) {
  if (a.is_cuda()) return a.device();
  return b.device();
}

// The output keeps a channels-last operand's layout when that operand has
// the output's full shape (what torch's TensorIterator does, simplified).
MemoryFormat out_format(const Shape& shape, const Tensor& a, const Tensor& b) {
  for (const Tensor* t : {&a, &b})
    if (t->sizes() == shape && t->suggest_memory_format() == MemoryFormat::ChannelsLast)
      return MemoryFormat::ChannelsLast;
  return MemoryFormat::Contiguous;
}

Tensor prep(const Tensor& t, DType dtype, Device device) {
  return t.to(device, dtype);
}

// A 0-dim CPU operand of a CUDA op (`x * 0.5`, a statistic's momentum) is
// not copied to the device: its value, converted to the op's dtype as the
// copy would convert it, travels in the StridedIter as a kernel argument, as
// torch's CPU scalars do. A copy would cost an allocation, a launch and a
// host synchronisation every time.
bool is_host_scalar(const Tensor& t, Device d) { return d.is_cuda() && t.device().is_cpu() && t.dim() == 0; }

void mark_host_scalar(StridedIter& it, int o, const Tensor& t, DType dtype) {
  const Tensor v = t.to(dtype);
  it.host_scalars |= 1u << o;
  it.scalar_f[o] = v.item();
  it.scalar_i[o] = is_floating(dtype) ? 0 : v.to(DType::Int64).data<int64_t>()[0];
  it.data[o] = nullptr;
}

void run_binary(BinaryOp op, const StridedIter& it, Device d, double alpha) {
  if (d.is_cuda()) binary_cuda(op, it, alpha); else binary_cpu(op, it, alpha);
}

Tensor binary_op(BinaryOp op, const char* name, const Tensor& a, const Tensor& b, double alpha = 1.0) {
  EMBER_CHECK(a.defined() && b.defined(), name, ": an input is undefined");
  check_same_device(a, b, name);
  Shape shape = broadcast_shapes(a.sizes(), b.sizes(), name);
  DType common = result_type(a, b);
  if ((op == BinaryOp::Div) && !is_floating(common)) common = DType::Float32;  // true division
  if (op == BinaryOp::Pow && common == DType::Bool) common = DType::Int64;
  EMBER_CHECK(common != DType::Bool || is_comparison(op) || op == BinaryOp::Maximum || op == BinaryOp::Minimum,
              name, ": arithmetic on bool tensors is not supported");
  Device d = pick_device(a, b);
  const bool ha = is_host_scalar(a, d), hb = is_host_scalar(b, d);
  Tensor ca = ha ? a : prep(a, common, d), cb = hb ? b : prep(b, common, d);
  Tensor out = Tensor::empty(shape, {is_comparison(op) ? DType::Bool : common, d}, out_format(shape, a, b));
  StridedIter it = make_iter(out, {ca, cb}, name);
  it.dtypes[0] = is_comparison(op) ? DType::Bool : common;
  if (ha) mark_host_scalar(it, 1, a, common);
  if (hb) mark_host_scalar(it, 2, b, common);
  it.dtypes[1] = it.dtypes[2] = common;
  run_binary(op, it, d, alpha);
  return out;
}

Tensor scalar_like(double s, const Tensor& like) {
  // Python-number semantics: a float scalar makes an integer tensor float32.
  bool integral = std::isfinite(s) && std::trunc(s) == s && std::fabs(s) < 9.2e18;
  DType t = (is_floating(like.dtype()) || integral) ? like.dtype() : DType::Float32;
  if (t == DType::Bool) t = integral ? DType::Int64 : DType::Float32;
  return scalar_tensor(s, t);
}

}  // namespace

namespace {
// An input's shape, dtype and device: all a gradient needs to be brought
// back to it (sum_to over broadcast dimensions, then the input's dtype and
// device), so backward need not keep the input itself.
struct InputMeta {
  Shape sizes;
  Device device;
  DType dtype;
  explicit InputMeta(const Tensor& t) : sizes(t.sizes()), device(t.device()), dtype(t.dtype()) {}
};
Tensor grad_to(const Tensor& g, const InputMeta& m) { return sum_to(g, m.sizes).to(m.device, m.dtype); }

// Derivatives of a (op) b with respect to a and b. Backward keeps only the
// tensors its formula reads for the inputs that want a gradient: a saved
// tensor lives until backward, and an add that kept its inputs and output
// kept every residual stream and attention score of a transformer alive.
Tensor binary_diff(BinaryOp op, const char* name, const Tensor& a, const Tensor& b, double alpha = 1.0) {
  return differentiable(
      name, {a, b}, [&] { return binary_op(op, name, a, b, alpha); },
      [&](const Tensor& out) {
        const bool ga = a.requires_grad(), gb = b.requires_grad();
        const InputMeta ma(a), mb(b);
        Tensor sa, sb, so;
        switch (op) {
          case BinaryOp::Add:
          case BinaryOp::Sub:
            break;
          case BinaryOp::Mul:
            if (ga) sb = b;
            if (gb) sa = a;
            break;
          case BinaryOp::Div:
            sb = b;
            if (gb) so = out;
            break;
          case BinaryOp::Pow:
            sa = a, sb = b;
            if (gb) so = out;
            break;
          default:  // maximum, minimum: which input won
            sa = a, sb = b;
            break;
        }
        BackwardFn fn = [=](const Tensor& g) {
          Tensor da, db;
          switch (op) {
            case BinaryOp::Add:
              da = g;
              db = alpha == 1.0 ? g : g * alpha;
              break;
            case BinaryOp::Sub:
              da = g;
              db = g * (-alpha);
              break;
            case BinaryOp::Mul:
              if (ga) da = g * sb;
              if (gb) db = g * sa;
              break;
            case BinaryOp::Div:
              if (ga) da = g / sb;
              if (gb) db = neg(g) * so / sb;
              break;
            case BinaryOp::Pow:  // d/da a^b = b a^(b-1); d/db = a^b log a
              if (ga) da = g * sb * pow(sa, sb - 1.0);
              if (gb) db = g * so * log(sa);
              break;
            case BinaryOp::Maximum:
            case BinaryOp::Minimum: {
              // Ties split the gradient evenly, as torch does.
              Tensor wa = cast(op == BinaryOp::Maximum ? gt(sa, sb) : lt(sa, sb), g.dtype());
              Tensor tie = cast(eq(sa, sb), g.dtype()) * 0.5;
              if (ga) da = g * (wa + tie);
              if (gb) db = g * (1.0 - wa - tie);
              break;
            }
            default:
              EMBER_INTERNAL_ASSERT(false, name, " is not differentiable");
          }
          return std::vector<Tensor>{ga && da.defined() ? grad_to(da, ma) : Tensor(),
                                     gb && db.defined() ? grad_to(db, mb) : Tensor()};
        };
        std::vector<Tensor> saved;
        for (const Tensor* t : {&sa, &sb, &so})
          if (t->defined()) saved.push_back(*t);
        const bool stateless = saved.empty();
        return Recorded{fn, std::move(saved), stateless};
      });
}
}  // namespace

Tensor add(const Tensor& a, const Tensor& b, double alpha) { return binary_diff(BinaryOp::Add, "add", a, b, alpha); }
Tensor sub(const Tensor& a, const Tensor& b, double alpha) { return binary_diff(BinaryOp::Sub, "sub", a, b, alpha); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary_diff(BinaryOp::Mul, "mul", a, b); }
Tensor div(const Tensor& a, const Tensor& b) { return binary_diff(BinaryOp::Div, "div", a, b); }
Tensor pow(const Tensor& a, const Tensor& b) {
  // float32 under autocast (autocast.h).
  if (Tensor ca = autocast::fp32(a), cb = autocast::fp32(b); !ca.is_same(a) || !cb.is_same(b)) return pow(ca, cb);
  return binary_diff(BinaryOp::Pow, "pow", a, b);
}
Tensor maximum(const Tensor& a, const Tensor& b) { return binary_diff(BinaryOp::Maximum, "maximum", a, b); }
Tensor minimum(const Tensor& a, const Tensor& b) { return binary_diff(BinaryOp::Minimum, "minimum", a, b); }
Tensor relu_backward(const Tensor& grad, const Tensor& out) {
  EMBER_PROFILE_OP("relu_backward", grad, out);
  return binary_op(BinaryOp::ReluGrad, "relu_backward", grad, out);
}
Tensor gelu_backward(const Tensor& grad, const Tensor& x, bool tanh_approx) {
  EMBER_PROFILE_OP("gelu_backward", grad, x);
  return binary_op(tanh_approx ? BinaryOp::GeluTanhGrad : BinaryOp::GeluGrad, "gelu_backward", grad, x);
}
Tensor silu_backward(const Tensor& grad, const Tensor& x) {
  EMBER_PROFILE_OP("silu_backward", grad, x);
  return binary_op(BinaryOp::SiluGrad, "silu_backward", grad, x);
}
namespace {
// The comparisons are not differentiable, so they get their profiler event
// here rather than from differentiable().
Tensor compare(BinaryOp op, const char* name, const Tensor& a, const Tensor& b) {
  EMBER_PROFILE_OP(name, a, b);
  return binary_op(op, name, a, b);
}
}  // namespace
Tensor eq(const Tensor& a, const Tensor& b) { return compare(BinaryOp::Eq, "eq", a, b); }
Tensor ne(const Tensor& a, const Tensor& b) { return compare(BinaryOp::Ne, "ne", a, b); }
Tensor lt(const Tensor& a, const Tensor& b) { return compare(BinaryOp::Lt, "lt", a, b); }
Tensor le(const Tensor& a, const Tensor& b) { return compare(BinaryOp::Le, "le", a, b); }
Tensor gt(const Tensor& a, const Tensor& b) { return compare(BinaryOp::Gt, "gt", a, b); }
Tensor ge(const Tensor& a, const Tensor& b) { return compare(BinaryOp::Ge, "ge", a, b); }

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  EMBER_CHECK(cond.defined() && a.defined() && b.defined(), "where: an input is undefined");
  EMBER_CHECK(cond.dtype() == DType::Bool, "where: condition must be bool, got ", cond.dtype());
  EMBER_CHECK(cond.device() == a.device() && a.device() == b.device(), "where: expected all on one device, got ",
              cond.device(), ", ", a.device(), ", ", b.device());
  Shape shape = broadcast_shapes(broadcast_shapes(cond.sizes(), a.sizes(), "where"), b.sizes(), "where");
  DType common = promote_types(a.dtype(), b.dtype());
  return differentiable(
      "where", {a, b},
      [&] {
        Tensor ca = a.to(common), cb = b.to(common);
        Tensor out = Tensor::empty(shape, {common, a.device()}, out_format(shape, a, b));
        StridedIter it = make_iter(out, {cond, ca, cb}, "where");
        if (out.is_cuda())
          where_cuda(it);
        else
          where_cpu(it);
        return out;
      },
      [&](const Tensor&) {
        Tensor c = cond;
        const InputMeta ma(a), mb(b);  // the inputs themselves are not needed
        bool ga = a.requires_grad(), gb = b.requires_grad();
        BackwardFn fn = [=](const Tensor& g) {
          Tensor z = zeros({}, {g.dtype(), g.device()});  // on g's device: a CPU zero made CUDA backward throw
          return std::vector<Tensor>{ga ? grad_to(where(c, g, z), ma) : Tensor(),
                                     gb ? grad_to(where(c, z, g), mb) : Tensor()};
        };
        return Recorded{fn, {c}};
      });
}

namespace {
Tensor& inplace_op(BinaryOp op, const char* name, Tensor& out, const Tensor& b, double alpha) {
  EMBER_CHECK(out.defined() && b.defined(), name, ": an input is undefined");
  check_inplace(out, name);
  check_same_device(out, b, name);
  Shape shape = broadcast_shapes(out.sizes(), b.sizes(), name);
  EMBER_CHECK(shape == out.sizes(), name, ": cannot broadcast ", shape_str(b.sizes()), " into the in-place output ",
              shape_str(out.sizes()));
  DType result = promote_types(out.dtype(), b.dtype());
  if (op == BinaryOp::Div && !is_floating(result)) result = DType::Float32;
  // torch's can_cast: no floating result into an integer output, nothing into bool.
  EMBER_CHECK(!(is_floating(result) && !is_floating(out.dtype())) && out.dtype() != DType::Bool, name,
              ": result type ", result, " can't be cast to the in-place output dtype ", out.dtype());
  const bool hb = is_host_scalar(b, out.device());
  Tensor cb = hb ? b : b.to(out.device(), out.dtype());
  // x += x.t(): b would be overwritten while still being read; read a copy.
  if (!hb && may_overlap(out, cb)) cb = cb.clone();
  StridedIter it = make_iter(out, {out, cb}, name);
  if (hb) {
    mark_host_scalar(it, 2, b, out.dtype());
    it.dtypes[2] = out.dtype();
  }
  run_binary(op, it, out.device(), alpha);
  return out;
}
}  // namespace

Tensor& add_(Tensor& out, const Tensor& b, double alpha) { return inplace_op(BinaryOp::Add, "add_", out, b, alpha); }
Tensor& mul_(Tensor& out, const Tensor& b) { return inplace_op(BinaryOp::Mul, "mul_", out, b, 1.0); }

Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator+(const Tensor& a, double s) { return add(a, scalar_like(s, a)); }
Tensor operator-(const Tensor& a, double s) { return sub(a, scalar_like(s, a)); }
Tensor operator*(const Tensor& a, double s) { return mul(a, scalar_like(s, a)); }
Tensor operator/(const Tensor& a, double s) { return div(a, scalar_like(s, a)); }
Tensor operator+(double s, const Tensor& a) { return add(scalar_like(s, a), a); }
Tensor operator-(double s, const Tensor& a) { return sub(scalar_like(s, a), a); }
Tensor operator*(double s, const Tensor& a) { return mul(scalar_like(s, a), a); }
Tensor operator/(double s, const Tensor& a) { return div(scalar_like(s, a), a); }

Tensor& Tensor::operator+=(const Tensor& o) { return add_(*this, o); }
Tensor& Tensor::operator-=(const Tensor& o) { return add_(*this, o, -1.0); }
Tensor& Tensor::operator*=(const Tensor& o) { return mul_(*this, o); }
Tensor& Tensor::operator/=(const Tensor& o) { return inplace_op(BinaryOp::Div, "div_", *this, o, 1.0); }
Tensor& Tensor::operator*=(double s) { return mul_(*this, scalar_like(s, *this)); }

}  // namespace ember
