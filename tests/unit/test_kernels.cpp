// Micro-kernels of every compiled ISA against their scalar twin, over edge
// shapes (m = 1, row/panel tails, odd K), and the packed-panel helpers.
#include <gtest/gtest.h>
#include <xmmintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/buffer.h"
#include "core/kernel_tally.h"
#include "formats/packed_bf16.h"
#include "formats/packed_quant.h"
#include "int8_operands.h"
#include "kernels/kernels.h"
#include "moe/reference.h"
#include "views.h"

namespace {

using kt::bf16_t;

// The compiled tables of the kernel registry (src/kernels/kernel_list.inc),
// on any CPU: a test on a table this CPU does not run skips, saying why.
const std::vector<kt::KernelTableInfo>& registry() {
  static const std::vector<kt::KernelTableInfo> tables = kt::compiled_kernel_tables();
  return tables;
}
const kt::KernelTableInfo& registry_entry(const kt::Kernels* k) {
  for (const kt::KernelTableInfo& t : registry())
    if (t.table == k) return t;
  static const kt::KernelTableInfo none{nullptr, "unlisted", "a place in the registry"};
  return none;
}
// An ISA's own table, not a variant of it.
bool isa_table(const kt::KernelTableInfo& t) { return kt::kernels_for(t.table->isa) == t.table; }

// The ISA tables (with_variants false), or all: the GEMM and dequantization
// tests also run each ISA's table as a CPU without an optional feature runs
// it (avx2_no_vnni, avx512bf16_no_vbmi).
std::vector<const kt::Kernels*> registry_tables(bool with_variants) {
  std::vector<const kt::Kernels*> v;
  for (const kt::KernelTableInfo& t : registry())
    if (with_variants || isa_table(t)) v.push_back(t.table);
  return v;
}
// The ISA tables this CPU runs.
std::vector<const kt::Kernels*> runnable_isa_tables() {
  std::vector<const kt::Kernels*> v;
  for (const kt::KernelTableInfo& t : registry())
    if (isa_table(t) && !*t.missing) v.push_back(t.table);
  return v;
}

std::string kernels_test_name(const ::testing::TestParamInfo<const kt::Kernels*>& i) {
  return registry_entry(i.param).name;
}

// Tests over the registry's tables: skipped where this CPU lacks what the
// table needs.
class RegistryTables : public ::testing::TestWithParam<const kt::Kernels*> {
 protected:
  void SetUp() override {
    const kt::KernelTableInfo& t = registry_entry(GetParam());
    if (*t.missing) GTEST_SKIP() << t.name << " not run: this CPU has no " << t.missing;
  }
};

// m rows of k values (a, row-major) in table K's A format, and pointers to
// them. The data lives in the returned object.
struct PackedRows {
  std::vector<char> data;
  std::vector<const void*> rows;
};
PackedRows pack_rows(const kt::Kernels& K, const std::vector<float>& a, int m, int64_t k) {
  PackedRows p;
  p.data.resize(static_cast<size_t>(m * k * K.a_elem_size));
  for (int i = 0; i < m; ++i) {
    K.pack_a_f32(&a[static_cast<size_t>(i * k)], k, k, &p.data[static_cast<size_t>(i * k * K.a_elem_size)]);
    p.rows.push_back(&p.data[static_cast<size_t>(i * k * K.a_elem_size)]);
  }
  return p;
}

using kt_test::view2d;

TEST(ZeroBytesStreaming, ZeroesExactlyTheRangeAtAnyAlignment) {
  std::vector<unsigned char> buf(3 * 8192 + 256);
  for (size_t n : {size_t{0}, size_t{1}, size_t{100}, size_t{4095}, size_t{4096}, size_t{4097},
                   size_t{8191 + 64}, size_t{3 * 8192 + 13}}) {
    for (size_t off : {size_t{0}, size_t{1}, size_t{17}, size_t{63}, size_t{64}, size_t{100}}) {
      // From a 64-byte boundary inside buf.
      const size_t base = (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
      std::fill(buf.begin(), buf.end(), 0xAB);
      kt::zero_bytes_streaming(buf.data() + base + off, n);
      for (size_t i = 0; i < buf.size(); ++i) {
        const bool inside = i >= base + off && i < base + off + n;
        ASSERT_EQ(buf[i], inside ? 0 : 0xAB) << "n " << n << " offset " << off << " byte " << i;
      }
    }
  }
}

TEST(PackedPanels, PackAndReadBackEveryElement) {
  for (auto dims : {std::pair<int64_t, int64_t>{1, 1}, {16, 2}, {17, 3}, {33, 64}, {5, 129}}) {
    const int64_t n = dims.first, k = dims.second;
    std::vector<float> w(static_cast<size_t>(n * k));
    for (size_t i = 0; i < w.size(); ++i) w[i] = kt::bf16_to_f32(kt::f32_to_bf16(0.01f * static_cast<float>(i) - 1.f));
    const kt::PanelShape s = kt::PanelShape::of(n, k);
    kt::Buffer<bf16_t> packed(static_cast<size_t>(s.elements()));
    kt::pack_bf16_panels(view2d(w.data(), n, k), 0, 1, s, packed.data());
    for (int64_t r = 0; r < s.padded_rows(); ++r)
      for (int64_t c = 0; c < s.kp; ++c) {
        const float want = r < n && c < k ? w[static_cast<size_t>(r * k + c)] : 0.f;
        ASSERT_EQ(kt::packed_get(packed.data(), s, r, c), want) << n << "x" << k << " at " << r << "," << c;
      }
  }
}

class TransposeKernels : public RegistryTables {};

TEST_P(TransposeKernels, TransposedPanelsHoldTheTranspose) {
  const kt::Kernels& K = *GetParam();
  for (auto dims : {std::pair<int64_t, int64_t>{16, 64}, {37, 70}, {3, 2}, {50, 130}, {768, 2048}}) {
    const int64_t n = dims.first, k = dims.second;
    std::vector<float> w(static_cast<size_t>(n * k));
    for (size_t i = 0; i < w.size(); ++i) w[i] = kt::bf16_to_f32(kt::f32_to_bf16(std::sin(static_cast<float>(i))));
    const kt::PanelShape s = kt::PanelShape::of(n, k);
    kt::Buffer<bf16_t> packed(static_cast<size_t>(s.elements()));
    kt::pack_bf16_panels(view2d(w.data(), n, k), 0, 1, s, packed.data());
    for (int64_t c0 = 0; c0 < k; c0 += 64) {
      for (int64_t cb : {std::min<int64_t>(64, k - c0), std::min<int64_t>(16, k - c0), std::min<int64_t>(37, k - c0)}) {
        // The transposed block is a packed [cb, padded_rows(n)] matrix.
        const kt::PanelShape t = kt::PanelShape::of(cb, s.padded_rows());
        kt::Buffer<bf16_t> tp(static_cast<size_t>(t.elements()));
        for (size_t i = 0; i < tp.size(); ++i) tp[i] = 0x7fc0;  // NaN: every element must be written
        K.transpose_panels(packed.data(), s.np, s.panel_stride(), c0, cb, tp.data());
        for (int64_t r = 0; r < t.padded_rows(); ++r)
          for (int64_t c = 0; c < t.kp; ++c) {
            const float want = r < cb && c < n ? w[static_cast<size_t>(c * k + c0 + r)] : 0.f;
            ASSERT_EQ(kt::packed_get(tp.data(), t, r, c), want)
                << K.gemm_name << " " << n << "x" << k << " block " << c0 << "+" << cb << " at " << r << "," << c;
          }
      }
    }
  }
}

class GemmKernels : public RegistryTables {};

// gemm_bf16w against the scalar twin on operands both represent exactly
// (bf16 values), so results agree to fp32 accumulation-order error.
TEST_P(GemmKernels, WeightGemmMatchesScalarTwin) {
  const kt::Kernels& K = *GetParam();
  const kt::Kernels& R = *kt::kernels_for(KT_ISA_REF);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  // m 16.., k 32..: the AMX kernel's tiles (one or two row tiles, one or
  // two panels, whole K tiles and a remainder); fewer: its AVX-512 path.
  // 6, 8, 12, 16: the most rows one AVX-512 tile of 4, 3, 2, 1 panels holds
  // (the panels of a call then go in groups of that many, and a rest).
  for (int m : {1, 3, 4, 5, 6, 7, 8, 12, 13, 16, 17, 33, 64})
    for (int np : {1, 2, 3, 4, 5})
      for (int64_t k : {1, 2, 31, 64, 100}) {
        const kt::PanelShape s = kt::PanelShape::of(np * 16, k);
        std::vector<float> w(static_cast<size_t>(np * 16 * k));
        for (auto& v : w) v = kt::bf16_to_f32(kt::f32_to_bf16(nd(rng)));
        kt::Buffer<bf16_t> packed(static_cast<size_t>(s.elements()));
        kt::pack_bf16_panels(view2d(w.data(), np * 16, k), 0, 1, s, packed.data());
        std::vector<float> a(static_cast<size_t>(m * k));
        for (auto& v : a) v = kt::bf16_to_f32(kt::f32_to_bf16(nd(rng)));
        std::vector<char> ak(static_cast<size_t>(m * s.kp * K.a_elem_size)), ar(static_cast<size_t>(m * s.kp * 4));
        std::vector<const void*> rk(static_cast<size_t>(m)), rr(static_cast<size_t>(m));
        for (int i = 0; i < m; ++i) {
          K.pack_a_f32(&a[static_cast<size_t>(i * k)], k, s.kp, &ak[static_cast<size_t>(i * s.kp * K.a_elem_size)]);
          R.pack_a_f32(&a[static_cast<size_t>(i * k)], k, s.kp, &ar[static_cast<size_t>(i * s.kp * 4)]);
          rk[static_cast<size_t>(i)] = &ak[static_cast<size_t>(i * s.kp * K.a_elem_size)];
          rr[static_cast<size_t>(i)] = &ar[static_cast<size_t>(i * s.kp * 4)];
        }
        const int64_t ldc = np * 16 + 3;
        for (bool acc : {false, true}) {
          std::vector<float> ck(static_cast<size_t>(m * ldc), 0.5f), cr(static_cast<size_t>(m * ldc), 0.5f);
          K.gemm_bf16w(rk.data(), m, s.kp, packed.data(), s.panel_stride(), np, ck.data(), ldc, acc,
                       kt::PrefetchRegion{packed.data(), 64, static_cast<int64_t>(packed.size() * 2 / 128), 128});
          R.gemm_bf16w(rr.data(), m, s.kp, packed.data(), s.panel_stride(), np, cr.data(), ldc, acc, kt::PrefetchRegion{});
          for (int i = 0; i < m; ++i)
            for (int64_t j = 0; j < ldc; ++j) {
              const float want = cr[static_cast<size_t>(i * ldc + j)];
              ASSERT_NEAR(ck[static_cast<size_t>(i * ldc + j)], want, 1e-4f * (1.f + std::fabs(want)) * std::sqrt(static_cast<float>(k)))
                  << K.gemm_name << " m=" << m << " np=" << np << " k=" << k << " acc=" << acc << " at " << i << "," << j;
            }
        }
      }
}

// The zipped weight-gradient GEMM against plain loops in double, on bf16
// values (exact products, fp32 sums): C[o, c] = sum_r D[r, o] * Z[r, c].
TEST_P(GemmKernels, ZippedGradientGemmMatchesPlainLoops) {
  const kt::Kernels& K = *GetParam();
  if (!K.gemm_zip_bf16) GTEST_SKIP() << K.gemm_name << " takes fp32 operands; no zipped path";
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  for (int rows : {1, 2, 5, 32, 33})
    for (int m : {1, 5, 6, 7, 13, 64})
      for (int np : {1, 3, 4, 5, 9}) {
        const int cols = np * 16 - (np > 1 ? 5 : 0);  // a partial last panel
        const int ldz = np * 32, ldd = 2 * m + 2;
        std::vector<float> d(static_cast<size_t>(rows * m)), z(static_cast<size_t>(rows * cols));
        for (auto& v : d) v = kt::bf16_to_f32(kt::f32_to_bf16(nd(rng)));
        for (auto& v : z) v = kt::bf16_to_f32(kt::f32_to_bf16(nd(rng)));
        const int groups = (rows + 1) / 2;
        std::vector<bf16_t> dz(static_cast<size_t>(groups * ldd), 0), zz(static_cast<size_t>(groups * ldz), 0);
        for (int g = 0; g < groups; ++g) {
          const bool pair = 2 * g + 1 < rows;
          K.zip_rows_bf16(&d[static_cast<size_t>(2 * g * m)], pair ? &d[static_cast<size_t>((2 * g + 1) * m)] : nullptr,
                          m, &dz[static_cast<size_t>(g * ldd)]);
          K.zip_rows_bf16(&z[static_cast<size_t>(2 * g * cols)],
                          pair ? &z[static_cast<size_t>((2 * g + 1) * cols)] : nullptr, cols,
                          &zz[static_cast<size_t>(g * ldz)]);
          for (int j = 0; j < m; ++j) {  // the zip itself: rounding of bf16 values is exact
            ASSERT_EQ(kt::bf16_to_f32(dz[static_cast<size_t>(g * ldd + 2 * j)]), d[static_cast<size_t>(2 * g * m + j)]);
            ASSERT_EQ(kt::bf16_to_f32(dz[static_cast<size_t>(g * ldd + 2 * j + 1)]),
                      pair ? d[static_cast<size_t>((2 * g + 1) * m + j)] : 0.f);
          }
        }
        for (int mode = 0; mode < 4; ++mode) {
          const bool acc = mode & 1, stream = mode & 2;
          const float scale = stream ? 0.5f : 1.f;
          // Streaming needs 64-byte aligned rows: whole rows of panels in an
          // aligned buffer; otherwise one padding column that must stay.
          const int ldc = stream ? np * 16 : np * 16 + 1;
          kt::Buffer<float> c(static_cast<size_t>(m * ldc));
          for (int i = 0; i < m * ldc; ++i) c[static_cast<size_t>(i)] = 0.25f;
          K.gemm_zip_bf16(dz.data(), ldd, m, zz.data(), ldz, np, groups, c.data(), ldc, acc, scale, stream);
          for (int o = 0; o < m; ++o)
            for (int j = 0; j < np * 16; ++j) {
              double want = 0.0;
              for (int r = 0; r < rows && j < cols; ++r)
                want += static_cast<double>(d[static_cast<size_t>(r * m + o)]) * z[static_cast<size_t>(r * cols + j)];
              want = scale * want + (acc ? 0.25 : 0.0);
              ASSERT_NEAR(c[static_cast<size_t>(o * ldc + j)], want, 1e-5 * (1.0 + std::fabs(want)) * rows)
                  << "rows=" << rows << " m=" << m << " np=" << np << " acc=" << acc << " at " << o << "," << j;
            }
          if (!stream) {
            ASSERT_EQ(c[static_cast<size_t>(m * ldc - 1)], 0.25f) << "wrote past the panels";
          }
        }
      }
}

// The product with W itself on W's panels against plain loops in double,
// on bf16 values (exact products, fp32 sums): C[r, j] = sum_i A[r][i] *
// W[i][c0 + j]. Rows past N (a partial last panel) are zero in the panels;
// columns from c0 (even) in blocks with a partial last one, both write
// modes, and nothing written past n columns. 150 rows are 10 panels: more
// than one group of the straight driver's, whose sums carry between them.
TEST_P(GemmKernels, ProductWithWMatchesPlainLoops) {
  const kt::Kernels& K = *GetParam();
  if (!K.gemm_bf16w_nn) GTEST_SKIP() << K.gemm_name << " has no gemm_bf16w_nn; backward builds W^T panels";
  std::mt19937 rng(13);
  std::normal_distribution<float> nd;
  for (int64_t rows_w : {16, 37, 80, 150})
    for (int64_t k : {2, 31, 64, 100}) {
      const kt::PanelShape s = kt::PanelShape::of(rows_w, k);
      const int np = static_cast<int>(s.np);
      std::vector<float> w(static_cast<size_t>(rows_w * k));
      for (auto& v : w) v = kt::bf16_to_f32(kt::f32_to_bf16(nd(rng)));
      kt::Buffer<bf16_t> packed(static_cast<size_t>(s.elements()));
      kt::pack_bf16_panels(view2d(w.data(), rows_w, k), 0, 1, s, packed.data());
      const int64_t ka = 16 * np;  // A rows: W's padded rows
      for (int m : {1, 2, 3, 4, 5, 7, 17}) {
        std::vector<float> a(static_cast<size_t>(m * rows_w));
        for (auto& v : a) v = kt::bf16_to_f32(kt::f32_to_bf16(nd(rng)));
        std::vector<char> ak(static_cast<size_t>(m * ka * K.a_elem_size));
        std::vector<const void*> rows(static_cast<size_t>(m));
        for (int i = 0; i < m; ++i) {
          K.pack_a_f32(&a[static_cast<size_t>(i * rows_w)], rows_w, ka, &ak[static_cast<size_t>(i * ka * K.a_elem_size)]);
          rows[static_cast<size_t>(i)] = &ak[static_cast<size_t>(i * ka * K.a_elem_size)];
        }
        for (int64_t c0 : {int64_t{0}, int64_t{2}, int64_t{16}, int64_t{34}}) {
          if (c0 >= k) continue;
          for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{33}, k - c0}) {
            if (n > k - c0) continue;
            const int64_t ldc = n + 3;
            for (bool acc : {false, true}) {
              std::vector<float> c(static_cast<size_t>(m * ldc), 0.25f);
              const kt::PrefetchRegion next = kt::transpose_source(packed.data(), s, 0, std::min<int64_t>(64, k));
              K.gemm_bf16w_nn(rows.data(), m, packed.data(), s.panel_stride(), np, c0, n, c.data(), ldc, acc, next);
              for (int r = 0; r < m; ++r)
                for (int64_t j = 0; j < ldc; ++j) {
                  double want = 0.25;
                  if (j < n) {
                    want = acc ? 0.25 : 0.0;
                    for (int64_t i = 0; i < rows_w; ++i)
                      want += static_cast<double>(a[static_cast<size_t>(r * rows_w + i)]) *
                              w[static_cast<size_t>(i * k + c0 + j)];
                  }
                  ASSERT_NEAR(c[static_cast<size_t>(r * ldc + j)], want, 1e-5 * (1.0 + std::fabs(want)) * rows_w)
                      << K.gemm_name << " W " << rows_w << "x" << k << " m=" << m << " c0=" << c0 << " n=" << n
                      << " acc=" << acc << " at " << r << "," << j;
                }
            }
          }
        }
      }
    }
}

// The oneDNN backend's weight GEMM (oneDNN matmul reading the packed panels
// as BA16a16b2a) against kt's own kernel on the same operands: K multiples of
// 32 run in oneDNN, others fall back; gathered and contiguous rows, both
// write modes, a C wider than the panels.
// The AMX kernels run their reference-twin tests (GemmKernels.*, with the
// amx table) only where the CPU has AMX; this says so where it has not.
TEST(AmxKernels, RunWhereTheCpuHasAmx) {
  const kt::Kernels* amx = kt::kernels_for(KT_ISA_AMX);
  if (!amx) GTEST_SKIP() << "this build has no AMX kernels (KT_ENABLE_AMX, or a compiler without -mamx-bf16)";
  if (kt::detect_cpu_isa() < KT_ISA_AMX)
    GTEST_SKIP() << "this CPU (or OS) has no AMX-BF16: the AMX kernels and their twin tests did not run";
  // The one-time self-test passed, so the automatic choice is the AMX table.
  EXPECT_TRUE(kt::amx_kernels_verified());
  EXPECT_EQ(kt::select_kernels(KT_ISA_AMX).isa, KT_ISA_AMX);
  EXPECT_EQ(kt::select_kernels(KT_ISA_AVX512BF16).isa, KT_ISA_AVX512BF16);
}

// KT_GEMM_AUTO measures only the AMX tables; every other table is its own
// choice, with nothing timed.
TEST(AutoGemm, TimesOnlyTheAmxTables) {
  std::string note;
  for (const kt::Kernels* k : runnable_isa_tables()) {
    if (k->isa == KT_ISA_AMX) continue;
    EXPECT_EQ(&kt::auto_gemm_kernels(*k, &note), k) << k->gemm_name;
    EXPECT_EQ(note, "") << k->gemm_name;
  }
  const kt::Kernels* amx = kt::kernels_for(KT_ISA_AMX);
  if (!amx || kt::detect_cpu_isa() < KT_ISA_AMX) GTEST_SKIP() << "no AMX here: the measured choice did not run";
  const kt::Kernels& chosen = kt::auto_gemm_kernels(*amx, &note);
  EXPECT_NE(note.find("auto picks"), std::string::npos) << note;
  EXPECT_TRUE(&chosen == amx || (kt::onednn_compiled() && &chosen == kt::onednn_kernels(*amx))) << chosen.gemm_name;
}

TEST(AutoGemm, TimesAWeightGemm) {
  const kt::Kernels& k = kt::select_kernels(KT_ISA_AMX);  // the best table this CPU runs
  if (k.a_elem_size != 2) GTEST_SKIP() << "the timed GEMM has bf16 operands; " << k.gemm_name << " takes fp32";
  // The best of the timed calls after the warm-up call: a measured time
  // (finite, positive), whatever the machine's speed; how long it takes is
  // the benchmark's business, not the test's.
  const double s = kt::time_weight_gemm(k, 16, 256, 4, 2);
  EXPECT_TRUE(std::isfinite(s)) << s;
  EXPECT_GT(s, 0.0);
  EXPECT_LT(s, 1e30) << "no timed call after the warm-up";
}

TEST(OneDnnBackend, WeightGemmMatchesKtKernel) {
  const kt::Kernels* base = kt::kernels_for(KT_ISA_AVX512BF16);
  if (!base || kt::detect_cpu_isa() < KT_ISA_AVX512BF16) GTEST_SKIP() << "no avx512bf16 kernels on this CPU/build";
  const kt::Kernels* d = kt::onednn_kernels(*base);
  if (!kt::onednn_compiled()) {
    EXPECT_EQ(d, nullptr);
    GTEST_SKIP() << "built without oneDNN";
  }
  ASSERT_NE(d, nullptr);
  EXPECT_STREQ(d->gemm_name, "gemm_bf16w_bf16_f32__onednn_brgemm");
  EXPECT_EQ(kt::onednn_kernels(*kt::kernels_for(KT_ISA_REF)), nullptr) << "fp32 activations cannot feed oneDNN bf16";
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (int64_t k : {32, 96, 100, 768})
    for (int m : {1, 5, 6, 17, 64})
      for (int np : {1, 3, 4}) {
        const kt::PanelShape s = kt::PanelShape::of(np * 16, k);
        std::vector<float> w(static_cast<size_t>(np * 16 * k));
        for (auto& v : w) v = nd(rng);
        kt::Buffer<bf16_t> packed(static_cast<size_t>(s.elements()));
        kt::pack_bf16_panels(view2d(w.data(), np * 16, k), 0, 1, s, packed.data());
        // Rows three times over: contiguous, gathered in reverse order, and
        // equally spaced wider than K (K chunks of longer rows; read in place).
        std::vector<bf16_t> a(static_cast<size_t>(m * s.kp));
        std::vector<float> row(static_cast<size_t>(k));
        for (int i = 0; i < m; ++i) {
          for (auto& v : row) v = nd(rng);
          base->pack_a_f32(row.data(), k, s.kp, &a[static_cast<size_t>(i * s.kp)]);
        }
        for (const char* layout : {"contiguous", "gathered", "spaced"}) {
          const std::string how = layout;
          std::vector<const void*> rows(static_cast<size_t>(m));
          const int64_t lda = s.kp + 40;
          std::vector<bf16_t> moved(static_cast<size_t>(m * lda), kt::f32_to_bf16(1e30f));
          for (int i = 0; i < m; ++i) {
            const bf16_t* src = &a[static_cast<size_t>(i * s.kp)];
            if (how == "gathered") {
              std::copy_n(src, s.kp, &moved[static_cast<size_t>((m - 1 - i) * s.kp)]);
              rows[static_cast<size_t>(i)] = &moved[static_cast<size_t>((m - 1 - i) * s.kp)];
            } else if (how == "spaced") {
              std::copy_n(src, s.kp, &moved[static_cast<size_t>(i * lda)]);
              rows[static_cast<size_t>(i)] = &moved[static_cast<size_t>(i * lda)];
            } else {
              rows[static_cast<size_t>(i)] = src;
            }
          }
          const int64_t ldc = np * 16 + 8;
          for (bool acc : {false, true}) {
            std::vector<float> cd(static_cast<size_t>(m * ldc), 0.5f), cb = cd;
            d->gemm_bf16w(rows.data(), m, s.kp, packed.data(), s.panel_stride(), np, cd.data(), ldc, acc, {});
            base->gemm_bf16w(rows.data(), m, s.kp, packed.data(), s.panel_stride(), np, cb.data(), ldc, acc, {});
            for (size_t i = 0; i < cd.size(); ++i)
              ASSERT_NEAR(cd[i], cb[i],
                          1e-5f * (1.f + std::fabs(cb[i])) * std::sqrt(static_cast<float>(k)))
                  << "k=" << k << " m=" << m << " np=" << np << " " << how << " acc=" << acc
                  << " at " << i;
          }
        }
      }
}

// oneDNN 2.6 answers some shapes with its reference matmul (a plain loop,
// far slower than kt's kernel): strided A rows (the K chunks of a quantized
// base, 256 values of rows 2048 apart) and some single-row calls (1 x 768 x
// 64). The backend must never run it: it gathers the rows or leaves the call
// to kt's kernel, and the profile names whichever computed it.
TEST(OneDnnBackend, NeverRunsOneDnnsReferenceLoop) {
  const kt::Kernels* base = kt::kernels_for(KT_ISA_AVX512BF16);
  if (!base || kt::detect_cpu_isa() < KT_ISA_AVX512BF16)
    GTEST_SKIP() << "no avx512bf16 kernels on this CPU/build";
  if (!kt::onednn_compiled()) GTEST_SKIP() << "built without oneDNN";
  const kt::Kernels& d = *kt::onednn_kernels(*base);
  const int onednn = kt::kernel_id(kt::KernelTable::kOneDnn, kt::KernelEntry::kGemmBf16w);
  const int own = kt::kernel_id(kt::KernelTable::kAvx512Bf16, kt::KernelEntry::kGemmBf16w);
  std::mt19937 rng(8);
  std::normal_distribution<float> nd;
  struct Case {
    int m;
    int64_t k, lda;
    int np;
  };
  // The K chunk of an int8 base at T=512 (29 rows of a 2048-wide x), whole
  // rows, a decode row, single panels.
  for (const Case& t : {Case{29, 256, 2048, 4}, Case{32, 2048, 2048, 4}, Case{1, 768, 768, 4},
                        Case{5, 256, 2048, 1}, Case{1, 64, 64, 1}, Case{17, 768, 800, 3}}) {
    const std::string what = "m=" + std::to_string(t.m) + " k=" + std::to_string(t.k) +
                             " lda=" + std::to_string(t.lda) + " np=" + std::to_string(t.np);
    const kt::PanelShape s = kt::PanelShape::of(t.np * 16, t.k);
    std::vector<float> w(static_cast<size_t>(t.np * 16 * t.k));
    for (auto& v : w) v = nd(rng);
    kt::Buffer<bf16_t> packed(static_cast<size_t>(s.elements()));
    kt::pack_bf16_panels(view2d(w.data(), t.np * 16, t.k), 0, 1, s, packed.data());
    std::vector<bf16_t> x(static_cast<size_t>(t.m * t.lda));
    for (auto& v : x) v = kt::f32_to_bf16(nd(rng));
    std::vector<const void*> rows(static_cast<size_t>(t.m));
    for (int i = 0; i < t.m; ++i) rows[static_cast<size_t>(i)] = &x[static_cast<size_t>(i * t.lda)];
    const int64_t ldc = t.np * 16;
    const std::string impl = kt::onednn_gemm_impl(rows.data(), t.m, s.kp, t.np, ldc, false);
    EXPECT_NE(impl.compare(0, 3, "ref"), 0) << what << ": " << impl;
    if (t.m == 29) {
      EXPECT_NE(impl, "") << what << ": the K chunks of a quantized base run on oneDNN";
    }
    std::vector<float> cd(static_cast<size_t>(t.m * ldc)), cb = cd;
    kt::KernelTally tally;
    {
      const kt::KernelTallyScope counting(&tally);
      d.gemm_bf16w(rows.data(), t.m, s.kp, packed.data(), s.panel_stride(), t.np, cd.data(), ldc,
                   false, {});
    }
    EXPECT_EQ(tally.calls[onednn].load(), impl.empty() ? 0 : 1) << what << ": " << impl;
    EXPECT_EQ(tally.calls[own].load(), impl.empty() ? 1 : 0) << what << ": " << impl;
    base->gemm_bf16w(rows.data(), t.m, s.kp, packed.data(), s.panel_stride(), t.np, cb.data(), ldc,
                     false, {});
    for (size_t i = 0; i < cd.size(); ++i)
      ASSERT_NEAR(cd[i], cb[i],
                  1e-5f * (1.f + std::fabs(cb[i])) * std::sqrt(static_cast<float>(t.k)))
          << what << " at " << i;
  }
}

TEST_P(GemmKernels, Fp32GemmsMatchPlainLoops) {
  const kt::Kernels& K = *GetParam();
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (int m : {1, 5, 16, 19})
    for (int n : {1, 7, 33, 64, 70, 130})
      for (int k : {0, 1, 5, 17, 40, 100}) {
        std::vector<float> a(static_cast<size_t>(m * k + 1)), at(static_cast<size_t>(k * m + 1)),
            b(static_cast<size_t>(k * n + 1)), bt(static_cast<size_t>(n * k + 1));
        for (auto& v : a) v = nd(rng);
        for (auto& v : b) v = nd(rng);
        for (int i = 0; i < m; ++i)
          for (int p = 0; p < k; ++p) at[static_cast<size_t>(p * m + i)] = a[static_cast<size_t>(i * k + p)];
        for (int p = 0; p < k; ++p)
          for (int j = 0; j < n; ++j) bt[static_cast<size_t>(j * k + p)] = b[static_cast<size_t>(p * n + j)];
        std::vector<const float*> arows(static_cast<size_t>(m)), brows(static_cast<size_t>(k));
        for (int i = 0; i < m; ++i) arows[static_cast<size_t>(i)] = &a[static_cast<size_t>(i * k)];
        for (int p = 0; p < k; ++p) brows[static_cast<size_t>(p)] = &b[static_cast<size_t>(p * n)];
        std::vector<double> want(static_cast<size_t>(m * n), 0.0);
        for (int i = 0; i < m; ++i)
          for (int j = 0; j < n; ++j)
            for (int p = 0; p < k; ++p)
              want[static_cast<size_t>(i * n + j)] += static_cast<double>(a[static_cast<size_t>(i * k + p)]) * b[static_cast<size_t>(p * n + j)];
        for (bool acc : {false, true}) {
          std::vector<float> c1(static_cast<size_t>(m * n), 1.f), c2 = c1, c3 = c1;
          K.sgemm_nn(m, n, k, arows.data(), b.data(), n, c1.data(), n, acc);
          K.sgemm_nt(m, n, k, arows.data(), bt.data(), k, c2.data(), n, acc);
          K.sgemm_tn(m, n, k, at.data(), m, brows.data(), c3.data(), n, acc);
          for (size_t i = 0; i < want.size(); ++i) {
            const double w = want[i] + (acc ? 1.0 : 0.0);
            const double tol = 1e-4 * (1.0 + std::fabs(w));
            ASSERT_NEAR(c1[i], w, tol) << "sgemm_nn m=" << m << " n=" << n << " k=" << k << " acc=" << acc;
            ASSERT_NEAR(c2[i], w, tol) << "sgemm_nt m=" << m << " n=" << n << " k=" << k << " acc=" << acc;
            ASSERT_NEAR(c3[i], w, tol) << "sgemm_tn m=" << m << " n=" << n << " k=" << k << " acc=" << acc;
          }
        }
      }
}

TEST_P(GemmKernels, PackAFormatRoundsToNearestEven) {
  const kt::Kernels& K = *GetParam();
  std::vector<float> src = {1.f, -2.5f, 1.00390625f /* tie: rounds to even */, 3.14159f, 1e-40f, -0.f, 65504.f,
                            1.0078125f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f, 16.f, 17.f};
  const int64_t k = static_cast<int64_t>(src.size()), kp = k + 1;
  std::vector<char> out(static_cast<size_t>(kp * K.a_elem_size), 1);
  K.pack_a_f32(src.data(), k, kp, out.data());
  for (int64_t i = 0; i < kp; ++i) {
    float got;
    if (K.a_elem_size == 2) got = kt::bf16_to_f32(reinterpret_cast<const bf16_t*>(out.data())[i]);
    else got = reinterpret_cast<const float*>(out.data())[i];
    const float want = i < k ? (K.a_elem_size == 2 ? kt::bf16_to_f32(kt::f32_to_bf16(src[static_cast<size_t>(i)])) : src[static_cast<size_t>(i)]) : 0.f;
    EXPECT_EQ(got, want) << K.gemm_name << " element " << i;
  }
}

// ---- quantized panels (formats/packed_quant.h)

// Element (lane, k) of a bf16 panel of kc columns, as float.
float panel_value(const std::vector<bf16_t>& d, int64_t kc, int p, int lane, int64_t k) {
  return kt::bf16_to_f32(d[static_cast<size_t>(p * 16 * kc + (k / 2) * 32 + lane * 2 + (k & 1))]);
}

// Hand-placed code bytes and the values they stand for: the nibble order
// (low nibble: pair group 2h, high nibble: pair group 2h + 1) and u - 8.
TEST_P(GemmKernels, Int4CodesDequantizeAsDocumented) {
  const kt::Kernels& K = *GetParam();
  const kt::QuantShape s = kt::QuantShape::of(KT_FORMAT_INT4_G32, 16, 32);
  std::vector<uint8_t> codes(static_cast<size_t>(s.code_panel_bytes), 0x88);  // all zero
  codes[0] = 0x9f;   // (lane 0, k 0) = 15 - 8 = 7; (lane 0, k 2) = 9 - 8 = 1
  codes[1] = 0x08;   // (lane 0, k 1) = 0; (lane 0, k 3) = -8
  codes[2] = 0x70;   // (lane 1, k 0) = -8; (lane 1, k 2) = -1
  codes[31] = 0xa3;  // (lane 15, k 1) = -5; (lane 15, k 3) = 2
  codes[32 * 7 + 5] = 0xc4;  // pair groups 14, 15; j 5 = lane 2, t 1: (2, 29) = -4, (2, 31) = 4
  std::vector<bf16_t> d(static_cast<size_t>(16 * 32));
  K.dequant_i4(codes.data(), s.code_panel_bytes, 1, 0, 32, nullptr, 0, 0, d.data());
  const struct { int lane; int64_t k; float v; } want[] = {
      {0, 0, 7}, {0, 2, 1}, {0, 1, 0}, {0, 3, -8}, {1, 0, -8}, {1, 2, -1}, {15, 1, -5}, {15, 3, 2},
      {2, 29, -4}, {2, 31, 4}, {3, 0, 0}, {2, 28, 0}};
  for (const auto& w : want) EXPECT_EQ(panel_value(d, 32, 0, w.lane, w.k), w.v) << K.gemm_name << " lane " << w.lane << " k " << w.k;
  // Scaled: each value times its lane's scale of the group, rounded to bf16.
  std::vector<float> scales(16, 0.5f);
  scales[15] = 0.1f;
  K.dequant_i4(codes.data(), s.code_panel_bytes, 1, 0, 32, scales.data(), 16, 32, d.data());
  EXPECT_EQ(panel_value(d, 32, 0, 0, 0), 3.5f);
  EXPECT_EQ(panel_value(d, 32, 0, 1, 0), -4.f);
  EXPECT_EQ(panel_value(d, 32, 0, 15, 1), kt::bf16_to_f32(kt::f32_to_bf16(-0.5f)));
  EXPECT_EQ(panel_value(d, 32, 0, 15, 3), kt::bf16_to_f32(kt::f32_to_bf16(0.2f)));
}

// Sets denormals-are-zero and flush-to-zero in MXCSR while it lives (when
// asked), as some hosts run.
class MxcsrGuard {
 public:
  explicit MxcsrGuard(bool daz_ftz) : saved_(_mm_getcsr()) {
    if (daz_ftz) _mm_setcsr(saved_ | 0x8040u);
  }
  ~MxcsrGuard() { _mm_setcsr(saved_); }
  MxcsrGuard(const MxcsrGuard&) = delete;
  MxcsrGuard& operator=(const MxcsrGuard&) = delete;

 private:
  unsigned saved_;
};

// Every e4m3 code but the two NaNs (normal, subnormal, zero, both signs,
// the largest finite 448) against the scalar decoding, through dequant_e4m3
// and, where the unit has it, gemm_quant on a one-hot row.
TEST_P(GemmKernels, E4m3EveryCodeDequantizesExactly) {
  const kt::Kernels& K = *GetParam();
  const kt::QuantShape s = kt::QuantShape::of(KT_FORMAT_FP8_B128, 16, 128);
  std::vector<uint8_t> ex(static_cast<size_t>(s.expert_bytes), 0);
  std::vector<uint8_t> code(16 * 128);
  for (int i = 0; i < 16 * 128; ++i) {
    const uint8_t b = static_cast<uint8_t>(i % 256);
    code[static_cast<size_t>(i)] = (b & 0x7f) == 0x7f ? 0 : b;  // lane i / 128, column i % 128
  }
  for (int lane = 0; lane < 16; ++lane)
    for (int c = 0; c < 128; ++c) ex[static_cast<size_t>((c / 2) * 32 + lane * 2 + (c & 1))] = code[static_cast<size_t>(lane * 128 + c)];
  const float one = 1.f;
  for (int i = 0; i < 16; ++i) std::memcpy(ex.data() + s.scales_offset + i * 4, &one, 4);
  std::vector<bf16_t> d(16 * 128);
  K.dequant_e4m3(ex.data(), s.code_panel_bytes, 1, 0, 128, nullptr, 0, 0, d.data());
  for (int lane = 0; lane < 16; ++lane)
    for (int c = 0; c < 128; ++c)
      ASSERT_EQ(panel_value(d, 128, 0, lane, c), kt::e4m3_to_f32(code[static_cast<size_t>(lane * 128 + c)]))
          << K.gemm_name << " code 0x" << std::hex << int(code[static_cast<size_t>(lane * 128 + c)]);
  // With scales: each value times its lane's scale of its group (64
  // columns), rounded to bf16 once.
  std::vector<float> sc(2 * 16);
  for (int j = 0; j < 2; ++j)
    for (int lane = 0; lane < 16; ++lane) sc[static_cast<size_t>(j * 16 + lane)] = 0.75f + 0.5f * j + lane / 64.f;
  K.dequant_e4m3(ex.data(), s.code_panel_bytes, 1, 0, 128, sc.data(), 32, 64, d.data());
  for (int lane = 0; lane < 16; ++lane)
    for (int c = 0; c < 128; ++c) {
      const float v = kt::e4m3_to_f32(code[static_cast<size_t>(lane * 128 + c)]) *
                      sc[static_cast<size_t>((c / 64) * 16 + lane)];
      ASSERT_EQ(panel_value(d, 128, 0, lane, c), kt::bf16_to_f32(kt::f32_to_bf16(v))) << K.gemm_name << " " << c;
    }
  if (!K.gemm_quant) return;
  std::vector<float> a(128, 0.f);
  std::vector<char> ak(static_cast<size_t>(128 * K.a_elem_size));
  // Also with denormals as zero and flushed to zero (a host may run so):
  // the subnormal codes still come out exact.
  for (bool daz : {false, true}) {
    const MxcsrGuard guard(daz);
    for (int c = 0; c < 128; ++c) {
      std::fill(a.begin(), a.end(), 0.f);
      a[static_cast<size_t>(c)] = 1.f;
      K.pack_a_f32(a.data(), 128, 128, ak.data());
      const void* row = ak.data();
      std::vector<float> out(16, 0.f);
      K.gemm_quant(s.panels(ex.data(), 0), &row, 1, 1, out.data(), 16, false, kt::PrefetchRegion{});
      for (int lane = 0; lane < 16; ++lane)
        ASSERT_EQ(out[static_cast<size_t>(lane)],
                  kt::e4m3_to_f32(code[static_cast<size_t>(lane * 128 + c)]))
            << K.gemm_name << " column " << c << " lane " << lane << (daz ? " under DAZ/FTZ" : "");
    }
  }
}

TEST_P(GemmKernels, Int8CodesDequantizeAsDocumented) {
  const kt::Kernels& K = *GetParam();
  const kt::QuantShape s = kt::QuantShape::of(KT_FORMAT_INT8_CHANNEL, 32, 64);
  std::vector<uint8_t> codes(static_cast<size_t>(2 * s.code_panel_bytes), 0);
  codes[0] = 0x81;   // (lane 0, k 0) = -127
  codes[1] = 0x7f;   // (lane 0, k 1) = 127
  codes[33] = 0xfe;  // pair group 1, j 1: (lane 0, k 3) = -2
  codes[static_cast<size_t>(s.code_panel_bytes) + 32 * 31 + 31] = 0x05;  // panel 1: (lane 15, k 63) = 5
  std::vector<bf16_t> d(static_cast<size_t>(2 * 16 * 64));
  K.dequant_i8(codes.data(), s.code_panel_bytes, 2, 0, 64, nullptr, 0, 0, d.data());
  EXPECT_EQ(panel_value(d, 64, 0, 0, 0), -127.f);
  EXPECT_EQ(panel_value(d, 64, 0, 0, 1), 127.f);
  EXPECT_EQ(panel_value(d, 64, 0, 0, 3), -2.f);
  EXPECT_EQ(panel_value(d, 64, 1, 15, 63), 5.f);
  EXPECT_EQ(panel_value(d, 64, 1, 15, 62), 0.f);
  // From column 32 on: the second half of each panel.
  std::vector<bf16_t> half(static_cast<size_t>(2 * 16 * 32));
  std::vector<float> scales(32, 0.25f);
  K.dequant_i8(codes.data(), s.code_panel_bytes, 2, 32, 32, scales.data(), 16, 64, half.data());
  EXPECT_EQ(panel_value(half, 32, 1, 15, 31), 1.25f);
}

// Quantization at load: a row whose values are multiples of its group's
// scale comes back exactly; other values round to the nearest step; the
// scale is the smallest bf16 >= max|w| / qmax.
TEST(QuantizedPanels, QuantizeAndReadBack) {
  const int64_t n = 17, k = 40;  // partial panel, partial group
  std::vector<float> w(static_cast<size_t>(n * k), 0.f);
  for (int64_t c = 0; c < k; ++c) w[static_cast<size_t>(c)] = 0.5f * static_cast<float>(c % 15 - 7);
  w[39] = 3.5f;  // row 0: each group's max is 3.5, scale 0.5
  w[static_cast<size_t>(16 * k + 33)] = -0.7f;  // row 16, group 1 (columns 32-39): amax 0.7
  w[static_cast<size_t>(16 * k + 34)] = 0.26f;
  const kt::QuantShape s4 = kt::QuantShape::of(KT_FORMAT_INT4_G32, n, k);
  EXPECT_EQ(s4.kq, 64);
  EXPECT_EQ(s4.ngroups, 2);
  std::vector<uint8_t> q4(static_cast<size_t>(s4.expert_bytes));
  kt::quantize_panels(view2d(w.data(), n, k), 0, 1, s4, q4.data());
  for (int64_t c = 0; c < k; ++c) EXPECT_EQ(kt::quant_get(q4.data(), s4, 0, c), w[static_cast<size_t>(c)]) << c;
  const float s = kt::bf16_to_f32(kt::f32_to_bf16(0.1f)) < 0.1f ? kt::bf16_to_f32(kt::f32_to_bf16(0.1f) + 1)
                                                                   : kt::bf16_to_f32(kt::f32_to_bf16(0.1f));
  EXPECT_GE(s, 0.7f / 7.f);
  EXPECT_EQ(kt::quant_get(q4.data(), s4, 16, 33), -7.f * s);
  EXPECT_EQ(kt::quant_get(q4.data(), s4, 16, 34), std::nearbyint(0.26f / s) * s);
  EXPECT_EQ(kt::quant_get(q4.data(), s4, 16, 0), 0.f);
  const kt::QuantShape s8 = kt::QuantShape::of(KT_FORMAT_INT8_CHANNEL, n, k);
  EXPECT_EQ(s8.ngroups, 1);
  std::vector<uint8_t> q8(static_cast<size_t>(s8.expert_bytes));
  kt::quantize_panels(view2d(w.data(), n, k), 0, 1, s8, q8.data());
  // Row 16: amax 0.7, scale the smallest bf16 >= 0.7 / 127.
  const float s16 = kt::quant_get(q8.data(), s8, 16, 33) / -127.f;
  EXPECT_GE(s16, 0.7f / 127.f);
  EXPECT_LT(s16, 0.7f / 127.f * (1.f + 1.f / 128.f));
  EXPECT_EQ(kt::quant_get(q8.data(), s8, 16, 34), std::nearbyint(0.26f / s16) * s16);
}

// gemm_bf16w_grouped against plain loops in double: per group partial sums
// times the group's scale; groups of one K step of 32 and of several, every
// row count up to 13 (each tile height and tail of the vector kernels) and
// 40. A row alone gives the bits it gives among others (AMX: below 16 rows).
TEST_P(GemmKernels, GroupedGemmMatchesPlainLoops) {
  const kt::Kernels& K = *GetParam();
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  for (int m : {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 40})
    for (int np : {1, 3, 4, 5})
      for (int64_t kp : {32, 96, 256, 384})
        for (int64_t group : {int64_t{32}, int64_t{128}, kp}) {
          // 128: several groups of several K steps (kp 256 and 384).
          if (kp % group != 0) continue;
          const kt::PanelShape s = kt::PanelShape::of(np * 16, kp);
          std::vector<float> w(static_cast<size_t>(np * 16 * kp));
          for (auto& v : w) v = static_cast<float>(static_cast<int>(nd(rng) * 3.f));  // small ints, as codes are
          kt::Buffer<bf16_t> packed(static_cast<size_t>(s.elements()));
          kt::pack_bf16_panels(view2d(w.data(), np * 16, kp), 0, 1, s, packed.data());
          const int64_t ng = kp / group;
          std::vector<float> scales(static_cast<size_t>(np * ng * 16));
          for (auto& v : scales) v = std::fabs(nd(rng)) + 0.1f;
          std::vector<float> a(static_cast<size_t>(m * kp));
          for (auto& v : a) v = kt::bf16_to_f32(kt::f32_to_bf16(nd(rng)));
          const PackedRows packed_a = pack_rows(K, a, m, kp);
          const std::vector<const void*>& rows = packed_a.rows;
          const int64_t ldc = np * 16 + 5;
          for (bool acc : {false, true}) {
            std::vector<float> c(static_cast<size_t>(m * ldc), 0.5f);
            K.gemm_bf16w_grouped(rows.data(), m, kp, packed.data(), s.panel_stride(), np, scales.data(), ng * 16,
                                 group, c.data(), ldc, acc, kt::PrefetchRegion{});
            for (int i = 0; i < m; ++i)
              for (int64_t col = 0; col < np * 16; ++col) {
                const int64_t p = col / 16, lane = col % 16;
                double want = acc ? 0.5 : 0.0, mag = 0.0;
                for (int64_t j = 0; j < ng; ++j) {
                  double part = 0;
                  for (int64_t kk = j * group; kk < (j + 1) * group; ++kk)
                    part += static_cast<double>(a[static_cast<size_t>(i * kp + kk)]) * w[static_cast<size_t>(col * kp + kk)];
                  const double sc = scales[static_cast<size_t>((p * ng + j) * 16 + lane)];
                  want += sc * part;
                  mag += sc * std::fabs(part);
                }
                ASSERT_NEAR(c[static_cast<size_t>(i * ldc + col)], want, 1e-5 * (1.0 + mag) * std::sqrt(static_cast<double>(kp)))
                    << K.gemm_name << " m=" << m << " np=" << np << " kp=" << kp << " group=" << group << " acc=" << acc;
              }
            for (int i = 0; i < m; ++i)  // columns past the panels untouched
              for (int64_t col = np * 16; col < ldc; ++col) ASSERT_EQ(c[static_cast<size_t>(i * ldc + col)], 0.5f);
            // The AMX table multiplies rows past its gemm_quant bound on
            // tiles, fewer on AVX-512: a row alone takes the other unit's
            // order there.
            if (acc || m == 1 || (K.isa == KT_ISA_AMX && m > K.gemm_quant_rows_4bit)) continue;
            for (int i = 0; i < m; ++i) {
              std::vector<float> one(static_cast<size_t>(ldc), 0.5f);
              K.gemm_bf16w_grouped(&rows[static_cast<size_t>(i)], 1, kp, packed.data(),
                                   s.panel_stride(), np, scales.data(), ng * 16, group, one.data(),
                                   ldc, false, kt::PrefetchRegion{});
              for (int64_t col = 0; col < np * 16; ++col)
                ASSERT_EQ(one[static_cast<size_t>(col)], c[static_cast<size_t>(i * ldc + col)])
                    << K.gemm_name << " m=" << m << " np=" << np << " kp=" << kp
                    << " group=" << group << " row " << i << " alone";
            }
          }
        }
}

// Asymmetric int4: a nibble u stands for u - zero (the zero byte z + 8 of
// its lane and group), the extremes -15 and 15 included; with scales each
// (u - zero) * scale rounded to bf16 once. Columns [k0, k0 + kc) of a
// two-group panel, zeros and scales relative to k0.
TEST_P(GemmKernels, Int4ZeroPointCodesDequantizeAsDocumented) {
  const kt::Kernels& K = *GetParam();
  const kt::QuantShape s = kt::QuantShape::of(KT_FORMAT_INT4_G32_ZP, 16, 64);
  std::vector<uint8_t> codes(static_cast<size_t>(s.code_panel_bytes), 0x88);
  codes[0] = 0x0f;            // (lane 0, k 0) u = 15; (lane 0, k 2) u = 0
  codes[2] = 0xf0;            // (lane 1, k 0) u = 0; (lane 1, k 2) u = 15
  codes[8 * 32 + 31] = 0x3c;  // group 1: (lane 15, k 33) u = 12; (lane 15, k 35) u = 3
  // zeros[group][lane]: group 0 lane 0 is 0 (z = -8), lane 1 is 15 (z = 7);
  // group 1 lane 15 is 5 (z = -3); the others 8 (z = 0).
  std::vector<uint8_t> zeros(32, 8);
  zeros[0] = 0;
  zeros[1] = 15;
  zeros[16 + 15] = 5;
  std::vector<bf16_t> d(static_cast<size_t>(16 * 64));
  K.dequant_i4_zero(codes.data(), s.code_panel_bytes, 1, 0, 64, zeros.data(), 32, nullptr, 0, 32, d.data());
  const struct { int lane; int64_t k; float v; } want[] = {
      {0, 0, 15}, {0, 2, 0}, {0, 1, 8}, {1, 0, -15}, {1, 2, 0}, {1, 1, -7},
      {15, 33, 7}, {15, 35, -2}, {15, 32, 3}, {14, 33, 0}, {2, 5, 0}};
  for (const auto& w : want)
    EXPECT_EQ(panel_value(d, 64, 0, w.lane, w.k), w.v) << K.gemm_name << " lane " << w.lane << " k " << w.k;
  // The second group alone (k0 = 32): zeros and scales from its own start.
  std::vector<float> scales(16, 0.5f);
  scales[15] = 0.1f;
  std::vector<bf16_t> half(static_cast<size_t>(16 * 32));
  K.dequant_i4_zero(codes.data(), s.code_panel_bytes, 1, 32, 32, zeros.data() + 16, 32, scales.data(), 16, 32,
                    half.data());
  EXPECT_EQ(panel_value(half, 32, 0, 15, 1), kt::bf16_to_f32(kt::f32_to_bf16(7 * 0.1f)));
  EXPECT_EQ(panel_value(half, 32, 0, 15, 3), kt::bf16_to_f32(kt::f32_to_bf16(-2 * 0.1f)));
  EXPECT_EQ(panel_value(half, 32, 0, 0, 0), 0.f);
}

// Every dequant_* of K against the ref table's, bit for bit, on random
// codes (any byte but the e4m3 NaNs; zero bytes 0..15) and random scales
// whose products round, one in `one_in` of them from `extremes` instead:
// column ranges from k0 > 0, several panels and group sizes, and no word
// written past the output.
// flush_ok: a word whose reference is subnormal or the smallest normal (a
// subnormal product, rounded) may also be the zero of its sign.
void expect_dequant_reference_bits(const kt::Kernels& K, const std::vector<float>& extremes,
                                   int one_in, bool flush_ok) {
  const kt::Kernels& R = *kt::kernels_for(KT_ISA_REF);
  enum Kind { kI8, kI4, kE4m3, kE2m1, kI4Zero };
  const char* const kind_name[] = {"dequant_i8", "dequant_i4", "dequant_e4m3", "dequant_e2m1",
                                   "dequant_i4_zero"};
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> byte(0, 255), nibble(0, 15), exponent(-20, 20),
      pick(1, one_in);
  std::uniform_real_distribution<float> mantissa(-2.f, 2.f);
  std::uniform_int_distribution<size_t> extreme(0, extremes.size() - 1);
  constexpr size_t kGuard = 64;  // words past the output that must stay untouched
  constexpr bf16_t kUnwritten = 0x7fc1;
  for (Kind kind : {kI8, kI4, kE4m3, kE2m1, kI4Zero}) {
    const bool nibbles = kind == kI4 || kind == kE2m1 || kind == kI4Zero;
    for (int64_t kc : {32, 64, 96, 128, 160, 256})
      for (int64_t k0 : {0, 32, 96})
        for (int np : {1, 2, 3})
          for (int64_t group : {32, 64, 128})
            for (bool scaled : {false, true}) {
              if (!scaled && kind != kI4Zero && group != 32)
                continue;  // the group only picks scales
              const int64_t columns = k0 + kc, code_panel_bytes = columns * (nibbles ? 8 : 16) + 32;
              const int64_t groups = (kc + group - 1) / group, scale_stride = groups * 16 + 16;
              std::vector<uint8_t> codes(static_cast<size_t>(np * code_panel_bytes));
              for (auto& b : codes) {
                b = static_cast<uint8_t>(byte(rng));
                if (kind == kE4m3 && (b & 0x7f) == 0x7f) b = static_cast<uint8_t>(b ^ 1);
              }
              std::vector<uint8_t> zeros(static_cast<size_t>(np * scale_stride));
              for (auto& z : zeros) z = static_cast<uint8_t>(nibble(rng));
              std::vector<float> scales(static_cast<size_t>(np * scale_stride));
              for (auto& s : scales)
                s = pick(rng) == 1 ? extremes[extreme(rng)]
                                   : std::ldexp(mantissa(rng), exponent(rng));
              const float* sp = scaled ? scales.data() : nullptr;
              const size_t words = static_cast<size_t>(np * 16 * kc);
              std::vector<bf16_t> got(words + kGuard, kUnwritten), want(words + kGuard, kUnwritten);
              for (int t = 0; t < 2; ++t) {  // K may be R itself
                const kt::Kernels* T = t ? &R : &K;
                bf16_t* out = t ? want.data() : got.data();
                const uint8_t* c = codes.data();
                if (kind == kI4Zero) {
                  T->dequant_i4_zero(c, code_panel_bytes, np, k0, kc, zeros.data(), scale_stride,
                                     sp, scale_stride, group, out);
                } else {
                  const auto dequant = kind == kI8     ? &kt::Kernels::dequant_i8
                                       : kind == kI4   ? &kt::Kernels::dequant_i4
                                       : kind == kE4m3 ? &kt::Kernels::dequant_e4m3
                                                       : &kt::Kernels::dequant_e2m1;
                  (T->*dequant)(c, code_panel_bytes, np, k0, kc, sp, scale_stride, group, out);
                }
              }
              for (size_t i = 0; i < words + kGuard; ++i) {
                if (flush_ok && i < words && (want[i] & 0x7fff) <= 0x0080 &&
                    got[i] == (want[i] & 0x8000))
                  continue;
                const int64_t p = static_cast<int64_t>(i) / (16 * kc),
                              w = static_cast<int64_t>(i) % (16 * kc);
                ASSERT_EQ(got[i], want[i])
                    << K.gemm_name << " " << kind_name[kind] << (scaled ? " scaled" : " unscaled")
                    << " kc " << kc << " k0 " << k0 << " np " << np << " group " << group
                    << ": panel " << p << " lane " << (w % 32) / 2 << " k "
                    << (w / 32) * 2 + (w & 1) << (i >= words ? " (past the output)" : "")
                    << std::hex << " got 0x" << got[i] << " want 0x" << want[i];
              }
            }
  }
}

// Products in the normal range, or past the largest finite fp32 (to inf or
// the bf16 max), and signed zeros. The smallest nonzero code value is 2^-9
// (e4m3), so scales from 1e-30 keep every product normal.
TEST_P(GemmKernels, DequantMatchesReferenceBits) {
  expect_dequant_reference_bits(
      *GetParam(), {3.4e38f, -3.3e38f, 1.7e38f, 4e37f, -1e36f, 0.f, -0.f, 6.1e-5f, -1e-30f}, 8,
      false);
}

// Subnormal products (and scales): the reference keeps them, rounded to
// nearest even as any other; a unit may give the zero of their sign instead
// (kernels.h: the AVX-512 BF16 conversion flushes them), nothing else.
TEST_P(GemmKernels, DequantSubnormalProductsMatchReference) {
  expect_dequant_reference_bits(*GetParam(),
                                {1.1754944e-38f, -1.2e-38f, 1e-39f, -3e-41f, 1e-44f, 1.4e-45f,
                                 2e-37f, -5e-38f, 1e-36f, -4e-36f},
                                2, true);
}

// Powers of two (e8m0 scales): all in the range where every e2m1 product is
// a normal number (a unit may then add exponents instead of multiplying),
// up to its edges; then mixed with powers past them, negative ones and
// others, in the same groups. Subnormal products of the other kinds (e4m3
// at 2^-125) may come out as zeros of their sign, as in the test above.
TEST_P(GemmKernels, DequantPowerOfTwoScalesMatchReferenceBits) {
  std::vector<float> in_range;
  for (int e : {-125, -124, -60, -3, -1, 0, 1, 2, 7, 100, 124, 125})
    in_range.push_back(std::ldexp(1.f, e));
  expect_dequant_reference_bits(*GetParam(), in_range, 1, true);
  std::vector<float> mixed = in_range;
  for (float v :
       {std::ldexp(1.f, -126), std::ldexp(1.f, 126), std::ldexp(1.f, 127), -2.f, 3.f, 0.f})
    mixed.push_back(v);
  expect_dequant_reference_bits(*GetParam(), mixed, 1, true);
}

// The most rows gemm_quant takes in its few-row tiles (the AVX-512 BF16
// kernel's kFewRowsMax): up to them a row gives the bits it gives alone.
int quant_few_rows_max(const kt::QuantShape& s) {
  return s.bits == 4 && !s.zero_points ? 2 : 3;
}

// gemm_quant, straight from the codes, against plain loops in double over
// the values quant_get reads: every code kind and scale type, one scale per
// row and groups, row and panel tails. Tables without it skip visibly.
TEST_P(GemmKernels, QuantGemmMatchesPlainLoops) {
  const kt::Kernels& K = *GetParam();
  if (!K.gemm_quant) GTEST_SKIP() << K.gemm_name << " has no gemm_quant (dequant_* and gemm_bf16w_grouped serve)";
  std::mt19937 rng(23);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> byte(0, 255);
  for (kt_weight_format f : {KT_FORMAT_INT8_CHANNEL, KT_FORMAT_INT4_G32, KT_FORMAT_INT4_G128, KT_FORMAT_FP8_B128,
                             KT_FORMAT_MXFP4, KT_FORMAT_INT4_G32_ZP, KT_FORMAT_INT4_G128_ZP})
    for (int64_t k : {128, 256})
      for (int np : {1, 2, 3, 4, 5, 7, 8, 13})
        for (int m : {1, 2, 3, 4, 5, 6, 7, 13, 23, 29}) {
          const kt::QuantShape s = kt::QuantShape::of(f, np * 16, k);
          ASSERT_EQ(s.kq, k);
          std::vector<uint8_t> ex(static_cast<size_t>(s.expert_bytes));
          for (int64_t i = 0; i < s.scales_offset; ++i) {
            uint8_t b = static_cast<uint8_t>(byte(rng));
            if (s.code == kt::QuantCode::kE4M3 && (b & 0x7f) == 0x7f) b = 0;  // e4m3 NaN: loads refuse it
            ex[static_cast<size_t>(i)] = b;
          }
          for (int64_t i = 0; i < np * s.scale_panel; ++i) {
            // Powers of two for e8m0, any positive value otherwise.
            const float v = s.code == kt::QuantCode::kE2M1 ? std::ldexp(1.f, static_cast<int>(nd(rng) * 3.f))
                                                            : std::fabs(nd(rng)) * 0.05f + 0.001f;
            uint8_t* to = ex.data() + s.scales_offset + i * s.scale_bytes;
            if (s.scale_bytes == 4) {
              std::memcpy(to, &v, 4);
            } else {
              const bf16_t b = kt::f32_to_bf16(v);
              std::memcpy(to, &b, 2);
            }
          }
          if (s.zero_points)  // any stored zero point z + 8
            for (int64_t i = 0; i < np * s.scale_panel; ++i)
              ex[static_cast<size_t>(s.zeros_offset + i)] = static_cast<uint8_t>(byte(rng) & 15);
          std::vector<float> a(static_cast<size_t>(m * k));
          for (auto& v : a) v = kt::bf16_to_f32(kt::f32_to_bf16(nd(rng)));
          const PackedRows packed_a = pack_rows(K, a, m, k);
          const std::vector<const void*>& rows = packed_a.rows;
          const int64_t ldc = np * 16 + 3;
          for (bool acc : {false, true}) {
            std::vector<float> c(static_cast<size_t>(m * ldc), 0.5f);
            // The next region: the same panels, with their scales and zero
            // points, as the layer gives a block (fetching has no effect on
            // the results).
            K.gemm_quant(s.panels(ex.data(), 0), rows.data(), m, np, c.data(), ldc, acc,
                         kt::quant_panel_block(ex.data(), s, 0, np * 16));
            for (int i = 0; i < m; ++i)
              for (int64_t col = 0; col < np * 16; ++col) {
                double want = acc ? 0.5 : 0.0, mag = 0.0;
                for (int64_t kk = 0; kk < k; ++kk) {
                  const double t = static_cast<double>(a[static_cast<size_t>(i * k + kk)]) *
                                   kt::quant_get(ex.data(), s, col, kk);
                  want += t;
                  mag += std::fabs(t);
                }
                ASSERT_NEAR(c[static_cast<size_t>(i * ldc + col)], want, 1e-5 * (1.0 + mag))
                    << K.gemm_name << " " << kt_weight_format_name(f) << " k=" << k << " np=" << np << " m=" << m
                    << " acc=" << acc << " col=" << col;
              }
            for (int i = 0; i < m; ++i)  // columns past the panels untouched
              for (int64_t col = np * 16; col < ldc; ++col) ASSERT_EQ(c[static_cast<size_t>(i * ldc + col)], 0.5f);
          }
          // Up to the few-row tiles' rows, a row alone gives the bits it
          // gives among others; past them, rows give the same bits under
          // other tile heights (3 more rows; 23 and 26 rows lie either side
          // of the AVX-512 BF16 kernel's 4 x 4 tiles of 4-bit codes, 7 and
          // 10 in one 12-row tile, 13 and 16 in two); and panels from p0 on (the
          // operand of panels(expert, p0)) the bits they give among all:
          // within each of the two row regimes, the summation order depends
          // on no split.
          std::vector<float> all(static_cast<size_t>(m * ldc), 0.f);
          K.gemm_quant(s.panels(ex.data(), 0), rows.data(), m, np, all.data(), ldc, false, kt::PrefetchRegion{});
          if (m <= quant_few_rows_max(s)) {
            for (int i = 0; i < m; ++i) {
              std::vector<float> one(static_cast<size_t>(ldc), 0.f);
              K.gemm_quant(s.panels(ex.data(), 0), &rows[static_cast<size_t>(i)], 1, np, one.data(), ldc, false,
                           kt::PrefetchRegion{});
              for (int64_t col = 0; col < np * 16; ++col)
                ASSERT_EQ(one[static_cast<size_t>(col)], all[static_cast<size_t>(i * ldc + col)]);
            }
          } else {
            std::vector<const void*> more(rows);
            for (int i = 0; i < 3; ++i) more.push_back(rows[0]);
            std::vector<float> wider(static_cast<size_t>((m + 3) * ldc), 0.f);
            K.gemm_quant(s.panels(ex.data(), 0), more.data(), m + 3, np, wider.data(), ldc, false, kt::PrefetchRegion{});
            for (int i = 0; i < m; ++i)
              for (int64_t col = 0; col < np * 16; ++col)
                ASSERT_EQ(wider[static_cast<size_t>(i * ldc + col)], all[static_cast<size_t>(i * ldc + col)]);
          }
          if (np > 1) {
            std::vector<float> tail(static_cast<size_t>(m * ldc), 0.f);
            K.gemm_quant(s.panels(ex.data(), 1), rows.data(), m, np - 1, tail.data(), ldc, false, kt::PrefetchRegion{});
            for (int i = 0; i < m; ++i)
              for (int64_t col = 16; col < np * 16; ++col)
                ASSERT_EQ(tail[static_cast<size_t>(i * ldc + col - 16)], all[static_cast<size_t>(i * ldc + col)]);
          }
        }
}

// A table that keeps 4-bit codes at prefill rows (gemm_quant_rows_4bit of
// 16 or more) may take the dequantized path there instead where that runs
// faster on the CPU (WeightOperand measures it once): past the few-row
// tiles, gemm_quant on int4 codes gives the bits of the panels decoded in
// cache (chunks of 256 K, as the layer's) times the grouped GEMM, so the
// choice changes the time only.
TEST_P(GemmKernels, Int4CodesPastFewRowsMatchDequantizedBits) {
  const kt::Kernels& K = *GetParam();
  if (!K.gemm_quant || K.gemm_quant_rows_4bit < 16)
    GTEST_SKIP() << K.gemm_name << " dequantizes 4-bit codes from " << K.gemm_quant_rows_4bit + 1 << " rows anyway";
  std::mt19937 rng(31);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> byte(0, 255);
  const int np = 5;
  const int64_t k = 768, chunk = 256;
  for (kt_weight_format f : {KT_FORMAT_INT4_G32, KT_FORMAT_INT4_G128, KT_FORMAT_INT4_G32_ZP})
    for (int m : {16, 23, 32}) {
      const kt::QuantShape s = kt::QuantShape::of(f, np * 16, k);
      std::vector<uint8_t> ex(static_cast<size_t>(s.expert_bytes));
      for (auto& b : ex) b = static_cast<uint8_t>(byte(rng));
      for (int64_t i = 0; i < np * s.scale_panel; ++i) {
        const bf16_t v = kt::f32_to_bf16(std::fabs(nd(rng)) * 0.05f + 0.001f);
        std::memcpy(ex.data() + s.scales_offset + i * s.scale_bytes, &v, 2);
      }
      if (s.zero_points)
        for (int64_t i = 0; i < np * s.scale_panel; ++i) ex[static_cast<size_t>(s.zeros_offset + i)] &= 15;
      std::vector<float> a(static_cast<size_t>(m * k));
      for (auto& v : a) v = nd(rng);
      const PackedRows packed = pack_rows(K, a, m, k);
      const int64_t ldc = np * 16;
      std::vector<float> codes(static_cast<size_t>(m * ldc)), cached(codes.size());
      K.gemm_quant(s.panels(ex.data(), 0), packed.rows.data(), m, np, codes.data(), ldc, false, kt::PrefetchRegion{});
      kt::Buffer<bf16_t> deq(static_cast<size_t>(np * 16 * chunk));
      std::vector<float> scales(static_cast<size_t>(np * (chunk / s.group) * 16));
      std::vector<const void*> rows(static_cast<size_t>(m));
      for (int64_t k0 = 0; k0 < k; k0 += chunk) {
        for (int r = 0; r < m; ++r)
          rows[static_cast<size_t>(r)] = static_cast<const char*>(packed.rows[static_cast<size_t>(r)]) + k0 * K.a_elem_size;
        const int64_t stride = chunk / s.group * 16;
        kt::quant_scales_f32(ex.data(), s, 0, np, k0 / s.group, chunk / s.group, scales.data());
        if (s.zero_points) {
          K.dequant_i4_zero(ex.data(), s.code_panel_bytes, np, k0, chunk, ex.data() + s.zeros_offset + k0 / s.group * 16,
                            s.scale_panel, nullptr, 0, s.group, deq.data());
        } else {
          K.dequant_i4(ex.data(), s.code_panel_bytes, np, k0, chunk, nullptr, 0, 0, deq.data());
        }
        K.gemm_bf16w_grouped(rows.data(), m, chunk, deq.data(), 16 * chunk, np, scales.data(), stride, s.group,
                             cached.data(), ldc, k0 > 0, kt::PrefetchRegion{});
      }
      for (size_t i = 0; i < codes.size(); ++i)
        ASSERT_EQ(codes[i], cached[i]) << K.gemm_name << " " << kt_weight_format_name(f) << " m=" << m << " at " << i;
    }
}

// Int8 A rows (KT_COMPUTE_INT8): known answers of the quantizer.
TEST(Int8Rows, QuantizeKnownAnswers) {
  // max |x| = 127: the codes are x rounded to nearest, ties to even.
  const std::vector<float> x = {2.5f, 3.5f, -0.5f, 127.f, -126.6f, 0.49f, -1.5f, 7.f, 1.f};
  const int64_t kq = 32, group = 32;
  for (bool nibble_order : {false, true}) {
    std::vector<uint8_t> row(static_cast<size_t>(kt::int8_row_bytes(kq, group)), 0xee);
    kt::quantize_int8_row(x.data(), static_cast<int64_t>(x.size()), kq, group, nibble_order, row.data());
    const int8_t want[9] = {2, 4, 0, 127, -127, 0, -2, 7, 1};
    // Logical k at stored position (k, k+2, k+1, k+3 per quad) for 4-bit weights.
    const int at[9] = {0, 2, 1, 3, 4, 6, 5, 7, 8};
    for (int k = 0; k < 9; ++k)
      EXPECT_EQ(static_cast<int8_t>(row[static_cast<size_t>(nibble_order ? at[k] : k)]), want[k]) << "k=" << k;
    for (int64_t k = 9; k < kq; ++k) EXPECT_EQ(row[static_cast<size_t>(k)], 0) << "padding k=" << k;
    int32_t sum;
    std::memcpy(&sum, row.data() + kq, 4);
    EXPECT_EQ(sum, 2 + 4 + 0 + 127 - 127 + 0 - 2 + 7 + 1);
    float s;
    std::memcpy(&s, row.data() + kq + 4, 4);
    EXPECT_EQ(s, 1.f);
  }
  // Scale max / 127; sums per group; a row of zeros has scale 0; a NaN or
  // an infinity makes the scale NaN.
  std::vector<float> y(64, 0.f);
  y[0] = 0.5f;
  y[40] = -1.f;
  std::vector<uint8_t> row(static_cast<size_t>(kt::int8_row_bytes(64, 32)));
  kt::quantize_int8_row(y.data(), 64, 64, 32, false, row.data());
  EXPECT_EQ(static_cast<int8_t>(row[0]), 64);  // 0.5 * 127 = 63.5 -> 64 (even)
  EXPECT_EQ(static_cast<int8_t>(row[40]), -127);
  int32_t sums[2];
  std::memcpy(sums, row.data() + 64, 8);
  EXPECT_EQ(sums[0], 64);
  EXPECT_EQ(sums[1], -127);
  float s;
  std::memcpy(&s, row.data() + 64 + 8, 4);
  EXPECT_EQ(s, 1.f / 127.f);
  std::fill(y.begin(), y.end(), 0.f);
  kt::quantize_int8_row(y.data(), 64, 64, 32, false, row.data());
  std::memcpy(&s, row.data() + 64 + 8, 4);
  EXPECT_EQ(s, 0.f);
  for (float bad : {NAN, INFINITY}) {
    y[3] = bad;
    kt::quantize_int8_row(y.data(), 64, 64, 32, false, row.data());
    std::memcpy(&s, row.data() + 64 + 8, 4);
    EXPECT_TRUE(std::isnan(s));
  }
  EXPECT_EQ(kt::int8_row_bytes(2048, 32) % 64, 0);
  EXPECT_GE(kt::int8_row_bytes(2048, 32), 2048 + 4 * 64 + 4);
}

// gemm_int8 on int8 A rows: bit for bit the reference table's (the same
// integer sums and fp32 operations), and against double loops over the
// values quant_get reads (an independent reading of the codes); row and
// panel tails, accumulate, columns past the panels untouched.
TEST_P(GemmKernels, Int8GemmMatchesReferenceBits) {
  const kt::Kernels& K = *GetParam();
  const kt::Kernels& R = *kt::kernels_for(KT_ISA_REF);
  std::mt19937 rng(29);
  for (kt_weight_format f : {KT_FORMAT_INT8_CHANNEL, KT_FORMAT_INT4_G32, KT_FORMAT_INT4_G128,
                             KT_FORMAT_INT4_G32_ZP, KT_FORMAT_INT4_G128_ZP, KT_FORMAT_MXFP4})
    for (int64_t k : {128, 384})
      for (int np : {1, 2, 4, 5, 7, 8, 13})
        for (int m : {1, 2, 3, 4, 5, 7, 13, 16, 33}) {
          const kt_test::Int8Operands op(f, np, k, m, rng);
          const kt::QuantShape& s = op.s;
          ASSERT_EQ(s.kq, k);
          const int64_t ldc = np * 16 + 3;
          for (bool acc : {false, true}) {
            std::vector<float> c(static_cast<size_t>(m * ldc), 0.5f), want(c);
            K.gemm_int8(op.panels(), op.rows.data(), m, np, c.data(), ldc, acc,
                        kt::quant_panel_block(op.expert.data(), s, 0, np * 16));
            R.gemm_int8(op.panels(), op.rows.data(), m, np, want.data(), ldc, acc,
                        kt::PrefetchRegion{});
            for (size_t i = 0; i < c.size(); ++i)
              ASSERT_EQ(c[i], want[i]) << K.gemm_name << " " << kt_weight_format_name(f) << " k=" << k
                                       << " np=" << np << " m=" << m << " acc=" << acc << " at " << i;
            for (int i = 0; i < m; ++i) {
              const uint8_t* row = static_cast<const uint8_t*>(op.rows[static_cast<size_t>(i)]);
              float sr;
              std::memcpy(&sr, row + k + 4 * (k / s.group), 4);
              for (int64_t col = 0; col < np * 16; ++col) {
                double sum = 0.0, mag = 0.0;
                for (int64_t kk = 0; kk < k; ++kk) {
                  const int64_t at = s.bits == 4 ? (kk & ~int64_t{3}) | ((kk & 1) << 1) | ((kk >> 1) & 1) : kk;
                  const double t = static_cast<int8_t>(row[at]) *
                                   static_cast<double>(kt::quant_get(op.expert.data(), s, col, kk));
                  sum += t;
                  mag += std::fabs(t);
                }
                const double expect = (acc ? 0.5 : 0.0) + sr * sum;
                ASSERT_NEAR(c[static_cast<size_t>(i * ldc + col)], expect, 1e-6 * (1.0 + sr * mag))
                    << K.gemm_name << " " << kt_weight_format_name(f) << " m=" << m << " col=" << col;
              }
              for (int64_t col = np * 16; col < ldc; ++col) ASSERT_EQ(c[static_cast<size_t>(i * ldc + col)], 0.5f);
            }
          }
        }
}

// Codes and activations at their extremes, where sums of products in 16 or
// 32 bits would overflow if a kernel's partial sums were too wide (AVX2:
// vpmaddubsw pair sums, blocks of 16-bit sums): every code byte the same
// extreme value, rows of +-127 (all one sign, alternating, in pairs), and a
// K of 4096 in one group (int8 per channel) or in groups of 32 and 128.
TEST_P(GemmKernels, Int8GemmExtremeCodesMatchReferenceBits) {
  const kt::Kernels& K = *GetParam();
  const kt::Kernels& R = *kt::kernels_for(KT_ISA_REF);
  std::mt19937 rng(31);
  const int64_t k = 4096;
  const int np = 2, m = 5;
  struct Case {
    kt_weight_format f;
    std::vector<uint8_t> bytes;  // code bytes tried (4-bit: both nibbles)
  };
  // int8: -128, 127, -127; int4: u = 15 or 0; e2m1: +6 (0x7), -6 (0xF), -0.
  const Case cases[] = {{KT_FORMAT_INT8_CHANNEL, {0x80, 0x7f, 0x81}},
                        {KT_FORMAT_INT4_G32, {0xff, 0x00, 0x0f}},
                        {KT_FORMAT_INT4_G128_ZP, {0xff, 0x00}},
                        {KT_FORMAT_MXFP4, {0x77, 0xff, 0x7f, 0x88}}};
  for (const Case& cs : cases)
    for (uint8_t byte : cs.bytes)
      for (int pattern = 0; pattern < 3; ++pattern) {
        kt_test::Int8Operands op(cs.f, np, k, m, rng);
        const kt::QuantShape& s = op.s;
        std::fill(op.expert.begin(), op.expert.begin() + s.scales_offset, byte);
        std::vector<float> x(static_cast<size_t>(k));
        for (int i = 0; i < m; ++i) {
          for (int64_t j = 0; j < k; ++j) {
            const bool negative = pattern == 0   ? i % 2 == 1
                                  : pattern == 1 ? j % 2 == 1
                                                 : (j / 2 + i) % 2 == 1;
            x[static_cast<size_t>(j)] = negative ? -1.f : 1.f;
          }
          kt::quantize_int8_row(x.data(), k, s.kq, s.group, s.bits == 4,
                                op.row_data.data() + i * op.row_stride);
        }
        const int64_t ldc = np * 16;
        std::vector<float> c(static_cast<size_t>(m * ldc)), want(c.size());
        K.gemm_int8(op.panels(), op.rows.data(), m, np, c.data(), ldc, false, kt::PrefetchRegion{});
        R.gemm_int8(op.panels(), op.rows.data(), m, np, want.data(), ldc, false,
                    kt::PrefetchRegion{});
        for (size_t i = 0; i < c.size(); ++i)
          ASSERT_EQ(c[i], want[i]) << K.gemm_name << " " << kt_weight_format_name(cs.f) << " byte "
                                   << int{byte} << " pattern " << pattern << " at " << i;
        // And the values: every product of a row is +-127 times one code value.
        for (int i = 0; i < m; ++i) {
          const uint8_t* row = static_cast<const uint8_t*>(op.rows[static_cast<size_t>(i)]);
          float sr;
          std::memcpy(&sr, row + k + 4 * (k / s.group), 4);
          for (int64_t col = 0; col < ldc; col += 7) {
            double sum = 0.0;
            for (int64_t kk = 0; kk < k; ++kk) {
              const int64_t at =
                  s.bits == 4 ? (kk & ~int64_t{3}) | ((kk & 1) << 1) | ((kk >> 1) & 1) : kk;
              sum += static_cast<int8_t>(row[at]) *
                     static_cast<double>(kt::quant_get(op.expert.data(), s, col, kk));
            }
            ASSERT_NEAR(c[static_cast<size_t>(i * ldc + col)], sr * sum,
                        1e-5 * (1.0 + std::fabs(sr * sum)))
                << K.gemm_name << " " << kt_weight_format_name(cs.f) << " byte " << int{byte}
                << " pattern " << pattern;
          }
        }
      }
}

// A K longer than the group sums a few-row int4 call holds at once
// (AVX-512 BF16: 256 groups, so K past 8192 at group 32 runs in slices)
// against plain loops in double, with and without zero points; a row alone
// gives the bits it gives among others.
TEST_P(GemmKernels, QuantGemmLongKMatchesPlainLoops) {
  const kt::Kernels& K = *GetParam();
  if (!K.gemm_quant) GTEST_SKIP() << K.gemm_name << " has no gemm_quant (dequant_* and gemm_bf16w_grouped serve)";
  std::mt19937 rng(29);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> byte(0, 255);
  const int64_t k = 8192 + 3 * 128;
  const int np = 5;  // a tile of 4 panels and one of 1
  const int64_t n = np * 16;
  for (kt_weight_format f : {KT_FORMAT_INT4_G32, KT_FORMAT_INT4_G32_ZP}) {
    const kt::QuantShape s = kt::QuantShape::of(f, n, k);
    std::vector<uint8_t> ex(static_cast<size_t>(s.expert_bytes));
    for (int64_t i = 0; i < s.scales_offset; ++i) ex[static_cast<size_t>(i)] = static_cast<uint8_t>(byte(rng));
    for (int64_t i = 0; i < np * s.scale_panel; ++i) {
      const bf16_t b = kt::f32_to_bf16(std::fabs(nd(rng)) * 0.05f + 0.001f);
      if (s.scale_bytes == 4) {
        const float v = kt::bf16_to_f32(b);
        std::memcpy(ex.data() + s.scales_offset + i * 4, &v, 4);
      } else {
        std::memcpy(ex.data() + s.scales_offset + i * 2, &b, 2);
      }
    }
    if (s.zero_points)
      for (int64_t i = 0; i < np * s.scale_panel; ++i) ex[static_cast<size_t>(s.zeros_offset + i)] = static_cast<uint8_t>(byte(rng) & 15);
    // The most rows of the few-row tiles (K spans two slices of group sums),
    // each row's result as it is alone; 9 rows: the wide tiles.
    for (int m : {quant_few_rows_max(s), 9}) {
      std::vector<float> a(static_cast<size_t>(m * k));
      for (auto& v : a) v = kt::bf16_to_f32(kt::f32_to_bf16(nd(rng)));
      const PackedRows packed_a = pack_rows(K, a, m, k);
      const std::vector<const void*>& rows = packed_a.rows;
      std::vector<float> c(static_cast<size_t>(m * n), 0.f);
      K.gemm_quant(s.panels(ex.data(), 0), rows.data(), m, np, c.data(), n, false,
                   kt::quant_panel_block(ex.data(), s, 0, n));
      for (int i = 0; i < m; ++i) {
        std::vector<float> one(static_cast<size_t>(n), 0.f);
        if (m <= quant_few_rows_max(s))
          K.gemm_quant(s.panels(ex.data(), 0), &rows[static_cast<size_t>(i)], 1, np, one.data(), n, false,
                       kt::PrefetchRegion{});
        for (int64_t col = 0; col < n; ++col) {
          double want = 0.0, mag = 0.0;
          for (int64_t kk = 0; kk < k; ++kk) {
            const double t = static_cast<double>(a[static_cast<size_t>(i * k + kk)]) * kt::quant_get(ex.data(), s, col, kk);
            want += t;
            mag += std::fabs(t);
          }
          const float got = c[static_cast<size_t>(i * n + col)];
          ASSERT_NEAR(got, want, 1e-5 * (1.0 + mag))
              << K.gemm_name << " " << kt_weight_format_name(f) << " m " << m << " row " << i << " col " << col;
          if (m <= quant_few_rows_max(s)) {
            ASSERT_EQ(one[static_cast<size_t>(col)], got) << kt_weight_format_name(f);
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Compiled, TransposeKernels, ::testing::ValuesIn(registry_tables(false)), kernels_test_name);

INSTANTIATE_TEST_SUITE_P(Compiled, GemmKernels, ::testing::ValuesIn(registry_tables(true)), kernels_test_name);

TEST(Bf16, RoundTripAndNearestEven) {
  EXPECT_EQ(kt::f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(kt::bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(kt::f32_to_bf16(1.00390625f), 0x3f80);  // tie, even stays
  EXPECT_EQ(kt::f32_to_bf16(1.01171875f), 0x3f82);  // tie, odd rounds up
  EXPECT_TRUE(std::isnan(kt::bf16_to_f32(kt::f32_to_bf16(std::nanf("")))));
  EXPECT_EQ(kt::f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(kt::f16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(kt::f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(kt::f16_to_f32(0x7bff), 65504.0f);
}

}  // namespace

namespace {

// The vectorised activations against the double-precision reference formula,
// across clamp boundaries and large |x| (where exp saturates).
TEST_P(GemmKernels, ActivationsMatchReference) {
  const kt::Kernels& K = *GetParam();
  for (int kind : {KT_ACT_SILU, KT_ACT_SWIGLU_OAI})
    for (float limit : {0.f, 0.75f, 7.f}) {
      kt::reference::Spec spec;
      spec.activation = static_cast<kt_activation>(kind);
      spec.limit = limit;
      spec.alpha = 1.702;
      const kt::ActParams ap{kind, 1.702f, limit};
      std::vector<float> g, u;
      for (float v = -95.f; v <= 95.f; v += 0.37f) {
        g.push_back(v);
        u.push_back(0.5f * v - 1.f);
      }
      for (float v = -3.f; v <= 3.f; v += 0.01f) {
        g.push_back(v);
        u.push_back(-v);
      }
      const int64_t n = static_cast<int64_t>(g.size());
      std::vector<float> a(g.size()), da(g.size(), 1.f), dg(g.size()), du(g.size()), a2(g.size());
      K.act_forward(ap, g.data(), u.data(), a.data(), n);
      const float dot = K.act_backward(ap, g.data(), u.data(), da.data(), 0.5f, dg.data(), du.data(), a2.data(), n);
      double want_dot = 0;
      for (int64_t j = 0; j < n; ++j) {
        const double want = kt::reference::activation(spec, g[static_cast<size_t>(j)], u[static_cast<size_t>(j)]);
        want_dot += want;
        ASSERT_NEAR(a[static_cast<size_t>(j)], want, 1e-6 * (1.0 + std::fabs(want)))
            << K.gemm_name << " kind " << kind << " limit " << limit << " g " << g[static_cast<size_t>(j)];
        ASSERT_EQ(a2[static_cast<size_t>(j)], a[static_cast<size_t>(j)]);
        // Central differences of the reference for da/dg and da/du, away from the clamp kinks.
        const double gj = g[static_cast<size_t>(j)], uj = u[static_cast<size_t>(j)], h = 1e-4;
        const bool near_kink = limit > 0 && (std::fabs(gj - limit) < 2 * h || std::fabs(std::fabs(uj) - limit) < 2 * h);
        if (near_kink) continue;
        const double dadg = (kt::reference::activation(spec, gj + h, uj) - kt::reference::activation(spec, gj - h, uj)) / (2 * h);
        const double dadu = (kt::reference::activation(spec, gj, uj + h) - kt::reference::activation(spec, gj, uj - h)) / (2 * h);
        ASSERT_NEAR(dg[static_cast<size_t>(j)], 0.5 * dadg, 2e-5 * (1.0 + std::fabs(dadg))) << "dg at g " << gj << " u " << uj;
        ASSERT_NEAR(du[static_cast<size_t>(j)], 0.5 * dadu, 2e-5 * (1.0 + std::fabs(dadu))) << "du at g " << gj << " u " << uj;
      }
      EXPECT_NEAR(dot, want_dot, 1e-5 * (1.0 + std::fabs(want_dot)));
    }
}

}  // namespace
