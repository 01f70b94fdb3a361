// Quantized panels to bf16 panels (kernels.h, dequant_*) in AVX2: the same
// bits as generic/quant.h's dequant_*_generic (the ref table's), at vector
// speed.
//
// 32 code bytes at a time. Scaled values go through fp32 as even and odd
// words: the dword of lane l holds words 2l (low half) and 2l + 1 (high
// half), both times lane l's scale, so 8 consecutive scales serve 16 words
// as they are loaded.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "core/dtype.h"
#include "formats/packed_quant.h"
#include "kernels/kernels.h"

namespace kt {
namespace avx2 {

// Rounds to bf16 as f32_to_bf16 does (nearest even; subnormals kept), the
// result in the high half of each dword. No NaN case: the values are
// products of finite codes and finite scales, so at most infinite.
static inline __m256i round_to_bf16_high(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
}

// 16 words from the fp32 values of the even and odd words: times the 8
// lane scales and rounded when scaled, else truncated (the values are exact
// in bf16 then).
template <bool Scaled>
static inline __m256i words_of(__m256 even, __m256 odd, __m256 scale) {
  __m256i e = _mm256_castps_si256(even), o = _mm256_castps_si256(odd);
  if constexpr (Scaled) {
    e = round_to_bf16_high(_mm256_mul_ps(even, scale));
    o = round_to_bf16_high(_mm256_mul_ps(odd, scale));
  }
  return _mm256_blend_epi16(_mm256_srli_epi32(e, 16), o, 0xaa);
}

// The same for 16 words already exact bf16 (table lookups): widened to fp32
// (even: the low halves shifted up, odd: the high halves as they are).
static inline __m256i scaled_words(__m256i w, __m256 scale) {
  const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  const __m256 odd =
      _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  return words_of<true>(even, odd, scale);
}

// ---- 8-bit codes: byte j of a 32-byte step is word j of its 32 outputs.

// An 8-bit code kind's words<Scaled>(16 code bytes, the 8 lanes' scales):
// the 16 bf16 words. Int8: the codes in the low (even) and high (odd) byte
// of each 16-bit word as fp32 (shifts that sign-extend, exact conversions).
struct Int8Value {
  template <bool Scaled>
  static inline __m256i words(__m128i bytes, __m256 scale) {
    const __m256i d = _mm256_cvtepi16_epi32(bytes);  // the odd byte's sign fills the high bits
    const __m256 even = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(d, 24), 24));
    const __m256 odd = _mm256_cvtepi32_ps(_mm256_srai_epi32(d, 8));
    return words_of<Scaled>(even, odd, scale);
  }
};

template <class Value, bool Scaled>
static void dequant_bytes(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0,
                          int64_t kc, const float* scales, int64_t scale_stride, int64_t group,
                          bf16_t* dst) {
  for (int p = 0; p < np; ++p) {
    const uint8_t* src = codes + p * code_panel_bytes + k0 * kPanelRows;
    bf16_t* out = dst + p * kPanelRows * kc;
    // The group's scales of lanes 0-7 and of lanes 8-15.
    __m256 s_lo = _mm256_setzero_ps(), s_hi = s_lo;
    for (int64_t g = 0; g < kc / 2; ++g) {  // one pair group: 32 bytes
      _mm_prefetch(reinterpret_cast<const char*>(src + g * 32 + 1024), _MM_HINT_T0);
      if (Scaled && (2 * g) % group == 0) {
        const float* s = scales + p * scale_stride + (2 * g / group) * kPanelRows;
        s_lo = _mm256_loadu_ps(s);
        s_hi = _mm256_loadu_ps(s + 8);
      }
      for (int half = 0; half < 2; ++half) {  // lanes 8 * half .. 8 * half + 7
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + g * 32 + 16 * half));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * 32 + 16 * half),
                            Value::template words<Scaled>(bytes, half ? s_hi : s_lo));
      }
    }
  }
}

static void dequant_i8(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0,
                       int64_t kc, const float* scales, int64_t scale_stride, int64_t group,
                       bf16_t* dst) {
  (scales ? dequant_bytes<Int8Value, true>
          : dequant_bytes<Int8Value, false>)(codes, code_panel_bytes, np, k0, kc, scales,
                                             scale_stride, group, dst);
}

// 16 e4m3 codes (one per word, zero-extended) to their bf16 words, exactly,
// in 16-bit lanes: a normal magnitude m7 (exponent field > 0) is the bf16
// (m7 << 4) + (120 << 7); the 8 subnormal ones (m * 2^-9) come from a
// table of their words' bytes; then the sign. About half the operations of
// making the fp32 values, which shows in the fp8_b128 prefill, where the
// unscaled dequantization serves.
static inline __m256i e4m3_words(__m256i w) {
  const __m256i m7 = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
  const __m256i normal = _mm256_add_epi16(_mm256_slli_epi16(m7, 4), _mm256_set1_epi16(120 << 7));
  // Subnormal words 0, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60
  // by m (index byte m7 < 8; a word's high byte indexes entry 0, which is 0).
  const __m256i low_bytes = _mm256_setr_epi8(0, 0, static_cast<char>(0x80), static_cast<char>(0xc0), 0, 0x20, 0x40,
                                             0x60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, static_cast<char>(0x80),
                                             static_cast<char>(0xc0), 0, 0x20, 0x40, 0x60, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m256i high_bytes = _mm256_setr_epi8(0, 0x3b, 0x3b, 0x3b, 0x3c, 0x3c, 0x3c, 0x3c, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                              0x3b, 0x3b, 0x3b, 0x3c, 0x3c, 0x3c, 0x3c, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m256i subnormal = _mm256_or_si256(_mm256_shuffle_epi8(low_bytes, m7),
                                            _mm256_slli_epi16(_mm256_shuffle_epi8(high_bytes, m7), 8));
  const __m256i is_subnormal = _mm256_cmpgt_epi16(_mm256_set1_epi16(8), m7);
  const __m256i mag = _mm256_blendv_epi8(normal, subnormal, is_subnormal);
  return _mm256_or_si256(mag, _mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16(static_cast<short>(0x8000))));
}

// e4m3 codes as words (e4m3_words), scaled as the nibble tables' words are.
struct E4m3Value {
  template <bool Scaled>
  static inline __m256i words(__m128i bytes, __m256 scale) {
    const __m256i w = e4m3_words(_mm256_cvtepu8_epi16(bytes));
    if constexpr (Scaled) return scaled_words(w, scale);
    return w;
  }
};

static void dequant_e4m3(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0,
                         int64_t kc, const float* scales, int64_t scale_stride, int64_t group,
                         bf16_t* dst) {
  (scales ? dequant_bytes<E4m3Value, true>
          : dequant_bytes<E4m3Value, false>)(codes, code_panel_bytes, np, k0, kc, scales,
                                             scale_stride, group, dst);
}

// ---- 4-bit codes: the 32 bytes of step h hold words [64h, 64h + 32) of the
// outputs in their low nibbles and [64h + 32, 64h + 64) in their high ones,
// word j <-> byte j.

// A 16-entry bf16 table as two byte tables (low and high bytes), repeated in
// both 128-bit halves for vpshufb.
struct NibbleTable {
  __m256i lo, hi;
  explicit NibbleTable(const bf16_t (&words)[16]) {
    alignas(16) uint8_t l[16], h[16];
    for (int i = 0; i < 16; ++i) {
      l[i] = static_cast<uint8_t>(words[i] & 0xff);
      h[i] = static_cast<uint8_t>(words[i] >> 8);
    }
    lo = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(l)));
    hi = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
  }
};

// Interleaves the low and high bytes of 32 words (byte j: word j) into the
// words, in order: 0-15 to *first, 16-31 to *second. unpack works within
// 128-bit halves, so it yields words 0-7 | 16-23 and 8-15 | 24-31.
static inline void interleave_words(__m256i lo, __m256i hi, __m256i* first, __m256i* second) {
  const __m256i a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi);
  *first = _mm256_permute2x128_si256(a, b, 0x20);
  *second = _mm256_permute2x128_si256(a, b, 0x31);
}

// Stores 32 words (16 lanes x 2 columns), times the lanes' scales when
// Scaled.
template <bool Scaled>
static inline void store_pair_groups(bf16_t* out, __m256i first, __m256i second, __m256 s_lo,
                                     __m256 s_hi) {
  if constexpr (Scaled) {
    first = scaled_words(first, s_lo);
    second = scaled_words(second, s_hi);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), first);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), second);
}

// Where each of 8 lanes' scales is a power of two 2^e with -125 <= e <=
// 125 (the layer's e8m0 scales; sign and mantissa bits zero, exponent field
// 2..252), every e2m1 value (0.5 to 6) times it is a normal number whose
// bf16 word is the value's word with e added to the exponent field: the
// product without fp32 (the same bits as rounding it). Returns whether all
// 8 are such, and in *add each lane's e << 7 in both 16-bit halves.
static inline bool power_of_two_scales(__m256 scale, __m256i* add) {
  const __m256i b = _mm256_castps_si256(scale);
  const __m256i field = _mm256_srli_epi32(b, 23);
  const __m256i ok = _mm256_and_si256(
      _mm256_cmpeq_epi32(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0x807fffffu))),
                         _mm256_setzero_si256()),
      _mm256_and_si256(_mm256_cmpgt_epi32(field, _mm256_set1_epi32(1)),
                       _mm256_cmpgt_epi32(_mm256_set1_epi32(253), field)));
  const __m256i e = _mm256_and_si256(_mm256_slli_epi32(_mm256_sub_epi32(field, _mm256_set1_epi32(127)), 7),
                                     _mm256_set1_epi32(0xffff));
  *add = _mm256_or_si256(e, _mm256_slli_epi32(e, 16));
  return _mm256_movemask_epi8(ok) == -1;
}

// 16 exact bf16 words times power-of-two scales (power_of_two_scales): the
// exponent added to each nonzero word (zeros keep their sign).
static inline __m256i exponent_added(__m256i w, __m256i add) {
  const __m256i zero =
      _mm256_cmpeq_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7fff)), _mm256_setzero_si256());
  return _mm256_add_epi16(w, _mm256_andnot_si256(zero, add));
}

// Nibble u -> table word u (int4 u - 8, or e2m1). Pow2Scales (e2m1): a
// group whose scales are all powers of two in range takes them as exponent
// adds; the others go through fp32 (as int4's always do).
template <bool Scaled, bool Pow2Scales>
static void dequant_nibbles(const NibbleTable& tab, const uint8_t* codes, int64_t code_panel_bytes,
                            int np, int64_t k0, int64_t kc, const float* scales,
                            int64_t scale_stride, int64_t group, bf16_t* dst) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (int p = 0; p < np; ++p) {
    const uint8_t* src = codes + p * code_panel_bytes + k0 * kPanelRows / 2;
    bf16_t* out = dst + p * kPanelRows * kc;
    __m256 s_lo = _mm256_setzero_ps(), s_hi = s_lo;
    __m256i add_lo = _mm256_setzero_si256(), add_hi = add_lo;
    bool pow2 = false;
    for (int64_t h = 0; h < kc / 4; ++h) {  // pair groups 2h, 2h + 1: 32 bytes
      _mm_prefetch(reinterpret_cast<const char*>(src + h * 32 + 1024), _MM_HINT_T0);
      if (Scaled && (4 * h) % group == 0) {
        const float* s = scales + p * scale_stride + (4 * h / group) * kPanelRows;
        s_lo = _mm256_loadu_ps(s);
        s_hi = _mm256_loadu_ps(s + 8);
        if constexpr (Pow2Scales) pow2 = power_of_two_scales(s_lo, &add_lo) & power_of_two_scales(s_hi, &add_hi);
      }
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + h * 32));
      for (int i = 0; i < 2; ++i) {  // low nibbles, then high
        const __m256i u = _mm256_and_si256(i ? _mm256_srli_epi16(b, 4) : b, low4);
        __m256i first, second;
        interleave_words(_mm256_shuffle_epi8(tab.lo, u), _mm256_shuffle_epi8(tab.hi, u), &first,
                         &second);
        if (Pow2Scales && pow2) {
          first = exponent_added(first, add_lo);
          second = exponent_added(second, add_hi);
          store_pair_groups<false>(out + h * 64 + 32 * i, first, second, s_lo, s_hi);
        } else {
          store_pair_groups<Scaled>(out + h * 64 + 32 * i, first, second, s_lo, s_hi);
        }
      }
    }
  }
}

template <QuantCode Code>
static void dequant_nibble_codes(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0,
                                 int64_t kc, const float* scales, int64_t scale_stride,
                                 int64_t group, bf16_t* dst) {
  bf16_t words[16];
  for (int u = 0; u < 16; ++u)
    words[u] = f32_to_bf16(quant_code_value(Code, 4, static_cast<uint8_t>(u)));
  const NibbleTable tab(words);
  constexpr bool kPow2 = Code == QuantCode::kE2M1;
  (scales ? dequant_nibbles<true, kPow2> : dequant_nibbles<false, kPow2>)(tab, codes, code_panel_bytes, np, k0,
                                                                            kc, scales, scale_stride, group, dst);
}

static void dequant_i4(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0,
                       int64_t kc, const float* scales, int64_t scale_stride, int64_t group,
                       bf16_t* dst) {
  dequant_nibble_codes<QuantCode::kInt>(codes, code_panel_bytes, np, k0, kc, scales, scale_stride,
                                        group, dst);
}

static void dequant_e2m1(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0,
                         int64_t kc, const float* scales, int64_t scale_stride, int64_t group,
                         bf16_t* dst) {
  dequant_nibble_codes<QuantCode::kE2M1>(codes, code_panel_bytes, np, k0, kc, scales, scale_stride,
                                         group, dst);
}

// Asymmetric int4: d = u - zero in int8 (zero bytes are z + 8 <= 15, so d
// is in [-15, 15]), looked up by |d| in a table of the bf16 of 0..15, with
// d's sign bit on the high byte (d = 0 stays +0, as the generic float(0)).
template <bool Scaled>
static void dequant_i4_zero_points(const uint8_t* codes, int64_t code_panel_bytes, int np,
                                   int64_t k0, int64_t kc, const uint8_t* zeros,
                                   int64_t zero_stride, const float* scales, int64_t scale_stride,
                                   int64_t group, bf16_t* dst) {
  bf16_t words[16];
  for (int i = 0; i < 16; ++i) words[i] = f32_to_bf16(static_cast<float>(i));
  const NibbleTable tab(words);
  const __m256i low4 = _mm256_set1_epi8(0x0f), sign = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int p = 0; p < np; ++p) {
    const uint8_t* src = codes + p * code_panel_bytes + k0 * kPanelRows / 2;
    bf16_t* out = dst + p * kPanelRows * kc;
    __m256 s_lo = _mm256_setzero_ps(), s_hi = s_lo;
    __m256i zero = _mm256_setzero_si256();
    for (int64_t h = 0; h < kc / 4; ++h) {  // pair groups 2h, 2h + 1: 32 bytes
      _mm_prefetch(reinterpret_cast<const char*>(src + h * 32 + 1024), _MM_HINT_T0);
      if ((4 * h) % group == 0) {
        const int64_t at = (4 * h / group) * kPanelRows;
        // Byte j of a step is lane j / 2: each lane's zero twice.
        const __m128i z =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(zeros + p * zero_stride + at));
        zero = _mm256_set_m128i(_mm_unpackhi_epi8(z, z), _mm_unpacklo_epi8(z, z));
        if (Scaled) {
          s_lo = _mm256_loadu_ps(scales + p * scale_stride + at);
          s_hi = _mm256_loadu_ps(scales + p * scale_stride + at + 8);
        }
      }
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + h * 32));
      for (int i = 0; i < 2; ++i) {  // low nibbles, then high
        const __m256i d =
            _mm256_sub_epi8(_mm256_and_si256(i ? _mm256_srli_epi16(b, 4) : b, low4), zero);
        const __m256i mag = _mm256_abs_epi8(d);
        const __m256i hi =
            _mm256_or_si256(_mm256_shuffle_epi8(tab.hi, mag), _mm256_and_si256(d, sign));
        __m256i first, second;
        interleave_words(_mm256_shuffle_epi8(tab.lo, mag), hi, &first, &second);
        store_pair_groups<Scaled>(out + h * 64 + 32 * i, first, second, s_lo, s_hi);
      }
    }
  }
}

static void dequant_i4_zero(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0,
                            int64_t kc, const uint8_t* zeros, int64_t zero_stride,
                            const float* scales, int64_t scale_stride, int64_t group, bf16_t* dst) {
  (scales ? dequant_i4_zero_points<true>
          : dequant_i4_zero_points<false>)(codes, code_panel_bytes, np, k0, kc, zeros, zero_stride,
                                           scales, scale_stride, group, dst);
}

}  // namespace avx2
}  // namespace kt
