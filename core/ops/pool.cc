// max_pool2d / avg_pool2d: CPU kernels and the op layer (pool.cu has the
// CUDA kernels). Each N*C plane is independent, so threads split planes.
// The per-element bodies are pool.h's, shared with CUDA so both backends
// agree to the last element; addresses come from pool_offset, so NCHW and
// channels-last inputs pool in place.
#include "core/ops/pool.h"

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/ops/cpu_loop.h"
#include "core/ops/kernels.h"
#include "core/ops_nn.h"

namespace ember {

// ---- CPU kernels ----
namespace {
template <typename T>
using pool_acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

int64_t plane_grain(const PoolGeom& g) {
  return std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(g.oh * g.ow * g.kh * g.kw, 1));
}

// For in's float dtype T: out's every element (r, c) of every plane p (of
// [rows, cols]) = value(in's data, p, r, c, o), o its offset, the planes
// split over threads. The CPU indexes in 64 bits (its division is cheap
// beside the GPU's).
template <typename Value>
void pool_cpu(const char* op, const PoolGeom& pg, const Tensor& in, Tensor& out, int64_t rows, int64_t cols,
              Value value) {
  const PoolIndex<int64_t> g(pg);
  EMBER_DISPATCH_FLOAT(in.dtype(), op, [&] {
    using T = scalar_t;
    const T* src = in.data<T>();
    T* dst = out.data<T>();
    parallel_for(pg.planes, plane_grain(pg), [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            const int64_t o = pool_offset(g, p, r, c, rows, cols);
            dst[o] = static_cast<T>(value(src, p, r, c, o));
          }
    });
  });
}

// The accumulation type of a kernel that reads its input through P, a const T*.
template <typename P>
using pool_acc_of = pool_acc_t<std::remove_cv_t<std::remove_pointer_t<P>>>;
}  // namespace

// Calls f(J{}) for the index tensor's element type J (pool_index_dtype).
template <typename F>
void with_index_type(const Tensor& indices, F&& f) {
  if (indices.dtype() == DType::UInt8)
    f(uint8_t{});
  else
    f(int32_t{});
}

void max_pool2d_cpu(const PoolGeom& pg, const Tensor& x, Tensor& y, Tensor& indices) {
  const PoolIndex<int64_t> g(pg);
  with_index_type(indices, [&](auto tag) {
    using J = decltype(tag);
    J* ip = indices.data<J>();
    pool_cpu("max_pool2d", pg, x, y, pg.oh, pg.ow, [&](auto xp, int64_t p, int64_t oh, int64_t ow, int64_t o) {
      int64_t arg;
      const auto best = max_pool_at<pool_acc_of<decltype(xp)>>(g, xp, p, oh, ow, &arg);
      ip[o] = static_cast<J>(arg);
      return best;
    });
  });
}

void max_pool2d_backward_cpu(const PoolGeom& pg, const Tensor& dy, const Tensor& indices, Tensor& dx) {
  const PoolIndex<int64_t> g(pg);
  with_index_type(indices, [&](auto tag) {
    using J = decltype(tag);
    const J* ip = indices.data<J>();
    pool_cpu("max_pool2d_backward", pg, dy, dx, pg.h, pg.w, [&](auto gp, int64_t p, int64_t ih, int64_t iw, int64_t) {
      return max_pool_backward_at<pool_acc_of<decltype(gp)>>(g, gp, ip, p, ih, iw);
    });
  });
}

void avg_pool2d_cpu(const PoolGeom& pg, const Tensor& x, Tensor& y) {
  const PoolIndex<int64_t> g(pg);
  pool_cpu("avg_pool2d", pg, x, y, pg.oh, pg.ow, [&](auto xp, int64_t p, int64_t oh, int64_t ow, int64_t) {
    return avg_pool_at<pool_acc_of<decltype(xp)>>(g, xp, p, oh, ow);
  });
}

void avg_pool2d_backward_cpu(const PoolGeom& pg, const Tensor& dy, Tensor& dx) {
  const PoolIndex<int64_t> g(pg);
  pool_cpu("avg_pool2d_backward", pg, dy, dx, pg.h, pg.w, [&](auto gp, int64_t p, int64_t ih, int64_t iw, int64_t) {
    return avg_pool_backward_at<pool_acc_of<decltype(gp)>>(g, gp, p, ih, iw);
  });
}

// ---- Op layer ----
int64_t pool_output_size(int64_t in, int64_t kernel, int64_t stride, int64_t pad, int64_t dilation, bool ceil_mode) {
  const int64_t num = in + 2 * pad - dilation * (kernel - 1) - 1 + (ceil_mode ? stride - 1 : 0);
  // Floor division (num may be negative when the kernel does not fit).
  int64_t out = (num >= 0 ? num / stride : -((-num + stride - 1) / stride)) + 1;
  if (ceil_mode && (out - 1) * stride >= in + pad) --out;
  return out;
}

namespace {
using Dims = std::array<int64_t, 2>;

PoolGeom pool_geom(const char* op, const Tensor& x, Dims kernel, Dims stride, Dims padding, bool ceil_mode,
                   bool count_include_pad) {
  EMBER_CHECK(x.defined(), op, ": input is undefined");
  EMBER_CHECK(x.dim() == 4, op, ": expected a 4-D input [N, C, H, W], got ", shape_str(x.sizes()));
  EMBER_CHECK(is_floating(x.dtype()), op, ": expected a floating input, got ", x.dtype());
  for (int i = 0; i < 2; ++i) {
    EMBER_CHECK(kernel[i] > 0 && stride[i] > 0 && padding[i] >= 0, op, ": kernel [", kernel[0], ",", kernel[1],
                "] and stride [", stride[0], ",", stride[1], "] must be positive and padding [", padding[0], ",",
                padding[1], "] non-negative");
    EMBER_CHECK(padding[i] <= kernel[i] / 2, op, ": padding [", padding[0], ",", padding[1],
                "] must be at most half of kernel [", kernel[0], ",", kernel[1], "]");
  }
  PoolGeom g{x.size(0) * x.size(1), x.size(2), x.size(3), 0, 0, kernel[0], kernel[1], stride[0], stride[1],
             padding[0], padding[1], count_include_pad};
  g.oh = pool_output_size(g.h, g.kh, g.sh, g.ph, 1, ceil_mode);
  g.ow = pool_output_size(g.w, g.kw, g.sw, g.pw, 1, ceil_mode);
  EMBER_CHECK(g.oh > 0 && g.ow > 0, op, ": kernel [", kernel[0], ",", kernel[1], "] is larger than the padded input ",
              g.h + 2 * g.ph, "x", g.w + 2 * g.pw, " of input ", shape_str(x.sizes()), " (output size would be ",
              g.oh, "x", g.ow, ")");
  return g;
}
}  // namespace

namespace {
// The op around a pool's kernels. Channels-last stays channels-last on both
// backends: the kernels read either layout (pool_offset), so the network
// after the pool keeps its layout with no copies; anything else is pooled
// as contiguous NCHW. fwd(g, xc, y) and bwd(g, dy, dx) run the device's
// kernels; `saved` is what backward reads besides dy (max's indices).
MemoryFormat format_of(const PoolGeom& g) { return g.nhwc ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous; }

template <typename Fwd, typename Bwd>
Tensor pool_op(const char* name, const Tensor& x, PoolGeom g, Fwd fwd, Bwd bwd, std::vector<Tensor> saved) {
  const MemoryFormat fmt = format_of(g);
  Tensor xc;
  {
    NoGradGuard no_grad;  // a kernel input, not a graph node
    xc = (g.nhwc ? x : x.contiguous()).detach();
  }
  const Shape out_shape{x.size(0), x.size(1), g.oh, g.ow};
  return differentiable(
      name, {x},
      [&] {
        Tensor y = Tensor::empty(out_shape, x.options(), fmt);
        if (y.numel() > 0) fwd(g, xc, y);
        return y;
      },
      [&](const Tensor&) {
        const Shape in_shape = x.sizes();
        BackwardFn fn = [=](const Tensor& gy) {
          Tensor dy = gy.contiguous(fmt);
          Tensor dx = Tensor::empty(in_shape, gy.options(), fmt);
          if (dx.numel() > 0) bwd(g, dy, dx);
          return std::vector<Tensor>{dx};
        };
        return Recorded{fn, saved};
      });
}

// pool_geom's, with the layout the kernels will read.
PoolGeom pool_geom_for(const char* op, const Tensor& x, Dims kernel, Dims stride, Dims padding, bool ceil_mode,
                       bool count_include_pad) {
  PoolGeom g = pool_geom(op, x, kernel, stride, padding, ceil_mode, count_include_pad);
  g.nhwc = x.suggest_memory_format() == MemoryFormat::ChannelsLast;
  g.c = x.size(1);
  return g;
}
}  // namespace

Tensor max_pool2d(const Tensor& x, Dims kernel, Dims stride, Dims padding, bool ceil_mode) {
  const PoolGeom g = pool_geom_for("max_pool2d", x, kernel, stride, padding, ceil_mode, false);
  Tensor indices = Tensor::empty({x.size(0), x.size(1), g.oh, g.ow}, {pool_index_dtype(g), x.device()}, format_of(g));
  return pool_op(
      "max_pool2d", x, g,
      [indices](const PoolGeom& g, const Tensor& xc, Tensor& y) mutable {
        if (xc.is_cuda())
          max_pool2d_cuda(g, xc, y, indices);
        else
          max_pool2d_cpu(g, xc, y, indices);
      },
      [indices](const PoolGeom& g, const Tensor& dy, Tensor& dx) {
        if (dy.is_cuda())
          max_pool2d_backward_cuda(g, dy, indices, dx);
        else
          max_pool2d_backward_cpu(g, dy, indices, dx);
      },
      {indices});
}

Tensor avg_pool2d(const Tensor& x, Dims kernel, Dims stride, Dims padding, bool ceil_mode, bool count_include_pad) {
  const PoolGeom g = pool_geom_for("avg_pool2d", x, kernel, stride, padding, ceil_mode, count_include_pad);
  return pool_op(
      "avg_pool2d", x, g,
      [](const PoolGeom& g, const Tensor& xc, Tensor& y) {
        if (xc.is_cuda())
          avg_pool2d_cuda(g, xc, y);
        else
          avg_pool2d_cpu(g, xc, y);
      },
      [](const PoolGeom& g, const Tensor& dy, Tensor& dx) {
        if (dy.is_cuda())
          avg_pool2d_backward_cuda(g, dy, dx);
        else
          avg_pool2d_backward_cpu(g, dy, dx);
      },
      {});
}

}  // namespace ember
