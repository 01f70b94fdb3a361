// Quantized panels to bf16 panels (kernels.h, dequant_*) in AVX-512 BF16, and
// the code expansions gemm_quant.h shares with them.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "core/dtype.h"
#include "formats/packed_quant.h"
#include "kernels/kernels.h"

namespace kt {
namespace avx512bf16 {

// Expanded scale vectors of one group for 32 values (16 lanes x 2): element
// 2l and 2l+1 take lane l's scale; lo covers lanes 0-7, hi lanes 8-15.
static inline void expand_scales(const float* s16, __m512* lo, __m512* hi) {
  const __m512 s = _mm512_loadu_ps(s16);
  *lo = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), s);
  *hi = _mm512_permutexvar_ps(_mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15), s);
}

// 32 values (one pair group, as int32 halves lo/hi in fp32) times the
// expanded scales, rounded to bf16 in panel order.
static inline __m512i scaled_pair_group(__m512 lo, __m512 hi, __m512 slo, __m512 shi) {
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, shi), _mm512_mul_ps(lo, slo));
}

static inline __m512 bf16_half_to_f32(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 4-bit codes: nibble u -> the bf16 of its value (int4 u - 8, or e2m1), by
// a 16-entry word permute.
template <QuantCode Code>
static void dequant_nibbles(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0, int64_t kc,
                            const float* scales, int64_t scale_stride, int64_t group, bf16_t* dst) {
  alignas(64) bf16_t table[32];
  for (int u = 0; u < 32; ++u) table[u] = f32_to_bf16(quant_code_value(Code, 4, static_cast<uint8_t>(u & 15)));
  const __m512i tab = _mm512_load_si512(table);
  const __m512i low4 = _mm512_set1_epi16(0x0f);
  for (int p = 0; p < np; ++p) {
    const uint8_t* src = codes + p * code_panel_bytes + k0 * kPanelRows / 2;
    bf16_t* out = dst + p * kPanelRows * kc;
    __m512 slo = _mm512_setzero_ps(), shi = slo;
    for (int64_t h = 0; h < kc / 4; ++h) {  // pair groups 2h, 2h + 1: 32 bytes
      _mm_prefetch(reinterpret_cast<const char*>(src + h * 32 + 1024), _MM_HINT_T0);
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + h * 32)));
      const __m512i v0 = _mm512_permutexvar_epi16(_mm512_and_si512(w, low4), tab);
      const __m512i v1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), tab);
      if (!scales) {
        _mm512_storeu_si512(out + h * 64, v0);
        _mm512_storeu_si512(out + h * 64 + 32, v1);
        continue;
      }
      if ((4 * h) % group == 0)
        expand_scales(scales + p * scale_stride + (4 * h / group) * kPanelRows, &slo, &shi);
      for (int i = 0; i < 2; ++i) {
        const __m512i v = i ? v1 : v0;
        const __m512 lo = bf16_half_to_f32(_mm512_castsi512_si256(v));
        const __m512 hi = bf16_half_to_f32(_mm512_extracti64x4_epi64(v, 1));
        _mm512_storeu_si512(out + h * 64 + 32 * i, scaled_pair_group(lo, hi, slo, shi));
      }
    }
  }
}

static void dequant_i4(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0, int64_t kc,
                       const float* scales, int64_t scale_stride, int64_t group, bf16_t* dst) {
  dequant_nibbles<QuantCode::kInt>(codes, code_panel_bytes, np, k0, kc, scales, scale_stride, group, dst);
}

// Asymmetric int4 (kernels.h, dequant_i4_zero): a word table of u - zero,
// word i holding the bf16 of i - 16, indexed by u + zero_bias (16 - zero:
// the index stays in [1, 31]).
static inline __m512i zero_point_table() {
  alignas(64) bf16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = f32_to_bf16(static_cast<float>(i - 16));
  return _mm512_load_si512(t);
}

// 16 - zero for each word of a pair group (words 2l, 2l + 1: lane l) from
// the 16 zero bytes of one panel and group.
static inline __m512i zero_bias(const uint8_t* z16) {
  const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z16)));
  return _mm512_sub_epi16(_mm512_set1_epi16(16), _mm512_or_si512(z, _mm512_slli_epi32(z, 16)));
}

static void dequant_i4_zero(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0, int64_t kc,
                            const uint8_t* zeros, int64_t zero_stride, const float* scales, int64_t scale_stride,
                            int64_t group, bf16_t* dst) {
  const __m512i tab = zero_point_table();
  const __m512i low4 = _mm512_set1_epi16(0x0f);
  for (int p = 0; p < np; ++p) {
    const uint8_t* src = codes + p * code_panel_bytes + k0 * kPanelRows / 2;
    bf16_t* out = dst + p * kPanelRows * kc;
    __m512 slo = _mm512_setzero_ps(), shi = slo;
    __m512i bias = _mm512_setzero_si512();
    for (int64_t h = 0; h < kc / 4; ++h) {  // pair groups 2h, 2h + 1: 32 bytes
      _mm_prefetch(reinterpret_cast<const char*>(src + h * 32 + 1024), _MM_HINT_T0);
      if ((4 * h) % group == 0) {
        bias = zero_bias(zeros + p * zero_stride + (4 * h / group) * kPanelRows);
        if (scales) expand_scales(scales + p * scale_stride + (4 * h / group) * kPanelRows, &slo, &shi);
      }
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + h * 32)));
      const __m512i v0 = _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_and_si512(w, low4), bias), tab);
      const __m512i v1 = _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_srli_epi16(w, 4), bias), tab);
      if (!scales) {
        _mm512_storeu_si512(out + h * 64, v0);
        _mm512_storeu_si512(out + h * 64 + 32, v1);
        continue;
      }
      for (int i = 0; i < 2; ++i) {
        const __m512i v = i ? v1 : v0;
        const __m512 lo = bf16_half_to_f32(_mm512_castsi512_si256(v));
        const __m512 hi = bf16_half_to_f32(_mm512_extracti64x4_epi64(v, 1));
        _mm512_storeu_si512(out + h * 64 + 32 * i, scaled_pair_group(lo, hi, slo, shi));
      }
    }
  }
}

static void dequant_e2m1(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0, int64_t kc,
                         const float* scales, int64_t scale_stride, int64_t group, bf16_t* dst) {
  dequant_nibbles<QuantCode::kE2M1>(codes, code_panel_bytes, np, k0, kc, scales, scale_stride, group, dst);
}

// 32 e4m3 codes (one pair group) to their bf16 bits, exactly: the 128
// magnitudes (normal and subnormal alike) from a table in four registers,
// two 64-entry word permutes and a blend on bit 6, then the sign.
struct E4m3Table {
  __m512i t[4];
  E4m3Table() {
    alignas(64) bf16_t v[128];
    for (int u = 0; u < 128; ++u) v[u] = f32_to_bf16(e4m3_to_f32(static_cast<uint8_t>(u)));
    for (int i = 0; i < 4; ++i) t[i] = _mm512_load_si512(v + 32 * i);
  }
};

static inline __m512i e4m3_to_bf16(__m256i bytes, const E4m3Table& tab) {
  const __m512i w = _mm512_cvtepu8_epi16(bytes);
  // The permutes read the low 6 bits of each index; bit 6 picks the half.
  const __m512i lo = _mm512_permutex2var_epi16(tab.t[0], w, tab.t[1]);
  const __m512i hi = _mm512_permutex2var_epi16(tab.t[2], w, tab.t[3]);
  const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)), lo, hi);
  // mag | (w << 8 & 0x8000): the code's sign bit on the bf16 sign.
  return _mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(w, 8), _mm512_set1_epi16(static_cast<short>(0x8000)),
                                   0xf8);
}

static void dequant_e4m3_table(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0, int64_t kc,
                               const float* scales, int64_t scale_stride, int64_t group, bf16_t* dst) {
  static const E4m3Table tab;
  for (int p = 0; p < np; ++p) {
    const uint8_t* src = codes + p * code_panel_bytes + k0 * kPanelRows;
    bf16_t* out = dst + p * kPanelRows * kc;
    __m512 slo = _mm512_set1_ps(1.f), shi = slo;
    for (int64_t g = 0; g < kc / 2; ++g) {  // one pair group: 32 bytes
      _mm_prefetch(reinterpret_cast<const char*>(src + g * 32 + 1024), _MM_HINT_T0);
      const __m512i v = e4m3_to_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + g * 32)), tab);
      if (!scales) {
        _mm512_storeu_si512(out + g * 32, v);
        continue;
      }
      if ((2 * g) % group == 0) expand_scales(scales + p * scale_stride + (2 * g / group) * kPanelRows, &slo, &shi);
      const __m512 lo = bf16_half_to_f32(_mm512_castsi512_si256(v));
      const __m512 hi = bf16_half_to_f32(_mm512_extracti64x4_epi64(v, 1));
      _mm512_storeu_si512(out + g * 32, scaled_pair_group(lo, hi, slo, shi));
    }
  }
}

// With AVX512-VBMI (not on every AVX-512 BF16 CPU: Cooper Lake lacks it),
// 64 codes at a time by byte lookups: the low and the high byte of each
// magnitude's bf16 from two 128-entry tables (vpermi2b reads the 7 low
// bits of each code), the sign onto the high byte, and the two bytes
// interleaved into words. The codes are first reordered so that the
// in-lane interleave leaves the words in code order. Less work than the
// word-table expansion, which the CPUs without VBMI keep.
struct E4m3ByteTables {
  __m512i lo0, lo1, hi0, hi1, order;
  E4m3ByteTables() {
    alignas(64) uint8_t lo[128], hi[128], ord[64];
    for (int u = 0; u < 128; ++u) {
      const bf16_t b = f32_to_bf16(e4m3_to_f32(static_cast<uint8_t>(u)));
      lo[u] = static_cast<uint8_t>(b & 0xff);
      hi[u] = static_cast<uint8_t>(b >> 8);
    }
    // unpacklo/hi_epi8 take bytes 0-7 / 8-15 of each 128-bit lane L: lane L
    // of the first result must hold codes 8L..8L+7, of the second 32+8L...
    for (int l = 0; l < 4; ++l)
      for (int i = 0; i < 8; ++i) {
        ord[16 * l + i] = static_cast<uint8_t>(8 * l + i);
        ord[16 * l + 8 + i] = static_cast<uint8_t>(32 + 8 * l + i);
      }
    lo0 = _mm512_load_si512(lo);
    lo1 = _mm512_load_si512(lo + 64);
    hi0 = _mm512_load_si512(hi);
    hi1 = _mm512_load_si512(hi + 64);
    order = _mm512_load_si512(ord);
  }
};

__attribute__((target("avx512vbmi"))) static inline void e4m3_to_bf16_vbmi(const uint8_t* src,
                                                                           const E4m3ByteTables& t, __m512i* first,
                                                                           __m512i* second) {
  const __m512i c = _mm512_permutexvar_epi8(t.order, _mm512_loadu_si512(src));
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, c, t.lo1);
  // hi | (c & 0x80): the code's sign on the bf16 sign.
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, c, t.hi1), c,
                                               _mm512_set1_epi8(static_cast<char>(0x80)), 0xf8);
  *first = _mm512_unpacklo_epi8(lo, hi);
  *second = _mm512_unpackhi_epi8(lo, hi);
}

__attribute__((target("avx512vbmi"))) static void dequant_e4m3_vbmi(const uint8_t* codes, int64_t code_panel_bytes,
                                                                    int np, int64_t k0, int64_t kc,
                                                                    const float* scales, int64_t scale_stride,
                                                                    int64_t group, bf16_t* dst) {
  static const E4m3ByteTables tab;
  for (int p = 0; p < np; ++p) {
    const uint8_t* src = codes + p * code_panel_bytes + k0 * kPanelRows;
    bf16_t* out = dst + p * kPanelRows * kc;
    __m512 slo = _mm512_set1_ps(1.f), shi = slo;
    for (int64_t g = 0; g < kc / 2; g += 2) {  // two pair groups: 64 bytes, one scale group (kc % 32 == 0)
      _mm_prefetch(reinterpret_cast<const char*>(src + g * 32 + 1024), _MM_HINT_T0);
      __m512i v[2];
      e4m3_to_bf16_vbmi(src + g * 32, tab, &v[0], &v[1]);
      if (!scales) {
        _mm512_storeu_si512(out + g * 32, v[0]);
        _mm512_storeu_si512(out + g * 32 + 32, v[1]);
        continue;
      }
      if ((2 * g) % group == 0) expand_scales(scales + p * scale_stride + (2 * g / group) * kPanelRows, &slo, &shi);
      for (int i = 0; i < 2; ++i) {
        const __m512 lo = bf16_half_to_f32(_mm512_castsi512_si256(v[i]));
        const __m512 hi = bf16_half_to_f32(_mm512_extracti64x4_epi64(v[i], 1));
        _mm512_storeu_si512(out + (g + i) * 32, scaled_pair_group(lo, hi, slo, shi));
      }
    }
  }
}

static void dequant_e4m3(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0, int64_t kc,
                         const float* scales, int64_t scale_stride, int64_t group, bf16_t* dst) {
  static const bool vbmi = __builtin_cpu_supports("avx512vbmi");
  (vbmi ? dequant_e4m3_vbmi : dequant_e4m3_table)(codes, code_panel_bytes, np, k0, kc, scales, scale_stride, group,
                                                  dst);
}

static void dequant_i8(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0, int64_t kc,
                       const float* scales, int64_t scale_stride, int64_t group, bf16_t* dst) {
  for (int p = 0; p < np; ++p) {
    const uint8_t* src = codes + p * code_panel_bytes + k0 * kPanelRows;
    bf16_t* out = dst + p * kPanelRows * kc;
    __m512 slo = _mm512_set1_ps(1.f), shi = slo;
    for (int64_t g = 0; g < kc / 2; ++g) {  // one pair group: 32 bytes
      _mm_prefetch(reinterpret_cast<const char*>(src + g * 32 + 1024), _MM_HINT_T0);
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + g * 32));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
      if (!scales) {  // small integers: exact in bf16 as they are
        _mm512_storeu_si512(out + g * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        continue;
      }
      if ((2 * g) % group == 0) expand_scales(scales + p * scale_stride + (2 * g / group) * kPanelRows, &slo, &shi);
      _mm512_storeu_si512(out + g * 32, scaled_pair_group(lo, hi, slo, shi));
    }
  }
}

}  // namespace avx512bf16
}  // namespace kt
