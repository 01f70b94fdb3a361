// Kernel table entries that count their calls and flops into this thread's
// kernel tally (core/kernel_tally.h) before they run.
#pragma once

#include <cstdint>

#include "core/kernel_tally.h"
#include "kernels/kernels.h"

namespace kt {

// 2 m n k of a call, one overload per entry signature of Kernels (a
// signature that changes no longer compiles here).
namespace entry_flops {
inline int64_t gemm(int64_t m, int64_t n, int64_t k) {
  return 2 * m * n * k;
}
// gemm_bf16w
inline int64_t of(const void* const*, int m, int64_t kp, const bf16_t*, int64_t, int np, float*,
                  int64_t, bool, const PrefetchRegion&) {
  return gemm(m, int64_t{kPanelRows} * np, kp);
}
// gemm_bf16w_nn: the sum runs over the panels' rows
inline int64_t of(const void* const*, int m, const bf16_t*, int64_t, int np, int64_t, int64_t n, float*, int64_t,
                  bool, const PrefetchRegion&) {
  return gemm(m, n, int64_t{kPanelRows} * np);
}
// gemm_bf16w_grouped
inline int64_t of(const void* const*, int m, int64_t kp, const bf16_t*, int64_t, int np,
                  const float*, int64_t, int64_t, float*, int64_t, bool, const PrefetchRegion&) {
  return gemm(m, int64_t{kPanelRows} * np, kp);
}
// gemm_quant, gemm_int8
inline int64_t of(const QuantPanels& w, const void* const*, int m, int np, float*, int64_t, bool,
                  const PrefetchRegion&) {
  return gemm(m, int64_t{kPanelRows} * np, w.kq);
}
// gemm_zip_bf16: K is two rows per group
inline int64_t of(const bf16_t*, int64_t, int m, const bf16_t*, int64_t, int np, int64_t groups,
                  float*, int64_t, bool, float, bool) {
  return gemm(m, int64_t{kPanelRows} * np, 2 * groups);
}
// sgemm_nn, sgemm_nt
inline int64_t of(int m, int n, int k, const float* const*, const float*, int64_t, float*, int64_t,
                  bool) {
  return gemm(m, n, k);
}
// sgemm_tn
inline int64_t of(int m, int n, int k, const float*, int64_t, const float* const*, float*, int64_t,
                  bool) {
  return gemm(m, n, k);
}
// transpose_panels: no arithmetic
inline int64_t of(const bf16_t*, int64_t, int64_t, int64_t, int64_t, bf16_t*) {
  return 0;
}
}  // namespace entry_flops

template <int Id, auto F>
struct Counted;
template <int Id, class R, class... A, R (*F)(A...)>
struct Counted<Id, F> {
  static R call(A... a) {
    count_kernel(Id, entry_flops::of(a...));
    return F(a...);
  }
};
// Entry E of kernel table T, computed by F: a constant, so tables stay
// constant-initialised.
template <KernelTable T, KernelEntry E, auto F>
constexpr auto counted = &Counted<kernel_id(T, E), F>::call;

}  // namespace kt
