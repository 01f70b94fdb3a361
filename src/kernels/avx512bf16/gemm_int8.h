// gemm_int8 (kernels.h) with AVX512-VNNI, bit for bit the generic kernel's
// result. vpdpbusd takes one operand as unsigned bytes: the weight codes go
// as u = q + off (Int8Codes) against the row's signed codes x, four
// products a lane, and each group's sum is taken back to
// sum x * q = sum x * u - off * sum x with the row's code sums (exact in
// int32: |sum x * u| <= 127 * 255 * group, and the layer keeps K <= 65536).
// Tiles of up to 4 rows x 4 panels: a step of 4 K values expands each
// panel's codes once for all rows. Takes group_scales and with_count from
// gemm_quant.h.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/avx512bf16/gemm_quant.h"
#include "kernels/avx512bf16/int8_codes.h"
#include "kernels/generic/quant.h"
#include "kernels/kernels.h"

namespace kt {
namespace avx512bf16 {

constexpr int64_t kInt8Ahead = 2048;  // bytes of codes fetched ahead into L1

// acc + the four products of each lane's unsigned bytes of u and signed bytes
// of x. In assembly: GCC 12 compiles _mm512_dpbusd_epi32 on a tile of
// accumulators with a copy of each per step and spills some to the stack
// (the tile then ran at half the instruction's rate).
__attribute__((target("avx512vnni"))) static inline __m512i dot_u8s8(__m512i acc, __m512i u, __m512i x) {
  __asm__("vpdpbusd %[x], %[u], %[acc]" : [acc] "+v"(acc) : [u] "v"(u), [x] "v"(x));
  return acc;
}

// The tile's panels are ps apart (1: adjacent; strided_tiles).
template <int Bits, QuantCode Code, bool Zero, int MR, int NP>
__attribute__((target("avx512vnni"))) static void int8_tile(const QuantPanels& w, const uint8_t* const* a, float* c,
                                                             int64_t ldc, bool accumulate,
                                                             const TileAhead& ahead, int64_t ps) {
  // The codes kInt8Ahead bytes ahead into L1, past the panels' ends the
  // streams that follow them (TileAhead), the scales (zero points) as far
  // ahead, as gemm_quant's tiles fetch.
  using Codes = Int8Codes<Bits, Code>;
  constexpr int64_t kStepBytes = Codes::kStepBytes;
  constexpr bool kE2m1 = Code == QuantCode::kE2M1;
  constexpr int32_t kOffset = Codes::kOffset;
  constexpr int64_t kStepsPerLine = 64 / kStepBytes;
  // Chains of sums per (row, panel): few of them (one row at decode) would
  // wait on vpdpbusd's latency, so each step goes to chain step % C.
  constexpr int C = MR * NP <= 4 ? 4 : MR * NP <= 8 ? 2 : 1;
  constexpr int kRound = C > kStepsPerLine ? C : static_cast<int>(kStepsPerLine);  // steps per round
  const int64_t groups = w.kq / w.group;
  const int64_t steps_per_group = w.group / 4;
  const int64_t steps = w.kq / 4;
  const int64_t panel_bytes = steps * kStepBytes;
  const int64_t code_stride = ps * w.code_panel_bytes, scale_stride = ps * w.scale_panel;
  const Codes codes;
  // The fp32 sums of the groups so far: in registers for small tiles (one
  // row at decode, where groups of 32 come every 8 steps), else in L1 (the
  // registers hold the integer sums).
  constexpr bool kPartsInRegs = MR * NP <= 4;
  __m512 reg_part[kPartsInRegs ? MR : 1][kPartsInRegs ? NP : 1];
  alignas(64) float mem_part[kPartsInRegs ? 1 : MR][kPartsInRegs ? 1 : NP][kPanelRows];
  #pragma GCC unroll 16
  for (auto& row : reg_part)
    #pragma GCC unroll 16
    for (auto& v : row) v = _mm512_setzero_ps();
  const int64_t groups_ahead = kInt8Ahead / (steps_per_group * kStepBytes);
  for (int64_t j = 0; j < groups; ++j) {
    {
      // The scales' (zero points') line of the group kInt8Ahead bytes of
      // codes on, once; past the K range's end, the stream that follows.
      const int64_t ja = j + groups_ahead;
      const bool within = ahead.goes_on || ja < groups;
      const uint8_t* scales = within ? w.scales : ahead.cont_scales;
      const uint8_t* zeros = within ? w.zeros : ahead.cont_zeros;
      const int np_ahead = within ? NP : scales ? ahead.cont_np : 0;
      const int64_t stride = within ? scale_stride : w.scale_panel;
      const int64_t at = (within ? ja : ja - groups) * kPanelRows;
      #pragma GCC unroll 16
      for (int p = 0; p < NP; ++p) {
        if (p >= np_ahead) break;
        if ((at * w.scale_bytes) % 64 == 0)
          _mm_prefetch(reinterpret_cast<const char*>(scales + (p * stride + at) * w.scale_bytes), _MM_HINT_T0);
        if constexpr (Zero)
          if (zeros && at % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(zeros + p * stride + at), _MM_HINT_T0);
      }
    }
    __m512i d[C][MR][NP];
    #pragma GCC unroll 16
    for (int i = 0; i < C; ++i)
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r)
        #pragma GCC unroll 16
        for (int p = 0; p < NP; ++p) d[i][r][p] = _mm512_setzero_si512();
    // Rounds of kRound steps, whole lines of each panel's codes (a group's
    // steps are a multiple of 8): one fetch per stream and line.
    for (int64_t st0 = j * steps_per_group; st0 < (j + 1) * steps_per_group; st0 += kRound)
    #pragma GCC unroll 8
    for (int i = 0; i < kRound; ++i) {
      const int64_t st = st0 + i;
      const int64_t at = st * kStepBytes + kInt8Ahead;  // the byte of each stream fetched now
      const bool fetch = i % kStepsPerLine == 0;
      __m512i u[NP];
      #pragma GCC unroll 16
      for (int p = 0; p < NP; ++p) {
        const uint8_t* src = w.codes + p * code_stride + st * kStepBytes;
        if (fetch) {
          if (ahead.goes_on || at < panel_bytes) {
            _mm_prefetch(reinterpret_cast<const char*>(src + kInt8Ahead), _MM_HINT_T0);
          } else if (p < ahead.cont_np) {
            _mm_prefetch(reinterpret_cast<const char*>(ahead.cont + p * w.code_panel_bytes + (at - panel_bytes)),
                         _MM_HINT_T0);
          }
        }
        u[p] = codes.step(src);
      }
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        int32_t x4;
        __builtin_memcpy(&x4, a[r] + st * 4, 4);
        const __m512i x = _mm512_set1_epi32(x4);
        #pragma GCC unroll 16
        for (int p = 0; p < NP; ++p) d[i % C][r][p] = dot_u8s8(d[i % C][r][p], u[p], x);
      }
    }
    // The chains' sums: exact, so the result does not depend on C.
    #pragma GCC unroll 16
    for (int i = 1; i < C; ++i)
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r)
        #pragma GCC unroll 16
        for (int p = 0; p < NP; ++p) d[0][r][p] = _mm512_add_epi32(d[0][r][p], d[i][r][p]);
    #pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) {
      const __m512 sv = group_scales(w.scales + (p * scale_stride + j * kPanelRows) * w.scale_bytes, w.scale_bytes);
      __m512i zero = _mm512_setzero_si512();  // zero points: the lanes' zero bytes, the codes' offsets
      if constexpr (Zero)
        zero = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.zeros + p * scale_stride + j * kPanelRows)));
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        int32_t sum;
        __builtin_memcpy(&sum, a[r] + w.kq + 4 * j, 4);
        const __m512i offset =
            Zero ? _mm512_mullo_epi32(zero, _mm512_set1_epi32(sum)) : _mm512_set1_epi32(kOffset * sum);
        const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(d[0][r][p], offset));
        if constexpr (kPartsInRegs) {
          reg_part[r][p] = _mm512_fmadd_ps(f, sv, reg_part[r][p]);
        } else {
          const __m512 before = j == 0 ? _mm512_setzero_ps() : _mm512_load_ps(mem_part[r][p]);
          _mm512_store_ps(mem_part[r][p], _mm512_fmadd_ps(f, sv, before));
        }
      }
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    float s;
    __builtin_memcpy(&s, a[r] + w.kq + 4 * groups, 4);
    const __m512 sr = _mm512_set1_ps(kE2m1 ? s * 0.5f : s);
    #pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) {
      float* cr = c + r * ldc + p * ps * kPanelRows;
      __m512 sum;
      if constexpr (kPartsInRegs) {
        sum = reg_part[r][p];
      } else {
        sum = _mm512_load_ps(mem_part[r][p]);
      }
      _mm512_storeu_ps(cr, accumulate ? _mm512_fmadd_ps(sum, sr, _mm512_loadu_ps(cr)) : _mm512_mul_ps(sum, sr));
    }
  }
}

template <int Bits, QuantCode Code, bool Zero>
__attribute__((target("avx512vnni"))) static void gemm_int8_bits(const QuantPanels& w, const void* const* a_rows,
                                                                  int m, int np, float* c, int64_t ldc,
                                                                  bool accumulate, const PrefetchRegion& next) {
  constexpr int kRows = 4, kPanels = 4;
  const uint8_t* const* a = reinterpret_cast<const uint8_t* const*>(a_rows);
  const int tiles = (m + kRows - 1) / kRows;
  // The streams that follow each tile's (TileShares).
  const TileShares shares(next, w.code_panel_bytes);
  for (int t = 0, r = 0; t < tiles; ++t) {
    const int h = (m - r) / (tiles - t);
    with_count<kRows>(h, [&](auto rows) {
      constexpr int MR = decltype(rows)::value;
      // One row tile (decode) streams the codes: strided where they fit.
      int p = 0;
      if (tiles == 1)
        p = strided_tiles<kPanels>(w, np, w.kq / 4 * Int8Codes<Bits, Code>::kStepBytes, shares,
                                   [&](const QuantPanels& wp, const TileAhead& ahead, int tp, int n) {
                                     int8_tile<Bits, Code, Zero, MR, kPanels>(wp, a + r, c + r * ldc + tp * kPanelRows,
                                                                             ldc, accumulate, ahead, n);
                                   });
      for (; p < np; p += kPanels) {
        const int n = np - p < kPanels ? np - p : kPanels;
        const QuantPanels wp = panels_from(w, p);
        const TileAhead ahead = shares.tile(wp, n, np - p);
        with_count<kPanels>(n, [&](auto panels) {
          int8_tile<Bits, Code, Zero, MR, decltype(panels)::value>(wp, a + r, c + r * ldc + p * kPanelRows, ldc,
                                                                  accumulate, ahead, 1);
        });
      }
    });
    r += h;
  }
}

static void gemm_int8(const QuantPanels& w, const void* const* a_rows, int m, int np, float* c, int64_t ldc,
                      bool accumulate, const PrefetchRegion& next) {
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  if (!vnni) {
    generic::gemm_int8_generic(w, a_rows, m, np, c, ldc, accumulate, next);
  } else if (w.bits == 8) {
    gemm_int8_bits<8, QuantCode::kInt, false>(w, a_rows, m, np, c, ldc, accumulate, next);
  } else if (w.code == QuantCode::kE2M1) {
    gemm_int8_bits<4, QuantCode::kE2M1, false>(w, a_rows, m, np, c, ldc, accumulate, next);
  } else if (w.zeros) {
    gemm_int8_bits<4, QuantCode::kInt, true>(w, a_rows, m, np, c, ldc, accumulate, next);
  } else {
    gemm_int8_bits<4, QuantCode::kInt, false>(w, a_rows, m, np, c, ldc, accumulate, next);
  }
}

}  // namespace avx512bf16
}  // namespace kt
