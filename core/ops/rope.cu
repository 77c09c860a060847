// CUDA kernel of rotary_embedding (rope.cc has the op, the convention and
// the CPU reference): a thread per V pairs (x[i..i+V), x[i+D/2..i+D/2+V))
// of a head vector, read and written as 16-byte vectors where D/2 and the
// pointers allow (one element a half otherwise), so a warp reads a
// contiguous run of each half; backward is the same kernel with the sine
// negated. 16-bit x is read and written as it is, rotated in float32 with
// the float32 tables. The head vector's and its position's indices come
// from 32-bit multiply-high divisions where x fits (int_div.h): the 64-bit
// divisions they took before were a subroutine of some 70 instructions
// each, three a pair, several times a pair's share of memory time.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "core/ops/cuda_utils.cuh"
#include "core/ops/int_div.h"
#include "core/ops/kernels.h"

namespace ember {
namespace {

// Divisors of a rotation's index math: a head vector's chunks of V pairs
// (half / V), the heads, the sequence.
template <typename I>
struct RopeIndex {
  I half;
  IntDiv<I> by_chunks, by_heads, by_seq;
};

// T: x's and y's dtype (16-bit read and written as it is), C: the tables'
// and the arithmetic's (float32, or float64 for float64), I: the index
// type, V: pairs a thread.
template <typename T, typename C, typename I, int V>
__global__ void rotate_kernel(const T* __restrict__ x, const C* __restrict__ cos, const C* __restrict__ sin, C sign,
                              int64_t items, const RopeIndex<I> g, T* __restrict__ y) {
  cuda::grid_stride_loop(items, [&](int64_t item) {
    const I p = static_cast<I>(item), v = g.by_chunks.div(p);  // v: the head vector
    const I i = (p - v * g.by_chunks.d) * V;                   // its first pair
    const I r = g.by_heads.div(v);                             // v's row of [outer * seq]
    const I t = r - g.by_seq.div(r) * g.by_seq.d;              // its position
    const I x1o = v * 2 * g.half + i, to = t * g.half + i;
    using VT = cuda::VecN<T, V>;
    using VC = cuda::VecN<C, V>;
    const VT a = *reinterpret_cast<const VT*>(x + x1o), b = *reinterpret_cast<const VT*>(x + x1o + g.half);
    const VC c = *reinterpret_cast<const VC*>(cos + to), s = *reinterpret_cast<const VC*>(sin + to);
    VT y1, y2;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const C x1 = static_cast<C>(a.v[k]), x2 = static_cast<C>(b.v[k]), sk = sign * s.v[k];
      y1.v[k] = static_cast<T>(x1 * c.v[k] - x2 * sk);
      y2.v[k] = static_cast<T>(x2 * c.v[k] + x1 * sk);
    }
    *reinterpret_cast<VT*>(y + x1o) = y1;
    *reinterpret_cast<VT*>(y + x1o + g.half) = y2;
  });
}

template <typename T, typename C>
void rotate(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse, const RopeGeom& g, Tensor& y) {
  cuda::DeviceGuard guard(x);
  const int64_t half = g.head_dim / 2, pairs = g.outer * g.seq * g.heads * half;
  const T* xp = x.data<T>();
  const C *cp = cos.data<C>(), *sp = sin.data<C>();
  constexpr int W = cuda::vec_width<T>();
  // A vector of pairs must not straddle the halves, and the tables' V
  // elements load as one vector too.
  const bool divisible = half % W == 0 && cuda::is_aligned_for<C, W>(cp) && cuda::is_aligned_for<C, W>(sp);
  cuda::with_vec_width<T>(
      pairs, {xp, y.data<T>()},
      [&](auto vec, unsigned grid) {
        constexpr int V = decltype(vec)::value;
        auto launch = [&]<typename I>() {
          const RopeIndex<I> ix{static_cast<I>(half), IntDiv<I>(half / V), IntDiv<I>(g.heads), IntDiv<I>(g.seq)};
          rotate_kernel<T, C, I, V><<<grid, cuda::kBlockSize, 0, cuda::stream_for(x)>>>(
              xp, cp, sp, inverse ? C(-1) : C(1), pairs / V, ix, y.data<T>());
        };
        // Offsets reach x's numel; the tables' (seq * half) are fewer.
        if (use_int_div32(x.numel()))
          launch.template operator()<int32_t>();
        else
          launch.template operator()<int64_t>();
      },
      divisible);
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void rope_cuda(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse, const RopeGeom& g, Tensor& y) {
  cuda::dispatch_io(x.dtype(), [&]<typename T, typename C>() { rotate<T, C>(x, cos, sin, inverse, g, y); });
}

}  // namespace ember
