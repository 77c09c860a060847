// Copy-with-cast, fill and arange (CPU kernels), the factory functions built
// on them, and allclose.
#include <cmath>
#include <cstring>

#include "core/ops.h"
#include "core/ops/cpu_loop.h"

namespace ember {

// ---- CPU kernels ----
void copy_cpu(const StridedIter& it) {
  if (it.dtypes[0] == it.dtypes[1] && it.all_contiguous()) {
    const size_t es = dtype_size(it.dtypes[0]);
    parallel_for(it.numel, 1 << 18, [&](int64_t b, int64_t e) {
      std::memcpy(it.data[0] + b * es, it.data[1] + b * es, (e - b) * es);
    });
    return;
  }
  EMBER_DISPATCH_CAST(it.dtypes[0], "copy_", [&] {
    using To = scalar_t;
    EMBER_DISPATCH_CAST(it.dtypes[1], "copy_", [&] {
      using From = scalar_t;
      cpu_loop(it, [&](char** p, const int64_t* s, int64_t n) {
        To* out = reinterpret_cast<To*>(p[0]);
        const From* in = reinterpret_cast<const From*>(p[1]);
        if (s[0] == 1 && s[1] == 1) {  // unit strides: the casts autocast makes, vectorized
          if constexpr (is_half_like_v<To> && !std::is_same_v<From, bool>)
            for (int64_t i = 0; i < n; ++i) store_as(out + i, static_cast<float>(in[i]));
          else
            for (int64_t i = 0; i < n; ++i) out[i] = cast_value<To, From>(in[i]);
        } else {
          for (int64_t i = 0; i < n; ++i) out[i * s[0]] = cast_value<To, From>(in[i * s[1]]);
        }
      });
    });
  });
}

void fill_cpu(const StridedIter& it, double value) {
  EMBER_DISPATCH_CAST(it.dtypes[0], "fill_", [&] {
    using T = scalar_t;
    const T v = cast_value<T, double>(value);
    cpu_loop(it, [&](char** p, const int64_t* s, int64_t n) {
      T* out = reinterpret_cast<T*>(p[0]);
      if (s[0] == 1) std::fill(out, out + n, v);
      else for (int64_t i = 0; i < n; ++i) out[i * s[0]] = v;
    });
  });
}

void arange_cpu(Tensor& out, double start, double step) {
  EMBER_DISPATCH_ALL(out.dtype(), "arange", [&] {
    using T = scalar_t;
    T* p = static_cast<T*>(out.raw_data());
    for (int64_t i = 0; i < out.numel(); ++i) p[i] = cast_value<T, double>(start + static_cast<double>(i) * step);
  });
}

// ---- Factories ----
Tensor empty(const Shape& sizes, TensorOptions opts) { return Tensor::empty(sizes, opts); }
Tensor full(const Shape& sizes, double value, TensorOptions opts) {
  Tensor t = Tensor::empty(sizes, opts);
  t.fill_(value);
  return t;
}
Tensor zeros(const Shape& sizes, TensorOptions opts) { return full(sizes, 0.0, opts); }
Tensor ones(const Shape& sizes, TensorOptions opts) { return full(sizes, 1.0, opts); }
// The *_like factories keep a channels-last tensor's layout (PyTorch's
// preserve_format), so optimizer state and buffers made from a
// channels-last parameter are laid out as it is.
Tensor empty_like(const Tensor& t) { return Tensor::empty(t.sizes(), t.options(), t.suggest_memory_format()); }
Tensor full_like(const Tensor& t, double value) {
  Tensor out = empty_like(t);
  out.fill_(value);
  return out;
}
Tensor zeros_like(const Tensor& t) { return full_like(t, 0.0); }
Tensor ones_like(const Tensor& t) { return full_like(t, 1.0); }
Tensor scalar_tensor(double value, TensorOptions opts) { return full({}, value, opts); }

Tensor arange(double end, TensorOptions opts) { return arange(0.0, end, 1.0, opts); }
Tensor arange(double start, double end, double step, TensorOptions opts) {
  EMBER_CHECK(step != 0, "arange: step must be nonzero");
  EMBER_CHECK(std::isfinite(start) && std::isfinite(end), "arange: start and end must be finite, got ", start, " and ",
              end);
  EMBER_CHECK((end - start) / step >= 0, "arange: the sign of step ", step, " does not lead from ", start, " to ",
              end);
  int64_t n = static_cast<int64_t>(std::ceil((end - start) / step));
  Tensor out = Tensor::empty({n}, opts);
  if (n == 0) return out;
  if (out.is_cuda()) arange_cuda(out, start, step); else arange_cpu(out, start, step);
  return out;
}

bool allclose(const Tensor& a, const Tensor& b, double rtol, double atol) {
  if (a.sizes() != b.sizes()) return false;
  std::vector<double> x = a.to_vector(), y = b.to_vector();
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || std::isnan(y[i])) {
      if (!(std::isnan(x[i]) && std::isnan(y[i]))) return false;
      continue;
    }
    if (x[i] == y[i]) continue;  // equal infinities
    if (std::abs(x[i] - y[i]) > atol + rtol * std::abs(y[i])) return false;
  }
  return true;
}

}  // namespace ember
