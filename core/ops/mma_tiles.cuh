// Warp-level tensor-core tiles for the 16-bit kernels (attention_flash.cu's
// fused attention, grouped_matmul.cu's grouped GEMMs): mma.m16n8k16
// fragments read from shared-memory tiles by ldmatrix in either
// orientation, and one warp's product over a K range; and the TF32
// tensor-core product (mma.m16n8k8) with float32's 3xTF32 split, which the
// float32 fused attention runs (attention_tf32.cu). Header-only, like
// cuda_utils.cuh, whose mma_16816 and ldmatrix_x4 these compose (and whose
// emulation they share).
#pragma once

#include <cstdint>
#include <cstring>

#include "core/ops/cuda_utils.cuh"

namespace ember::cuda {

// TF32 tensor cores, one warp: C[16x8] += A[16x8] B[8x8] on float32 bits
// read as TF32 (the high 19: sign, exponent, 10 mantissa bits), float32
// accumulation: PTX's mma.sync.m16n8k8.row.col.f32.tf32.tf32.f32. Lane
// l = 4 g + t holds
//   a[0] A(g, t)  a[1] A(g+8, t)  a[2] A(g, t+4)  a[3] A(g+8, t+4)
//   b[0] B(t, g)  b[1] B(t+4, g)
//   c as mma_16816's: c[0..1] C(g, 2t..2t+1)  c[2..3] C(g+8, 2t..2t+1).
// Unlike m16n8k16's, an accumulator is not an A fragment as it lies: a
// kernel that feeds one to the next product permutes that product's k
// (column t of A and row t of B mean k = 2t, column t + 4 means 2t + 1).
__device__ __forceinline__ void mma_1688_tf32(float c[4], const uint32_t a[4], const uint32_t b[2]) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif !defined(__CUDACC__)
  const auto tf32 = [](uint32_t r) {
    r &= ~0x1fffu;  // the bits the tensor core reads
    float f;
    std::memcpy(&f, &r, 4);
    return f;
  };
  emulated_mma<8>(
      c, a, b,
      [&](int g, int t, const uint32_t* regs, float(&A)[16][8], float(&B)[8][8]) {
        for (int r = 0; r < 4; ++r) A[g + 8 * (r % 2)][t + 4 * (r / 2)] = tf32(regs[r]);
        for (int r = 0; r < 2; ++r) B[t + 4 * r][g] = tf32(regs[4 + r]);
      },
      EMU_SITE);
#endif
}
// 3xTF32: x as big + small, both read as TF32 by the tensor core, so that
// a product's three partial products big big + big small + small big give
// nearly float32's accuracy on TF32 tensor cores, at a third of their rate
// (CUTLASS's OpMultiplyAddFastF32, which PyTorch's efficient attention
// runs for float32). big is x rounded to the nearest TF32 (ties away from
// zero: add half a TF32 ulp to the bits, clear the low 13), small is
// x - big (exact in float32, at most 2^-11 |x|, of either sign), passed
// whole: the tensor core reads the high 19 bits of each operand, as the
// emulated mma_1688_tf32 does (ptxas relies on it too: it passes x + half
// an ulp where the code passes big). Three instructions an element, where
// cvt.rna.tf32.f32 for both parts (on sm_90 a test for inf and NaN, a
// predicated add and an AND) took six with the subtraction. Error of a
// product: the truncated smalls, each below 2^-21 |a b| and of either
// sign (truncating big instead, as CUTLASS does, halves the work again
// but leaves every error with the sign of a b, so they add up along k),
// and the dropped small small, below 2^-22; one TF32 product is about
// 2^-10 off. Inf stays inf as big (small NaN, so the sums are NaN), NaN
// gives NaN, and a finite x within half a TF32 ulp of overflow rounds to
// inf as cvt.rna rounds it: the same special values as before.
struct Tf32x2 {
  uint32_t big, small;
};
__device__ __forceinline__ Tf32x2 split_tf32(float x) {
  uint32_t xb, sb;
  std::memcpy(&xb, &x, 4);  // a register move on the device
  const uint32_t big = (xb + 0x1000u) & ~0x1fffu;
  float b;
  std::memcpy(&b, &big, 4);
  const float small = x - b;
  std::memcpy(&sb, &small, 4);
  return {big, sb};
}
// Fragments of m16n8k8 split for 3xTF32 (split_tf32): A's four registers
// or B's two, each as its big and its small part.
template <int R>
struct Tf32Frag {
  uint32_t big[R], small[R];
};
using Tf32A = Tf32Frag<4>;
using Tf32B = Tf32Frag<2>;
// c[n] += A B(n) in 3xTF32 for N n-tiles, B(n) = b_frag(n): the three
// partial products in three passes over the n-tiles, the small ones first,
// each pass's N products independent, where one n-tile's three in a row
// would each wait for the one before (a chain the split's few instructions
// do not fill). Each c[n] sums the same three products in the same order
// as a lone n-tile's: the same results. (Passes in chunks of n-tiles, fewer
// B fragments live, measured no faster in the float32 backward.)
template <int N, typename BFrag>
__device__ __forceinline__ void mma_row_3xtf32(float (&c)[N][4], const Tf32A& a, BFrag&& b_frag) {
  Tf32B b[N];
#pragma unroll
  for (int n = 0; n < N; ++n) b[n] = b_frag(n);
#pragma unroll
  for (int n = 0; n < N; ++n) mma_1688_tf32(c[n], a.small, b[n].big);
#pragma unroll
  for (int n = 0; n < N; ++n) mma_1688_tf32(c[n], a.big, b[n].small);
#pragma unroll
  for (int n = 0; n < N; ++n) mma_1688_tf32(c[n], a.big, b[n].big);
}
// c += A B in 3xTF32: the row of one n-tile.
__device__ __forceinline__ void mma_1688_3xtf32(float c[4], const Tf32A& a, const Tf32B& b) {
  mma_row_3xtf32(reinterpret_cast<float(&)[1][4]>(*c), a, [&](int) { return b; });
}

// Fragments from shared tiles by ldmatrix (the layouts of mma_16816).
// A (16 x 16) at rows m0.., columns k0.. of a row-major tile.
__device__ __forceinline__ void frag_a(const uint16_t* tile, int ld, int m0, int k0, int lane, uint32_t a[4]) {
  const int i = lane / 8, r = lane % 8;
  ldmatrix_x4<false>(a, tile + (m0 + r + 8 * (i % 2)) * ld + k0 + 8 * (i / 2));
}
// A (16 x 16) at rows m0.., columns k0.. where A(m, k) = tile[k][m] (a
// tile stored transposed): ldmatrix's transposed read.
__device__ __forceinline__ void frag_a_cols(const uint16_t* tile, int ld, int m0, int k0, int lane, uint32_t a[4]) {
  const int i = lane / 8, r = lane % 8;
  ldmatrix_x4<true>(a, tile + (k0 + r + 8 * (i / 2)) * ld + m0 + 8 * (i % 2));
}
// B of two n-tiles (n0, n0 + 8) where B(k, n) = tile[n][k]: the tile's rows
// are B's columns (k in q k^T).
__device__ __forceinline__ void frag_b_rows(const uint16_t* tile, int ld, int k0, int n0, int lane, uint32_t b[2][2]) {
  const int i = lane / 8, r = lane % 8;
  uint32_t x[4];
  ldmatrix_x4<false>(x, tile + (n0 + r + 8 * (i / 2)) * ld + k0 + 8 * (i % 2));
  b[0][0] = x[0], b[0][1] = x[1], b[1][0] = x[2], b[1][1] = x[3];
}
// B of two n-tiles where B(k, n) = tile[k][n] (v in P v): the transposed read.
__device__ __forceinline__ void frag_b_cols(const uint16_t* tile, int ld, int k0, int n0, int lane, uint32_t b[2][2]) {
  const int i = lane / 8, r = lane % 8;
  uint32_t x[4];
  ldmatrix_x4<true>(x, tile + (k0 + r + 8 * (i % 2)) * ld + n0 + 8 * (i / 2));
  b[0][0] = x[0], b[0][1] = x[1], b[1][0] = x[2], b[1][1] = x[3];
}
// Accumulator tiles nt = 2 kk and 2 kk + 1 (16 x 16) as the A operand of the
// next product, rounded to T.
template <typename T>
__device__ __forceinline__ void c_to_a(const float c0[4], const float c1[4], uint32_t a[4]) {
  a[0] = pack16<T>(c0[0], c0[1]);
  a[1] = pack16<T>(c0[2], c0[3]);
  a[2] = pack16<T>(c1[0], c1[1]);
  a[3] = pack16<T>(c1[2], c1[3]);
}

// One warp's product over K = 16 KT: acc (MT tiles of 16 rows, each N
// tiles of 8 columns) += A B, where a_frag(kk, mt, a) gives A's fragment of
// k-step kk for row tile mt (from shared memory or from registers), and B's
// fragments come from the shared tile `b` by frag_b_cols (B(k, n) =
// b[k][n]) or frag_b_rows (B(k, n) = b[n][k]), each serving all MT tiles.
template <typename T, int KT, bool BCols, int MT, int N, typename AFrag>
__device__ __forceinline__ void warp_mma(float (&acc)[MT][N][4], const AFrag& a_frag, const uint16_t* b, int ld,
                                         int lane) {
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) a_frag(kk, mt, a[mt]);
#pragma unroll
    for (int np = 0; np < N / 2; ++np) {
      uint32_t bb[2][2];
      if constexpr (BCols)
        frag_b_cols(b, ld, kk * 16, np * 16, lane, bb);
      else
        frag_b_rows(b, ld, kk * 16, np * 16, lane, bb);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) mma_16816<T>(acc[mt][2 * np + h], a[mt], bb[h]);
    }
  }
}
// The same for one row tile: acc [N][4], a_frag(kk, a).
template <typename T, int KT, bool BCols, int N, typename AFrag>
__device__ __forceinline__ void warp_mma(float (&acc)[N][4], const AFrag& a_frag, const uint16_t* b, int ld, int lane) {
  warp_mma<T, KT, BCols>(
      reinterpret_cast<float(&)[1][N][4]>(acc), [&](int kk, int, uint32_t* a) { a_frag(kk, a); }, b, ld, lane);
}

}  // namespace ember::cuda
