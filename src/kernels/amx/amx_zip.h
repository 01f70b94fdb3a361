// Weight gradients (Kernels::gemm_zip_bf16) on tiles, with amx_gemm.h's
// block product and tile machine M (see there), which also provides
//   zip_fallback(...): a Kernels::gemm_zip_bf16, for fewer than kZipMinRows
//   rows or pair groups, and the pair groups past the last whole tile.
// Z's pair groups are AMX B tiles as they are (16 columns x 2 bf16 a group,
// ldz apart); D's are gathered once per block of 32 rows into A rows (row o:
// the pairs D[g][o] of every group g, K = 2 x groups), which every panel of
// the block then reads.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "kernels/amx/amx_gemm.h"
#include "kernels/counted.h"
#include "kernels/kernels.h"

namespace kt {
namespace amx {
namespace {

// D's pairs [0, groups) of rows [o0, o0 + rows) as A rows of 2 * groups
// values, zero rows up to whole tiles.
inline void gather_zip_rows(const bf16_t* d, int64_t ldd, int o0, int rows, int64_t groups, bf16_t* block) {
  const int padded = rows > kTileRows ? kBlockRows : kTileRows;
  const int64_t k = 2 * groups;
  for (int64_t g = 0; g < groups; ++g) {
    const bf16_t* src = d + g * ldd + 2 * o0;
    for (int r = 0; r < rows; ++r) std::memcpy(block + r * k + 2 * g, src + 2 * r, 2 * sizeof(bf16_t));
  }
  std::memset(block + rows * k, 0, static_cast<size_t>((padded - rows) * k) * sizeof(bf16_t));
}

template <class M>
void gemm_zip_bf16(const bf16_t* d, int64_t ldd, int m, const bf16_t* z, int64_t ldz, int np, int64_t groups,
                   float* c, int64_t ldc, bool accumulate, float scale, bool stream) {
  const int64_t full = groups / kTileRows * kTileRows;  // pair groups in whole tiles (K 32)
  if (m < kZipMinRows || full == 0) {
    M::zip_fallback(d, ldd, m, z, ldz, np, groups, c, ldc, accumulate, scale, stream);
    return;
  }
  kt::count_kernel(kt::kernel_id(kt::KernelTable::kAmx, kt::KernelEntry::kGemmZipBf16),
                   kt::entry_flops::gemm(m, int64_t{kTileRows} * np, 2 * full));
  M::configure();
  thread_local std::vector<bf16_t> block;
  block.resize(static_cast<size_t>(kBlockRows * 2 * full));
  alignas(64) float out[kBlockRows * 32];
  PrefetchCursor none{PrefetchRegion{}};
  for (int o0 = 0; o0 < m; o0 += kBlockRows) {
    const int rows = m - o0 < kBlockRows ? m - o0 : kBlockRows;
    gather_zip_rows(d, ldd, o0, rows, full, block.data());
    const BlockRows a{{block.data(), block.data() + kTileRows * 2 * full}, {2 * full, 2 * full}};
    for (int p = 0; p < np; p += 2) {
      const bool two_panels = p + 1 < np;
      block_product_of<M>(rows > kTileRows, two_panels, a, 0, 2 * full, z + p * 32, ldz, 32, out, none, 0);
      store_block(out, rows, two_panels ? 2 : 1, c + o0 * ldc + 16 * p, ldc, accumulate, scale);
    }
  }
  M::release();
  if (full < groups)  // the last groups (fewer than a tile) on AVX-512, added in
    M::zip_fallback(d + full * ldd, ldd, m, z + full * ldz, ldz, np, groups - full, c, ldc, true, scale, stream);
}

}  // namespace
}  // namespace amx
}  // namespace kt
