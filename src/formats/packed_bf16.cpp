#include "formats/packed_bf16.h"

#include <cstring>

namespace kt {

void pack_bf16_panels(const View& src, int64_t row0, int64_t row_step, const PanelShape& s,
                      bf16_t* dst) {
  std::memset(dst, 0, static_cast<size_t>(s.elements()) * sizeof(bf16_t));
  const bool fast = src.dtype == DType::kBF16 && src.strides[1] == 1;
  for (int64_t r = 0; r < s.n; ++r) {
    const int64_t panel = r / kPanelRows, lane = r % kPanelRows;
    bf16_t* out = dst + panel * s.panel_stride() + lane * 2;
    const char* row = src.at(row0 + r * row_step, 0);
    if (fast) {
      const bf16_t* in = reinterpret_cast<const bf16_t*>(row);
      for (int64_t c = 0; c < s.k; ++c) out[(c / 2) * 2 * kPanelRows + (c & 1)] = in[c];
    } else {
      const int64_t step = src.strides[1] * static_cast<int64_t>(src.elem_size());
      for (int64_t c = 0; c < s.k; ++c)
        out[(c / 2) * 2 * kPanelRows + (c & 1)] = f32_to_bf16(load_as_f32(row + c * step, src.dtype));
    }
  }
}

void transpose_panels(const bf16_t* packed, const PanelShape& s, int64_t c0, int64_t cb, bf16_t* dst) {
  const int64_t kp2 = s.padded_rows();  // K' of the transposed panels
  const int64_t stride2 = kPanelRows * kp2;
  const int64_t nq = (cb + kPanelRows - 1) / kPanelRows;
  if (cb % kPanelRows) std::memset(dst, 0, static_cast<size_t>(nq * stride2) * sizeof(bf16_t));
  // Source group (panel P, pair g) holds W[16P + l][2g + t] at l*2 + t. It
  // goes to transposed panel q = (2g + t - c0) / 16, pair n/2, lane
  // (2g + t - c0) % 16, slot n % 2, with n = 16P + l.
  for (int64_t P = 0; P < s.np; ++P) {
    const bf16_t* src_panel = packed + P * s.panel_stride();
    for (int64_t g = c0 / 2; g < (c0 + cb + 1) / 2; ++g) {
      const bf16_t* grp = src_panel + g * 2 * kPanelRows;
      for (int t = 0; t < 2; ++t) {
        const int64_t c = 2 * g + t - c0;
        if (c >= cb) continue;
        bf16_t* out = dst + (c / kPanelRows) * stride2 + (c % kPanelRows) * 2;
        for (int l = 0; l < kPanelRows; l += 2) {
          const int64_t n = P * kPanelRows + l;
          bf16_t* o = out + (n / 2) * 2 * kPanelRows;
          o[0] = grp[l * 2 + t];
          o[1] = grp[(l + 1) * 2 + t];
        }
      }
    }
  }
}

}  // namespace kt
