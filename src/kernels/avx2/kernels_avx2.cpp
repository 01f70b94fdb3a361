// AVX2 + FMA kernels. A format is fp32; the bf16 weight pairs are widened in
// registers (even K: shift left 16, odd K: mask the high half).
#include <immintrin.h>

#include <cstring>

#include "formats/packed_bf16.h"
#include "kernels/kernels.h"

namespace kt {
namespace avx2 {

#include "kernels/sgemm_generic.inc"
#include "kernels/activation_generic.inc"

// MR rows x one 16-row panel: 2*MR accumulators + 4 widened weight vectors.
template <int MR>
static inline void tile(const float* const* a, int64_t kp, const bf16_t* w, float* c, int64_t ldc,
                        bool accumulate) {
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t g = 0; g < kp / 2; ++g) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 32));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 32 + 16));
    const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
    const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, hi_mask));
    const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
    const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, hi_mask));
    for (int r = 0; r < MR; ++r) {
      const __m256 a0 = _mm256_broadcast_ss(a[r] + 2 * g);
      const __m256 a1 = _mm256_broadcast_ss(a[r] + 2 * g + 1);
      acc[r][0] = _mm256_fmadd_ps(a0, e0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a0, e1, acc[r][1]);
      acc[r][0] = _mm256_fmadd_ps(a1, o0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a1, o1, acc[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
    if (accumulate) {
      acc[r][0] = _mm256_add_ps(acc[r][0], _mm256_loadu_ps(cr));
      acc[r][1] = _mm256_add_ps(acc[r][1], _mm256_loadu_ps(cr + 8));
    }
    _mm256_storeu_ps(cr, acc[r][0]);
    _mm256_storeu_ps(cr + 8, acc[r][1]);
  }
}

static void gemm_bf16w(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                       int64_t panel_stride, int np, float* c, int64_t ldc, bool accumulate,
                       const PrefetchRegion& /*next*/) {
  const float* const* a = reinterpret_cast<const float* const*>(a_rows);
  for (int p = 0; p < np; ++p) {
    const bf16_t* w = panels + p * panel_stride;
    float* cp = c + p * kPanelRows;
    int r = 0;
    for (; r + 4 <= m; r += 4) tile<4>(a + r, kp, w, cp + r * ldc, ldc, accumulate);
    switch (m - r) {
      case 3: tile<3>(a + r, kp, w, cp + r * ldc, ldc, accumulate); break;
      case 2: tile<2>(a + r, kp, w, cp + r * ldc, ldc, accumulate); break;
      case 1: tile<1>(a + r, kp, w, cp + r * ldc, ldc, accumulate); break;
      default: break;
    }
  }
}


}  // namespace avx2

extern const Kernels kernels_avx2 = {
    KT_ISA_AVX2, "gemm_bf16w_f32_f32_4x16__avx2_fma", 4, avx2::gemm_bf16w, nullptr, nullptr, avx2::pack_a_f32_copy,
    avx2::sgemm_nn_generic, avx2::sgemm_nt_generic, avx2::sgemm_tn_generic,
    avx2::transpose_panels_generic, avx2::act_forward_generic, avx2::act_backward_generic,
};

}  // namespace kt
