// The ABI boundary: every exported function checks its handles and options,
// calls the core, and turns every exception into a status + thread-local
// message. Nothing thrown crosses this file.
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <new>
#include <string>

#include "api/guard.h"
#include "core/checked.h"
#include "core/error.h"
#include "core/sized_struct.h"
#include "kt_c_api.h"
#include "moe/moe_layer.h"
#include "optim/optimizer.h"
#include "runtime/engine.h"

#ifdef KT_HAVE_BUILD_INFO_H
#include "kt_build_info.h"
#endif
#ifndef KT_BUILD_INFO
#define KT_BUILD_INFO "unknown build"
#endif

namespace {
thread_local std::string t_last_error;
}  // namespace

namespace kt {

void set_last_error(const std::string& message) noexcept {
  try {
    t_last_error = message;
  } catch (...) {
    t_last_error.clear();  // out of memory for the message: the status still reports
  }
}

}  // namespace kt

namespace {

void set_error(const std::string& message) { kt::set_last_error(message); }

using kt::guarded;

void check_engine(const kt_engine* e, const char* where) {
  kt::check(e != nullptr, KT_ERR_INVALID_HANDLE, std::string(where) + ": engine is NULL");
  kt::check(e->magic == kt_engine::kMagic, KT_ERR_INVALID_HANDLE,
            std::string(where) + ": engine is not a live kt_engine (destroyed?)");
}

void check_moe(const kt_moe* m, const char* where) {
  kt::check(m != nullptr, KT_ERR_INVALID_HANDLE, std::string(where) + ": moe is NULL");
  kt::check(m->magic == kt_moe::kMagic, KT_ERR_INVALID_HANDLE,
            std::string(where) + ": moe is not a live kt_moe (destroyed?)");
}

bool finite(float v) { return std::isfinite(v); }

void validate_moe_options(const kt_moe_options& o) {
  const char* w = "kt_moe_create";
  using kt::check;
  auto range = [&](int64_t v, int64_t lo, int64_t hi, const char* name) {
    check(v >= lo && v <= hi, KT_ERR_INVALID_ARGUMENT,
          std::string(w) + ": options->" + name + " = " + std::to_string(v) + " is outside [" +
              std::to_string(lo) + ", " + std::to_string(hi) + "]");
  };
  range(o.num_experts, 1, 1 << 20, "num_experts");
  range(o.top_k, 1, o.num_experts, "top_k");
  range(o.hidden, 1, 1 << 20, "hidden");
  range(o.intermediate, 1, 1 << 20, "intermediate");
  range(o.max_tokens, 1, (int64_t{1} << 31) / o.top_k / 64, "max_tokens");
  // Enum fields as integers first: a C host may store any int in them.
  kt::check_enum(o.activation, KT_ACT_SILU, KT_ACT_SWIGLU_OAI, std::string(w) + ": options->activation",
                 "kt_activation");
  kt::check_enum(o.mode, KT_MODE_INFERENCE, KT_MODE_FULL, std::string(w) + ": options->mode", "kt_mode");
  check(kt::enum_bits(o.weight_format) == KT_FORMAT_BF16, KT_ERR_UNSUPPORTED,
        std::string(w) + ": options->weight_format = " + std::to_string(kt::enum_bits(o.weight_format)) +
            ": this kt stores bf16 weights only");
  check(finite(o.act_alpha) && o.act_alpha > 0.f, KT_ERR_INVALID_ARGUMENT,
        std::string(w) + ": options->act_alpha must be finite and > 0");
  check(finite(o.act_limit), KT_ERR_INVALID_ARGUMENT,
        std::string(w) + ": options->act_limit must be finite (<= 0 for none)");
  range(o.has_bias, 0, 1, "has_bias");
  if (o.mode == KT_MODE_LORA) {
    range(o.lora_rank, 1, 1024, "lora_rank");
    check(finite(o.lora_alpha), KT_ERR_INVALID_ARGUMENT,
          std::string(w) + ": options->lora_alpha must be finite");
    range(o.use_rslora, 0, 1, "use_rslora");
    check(o.lora_targets != 0 && (o.lora_targets & ~KT_PROJ_ALL) == 0, KT_ERR_INVALID_ARGUMENT,
          std::string(w) + ": options->lora_targets must be a non-empty set of KT_PROJ_* bits");
  }
}

// A layer is allocated when it is created: refuse one whose memory cannot be
// counted in 64 bits or exceeds the machine's physical memory, before any
// allocation (an allocation that still fails is KT_ERR_OUT_OF_MEMORY).
void check_layer_fits(const kt_moe_options& o, const kt_engine& engine, const char* w) {
  const kt::CheckedSize bytes =
      kt_moe::memory_bytes(o, engine.pool->size(), engine.kernels->a_elem_size);
  const std::string shape = "E=" + std::to_string(o.num_experts) + ", H=" + std::to_string(o.hidden) +
                            ", I=" + std::to_string(o.intermediate) +
                            ", max_tokens=" + std::to_string(o.max_tokens);
  kt::check(!bytes.overflow(), KT_ERR_INVALID_ARGUMENT,
            std::string(w) + ": options (" + shape + ") describe a layer of more than 2^63 bytes");
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return;
  const kt::CheckedSize physical = kt::CheckedSize(pages) * page;
  kt::check(physical.overflow() || bytes.value() <= physical.value(), KT_ERR_INVALID_ARGUMENT,
            std::string(w) + ": options (" + shape + ") describe a layer of " + std::to_string(bytes.value()) +
                " bytes (packed weights, biases, LoRA factors, workspaces), more than the " +
                std::to_string(physical.value()) + " bytes of this machine's physical memory");
}

// Ends a submitted job's bookkeeping on its layer.
void finish_job(kt_moe* m, kt_job* job) {
  std::lock_guard<std::mutex> lock(m->state_mutex);
  m->jobs.erase(job);
  if (m->jobs.empty()) m->jobs_done.notify_all();
}

void call_grad_hook(kt_moe* m) {
  kt_grad_ready_fn fn;
  void* user;
  {
    std::lock_guard<std::mutex> lock(m->state_mutex);
    fn = m->grad_hook;
    user = m->grad_hook_user;
  }
  if (fn) fn(m, user);
}

// Marks a forward's context after its run; frees it if the host already
// released it.
void settle_context(kt_moe* m, kt_context* ctx, bool ok) {
  bool release = false;
  {
    std::lock_guard<std::mutex> lock(m->state_mutex);
    ctx->state = ok ? kt_context::kReady : kt_context::kFailed;
    release = ctx->released;
  }
  if (release) m->release_context(ctx);
}

kt_job* new_job(kt_moe* m, unsigned flags) {
  kt_job* job = new kt_job;
  job->deferred = (flags & KT_SUBMIT_DEFERRED) != 0;
  job->engine = m->engine;
  std::lock_guard<std::mutex> lock(m->state_mutex);
  m->jobs.insert(job);
  return job;
}

void start_job(kt_moe* m, kt_job* job) {
  if (!job->deferred) m->engine->enqueue(job);
}

}  // namespace

extern "C" {

const char* kt_version(void) {
#define KT_STR2(x) #x
#define KT_STR(x) KT_STR2(x)
  return KT_STR(KT_VERSION_MAJOR) "." KT_STR(KT_VERSION_MINOR) "." KT_STR(KT_VERSION_PATCH);
}

int kt_version_number(void) {
  return KT_VERSION_MAJOR * 10000 + KT_VERSION_MINOR * 100 + KT_VERSION_PATCH;
}

int kt_abi_version(void) { return KT_ABI_VERSION; }

const char* kt_build_info(void) { return KT_BUILD_INFO; }

const char* kt_status_string(kt_status status) {
  switch (kt::enum_bits(status)) {
    case KT_OK: return "KT_OK";
    case KT_ERR_INVALID_ARGUMENT: return "KT_ERR_INVALID_ARGUMENT";
    case KT_ERR_NULL_POINTER: return "KT_ERR_NULL_POINTER";
    case KT_ERR_INVALID_HANDLE: return "KT_ERR_INVALID_HANDLE";
    case KT_ERR_DTYPE: return "KT_ERR_DTYPE";
    case KT_ERR_SHAPE: return "KT_ERR_SHAPE";
    case KT_ERR_STRIDE: return "KT_ERR_STRIDE";
    case KT_ERR_DEVICE: return "KT_ERR_DEVICE";
    case KT_ERR_EXPERT_ID: return "KT_ERR_EXPERT_ID";
    case KT_ERR_TOO_MANY_TOKENS: return "KT_ERR_TOO_MANY_TOKENS";
    case KT_ERR_CONTEXT: return "KT_ERR_CONTEXT";
    case KT_ERR_NOT_BOUND: return "KT_ERR_NOT_BOUND";
    case KT_ERR_NOT_LOADED: return "KT_ERR_NOT_LOADED";
    case KT_ERR_MODE: return "KT_ERR_MODE";
    case KT_ERR_UNSUPPORTED: return "KT_ERR_UNSUPPORTED";
    case KT_ERR_OUT_OF_MEMORY: return "KT_ERR_OUT_OF_MEMORY";
    case KT_ERR_IO: return "KT_ERR_IO";
    case KT_ERR_INTERNAL: return "KT_ERR_INTERNAL";
  }
  return "KT_ERR_UNKNOWN";
}

const char* kt_last_error(void) { return t_last_error.c_str(); }

void kt_clear_error(void) { t_last_error.clear(); }

kt_isa kt_cpu_isa(void) {
  try {
    return kt::detect_cpu_isa();
  } catch (...) {
    return KT_ISA_REF;
  }
}

const char* kt_isa_name(kt_isa isa) {
  switch (kt::enum_bits(isa)) {
    case KT_ISA_AUTO: return "auto";
    case KT_ISA_REF: return "ref";
    case KT_ISA_AVX2: return "avx2";
    case KT_ISA_AVX512BF16: return "avx512bf16";
    case KT_ISA_AMX: return "amx";
  }
  return "unknown";
}

namespace {
void set_engine_options_defaults(kt_engine_options& o) {
  o.num_threads = 0;
  o.pin_threads = 1;
  o.max_isa = KT_ISA_AUTO;
  o.verbosity = -1;
  o.precision = KT_PRECISION_DEFAULT;
}
}  // namespace

void kt_engine_options_defaults(kt_engine_options* o, size_t struct_size) {
  kt::write_defaults(o, struct_size, set_engine_options_defaults);
}

kt_status kt_engine_create(const kt_engine_options* options, kt_engine** engine) {
  const char* w = "kt_engine_create";
  return guarded(w, [&] {
    kt::check(engine != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": engine is NULL");
    kt_engine_options o = kt::read_sized(options, set_engine_options_defaults, w, "options");
    kt::check(o.num_threads >= 0 && o.num_threads <= 4096, KT_ERR_INVALID_ARGUMENT,
              std::string(w) + ": options->num_threads = " + std::to_string(o.num_threads) +
                  " is outside [0, 4096]");
    kt::check_enum(o.max_isa, KT_ISA_AUTO, KT_ISA_AMX, std::string(w) + ": options->max_isa", "kt_isa");
    kt::check(o.pin_threads == 0 || o.pin_threads == 1, KT_ERR_INVALID_ARGUMENT,
              std::string(w) + ": options->pin_threads must be 0 or 1");
    int precision;  // the raw value: a C caller may pass any int
    static_assert(sizeof(precision) == sizeof(o.precision), "kt_precision is int-sized");
    std::memcpy(&precision, &o.precision, sizeof(precision));
    kt::check(precision == KT_PRECISION_DEFAULT || precision == KT_PRECISION_FP32, KT_ERR_INVALID_ARGUMENT,
              std::string(w) + ": options->precision = " + std::to_string(precision) +
                  " is not a kt_precision (KT_PRECISION_DEFAULT 0, KT_PRECISION_FP32 1)");
    *engine = new kt_engine(o);
  });
}

kt_status kt_engine_destroy(kt_engine* engine) {
  const char* w = "kt_engine_destroy";
  if (!engine) return KT_OK;
  return guarded(w, [&] {
    check_engine(engine, w);
    kt::check(engine->num_layers.load() == 0, KT_ERR_INVALID_ARGUMENT,
              std::string(w) + ": " + std::to_string(engine->num_layers.load()) +
                  " layer(s) still use this engine; destroy them first");
    kt::check(engine->num_optimizers.load() == 0, KT_ERR_INVALID_ARGUMENT,
              std::string(w) + ": " + std::to_string(engine->num_optimizers.load()) +
                  " optimizer(s) still use this engine; destroy them first");
    engine->drain();
    delete engine;
  });
}

kt_status kt_engine_set_gemm_backend(kt_engine* engine, kt_gemm_backend backend) {
  const char* w = "kt_engine_set_gemm_backend";
  return guarded(w, [&] {
    check_engine(engine, w);
    kt::check_enum(backend, KT_GEMM_AUTO, KT_GEMM_ONEDNN, std::string(w) + ": backend", "kt_gemm_backend");
    engine->set_gemm_backend(backend);
  });
}

kt_status kt_engine_get_info(const kt_engine* engine, kt_engine_info* info) {
  const char* w = "kt_engine_get_info";
  return guarded(w, [&] {
    check_engine(engine, w);
    kt_engine_info full;
    std::memset(&full, 0, sizeof(full));
    full.struct_size = sizeof(full);
    full.num_threads = engine->pool->size();
    full.isa = engine->kernels->isa;
    full.cpu_isa = engine->cpu_isa;
    full.kernel_name = engine->kernels->gemm_name;
    full.gemm_backend = engine->gemm_backend;
    full.precision = engine->precision;
    kt::write_sized(info, full, w, "info");
  });
}

namespace {
void set_moe_options_defaults(kt_moe_options& o) {
  o.max_tokens = 1024;
  o.activation = KT_ACT_SILU;
  o.act_alpha = 1.702f;
  o.act_limit = 0.f;
  o.mode = KT_MODE_INFERENCE;
  o.weight_format = KT_FORMAT_BF16;
  o.lora_rank = 16;
  o.lora_alpha = 32.f;
  o.lora_targets = KT_PROJ_ALL;
}
}  // namespace

void kt_moe_options_defaults(kt_moe_options* o, size_t struct_size) {
  kt::write_defaults(o, struct_size, set_moe_options_defaults);
}

kt_status kt_moe_create(kt_engine* engine, const kt_moe_options* options, kt_moe** moe) {
  const char* w = "kt_moe_create";
  return guarded(w, [&] {
    check_engine(engine, w);
    kt::check(moe != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": moe is NULL");
    kt::check(options != nullptr, KT_ERR_NULL_POINTER,
              std::string(w) + ": options is NULL (the shapes are required)");
    kt_moe_options o = kt::read_sized(options, set_moe_options_defaults, w, "options");
    validate_moe_options(o);
    check_layer_fits(o, *engine, w);
    kt_moe* m = new kt_moe(engine, o);
    engine->log(1, "moe: E=" + std::to_string(o.num_experts) + " k=" + std::to_string(o.top_k) +
                       " H=" + std::to_string(o.hidden) + " I=" + std::to_string(o.intermediate) +
                       " mode=" + std::to_string(o.mode) + " kernels " + engine->kernels->gemm_name);
    *moe = m;
  });
}

void kt_moe_destroy(kt_moe* moe) {
  if (!moe || moe->magic != kt_moe::kMagic) return;
  try {
    std::vector<kt_job*> deferred;
    {
      std::lock_guard<std::mutex> lock(moe->state_mutex);
      for (kt_job* j : moe->jobs)
        if (j->deferred) deferred.push_back(j);
    }
    for (kt_job* j : deferred) {
      std::lock_guard<std::mutex> lock(j->mutex);
      if (j->state == 0) {  // never run: cancel so it cannot touch the layer
        j->state = 2;
        j->status = KT_ERR_INVALID_HANDLE;
        j->message = "kt_job: its layer was destroyed before the job ran";
        j->work = nullptr;
        j->cv.notify_all();
        std::lock_guard<std::mutex> l2(moe->state_mutex);
        moe->jobs.erase(j);
      }
    }
    {
      std::unique_lock<std::mutex> lock(moe->state_mutex);
      moe->jobs_done.wait(lock, [&] { return moe->jobs.empty(); });
    }
    std::lock_guard<std::mutex> lock(moe->engine->compute_mutex);
    kt::optim::detach_layer(moe);
    delete moe;
  } catch (...) {
    // Destruction cannot report; nothing here throws in practice.
  }
}

kt_status kt_moe_lora_scale(const kt_moe* moe, float* scale) {
  const char* w = "kt_moe_lora_scale";
  return guarded(w, [&] {
    check_moe(moe, w);
    kt::check(scale != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": scale is NULL");
    *scale = moe->lora_scale;
  });
}

namespace {
void set_load_options_defaults(kt_load_options& o) {
  o.orientation = KT_ORIENT_OUT_IN;
  o.gate_up_order = KT_GATE_UP_CONCAT;
}
}  // namespace

void kt_load_options_defaults(kt_load_options* o, size_t struct_size) {
  kt::write_defaults(o, struct_size, set_load_options_defaults);
}

kt_status kt_moe_load_weights(kt_moe* moe, const kt_load_options* options, const kt_arg* args,
                              size_t num_args) {
  const char* w = "kt_moe_load_weights";
  return guarded(w, [&] {
    check_moe(moe, w);
    kt_load_options o = kt::read_sized(options, set_load_options_defaults, w, "options");
    std::lock_guard<std::mutex> lock(moe->engine->compute_mutex);
    moe->load(o, args, num_args, -1, w);
  });
}

kt_status kt_moe_load_expert(kt_moe* moe, int64_t expert, const kt_load_options* options,
                             const kt_arg* args, size_t num_args) {
  const char* w = "kt_moe_load_expert";
  return guarded(w, [&] {
    check_moe(moe, w);
    kt::check(expert >= 0 && expert < moe->E, KT_ERR_EXPERT_ID,
              std::string(w) + ": expert " + std::to_string(expert) + " is outside [0, " +
                  std::to_string(moe->E) + ")");
    kt_load_options o = kt::read_sized(options, set_load_options_defaults, w, "options");
    std::lock_guard<std::mutex> lock(moe->engine->compute_mutex);
    moe->load(o, args, num_args, expert, w);
  });
}

kt_status kt_moe_set_skipped(kt_moe* moe, const DLTensor* mask) {
  const char* w = "kt_moe_set_skipped";
  return guarded(w, [&] {
    check_moe(moe, w);
    std::lock_guard<std::mutex> lock(moe->engine->compute_mutex);
    moe->set_skipped(mask);
  });
}

kt_status kt_moe_num_loaded(const kt_moe* moe, int64_t* count) {
  const char* w = "kt_moe_num_loaded";
  return guarded(w, [&] {
    check_moe(moe, w);
    kt::check(count != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": count is NULL");
    std::lock_guard<std::mutex> lock(moe->engine->compute_mutex);
    *count = moe->num_loaded();
  });
}

kt_status kt_moe_bind(kt_moe* moe, const kt_arg* args, size_t num_args) {
  const char* w = "kt_moe_bind";
  return guarded(w, [&] {
    check_moe(moe, w);
    std::lock_guard<std::mutex> lock(moe->engine->compute_mutex);
    moe->bind(args, num_args);
  });
}

kt_status kt_moe_params_changed(kt_moe* moe) {
  const char* w = "kt_moe_params_changed";
  return guarded(w, [&] {
    check_moe(moe, w);
    std::lock_guard<std::mutex> lock(moe->engine->compute_mutex);
    moe->params_changed();
  });
}

kt_status kt_moe_set_grad_hook(kt_moe* moe, kt_grad_ready_fn fn, void* user) {
  const char* w = "kt_moe_set_grad_hook";
  return guarded(w, [&] {
    check_moe(moe, w);
    std::lock_guard<std::mutex> lock(moe->state_mutex);
    moe->grad_hook = fn;
    moe->grad_hook_user = fn ? user : nullptr;
  });
}

kt_status kt_moe_forward(kt_moe* moe, const kt_arg* args, size_t num_args, kt_context** saved) {
  const char* w = "kt_moe_forward";
  return guarded(w, [&] {
    check_moe(moe, w);
    std::lock_guard<std::mutex> lock(moe->engine->compute_mutex);
    kt_moe::ForwardCall call = moe->check_forward(args, num_args, w);
    if (moe->engine->verbosity >= 2)
      moe->engine->log(2, "forward: T=" + std::to_string(call.T) + (saved ? " (saving a context)" : ""));
    kt_context* ctx = saved ? moe->new_context(call) : nullptr;
    try {
      moe->forward(call, ctx);
    } catch (...) {
      if (ctx) {
        settle_context(moe, ctx, false);
        moe->release_context(ctx);
      }
      throw;
    }
    if (ctx) {
      settle_context(moe, ctx, true);
      *saved = ctx;
    }
  });
}

namespace {
void set_backward_options_defaults(kt_backward_options& o) {
  o.grad_scale = 1.f;
  o.accumulate = KT_GRAD_OVERWRITE;
  o.param_grads = 1;
}
}  // namespace

void kt_backward_options_defaults(kt_backward_options* o, size_t struct_size) {
  kt::write_defaults(o, struct_size, set_backward_options_defaults);
}

kt_status kt_moe_backward(kt_moe* moe, kt_context* ctx, const kt_backward_options* options,
                          const kt_arg* args, size_t num_args) {
  const char* w = "kt_moe_backward";
  bool hook = false;
  kt_status st = guarded(w, [&] {
    check_moe(moe, w);
    std::lock_guard<std::mutex> lock(moe->engine->compute_mutex);
    kt_moe::BackwardCall call = moe->check_backward(ctx, options, args, num_args, w);
    {
      std::lock_guard<std::mutex> l(moe->state_mutex);
      kt::check(!ctx->backward_queued, KT_ERR_CONTEXT,
                std::string(w) + ": ctx already has a backward submitted");
    }
    if (moe->engine->verbosity >= 2)
      moe->engine->log(2, "backward: T=" + std::to_string(ctx->tokens) +
                              " grad_scale=" + std::to_string(call.opt.grad_scale) +
                              (call.opt.accumulate ? " accumulate" : " overwrite"));
    moe->backward(ctx, call);
    hook = call.opt.param_grads && moe->opt.mode != KT_MODE_INFERENCE;
  });
  if (st == KT_OK && hook) call_grad_hook(moe);
  return st;
}

void kt_context_release(kt_context* ctx) {
  if (!ctx || ctx->magic != kt_context::kMagic || !ctx->layer) return;
  try {
    ctx->layer->release_context(ctx);
  } catch (...) {
  }
}

kt_status kt_moe_forward_submit(kt_moe* moe, const kt_arg* args, size_t num_args,
                                kt_context** saved, unsigned flags, kt_job** job) {
  const char* w = "kt_moe_forward_submit";
  return guarded(w, [&] {
    check_moe(moe, w);
    kt::check(job != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": job is NULL");
    kt::check((flags & ~KT_SUBMIT_DEFERRED) == 0, KT_ERR_INVALID_ARGUMENT,
              std::string(w) + ": unknown flags");
    kt_moe::ForwardCall call = moe->check_forward(args, num_args, w);
    kt_context* ctx = saved ? moe->new_context(call) : nullptr;
    kt_job* j = new_job(moe, flags);
    kt_engine* engine = moe->engine;
    j->work = [moe, call, ctx, j, engine] {
      bool ok = false;
      try {
        {
          std::lock_guard<std::mutex> lock(engine->compute_mutex);
          moe->forward(call, ctx);
        }
        ok = true;
      } catch (...) {
        if (ctx) settle_context(moe, ctx, false);
        finish_job(moe, j);
        throw;
      }
      if (ctx) settle_context(moe, ctx, ok);
      finish_job(moe, j);
    };
    if (saved) *saved = ctx;
    *job = j;
    start_job(moe, j);
  });
}

kt_status kt_moe_backward_submit(kt_moe* moe, kt_context* ctx, const kt_backward_options* options,
                                 const kt_arg* args, size_t num_args, unsigned flags,
                                 kt_job** job) {
  const char* w = "kt_moe_backward_submit";
  return guarded(w, [&] {
    check_moe(moe, w);
    kt::check(job != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": job is NULL");
    kt::check((flags & ~KT_SUBMIT_DEFERRED) == 0, KT_ERR_INVALID_ARGUMENT,
              std::string(w) + ": unknown flags");
    kt_moe::BackwardCall call;
    {
      // A context whose forward job is queued may be submitted against: the
      // job thread runs jobs in order. Mark it so it is not submitted twice.
      kt::check(ctx != nullptr, KT_ERR_CONTEXT, std::string(w) + ": ctx is NULL");
      std::unique_lock<std::mutex> lock(moe->state_mutex);
      kt::check(moe->owns(ctx) && !ctx->released, KT_ERR_CONTEXT,
                std::string(w) + ": ctx does not belong to this layer or was released");
      kt::check(!ctx->backward_queued && ctx->state != kt_context::kSpent, KT_ERR_CONTEXT,
                std::string(w) + ": ctx is spent or already has a backward submitted");
      kt::check(ctx->state != kt_context::kFailed, KT_ERR_CONTEXT,
                std::string(w) + ": ctx: its forward failed");
      const auto state = ctx->state;
      ctx->state = kt_context::kReady;  // let the argument check pass
      lock.unlock();
      try {
        call = moe->check_backward(ctx, options, args, num_args, w);
      } catch (...) {
        std::lock_guard<std::mutex> l(moe->state_mutex);
        ctx->state = state;
        throw;
      }
      lock.lock();
      ctx->state = state;
      ctx->backward_queued = true;
    }
    kt_job* j = new_job(moe, flags);
    kt_engine* engine = moe->engine;
    j->work = [moe, call, ctx, j, engine] {
      try {
        {
          std::lock_guard<std::mutex> lock(engine->compute_mutex);
          moe->backward(ctx, call);
        }
      } catch (...) {
        {
          std::lock_guard<std::mutex> l(moe->state_mutex);
          ctx->backward_queued = false;
        }
        finish_job(moe, j);
        throw;
      }
      if (call.opt.param_grads && moe->opt.mode != KT_MODE_INFERENCE) call_grad_hook(moe);
      finish_job(moe, j);
    };
    *job = j;
    start_job(moe, j);
  });
}

const char* kt_stage_name(int stage) {
  static const char* const names[kt_engine::kStages] = {
      "route", "pack_input", "lora_a", "gate_up", "down", "bwd_down",
      "bwd_lora", "bwd_dx", "bwd_route", "lora_grads", "full_grads"};
  return stage >= 0 && stage < kt_engine::kStages ? names[stage] : nullptr;
}

kt_status kt_engine_set_profiling(kt_engine* engine, int enabled) {
  const char* w = "kt_engine_set_profiling";
  return guarded(w, [&] {
    check_engine(engine, w);
    engine->profiling.store(enabled != 0);
  });
}

kt_status kt_engine_profile_stage(const kt_engine* engine, int stage, int64_t* calls, double* seconds) {
  const char* w = "kt_engine_profile_stage";
  return guarded(w, [&] {
    check_engine(engine, w);
    kt::check(stage >= 0 && stage < kt_engine::kStages, KT_ERR_INVALID_ARGUMENT,
              std::string(w) + ": stage " + std::to_string(stage) + " is outside [0, " +
                  std::to_string(kt_engine::kStages) + ")");
    if (calls) *calls = engine->stage_calls[stage].load();
    if (seconds) *seconds = static_cast<double>(engine->stage_ns[stage].load()) * 1e-9;
  });
}

kt_status kt_engine_reset_profile(kt_engine* engine) {
  const char* w = "kt_engine_reset_profile";
  return guarded(w, [&] {
    check_engine(engine, w);
    for (int i = 0; i < kt_engine::kStages; ++i) {
      engine->stage_ns[i].store(0);
      engine->stage_calls[i].store(0);
    }
  });
}

void kt_job_run(void* job) {
  kt_job* j = static_cast<kt_job*>(job);
  if (!j || !j->deferred) return;
  j->execute();
}

kt_status kt_job_wait(kt_job* job) {
  if (!job) {
    set_error("kt_job_wait: job is NULL");
    return KT_ERR_INVALID_HANDLE;
  }
  job->wait();
  if (job->status != KT_OK) set_error(job->message);
  return job->status;
}

int kt_job_done(const kt_job* job) {
  if (!job) return 1;
  kt_job* j = const_cast<kt_job*>(job);
  std::lock_guard<std::mutex> lock(j->mutex);
  return j->state == 2;
}

void kt_job_destroy(kt_job* job) {
  if (!job) return;
  job->wait();
  delete job;
}

}  // extern "C"
