// The AMX weight GEMM over the packed panels, written once against a tile
// machine M: the hardware one in kernels_amx.cpp, a plain emulation in the
// tests (so the blocking, the gathering of rows and the K remainder are
// checked on every machine). M provides, as static members:
//   template <int T> zero(); template <int T> load(base, stride_bytes);
//   template <int T> store(base, stride_bytes);
//   template <int C, int A, int B> dpbf16();  // C += A . B, bf16 pairs into fp32
//   configure();  // every tile 16 rows x 64 bytes
//   release();
//   fallback_gemm(...): a Kernels::gemm_bf16w on bf16 rows, for few rows
//   and the K remainder;
//   grouped_fallback(...): a Kernels::gemm_bf16w_grouped, for few rows.
// Everything here has internal linkage (an unnamed namespace): each unit
// that includes it compiles its own copy with its own flags.
//
// Calls that run on tiles count as the amx kernels' (kernels/counted.h);
// those left to the fallbacks count as theirs.
//
// A packed panel (16 output rows, K in pairs: 64 bytes per pair of K) is
// already the layout of an AMX B tile: 16 consecutive pair groups are one
// 16 x 64-byte tile (K = 32). The A rows (activations, bf16) are tile rows
// where they lie when they are equally spaced (whole tiles of them);
// otherwise they are gathered from their row pointers into a compact block,
// 32 K values per tile row.
// Tiles 0-3 hold C (2 x 2 blocks of 16 x 16 fp32), 4-5 A, 6-7 B.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "kernels/counted.h"
#include "kernels/kernels.h"

namespace kt {
namespace amx {
namespace {

constexpr int kTileRows = 16;
constexpr int64_t kTileK = 32;  // bf16 values per tile row (64 bytes)
constexpr int kBlockRows = 32;  // rows per block: two A tiles
// Below this many rows the AVX-512 kernel is faster than a tile with
// empty rows: from 8 rows on the AVX-512 kernel is bound by vdpbf16ps
// (bench/README.md, AMX kernels).
constexpr int kMinRows = 8;
// The weight gradients' tiles (amx_zip.h) from a whole tile of rows: fewer
// are not measured against the AVX-512 kernel.
constexpr int kZipMinRows = 16;

// Rows < rows_valid of one 16-column C tile (rows `stride` floats apart)
// times scale into c, adding to c when accumulate.
void store_tile(const float* tile, int64_t stride, int rows_valid, float* c, int64_t ldc, bool accumulate,
                float scale = 1.f) {
  for (int r = 0; r < rows_valid; ++r) {
    float* cr = c + r * ldc;
    const float* tr = tile + r * stride;
    for (int j = 0; j < 16; ++j) cr[j] = accumulate ? cr[j] + scale * tr[j] : scale * tr[j];
  }
}

// The 1-2 x 1-2 C tiles of a block (out: 32 floats a row) into c: rows
// [0, rows), panels [0, panels).
void store_block(const float* out, int rows, int panels, float* c, int64_t ldc, bool accumulate, float scale = 1.f) {
  const int rows_lo = rows < kTileRows ? rows : kTileRows;
  for (int q = 0; q < panels; ++q) {
    store_tile(out + 16 * q, 32, rows_lo, c + 16 * q, ldc, accumulate, scale);
    if (rows > kTileRows)
      store_tile(out + kTileRows * 32 + 16 * q, 32, rows - kTileRows, c + kTileRows * ldc + 16 * q, ldc, accumulate,
                 scale);
  }
}

// Rows [r0, r0 + rows) of A (rows <= 16), K values [0, k) of type E,
// gathered compactly into one tile's rows (k apart), zero rows up to 16.
template <class E>
void gather_tile_rows(const void* const* a_rows, int r0, int rows, int64_t k, E* tile) {
  for (int r = 0; r < kTileRows; ++r) {
    E* dst = tile + r * k;
    if (r < rows) std::memcpy(dst, a_rows[r0 + r], static_cast<size_t>(k) * sizeof(E));
    else std::memset(dst, 0, static_cast<size_t>(k) * sizeof(E));
  }
}

// The spacing of the m rows in values of `size` bytes when each lies that
// far past the one before (rows the caller laid out in order), else 0. The
// tiles load such rows where they lie; others are gathered first, on every
// call.
inline int64_t row_spacing(const void* const* a_rows, int m, size_t size) {
  if (m < 2) return 0;
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(a_rows[0]);
  const uintptr_t a1 = reinterpret_cast<uintptr_t>(a_rows[1]);
  if (a1 <= a0 || (a1 - a0) % size != 0) return 0;
  const uintptr_t step = a1 - a0;
  for (int r = 2; r < m; ++r)
    if (reinterpret_cast<uintptr_t>(a_rows[r]) != a0 + static_cast<uintptr_t>(r) * step) return 0;
  return static_cast<int64_t>(step / size);
}

// The two A tiles of a block: rows of tile i ld[i] values apart from a[i].
template <class E>
struct TileRows {
  const E* a[2];
  int64_t ld[2];
};
using BlockRows = TileRows<bf16_t>;

// The A tiles of rows [r0, r0 + rows) (rows <= 32), K values [0, k): whole
// tiles of spaced rows (spacing != 0, in values) where they lie, the others
// gathered into block (32 rows k apart).
template <class E>
TileRows<E> block_rows(const void* const* a_rows, int64_t spacing, int r0, int rows, int64_t k, E* block) {
  TileRows<E> b;
  for (int i = 0; i < 2; ++i) {
    const int t0 = r0 + i * kTileRows, n = rows - i * kTileRows;
    if (n <= 0) {
      b.a[i] = nullptr;
      b.ld[i] = 0;
    } else if (spacing != 0 && n >= kTileRows) {
      b.a[i] = static_cast<const E*>(a_rows[t0]);
      b.ld[i] = spacing;
    } else {
      E* tile = block + i * kTileRows * k;
      gather_tile_rows(a_rows, t0, n < kTileRows ? n : kTileRows, k, tile);
      b.a[i] = tile;
      b.ld[i] = k;
    }
  }
  return b;
}

// A: the block's tiles (rows.a[i], rows.ld[i] values apart; the second
// only when MT is 2), K values [off, off + k) (k a multiple of kTileK).
// B: pair group g of panel q at b + g * b_row + q * b_panel (elements; a
// packed panel: b_row 32, b_panel its stride).
// ahead: per tile step, `per_step` lines of the region the caller reads
// next are fetched (spread over the call's steps).
template <class M, int MT, int NT>
void block_product(const BlockRows& rows, int64_t off, int64_t k, const bf16_t* b, int64_t b_row, int64_t b_panel,
                   float* out, PrefetchCursor& ahead, int64_t per_step) {
  M::template zero<0>();
  if (NT > 1) M::template zero<1>();
  if (MT > 1) M::template zero<2>();
  if (MT > 1 && NT > 1) M::template zero<3>();
  const bf16_t* a0 = rows.a[0] + off;
  const bf16_t* a1 = MT > 1 ? rows.a[1] + off : nullptr;
  const int64_t a0_stride = rows.ld[0] * static_cast<int64_t>(sizeof(bf16_t));
  const int64_t a1_stride = rows.ld[1] * static_cast<int64_t>(sizeof(bf16_t));
  const int64_t b_stride = b_row * static_cast<int64_t>(sizeof(bf16_t));
  const int64_t tiles = k / kTileK;
  for (int64_t t = 0; t < tiles; ++t) {
    ahead.issue(per_step);
    // A tile is 16 pair groups of 16 columns x 2 bf16.
    const bf16_t* b0 = b + t * kTileRows * b_row;
    M::template load<6>(b0, b_stride);
    if (NT > 1) M::template load<7>(b0 + b_panel, b_stride);
    M::template load<4>(a0 + t * kTileK, a0_stride);
    M::template dpbf16<0, 4, 6>();
    if (NT > 1) M::template dpbf16<1, 4, 7>();
    if (MT > 1) {
      M::template load<5>(a1 + t * kTileK, a1_stride);
      M::template dpbf16<2, 5, 6>();
      if (NT > 1) M::template dpbf16<3, 5, 7>();
    }
  }
  // out: [MT * 16 rows][NT * 16 columns], 128 bytes per row.
  M::template store<0>(out, 128);
  if (NT > 1) M::template store<1>(out + 16, 128);
  if (MT > 1) M::template store<2>(out + 16 * 32, 128);
  if (MT > 1 && NT > 1) M::template store<3>(out + 16 * 32 + 16, 128);
}

template <class M>
void block_product_of(bool two_row_tiles, bool two_panels, const BlockRows& rows, int64_t off, int64_t k,
                      const bf16_t* b, int64_t b_row, int64_t b_panel, float* out, PrefetchCursor& ahead,
                      int64_t per_step) {
  if (two_row_tiles && two_panels) block_product<M, 2, 2>(rows, off, k, b, b_row, b_panel, out, ahead, per_step);
  else if (two_row_tiles) block_product<M, 2, 1>(rows, off, k, b, b_row, b_panel, out, ahead, per_step);
  else if (two_panels) block_product<M, 1, 2>(rows, off, k, b, b_row, b_panel, out, ahead, per_step);
  else block_product<M, 1, 1>(rows, off, k, b, b_row, b_panel, out, ahead, per_step);
}

// The tile path of the weight GEMMs: K values [0, k) of the rows in blocks
// of up to 32 rows x pairs of panels; each group of `group` K values (group
// divides k) is one product in the C tiles, handed to
// take(out, r0, rows, p, panels, j) for rows [r0, r0 + rows), panels
// [p, p + panels) and group j (out: the block's rows 32 floats apart, tile
// columns 0-15 and 16-31).
// The lines of `next` (the region the caller reads after this call: its
// next block of panels, which stream from memory) are fetched spread over
// the call's tile steps, so they arrive while this call computes.
template <class M, class Take>
void tile_products(const void* const* a_rows, int m, int64_t k, const bf16_t* panels, int64_t panel_stride, int np,
                   int64_t group, const PrefetchRegion& next, Take&& take) {
  PrefetchCursor ahead(next);
  const int64_t steps = (m + kBlockRows - 1) / kBlockRows * ((np + 1) / 2) * (k / kTileK);
  const int64_t per_step = steps > 0 ? (next.lines() + steps - 1) / steps : 0;
  M::configure();
  thread_local std::vector<bf16_t> block;
  block.resize(static_cast<size_t>(kBlockRows * k));
  alignas(64) float out[kBlockRows * 32];
  const int64_t groups = k / group;
  const int64_t spacing = row_spacing(a_rows, m, sizeof(bf16_t));
  for (int r0 = 0; r0 < m; r0 += kBlockRows) {
    const int rows = m - r0 < kBlockRows ? m - r0 : kBlockRows;
    const BlockRows a = block_rows(a_rows, spacing, r0, rows, k, block.data());
    const bool two_row_tiles = rows > kTileRows;
    for (int p = 0; p < np; p += 2) {
      const bool two_panels = p + 1 < np;
      for (int64_t j = 0; j < groups; ++j) {
        block_product_of<M>(two_row_tiles, two_panels, a, j * group, group,
                         panels + p * panel_stride + j * group / 2 * 32, 32, panel_stride, out, ahead, per_step);
        take(static_cast<const float*>(out), r0, rows, p, two_panels ? 2 : 1, j);
      }
    }
  }
  M::release();
}

template <class M>
void gemm_bf16w(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels, int64_t panel_stride, int np,
                float* c, int64_t ldc, bool accumulate, const PrefetchRegion& next) {
  const int64_t k_full = kp / kTileK * kTileK;
  if (m < kMinRows || k_full == 0) {
    M::fallback_gemm(a_rows, m, kp, panels, panel_stride, np, c, ldc, accumulate, next);
    return;
  }
  kt::count_kernel(kt::kernel_id(kt::KernelTable::kAmx, kt::KernelEntry::kGemmBf16w),
                   kt::entry_flops::gemm(m, int64_t{kTileRows} * np, k_full));
  // With a K remainder the fallback that follows takes `next`.
  tile_products<M>(a_rows, m, k_full, panels, panel_stride, np, k_full, k_full < kp ? PrefetchRegion{} : next,
                [&](const float* out, int r0, int rows, int p, int n, int64_t) {
                  store_block(out, rows, n, c + r0 * ldc + 16 * p, ldc, accumulate);
                });
  if (k_full < kp) {
    // The remaining K values (fewer than a tile) on AVX-512, added in.
    std::vector<const void*> tail(static_cast<size_t>(m));
    for (int r = 0; r < m; ++r) tail[static_cast<size_t>(r)] = static_cast<const bf16_t*>(a_rows[r]) + k_full;
    M::fallback_gemm(tail.data(), m, kp - k_full, panels + k_full / 2 * 32, panel_stride, np, c, ldc, true, next);
  }
}

// c[l] = s[l] * t[l], or += with add, over one tile row (16 lanes). The
// restrict pointers let the compiler take the row as one vector: written in
// place with c possibly aliasing s or t, it stays one lane at a time.
inline void scale_tile_row(float* __restrict c, const float* __restrict s, const float* __restrict t, bool add) {
  if (add) {
    for (int l = 0; l < kTileRows; ++l) c[l] += s[l] * t[l];
  } else {
    for (int l = 0; l < kTileRows; ++l) c[l] = s[l] * t[l];
  }
}

// gemm_bf16w_grouped (kernels.h) on tiles: each group's product in the C
// tiles (group / 32 tile steps), then times the group's scales into c in
// fp32, as the vector kernels take each group's partial sums. group divides
// kp, so no K remainder is left.
template <class M>
void gemm_bf16w_grouped(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels, int64_t panel_stride,
                        int np, const float* scales, int64_t scale_stride, int64_t group, float* c, int64_t ldc,
                        bool accumulate, const PrefetchRegion& next) {
  if (m < kMinRows || group % kTileK != 0 || kp % group != 0) {
    M::grouped_fallback(a_rows, m, kp, panels, panel_stride, np, scales, scale_stride, group, c, ldc, accumulate, next);
    return;
  }
  kt::count_kernel(kt::kernel_id(kt::KernelTable::kAmx, kt::KernelEntry::kGemmBf16wGrouped),
                   kt::entry_flops::gemm(m, int64_t{kTileRows} * np, kp));
  tile_products<M>(a_rows, m, kp, panels, panel_stride, np, group, next,
                [&](const float* out, int r0, int rows, int p, int n, int64_t j) {
                  const bool add = accumulate || j > 0;
                  for (int r = 0; r < rows; ++r)
                    for (int q = 0; q < n; ++q)
                      scale_tile_row(c + (r0 + r) * ldc + (p + q) * kTileRows,
                                     scales + (p + q) * scale_stride + j * kTileRows, out + r * 32 + q * 16, add);
                });
}

}  // namespace
}  // namespace amx
}  // namespace kt
