// gemm_quant (kernels.h) for AVX2 + FMA: the weight GEMM of a few fp32 rows
// straight from a quantized base's codes. Each 32-byte step of a panel's
// codes is widened in registers to fp32 (exact: every code value is) and
// multiplied at once, so the code stream from memory never waits for a
// dequantized copy in cache (without it, decode on a quantized base ran
// many times the time of bf16). Each group's partial sums times the
// group's scale go into C.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "core/dtype.h"
#include "formats/packed_quant.h"
#include "kernels/generic/macro_kernel.h"
#include "kernels/kernels.h"

namespace kt {
namespace avx2 {

enum class Avx2Code { kInt4, kInt4Zero, kE2m1, kInt8, kE4m3 };

template <Avx2Code Kind>
constexpr bool kAvx2Nibbles = Kind == Avx2Code::kInt4 || Kind == Avx2Code::kInt4Zero || Kind == Avx2Code::kE2m1;

constexpr float kE4m3Unit = 256.f;  // an e4m3 value over its half-precision image

// The codes of one 32-byte step as fp32 vectors, one per 8 lanes and K
// position of the step. The code bytes come as words, byte 2l + t of lane l
// at the step's pair position t (formats/packed_quant.h).

template <Avx2Code Kind>
struct Avx2Step {
  // K positions per step: 4-bit codes hold pair groups 2h (low nibbles) and
  // 2h + 1 (high nibbles), so the positions are 4h + {0, 1, 2, 3}.
  static constexpr int kValues = kAvx2Nibbles<Kind> ? 4 : 2;
  // E2m1 codes as the bytes 2 v + 12 (0..24: the doubled values are the
  // integers -12..12), for the offset words of Avx2QuantTile.
  __m256i e2m1_bytes;

  Avx2Step() {
    alignas(32) uint8_t b[32];
    for (int u = 0; u < 32; ++u)
      b[u] = static_cast<uint8_t>(2.f * quant_code_value(QuantCode::kE2M1, 4, static_cast<uint8_t>(u & 15)) + 12.f);
    e2m1_bytes = _mm256_load_si256(reinterpret_cast<const __m256i*>(b));
  }

  // A step's codes as loaded: int8 the two halves' words sign-extended to
  // int32, e4m3 the 16 words as they are.
  struct Codes {
    __m256i v[2];
  };
  static inline Codes load(const uint8_t* src) {
    Codes c;
    if constexpr (Kind == Avx2Code::kE4m3) {
      c.v[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      c.v[1] = c.v[0];
      return c;
    }
    for (int h = 0; h < 2; ++h) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * h));
      c.v[h] = _mm256_cvtepi16_epi32(bytes);  // int8: the high byte's sign on top
    }
    return c;
  }

  // 8-bit codes (4-bit ones go as offset words in Avx2QuantTile):
  // out[h]: lanes 8h..8h+7 at the step's K position I, made just before
  // their products (all of a step's values at once, with the partial sums,
  // spilled out of the 16 registers). E4m3 gives the value times 2^-8
  // (kE4m3Unit), which the group's end puts back.
  template <int I>
  inline void values(const Codes& c, __m256* out) const {
    static_assert(!kAvx2Nibbles<Kind>, "4-bit codes go as offset words");
    if constexpr (Kind == Avx2Code::kE4m3) {
      // All 16 lanes at once, through half precision: a code's magnitude
      // bits shifted into a half's exponent and mantissa make the value
      // times 2^-8, subnormals included (the conversion reads no fp32
      // subnormal, so denormals-as-zero on the host changes nothing). The
      // code in a word's high byte (the odd position's, or the even one's
      // shifted up) shifted right by one with its sign: the sign stays in
      // bit 15 and comes again in bit 14, which the mask clears, and the
      // magnitude lands in bits 7-13.
      const __m256i w = c.v[0];
      const __m256i keep = _mm256_set1_epi16(static_cast<short>(0xbf80));
      const __m256i hv = _mm256_and_si256(_mm256_srai_epi16(I == 0 ? _mm256_slli_epi16(w, 8) : w, 1), keep);
      out[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(hv));
      out[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(hv, 1));
      return;
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i v = c.v[h];
      out[h] = _mm256_cvtepi32_ps(I == 0 ? _mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24) : _mm256_srai_epi32(v, 8));
    }
  }
};

// 8 lanes' fp32 scales of one panel and group.
static inline __m256 avx2_group_scales(const uint8_t* s, int scale_bytes) {
  if (scale_bytes == 4) return _mm256_loadu_ps(reinterpret_cast<const float*>(s));
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

// The fp32 vector operations of the code macro-kernel's traits
// (generic/macro_kernel.h) on 8 lanes.
struct Avx2Floats {
  using F = __m256;
  static inline F fzero() { return _mm256_setzero_ps(); }
  static inline F fload(const float* p) { return _mm256_loadu_ps(p); }
  static inline void fstore(float* p, F v) { _mm256_storeu_ps(p, v); }
  static inline F fadd(F x, F y) { return _mm256_add_ps(x, y); }
  static inline F fmul(F x, F y) { return _mm256_mul_ps(x, y); }
  static inline F ffma(F x, F y, F z) { return _mm256_fmadd_ps(x, y, z); }
};

// The micro-tile (generic/macro_kernel.h): a panel's 16 lanes in two
// registers of 8; a step's kValues K positions each take the row's value
// broadcast. Two chains per (row, panel, 8 lanes), the step's even and odd
// K positions, added at the group's end; the group's sum times its scale
// goes into C (SumsIn::kC).
//
// 4-bit codes go as offset bf16 words: 128 + u for int4, 128 + 2 v + 12 for
// e2m1; each group's sum less that offset times the sum of the row's values
// in the group (e2m1's halved). The sums run some 20-30 times the plain
// ones, so they keep about 19 of fp32's 24 bits, as the AVX-512 kernel's
// do, where the bf16 path's bounds need about 8. The nibbles of a step split
// in bytes (e2m1: looked up as 2 v + 12) and interleaved with 0x43 (in-lane
// unpacks) are the bf16 words 0x4300 | b = 128 + b of lanes L1 = {0-3,
// 8-11} (unpacklo, register 0) or L2 = {4-7, 12-15} (unpackhi, register 1),
// each dword a lane's pair of K positions; the even position's word shifted
// up and the odd one's masked are its fp32. 15 operations per 64 int4
// values (e2m1 17), against 22 widening each position's nibble to int32 and
// converting it (e2m1 about 40, by a permute of fp32 values); decode on
// AVX2 is bound by them. The group's end puts the lanes back in order.
template <Avx2Code Kind>
struct Avx2QuantTile : Avx2Floats {
  static constexpr bool kNibbles = kAvx2Nibbles<Kind>;
  using Row = float;
  using Sum = __m256;
  using Inner = __m256;
  using A = __m256;
  using B = __m256;
  struct Raw {
    __m256i v[2];  // nibbles: the low and high nibbles as bytes; 8-bit: Avx2Step's Codes
  };
  struct Codes {};
  struct Group {
    __m256 scale[2];
    __m256 offset[2];  // nibbles: 128 + the zero (8, the lanes' zero points, or e2m1's 12)
  };
  static constexpr int kV = 2, kS = Avx2Step<Kind>::kValues, kStepK = kS, kBlock = 0;
  static constexpr int64_t kStepBytes = 32;
  static constexpr int64_t kXsumStride = 0;
  static constexpr int kUnroll = 1;
  static constexpr bool kRowScale = false, kFetchScales = false, kInlineTake = true;
  // Codes fetched 2 KiB ahead into L1 (one thread's stream from memory
  // holds a few lines of compute per line: the prefetchers alone run out
  // of misses in flight).
  static constexpr int64_t ahead_bytes(int, int) { return 2048; }
  static constexpr bool panel_at_a_time(int, int) { return true; }
  static constexpr bool hold_rows(int, int) { return false; }
  Avx2Step<Kind> step;

  inline Raw load(const uint8_t* src) const {
    Raw raw;
    if constexpr (kNibbles) {
      const __m256i nibble = _mm256_set1_epi8(0x0f);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      raw.v[0] = _mm256_and_si256(wv, nibble);
      raw.v[1] = _mm256_and_si256(_mm256_srli_epi16(wv, 4), nibble);
      if constexpr (Kind == Avx2Code::kE2m1)
        for (__m256i& h : raw.v) h = _mm256_shuffle_epi8(step.e2m1_bytes, h);
    } else {
      const auto c = Avx2Step<Kind>::load(src);
      raw.v[0] = c.v[0];
      raw.v[1] = c.v[1];
    }
    return raw;
  }
  static inline Codes codes_of(const QuantPanels&, int64_t) { return {}; }
  // K position s of the step: nibbles from half s / 2, the pair's even or
  // odd word; 8-bit codes through Avx2Step::values.
  inline void expand(const Raw& raw, int s, Codes, B (&b)[2]) const {
    if constexpr (kNibbles) {
      const __m256i high = _mm256_set1_epi8(0x43);
      const __m256 odd_word = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xffff0000u)));
      for (int v = 0; v < 2; ++v) {
        const __m256i words = v == 0 ? _mm256_unpacklo_epi8(raw.v[s / 2], high) : _mm256_unpackhi_epi8(raw.v[s / 2], high);
        b[v] = s % 2 == 0 ? _mm256_castsi256_ps(_mm256_slli_epi32(words, 16))
                          : _mm256_and_ps(_mm256_castsi256_ps(words), odd_word);
      }
    } else {
      typename Avx2Step<Kind>::Codes c;
      c.v[0] = raw.v[0];
      c.v[1] = raw.v[1];
      if (s == 0) {
        step.template values<0>(c, b);
      } else {
        step.template values<1>(c, b);
      }
    }
  }
  static inline A a_operand(const float* row, int64_t st, int s) { return _mm256_broadcast_ss(row + st * kStepK + s); }
  static inline Sum dot(Sum acc, A x, B b) { return _mm256_fmadd_ps(x, b, acc); }
  static inline Sum sum_zero() { return _mm256_setzero_ps(); }
  static inline Sum add(Sum x, Sum y) { return _mm256_add_ps(x, y); }
  // The scales of lanes 0-7 and 8-15 (e2m1: halved, for the doubled values'
  // sums; exact).
  static inline Group scales_of(const QuantPanels& w, int64_t at) {
    Group g;
    for (int h = 0; h < 2; ++h) {
      g.scale[h] = avx2_group_scales(w.scales + (at + 8 * h) * w.scale_bytes, w.scale_bytes);
      if constexpr (Kind == Avx2Code::kE2m1) g.scale[h] = _mm256_mul_ps(g.scale[h], _mm256_set1_ps(0.5f));
      g.offset[h] = _mm256_set1_ps(Kind == Avx2Code::kE2m1 ? 140.f : 136.f);
      if constexpr (Kind == Avx2Code::kInt4Zero)
        g.offset[h] = _mm256_add_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.zeros + at + 8 * h)))),
            _mm256_set1_ps(128.f));
    }
    return g;
  }
  // Nibbles: the sum of the row's values in group j.
  static inline float row_group(const float* row, int, int64_t j, const QuantPanels& w, const float*) {
    if constexpr (!kNibbles) return 0.f;
    __m256 t = _mm256_loadu_ps(row + j * w.group);
    for (int64_t k = 8; k < w.group; k += 8) t = _mm256_add_ps(t, _mm256_loadu_ps(row + j * w.group + k));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
  }
  static inline void value(const Sum (&d)[2], const Group& g, float xsum, __m256 (&f)[2]) {
    if constexpr (kNibbles) {
      // Lanes L1 and L2 as lanes 0-7 and 8-15.
      const __m256 natural[2] = {_mm256_permute2f128_ps(d[0], d[1], 0x20), _mm256_permute2f128_ps(d[0], d[1], 0x31)};
      for (int h = 0; h < 2; ++h) f[h] = _mm256_fnmadd_ps(g.offset[h], _mm256_set1_ps(xsum), natural[h]);
    } else {
      for (int h = 0; h < 2; ++h)
        f[h] = Kind == Avx2Code::kE4m3 ? _mm256_mul_ps(d[h], _mm256_set1_ps(kE4m3Unit)) : d[h];  // exact
    }
  }
};

// Rows in pairs under one panel at a time, an odd row under two panels at
// a time (8 chains in flight either way); the passes after the first meet
// the call's codes in cache. The odd row's tiles take panels t and t + n
// (strided), so that each tile's two streams go on into the next tile's
// panels and run from end to end of the call, as the pairs' one stream
// does, instead of starting short streams anew per tile.
struct Avx2QuantSchedule {
  static constexpr int kRows = 2;
  static constexpr bool kPanelsOuter = false;
  static constexpr int panels(int mr) { return mr == 1 ? 2 : 1; }
  static constexpr int chains(int, int) { return 2; }
  static constexpr generic::SumsIn sums(int, int) { return generic::SumsIn::kC; }
  static constexpr bool strided(int mr, int) { return mr == 1; }
};

template <Avx2Code Kind>
static void avx2_gemm_quant_kind(const QuantPanels& w, const float* const* a, int m, int np, float* c, int64_t ldc,
                                 bool accumulate, const PrefetchRegion& next) {
  static const Avx2QuantTile<Kind> tile;
  generic::code_gemm<Avx2QuantTile<Kind>, Avx2QuantSchedule>(tile, w, a, m, np, c, ldc, accumulate, next, nullptr);
}

static void gemm_quant(const QuantPanels& w, const void* const* a_rows, int m, int np, float* c, int64_t ldc,
                       bool accumulate, const PrefetchRegion& next) {
  const float* const* a = reinterpret_cast<const float* const*>(a_rows);
  switch (w.code) {
    case QuantCode::kE4M3: return avx2_gemm_quant_kind<Avx2Code::kE4m3>(w, a, m, np, c, ldc, accumulate, next);
    case QuantCode::kE2M1: return avx2_gemm_quant_kind<Avx2Code::kE2m1>(w, a, m, np, c, ldc, accumulate, next);
    case QuantCode::kInt: break;
  }
  if (w.zeros) return avx2_gemm_quant_kind<Avx2Code::kInt4Zero>(w, a, m, np, c, ldc, accumulate, next);
  if (w.bits == 4) return avx2_gemm_quant_kind<Avx2Code::kInt4>(w, a, m, np, c, ldc, accumulate, next);
  avx2_gemm_quant_kind<Avx2Code::kInt8>(w, a, m, np, c, ldc, accumulate, next);
}

}  // namespace avx2
}  // namespace kt
