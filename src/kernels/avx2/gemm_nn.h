// gemm_bf16w_nn on AVX2 + FMA (contract in kernels.h): C = A W straight
// from W's panels, the operand gemm_bf16w reads for A W^T, so backward's
// da' and dx need no W^T panels built in cache at few rows.
//
// A panel's 64-byte step holds, in 32-bit lane l, the pair (W[l][k],
// W[l][k + 1]) of its 16 rows at columns k, k + 1: two registers of 8 rows,
// widened as the forward's tile widens them (even column: shift left 16,
// odd column: the high half masked). The A operand is the row's 16 fp32
// values of the panel in the same two halves, so the products run along
// W's rows, the sum's direction, with no shuffle: each (row, column) sums
// into its own register of 8 lanes over all panels (lanes 0-7, then 8-15,
// of each panel in turn), and at the end a fixed tree adds the 8 lanes.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "core/dtype.h"
#include "formats/panels.h"
#include "kernels/generic/nn_driver.h"

namespace kt {
namespace avx2 {

// The 8 columns of sums s[0..8) (s[2g + h]: step g, column h): each the
// sum of its register's 8 lanes, as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) +
// (l6 + l7)) for every column.
static inline __m256 nn_reduce(const __m256 (&s)[8]) {
  const __m256 h01 = _mm256_hadd_ps(s[0], s[1]), h23 = _mm256_hadd_ps(s[2], s[3]);
  const __m256 h45 = _mm256_hadd_ps(s[4], s[5]), h67 = _mm256_hadd_ps(s[6], s[7]);
  // 128-bit halves: (s0..s3 of lanes 0-3), (s0..s3 of lanes 4-7); likewise s4..s7.
  const __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

// The micro-tile of the straight driver (generic/nn_driver.h). A block is
// 4 steps for one row, 2 for two, 1 for three or four rows, so that the
// sums (two registers per row and step), the rows' operands (or their
// loads, at four rows) and a step's four widened halves fit in the 16
// registers.
struct Avx2NnTile {
  using Row = float;
  using Reg = __m256;
  static constexpr int kMaxRows = 4;
  template <int MR>
  static constexpr int kSteps = MR == 1   ? 4
                                : MR == 2 ? 2
                                          : 1;
  template <int MR>
  static constexpr int kRegs = 2 * kSteps<MR>;
  // 256 columns (a tile's carried sums, 16 KiB at two rows, within L1);
  // 128 from three rows.
  template <int MR>
  static constexpr int kPassSteps = MR <= 2 ? 128 : 64;
  // 256 bytes: 512 ran 3 % slower at T=32, 1 KiB 6 % slower at decode and
  // 2 KiB slower still (kt_ab, bench/README.md): more lines in flight
  // crowd the streams' own.
  static constexpr int kAheadSteps = 4;
  // The panels [p0, p1) of MR rows x S steps from step g0 (a block of SB
  // steps, S <= SB of them inside the call's columns), on top of the sums in
  // `carry` (first: from zero), into `carry` or, for the last group, reduced
  // into C (n <= 2 S columns). fetch_at: where the stream of panel p fetches
  // the S steps it reads later, at fetch_at + (p - p0) fetch_stride (nullptr:
  // nothing).
  template <int MR, int SB, int S>
  static void tile(const float* const* a, const bf16_t* w, int64_t panel_stride, int p0, int p1,
                   int64_t g0, __m256 (*carry)[2 * SB], bool first, bool last, float* c,
                   int64_t ldc, int n, bool accumulate, const char* fetch_at,
                   int64_t fetch_stride) {
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    __m256 acc[MR][2 * S];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int i = 0; i < 2 * S; ++i) acc[r][i] = first ? _mm256_setzero_ps() : carry[r][i];
    static_assert(S <= SB, "a block's steps");
    for (int p = p0; p < p1; ++p) {
      const bf16_t* wp = w + p * panel_stride + g0 * 2 * kPanelRows;
      if (fetch_at)
#pragma GCC unroll 4
        for (int g = 0; g < S; ++g)
          _mm_prefetch(fetch_at + (p - p0) * fetch_stride + g * 64, _MM_HINT_T0);
      __m256 lo[MR], hi[MR];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        lo[r] = _mm256_loadu_ps(a[r] + p * kPanelRows);
        hi[r] = _mm256_loadu_ps(a[r] + p * kPanelRows + 8);
      }
#pragma GCC unroll 4
      for (int g = 0; g < S; ++g) {
        const __m256i v0 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + g * 2 * kPanelRows));
        const __m256i v1 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + g * 2 * kPanelRows + 16));
        const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
        const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, hi_mask));
        const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, hi_mask));
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          acc[r][2 * g] = _mm256_fmadd_ps(hi[r], e1, _mm256_fmadd_ps(lo[r], e0, acc[r][2 * g]));
          acc[r][2 * g + 1] =
              _mm256_fmadd_ps(hi[r], o1, _mm256_fmadd_ps(lo[r], o0, acc[r][2 * g + 1]));
        }
      }
    }
    if (!last) {
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
        for (int i = 0; i < 2 * S; ++i) carry[r][i] = acc[r][i];
      return;
    }
    for (int r = 0; r < MR; ++r) {
      __m256 s[8];
      for (int i = 0; i < 8; ++i) s[i] = i < 2 * S ? acc[r][i] : _mm256_setzero_ps();
      __m256 sum = nn_reduce(s);
      float* cr = c + r * ldc;
      if (n == 8) {
        if (accumulate) sum = _mm256_add_ps(sum, _mm256_loadu_ps(cr));
        _mm256_storeu_ps(cr, sum);
      } else {
        alignas(32) float out[8];
        _mm256_store_ps(out, sum);
        for (int j = 0; j < n; ++j) cr[j] = accumulate ? cr[j] + out[j] : out[j];
      }
    }
  }
};

}  // namespace avx2
}  // namespace kt
