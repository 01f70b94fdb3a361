// How a stage's work is cut for the workers (moe/blocking.h): item ranges
// cover every item once, in order, shrinking to single items at the end; the
// combine split gives every (token, column) one owner, with narrow column
// blocks at decode (wider on a quantized base while the workers keep
// enough); gate/up items are as wide as the workers and the tile allow.
#include <gtest/gtest.h>

#include <vector>

#include "moe/blocking.h"

using kt::CombineSplit;
using kt::ItemRanges;

TEST(ItemRanges, CoverEveryItemOnceInShrinkingRangesEndingInSingleItems) {
  for (int threads : {1, 2, 3, 16, 64})
    for (int64_t n :
         {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{96}, int64_t{1536}, int64_t{100000}}) {
      SCOPED_TRACE("threads " + std::to_string(threads) + ", items " + std::to_string(n));
      const ItemRanges r(n, threads);
      if (n == 0) {
        EXPECT_EQ(r.count, 0);
        continue;
      }
      ASSERT_GE(r.count, 1);
      EXPECT_EQ(r.begin(0), 0);
      EXPECT_EQ(r.end(r.count - 1), n);
      for (int64_t i = 0; i < r.count; ++i) {
        ASSERT_LT(r.begin(i), r.end(i)) << "range " << i << " is empty";
        if (i > 0) {
          EXPECT_EQ(r.begin(i), r.end(i - 1));
          EXPECT_LE(r.end(i) - r.begin(i), r.end(i - 1) - r.begin(i - 1))
              << "range " << i << " grew";
        }
      }
      EXPECT_EQ(r.end(r.count - 1) - r.begin(r.count - 1), 1);
      // No range takes more than a quarter of a thread's share.
      EXPECT_LE(r.end(0) - r.begin(0), n / (4 * threads) + 1);
    }
}

// Grouped (one group per NUMA node): each group's ranges cover its items
// only, as the ungrouped ranges of its items with its threads would.
TEST(ItemRanges, GroupsKeepTheirItemsInRangesOfTheirOwn) {
  const std::vector<int64_t> groups = {0, 96, 96, 1600};
  const std::vector<int> threads = {2, 1, 3};
  const ItemRanges r(groups, threads);
  ASSERT_EQ(r.group_bounds.size(), 4u);
  EXPECT_EQ(r.group_bounds[0], 0);
  EXPECT_EQ(r.group_bounds[3], r.count);
  for (size_t g = 0; g + 1 < groups.size(); ++g) {
    const ItemRanges alone(groups[g + 1] - groups[g], threads[g]);
    ASSERT_EQ(r.group_bounds[g + 1] - r.group_bounds[g], alone.count) << g;
    for (int64_t i = 0; i < alone.count; ++i) {
      EXPECT_EQ(r.begin(r.group_bounds[g] + i), groups[g] + alone.begin(i));
      EXPECT_EQ(r.end(r.group_bounds[g] + i), groups[g] + alone.end(i));
    }
  }
  const ItemRanges one({0, 1536}, {16});
  EXPECT_EQ(one.bounds, ItemRanges(1536, 16).bounds);
  EXPECT_EQ(one.group_bounds, (std::vector<int64_t>{0, one.count}));
}

TEST(CombineSplit, EveryTokenAndColumnHasOneOwnerAndDecodeItemsAreNarrow) {
  for (int threads : {1, 2, 8, 64})
    for (int64_t T :
         {int64_t{1}, int64_t{8}, int64_t{64}, int64_t{65}, int64_t{512}, int64_t{1000}})
      for (int64_t n : {int64_t{16}, int64_t{200}, int64_t{2048}, int64_t{7168}}) {
        SCOPED_TRACE("threads " + std::to_string(threads) + ", T " + std::to_string(T) + ", n " +
                     std::to_string(n));
        const CombineSplit s = CombineSplit::plan(T, n, threads);
        ASSERT_GT(s.cols, 0);
        EXPECT_EQ(s.cols % kt::kPanelRows, 0);
        EXPECT_LE(s.cols, kt::kMaxItemCols);
        if (T <= kt::kRowChunk) {
          EXPECT_LE(s.cols, kt::kBlockCols);
          EXPECT_EQ(s.token_ranges, 1);
        }
        std::vector<int> owners(static_cast<size_t>(T * n), 0);
        for (int64_t item = 0; item < s.items(); ++item) {
          const int64_t col0 = (item % s.col_blocks) * s.cols;
          const int64_t t0 = (item / s.col_blocks) * s.token_chunk;
          for (int64_t t = t0; t < std::min(T, t0 + s.token_chunk); ++t)
            for (int64_t c = col0; c < std::min(n, col0 + s.cols); ++c)
              ++owners[static_cast<size_t>(t * n + c)];
        }
        for (size_t i = 0; i < owners.size(); ++i)
          ASSERT_EQ(owners[i], 1) << "token " << i / n << " column " << i % n;
      }
}

TEST(CombineSplit, QuantizedDecodeItemsWidenWhileEveryWorkerKeepsTwoAndTheTileFits) {
  using kt::kBlockCols;
  const auto widened = [](int64_t T, int64_t n, int threads, int64_t max_rows) {
    CombineSplit s = CombineSplit::plan(T, n, threads);
    s.widen_for_quantized_decode(T, n, threads, max_rows);
    return s;
  };
  // Qwen3-30B-A3B down at decode, 2 threads: 4 items of 512 columns, each
  // call spanning its item.
  CombineSplit s = widened(1, 2048, 2, 1);
  EXPECT_EQ(s.cols, 8 * kBlockCols);
  EXPECT_EQ(s.col_blocks, 4);
  EXPECT_EQ(s.call_cols, 8 * kBlockCols);
  // 9 rows: 455 columns fit the tile, so 256.
  s = widened(8, 2048, 2, 9);
  EXPECT_EQ(s.cols, 4 * kBlockCols);
  EXPECT_EQ(s.call_cols, 4 * kBlockCols);
  // Rows per expert bound the tile: 64 rows keep one block per call.
  s = widened(64, 2048, 2, kt::kRowChunk);
  EXPECT_EQ(s.cols, kBlockCols);
  EXPECT_EQ(s.call_cols, kBlockCols);
  // Many tokens (token ranges) and narrow decode items stay as planned.
  for (int64_t T : {int64_t{65}, int64_t{512}}) {
    const CombineSplit planned = CombineSplit::plan(T, 2048, 2);
    s = widened(T, 2048, 2, 8);
    EXPECT_EQ(s.cols, planned.cols);
    EXPECT_EQ(s.call_cols, kBlockCols);
  }
  s = widened(1, 200, 8, 1);
  EXPECT_EQ(s.cols, kt::kPanelRows);
  EXPECT_EQ(s.call_cols, kBlockCols);
  for (int threads : {1, 2, 8, 64})
    for (int64_t T : {int64_t{1}, int64_t{8}, int64_t{64}})
      for (int64_t rows : {int64_t{1}, int64_t{3}, int64_t{8}, int64_t{64}})
        for (int64_t n : {int64_t{16}, int64_t{200}, int64_t{2048}, int64_t{7168}}) {
          SCOPED_TRACE("threads " + std::to_string(threads) + ", T " + std::to_string(T) +
                       ", rows " + std::to_string(rows) + ", n " + std::to_string(n));
          const CombineSplit planned = CombineSplit::plan(T, n, threads);
          s = widened(T, n, threads, rows);
          EXPECT_EQ(s.cols % kt::kPanelRows, 0);
          EXPECT_EQ(s.col_blocks, kt::ceil_div(n, s.cols));
          EXPECT_EQ(s.token_ranges, 1);
          EXPECT_LE(rows * s.call_cols, kt::kRowChunk * kBlockCols);
          if (s.cols > planned.cols) {
            EXPECT_GE(s.col_blocks, 2 * threads);
            EXPECT_EQ(s.call_cols, s.cols);
          }
        }
}

TEST(GateUpItems, EachExpertInAsFewItemsAsLeaveFourPerWorkerWithinTheTile) {
  using kt::gate_up_item_cols;
  using kt::kBlockCols;
  // Qwen3-30B-A3B at decode: 8 experts of one row, 12 blocks of I = 768.
  EXPECT_EQ(gate_up_item_cols(8, 1, 768, 2), 12 * kBlockCols);  // whole experts: 8 items
  EXPECT_EQ(gate_up_item_cols(8, 1, 768, 1), 12 * kBlockCols);  // whole experts
  EXPECT_EQ(gate_up_item_cols(8, 1, 768, 3), 6 * kBlockCols);   // 2 per expert: 16
  EXPECT_EQ(gate_up_item_cols(8, 1, 768, 5), 4 * kBlockCols);   // 3 per expert: 24
  EXPECT_EQ(gate_up_item_cols(8, 1, 768, 7), 3 * kBlockCols);   // 4 per expert: 32
  EXPECT_EQ(gate_up_item_cols(8, 1, 768, 9), 2 * kBlockCols);  // 5 per expert wanted: 6 of 2 blocks
  EXPECT_EQ(gate_up_item_cols(8, 1, 768, 64), kBlockCols);     // never less than one block
  // Rows: the tile of max_rows x W stays within kRowChunk x kBlockCols.
  EXPECT_EQ(gate_up_item_cols(8, 20, 768, 2), 3 * kBlockCols);
  EXPECT_EQ(gate_up_item_cols(8, kt::kRowChunk, 768, 2), kBlockCols);
  EXPECT_EQ(gate_up_item_cols(8, 1, 40, 2), kBlockCols);  // one partial block
  for (int threads : {1, 2, 3, 8})
    for (int64_t active : {1, 3, 8, 128})
      for (int64_t rows : {1, 2, 5, 64, 300})
        for (int64_t n : {19, 64, 768, 1000, 2048}) {
          SCOPED_TRACE(std::to_string(active) + " experts of " + std::to_string(rows) +
                       " rows, n " + std::to_string(n) + ", " + std::to_string(threads) +
                       " threads");
          const int64_t w = gate_up_item_cols(active, rows, n, threads);
          ASSERT_EQ(w % kBlockCols, 0);
          ASSERT_GE(w, kBlockCols);
          if (w == kBlockCols) continue;
          EXPECT_GE(active * kt::ceil_div(n, w), 4 * threads);
          EXPECT_LE(rows * (w / kBlockCols), kt::kRowChunk);
          EXPECT_LE(w, kt::round_up(n, kBlockCols));
        }
}
