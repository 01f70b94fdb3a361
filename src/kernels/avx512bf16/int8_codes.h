// The weight codes of int8 compute as unsigned bytes, one step (4 K values of
// a panel's 16 lanes) at a time: lane L's 32-bit word holds its codes for the
// 4 bytes q[4s..4s+3] of an int8 A row (kernels.h; 4-bit codes in the rows'
// nibble order), each code u = value + kOffset (int8: the sign bit flipped,
// offset 128; int4: the nibble, offset 8, or with zero points the stored zero
// byte; e2m1: twice its value from a byte table, offset 12). vpdpbusd and
// AMX's tdpbsud take them as their unsigned operand. Included by the
// AVX-512 BF16 and AMX units (AVX512BW); in an unnamed namespace, so each
// unit compiles its own copy with its own flags.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "core/dtype.h"
#include "formats/packed_quant.h"
#include "kernels/kernels.h"

namespace kt {
namespace avx512bf16 {
namespace {

template <int Bits, QuantCode Code>
struct Int8Codes {
  static constexpr int64_t kStepBytes = Bits == 8 ? 64 : 32;  // codes of one step
  static constexpr int32_t kOffset = Bits == 8 ? 128 : Code == QuantCode::kE2M1 ? 12 : 8;
  __m512i quads, sign, nibbles, e2m1_table;

  Int8Codes() {
    // Int8: out word 2L is word L (pair group 2s of lane L), 2L + 1 word 16 + L
    // (pair group 2s + 1): each 32-bit lane holds its row's K values 4s..4s+3.
    alignas(64) static constexpr int16_t kLaneQuads[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                           8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    // e2m1: nibble n -> 2 * value(n) + 12, in each 16-byte lane of the table.
    alignas(16) static constexpr uint8_t kE2m1Doubled[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                                             12, 11, 10, 9,  8,  6,  4,  0};
    quads = _mm512_load_si512(kLaneQuads);
    sign = _mm512_set1_epi8(static_cast<char>(0x80));
    nibbles = _mm512_set1_epi16(0x0f0f);
    e2m1_table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2m1Doubled)));
  }

  // The step at src (kStepBytes of a panel's codes).
  inline __m512i step(const uint8_t* src) const {
    if constexpr (Bits == 8) {
      return _mm512_xor_si512(_mm512_permutexvar_epi16(quads, _mm512_loadu_si512(src)), sign);
    } else {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
      const __m512i u = _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(v, 4), nibbles, 0xa8);  // (v | v << 4) & 0x0f0f
      if constexpr (Code == QuantCode::kE2M1) return _mm512_shuffle_epi8(e2m1_table, u);
      return u;
    }
  }
};

}  // namespace
}  // namespace avx512bf16
}  // namespace kt
