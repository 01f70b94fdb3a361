// The panel layout of packed weights, as the kernels read it: the rows of a
// panel, the operand of a quantized base, and the memory a kernel may fetch
// ahead. The formats (packed_bf16.h, packed_quant.h) write it; the kernels
// (kernels/kernels.h) read it.
//
// Packed weight layout (formats/packed_bf16.h, PanelShape): a logical [N, K] (out x in) matrix
// is stored as ceil(N/16) panels of 16 rows; a panel holds K_pad/2 groups of
// 16 x 2 bf16 (row-lane major, the K pair innermost), 64 bytes per group.
// K_pad = K rounded up to even, zero padded; rows past N are zero.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/dtype.h"

namespace kt {

constexpr int kPanelRows = 16;

// Memory a caller reads next: `chunks` chunks of chunk_bytes, stride bytes
// apart (one chunk: a contiguous block of panels; many: the slices of a
// packed matrix that W^T panels are built from). Kernels fetch it into cache
// while they compute.
struct PrefetchRegion {
  const void* base = nullptr;
  int64_t chunk_bytes = 0;
  int64_t chunks = 0;
  int64_t stride = 0;
  // A block of a quantized base's panels (formats/packed_quant.h): where
  // their scales and zero points begin (QuantPanels' layout), of which a
  // kernel may fetch the first with the codes'; nullptr where none.
  const void* quant_scales = nullptr;
  const void* quant_zeros = nullptr;

  static PrefetchRegion block(const void* p, int64_t bytes) { return {p, bytes, p ? 1 : 0, 0}; }
  int64_t lines_per_chunk() const { return (chunk_bytes + 63) / 64; }
  int64_t lines() const { return base ? chunks * lines_per_chunk() : 0; }
};

// What a stored code of a quantized base stands for (formats/packed_quant.h):
// a signed integer (int8, or int4 as u - 8), an fp8 e4m3 or an fp4 e2m1 value.
enum class QuantCode { kInt, kE4M3, kE2M1 };

// Panels of a quantized base as a GEMM operand (formats/packed_quant.h): the
// codes of panel p at codes + p * code_panel_bytes, the 16 scales of panel p
// and group j at scales + (p * scale_panel + 16 j) * scale_bytes (bf16, or
// fp32 when scale_bytes is 4). Asymmetric int4: the 16 zero bytes (z + 8)
// of panel p and group j at zeros + p * scale_panel + 16 j, and a code
// nibble u stands for u - zero byte; zeros is NULL for the other formats.
struct QuantPanels {
  const uint8_t* codes = nullptr;
  int64_t code_panel_bytes = 0;
  const uint8_t* scales = nullptr;
  int64_t scale_panel = 0;
  int scale_bytes = 2;
  const uint8_t* zeros = nullptr;
  int bits = 8;
  QuantCode code = QuantCode::kInt;
  int64_t kq = 0;     // K of the codes and of the A rows
  int64_t group = 0;  // K per scale, a multiple of 32 dividing kq
};

// A stored scale (fp32, or bf16 when scale_bytes is 2) as fp32.
inline float stored_scale(const uint8_t* at, int scale_bytes) {
  if (scale_bytes == 4) {
    float f;
    std::memcpy(&f, at, 4);
    return f;
  }
  bf16_t b;
  std::memcpy(&b, at, 2);
  return bf16_to_f32(b);
}
// The scale of panel p, group j and lane of w.
inline float quant_scale(const QuantPanels& w, int p, int64_t j, int lane) {
  return stored_scale(w.scales + (p * w.scale_panel + j * kPanelRows + lane) * w.scale_bytes,
                      w.scale_bytes);
}

}  // namespace kt
