// The pooling kernels' index math and per-element bodies, the one
// definition pool.cc's CPU loops and pool.cu's CUDA kernels both run (the
// CPU loops over the elements, CUDA runs one a thread), so the backends
// agree to the last bit. A is the accumulation type, p the plane (n * c +
// channel), I the index type: the CUDA kernels take int32_t with
// multiply-high divisors (int_div.h) where every index fits, and the
// per-element math then costs tens of instructions where a dozen divisions
// by runtime sizes took hundreds; int64_t otherwise, and on the CPU.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/ops/int_div.h"
#include "core/ops/kernels.h"

namespace ember {

// PoolGeom in index type I, with the divisors its index math uses.
template <typename I>
struct PoolIndex {
  using index_type = I;
  I h, w, oh, ow, kh, kw, sh, sw, ph, pw, c;
  bool count_include_pad, nhwc;
  IntDiv<I> by_c, by_h, by_w, by_oh, by_ow, by_sh, by_sw;
  explicit PoolIndex(const PoolGeom& g)
      : h(static_cast<I>(g.h)),
        w(static_cast<I>(g.w)),
        oh(static_cast<I>(g.oh)),
        ow(static_cast<I>(g.ow)),
        kh(static_cast<I>(g.kh)),
        kw(static_cast<I>(g.kw)),
        sh(static_cast<I>(g.sh)),
        sw(static_cast<I>(g.sw)),
        ph(static_cast<I>(g.ph)),
        pw(static_cast<I>(g.pw)),
        c(static_cast<I>(g.c)),
        count_include_pad(g.count_include_pad),
        nhwc(g.nhwc),
        by_c(g.c),
        by_h(g.h),
        by_w(g.w),
        by_oh(g.oh),
        by_ow(g.ow),
        by_sh(g.sh),
        by_sw(g.sw) {}
};
// Whether an operation of g's with the larger of its input's and output's
// element counts `numel` can index in 32 bits: every offset and coordinate
// is below numel, and the covering outputs' bounds add at most a window to
// an input coordinate.
inline bool pool_fits_int32(const PoolGeom& g, int64_t numel) {
  return use_int_div32(numel + g.kh + g.kw + g.ph + g.pw);
}

// Where element (plane p, row r, column s) of a [N, C, rows, cols] tensor
// laid out as g says lies in memory.
template <typename I>
EMBER_HD I pool_offset(const PoolIndex<I>& g, I p, I r, I s, I rows, I cols) {
  if (!g.nhwc) return (p * rows + r) * cols + s;
  const I n = g.by_c.div(p);
  return ((n * rows + r) * cols + s) * g.c + (p - n * g.c);
}
// The inverse: the plane, row and column of memory index i, with rows and
// cols the tensor's (g's h and w, or oh and ow).
template <typename I>
EMBER_HD void pool_coords(const PoolIndex<I>& g, I i, const IntDiv<I>& rows, const IntDiv<I>& cols, I* p, I* r, I* s) {
  I ch = 0;
  if (g.nhwc) {
    const I rest = g.by_c.div(i);
    ch = i - rest * g.c;
    i = rest;
  }
  const I q = cols.div(i), n = rows.div(q);
  *s = i - q * cols.d;
  *r = q - n * rows.d;
  *p = g.nhwc ? n * g.c + ch : n;
}
// Window of output `o` along one dim of an input of size `in`, clipped to
// the input: [*begin, *end). Returns its size clipped only to the padded
// input, which is avg pooling's count_include_pad divisor (as PyTorch).
template <typename I>
EMBER_HD I pool_window(I o, I in, I k, I s, I p, I* begin, I* end) {
  const I b = o * s - p, e = b + k < in + p ? b + k : in + p;
  *begin = b < 0 ? 0 : b;
  *end = e < in ? e : in;
  return e - b;
}
// The outputs whose windows contain input index i: [*lo, *hi), by_s the
// stride. Backward kernels gather over these, so each dx element has one
// writer (no atomics, deterministic, the same sums on CPU and CUDA).
template <typename I>
EMBER_HD void pool_covering(I i, I out, I k, const IntDiv<I>& by_s, I p, I* lo, I* hi) {
  *lo = i + p < k ? 0 : by_s.div(i + p - k) + 1;
  const I h = by_s.div(i + p) + 1;
  *hi = h < out ? h : out;
}

// Max over the window of output (oh, ow); *arg gets the argmax's place in
// the window (row * kw + column of the unclipped kh x kw window). NaN wins
// (and the last NaN), as in PyTorch: a NaN input must not vanish.
template <typename A, typename T, typename I>
EMBER_HD A max_pool_at(const PoolIndex<I>& g, const T* x, I p, I oh, I ow, I* arg) {
  I h0, h1, w0, w1;
  pool_window(oh, g.h, g.kh, g.sh, g.ph, &h0, &h1);
  pool_window(ow, g.w, g.kw, g.sw, g.pw, &w0, &w1);
  const I hb = oh * g.sh - g.ph, wb = ow * g.sw - g.pw;  // the window's first row and column
  A best = static_cast<A>(-INFINITY);
  *arg = (h0 - hb) * g.kw + (w0 - wb);
  for (I ih = h0; ih < h1; ++ih)
    for (I iw = w0; iw < w1; ++iw) {
      const A v = cast_value<A>(x[pool_offset(g, p, ih, iw, g.h, g.w)]);
      if (v > best || v != v) {
        best = v;
        *arg = (ih - hb) * g.kw + (iw - wb);
      }
    }
  return best;
}

// The gradient of input (ih, iw): the sum of dy over the outputs covering
// it whose argmax it is (its place in output (oh, ow)'s window is
// (ih - oh sh + ph) kw + iw - ow sw + pw).
template <typename A, typename T, typename J, typename I>
EMBER_HD A max_pool_backward_at(const PoolIndex<I>& g, const T* dy, const J* indices, I p, I ih, I iw) {
  I oh0, oh1, ow0, ow1;
  pool_covering(ih, g.oh, g.kh, g.by_sh, g.ph, &oh0, &oh1);
  pool_covering(iw, g.ow, g.kw, g.by_sw, g.pw, &ow0, &ow1);
  A acc = 0;
  for (I oh = oh0; oh < oh1; ++oh) {
    const I row = (ih - oh * g.sh + g.ph) * g.kw + iw + g.pw;  // the place, plus ow sw
    for (I ow = ow0; ow < ow1; ++ow) {
      const I o = pool_offset(g, p, oh, ow, g.oh, g.ow);
      if (static_cast<I>(indices[o]) == row - ow * g.sw) acc += cast_value<A>(dy[o]);
    }
  }
  return acc;
}

// The divisor of output (oh, ow)'s average; [h0, h1) x [w0, w1) its window.
template <typename I>
EMBER_HD I avg_pool_window(const PoolIndex<I>& g, I oh, I ow, I* h0, I* h1, I* w0, I* w1) {
  const I size = pool_window(oh, g.h, g.kh, g.sh, g.ph, h0, h1) * pool_window(ow, g.w, g.kw, g.sw, g.pw, w0, w1);
  return g.count_include_pad ? size : (*h1 - *h0) * (*w1 - *w0);
}

// The average over the window of output (oh, ow); 0 for an empty one.
template <typename A, typename T, typename I>
EMBER_HD A avg_pool_at(const PoolIndex<I>& g, const T* x, I p, I oh, I ow) {
  I h0, h1, w0, w1;
  const I div = avg_pool_window(g, oh, ow, &h0, &h1, &w0, &w1);
  A acc = 0;
  for (I ih = h0; ih < h1; ++ih)
    for (I iw = w0; iw < w1; ++iw) acc += cast_value<A>(x[pool_offset(g, p, ih, iw, g.h, g.w)]);
  return div > 0 ? acc / static_cast<A>(div) : A(0);
}

// The gradient of input (ih, iw): dy / divisor summed over the outputs
// covering it.
template <typename A, typename T, typename I>
EMBER_HD A avg_pool_backward_at(const PoolIndex<I>& g, const T* dy, I p, I ih, I iw) {
  I oh0, oh1, ow0, ow1;
  pool_covering(ih, g.oh, g.kh, g.by_sh, g.ph, &oh0, &oh1);
  pool_covering(iw, g.ow, g.kw, g.by_sw, g.pw, &ow0, &ow1);
  A acc = 0;
  for (I oh = oh0; oh < oh1; ++oh)
    for (I ow = ow0; ow < ow1; ++ow) {
      I h0, h1, w0, w1;
      const I div = avg_pool_window(g, oh, ow, &h0, &h1, &w0, &w1);
      acc += cast_value<A>(dy[pool_offset(g, p, oh, ow, g.oh, g.ow)]) / static_cast<A>(div);
    }
  return acc;
}

}  // namespace ember
