// The layer and job calls of the ABI (kt_moe_*, kt_context_release, kt_job_*):
// every one checks its handles and options, calls the core (jobs:
// runtime/jobs.h), and turns every exception into a status + thread-local
// message (kt::guarded).
#include <cstring>
#include <string>

#include "api/guard.h"
#include "api/live.h"
#include "core/checked.h"
#include "core/error.h"
#include "core/kernel_tally.h"
#include "core/sized_struct.h"
#include "kt_c_api.h"
#include "formats/formats.h"
#include "moe/args.h"
#include "moe/layer_calls.h"
#include "moe/layer_jobs.h"
#include "moe/moe_layer.h"
#include "runtime/engine.h"
#include "runtime/jobs.h"

namespace {

void set_error(const std::string& message) { kt::set_last_error(message); }

using kt::GradHook;
using kt::guarded;
using kt::HandleKind;

using kt::live_engine;
using kt::live_moe;

}  // namespace

extern "C" {

void kt_moe_options_defaults(kt_moe_options* o, size_t struct_size) {
  kt::write_defaults(o, struct_size, kt::set_moe_options_defaults);
}

kt_status kt_moe_create(kt_engine* engine, const kt_moe_options* options, kt_moe** moe) {
  const char* w = "kt_moe_create";
  return guarded(w, [&] {
    const std::shared_ptr<kt_engine> eng = live_engine(engine, w);
    KT_CHECK(moe != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": moe is NULL");
    KT_CHECK(options != nullptr, KT_ERR_NULL_POINTER,
             std::string(w) + ": options is NULL (the shapes are required)");
    const kt_moe_options o = kt::read_sized(options, kt::set_moe_options_defaults, w, "options");
    const std::shared_ptr<kt_moe> m = kt::create_layer(eng, o, w);
    *moe = kt::handle_value<kt_moe>(m->handle());
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
    kt::destroy_layer(m);
  } catch (...) {
    // Destruction cannot report; nothing here throws in practice.
  }
}

kt_status kt_moe_lora_scale(const kt_moe* moe, float* scale) {
  const char* w = "kt_moe_lora_scale";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    KT_CHECK(scale != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": scale is NULL");
    *scale = layer->lora_scale();
  });
}

const char* kt_weight_format_name(kt_weight_format format) { return kt::weight_format_name(format); }

kt_status kt_moe_get_info(const kt_moe* moe, kt_moe_info* info) {
  const char* w = "kt_moe_get_info";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    kt_moe_info full;
    std::memset(&full, 0, sizeof(full));
    full.struct_size = sizeof(full);
    const kt_moe_options& o = layer->options();
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
      std::lock_guard<std::mutex> lock(layer->engine()->compute_mutex);
      full.num_loaded = layer->num_loaded();
    }
    kt::write_sized(info, full, w, "info");
  });
}

kt_status kt_moe_read_weights(const kt_moe* moe, const kt_arg* args, size_t num_args) {
  const char* w = "kt_moe_read_weights";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    std::lock_guard<std::mutex> lock(layer->engine()->compute_mutex);
    layer->read_weights(args, num_args);
  });
}

void kt_load_options_defaults(kt_load_options* o, size_t struct_size) {
  kt::write_defaults(o, struct_size, kt::set_load_options_defaults);
}

kt_status kt_moe_load_weights(kt_moe* moe, const kt_load_options* options, const kt_arg* args,
                              size_t num_args) {
  const char* w = "kt_moe_load_weights";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    kt_load_options o = kt::read_sized(options, kt::set_load_options_defaults, w, "options");
    std::lock_guard<std::mutex> lock(layer->engine()->compute_mutex);
    layer->load(o, args, num_args, -1, w);
  });
}

kt_status kt_moe_load_expert(kt_moe* moe, int64_t expert, const kt_load_options* options,
                             const kt_arg* args, size_t num_args) {
  const char* w = "kt_moe_load_expert";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    KT_CHECK(expert >= 0 && expert < layer->num_experts(), KT_ERR_EXPERT_ID,
             std::string(w) + ": expert " + std::to_string(expert) + " is outside [0, " +
                 std::to_string(layer->num_experts()) + ")");
    kt_load_options o = kt::read_sized(options, kt::set_load_options_defaults, w, "options");
    std::lock_guard<std::mutex> lock(layer->engine()->compute_mutex);
    layer->load(o, args, num_args, expert, w);
  });
}

kt_status kt_moe_set_skipped(kt_moe* moe, const DLTensor* mask) {
  const char* w = "kt_moe_set_skipped";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    std::lock_guard<std::mutex> lock(layer->engine()->compute_mutex);
    layer->set_skipped(mask);
  });
}

kt_status kt_moe_num_loaded(const kt_moe* moe, int64_t* count) {
  const char* w = "kt_moe_num_loaded";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    KT_CHECK(count != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": count is NULL");
    std::lock_guard<std::mutex> lock(layer->engine()->compute_mutex);
    *count = layer->num_loaded();
  });
}

kt_status kt_moe_bind(kt_moe* moe, const kt_arg* args, size_t num_args) {
  const char* w = "kt_moe_bind";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    std::lock_guard<std::mutex> lock(layer->engine()->compute_mutex);
    layer->bind(args, num_args);
  });
}

kt_status kt_moe_params_changed(kt_moe* moe) {
  const char* w = "kt_moe_params_changed";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    std::lock_guard<std::mutex> lock(layer->engine()->compute_mutex);
    layer->params_changed();
  });
}

kt_status kt_moe_set_grad_hook(kt_moe* moe, kt_grad_ready_fn fn, void* user) {
  const char* w = "kt_moe_set_grad_hook";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    layer->set_grad_hook(fn, user);
  });
}

kt_status kt_moe_forward(kt_moe* moe, const kt_arg* args, size_t num_args, kt_context** saved) {
  const char* w = "kt_moe_forward";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    kt::forward_layer(*layer, args, num_args, saved, w);
  });
}

void kt_backward_options_defaults(kt_backward_options* o, size_t struct_size) {
  kt::write_defaults(o, struct_size, kt::set_backward_options_defaults);
}

kt_status kt_moe_backward(kt_moe* moe, kt_context* ctx, const kt_backward_options* options,
                          const kt_arg* args, size_t num_args) {
  const char* w = "kt_moe_backward";
  GradHook hook;
  kt_status st = guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = live_moe(moe, w);
    hook = kt::backward_layer(*layer, ctx, options, args, num_args, w);
  });
  if (st == KT_OK) hook.call();
  return st;
}

void kt_context_release(kt_context* ctx) {
  if (!ctx) return;
  try {
    if (!kt::release_layer_context(ctx))
      set_error(kt::issued_before_fork(kt::handle_id(ctx))
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
    *job = kt::submit_forward(layer, args, num_args, saved, (flags & KT_SUBMIT_DEFERRED) != 0, w);
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
    *job = kt::submit_backward(layer, ctx, options, args, num_args, (flags & KT_SUBMIT_DEFERRED) != 0, w);
  });
}

void kt_job_run(void* job) {
  if (!kt::run_job(job) && kt::issued_before_fork(kt::handle_id(job)))
    set_error(kt::not_live_message(job, HandleKind::kJob, "kt_job_run", "job"));
}

kt_status kt_job_wait(kt_job* job) {
  const char* w = "kt_job_wait";
  std::shared_ptr<kt_job> j;
  const kt_status st = guarded(w, [&] { j = kt::live_job(job, w); });
  if (st != KT_OK) return st;
  j->wait();
  if (j->status != KT_OK) set_error(j->message);
  return j->status;
}

int kt_job_done(const kt_job* job) { return kt::job_done(job) ? 1 : 0; }

void kt_job_destroy(kt_job* job) {
  if (!job) return;
  if (!kt::destroy_job(job)) set_error(kt::not_live_message(job, HandleKind::kJob, "kt_job_destroy", "job"));
}

}  // extern "C"
