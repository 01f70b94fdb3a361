// Work-item geometry shared by forward and backward: a column block is 4
// panels (64 output columns); rows go in chunks of 64 so a chunk's A rows and
// C tile stay in L1/L2 while a block of weight panels streams past.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/tensor.h"
#include "kernels/kernels.h"

namespace kt {

constexpr int64_t kBlockPanels = 4;
constexpr int64_t kBlockCols = kBlockPanels * kPanelRows;
constexpr int64_t kRowChunk = 64;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Column ownership: a work item owns columns [col0, col0 + ncols) of an fp32
// accumulator [T, ld] for all tokens. It clears them, adds every expert's
// contribution in expert order, then stores them into out ([T, *], bf16 or
// fp32, unit inner stride).
inline void clear_columns(float* acc, int64_t T, int64_t ld, int64_t col0, int64_t ncols) {
  for (int64_t t = 0; t < T; ++t) std::memset(acc + t * ld + col0, 0, static_cast<size_t>(ncols) * sizeof(float));
}

inline void store_columns(const float* acc, int64_t T, int64_t ld, int64_t col0, int64_t ncols, const View& out) {
  for (int64_t t = 0; t < T; ++t) {
    const float* src = acc + t * ld + col0;
    char* dst = out.at(t, col0);
    if (out.dtype == DType::kF32) {
      std::memcpy(dst, src, static_cast<size_t>(ncols) * sizeof(float));
    } else {
      bf16_t* d = reinterpret_cast<bf16_t*>(dst);
      for (int64_t j = 0; j < ncols; ++j) d[j] = f32_to_bf16(src[j]);
    }
  }
}

}  // namespace kt
