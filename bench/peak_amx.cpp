// The AMX-BF16 compute peak: tdpbf16ps on four independent C tiles from two
// A and two B tiles held in registers. Compiled with -mamx-tile -mamx-bf16;
// called only on CPUs that report AMX-BF16 and after the OS granted the
// process the tile data state.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "machine_limits.h"

namespace kt_bench {

namespace {
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
}  // namespace

bool request_amx_permission() {
#if defined(SYS_arch_prctl)
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

double run_bf16_tile_amx(int64_t iterations) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // Keeps the stores GCC 12 may otherwise drop before ldtilecfg.
  __asm__ volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
  // Small operands keep the sums finite (1e-3 in bf16 pairs).
  alignas(64) uint16_t operand[16 * 32];
  for (auto& v : operand) v = 0x3a83;
  alignas(64) float out[16 * 16];
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t it = 0; it < iterations; ++it) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  volatile float sink = out[0];
  (void)sink;
  // Per tdpbf16ps: 16 x 16 outputs x 32 products x (multiply + add).
  return static_cast<double>(iterations) * 4 * 16 * 16 * 32 * 2;
}

}  // namespace kt_bench
