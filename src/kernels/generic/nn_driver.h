// The driver of gemm_bf16w_nn (C = A W straight from W's panels; contract
// in kernels.h), written once over a per-ISA micro-tile trait. The driver
// owns what every ISA does alike: the columns in passes, the rows in
// balanced tiles, the panels in groups that stream side by side over a
// pass (each slice read front to back: few streams, long runs, as the
// forward's tiles read theirs), the sums carried from group to group
// through an L1 buffer, and the fetches ahead in each stream (past a pass's
// end the next group's heads, past the last group's those of the caller's
// next region). A trait supplies only its micro-tile; a table's entry is
// nn_gemm<trait>.
//
// A trait T has:
//   Row                    the A rows' element type
//   Reg                    a register of sums
//   kMaxRows               the tallest tile
//   kSteps<MR>             steps (column pairs) of a block, a tile's width
//   kRegs<MR>              registers of sums per row of a block
//   kPassSteps<MR>         steps of a pass with one row tile (with more,
//                          kPassStepsTiles: the later tiles read the pass
//                          again, and its slices then stay in L2)
//   kAheadSteps            how far ahead of its loads a panel's stream is
//                          fetched (a multiple of every kSteps)
//   tile<MR, SB, S>(a, w, panel_stride, p0, p1, g0, carry, first, last, c,
//                   ldc, n, accumulate, fetch_at, fetch_stride):
//     the panels [p0, p1) of MR rows x S <= SB steps from step g0 (a block
//     of SB steps), on top of the sums in carry (Reg[MR][kRegs]; first:
//     from zero), into carry or, for the last group, reduced into C (n <=
//     2 S columns); fetch_at: where the stream of panel p fetches the S
//     steps it reads later, at fetch_at + (p - p0) fetch_stride (nullptr:
//     nothing).
// Each C value is one fixed-order sum whatever m and n: a tile's sums run
// over the panels in order, and carry keeps them between groups.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "formats/panels.h"
#include "kernels/generic/macro_kernel.h"

namespace kt {
namespace generic {

// Panels per group.
constexpr int kNnGroupPanels = 8;
// Steps of a pass where the call has two row tiles or more (64 columns).
constexpr int kNnPassStepsTiles = 32;

// One row tile (MR rows) over a pass of steps [g0, g0 + steps): the panels
// in groups, each group over the pass's blocks.
template <class T, int MR>
static void nn_rows(const typename T::Row* const* a, const bf16_t* w, int64_t panel_stride, int np,
                    int64_t g0, int64_t steps, int64_t n, float* c, int64_t ldc, bool accumulate,
                    bool fetch_next, const PrefetchRegion& next) {
  constexpr int SB = T::template kSteps<MR>;
  constexpr int kAheadBlocks = T::kAheadSteps / SB;
  alignas(64) typename T::Reg carry[T::template kPassSteps<MR> / SB][MR][T::template kRegs<MR>];
  const int64_t blocks = (steps + SB - 1) / SB;
  const char* base = reinterpret_cast<const char*>(w);
  const int64_t stride = panel_stride * static_cast<int64_t>(sizeof(bf16_t));
  for (int p0 = 0; p0 < np; p0 += kNnGroupPanels) {
    const int p1 = p0 + kNnGroupPanels < np ? p0 + kNnGroupPanels : np;
    for (int64_t kb = 0; kb < blocks; ++kb) {
      const char* fetch_at = nullptr;
      int64_t fetch_stride = stride;
      if (fetch_next) {
        const int64_t ahead = kb + kAheadBlocks;
        if (ahead < blocks) {
          fetch_at = base + p0 * stride + (g0 + ahead * SB) * 64;
        } else if (p1 < np) {
          fetch_at = base + p1 * stride + (g0 + (ahead - blocks) * SB) * 64;
        } else if (next.base && ahead == blocks) {
          fetch_at = static_cast<const char*>(next.base);
          fetch_stride = next.stride;
        }
      }
      const int64_t j = kb * 2 * SB;
      const int nb = static_cast<int>(n - j < 2 * SB ? n - j : 2 * SB);
      const bool first = p0 == 0, last = p1 == np;
      // A short last block reads only its own steps (past them may lie the
      // panel's end).
      with_count<SB>((nb + 1) / 2, [&](auto s) {
        T::template tile<MR, SB, decltype(s)::value>(a, w, panel_stride, p0, p1, g0 + kb * SB,
                                                     carry[kb], first, last, c + j, ldc, nb,
                                                     accumulate, fetch_at, fetch_stride);
      });
    }
  }
}

// Passes of columns; in each, the rows in balanced tiles of up to
// kMaxRows, the first of which fetches ahead (the later ones find the
// pass's slices in cache).
template <class T>
static void nn_gemm(const void* const* a_rows, int m, const bf16_t* panels, int64_t panel_stride,
                    int np, int64_t c0, int64_t n, float* c, int64_t ldc, bool accumulate,
                    const PrefetchRegion& next) {
  if (m <= 0) return;
  const auto* const* a = reinterpret_cast<const typename T::Row* const*>(a_rows);
  const int tiles = (m + T::kMaxRows - 1) / T::kMaxRows;
  int64_t pass_steps = kNnPassStepsTiles;
  if (tiles == 1)
    with_count<T::kMaxRows>(
        m, [&](auto rows) { pass_steps = T::template kPassSteps<decltype(rows)::value>; });
  const int64_t pass = 2 * pass_steps;
  for (int64_t j = 0; j < n; j += pass) {
    const int64_t nj = n - j < pass ? n - j : pass;
    const bool last_pass = j + pass >= n;
    for (int t = 0, r = 0; t < tiles; ++t) {
      const int h = (m - r) / (tiles - t);
      with_count<T::kMaxRows>(h, [&](auto rows) {
        nn_rows<T, decltype(rows)::value>(a + r, panels, panel_stride, np, (c0 + j) / 2,
                                          (nj + 1) / 2, nj, c + r * ldc + j, ldc, accumulate,
                                          t == 0, last_pass ? next : PrefetchRegion{});
      });
      r += h;
    }
  }
}

}  // namespace generic
}  // namespace kt
