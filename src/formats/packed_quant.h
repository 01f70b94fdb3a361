// Quantized frozen-base formats in the kernels' panel layout (kernels.h):
// the same 16-row panels and K pairs, holding codes instead of bf16 values,
// with a bf16 scale per (row, group of K). One copy of the weights; kernels
// dequantize a panel block into bf16 in cache.
//
// Per expert and projection ([n, k], out x in), one 64-byte aligned block:
//   codes:  np panels of code_panel_bytes, K padded to kq = round_up(k, 32)
//     8-bit codes (int8): byte (g * 32 + lane * 2 + t) is W[16P + lane][2g + t],
//       the bf16 panel order with one byte per element;
//     4-bit codes (int4): K pair groups go in twos: the 32 bytes of pair
//       groups (2h, 2h + 1) hold element j = lane * 2 + t of group 2h in the
//       low nibble of byte j and that of group 2h + 1 in the high nibble.
//       A nibble u stands for u - 8.
//   scales: np panels of ngroups * 16 bf16, [group][lane] within a panel.
// Padding (rows past n, columns past k) is code 0 with scale 0.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/tensor.h"
#include "kernels/kernels.h"
#include "kt_c_api.h"

namespace kt {

constexpr int64_t kQuantKAlign = 32;

inline bool is_quantized(kt_weight_format f) { return f != KT_FORMAT_BF16; }

struct QuantShape {
  kt_weight_format format = KT_FORMAT_BF16;
  int64_t n = 0, k = 0;
  int64_t kq = 0;       // k rounded up to 32: the A rows are padded to it
  int64_t np = 0;       // panels of 16 rows
  int bits = 0;         // 8 or 4
  int64_t group = 0;    // K elements per scale (kq: one scale per row)
  int64_t ngroups = 0;  // scales per row
  int64_t code_panel_bytes = 0;
  int64_t scale_panel = 0;  // scales per panel (ngroups * 16)
  int64_t scales_offset = 0, expert_bytes = 0;

  static QuantShape of(kt_weight_format f, int64_t n, int64_t k);
  const uint8_t* codes(const uint8_t* expert) const { return expert; }
  const bf16_t* scales(const uint8_t* expert) const {
    return reinterpret_cast<const bf16_t*>(expert + scales_offset);
  }
};

// Quantizes rows [row0, row0 + n * row_step) (every row_step-th) of src, a
// 2-D [rows, k] view of any float dtype and strides, into one expert's
// block (s.expert_bytes).
void quantize_panels(const View& src, int64_t row0, int64_t row_step, const QuantShape& s, uint8_t* dst);

// The value the layer computes with at (r, c): code * scale, exact in fp32.
float quant_get(const uint8_t* expert, const QuantShape& s, int64_t r, int64_t c);

// fp32 scales of panels [p0, p0 + np), groups [g0, g0 + ng): dst[p][j][16].
void quant_scales_f32(const uint8_t* expert, const QuantShape& s, int64_t p0, int64_t np, int64_t g0, int64_t ng,
                      float* dst);

// The codes of packed rows [r0, r0 + rb) (r0 a multiple of 16).
inline PrefetchRegion quant_panel_block(const uint8_t* expert, const QuantShape& s, int64_t r0, int64_t rb) {
  return PrefetchRegion::block(expert + (r0 / kPanelRows) * s.code_panel_bytes,
                               (rb + kPanelRows - 1) / kPanelRows * s.code_panel_bytes);
}

// The codes that columns [c0, c0 + cb) (c0 a multiple of 32) of every panel
// are dequantized from.
inline PrefetchRegion quant_column_source(const uint8_t* expert, const QuantShape& s, int64_t c0, int64_t cb) {
  const int64_t kc = (cb + kQuantKAlign - 1) / kQuantKAlign * kQuantKAlign;
  return {expert + c0 * kPanelRows * s.bits / 8, kc * kPanelRows * s.bits / 8, s.np, s.code_panel_bytes};
}

}  // namespace kt
