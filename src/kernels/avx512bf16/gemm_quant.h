// gemm_quant (kernels.h): the weight GEMM of a few rows straight from a
// quantized base's codes, a micro-tile of the code macro-kernel
// (generic/macro_kernel.h). Each 32-byte step of a panel's codes is expanded
// in registers into bf16 pair groups (exact: the codes' values are exact in
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
#include "kernels/generic/macro_kernel.h"
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

// The fp32 vector operations of the code macro-kernel's traits
// (generic/macro_kernel.h) on 16 lanes.
struct Avx512Floats {
  using F = __m512;
  static inline F fzero() { return _mm512_setzero_ps(); }
  static inline F fload(const float* p) { return _mm512_loadu_ps(p); }
  static inline void fstore(float* p, F v) { _mm512_storeu_ps(p, v); }
  static inline F fadd(F x, F y) { return _mm512_add_ps(x, y); }
  static inline F fmul(F x, F y) { return _mm512_mul_ps(x, y); }
  static inline F ffma(F x, F y, F z) { return _mm512_fmadd_ps(x, y, z); }
};

// The 16 fp32 scales of one panel and group.
static inline __m512 group_scales(const uint8_t* s, int scale_bytes) {
  if (scale_bytes == 4) return _mm512_loadu_ps(s);
  return bf16_half_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}

// The micro-tile (generic/macro_kernel.h): each 32-byte step of 16 lanes'
// codes expands into kS pair groups as bf16 vectors, each multiplied at once
// by a row's bf16 pair (vdpbf16ps); a group's fp32 sum times its scale goes
// into the row's sums. Offset: 4-bit integer codes as the words 128 + u
// (kOffsetCodes), the group's offset taken off with the rows' group sums
// (xsum, kOffsetSliceGroups per row). Zero (asymmetric int4, not Offset):
// the nibbles plus the lanes' zero_bias index a table of u - zero.
template <int Bits, QuantCode Code, bool Zero, bool Offset>
struct QuantTile : Avx512Floats {
  using Row = bf16_t;
  using Sum = __m512;
  using Inner = __m512;
  using A = __m512bh;
  using B = __m512bh;
  struct Codes {
    __m512i bias;  // the panel's zero_bias for the group (Zero, not Offset)
  };
  struct Group {
    __m512 scale[1];
    __m512 offset;  // Offset: 128 + zero, zero 8 or the lanes' zero points
  };
  static constexpr int kV = 1, kS = Bits == 4 ? 2 : 1, kStepK = 2 * kS, kBlock = 0;
  static constexpr int64_t kStepBytes = 32;
  static constexpr int64_t kXsumStride = kOffsetSliceGroups;
  static constexpr int kUnroll = 1;
  static constexpr bool kRowScale = false, kFetchScales = true;
  // Codes are fetched ahead of the loads (one thread's stream from DRAM, 4
  // to 8 lines of compute per line at decode, so the hardware prefetchers
  // and the out-of-order window alone run out of misses in flight): 2 KiB
  // ahead into L1, and the scales (zero points) as far ahead: one thread's
  // DRAM stream runs faster this way than with the codes 4 KiB ahead into L2
  // within the panel and no fetch of the scales. Few-row tiles of fewer
  // panels (2 to 4 rows x 2 panels) fetch as far further ahead, so a thread
  // keeps 8 KiB of codes in flight as the one-row tile's 4 streams do.
  static constexpr int64_t ahead_bytes(int chains, int panels) { return chains == 2 ? 8192 / panels : 2048; }
  // One row: its pairs stay, each panel's codes come and go; more rows: the
  // panels' codes stay, each row's pair is broadcast from memory.
  static constexpr bool panel_at_a_time(int mr, int np) { return mr < np; }
  static constexpr bool hold_rows(int, int) { return true; }
  __m512i table = _mm512_setzero_si512();  // 4-bit codes: nibble -> bf16
  E4m3Table e4m3;                          // e4m3 codes: magnitude -> bf16

  QuantTile() {
    if constexpr (Zero) {
      table = zero_point_table();
    } else if constexpr (Bits == 4) {
      alignas(64) bf16_t t[32];
      for (int u = 0; u < 32; ++u) t[u] = f32_to_bf16(quant_code_value(Code, 4, static_cast<uint8_t>(u & 15)));
      table = _mm512_load_si512(t);
    }
  }

  // 4-bit codes widened to words; 8-bit ones as loaded (the low half).
  static inline __m512i load(const uint8_t* src) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return Bits == 4 ? _mm512_cvtepu8_epi16(b) : _mm512_castsi256_si512(b);
  }
  static inline Codes codes_of(const QuantPanels& w, int64_t zero_at) {
    if constexpr (Zero && !Offset) return {zero_bias(w.zeros + zero_at)};
    return {_mm512_setzero_si512()};
  }
  // Pair group s of the step (s = 0: the low nibbles).
  inline void expand(__m512i w, int s, const Codes& codes, B (&b)[1]) const {
    const __m512i low = _mm512_set1_epi16(0x0f);
    if constexpr (Offset) {
      // The bf16 of 128 + u for each nibble u: (w & 15) | high, w >> 4 | high.
      const __m512i high = _mm512_set1_epi16(0x4300);
      b[0] = (__m512bh)(s == 0 ? _mm512_ternarylogic_epi32(w, low, high, 0xea)
                               : _mm512_or_si512(_mm512_srli_epi16(w, 4), high));
    } else if constexpr (Bits == 4) {
      __m512i u = s == 0 ? _mm512_and_si512(w, low) : _mm512_srli_epi16(w, 4);
      if constexpr (Zero) u = _mm512_add_epi16(u, codes.bias);
      b[0] = (__m512bh)_mm512_permutexvar_epi16(u, table);
    } else if constexpr (Code == QuantCode::kE4M3) {
      b[0] = (__m512bh)e4m3_to_bf16(_mm512_castsi512_si256(w), e4m3);
    } else {
      const __m256i v = _mm512_castsi512_si256(w);
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
      b[0] = _mm512_cvtne2ps_pbh(hi, lo);
    }
  }
  static inline A a_operand(const bf16_t* row, int64_t step, int s) {
    int32_t v;
    __builtin_memcpy(&v, row + step * kStepK + 2 * s, 4);
    return (__m512bh)_mm512_set1_epi32(v);
  }
  static inline Sum dot(Sum acc, A x, B b) { return _mm512_dpbf16_ps(acc, x, b); }
  static inline Sum sum_zero() { return _mm512_setzero_ps(); }
  static inline Sum add(Sum x, Sum y) { return _mm512_add_ps(x, y); }
  static inline Group scales_of(const QuantPanels& w, int64_t at) {
    Group g{{group_scales(w.scales + at * w.scale_bytes, w.scale_bytes)}, _mm512_set1_ps(136.f)};
    if constexpr (Offset && Zero) {
      const __m128i z = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.zeros + at));
      g.offset = _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(z)), _mm512_set1_ps(128.f));
    }
    return g;
  }
  // Offset: row r's sum of its values in group j.
  static inline float row_group(const bf16_t*, int r, int64_t j, const QuantPanels&, const float* xsum) {
    return Offset ? xsum[r * kOffsetSliceGroups + j] : 0.f;
  }
  static inline void value(const Sum (&d)[1], const Group& g, float xsum, __m512 (&f)[1]) {
    f[0] = Offset ? _mm512_fnmadd_ps(_mm512_set1_ps(xsum), g.offset, d[0]) : d[0];
  }
};

// Up to 4 rows: one tile height, 2 chains (the products of pair group g
// into chain g % 2, so that a tile of few sums keeps several dot products
// in flight), strided; one row takes 4 panels (4 streams per thread), more
// rows 2. Two chains rather than four (4 / MR panels then): with four, one
// row's tile expanded its codes in cache only about as fast as one thread
// reads them from DRAM, so it could not hide the memory.
struct QuantFewRows {
  static constexpr int kRows = 4;
  static constexpr bool kPanelsOuter = false;
  static constexpr int panels(int mr) { return mr == 1 ? 4 : 2; }
  static constexpr int chains(int, int) { return 2; }
  static constexpr generic::SumsIn sums(int, int) { return generic::SumsIn::kRegisters; }
  static constexpr bool strided(int, int) { return true; }
};

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
// row tile; 8-bit codes up to gemm_quant_rows_int8/_e4m3): one chain; heights
// balanced as the bf16 tiles' are; 2 panels. Symmetric codes (int4, e2m1)
// and 8-bit codes: up to 12 rows, so that a prefill's 5 to 12 rows per
// expert expand each step once rather than in two or three tiles (Intel
// with AMX hidden, kt_ab in the layer: int4_g32 T=128 0.87x the time of
// the 4 x 4 tiles placed on Zen5; T=128 int8_channel 1.32 -> 1.15x and
// fp8_b128 1.36 -> 1.18x the bf16 layer's time, against 6-row tiles).
// Symmetric 4-bit codes put the scaled group sums straight into C (in L1),
// so the registers hold only the partial sums. Zero points (their biases
// take registers): 6 rows.
template <int Bits, bool Zero>
struct QuantManyRows {
  static constexpr int kRows = Zero ? 6 : 12;
  static constexpr bool kPanelsOuter = false;
  static constexpr int panels(int) { return 2; }
  static constexpr int chains(int, int) { return 1; }
  static constexpr generic::SumsIn sums(int, int) {
    return Bits == 4 ? generic::SumsIn::kC : generic::SumsIn::kRegisters;
  }
  static constexpr bool strided(int, int) { return false; }
};
// Symmetric 4-bit codes past two wide tiles' rows: tiles of 4 rows x 4
// panels, which expand each panel's codes once per 4 rows rather than per
// 12 yet ran faster there on AMD Zen4 (kt_ab in the layer, against 12 x 2
// tiles: int4_g32 T=512 0.98-0.99x the time, T=2048 0.94x; the same bits,
// the sums going in one order either way).
struct QuantTallRows {
  static constexpr int kRows = 4;
  static constexpr bool kPanelsOuter = false;
  static constexpr int panels(int) { return 4; }
  static constexpr int chains(int, int) { return 1; }
  static constexpr generic::SumsIn sums(int, int) { return generic::SumsIn::kC; }
  static constexpr bool strided(int, int) { return false; }
};
// Up to this many rows the few-row tiles (QuantFewRows); past it the wide
// ones, which expand each panel's codes once for more columns of work:
// faster from 3 rows of symmetric 4-bit codes and from 4 rows of
// zero-point codes, 8-bit codes the same either way. Placed when the
// few-row tiles still had four chains (bench/README.md, kt_kernel_bench).
template <int Bits, bool Zero>
constexpr int kFewRowsMax = Bits == 4 && !Zero ? 2 : 3;

// The next region (generic::TileShares): its panels' heads are fetched as
// the call's streams end: a call's codes are a quarter to an eighth of its
// bf16 panels, and without the next call's first codes on the way each
// call's streams started from memory cold.
template <int Bits, QuantCode Code, bool Zero>
static void gemm_quant_code(const QuantPanels& w, const bf16_t* const* a, int m, int np, float* c, int64_t ldc,
                            bool accumulate, const PrefetchRegion& next) {
  using Plain = QuantTile<Bits, Code, Zero, false>;
  if (m > kFewRowsMax<Bits, Zero>) {
    static const Plain tile;
    if constexpr (Bits == 4 && !Zero) {
      if (m > 2 * QuantManyRows<Bits, Zero>::kRows) {
        generic::code_gemm<Plain, QuantTallRows>(tile, w, a, m, np, c, ldc, accumulate, next, nullptr);
        return;
      }
    }
    generic::code_gemm<Plain, QuantManyRows<Bits, Zero>>(tile, w, a, m, np, c, ldc, accumulate, next, nullptr);
    return;
  }
  if constexpr (kOffsetCodes<Bits, Code>) {
    using Offset = QuantTile<Bits, Code, Zero, true>;
    static const Offset tile;
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
      generic::code_gemm<Offset, QuantFewRows>(tile, ws, rows, m, np, c, ldc, accumulate || j0 > 0, after, xsum);
    }
  } else {
    static const Plain tile;
    generic::code_gemm<Plain, QuantFewRows>(tile, w, a, m, np, c, ldc, accumulate, next, nullptr);
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
