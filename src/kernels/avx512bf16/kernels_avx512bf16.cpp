// AVX-512 BF16 kernels: vdpbf16ps on bf16 pairs along K. A format is bf16
// (activations rounded to nearest even once, when packed); fp32 accumulate.
#include <immintrin.h>

#include "formats/packed_bf16.h"
#include "kernels/kernels.h"

namespace kt {
namespace avx512bf16 {

#include "kernels/sgemm_generic.inc"
#include "kernels/activation_generic.inc"

// MR rows x NP panels of 16: MR*NP accumulators (<= 24) + NP weight vectors.
template <int MR, int NP>
static inline void tile(const bf16_t* const* a, int64_t kp, const bf16_t* w, int64_t panel_stride,
                        float* c, int64_t ldc, bool accumulate) {
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t g = 0; g < kp / 2; ++g) {
    __m512bh b[NP];
    for (int p = 0; p < NP; ++p)
      b[p] = (__m512bh)_mm512_loadu_si512(w + p * panel_stride + g * 32);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      __builtin_memcpy(&pair, a[r] + 2 * g, 4);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], av, b[p]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
    for (int p = 0; p < NP; ++p) {
      if (accumulate) acc[r][p] = _mm512_add_ps(acc[r][p], _mm512_loadu_ps(cr + 16 * p));
      _mm512_storeu_ps(cr + 16 * p, acc[r][p]);
    }
  }
}

template <int NP>
static void rows(const bf16_t* const* a, int m, int64_t kp, const bf16_t* w, int64_t panel_stride,
                 float* c, int64_t ldc, bool accumulate) {
  constexpr int MR = NP == 4 ? 6 : NP == 3 ? 8 : NP == 2 ? 12 : 16;
  int r = 0;
  for (; r + MR <= m; r += MR) tile<MR, NP>(a + r, kp, w, panel_stride, c + r * ldc, ldc, accumulate);
  for (; r + 4 <= m; r += 4) tile<4, NP>(a + r, kp, w, panel_stride, c + r * ldc, ldc, accumulate);
  for (; r < m; ++r) tile<1, NP>(a + r, kp, w, panel_stride, c + r * ldc, ldc, accumulate);
}

static void gemm_bf16w(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                       int64_t panel_stride, int np, float* c, int64_t ldc, bool accumulate) {
  const bf16_t* const* a = reinterpret_cast<const bf16_t* const*>(a_rows);
  int p = 0;
  for (; p + 4 <= np; p += 4)
    rows<4>(a, m, kp, panels + p * panel_stride, panel_stride, c + p * kPanelRows, ldc, accumulate);
  switch (np - p) {
    case 3: rows<3>(a, m, kp, panels + p * panel_stride, panel_stride, c + p * kPanelRows, ldc, accumulate); break;
    case 2: rows<2>(a, m, kp, panels + p * panel_stride, panel_stride, c + p * kPanelRows, ldc, accumulate); break;
    case 1: rows<1>(a, m, kp, panels + p * panel_stride, panel_stride, c + p * kPanelRows, ldc, accumulate); break;
    default: break;
  }
}

static void pack_a_f32(const float* src, int64_t k, int64_t kp, void* dst) {
  bf16_t* d = static_cast<bf16_t*>(dst);
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    // Round to nearest even, as f32_to_bf16 does.
    __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src + i));
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    __mmask16 is_nan = _mm512_cmp_ps_mask(_mm512_castsi512_ps(u), _mm512_castsi512_ps(u), _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(is_nan, _mm512_srli_epi32(r, 16), nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), _mm512_cvtepi32_epi16(r));
  }
  for (; i < k; ++i) d[i] = f32_to_bf16(src[i]);
  for (; i < kp; ++i) d[i] = 0;
}

}  // namespace avx512bf16

extern const Kernels kernels_avx512bf16 = {
    KT_ISA_AVX512BF16, "gemm_bf16w_bf16_f32_6x64__avx512bf16", 2, avx512bf16::gemm_bf16w,
    avx512bf16::pack_a_f32, avx512bf16::sgemm_nn_generic, avx512bf16::sgemm_nt_generic, avx512bf16::sgemm_tn_generic,
    avx512bf16::transpose_panels_generic, avx512bf16::act_forward_generic, avx512bf16::act_backward_generic,
};

}  // namespace kt
