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
  // integers -12..12), for the offset words of avx2_quant_tile.
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

  // 8-bit codes (4-bit ones go as offset words in avx2_quant_tile):
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
      // subnormal, so denormals-as-zero on the host changes nothing).
      const __m256i w = c.v[0];
      const __m256i mag = _mm256_set1_epi16(0x3f80), sign = _mm256_set1_epi16(static_cast<short>(0x8000));
      const __m256i hv = I == 0 ? _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(w, 7), mag),
                                                  _mm256_and_si256(_mm256_slli_epi16(w, 8), sign))
                                : _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 1), mag), _mm256_and_si256(w, sign));
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

// Where a tile's code fetches go past the end of its K range: the same
// panel of the next tile of the call, and past the call's last panel the
// next region's panels (whole panels of the same layout; kernels.h).
struct Avx2Ahead {
  const uint8_t* codes;  // this call's
  int np;
  const uint8_t* next = nullptr;  // the next region's codes
  int next_np = 0;
  int64_t stride;  // code_panel_bytes
  Avx2Ahead(const QuantPanels& w, int np_, const PrefetchRegion& r) : codes(w.codes), np(np_), stride(w.code_panel_bytes) {
    if (r.chunks == 1) {
      next = static_cast<const uint8_t*>(r.base);
      next_np = static_cast<int>(r.chunk_bytes / w.code_panel_bytes);
    }
  }
  // Panel q's first bytes at offset off of its K range (nullptr: none).
  const uint8_t* at(int q, int64_t off) const {
    if (q < np) return codes + q * stride + off;
    if (q - np < next_np) return next + (q - np) * stride + off;
    return nullptr;
  }
};

// Panels p0 + p ps of a call (p = 0, 1, ...).
struct Avx2Panels {
  int p0, ps;
};

// MR rows x NP panels (MR * NP <= 2: 8 chains of partial sums in registers):
// the panels `mine`, whose code streams go on (fetched ahead past the K
// range's end) into the panels `next`.
// Each (row, panel, 8 lanes) has two chains, the step's even and odd K
// positions, added at the group's end; the group's sum times its scale goes
// into C. The order depends on neither the tile's height nor the panel
// split, so a row's result is the one it gets alone.
template <Avx2Code Kind, int MR, int NP>
static void avx2_quant_tile(const Avx2Step<Kind>& cs, const QuantPanels& w, Avx2Panels mine, Avx2Panels next,
                            const float* const* a, float* c, int64_t ldc, bool accumulate, const Avx2Ahead& ahead) {
  constexpr int V = Avx2Step<Kind>::kValues;
  // 4-bit codes as offset bf16 words (below): 128 + u for int4, 128 + 2 v +
  // 12 for e2m1; each group's sum less that offset times the sum of the
  // row's values in the group (e2m1's halved). The sums run some 20-30
  // times the plain ones, so they keep about 19 of fp32's 24 bits, as the
  // AVX-512 kernel's do, where the bf16 path's bounds need about 8.
  constexpr bool kOffsetWords = kAvx2Nibbles<Kind>;
  // Codes fetched 2 KiB ahead into L1 (one thread's stream from memory
  // holds a few lines of compute per line: the prefetchers alone run out
  // of misses in flight), one line per two steps.
  constexpr int64_t kAhead = 2048;
  const int64_t steps_per_group = w.group / V;
  const int64_t groups = w.kq / w.group;
  const int64_t panel_bytes = w.kq * kPanelRows * (kAvx2Nibbles<Kind> ? 1 : 2) / 2;
  const uint8_t* codes[NP];
  int panel[NP];
  for (int p = 0; p < NP; ++p) {
    panel[p] = mine.p0 + p * mine.ps;
    codes[p] = w.codes + panel[p] * w.code_panel_bytes;
  }
  for (int64_t j = 0; j < groups; ++j) {
    __m256 part[MR][NP][2][2];  // row, panel, 8 lanes, chain
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
      #pragma GCC unroll 16
      for (int p = 0; p < NP; ++p)
        for (int h = 0; h < 2; ++h) part[r][p][h][0] = part[r][p][h][1] = _mm256_setzero_ps();
    const int64_t st0 = j * steps_per_group;
    for (int64_t st = st0; st < st0 + steps_per_group; st += 2) {  // steps per group: even
      const int64_t off = st * 32 + kAhead;
      #pragma GCC unroll 16
      for (int p = 0; p < NP; ++p) {
        const uint8_t* f = off < panel_bytes ? codes[p] + off : ahead.at(next.p0 + p * next.ps, off - panel_bytes);
        if (f) _mm_prefetch(reinterpret_cast<const char*>(f), _MM_HINT_T0);
      }
      #pragma GCC unroll 2
      for (int u = 0; u < 2; ++u) {
        const int64_t k = (st + u) * V;
        if constexpr (kOffsetWords) {
          // The nibbles of a step split in bytes (e2m1: looked up as 2 v +
          // 12) and interleaved with 0x43 (in-lane unpacks) are the bf16
          // words 0x4300 | b = 128 + b of lanes L1 = {0-3, 8-11} (unpacklo)
          // or L2 = {4-7, 12-15} (unpackhi), each dword a lane's pair of K
          // positions; the even position's word shifted up and the odd
          // one's masked are its fp32. 15 operations per 64 int4 values
          // (e2m1 17), against 22 widening each position's nibble to int32
          // and converting it (e2m1 about 40, by a permute of fp32 values);
          // decode on AVX2 is bound by them.
          const __m256i nibble = _mm256_set1_epi8(0x0f), high = _mm256_set1_epi8(0x43);
          const __m256 odd_word = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xffff0000u)));
          #pragma GCC unroll 2
          for (int p = 0; p < NP; ++p) {
            const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes[p] + (st + u) * 32));
            __m256i half[2] = {_mm256_and_si256(wv, nibble), _mm256_and_si256(_mm256_srli_epi16(wv, 4), nibble)};
            if constexpr (Kind == Avx2Code::kE2m1)
              for (__m256i& h : half) h = _mm256_shuffle_epi8(cs.e2m1_bytes, h);
            #pragma GCC unroll 4
            for (int q = 0; q < 4; ++q) {  // nibble half q / 2 (K positions 2 (q / 2) + {0, 1}), lanes L1 or L2
              const __m256i words = q % 2 == 0 ? _mm256_unpacklo_epi8(half[q / 2], high)
                                               : _mm256_unpackhi_epi8(half[q / 2], high);
              const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
              const __m256 odd = _mm256_and_ps(_mm256_castsi256_ps(words), odd_word);
              const int64_t kq = k + 2 * (q / 2);
              #pragma GCC unroll 2
              for (int r = 0; r < MR; ++r) {
                part[r][p][q % 2][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(a[r] + kq), even, part[r][p][q % 2][0]);
                part[r][p][q % 2][1] = _mm256_fmadd_ps(_mm256_broadcast_ss(a[r] + kq + 1), odd, part[r][p][q % 2][1]);
              }
            }
          }
        } else {
          typename Avx2Step<Kind>::Codes v[NP];
          #pragma GCC unroll 2
          for (int p = 0; p < NP; ++p) v[p] = cs.load(codes[p] + (st + u) * 32);
          const auto products = [&](auto position) {
            constexpr int I = decltype(position)::value;
            __m256 av[MR];
            #pragma GCC unroll 2
            for (int r = 0; r < MR; ++r) av[r] = _mm256_broadcast_ss(a[r] + k + I);
            #pragma GCC unroll 2
            for (int p = 0; p < NP; ++p) {
              __m256 b[2];
              cs.template values<I>(v[p], b);
              #pragma GCC unroll 2
              for (int h = 0; h < 2; ++h)
                #pragma GCC unroll 2
                for (int r = 0; r < MR; ++r) part[r][p][h][I % 2] = _mm256_fmadd_ps(av[r], b[h], part[r][p][h][I % 2]);
            }
          };
          products(std::integral_constant<int, 0>{});
          products(std::integral_constant<int, 1>{});
        }
      }
    }
    __m256 xsum[MR];  // Offset words: the sums of the rows' values in the group
    if constexpr (kOffsetWords) {
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        __m256 t = _mm256_loadu_ps(a[r] + j * w.group);
        for (int64_t k = 8; k < w.group; k += 8) t = _mm256_add_ps(t, _mm256_loadu_ps(a[r] + j * w.group + k));
        const __m128 q = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
        xsum[r] = _mm256_set1_ps(_mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d))));
      }
    }
    #pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) {
      const int64_t at = panel[p] * w.scale_panel + j * kPanelRows;
      // Offset words: the chains' sums of lanes L1 and L2, as lanes 0-7 and 8-15.
      __m256 natural[MR][2];
      if constexpr (kOffsetWords) {
        #pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          const __m256 l1 = _mm256_add_ps(part[r][p][0][0], part[r][p][0][1]);
          const __m256 l2 = _mm256_add_ps(part[r][p][1][0], part[r][p][1][1]);
          natural[r][0] = _mm256_permute2f128_ps(l1, l2, 0x20);
          natural[r][1] = _mm256_permute2f128_ps(l1, l2, 0x31);
        }
      }
      #pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m256 s = avx2_group_scales(w.scales + (at + 8 * h) * w.scale_bytes, w.scale_bytes);
        // 128 + the zero: 8, or the lanes' zero points; e2m1 128 + 12, and
        // the doubled values' sums halved with the scale (exact).
        __m256 offset = _mm256_set1_ps(Kind == Avx2Code::kE2m1 ? 140.f : 136.f);
        if constexpr (Kind == Avx2Code::kE2m1) s = _mm256_mul_ps(s, _mm256_set1_ps(0.5f));
        if constexpr (Kind == Avx2Code::kInt4Zero)
          offset = _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.zeros + at + 8 * h)))),
                                 _mm256_set1_ps(128.f));
        #pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          __m256 sum = kOffsetWords ? natural[r][h] : _mm256_add_ps(part[r][p][h][0], part[r][p][h][1]);
          if constexpr (kOffsetWords) sum = _mm256_fnmadd_ps(offset, xsum[r], sum);
          if constexpr (Kind == Avx2Code::kE4m3) sum = _mm256_mul_ps(sum, _mm256_set1_ps(kE4m3Unit));  // exact
          float* cr = c + r * ldc + panel[p] * kPanelRows + 8 * h;
          const __m256 before = j == 0 && !accumulate ? _mm256_setzero_ps() : _mm256_loadu_ps(cr);
          _mm256_storeu_ps(cr, _mm256_fmadd_ps(sum, s, before));
        }
      }
    }
  }
}

// Rows in pairs under one panel at a time, then an odd row under two
// panels at a time (8 chains in flight either way); the passes after the
// first meet the call's codes in cache. The odd row's tiles over the
// call's first 2n panels take panels t and t + n, so that each tile's two
// streams go on into the next tile's panels (a panel's codes follow the
// one before it) and run from end to end of the call, as the pairs' one
// stream does, instead of starting short streams anew per tile.
template <Avx2Code Kind>
static void avx2_gemm_quant_kind(const QuantPanels& w, const float* const* a, int m, int np, float* c, int64_t ldc,
                                 bool accumulate, const PrefetchRegion& next) {
  static const Avx2Step<Kind> cs;
  const Avx2Ahead ahead(w, np, next);
  int r = 0;
  for (; r + 2 <= m; r += 2)
    for (int p = 0; p < np; ++p)
      avx2_quant_tile<Kind, 2, 1>(cs, w, {p, 1}, {p + 1, 1}, a + r, c + r * ldc, ldc, accumulate, ahead);
  if (r == m) return;
  const int n = np / 2;
  for (int t = 0; t < n; ++t) {
    const Avx2Panels then = t + 1 < n ? Avx2Panels{t + 1, n} : Avx2Panels{2 * n, 1};
    avx2_quant_tile<Kind, 1, 2>(cs, w, {t, n}, then, a + r, c + r * ldc, ldc, accumulate, ahead);
  }
  if (2 * n < np) avx2_quant_tile<Kind, 1, 1>(cs, w, {2 * n, 1}, {2 * n + 1, 1}, a + r, c + r * ldc, ldc, accumulate, ahead);
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
