// The layer and job calls of the ABI (kt_moe_*, kt_context_release, kt_job_*):
// every one checks its handles and options, calls the core, and turns every
// exception into a status + thread-local message (kt::guarded).
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <new>
#include <string>

#include "api/guard.h"
#include "api/live.h"
#include "core/checked.h"
#include "core/error.h"
#include "core/kernel_tally.h"
#include "core/sized_struct.h"
#include "kt_c_api.h"
#include "moe/moe_layer.h"
#include "optim/optimizer.h"
#include "runtime/engine.h"


namespace {

void set_error(const std::string& message) { kt::set_last_error(message); }

using kt::guarded;

using kt::HandleId;
using kt::HandleKind;

using kt::live_engine;
using kt::live_moe;

bool finite(float v) { return std::isfinite(v); }

void validate_moe_options(const kt_moe_options& o) {
  const char* w = "kt_moe_create";
  auto range = [&](int64_t v, int64_t lo, int64_t hi, const char* name) {
    KT_CHECK(v >= lo && v <= hi, KT_ERR_INVALID_ARGUMENT,
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
  const int64_t format = kt::enum_bits(o.weight_format);
  KT_CHECK(format >= KT_FORMAT_BF16 && format <= KT_FORMAT_INT4_G128_ZP, KT_ERR_UNSUPPORTED,
           std::string(w) + ": options->weight_format = " + std::to_string(format) +
               " is not a storage format of this kt (bf16, int8_channel, int4_g32, fp8_b128, "
               "mxfp4, int4_g128, "
               "int4_g32_zp, int4_g128_zp)");
  KT_CHECK(!kt::is_quantized(o.weight_format) || o.mode != KT_MODE_FULL, KT_ERR_MODE,
           std::string(w) + ": options->weight_format " + kt_weight_format_name(o.weight_format) +
               " is a frozen quantized base: KT_MODE_FULL trains the base weights and needs "
               "KT_FORMAT_BF16 "
               "(train LoRA on the quantized base with KT_MODE_LORA)");
  kt::check_enum(o.compute, KT_COMPUTE_BF16, KT_COMPUTE_INT8, std::string(w) + ": options->compute",
                 "kt_compute");
  if (o.compute == KT_COMPUTE_INT8) {
    KT_CHECK(kt::int8_compute_takes(o.weight_format), KT_ERR_UNSUPPORTED,
             std::string(w) +
                 ": options->compute KT_COMPUTE_INT8 multiplies integer codes (int8_channel, "
                 "int4_g32, int4_g128, int4_g32_zp, int4_g128_zp, and mxfp4's e2m1 doubled); "
                 "options->weight_format is " +
                 kt_weight_format_name(o.weight_format));
    KT_CHECK(o.mode == KT_MODE_INFERENCE, KT_ERR_MODE,
             std::string(w) +
                 ": options->compute KT_COMPUTE_INT8 is for inference: options->mode must be "
                 "KT_MODE_INFERENCE (int8 activations have no backward)");
    KT_CHECK(o.hidden <= kt::kInt8ComputeMaxK && o.intermediate <= kt::kInt8ComputeMaxK,
             KT_ERR_UNSUPPORTED,
             std::string(w) +
                 ": options->compute KT_COMPUTE_INT8 takes hidden and intermediate up to " +
                 std::to_string(kt::kInt8ComputeMaxK) + " (exact int32 sums); the layer has " +
                 std::to_string(o.hidden) + " and " + std::to_string(o.intermediate));
  }
  KT_CHECK(finite(o.act_alpha) && o.act_alpha > 0.f, KT_ERR_INVALID_ARGUMENT,
           std::string(w) + ": options->act_alpha must be finite and > 0");
  KT_CHECK(finite(o.act_limit), KT_ERR_INVALID_ARGUMENT,
           std::string(w) + ": options->act_limit must be finite (<= 0 for none)");
  range(o.has_bias, 0, 1, "has_bias");
  if (o.mode == KT_MODE_LORA) {
    range(o.lora_rank, 1, 1024, "lora_rank");
    KT_CHECK(finite(o.lora_alpha), KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": options->lora_alpha must be finite");
    range(o.use_rslora, 0, 1, "use_rslora");
    KT_CHECK(o.lora_targets != 0 && (o.lora_targets & ~KT_PROJ_ALL) == 0, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": options->lora_targets must be a non-empty set of KT_PROJ_* bits");
  }
}

// A layer is allocated when it is created: refuse one whose memory cannot be
// counted in 64 bits or exceeds the machine's physical memory, before any
// allocation (an allocation that still fails is KT_ERR_OUT_OF_MEMORY).
void check_layer_fits(const kt_moe_options& o, const kt_engine& engine, const char* w) {
  const kt::CheckedSize bytes = kt_moe::memory_bytes(
      o, engine.pool->size(), engine.kernels->a_elem_size, engine.kernels->gemm_reads_spaced_rows);
  const std::string shape = "E=" + std::to_string(o.num_experts) + ", H=" + std::to_string(o.hidden) +
                            ", I=" + std::to_string(o.intermediate) +
                            ", max_tokens=" + std::to_string(o.max_tokens);
  KT_CHECK(!bytes.overflow(), KT_ERR_INVALID_ARGUMENT,
           std::string(w) + ": options (" + shape + ") describe a layer of more than 2^63 bytes");
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return;
  const kt::CheckedSize physical = kt::CheckedSize(pages) * page;
  KT_CHECK(physical.overflow() || bytes.value() <= physical.value(), KT_ERR_INVALID_ARGUMENT,
           std::string(w) + ": options (" + shape + ") describe a layer of " +
               std::to_string(bytes.value()) +
               " bytes (packed weights, biases, LoRA factors, workspaces), more than the " +
               std::to_string(physical.value()) + " bytes of this machine's physical memory");
}

// Ends a submitted job's bookkeeping on its layer. The job's closure keeps
// the layer alive; after this, kt_moe_destroy may return.
void finish_job(kt_moe* m, kt_job* job) {
  std::shared_ptr<kt_job> mine;  // dropped after the lock
  std::lock_guard<std::mutex> lock(m->state_mutex);
  auto it = m->jobs.find(job);
  if (it != m->jobs.end()) {
    mine = std::move(it->second);
    m->jobs.erase(it);
  }
  if (m->jobs.empty()) m->jobs_done.notify_all();
}

struct GradHook {
  kt_grad_ready_fn fn = nullptr;
  void* user = nullptr;
  HandleId layer = 0;
  // The hook gets the layer's handle; it runs when kt no longer holds the
  // layer (it may call kt, even destroy the layer).
  void call() const {
    if (fn) fn(kt::handle_value<kt_moe>(layer), user);
  }
};

GradHook grad_hook_of(kt_moe* m) {
  std::lock_guard<std::mutex> lock(m->state_mutex);
  return GradHook{m->grad_hook, m->grad_hook_user, m->handle};
}

// Marks a submitted forward's context after its run and ends the job's hold
// (freeing the context if the host released it meanwhile).
void settle_context(kt_moe* m, kt_context* ctx, bool ok) {
  std::shared_ptr<kt_job> forward_job;
  {
    std::lock_guard<std::mutex> lock(m->state_mutex);
    ctx->state = ok ? kt_context::kReady : kt_context::kFailed;
    forward_job.swap(ctx->forward_job);
  }
  m->drop_hold(ctx);
}

// A new job of layer m; refused once the layer's destruction has begun.
std::shared_ptr<kt_job> new_job(kt_moe* m, unsigned flags, const char* where) {
  auto job = std::make_shared<kt_job>();
  job->deferred = (flags & KT_SUBMIT_DEFERRED) != 0;
  std::lock_guard<std::mutex> lock(m->state_mutex);
  KT_CHECK(!m->destroyed, KT_ERR_INVALID_HANDLE,
           std::string(where) + ": moe is being destroyed by another thread");
  m->jobs.emplace(job.get(), job);
  return job;
}

// Gives the job its handle and starts it (unless deferred).
kt_job* start_job(kt_moe* m, const std::shared_ptr<kt_job>& job) {
  kt_job* handle = kt::handle_value<kt_job>(kt::add_handle(HandleKind::kJob, job));
  if (!job->deferred) m->engine->jobs.enqueue(job);
  return handle;
}

std::shared_ptr<kt_job> live_job(const kt_job* job) {
  return std::static_pointer_cast<kt_job>(kt::find_handle(kt::handle_id(job), HandleKind::kJob));
}

// Holds a context of a layer for one synchronous call.
class ContextHold {
 public:
  ContextHold(kt_moe* m, const kt_context* handle, const char* where)
      : m_(m), ctx_(m->hold_context(handle, where)) {}
  ~ContextHold() { m_->drop_hold(ctx_); }
  ContextHold(const ContextHold&) = delete;
  ContextHold& operator=(const ContextHold&) = delete;
  kt_context* get() const { return ctx_; }

 private:
  kt_moe* m_;
  kt_context* ctx_;
};

}  // namespace

extern "C" {

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
    const std::shared_ptr<kt_engine> eng = live_engine(engine, w);
    KT_CHECK(moe != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": moe is NULL");
    KT_CHECK(options != nullptr, KT_ERR_NULL_POINTER,
             std::string(w) + ": options is NULL (the shapes are required)");
    kt_moe_options o = kt::read_sized(options, set_moe_options_defaults, w, "options");
    validate_moe_options(o);
    check_layer_fits(o, *eng, w);
    std::shared_ptr<kt_moe> m;
    {
      std::lock_guard<std::mutex> lock(eng->lifetime_mutex);
      KT_CHECK(!eng->destroyed, KT_ERR_INVALID_HANDLE,
               std::string(w) + ": engine is being destroyed by another thread");
      m = std::make_shared<kt_moe>(eng.get(), o);
    }
    m->engine_ref = eng;
    m->handle = kt::add_handle(HandleKind::kMoe, m);
    eng->log(1, "moe: E=" + std::to_string(o.num_experts) + " k=" + std::to_string(o.top_k) +
                       " H=" + std::to_string(o.hidden) + " I=" + std::to_string(o.intermediate) +
                       " mode=" + std::to_string(o.mode) + " kernels " + eng->kernels->gemm_name);
    *moe = kt::handle_value<kt_moe>(m->handle);
  });
}

void kt_moe_destroy(kt_moe* moe) {
  if (!moe) return;
  try {
    std::shared_ptr<kt_moe> m =
        std::static_pointer_cast<kt_moe>(kt::remove_handle(kt::handle_id(moe), HandleKind::kMoe));
    if (!m) {
      set_error(kt::issued_before_fork(kt::handle_id(moe))
                    ? kt::not_live_message(moe, HandleKind::kMoe, "kt_moe_destroy", "moe")
                    : "kt_moe_destroy: moe is not a live kt_moe (destroyed?)");
      return;
    }
    // Jobs that never started are cancelled so they cannot touch the layer:
    // deferred ones, and on the job thread (a hook destroying its layer)
    // also the queued ones, which could never run before this returns.
    const bool on_job_thread = m->engine->jobs.on_job_thread();
    std::vector<std::shared_ptr<kt_job>> pending;
    {
      std::lock_guard<std::mutex> lock(m->state_mutex);
      m->destroyed = true;
      for (auto& kv : m->jobs)
        if (kv.second->deferred || on_job_thread) pending.push_back(kv.second);
    }
    for (auto& j : pending)
      if (j->cancel(KT_ERR_INVALID_HANDLE, "kt_job: its layer was destroyed before the job ran"))
        finish_job(m.get(), j.get());
    pending.clear();
    {
      std::unique_lock<std::mutex> lock(m->state_mutex);
      m->jobs_done.wait(lock, [&] { return m->jobs.empty(); });
    }
    {
      std::lock_guard<std::mutex> lock(m->engine->compute_mutex);
      kt::optim::detach_layer(m.get());
    }
    m->end_context_handles();
    {
      std::lock_guard<std::mutex> lock(m->engine->lifetime_mutex);
      m->leave_engine();
    }
    // Freed here, or when another thread's call (or a job's hook) on the
    // layer returns; it keeps its engine alive until then.
  } catch (...) {
    // Destruction cannot report; nothing here throws in practice.
  }
}

kt_status kt_moe_lora_scale(const kt_moe* moe, float* scale) {
  const char* w = "kt_moe_lora_scale";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    KT_CHECK(scale != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": scale is NULL");
    *scale = layer->lora_scale;
  });
}

const char* kt_weight_format_name(kt_weight_format format) {
  switch (kt::enum_bits(format)) {
    case KT_FORMAT_BF16: return "bf16";
    case KT_FORMAT_INT8_CHANNEL: return "int8_channel";
    case KT_FORMAT_INT4_G32: return "int4_g32";
    case KT_FORMAT_FP8_B128: return "fp8_b128";
    case KT_FORMAT_MXFP4: return "mxfp4";
    case KT_FORMAT_INT4_G128: return "int4_g128";
    case KT_FORMAT_INT4_G32_ZP: return "int4_g32_zp";
    case KT_FORMAT_INT4_G128_ZP: return "int4_g128_zp";
    default: return "unknown";
  }
}

kt_status kt_moe_get_info(const kt_moe* moe, kt_moe_info* info) {
  const char* w = "kt_moe_get_info";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    kt_moe_info full;
    std::memset(&full, 0, sizeof(full));
    full.struct_size = sizeof(full);
    const kt_moe_options& o = layer->opt;
    full.num_experts = o.num_experts;
    full.top_k = o.top_k;
    full.hidden = o.hidden;
    full.intermediate = o.intermediate;
    full.max_tokens = o.max_tokens;
    full.mode = o.mode;
    full.weight_format = o.weight_format;
    full.compute = o.compute;
    full.weight_bytes = kt_moe::weight_bytes(o).value();
    full.num_weights = 3 * o.num_experts * o.hidden * o.intermediate;
    {
      std::lock_guard<std::mutex> lock(layer->engine->compute_mutex);
      full.num_loaded = layer->num_loaded();
    }
    kt::write_sized(info, full, w, "info");
  });
}

kt_status kt_moe_read_weights(const kt_moe* moe, const kt_arg* args, size_t num_args) {
  const char* w = "kt_moe_read_weights";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    std::lock_guard<std::mutex> lock(layer->engine->compute_mutex);
    layer->read_weights(args, num_args);
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
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    kt_load_options o = kt::read_sized(options, set_load_options_defaults, w, "options");
    std::lock_guard<std::mutex> lock(layer->engine->compute_mutex);
    layer->load(o, args, num_args, -1, w);
  });
}

kt_status kt_moe_load_expert(kt_moe* moe, int64_t expert, const kt_load_options* options,
                             const kt_arg* args, size_t num_args) {
  const char* w = "kt_moe_load_expert";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    KT_CHECK(expert >= 0 && expert < layer->E, KT_ERR_EXPERT_ID,
             std::string(w) + ": expert " + std::to_string(expert) + " is outside [0, " +
                 std::to_string(layer->E) + ")");
    kt_load_options o = kt::read_sized(options, set_load_options_defaults, w, "options");
    std::lock_guard<std::mutex> lock(layer->engine->compute_mutex);
    layer->load(o, args, num_args, expert, w);
  });
}

kt_status kt_moe_set_skipped(kt_moe* moe, const DLTensor* mask) {
  const char* w = "kt_moe_set_skipped";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    std::lock_guard<std::mutex> lock(layer->engine->compute_mutex);
    layer->set_skipped(mask);
  });
}

kt_status kt_moe_num_loaded(const kt_moe* moe, int64_t* count) {
  const char* w = "kt_moe_num_loaded";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    KT_CHECK(count != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": count is NULL");
    std::lock_guard<std::mutex> lock(layer->engine->compute_mutex);
    *count = layer->num_loaded();
  });
}

kt_status kt_moe_bind(kt_moe* moe, const kt_arg* args, size_t num_args) {
  const char* w = "kt_moe_bind";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    std::lock_guard<std::mutex> lock(layer->engine->compute_mutex);
    layer->bind(args, num_args);
  });
}

kt_status kt_moe_params_changed(kt_moe* moe) {
  const char* w = "kt_moe_params_changed";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    std::lock_guard<std::mutex> lock(layer->engine->compute_mutex);
    layer->params_changed();
  });
}

kt_status kt_moe_set_grad_hook(kt_moe* moe, kt_grad_ready_fn fn, void* user) {
  const char* w = "kt_moe_set_grad_hook";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    std::lock_guard<std::mutex> lock(layer->state_mutex);
    layer->grad_hook = fn;
    layer->grad_hook_user = fn ? user : nullptr;
  });
}

kt_status kt_moe_forward(kt_moe* moe, const kt_arg* args, size_t num_args, kt_context** saved) {
  const char* w = "kt_moe_forward";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    std::lock_guard<std::mutex> lock(layer->engine->compute_mutex);
    kt_moe::ForwardCall call = layer->check_forward(args, num_args, w);
    if (layer->engine->verbosity >= 2)
      layer->engine->log(2, "forward: T=" + std::to_string(call.T) + (saved ? " (saving a context)" : ""));
    // Held while it is filled: its handle exists (and could be released by
    // a host guessing it) before the call returns it.
    kt_context* ctx = saved ? layer->new_context(call, 1) : nullptr;
    try {
      layer->forward(call, ctx);
    } catch (...) {
      if (ctx) {
        layer->release_context(ctx->handle);
        layer->drop_hold(ctx);
      }
      throw;
    }
    if (ctx) {
      kt_context* handle;
      {
        std::lock_guard<std::mutex> l(layer->state_mutex);
        ctx->state = kt_context::kReady;
        handle = kt::handle_value<kt_context>(ctx->handle);
      }
      layer->drop_hold(ctx);
      *saved = handle;
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
  GradHook hook;
  kt_status st = guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    std::lock_guard<std::mutex> lock(layer->engine->compute_mutex);
    ContextHold held(layer.get(), ctx, w);
    kt_context* c = held.get();
    kt_moe::BackwardCall call = layer->check_backward(c, options, args, num_args, w);
    {
      std::lock_guard<std::mutex> l(layer->state_mutex);
      KT_CHECK(!c->backward_queued, KT_ERR_CONTEXT,
               std::string(w) + ": ctx already has a backward submitted");
    }
    if (layer->engine->verbosity >= 2)
      layer->engine->log(2, "backward: T=" + std::to_string(c->tokens) +
                              " grad_scale=" + std::to_string(call.opt.grad_scale) +
                              (call.opt.accumulate ? " accumulate" : " overwrite"));
    layer->backward(c, call);
    if (call.opt.param_grads && layer->opt.mode != KT_MODE_INFERENCE) hook = grad_hook_of(layer.get());
  });
  if (st == KT_OK) hook.call();
  return st;
}

void kt_context_release(kt_context* ctx) {
  if (!ctx) return;
  try {
    const HandleId id = kt::handle_id(ctx);
    std::shared_ptr<kt_moe> layer;
    if (const HandleId owner = kt::context_owner(id))
      layer = std::static_pointer_cast<kt_moe>(kt::find_handle(owner, HandleKind::kMoe));
    if (!layer || !layer->release_context(id))
      set_error(kt::issued_before_fork(id)
                    ? kt::not_live_message(ctx, HandleKind::kContext, "kt_context_release", "ctx")
                    : "kt_context_release: ctx is not a live kt_context (released already, or its layer "
                      "was destroyed); nothing was released");
  } catch (...) {
    // Release cannot report; nothing here throws in practice.
  }
}

kt_status kt_moe_forward_submit(kt_moe* moe, const kt_arg* args, size_t num_args,
                                kt_context** saved, unsigned flags, kt_job** job) {
  const char* w = "kt_moe_forward_submit";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    KT_CHECK(job != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": job is NULL");
    KT_CHECK((flags & ~KT_SUBMIT_DEFERRED) == 0, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": unknown flags");
    kt_moe::ForwardCall call = layer->check_forward(args, num_args, w);
    std::shared_ptr<kt_job> j = new_job(layer.get(), flags, w);
    // The job holds the context until it ends.
    kt_context* ctx = nullptr;
    if (saved) {
      try {
        ctx = layer->new_context(call, 1);
      } catch (...) {
        finish_job(layer.get(), j.get());
        throw;
      }
      std::lock_guard<std::mutex> lock(layer->state_mutex);
      ctx->forward_job = j;
    }
    kt_job* raw = j.get();
    j->work = [layer, call, ctx, raw] {
      bool ok = false;
      try {
        std::lock_guard<std::mutex> lock(layer->engine->compute_mutex);
        layer->forward(call, ctx);
        ok = true;
      } catch (...) {
        if (ctx) settle_context(layer.get(), ctx, false);
        finish_job(layer.get(), raw);
        throw;
      }
      if (ctx) settle_context(layer.get(), ctx, ok);
      finish_job(layer.get(), raw);
    };
    if (saved) *saved = kt::handle_value<kt_context>(ctx->handle);
    *job = start_job(layer.get(), j);
  });
}

kt_status kt_moe_backward_submit(kt_moe* moe, kt_context* ctx, const kt_backward_options* options,
                                 const kt_arg* args, size_t num_args, unsigned flags,
                                 kt_job** job) {
  const char* w = "kt_moe_backward_submit";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    KT_CHECK(job != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": job is NULL");
    KT_CHECK((flags & ~KT_SUBMIT_DEFERRED) == 0, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": unknown flags");
    // The job holds the context until it ends (a release meanwhile frees it
    // then). A context whose forward job has not ended may be submitted
    // against: the backward job runs or waits for that forward first.
    ContextHold held(layer.get(), ctx, w);
    kt_context* c = held.get();
    const kt_moe::BackwardCall call = layer->check_backward(c, options, args, num_args, w, true);
    {
      std::lock_guard<std::mutex> lock(layer->state_mutex);
      KT_CHECK(!c->backward_queued, KT_ERR_CONTEXT,
               std::string(w) + ": ctx already has a backward submitted");
      c->backward_queued = true;
      ++c->holds;  // the job's own
    }
    std::shared_ptr<kt_job> j;
    try {
      j = new_job(layer.get(), flags, w);
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(layer->state_mutex);
        c->backward_queued = false;
      }
      layer->drop_hold(c);
      throw;
    }
    kt_job* raw = j.get();
    j->work = [layer, call, c, raw] {
      GradHook hook;
      try {
        std::shared_ptr<kt_job> forward_job;
        {
          std::lock_guard<std::mutex> lock(layer->state_mutex);
          forward_job = c->forward_job;
        }
        if (forward_job) forward_job->wait();  // runs a deferred forward nobody ran yet
        std::lock_guard<std::mutex> lock(layer->engine->compute_mutex);
        layer->backward(c, call);
        if (call.opt.param_grads && layer->opt.mode != KT_MODE_INFERENCE) hook = grad_hook_of(layer.get());
      } catch (...) {
        {
          std::lock_guard<std::mutex> l(layer->state_mutex);
          c->backward_queued = false;
        }
        layer->drop_hold(c);
        finish_job(layer.get(), raw);
        throw;
      }
      layer->drop_hold(c);
      finish_job(layer.get(), raw);
      hook.call();
    };
    *job = start_job(layer.get(), j);
  });
}

void kt_job_run(void* job) {
  std::shared_ptr<kt_job> j = live_job(static_cast<const kt_job*>(job));
  if (!j && kt::issued_before_fork(kt::handle_id(job)))
    set_error(kt::not_live_message(job, HandleKind::kJob, "kt_job_run", "job"));
  if (!j || !j->deferred) return;
  // Returns when the job has ended, also when another thread runs it (a
  // backward job that started its forward): a host stream that runs this
  // may read the job's outputs next.
  j->wait();
}

kt_status kt_job_wait(kt_job* job) {
  const char* w = "kt_job_wait";
  std::shared_ptr<kt_job> j;
  const kt_status st = guarded(w, [&] {
    j = std::static_pointer_cast<kt_job>(kt::live_handle(job, HandleKind::kJob, w, "job"));
  });
  if (st != KT_OK) return st;
  j->wait();
  if (j->status != KT_OK) set_error(j->message);
  return j->status;
}

int kt_job_done(const kt_job* job) {
  std::shared_ptr<kt_job> j = live_job(job);
  if (!j) return 1;
  std::lock_guard<std::mutex> lock(j->mutex);
  return j->state == 2;
}

void kt_job_destroy(kt_job* job) {
  if (!job) return;
  std::shared_ptr<kt_job> j =
      std::static_pointer_cast<kt_job>(kt::remove_handle(kt::handle_id(job), HandleKind::kJob));
  if (!j) {
    set_error(kt::not_live_message(job, HandleKind::kJob, "kt_job_destroy", "job"));
    return;
  }
  j->wait();
}

}  // extern "C"
