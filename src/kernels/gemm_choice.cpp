// KT_GEMM_AUTO: kt's own weight GEMM, unless on this CPU oneDNN's measured
// clearly faster. Only the AMX tables are measured: there oneDNN's brgemm
// has been the faster one at prefill sizes, and kt's tile kernel must earn
// its place; on the AVX-512 and AVX2 paths kt's kernels were measured faster
// in every case of kt-moe bench, so nothing is timed there.
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "kernels/kernels.h"

namespace kt {

double time_weight_gemm(const Kernels& k, int m, int64_t kp, int np, int reps) {
  std::vector<bf16_t> a(static_cast<size_t>(m) * static_cast<size_t>(kp));
  Buffer<bf16_t> w(static_cast<size_t>(np) * kPanelRows * static_cast<size_t>(kp));
  std::vector<float> c(static_cast<size_t>(m) * kPanelRows * static_cast<size_t>(np));
  // Small finite bf16 values (0.0625 .. 0.99): the time does not depend on them.
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<bf16_t>(0x3d80 + i % 97);
  for (size_t i = 0; i < w.size(); ++i) w.data()[i] = static_cast<bf16_t>(0x3d80 + i % 89);
  std::vector<const void*> rows(static_cast<size_t>(m));
  for (int r = 0; r < m; ++r) rows[static_cast<size_t>(r)] = a.data() + static_cast<size_t>(r) * static_cast<size_t>(kp);
  double best = 1e30;
  for (int i = 0; i <= reps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    k.gemm_bf16w(rows.data(), m, kp, w.data(), kPanelRows * kp, np, c.data(), kPanelRows * np, false,
                 PrefetchRegion{});
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (i > 0 && s < best) best = s;  // the first call warms caches and builds plans
  }
  return best;
}

const Kernels& auto_gemm_kernels(const Kernels& native, std::string* note) {
  note->clear();
  const Kernels* dnnl = native.isa == KT_ISA_AMX ? onednn_kernels(native) : nullptr;
  if (!dnnl) return native;
  // Measured once per process, on the first engine: gate/up GEMMs of a
  // Qwen3-30B-A3B expert (H 2048, I 768) at 4 rows (decode: an expert gets
  // a few routes) and at 128 rows (prefill of a couple of thousand tokens).
  // oneDNN is taken only where it wins both: a layer runs both sizes, and
  // a choice made on one size alone lost at the other on a real AMX CPU
  // (bench/README.md).
  static std::once_flag once;
  static bool prefer_onednn = false;
  static std::string measured;
  std::call_once(once, [&] {
    const int np = 48;
    const int64_t kp = 2048;
    const double n4 = time_weight_gemm(native, 4, kp, np, 5), d4 = time_weight_gemm(*dnnl, 4, kp, np, 5);
    const double n128 = time_weight_gemm(native, 128, kp, np, 5), d128 = time_weight_gemm(*dnnl, 128, kp, np, 5);
    // A margin keeps the choice stable from run to run when the two are close.
    prefer_onednn = d4 * 1.15 < n4 && d128 * 1.15 < n128;
    char buffer[300];
    std::snprintf(buffer, sizeof(buffer),
                  "weight GEMM 4x2048x768 / 128x2048x768: %s %.1f / %.1f us, %s %.1f / %.1f us; auto picks %s",
                  native.gemm_name, n4 * 1e6, n128 * 1e6, dnnl->gemm_name, d4 * 1e6, d128 * 1e6,
                  prefer_onednn ? "oneDNN" : "kt's kernels");
    measured = buffer;
  });
  *note = measured;
  return prefer_onednn ? *dnnl : native;
}

}  // namespace kt
