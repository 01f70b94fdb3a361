// The engine's worker pool: persistent (optionally pinned) threads that
// self-schedule work items from an atomic counter. No allocation per run.
// Results are deterministic when each item writes only its own outputs.
// Workers may form groups (one per NUMA node): a grouped run hands each
// group's items to that group's workers only.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/kernel_tally.h"

namespace kt {

// The recent pauses between a pool's runs and how long idle workers spin
// after them: twice the longest of the last kGaps pauses (not counting those
// past half of kMaxSpin), within [kMinSpin, kMaxSpin]. A host that calls
// layer after layer with its own work between them (attention on the GPU)
// then finds the workers awake. A plain value, so the policy is the same
// whatever clock feeds it.
class PauseMemory {
 public:
  static constexpr std::chrono::microseconds kMinSpin{100}, kMaxSpin{5000};
  static constexpr int kGaps = 16;  // pauses remembered: a few layers' runs
  // Records a pause and returns the spin it calls for.
  std::chrono::microseconds note(std::chrono::microseconds pause);

 private:
  int64_t gaps_us_[kGaps] = {};
  int at_ = 0;
};

// Whether this build can run a pool on the host's OpenMP threads, and the
// calling thread's OpenMP thread count (1 without OpenMP).
bool host_openmp_built();
int host_openmp_threads();

class ThreadPool {
 public:
  // cpus: CPU ids to pin worker i to cpus[i] (empty = not pinned).
  // host_openmp: no workers of its own; a run of several items is an OpenMP
  // parallel region of num_threads on the calling thread (kt_engine_options.
  // host_openmp; needs host_openmp_built()).
  // groups: the group of worker i, in [0, groups), every group with a
  // worker (empty = one group; ignored with host_openmp or one thread).
  ThreadPool(int num_threads, const std::vector<int>& cpus, bool host_openmp = false,
             const std::vector<int>& groups = {});
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Threads that compute: the workers, or the caller alone in a pool of one.
  int size() const { return size_; }
  // Worker groups (1 unless the pool was made with several), the group of
  // thread index tid, and how many workers a group has.
  int groups() const { return static_cast<int>(group_workers_.size()); }
  int group_of(int tid) const { return worker_group_.empty() ? 0 : worker_group_[static_cast<size_t>(tid)]; }
  int workers_in(int group) const { return group_workers_[static_cast<size_t>(group)]; }

  // How long an idle worker spins before it sleeps (PauseMemory, fed with
  // the pauses between this pool's runs).
  std::chrono::microseconds worker_spin() const;
  static constexpr std::chrono::microseconds kMinSpin = PauseMemory::kMinSpin, kMaxSpin = PauseMemory::kMaxSpin;

  // Runs fn(item, thread_index) for item in [0, n) on the workers (a single
  // item, or all in a pool of one, on the caller as index 0) and returns when all are done.
  // Rethrows the first exception an item threw (the other items still run). One run at a time
  // (callers serialise on the engine).
  template <class F>
  void run(int64_t n, F&& fn) {
    if (n <= 0) return;
    auto thunk = [](void* f, int64_t item, int tid) { (*static_cast<F*>(f))(item, tid); };
    run_impl(n, thunk, &fn, nullptr);
  }
  // Runs fn(item, thread_index) for the items [bounds[g], bounds[g + 1]) of
  // each group g (bounds has groups() + 1 entries, bounds[0] = 0) on the
  // workers of group g only; otherwise as run(). With one group it is
  // run(bounds[1], fn).
  template <class F>
  void run_grouped(const int64_t* bounds, F&& fn) {
    const int64_t n = bounds[groups()];
    if (n <= 0) return;
    auto thunk = [](void* f, int64_t item, int tid) { (*static_cast<F*>(f))(item, tid); };
    run_impl(n, thunk, &fn, groups() > 1 ? bounds : nullptr);
  }

 private:
  using Thunk = void (*)(void*, int64_t, int);
  // One counter of items per group (a run without groups uses the first).
  struct Queue {
    alignas(64) std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  // bounds: per-group item ranges (null: every worker takes from [0, n)).
  void run_impl(int64_t n, Thunk thunk, void* fn, const int64_t* bounds);
  void run_on_openmp(int64_t n, Thunk thunk, void* fn);
  void worker_loop(int index);
  // Runs items from a queue until none are left; an item's exception is
  // kept (the first) and the next item taken.
  void take_items(Thunk thunk, void* fn, Queue& queue, int index);

  // Waits up to `limit` (yielding the CPU) for cond before the thread falls
  // back to its condition variable: runs come in quick succession (a
  // layer's stages), and a sleep/wake pair costs tens of microseconds.
  template <class Cond>
  static bool spin_until(Cond cond, std::chrono::microseconds limit);

  int size_ = 1;
  bool host_openmp_ = false;
  std::vector<int> worker_group_;    // per worker (empty: one group)
  std::vector<int> group_workers_;   // workers per group
  std::unique_ptr<Queue[]> queues_;  // per group
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int> active_{0};
  // The caller's (runs are serialised): when the last run ended (the
  // pool's start before the first), the recent pauses between runs.
  std::chrono::steady_clock::time_point last_end_ = std::chrono::steady_clock::now();
  PauseMemory pauses_;
  std::atomic<int64_t> worker_spin_us_{kMinSpin.count()};
  Thunk thunk_ = nullptr;
  void* fn_ = nullptr;
  KernelTally* tally_ = nullptr;  // the caller's, which the workers count into for the run
  bool grouped_ = false;  // the current run hands each group its own queue
  std::exception_ptr error_;
};

// CPUs in this process's affinity mask, in increasing order.
std::vector<int> allowed_cpus();

}  // namespace kt
