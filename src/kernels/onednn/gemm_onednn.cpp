// The oneDNN GEMM backend (KT_GEMM_ONEDNN): the weight GEMM of the
// avx512bf16 or amx table done by oneDNN's matmul, everything else unchanged.
//
// kt's packed panels are oneDNN's BA16a16b2a layout of W^T ([K, N], N in
// blocks of 16, K in blocks of 32 with bf16 pairs innermost), so oneDNN reads
// the layer's weights in place: no second copy. oneDNN picks its brgemm
// kernels for that layout (AMX where the CPU has it). Each worker thread runs
// its calls single-threaded (the work split stays kt's) and keeps its own
// primitives, one per shape.
#include "kernels/kernels.h"

#if KT_HAVE_ONEDNN

#include <omp.h>

#include <cstring>
#include <dnnl.hpp>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/counted.h"

namespace kt {
namespace {

// The bf16-activation tables the oneDNN ones extend: [0] avx512bf16, [1] amx.
const Kernels* g_bases[2] = {nullptr, nullptr};

struct Shape {
  int m;
  int64_t kp;
  int64_t lda;  // A's rows, lda >= kp values apart
  int64_t n;
  int64_t ldc;
  bool accumulate;
  bool operator<(const Shape& o) const {
    return std::tie(m, kp, lda, n, ldc, accumulate) <
           std::tie(o.m, o.kp, o.lda, o.n, o.ldc, o.accumulate);
  }
};

struct Plan {
  dnnl::memory::desc a, b, c;
  dnnl::matmul matmul;
  // oneDNN's implementation for the shape; "ref:..." is its plain C++ loop
  // (oneDNN 2.6 takes it for strided A rows and for some single-row calls,
  // e.g. 1 x 768 x 64), far slower than kt's kernel, so such a plan never
  // runs.
  std::string impl;
  bool reference() const { return impl.compare(0, 3, "ref") == 0; }
};

struct WorkerState {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::map<Shape, Plan> plans;
  std::vector<bf16_t> rows;  // gathered A rows
};

// oneDNN (built with OpenMP) runs a primitive on omp_get_max_threads()
// threads of the calling thread. kt's call stays on its thread: one
// OpenMP thread for the call, and the thread's own setting back after it.
// The thread may be the host's (a pool runs single items on its caller),
// whose torch shares the OpenMP runtime: a setting left at 1 would make
// the host's own CPU work single-threaded.
class OneOpenMpThread {
 public:
  OneOpenMpThread() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneOpenMpThread() { omp_set_num_threads(saved_); }
  OneOpenMpThread(const OneOpenMpThread&) = delete;
  OneOpenMpThread& operator=(const OneOpenMpThread&) = delete;

 private:
  int saved_;
};

WorkerState& worker_state() {
  thread_local WorkerState state;
  return state;
}

const Plan& plan_for(WorkerState& w, const Shape& s) {
  auto it = w.plans.find(s);
  if (it != w.plans.end()) return it->second;
  using dt = dnnl::memory::data_type;
  Plan p;
  p.a = dnnl::memory::desc({s.m, s.kp}, dt::bf16, dnnl::memory::dims{s.lda, 1});
  p.b = dnnl::memory::desc({s.kp, s.n}, dt::bf16, dnnl::memory::format_tag::BA16a16b2a);
  p.c = dnnl::memory::desc({s.m, s.n}, dt::f32, dnnl::memory::dims{s.ldc, 1});
  dnnl::primitive_attr attr;
  if (s.accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.f);
    attr.set_post_ops(ops);
  }
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(p.a, p.b, p.c), attr, w.engine);
  p.impl = pd.impl_info_str();
  p.matmul = dnnl::matmul(pd);
  return w.plans.emplace(s, std::move(p)).first->second;
}

// Rows equally spaced at least kp apart (x's rows in route order, or K
// chunks of them): their spacing, else 0.
int64_t row_spacing(const void* const* a_rows, int m, int64_t kp) {
  const bf16_t* a = static_cast<const bf16_t*>(a_rows[0]);
  if (m == 1) return kp;
  const std::ptrdiff_t step = static_cast<const bf16_t*>(a_rows[1]) - a;
  if (step < kp) return 0;
  for (int r = 2; r < m; ++r)
    if (a_rows[r] != a + r * step) return 0;
  return step;
}

// The plan a call runs: rows read in place where they are equally spaced
// and oneDNN has a kernel for that, else gathered (lda = kp); nullptr where
// oneDNN has only its reference loop for the shape (kt's kernel runs).
const Plan* choose_plan(WorkerState& w, const void* const* a_rows, int m, int64_t kp, int np,
                        int64_t ldc, bool accumulate, bool* gather) {
  const int64_t n = int64_t{np} * kPanelRows;
  const int64_t lda = row_spacing(a_rows, m, kp);
  *gather = lda == 0;
  if (lda != 0) {
    const Plan& p = plan_for(w, Shape{m, kp, lda, n, ldc, accumulate});
    if (!p.reference()) return &p;
    if (lda == kp) return nullptr;
    *gather = true;
  }
  const Plan& p = plan_for(w, Shape{m, kp, kp, n, ldc, accumulate});
  return p.reference() ? nullptr : &p;
}

void gemm_onednn(const Kernels& base, const void* const* a_rows, int m, int64_t kp, const bf16_t* panels,
                 int64_t panel_stride, int np, float* c, int64_t ldc, bool accumulate, const PrefetchRegion& next) {
  if (m <= 0) return;
  // The layout needs K in blocks of 32 and panels 16 * kp apart; other
  // shapes (none of the real models) run kt's kernel.
  if (kp % 32 != 0 || panel_stride != kPanelRows * kp) {
    base.gemm_bf16w(a_rows, m, kp, panels, panel_stride, np, c, ldc, accumulate, next);
    return;
  }
  WorkerState& w = worker_state();
  bool gather = false;
  const Plan* plan = choose_plan(w, a_rows, m, kp, np, ldc, accumulate, &gather);
  if (!plan) {
    base.gemm_bf16w(a_rows, m, kp, panels, panel_stride, np, c, ldc, accumulate, next);
    return;
  }
  count_kernel(kernel_id(KernelTable::kOneDnn, KernelEntry::kGemmBf16w),
               entry_flops::gemm(m, int64_t{kPanelRows} * np, kp));
  const bf16_t* a = static_cast<const bf16_t*>(a_rows[0]);
  if (gather) {
    w.rows.resize(static_cast<size_t>(m * kp));
    for (int r = 0; r < m; ++r)
      std::memcpy(w.rows.data() + r * kp, a_rows[r], static_cast<size_t>(kp) * sizeof(bf16_t));
    a = w.rows.data();
  }
  const Plan& p = *plan;
  dnnl::memory am(p.a, w.engine, const_cast<bf16_t*>(a));
  dnnl::memory bm(p.b, w.engine, const_cast<bf16_t*>(panels));
  dnnl::memory cm(p.c, w.engine, c);
  const OneOpenMpThread one_thread;
  p.matmul.execute(w.stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  w.stream.wait();
}

template <int I>
void gemm_onednn_over(const void* const* a_rows, int m, int64_t kp, const bf16_t* panels, int64_t panel_stride, int np,
                      float* c, int64_t ldc, bool accumulate, const PrefetchRegion& next) {
  gemm_onednn(*g_bases[I], a_rows, m, kp, panels, panel_stride, np, c, ldc, accumulate, next);
}

template <int I>
Kernels table_over(const Kernels& base) {
  g_bases[I] = &base;
  Kernels t = base;
  t.gemm_name = "gemm_bf16w_bf16_f32__onednn_brgemm";
  t.gemm_bf16w = gemm_onednn_over<I>;
  t.gemm_bf16w_fetches_panels = false;
  t.gemm_reads_spaced_rows = true;
  return t;
}

}  // namespace

bool onednn_compiled() { return true; }

std::string onednn_gemm_impl(const void* const* a_rows, int m, int64_t kp, int np, int64_t ldc,
                             bool accumulate) {
  if (m <= 0 || kp % 32 != 0) return "";
  bool gather = false;
  const Plan* p = choose_plan(worker_state(), a_rows, m, kp, np, ldc, accumulate, &gather);
  return p ? p->impl + (gather ? " (rows gathered)" : "") : "";
}

const Kernels* onednn_kernels(const Kernels& base) {
  if (base.a_elem_size != 2) return nullptr;  // oneDNN's bf16 matmul needs bf16 activations
  // One table per base with bf16 activations (avx512bf16, amx): shapes
  // oneDNN's layout does not take run that base's own kernel.
  if (base.isa == KT_ISA_AMX) {
    static const Kernels amx = table_over<1>(base);
    return &amx;
  }
  static const Kernels avx512 = table_over<0>(base);
  return &avx512;
}

}  // namespace kt

#else  // !KT_HAVE_ONEDNN

namespace kt {
bool onednn_compiled() { return false; }
const Kernels* onednn_kernels(const Kernels&) { return nullptr; }
std::string onednn_gemm_impl(const void* const*, int, int64_t, int, int64_t, bool) {
  return "";
}
}  // namespace kt

#endif
