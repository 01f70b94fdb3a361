// kt_engine: kernels chosen for this CPU, the worker pool, the job thread
// that runs submitted (asynchronous) work (runtime/jobs.h), and logging. No globals: two
// engines in one process are independent.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "core/kernel_tally.h"
#include "kernels/kernels.h"
#include "kt_c_api.h"
#include "runtime/jobs.h"
#include "runtime/numa.h"
#include "runtime/thread_pool.h"

namespace kt {
struct MoeWorkspace;  // moe/workspace.h: the one its layers share
}

struct kt_engine {
  int verbosity = 0;
  kt_log_fn log_fn = nullptr;
  void* log_user = nullptr;
  const kt::Kernels* kernels = nullptr;         // what layers created now get
  const kt::Kernels* native_kernels = nullptr;  // kt's own for the ISA cap
  kt_gemm_backend gemm_backend = KT_GEMM_NATIVE;
  kt_precision precision = KT_PRECISION_DEFAULT;
  // kt_engine_set_gemm_backend (throws kt::Error).
  void set_gemm_backend(kt_gemm_backend backend);
  kt_isa cpu_isa = KT_ISA_REF;
  // The nodes the workers and the layers' experts are split over (one
  // unless options.numa is KT_NUMA_AUTO on several nodes); the pool's
  // worker groups are its nodes.
  kt::NumaLayout numa;
  std::unique_ptr<kt::ThreadPool> pool;
  // One computation at a time on the pool.
  std::mutex compute_mutex;
  std::atomic<int> num_layers{0};
  // Intermediates and scratch of a layer's computation, shared by its layers
  // (they compute one at a time); made by the first layer created.
  std::shared_ptr<kt::MoeWorkspace> moe_workspace;
  // Layer creation and engine destruction: no layer is created on an engine
  // once its destruction has begun.
  std::mutex lifetime_mutex;
  bool destroyed = false;
  std::atomic<int> num_optimizers{0};  // kt_optimizer on this engine (or its layers)

  // Per-stage profile (kt_stage): off by default.
  static constexpr int kStages = 12;
  std::atomic<bool> profiling{false};
  std::atomic<int64_t> stage_ns[kStages] = {};
  std::atomic<int64_t> stage_calls[kStages] = {};
  kt::KernelTally stage_kernels[kStages];  // the kernels each stage ran

  // topology: the nodes to split over with KT_NUMA_AUTO (null: the
  // machine's, discovered; tests give simulated ones).
  explicit kt_engine(const kt_engine_options& options, const kt::Topology* topology = nullptr);
  ~kt_engine();

  void log(int level, const std::string& message) const;
  // The job thread that runs non-deferred jobs.
  kt::JobRunner jobs;
};

namespace kt {

// Times consecutive stages into the engine's profile when profiling is on:
// enter(stage) ends the previous stage and starts the next; destruction ends
// the last one. While a stage runs, the kernels this thread (and the pool's
// runs it starts) calls count into that stage's tally.
class StageClock {
 public:
  explicit StageClock(kt_engine* engine)
      : engine_(engine->profiling.load(std::memory_order_relaxed) ? engine : nullptr),
        saved_tally_(current_kernel_tally()) {}
  ~StageClock() { stop(); }
  StageClock(const StageClock&) = delete;
  StageClock& operator=(const StageClock&) = delete;

  void enter(kt_stage stage) {
    if (!engine_) return;
    stop();
    stage_ = stage;
    current_kernel_tally() = &engine_->stage_kernels[stage];
    start_ = std::chrono::steady_clock::now();
  }
  void stop() {
    if (!engine_ || stage_ < 0) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - start_).count();
    engine_->stage_ns[stage_].fetch_add(ns, std::memory_order_relaxed);
    engine_->stage_calls[stage_].fetch_add(1, std::memory_order_relaxed);
    current_kernel_tally() = saved_tally_;
    stage_ = -1;
  }

 private:
  kt_engine* engine_;
  KernelTally* saved_tally_;
  int stage_ = -1;
  std::chrono::steady_clock::time_point start_;
};

// Resolves the ISA cap of options + env KT_MAX_ISA (the lower wins); an
// unknown KT_MAX_ISA value throws KT_ERR_INVALID_ARGUMENT naming `where`.
kt_isa effective_isa_cap(kt_isa requested, const char* where);
// Kernel level names, any case ("ref", "AVX2", ...).
bool parse_isa(const char* text, kt_isa* out);
}  // namespace kt
