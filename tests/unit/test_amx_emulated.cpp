// The AMX weight GEMM's blocking (src/kernels/amx/amx_gemm.h) on emulated
// tiles, on every machine: the same templates as the AMX kernel, on a tile
// machine whose operations are done in plain code (tdpbf16ps: C[m][n] += sum over pairs k of
// A[m][2k] B[k][n][0] + A[m][2k+1] B[k][n][1]). It checks the gathering of
// row pointers, the 1-2 row tiles x 1-2 panel blocks, partial blocks, the
// stores with accumulate, and the K remainder handed to the fallback. The
// same for the grouped GEMM of quantized bases, the weight gradients (amx_zip.h) and the AMX-INT8
// GEMM (amx_int8.h, tdpbsud on int8 rows and the codes as unsigned bytes). The hardware path
// itself runs in GemmKernels.* where the CPU has AMX.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/buffer.h"
#include "core/tensor.h"
#include "formats/packed_bf16.h"
#include "int8_operands.h"
#include "kernels/amx/amx_gemm.h"
#include "kernels/amx/amx_int8.h"
#include "kernels/amx/amx_zip.h"
#include "kernels/counted.h"
#include "kernels/kernels.h"
#include "views.h"

namespace emulated {

using kt::bf16_t;
using kt::PrefetchCursor;
using kt::PrefetchRegion;

struct Tiles {
  alignas(64) unsigned char t[8][16 * 64];
  int rows[8] = {}, colsb[8] = {};  // the configuration's shapes
  bool configured = false;
  int dot_products = 0;  // tdpbf16ps / tdpbsud executed
  // Tile loads whose rows all lay in [lo, hi): A tiles read where the rows lie.
  const char *lo = nullptr, *hi = nullptr;
  int loads_in_place = 0;
};
Tiles g;

template <int T>
void tile_zero() {
  std::memset(g.t[T], 0, sizeof(g.t[T]));
}
// As the hardware loads: the configured rows and bytes, the rest zero.
template <int T>
void tile_load(const void* base, int64_t stride) {
  EXPECT_TRUE(g.configured) << "tile load before the tiles were configured";
  const char* first = static_cast<const char*>(base);
  if (first >= g.lo && first + (g.rows[T] - 1) * stride + g.colsb[T] <= g.hi) ++g.loads_in_place;
  tile_zero<T>();
  for (int r = 0; r < g.rows[T]; ++r)
    std::memcpy(g.t[T] + r * 64, static_cast<const char*>(base) + r * stride,
                static_cast<size_t>(g.colsb[T]));
}
template <int T>
void tile_store(void* base, int64_t stride) {
  for (int r = 0; r < g.rows[T]; ++r)
    std::memcpy(static_cast<char*>(base) + r * stride, g.t[T] + r * 64,
                static_cast<size_t>(g.colsb[T]));
}
// tdpbsud: C[m][n] (int32) += sum over the K quads i of A's signed bytes
// A[m][4i + j] times B's unsigned bytes B[i][4n + j].
template <int C, int A, int B>
void tile_dpbsud() {
  const int quads = g.colsb[A] / 4;
  EXPECT_EQ(g.rows[B], quads) << "B's rows must be A's K quads";
  EXPECT_EQ(g.colsb[B], 64);
  int32_t* c = reinterpret_cast<int32_t*>(g.t[C]);
  const int8_t* a = reinterpret_cast<const int8_t*>(g.t[A]);
  const uint8_t* b = g.t[B];
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n)
      for (int i = 0; i < quads; ++i)
        for (int j = 0; j < 4; ++j) c[m * 16 + n] += a[m * 64 + 4 * i + j] * b[i * 64 + 4 * n + j];
  ++g.dot_products;
}
template <int C, int A, int B>
void tile_dpbf16() {
  float* c = reinterpret_cast<float*>(g.t[C]);
  const bf16_t* a = reinterpret_cast<const bf16_t*>(g.t[A]);  // [16 rows][32 K]
  const bf16_t* b = reinterpret_cast<const bf16_t*>(g.t[B]);  // [16 K pairs][16 columns][2]
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      float acc = c[m * 16 + n];
      for (int k = 0; k < 16; ++k)
        acc += kt::bf16_to_f32(a[m * 32 + 2 * k]) * kt::bf16_to_f32(b[k * 32 + n * 2]) +
               kt::bf16_to_f32(a[m * 32 + 2 * k + 1]) * kt::bf16_to_f32(b[k * 32 + n * 2 + 1]);
      c[m * 16 + n] = acc;
    }
  ++g.dot_products;
}
void configure_tiles_as(int a_bytes, int b_rows) {
  for (int t = 0; t < 8; ++t) {
    g.rows[t] = t >= 6 ? b_rows : 16;
    g.colsb[t] = t == 4 || t == 5 ? a_bytes : 64;
  }
  g.configured = true;
}
void configure_tiles() {
  configure_tiles_as(64, 16);
}
void configure_int8_tiles(int k_bytes) {
  EXPECT_TRUE(k_bytes == 32 || k_bytes == 64) << k_bytes;
  configure_tiles_as(k_bytes, k_bytes / 4);
}
void release_tiles() { g.configured = false; }

// The fallback: plain loops over the packed panels (counted as the ref
// kernel, so the tests see what the tiles left to it).
void fallback_gemm(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels, int64_t panel_stride, int np,
                   float* c, int64_t ldc, bool accumulate, const PrefetchRegion&) {
  kt::count_kernel(kt::kernel_id(kt::KernelTable::kRef, kt::KernelEntry::kGemmBf16w),
                   kt::entry_flops::gemm(m, 16 * np, kp));
  for (int r = 0; r < m; ++r) {
    const bf16_t* a = static_cast<const bf16_t*>(a_rows[r]);
    for (int p = 0; p < np; ++p)
      for (int j = 0; j < 16; ++j) {
        float acc = 0.f;
        for (int64_t k = 0; k < kp; ++k)
          acc += kt::bf16_to_f32(a[k]) * kt::bf16_to_f32(panels[p * panel_stride + k / 2 * 32 + j * 2 + k % 2]);
        float& out = c[r * ldc + 16 * p + j];
        out = accumulate ? out + acc : acc;
      }
  }
}

// The grouped fallback: plain loops, each group's sum times its scale.
void grouped_fallback(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                      int64_t panel_stride, int np, const float* scales, int64_t scale_stride,
                      int64_t group, float* c, int64_t ldc, bool accumulate,
                      const PrefetchRegion&) {
  for (int r = 0; r < m; ++r) {
    const bf16_t* a = static_cast<const bf16_t*>(a_rows[r]);
    for (int p = 0; p < np; ++p)
      for (int j = 0; j < 16; ++j) {
        float acc = 0.f;
        for (int64_t g0 = 0; g0 < kp; g0 += group) {
          float part = 0.f;
          for (int64_t k = g0; k < g0 + group; ++k)
            part += kt::bf16_to_f32(a[k]) *
                    kt::bf16_to_f32(panels[p * panel_stride + k / 2 * 32 + j * 2 + k % 2]);
          acc += scales[p * scale_stride + g0 / group * 16 + j] * part;
        }
        float& out = c[r * ldc + 16 * p + j];
        out = accumulate ? out + acc : acc;
      }
  }
}

// The weight-gradient fallback: plain loops over the zipped pairs.
void zip_fallback(const bf16_t* d, int64_t ldd, int m, const bf16_t* z, int64_t ldz, int np,
                  int64_t groups, float* c, int64_t ldc, bool accumulate, float scale, bool) {
  for (int o = 0; o < m; ++o)
    for (int col = 0; col < 16 * np; ++col) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g)
        for (int j = 0; j < 2; ++j)
          acc +=
              kt::bf16_to_f32(d[g * ldd + 2 * o + j]) * kt::bf16_to_f32(z[g * ldz + 2 * col + j]);
      float& out = c[o * ldc + col];
      out = accumulate ? out + scale * acc : scale * acc;
    }
}

using kt::QuantCode;
using kt::QuantPanels;

// The codes of one step as unsigned bytes, read from the packed layout
// (formats/packed_quant.h) in plain code: lane L's 4 bytes are its codes at
// the K values the int8 A rows hold at 4s..4s+3 (4-bit: nibble order, K
// 4s + 0, 2, 1, 3), each plus its offset (int8 128, int4 8, e2m1 doubled 12;
// zero points: the nibble as stored).
template <int Bits, QuantCode Code>
struct B_codes {
  static constexpr int64_t kStepBytes = Bits == 8 ? 64 : 32;
  static constexpr int32_t kOffset = Bits == 8 ? 128 : Code == QuantCode::kE2M1 ? 12 : 8;
  void operator()(const uint8_t* src, uint8_t* out) const {
    for (int lane = 0; lane < 16; ++lane)
      for (int j = 0; j < 4; ++j) {
        uint8_t u;
        if constexpr (Bits == 8) {
          const int8_t q = static_cast<int8_t>(src[(j / 2) * 32 + lane * 2 + j % 2]);  // K 4s + j
          u = static_cast<uint8_t>(q + kOffset);
        } else {
          const int kk = (j & 1) << 1 | j >> 1;  // K 4s + kk: pair group kk / 2, element kk % 2
          const uint8_t b = src[lane * 2 + kk % 2];
          const uint8_t nibble = static_cast<uint8_t>(kk / 2 ? b >> 4 : b & 15);
          // int4: the nibble is value + 8 (with zero points, the code as stored)
          u = Code == QuantCode::kE2M1
                  ? static_cast<uint8_t>(2.f * kt::e2m1_to_f32(nibble) + kOffset)
                  : nibble;
        }
        out[lane * 4 + j] = u;
      }
  }
};

void int8_fallback(const QuantPanels& w, const void* const* a_rows, int m, int np, float* c,
                   int64_t ldc, bool accumulate, const PrefetchRegion& next) {
  kt::kernels_for(KT_ISA_REF)->gemm_int8(w, a_rows, m, np, c, ldc, accumulate, next);
}

// The tile machine of src/kernels/amx/amx_gemm.h, emulated.
struct EmulatedTiles {
  template <int T>
  static void zero() {
    tile_zero<T>();
  }
  template <int T>
  static void load(const void* base, int64_t stride) {
    tile_load<T>(base, stride);
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    tile_store<T>(base, stride);
  }
  template <int C, int A, int B>
  static void dpbf16() {
    tile_dpbf16<C, A, B>();
  }
  template <int C, int A, int B>
  static void dpbsud() {
    tile_dpbsud<C, A, B>();
  }
  static void configure() { configure_tiles(); }
  static void configure_int8(int k_bytes) { configure_int8_tiles(k_bytes); }
  static void release() { release_tiles(); }
  static constexpr auto fallback_gemm = emulated::fallback_gemm;
  static constexpr auto grouped_fallback = emulated::grouped_fallback;
  static constexpr auto zip_fallback = emulated::zip_fallback;
  static constexpr auto int8_fallback = emulated::int8_fallback;
  template <int Bits, QuantCode Code>
  using B_codes = emulated::B_codes<Bits, Code>;
};

constexpr auto gemm_bf16w = kt::amx::gemm_bf16w<EmulatedTiles>;
constexpr auto gemm_bf16w_grouped = kt::amx::gemm_bf16w_grouped<EmulatedTiles>;
constexpr auto gemm_zip_bf16 = kt::amx::gemm_zip_bf16<EmulatedTiles>;
constexpr auto gemm_int8 = kt::amx::gemm_int8<EmulatedTiles>;

}  // namespace emulated

namespace {

using kt_test::view2d;

// Rows out of memory order, as the MoE gathers an expert's tokens (gathered
// into a block by the kernel), or equally spaced wider than K, as a caller
// lays them out in route order (whole tiles loaded where they lie).
enum class RowLayout { kScattered, kSpaced };

// Counts the tile loads within [data, data + bytes) from here on.
void watch_loads(const void* data, size_t bytes) {
  emulated::g.lo = static_cast<const char*>(data);
  emulated::g.hi = emulated::g.lo + bytes;
  emulated::g.loads_in_place = 0;
}

struct Rows {
  std::vector<kt::bf16_t> data;
  std::vector<const void*> ptrs;
  // m rows of k values from gen(); row spacing kp (+ 40 when spaced).
  template <class Gen>
  Rows(RowLayout layout, int m, int64_t k, int64_t kp, Gen&& gen) {
    const int64_t step = layout == RowLayout::kSpaced ? kp + 40 : kp;
    data.assign(static_cast<size_t>(m * step), kt::f32_to_bf16(99.f));
    ptrs.resize(static_cast<size_t>(m));
    for (int i = 0; i < m; ++i) {
      for (int64_t j = 0; j < kp; ++j)
        data[static_cast<size_t>(i * step + j)] = j < k ? gen() : kt::bf16_t{0};
      ptrs[static_cast<size_t>(layout == RowLayout::kSpaced ? i : m - 1 - i)] =
          &data[static_cast<size_t>(i * step)];
    }
  }
  void watch() const { watch_loads(data.data(), data.size() * sizeof(kt::bf16_t)); }
};

// Spaced rows: every whole 16-row tile of a block is loaded in place (not
// copied first), so at least (m / 16 whole tiles) x K tiles loads read the
// source; scattered rows never are.
void expect_loads(RowLayout layout, int m, int64_t k_full, int np, const char* what) {
  const int whole_tiles = m / 32 * 2 + (m % 32 >= 16 ? 1 : 0);
  const int64_t want = static_cast<int64_t>(whole_tiles) * (k_full / 32) * ((np + 1) / 2);
  if (layout == RowLayout::kSpaced && m >= 16)
    EXPECT_GE(emulated::g.loads_in_place, want)
        << what << " m=" << m << " np=" << np << " k=" << k_full;
  else
    EXPECT_EQ(emulated::g.loads_in_place, 0)
        << what << " m=" << m << " np=" << np << " k=" << k_full;
}

// What a call counted: on tiles, one amx call of the whole K's flops (in
// tile steps); the rest, the fallback's.
void expect_tally(const kt::KernelTally& t, bool tiled, int m, int np, int64_t kp,
                  const char* what) {
  using kt::KernelEntry;
  using kt::KernelTable;
  const int amx = kt::kernel_id(KernelTable::kAmx, KernelEntry::kGemmBf16w);
  const int ref = kt::kernel_id(KernelTable::kRef, KernelEntry::kGemmBf16w);
  const int64_t k_tiles = tiled ? kp / 32 * 32 : 0;
  EXPECT_EQ(t.calls[amx].load(), tiled ? 1 : 0) << what << " m=" << m << " kp=" << kp;
  EXPECT_EQ(t.flops[amx].load(), 2 * int64_t{m} * 16 * np * k_tiles)
      << what << " m=" << m << " kp=" << kp;
  EXPECT_EQ(t.calls[ref].load(), k_tiles < kp ? 1 : 0) << what << " m=" << m << " kp=" << kp;
  EXPECT_EQ(t.flops[ref].load(), 2 * int64_t{m} * 16 * np * (kp - k_tiles))
      << what << " m=" << m << " kp=" << kp;
}

TEST(AmxEmulated, WeightGemmMatchesDoubleLoops) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  int tiled_calls = 0;
  for (RowLayout layout : {RowLayout::kScattered, RowLayout::kSpaced})
    for (int m : {1, 15, 16, 17, 31, 32, 33, 48, 70})
      for (int np : {1, 2, 3, 5})
        for (int64_t k : {31, 32, 64, 100, 130}) {
          const kt::PanelShape s = kt::PanelShape::of(np * 16, k);
          std::vector<float> w(static_cast<size_t>(np * 16 * k));
          for (auto& v : w) v = kt::bf16_to_f32(kt::f32_to_bf16(nd(rng)));
          kt::Buffer<kt::bf16_t> packed(static_cast<size_t>(s.elements()));
          kt::pack_bf16_panels(view2d(w.data(), np * 16, k), 0, 1, s, packed.data());
          const Rows a(layout, m, k, s.kp, [&] { return kt::f32_to_bf16(nd(rng)); });
          const std::vector<const void*>& rows = a.ptrs;
          const int64_t ldc = np * 16 + 5;
          for (bool acc : {false, true}) {
            std::vector<float> c(static_cast<size_t>(m * ldc), 0.25f);
            const int before = emulated::g.dot_products;
            a.watch();
            kt::KernelTally tally;
            {
              const kt::KernelTallyScope counting(&tally);
              emulated::gemm_bf16w(rows.data(), m, s.kp, packed.data(), s.panel_stride(), np,
                                   c.data(), ldc, acc, kt::PrefetchRegion{});
            }
            const bool tiled = emulated::g.dot_products > before;
            tiled_calls += tiled;
            expect_tally(tally, tiled, m, np, s.kp, "gemm_bf16w");
            EXPECT_FALSE(emulated::g.configured) << "tiles not released";
            expect_loads(layout, m, s.kp / 32 * 32, np, "gemm_bf16w");
            for (int i = 0; i < m; ++i) {
              const kt::bf16_t* ar = static_cast<const kt::bf16_t*>(rows[static_cast<size_t>(i)]);
              for (int64_t col = 0; col < ldc; ++col) {
                double want = 0.25;
                if (col < np * 16) {
                  double sum = 0;
                  for (int64_t j = 0; j < k; ++j)
                    sum += static_cast<double>(kt::bf16_to_f32(ar[j])) *
                           w[static_cast<size_t>(col * k + j)];
                  want = acc ? 0.25 + sum : sum;
                }
                ASSERT_NEAR(c[static_cast<size_t>(i * ldc + col)], want,
                            1e-4 * std::sqrt(static_cast<double>(k)) * (1 + std::fabs(want)))
                    << "m=" << m << " np=" << np << " k=" << k << " acc=" << acc << " at " << i
                    << "," << col;
              }
            }
          }
        }
  // Most shapes went through the tiles (m >= 16 and k >= 32).
  EXPECT_GT(tiled_calls, 200);
}

// The grouped GEMM on tiles (quantized bases dequantized into cache): per
// group the C tiles' sums times the group's scales, added in fp32; groups
// of one tile step and of several, 1-2 row tiles x 1-2 panels, partial
// blocks, accumulate, against double loops; few rows go to the fallback.
TEST(AmxEmulated, GroupedGemmMatchesDoubleLoops) {
  std::mt19937 rng(12);
  std::normal_distribution<float> nd;
  int tiled_calls = 0;
  for (RowLayout layout : {RowLayout::kScattered, RowLayout::kSpaced})
    for (int m : {1, 15, 16, 17, 32, 33, 70})
      for (int np : {1, 2, 3, 5})
        for (int64_t kp : {32, 96, 256})
          for (int64_t group : {int64_t{32}, int64_t{128}, kp}) {
            if (kp % group != 0) continue;
            const kt::PanelShape s = kt::PanelShape::of(np * 16, kp);
            std::vector<float> w(static_cast<size_t>(np * 16 * kp));
            for (auto& v : w)
              v = static_cast<float>(static_cast<int>(nd(rng) * 3.f));  // small ints, as codes are
            kt::Buffer<kt::bf16_t> packed(static_cast<size_t>(s.elements()));
            kt::pack_bf16_panels(view2d(w.data(), np * 16, kp), 0, 1, s, packed.data());
            const int64_t ng = kp / group;
            std::vector<float> scales(static_cast<size_t>(np * ng * 16));
            for (auto& v : scales) v = std::fabs(nd(rng)) + 0.1f;
            const Rows a(layout, m, kp, kp, [&] { return kt::f32_to_bf16(nd(rng)); });
            const std::vector<const void*>& rows = a.ptrs;
            const int64_t ldc = np * 16 + 5;
            for (bool acc : {false, true}) {
              std::vector<float> c(static_cast<size_t>(m * ldc), 0.5f);
              const int before = emulated::g.dot_products;
              a.watch();
              emulated::gemm_bf16w_grouped(rows.data(), m, kp, packed.data(), s.panel_stride(), np,
                                           scales.data(), ng * 16, group, c.data(), ldc, acc,
                                           kt::PrefetchRegion{});
              const int dots = emulated::g.dot_products - before;
              tiled_calls += dots > 0;
              EXPECT_EQ(dots > 0, m >= kt::amx::kMinRows) << "m=" << m << ": tiles from kMinRows rows on";
              EXPECT_FALSE(emulated::g.configured) << "tiles not released";
              expect_loads(layout, m, kp, np, "gemm_bf16w_grouped");
              for (int i = 0; i < m; ++i) {
                const kt::bf16_t* ar = static_cast<const kt::bf16_t*>(rows[static_cast<size_t>(i)]);
                for (int64_t col = 0; col < ldc; ++col) {
                  const float got = c[static_cast<size_t>(i * ldc + col)];
                  if (col >= np * 16) {
                    ASSERT_EQ(got, 0.5f) << "a column past the panels was written";
                    continue;
                  }
                  const int64_t p = col / 16, lane = col % 16;
                  double want = acc ? 0.5 : 0.0, mag = 0.0;
                  for (int64_t j = 0; j < ng; ++j) {
                    double part = 0;
                    for (int64_t kk = j * group; kk < (j + 1) * group; ++kk)
                      part += static_cast<double>(kt::bf16_to_f32(ar[kk])) *
                              w[static_cast<size_t>(col * kp + kk)];
                    const double sc = scales[static_cast<size_t>((p * ng + j) * 16 + lane)];
                    want += sc * part;
                    mag += sc * std::fabs(part);
                  }
                  ASSERT_NEAR(got, want, 1e-5 * (1.0 + mag) * std::sqrt(static_cast<double>(kp)))
                      << "m=" << m << " np=" << np << " kp=" << kp << " group=" << group
                      << " acc=" << acc << " at " << i << "," << col;
                }
              }
            }
          }
  EXPECT_GT(tiled_calls, 100);
}

// The weight gradients on tiles (amx_zip.h): D's pairs gathered into A
// rows, Z's groups as B tiles in place (ldz and ldd wider than the data),
// partial row blocks, odd panels, the groups past the last whole tile,
// scale and accumulate, against double loops.
TEST(AmxEmulated, WeightGradientGemmMatchesDoubleLoops) {
  std::mt19937 rng(17);
  std::normal_distribution<float> nd;
  int tiled_calls = 0;
  for (int m : {1, 15, 16, 17, 32, 40})
    for (int np : {1, 2, 3})
      for (int64_t groups : {8, 16, 17, 40}) {
        const int64_t ldd = 2 * m + 6, ldz = 32 * np + 4;
        std::vector<kt::bf16_t> d(static_cast<size_t>(groups * ldd)),
            z(static_cast<size_t>(groups * ldz));
        for (auto& v : d) v = kt::f32_to_bf16(nd(rng));
        for (auto& v : z) v = kt::f32_to_bf16(nd(rng));
        const int64_t ldc = 16 * np + 3;
        for (bool acc : {false, true}) {
          std::vector<float> c(static_cast<size_t>(m * ldc), 0.25f);
          const int before = emulated::g.dot_products;
          emulated::gemm_zip_bf16(d.data(), ldd, m, z.data(), ldz, np, groups, c.data(), ldc, acc,
                                  0.5f, false);
          tiled_calls += emulated::g.dot_products > before;
          EXPECT_FALSE(emulated::g.configured) << "tiles not released";
          for (int o = 0; o < m; ++o)
            for (int64_t col = 0; col < ldc; ++col) {
              double want = 0.25;
              if (col < 16 * np) {
                double sum = 0.0;
                for (int64_t gg = 0; gg < groups; ++gg)
                  for (int j = 0; j < 2; ++j)
                    sum += static_cast<double>(
                               kt::bf16_to_f32(d[static_cast<size_t>(gg * ldd + 2 * o + j)])) *
                           kt::bf16_to_f32(z[static_cast<size_t>(gg * ldz + 2 * col + j)]);
                want = (acc ? 0.25 : 0.0) + 0.5 * sum;
              }
              ASSERT_NEAR(c[static_cast<size_t>(o * ldc + col)], want,
                          1e-5 * std::sqrt(static_cast<double>(groups)) * (1 + std::fabs(want)))
                  << "m=" << m << " np=" << np << " groups=" << groups << " acc=" << acc << " at "
                  << o << "," << col;
            }
        }
      }
  // The shapes with 16 rows and 16 groups or more went through the tiles.
  EXPECT_EQ(tiled_calls, 4 * 3 * 3 * 2);
}

// The AMX-INT8 GEMM (amx_int8.h) on emulated tiles: bit for bit the
// reference table's gemm_int8 in every int8 compute format, tile steps of 64
// and of 32 K bytes (groups of 32, and int8 per channel at K 96), blocks of
// one and two row tiles and of one and two panels, accumulate, rows equally
// spaced and gathered.
TEST(AmxEmulated, Int8GemmMatchesReferenceBits) {
  const kt::Kernels& R = *kt::kernels_for(KT_ISA_REF);
  std::mt19937 rng(13);
  int tiled_calls = 0;
  for (kt_weight_format f : {KT_FORMAT_INT8_CHANNEL, KT_FORMAT_INT4_G32, KT_FORMAT_INT4_G128,
                             KT_FORMAT_INT4_G32_ZP, KT_FORMAT_INT4_G128_ZP, KT_FORMAT_MXFP4})
    for (int64_t k : {96, 128, 384})
      for (int np : {1, 2, 3})
        for (int m : {1, 15, 16, 17, 32, 33, 50}) {
          const kt_test::Int8Operands op(f, np, k, m, rng);
          if (op.s.kq != k) continue;  // groups of 128 need K a multiple of 128
          const int64_t ldc = np * 16 + 5;
          // The rows as laid out (equally spaced: whole tiles loaded where
          // they lie), and in reverse order (gathered).
          const std::vector<const void*> reversed(op.rows.rbegin(), op.rows.rend());
          for (RowLayout layout : {RowLayout::kSpaced, RowLayout::kScattered})
            for (bool acc : {false, true}) {
              const std::vector<const void*>& rows =
                  layout == RowLayout::kSpaced ? op.rows : reversed;
              std::vector<float> got(static_cast<size_t>(m * ldc), 0.25f), want(got);
              const int before = emulated::g.dot_products;
              watch_loads(op.row_data.data(), op.row_data.size());
              emulated::gemm_int8(op.panels(), rows.data(), m, np, got.data(), ldc, acc,
                                  kt::PrefetchRegion{});
              tiled_calls += emulated::g.dot_products > before;
              EXPECT_FALSE(emulated::g.configured) << "tiles not released";
              if (layout == RowLayout::kSpaced && m >= 16)
                EXPECT_GE(emulated::g.loads_in_place, (m / 16) * (op.s.kq / 64) * ((np + 1) / 2))
                    << "whole tiles of spaced rows loaded where they lie, m=" << m;
              else
                EXPECT_EQ(emulated::g.loads_in_place, 0) << "m=" << m;
              R.gemm_int8(op.panels(), rows.data(), m, np, want.data(), ldc, acc,
                          kt::PrefetchRegion{});
              for (size_t i = 0; i < got.size(); ++i)
                ASSERT_EQ(got[i], want[i]) << kt_weight_format_name(f) << " k=" << k << " np=" << np
                                           << " m=" << m << " acc=" << acc << " at " << i;
            }
        }
  EXPECT_GT(tiled_calls, 300);
}

}  // namespace
