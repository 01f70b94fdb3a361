// AMX kernels: the weight GEMM on tile registers (tdpbf16ps,
// amx_gemm.h; plain and with a scale per group of K, for quantized bases
// dequantized into cache), the weight gradients (amx_zip.h) and, where the CPU has
// AMX-INT8, the int8 compute GEMM
// (tdpbsud, amx_int8.h); every other entry of the table from the AVX-512
// BF16 kernels. C is fp32 as with vdpbf16ps, so the BF16 accuracy bounds hold
// unchanged. Few rows per call (decode) and the K remainder past the last
// whole tile go to the AVX-512 kernel: a tile pays from kMinRows rows (8), and tile
// shapes are fixed per configuration.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/amx/amx_entries.h"
#include "kernels/amx/amx_gemm.h"
#include "kernels/amx/amx_int8.h"
#include "kernels/amx/amx_zip.h"
#include "kernels/avx512bf16/int8_codes.h"
#include "kernels/counted.h"
#include "kernels/kernels.h"

namespace kt {

extern const Kernels kernels_avx512bf16;

namespace amx {
namespace {

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
// this thread. C tiles (0-3) 16 rows x 64 bytes, A tiles (4, 5) 16 rows x
// a_bytes, B tiles (6, 7) b_rows x 64 bytes.
void configure_tiles_as(int a_bytes, int b_rows) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(t >= 6 ? b_rows : 16);
    cfg.colsb[t] = static_cast<uint16_t>(t == 4 || t == 5 ? a_bytes : 64);
  }
  // GCC 12 has been seen to drop these stores as dead before ldtilecfg
  // (which it does not see read memory); the barrier keeps them. The file
  // is also compiled with -fno-dse.
  __asm__ volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// The tile machine of amx_gemm.h on the hardware. The intrinsics take tile
// numbers as literal tokens: one case per tile the blocks use (C 0-3, A 4-5,
// B 6-7; C tile c = 2 i + j takes A tile 4 + i and B tile 6 + j).
struct Tiles {
  template <int T>
  static void zero() {
    static_assert(T >= 0 && T < 4, "C tiles are 0-3");
    if constexpr (T == 0) _tile_zero(0);
    else if constexpr (T == 1) _tile_zero(1);
    else if constexpr (T == 2) _tile_zero(2);
    else _tile_zero(3);
  }
  template <int T>
  static void load(const void* base, int64_t stride) {
    static_assert(T >= 4 && T < 8, "A and B tiles are 4-7");
    if constexpr (T == 4) _tile_loadd(4, base, stride);
    else if constexpr (T == 5) _tile_loadd(5, base, stride);
    else if constexpr (T == 6) _tile_loadd(6, base, stride);
    else _tile_loadd(7, base, stride);
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    static_assert(T >= 0 && T < 4, "C tiles are 0-3");
    if constexpr (T == 0) _tile_stored(0, base, stride);
    else if constexpr (T == 1) _tile_stored(1, base, stride);
    else if constexpr (T == 2) _tile_stored(2, base, stride);
    else _tile_stored(3, base, stride);
  }
  template <int C, int A, int B>
  static void dpbf16() {
    static_assert(C >= 0 && C < 4 && A == 4 + C / 2 && B == 6 + C % 2, "the blocks' tiles");
    if constexpr (C == 0) _tile_dpbf16ps(0, 4, 6);
    else if constexpr (C == 1) _tile_dpbf16ps(1, 4, 7);
    else if constexpr (C == 2) _tile_dpbf16ps(2, 5, 6);
    else _tile_dpbf16ps(3, 5, 7);
  }
  template <int C, int A, int B>
  static void dpbsud() {
    static_assert(C >= 0 && C < 4 && A == 4 + C / 2 && B == 6 + C % 2, "the blocks' tiles");
    if constexpr (C == 0) _tile_dpbsud(0, 4, 6);
    else if constexpr (C == 1) _tile_dpbsud(1, 4, 7);
    else if constexpr (C == 2) _tile_dpbsud(2, 5, 6);
    else _tile_dpbsud(3, 5, 7);
  }

  static void configure() { configure_tiles_as(64, 16); }
  // Int8 tiles of k_bytes (32 or 64) of K: B tiles of k_bytes / 4 rows of 4
  // bytes per column.
  static void configure_int8(int k_bytes) { configure_tiles_as(k_bytes, k_bytes / 4); }
  static void release() { _tile_release(); }

  static void fallback_gemm(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                            int64_t panel_stride, int np, float* c, int64_t ldc, bool accumulate,
                            const PrefetchRegion& next) {
    kernels_avx512bf16.gemm_bf16w(a_rows, m, kp, panels, panel_stride, np, c, ldc, accumulate, next);
  }
  static void grouped_fallback(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                               int64_t panel_stride, int np, const float* scales, int64_t scale_stride,
                               int64_t group, float* c, int64_t ldc, bool accumulate,
                               const PrefetchRegion& next) {
    kernels_avx512bf16.gemm_bf16w_grouped(a_rows, m, kp, panels, panel_stride, np, scales, scale_stride,
                                          group, c, ldc, accumulate, next);
  }
  static void zip_fallback(const bf16_t* d, int64_t ldd, int m, const bf16_t* z, int64_t ldz, int np,
                           int64_t groups, float* c, int64_t ldc, bool accumulate, float scale, bool stream) {
    kernels_avx512bf16.gemm_zip_bf16(d, ldd, m, z, ldz, np, groups, c, ldc, accumulate, scale, stream);
  }
  static void int8_fallback(const QuantPanels& w, const void* const* a_rows, int m, int np, float* c,
                            int64_t ldc, bool accumulate, const PrefetchRegion& next) {
    kernels_avx512bf16.gemm_int8(w, a_rows, m, np, c, ldc, accumulate, next);
  }

  template <int Bits, QuantCode Code>
  struct B_codes {
    static constexpr int64_t kStepBytes = avx512bf16::Int8Codes<Bits, Code>::kStepBytes;
    static constexpr int32_t kOffset = avx512bf16::Int8Codes<Bits, Code>::kOffset;
    avx512bf16::Int8Codes<Bits, Code> codes;
    // out: a thread's expanded-codes buffer, 64-byte steps from an address
    // the allocator chose (16-byte aligned at least): unaligned store.
    void operator()(const uint8_t* src, uint8_t* out) const { _mm512_storeu_si512(out, codes.step(src)); }
  };
};


// The int8 tile GEMM against the AVX-512 kernel, bit for bit, on 40 rows x
// 3 panels x K 128 in each code kind (int8 per channel, int4 in groups of
// 32 and of 128 with zero points, e2m1): both compute the generic kernel's
// bits.
bool int8_self_test() {
  struct Kind {
    int bits;
    QuantCode code;
    bool zeros;
    int64_t group;
  };
  const Kind kinds[] = {{8, QuantCode::kInt, false, 128},
                        {4, QuantCode::kInt, false, 32},
                        {4, QuantCode::kInt, true, 128},
                        {4, QuantCode::kE2M1, false, 32}};
  const int m = 40, np = 3;
  const int64_t kq = 128;
  uint32_t state = 54321;
  auto next_byte = [&state] {
    state = state * 1664525u + 1013904223u;
    return static_cast<uint8_t>(state >> 24);
  };
  for (const Kind& kind : kinds) {
    QuantPanels w;
    w.bits = kind.bits;
    w.code = kind.code;
    w.kq = kq;
    w.group = kind.group;
    w.code_panel_bytes = 16 * kq * kind.bits / 8;
    w.scale_panel = kq / kind.group * 16;
    w.scale_bytes = 2;
    std::vector<uint8_t> codes(static_cast<size_t>(np * w.code_panel_bytes)),
        zeros(static_cast<size_t>(np * w.scale_panel));
    std::vector<bf16_t> scales(static_cast<size_t>(np * w.scale_panel));
    for (auto& b : codes) b = next_byte();
    for (auto& b : zeros) b = next_byte() & 15;
    for (auto& v : scales) v = f32_to_bf16(static_cast<float>(1 + (next_byte() & 63)) / 1024.f);
    w.codes = codes.data();
    w.scales = reinterpret_cast<const uint8_t*>(scales.data());
    w.zeros = kind.zeros ? zeros.data() : nullptr;
    const int64_t stride = int8_row_bytes(kq, kind.group);
    std::vector<uint8_t> data(static_cast<size_t>(m * stride));
    std::vector<const void*> rows(static_cast<size_t>(m));
    std::vector<float> x(static_cast<size_t>(kq));
    for (int r = 0; r < m; ++r) {
      for (auto& v : x) v = static_cast<float>(static_cast<int>(next_byte()) - 128);
      quantize_int8_row(x.data(), kq, kq, kind.group, kind.bits == 4, data.data() + r * stride);
      rows[static_cast<size_t>(r)] = data.data() + r * stride;
    }
    const int64_t ldc = 16 * np;
    std::vector<float> got(static_cast<size_t>(m * ldc), 1.f), want(got);
    gemm_int8<Tiles>(w, rows.data(), m, np, got.data(), ldc, true, PrefetchRegion{});
    kernels_avx512bf16.gemm_int8(w, rows.data(), m, np, want.data(), ldc, true, PrefetchRegion{});
    if (std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) != 0) return false;
  }
  return true;
}

}  // namespace

// The tile GEMMs against the AVX-512 kernels on a product of 40 rows, K = 100
// (three tiles and a remainder) and 3 panels, the weight gradients on the
// same values, and the int8 GEMM: catches a CPU or OS that reports AMX but
// computes wrongly, and a miscompiled tile configuration.
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
  // Products of these values are exact; sums of 100 of them in fp32 differ
  // only by order.
  const auto close = [&] {
    for (size_t i = 0; i < got.size(); ++i) {
      const float d = got[i] - want[i];
      if (!(d <= 1e-3f && d >= -1e-3f)) return false;
    }
    return true;
  };
  gemm_bf16w<Tiles>(rows.data(), m, kp, w.data(), panel_stride, np, got.data(), ldc, true, PrefetchRegion{});
  kernels_avx512bf16.gemm_bf16w(rows.data(), m, kp, w.data(), panel_stride, np, want.data(), ldc, true,
                                PrefetchRegion{});
  if (!close()) return false;
  // The grouped GEMM over K 96 (three groups of 32), scales 1/4 and 1/2
  // (exact: the sums differ by order only).
  {
    const int64_t kg = 96, groups = kg / 32;
    std::vector<float> scales(static_cast<size_t>(np * groups * 16));
    for (size_t i = 0; i < scales.size(); ++i) scales[i] = i % 3 == 0 ? 0.5f : 0.25f;
    gemm_bf16w_grouped<Tiles>(rows.data(), m, kg, w.data(), panel_stride, np, scales.data(), groups * 16,
                       32, got.data(), ldc, false, PrefetchRegion{});
    kernels_avx512bf16.gemm_bf16w_grouped(rows.data(), m, kg, w.data(), panel_stride, np,
                                          scales.data(), groups * 16, 32, want.data(), ldc, false,
                                          PrefetchRegion{});
    if (!close()) return false;
  }
  // The weight-gradient GEMM on the same values: D 50 pair groups of 40
  // columns (three tiles and a remainder), Z 50 groups of 48.
  gemm_zip_bf16<Tiles>(a.data(), 2 * m, m, w.data(), 32 * np, np, kp / 2, got.data(), ldc, false, 0.5f,
                false);
  kernels_avx512bf16.gemm_zip_bf16(a.data(), 2 * m, m, w.data(), 32 * np, np, kp / 2, want.data(),
                                   ldc, false, 0.5f, false);
  if (!close()) return false;
  return !cpu_has_amx_int8() || int8_self_test();
}

}  // namespace amx

// The tile kernels for table_amx.cpp, constant-initialised: no code of this
// file (compiled for AVX-512 and AMX) may run while the library loads, on a
// CPU that has neither.
extern const AmxEntries amx_entries = {amx::gemm_bf16w<amx::Tiles>, amx::gemm_bf16w_grouped<amx::Tiles>,
                                       amx::gemm_zip_bf16<amx::Tiles>, amx::gemm_int8<amx::Tiles>,
                                       amx::kMinRows};

}  // namespace kt
