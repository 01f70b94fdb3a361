// The kt_optimizer_* ABI: handle and argument checks around src/optim's core,
// every exception turned into a status by kt::guarded.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include "api/guard.h"
#include "runtime/handles.h"
#include "core/checked.h"
#include "core/error.h"
#include "core/sized_struct.h"
#include "kt_c_api.h"
#include "moe/moe_layer.h"
#include "optim/optimizer.h"
#include "optim/step_job.h"
#include "runtime/engine.h"
#include "runtime/jobs.h"

namespace kt {
namespace optim {

void detach_layer(kt_moe* moe) {
  for (kt_optimizer* o : moe->take_optimizers()) o->moe = nullptr;
}

}  // namespace optim
}  // namespace kt

namespace {

using kt::guarded;

std::shared_ptr<kt_optimizer> live_optimizer(const kt_optimizer* o, const char* where) {
  return kt::live(o, kt::HandleKind::kOptimizer, where, "opt");
}

void set_step_options_defaults(kt_optimizer_step_options& o) {
  o.grad_unscale = 1.f;
  o.clip_coef = 1.f;
  o.found_nonfinite = nullptr;
}

kt_optimizer_step_options read_step_options(const kt_optimizer_step_options* options, const char* w) {
  kt_optimizer_step_options o = kt::read_sized(options, set_step_options_defaults, w, "options");
  KT_CHECK(std::isfinite(o.grad_unscale) && std::isfinite(o.clip_coef), KT_ERR_INVALID_ARGUMENT,
           std::string(w) + ": options->grad_unscale and options->clip_coef must be finite");
  return o;
}

kt_optimizer_options read_options(const kt_optimizer_options* options, const char* w) {
  kt_optimizer_options o = kt::read_sized(options, kt::optim::set_options_defaults, w, "options");
  kt::optim::validate_options(o, w);
  return o;
}

// Registers a new optimizer with its engine and layer, and gives it its
// handle. Not on an engine whose destruction has begun.
kt_optimizer* adopt(std::unique_ptr<kt_optimizer> owned, const char* where) {
  std::shared_ptr<kt_optimizer> op(std::move(owned));
  if (op->engine) {
    std::lock_guard<std::mutex> lock(op->engine->lifetime_mutex);
    KT_CHECK(!op->engine->destroyed, KT_ERR_INVALID_HANDLE,
             std::string(where) + ": its engine is being destroyed by another thread");
    op->engine->num_optimizers.fetch_add(1);
  }
  if (op->moe) op->moe->attach_optimizer(op.get());
  return kt::handle_value<kt_optimizer>(kt::add_handle(kt::HandleKind::kOptimizer, op));
}

}  // namespace

extern "C" {

void kt_optimizer_options_defaults(kt_optimizer_options* o, size_t struct_size) {
  kt::write_defaults(o, struct_size, kt::optim::set_options_defaults);
}

void kt_optimizer_step_options_defaults(kt_optimizer_step_options* o, size_t struct_size) {
  kt::write_defaults(o, struct_size, set_step_options_defaults);
}

kt_status kt_optimizer_create(kt_engine* engine, const kt_optimizer_options* options,
                              const kt_optimizer_param* params, size_t num_params, kt_optimizer** opt) {
  const char* w = "kt_optimizer_create";
  return guarded(w, [&] {
    std::shared_ptr<kt_engine> eng;
    if (engine) eng = kt::live(engine, kt::HandleKind::kEngine, w, "engine");
    KT_CHECK(opt != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": opt is NULL");
    const kt_optimizer_options o = read_options(options, w);
    std::unique_ptr<kt_optimizer> op(kt::optim::create_for_tensors(eng.get(), o, params, num_params, w));
    *opt = adopt(std::move(op), w);
  });
}

kt_status kt_optimizer_create_for_layer(kt_moe* moe, const kt_optimizer_options* options, kt_optimizer** opt) {
  const char* w = "kt_optimizer_create_for_layer";
  return guarded(w, [&] {
    const std::shared_ptr<kt_moe> layer = kt::live(moe, kt::HandleKind::kMoe, w, "moe");
    KT_CHECK(opt != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": opt is NULL");
    const kt_optimizer_options o = read_options(options, w);
    std::lock_guard<std::mutex> lock(layer->engine()->compute_mutex);
    {
      std::lock_guard<std::mutex> state(layer->state_mutex());
      KT_CHECK(!layer->jobs().closed(), KT_ERR_INVALID_HANDLE,
               std::string(w) + ": moe is being destroyed by another thread");
    }
    std::unique_ptr<kt_optimizer> op(kt::optim::create_for_layer(layer.get(), o, w));
    *opt = adopt(std::move(op), w);
  });
}

void kt_optimizer_destroy(kt_optimizer* opt) {
  if (!opt) return;
  try {
    const std::shared_ptr<kt_optimizer> op =
        std::static_pointer_cast<kt_optimizer>(kt::remove_handle(kt::handle_id(opt), kt::HandleKind::kOptimizer));
    if (!op) {
      kt::set_last_error(kt::not_live_message(opt, kt::HandleKind::kOptimizer, "kt_optimizer_destroy", "opt"));
      return;
    }
    // Steps that never started are cancelled so they cannot touch the
    // optimizer; the others are waited for.
    std::vector<std::shared_ptr<kt_job>> deferred;
    {
      std::lock_guard<std::mutex> lock(op->state_mutex);
      for (const auto& kv : op->jobs)
        if (kv.second->deferred) deferred.push_back(kv.second);
    }
    for (const auto& j : deferred)
      if (j->cancel(KT_ERR_INVALID_HANDLE, "kt_job: its optimizer was destroyed before the job ran"))
        op->job_ended(j.get());
    {
      std::unique_lock<std::mutex> lock(op->state_mutex);
      op->jobs_done.wait(lock, [&] { return op->jobs.empty(); });
    }
    {
      auto lock = op->lock_compute();
      if (op->moe) op->moe->detach_optimizer(op.get());
    }
    if (op->engine) op->engine->num_optimizers.fetch_sub(1);
  } catch (...) {
    // Destruction cannot report; nothing here throws in practice.
  }
}

kt_status kt_optimizer_set_options(kt_optimizer* opt, const kt_optimizer_options* options) {
  const char* w = "kt_optimizer_set_options";
  return guarded(w, [&] {
    const std::shared_ptr<kt_optimizer> held = live_optimizer(opt, w);
    kt_optimizer* const op = held.get();
    KT_CHECK(options != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": options is NULL");
    const kt_optimizer_options o = read_options(options, w);
    auto lock = op->lock_compute();
    KT_CHECK(o.algorithm == op->opt.algorithm, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": options->algorithm cannot change after creation");
    KT_CHECK(o.amsgrad == op->opt.amsgrad, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": options->amsgrad cannot change after creation");
    op->opt = o;
  });
}

kt_status kt_optimizer_get_options(const kt_optimizer* opt, kt_optimizer_options* options) {
  const char* w = "kt_optimizer_get_options";
  return guarded(w, [&] {
    const std::shared_ptr<kt_optimizer> held = live_optimizer(opt, w);
    kt_optimizer* const op = held.get();
    auto lock = op->lock_compute();
    kt_optimizer_options full = op->opt;
    full.struct_size = sizeof(full);
    kt::write_sized(options, full, w, "options");
  });
}

kt_status kt_optimizer_set_grad(kt_optimizer* opt, size_t index, const DLTensor* grad) {
  const char* w = "kt_optimizer_set_grad";
  return guarded(w, [&] {
    const std::shared_ptr<kt_optimizer> held = live_optimizer(opt, w);
    kt_optimizer* const op = held.get();
    KT_CHECK(
        !op->layer_mode, KT_ERR_MODE,
        std::string(w) + ": the optimizer updates a layer: bind its gradients with kt_moe_bind");
    KT_CHECK(index < op->params.size(), KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": index " + std::to_string(index) + " is outside [0, " +
                 std::to_string(op->params.size()) + ")");
    auto lock = op->lock_compute();
    kt_optimizer::Param& p = op->params[index];
    kt::View g = kt::optim::check_grad(grad, p.param, "grad", w);
    for (size_t j = 0; j < op->params.size(); ++j)
      kt::check_disjoint(op->params[j].param, ("params[" + std::to_string(j) + "].param").c_str(), g, "grad", w);
    p.grad = g;
  });
}

kt_status kt_optimizer_step(kt_optimizer* opt, const kt_optimizer_step_options* options) {
  const char* w = "kt_optimizer_step";
  return guarded(w, [&] {
    const std::shared_ptr<kt_optimizer> held = live_optimizer(opt, w);
    kt_optimizer* const op = held.get();
    const kt_optimizer_step_options o = read_step_options(options, w);
    bool stepped;
    {
      auto lock = op->lock_compute();
      stepped = op->step_now(o.grad_unscale, o.clip_coef, w);
    }
    if (o.found_nonfinite) *o.found_nonfinite = stepped ? 0 : 1;
  });
}

kt_status kt_optimizer_step_submit(kt_optimizer* opt, const kt_optimizer_step_options* options, unsigned flags,
                                   kt_job** job) {
  const char* w = "kt_optimizer_step_submit";
  return guarded(w, [&] {
    const std::shared_ptr<kt_optimizer> held = live_optimizer(opt, w);
    kt_optimizer* const op = held.get();
    KT_CHECK(job != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": job is NULL");
    KT_CHECK((flags & ~KT_SUBMIT_DEFERRED) == 0, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": unknown flags");
    KT_CHECK(op->engine != nullptr, KT_ERR_UNSUPPORTED,
             std::string(w) + ": the optimizer has no engine to run jobs (create it with one)");
    const kt_optimizer_step_options o = read_step_options(options, w);
    *job = kt::submit_optimizer_step(held, o, (flags & KT_SUBMIT_DEFERRED) != 0, w);
  });
}

kt_status kt_optimizer_grad_sq_norm(kt_optimizer* opt, double* out) {
  const char* w = "kt_optimizer_grad_sq_norm";
  return guarded(w, [&] {
    const std::shared_ptr<kt_optimizer> held = live_optimizer(opt, w);
    kt_optimizer* const op = held.get();
    KT_CHECK(out != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": out is NULL");
    auto lock = op->lock_compute();
    *out = op->grad_sq_norm(w);
  });
}

kt_status kt_optimizer_num_params(const kt_optimizer* opt, size_t* count) {
  const char* w = "kt_optimizer_num_params";
  return guarded(w, [&] {
    const std::shared_ptr<kt_optimizer> held = live_optimizer(opt, w);
    kt_optimizer* const op = held.get();
    KT_CHECK(count != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": count is NULL");
    *count = op->params.size();
  });
}

kt_status kt_optimizer_get_step(const kt_optimizer* opt, int64_t* step) {
  const char* w = "kt_optimizer_get_step";
  return guarded(w, [&] {
    const std::shared_ptr<kt_optimizer> held = live_optimizer(opt, w);
    kt_optimizer* const op = held.get();
    KT_CHECK(step != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": step is NULL");
    auto lock = op->lock_compute();
    *step = op->step;
  });
}

kt_status kt_optimizer_set_step(kt_optimizer* opt, int64_t step) {
  const char* w = "kt_optimizer_set_step";
  return guarded(w, [&] {
    const std::shared_ptr<kt_optimizer> held = live_optimizer(opt, w);
    kt_optimizer* const op = held.get();
    KT_CHECK(step >= 0, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": step " + std::to_string(step) + " is negative");
    auto lock = op->lock_compute();
    op->step = step;
    op->momentum_started = step > 0 && op->opt.momentum != 0.0;
  });
}

kt_status kt_optimizer_state(kt_optimizer* opt, size_t index, kt_optim_state which, DLTensor* out) {
  const char* w = "kt_optimizer_state";
  return guarded(w, [&] {
    const std::shared_ptr<kt_optimizer> held = live_optimizer(opt, w);
    kt_optimizer* const op = held.get();
    KT_CHECK(out != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": out is NULL");
    KT_CHECK(index < op->params.size(), KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": index " + std::to_string(index) + " is outside [0, " +
                 std::to_string(op->params.size()) + ")");
    kt::check_enum(which, KT_OPTIM_STATE_MASTER, KT_OPTIM_STATE_MOMENTUM, std::string(w) + ": which",
                   "kt_optim_state");
    kt_optimizer::Param& p = op->params[index];
    const bool adamw = op->opt.algorithm == KT_OPTIM_ADAMW;
    float* data = nullptr;
    switch (which) {
      case KT_OPTIM_STATE_MASTER: data = p.master; break;
      case KT_OPTIM_STATE_EXP_AVG: data = adamw ? p.m.data() : nullptr; break;
      case KT_OPTIM_STATE_EXP_AVG_SQ: data = adamw ? p.v.data() : nullptr; break;
      case KT_OPTIM_STATE_MAX_EXP_AVG_SQ: data = adamw && op->opt.amsgrad ? p.vmax.data() : nullptr; break;
      case KT_OPTIM_STATE_MOMENTUM: data = adamw ? nullptr : p.m.data(); break;
    }
    KT_CHECK(data != nullptr || p.numel == 0, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": which = " + std::to_string(kt::enum_bits(which)) + ": " +
                 (adamw ? "AdamW" : "SGD") + (adamw && !op->opt.amsgrad ? " without amsgrad" : "") +
                 " keeps no such state");
    std::memset(out, 0, sizeof(*out));
    out->data = data;
    out->device.device_type = kDLCPU;
    out->ndim = p.param.ndim;
    out->dtype.code = kDLFloat;
    out->dtype.bits = 32;
    out->dtype.lanes = 1;
    out->shape = p.shape.data();
  });
}

kt_status kt_optimizer_save(kt_optimizer* opt, const char* path) {
  const char* w = "kt_optimizer_save";
  return guarded(w, [&] {
    const std::shared_ptr<kt_optimizer> held = live_optimizer(opt, w);
    kt_optimizer* const op = held.get();
    KT_CHECK(path != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": path is NULL");
    auto lock = op->lock_compute();
    op->save(path, w);
  });
}

kt_status kt_optimizer_load(kt_optimizer* opt, const char* path) {
  const char* w = "kt_optimizer_load";
  return guarded(w, [&] {
    const std::shared_ptr<kt_optimizer> held = live_optimizer(opt, w);
    kt_optimizer* const op = held.get();
    KT_CHECK(path != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": path is NULL");
    auto lock = op->lock_compute();
    op->load(path, w);
  });
}

}  // extern "C"
