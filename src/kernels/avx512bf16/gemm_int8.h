// gemm_int8 (kernels.h) with AVX512-VNNI, bit for bit the generic kernel's
// result: a micro-tile of the code macro-kernel (generic/macro_kernel.h).
// vpdpbusd takes one operand as unsigned bytes: the weight codes go as u =
// q + off (Int8Codes) against the row's signed codes x, four products a
// lane, and each group's sum is taken back to sum x * q = sum x * u - off *
// sum x with the row's code sums (exact in int32: |sum x * u| <= 127 * 255 *
// group, and the layer keeps K <= 65536). Tiles of up to 4 rows x 4 panels:
// a step of 4 K values expands each panel's codes once for all rows.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/avx512bf16/gemm_quant.h"
#include "kernels/avx512bf16/int8_codes.h"
#include "kernels/generic/macro_kernel.h"
#include "kernels/generic/quant.h"
#include "kernels/kernels.h"

namespace kt {
namespace avx512bf16 {

// acc + the four products of each lane's unsigned bytes of u and signed bytes
// of x, in assembly (the unit is not built for AVX512-VNNI; the tiles run
// only where cpuid says it is there): GCC 12 compiles _mm512_dpbusd_epi32 on
// a tile of accumulators with a copy of each per step and spills some to the
// stack (the tile then ran at half the instruction's rate).
static inline __m512i dot_u8s8(__m512i acc, __m512i u, __m512i x) {
  __asm__("vpdpbusd %[x], %[u], %[acc]" : [acc] "+v"(acc) : [u] "v"(u), [x] "v"(x));
  return acc;
}

namespace {  // as Int8Codes: each unit its own copy

// The micro-tile (generic/macro_kernel.h): one 16-lane register per panel,
// one A operand (a row's 4 code bytes) per step of 4 K values.
template <int Bits, QuantCode Code, bool Zero>
struct Int8Tile : Avx512Floats, generic::Int8RowTail {
  using Row = uint8_t;
  using Sum = __m512i;
  using Inner = __m512i;
  using A = __m512i;
  using B = __m512i;
  struct Codes {};
  struct Group {
    __m512 scale[1];
    __m512i zero;  // zero points: the lanes' zero bytes, the codes' offsets
  };
  static constexpr int kV = 1, kS = 1, kStepK = 4, kBlock = 0;
  static constexpr int64_t kStepBytes = Int8Codes<Bits, Code>::kStepBytes;
  static constexpr int64_t kXsumStride = 0;
  static constexpr int kUnroll = 1;
  static constexpr bool kRowScale = true, kFetchScales = true;
  static constexpr int64_t ahead_bytes(int, int) { return 2048; }  // into L1
  static constexpr bool panel_at_a_time(int, int) { return false; }
  static constexpr bool hold_rows(int, int) { return false; }
  Int8Codes<Bits, Code> codes;

  inline __m512i load(const uint8_t* src) const { return codes.step(src); }
  inline Codes codes_of(const QuantPanels&, int64_t) const { return {}; }
  static inline void expand(__m512i raw, int, Codes, B (&b)[1]) { b[0] = raw; }
  static inline A a_operand(const uint8_t* row, int64_t step, int) {
    int32_t x4;
    __builtin_memcpy(&x4, row + step * 4, 4);
    return _mm512_set1_epi32(x4);
  }
  static inline Sum dot(Sum acc, A x, B u) { return dot_u8s8(acc, u, x); }
  static inline Sum sum_zero() { return _mm512_setzero_si512(); }
  static inline Sum add(Sum x, Sum y) { return _mm512_add_epi32(x, y); }
  static inline Group scales_of(const QuantPanels& w, int64_t at) {
    Group g{{group_scales(w.scales + at * w.scale_bytes, w.scale_bytes)}, _mm512_setzero_si512()};
    if constexpr (Zero) g.zero = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.zeros + at)));
    return g;
  }
  static inline void value(const Sum (&d)[1], const Group& g, int32_t sum, __m512 (&f)[1]) {
    const __m512i offset = Zero ? _mm512_mullo_epi32(g.zero, _mm512_set1_epi32(sum))
                                : _mm512_set1_epi32(Int8Codes<Bits, Code>::kOffset * sum);
    f[0] = _mm512_cvtepi32_ps(_mm512_sub_epi32(d[0], offset));
  }
  static inline __m512 row_scale(const uint8_t* row, const QuantPanels& w) {
    return _mm512_set1_ps(row_scale_of(row, w, Code == QuantCode::kE2M1));
  }
};

}  // namespace

// Rows in tiles of up to 4 under groups of 4 panels; one row tile (decode)
// streams the codes strided. Chains of sums per (row, panel): few of them
// (one row at decode) would wait on vpdpbusd's latency (the sums are exact,
// so their count changes no bits). The fp32 sums of the groups so far stay
// in registers for small tiles (one row at decode, where groups of 32 come
// every 8 steps), else in L1 (the registers hold the integer sums).
struct Int8Schedule {
  static constexpr int kRows = 4;
  static constexpr bool kPanelsOuter = false;
  static constexpr int panels(int) { return 4; }
  static constexpr int chains(int mr, int np) { return mr * np <= 4 ? 4 : mr * np <= 8 ? 2 : 1; }
  static constexpr generic::SumsIn sums(int mr, int np) {
    return mr * np <= 4 ? generic::SumsIn::kRegisters : generic::SumsIn::kL1;
  }
  static constexpr bool strided(int, int tiles) { return tiles == 1; }
};

template <int Bits, QuantCode Code, bool Zero>
static void gemm_int8_bits(const QuantPanels& w, const void* const* a_rows, int m, int np, float* c, int64_t ldc,
                           bool accumulate, const PrefetchRegion& next) {
  static const Int8Tile<Bits, Code, Zero> tile;
  generic::code_gemm<Int8Tile<Bits, Code, Zero>, Int8Schedule>(
      tile, w, reinterpret_cast<const uint8_t* const*>(a_rows), m, np, c, ldc, accumulate, next, nullptr);
}

static void gemm_int8(const QuantPanels& w, const void* const* a_rows, int m, int np, float* c, int64_t ldc,
                      bool accumulate, const PrefetchRegion& next) {
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  if (!vnni) {
    generic::gemm_int8_generic(w, a_rows, m, np, c, ldc, accumulate, next);
  } else if (w.bits == 8) {
    gemm_int8_bits<8, QuantCode::kInt, false>(w, a_rows, m, np, c, ldc, accumulate, next);
  } else if (w.code == QuantCode::kE2M1) {
    gemm_int8_bits<4, QuantCode::kE2M1, false>(w, a_rows, m, np, c, ldc, accumulate, next);
  } else if (w.zeros) {
    gemm_int8_bits<4, QuantCode::kInt, true>(w, a_rows, m, np, c, ldc, accumulate, next);
  } else {
    gemm_int8_bits<4, QuantCode::kInt, false>(w, a_rows, m, np, c, ldc, accumulate, next);
  }
}

}  // namespace avx512bf16
}  // namespace kt
