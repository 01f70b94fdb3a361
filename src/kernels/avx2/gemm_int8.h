// gemm_int8 (kernels.h) for AVX2: int8 A rows times a quantized base's
// integer codes, bit for bit the generic kernel's result. vpmaddubsw
// multiplies unsigned code bytes by the row's signed bytes and sums pairs in
// 16 bits; vpmaddwd sums a lane's two pairs in 32 bits. Each group's int32
// sums are exact, so only the order of the fp32 steps after them matters,
// and that is the generic kernel's. Takes avx2_group_scales and Avx2Ahead
// from gemm_quant.h.
//
// - 4-bit codes (int4, with or without zero points; e2m1 doubled, offset
//   12): the nibbles u (0..24) against |x| <= 127 make pair sums of at most
//   2 * 24 * 127, so a block of steps sums in 16 bits (8 steps of int4, 4 of
//   e2m1) before vpmaddwd; the group's offset (8, 12 or the zero point) is
//   taken off with the row's code sum.
// - int8 codes q: u = q + 128 would overflow the 16-bit pair sums
//   (2 * 255 * 127), so the products go as |q| times x with q's sign
//   (vpsignb): at most 2 * 128 * 127, no offset.
// - With AVX-VNNI (vpdpbusd: a lane's four u8 x s8 products added to its
//   int32 sum at once, no 16-bit step): one instruction per step, row and
//   half instead of vpmaddubsw, an add and the block's vpmaddwd; int8 codes
//   go as q + 128 with 128 times the row's group sum taken off. The int32
//   sums are the same, so are the bits (past K of some 66000 per group the
//   offset sums wrap modulo 2^32, as vpdpbusd, vpmulld and vpsubd do, and
//   the difference, which fits, comes back exact).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/avx2/gemm_quant.h"
#include "kernels/kernels.h"

namespace kt {
namespace avx2 {

// vpdpbusd in its VEX form (AVX-VNNI), as inline assembly: an intrinsic
// would need the whole tile compiled for AVX-VNNI, which not every AVX2 CPU
// has; the tiles that use it run only where cpuid says it is there.
static inline __m256i dpbusd_vex(__m256i acc, __m256i u, __m256i s) {
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
  return acc;
}

enum class Avx2Int8Kind { kInt8, kInt4, kInt4Zero, kE2m1 };

// One step (4 K values of a panel's 16 lanes) of codes as unsigned bytes,
// each 32-bit word a lane's 4 codes in the A rows' order (nibble order for
// 4-bit codes, kernels.h): u[0] holds lanes 0-3 and 8-11, u[1] lanes 4-7
// and 12-15 (the order the 128-bit unpacks give; the group's end puts the
// lanes back in order).
template <Avx2Int8Kind Kind>
struct Avx2Int8Step {
  static constexpr bool kNibbles = Kind != Avx2Int8Kind::kInt8;
  static constexpr int64_t kStepBytes = kNibbles ? 32 : 64;
  // Steps whose 16-bit pair sums cannot overflow: 8 * 2 * 15 * 127 and
  // 4 * 2 * 24 * 127 are below 2^15.
  static constexpr int kBlock = Kind == Avx2Int8Kind::kE2m1 ? 4 : 8;
  static constexpr int32_t kOffset = Kind == Avx2Int8Kind::kInt4 ? 8 : Kind == Avx2Int8Kind::kE2m1 ? 12 : 0;
  __m256i nibble_mask, e2m1_table;

  Avx2Int8Step() {
    // e2m1: nibble n -> 2 * value(n) + 12 (0..24).
    alignas(16) uint8_t doubled[16];
    for (int n = 0; n < 16; ++n)
      doubled[n] = static_cast<uint8_t>(2.f * quant_code_value(QuantCode::kE2M1, 4, static_cast<uint8_t>(n)) + 12.f);
    nibble_mask = _mm256_set1_epi8(0x0f);
    e2m1_table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(doubled)));
  }

  inline void load(const uint8_t* src, __m256i* u) const {
    if constexpr (!kNibbles) {
      // Word l of the first 32 bytes: lane l's K 4s, 4s + 1; of the second:
      // 4s + 2, 4s + 3 (formats/packed_quant.h).
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
      u[0] = _mm256_unpacklo_epi16(a, b);
      u[1] = _mm256_unpackhi_epi16(a, b);
    } else {
      // Bytes 2l, 2l + 1: lane l's 4 nibbles; each byte's low nibble comes
      // first.
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      __m256i lo = _mm256_and_si256(v, nibble_mask);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble_mask);
      if constexpr (Kind == Avx2Int8Kind::kE2m1) {
        lo = _mm256_shuffle_epi8(e2m1_table, lo);
        hi = _mm256_shuffle_epi8(e2m1_table, hi);
      }
      u[0] = _mm256_unpacklo_epi8(lo, hi);
      u[1] = _mm256_unpackhi_epi8(lo, hi);
    }
  }
};

// MR rows x one panel. Per group: the int32 sums d (two registers per row;
// 4-bit codes add a block's 16-bit sums to them), the lanes put
// back in order, the offset taken off, d in fp32 times the group's scale
// added to the row's fp32 sum (L1); at the end that sum times the row's
// scale goes into C.
template <Avx2Int8Kind Kind, int MR, bool Vnni>
static void avx2_int8_tile(const Avx2Int8Step<Kind>& cs, const QuantPanels& w, int p, const uint8_t* const* a,
                           float* c, int64_t ldc, bool accumulate, const Avx2Ahead& ahead) {
  using Step = Avx2Int8Step<Kind>;
  constexpr int64_t kAhead = 2048;  // bytes of codes fetched ahead into L1, as gemm_quant's
  constexpr int64_t kStepBytes = Step::kStepBytes;
  const int64_t groups = w.kq / w.group;
  const int64_t steps_per_group = w.group / 4;
  const int64_t panel_bytes = w.kq / 4 * kStepBytes;
  const uint8_t* codes = w.codes + p * w.code_panel_bytes;
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) float part[MR][kPanelRows] = {};  // the generic kernel's sums start at +0 too
  for (int64_t j = 0; j < groups; ++j) {
    __m256i d[MR][2];
    #pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) d[r][0] = d[r][1] = _mm256_setzero_si256();
    const int64_t st_end = (j + 1) * steps_per_group;
    for (int64_t st0 = j * steps_per_group; st0 < st_end; st0 += Step::kBlock) {
      __m256i h[Step::kNibbles ? MR : 1][2];  // a block's 16-bit pair sums
      #pragma GCC unroll 4
      for (int r = 0; r < (Step::kNibbles ? MR : 1); ++r) h[r][0] = h[r][1] = _mm256_setzero_si256();
      #pragma GCC unroll 8
      for (int i = 0; i < Step::kBlock; ++i) {
        const int64_t st = st0 + i;
        const int64_t off = st * kStepBytes + kAhead;
        if (off % 64 == 0) {
          const uint8_t* f = off < panel_bytes ? codes + off : ahead.at(p + 1, off - panel_bytes);
          if (f) _mm_prefetch(reinterpret_cast<const char*>(f), _MM_HINT_T0);
        }
        __m256i u[2];
        cs.load(codes + st * kStepBytes, u);
        const auto row = [&](int r) {
          int32_t x4;
          __builtin_memcpy(&x4, a[r] + st * 4, 4);
          return _mm256_set1_epi32(x4);
        };
        if constexpr (Vnni) {
          if constexpr (!Step::kNibbles) {
            const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
            u[0] = _mm256_xor_si256(u[0], flip);
            u[1] = _mm256_xor_si256(u[1], flip);
          }
          #pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const __m256i x = row(r);
            d[r][0] = dpbusd_vex(d[r][0], u[0], x);
            d[r][1] = dpbusd_vex(d[r][1], u[1], x);
          }
        } else if constexpr (Step::kNibbles) {
          #pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const __m256i x = row(r);
            h[r][0] = _mm256_add_epi16(h[r][0], _mm256_maddubs_epi16(u[0], x));
            h[r][1] = _mm256_add_epi16(h[r][1], _mm256_maddubs_epi16(u[1], x));
          }
        } else {
          const __m256i m0 = _mm256_abs_epi8(u[0]), m1 = _mm256_abs_epi8(u[1]);
          #pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const __m256i x = row(r);
            const __m256i p0 = _mm256_maddubs_epi16(m0, _mm256_sign_epi8(x, u[0]));
            const __m256i p1 = _mm256_maddubs_epi16(m1, _mm256_sign_epi8(x, u[1]));
            d[r][0] = _mm256_add_epi32(d[r][0], _mm256_madd_epi16(p0, ones));
            d[r][1] = _mm256_add_epi32(d[r][1], _mm256_madd_epi16(p1, ones));
          }
        }
      }
      if constexpr (Step::kNibbles && !Vnni) {
        #pragma GCC unroll 4
        for (int r = 0; r < MR; ++r)
          for (int t = 0; t < 2; ++t) d[r][t] = _mm256_add_epi32(d[r][t], _mm256_madd_epi16(h[r][t], ones));
      }
    }
    const int64_t at = p * w.scale_panel + j * kPanelRows;
    const __m256 s[2] = {avx2_group_scales(w.scales + at * w.scale_bytes, w.scale_bytes),
                         avx2_group_scales(w.scales + (at + 8) * w.scale_bytes, w.scale_bytes)};
    // The codes' offset (int8 codes: 128 with AVX-VNNI, none without).
    constexpr bool kOffsetSums = Kind != Avx2Int8Kind::kInt8 || Vnni;
    constexpr int32_t kOffset = Kind == Avx2Int8Kind::kInt8 ? 128 : Step::kOffset;
    __m256i offset[2] = {_mm256_set1_epi32(kOffset), _mm256_set1_epi32(kOffset)};
    if constexpr (Kind == Avx2Int8Kind::kInt4Zero)
      for (int t = 0; t < 2; ++t)
        offset[t] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.zeros + at + 8 * t)));
    #pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      // Lanes 0-7 and 8-15 from the unpacks' halves.
      const __m256i n[2] = {_mm256_permute2x128_si256(d[r][0], d[r][1], 0x20),
                            _mm256_permute2x128_si256(d[r][0], d[r][1], 0x31)};
      int32_t sum;
      __builtin_memcpy(&sum, a[r] + w.kq + 4 * j, 4);
      const __m256i xs = _mm256_set1_epi32(sum);
      for (int t = 0; t < 2; ++t) {
        __m256i dj = n[t];
        if constexpr (kOffsetSums) dj = _mm256_sub_epi32(dj, _mm256_mullo_epi32(offset[t], xs));
        _mm256_store_ps(part[r] + 8 * t,
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(dj), s[t], _mm256_load_ps(part[r] + 8 * t)));
      }
    }
  }
  #pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    float sr;
    __builtin_memcpy(&sr, a[r] + w.kq + 4 * groups, 4);
    if constexpr (Kind == Avx2Int8Kind::kE2m1) sr *= 0.5f;
    const __m256 sv = _mm256_set1_ps(sr);
    float* cr = c + r * ldc + p * kPanelRows;
    for (int t = 0; t < 2; ++t) {
      const __m256 sum = _mm256_load_ps(part[r] + 8 * t);
      _mm256_storeu_ps(cr + 8 * t, accumulate ? _mm256_fmadd_ps(sum, sv, _mm256_loadu_ps(cr + 8 * t))
                                              : _mm256_mul_ps(sum, sv));
    }
  }
}

// Per panel, the rows in balanced tiles of at most 4: the first streams the
// panel's codes from memory, the others meet them in cache.
template <Avx2Int8Kind Kind, bool Vnni>
static void avx2_gemm_int8_kind(const QuantPanels& w, const uint8_t* const* a, int m, int np, float* c, int64_t ldc,
                                bool accumulate, const PrefetchRegion& next) {
  static const Avx2Int8Step<Kind> cs;
  constexpr int MR = 4;
  const Avx2Ahead ahead(w, np, next);
  const int tiles = (m + MR - 1) / MR;
  for (int p = 0; p < np; ++p) {
    for (int t = 0, r = 0; t < tiles; ++t) {
      const int h = (m - r) / (tiles - t);
      float* cr = c + r * ldc;
      switch (h) {
        case 4: avx2_int8_tile<Kind, 4, Vnni>(cs, w, p, a + r, cr, ldc, accumulate, ahead); break;
        case 3: avx2_int8_tile<Kind, 3, Vnni>(cs, w, p, a + r, cr, ldc, accumulate, ahead); break;
        case 2: avx2_int8_tile<Kind, 2, Vnni>(cs, w, p, a + r, cr, ldc, accumulate, ahead); break;
        default: avx2_int8_tile<Kind, 1, Vnni>(cs, w, p, a + r, cr, ldc, accumulate, ahead); break;
      }
      r += h;
    }
  }
}

template <bool Vnni>
static void gemm_int8_isa(const QuantPanels& w, const void* const* a_rows, int m, int np, float* c, int64_t ldc,
                          bool accumulate, const PrefetchRegion& next) {
  const uint8_t* const* a = reinterpret_cast<const uint8_t* const*>(a_rows);
  if (w.bits == 8) return avx2_gemm_int8_kind<Avx2Int8Kind::kInt8, Vnni>(w, a, m, np, c, ldc, accumulate, next);
  if (w.code == QuantCode::kE2M1)
    return avx2_gemm_int8_kind<Avx2Int8Kind::kE2m1, Vnni>(w, a, m, np, c, ldc, accumulate, next);
  if (w.zeros) return avx2_gemm_int8_kind<Avx2Int8Kind::kInt4Zero, Vnni>(w, a, m, np, c, ldc, accumulate, next);
  avx2_gemm_int8_kind<Avx2Int8Kind::kInt4, Vnni>(w, a, m, np, c, ldc, accumulate, next);
}

static void gemm_int8(const QuantPanels& w, const void* const* a_rows, int m, int np, float* c, int64_t ldc,
                      bool accumulate, const PrefetchRegion& next) {
  static const bool vnni = kt::cpu_has_avx_vnni();
  (vnni ? gemm_int8_isa<true> : gemm_int8_isa<false>)(w, a_rows, m, np, c, ldc, accumulate, next);
}

// Without AVX-VNNI whatever the CPU has (the tests' second table).
static void gemm_int8_no_vnni(const QuantPanels& w, const void* const* a_rows, int m, int np, float* c,
                              int64_t ldc, bool accumulate, const PrefetchRegion& next) {
  gemm_int8_isa<false>(w, a_rows, m, np, c, ldc, accumulate, next);
}

}  // namespace avx2
}  // namespace kt
