#include "runtime/jobs.h"

#include <atomic>
#include <deque>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#include "core/error.h"
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

std::atomic<int> g_failing_starts{0};

}  // namespace

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
