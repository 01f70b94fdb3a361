// Work-item geometry shared by forward and backward: a column block is 4
// panels (64 output columns); rows go in chunks of 64 so a chunk's A rows and
// C tile stay in L1/L2 while a block of weight panels streams past.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/tensor.h"
#include "kernels/kernels.h"

namespace kt {

constexpr int64_t kBlockPanels = 4;
constexpr int64_t kBlockCols = kBlockPanels * kPanelRows;
// K columns a quantized base dequantizes per GEMM call: 4 panels of 256
// columns are 32 KiB of bf16, which stay in L1/L2 while the row tiles pass.
constexpr int64_t kQuantChunk = 256;
constexpr int64_t kRowChunk = 64;
constexpr int64_t kMaxItemCols = 4 * kBlockCols;
// The most rows of an expert that backward multiplies straight from W's
// panels (gemm_bf16w_nn) whatever the table allows: one call then spans an
// item's columns, and its C tile still fits kRowChunk x kBlockCols floats.
constexpr int64_t kStraightMaxRows = kRowChunk * kBlockCols / kMaxItemCols;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Column ownership: a work item owns columns [col0, col0 + ncols) of an fp32
// accumulator [T, ld] for the tokens [t0, t1). It clears them, adds every expert's
// contribution in expert order, then stores them into out ([T, *], bf16 or
// fp32, unit inner stride).
inline void clear_columns(float* acc, int64_t t0, int64_t t1, int64_t ld, int64_t col0, int64_t ncols) {
  for (int64_t t = t0; t < t1; ++t) std::memset(acc + t * ld + col0, 0, static_cast<size_t>(ncols) * sizeof(float));
}

inline void store_columns(const float* acc, int64_t t0, int64_t t1, int64_t ld, int64_t col0, int64_t ncols,
                          const View& out) {
  for (int64_t t = t0; t < t1; ++t) {
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

// How the combine stages (down + combine, dx) split [T, n] into work items
// that each own a block of columns for a range of tokens. Enough items for
// every worker (~4 per thread to balance skewed routing): narrower column
// blocks when there are few tokens (decode: each item still streams whole
// panels), token ranges when there are many. Each (token, column) has one
// owner and experts are added in ascending order, so results do not depend on
// the thread count.
struct CombineSplit {
  int64_t cols;      // columns per item (a multiple of 16, or the tail)
  int64_t col_blocks;
  int64_t token_chunk;
  int64_t token_ranges;

  static CombineSplit plan(int64_t T, int64_t n, int threads) {
    CombineSplit s;
    const int64_t want = 4 * static_cast<int64_t>(threads);
    s.cols = kBlockCols;
    // Many tokens: wider items while there are enough, as an item reads each
    // expert's rows once for all its columns. Few (decode): the rows are
    // cheap to read again, and narrow items let the workers end together
    // (an item takes every expert).
    while (T > kRowChunk && s.cols < kMaxItemCols && ceil_div(n, 2 * s.cols) >= want) s.cols *= 2;
    s.col_blocks = ceil_div(n, s.cols);
    if (s.col_blocks < want && T <= kRowChunk) {
      s.cols = kPanelRows;
      s.col_blocks = ceil_div(n, s.cols);
    }
    s.token_ranges = 1;
    if (s.col_blocks < want && T > kRowChunk)
      s.token_ranges = std::min(ceil_div(want, s.col_blocks), ceil_div(T, kRowChunk));
    s.token_chunk = ceil_div(std::max<int64_t>(T, 1), s.token_ranges);
    return s;
  }
  int64_t items() const { return col_blocks * token_ranges; }

  // Columns of one base GEMM call within an item (the C tile's width).
  int64_t call_cols = kBlockCols;

  // A quantized base at decode (T <= kRowChunk): columns per item doubled
  // while every worker keeps 2 items (at decode each item takes every
  // expert, so the items cost the same) and an item's C tile (max_rows
  // rows) fits the scratch, each call then spanning the item's columns: a
  // 64-column call of int4 codes reads 27 KiB, a quarter of bf16's, and
  // each call's streams start anew (gemm_quant's strided tiles run them on
  // within a call). Two items per worker rather than one, so that the
  // workers still end together.
  void widen_for_quantized_decode(int64_t T, int64_t n, int threads, int64_t max_rows) {
    if (T > kRowChunk || token_ranges != 1 || max_rows < 1 || cols < kBlockCols) return;
    const int64_t want = 2 * static_cast<int64_t>(threads);
    const int64_t fits = kRowChunk * kBlockCols / max_rows;
    while (2 * cols <= fits && ceil_div(n, 2 * cols) >= want) cols *= 2;
    col_blocks = ceil_div(n, cols);
    call_cols = cols;
  }
  // Backward's dx at decode where the experts' W panels are read straight
  // (gemm_bf16w_nn, up to kStraightMaxRows rows): the same, each call
  // spanning an item's columns (the C tile fits: kStraightMaxRows rows of
  // kMaxItemCols).
  void widen_for_straight(int64_t T, int64_t n, int threads) {
    widen_for_quantized_decode(T, n, threads, kStraightMaxRows);
  }
};

// Columns of a gate/up item (an expert's rows times a block of its n
// columns): whole kBlockCols blocks, each expert's blocks cut into as few
// items as leave every worker at least 4 (ItemRanges then still ends the
// workers together), and the item's C tile of max_rows rows within
// kRowChunk x kBlockCols floats. At decode each call then streams more
// panels, in longer streams that start cold less often; with gemm_quant's
// strided tiles running a call's streams on, items as wide as whole
// experts pay at T=1.
inline int64_t gate_up_item_cols(int64_t active, int64_t max_rows, int64_t n, int threads) {
  const int64_t blocks = ceil_div(n, kBlockCols);
  const int64_t want = 4 * static_cast<int64_t>(std::max(threads, 1));
  const int64_t per_expert = ceil_div(want, std::max<int64_t>(active, 1));
  const int64_t w = std::min(blocks / per_expert, kRowChunk / std::max<int64_t>(max_rows, 1));
  return std::max<int64_t>(w, 1) * kBlockCols;
}

// Items handed out in ranges of consecutive items, so a worker knows its
// next item and can prefetch its weights while it computes the current one.
// Ranges shrink as the items run out (each a quarter of what is left per
// thread, down to single items), so the workers end together even when the
// items' costs differ (skewed routing) or one worker's memory runs slower.
// With groups of items (one per NUMA node, for ThreadPool::run_grouped),
// the same within each group for its threads: no range spans two groups.
struct ItemRanges {
  std::vector<int64_t> bounds;  // range r is [bounds[r], bounds[r + 1])
  std::vector<int64_t> group_bounds;  // group g's ranges are [group_bounds[g], group_bounds[g + 1])
  int64_t count = 0;
  ItemRanges(int64_t n, int threads) : ItemRanges({0, n}, {threads}) {}
  // item_groups: group g holds the items [item_groups[g], item_groups[g + 1]),
  // item_groups[0] = 0; threads[g]: the threads that take them.
  ItemRanges(const std::vector<int64_t>& item_groups, const std::vector<int>& threads) {
    bounds.push_back(0);
    for (size_t g = 0; g + 1 < item_groups.size(); ++g) {
      group_bounds.push_back(static_cast<int64_t>(bounds.size()) - 1);
      const int64_t parts = 4 * static_cast<int64_t>(std::max(threads[g], 1));
      const int64_t n = item_groups[g + 1];
      for (int64_t done = item_groups[g]; done < n;) {
        done += std::max<int64_t>(1, (n - done) / parts);
        bounds.push_back(done);
      }
    }
    count = static_cast<int64_t>(bounds.size()) - 1;
    group_bounds.push_back(count);
  }
  int64_t begin(int64_t r) const { return bounds[static_cast<size_t>(r)]; }
  int64_t end(int64_t r) const { return bounds[static_cast<size_t>(r) + 1]; }
};

// Positions [begin, end) of one expert whose tokens fall in [t0, t1):
// positions are sorted by token within an expert.
inline void token_range(const int32_t* token, int64_t begin, int64_t end, int64_t t0, int64_t t1,
                        int64_t* first, int64_t* last) {
  int64_t lo = begin, hi = end;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (token[mid] < t0) lo = mid + 1; else hi = mid;
  }
  *first = lo;
  hi = end;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (token[mid] < t1) lo = mid + 1; else hi = mid;
  }
  *last = lo;
}

}  // namespace kt
