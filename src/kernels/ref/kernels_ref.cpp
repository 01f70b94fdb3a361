// Portable scalar kernels: the reference twin of every ISA kernel. A format is
// fp32; accumulation in fp32 in K order.
#include <cmath>
#include <cstring>

#include "formats/packed_bf16.h"
#include "formats/packed_quant.h"
#include "kernels/counted.h"
#include "kernels/generic/activation.h"
#include "kernels/generic/quant.h"
#include "kernels/generic/sgemm.h"
#include "kernels/kernels.h"
#include "kernels/update.h"

namespace kt {
namespace ref {

using namespace generic;  // the kernels written once, compiled here as portable code

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

// C = A W: each value summed over W's rows in order.
static void gemm_bf16w_nn(const void* const* a_rows, int m, const bf16_t* panels, int64_t panel_stride, int np,
                          int64_t c0, int64_t n, float* c, int64_t ldc, bool accumulate,
                          const PrefetchRegion& /*next*/) {
  for (int r = 0; r < m; ++r) {
    const float* a = static_cast<const float*>(a_rows[r]);
    float* cr = c + r * ldc;
    for (int64_t j = 0; j < n; ++j) {
      // Column k of row i: element 2 (k / 2) * 16 + 2 (i % 16) + k % 2 of
      // panel i / 16.
      const int64_t k = c0 + j, at = (k / 2) * 2 * kPanelRows + k % 2;
      float acc = 0.f;
      for (int64_t i = 0; i < int64_t{kPanelRows} * np; ++i)
        acc += a[i] * bf16_to_f32(panels[(i / kPanelRows) * panel_stride + at + 2 * (i % kPanelRows)]);
      cr[j] = accumulate ? cr[j] + acc : acc;
    }
  }
}

}  // namespace ref

// Entries that run a GEMM count their calls (kernels/counted.h).
constexpr KernelTable kTable = KernelTable::kRef;
using E = KernelEntry;

constexpr Kernels make_kernels_ref() {
  Kernels k;
  k.isa = KT_ISA_REF;
  k.gemm_name = "gemm_bf16w_f32_f32_1x16__ref";
  k.a_elem_size = sizeof(float);
  k.gemm_bf16w = counted<kTable, E::kGemmBf16w, ref::gemm_bf16w>;
  k.gemm_bf16w_nn = counted<kTable, E::kGemmBf16wNn, ref::gemm_bf16w_nn>;
  // gemm_zip_bf16, zip_rows_bf16: none (the A format is fp32).
  k.pack_a_f32 = ref::pack_a_f32_copy;
  k.sgemm_nn = counted<kTable, E::kSgemmNn, ref::sgemm_nn_generic>;
  k.sgemm_nt = counted<kTable, E::kSgemmNt, ref::sgemm_nt_generic>;
  k.sgemm_tn = counted<kTable, E::kSgemmTn, ref::sgemm_tn_generic>;
  k.transpose_panels = counted<kTable, E::kTransposePanels, ref::transpose_panels_generic>;
  k.act_forward = ref::act_forward_generic;
  k.act_backward = ref::act_backward_generic;
  k.dequant_i8 = ref::dequant_i8_generic;
  k.dequant_i4 = ref::dequant_i4_generic;
  k.dequant_e4m3 = ref::dequant_e4m3_generic;
  k.dequant_e2m1 = ref::dequant_e2m1_generic;
  k.dequant_i4_zero = ref::dequant_i4_zero_generic;
  k.gemm_bf16w_grouped = counted<kTable, E::kGemmBf16wGrouped, ref::gemm_bf16w_grouped_fp32a<ref::gemm_bf16w>>;
  // gemm_quant: none; quantized bases always dequantize into cache.
  k.gemm_int8 = counted<kTable, E::kGemmInt8, ref::gemm_int8_generic>;
  k.optimizer = &optim::generic::kKernels;
  // Tuning: no gemm_quant to switch to.
  k.gemm_quant_rows_int8 = 0;
  k.gemm_quant_rows_e4m3 = 0;
  k.gemm_quant_rows_4bit = 0;
  // The W^T panels' transposes would be the same loops again.
  k.gemm_bf16w_nn_rows = 1 << 30;
  // Reads every row through its pointer and fetches nothing ahead.
  k.gemm_bf16w_fetches_panels = false;
  k.gemm_reads_spaced_rows = false;
  return k;
}

// Constant-initialised (a constant expression): complete before any code
// that runs while the library loads reads it.
constexpr Kernels kKernelsRef = make_kernels_ref();
extern const Kernels kernels_ref = kKernelsRef;

}  // namespace kt
