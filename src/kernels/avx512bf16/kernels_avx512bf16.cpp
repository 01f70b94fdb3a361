// AVX-512 BF16 kernels: vdpbf16ps on bf16 pairs along K. A format is bf16
// (activations rounded to nearest even once, when packed); fp32 accumulate.
#include <immintrin.h>

#include <cmath>
#include <type_traits>

#include "formats/packed_bf16.h"
#include "formats/packed_quant.h"
#include "kernels/avx512bf16/dequant.h"  // the unit's own quantized-panel kernels
#include "kernels/avx512bf16/gemm_int8.h"
#include "kernels/avx512bf16/gemm_nn.h"
#include "kernels/avx512bf16/gemm_quant.h"
#include "kernels/counted.h"
#include "kernels/generic/activation.h"
#include "kernels/generic/quant.h"
#include "kernels/generic/sgemm.h"
#include "kernels/kernels.h"
#include "kernels/update.h"

namespace kt {
namespace avx512bf16 {

using namespace generic;  // the kernels written once, compiled here for AVX-512

// Per-group scales of a grouped GEMM (kernels.h, gemm_bf16w_grouped): the
// scale vector of panel p and group j is at scales + p * stride + 16 j; a
// group is `steps` K steps of the tile.
struct GroupScales {
  const float* scales = nullptr;
  int64_t stride = 0;
  int64_t steps = 0;
};

// MR rows x NP panels of 16: MR*NP accumulators (<= 24) + NP weight vectors.
// Alongside, `quota` lines of the caller's next region are prefetched evenly
// over the K loop. Grouped: the registers hold the group's partial sums, and
// at the end of each group C (in L1) takes them times the group's scale, so
// the tile stays as large as the plain one.
template <int MR, int NP, bool Grouped>
static inline void tile(const bf16_t* const* a, int64_t kp, const bf16_t* w, int64_t panel_stride,
                        float* c, int64_t ldc, bool accumulate, PrefetchCursor& next, int64_t quota,
                        const GroupScales& gs) {
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  // The K loop runs in steps of kStep groups; the prefetch lines of a step
  // are issued before it, so the inner loop keeps its registers for the
  // row pointers and accumulators.
  constexpr int64_t kStep = 16;
  const int64_t groups = kp / 2;
  const int64_t steps = (groups + kStep - 1) / kStep;
  for (int64_t st = 0; st < steps; ++st) {
    if (quota > 0) {
      const int64_t n = quota * (st + 1) / steps - quota * st / steps;
      next.issue(n);
    }
    const int64_t g1 = (st + 1) * kStep < groups ? (st + 1) * kStep : groups;
    for (int64_t g = st * kStep; g < g1; ++g) {
      __m512bh b[NP];
      for (int p = 0; p < NP; ++p) {
        // The weights stream from DRAM with little compute to hide it at
        // decode and small batches: every tile, not only one-row ones,
        // fetches 1 KiB ahead of the hardware prefetcher. The distance is
        // tuned: half and twice it both ran slower (bench/README.md).
        if (!Grouped)
          _mm_prefetch(reinterpret_cast<const char*>(w + p * panel_stride + (g + 16) * 32), _MM_HINT_T0);
        b[p] = (__m512bh)_mm512_loadu_si512(w + p * panel_stride + g * 32);
      }
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        __builtin_memcpy(&pair, a[r] + 2 * g, 4);
        const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
        for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], av, b[p]);
      }
    }
    if constexpr (Grouped) {
      if ((st + 1) % gs.steps == 0) {
        const bool first = st + 1 == gs.steps;
        const float* sj = gs.scales + (st / gs.steps) * kPanelRows;
        for (int p = 0; p < NP; ++p) {
          const __m512 sv = _mm512_loadu_ps(sj + p * gs.stride);
          for (int r = 0; r < MR; ++r) {
            float* cr = c + r * ldc + 16 * p;
            const __m512 sum = first && !accumulate ? _mm512_setzero_ps() : _mm512_loadu_ps(cr);
            _mm512_storeu_ps(cr, _mm512_fmadd_ps(acc[r][p], sv, sum));
            acc[r][p] = _mm512_setzero_ps();
          }
        }
      }
    }
  }
  if constexpr (Grouped) return;
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
    for (int p = 0; p < NP; ++p) {
      if (accumulate) acc[r][p] = _mm512_add_ps(acc[r][p], _mm512_loadu_ps(cr + 16 * p));
      _mm512_storeu_ps(cr + 16 * p, acc[r][p]);
    }
  }
}

// One tile of h rows, 1 <= h <= R.
template <int NP, int R, bool Grouped>
static void tile_of_height(int h, const bf16_t* const* a, int64_t kp, const bf16_t* w, int64_t panel_stride,
                           float* c, int64_t ldc, bool accumulate, PrefetchCursor& next, int64_t quota,
                           const GroupScales& gs) {
  if constexpr (R > 0) {
    if (h == R) {
      tile<R, NP, Grouped>(a, kp, w, panel_stride, c, ldc, accumulate, next, quota, gs);
    } else {
      tile_of_height<NP, R - 1, Grouped>(h, a, kp, w, panel_stride, c, ldc, accumulate, next, quota, gs);
    }
  }
}

// The rows go in ceil(m / MR) tiles of balanced height (32 rows: 5,5,5,5,6,6
// rather than 6,6,6,6,6,2): a low tile has too few accumulators to cover the
// dot-product latency yet streams the panels as often as a full one.
// With two tiles or more, the first streams the panels from memory and the
// others find them in cache. From kMinPrefetchRows rows on, every tile also
// prefetches the caller's next region, a share each: backward's dx and da'
// build their W^T panels from it, the heads of a slice of every panel, which
// the transposes then read on from (WeightOperand::transposed_block). Fewer
// rows make too short a call: the fetches crowd L1 (fwd+bwd dx T=1 1.03x the
// time). A call that streams its own panels passes none
// (gemm_bf16w_fetches_panels).
constexpr int kMinPrefetchRows = 4;

// Rows of a full tile of NP panels: MR * NP accumulators (<= 24 with 4
// panels, 16 from 2 panels on to keep the dot products' latency covered).
constexpr int tile_rows(int np) { return np == 4 ? 6 : np == 3 ? 8 : np == 2 ? 12 : 16; }

// Panels per group of a call of m rows: up to kGemmSingleTileRows rows, the
// most panels whose tile holds every row, so the panels stream once, with
// every row's products to hide the stream. (At 8 rows, two tiles of 4 rows
// by 4 panels ran the first at the memory's pace and the second from L2 at
// the dot products': forward T=128 took 1.08x the time of one 8 x 3 tile.)
// Past that, 4 panels: more rows gained nothing measurable (bench/README.md).
static int panels_per_group(int m) {
  for (int np = 4; np >= 1; --np)
    if (m <= tile_rows(np)) return np;
  return 4;
}

template <int NP, bool Grouped>
static void rows(const bf16_t* const* a, int m, int64_t kp, const bf16_t* w, int64_t panel_stride,
                 float* c, int64_t ldc, bool accumulate, PrefetchCursor& next, int64_t lines,
                 const GroupScales& gs) {
  constexpr int MR = tile_rows(NP);
  static_assert(MR <= kGemmSingleTileRows, "kernels.h: the most rows of one tile");
  const int tiles = (m + MR - 1) / MR;
  if (m < kMinPrefetchRows) lines = 0;
  for (int t = 0, r = 0; t < tiles; ++t) {
    const int h = (m - r) / (tiles - t);
    const int64_t quota = lines * (t + 1) / tiles - lines * t / tiles;
    if (h == MR) {
      tile<MR, NP, Grouped>(a + r, kp, w, panel_stride, c + r * ldc, ldc, accumulate, next, quota, gs);
    } else {
      tile_of_height<NP, MR - 1, Grouped>(h, a + r, kp, w, panel_stride, c + r * ldc, ldc, accumulate, next, quota,
                                          gs);
    }
    r += h;
  }
}

template <bool Grouped>
static void gemm_panels(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels, int64_t panel_stride,
                        int np, float* c, int64_t ldc, bool accumulate, const PrefetchRegion& region,
                        const GroupScales& gs) {
  const bf16_t* const* a = reinterpret_cast<const bf16_t* const*>(a_rows);
  PrefetchCursor next(region);
  const int64_t lines = region.lines();
  // The calls over column groups each take a share of the prefetch.
  const int per_group = panels_per_group(m);
  const int groups = (np + per_group - 1) / per_group;
  int p = 0;
  for (int gi = 0; p < np; ++gi) {
    const int n = np - p >= per_group ? per_group : np - p;
    const int64_t share = lines * (gi + 1) / groups - lines * gi / groups;
    const bf16_t* w = panels + p * panel_stride;
    float* cp = c + p * kPanelRows;
    GroupScales g = gs;
    g.scales = gs.scales ? gs.scales + p * gs.stride : nullptr;
    switch (n) {
      case 4: rows<4, Grouped>(a, m, kp, w, panel_stride, cp, ldc, accumulate, next, share, g); break;
      case 3: rows<3, Grouped>(a, m, kp, w, panel_stride, cp, ldc, accumulate, next, share, g); break;
      case 2: rows<2, Grouped>(a, m, kp, w, panel_stride, cp, ldc, accumulate, next, share, g); break;
      default: rows<1, Grouped>(a, m, kp, w, panel_stride, cp, ldc, accumulate, next, share, g); break;
    }
    p += n;
  }
}

static void gemm_bf16w(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                       int64_t panel_stride, int np, float* c, int64_t ldc, bool accumulate,
                       const PrefetchRegion& region) {
  gemm_panels<false>(a_rows, m, kp, panels, panel_stride, np, c, ldc, accumulate, region, GroupScales{});
}

static void gemm_bf16w_grouped(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                               int64_t panel_stride, int np, const float* scales, int64_t scale_stride,
                               int64_t group, float* c, int64_t ldc, bool accumulate, const PrefetchRegion& region) {
  gemm_panels<true>(a_rows, m, kp, panels, panel_stride, np, c, ldc, accumulate, region,
                    GroupScales{scales, scale_stride, group / 32});
}

// ---- fp32 GEMMs (LoRA projections and gradients): register tiles of fp32
// FMAs; column tails by masks. Rows of C are independent of how many rows a
// call gets, so results do not depend on the work split.

static inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

// C[MR rows, NV vectors of 16 columns (the last masked by `last`)] (=|+=)
// sum over p < k of a_at(r, p) * b_row(p)[columns]: the tile stays in
// registers over the whole reduction. sgemm_nn and sgemm_tn differ only in
// where a(r, p) and the rows of B are.
template <int MR, int NV, class AAt, class BRow>
static inline void outer_tile(int k, AAt a_at, BRow b_row, float* c, int64_t ldc, bool accumulate, __mmask16 last) {
  __m512 acc[MR][NV];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 16
    for (int v = 0; v < NV; ++v)
      acc[r][v] = accumulate ? _mm512_maskz_loadu_ps(v == NV - 1 ? last : 0xffff, c + r * ldc + 16 * v)
                             : _mm512_setzero_ps();
  for (int p = 0; p < k; ++p) {
    const float* bp = b_row(p);
    __m512 bv[NV];
    #pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) bv[v] = _mm512_maskz_loadu_ps(v == NV - 1 ? last : 0xffff, bp + 16 * v);
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 av = _mm512_set1_ps(a_at(r, p));
      #pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) _mm512_mask_storeu_ps(c + r * ldc + 16 * v, v == NV - 1 ? last : 0xffff, acc[r][v]);
}

template <int MR, int NV>
static inline void nn_tile(int k, const float* const* a_rows, const float* b, int64_t ldb, float* c, int64_t ldc,
                           bool accumulate, __mmask16 last) {
  outer_tile<MR, NV>(
      k, [&](int r, int p) { return a_rows[r][p]; }, [&](int p) { return b + p * ldb; }, c, ldc, accumulate, last);
}

template <int MR>
static inline void nn_rows(int n, int k, const float* const* a_rows, const float* b, int64_t ldb, float* c,
                           int64_t ldc, bool accumulate) {
  for (int j = 0; j < n; j += 64) {
    const int w = n - j < 64 ? n - j : 64;
    const int nv = (w + 15) / 16;
    const __mmask16 last = tail_mask(w - 16 * (nv - 1));
    switch (nv) {
      case 4: nn_tile<MR, 4>(k, a_rows, b + j, ldb, c + j, ldc, accumulate, last); break;
      case 3: nn_tile<MR, 3>(k, a_rows, b + j, ldb, c + j, ldc, accumulate, last); break;
      case 2: nn_tile<MR, 2>(k, a_rows, b + j, ldb, c + j, ldc, accumulate, last); break;
      default: nn_tile<MR, 1>(k, a_rows, b + j, ldb, c + j, ldc, accumulate, last); break;
    }
  }
}

static void sgemm_nn(int m, int n, int k, const float* const* a_rows, const float* b, int64_t ldb, float* c,
                     int64_t ldc, bool accumulate) {
  int r = 0;
  for (; r + 4 <= m; r += 4) nn_rows<4>(n, k, a_rows + r, b, ldb, c + r * ldc, ldc, accumulate);
  for (; r < m; ++r) nn_rows<1>(n, k, a_rows + r, b, ldb, c + r * ldc, ldc, accumulate);
}

// C[r, j] = dot(a_rows[r], B[j]) over k: MR x NJ accumulators of 16 partial
// sums along k, reduced at the end.
template <int MR, int NJ>
static inline void nt_tile(int k, const float* const* a_rows, const float* b, int64_t ldb, float* c, int64_t ldc,
                           bool accumulate) {
  __m512 acc[MR][NJ];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 16
    for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int p = 0; p < k; p += 16) {
    const __mmask16 mk = tail_mask(k - p);
    __m512 av[MR];
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) av[r] = _mm512_maskz_loadu_ps(mk, a_rows[r] + p);
    #pragma GCC unroll 16
    for (int j = 0; j < NJ; ++j) {
      const __m512 bv = _mm512_maskz_loadu_ps(mk, b + j * ldb + p);
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) acc[r][j] = _mm512_fmadd_ps(av[r], bv, acc[r][j]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 16
    for (int j = 0; j < NJ; ++j) {
      const float sum = _mm512_reduce_add_ps(acc[r][j]);
      c[r * ldc + j] = accumulate ? c[r * ldc + j] + sum : sum;
    }
}

template <int MR>
static inline void nt_rows(int n, int k, const float* const* a_rows, const float* b, int64_t ldb, float* c,
                           int64_t ldc, bool accumulate) {
  int j = 0;
  for (; j + 4 <= n; j += 4) nt_tile<MR, 4>(k, a_rows, b + j * ldb, ldb, c + j, ldc, accumulate);
  for (; j < n; ++j) nt_tile<MR, 1>(k, a_rows, b + j * ldb, ldb, c + j, ldc, accumulate);
}

// 4 rows x 4 columns a tile: each B row read per 4 rows of A. Tiles of
// 2 x 8 read all of B per pair of rows, which at LoRA's n = r = 16 and
// k = H lies past L1 (kt_kernel_bench's LoRA section).
static void sgemm_nt(int m, int n, int k, const float* const* a_rows, const float* b, int64_t ldb, float* c,
                     int64_t ldc, bool accumulate) {
  int r = 0;
  for (; r + 4 <= m; r += 4) nt_rows<4>(n, k, a_rows + r, b, ldb, c + r * ldc, ldc, accumulate);
  for (; r + 2 <= m; r += 2) nt_rows<2>(n, k, a_rows + r, b, ldb, c + r * ldc, ldc, accumulate);
  for (; r < m; ++r) nt_rows<1>(n, k, a_rows + r, b, ldb, c + r * ldc, ldc, accumulate);
}

// C[i, cols] (=|+=) sum over the k rows r of A[r, i] * B_r[cols].
template <int MR, int NV>
static inline void tn_tile(int k, const float* a, int64_t lda, const float* const* b_rows, int64_t j, float* c,
                           int64_t ldc, bool accumulate, __mmask16 last) {
  outer_tile<MR, NV>(
      k, [&](int i, int r) { return a[r * lda + i]; }, [&](int r) { return b_rows[r] + j; }, c, ldc, accumulate,
      last);
}

// Blocks of 32 columns, all rows of C under each: the block's k x 32 slice
// of B stays in L1 across the row tiles, and the k rows of B are each read
// once, front to back (prefetched a few blocks ahead: the rows are many
// separate streams).
static void sgemm_tn(int m, int n, int k, const float* a, int64_t lda, const float* const* b_rows, float* c,
                     int64_t ldc, bool accumulate) {
  for (int j = 0; j < n; j += 32) {
    const int w = n - j < 32 ? n - j : 32;
    const __mmask16 last = tail_mask(w > 16 ? w - 16 : w);
    if (j + 128 < n)
      for (int r = 0; r < k; ++r) _mm_prefetch(reinterpret_cast<const char*>(b_rows[r] + j + 128), _MM_HINT_T0);
    int i = 0;
    if (w > 16) {
      for (; i + 8 <= m; i += 8) tn_tile<8, 2>(k, a + i, lda, b_rows, j, c + i * ldc + j, ldc, accumulate, last);
      for (; i + 4 <= m; i += 4) tn_tile<4, 2>(k, a + i, lda, b_rows, j, c + i * ldc + j, ldc, accumulate, last);
      for (; i < m; ++i) tn_tile<1, 2>(k, a + i, lda, b_rows, j, c + i * ldc + j, ldc, accumulate, last);
    } else {
      for (; i + 8 <= m; i += 8) tn_tile<8, 1>(k, a + i, lda, b_rows, j, c + i * ldc + j, ldc, accumulate, last);
      for (; i + 4 <= m; i += 4) tn_tile<4, 1>(k, a + i, lda, b_rows, j, c + i * ldc + j, ldc, accumulate, last);
      for (; i < m; ++i) tn_tile<1, 1>(k, a + i, lda, b_rows, j, c + i * ldc + j, ldc, accumulate, last);
    }
  }
}

// Weight gradients: MR rows of D x NP panels of Z, both zipped (kernels.h).
template <int MR, int NP>
static inline void zip_tile(const bf16_t* d, int64_t ldd, const bf16_t* z, int64_t ldz, int64_t groups, float* c,
                            int64_t ldc, bool accumulate, float scale, bool stream) {
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512bh b[NP];
    for (int p = 0; p < NP; ++p) b[p] = (__m512bh)_mm512_loadu_si512(z + g * ldz + p * 32);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      __builtin_memcpy(&pair, d + g * ldd + 2 * r, 4);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], av, b[p]);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
    for (int p = 0; p < NP; ++p) {
      __m512 v = _mm512_mul_ps(acc[r][p], s);
      if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(cr + 16 * p));
      if (stream) {
        _mm512_stream_ps(cr + 16 * p, v);
      } else {
        _mm512_storeu_ps(cr + 16 * p, v);
      }
    }
  }
}

template <int NP, int R>
static void zip_tile_of_height(int h, const bf16_t* d, int64_t ldd, const bf16_t* z, int64_t ldz, int64_t groups,
                               float* c, int64_t ldc, bool accumulate, float scale, bool stream) {
  if constexpr (R > 0) {
    if (h == R) {
      zip_tile<R, NP>(d, ldd, z, ldz, groups, c, ldc, accumulate, scale, stream);
    } else {
      zip_tile_of_height<NP, R - 1>(h, d, ldd, z, ldz, groups, c, ldc, accumulate, scale, stream);
    }
  }
}

// Z columns in groups of 4 panels (a few KB per group of rows, in L1); the
// m rows of D in balanced tiles under them.
static void gemm_zip_bf16(const bf16_t* d, int64_t ldd, int m, const bf16_t* z, int64_t ldz, int np, int64_t groups,
                          float* c, int64_t ldc, bool accumulate, float scale, bool stream) {
  constexpr int MR = 6;
  // Streaming stores need every C row 64-byte aligned.
  stream = stream && reinterpret_cast<uintptr_t>(c) % 64 == 0 && (ldc * sizeof(float)) % 64 == 0;
  const int tiles = (m + MR - 1) / MR;
  for (int p = 0; p < np; p += 4) {
    const int n = np - p >= 4 ? 4 : np - p;
    for (int t = 0, r = 0; t < tiles; ++t) {
      const int h = (m - r) / (tiles - t);
      const bf16_t* dr = d + 2 * r;
      const bf16_t* zp = z + p * 32;
      float* cr = c + r * ldc + p * kPanelRows;
      switch (n) {
        case 4: zip_tile_of_height<4, MR>(h, dr, ldd, zp, ldz, groups, cr, ldc, accumulate, scale, stream); break;
        case 3: zip_tile_of_height<3, MR>(h, dr, ldd, zp, ldz, groups, cr, ldc, accumulate, scale, stream); break;
        case 2: zip_tile_of_height<2, MR>(h, dr, ldd, zp, ldz, groups, cr, ldc, accumulate, scale, stream); break;
        default: zip_tile_of_height<1, MR>(h, dr, ldd, zp, ldz, groups, cr, ldc, accumulate, scale, stream); break;
      }
      r += h;
    }
  }
  // Streaming stores are weakly ordered: make them visible before the
  // caller signals that C is done.
  if (stream) _mm_sfence();
}

// Round to nearest even (vcvtne2ps2bf16) and interleave the two rows.
static void zip_rows_bf16(const float* r0, const float* r1, int64_t n, bf16_t* dst) {
  // Element i takes r0[i/2] (even i) or r1[i/2] (odd i).
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24,
                                         8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 b = r1 ? _mm512_loadu_ps(r1 + j) : _mm512_setzero_ps();
    // Low half from r0, high half from r1.
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, _mm512_loadu_ps(r0 + j));
    _mm512_storeu_si512(dst + 2 * j, _mm512_permutexvar_epi16(order, both));
  }
  for (; j < n; ++j) {
    dst[2 * j] = f32_to_bf16(r0[j]);
    dst[2 * j + 1] = r1 ? f32_to_bf16(r1[j]) : bf16_t{0};
  }
}

static void pack_a_f32(const float* src, int64_t k, int64_t kp, void* dst) {
  bf16_t* d = static_cast<bf16_t*>(dst);
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    // Round to nearest even, as f32_to_bf16 does.
    __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src + i));
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    __mmask16 is_nan =
        _mm512_cmp_ps_mask(_mm512_castsi512_ps(u), _mm512_castsi512_ps(u), _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(is_nan, _mm512_srli_epi32(r, 16), nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), _mm512_cvtepi32_epi16(r));
  }
  for (; i < k; ++i) d[i] = f32_to_bf16(src[i]);
  for (; i < kp; ++i) d[i] = 0;
}

// W^T panels by 8x8 transposes of 64-bit 2x2 blocks: the 8 pair-groups of a
// source panel that cover 16 columns hold, qword j, the block of rows
// (2j, 2j+1) x columns (2g, 2g+1); transposed, qword i of row j is the block
// of columns (2i, 2i+1), which is destination group j once a byte shuffle
// swaps the middle halves of each block (see the portable version).
static void transpose_panels_avx512(const bf16_t* packed, int64_t np, int64_t panel_stride,
                                    int64_t c0, int64_t cb, bf16_t* dst) {
  const __m512i s1_lo = _mm512_setr_epi64(0, 8, 2, 10, 4, 12, 6, 14);
  const __m512i s1_hi = _mm512_setr_epi64(1, 9, 3, 11, 5, 13, 7, 15);
  const __m512i s2_lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i s2_hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  const __m512i s3_lo = _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11);
  const __m512i s3_hi = _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15);
  // Byte order [0,1,4,5,2,3,6,7] within each qword (indices are per 128-bit lane).
  const long long lo = 0x0706030205040100ll, hi = 0x0f0e0b0a0d0c0908ll;
  const __m512i swap = _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo);
  transpose_panels_by_blocks(
      packed, np, panel_stride, c0, cb, dst, [&](const bf16_t* src, bf16_t* o) {
        __m512i r[8], a[8], b[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm512_loadu_si512(src + i * 2 * kPanelRows);
        for (int i = 0; i < 8; i += 2) {
          a[i] = _mm512_permutex2var_epi64(r[i], s1_lo, r[i + 1]);
          a[i + 1] = _mm512_permutex2var_epi64(r[i], s1_hi, r[i + 1]);
        }
        for (int i = 0; i < 8; i += 4)
          for (int j = 0; j < 2; ++j) {
            b[i + j] = _mm512_permutex2var_epi64(a[i + j], s2_lo, a[i + j + 2]);
            b[i + j + 2] = _mm512_permutex2var_epi64(a[i + j], s2_hi, a[i + j + 2]);
          }
        // b[0] = rows 0-3 of qwords 0 and 4, b[1]: qwords 1 and 5, b[2]: 2 and 6,
        // b[3]: 3 and 7; b[4..7] the same for rows 4-7.
        for (int j = 0; j < 4; ++j) {
          const __m512i col_lo =
              _mm512_shuffle_epi8(_mm512_permutex2var_epi64(b[j], s3_lo, b[j + 4]), swap);
          const __m512i col_hi =
              _mm512_shuffle_epi8(_mm512_permutex2var_epi64(b[j], s3_hi, b[j + 4]), swap);
          _mm512_storeu_si512(o + j * 2 * kPanelRows, col_lo);
          _mm512_storeu_si512(o + (j + 4) * 2 * kPanelRows, col_hi);
        }
      });
}

}  // namespace avx512bf16

// Entries that run a GEMM count their calls (kernels/counted.h).
constexpr KernelTable kTable = KernelTable::kAvx512Bf16;
using E = KernelEntry;

constexpr Kernels make_kernels_avx512bf16() {
  Kernels k;
  k.isa = KT_ISA_AVX512BF16;
  k.gemm_name = "gemm_bf16w_bf16_f32_6x64__avx512bf16";
  k.a_elem_size = sizeof(bf16_t);
  k.gemm_bf16w = counted<kTable, E::kGemmBf16w, avx512bf16::gemm_bf16w>;
  k.gemm_bf16w_nn = counted<kTable, E::kGemmBf16wNn, generic::nn_gemm<avx512bf16::Avx512NnTile>>;
  k.gemm_zip_bf16 = counted<kTable, E::kGemmZipBf16, avx512bf16::gemm_zip_bf16>;
  k.zip_rows_bf16 = avx512bf16::zip_rows_bf16;
  k.pack_a_f32 = avx512bf16::pack_a_f32;
  k.sgemm_nn = counted<kTable, E::kSgemmNn, avx512bf16::sgemm_nn>;
  k.sgemm_nt = counted<kTable, E::kSgemmNt, avx512bf16::sgemm_nt>;
  k.sgemm_tn = counted<kTable, E::kSgemmTn, avx512bf16::sgemm_tn>;
  k.transpose_panels = counted<kTable, E::kTransposePanels, avx512bf16::transpose_panels_avx512>;
  k.act_forward = avx512bf16::act_forward_generic;
  k.act_backward = avx512bf16::act_backward_generic;
  k.dequant_i8 = avx512bf16::dequant_i8;
  k.dequant_i4 = avx512bf16::dequant_i4;
  k.dequant_e4m3 = avx512bf16::dequant_e4m3;
  k.dequant_e2m1 = avx512bf16::dequant_e2m1;
  k.dequant_i4_zero = avx512bf16::dequant_i4_zero;
  k.gemm_bf16w_grouped = counted<kTable, E::kGemmBf16wGrouped, avx512bf16::gemm_bf16w_grouped>;
  k.gemm_quant = counted<kTable, E::kGemmQuant, avx512bf16::gemm_quant>;
  k.gemm_int8 = counted<kTable, E::kGemmInt8, avx512bf16::gemm_int8>;
  k.optimizer = &optim::avx512::kKernels;
  // Against dequant_* + gemm_bf16w_grouped (bench/README.md, kernels):
  // 8-bit codes from the codes up to 24 rows, short of where the two break
  // even; 4-bit codes stay ahead up to a full row chunk on AMD Zen4/Zen5,
  // so the table never dequantizes them; on CPUs where the cache path wins
  // from 16 rows (Intel without AMX) the layer measures it and takes it
  // (WeightOperand::code_rows_4bit).
  k.gemm_quant_rows_int8 = 24;
  k.gemm_quant_rows_e4m3 = 24;
  k.gemm_quant_rows_4bit = 1 << 30;
  // Backward reads W's panels straight (gemm_bf16w_nn) up to 16 rows of an
  // expert: there the transposes cost more than the step's shuffle.
  k.gemm_bf16w_nn_rows = 4;
  // The tiles fetch their own panels ahead at every row count
  // (avx512bf16::gemm_bf16w); each row is read through its pointer.
  k.gemm_bf16w_fetches_panels = true;
  k.gemm_reads_spaced_rows = false;
  return k;
}

// Constant-initialised (a constant expression, so no AVX-512 code runs
// while the library loads; the AMX table, made then, copies it).
constexpr Kernels kKernelsAvx512Bf16 = make_kernels_avx512bf16();
extern const Kernels kernels_avx512bf16 = kKernelsAvx512Bf16;

// The same kernels as a CPU without AVX512-VBMI runs them (the e4m3
// expansion by word tables), for the tests to run wherever AVX-512 BF16 is.
constexpr Kernels make_kernels_avx512bf16_no_vbmi() {
  Kernels k = kKernelsAvx512Bf16;
  k.dequant_e4m3 = avx512bf16::dequant_e4m3_table;
  return k;
}
constexpr Kernels kKernelsAvx512Bf16NoVbmi = make_kernels_avx512bf16_no_vbmi();
extern const Kernels kernels_avx512bf16_no_vbmi = kKernelsAvx512Bf16NoVbmi;

}  // namespace kt
