// Portable scalar kernels: the reference twin of every ISA kernel. A format is
// fp32; accumulation in fp32 in K order.
#include <cmath>
#include <cstring>

#include "formats/packed_bf16.h"
#include "formats/packed_quant.h"
#include "kernels/counted.h"
#include "kernels/kernels.h"

namespace kt {
namespace ref {

#include "kernels/sgemm_generic.inc"
#include "kernels/activation_generic.inc"
#include "kernels/quant_generic.inc"

static void gemm_bf16w(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                       int64_t panel_stride, int np, float* c, int64_t ldc, bool accumulate,
                       const PrefetchRegion& /*next*/) {
  for (int r = 0; r < m; ++r) {
    const float* a = static_cast<const float*>(a_rows[r]);
    for (int p = 0; p < np; ++p) {
      const bf16_t* w = panels + p * panel_stride;
      float acc[kPanelRows];
      for (int l = 0; l < kPanelRows; ++l) acc[l] = 0.f;
      for (int64_t g = 0; g < kp / 2; ++g) {
        const bf16_t* wg = w + g * 2 * kPanelRows;
        for (int l = 0; l < kPanelRows; ++l)
          acc[l] += a[2 * g] * bf16_to_f32(wg[2 * l]) + a[2 * g + 1] * bf16_to_f32(wg[2 * l + 1]);
      }
      float* cr = c + r * ldc + p * kPanelRows;
      for (int l = 0; l < kPanelRows; ++l) cr[l] = accumulate ? cr[l] + acc[l] : acc[l];
    }
  }
}

}  // namespace ref

// Entries that run a GEMM count their calls (kernels/counted.h).
constexpr KernelTable kTable = KernelTable::kRef;
using E = KernelEntry;

extern const Kernels kernels_ref = {
    KT_ISA_REF,
    "gemm_bf16w_f32_f32_1x16__ref",
    4,
    counted<kTable, E::kGemmBf16w, ref::gemm_bf16w>,
    nullptr,
    nullptr,
    ref::pack_a_f32_copy,
    counted<kTable, E::kSgemmNn, ref::sgemm_nn_generic>,
    counted<kTable, E::kSgemmNt, ref::sgemm_nt_generic>,
    counted<kTable, E::kSgemmTn, ref::sgemm_tn_generic>,
    counted<kTable, E::kTransposePanels, ref::transpose_panels_generic>,
    ref::act_forward_generic,
    ref::act_backward_generic,
    ref::dequant_i8_generic,
    ref::dequant_i4_generic,
    ref::dequant_e4m3_generic,
    ref::dequant_e2m1_generic,
    ref::dequant_i4_zero_generic,
    counted<kTable, E::kGemmBf16wGrouped, ref::gemm_bf16w_grouped_fp32a>,
    nullptr,
    0,
    0,
    counted<kTable, E::kGemmInt8, ref::gemm_int8_generic>,
    false,
    false,
};

}  // namespace kt
