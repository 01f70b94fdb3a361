// Quantized frozen-base formats in the kernels' panel layout (formats/panels.h):
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
//       A nibble u stands for u - 8 (int4) or is an e2m1 code (mxfp4).
//     fp8 (e4m3) codes are bytes in the int8 order.
//   scales: np panels of ngroups * 16 scales, [group][lane] within a panel:
//     bf16, or fp32 for fp8 blocks (their fp32 scales are not exact in bf16;
//     e8m0 scales are powers of two, exact in bf16).
//   zeros (asymmetric int4, the _ZP formats): np panels of ngroups * 16
//     bytes, [group][lane] as the scales, each the zero point z + 8 (the
//     nibble as compressed-tensors stores it); W = (u - zero byte) * scale
//     for a code nibble u (= q + 8).
// K is padded to kq = round_up(k, 32), or to the group where groups are
// wider. Padding (rows past n, columns past k) has scale 0; in the _ZP
// formats padding rows have codes and zeros 0 and padding columns the code
// of their row's zero, so (u - zero) is 0 there as well.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "core/dtype.h"
#include "core/tensor.h"
#include "formats/formats.h"
#include "formats/panels.h"
#include "kt_c_api.h"

namespace kt {

constexpr int64_t kQuantKAlign = 32;

// The value of a raw code (a byte, or a nibble in the low 4 bits).
inline float quant_code_value(QuantCode code, int bits, uint8_t raw) {
  switch (code) {
    case QuantCode::kE4M3: return e4m3_to_f32(raw);
    case QuantCode::kE2M1: return e2m1_to_f32(raw);
    case QuantCode::kInt: break;
  }
  return bits == 8 ? static_cast<float>(static_cast<int8_t>(raw)) : static_cast<float>(static_cast<int>(raw) - 8);
}

struct QuantShape {
  kt_weight_format format = KT_FORMAT_BF16;
  int64_t n = 0, k = 0;
  int64_t kq = 0;       // k padded (see above): the A rows are padded to it
  int64_t np = 0;       // panels of 16 rows
  int bits = 0;         // 8 or 4
  QuantCode code = QuantCode::kInt;
  int scale_bytes = 2;  // 2: bf16 scales, 4: fp32 scales
  int64_t group = 0;    // K elements per scale (kq: one scale per row)
  int64_t ngroups = 0;  // scales per row
  int64_t code_panel_bytes = 0;
  int64_t scale_panel = 0;  // scales per panel (ngroups * 16); zero points too
  bool zero_points = false;
  int64_t scales_offset = 0, zeros_offset = 0, expert_bytes = 0;

  static QuantShape of(kt_weight_format f, int64_t n, int64_t k);
  const uint8_t* codes(const uint8_t* expert) const { return expert; }
  // Panels [p0, ...) of one expert's block as a GEMM operand.
  QuantPanels panels(const uint8_t* expert, int64_t p0) const {
    QuantPanels w;
    w.codes = expert + p0 * code_panel_bytes;
    w.code_panel_bytes = code_panel_bytes;
    w.scales = expert + scales_offset + p0 * scale_panel * scale_bytes;
    w.scale_panel = scale_panel;
    w.scale_bytes = scale_bytes;
    w.zeros = zero_points ? expert + zeros_offset + p0 * scale_panel : nullptr;
    w.bits = bits;
    w.code = code;
    w.kq = kq;
    w.group = group;
    return w;
  }
  // The fp32 value of stored scale i (panel-major index).
  float scale_at(const uint8_t* expert, int64_t i) const {
    return stored_scale(expert + scales_offset + i * scale_bytes, scale_bytes);
  }
  // The stored zero byte (z + 8) of index i (panel-major, as the scales).
  uint8_t zero_at(const uint8_t* expert, int64_t i) const { return expert[zeros_offset + i]; }
};

// Quantizes rows [row0, row0 + n * row_step) (every row_step-th) of src, a
// 2-D [rows, k] view of any float dtype and strides, into one expert's
// block (s.expert_bytes). Integer formats only (kt_quantizes_to).
void quantize_panels(const View& src, int64_t row0, int64_t row_step, const QuantShape& s, uint8_t* dst);

// The value the layer computes with at (r, c): code * scale (with zero
// points (u - zero) * scale), exact in fp32.
float quant_get(const uint8_t* expert, const QuantShape& s, int64_t r, int64_t c);

// fp32 scales of panels [p0, p0 + np), groups [g0, g0 + ng): dst[p][j][16].
void quant_scales_f32(const uint8_t* expert, const QuantShape& s, int64_t p0, int64_t np, int64_t g0, int64_t ng,
                      float* dst);

// fp32 scales of every panel for columns [c0, c0 + kc) (both multiples of
// 32) in steps of 32 columns: dst[p][j][16] is the scale of column c0 + 32 j
// (any group size; for dequantizing with group 32).
void quant_scales_cols(const uint8_t* expert, const QuantShape& s, int64_t c0, int64_t kc, float* dst);
// The stored zero bytes laid out as quant_scales_cols lays out the scales
// (formats with zero points).
void quant_zeros_cols(const uint8_t* expert, const QuantShape& s, int64_t c0, int64_t kc, uint8_t* dst);

// A projection quantized as a checkpoint stores it (io/layout.cpp finds the
// tensors), logical [n, k] (out x in), taking source rows row0 + r * row_step:
// - codes: source row R at codes + R * code_row_bytes; 8-bit codes: byte c;
//   4-bit codes: byte c / 2, the even column in the low nibble (int4 stored
//   as q + 8, the compressed-tensors int32 words read as little-endian bytes,
//   or e2m1);
// - scale of (r, c): element (R / scale_row_div) * scale_row + c / group of
//   scales, of scale_dtype (F32/BF16/F16, or E8M0/U8 as 2^(s - 127));
// - zeros (asymmetric int4, optional): compressed-tensors zero points, int32
//   words packing 8 rows ([ceil(n/8), groups], nibble R % 8 of word (R / 8,
//   g), stored as z + 8); W = (q - z) * scale.
struct QuantSource {
  QuantCode code = QuantCode::kInt;
  int bits = 8;
  int64_t group = 0;  // inputs per scale along a row
  const uint8_t* codes = nullptr;
  int64_t code_row_bytes = 0;
  const uint8_t* scales = nullptr;
  kt_ckpt_dtype scale_dtype = KT_CKPT_DTYPE_F32;
  int64_t scale_row = 0, scale_row_div = 1;
  const uint8_t* zeros = nullptr;
  int64_t zero_row = 0;  // int32 words per packed zero-point row (= groups)
  int64_t row0 = 0, row_step = 1;
  // Describes the source's tensors in messages ("...experts.3.gate_proj").
  const char* name = "";
};

// Checks every code and scale of the [n, k] source. status KT_OK when they
// are values, else KT_ERR_IO and what was found where (an e4m3 NaN code, an
// e8m0 scale 0xFF, a non-finite scale). With `into` (a layer format's shape
// of the same code kind, bits and group), also that the codes and scales go
// into its storage as they are: a scale not exact in a bf16-scaled format,
// or zero points where the format has none (or none where it has them), are
// KT_ERR_UNSUPPORTED.
struct SourceProblem {
  kt_status status = KT_OK;
  std::string text;
};
SourceProblem check_quant_source(const QuantSource& src, int64_t n, int64_t k, const QuantShape* into);

// Writes src (checked against s) into one expert's block of format s: the
// same codes, scales and zero points, no rounding.
void pack_quant_source(const QuantSource& src, const QuantShape& s, uint8_t* dst);

// The dequantized value W[r][c] of src in fp32 (exact: codes are exact in
// bf16, scales are fp32 values and e8m0 powers of two).
float quant_source_value(const QuantSource& src, int64_t r, int64_t c);

// The codes of packed rows [r0, r0 + rb) (r0 a multiple of 16), with where
// their scales and zero points begin.
inline PrefetchRegion quant_panel_block(const uint8_t* expert, const QuantShape& s, int64_t r0, int64_t rb) {
  PrefetchRegion r = PrefetchRegion::block(expert + (r0 / kPanelRows) * s.code_panel_bytes,
                                           (rb + kPanelRows - 1) / kPanelRows * s.code_panel_bytes);
  const QuantPanels w = s.panels(expert, r0 / kPanelRows);
  r.quant_scales = w.scales;
  r.quant_zeros = w.zeros;
  return r;
}

// The codes that columns [c0, c0 + cb) (c0 a multiple of 32) of every panel
// are dequantized from.
inline PrefetchRegion quant_column_source(const uint8_t* expert, const QuantShape& s, int64_t c0, int64_t cb) {
  const int64_t kc = (cb + kQuantKAlign - 1) / kQuantKAlign * kQuantKAlign;
  return {expert + c0 * kPanelRows * s.bits / 8, kc * kPanelRows * s.bits / 8, s.np, s.code_panel_bytes};
}

}  // namespace kt
