// Submitted (asynchronous) work: the kt_job and the engine's job thread that
// runs it. What a job does is given by its submitter (moe/layer_jobs.h,
// optim/step_job.h), which keeps its context, layer or optimizer valid until
// it ends; the kt_job_* shims (src/api) call these; `where` names the ABI
// call in every message.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "kt_c_api.h"

// A unit of submitted work. Its closure owns copies of the argument
// descriptors (and keeps its layer alive); the tensors' memory stays the
// host's. Shared by its handle, the queue that runs it, and the layer's list
// of pending jobs, so whichever lets go last frees it.
struct kt_job {
  std::function<void()> work;  // throws kt::Error on failure
  bool deferred = false;
  std::mutex mutex;
  std::condition_variable cv;
  int state = 0;  // 0 waiting, 1 running, 2 ended
  kt_status status = KT_OK;
  std::string message;

  // Runs the work on the calling thread once; later calls return at once.
  void execute();
  // Waits until the job ended; runs a deferred job nobody started.
  void wait();
  // Ends a job that has not started with status and message (its work is
  // dropped); false when it already started.
  bool cancel(kt_status status, const std::string& message);
  // Whether the job has ended.
  bool done();
};

namespace kt {

// The engine's job thread and its queue. The thread shares the queue's
// state, so the runner may be destroyed from the job thread itself (a hook
// that destroys the last layer and the engine): the thread is then
// detached and ends once its current job returns.
class JobRunner {
 public:
  JobRunner();
  ~JobRunner();
  JobRunner(const JobRunner&) = delete;
  JobRunner& operator=(const JobRunner&) = delete;

  void enqueue(std::shared_ptr<kt_job> job);
  // Blocks until every queued job has ended (returns at once on the job
  // thread, which cannot wait for itself).
  void drain();
  bool on_job_thread() const;

 private:
  struct State;
  static void loop(std::shared_ptr<State> s);
  std::shared_ptr<State> s_;
};

// Gives job its handle and starts it on runner (unless deferred); on a
// failure the handle is gone again, nothing was queued, and the exception
// is rethrown for the submitter to roll back what the job holds.
kt_job* start_job(JobRunner& runner, const std::shared_ptr<kt_job>& job);

// The job of a live job handle, or null (never dereferences the handle).
std::shared_ptr<kt_job> find_job(const void* handle);
// The job of a live job handle, or KT_ERR_INVALID_HANDLE naming where and
// the argument "job".
std::shared_ptr<kt_job> live_job(const kt_job* handle, const char* where);

// kt_job_run: runs a deferred job on the calling thread and returns when it
// has ended (also when another thread runs it); a job that is not deferred
// is left to the job thread. False when handle is not a live job.
bool run_job(const void* handle);
// Whether a job has ended; true for a handle that is not a live job.
bool job_done(const kt_job* handle);
// Ends a job's handle, then waits for the job (running a deferred one nobody
// ran). False when handle was not a live job.
bool destroy_job(const kt_job* handle);

// Tests only: the next n job starts fail after the job got its handle, as
// if its place in the queue could not be allocated.
void fail_job_starts_for_tests(int n);

}  // namespace kt
