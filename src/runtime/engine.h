// kt_engine: kernels chosen for this CPU, the worker pool, the job thread
// that runs submitted (asynchronous) work, and logging. No globals: two
// engines in one process are independent.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "kernels/kernels.h"
#include "kt_c_api.h"
#include "runtime/thread_pool.h"

// A unit of submitted work. Its closure owns copies of the argument
// descriptors; the tensors' memory stays the host's.
struct kt_job {
  std::function<void()> work;  // throws kt::Error on failure
  bool deferred = false;
  std::mutex mutex;
  std::condition_variable cv;
  int state = 0;  // 0 waiting, 1 running, 2 ended
  kt_status status = KT_OK;
  std::string message;
  kt_engine* engine = nullptr;

  // Runs the work on the calling thread once; later calls return at once.
  void execute();
  void wait();
};

struct kt_engine {
  static constexpr uint32_t kMagic = 0x6b74656eu;  // "kten"
  uint32_t magic = kMagic;
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
  std::unique_ptr<kt::ThreadPool> pool;
  // One computation at a time on the pool.
  std::mutex compute_mutex;
  std::atomic<int> num_layers{0};
  std::atomic<int> num_optimizers{0};  // kt_optimizer on this engine (or its layers)

  // Per-stage profile (kt_stage): off by default.
  static constexpr int kStages = 11;
  std::atomic<bool> profiling{false};
  std::atomic<int64_t> stage_ns[kStages] = {};
  std::atomic<int64_t> stage_calls[kStages] = {};

  explicit kt_engine(const kt_engine_options& options);
  ~kt_engine();

  void log(int level, const std::string& message) const;
  // Queues a non-deferred job on the job thread.
  void enqueue(kt_job* job);
  // Blocks until every queued job has ended.
  void drain();

 private:
  void job_loop();
  std::mutex jobs_mutex_;
  std::condition_variable jobs_cv_;
  std::condition_variable idle_cv_;
  std::deque<kt_job*> queue_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread job_thread_;
};

namespace kt {

// Times consecutive stages into the engine's profile when profiling is on:
// enter(stage) ends the previous stage and starts the next; destruction ends
// the last one.
class StageClock {
 public:
  explicit StageClock(kt_engine* engine)
      : engine_(engine->profiling.load(std::memory_order_relaxed) ? engine : nullptr) {}
  ~StageClock() { stop(); }
  StageClock(const StageClock&) = delete;
  StageClock& operator=(const StageClock&) = delete;

  void enter(kt_stage stage) {
    if (!engine_) return;
    stop();
    stage_ = stage;
    start_ = std::chrono::steady_clock::now();
  }
  void stop() {
    if (!engine_ || stage_ < 0) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - start_).count();
    engine_->stage_ns[stage_].fetch_add(ns, std::memory_order_relaxed);
    engine_->stage_calls[stage_].fetch_add(1, std::memory_order_relaxed);
    stage_ = -1;
  }

 private:
  kt_engine* engine_;
  int stage_ = -1;
  std::chrono::steady_clock::time_point start_;
};

// Resolves the ISA cap of options + env KT_MAX_ISA (the lower wins); an
// unknown KT_MAX_ISA value throws KT_ERR_INVALID_ARGUMENT naming `where`.
kt_isa effective_isa_cap(kt_isa requested, const char* where);
// Kernel level names, any case ("ref", "AVX2", ...).
bool parse_isa(const char* text, kt_isa* out);
}  // namespace kt
