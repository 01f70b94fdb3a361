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
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
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

// Panels per group: a group's panels stream side by side over the call's
// columns, each slice read front to back (few streams, long runs, as the
// forward's tiles read theirs); the sums of each step carry over from group
// to group through an L1 buffer.
constexpr int kNnGroupPanels = 8;
// Steps of one pass (256 columns): the buffer of a tile's sums, 3 rows x 128
// steps x 64 bytes, stays within L1.
constexpr int kNnPassSteps = 128;
// With two row tiles or more, passes of 64 columns: the later tiles read the
// pass again, and its slices then stay in L2.
constexpr int kNnPassStepsTiles = 32;

// The panels [p0, p1) of MR rows x S steps from step g0, on top of the sums
// in `carry` (first: from zero), into `carry` or, for the last group,
// reduced into C (n <= 2 S columns). fetch_at: where the stream of panel p
// fetches the S steps it reads after these, at fetch_at + (p - p0)
// fetch_stride (nullptr: nothing).
template <int MR, int S>
static inline void nn_tile(const bf16_t* const* a, const bf16_t* w, int64_t panel_stride, int p0, int p1, int64_t g0,
                           __m512 (*carry)[kNnSteps], bool first, bool last, float* c, int64_t ldc, int n,
                           bool accumulate, const char* fetch_at, int64_t fetch_stride) {
  const __m512i idx = nn_regroup_index();
  __m512 acc[MR][kNnSteps];
  for (int r = 0; r < MR; ++r)
    for (int g = 0; g < kNnSteps; ++g) acc[r][g] = first || g >= S ? _mm512_setzero_ps() : carry[r][g];
  for (int p = p0; p < p1; ++p) {
    const bf16_t* wp = w + p * panel_stride + g0 * 2 * kPanelRows;
    if (fetch_at)
      for (int64_t b = 0; b < S * 64; b += 64) _mm_prefetch(fetch_at + (p - p0) * fetch_stride + b, _MM_HINT_T0);
    __m512i av[MR];
    for (int r = 0; r < MR; ++r)
      av[r] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[r] + p * kPanelRows)));
    for (int g = 0; g < S; ++g) {
      const __m512i wg = _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(wp + g * 2 * kPanelRows));
      for (int r = 0; r < MR; ++r) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], (__m512bh)av[r], (__m512bh)wg);
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

// One row tile (h rows) over a pass of steps [g0, g0 + steps): the panels in
// groups, each group over the pass's blocks of 8 steps.
template <int MR>
static void nn_rows(const bf16_t* const* a, const bf16_t* w, int64_t panel_stride, int np, int64_t g0, int64_t steps,
                    int64_t n, float* c, int64_t ldc, bool accumulate, bool fetch_next, const PrefetchRegion& next) {
  alignas(64) __m512 carry[kNnPassSteps / kNnSteps][MR][kNnSteps];
  const int64_t blocks = (steps + kNnSteps - 1) / kNnSteps;
  const char* base = reinterpret_cast<const char*>(w);
  const int64_t stride = panel_stride * static_cast<int64_t>(sizeof(bf16_t));
  for (int p0 = 0; p0 < np; p0 += kNnGroupPanels) {
    const int p1 = p0 + kNnGroupPanels < np ? p0 + kNnGroupPanels : np;
    for (int64_t kb = 0; kb < blocks; ++kb) {
      // 2 blocks ahead in each stream; past the pass's end, the next group's
      // heads, and past the last group's, those of `next`.
      const char* fetch_at = nullptr;
      int64_t fetch_stride = stride;
      if (fetch_next) {
        if (kb + 2 < blocks) {
          fetch_at = base + p0 * stride + (g0 + (kb + 2) * kNnSteps) * 64;
        } else if (p1 < np) {
          fetch_at = base + p1 * stride + (g0 + (kb + 2 - blocks) * kNnSteps) * 64;
        } else if (next.base && kb + 2 - blocks == 0) {
          fetch_at = static_cast<const char*>(next.base);
          fetch_stride = next.stride;
        }
      }
      const int64_t j = kb * 2 * kNnSteps;
      const int nb = static_cast<int>(n - j < 2 * kNnSteps ? n - j : 2 * kNnSteps);
      const bool first = p0 == 0, last = p1 == np;
      auto* cy = carry[kb];
      float* cb = c + j;
      switch ((nb + 1) / 2) {
#define KT_NN_CASE(S_)                                                                                           \
  case S_:                                                                                                       \
    nn_tile<MR, S_>(a, w, panel_stride, p0, p1, g0 + kb * kNnSteps, cy, first, last, cb, ldc, nb, accumulate,   \
                    fetch_at, fetch_stride);                                                                     \
    break;
        KT_NN_CASE(8)
        KT_NN_CASE(7)
        KT_NN_CASE(6)
        KT_NN_CASE(5)
        KT_NN_CASE(4)
        KT_NN_CASE(3)
        KT_NN_CASE(2)
        default: KT_NN_CASE(1)
#undef KT_NN_CASE
      }
    }
  }
}

// Passes of up to 256 columns; in each, the rows in balanced tiles of up to
// 3, the first of which fetches ahead (the later ones find the pass's slices
// in cache: with two tiles or more, passes of 64 columns, whose slices stay
// in L2).
static void gemm_bf16w_nn(const void* const* a_rows, int m, const bf16_t* panels, int64_t panel_stride, int np,
                          int64_t c0, int64_t n, float* c, int64_t ldc, bool accumulate, const PrefetchRegion& next) {
  const bf16_t* const* a = reinterpret_cast<const bf16_t* const*>(a_rows);
  const int tiles = (m + kNnRows - 1) / kNnRows;
  const int64_t pass = 2 * (tiles > 1 ? kNnPassStepsTiles : kNnPassSteps);
  for (int64_t j = 0; j < n; j += pass) {
    const int64_t nj = n - j < pass ? n - j : pass;
    const int64_t g0 = (c0 + j) / 2, steps = (nj + 1) / 2;
    const bool last_pass = j + pass >= n;
    for (int t = 0, r = 0; t < tiles; ++t) {
      const int h = (m - r) / (tiles - t);
      const PrefetchRegion& ahead = last_pass ? next : PrefetchRegion{};
      float* cr = c + r * ldc + j;
      switch (h) {
        case 1: nn_rows<1>(a + r, panels, panel_stride, np, g0, steps, nj, cr, ldc, accumulate, t == 0, ahead); break;
        case 2: nn_rows<2>(a + r, panels, panel_stride, np, g0, steps, nj, cr, ldc, accumulate, t == 0, ahead); break;
        default: nn_rows<3>(a + r, panels, panel_stride, np, g0, steps, nj, cr, ldc, accumulate, t == 0, ahead); break;
      }
      r += h;
    }
  }
}

}  // namespace avx512bf16
}  // namespace kt
