#include "formats/packed_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/ckpt_names.h"

namespace kt {

static int64_t align64(int64_t v) { return (v + 63) / 64 * 64; }

QuantShape QuantShape::of(kt_weight_format f, int64_t n, int64_t k) {
  QuantShape s;
  s.format = f;
  s.n = n;
  s.k = k;
  s.np = (n + kPanelRows - 1) / kPanelRows;
  const WeightFormat& w = *weight_format_of(f);
  s.zero_points = w.zero_points;
  s.bits = w.bits;
  s.code = w.code;
  s.scale_bytes = w.scale_bytes;
  // Groups wider than 32 pad K to whole groups, so every chunk of K the
  // kernels take holds whole groups; one scale per row pads K to 32.
  const int64_t align = w.group > kQuantKAlign ? w.group : kQuantKAlign;
  s.kq = (k + align - 1) / align * align;
  s.group = w.group ? w.group : s.kq;
  s.ngroups = s.kq / s.group;
  s.code_panel_bytes = kPanelRows * s.kq * s.bits / 8;
  s.scale_panel = s.ngroups * kPanelRows;
  s.scales_offset = align64(s.np * s.code_panel_bytes);
  s.zeros_offset = align64(s.scales_offset + s.np * s.scale_panel * s.scale_bytes);
  s.expert_bytes = s.zero_points ? align64(s.zeros_offset + s.np * s.scale_panel) : s.zeros_offset;
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

// The raw code (a byte, or a nibble) at (lane, c) of a panel's codes.
static inline uint8_t raw_code(const uint8_t* panel, int bits, int64_t lane, int64_t c) {
  if (bits == 8) return panel[code_index(lane, c)];
  const int64_t pg = c / 2;
  const uint8_t b = panel[(pg / 2) * 32 + lane * 2 + (c & 1)];
  return static_cast<uint8_t>(pg % 2 ? b >> 4 : b & 0x0f);
}

static inline void put_code(uint8_t* panel, int bits, int64_t lane, int64_t c, uint8_t raw) {
  if (bits == 8) {
    panel[code_index(lane, c)] = raw;
    return;
  }
  const int64_t pg = c / 2;
  uint8_t& b = panel[(pg / 2) * 32 + lane * 2 + (c & 1)];
  b = static_cast<uint8_t>(pg % 2 ? (b & 0x0f) | (raw << 4) : (b & 0xf0) | (raw & 0x0f));
}

float quant_get(const uint8_t* expert, const QuantShape& s, int64_t r, int64_t c) {
  const int64_t P = r / kPanelRows, lane = r % kPanelRows;
  const int64_t i = P * s.scale_panel + (c / s.group) * kPanelRows + lane;
  const uint8_t raw = raw_code(expert + P * s.code_panel_bytes, s.bits, lane, c);
  const float q = s.zero_points ? static_cast<float>(static_cast<int>(raw) - s.zero_at(expert, i))
                                : quant_code_value(s.code, s.bits, raw);
  return q * s.scale_at(expert, i);
}

// 16 stored scales from index `from` (panel-major) as fp32: straight
// loops per scale type, which the compiler vectorises.
static inline void lane_scales(const uint8_t* expert, const QuantShape& s, int64_t from, float* to) {
  const uint8_t* p = expert + s.scales_offset + from * s.scale_bytes;
  if (s.scale_bytes == 4) {
    std::memcpy(to, p, kPanelRows * sizeof(float));
    return;
  }
  uint16_t b[kPanelRows];
  std::memcpy(b, p, sizeof(b));
  for (int l = 0; l < kPanelRows; ++l) {
    const uint32_t bits = static_cast<uint32_t>(b[l]) << 16;
    std::memcpy(to + l, &bits, 4);
  }
}

void quant_scales_f32(const uint8_t* expert, const QuantShape& s, int64_t p0, int64_t np, int64_t g0, int64_t ng,
                      float* dst) {
  for (int64_t p = 0; p < np; ++p)
    for (int64_t j = 0; j < ng; ++j)
      lane_scales(expert, s, (p0 + p) * s.scale_panel + (g0 + j) * kPanelRows, dst + (p * ng + j) * kPanelRows);
}

void quant_scales_cols(const uint8_t* expert, const QuantShape& s, int64_t c0, int64_t kc, float* dst) {
  const int64_t nj = kc / kQuantKAlign;
  for (int64_t p = 0; p < s.np; ++p)
    for (int64_t j = 0; j < nj; ++j)
      lane_scales(expert, s, p * s.scale_panel + ((c0 + j * kQuantKAlign) / s.group) * kPanelRows,
                  dst + (p * nj + j) * kPanelRows);
}

void quant_zeros_cols(const uint8_t* expert, const QuantShape& s, int64_t c0, int64_t kc, uint8_t* dst) {
  const int64_t nj = kc / kQuantKAlign;
  for (int64_t p = 0; p < s.np; ++p)
    for (int64_t j = 0; j < nj; ++j)
      std::memcpy(dst + (p * nj + j) * kPanelRows,
                  expert + s.zeros_offset + p * s.scale_panel + ((c0 + j * kQuantKAlign) / s.group) * kPanelRows,
                  kPanelRows);
}

// ---------------------------------------------------- checkpoint sources

static inline uint8_t source_code(const QuantSource& src, int64_t R, int64_t c) {
  const uint8_t* row = src.codes + R * src.code_row_bytes;
  if (src.bits == 8) return row[c];
  const uint8_t b = row[c / 2];
  return static_cast<uint8_t>(c & 1 ? b >> 4 : b & 0x0f);
}

static inline int64_t source_row(const QuantSource& src, int64_t r) { return src.row0 + r * src.row_step; }

static inline bool e8m0_scales(const QuantSource& src) {
  return src.scale_dtype == KT_CKPT_DTYPE_E8M0 || src.scale_dtype == KT_CKPT_DTYPE_U8;
}

// The raw scale element of (source row R, group g) and its value.
static inline const uint8_t* scale_ptr(const QuantSource& src, int64_t R, int64_t g) {
  const int64_t i = (R / src.scale_row_div) * src.scale_row + g;
  const int64_t size = e8m0_scales(src) ? 1 : src.scale_dtype == KT_CKPT_DTYPE_F32 ? 4 : 2;
  return src.scales + i * size;
}

static inline float scale_value(const QuantSource& src, const uint8_t* p) {
  switch (src.scale_dtype) {
    case KT_CKPT_DTYPE_F32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case KT_CKPT_DTYPE_BF16:
    case KT_CKPT_DTYPE_F16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return src.scale_dtype == KT_CKPT_DTYPE_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
    }
    default: return e8m0_to_f32(*p);
  }
}

// The stored zero-point nibble (z + 8) of (source row R, group g).
static inline uint8_t zero_nibble(const QuantSource& src, int64_t R, int64_t g) {
  uint32_t w;
  std::memcpy(&w, src.zeros + ((R / 8) * src.zero_row + g) * 4, 4);
  return static_cast<uint8_t>((w >> (4 * (R % 8))) & 15u);
}

static inline int zero_point(const QuantSource& src, int64_t R, int64_t g) { return zero_nibble(src, R, g) - 8; }

static std::string hex_byte(uint8_t b) {
  static const char* digits = "0123456789abcdef";
  return std::string("0x") + digits[b >> 4] + digits[b & 15];
}

SourceProblem check_quant_source(const QuantSource& src, int64_t n, int64_t k, const QuantShape* into) {
  const std::string at = std::string(src.name);
  auto io = [](std::string t) { return SourceProblem{KT_ERR_IO, std::move(t)}; };
  auto unsupported = [](std::string t) { return SourceProblem{KT_ERR_UNSUPPORTED, std::move(t)}; };
  if (into && src.zeros && !into->zero_points)
    return unsupported(at + "': zero points (asymmetric int4) have no place in a " + weight_format_name(into->format) +
           " layer");
  if (into && !src.zeros && into->zero_points)
    return unsupported(at + "': symmetric int4 (no zero points) goes into int4_g32 or int4_g128, not a " +
                       weight_format_name(into->format) + " layer");
  const int64_t ngroups = (k + src.group - 1) / src.group;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t R = source_row(src, r);
    if (src.code == QuantCode::kE4M3)
      for (int64_t c = 0; c < k; ++c)
        if (e4m3_is_nan(source_code(src, R, c)))
          return io(at + "': row " + std::to_string(r) + ", column " + std::to_string(c) +
                    " holds the e4m3 NaN code " + hex_byte(source_code(src, R, c)));
    for (int64_t g = 0; g < ngroups; ++g) {
      const uint8_t* p = scale_ptr(src, R, g);
      // Built only for a problem: this loop runs once per group of every loaded expert.
      auto where = [&] {
        return at + "': the scale of row " + std::to_string(r) + ", columns " + std::to_string(g * src.group) + "-" +
               std::to_string(std::min(k, (g + 1) * src.group) - 1);
      };
      if (e8m0_scales(src) && e8m0_is_nan(*p)) return io(where() + " is the e8m0 NaN code 0xff");
      const float v = scale_value(src, p);
      if (!std::isfinite(v)) return io(where() + " is " + std::to_string(v) + ", not finite");
      if (into && into->scale_bytes == 2 && bf16_to_f32(f32_to_bf16(v)) != v)
        return unsupported(where() + " is " + std::to_string(v) + " (" + io::dtype_name(src.scale_dtype) +
                           "), not exact in the bf16 scales of a " + weight_format_name(into->format) +
                           " layer; load it dequantized");
    }
  }
  return SourceProblem{};
}

// A row of 4-bit source codes (two a byte, low nibble first) into lane
// `lane` of a panel, four columns a step: put_code keeps columns 4m and
// 4m+2 in byte 32m + 2 lane and columns 4m+1 and 4m+3 in the byte after it
// (low nibble first), so each source byte pair makes one such pair whole.
// As a little-endian 16-bit word, a source byte pair holds the nibbles of
// columns 4m..4m+3 in the order 0 1 2 3 and the panel's pair wants 0 2 1 3:
// the middle nibbles swap, for four quads of one 64-bit word at a time.
static void put_codes4(uint8_t* panel, int64_t lane, const uint8_t* row, int64_t k) {
  const int64_t quads = k / 4;
  int64_t m = 0;
  for (; m + 4 <= quads; m += 4) {
    uint64_t w;
    std::memcpy(&w, row + 2 * m, 8);
    w = (w & 0xF00FF00FF00FF00Full) | ((w & 0x00F000F000F000F0ull) << 4) | ((w & 0x0F000F000F000F00ull) >> 4);
    for (int j = 0; j < 4; ++j) {
      const uint16_t pair = static_cast<uint16_t>(w >> (16 * j));
      std::memcpy(panel + (m + j) * 32 + lane * 2, &pair, 2);
    }
  }
  for (; m < quads; ++m) {
    const uint8_t s0 = row[2 * m], s1 = row[2 * m + 1];
    uint8_t* b = panel + m * 32 + lane * 2;
    b[0] = static_cast<uint8_t>((s0 & 0x0f) | (s1 << 4));
    b[1] = static_cast<uint8_t>((s0 >> 4) | (s1 & 0xf0));
  }
  for (int64_t c = quads * 4; c < k; ++c) {
    const uint8_t b = row[c / 2];
    put_code(panel, 4, lane, c, static_cast<uint8_t>(c & 1 ? b >> 4 : b & 0x0f));
  }
}

void pack_quant_source(const QuantSource& src, const QuantShape& s, uint8_t* dst) {
  std::memset(dst, 0, static_cast<size_t>(s.expert_bytes));
  // The code of value 0 in the padding columns (the A rows are zero there).
  const uint8_t zero = s.code == QuantCode::kInt && s.bits == 4 ? 8 : 0;
  const int64_t ngroups = (s.k + s.group - 1) / s.group;
  uint8_t* scales = dst + s.scales_offset;
  for (int64_t r = 0; r < s.n; ++r) {
    const int64_t R = source_row(src, r), P = r / kPanelRows, lane = r % kPanelRows;
    uint8_t* panel = dst + P * s.code_panel_bytes;
    if (s.bits == 4 && src.bits == 4)
      put_codes4(panel, lane, src.codes + R * src.code_row_bytes, s.k);
    else
      for (int64_t c = 0; c < s.k; ++c) put_code(panel, s.bits, lane, c, source_code(src, R, c));
    // With zero points the padding columns (in the last group) take the
    // code of that group's zero.
    const uint8_t pad = s.zero_points ? zero_nibble(src, R, ngroups - 1) : zero;
    for (int64_t c = s.k; c < s.kq; ++c) put_code(panel, s.bits, lane, c, pad);
    for (int64_t g = 0; g < ngroups; ++g) {
      if (s.zero_points) dst[s.zeros_offset + P * s.scale_panel + g * kPanelRows + lane] = zero_nibble(src, R, g);
      const float v = scale_value(src, scale_ptr(src, R, g));
      uint8_t* to = scales + (P * s.scale_panel + g * kPanelRows + lane) * s.scale_bytes;
      if (s.scale_bytes == 4) {
        std::memcpy(to, &v, 4);
      } else {
        const bf16_t b = f32_to_bf16(v);
        std::memcpy(to, &b, 2);
      }
    }
  }
}

float quant_source_value(const QuantSource& src, int64_t r, int64_t c) {
  const int64_t R = source_row(src, r);
  float q = quant_code_value(src.code, src.bits, source_code(src, R, c));
  if (src.zeros) q -= static_cast<float>(zero_point(src, R, c / src.group));
  return q * scale_value(src, scale_ptr(src, R, c / src.group));
}

}  // namespace kt
