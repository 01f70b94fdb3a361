// AMX-BF16 kernels: the weight GEMM on tile registers (tdpbf16ps,
// amx_gemm.inc), every other entry of the table from the AVX-512 BF16
// kernels. C is fp32 as with vdpbf16ps, so the BF16 accuracy bounds hold
// unchanged. Few rows per call (decode) and the K remainder past the last
// whole tile go to the AVX-512 kernel: a tile needs 16 rows to pay, and tile
// shapes are fixed per configuration.
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "kernels/kernels.h"

namespace kt {

extern const Kernels kernels_avx512bf16;

namespace amx {
namespace {

#define KT_TILE_ZERO(t) _tile_zero(t)
#define KT_TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define KT_TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define KT_TILE_DPBF16(c, a, b) _tile_dpbf16ps(c, a, b)

// The 64-byte tile configuration of palette 1.
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// Loaded on every call: another library (oneDNN) may configure tiles on
// this thread.
void configure_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // GCC 12 has been seen to drop these stores as dead before ldtilecfg
  // (which it does not see read memory); the barrier keeps them. The file
  // is also compiled with -fno-dse.
  __asm__ volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

inline void release_tiles() { _tile_release(); }

inline void fallback_gemm(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels, int64_t panel_stride,
                          int np, float* c, int64_t ldc, bool accumulate, const PrefetchRegion& next) {
  kernels_avx512bf16.gemm_bf16w(a_rows, m, kp, panels, panel_stride, np, c, ldc, accumulate, next);
}

#include "kernels/amx/amx_gemm.inc"

}  // namespace

// The tile GEMM against the AVX-512 kernel on a product of 40 rows, K = 100
// (three tiles and a remainder) and 3 panels: catches a CPU or OS that
// reports AMX but computes wrongly, and a miscompiled tile configuration.
bool self_test() {
  const int m = 40, np = 3;
  const int64_t kp = 100, panel_stride = 16 * kp;
  std::vector<bf16_t> a(static_cast<size_t>(m * kp)), w(static_cast<size_t>(np * panel_stride));
  uint32_t state = 12345;
  auto next_value = [&state] {
    state = state * 1664525u + 1013904223u;
    return f32_to_bf16(static_cast<float>(static_cast<int>(state >> 24) - 128) / 64.f);
  };
  for (auto& v : a) v = next_value();
  for (auto& v : w) v = next_value();
  std::vector<const void*> rows(static_cast<size_t>(m));
  for (int r = 0; r < m; ++r) rows[static_cast<size_t>(r)] = a.data() + r * kp;
  const int64_t ldc = 16 * np;
  std::vector<float> got(static_cast<size_t>(m * ldc), 1.f), want(static_cast<size_t>(m * ldc), 1.f);
  gemm_bf16w(rows.data(), m, kp, w.data(), panel_stride, np, got.data(), ldc, true, PrefetchRegion{});
  kernels_avx512bf16.gemm_bf16w(rows.data(), m, kp, w.data(), panel_stride, np, want.data(), ldc, true,
                                PrefetchRegion{});
  for (size_t i = 0; i < got.size(); ++i) {
    const float d = got[i] - want[i];
    // Products of these values are exact; sums of 100 of them in fp32
    // differ only by order.
    if (!(d <= 1e-3f && d >= -1e-3f)) return false;
  }
  return true;
}

// The AVX-512 BF16 table (constant-initialised, so it is complete before
// this one is made) with the weight GEMM on tiles.
Kernels make_table() {
  Kernels k = kernels_avx512bf16;
  k.isa = KT_ISA_AMX;
  k.gemm_name = "gemm_bf16w_bf16_f32_32x32__amx";
  k.gemm_bf16w = gemm_bf16w;
  return k;
}

}  // namespace amx

extern const Kernels kernels_amx = amx::make_table();

}  // namespace kt
