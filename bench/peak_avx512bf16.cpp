// Register-blocked AVX-512 loops for the compute peaks. Compiled with
// -mavx512bf16 -mavx512f -mavx512bw -mavx512vl; called only on CPUs that
// report those features.
#include <immintrin.h>

#include "machine_limits.h"

namespace kt_bench {

namespace {
// Sixteen independent accumulators cover the dot-product latency on two
// ports (latency ~6 cycles x 2 ports = 12 in flight at least).
constexpr int kAccumulators = 16;

// Stores the sums so the loop cannot be optimised away (a plain store rather
// than _mm512_reduce_add_ps, which GCC 12 warns about inside its own header).
void keep(__m512 sum) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  volatile float sink = lanes[0] + lanes[15];
  (void)sink;
}
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

}  // namespace kt_bench
