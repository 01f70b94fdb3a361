// The kt_optimizer_* ABI: handle and argument checks around src/optim's core,
// every exception turned into a status by kt::guarded.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include "api/guard.h"
#include "core/checked.h"
#include "core/error.h"
#include "core/sized_struct.h"
#include "kt_c_api.h"
#include "moe/moe_layer.h"
#include "optim/optimizer.h"
#include "runtime/engine.h"

namespace kt {
namespace optim {

void detach_layer(kt_moe* moe) {
  for (kt_optimizer* o : moe->optimizers) o->moe = nullptr;
  moe->optimizers.clear();
}

}  // namespace optim
}  // namespace kt

namespace {

using kt::check;
using kt::guarded;

void check_optimizer(const kt_optimizer* o, const char* where) {
  check(o != nullptr, KT_ERR_INVALID_HANDLE, std::string(where) + ": opt is NULL");
  check(o->magic == kt_optimizer::kMagic, KT_ERR_INVALID_HANDLE,
        std::string(where) + ": opt is not a live kt_optimizer (destroyed?)");
}

void check_engine_handle(const kt_engine* e, const char* where) {
  check(e->magic == kt_engine::kMagic, KT_ERR_INVALID_HANDLE,
        std::string(where) + ": engine is not a live kt_engine (destroyed?)");
}

void set_step_options_defaults(kt_optimizer_step_options& o) {
  o.grad_unscale = 1.f;
  o.clip_coef = 1.f;
  o.found_nonfinite = nullptr;
}

kt_optimizer_step_options read_step_options(const kt_optimizer_step_options* options, const char* w) {
  kt_optimizer_step_options o = kt::read_sized(options, set_step_options_defaults, w, "options");
  check(std::isfinite(o.grad_unscale) && std::isfinite(o.clip_coef), KT_ERR_INVALID_ARGUMENT,
        std::string(w) + ": options->grad_unscale and options->clip_coef must be finite");
  return o;
}

kt_optimizer_options read_options(const kt_optimizer_options* options, const char* w) {
  kt_optimizer_options o = kt::read_sized(options, kt::optim::set_options_defaults, w, "options");
  kt::optim::validate_options(o, w);
  return o;
}

// Registers a new optimizer with its engine and layer.
void adopt(kt_optimizer* op) {
  if (op->engine) op->engine->num_optimizers.fetch_add(1);
  if (op->moe) op->moe->optimizers.push_back(op);
}

void finish_job(kt_optimizer* op, kt_job* job) {
  std::lock_guard<std::mutex> lock(op->state_mutex);
  op->jobs.erase(job);
  if (op->jobs.empty()) op->jobs_done.notify_all();
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
    if (engine) check_engine_handle(engine, w);
    check(opt != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": opt is NULL");
    const kt_optimizer_options o = read_options(options, w);
    kt_optimizer* op = kt::optim::create_for_tensors(engine, o, params, num_params, w);
    adopt(op);
    *opt = op;
  });
}

kt_status kt_optimizer_create_for_layer(kt_moe* moe, const kt_optimizer_options* options, kt_optimizer** opt) {
  const char* w = "kt_optimizer_create_for_layer";
  return guarded(w, [&] {
    check(moe != nullptr, KT_ERR_INVALID_HANDLE, std::string(w) + ": moe is NULL");
    check(moe->magic == kt_moe::kMagic, KT_ERR_INVALID_HANDLE,
          std::string(w) + ": moe is not a live kt_moe (destroyed?)");
    check(opt != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": opt is NULL");
    const kt_optimizer_options o = read_options(options, w);
    std::lock_guard<std::mutex> lock(moe->engine->compute_mutex);
    kt_optimizer* op = kt::optim::create_for_layer(moe, o, w);
    adopt(op);
    *opt = op;
  });
}

void kt_optimizer_destroy(kt_optimizer* opt) {
  if (!opt || opt->magic != kt_optimizer::kMagic) return;
  try {
    std::vector<kt_job*> deferred;
    {
      std::lock_guard<std::mutex> lock(opt->state_mutex);
      for (kt_job* j : opt->jobs)
        if (j->deferred) deferred.push_back(j);
    }
    for (kt_job* j : deferred) {
      std::lock_guard<std::mutex> lock(j->mutex);
      if (j->state == 0) {  // never run: cancel so it cannot touch the optimizer
        j->state = 2;
        j->status = KT_ERR_INVALID_HANDLE;
        j->message = "kt_job: its optimizer was destroyed before the job ran";
        j->work = nullptr;
        j->cv.notify_all();
        std::lock_guard<std::mutex> l2(opt->state_mutex);
        opt->jobs.erase(j);
      }
    }
    {
      std::unique_lock<std::mutex> lock(opt->state_mutex);
      opt->jobs_done.wait(lock, [&] { return opt->jobs.empty(); });
    }
    {
      auto lock = opt->lock_compute();
      if (opt->moe) {
        auto& list = opt->moe->optimizers;
        list.erase(std::remove(list.begin(), list.end(), opt), list.end());
      }
    }
    if (opt->engine) opt->engine->num_optimizers.fetch_sub(1);
    opt->magic = 0;
    delete opt;
  } catch (...) {
    // Destruction cannot report; nothing here throws in practice.
  }
}

kt_status kt_optimizer_set_options(kt_optimizer* opt, const kt_optimizer_options* options) {
  const char* w = "kt_optimizer_set_options";
  return guarded(w, [&] {
    check_optimizer(opt, w);
    check(options != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": options is NULL");
    const kt_optimizer_options o = read_options(options, w);
    auto lock = opt->lock_compute();
    check(o.algorithm == opt->opt.algorithm, KT_ERR_INVALID_ARGUMENT,
          std::string(w) + ": options->algorithm cannot change after creation");
    check(o.amsgrad == opt->opt.amsgrad, KT_ERR_INVALID_ARGUMENT,
          std::string(w) + ": options->amsgrad cannot change after creation");
    opt->opt = o;
  });
}

kt_status kt_optimizer_get_options(const kt_optimizer* opt, kt_optimizer_options* options) {
  const char* w = "kt_optimizer_get_options";
  return guarded(w, [&] {
    check_optimizer(opt, w);
    kt_optimizer* op = const_cast<kt_optimizer*>(opt);
    auto lock = op->lock_compute();
    kt_optimizer_options full = op->opt;
    full.struct_size = sizeof(full);
    kt::write_sized(options, full, w, "options");
  });
}

kt_status kt_optimizer_set_grad(kt_optimizer* opt, size_t index, const DLTensor* grad) {
  const char* w = "kt_optimizer_set_grad";
  return guarded(w, [&] {
    check_optimizer(opt, w);
    check(!opt->layer_mode, KT_ERR_MODE,
          std::string(w) + ": the optimizer updates a layer: bind its gradients with kt_moe_bind");
    check(index < opt->params.size(), KT_ERR_INVALID_ARGUMENT,
          std::string(w) + ": index " + std::to_string(index) + " is outside [0, " +
              std::to_string(opt->params.size()) + ")");
    auto lock = opt->lock_compute();
    kt_optimizer::Param& p = opt->params[index];
    kt::View g = kt::optim::check_grad(grad, p.param, "grad", w);
    for (size_t j = 0; j < opt->params.size(); ++j)
      kt::check_disjoint(opt->params[j].param, ("params[" + std::to_string(j) + "].param").c_str(), g, "grad", w);
    p.grad = g;
  });
}

kt_status kt_optimizer_step(kt_optimizer* opt, const kt_optimizer_step_options* options) {
  const char* w = "kt_optimizer_step";
  return guarded(w, [&] {
    check_optimizer(opt, w);
    const kt_optimizer_step_options o = read_step_options(options, w);
    bool stepped;
    {
      auto lock = opt->lock_compute();
      stepped = opt->step_now(o.grad_unscale, o.clip_coef, w);
    }
    if (o.found_nonfinite) *o.found_nonfinite = stepped ? 0 : 1;
  });
}

kt_status kt_optimizer_step_submit(kt_optimizer* opt, const kt_optimizer_step_options* options, unsigned flags,
                                   kt_job** job) {
  const char* w = "kt_optimizer_step_submit";
  return guarded(w, [&] {
    check_optimizer(opt, w);
    check(job != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": job is NULL");
    check((flags & ~KT_SUBMIT_DEFERRED) == 0, KT_ERR_INVALID_ARGUMENT, std::string(w) + ": unknown flags");
    check(opt->engine != nullptr, KT_ERR_UNSUPPORTED,
          std::string(w) + ": the optimizer has no engine to run jobs (create it with one)");
    const kt_optimizer_step_options o = read_step_options(options, w);
    std::unique_ptr<kt_job> j(new kt_job);
    j->deferred = (flags & KT_SUBMIT_DEFERRED) != 0;
    j->engine = opt->engine;
    kt_job* raw = j.get();
    raw->work = [opt, o, raw] {
      bool stepped = false;
      try {
        auto lock = opt->lock_compute();
        stepped = opt->step_now(o.grad_unscale, o.clip_coef, "kt_optimizer_step_submit");
      } catch (...) {
        finish_job(opt, raw);
        throw;
      }
      if (o.found_nonfinite) *o.found_nonfinite = stepped ? 0 : 1;
      finish_job(opt, raw);
    };
    {
      std::lock_guard<std::mutex> lock(opt->state_mutex);
      opt->jobs.insert(raw);
    }
    *job = j.release();
    if (!raw->deferred) opt->engine->enqueue(raw);
  });
}

kt_status kt_optimizer_grad_sq_norm(kt_optimizer* opt, double* out) {
  const char* w = "kt_optimizer_grad_sq_norm";
  return guarded(w, [&] {
    check_optimizer(opt, w);
    check(out != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": out is NULL");
    auto lock = opt->lock_compute();
    *out = opt->grad_sq_norm(w);
  });
}

kt_status kt_optimizer_num_params(const kt_optimizer* opt, size_t* count) {
  const char* w = "kt_optimizer_num_params";
  return guarded(w, [&] {
    check_optimizer(opt, w);
    check(count != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": count is NULL");
    *count = opt->params.size();
  });
}

kt_status kt_optimizer_get_step(const kt_optimizer* opt, int64_t* step) {
  const char* w = "kt_optimizer_get_step";
  return guarded(w, [&] {
    check_optimizer(opt, w);
    check(step != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": step is NULL");
    kt_optimizer* op = const_cast<kt_optimizer*>(opt);
    auto lock = op->lock_compute();
    *step = op->step;
  });
}

kt_status kt_optimizer_set_step(kt_optimizer* opt, int64_t step) {
  const char* w = "kt_optimizer_set_step";
  return guarded(w, [&] {
    check_optimizer(opt, w);
    check(step >= 0, KT_ERR_INVALID_ARGUMENT, std::string(w) + ": step " + std::to_string(step) + " is negative");
    auto lock = opt->lock_compute();
    opt->step = step;
    opt->momentum_started = step > 0 && opt->opt.momentum != 0.0;
  });
}

kt_status kt_optimizer_state(kt_optimizer* opt, size_t index, kt_optim_state which, DLTensor* out) {
  const char* w = "kt_optimizer_state";
  return guarded(w, [&] {
    check_optimizer(opt, w);
    check(out != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": out is NULL");
    check(index < opt->params.size(), KT_ERR_INVALID_ARGUMENT,
          std::string(w) + ": index " + std::to_string(index) + " is outside [0, " +
              std::to_string(opt->params.size()) + ")");
    kt::check_enum(which, KT_OPTIM_STATE_MASTER, KT_OPTIM_STATE_MOMENTUM, std::string(w) + ": which",
                   "kt_optim_state");
    kt_optimizer::Param& p = opt->params[index];
    const bool adamw = opt->opt.algorithm == KT_OPTIM_ADAMW;
    float* data = nullptr;
    switch (which) {
      case KT_OPTIM_STATE_MASTER: data = p.master; break;
      case KT_OPTIM_STATE_EXP_AVG: data = adamw ? p.m.data() : nullptr; break;
      case KT_OPTIM_STATE_EXP_AVG_SQ: data = adamw ? p.v.data() : nullptr; break;
      case KT_OPTIM_STATE_MAX_EXP_AVG_SQ: data = adamw && opt->opt.amsgrad ? p.vmax.data() : nullptr; break;
      case KT_OPTIM_STATE_MOMENTUM: data = adamw ? nullptr : p.m.data(); break;
    }
    check(data != nullptr || p.numel == 0, KT_ERR_INVALID_ARGUMENT,
          std::string(w) + ": which = " + std::to_string(kt::enum_bits(which)) + ": " +
              (adamw ? "AdamW" : "SGD") + (adamw && !opt->opt.amsgrad ? " without amsgrad" : "") +
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
    check_optimizer(opt, w);
    check(path != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": path is NULL");
    auto lock = opt->lock_compute();
    opt->save(path, w);
  });
}

kt_status kt_optimizer_load(kt_optimizer* opt, const char* path) {
  const char* w = "kt_optimizer_load";
  return guarded(w, [&] {
    check_optimizer(opt, w);
    check(path != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": path is NULL");
    auto lock = opt->lock_compute();
    opt->load(path, w);
  });
}

}  // extern "C"
