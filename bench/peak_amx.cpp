// The AMX compute peaks: tdpbf16ps (AMX-BF16) and tdpbssd (AMX-INT8) on four
// independent C tiles from two A and two B tiles held in registers. Compiled
// with -mamx-tile -mamx-bf16 -mamx-int8; each called only on CPUs that report
// its feature and after the OS granted the process the tile data state.
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

namespace {
// Configures eight 16 x 64-byte tiles, loads small operands into tiles 4-7
// and zeroes the accumulators 0-3.
void configure_tiles(const void* operand) {
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
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

void release_tiles() {
  alignas(64) int32_t out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  volatile int32_t sink = out[0];
  (void)sink;
}

// Four independent accumulators: step() issues one product per C tile.
template <class Step>
void run_tiles(int64_t iterations, const void* operand, Step step) {
  configure_tiles(operand);
  for (int64_t it = 0; it < iterations; ++it) step();
  release_tiles();
}
}  // namespace

double run_bf16_tile_amx(int64_t iterations) {
  // Small operands keep the sums finite (1e-3 in bf16 pairs).
  alignas(64) uint16_t operand[16 * 32];
  for (auto& v : operand) v = 0x3a83;
  run_tiles(iterations, operand, [] {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  });
  // Per tdpbf16ps: 16 x 16 outputs x 32 products x (multiply + add).
  return static_cast<double>(iterations) * 4 * 16 * 16 * 32 * 2;
}

double run_int8_tile_amx(int64_t iterations) {
  alignas(64) int8_t operand[16 * 64];
  for (auto& v : operand) v = 1;
  run_tiles(iterations, operand, [] {
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  });
  // Per tdpbssd: 16 x 16 outputs x 64 products x (multiply + add).
  return static_cast<double>(iterations) * 4 * 16 * 16 * 64 * 2;
}

}  // namespace kt_bench
