#include "runtime/engine.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <strings.h>

#include "core/error.h"

namespace kt {

bool parse_isa(const char* text, kt_isa* out) {
  if (strcasecmp(text, "auto") == 0) {
    *out = KT_ISA_AUTO;
    return true;
  }
  for (kt_isa isa : {KT_ISA_REF, KT_ISA_AVX2, KT_ISA_AVX512BF16, KT_ISA_AMX})
    if (strcasecmp(text, kernel_isa_name(isa)) == 0) {
      *out = isa;
      return true;
    }
  return false;
}

kt_isa effective_isa_cap(kt_isa requested, const char* where) {
  kt_isa cap = requested == KT_ISA_AUTO ? KT_ISA_AMX : requested;
  const char* env = std::getenv("KT_MAX_ISA");
  if (!env || !*env) return cap;
  kt_isa env_cap;
  // A typo must not quietly change which kernels (and which precision) run.
  KT_CHECK(parse_isa(env, &env_cap), KT_ERR_INVALID_ARGUMENT,
           std::string(where) + ": environment variable KT_MAX_ISA = '" + env +
               "' is not a kernel level; accepted (any case): ref, avx2, avx512bf16, amx, auto");
  if (env_cap != KT_ISA_AUTO && env_cap < cap) cap = env_cap;
  return cap;
}

}  // namespace kt

kt_engine::kt_engine(const kt_engine_options& o, const kt::Topology* topology) {
  verbosity = o.verbosity;
  if (verbosity < 0) {
    const char* env = std::getenv("KT_VERBOSE");
    verbosity = env ? std::atoi(env) : 0;
  }
  log_fn = o.log_fn;
  log_user = o.log_user;
  cpu_isa = kt::detect_cpu_isa();
  precision = o.precision;
  kt_isa cap = kt::effective_isa_cap(o.max_isa, "kt_engine_create");
  // fp32 operands: the highest table whose weight GEMM reads fp32 rows.
  if (precision == KT_PRECISION_FP32 && cap > KT_ISA_AVX2) cap = KT_ISA_AVX2;
  native_kernels = &kt::select_kernels(cap);
  std::string auto_note;
  kernels = &kt::auto_gemm_kernels(*native_kernels, &auto_note);
  gemm_backend = kernels == native_kernels ? KT_GEMM_NATIVE : KT_GEMM_ONEDNN;
  std::vector<int> cpus = kt::allowed_cpus();
  const bool host_openmp = o.host_openmp != 0;
  int n = o.num_threads > 0 ? o.num_threads
          : host_openmp     ? kt::host_openmp_threads()
                            : static_cast<int>(cpus.size());
  // NUMA nodes only for kt's own workers, in a build that can bind memory.
  const bool split = o.numa == KT_NUMA_AUTO && !host_openmp && kt::numa_built();
  numa = kt::NumaLayout(split ? (topology ? *topology : kt::discover_topology(cpus)) : kt::Topology{}, n);
  const std::vector<int> pin = numa.split()                     ? numa.worker_cpus()
                               : o.pin_threads && !host_openmp ? cpus
                                                               : std::vector<int>{};
  pool.reset(new kt::ThreadPool(n, pin, host_openmp, numa.worker_nodes()));
  std::string nodes;
  for (int k = 0; k < numa.nodes() && numa.split(); ++k)
    nodes += (k ? ", " : "") + std::to_string(numa.workers_on(k)) + " on node " + std::to_string(numa.node_id(k));
  log(1, std::string("engine: cpu isa ") + kt::kernel_isa_name(cpu_isa) + ", kernels " +
             kt::kernel_isa_name(kernels->isa) + " (" + kernels->gemm_name + ")" +
             (precision == KT_PRECISION_FP32 ? " for fp32 precision" : "") + ", " + std::to_string(n) +
             " threads" +
             (host_openmp                  ? " (the caller's OpenMP threads)"
              : numa.split()               ? " pinned per NUMA node (" + nodes + ")"
              : o.pin_threads && n > 1     ? " pinned"
                                           : ""));
  if (!auto_note.empty()) log(1, "engine: " + auto_note);
}

kt_engine::~kt_engine() = default;

void kt_engine::set_gemm_backend(kt_gemm_backend backend) {
  const char* w = "kt_engine_set_gemm_backend";
  KT_CHECK(
      num_layers.load() == 0, KT_ERR_INVALID_ARGUMENT,
      std::string(w) + ": " + std::to_string(num_layers.load()) +
          " layer(s) were created on this engine with its current kernels; set the backend first");
  if (backend == KT_GEMM_ONEDNN) {
    const kt::Kernels* dnnl = kt::onednn_kernels(*native_kernels);
    KT_CHECK(dnnl != nullptr, KT_ERR_UNSUPPORTED,
             std::string(w) + ": KT_GEMM_ONEDNN needs " +
                 (kt::onednn_compiled()
                      ? "the avx512bf16 or amx kernels (bf16 operands); the engine runs " +
                            std::string(kt::kernel_isa_name(native_kernels->isa))
                      : std::string("a build with oneDNN (libdnnl-dev); this one has none")));
    kernels = dnnl;
    gemm_backend = KT_GEMM_ONEDNN;
  } else if (backend == KT_GEMM_AUTO) {
    std::string note;
    kernels = &kt::auto_gemm_kernels(*native_kernels, &note);
    gemm_backend = kernels == native_kernels ? KT_GEMM_NATIVE : KT_GEMM_ONEDNN;
  } else {
    kernels = native_kernels;
    gemm_backend = KT_GEMM_NATIVE;
  }
  log(1, std::string("engine: weight GEMMs by ") + kernels->gemm_name);
}

void kt_engine::log(int level, const std::string& message) const {
  if (level > verbosity) return;
  if (log_fn) {
    log_fn(level, message.c_str(), log_user);
  } else {
    std::fprintf(stderr, "kt: %s\n", message.c_str());
  }
}
