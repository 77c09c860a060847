// batch_norm CUDA kernels and launchers. x arrives as contiguous [n, c, s]
// memory: NCHW is (N, C, H*W); channels-last NHWC is (N*H*W, C, 1), so s == 1
// is the NHWC case and gets kernels with threads along C.
//
// Each reduction (the statistics; backward's sums of dy and dy * (x - mean))
// is two launches:
//  - a 2-D grid of (channel tiles x chunks of rows) in which every thread
//    accumulates its elements with 16-byte loads (Welford for the statistics:
//    one pass over x), warps and then the block merge in a fixed order, and
//    the block writes one partial per channel to [chunks, c];
//  - one finalize thread per channel that merges the partials in chunk order
//    (deterministic: no atomics) and writes everything per-channel the step
//    needs: mean and invstd and the running statistics updated in place
//    (forward), dw, db and the three dx coefficients (backward). Nothing
//    returns to the host, so a training step's batch norms never synchronise.
// The elementwise passes (normalise, dx) are one kernel shape, out = p * u +
// q * (v - mu) + k per channel: in NHWC each thread keeps its channels'
// coefficients in registers and walks rows; in NCHW a vector's channel costs
// one 32-bit division and one set of coefficient loads.
// Accumulation is in acc_t: float for 16-bit and float32 input, double for
// double. Batch norm fused with ReLU adds the ReLU to the normalising pass
// and reads the gradient through the fused output's mask (dy where y > 0)
// in both backward passes: no ReLU kernel either way. With a residual block's
// add as well, the normalising pass reads the residual, and the backward's
// sums pass writes the masked dy (the residual's gradient), which its dx
// pass then reads: no add or ReLU kernel, no relu_backward.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda_check.h"
#include "core/device.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/kernels.h"

namespace ember {
namespace {

using cuda::cast_value;
using cuda::VecN;
constexpr int kWarp = cuda::kWarpSize;

// ---- Reduction state ----

// Welford's running mean and sum of squared deviations over n values; merge
// is Chan's formula, so any split of the data gives the same statistics up to
// rounding, and a fixed merge order gives the same bits every run.
template <typename A>
struct Welford {
  A mean, m2, n;  // no initializers: __shared__ arrays of it are allowed
  __device__ __forceinline__ void add(A v) {
    n += A(1);
    const A d = v - mean;
    mean += d / n;
    m2 += d * (v - mean);
  }
  __device__ __forceinline__ void merge(A bm, A bm2, A bn) {
    const A tn = n + bn;
    if (bn == A(0)) return;
    const A d = bm - mean, f = bn / tn;
    mean += d * f;
    m2 += bm2 + d * d * n * f;
    n = tn;
  }
};

// A thread's own accumulation of the statistics: sums of d = v - shift and
// d * d, where shift is the first value the thread saw. Two FMAs a value and
// no division (a Welford step per value divides, which made 16-bit inputs,
// 8 values per 16-byte load, bound by arithmetic); the shift is a sample of
// the data, so d is of the order of the standard deviation however far the
// mean is from zero, and m2 = s2 - s1 * s1 / n does not cancel. It becomes
// a Welford state for the merges.
template <typename A>
struct Shifted {
  A shift, s1, s2, n;
  __device__ __forceinline__ void add(A v) {
    if (n == A(0)) shift = v;
    const A d = v - shift;
    s1 += d;
    s2 += d * d;
    n += A(1);
  }
  __device__ __forceinline__ Welford<A> welford() const {
    Welford<A> w{};
    if (n > A(0)) {
      w.n = n;
      w.mean = shift + s1 / n;
      const A m2 = s2 - s1 * s1 / n;
      w.m2 = m2 > A(0) ? m2 : A(0);
    }
    return w;
  }
};

// Two plain sums: backward's sum(dy) and sum(dy * (x - mean)).
template <typename A>
struct Sums2 {
  A a, b;
};

template <typename A>
__device__ __forceinline__ Welford<A> warp_merge(Welford<A> w) {
  for (int d = kWarp / 2; d > 0; d /= 2) {
    const A m = cuda::shfl_down(w.mean, d), m2 = cuda::shfl_down(w.m2, d), n = cuda::shfl_down(w.n, d);
    w.merge(m, m2, n);
  }
  return w;  // complete in lane 0
}
template <typename A>
__device__ __forceinline__ Sums2<A> warp_merge(Sums2<A> s) {
  for (int d = kWarp / 2; d > 0; d /= 2) {
    s.a += cuda::shfl_down(s.a, d);
    s.b += cuda::shfl_down(s.b, d);
  }
  return s;
}

// Writes a block's partial for one channel into the [k][chunks][c] partials.
template <typename A>
__device__ __forceinline__ void put_partial(A* part, int64_t chunks, int64_t c, int64_t chunk, int64_t ch,
                                            const Welford<A>& w) {
  part[chunk * c + ch] = w.mean;
  part[(chunks + chunk) * c + ch] = w.m2;
  part[(2 * chunks + chunk) * c + ch] = w.n;
}
template <typename A>
__device__ __forceinline__ void put_partial(A* part, int64_t chunks, int64_t c, int64_t chunk, int64_t ch,
                                            const Sums2<A>& s) {
  part[chunk * c + ch] = s.a;
  part[(chunks + chunk) * c + ch] = s.b;
}

// The per-element work of each reduction: a Welford step over x, or the two
// backward sums over (dy, x - mean).
// Acc is a thread's accumulator, State what the merges combine.
template <typename T, typename A>
struct StatsOp {
  using State = Welford<A>;
  using Acc = Shifted<A>;
  const T* x;
  __device__ __forceinline__ static State finish(const Acc& a) { return a.welford(); }
  __device__ __forceinline__ void load(Acc& st, int64_t i, A /*mean*/) const { st.add(cast_value<A>(x[i])); }
  template <int VEC>
  __device__ __forceinline__ void load_vec(Acc* st, int64_t i, const A* /*mean*/, bool same_channel) const {
    const VecN<T, VEC> v = *reinterpret_cast<const VecN<T, VEC>*>(x + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) st[same_channel ? 0 : j].add(cast_value<A>(v.v[j]));
  }
};

// MASK (batch norm fused with ReLU): dy counts where the fused output y is
// > 0, relu_backward's rule, so the sums are those of the unfused pair.
// STORE (and a residual added before the ReLU): that masked dy is also
// written to dz, the residual's gradient, as the pass reads it (every
// element is loaded exactly once).
template <typename T, typename A, bool MASK = false, bool STORE = false>
struct BackwardSumsOp {
  static_assert(MASK || !STORE, "the stored gradient is the masked one");
  using State = Sums2<A>;
  using Acc = Sums2<A>;
  const T* x;
  const T* dy;
  const T* y;  // MASK only
  T* dz;       // STORE only
  __device__ __forceinline__ static State finish(const Acc& a) { return a; }
  __device__ __forceinline__ void load(State& st, int64_t i, A mean) const {
    A g = cast_value<A>(dy[i]);
    if constexpr (MASK) g = cast_value<A>(y[i]) > A(0) ? g : A(0);
    if constexpr (STORE) dz[i] = cast_value<T>(g);
    st.a += g;
    st.b += g * (cast_value<A>(x[i]) - mean);
  }
  template <int VEC>
  __device__ __forceinline__ void load_vec(State* st, int64_t i, const A* mean, bool same_channel) const {
    const VecN<T, VEC> vx = *reinterpret_cast<const VecN<T, VEC>*>(x + i);
    const VecN<T, VEC> vg = *reinterpret_cast<const VecN<T, VEC>*>(dy + i);
    VecN<T, VEC> vy, vz;
    if constexpr (MASK) vy = *reinterpret_cast<const VecN<T, VEC>*>(y + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const int k = same_channel ? 0 : j;
      A g = cast_value<A>(vg.v[j]);
      if constexpr (MASK) g = cast_value<A>(vy.v[j]) > A(0) ? g : A(0);
      if constexpr (STORE) vz.v[j] = cast_value<T>(g);
      st[k].a += g;
      st[k].b += g * (cast_value<A>(vx.v[j]) - mean[k]);
    }
    if constexpr (STORE) *reinterpret_cast<VecN<T, VEC>*>(dz + i) = vz;
  }
};

template <typename A>
__device__ __forceinline__ void merge_into(Welford<A>& a, const Welford<A>& b) {
  a.merge(b.mean, b.m2, b.n);
}
template <typename A>
__device__ __forceinline__ void merge_into(Sums2<A>& a, const Sums2<A>& b) {
  a.a += b.a;
  a.b += b.b;
}

// ---- Reduction kernels ----

// NCHW (s > 1): block (ch, chunk) reduces planes [chunk * ppc, ...) of
// channel ch, one warp per plane, the lanes along the plane with VEC-wide
// loads where the plane is aligned. mean may be null (statistics).
template <typename Op, typename A, int VEC>
__global__ void reduce_planes_kernel(Op op, const A* __restrict__ mean, A* __restrict__ part, int64_t n, int64_t c,
                                     int64_t s, int64_t ppc) {
  using State = typename Op::State;
  __shared__ State warp_states[cuda::kBlockSize / kWarp];
  const int64_t ch = blockIdx.x, chunk = blockIdx.y;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, nwarps = blockDim.x / kWarp;
  const A mu = mean ? mean[ch] : A(0);
  const int64_t p_end = std::min<int64_t>(n, (chunk + 1) * ppc);
  typename Op::Acc st{};
  if (s < kWarp * (VEC > 4 ? VEC : 4)) {
    // Planes too small to keep a warp's loads busy (7x7; 14x14 at 16 bits):
    // the block walks the chunk's planes as one flat range, a 32-bit
    // division per element.
    const uint32_t p0 = static_cast<uint32_t>(chunk * ppc), len = static_cast<uint32_t>((p_end - p0) * s);
    for (uint32_t j = threadIdx.x; j < len; j += blockDim.x) {
      const uint32_t pl = j / static_cast<uint32_t>(s), i = j - pl * static_cast<uint32_t>(s);
      op.load(st, (static_cast<int64_t>(p0 + pl) * c + ch) * s + i, mu);
    }
  } else {
    for (int64_t p = chunk * ppc + warp; p < p_end; p += nwarps) {
      const int64_t base = (p * c + ch) * s;
      cuda::for_each_aligned<VEC>(
          op.x + base, 0, s, lane, kWarp, [&](int64_t i) { op.load(st, base + i, mu); },
          [&](int64_t i) { op.template load_vec<VEC>(&st, base + i, &mu, true); });
    }
  }
  const State merged = warp_merge(Op::finish(st));
  if (lane == 0) warp_states[warp] = merged;
  __syncthreads();
  if (threadIdx.x == 0) {
    State total = warp_states[0];
    for (int w = 1; w < nwarps; ++w) merge_into(total, warp_states[w]);
    put_partial(part, gridDim.y, c, chunk, ch, total);
  }
}

// NHWC (s == 1, x is [m, c]): threads along c with VEC channels each
// (threadIdx.x), rows along threadIdx.y and the chunks of gridDim.y; the
// block merges its rows in order through shared memory.
template <typename Op, typename A, int VEC>
__global__ void reduce_rows_kernel(Op op, const A* __restrict__ mean, A* __restrict__ part, int64_t m, int64_t c) {
  using State = typename Op::State;
  __shared__ State rows[cuda::kBlockSize * VEC];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + tx) * VEC;
  const bool active = c0 < c;
  typename Op::Acc st[VEC] = {};
  A mu[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) mu[j] = mean && active && (VEC == 1 || c0 + j < c) ? mean[c0 + j] : A(0);
  if (active) {
#pragma unroll 4
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + ty; r < m;
         r += static_cast<int64_t>(gridDim.y) * blockDim.y) {
      if constexpr (VEC == 1) op.load(st[0], r * c + c0, mu[0]);
      else op.template load_vec<VEC>(st, r * c + c0, mu, false);
    }
  }
  const int tile = blockDim.x * VEC;  // channels of this block
#pragma unroll
  for (int j = 0; j < VEC; ++j) rows[ty * tile + tx * VEC + j] = Op::finish(st[j]);
  __syncthreads();
  // One thread per channel of the tile merges the rows in order.
  const int t = ty * blockDim.x + tx;
  for (int k = t; k < tile; k += blockDim.x * blockDim.y) {
    const int64_t ch = static_cast<int64_t>(blockIdx.x) * tile + k;
    if (ch >= c) continue;
    State total = rows[k];
    for (int y = 1; y < static_cast<int>(blockDim.y); ++y) merge_into(total, rows[y * tile + k]);
    put_partial(part, gridDim.y, c, blockIdx.y, ch, total);
  }
}

// ---- Finalize kernels (one warp per channel) ----

// A reduction may leave thousands of partials per channel (NHWC splits rows
// into many chunks): a warp per channel merges them, lane l taking chunks
// l, l + 32, ... in order and the lanes then merging in a fixed tree, so the
// loads overlap and the result is still the same bits every run.
constexpr int kFinalizeChannels = cuda::kBlockSize / kWarp;  // per block

// mean, invstd = 1 / sqrt(var + eps), and the running statistics (if rm):
// running = (1 - momentum) * running + momentum * batch, with the unbiased
// variance (var * m / (m - 1)) in running_var, as torch.
template <typename A>
__global__ void stats_finalize_kernel(const A* __restrict__ part, int64_t chunks, int64_t c, A* __restrict__ mean,
                                      A* __restrict__ invstd, A eps, A* __restrict__ rm, A* __restrict__ rv, A keep,
                                      A momentum, A unbias_momentum, int64_t* __restrict__ count) {
  const int64_t ch = static_cast<int64_t>(blockIdx.x) * kFinalizeChannels + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (ch >= c) return;  // whole warps: the shuffles below see all 32 lanes
  Welford<A> w{};
  for (int64_t k = lane; k < chunks; k += kWarp)
    w.merge(part[k * c + ch], part[(chunks + k) * c + ch], part[(2 * chunks + k) * c + ch]);
  w = warp_merge(w);
  if (lane != 0) return;
  const A var = w.m2 / w.n;
  mean[ch] = w.mean;
  invstd[ch] = A(1) / sqrt(var + eps);
  if (rm) {
    rm[ch] = rm[ch] * keep + w.mean * momentum;
    rv[ch] = rv[ch] * keep + var * unbias_momentum;
  }
  if (count && ch == 0) *count += 1;  // BatchNorm2d's num_batches_tracked: one thread
}

// dw = sum(dy * xhat), db = sum(dy); dx = a * dy + b * (x - mean) + k, with
// coef = [a; b; k] per channel (train: through the batch statistics; eval:
// b = k = 0).
template <typename A>
__global__ void backward_finalize_kernel(const A* __restrict__ part, int64_t chunks, int64_t c,
                                         const A* __restrict__ invstd, const A* __restrict__ w, A inv_m, bool train,
                                         A* __restrict__ dw, A* __restrict__ db, A* __restrict__ coef) {
  const int64_t ch = static_cast<int64_t>(blockIdx.x) * kFinalizeChannels + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (ch >= c) return;
  Sums2<A> s{};
  if (part)
    for (int64_t k = lane; k < chunks; k += kWarp) {
      s.a += part[k * c + ch];
      s.b += part[(chunks + k) * c + ch];
    }
  s = warp_merge(s);
  if (lane != 0) return;
  const A sum_dy = s.a, sum_dy_xmu = s.b;
  const A inv = invstd[ch], wc = w ? w[ch] : A(1);
  const A sum_dy_xhat = sum_dy_xmu * inv;
  if (dw) dw[ch] = sum_dy_xhat;
  if (db) db[ch] = sum_dy;
  if (coef) {
    const A a = wc * inv;
    coef[ch] = a;
    coef[c + ch] = train ? -a * inv * sum_dy_xhat * inv_m : A(0);
    coef[2 * c + ch] = train ? -a * sum_dy * inv_m : A(0);
  }
}

// ---- Elementwise kernels ----

// p * u + k with one rounding, as nvcc contracts it anyway; written out,
// a host compiler that does not contract (gcc below -O2: the emulation
// under ASan) computes the same. It matters for the normalising pass: p * x
// and k = b - mean * p are both of x's magnitude, and with a large mean (x
// near 1e4) a product rounded on its own loses the output's low bits (a
// unit of 1e4's last place, 1e-3, in an output near 1).
template <typename A>
__device__ __forceinline__ A fma_of(A p, A u, A k) {
  if constexpr (sizeof(A) == sizeof(float))
    return fmaf(p, u, k);
  else
    return fma(p, u, k);
}

// Both elementwise passes are out = p * u + q * (v - mu) + k per channel:
// normalise (u = x, q = 0: p = invstd * w, k = b - mean * p) and dx (u = dy,
// v = x: p, q, k from backward's finalize, mu = mean; q = k = 0 in eval).
template <typename A>
struct ApplyCoef {
  const A *mean, *invstd, *w, *b;
  __device__ __forceinline__ void at(int64_t ch, A& p, A& q, A& mu, A& k) const {
    p = invstd[ch] * (w ? w[ch] : A(1));
    k = fma_of(-mean[ch], p, b ? b[ch] : A(0));
    q = A(0);
    mu = A(0);
  }
};
template <typename A>
struct DxCoef {
  const A *mean, *coef;  // coef = [a; b; k], each [c]
  int64_t c;
  bool train;
  __device__ __forceinline__ void at(int64_t ch, A& p, A& q, A& mu, A& k) const {
    p = coef[ch];
    q = train ? coef[c + ch] : A(0);
    k = train ? coef[2 * c + ch] : A(0);
    mu = train ? mean[ch] : A(0);
  }
};
// out = u (with kMaskU: the masked gradient alone, a residual's gradient
// where no backward sums are taken). k is -0, not +0: u + -0 is u for every
// u, where u + +0 would turn a -0 gradient into +0 (relu_backward keeps it).
template <typename A>
struct IdentityCoef {
  __device__ __forceinline__ void at(int64_t, A& p, A& q, A& mu, A& k) const {
    p = A(1);
    q = mu = A(0);
    k = -A(0);
  }
};

// What the elementwise passes add for batch norm fused with ReLU: the ReLU
// on the output (the forward), or u (dy) taken only where m (the fused
// output) is > 0 (the backward's dx); with a residual block's add too, m is
// the residual, added to the output rounded to T (where the unfused batch
// norm stores it) and then the ReLU.
enum Epilogue { kPlain = 0, kRelu = 1, kMaskU = 2, kAddRelu = 3 };

template <typename A>
__device__ __forceinline__ A relu_of(A v) {
  return v > A(0) ? v : (v != v ? v : A(0));  // NaN kept, as relu
}

// NCHW (s > 1): grid-stride over VEC-wide vectors. A vector's first channel
// costs one division (32-bit where the tensor allows); planes whose size is
// not a multiple of VEC (7x7, 14x14 at 16 bits) end inside a vector, and the
// lanes past the boundary move on to the next channel(s) without dividing.
// v is read only when HAS_V, m only when EPI is kMaskU (the mask) or
// kAddRelu (the residual).
template <typename T, typename A, int VEC, bool HAS_V, int EPI, typename I, typename Coef>
__global__ void affine_planes_kernel(const T* __restrict__ u, const T* __restrict__ v, const T* __restrict__ m,
                                     Coef coef, T* __restrict__ out, int64_t total, int64_t c, int64_t s) {
  const int64_t nvec = total / VEC;
  for (int64_t vi = cuda::global_thread_id(); vi < nvec; vi += cuda::grid_stride()) {
    const int64_t i = vi * VEC;
    const I ii = static_cast<I>(i);
    const I plane = ii / static_cast<I>(s);
    int64_t ch = static_cast<int64_t>(plane % static_cast<I>(c));
    int64_t next = (static_cast<int64_t>(plane) + 1) * s;  // first index of the next plane
    A p, q, mu, k;
    coef.at(ch, p, q, mu, k);
    const VecN<T, VEC> uv = *reinterpret_cast<const VecN<T, VEC>*>(u + i);
    VecN<T, VEC> vv, mv;
    if constexpr (HAS_V) vv = *reinterpret_cast<const VecN<T, VEC>*>(v + i);
    if constexpr (EPI == kMaskU || EPI == kAddRelu) mv = *reinterpret_cast<const VecN<T, VEC>*>(m + i);
    VecN<T, VEC> r;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (VEC > 1 && i + j == next) {  // a plane boundary inside the vector
        ch = ch + 1 == c ? 0 : ch + 1;
        next += s;
        coef.at(ch, p, q, mu, k);
      }
      A uu = cast_value<A>(uv.v[j]);
      if constexpr (EPI == kMaskU) uu = cast_value<A>(mv.v[j]) > A(0) ? uu : A(0);
      A o = fma_of(p, uu, k);
      if constexpr (HAS_V) o = fma_of(q, cast_value<A>(vv.v[j]) - mu, o);
      if constexpr (EPI == kRelu) o = relu_of(o);
      if constexpr (EPI == kAddRelu) o = relu_of(cast_value<A>(cast_value<T>(o)) + cast_value<A>(mv.v[j]));
      r.v[j] = cast_value<T>(o);
    }
    *reinterpret_cast<VecN<T, VEC>*>(out + i) = r;
  }
}

// NHWC (s == 1, tensors [m, c]): each thread owns VEC consecutive channels
// (threadIdx.x and blockIdx.x), keeps their coefficients in registers, and
// walks rows (threadIdx.y, blockIdx.y); a block's row segment is contiguous.
template <typename T, typename A, int VEC, bool HAS_V, int EPI, typename Coef>
__global__ void affine_rows_kernel(const T* __restrict__ u, const T* __restrict__ v, const T* __restrict__ mask,
                                   Coef coef, T* __restrict__ out, int64_t m, int64_t c) {
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (c0 >= c) return;
  A p[VEC], q[VEC], mu[VEC], k[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) coef.at(c0 + j, p[j], q[j], mu[j], k[j]);
#pragma unroll 4
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < m;
       r += static_cast<int64_t>(gridDim.y) * blockDim.y) {
    const int64_t i = r * c + c0;
    const VecN<T, VEC> uv = *reinterpret_cast<const VecN<T, VEC>*>(u + i);
    VecN<T, VEC> vv, mv;
    if constexpr (HAS_V) vv = *reinterpret_cast<const VecN<T, VEC>*>(v + i);
    if constexpr (EPI == kMaskU || EPI == kAddRelu) mv = *reinterpret_cast<const VecN<T, VEC>*>(mask + i);
    VecN<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      A uu = cast_value<A>(uv.v[j]);
      if constexpr (EPI == kMaskU) uu = cast_value<A>(mv.v[j]) > A(0) ? uu : A(0);
      A val = fma_of(p[j], uu, k[j]);
      if constexpr (HAS_V) val = fma_of(q[j], cast_value<A>(vv.v[j]) - mu[j], val);
      if constexpr (EPI == kRelu) val = relu_of(val);
      if constexpr (EPI == kAddRelu) val = relu_of(cast_value<A>(cast_value<T>(val)) + cast_value<A>(mv.v[j]));
      o.v[j] = cast_value<T>(val);
    }
    *reinterpret_cast<VecN<T, VEC>*>(out + i) = o;
  }
}

// ---- Launch plumbing ----

template <typename A>
const A* opt_ptr(const Tensor& t) {
  return t.defined() ? static_cast<const A*>(t.raw_data()) : nullptr;
}
template <typename A>
A* opt_mut(Tensor* t) {
  return t && t->defined() ? static_cast<A*>(t->raw_data()) : nullptr;
}

// [N, C, H, W] as (n, c, s = H * W).
struct Dims3 {
  int64_t n, c, s;
};
Dims3 dims_of(const Tensor& x) { return {x.size(0), x.size(1), x.size(2) * x.size(3)}; }

// Blocks wanted in flight for a reduction: enough to cover every SM several
// times (a reduction over a few channels must still fill the GPU).
int64_t target_blocks(int device) { return int64_t{16} * cuda::sm_count(device); }

// The reduction's geometry, shared by forward and backward.
struct ReducePlan {
  bool rows;           // NHWC kernel (s == 1)
  int vec;             // elements per load (1 or the 16-byte width)
  dim3 grid, block;
  int64_t chunks, ppc;  // chunks of rows; planes per chunk (NCHW)
};

// Threads along channels for a [m, c] tensor: tx lanes of VEC channels
// (a power of two up to a warp), ty rows, enough row chunks to fill the GPU.
struct RowsGeometry {
  dim3 grid, block;
  int64_t chunks;
};
RowsGeometry rows_geometry(int64_t m, int64_t c, int vec, int device) {
  const int64_t nvec = cuda::ceil_div(c, vec);
  int tx = 1;
  while (tx < nvec && tx < kWarp) tx *= 2;
  const int ty = cuda::kBlockSize / tx;
  const int64_t tiles = cuda::ceil_div(nvec, tx);
  int64_t chunks = std::clamp<int64_t>(cuda::ceil_div(target_blocks(device), tiles), 1,
                                       std::max<int64_t>(1, cuda::ceil_div(m, int64_t{4} * ty)));
  chunks = std::min<int64_t>(chunks, 65535);
  return {dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(chunks)), dim3(tx, ty), chunks};
}

template <typename T>
ReducePlan plan_reduce(const Dims3& d, const void* p0, const void* p1, int device, const void* p2 = nullptr,
                       const void* p3 = nullptr) {
  constexpr int V = cuda::vec_width<T>();
  ReducePlan pl{};
  if (d.s == 1) {
    pl.rows = true;
    const bool vec_ok = d.c % V == 0 && cuda::is_aligned_for<T, V>(p0) && (!p1 || cuda::is_aligned_for<T, V>(p1)) &&
                        (!p2 || cuda::is_aligned_for<T, V>(p2)) && (!p3 || cuda::is_aligned_for<T, V>(p3));
    pl.vec = vec_ok ? V : 1;
    const RowsGeometry g = rows_geometry(d.n, d.c, pl.vec, device);
    pl.grid = g.grid;
    pl.block = g.block;
    pl.chunks = g.chunks;
  } else {
    pl.rows = false;
    // for_each_aligned aligns the loads on x; dy (and y, dz) must then be
    // aligned alike.
    const uintptr_t a0 = reinterpret_cast<uintptr_t>(p0), a1 = reinterpret_cast<uintptr_t>(p1 ? p1 : p0),
                    a2 = reinterpret_cast<uintptr_t>(p2 ? p2 : p0), a3 = reinterpret_cast<uintptr_t>(p3 ? p3 : p0);
    const uintptr_t width = sizeof(T) * V;
    pl.vec = (a0 - a1) % width == 0 && (a0 - a2) % width == 0 && (a0 - a3) % width == 0 ? V : 1;
    pl.chunks = std::clamp<int64_t>(cuda::ceil_div(target_blocks(device), d.c), 1, std::min<int64_t>(d.n, 65535));
    pl.ppc = cuda::ceil_div(d.n, pl.chunks);
    pl.chunks = cuda::ceil_div(d.n, pl.ppc);
    pl.grid = dim3(static_cast<unsigned>(d.c), static_cast<unsigned>(pl.chunks));
    pl.block = dim3(cuda::kBlockSize);
  }
  return pl;
}

template <typename Op, typename A, int V>
void launch_reduce(const ReducePlan& pl, const Op& op, const A* mean, A* part, const Dims3& d, cudaStream_t stream) {
  if (pl.rows) {
    if (pl.vec == V && V > 1)
      reduce_rows_kernel<Op, A, V><<<pl.grid, pl.block, 0, stream>>>(op, mean, part, d.n, d.c);
    else
      reduce_rows_kernel<Op, A, 1><<<pl.grid, pl.block, 0, stream>>>(op, mean, part, d.n, d.c);
  } else {
    if (pl.vec == V)
      reduce_planes_kernel<Op, A, V><<<pl.grid, pl.block, 0, stream>>>(op, mean, part, d.n, d.c, d.s, pl.ppc);
    else
      reduce_planes_kernel<Op, A, 1><<<pl.grid, pl.block, 0, stream>>>(op, mean, part, d.n, d.c, d.s, pl.ppc);
  }
  EMBER_CUDA_CHECK(cudaGetLastError());
}

// out = p * u + q * (v - mu) + k (see ApplyCoef), vectorised when the
// pointers are aligned and the vectors tile the tensor (NCHW: total % V ==
// 0, planes may end inside a vector) or its rows (NHWC: c % V == 0); v may
// be null.
// EPI (Epilogue): kRelu on the output, kMaskU with m the mask's tensor, or
// kAddRelu with m the residual.
template <typename T, typename A, int EPI, typename Coef>
void launch_affine(const Dims3& d, const T* u, const T* v, const T* m, const Coef& coef, T* out, int device,
                   cudaStream_t stream) {
  constexpr int V = cuda::vec_width<T>();
  const int64_t total = d.n * d.c * d.s;
  bool vec_ok = d.s == 1 ? d.c % V == 0 : total % V == 0;
  for (const void* p : {static_cast<const void*>(u), static_cast<const void*>(v), static_cast<const void*>(m),
                        static_cast<const void*>(out)})
    vec_ok = vec_ok && (!p || cuda::is_aligned_for<T, V>(p));
  auto go = [&](auto vec_c, auto has_v) {
    constexpr int VEC = decltype(vec_c)::value;
    constexpr bool HV = decltype(has_v)::value;
    if (d.s == 1) {
      const RowsGeometry g = rows_geometry(d.n, d.c, VEC, device);
      affine_rows_kernel<T, A, VEC, HV, EPI, Coef><<<g.grid, g.block, 0, stream>>>(u, v, m, coef, out, d.n, d.c);
    } else if (total < (int64_t{1} << 31)) {
      affine_planes_kernel<T, A, VEC, HV, EPI, uint32_t, Coef>
          <<<cuda::grid_for(total, cuda::kBlockSize, VEC), cuda::kBlockSize, 0, stream>>>(u, v, m, coef, out, total,
                                                                                          d.c, d.s);
    } else {
      affine_planes_kernel<T, A, VEC, HV, EPI, int64_t, Coef>
          <<<cuda::grid_for(total, cuda::kBlockSize, VEC), cuda::kBlockSize, 0, stream>>>(u, v, m, coef, out, total,
                                                                                          d.c, d.s);
    }
  };
  using One = std::integral_constant<int, 1>;
  using Wide = std::integral_constant<int, V>;
  if (v) {
    if (vec_ok) go(Wide{}, std::true_type{});
    else go(One{}, std::true_type{});
  } else {
    if (vec_ok) go(Wide{}, std::false_type{});
    else go(One{}, std::false_type{});
  }
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void batch_norm_stats_cuda(const Tensor& x, Tensor& mean, Tensor& invstd, double eps, Tensor* running_mean,
                           Tensor* running_var, double momentum, Tensor* num_batches_tracked) {
  const Dims3 d = dims_of(x);
  if (d.c == 0) return;
  const int dev = x.device().index;
  cuda::DeviceGuard guard(dev);
  cudaStream_t stream = cuda::stream_for(dev);
  const double m = static_cast<double>(d.n * d.s);
  EMBER_DISPATCH_FLOAT(x.dtype(), "batch_norm", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    constexpr int V = cuda::vec_width<T>();
    const ReducePlan pl = plan_reduce<T>(d, x.raw_data(), nullptr, dev);
    Tensor part = Tensor::empty({3, pl.chunks, d.c}, mean.options());
    const StatsOp<T, A> op{static_cast<const T*>(x.raw_data())};
    launch_reduce<StatsOp<T, A>, A, V>(pl, op, nullptr, static_cast<A*>(part.raw_data()), d, stream);
    stats_finalize_kernel<A><<<cuda::grid_for(d.c, kFinalizeChannels), cuda::kBlockSize, 0, stream>>>(
        static_cast<const A*>(part.raw_data()), pl.chunks, d.c, static_cast<A*>(mean.raw_data()),
        static_cast<A*>(invstd.raw_data()), static_cast<A>(eps), opt_mut<A>(running_mean), opt_mut<A>(running_var),
        static_cast<A>(1.0 - momentum), static_cast<A>(momentum),
        static_cast<A>(m > 1 ? momentum * m / (m - 1.0) : momentum),
        num_batches_tracked ? num_batches_tracked->data<int64_t>() : nullptr);
    EMBER_CUDA_CHECK(cudaGetLastError());
  });
}

void batch_norm_apply_cuda(const Tensor& x, const Tensor& mean, const Tensor& invstd, const Tensor& w, const Tensor& b,
                           Tensor& y, bool relu, const Tensor* residual) {
  const Dims3 d = dims_of(x);
  const int64_t total = x.numel();
  if (total == 0) return;
  cuda::DeviceGuard guard(x);
  cudaStream_t stream = cuda::stream_for(x);
  EMBER_DISPATCH_FLOAT(x.dtype(), "batch_norm", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const ApplyCoef<A> coef{static_cast<const A*>(mean.raw_data()), static_cast<const A*>(invstd.raw_data()),
                            opt_ptr<A>(w), opt_ptr<A>(b)};
    const T* xp = static_cast<const T*>(x.raw_data());
    T* yp = static_cast<T*>(y.raw_data());
    if (residual)
      launch_affine<T, A, kAddRelu>(d, xp, nullptr, static_cast<const T*>(residual->raw_data()), coef, yp,
                                    x.device().index, stream);
    else if (relu)
      launch_affine<T, A, kRelu>(d, xp, nullptr, nullptr, coef, yp, x.device().index, stream);
    else
      launch_affine<T, A, kPlain>(d, xp, nullptr, nullptr, coef, yp, x.device().index, stream);
  });
}

void batch_norm_backward_cuda(const Tensor& x, const Tensor& dy, const Tensor& mean, const Tensor& invstd,
                              const Tensor& w, bool train, Tensor* dx, Tensor* dw, Tensor* db, const Tensor* relu_out,
                              Tensor* dres) {
  EMBER_INTERNAL_ASSERT(!dres || relu_out, "batch_norm_backward_cuda: dres without relu_out");
  const Dims3 d = dims_of(x);
  const int64_t total = x.numel();
  if (total == 0 || d.c == 0) return;
  const int dev = x.device().index;
  cuda::DeviceGuard guard(dev);
  cudaStream_t stream = cuda::stream_for(dev);
  // The sums are only needed for dw, db, or the training-mode dx.
  const bool need_sums = dw || db || (dx && train);
  EMBER_DISPATCH_FLOAT(x.dtype(), "batch_norm_backward", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    constexpr int V = cuda::vec_width<T>();
    const T* xp = static_cast<const T*>(x.raw_data());
    const T* gp = static_cast<const T*>(dy.raw_data());
    const T* yp = relu_out ? static_cast<const T*>(relu_out->raw_data()) : nullptr;
    T* zp = dres ? static_cast<T*>(dres->raw_data()) : nullptr;
    const A* mp = static_cast<const A*>(mean.raw_data());
    Tensor part, coef_t;
    int64_t chunks = 0;
    if (need_sums) {
      const ReducePlan pl = plan_reduce<T>(d, xp, gp, dev, yp, zp);
      chunks = pl.chunks;
      part = Tensor::empty({2, chunks, d.c}, mean.options());
      A* pp = static_cast<A*>(part.raw_data());
      if (zp)
        launch_reduce<BackwardSumsOp<T, A, true, true>, A, V>(pl, {xp, gp, yp, zp}, mp, pp, d, stream);
      else if (yp)
        launch_reduce<BackwardSumsOp<T, A, true>, A, V>(pl, {xp, gp, yp, nullptr}, mp, pp, d, stream);
      else
        launch_reduce<BackwardSumsOp<T, A>, A, V>(pl, {xp, gp, nullptr, nullptr}, mp, pp, d, stream);
    } else if (zp) {
      // No sums to take (eval, no parameter gradients): the residual's
      // gradient in a pass of its own.
      launch_affine<T, A, kMaskU>(d, gp, nullptr, yp, IdentityCoef<A>{}, zp, dev, stream);
    }
    if (dx) coef_t = Tensor::empty({3, d.c}, mean.options());
    backward_finalize_kernel<A><<<cuda::grid_for(d.c, kFinalizeChannels), cuda::kBlockSize, 0, stream>>>(
        need_sums ? static_cast<const A*>(part.raw_data()) : nullptr, chunks, d.c,
        static_cast<const A*>(invstd.raw_data()), opt_ptr<A>(w), A(1) / static_cast<A>(d.n * d.s), train,
        opt_mut<A>(dw), opt_mut<A>(db), dx ? static_cast<A*>(coef_t.raw_data()) : nullptr);
    EMBER_CUDA_CHECK(cudaGetLastError());
    if (!dx) return;
    const DxCoef<A> coef{mp, static_cast<const A*>(coef_t.raw_data()), d.c, train};
    T* dxp = static_cast<T*>(dx->raw_data());
    if (zp)  // the masked dy, just written: two reads (dz, x) where dy, y, x were three
      launch_affine<T, A, kPlain>(d, zp, train ? xp : nullptr, nullptr, coef, dxp, dev, stream);
    else if (yp)
      launch_affine<T, A, kMaskU>(d, gp, train ? xp : nullptr, yp, coef, dxp, dev, stream);
    else
      launch_affine<T, A, kPlain>(d, gp, train ? xp : nullptr, nullptr, coef, dxp, dev, stream);
  });
}

}  // namespace ember
