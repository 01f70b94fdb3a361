// The engine calls of the ABI: options, create/destroy, GEMM backend, info,
// and the per-stage and per-kernel profile.
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "api/engine_create.h"
#include "api/guard.h"
#include "api/live.h"
#include "core/checked.h"
#include "core/error.h"
#include "core/kernel_tally.h"
#include "core/sized_struct.h"
#include "kt_c_api.h"
#include "runtime/engine.h"

using kt::guarded;
using kt::HandleKind;
using kt::live_engine;

extern "C" {

namespace {
void set_engine_options_defaults(kt_engine_options& o) {
  o.num_threads = 0;
  o.pin_threads = 1;
  o.max_isa = KT_ISA_AUTO;
  o.verbosity = -1;
  o.precision = KT_PRECISION_DEFAULT;
  o.numa = KT_NUMA_OFF;
}
}  // namespace

void kt_engine_options_defaults(kt_engine_options* o, size_t struct_size) {
  kt::write_defaults(o, struct_size, set_engine_options_defaults);
}

kt_status kt_engine_create(const kt_engine_options* options, kt_engine** engine) {
  return kt::engine_create_on(options, nullptr, engine);
}

}  // extern "C"

kt_status kt::engine_create_on(const kt_engine_options* options, const Topology* topology, kt_engine** engine) {
  const char* w = "kt_engine_create";
  return guarded(w, [&] {
    KT_CHECK(engine != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": engine is NULL");
    kt_engine_options o = kt::read_sized(options, set_engine_options_defaults, w, "options");
    KT_CHECK(o.num_threads >= 0 && o.num_threads <= 4096, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": options->num_threads = " + std::to_string(o.num_threads) +
                 " is outside [0, 4096]");
    kt::check_enum(o.max_isa, KT_ISA_AUTO, KT_ISA_AMX, std::string(w) + ": options->max_isa", "kt_isa");
    KT_CHECK(o.pin_threads == 0 || o.pin_threads == 1, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": options->pin_threads must be 0 or 1");
    KT_CHECK(o.host_openmp == 0 || o.host_openmp == 1, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": options->host_openmp must be 0 or 1");
    KT_CHECK(o.host_openmp == 0 || kt::host_openmp_built(), KT_ERR_UNSUPPORTED,
             std::string(w) + ": options->host_openmp = 1 needs a kt built with OpenMP; this one has none");
    int precision;  // the raw value: a C caller may pass any int
    static_assert(sizeof(precision) == sizeof(o.precision), "kt_precision is int-sized");
    std::memcpy(&precision, &o.precision, sizeof(precision));
    KT_CHECK(precision == KT_PRECISION_DEFAULT || precision == KT_PRECISION_FP32,
             KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": options->precision = " + std::to_string(precision) +
                 " is not a kt_precision (KT_PRECISION_DEFAULT 0, KT_PRECISION_FP32 1)");
    kt::check_enum(o.numa, KT_NUMA_OFF, KT_NUMA_AUTO, std::string(w) + ": options->numa", "kt_numa_mode");
    auto e = std::make_shared<kt_engine>(o, topology);
    *engine = kt::handle_value<kt_engine>(kt::add_handle(HandleKind::kEngine, e));
  });
}

extern "C" {

kt_status kt_engine_destroy(kt_engine* engine) {
  const char* w = "kt_engine_destroy";
  if (!engine) return KT_OK;
  return guarded(w, [&] {
    const std::shared_ptr<kt_engine> eng = live_engine(engine, w);
    {
      std::lock_guard<std::mutex> lock(eng->lifetime_mutex);
      KT_CHECK(eng->num_layers.load() == 0, KT_ERR_INVALID_ARGUMENT,
               std::string(w) + ": " + std::to_string(eng->num_layers.load()) +
                   " layer(s) still use this engine; destroy them first");
      KT_CHECK(eng->num_optimizers.load() == 0, KT_ERR_INVALID_ARGUMENT,
               std::string(w) + ": " + std::to_string(eng->num_optimizers.load()) +
                   " optimizer(s) still use this engine; destroy them first");
      KT_CHECK(!eng->destroyed, KT_ERR_INVALID_HANDLE,
               std::string(w) + ": engine is being destroyed by another thread");
      eng->destroyed = true;
    }
    kt::remove_handle(kt::handle_id(engine), HandleKind::kEngine);
    eng->jobs.drain();
    // Freed here, or when another thread's call on it returns.
  });
}

kt_status kt_engine_set_gemm_backend(kt_engine* engine, kt_gemm_backend backend) {
  const char* w = "kt_engine_set_gemm_backend";
  return guarded(w, [&] {
    const std::shared_ptr<kt_engine> eng = live_engine(engine, w);
    kt::check_enum(backend, KT_GEMM_AUTO, KT_GEMM_ONEDNN, std::string(w) + ": backend", "kt_gemm_backend");
    eng->set_gemm_backend(backend);
  });
}

kt_status kt_engine_get_info(const kt_engine* engine, kt_engine_info* info) {
  const char* w = "kt_engine_get_info";
  return guarded(w, [&] {
    const std::shared_ptr<kt_engine> eng = live_engine(engine, w);
    kt_engine_info full;
    std::memset(&full, 0, sizeof(full));
    full.struct_size = sizeof(full);
    full.num_threads = eng->pool->size();
    full.isa = eng->kernels->isa;
    full.cpu_isa = eng->cpu_isa;
    full.kernel_name = eng->kernels->gemm_name;
    full.gemm_backend = eng->gemm_backend;
    full.precision = eng->precision;
    full.numa_nodes = eng->numa.nodes();
    full.numa_node_workers = eng->numa.workers_per_node().data();
    kt::write_sized(info, full, w, "info");
  });
}

namespace {
// A profile index: KT_ERR_INVALID_ARGUMENT outside [0, count).
void check_in_range(const char* where, const char* what, int value, int count) {
  KT_CHECK(value >= 0 && value < count, KT_ERR_INVALID_ARGUMENT,
           std::string(where) + ": " + what + " " + std::to_string(value) + " is outside [0, " +
               std::to_string(count) + ")");
}
}  // namespace

const char* kt_stage_name(int stage) {
  static const char* const names[kt_engine::kStages] = {
      "route",    "pack_input", "lora_a",    "gate_up",    "down",       "bwd_down",
      "bwd_lora", "bwd_dx",     "bwd_route", "lora_grads", "full_grads", "experts"};
  return stage >= 0 && stage < kt_engine::kStages ? names[stage] : nullptr;
}

kt_status kt_engine_set_profiling(kt_engine* engine, int enabled) {
  const char* w = "kt_engine_set_profiling";
  return guarded(w, [&] {
    const std::shared_ptr<kt_engine> eng = live_engine(engine, w);
    eng->profiling.store(enabled != 0);
  });
}

kt_status kt_engine_profile_stage(const kt_engine* engine, int stage, int64_t* calls, double* seconds) {
  const char* w = "kt_engine_profile_stage";
  return guarded(w, [&] {
    const std::shared_ptr<kt_engine> eng = live_engine(engine, w);
    check_in_range(w, "stage", stage, kt_engine::kStages);
    if (calls) *calls = eng->stage_calls[stage].load();
    if (seconds) *seconds = static_cast<double>(eng->stage_ns[stage].load()) * 1e-9;
  });
}

kt_status kt_engine_reset_profile(kt_engine* engine) {
  const char* w = "kt_engine_reset_profile";
  return guarded(w, [&] {
    const std::shared_ptr<kt_engine> eng = live_engine(engine, w);
    for (int i = 0; i < kt_engine::kStages; ++i) {
      eng->stage_ns[i].store(0);
      eng->stage_calls[i].store(0);
      eng->stage_kernels[i].reset();
    }
  });
}

const char* kt_kernel_name(int kernel) {
  return kt::kernel_id_name(kernel);
}

kt_status kt_engine_profile_kernel(const kt_engine* engine, int stage, int kernel, int64_t* calls,
                                   int64_t* flops) {
  const char* w = "kt_engine_profile_kernel";
  return guarded(w, [&] {
    const std::shared_ptr<kt_engine> eng = live_engine(engine, w);
    check_in_range(w, "stage", stage, kt_engine::kStages);
    check_in_range(w, "kernel", kernel, kt::kKernelIds);
    const kt::KernelTally& t = eng->stage_kernels[stage];
    if (calls) *calls = t.calls[kernel].load();
    if (flops) *flops = t.flops[kernel].load();
  });
}

}  // extern "C"
