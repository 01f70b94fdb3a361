// AVX2/FMA loops: the fp32 FMA peak of the AVX2 path and the streaming read
// used for DRAM bandwidth. Compiled with -mavx2 -mfma; called only on CPUs
// that report both.
#include <immintrin.h>

#include "machine_limits.h"

namespace kt_bench {

namespace {
constexpr int kAccumulators = 12;  // FMA latency 4 cycles x 2 ports, with slack
}  // namespace

double run_fp32_fma_avx2(int64_t iterations) {
  __m256 acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  const __m256 a = _mm256_set1_ps(0.999999f);
  const __m256 b = _mm256_set1_ps(1e-6f);
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  __m256 sum = acc[0];
  for (int i = 1; i < kAccumulators; ++i) sum = _mm256_add_ps(sum, acc[i]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  volatile float sink = lanes[0] + lanes[7];
  (void)sink;
  return static_cast<double>(iterations) * kAccumulators * 8 * 2;
}

uint64_t stream_read_avx2(const void* data, size_t bytes) {
  // Two cache lines per iteration into four independent sums; the adds are
  // far cheaper than the loads, so the loop runs at the memory's pace.
  const __m256i* p = static_cast<const __m256i*>(data);
  const size_t vectors = bytes / sizeof(__m256i) / 4 * 4;
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i < vectors; i += 4) {
    s0 = _mm256_add_epi64(s0, _mm256_load_si256(p + i));
    s1 = _mm256_add_epi64(s1, _mm256_load_si256(p + i + 1));
    s2 = _mm256_add_epi64(s2, _mm256_load_si256(p + i + 2));
    s3 = _mm256_add_epi64(s3, _mm256_load_si256(p + i + 3));
  }
  const __m256i s = _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

}  // namespace kt_bench
