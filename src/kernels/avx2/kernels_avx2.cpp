// AVX2 + FMA (+ F16C) kernels. A format is fp32; the bf16 weight pairs are widened in
// registers (even K: shift left 16, odd K: mask the high half).
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "formats/packed_bf16.h"
#include "formats/packed_quant.h"
#include "kernels/avx2/dequant.h"  // the unit's own quantized-panel kernels
#include "kernels/avx2/gemm_int8.h"
#include "kernels/avx2/gemm_nn.h"
#include "kernels/avx2/gemm_quant.h"
#include "kernels/counted.h"
#include "kernels/generic/activation.h"
#include "kernels/generic/quant.h"
#include "kernels/generic/sgemm.h"
#include "kernels/kernels.h"
#include "kernels/update.h"

namespace kt {
namespace avx2 {

using namespace generic;  // the kernels written once, compiled here for AVX2

// Per-group scales of a grouped GEMM (kernels.h, gemm_bf16w_grouped): the
// 16 scales of the tile's panel p and group j at scales + p * stride + 16 j;
// a group is `steps` K steps of the tile (32 K each).
struct GroupScales {
  const float* scales = nullptr;
  int64_t stride = 0;
  int64_t steps = 0;
};

// MR rows x NP 16-row panels (MR * NP <= 5). One accumulator per (row,
// panel, 8 lanes) takes a K pair's even product, then its odd one: one
// chain, so 5 rows make 10 accumulators, two widened weight vectors and a
// broadcast in the 16 ymm registers, and each weight pair widened serves 5
// rows. The chain's two FMAs a pair need 10 accumulators (or 8, just) to
// cover the FMA latency on two pipes: the tiles of 4-5 rows do, decode's
// one row takes 4 panels at a time (8). Earlier even and odd K went to
// separate accumulators, 3 rows at most (12); against that, on AMD Zen3,
// the layer ran 0.90-1.01x the time (bench/README.md, Zen3).
// A panel's sums go in the same order whatever MR and NP: the bits of a row
// do not depend on the tile it is in.
// `quota` lines of the caller's next region are prefetched on the way.
// Grouped: the registers hold the group's partial sums, and at the end of
// each group C (in L1) takes them times the group's scales, as in the
// AVX-512 kernel.
template <int MR, int NP, bool Grouped>
static inline void tile(const float* const* a, int64_t kp, const bf16_t* w, int64_t panel_stride,
                        float* c, int64_t ldc, bool accumulate, PrefetchCursor& next, int64_t quota,
                        bool fetch_ahead, const GroupScales& gs) {
  static_assert(MR * NP <= 5, "16 ymm registers");
  __m256 acc[MR][NP][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  constexpr int64_t kStep = 16;  // K pairs per prefetch step (see the AVX-512 tile)
  const int64_t groups = kp / 2;
  const int64_t steps = (groups + kStep - 1) / kStep;
  for (int64_t st = 0; st < steps; ++st) {
    if (quota > 0) next.issue(quota * (st + 1) / steps - quota * st / steps);
    const int64_t g1 = (st + 1) * kStep < groups ? (st + 1) * kStep : groups;
    for (int64_t g = st * kStep; g < g1; ++g) {
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) {
        const bf16_t* wp = w + p * panel_stride + g * 32;
        if (fetch_ahead) _mm_prefetch(reinterpret_cast<const char*>(wp + 32 * 32), _MM_HINT_T0);
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16));
        const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
        const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m256 a0 = _mm256_broadcast_ss(a[r] + 2 * g);
          acc[r][p][0] = _mm256_fmadd_ps(a0, e0, acc[r][p][0]);
          acc[r][p][1] = _mm256_fmadd_ps(a0, e1, acc[r][p][1]);
        }
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, hi_mask));
        const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, hi_mask));
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m256 a1 = _mm256_broadcast_ss(a[r] + 2 * g + 1);
          acc[r][p][0] = _mm256_fmadd_ps(a1, o0, acc[r][p][0]);
          acc[r][p][1] = _mm256_fmadd_ps(a1, o1, acc[r][p][1]);
        }
      }
    }
    if constexpr (Grouped) {
      // kp is a multiple of the group, itself of 32: every step is whole.
      if ((st + 1) % gs.steps == 0) {
        const bool fresh = st + 1 == gs.steps && !accumulate;  // C's first group, set not added to
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p) {
          const float* sj = gs.scales + p * gs.stride + (st / gs.steps) * kPanelRows;
          const __m256 s_lo = _mm256_loadu_ps(sj), s_hi = _mm256_loadu_ps(sj + 8);
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) {
            float* cr = c + r * ldc + p * kPanelRows;
            const __m256 lo = acc[r][p][0];
            const __m256 hi = acc[r][p][1];
            const __m256 c_lo = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(cr);
            const __m256 c_hi = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(cr + 8);
            _mm256_storeu_ps(cr, _mm256_fmadd_ps(lo, s_lo, c_lo));
            _mm256_storeu_ps(cr + 8, _mm256_fmadd_ps(hi, s_hi, c_hi));
            acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
          }
        }
      }
    }
  }
  if constexpr (Grouped) return;
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      float* cr = c + r * ldc + p * kPanelRows;
      __m256 lo = acc[r][p][0], hi = acc[r][p][1];
      if (accumulate) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(cr));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(cr + 8));
      }
      _mm256_storeu_ps(cr, lo);
      _mm256_storeu_ps(cr + 8, hi);
    }
  }
}

// Per panel, the rows in balanced tiles of at most 5; every tile with
// another after it (so not decode) prefetches a share of the caller's next
// region. One row (decode) takes the panels four at a time: a one-panel row
// tile has 2 accumulators, too few to cover the FMA latency.
template <bool Grouped>
static void gemm_panels(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                        int64_t panel_stride, int np, float* c, int64_t ldc, bool accumulate,
                        const PrefetchRegion& region, const float* scales, int64_t scale_stride,
                        int64_t group) {
  constexpr int MR = 5;
  const float* const* a = reinterpret_cast<const float* const*>(a_rows);
  PrefetchCursor next(region);
  // The first tile of a panel fetches it 2 KiB ahead (the others find it in
  // cache), as the AVX-512 tiles do 1 KiB, and the caller's next region is
  // spread over the tiles as well (kernels.h, gemm_bf16w_fetches_panels).
  // 2 KiB rather than the AVX-512 tiles' 1 KiB: decode ran faster so.
  // Grouped GEMMs run on panels dequantized into cache.
  const bool fetch_ahead = !Grouped;
  if (m == 1) {
    for (int p = 0; p < np;) {
      const GroupScales gs{Grouped ? scales + p * scale_stride : nullptr, scale_stride, group / 32};
      const bf16_t* w = panels + p * panel_stride;
      float* cp = c + p * kPanelRows;
      if (np - p >= 4) {
        tile<1, 4, Grouped>(a, kp, w, panel_stride, cp, ldc, accumulate, next, 0, fetch_ahead, gs);
        p += 4;
      } else if (np - p >= 2) {
        tile<1, 2, Grouped>(a, kp, w, panel_stride, cp, ldc, accumulate, next, 0, fetch_ahead, gs);
        p += 2;
      } else {
        tile<1, 1, Grouped>(a, kp, w, panel_stride, cp, ldc, accumulate, next, 0, fetch_ahead, gs);
        p += 1;
      }
    }
    return;
  }
  const int tiles = (m + MR - 1) / MR;
  const int64_t lines = tiles >= 2 ? region.lines() : 0;
  const int64_t calls = static_cast<int64_t>(np) * tiles;
  int64_t call = 0;
  for (int p = 0; p < np; ++p) {
    const bf16_t* w = panels + p * panel_stride;
    float* cp = c + p * kPanelRows;
    const GroupScales gs{Grouped ? scales + p * scale_stride : nullptr, scale_stride, group / 32};
    for (int t = 0, r = 0; t < tiles; ++t, ++call) {
      const int h = (m - r) / (tiles - t);
      const int64_t quota = lines * (call + 1) / calls - lines * call / calls;
      float* ct = cp + r * ldc;
      switch (h) {
        case 5:
          tile<5, 1, Grouped>(a + r, kp, w, panel_stride, ct, ldc, accumulate, next, quota,
                              fetch_ahead && t == 0, gs);
          break;
        case 4:
          tile<4, 1, Grouped>(a + r, kp, w, panel_stride, ct, ldc, accumulate, next, quota,
                              fetch_ahead && t == 0, gs);
          break;
        case 3:
          tile<3, 1, Grouped>(a + r, kp, w, panel_stride, ct, ldc, accumulate, next, quota,
                              fetch_ahead && t == 0, gs);
          break;
        case 2:
          tile<2, 1, Grouped>(a + r, kp, w, panel_stride, ct, ldc, accumulate, next, quota,
                              fetch_ahead && t == 0, gs);
          break;
        default:
          tile<1, 1, Grouped>(a + r, kp, w, panel_stride, ct, ldc, accumulate, next, quota,
                              fetch_ahead && t == 0, gs);
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
// one chain over its K pairs (even, then odd), then C's fma.
static void gemm_bf16w_grouped(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                               int64_t panel_stride, int np, const float* scales,
                               int64_t scale_stride, int64_t group, float* c, int64_t ldc,
                               bool accumulate, const PrefetchRegion& region) {
  gemm_panels<true>(a_rows, m, kp, panels, panel_stride, np, c, ldc, accumulate, region, scales,
                    scale_stride, group);
}

// W^T panels (kernels.h, transpose_panels) by 4x4 transposes of 64-bit 2x2
// blocks, as the AVX-512 kernel's 8x8: the 8 pair groups of a source panel
// that cover 16 columns hold, qword j, the block of rows (2j, 2j+1) x
// columns (2g, 2g+1); destination group j takes, qword i, the block of
// source group i, once a byte shuffle swaps the middle halves of each block
// (see the portable version). The generic version's 8-byte moves took more
// time than the backward's GEMMs on the AVX2 path.
static void transpose_panels(const bf16_t* packed, int64_t np, int64_t panel_stride, int64_t c0,
                             int64_t cb, bf16_t* dst) {
  constexpr int64_t kGroup = 2 * kPanelRows;  // bf16 of one pair group
  // Byte order [0,1,4,5,2,3,6,7] within each qword.
  const __m256i swap = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15, 0, 1,
                                        4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
  transpose_panels_by_blocks(
      packed, np, panel_stride, c0, cb, dst, [&](const bf16_t* src, bf16_t* o) {
        // Source groups 4I..4I+3, qwords 4J..4J+3 -> destination groups
        // 4J..4J+3, qwords 4I..4I+3.
        for (int I = 0; I < 2; ++I)
          for (int J = 0; J < 2; ++J) {
            __m256i x[4];
            for (int i = 0; i < 4; ++i)
              x[i] = _mm256_loadu_si256(
                  reinterpret_cast<const __m256i*>(src + (4 * I + i) * kGroup + 16 * J));
            const __m256i t0 = _mm256_unpacklo_epi64(x[0], x[1]),
                          t1 = _mm256_unpackhi_epi64(x[0], x[1]);
            const __m256i t2 = _mm256_unpacklo_epi64(x[2], x[3]),
                          t3 = _mm256_unpackhi_epi64(x[2], x[3]);
            const __m256i y[4] = {
                _mm256_permute2x128_si256(t0, t2, 0x20), _mm256_permute2x128_si256(t1, t3, 0x20),
                _mm256_permute2x128_si256(t0, t2, 0x31), _mm256_permute2x128_si256(t1, t3, 0x31)};
            for (int j = 0; j < 4; ++j)
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + (4 * J + j) * kGroup + 16 * I),
                                  _mm256_shuffle_epi8(y[j], swap));
          }
      });
}

}  // namespace avx2

// Entries that run a GEMM count their calls (kernels/counted.h).
constexpr KernelTable kTable = KernelTable::kAvx2;
using E = KernelEntry;

constexpr Kernels make_kernels_avx2() {
  Kernels k;
  k.isa = KT_ISA_AVX2;
  k.gemm_name = "gemm_bf16w_f32_f32_5x16__avx2_fma";
  k.a_elem_size = sizeof(float);
  k.gemm_bf16w = counted<kTable, E::kGemmBf16w, avx2::gemm_bf16w>;
  // gemm_zip_bf16, zip_rows_bf16: none (the A format is fp32).
  k.pack_a_f32 = avx2::pack_a_f32_copy;
  k.sgemm_nn = counted<kTable, E::kSgemmNn, avx2::sgemm_nn_generic>;
  k.sgemm_nt = counted<kTable, E::kSgemmNt, avx2::sgemm_nt_generic>;
  k.sgemm_tn = counted<kTable, E::kSgemmTn, avx2::sgemm_tn_generic>;
  k.transpose_panels = counted<kTable, E::kTransposePanels, avx2::transpose_panels>;
  k.act_forward = avx2::act_forward_generic;
  k.act_backward = avx2::act_backward_generic;
  k.dequant_i8 = avx2::dequant_i8;
  k.dequant_i4 = avx2::dequant_i4;
  k.dequant_e4m3 = avx2::dequant_e4m3;
  k.dequant_e2m1 = avx2::dequant_e2m1;
  k.dequant_i4_zero = avx2::dequant_i4_zero;
  k.gemm_bf16w_grouped = counted<kTable, E::kGemmBf16wGrouped, avx2::gemm_bf16w_grouped>;
  k.gemm_quant = counted<kTable, E::kGemmQuant, avx2::gemm_quant>;
  k.gemm_int8 = counted<kTable, E::kGemmInt8, avx2::gemm_int8>;
  k.optimizer = &optim::avx2::kKernels;
  // Past these rows dequantizing once into cache and the grouped GEMM take
  // less time (bench/README.md, kernels): 8-bit codes expand to fp32 per
  // row tile (e4m3 through half precision; measured apart, it does best
  // at 4 rows, int8 at 8); 4-bit codes, which go as offset words, expand
  // cheaper, but the 5-row bf16 tiles on the dequantized panels win from 5.
  k.gemm_quant_rows_int8 = 8;
  k.gemm_quant_rows_e4m3 = 4;
  k.gemm_quant_rows_4bit = 4;
  k.gemm_bf16w_nn = counted<kTable, E::kGemmBf16wNn, generic::nn_gemm<avx2::Avx2NnTile>>;
  // Backward reads W's panels straight (gemm_bf16w_nn) up to this many rows
  // of an expert; past them it builds W^T panels (bench/README.md).
  k.gemm_bf16w_nn_rows = 8;
  // The tiles read each row through its pointer and fetch only the caller's
  // next region.
  k.gemm_bf16w_fetches_panels = false;
  k.gemm_reads_spaced_rows = false;
  return k;
}

// Constant-initialised (a constant expression, so no AVX2 code runs while
// the library loads): complete before any code that runs then reads it.
constexpr Kernels kKernelsAvx2 = make_kernels_avx2();
extern const Kernels kernels_avx2 = kKernelsAvx2;

// The same kernels as a CPU without AVX-VNNI runs them (int8 activations
// by vpmaddubsw and vpmaddwd), for the tests to run both wherever it is.
constexpr Kernels make_kernels_avx2_no_vnni() {
  Kernels k = kKernelsAvx2;
  k.gemm_int8 = counted<kTable, E::kGemmInt8, avx2::gemm_int8_no_vnni>;
  return k;
}
constexpr Kernels kKernelsAvx2NoVnni = make_kernels_avx2_no_vnni();
extern const Kernels kernels_avx2_no_vnni = kKernelsAvx2NoVnni;

}  // namespace kt
