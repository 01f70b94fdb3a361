#include "runtime/thread_pool.h"

#include <pthread.h>
#include <sched.h>

namespace kt {

std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  if (cpus.empty()) {
    unsigned n = std::thread::hardware_concurrency();
    for (unsigned c = 0; c < (n ? n : 1); ++c) cpus.push_back(static_cast<int>(c));
  }
  return cpus;
}

ThreadPool::ThreadPool(int num_threads, const std::vector<int>& cpus) {
  workers_.reserve(static_cast<size_t>(num_threads));
  for (int i = 0; i < num_threads; ++i) {
    workers_.emplace_back([this, i] { worker_loop(i); });
    if (!cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpus[static_cast<size_t>(i) % cpus.size()], &set);
      // Pinning is a hint for locality; a refusal (e.g. a cgroup) is harmless.
      pthread_setaffinity_np(workers_.back().native_handle(), sizeof(set), &set);
    }
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_impl(int64_t n, Thunk thunk, void* fn) {
  std::unique_lock<std::mutex> lock(mutex_);
  thunk_ = thunk;
  fn_ = fn;
  n_ = n;
  next_.store(0, std::memory_order_relaxed);
  error_ = nullptr;
  active_ = size();
  ++generation_;
  wake_.notify_all();
  done_.wait(lock, [this] { return active_ == 0; });
  thunk_ = nullptr;
  fn_ = nullptr;
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    Thunk thunk;
    void* fn;
    int64_t n;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      thunk = thunk_;
      fn = fn_;
      n = n_;
    }
    for (;;) {
      const int64_t item = next_.fetch_add(1, std::memory_order_relaxed);
      if (item >= n) break;
      try {
        thunk(fn, item, index);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (--active_ == 0) done_.notify_one();
  }
}

}  // namespace kt
