// Warp-level tensor-core tiles for the 16-bit kernels (attention_flash.cu's
// fused attention, grouped_matmul.cu's grouped GEMMs): mma.m16n8k16
// fragments read from shared-memory tiles by ldmatrix in either
// orientation, and one warp's product over a K range. Header-only, like
// cuda_utils.cuh, whose mma_16816 and ldmatrix_x4 these compose (and whose
// emulation they share).
#pragma once

#include <cstdint>

#include "core/ops/cuda_utils.cuh"

namespace ember::cuda {

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
