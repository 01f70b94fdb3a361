// gemm_int8 (kernels.h) for AVX2: int8 A rows times a quantized base's
// integer codes, bit for bit the generic kernel's result. vpmaddubsw
// multiplies unsigned code bytes by the row's signed bytes and sums pairs in
// 16 bits; vpmaddwd sums a lane's two pairs in 32 bits. Each group's int32
// sums are exact, so only the order of the fp32 steps after them matters,
// and that is the generic kernel's. A micro-tile of the code macro-kernel
// (generic/macro_kernel.h); takes avx2_group_scales and Avx2Floats from
// gemm_quant.h.
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

// The micro-tile (generic/macro_kernel.h): MR rows x one panel, the
// panel's lanes in two registers (Avx2Int8Step's order), one A operand (a
// row's 4 code bytes) per step. Per group: the int32 sums (4-bit codes
// without AVX-VNNI add a block's 16-bit sums to them), the lanes put back in
// order, the offset taken off, the sums in fp32 times the group's scale
// added to the row's fp32 sums (L1; the generic kernel's start at +0 too);
// at the end those sums times the row's scale go into C.
template <Avx2Int8Kind Kind, bool Vnni>
struct Avx2Int8Tile : Avx2Floats, generic::Int8RowTail {
  using Step = Avx2Int8Step<Kind>;
  using Row = uint8_t;
  using Sum = __m256i;
  using Inner = __m256i;  // a block's 16-bit pair sums
  using A = __m256i;
  struct B {
    __m256i u;
    __m256i m;  // int8 codes without AVX-VNNI: |q|
  };
  struct Raw {
    __m256i u[2];
  };
  struct Codes {};
  struct Group {
    __m256 scale[2];
    __m256i offset[2];  // the codes' offset per lane, in lane order
  };
  // The codes' offset (int8 codes: 128 with AVX-VNNI, none without).
  static constexpr bool kOffsetSums = Kind != Avx2Int8Kind::kInt8 || Vnni;
  static constexpr int32_t kOffset = Kind == Avx2Int8Kind::kInt8 ? 128 : Step::kOffset;
  static constexpr int kV = 2, kS = 1, kStepK = 4;
  static constexpr int kBlock = Step::kNibbles && !Vnni ? Step::kBlock : 0;
  static constexpr int64_t kStepBytes = Step::kStepBytes;
  static constexpr int64_t kXsumStride = 0;
  static constexpr int kUnroll = Step::kBlock;  // a block's steps, with or without 16-bit sums
  static constexpr bool kRowScale = true, kFetchScales = false, kInlineTake = true;
  static constexpr int64_t ahead_bytes(int, int) { return 2048; }  // into L1, as gemm_quant's
  static constexpr bool panel_at_a_time(int, int) { return true; }
  static constexpr bool hold_rows(int, int) { return false; }
  Step step;

  inline Raw load(const uint8_t* src) const {
    Raw raw;
    step.load(src, raw.u);
    if constexpr (Vnni && !Step::kNibbles) {
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      raw.u[0] = _mm256_xor_si256(raw.u[0], flip);
      raw.u[1] = _mm256_xor_si256(raw.u[1], flip);
    }
    return raw;
  }
  static inline Codes codes_of(const QuantPanels&, int64_t) { return {}; }
  static inline void expand(const Raw& raw, int, Codes, B (&b)[2]) {
    for (int v = 0; v < 2; ++v) {
      b[v].u = raw.u[v];
      if constexpr (!Vnni && !Step::kNibbles) b[v].m = _mm256_abs_epi8(raw.u[v]);
    }
  }
  static inline A a_operand(const uint8_t* row, int64_t st, int) {
    int32_t x4;
    __builtin_memcpy(&x4, row + st * 4, 4);
    return _mm256_set1_epi32(x4);
  }
  // Integer sums may be added in any order, and GCC, free to, regroups a
  // block's unrolled steps of 16-bit sums into a tree whose products wait on
  // the stack (the 4-bit tiles' loops: int4 4 rows 93 of 316 instructions,
  // e2m1 2 rows 17 of 111). An empty asm on each block sum keeps one chain
  // per register, added step by step (int4 12, e2m1 1; kt_ab on Zen3:
  // int4_g32/int8 and mxfp4/int8 0.92-0.96x the time). The int8 codes'
  // 32-bit sums are left to GCC: ordered the same way they ran 1.02-1.03x.
  static inline __m256i in_order(__m256i sum) {
    asm("" : "+x"(sum));
    return sum;
  }
  static inline Sum dot(Sum d, A x, const B& b) {
    if constexpr (Vnni) {
      return dpbusd_vex(d, b.u, x);
    } else {
      const __m256i p = _mm256_maddubs_epi16(b.m, _mm256_sign_epi8(x, b.u));
      return _mm256_add_epi32(d, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
    }
  }
  static inline Inner inner_zero() { return _mm256_setzero_si256(); }
  static inline Inner inner_dot(Inner h, A x, const B& b) {
    return in_order(_mm256_add_epi16(h, _mm256_maddubs_epi16(b.u, x)));
  }
  static inline Sum flush(Sum d, Inner h) { return _mm256_add_epi32(d, _mm256_madd_epi16(h, _mm256_set1_epi16(1))); }
  static inline Sum sum_zero() { return _mm256_setzero_si256(); }
  static inline Sum add(Sum x, Sum y) { return _mm256_add_epi32(x, y); }
  static inline Group scales_of(const QuantPanels& w, int64_t at) {
    Group g;
    for (int t = 0; t < 2; ++t) {
      g.scale[t] = avx2_group_scales(w.scales + (at + 8 * t) * w.scale_bytes, w.scale_bytes);
      g.offset[t] = Kind == Avx2Int8Kind::kInt4Zero
                        ? _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.zeros + at + 8 * t)))
                        : _mm256_set1_epi32(kOffset);
    }
    return g;
  }
  static inline void value(const Sum (&d)[2], const Group& g, int32_t sum, __m256 (&f)[2]) {
    // Lanes 0-7 and 8-15 from the unpacks' halves.
    const __m256i n[2] = {_mm256_permute2x128_si256(d[0], d[1], 0x20), _mm256_permute2x128_si256(d[0], d[1], 0x31)};
    const __m256i xs = _mm256_set1_epi32(sum);
    for (int t = 0; t < 2; ++t)
      f[t] = _mm256_cvtepi32_ps(kOffsetSums ? _mm256_sub_epi32(n[t], _mm256_mullo_epi32(g.offset[t], xs)) : n[t]);
  }
  static inline __m256 row_scale(const uint8_t* row, const QuantPanels& w) {
    return _mm256_set1_ps(row_scale_of(row, w, Kind == Avx2Int8Kind::kE2m1));
  }
};

// Per panel, the rows in balanced tiles of at most 4: the first streams the
// panel's codes from memory, the others meet them in cache.
struct Avx2Int8Schedule {
  static constexpr int kRows = 4;
  static constexpr bool kPanelsOuter = true;
  static constexpr int panels(int) { return 1; }
  static constexpr int chains(int, int) { return 1; }
  static constexpr generic::SumsIn sums(int, int) { return generic::SumsIn::kL1; }
  static constexpr bool strided(int, int) { return false; }
};

template <Avx2Int8Kind Kind, bool Vnni>
static void avx2_gemm_int8_kind(const QuantPanels& w, const uint8_t* const* a, int m, int np, float* c, int64_t ldc,
                                bool accumulate, const PrefetchRegion& next) {
  static const Avx2Int8Tile<Kind, Vnni> tile;
  generic::code_gemm<Avx2Int8Tile<Kind, Vnni>, Avx2Int8Schedule>(tile, w, a, m, np, c, ldc, accumulate, next, nullptr);
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
