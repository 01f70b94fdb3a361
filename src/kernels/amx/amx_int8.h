// gemm_int8 (kernels.h) on AMX-INT8 tiles, written once against a small set
// of operations of a tile machine, as amx_gemm.h is: the hardware
// ones in kernels_amx.cpp, a plain emulation in the tests. Bit for bit the
// generic kernel's result: tdpbsud sums the products of signed A bytes (the
// int8 rows) and unsigned B bytes (the codes as Int8Codes gives them, u =
// value + offset) exactly in int32, as vpdpbusd does, and each group's sums
// go through the same fp32 operations in the same order.
// The tile machine M (amx_gemm.h) provides, besides zero, load and store:
//   template <int C, int A, int B> dpbsud();  // C(int32) += A(signed bytes) . B(unsigned bytes)
//   configure_int8(int k_bytes);  // C: 16 x 64 bytes; A (4, 5):
//       16 rows x k_bytes; B (6, 7): k_bytes / 4 rows x 64 bytes
//   release();
//   template <int Bits, QuantCode Code> B_codes { B_codes();
//       void operator()(const uint8_t* src, uint8_t* out) const; kStepBytes;
//       kOffset; }: the 64 unsigned code bytes (value + kOffset) of the
//       step of kStepBytes at src, in Int8Codes' order;
//   int8_fallback(...): a Kernels::gemm_int8, for fewer than kInt8MinRows rows.
// Takes kTileRows, kBlockRows, row_spacing and block_rows from amx_gemm.h
// (whole tiles of equally spaced rows are loaded where they lie).
//
// Blocks of up to 32 rows (two A tiles) x 2 panels (two B tiles). A group's
// K goes in tile steps of kt = 64 bytes (32 where the group is not a
// multiple of 64: groups of 32, and some per-channel K); each step's B tile
// is kt / 4 code steps of a panel, from the pair's codes expanded over the
// whole K into cache once before its row blocks. At a group's end the
// four int32 C tiles are stored and taken into fp32 sums: (d - offset * the
// row's code sum) * the group's scales, by fma, as the generic kernel does.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "formats/packed_quant.h"
#include "kernels/amx/amx_gemm.h"
#include "kernels/counted.h"
#include "kernels/kernels.h"

namespace kt {
namespace amx {
namespace {

constexpr int kInt8MinRows = 16;  // fewer rows: the AVX-512 VNNI kernel

// One C-tile row of group j into the row's fp32 sums: part += (d - offset
// * sum) * scale, lane by lane; restrict (the arrays never overlap) lets the
// compiler take the 16 lanes as one vector.
inline void add_group_row(float* __restrict part, const int32_t* __restrict d, const int32_t* __restrict offset,
                          int32_t sum, const float* __restrict scale) {
  for (int lane = 0; lane < kTileRows; ++lane)
    part[lane] = std::fma(static_cast<float>(d[lane] - offset[lane] * sum), scale[lane], part[lane]);
}

// c = part * s, or c += part * s with accumulate (one fma), over a tile row.
inline void store_row_times(float* __restrict c, const float* __restrict part, float s, bool accumulate) {
  if (accumulate) {
    for (int lane = 0; lane < kTileRows; ++lane) c[lane] = std::fma(part[lane], s, c[lane]);
  } else {
    for (int lane = 0; lane < kTileRows; ++lane) c[lane] = part[lane] * s;
  }
}

template <class M, int Bits, QuantCode Code, bool Zero>
void gemm_int8_tiles(const QuantPanels& w, const void* const* a_rows, int m, int np, float* c, int64_t ldc,
                     bool accumulate) {
  using Codes = typename M::template B_codes<Bits, Code>;
  static const Codes expand;
  constexpr int64_t kStepBytes = Codes::kStepBytes;  // a panel's codes of one step (4 K values)
  constexpr int32_t kOffset = Codes::kOffset;
  const int kt = w.group % 64 == 0 ? 64 : 32;  // K bytes per tile step
  const int64_t tiles_per_group = w.group / kt;
  const int64_t groups = w.kq / w.group;
  M::configure_int8(kt);
  // Every row block's A tiles, gathered once (whole tiles of spaced rows
  // stay where they lie), and a panel pair's codes expanded over the whole
  // K once: the pair loop is outside the row blocks, so no block expands
  // the same codes again.
  const int blocks = (m + kBlockRows - 1) / kBlockRows;
  thread_local std::vector<int8_t> block;
  block.resize(static_cast<size_t>(blocks * kBlockRows * w.kq));
  thread_local std::vector<TileRows<int8_t>> a_blocks;
  a_blocks.resize(static_cast<size_t>(blocks));
  const int64_t spacing = row_spacing(a_rows, m, 1);
  for (int b = 0; b < blocks; ++b) {
    const int r0 = b * kBlockRows;
    a_blocks[static_cast<size_t>(b)] = block_rows(a_rows, spacing, r0, m - r0 < kBlockRows ? m - r0 : kBlockRows,
                                                  w.kq, block.data() + r0 * w.kq);
  }
  const int64_t steps = w.kq / 4;  // code steps of a panel (4 K values each)
  thread_local std::vector<uint8_t> b_codes;
  b_codes.resize(static_cast<size_t>(2 * steps * 64));
  alignas(64) int32_t d[kBlockRows * 32];  // the C tiles: [row][2 panels x 16 lanes]
  alignas(64) float part[kBlockRows * 32];  // fp32 sums of the groups so far, same layout
  for (int p = 0; p < np; p += 2) {
    const int panels = p + 1 < np ? 2 : 1;
    for (int q = 0; q < panels; ++q) {
      const uint8_t* src = w.codes + (p + q) * w.code_panel_bytes;
      uint8_t* dst = b_codes.data() + q * steps * 64;
      for (int64_t st = 0; st < steps; ++st) expand(src + st * kStepBytes, dst + st * 64);
    }
    for (int r0 = 0; r0 < m; r0 += kBlockRows) {
      const int rows = m - r0 < kBlockRows ? m - r0 : kBlockRows;
      const TileRows<int8_t>& a = a_blocks[static_cast<size_t>(r0 / kBlockRows)];
      const bool two_row_tiles = rows > kTileRows;
      std::memset(part, 0, sizeof(part));
      for (int64_t j = 0; j < groups; ++j) {
        M::template zero<0>();
        M::template zero<1>();
        M::template zero<2>();
        M::template zero<3>();
        for (int64_t t = 0; t < tiles_per_group; ++t) {
          const int64_t k0 = (j * tiles_per_group + t) * kt;  // K bytes of the A rows
          M::template load<6>(b_codes.data() + k0 / 4 * 64, 64);
          if (panels > 1) M::template load<7>(b_codes.data() + (steps + k0 / 4) * 64, 64);
          M::template load<4>(a.a[0] + k0, a.ld[0]);
          M::template dpbsud<0, 4, 6>();
          if (panels > 1) M::template dpbsud<1, 4, 7>();
          if (two_row_tiles) {
            M::template load<5>(a.a[1] + k0, a.ld[1]);
            M::template dpbsud<2, 5, 6>();
            if (panels > 1) M::template dpbsud<3, 5, 7>();
          }
        }
        M::template store<0>(d, 128);
        if (panels > 1) M::template store<1>(d + 16, 128);
        if (two_row_tiles) {
          M::template store<2>(d + kTileRows * 32, 128);
          if (panels > 1) M::template store<3>(d + kTileRows * 32 + 16, 128);
        }
        alignas(64) float scale[2][kTileRows];
        alignas(64) int32_t offset[2][kTileRows];  // times the row's code sum
        for (int q = 0; q < panels; ++q)
          for (int lane = 0; lane < kTileRows; ++lane) {
            scale[q][lane] = quant_scale(w, p + q, j, lane);
            offset[q][lane] = Zero ? w.zeros[(p + q) * w.scale_panel + j * kTileRows + lane] : kOffset;
          }
        for (int r = 0; r < rows; ++r) {
          int32_t sum;  // the row's code sum over group j (after its kq code bytes)
          std::memcpy(&sum, static_cast<const uint8_t*>(a_rows[r0 + r]) + w.kq + 4 * j, 4);
          for (int q = 0; q < panels; ++q)
            add_group_row(part + r * 32 + q * 16, d + r * 32 + q * 16, offset[q], sum, scale[q]);
        }
      }
      for (int r = 0; r < rows; ++r) {
        float s;
        std::memcpy(&s, static_cast<const uint8_t*>(a_rows[r0 + r]) + w.kq + 4 * groups, 4);
        if (Code == QuantCode::kE2M1) s *= 0.5f;
        for (int q = 0; q < panels; ++q) {
          store_row_times(c + (r0 + r) * ldc + (p + q) * kTileRows, part + r * 32 + q * 16, s, accumulate);
        }
      }
    }
  }
  M::release();
}

template <class M>
void gemm_int8(const QuantPanels& w, const void* const* a_rows, int m, int np, float* c, int64_t ldc,
               bool accumulate, const PrefetchRegion& next) {
  if (m < kInt8MinRows) {
    M::int8_fallback(w, a_rows, m, np, c, ldc, accumulate, next);
    return;
  }
  kt::count_kernel(kt::kernel_id(kt::KernelTable::kAmx, kt::KernelEntry::kGemmInt8),
                   kt::entry_flops::gemm(m, int64_t{kTileRows} * np, w.kq));
  if (w.bits == 8) {
    gemm_int8_tiles<M, 8, QuantCode::kInt, false>(w, a_rows, m, np, c, ldc, accumulate);
  } else if (w.code == QuantCode::kE2M1) {
    gemm_int8_tiles<M, 4, QuantCode::kE2M1, false>(w, a_rows, m, np, c, ldc, accumulate);
  } else if (w.zeros) {
    gemm_int8_tiles<M, 4, QuantCode::kInt, true>(w, a_rows, m, np, c, ldc, accumulate);
  } else {
    gemm_int8_tiles<M, 4, QuantCode::kInt, false>(w, a_rows, m, np, c, ldc, accumulate);
  }
}

}  // namespace
}  // namespace amx
}  // namespace kt
