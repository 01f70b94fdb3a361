// Register-blocked AVX-512 loops for the compute peaks. Compiled with
// -mavx512bf16 -mavx512vnni -mavx512f -mavx512bw -mavx512vl; each called
// only on CPUs that report the features it uses. The AVX512_VNNI loops,
// vpdpbusd (u8 x s8, four products per lane) and vpdpwssd (s16 x s16, two),
// are what an int8 or int16 activation path would run instead of vdpbf16ps.
#include <immintrin.h>

#include <cstring>

#include "machine_limits.h"

namespace kt_bench {

namespace {
// Sixteen independent accumulators cover the dot-product latency on two
// ports (latency ~6 cycles x 2 ports = 12 in flight at least).
constexpr int kAccumulators = 16;

// Stores the sums so the loop cannot be optimised away (a plain store rather
// than _mm512_reduce_add_ps, which GCC 12 warns about inside its own header).
template <class Vector>
void keep(Vector sum) {
  static_assert(sizeof(Vector) == 64, "one 512-bit vector");
  int32_t lanes[16];
  std::memcpy(lanes, &sum, sizeof(lanes));
  volatile int32_t sink = lanes[0] ^ lanes[15];
  (void)sink;
}

// Integer dot products on sixteen independent chains, each from its own
// value. In assembly: GCC 12 compiles these intrinsics on an array of
// accumulators with a copy of every accumulator per step and one through the
// stack, which measured the loop, not the instruction (int8 1.55-2.0x the bf16
// dot from one build to the next).
// Eight of them per statement (an asm takes at most 30 operands), on named
// accumulators (an array's elements went through memory every step).
#define KT_BENCH_DOT8(insn, c0, c1, c2, c3, c4, c5, c6, c7)                                     \
  __asm__ volatile(insn " %[b], %[a], %[x0]\n\t" insn " %[b], %[a], %[x1]\n\t" insn             \
                        " %[b], %[a], %[x2]\n\t" insn " %[b], %[a], %[x3]\n\t" insn             \
                        " %[b], %[a], %[x4]\n\t" insn " %[b], %[a], %[x5]\n\t" insn             \
                        " %[b], %[a], %[x6]\n\t" insn " %[b], %[a], %[x7]\n\t"                  \
                   : [x0] "+v"(c0), [x1] "+v"(c1), [x2] "+v"(c2), [x3] "+v"(c3), [x4] "+v"(c4), \
                     [x5] "+v"(c5), [x6] "+v"(c6), [x7] "+v"(c7)                                \
                   : [a] "v"(a), [b] "v"(b))

template <bool kInt8>
void run_integer_chains(int64_t iterations) {
  static_assert(kAccumulators == 16, "sixteen named accumulators");
  __m512i c0 = _mm512_set1_epi32(0), c1 = _mm512_set1_epi32(1), c2 = _mm512_set1_epi32(2),
          c3 = _mm512_set1_epi32(3), c4 = _mm512_set1_epi32(4), c5 = _mm512_set1_epi32(5),
          c6 = _mm512_set1_epi32(6), c7 = _mm512_set1_epi32(7), c8 = _mm512_set1_epi32(8),
          c9 = _mm512_set1_epi32(9), c10 = _mm512_set1_epi32(10), c11 = _mm512_set1_epi32(11),
          c12 = _mm512_set1_epi32(12), c13 = _mm512_set1_epi32(13), c14 = _mm512_set1_epi32(14),
          c15 = _mm512_set1_epi32(15);
  const __m512i a = _mm512_set1_epi8(3);
  const __m512i b = _mm512_set1_epi8(-2);
  for (int64_t it = 0; it < iterations; ++it) {
    if constexpr (kInt8) {
      KT_BENCH_DOT8("vpdpbusd", c0, c1, c2, c3, c4, c5, c6, c7);
      KT_BENCH_DOT8("vpdpbusd", c8, c9, c10, c11, c12, c13, c14, c15);
    } else {
      KT_BENCH_DOT8("vpdpwssd", c0, c1, c2, c3, c4, c5, c6, c7);
      KT_BENCH_DOT8("vpdpwssd", c8, c9, c10, c11, c12, c13, c14, c15);
    }
  }
  const __m512i low =
      _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                       _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7)));
  const __m512i high =
      _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c8, c9), _mm512_add_epi32(c10, c11)),
                       _mm512_add_epi32(_mm512_add_epi32(c12, c13), _mm512_add_epi32(c14, c15)));
  keep(_mm512_add_epi32(low, high));
}
#undef KT_BENCH_DOT8
}  // namespace

double run_bf16_dot_avx512bf16(int64_t iterations) {
  __m512 acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_setzero_ps();
  // Small operands keep the sums finite and away from denormals.
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(2e-3f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(3e-3f), _mm512_set1_ps(1e-3f));
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < kAccumulators; ++i) sum = _mm512_add_ps(sum, acc[i]);
  keep(sum);
  // 16 lanes x 2 bf16 pairs x (multiply + add) per instruction.
  return static_cast<double>(iterations) * kAccumulators * 16 * 2 * 2;
}

double run_fp32_fma_avx512(int64_t iterations) {
  __m512 acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 a = _mm512_set1_ps(0.999999f);
  const __m512 b = _mm512_set1_ps(1e-6f);
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < kAccumulators; ++i) sum = _mm512_add_ps(sum, acc[i]);
  keep(sum);
  return static_cast<double>(iterations) * kAccumulators * 16 * 2;
}

double run_int8_dot_avx512vnni(int64_t iterations) {
  run_integer_chains<true>(iterations);
  // 16 lanes x 4 byte products x (multiply + add) per instruction.
  return static_cast<double>(iterations) * kAccumulators * 16 * 4 * 2;
}

double run_int16_dot_avx512vnni(int64_t iterations) {
  run_integer_chains<false>(iterations);
  // 16 lanes x 2 word products x (multiply + add) per instruction.
  return static_cast<double>(iterations) * kAccumulators * 16 * 2 * 2;
}

}  // namespace kt_bench
