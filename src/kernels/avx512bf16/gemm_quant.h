// gemm_quant (kernels.h): the weight GEMM of a few rows straight from a
// quantized base's codes. Each 32-byte step of a panel's codes is expanded in
// registers into bf16 pair groups (exact: the codes' values are exact in
// bf16) and multiplied at once, so the code stream from memory never waits
// for a dequantized copy in cache; each group's partial sums are added to the
// accumulators times the group's fp32 scale. Takes the code expansions of
// dequant.h.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "core/dtype.h"
#include "formats/packed_quant.h"
#include "kernels/avx512bf16/dequant.h"
#include "kernels/kernels.h"

namespace kt {
namespace avx512bf16 {

// Int4 codes under few rows (decode) go without a table: the word 0x4300 | u
// is the bf16 of 128 + u, exactly, so a group's sum over these is the sum
// over u - zero plus (128 + zero) times the sum of the row's values in the
// group, which is taken off at the group's end (zero: 8, or the lane's zero
// point). Two plain vector operations per pair group instead of a permute:
// the permutes (and for zero points the index adds) bound the decode loop.
// The sums are a few times the plain ones, so the fp32 sums keep some 19 of
// their 24 bits where the bf16 products need 8.
template <int Bits, QuantCode Code>
constexpr bool kOffsetCodes = Bits == 4 && Code == QuantCode::kInt;
constexpr int64_t kOffsetSliceGroups = 256;  // group sums held per row and call

// One 32-byte step of 16 lanes' codes: S pair groups as bf16 vectors.
// Zero (asymmetric int4): the nibbles plus the lanes' zero_bias index a
// table of u - zero.
template <int Bits, QuantCode Code, bool Zero>
struct CodeStep {
  static constexpr int S = Bits == 4 ? 2 : 1;  // pair groups per step
  __m512i table = _mm512_setzero_si512();     // 4-bit codes: nibble -> bf16
  E4m3Table e4m3;                              // e4m3 codes: magnitude -> bf16

  CodeStep() {
    if constexpr (Zero) {
      table = zero_point_table();
    } else if constexpr (Bits == 4) {
      alignas(64) bf16_t t[32];
      for (int u = 0; u < 32; ++u) t[u] = f32_to_bf16(quant_code_value(Code, 4, static_cast<uint8_t>(u & 15)));
      table = _mm512_load_si512(t);
    }
  }

  // kOffsetCodes: the bf16 of 128 + u for each nibble u.
  static inline void expand_offset(const uint8_t* src, __m512bh* out) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    const __m512i high = _mm512_set1_epi16(0x4300);
    out[0] = (__m512bh)_mm512_ternarylogic_epi32(w, _mm512_set1_epi16(0x0f), high, 0xea);  // (w & 15) | high
    out[1] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 4), high);
  }

  // bias: the panel's zero_bias for the current group (Zero only).
  inline void expand(const uint8_t* src, __m512bh* out, __m512i bias) const {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    if constexpr (Zero) {
      const __m512i w = _mm512_cvtepu8_epi16(b);
      const __m512i lo = _mm512_add_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x0f)), bias);
      out[0] = (__m512bh)_mm512_permutexvar_epi16(lo, table);
      out[1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_srli_epi16(w, 4), bias), table);
    } else if constexpr (Bits == 4) {
      const __m512i w = _mm512_cvtepu8_epi16(b);
      out[0] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x0f)), table);
      out[1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
    } else if constexpr (Code == QuantCode::kE4M3) {
      out[0] = (__m512bh)e4m3_to_bf16(b, e4m3);
    } else {
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
      out[0] = _mm512_cvtne2ps_pbh(hi, lo);
    }
  }
};

// The 16 fp32 scales of one panel and group.
static inline __m512 group_scales(const uint8_t* s, int scale_bytes) {
  if (scale_bytes == 4) return _mm512_loadu_ps(s);
  return bf16_half_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}

// A tile's fetches beyond its codes: where its streams go on past its K
// range: panel p at cont + p * code_panel_bytes for p < cont_np, and their
// scales (zero points) at cont_scales (cont_zeros) in the layout of w's
// (nullptr: not fetched).
// goes_on: the tile's streams go on, each into the panel right after its
// own (a strided call's next tile, strided_tiles), and are fetched on as one.
struct TileAhead {
  const uint8_t* cont;
  int cont_np;
  const uint8_t* cont_scales;
  const uint8_t* cont_zeros;
  bool goes_on = false;
};
// What the tiles of a call fetch ahead beyond their own codes: the heads of
// the streams that follow each tile's (the next tile's panels, and past the
// call's last tile the next call's, from the caller's next region), kAhead
// bytes per panel, fetched as the tile's own streams near their ends; not
// the whole next region over the call: at decode, that doubled the lines in
// flight into L1 and crowded the call's own stream. Many rows fetch the
// same way: the next region spread over the tiles with the codes 4 KiB
// ahead into L2 ran slower there too (bench/README.md).
struct TileShares {
  // The next call's next_np panels, their scales and zero points.
  const uint8_t *next_codes = nullptr, *next_scales = nullptr, *next_zeros = nullptr;
  int next_np = 0;
  TileShares(const PrefetchRegion& r, int64_t code_panel_bytes) {
    if (r.chunks == 1) {
      next_codes = static_cast<const uint8_t*>(r.base);
      next_scales = static_cast<const uint8_t*>(r.quant_scales);
      next_zeros = static_cast<const uint8_t*>(r.quant_zeros);
      next_np = static_cast<int>(r.chunk_bytes / code_panel_bytes);
    }
  }
  // The next tile's fetches: over wp, the first n of the np_left panels left
  // in this call (the rest are its streams' continuation).
  TileAhead tile(const QuantPanels& wp, int n, int np_left) const {
    TileAhead a{next_codes, next_np, next_scales, next_zeros, false};
    if (n < np_left) {
      a.cont = wp.codes + n * wp.code_panel_bytes;
      a.cont_np = np_left - n;
      a.cont_scales = wp.scales + n * wp.scale_panel * wp.scale_bytes;
      a.cont_zeros = wp.zeros ? wp.zeros + n * wp.scale_panel : nullptr;
    }
    return a;
  }
};

// MR rows x NP panels, C chains of partial sums per (row, panel) and group;
// the tile's panels are ps apart (1: adjacent; strided_tiles).
// C = 2 (few rows): the products of pair group g go into chain g % 2, so
// that a tile of few sums still keeps several dot products in flight; at the
// group's end the chains are added. C = 1 (many rows): MR * NP sums already
// hide the latency. Then each group's sum times the scale goes into the
// accumulator. The order depends on neither the tile's height nor the panel
// split within one C, so a column's result does not depend on how the work
// was cut, and a row's on the few rows beside it.
template <int Bits, QuantCode Code, bool Zero, int MR, int NP, int C>
static void quant_tile(const CodeStep<Bits, Code, Zero>& cs, const QuantPanels& w, const bf16_t* const* a, float* c,
                       int64_t ldc, bool accumulate, const TileAhead& ahead_of, const float* xsum, int64_t ps) {
  constexpr int S = CodeStep<Bits, Code, Zero>::S;
  constexpr bool kOffset = kOffsetCodes<Bits, Code> && C == 2;
  // Many rows of 4-bit codes: the scaled group sums go straight into C (in
  // L1), so the registers hold only the partial sums and the tile can span
  // four panels, expanding each panel's codes once for more rows.
  constexpr bool kAccInC = C == 1 && Bits == 4;
  // Steps per round: every chain once, and at least two, so that the step
  // that fetches (every other one) is known when compiling: a test of the
  // step's parity in the loop slows the tiles markedly.
  constexpr int kUnroll = C > S ? C / S : 2;
  // Codes are fetched ahead of the loads (one thread's stream from DRAM, 4
  // to 8 lines of compute per line at decode, so the hardware prefetchers
  // and the out-of-order window alone run out of misses in flight): 2 KiB
  // ahead into L1, past a panel's end into the stream that follows
  // (ahead_of.cont), and the scales (zero points) as far ahead: one
  // thread's DRAM stream runs faster this way than with the codes 4 KiB
  // ahead into L2 within the panel and no fetch of the scales. Few-row
  // tiles of fewer panels (2 to 4 rows x 2 panels) fetch as far further
  // ahead, so a thread keeps 8 KiB of codes in flight as the one-row
  // tile's 4 streams do.
  constexpr int64_t kAhead = C == 2 ? 8192 / NP : 2048;
  static_assert(C == 1 || C == 2, "chains");
  const int64_t step_k = 2 * S;  // K values per step
  const int64_t steps_per_group = w.group / step_k;
  const int64_t groups = w.kq / w.group;
  const int64_t panel_bytes = 2 * w.kq * Bits;  // of this K range
  const int64_t code_stride = ps * w.code_panel_bytes, scale_stride = ps * w.scale_panel;
  __m512 acc[MR][NP];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t j = 0; j < groups; ++j) {
    {
      // The scales (zero points) of the group kAhead bytes of codes on;
      // past the K range's end, those of the stream that follows.
      const int64_t ja = j + kAhead / (steps_per_group * 32);
      const bool within = ahead_of.goes_on || ja < groups;
      const uint8_t* scales = within ? w.scales : ahead_of.cont_scales;
      const uint8_t* zeros = within ? w.zeros : ahead_of.cont_zeros;
      const int np_ahead = within ? NP : scales ? ahead_of.cont_np : 0;
      const int64_t stride = within ? scale_stride : w.scale_panel;
      const int64_t at = (within ? ja : ja - groups) * kPanelRows;
      #pragma GCC unroll 16
      for (int p = 0; p < NP; ++p) {
        if (p >= np_ahead) break;
        _mm_prefetch(reinterpret_cast<const char*>(scales + (p * stride + at) * w.scale_bytes), _MM_HINT_T0);
        if constexpr (Zero)
          if (zeros) _mm_prefetch(reinterpret_cast<const char*>(zeros + p * stride + at), _MM_HINT_T0);
      }
    }
    __m512i bias[NP];  // the group's zero points (Zero only)
    #pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) {
      if constexpr (Zero && !kOffset) {
        bias[p] = zero_bias(w.zeros + p * scale_stride + j * kPanelRows);
      } else {
        bias[p] = _mm512_setzero_si512();
      }
    }
    __m512 part[C][MR][NP];
    #pragma GCC unroll 16
    for (int i = 0; i < C; ++i)
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r)
        #pragma GCC unroll 16
        for (int p = 0; p < NP; ++p) part[i][r][p] = _mm512_setzero_ps();
    const int64_t st0 = j * steps_per_group;
    for (int64_t st = st0; st < st0 + steps_per_group; st += kUnroll) {
      // Every other step (rounds of kUnroll steps start at even steps: the
      // steps of a group are even) fetches the line of two, for panel p at
      // ahead + p * ahead_stride + 32 u (a round's bytes never straddle
      // the K range's end less kAhead: both are multiples of 256).
      const bool within = ahead_of.goes_on || st * 32 + kAhead < panel_bytes;
      const uint8_t* ahead = within          ? w.codes + st * 32 + kAhead
                             : ahead_of.cont ? ahead_of.cont + (st * 32 + kAhead - panel_bytes)
                                             : nullptr;
      const int np_ahead = within ? NP : ahead_of.cont ? ahead_of.cont_np : 0;
      const int64_t ahead_stride = within ? code_stride : w.code_panel_bytes;
      #pragma GCC unroll 16
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t step = st + u;
        const auto pair = [&](int r, int s) {
          int32_t v;
          __builtin_memcpy(&v, a[r] + step * step_k + 2 * s, 4);
          return (__m512bh)_mm512_set1_epi32(v);
        };
        const auto prefetch = [&](int p) {
          if (u % 2 == 0 && p < np_ahead)
            _mm_prefetch(reinterpret_cast<const char*>(ahead + p * ahead_stride + 32 * u), _MM_HINT_T0);
        };
        if constexpr (MR < NP) {  // one row: its pairs stay, each panel's codes come and go
          __m512bh av[MR][S];
          #pragma GCC unroll 16
          for (int r = 0; r < MR; ++r)
            #pragma GCC unroll 16
            for (int s = 0; s < S; ++s) av[r][s] = pair(r, s);
          #pragma GCC unroll 16
          for (int p = 0; p < NP; ++p) {
            const uint8_t* src = w.codes + p * code_stride + step * 32;
            prefetch(p);
            __m512bh b[S];
            if constexpr (kOffset) {
              cs.expand_offset(src, b);
            } else {
              cs.expand(src, b, bias[p]);
            }
            #pragma GCC unroll 16
            for (int s = 0; s < S; ++s)
              #pragma GCC unroll 16
              for (int r = 0; r < MR; ++r) {
                const int ch = (u * S + s) % C;
                part[ch][r][p] = _mm512_dpbf16_ps(part[ch][r][p], av[r][s], b[s]);
              }
          }
        } else {  // the panels' values stay, each row's pair is broadcast from memory
          __m512bh b[NP][S];
          #pragma GCC unroll 16
          for (int p = 0; p < NP; ++p) {
            const uint8_t* src = w.codes + p * code_stride + step * 32;
            prefetch(p);
            if constexpr (kOffset) {
              cs.expand_offset(src, b[p]);
            } else {
              cs.expand(src, b[p], bias[p]);
            }
          }
          #pragma GCC unroll 16
          for (int s = 0; s < S; ++s)
            #pragma GCC unroll 16
            for (int r = 0; r < MR; ++r) {
              const __m512bh av = pair(r, s);
              const int ch = (u * S + s) % C;
              #pragma GCC unroll 16
              for (int p = 0; p < NP; ++p) part[ch][r][p] = _mm512_dpbf16_ps(part[ch][r][p], av, b[p][s]);
            }
        }
      }
    }
    #pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) {
      const __m512 sv = group_scales(w.scales + (p * scale_stride + j * kPanelRows) * w.scale_bytes, w.scale_bytes);
      __m512 offset = _mm512_set1_ps(136.f);  // 128 + zero, zero 8 or the lanes' zero points
      if constexpr (kOffset && Zero) {
        const __m128i z = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.zeros + p * scale_stride + j * kPanelRows));
        offset = _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(z)), _mm512_set1_ps(128.f));
      }
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        __m512 sum = part[0][r][p];
        if constexpr (C == 2) sum = _mm512_add_ps(part[0][r][p], part[1][r][p]);
        if constexpr (kOffset) sum = _mm512_fnmadd_ps(_mm512_set1_ps(xsum[r * kOffsetSliceGroups + j]), offset, sum);
        if constexpr (kAccInC) {
          float* cr = c + r * ldc + 16 * p * ps;
          const __m512 before = j == 0 && !accumulate ? _mm512_setzero_ps() : _mm512_loadu_ps(cr);
          _mm512_storeu_ps(cr, _mm512_fmadd_ps(sum, sv, before));
        } else {
          acc[r][p] = _mm512_fmadd_ps(sum, sv, acc[r][p]);
        }
      }
    }
  }
  if constexpr (kAccInC) return;
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
    #pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) {
      if (accumulate) acc[r][p] = _mm512_add_ps(acc[r][p], _mm512_loadu_ps(cr + 16 * p * ps));
      _mm512_storeu_ps(cr + 16 * p * ps, acc[r][p]);
    }
  }
}

// f(std::integral_constant<int, n>{}) for a count 1 <= n <= Max known only
// at run time (tile heights and panel counts are template arguments).
template <int Max, class F>
static void with_count(int n, F&& f) {
  if constexpr (Max > 1) {
    if (n < Max) return with_count<Max - 1>(n, f);
  }
  f(std::integral_constant<int, Max>{});
}

// The panels of w from panel p on.
static inline QuantPanels panels_from(const QuantPanels& w, int p) {
  QuantPanels wp = w;
  wp.codes = w.codes + p * w.code_panel_bytes;
  wp.scales = w.scales + p * w.scale_panel * w.scale_bytes;
  if (w.zeros) wp.zeros = w.zeros + p * w.scale_panel;
  return wp;
}

// Few rows over n >= 2 groups of kMaxNP panels whose K range is the whole
// panel (panel_bytes, of that range: a panel's codes, scales and zero
// points then follow the panel before it): tile t takes panels t, t + n,
// t + 2n, ..., so that each tile's streams go on into the next tile's
// panels (TileAhead::goes_on) and a thread reads kMaxNP streams from end to
// end of the call instead of kMaxNP new ones per tile, each a short stream
// that started cold. The last tile's streams end where an adjacent group's
// would at the strided panels' end: into the rest, or the next call's. Calls
// tile(panels_from(w, t), ahead, t, n) for each tile; returns the panels it
// took (0 where they do not fit this).
template <int kMaxNP, class Tile>
static int strided_tiles(const QuantPanels& w, int np, int64_t panel_bytes, const TileShares& next, Tile&& tile) {
  const int n = np / kMaxNP;
  if (n < 2 || panel_bytes != w.code_panel_bytes) return 0;
  const int last = (n - 1) * kMaxNP;
  const TileAhead at_end = next.tile(panels_from(w, last), kMaxNP, np - last);
  for (int t = 0; t < n; ++t) {
    TileAhead ahead = at_end;
    ahead.goes_on = t + 1 < n;
    tile(panels_from(w, t), ahead, t, n);
  }
  return n * kMaxNP;
}

// Panels in groups of up to kMaxNP, each group under all MR rows at once;
// few rows (C = 2) strided where they fit (strided_tiles).
template <int Bits, QuantCode Code, bool Zero, int MR, int C, int kMaxNP>
static void quant_rows(const CodeStep<Bits, Code, Zero>& cs, QuantPanels w, const bf16_t* const* a, int np, float* c,
                       int64_t ldc, bool accumulate, const TileShares& next, const float* xsum) {
  int p = 0;
  if constexpr (C == 2)
    p = strided_tiles<kMaxNP>(w, np, 2 * w.kq * Bits, next, [&](const QuantPanels& wp, const TileAhead& ahead, int t, int n) {
      quant_tile<Bits, Code, Zero, MR, kMaxNP, C>(cs, wp, a, c + t * kPanelRows, ldc, accumulate, ahead, xsum, n);
    });
  while (p < np) {
    const int n = np - p >= kMaxNP ? kMaxNP : np - p;
    const QuantPanels wp = panels_from(w, p);
    float* cp = c + p * kPanelRows;
    const TileAhead ahead = next.tile(wp, n, np - p);
    with_count<kMaxNP>(n, [&](auto panels) {
      quant_tile<Bits, Code, Zero, MR, decltype(panels)::value, C>(cs, wp, a, cp, ldc, accumulate, ahead, xsum, 1);
    });
    p += n;
  }
}

// Up to 4 rows: one tile height, 2 chains; one row takes 4 panels (4
// streams per thread), more rows 2. Two chains rather than four (4 / MR
// panels then): with four, one row's tile expanded its codes in cache only
// about as fast as one thread reads them from DRAM, so it could not hide
// the memory.
template <int Bits, QuantCode Code, bool Zero, int MR>
static void quant_few_rows(const CodeStep<Bits, Code, Zero>& cs, const QuantPanels& w, const bf16_t* const* a, int np,
                           float* c, int64_t ldc, bool accumulate, const PrefetchRegion& next, const float* xsum) {
  constexpr int kMaxNP = MR == 1 ? 4 : 2;
  const TileShares shares(next, w.code_panel_bytes);
  quant_rows<Bits, Code, Zero, MR, 2, kMaxNP>(cs, w, a, np, c, ldc, accumulate, shares, xsum);
}

template <int Bits, QuantCode Code, bool Zero>
static void quant_few_rows_of(const CodeStep<Bits, Code, Zero>& cs, const QuantPanels& w, const bf16_t* const* a,
                              int m, int np, float* c, int64_t ldc, bool accumulate, const PrefetchRegion& next,
                              const float* xsum) {
  switch (m) {
    case 4: quant_few_rows<Bits, Code, Zero, 4>(cs, w, a, np, c, ldc, accumulate, next, xsum); break;
    case 3: quant_few_rows<Bits, Code, Zero, 3>(cs, w, a, np, c, ldc, accumulate, next, xsum); break;
    case 2: quant_few_rows<Bits, Code, Zero, 2>(cs, w, a, np, c, ldc, accumulate, next, xsum); break;
    default: quant_few_rows<Bits, Code, Zero, 1>(cs, w, a, np, c, ldc, accumulate, next, xsum); break;
  }
}

// Offset codes: each row's sums over the groups of a slice of K, in one
// fixed order (16 lanes of pair sums, then the lanes added), so a row's
// result does not depend on the rows beside it.
static void group_sums(const bf16_t* const* a, int m, int64_t groups, int64_t group, float* xsum) {
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
  for (int r = 0; r < m; ++r)
    for (int64_t j = 0; j < groups; ++j) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t k = j * group; k < (j + 1) * group; k += 32)
        s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(a[r] + k), ones);
      xsum[r * kOffsetSliceGroups + j] = _mm512_reduce_add_ps(s);
    }
}

// More rows (4-bit codes, which expand cheaply enough to do it once per
// row tile; 8-bit codes up to gemm_quant_rows_8bit): one chain; heights
// balanced as the bf16 tiles' are. Symmetric 4-bit codes: up to 4 rows x 4
// panels (each panel's codes expanded once per 4 rows rather than per 6 rows
// x 2 panels; 5 rows spill registers). Zero points (their biases take
// registers, so 4 x 4 ran slower than 6 x 2) and 8-bit codes (the e4m3
// table takes four): 6 rows x 2 panels.
template <int Bits, bool Zero>
constexpr int kWidePanels = Bits == 4 && !Zero ? 4 : 2;
template <int Bits, bool Zero>
constexpr int kWideRows = Bits == 4 && !Zero ? 4 : 6;
// Up to this many rows the few-row tiles (quant_few_rows); past it the wide
// ones, which expand each panel's codes once for more columns of work:
// faster from 3 rows of symmetric 4-bit codes and from 4 rows of
// zero-point codes, 8-bit codes the same either way. Placed when the
// few-row tiles still had four chains (bench/README.md, kt_kernel_bench).
template <int Bits, bool Zero>
constexpr int kFewRowsMax = Bits == 4 && !Zero ? 2 : 3;

// The next region (TileShares): its panels' heads are fetched as the call's
// streams end: a call's codes are a quarter to an eighth of its bf16 panels,
// and without the next call's first codes on the way each call's streams
// started from memory cold.
template <int Bits, QuantCode Code, bool Zero>
static void gemm_quant_code(const QuantPanels& w, const bf16_t* const* a, int m, int np, float* c, int64_t ldc,
                            bool accumulate, const PrefetchRegion& next) {
  static const CodeStep<Bits, Code, Zero> cs;
  if (m > kFewRowsMax<Bits, Zero>) {
    constexpr int kRows = kWideRows<Bits, Zero>;
    constexpr int kPanels = kWidePanels<Bits, Zero>;
    const int tiles = (m + kRows - 1) / kRows;
    const TileShares shares(next, w.code_panel_bytes);
    for (int t = 0, r = 0; t < tiles; ++t) {
      const int h = (m - r) / (tiles - t);
      with_count<kRows>(h, [&](auto rows) {
        quant_rows<Bits, Code, Zero, decltype(rows)::value, 1, kPanels>(cs, w, a + r, np, c + r * ldc, ldc, accumulate,
                                                                        shares, nullptr);
      });
      r += h;
    }
    return;
  }
  if constexpr (kOffsetCodes<Bits, Code>) {
    // K in slices of at most kOffsetSliceGroups groups (one slice for any
    // real model's K), each with its rows' group sums.
    alignas(64) float xsum[4 * kOffsetSliceGroups];
    const int64_t groups = w.kq / w.group;
    for (int64_t j0 = 0; j0 < groups; j0 += kOffsetSliceGroups) {
      const int64_t ng = groups - j0 < kOffsetSliceGroups ? groups - j0 : kOffsetSliceGroups;
      const int64_t k0 = j0 * w.group;
      QuantPanels ws = w;
      ws.codes = w.codes + k0 * kPanelRows / 2;
      ws.scales = w.scales + j0 * kPanelRows * w.scale_bytes;
      if (w.zeros) ws.zeros = w.zeros + j0 * kPanelRows;
      ws.kq = ng * w.group;
      const bf16_t* rows[4];
      for (int r = 0; r < m; ++r) rows[r] = a[r] + k0;
      group_sums(rows, m, ng, w.group, xsum);
      // Past a slice, the streams go on into the next slice of the same panels.
      const bool last = j0 + ng >= groups;
      PrefetchRegion after = next;
      if (!last) {
        after = PrefetchRegion::block(ws.codes + ws.kq * kPanelRows / 2, np * w.code_panel_bytes);
        after.quant_scales = ws.scales + ng * kPanelRows * w.scale_bytes;
        after.quant_zeros = w.zeros ? ws.zeros + ng * kPanelRows : nullptr;
      }
      quant_few_rows_of(cs, ws, rows, m, np, c, ldc, accumulate || j0 > 0, after, xsum);
    }
  } else {
    quant_few_rows_of(cs, w, a, m, np, c, ldc, accumulate, next, nullptr);
  }
}

static void gemm_quant(const QuantPanels& w, const void* const* a_rows, int m, int np, float* c, int64_t ldc,
                       bool accumulate, const PrefetchRegion& next) {
  const bf16_t* const* a = reinterpret_cast<const bf16_t* const*>(a_rows);
  switch (w.code) {
    case QuantCode::kE4M3: gemm_quant_code<8, QuantCode::kE4M3, false>(w, a, m, np, c, ldc, accumulate, next); return;
    case QuantCode::kE2M1: gemm_quant_code<4, QuantCode::kE2M1, false>(w, a, m, np, c, ldc, accumulate, next); return;
    case QuantCode::kInt: break;
  }
  if (w.zeros) {
    gemm_quant_code<4, QuantCode::kInt, true>(w, a, m, np, c, ldc, accumulate, next);
  } else if (w.bits == 4) {
    gemm_quant_code<4, QuantCode::kInt, false>(w, a, m, np, c, ldc, accumulate, next);
  } else {
    gemm_quant_code<8, QuantCode::kInt, false>(w, a, m, np, c, ldc, accumulate, next);
  }
}

}  // namespace avx512bf16
}  // namespace kt
