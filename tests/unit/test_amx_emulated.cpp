// The AMX weight GEMM's blocking (src/kernels/amx/amx_gemm.inc) on emulated
// tiles, on every machine: the same source as the AMX kernel, with the tile
// operations done in plain code (tdpbf16ps: C[m][n] += sum over pairs k of
// A[m][2k] B[k][n][0] + A[m][2k+1] B[k][n][1]). It checks the gathering of
// row pointers, the 1-2 row tiles x 1-2 panel blocks, partial blocks, the
// stores with accumulate, and the K remainder handed to the fallback. The
// hardware path itself runs in GemmKernels.* where the CPU has AMX.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/buffer.h"
#include "core/tensor.h"
#include "formats/packed_bf16.h"
#include "kernels/kernels.h"
#include "views.h"

namespace emulated {

using kt::bf16_t;
using kt::PrefetchRegion;

struct Tiles {
  alignas(64) unsigned char t[8][16 * 64];
  bool configured = false;
  int dot_products = 0;  // tdpbf16ps executed
};
Tiles g;

template <int T>
void tile_zero() {
  std::memset(g.t[T], 0, sizeof(g.t[T]));
}
template <int T>
void tile_load(const void* base, int64_t stride) {
  EXPECT_TRUE(g.configured) << "tile load before the tiles were configured";
  for (int r = 0; r < 16; ++r) std::memcpy(g.t[T] + r * 64, static_cast<const char*>(base) + r * stride, 64);
}
template <int T>
void tile_store(void* base, int64_t stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(static_cast<char*>(base) + r * stride, g.t[T] + r * 64, 64);
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
#define KT_TILE_ZERO(t) tile_zero<t>()
#define KT_TILE_LOAD(t, base, stride) tile_load<t>(base, stride)
#define KT_TILE_STORE(t, base, stride) tile_store<t>(base, stride)
#define KT_TILE_DPBF16(c, a, b) tile_dpbf16<c, a, b>()

void configure_tiles() { g.configured = true; }
void release_tiles() { g.configured = false; }

// The fallback: plain loops over the packed panels.
void fallback_gemm(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels, int64_t panel_stride, int np,
                   float* c, int64_t ldc, bool accumulate, const PrefetchRegion&) {
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

#include "kernels/amx/amx_gemm.inc"

}  // namespace emulated

namespace {

using kt_test::view2d;

TEST(AmxEmulated, WeightGemmMatchesDoubleLoops) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  int tiled_calls = 0;
  for (int m : {1, 15, 16, 17, 31, 32, 33, 48, 70})
    for (int np : {1, 2, 3, 5})
      for (int64_t k : {31, 32, 64, 100, 130}) {
        const kt::PanelShape s = kt::PanelShape::of(np * 16, k);
        std::vector<float> w(static_cast<size_t>(np * 16 * k));
        for (auto& v : w) v = kt::bf16_to_f32(kt::f32_to_bf16(nd(rng)));
        kt::Buffer<kt::bf16_t> packed(static_cast<size_t>(s.elements()));
        kt::pack_bf16_panels(view2d(w.data(), np * 16, k), 0, 1, s, packed.data());
        // Rows out of memory order, as the MoE gathers an expert's tokens.
        std::vector<kt::bf16_t> a(static_cast<size_t>(m * s.kp), 0);
        std::vector<const void*> rows(static_cast<size_t>(m));
        for (int i = 0; i < m; ++i) {
          for (int64_t j = 0; j < k; ++j) a[static_cast<size_t>(i * s.kp + j)] = kt::f32_to_bf16(nd(rng));
          rows[static_cast<size_t>(m - 1 - i)] = &a[static_cast<size_t>(i * s.kp)];
        }
        const int64_t ldc = np * 16 + 5;
        for (bool acc : {false, true}) {
          std::vector<float> c(static_cast<size_t>(m * ldc), 0.25f);
          const int before = emulated::g.dot_products;
          emulated::gemm_bf16w(rows.data(), m, s.kp, packed.data(), s.panel_stride(), np, c.data(), ldc, acc,
                               kt::PrefetchRegion{});
          tiled_calls += emulated::g.dot_products > before;
          EXPECT_FALSE(emulated::g.configured) << "tiles not released";
          for (int i = 0; i < m; ++i) {
            const kt::bf16_t* ar = static_cast<const kt::bf16_t*>(rows[static_cast<size_t>(i)]);
            for (int64_t col = 0; col < ldc; ++col) {
              double want = 0.25;
              if (col < np * 16) {
                double sum = 0;
                for (int64_t j = 0; j < k; ++j)
                  sum += static_cast<double>(kt::bf16_to_f32(ar[j])) * w[static_cast<size_t>(col * k + j)];
                want = acc ? 0.25 + sum : sum;
              }
              ASSERT_NEAR(c[static_cast<size_t>(i * ldc + col)], want, 1e-4 * std::sqrt(static_cast<double>(k)) * (1 + std::fabs(want)))
                  << "m=" << m << " np=" << np << " k=" << k << " acc=" << acc << " at " << i << "," << col;
            }
          }
        }
      }
  // Most shapes went through the tiles (m >= 16 and k >= 32).
  EXPECT_GT(tiled_calls, 100);
}

}  // namespace
