#include "formats/packed_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace kt {

static int64_t align64(int64_t v) { return (v + 63) / 64 * 64; }

QuantShape QuantShape::of(kt_weight_format f, int64_t n, int64_t k) {
  QuantShape s;
  s.format = f;
  s.n = n;
  s.k = k;
  s.kq = (k + kQuantKAlign - 1) / kQuantKAlign * kQuantKAlign;
  s.np = (n + kPanelRows - 1) / kPanelRows;
  s.bits = f == KT_FORMAT_INT4_G32 ? 4 : 8;
  s.group = f == KT_FORMAT_INT4_G32 ? 32 : s.kq;
  s.ngroups = s.kq / s.group;
  s.code_panel_bytes = kPanelRows * s.kq * s.bits / 8;
  s.scale_panel = s.ngroups * kPanelRows;
  s.scales_offset = align64(s.np * s.code_panel_bytes);
  s.expert_bytes = align64(s.scales_offset + s.np * s.scale_panel * static_cast<int64_t>(sizeof(bf16_t)));
  return s;
}

// The smallest bf16 at or above v (v >= 0, finite).
static bf16_t bf16_at_least(float v) {
  bf16_t b = f32_to_bf16(v);
  if (bf16_to_f32(b) < v) ++b;
  return b;
}

// Byte offset and nibble shift of code (lane, c) inside a panel's codes.
static inline int64_t code_index(int64_t lane, int64_t c) {
  return (c / 2) * 2 * kPanelRows + lane * 2 + (c & 1);
}

void quantize_panels(const View& src, int64_t row0, int64_t row_step, const QuantShape& s, uint8_t* dst) {
  std::memset(dst, 0, static_cast<size_t>(s.expert_bytes));
  bf16_t* scales = reinterpret_cast<bf16_t*>(dst + s.scales_offset);
  const float qmax = s.bits == 4 ? 7.f : 127.f;
  std::vector<float> row(static_cast<size_t>(s.k));
  for (int64_t r = 0; r < s.n; ++r) {
    const int64_t P = r / kPanelRows, lane = r % kPanelRows;
    for (int64_t c = 0; c < s.k; ++c) row[static_cast<size_t>(c)] = load_as_f32(src.at(row0 + r * row_step, c), src.dtype);
    uint8_t* codes = dst + P * s.code_panel_bytes;
    for (int64_t g = 0; g < s.ngroups; ++g) {
      const int64_t c0 = g * s.group, c1 = std::min(s.k, c0 + s.group);
      float amax = 0.f;
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(row[static_cast<size_t>(c)]));
      const bf16_t sb = bf16_at_least(amax / qmax);
      scales[P * s.scale_panel + g * kPanelRows + lane] = sb;
      const float scale = bf16_to_f32(sb);
      for (int64_t c = c0; c < c1; ++c) {
        const float q = scale > 0.f ? std::min(qmax, std::max(-qmax, std::nearbyint(row[static_cast<size_t>(c)] / scale)))
                                    : 0.f;
        const int qi = static_cast<int>(q);
        if (s.bits == 8) {
          codes[code_index(lane, c)] = static_cast<uint8_t>(static_cast<int8_t>(qi));
        } else {
          // Pair groups 2h and 2h+1 share 32 bytes: low nibble, high nibble.
          const int64_t pg = c / 2, j = lane * 2 + (c & 1);
          uint8_t& b = codes[(pg / 2) * 32 + j];
          const uint8_t u = static_cast<uint8_t>(qi + 8);
          b = static_cast<uint8_t>(pg % 2 ? (b & 0x0f) | (u << 4) : (b & 0xf0) | u);
        }
      }
      // Padding columns of a 4-bit row decode to 0: nibble 8.
      if (s.bits == 4)
        for (int64_t c = c1; c < (g + 1) * s.group; ++c) {
          const int64_t pg = c / 2, j = lane * 2 + (c & 1);
          uint8_t& b = codes[(pg / 2) * 32 + j];
          b = static_cast<uint8_t>(pg % 2 ? (b & 0x0f) | (8 << 4) : (b & 0xf0) | 8);
        }
    }
  }
}

float quant_get(const uint8_t* expert, const QuantShape& s, int64_t r, int64_t c) {
  const int64_t P = r / kPanelRows, lane = r % kPanelRows;
  const uint8_t* codes = expert + P * s.code_panel_bytes;
  int q;
  if (s.bits == 8) {
    q = static_cast<int8_t>(codes[code_index(lane, c)]);
  } else {
    const int64_t pg = c / 2, j = lane * 2 + (c & 1);
    const uint8_t b = codes[(pg / 2) * 32 + j];
    q = (pg % 2 ? b >> 4 : b & 0x0f) - 8;
  }
  const float scale = bf16_to_f32(s.scales(expert)[P * s.scale_panel + (c / s.group) * kPanelRows + lane]);
  return static_cast<float>(q) * scale;
}

void quant_scales_f32(const uint8_t* expert, const QuantShape& s, int64_t p0, int64_t np, int64_t g0, int64_t ng,
                      float* dst) {
  const bf16_t* sc = s.scales(expert);
  for (int64_t p = 0; p < np; ++p)
    for (int64_t j = 0; j < ng; ++j) {
      const bf16_t* from = sc + (p0 + p) * s.scale_panel + (g0 + j) * kPanelRows;
      float* to = dst + (p * ng + j) * kPanelRows;
      for (int l = 0; l < kPanelRows; ++l) to[l] = bf16_to_f32(from[l]);
    }
}

}  // namespace kt
