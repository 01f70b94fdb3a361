// Work-item geometry shared by forward and backward: a column block is 4
// panels (64 output columns); rows go in chunks of 64 so a chunk's A rows and
// C tile stay in L1/L2 while a block of weight panels streams past.
#pragma once

#include <cstdint>

#include "kernels/kernels.h"

namespace kt {

constexpr int64_t kBlockPanels = 4;
constexpr int64_t kBlockCols = kBlockPanels * kPanelRows;
constexpr int64_t kRowChunk = 64;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

}  // namespace kt
