// The quantized-panel kernels written once (contracts in kernels.h), compiled
// in each ISA translation unit with its flags. Static functions: each unit
// that includes this header compiles its own copy (generic/sgemm.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"
#include "formats/packed_quant.h"
#include "kernels/kernels.h"

namespace kt {
namespace generic {

// Value of the code at (lane, column c) of a panel, and the bf16 that the
// dequantized panels hold for it.
template <int Bits, QuantCode Code>
static inline float code_value(const uint8_t* panel, int lane, int64_t c) {
  uint8_t raw;
  if constexpr (Bits == 8) {
    raw = panel[(c / 2) * 32 + lane * 2 + (c & 1)];
  } else {
    const int64_t pg = c / 2;
    const uint8_t b = panel[(pg / 2) * 32 + lane * 2 + (c & 1)];
    raw = static_cast<uint8_t>(pg % 2 ? b >> 4 : b & 0x0f);
  }
  return quant_code_value(Code, Bits, raw);
}

template <int Bits, QuantCode Code = QuantCode::kInt>
static void dequant_generic(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0, int64_t kc,
                            const float* scales, int64_t scale_stride, int64_t group, bf16_t* dst) {
  for (int p = 0; p < np; ++p) {
    const uint8_t* panel = codes + p * code_panel_bytes;
    bf16_t* out = dst + p * kPanelRows * kc;
    for (int64_t g = 0; g < kc / 2; ++g)
      for (int lane = 0; lane < kPanelRows; ++lane)
        for (int t = 0; t < 2; ++t) {
          const int64_t k = 2 * g + t;
          float v = code_value<Bits, Code>(panel, lane, k0 + k);
          if (scales) v *= scales[p * scale_stride + (k / group) * kPanelRows + lane];
          out[g * 2 * kPanelRows + lane * 2 + t] = f32_to_bf16(v);
        }
  }
}

[[maybe_unused]] static void dequant_e4m3_generic(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0,
                                                  int64_t kc, const float* scales, int64_t scale_stride,
                                                  int64_t group, bf16_t* dst) {
  dequant_generic<8, QuantCode::kE4M3>(codes, code_panel_bytes, np, k0, kc, scales, scale_stride, group, dst);
}

[[maybe_unused]] static void dequant_e2m1_generic(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0,
                                                  int64_t kc, const float* scales, int64_t scale_stride,
                                                  int64_t group, bf16_t* dst) {
  dequant_generic<4, QuantCode::kE2M1>(codes, code_panel_bytes, np, k0, kc, scales, scale_stride, group, dst);
}

[[maybe_unused]] static void dequant_i8_generic(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0,
                                                int64_t kc, const float* scales, int64_t scale_stride, int64_t group,
                                                bf16_t* dst) {
  dequant_generic<8>(codes, code_panel_bytes, np, k0, kc, scales, scale_stride, group, dst);
}

[[maybe_unused]] static void dequant_i4_generic(const uint8_t* codes, int64_t code_panel_bytes, int np, int64_t k0,
                                                int64_t kc, const float* scales, int64_t scale_stride, int64_t group,
                                                bf16_t* dst) {
  dequant_generic<4>(codes, code_panel_bytes, np, k0, kc, scales, scale_stride, group, dst);
}

// Asymmetric int4: (u - zero) [* scale] per element.
[[maybe_unused]] static void dequant_i4_zero_generic(const uint8_t* codes, int64_t code_panel_bytes, int np,
                                                     int64_t k0, int64_t kc, const uint8_t* zeros,
                                                     int64_t zero_stride, const float* scales, int64_t scale_stride,
                                                     int64_t group, bf16_t* dst) {
  for (int p = 0; p < np; ++p) {
    const uint8_t* panel = codes + p * code_panel_bytes;
    bf16_t* out = dst + p * kPanelRows * kc;
    for (int64_t g = 0; g < kc / 2; ++g)
      for (int lane = 0; lane < kPanelRows; ++lane)
        for (int t = 0; t < 2; ++t) {
          const int64_t k = 2 * g + t, c = k0 + k, pg = c / 2;
          const uint8_t b = panel[(pg / 2) * 32 + lane * 2 + (c & 1)];
          const int u = pg % 2 ? b >> 4 : b & 0x0f;
          const int64_t i = (k / group) * kPanelRows + lane;
          float v = static_cast<float>(u - zeros[p * zero_stride + i]);
          if (scales) v *= scales[p * scale_stride + i];
          out[g * 2 * kPanelRows + lane * 2 + t] = f32_to_bf16(v);
        }
  }
}

// gemm_bf16w_grouped on top of the unit's own gemm_bf16w (Gemm), one call per
// group into a tile that is then scaled: the reference twin's, plain and
// slow (a vector unit keeps each group's sums in registers instead, as the
// AVX2 one does for the quantized layer's prefill). ASize is the A
// format's element size.
template <int ASize, class Gemm>
static void gemm_grouped_by_calls(Gemm gemm, const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                                  int64_t panel_stride, int np, const float* scales, int64_t scale_stride,
                                  int64_t group, float* c, int64_t ldc, bool accumulate) {
  constexpr int kRows = 16, kPanels = 4;
  const void* rows[kRows];
  float tile[kRows * kPanels * kPanelRows];
  const PrefetchRegion none{};
  for (int r0 = 0; r0 < m; r0 += kRows) {
    const int mr = m - r0 < kRows ? m - r0 : kRows;
    for (int p0 = 0; p0 < np; p0 += kPanels) {
      const int npp = np - p0 < kPanels ? np - p0 : kPanels;
      for (int64_t j = 0; j * group < kp; ++j) {
        for (int r = 0; r < mr; ++r) rows[r] = static_cast<const char*>(a_rows[r0 + r]) + j * group * ASize;
        gemm(rows, mr, group, panels + p0 * panel_stride + j * group * kPanelRows, panel_stride, npp, tile,
             kPanels * kPanelRows, false, none);
        for (int r = 0; r < mr; ++r)
          for (int p = 0; p < npp; ++p) {
            const float* s = scales + (p0 + p) * scale_stride + j * kPanelRows;
            const float* t = tile + r * kPanels * kPanelRows + p * kPanelRows;
            float* cr = c + (r0 + r) * ldc + (p0 + p) * kPanelRows;
            const bool add = accumulate || j > 0;
            for (int l = 0; l < kPanelRows; ++l) cr[l] = add ? cr[l] + s[l] * t[l] : s[l] * t[l];
          }
      }
    }
  }
}

// The grouped GEMM of the units whose A format is fp32, over their own
// gemm_bf16w (Gemm).
template <auto Gemm>
static void gemm_bf16w_grouped_fp32a(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                                     int64_t panel_stride, int np, const float* scales, int64_t scale_stride,
                                     int64_t group, float* c, int64_t ldc, bool accumulate,
                                     const PrefetchRegion& /*next*/) {
  gemm_grouped_by_calls<sizeof(float)>(Gemm, a_rows, m, kp, panels, panel_stride, np, scales, scale_stride, group,
                                       c, ldc, accumulate);
}

// gemm_int8 (kernels.h), written once: the reference twin of the vector
// kernels, which compute the same bits (exact int32 group sums, the same fp32
// operations in the same order).
[[maybe_unused]] static void gemm_int8_generic(const QuantPanels& w, const void* const* a_rows, int m, int np,
                                               float* c, int64_t ldc, bool accumulate,
                                               const PrefetchRegion& /*next*/) {
  const int64_t groups = w.kq / w.group;
  const bool nibbles = w.bits == 4;
  const bool e2m1 = w.code == QuantCode::kE2M1;  // codes summed as the integers 2 * e2m1, halved with s
  for (int r = 0; r < m; ++r) {
    const int8_t* q = static_cast<const int8_t*>(a_rows[r]);
    float s;
    std::memcpy(&s, q + w.kq + 4 * groups, 4);
    if (e2m1) s *= 0.5f;
    for (int p = 0; p < np; ++p) {
      const uint8_t* panel = w.codes + p * w.code_panel_bytes;
      for (int lane = 0; lane < kPanelRows; ++lane) {
        float acc = 0.f;
        for (int64_t j = 0; j < groups; ++j) {
          int32_t d = 0;
          for (int64_t k = j * w.group; k < (j + 1) * w.group; ++k) {
            const int64_t at = nibbles ? (k & ~int64_t{3}) | ((k & 1) << 1) | ((k >> 1) & 1) : k;
            int code = static_cast<int>(e2m1      ? 2.f * code_value<4, QuantCode::kE2M1>(panel, lane, k)
                                        : nibbles ? code_value<4, QuantCode::kInt>(panel, lane, k)
                                                  : code_value<8, QuantCode::kInt>(panel, lane, k));
            if (w.zeros) code += 8 - w.zeros[p * w.scale_panel + j * kPanelRows + lane];  // u - zero byte
            d += q[at] * code;
          }
          acc = std::fma(static_cast<float>(d), quant_scale(w, p, j, lane), acc);
        }
        float* out = c + r * ldc + p * kPanelRows + lane;
        *out = accumulate ? std::fma(acc, s, *out) : acc * s;
      }
    }
  }
}

}  // namespace generic
}  // namespace kt
