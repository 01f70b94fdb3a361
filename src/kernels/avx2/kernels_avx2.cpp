// AVX2 + FMA (+ F16C) kernels. A format is fp32; the bf16 weight pairs are widened in
// registers (even K: shift left 16, odd K: mask the high half).
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "formats/packed_bf16.h"
#include "formats/packed_quant.h"
#include "kernels/kernels.h"

namespace kt {
namespace avx2 {

#include "kernels/sgemm_generic.inc"
#include "kernels/activation_generic.inc"
#include "kernels/quant_generic.inc"

// The unit's own quantized-panel kernels (in place of the generic ones).
#include "kernels/avx2/dequant.inc"
#include "kernels/avx2/gemm_quant.inc"

// Per-group scales of a grouped GEMM (kernels.h, gemm_bf16w_grouped): the
// 16 scales of the tile's panel and group j at scales + 16 j; a group is
// `steps` K steps of the tile (32 K each).
struct GroupScales {
  const float* scales = nullptr;
  int64_t steps = 0;
};

// MR rows x one 16-row panel. The even-K and odd-K products go to separate
// accumulators (4*MR of them), so each accumulator takes one FMA per K pair
// and the FMA latency is covered with only 16 ymm registers: 12 accumulators,
// two widened weight vectors (even halves, then odd halves) and a broadcast.
// `quota` lines of the caller's next region are prefetched on the way.
// Grouped: the registers hold the group's partial sums, and at the end of
// each group C (in L1) takes them times the group's scales, as in the
// AVX-512 kernel. Running sums in registers too leave room for 2 rows only,
// or need the even/odd split folded (FMA latency exposed): on the layer's
// chunks (9-64 rows x K 256 x 4 panels, Zen, one thread) 1.2-1.4x and
// 1.4-2.3x the plain tile's time, against 1.02-1.10x for this one.
template <int MR, bool Grouped>
static inline void tile(const float* const* a, int64_t kp, const bf16_t* w, float* c, int64_t ldc,
                        bool accumulate, PrefetchCursor& next, int64_t quota,
                        const GroupScales& gs) {
  __m256 even[MR][2], odd[MR][2];
  for (int r = 0; r < MR; ++r) even[r][0] = even[r][1] = odd[r][0] = odd[r][1] = _mm256_setzero_ps();
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  constexpr int64_t kStep = 16;  // K pairs per prefetch step (see the AVX-512 tile)
  const int64_t groups = kp / 2;
  const int64_t steps = (groups + kStep - 1) / kStep;
  for (int64_t st = 0; st < steps; ++st) {
    if (quota > 0) next.issue(quota * (st + 1) / steps - quota * st / steps);
    const int64_t g1 = (st + 1) * kStep < groups ? (st + 1) * kStep : groups;
    for (int64_t g = st * kStep; g < g1; ++g) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 32));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 32 + 16));
      const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
      const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
      for (int r = 0; r < MR; ++r) {
        const __m256 a0 = _mm256_broadcast_ss(a[r] + 2 * g);
        even[r][0] = _mm256_fmadd_ps(a0, e0, even[r][0]);
        even[r][1] = _mm256_fmadd_ps(a0, e1, even[r][1]);
      }
      const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, hi_mask));
      const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, hi_mask));
      for (int r = 0; r < MR; ++r) {
        const __m256 a1 = _mm256_broadcast_ss(a[r] + 2 * g + 1);
        odd[r][0] = _mm256_fmadd_ps(a1, o0, odd[r][0]);
        odd[r][1] = _mm256_fmadd_ps(a1, o1, odd[r][1]);
      }
    }
    if constexpr (Grouped) {
      // kp is a multiple of the group, itself of 32: every step is whole.
      if ((st + 1) % gs.steps == 0) {
        const bool fresh = st + 1 == gs.steps && !accumulate;  // C's first group, set not added to
        const float* sj = gs.scales + (st / gs.steps) * kPanelRows;
        const __m256 s_lo = _mm256_loadu_ps(sj), s_hi = _mm256_loadu_ps(sj + 8);
        for (int r = 0; r < MR; ++r) {
          float* cr = c + r * ldc;
          const __m256 lo = _mm256_add_ps(even[r][0], odd[r][0]);
          const __m256 hi = _mm256_add_ps(even[r][1], odd[r][1]);
          const __m256 c_lo = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(cr);
          const __m256 c_hi = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(cr + 8);
          _mm256_storeu_ps(cr, _mm256_fmadd_ps(lo, s_lo, c_lo));
          _mm256_storeu_ps(cr + 8, _mm256_fmadd_ps(hi, s_hi, c_hi));
          even[r][0] = even[r][1] = odd[r][0] = odd[r][1] = _mm256_setzero_ps();
        }
      }
    }
  }
  if constexpr (Grouped) return;
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
    __m256 lo = _mm256_add_ps(even[r][0], odd[r][0]), hi = _mm256_add_ps(even[r][1], odd[r][1]);
    if (accumulate) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(cr));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(cr + 8));
    }
    _mm256_storeu_ps(cr, lo);
    _mm256_storeu_ps(cr + 8, hi);
  }
}

// Per panel, the rows in balanced tiles of at most 3 (as in the AVX-512
// kernel); every tile with another after it (so not decode) prefetches a
// share of the caller's next region.
template <bool Grouped>
static void gemm_panels(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                        int64_t panel_stride, int np, float* c, int64_t ldc, bool accumulate,
                        const PrefetchRegion& region, const float* scales, int64_t scale_stride,
                        int64_t group) {
  constexpr int MR = 3;
  const float* const* a = reinterpret_cast<const float* const*>(a_rows);
  const int tiles = (m + MR - 1) / MR;
  PrefetchCursor next(region);
  const int64_t lines = tiles >= 2 ? region.lines() : 0;
  const int64_t calls = static_cast<int64_t>(np) * tiles;
  int64_t call = 0;
  for (int p = 0; p < np; ++p) {
    const bf16_t* w = panels + p * panel_stride;
    float* cp = c + p * kPanelRows;
    const GroupScales gs{Grouped ? scales + p * scale_stride : nullptr, group / 32};
    for (int t = 0, r = 0; t < tiles; ++t, ++call) {
      const int h = (m - r) / (tiles - t);
      const int64_t quota = lines * (call + 1) / calls - lines * call / calls;
      float* ct = cp + r * ldc;
      switch (h) {
        case 3:
          tile<3, Grouped>(a + r, kp, w, ct, ldc, accumulate, next, quota, gs);
          break;
        case 2:
          tile<2, Grouped>(a + r, kp, w, ct, ldc, accumulate, next, quota, gs);
          break;
        default:
          tile<1, Grouped>(a + r, kp, w, ct, ldc, accumulate, next, quota, gs);
          break;
      }
      r += h;
    }
  }
}

static void gemm_bf16w(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                       int64_t panel_stride, int np, float* c, int64_t ldc, bool accumulate,
                       const PrefetchRegion& region) {
  gemm_panels<false>(a_rows, m, kp, panels, panel_stride, np, c, ldc, accumulate, region, nullptr,
                     0, 0);
}

// Each row's sums go in the same order whatever the tile height: per group
// the even and odd partial sums, their sum, then C's fma.
static void gemm_bf16w_grouped(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                               int64_t panel_stride, int np, const float* scales,
                               int64_t scale_stride, int64_t group, float* c, int64_t ldc,
                               bool accumulate, const PrefetchRegion& region) {
  gemm_panels<true>(a_rows, m, kp, panels, panel_stride, np, c, ldc, accumulate, region, scales,
                    scale_stride, group);
}

}  // namespace avx2

extern const Kernels kernels_avx2 = {
    KT_ISA_AVX2,
    "gemm_bf16w_f32_f32_3x16__avx2_fma",
    4,
    avx2::gemm_bf16w,
    nullptr,
    nullptr,
    avx2::pack_a_f32_copy,
    avx2::sgemm_nn_generic,
    avx2::sgemm_nt_generic,
    avx2::sgemm_tn_generic,
    avx2::transpose_panels_generic,
    avx2::act_forward_generic,
    avx2::act_backward_generic,
    avx2::dequant_i8,
    avx2::dequant_i4,
    avx2::dequant_e4m3,
    avx2::dequant_e2m1,
    avx2::dequant_i4_zero,
    avx2::gemm_bf16w_grouped,
    avx2::gemm_quant,
    // Past these rows dequantizing once into cache and the grouped GEMM
    // take less time (one thread, codes in cache, 8 panels x K 2048: at 3
    // rows int4 g32 1.01x, mxfp4 1.31x; int8 per channel 0.69x still at 4,
    // e4m3 1.16x at 3 and 0.95x at 4).
    4,
    2,
    avx2::gemm_int8_generic,
    false,
};

}  // namespace kt
