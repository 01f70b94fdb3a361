// gemm_bf16w_nn on AVX-512 BF16 (contract in kernels.h): C = A W straight
// from W's panels, the operand gemm_bf16w reads for A W^T, so backward's
// da' and dx need no W^T panels built in cache at few rows.
//
// A panel's 64-byte step holds, in 32-bit lane l, the pair (W[l][k],
// W[l][k + 1]) of its 16 rows at columns k, k + 1. One vpermw per step
// regroups it so that lane j < 8 holds rows (2j, 2j + 1) at column k and
// lane 8 + j the same rows at column k + 1: the pairs then run along the
// rows, the sum's direction. The A operand is the row's 16 values of the
// panel, pairs (2j, 2j + 1) in lane j, broadcast into both halves: a plain
// load, so the one shuffle per step is shared by every row of a tile. Each
// (row, step) sums into its own register over all panels; at the end a
// fixed tree adds each half's 8 lanes into that column's value.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "core/dtype.h"
#include "formats/panels.h"
#include "kernels/generic/nn_driver.h"

namespace kt {
namespace avx512bf16 {

// The most steps (column pairs) and rows of one tile: 8 x 3 sums, the step's
// regrouped weights, the rows' operands and the regrouping index in the 32
// registers.
constexpr int kNnSteps = 8;
constexpr int kNnRows = 3;

// Word w of the regrouped step takes word idx[w] of the stored one: lane j
// (words 2j, 2j + 1) rows 2j, 2j + 1 at the even column (words 4j, 4j + 2),
// lane 8 + j the same rows at the odd column (4j + 1, 4j + 3).
static inline __m512i nn_regroup_index() {
  alignas(64) int16_t idx[32];
  for (int j = 0; j < 8; ++j) {
    idx[2 * j] = static_cast<int16_t>(4 * j);
    idx[2 * j + 1] = static_cast<int16_t>(4 * j + 2);
    idx[16 + 2 * j] = static_cast<int16_t>(4 * j + 1);
    idx[17 + 2 * j] = static_cast<int16_t>(4 * j + 3);
  }
  return _mm512_load_si512(idx);
}

// The 16 columns of sums s[0..kNnSteps): column 2g + h is the sum of the 8
// lanes of half h of s[g], as ((l0 + l2) + (l1 + l3)) + ((l4 + l6) + (l5 +
// l7)) for every column.
static inline __m512 nn_reduce(const __m512 (&s)[kNnSteps]) {
  __m512 u[4];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]),
                         _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
  __m512 v[2];
  for (int i = 0; i < 2; ++i)  // per 128-bit lane: the quarter sums of 4 steps
    v[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // 128-bit lanes: steps 0-3 even columns, steps 0-3 odd, 4-7 even, 4-7 odd.
  const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  return _mm512_permutexvar_ps(order, w);
}

// The micro-tile of the straight driver (generic/nn_driver.h): blocks of
// kNnSteps steps at every height; a pass of 128 steps (256 columns: the
// buffer of a tile's sums, 3 rows x 128 steps x 64 bytes, stays within L1).
struct Avx512NnTile {
  using Row = bf16_t;
  using Reg = __m512;
  static constexpr int kMaxRows = kNnRows;
  template <int MR>
  static constexpr int kSteps = kNnSteps;
  template <int MR>
  static constexpr int kRegs = kNnSteps;
  template <int MR>
  static constexpr int kPassSteps = 128;
  static constexpr int kAheadSteps = 2 * kNnSteps;
  // The panels [p0, p1) of MR rows x S steps from step g0 (the driver's
  // contract): every block is kNnSteps wide, S of them inside the call.
  template <int MR, int SB, int S>
  static void tile(const bf16_t* const* a, const bf16_t* w, int64_t panel_stride, int p0, int p1,
                   int64_t g0, __m512 (*carry)[kNnSteps], bool first, bool last, float* c,
                   int64_t ldc, int n, bool accumulate, const char* fetch_at,
                   int64_t fetch_stride) {
    static_assert(SB == kNnSteps, "one block width");
    const __m512i idx = nn_regroup_index();
    __m512 acc[MR][kNnSteps];
    for (int r = 0; r < MR; ++r)
      for (int g = 0; g < kNnSteps; ++g)
        acc[r][g] = first || g >= S ? _mm512_setzero_ps() : carry[r][g];
    for (int p = p0; p < p1; ++p) {
      const bf16_t* wp = w + p * panel_stride + g0 * 2 * kPanelRows;
      if (fetch_at)
        for (int64_t b = 0; b < S * 64; b += 64)
          _mm_prefetch(fetch_at + (p - p0) * fetch_stride + b, _MM_HINT_T0);
      __m512i av[MR];
      for (int r = 0; r < MR; ++r)
        av[r] = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[r] + p * kPanelRows)));
      for (int g = 0; g < S; ++g) {
        const __m512i wg =
            _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(wp + g * 2 * kPanelRows));
        for (int r = 0; r < MR; ++r)
          acc[r][g] = _mm512_dpbf16_ps(acc[r][g], (__m512bh)av[r], (__m512bh)wg);
      }
    }
    if (!last) {
      for (int r = 0; r < MR; ++r)
        for (int g = 0; g < S; ++g) carry[r][g] = acc[r][g];
      return;
    }
    const __mmask16 keep = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
    for (int r = 0; r < MR; ++r) {
      float* cr = c + r * ldc;
      __m512 sum = nn_reduce(acc[r]);
      if (accumulate) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(keep, cr));
      _mm512_mask_storeu_ps(cr, keep, sum);
    }
  }
};

}  // namespace avx512bf16
}  // namespace kt
