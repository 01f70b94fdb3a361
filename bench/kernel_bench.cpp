// kt_kernel_bench: kt's micro-kernels alone, on one pinned thread, against
// that thread's measured peak and read bandwidth. It separates what a kernel
// can do (weights hot in cache) from what it does when its weights stream
// from memory (cold), with and without the prefetch of the next block that
// the MoE stages pass it; then the same for the quantized bases' gemm_quant
// at decode's row counts, and at prefill's against dequantizing into cache;
// then transpose_panels (backward's W^T panels), backward's products with W
// straight from its panels against through W^T panels, and the LoRA fp32 GEMMs. Read with kt_bench's
// per-stage profile: a stage below its kernel's cold figure loses time outside the kernel.
//
// usage: kt_kernel_bench [--isa NAME] [--quick]; NAME: a table of the kernel
// registry (src/kernels/kernel_list.inc: ref, avx2, avx2_no_vnni, ...); by
// default the best this CPU runs.
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "formats/packed_bf16.h"
#include "formats/packed_quant.h"
#include "kernels/kernels.h"
#include "machine_limits.h"
#include "moe/blocking.h"
#include "runtime/thread_pool.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The best over reps runs of call(0) ... call(calls - 1), in seconds per call.
template <class F>
double best_seconds_per_call(int64_t calls, int reps, F&& call) {
  double best = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < calls; ++i) call(i);
    best = std::min(best, seconds_since(t0) / static_cast<double>(calls));
  }
  return best;
}

struct Shape {
  const char* what;
  int64_t k;  // reduction length (H for gate/up, I for down)
};

// gemm_quant at 1, 2, 3, 4 and 8 rows (few-row and wide tiles), on 4 panels of a quantized base
// laid out as the layer holds one expert's block (codes, then scales, then
// zero points): hot, cold, and cold with the next block as the stages pass
// it. GB/s on the block's bytes (codes and scales): the figure to hold
// against the DRAM read rate, since decode is bound by those bytes.
void quant_section(const kt::Kernels& K, const kt_bench::MachineLimits& lim, bool quick,
                   size_t buffer_bytes) {
  std::printf(
      "\ngemm_quant: m rows x 4 panels (64 columns) x k of a quantized base, GB/s of its codes "
      "and\n"
      "scales (hot / cold / cold +pf as above), against the one thread's DRAM read %.1f GB/s\n",
      lim.dram_read_gbs);
  std::printf("%-10s %-13s %5s %4s %9s %9s %9s %7s\n", "shape", "format", "k", "m", "hot GB/s",
              "cold GB/s", "+pf GB/s", "%read");
  const struct {
    const char* name;
    kt_weight_format f;
  } formats[] = {{"int4_g32", KT_FORMAT_INT4_G32},
                 {"int4_g128", KT_FORMAT_INT4_G128},
                 {"mxfp4", KT_FORMAT_MXFP4},
                 {"int8_channel", KT_FORMAT_INT8_CHANNEL},
                 {"int4_g32_zp", KT_FORMAT_INT4_G32_ZP}};
  const Shape shapes[] = {{"down", 768}, {"gate/up", 2048}};
  for (const Shape& sh : shapes) {
    for (const auto& fm : formats) {
      const kt::QuantShape qs = kt::QuantShape::of(fm.f, 64, sh.k);
      const int64_t block = qs.expert_bytes;
      const int64_t blocks = static_cast<int64_t>(buffer_bytes) / block;
      kt::Buffer<uint8_t> w(static_cast<size_t>(blocks * block));
      uint32_t x = 12345;
      for (int64_t i = 0; i < blocks * block; ++i) {
        x = x * 1664525u + 1013904223u;
        w[static_cast<size_t>(i)] = static_cast<uint8_t>(x >> 24);
      }
      // Finite scales (bf16 2^-7 or fp32 2^-7), zero points of 8.
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* ex = w.data() + b * block;
        for (int64_t i = 0; i < qs.np * qs.scale_panel; ++i) {
          if (qs.scale_bytes == 4) {
            const float v = 1.f / 128;
            std::memcpy(ex + qs.scales_offset + 4 * i, &v, 4);
          } else {
            const kt::bf16_t v = 0x3c00;
            std::memcpy(ex + qs.scales_offset + 2 * i, &v, 2);
          }
          if (qs.zero_points) ex[qs.zeros_offset + i] = 8;
        }
      }
      std::vector<kt::bf16_t> a(static_cast<size_t>(8 * qs.kq), 0x3f00);
      std::vector<const void*> rows(8);
      for (int r = 0; r < 8; ++r) rows[static_cast<size_t>(r)] = a.data() + r * qs.kq;
      std::vector<float> c(8 * 64);
      const int max_m = qs.bits == 4 ? K.gemm_quant_rows_4bit : K.gemm_quant_rows_8bit(qs.code);
      const double bytes =
          static_cast<double>(qs.np * (qs.code_panel_bytes + qs.scale_panel * qs.scale_bytes +
                                       (qs.zero_points ? qs.scale_panel : 0)));
      for (int m = 1; m <= std::min(max_m, 8); m = m < 4 ? m + 1 : 2 * m) {
        double gbs[3];
        for (int mode = 0; mode < 3; ++mode) {
          const int64_t calls = mode == 0 ? (quick ? 50 : 4000) : blocks - 1;
          const double best = best_seconds_per_call(calls, quick ? 1 : 3, [&](int64_t i) {
            const uint8_t* ex = w.data() + (mode == 0 ? 0 : i) * block;
            const kt::PrefetchRegion next =
                mode == 2 ? kt::quant_panel_block(ex + block, qs, 0, 64) : kt::PrefetchRegion{};
            K.gemm_quant(qs.panels(ex, 0), rows.data(), m, 4, c.data(), 64, false, next);
          });
          gbs[mode] = bytes / best / 1e9;
        }
        std::printf("%-10s %-13s %5lld %4d %9.1f %9.1f %9.1f %6.0f%%\n", sh.what, fm.name,
                    static_cast<long long>(sh.k), m, gbs[0], gbs[1], gbs[2],
                    100 * gbs[2] / lim.dram_read_gbs);
      }
    }
  }
}

// A quantized base at prefill's row counts, weights hot: straight from the
// codes (gemm_quant) against dequantized into cache in chunks of 256 K
// values and the grouped GEMM on them (gemm_bf16w_grouped), as the layer
// does past the table's gemm_quant_rows: the figures that place that
// threshold (int4 groups of 32 on the gate/up shape, 4 panels).
void quant_rows_section(const kt::Kernels& K, double peak, bool quick) {
  const kt::QuantShape qs = kt::QuantShape::of(KT_FORMAT_INT4_G32, 64, 2048);
  kt::Buffer<uint8_t> ex(static_cast<size_t>(qs.expert_bytes));
  uint32_t x = 777;
  for (int64_t i = 0; i < qs.expert_bytes; ++i) {
    x = x * 1664525u + 1013904223u;
    ex[static_cast<size_t>(i)] = static_cast<uint8_t>(x >> 24);
  }
  for (int64_t i = 0; i < qs.np * qs.scale_panel; ++i) {
    const kt::bf16_t v = 0x3c00;
    std::memcpy(ex.data() + qs.scales_offset + 2 * i, &v, 2);
  }
  constexpr int64_t kChunk = kt::kQuantChunk;  // the layer's
  kt::Buffer<kt::bf16_t> deq(static_cast<size_t>(qs.np * kt::kPanelRows * kChunk));
  std::vector<float> scales(static_cast<size_t>(qs.np * kChunk / qs.group * kt::kPanelRows));
  const int max_rows = 64;
  std::vector<char> a(static_cast<size_t>(max_rows * qs.kq * K.a_elem_size), 0);
  std::vector<float> af(static_cast<size_t>(qs.kq), 0.5f);
  std::vector<const void*> rows(max_rows), chunk_rows(max_rows);
  for (int r = 0; r < max_rows; ++r) {
    K.pack_a_f32(af.data(), qs.kq, qs.kq, a.data() + r * qs.kq * K.a_elem_size);
    rows[static_cast<size_t>(r)] = a.data() + r * qs.kq * K.a_elem_size;
  }
  std::vector<float> c(static_cast<size_t>(max_rows * 64));
  std::printf(
      "\nquantized base at prefill rows: m rows x 4 panels x k %lld of int4_g32, weights hot, "
      "GFLOP/s\n"
      "(%%peak of %.0f): straight from the codes (gemm_quant) and dequantized into cache + grouped "
      "GEMM;\n"
      "the layer takes the codes %s\n",
      static_cast<long long>(qs.kq), peak,
      !K.gemm_quant ? "never (no gemm_quant)"
      : K.gemm_quant_rows_4bit >= 1 << 20
          ? "at every row count where the table decides (a table at that bound is measured by the "
            "layer once per process: WeightOperand::code_rows_4bit)"
          : ("up to " + std::to_string(K.gemm_quant_rows_4bit) + " rows").c_str());
  std::printf("%4s %12s %7s %12s %7s\n", "m", "codes GF/s", "%peak", "cache GF/s", "%peak");
  const int64_t calls = quick ? 20 : 200;
  const int reps = quick ? 1 : 3;
  for (int m : {8, 16, 24, 32, 64}) {
    const double flops = 2.0 * m * 64 * static_cast<double>(qs.kq);
    double direct = 0;
    if (K.gemm_quant) {
      direct = flops /
               best_seconds_per_call(calls, reps,
                                     [&](int64_t) {
                                       K.gemm_quant(qs.panels(ex.data(), 0), rows.data(), m, 4,
                                                    c.data(), 64, false, kt::PrefetchRegion{});
                                     }) /
               1e9;
    }
    const double cached =
        flops /
        best_seconds_per_call(
            calls, reps,
            [&](int64_t) {
              for (int64_t k0 = 0; k0 < qs.kq; k0 += kChunk) {
                const int64_t kc = std::min(kChunk, qs.kq - k0);
                for (int r = 0; r < m; ++r)
                  chunk_rows[static_cast<size_t>(r)] =
                      static_cast<const char*>(rows[static_cast<size_t>(r)]) + k0 * K.a_elem_size;
                kt::quant_scales_f32(ex.data(), qs, 0, 4, k0 / qs.group, kc / qs.group,
                                     scales.data());
                K.dequant_i4(ex.data(), qs.code_panel_bytes, 4, k0, kc, nullptr, 0, 0, deq.data());
                K.gemm_bf16w_grouped(chunk_rows.data(), m, kc, deq.data(), kt::kPanelRows * kc, 4,
                                     scales.data(), kc / qs.group * kt::kPanelRows, qs.group,
                                     c.data(), 64, k0 > 0, kt::PrefetchRegion{});
              }
            }) /
        1e9;
    if (K.gemm_quant) {
      std::printf("%4d %12.1f %6.1f%% %12.1f %6.1f%%\n", m, direct, 100 * direct / peak, cached,
                  100 * cached / peak);
    } else {
      std::printf("%4d %12s %7s %12.1f %6.1f%%\n", m, "-", "-", cached, 100 * cached / peak);
    }
  }
}

// Backward's two weight shapes of Qwen3-30B-A3B: gate/up (48 panels of
// K = 2048: dx's columns of H) and down (128 panels of K = 768: da''s
// columns of I), as panels' rows (16 * np) and K.
struct BackwardShape {
  const char* what;
  int64_t out, k;
};
constexpr BackwardShape kBackwardShapes[] = {{"gate/up", 768, 2048}, {"down", 2048, 768}};

// As many experts of shape s as fill buffer_bytes (at least 2), so that a
// walk over them streams from memory.
struct ColdExperts {
  int64_t count;
  kt::Buffer<kt::bf16_t> w;
  ColdExperts(const kt::PanelShape& s, size_t buffer_bytes)
      : count(std::max<int64_t>(2, static_cast<int64_t>(buffer_bytes / sizeof(kt::bf16_t)) / s.elements())),
        w(static_cast<size_t>(count * s.elements())) {
    for (int64_t i = 0; i < count * s.elements(); ++i)
      w[static_cast<size_t>(i)] = static_cast<kt::bf16_t>(0x3f80 + (i % 7));
  }
};

// transpose_panels, which backward's dx and da' stages run before their
// GEMMs (the W^T panels of a block of 64 columns, built in cache from a
// slice of every panel of the expert), on kBackwardShapes. Hot: the same
// slice every call; cold: as dx takes them, 4 consecutive blocks of an
// expert, then the next expert's, from a large buffer. GB/s of the slices read, against the thread's DRAM read rate.
void transpose_section(const kt::Kernels& K, const kt_bench::MachineLimits& lim, bool quick) {
  std::printf(
      "\ntranspose_panels (W^T panels of 64 columns in cache), GB/s of the source slices; DRAM "
      "read %.1f GB/s\n",
      lim.dram_read_gbs);
  std::printf("%-8s %4s %6s %10s %10s\n", "shape", "np", "K", "hot", "cold");
  const size_t buffer_bytes = (quick ? 64ull : 512ull) << 20;
  for (const BackwardShape& t : kBackwardShapes) {
    const kt::PanelShape s = kt::PanelShape::of(t.out, t.k);
    const ColdExperts cold(s, buffer_bytes);
    const int64_t experts = cold.count;
    const kt::Buffer<kt::bf16_t>& w = cold.w;
    kt::Buffer<kt::bf16_t> dst(static_cast<size_t>(s.np * kt::kPanelRows * kt::kBlockCols));
    const double slice =
        static_cast<double>(s.np) * kt::kPanelRows * kt::kBlockCols * sizeof(kt::bf16_t);
    const int64_t per_expert = std::min<int64_t>(4, t.k / kt::kBlockCols);
    double gbs[2];
    for (int mode = 0; mode < 2; ++mode) {
      const int64_t calls = mode == 0 ? (quick ? 50 : 2000) : experts * per_expert;
      const double best = best_seconds_per_call(calls, quick ? 1 : 3, [&](int64_t i) {
        const int64_t e = mode == 0 ? 0 : i / per_expert;
        const int64_t c0 = mode == 0 ? 0 : i % per_expert * kt::kBlockCols;
        K.transpose_panels(w.data() + e * s.elements(), s.np, s.panel_stride(), c0, kt::kBlockCols,
                           dst.data());
      });
      gbs[mode] = slice / best / 1e9;
    }
    std::printf("%-8s %4lld %6lld %10.1f %10.1f\n", t.what, static_cast<long long>(s.np),
                static_cast<long long>(t.k), gbs[0], gbs[1]);
  }
}

// Backward's products with W of one expert's m rows, cold, the two ways the
// dx and da' stages take them: straight from W's panels (gemm_bf16w_nn, a
// call per 256 columns, as dx takes them at decode) and through W^T panels
// (transpose_panels then gemm_bf16w, per block of 64 columns). GB/s of the
// weights read, against the thread's DRAM read rate; the layer takes the
// straight path up to the table's gemm_bf16w_nn_rows rows.
void straight_section(const kt::Kernels& K, const kt_bench::MachineLimits& lim, bool quick) {
  if (!K.gemm_bf16w_nn) {
    std::printf("\ngemm_bf16w_nn: the %s table has none (backward builds W^T panels)\n", K.gemm_name);
    return;
  }
  std::printf(
      "\nbackward's C = A W, cold, GB/s of the weights: straight (gemm_bf16w_nn) against W^T panels "
      "(transpose_panels + gemm_bf16w); taken straight up to %d rows; DRAM read %.1f GB/s\n",
      K.gemm_bf16w_nn_rows, lim.dram_read_gbs);
  std::printf("%-8s %4s %6s %4s %10s %10s\n", "shape", "np", "K", "m", "straight", "W^T");
  const size_t buffer_bytes = (quick ? 64ull : 512ull) << 20;
  for (const BackwardShape& t : kBackwardShapes) {
    const kt::PanelShape s = kt::PanelShape::of(t.out, t.k);
    const ColdExperts cold(s, buffer_bytes);
    const int64_t experts = cold.count;
    const kt::Buffer<kt::bf16_t>& w = cold.w;
    kt::Buffer<kt::bf16_t> wt(static_cast<size_t>(s.np * kt::kPanelRows * kt::kBlockCols));
    const int64_t ka = s.padded_rows();
    std::vector<char> a(static_cast<size_t>(16 * ka * K.a_elem_size), 0);
    std::vector<float> af(static_cast<size_t>(ka), 0.5f);
    std::vector<const void*> rows(16);
    for (int r = 0; r < 16; ++r) {
      K.pack_a_f32(af.data(), t.out, ka, a.data() + r * ka * K.a_elem_size);
      rows[static_cast<size_t>(r)] = a.data() + r * ka * K.a_elem_size;
    }
    std::vector<float> c(static_cast<size_t>(16 * kt::kMaxItemCols));
    const int64_t span = std::min<int64_t>(kt::kMaxItemCols, t.k);
    const int64_t per_expert = t.k / span;
    for (int m : {1, 2, 4, 8, 16}) {
      double gbs[2];
      for (int mode = 0; mode < 2; ++mode) {
        const double best = best_seconds_per_call(experts * per_expert, quick ? 1 : 3, [&](int64_t i) {
          const kt::bf16_t* we = w.data() + i / per_expert * s.elements();
          const int64_t c0 = i % per_expert * span;
          if (mode == 0) {
            K.gemm_bf16w_nn(rows.data(), m, we, s.panel_stride(), static_cast<int>(s.np), c0, span, c.data(), span,
                            false, kt::PrefetchRegion{});
            return;
          }
          for (int64_t b0 = c0; b0 < c0 + span; b0 += kt::kBlockCols) {
            K.transpose_panels(we, s.np, s.panel_stride(), b0, kt::kBlockCols, wt.data());
            K.gemm_bf16w(rows.data(), m, ka, wt.data(), kt::kPanelRows * ka, static_cast<int>(kt::kBlockPanels),
                         c.data(), span, false, kt::PrefetchRegion{});
          }
        });
        gbs[mode] = static_cast<double>(s.np) * kt::kPanelRows * span * sizeof(kt::bf16_t) / best / 1e9;
      }
      std::printf("%-8s %4lld %6lld %4d %10.1f %10.1f\n", t.what, static_cast<long long>(s.np),
                  static_cast<long long>(t.k), m, gbs[0], gbs[1]);
    }
  }
}

// The fp32 GEMMs of LoRA at rank r on the Qwen3-30B-A3B shapes, m rows of
// one expert: the A-projections (sgemm_nt: x . A^T, k = H; the backward's
// dg . sB, k = I), the B-projections added into the C tile (sgemm_nn, 64
// columns, k = r) and the factor gradients (sgemm_tn: dA [r, H] and dB^T
// [r, I] over the rows). Rows are taken from a tokens x k buffer (4 MiB at
// H: a prefill's x in fp32) in a scattered order, as an expert's routes
// are; hot = the same rows every call, spread = each call the next m rows
// of a shuffled order.
void lora_section(const kt::Kernels& K, double peak, bool quick) {
  const int r = 16;
  const int64_t tokens = 512;
  std::printf("\nLoRA fp32 GEMMs, rank %d: GFLOP/s and %% of the fp32 FMA peak (%.0f GFLOP/s)\n", r,
              peak);
  std::printf("%-34s %4s %10s %7s %10s %7s\n", "gemm", "m", "hot GF/s", "%peak", "spread", "%peak");
  std::vector<int> order(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t)
    order[static_cast<size_t>(t)] = static_cast<int>((t * 193) % tokens);
  for (int64_t k : {int64_t{2048}, int64_t{768}}) {
    std::vector<float> x(static_cast<size_t>(tokens * k)), f(static_cast<size_t>(r * k)),
        c(static_cast<size_t>(64 * k));
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 13) * 0.01f;
    for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(i % 7) * 0.01f;
    std::vector<float> lr(static_cast<size_t>(64 * r), 0.5f);
    for (int m : {8, 32, 64}) {
      std::vector<const float*> rows(static_cast<size_t>(m)), lrows(static_cast<size_t>(m));
      for (int i = 0; i < m; ++i) lrows[static_cast<size_t>(i)] = lr.data() + i * r;
      const auto take_rows = [&](int64_t call) {
        for (int i = 0; i < m; ++i)
          rows[static_cast<size_t>(i)] =
              x.data() + order[static_cast<size_t>((call * m + i) % tokens)] * k;
      };
      struct Gemm {
        const char* what;
        double flops;
        bool per_k;  // depends on k (the B-projection's k is r: timed at the first k only)
        std::function<void()> run;
      };
      char a_name[64], b_name[64], g_name[64];
      std::snprintf(a_name, sizeof(a_name), "sgemm_nt x.A^T  n=%d k=%lld", r,
                    static_cast<long long>(k));
      std::snprintf(b_name, sizeof(b_name), "sgemm_nn la.sB^T n=64 k=%d", r);
      std::snprintf(g_name, sizeof(g_name), "sgemm_tn dA [%d,%lld] over m", r,
                    static_cast<long long>(k));
      const Gemm gemms[] = {
          {a_name, 2.0 * m * r * static_cast<double>(k), true,
           [&] {
             K.sgemm_nt(m, r, static_cast<int>(k), rows.data(), f.data(), k, c.data(), r, false);
           }},
          {b_name, 2.0 * m * 64 * r, false,
           [&] { K.sgemm_nn(m, 64, r, lrows.data(), f.data(), k, c.data(), 64, true); }},
          {g_name, 2.0 * m * r * static_cast<double>(k), true,
           [&] {
             K.sgemm_tn(r, static_cast<int>(k), m, lr.data(), r, rows.data(), c.data(), k, false);
           }},
      };
      for (const Gemm& g : gemms) {
        if (!g.per_k && k != 2048) continue;
        double gf[2];
        for (int mode = 0; mode < 2; ++mode) {
          take_rows(0);
          const int64_t calls = quick ? 20 : 400;
          gf[mode] = g.flops /
                     best_seconds_per_call(calls, quick ? 1 : 3,
                                           [&](int64_t i) {
                                             if (mode == 1) take_rows(i);
                                             g.run();
                                           }) /
                     1e9;
        }
        std::printf("%-34s %4d %10.1f %6.1f%% %10.1f %6.1f%%\n", g.what, m, gf[0],
                    100 * gf[0] / peak, gf[1], 100 * gf[1] / peak);
      }
    }
  }
}

// The registry's table of that name, or nullptr.
const kt::KernelTableInfo* registry_table(const std::vector<kt::KernelTableInfo>& tables, const std::string& name) {
  for (const kt::KernelTableInfo& t : tables)
    if (name == t.name) return &t;
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  const std::vector<kt::KernelTableInfo> tables = kt::compiled_kernel_tables();
  const kt::Kernels* chosen = &kt::select_kernels(KT_ISA_AMX);  // no cap: the best this CPU runs
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const kt::KernelTableInfo* t = a == "--isa" && i + 1 < argc ? registry_table(tables, argv[i + 1]) : nullptr;
    if (a == "--quick") {
      quick = true;
    } else if (t) {
      ++i;
      if (*t->missing) {
        std::printf("kt_kernel_bench: %s not run: this CPU has no %s\n", t->name, t->missing);
        return 0;
      }
      chosen = t->table;
    } else {
      std::string names;
      for (const kt::KernelTableInfo& r : tables) names += std::string(names.empty() ? "" : "|") + r.name;
      std::fprintf(stderr, "usage: kt_kernel_bench [--isa %s] [--quick]\n", names.c_str());
      return a == "-h" || a == "--help" ? 0 : 2;
    }
  }
  // One thread, pinned like a kt worker.
  const std::vector<int> cpus = kt::allowed_cpus();
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpus.front(), &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);

  const kt::Kernels& K = *chosen;
  const kt_bench::MachineLimits lim = kt_bench::measure_machine_limits(1, quick);
  const bool bf16 = K.a_elem_size == 2;
  // The AMX table's peak is the tiles' (tdpbf16ps), measured beside the rest.
  const bool tiles = K.isa == KT_ISA_AMX && lim.amx_bf16_gflops > 0;
  const double peak = tiles  ? lim.amx_bf16_gflops
                      : bf16 ? lim.bf16_dot_gflops
                             : lim.fp32_fma_avx2_gflops;
  std::printf("kt_kernel_bench: %s, one thread on CPU %d\n", K.gemm_name, cpus.front());
  std::printf("one thread: %s peak %.0f GFLOP/s, DRAM read %.1f GB/s\n",
              tiles  ? "AMX-BF16 tile"
              : bf16 ? "bf16 dot"
                     : "fp32 FMA (avx2)",
              peak, lim.dram_read_gbs);
  std::printf("gemm_bf16w: m rows x 4 panels (64 columns) x k; hot = the same panels every call, cold = a new\n"
              "block from a %s buffer each call, +pf = cold with the next block prefetched as the stages do\n",
              quick ? "64 MiB" : "512 MiB");
  std::printf("%-10s %5s %4s %10s %7s %10s %7s %10s %7s %9s\n", "shape", "k", "m", "hot GF/s", "%peak", "cold GF/s",
              "%peak", "+pf GF/s", "%peak", "cold GB/s");

  const int np = 4;
  const size_t buffer_bytes = (quick ? 64ull : 512ull) << 20;
  const Shape shapes[] = {{"down", 768}, {"gate/up", 2048}};
  for (const Shape& sh : shapes) {
    const int64_t kp = (sh.k + 1) / 2 * 2;
    const int64_t panel_stride = kt::kPanelRows * kp;
    const int64_t block = np * panel_stride;  // elements of one 64-column block
    const int64_t blocks = static_cast<int64_t>(buffer_bytes / sizeof(kt::bf16_t)) / block;
    kt::Buffer<kt::bf16_t> w(static_cast<size_t>(blocks * block));
    for (int64_t i = 0; i < blocks * block; ++i) w[static_cast<size_t>(i)] = static_cast<kt::bf16_t>(0x3f80 + (i % 7));
    std::vector<char> a(static_cast<size_t>(64 * kp * K.a_elem_size), 0);
    std::vector<float> af(static_cast<size_t>(kp), 0.5f);
    std::vector<const void*> rows(64);
    for (int r = 0; r < 64; ++r) {
      K.pack_a_f32(af.data(), sh.k, kp, a.data() + r * kp * K.a_elem_size);
      rows[static_cast<size_t>(r)] = a.data() + r * kp * K.a_elem_size;
    }
    std::vector<float> c(64 * 64);
    for (int m : {1, 6, 8, 12, 16, 32, 64}) {
      const double flops = 2.0 * m * 64 * static_cast<double>(sh.k);
      double gf[3];
      for (int mode = 0; mode < 3; ++mode) {
        const int64_t calls = mode == 0 ? (quick ? 50 : 2000) : blocks - 1;
        const double best = best_seconds_per_call(calls, quick ? 1 : 3, [&](int64_t i) {
          const kt::bf16_t* wb = w.data() + (mode == 0 ? 0 : i) * block;
          const kt::PrefetchRegion next =
              mode == 2 ? kt::PrefetchRegion::block(wb + block, block * 2) : kt::PrefetchRegion{};
          K.gemm_bf16w(rows.data(), m, kp, wb, panel_stride, np, c.data(), 64, false, next);
        });
        gf[mode] = flops / best / 1e9;
      }
      const double cold_gbs = gf[1] / flops * static_cast<double>(block * 2);
      std::printf("%-10s %5lld %4d %10.1f %6.1f%% %10.1f %6.1f%% %10.1f %6.1f%% %9.1f\n", sh.what,
                  static_cast<long long>(sh.k), m, gf[0], 100 * gf[0] / peak, gf[1], 100 * gf[1] / peak, gf[2],
                  100 * gf[2] / peak, cold_gbs);
    }
  }
  if (K.gemm_quant) {
    quant_section(K, lim, quick, buffer_bytes);
  } else {
    std::printf("\ngemm_quant: the %s table has none\n", K.gemm_name);
  }
  quant_rows_section(K, peak, quick);
  transpose_section(K, lim, quick);
  straight_section(K, lim, quick);
  lora_section(
      K, lim.fp32_fma_avx512_gflops > 0 ? lim.fp32_fma_avx512_gflops : lim.fp32_fma_avx2_gflops,
      quick);
  return 0;
}
