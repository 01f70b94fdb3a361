#include "formats/packed_bf16.h"

#include <algorithm>
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
  // For rows n, n+1 (n even) and columns k, k+1 (k even) the source holds the
  // 2x2 block as 8 contiguous bytes W[n][k], W[n][k+1], W[n+1][k], W[n+1][k+1]
  // (lanes n, n+1 of pair group k/2); the transposed panel wants W[n][k],
  // W[n+1][k], W[n][k+1], W[n+1][k+1] (lanes k, k+1 of pair group n/2):
  // one 8-byte read, a swap of the middle halves, one 8-byte write, with the
  // destination written sequentially.
  for (int64_t q = 0; q < nq; ++q) {
    bf16_t* out = dst + q * stride2;
    const int64_t cq = c0 + q * kPanelRows;  // first source column of this panel
    const int64_t valid = std::min<int64_t>(kPanelRows, c0 + cb - cq);
    for (int64_t np = 0; np < kp2 / 2; ++np) {
      const int64_t n = 2 * np;
      const bf16_t* src = packed + (n / kPanelRows) * s.panel_stride() + (n % kPanelRows) * 2;
      bf16_t* o = out + np * 2 * kPanelRows;
      int64_t c = 0;
      for (; c + 2 <= valid; c += 2) {
        const bf16_t* g = src + ((cq + c) / 2) * 2 * kPanelRows;
        uint64_t v;
        std::memcpy(&v, g, 8);
        const uint64_t swapped = (v & 0xffff00000000ffffull) | ((v >> 16) & 0x00000000ffff0000ull) |
                                 ((v << 16) & 0x0000ffff00000000ull);
        std::memcpy(o + c * 2, &swapped, 8);
      }
      for (; c < kPanelRows; ++c) {  // odd tail column, and zero lanes past cb
        bf16_t* oc = o + c * 2;
        if (c < valid) {
          const int64_t k = cq + c;
          const bf16_t* g = src + (k / 2) * 2 * kPanelRows + (k & 1);
          oc[0] = g[0];
          oc[1] = g[2];
        } else {
          oc[0] = oc[1] = 0;
        }
      }
    }
  }
}

}  // namespace kt
