// The bf16 packed-panel weight format (layout in formats/panels.h). Frozen
// quantized formats (int8, int4 groups, fp8 blocks, mxfp4) add sibling
// formats whose panels are dequantized into this layout in cache.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/tensor.h"
#include "formats/panels.h"

namespace kt {

struct PanelShape {
  int64_t n = 0;   // logical rows (out)
  int64_t k = 0;   // logical columns (in)
  int64_t kp = 0;  // k rounded up to even
  int64_t np = 0;  // panels = ceil(n / 16)

  static PanelShape of(int64_t n, int64_t k) {
    PanelShape s;
    s.n = n;
    s.k = k;
    s.kp = (k + 1) / 2 * 2;
    s.np = (n + kPanelRows - 1) / kPanelRows;
    return s;
  }
  int64_t panel_stride() const { return kPanelRows * kp; }
  int64_t elements() const { return np * panel_stride(); }
  int64_t padded_rows() const { return np * kPanelRows; }
};

// Packs rows [row0, row0 + shape.n) of src (a 2-D [rows, k] view of any
// dtype/strides, taking every row_step-th row) into dst (shape.elements()).
void pack_bf16_panels(const View& src, int64_t row0, int64_t row_step, const PanelShape& shape,
                      bf16_t* dst);

// Element (r, c) of a packed matrix.
inline float packed_get(const bf16_t* p, const PanelShape& s, int64_t r, int64_t c) {
  const int64_t panel = r / kPanelRows, lane = r % kPanelRows;
  return bf16_to_f32(p[panel * s.panel_stride() + (c / 2) * 2 * kPanelRows + lane * 2 + (c & 1)]);
}

// W^T panels made in cache for backward: from packed W ([n, k]) builds the
// packed form of W^T rows [c0, c0 + cb) (c0 even), i.e. ceil(cb/16) panels
// of K' = s.padded_rows() (even, zero padded past n). dst holds
// ceil(cb/16) * 16 * s.padded_rows() elements.
void transpose_panels(const bf16_t* packed, const PanelShape& s, int64_t c0, int64_t cb, bf16_t* dst);

// The panels of packed rows [r0, r0 + rb) (r0 a multiple of 16): one
// contiguous block.
inline PrefetchRegion panel_block(const bf16_t* packed, const PanelShape& s, int64_t r0, int64_t rb) {
  return PrefetchRegion::block(packed + (r0 / kPanelRows) * s.panel_stride(),
                               (rb + kPanelRows - 1) / kPanelRows * s.panel_stride() *
                                   static_cast<int64_t>(sizeof(bf16_t)));
}

// What transpose_panels(packed, s, c0, cb) reads: a slice of every panel.
inline PrefetchRegion transpose_source(const bf16_t* packed, const PanelShape& s, int64_t c0, int64_t cb) {
  return {packed + c0 * kPanelRows, ((cb + 1) / 2) * 2 * kPanelRows * static_cast<int64_t>(sizeof(bf16_t)), s.np,
          s.panel_stride() * static_cast<int64_t>(sizeof(bf16_t))};
}

}  // namespace kt
