// Operands of an int8 compute GEMM (kernels.h, gemm_int8) for the kernel
// tests: one expert's panels of a quantized format with random codes,
// positive scales (e8m0 powers of two for mxfp4, as checkpoints hold), any
// zero bytes, and m int8 A rows quantized from Gaussian rows whose last 3
// values are padding.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "formats/packed_quant.h"
#include "kernels/kernels.h"

namespace kt_test {

struct Int8Operands {
  kt::QuantShape s;
  std::vector<uint8_t> expert;  // codes, scales, zero points
  int64_t row_stride = 0;
  std::vector<uint8_t> row_data;
  std::vector<const void*> rows;

  Int8Operands(kt_weight_format f, int np, int64_t k, int m, std::mt19937& rng)
      : s(kt::QuantShape::of(f, np * 16, k)), expert(static_cast<size_t>(s.expert_bytes)) {
    std::normal_distribution<float> nd;
    std::uniform_int_distribution<int> byte(0, 255);
    for (int64_t i = 0; i < s.scales_offset; ++i)
      expert[static_cast<size_t>(i)] = static_cast<uint8_t>(byte(rng));
    for (int64_t i = 0; i < np * s.scale_panel; ++i) {
      const float scale = f == KT_FORMAT_MXFP4 ? std::ldexp(1.f, byte(rng) % 12 - 8)
                                               : std::fabs(nd(rng)) * 0.05f + 0.001f;
      const kt::bf16_t b = kt::f32_to_bf16(scale);
      std::memcpy(expert.data() + s.scales_offset + i * 2, &b, 2);
    }
    if (s.zero_points)  // any stored zero byte z + 8
      for (int64_t i = 0; i < np * s.scale_panel; ++i)
        expert[static_cast<size_t>(s.zeros_offset + i)] = static_cast<uint8_t>(byte(rng) & 15);
    row_stride = kt::int8_row_bytes(s.kq, s.group);
    row_data.resize(static_cast<size_t>(m * row_stride));
    std::vector<float> x(static_cast<size_t>(s.kq));
    for (int i = 0; i < m; ++i) {
      for (auto& v : x) v = nd(rng);
      kt::quantize_int8_row(x.data(), k - 3, s.kq, s.group, s.bits == 4,
                            row_data.data() + i * row_stride);
      rows.push_back(row_data.data() + i * row_stride);
    }
  }
  kt::QuantPanels panels() const { return s.panels(expert.data(), 0); }
};

}  // namespace kt_test
