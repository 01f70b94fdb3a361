// fp32 GEMMs written once, compiled in each ISA translation unit with that
// unit's flags so the compiler vectorises the n loops for it: every function
// here is static (or a static template), so each unit that includes this
// header gets its own copy, built with its flags. A unit takes them into its
// namespace by `using namespace generic;`.
#pragma once

#include <cstdint>

#include "formats/packed_bf16.h"
#include "kernels/kernels.h"

namespace kt {
namespace generic {

// The fp32 A format: a copy, zero padded to kp.
[[maybe_unused]] static void pack_a_f32_copy(const float* src, int64_t k, int64_t kp, void* dst) {
  float* d = static_cast<float*>(dst);
  for (int64_t i = 0; i < k; ++i) d[i] = src[i];
  for (int64_t i = k; i < kp; ++i) d[i] = 0.f;
}

// The portable W^T panel builder (formats/packed_bf16.cpp).
[[maybe_unused]] static void transpose_panels_generic(const bf16_t* packed, int64_t np, int64_t panel_stride,
                                                      int64_t c0, int64_t cb, bf16_t* dst) {
  PanelShape s;
  s.np = np;
  s.kp = panel_stride / kPanelRows;
  s.n = np * kPanelRows;
  s.k = s.kp;
  transpose_panels(packed, s, c0, cb, dst);
}

// W^T panels (kernels.h, transpose_panels) with a vector block transpose:
// block(src, o) turns the 8 pair groups at src (16 source columns of one
// 16-row panel) into the 8 destination pair groups at o; a partial last
// block of columns takes the portable path.
// The source is a slice of every panel, cb / 2 pair groups each (2 KiB for
// a block of 64 columns), read from memory: so many short streams defeat
// the hardware prefetcher, and the GEMM that runs before a transpose of a
// few rows is too short to fetch them ahead. So each slice is read whole
// in turn, and the slice kSliceAhead panels on is fetched meanwhile, into
// L2 (into L1 its lines crowd the loads; 2 and 8 panels ahead, or the
// fetches spread over the slice, ran no faster: bench/README.md).
template <class Block>
static void transpose_panels_by_blocks(const bf16_t* packed, int64_t np, int64_t panel_stride, int64_t c0,
                                       int64_t cb, bf16_t* dst, const Block& block) {
  constexpr int64_t kGroup = 2 * kPanelRows;  // bf16 of one pair group
  constexpr int64_t kSliceAhead = 4;
  const int64_t stride2 = kPanelRows * np * kPanelRows;
  const int64_t whole = cb / kPanelRows;  // whole blocks of 16 columns
  const int64_t slice_bytes = whole * (kPanelRows / 2) * kGroup * static_cast<int64_t>(sizeof(bf16_t));
  for (int64_t P = 0; P < np; ++P) {
    const bf16_t* src = packed + P * panel_stride + (c0 / 2) * kGroup;
    if (P + kSliceAhead < np) {
      const char* ahead = reinterpret_cast<const char*>(src + kSliceAhead * panel_stride);
      for (int64_t b = 0; b < slice_bytes; b += 64) __builtin_prefetch(ahead + b, 0, 2);
    }
    for (int64_t q = 0; q < whole; ++q)
      block(src + q * (kPanelRows / 2) * kGroup, dst + q * stride2 + P * (kPanelRows / 2) * kGroup);
  }
  if (whole * kPanelRows < cb)
    transpose_panels_generic(packed, np, panel_stride, c0 + whole * kPanelRows, cb - whole * kPanelRows,
                             dst + whole * stride2);
}

[[maybe_unused]] static void sgemm_nn_generic(int m, int n, int k, const float* const* a_rows, const float* b,
                             int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for (int r = 0; r < m; ++r) {
    float* __restrict cr = c + r * ldc;
    if (!accumulate)
      for (int j = 0; j < n; ++j) cr[j] = 0.f;
    const float* ar = a_rows[r];
    for (int p = 0; p < k; ++p) {
      const float av = ar[p];
      const float* __restrict bp = b + p * ldb;
      for (int j = 0; j < n; ++j) cr[j] += av * bp[j];
    }
  }
}

[[maybe_unused]] static void sgemm_tn_generic(int m, int n, int k, const float* a, int64_t lda,
                             const float* const* b_rows, float* c, int64_t ldc, bool accumulate) {
  if (!accumulate)
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) c[i * ldc + j] = 0.f;
  // Four rows of the reduction at a time keep C traffic down.
  int r = 0;
  for (; r + 4 <= k; r += 4) {
    const float* __restrict b0 = b_rows[r];
    const float* __restrict b1 = b_rows[r + 1];
    const float* __restrict b2 = b_rows[r + 2];
    const float* __restrict b3 = b_rows[r + 3];
    for (int i = 0; i < m; ++i) {
      const float a0 = a[r * lda + i], a1 = a[(r + 1) * lda + i];
      const float a2 = a[(r + 2) * lda + i], a3 = a[(r + 3) * lda + i];
      if (a0 == 0.f && a1 == 0.f && a2 == 0.f && a3 == 0.f) continue;
      float* __restrict ci = c + i * ldc;
      for (int j = 0; j < n; ++j) ci[j] += a0 * b0[j] + a1 * b1[j] + a2 * b2[j] + a3 * b3[j];
    }
  }
  for (; r < k; ++r) {
    const float* __restrict b0 = b_rows[r];
    for (int i = 0; i < m; ++i) {
      const float a0 = a[r * lda + i];
      float* __restrict ci = c + i * ldc;
      for (int j = 0; j < n; ++j) ci[j] += a0 * b0[j];
    }
  }
}

[[maybe_unused]] static void sgemm_nt_generic(int m, int n, int k, const float* const* a_rows, const float* b,
                             int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  // 16 independent partial sums per dot product so the loop vectorises
  // without reassociation; the reduction order is fixed.
  constexpr int L = 16;
  for (int r = 0; r < m; ++r) {
    const float* __restrict ar = a_rows[r];
    for (int j = 0; j < n; ++j) {
      const float* __restrict bj = b + j * ldb;
      float acc[L] = {};
      int p = 0;
      for (; p + L <= k; p += L)
        for (int l = 0; l < L; ++l) acc[l] += ar[p + l] * bj[p + l];
      for (int l = 0; p + l < k; ++l) acc[l] += ar[p + l] * bj[p + l];
      float s = 0.f;
      for (int l = 0; l < L; ++l) s += acc[l];
      c[r * ldc + j] = accumulate ? c[r * ldc + j] + s : s;
    }
  }
}

}  // namespace generic
}  // namespace kt
