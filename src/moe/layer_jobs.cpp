#include "moe/layer_jobs.h"

#include <mutex>
#include <string>

#include "core/error.h"
#include "moe/layer_calls.h"
#include "runtime/engine.h"
#include "runtime/handles.h"
#include "runtime/jobs.h"

namespace kt {

namespace {

// Marks a submitted forward's context after its run and ends the job's hold
// (freeing the context if the host released it meanwhile).
void settle_context(kt_moe* m, kt_context* ctx, bool ok) {
  std::shared_ptr<kt_job> forward_job;
  {
    std::lock_guard<std::mutex> lock(m->state_mutex());
    ctx->state = ok ? kt_context::kReady : kt_context::kFailed;
    forward_job.swap(ctx->forward_job);
  }
  m->drop_hold(ctx);
}

// A new job of layer m; refused once the layer's destruction has begun.
std::shared_ptr<kt_job> new_job(kt_moe* m, bool deferred, const char* where) {
  auto job = std::make_shared<kt_job>();
  job->deferred = deferred;
  std::lock_guard<std::mutex> lock(m->state_mutex());
  m->jobs().add(job, where);
  return job;
}

// Ends a job that was never started: its work (and what it holds) dropped,
// the layer's list without it.
void drop_unstarted(kt_moe* m, const std::shared_ptr<kt_job>& job) {
  job->cancel(KT_ERR_INTERNAL, "kt_job: the job could not be started");
  finish_job(m, job.get());
}

}  // namespace

void LayerJobs::add(const std::shared_ptr<kt_job>& job, const char* where) {
  KT_CHECK(!closed_, KT_ERR_INVALID_HANDLE, std::string(where) + ": moe is being destroyed by another thread");
  jobs_.emplace(job.get(), job);
}

std::shared_ptr<kt_job> LayerJobs::remove(kt_job* job) {
  std::shared_ptr<kt_job> mine;
  auto it = jobs_.find(job);
  if (it != jobs_.end()) {
    mine = std::move(it->second);
    jobs_.erase(it);
  }
  if (jobs_.empty()) done_.notify_all();
  return mine;
}

std::vector<std::shared_ptr<kt_job>> LayerJobs::close(bool all_queued) {
  closed_ = true;
  std::vector<std::shared_ptr<kt_job>> pending;
  for (auto& kv : jobs_)
    if (kv.second->deferred || all_queued) pending.push_back(kv.second);
  return pending;
}

void LayerJobs::wait_all(std::unique_lock<std::mutex>& lock) {
  done_.wait(lock, [&] { return jobs_.empty(); });
}

kt_job* submit_forward(const std::shared_ptr<kt_moe>& layer, const kt_arg* args, size_t num_args,
                       kt_context** saved, bool deferred, const char* where) {
  kt_moe::ForwardCall call = layer->check_forward(args, num_args, where);
  std::shared_ptr<kt_job> j = new_job(layer.get(), deferred, where);
  // The job holds the context until it ends.
  kt_context* ctx = nullptr;
  if (saved) {
    try {
      ctx = layer->new_context(call, 1);
    } catch (...) {
      finish_job(layer.get(), j.get());
      throw;
    }
    std::lock_guard<std::mutex> lock(layer->state_mutex());
    ctx->forward_job = j;
  }
  kt_job* raw = j.get();
  j->work = [layer, call, ctx, raw] {
    bool ok = false;
    try {
      std::lock_guard<std::mutex> lock(layer->engine()->compute_mutex);
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
  kt_job* handle = nullptr;
  try {
    handle = start_job(layer->engine()->jobs, j);
  } catch (...) {
    // The host never sees the context: it goes with the job.
    if (ctx) {
      {
        std::lock_guard<std::mutex> lock(layer->state_mutex());
        ctx->forward_job.reset();
      }
      layer->release_context(ctx->handle);
      layer->drop_hold(ctx);
    }
    drop_unstarted(layer.get(), j);
    throw;
  }
  if (saved) *saved = handle_value<kt_context>(ctx->handle);
  return handle;
}

kt_job* submit_backward(const std::shared_ptr<kt_moe>& layer, kt_context* ctx,
                        const kt_backward_options* options, const kt_arg* args, size_t num_args,
                        bool deferred, const char* where) {
  // The call holds the context while it checks; the job takes its own hold.
  ContextHold held(layer.get(), ctx, where);
  kt_context* c = held.get();
  const kt_moe::BackwardCall call = layer->check_backward(c, options, args, num_args, where, true);
  {
    std::lock_guard<std::mutex> lock(layer->state_mutex());
    KT_CHECK(!c->backward_queued, KT_ERR_CONTEXT,
             std::string(where) + ": ctx already has a backward submitted");
    c->backward_queued = true;
    ++c->holds;  // the job's own
  }
  std::shared_ptr<kt_job> j;
  try {
    j = new_job(layer.get(), deferred, where);
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(layer->state_mutex());
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
        std::lock_guard<std::mutex> lock(layer->state_mutex());
        forward_job = c->forward_job;
      }
      if (forward_job) forward_job->wait();  // runs a deferred forward nobody ran yet
      std::lock_guard<std::mutex> lock(layer->engine()->compute_mutex);
      layer->backward(c, call);
      if (call.opt.param_grads && layer->options().mode != KT_MODE_INFERENCE) hook = layer->grad_hook();
    } catch (...) {
      {
        std::lock_guard<std::mutex> l(layer->state_mutex());
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
  try {
    return start_job(layer->engine()->jobs, j);
  } catch (...) {
    drop_unstarted(layer.get(), j);
    {
      std::lock_guard<std::mutex> lock(layer->state_mutex());
      c->backward_queued = false;
    }
    layer->drop_hold(c);
    throw;
  }
}

}  // namespace kt
