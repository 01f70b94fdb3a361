#include "runtime/jobs.h"

#include <atomic>
#include <deque>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#include "core/error.h"
#include "moe/layer_calls.h"
#include "moe/moe_layer.h"
#include "optim/optimizer.h"
#include "runtime/engine.h"
#include "runtime/handles.h"

void kt_job::execute() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (state != 0) return;
    state = 1;
  }
  kt_status st = KT_OK;
  std::string msg;
  try {
    work();
  } catch (const kt::Error& e) {
    st = e.status();
    msg = e.what();
  } catch (const std::bad_alloc&) {
    st = KT_ERR_OUT_OF_MEMORY;
    msg = "out of memory while running a job";
  } catch (const std::exception& e) {
    st = KT_ERR_INTERNAL;
    msg = std::string("internal error in a job: ") + e.what();
  } catch (...) {
    st = KT_ERR_INTERNAL;
    msg = "internal error in a job";
  }
  work = nullptr;  // drop captured state (and with it references to handles)
  std::lock_guard<std::mutex> lock(mutex);
  status = st;
  message = msg;
  state = 2;
  cv.notify_all();
}

bool kt_job::cancel(kt_status st, const std::string& msg) {
  std::function<void()> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (state != 0) return false;
    state = 2;
    status = st;
    message = msg;
    dropped.swap(work);
    cv.notify_all();
  }
  return true;  // the work (and what it holds) is dropped here, unlocked
}

void kt_job::wait() {
  bool run_here;
  {
    std::lock_guard<std::mutex> lock(mutex);
    run_here = deferred && state == 0;
  }
  if (run_here) execute();
  std::unique_lock<std::mutex> lock(mutex);
  cv.wait(lock, [this] { return state == 2; });
}

bool kt_job::done() {
  std::lock_guard<std::mutex> lock(mutex);
  return state == 2;
}

namespace kt {

struct JobRunner::State {
  std::mutex mutex;
  std::condition_variable work_cv;
  std::condition_variable idle_cv;
  std::deque<std::shared_ptr<kt_job>> queue;
  bool busy = false;
  bool stop = false;
  std::thread thread;  // started by the first job
  std::thread::id thread_id;
};

JobRunner::JobRunner() : s_(std::make_shared<State>()) {}

JobRunner::~JobRunner() {
  {
    std::lock_guard<std::mutex> lock(s_->mutex);
    s_->stop = true;
  }
  s_->work_cv.notify_all();
  if (!s_->thread.joinable()) return;
  if (s_->thread.get_id() == std::this_thread::get_id())
    s_->thread.detach();  // it finishes its current job, then leaves the loop
  else
    s_->thread.join();
}

void JobRunner::enqueue(std::shared_ptr<kt_job> job) {
  std::lock_guard<std::mutex> lock(s_->mutex);
  if (!s_->thread.joinable()) {
    s_->thread = std::thread(&JobRunner::loop, s_);
    s_->thread_id = s_->thread.get_id();
  }
  s_->queue.push_back(std::move(job));
  s_->work_cv.notify_all();
}

void JobRunner::drain() {
  std::unique_lock<std::mutex> lock(s_->mutex);
  if (s_->thread_id == std::this_thread::get_id()) return;
  s_->idle_cv.wait(lock, [this] { return s_->queue.empty() && !s_->busy; });
}

bool JobRunner::on_job_thread() const {
  std::lock_guard<std::mutex> lock(s_->mutex);
  return s_->thread_id == std::this_thread::get_id();
}

void JobRunner::loop(std::shared_ptr<State> s) {
  std::unique_lock<std::mutex> lock(s->mutex);
  for (;;) {
    s->work_cv.wait(lock, [&] { return s->stop || !s->queue.empty(); });
    if (s->queue.empty()) return;  // stop requested and nothing left
    std::shared_ptr<kt_job> job = std::move(s->queue.front());
    s->queue.pop_front();
    s->busy = true;
    lock.unlock();
    job->execute();
    job.reset();
    lock.lock();
    s->busy = false;
    if (s->queue.empty()) s->idle_cv.notify_all();
  }
}

namespace {

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
std::shared_ptr<kt_job> new_job(kt_moe* m, bool deferred, const char* where) {
  auto job = std::make_shared<kt_job>();
  job->deferred = deferred;
  std::lock_guard<std::mutex> lock(m->state_mutex);
  KT_CHECK(!m->destroyed, KT_ERR_INVALID_HANDLE,
           std::string(where) + ": moe is being destroyed by another thread");
  m->jobs.emplace(job.get(), job);
  return job;
}

std::atomic<int> g_failing_starts{0};

// Gives the job its handle and starts it on runner (unless deferred); on a
// failure the handle is gone again and nothing was queued.
kt_job* start_job(JobRunner& runner, const std::shared_ptr<kt_job>& job) {
  const HandleId id = add_handle(HandleKind::kJob, job);
  try {
    if (g_failing_starts.load() > 0 && g_failing_starts.fetch_sub(1) > 0) throw std::bad_alloc();
    if (!job->deferred) runner.enqueue(job);
  } catch (...) {
    remove_handle(id, HandleKind::kJob);
    throw;
  }
  return handle_value<kt_job>(id);
}

// Ends a job that was never started: its work (and what it holds) dropped,
// the layer's list without it.
void drop_unstarted(kt_moe* m, const std::shared_ptr<kt_job>& job) {
  job->cancel(KT_ERR_INTERNAL, "kt_job: the job could not be started");
  finish_job(m, job.get());
}

}  // namespace

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
  kt_job* handle = nullptr;
  try {
    handle = start_job(layer->engine->jobs, j);
  } catch (...) {
    // The host never sees the context: it goes with the job.
    if (ctx) {
      {
        std::lock_guard<std::mutex> lock(layer->state_mutex);
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
    std::lock_guard<std::mutex> lock(layer->state_mutex);
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
  try {
    return start_job(layer->engine->jobs, j);
  } catch (...) {
    drop_unstarted(layer.get(), j);
    {
      std::lock_guard<std::mutex> lock(layer->state_mutex);
      c->backward_queued = false;
    }
    layer->drop_hold(c);
    throw;
  }
}

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

void fail_job_starts_for_tests(int n) { g_failing_starts.store(n); }

std::shared_ptr<kt_job> find_job(const void* handle) {
  return std::static_pointer_cast<kt_job>(find_handle(handle_id(handle), HandleKind::kJob));
}

std::shared_ptr<kt_job> live_job(const kt_job* handle, const char* where) {
  return live(handle, HandleKind::kJob, where, "job");
}

bool run_job(const void* handle) {
  const std::shared_ptr<kt_job> j = find_job(handle);
  if (!j) return false;
  // Returns when the job has ended, also when another thread runs it (a
  // backward job that started its forward): a host stream that runs this
  // may read the job's outputs next.
  if (j->deferred) j->wait();
  return true;
}

bool job_done(const kt_job* handle) {
  const std::shared_ptr<kt_job> j = find_job(handle);
  return !j || j->done();
}

bool destroy_job(const kt_job* handle) {
  const std::shared_ptr<kt_job> j =
      std::static_pointer_cast<kt_job>(remove_handle(handle_id(handle), HandleKind::kJob));
  if (!j) return false;
  j->wait();
  return true;
}

}  // namespace kt
