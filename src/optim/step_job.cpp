#include "optim/step_job.h"

#include <string>

#include "runtime/engine.h"
#include "runtime/jobs.h"

namespace kt {

kt_job* submit_optimizer_step(const std::shared_ptr<kt_optimizer>& op, const kt_optimizer_step_options& o,
                              bool deferred, const char* where) {
  auto j = std::make_shared<kt_job>();
  j->deferred = deferred;
  kt_job* raw = j.get();
  const std::string w = where;
  // The job keeps the optimizer alive; kt_optimizer_destroy waits for it.
  raw->work = [op, o, raw, w] {
    bool stepped = false;
    try {
      auto lock = op->lock_compute();
      stepped = op->step_now(o.grad_unscale, o.clip_coef, w.c_str());
    } catch (...) {
      op->job_ended(raw);
      throw;
    }
    if (o.found_nonfinite) *o.found_nonfinite = stepped ? 0 : 1;
    op->job_ended(raw);
  };
  {
    std::lock_guard<std::mutex> lock(op->state_mutex);
    op->jobs.emplace(raw, j);
  }
  try {
    return start_job(op->engine->jobs, j);
  } catch (...) {
    j->cancel(KT_ERR_INTERNAL, "kt_job: the job could not be started");
    op->job_ended(raw);
    throw;
  }
}

}  // namespace kt
