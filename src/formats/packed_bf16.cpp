#include "formats/packed_bf16.h"

#include <cstring>

namespace kt {

void pack_bf16_panels(const View& src, int64_t row0, int64_t row_step, const PanelShape& s,
                      bf16_t* dst) {
  const bool fast = src.dtype == DType::kBF16 && (src.strides[1] == 1 || s.k == 1);
  const int64_t col_step = src.strides[1] * static_cast<int64_t>(src.elem_size());
  // Panel by panel, writing dst sequentially while reading the panel's 16
  // source rows as 16 sequential streams.
  for (int64_t P = 0; P < s.np; ++P) {
    bf16_t* out = dst + P * s.panel_stride();
    const char* rows[kPanelRows];
    int64_t live = 0;
    for (int l = 0; l < kPanelRows; ++l) {
      const int64_t r = P * kPanelRows + l;
      rows[l] = r < s.n ? src.at(row0 + r * row_step, 0) : nullptr;
      live += r < s.n;
    }
    for (int64_t g = 0; g < s.kp / 2; ++g) {
      bf16_t* o = out + g * 2 * kPanelRows;
      for (int l = 0; l < kPanelRows; ++l) {
        for (int t = 0; t < 2; ++t) {
          const int64_t c = 2 * g + t;
          bf16_t v = 0;
          if (l < live && c < s.k) {
            if (fast) {
              v = reinterpret_cast<const bf16_t*>(rows[l])[c];
            } else {
              v = f32_to_bf16(load_as_f32(rows[l] + c * col_step, src.dtype));
            }
          }
          o[l * 2 + t] = v;
        }
      }
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
