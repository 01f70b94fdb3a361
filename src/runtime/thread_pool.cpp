#include "runtime/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>

#if KT_HAVE_OPENMP
#include <omp.h>
#endif

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

#if KT_HAVE_OPENMP
bool host_openmp_built() { return true; }
int host_openmp_threads() { return omp_get_max_threads(); }
#else
bool host_openmp_built() { return false; }
int host_openmp_threads() { return 1; }
#endif

ThreadPool::ThreadPool(int num_threads, const std::vector<int>& cpus, bool host_openmp,
                       const std::vector<int>& groups)
    : size_(num_threads > 1 ? num_threads : 1), host_openmp_(host_openmp) {
  // Groups only among kt's own workers, each group with one at least.
  if (size_ > 1 && !host_openmp_ && groups.size() == static_cast<size_t>(size_)) {
    const int count = *std::max_element(groups.begin(), groups.end()) + 1;
    group_workers_.assign(static_cast<size_t>(count), 0);
    for (int g : groups) ++group_workers_[static_cast<size_t>(g)];
    if (*std::min_element(group_workers_.begin(), group_workers_.end()) > 0 && count > 1) worker_group_ = groups;
  }
  if (worker_group_.empty()) group_workers_.assign(1, size_);
  queues_.reset(new Queue[group_workers_.size()]);
  // One thread computes on the caller: a worker would only add hand-offs.
  // On the host's OpenMP threads, the region's team are the threads.
  if (size_ == 1 || host_openmp_) return;
  workers_.reserve(static_cast<size_t>(size_));
  for (int i = 0; i < size_; ++i) {
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
    stop_.store(true);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

template <class Cond>
bool ThreadPool::spin_until(Cond cond, std::chrono::microseconds limit) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 1;; ++i) {
    if (cond()) return true;
    // sched_yield lets a thread waiting for this CPU (the caller, a worker)
    // run; with nothing else to run it returns at once.
    sched_yield();
    if (i % 64 == 0 && std::chrono::steady_clock::now() - start > limit) return cond();
  }
}

void ThreadPool::take_items(Thunk thunk, void* fn, Queue& queue, int index) {
  for (;;) {
    const int64_t item = queue.next.fetch_add(1, std::memory_order_relaxed);
    if (item >= queue.end) return;
    try {
      thunk(fn, item, index);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

std::chrono::microseconds ThreadPool::worker_spin() const {
  return std::chrono::microseconds(worker_spin_us_.load(std::memory_order_relaxed));
}

std::chrono::microseconds PauseMemory::note(std::chrono::microseconds pause) {
  gaps_us_[at_] = pause.count();
  at_ = (at_ + 1) % kGaps;
  int64_t longest = 0;
  for (int64_t g : gaps_us_)
    if (g <= kMaxSpin.count() / 2) longest = std::max(longest, g);
  return std::chrono::microseconds(std::min(std::max(2 * longest, kMinSpin.count()), kMaxSpin.count()));
}

// The items on the calling thread's OpenMP team: thread i of the region is
// index i (a smaller team, e.g. inside the host's own region, takes them
// all the same). Runs are serialised by the engine, so the shared counter
// and error slot are this run's.
void ThreadPool::run_on_openmp(int64_t n, Thunk thunk, void* fn) {
  Queue& queue = queues_[0];
  queue.next.store(0, std::memory_order_relaxed);
  queue.end = n;
  error_ = nullptr;
#if KT_HAVE_OPENMP
  KernelTally* tally = current_kernel_tally();
  const int threads = size_;
#pragma omp parallel num_threads(threads)
  {
    const KernelTallyScope counting(tally);
    take_items(thunk, fn, queue, omp_get_thread_num());
  }
#else
  take_items(thunk, fn, queue, 0);
#endif
  std::lock_guard<std::mutex> lock(mutex_);
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void ThreadPool::run_impl(int64_t n, Thunk thunk, void* fn, const int64_t* bounds) {
  if (host_openmp_ && n > 1) {
    run_on_openmp(n, thunk, fn);
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  worker_spin_us_.store(pauses_.note(std::chrono::duration_cast<std::chrono::microseconds>(start - last_end_)).count(),
                        std::memory_order_relaxed);
  struct Ended {
    ThreadPool* pool;
    ~Ended() { pool->last_end_ = std::chrono::steady_clock::now(); }
  } ended{this};
  // A single item, or every item of a one-thread pool, runs on the caller
  // (as index 0; the workers are idle between runs): a worker would only
  // add the hand-off. A grouped run keeps each item on its group's workers.
  const bool on_caller = (n == 1 && !bounds) || workers_.empty();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    thunk_ = thunk;
    fn_ = fn;
    tally_ = current_kernel_tally();
    grouped_ = bounds != nullptr;
    for (int g = 0; g < (grouped_ ? groups() : 1); ++g) {
      queues_[g].next.store(grouped_ ? bounds[g] : 0, std::memory_order_relaxed);
      queues_[g].end = grouped_ ? bounds[g + 1] : n;
    }
    error_ = nullptr;
    if (!on_caller) {
      active_.store(size(), std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
  }
  if (on_caller) {
    take_items(thunk, fn, queues_[0], 0);
  } else {
    wake_.notify_all();
    // The caller waits for its own run, which ends: asleep, it would add its
    // waking to the run's time.
    if (!spin_until([this] { return active_.load(std::memory_order_acquire) == 0; }, kMaxSpin)) {
      std::unique_lock<std::mutex> lock(mutex_);
      done_.wait(lock, [this] { return active_.load(std::memory_order_acquire) == 0; });
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
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
    KernelTally* tally;
    Queue* queue;
    const auto ready = [&] { return stop_.load() || generation_.load(std::memory_order_acquire) != seen; };
    if (!spin_until(ready, worker_spin())) {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, ready);
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop_.load()) return;
      seen = generation_.load(std::memory_order_relaxed);
      thunk = thunk_;
      fn = fn_;
      tally = tally_;
      queue = &queues_[grouped_ ? group_of(index) : 0];
    }
    {
      const KernelTallyScope counting(tally);
      take_items(thunk, fn, *queue, index);
    }
    // The last worker out wakes the caller (under the lock, so a caller
    // between its check and its wait cannot miss it).
    if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mutex_);
      done_.notify_one();
    }
  }
}

}  // namespace kt
