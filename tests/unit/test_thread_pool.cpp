// The worker pool: every item runs once with a worker index below the size;
// a single item, or a pool of one, stays on the caller; an item's exception reaches the caller
// after the other items ran; worker i is pinned to the i-th CPU given.
#include <gtest/gtest.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "runtime/thread_pool.h"

#ifdef _OPENMP
#include <omp.h>
#endif

using kt::ThreadPool;

namespace {

struct Seen {
  std::mutex mutex;
  std::set<int> indices;
  std::set<std::thread::id> threads;
  void add(int index) {
    std::lock_guard<std::mutex> lock(mutex);
    indices.insert(index);
    threads.insert(std::this_thread::get_id());
  }
};

}  // namespace

TEST(ThreadPool, EveryItemRunsOnceWithIndicesBelowTheSize) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads, {});
    ASSERT_EQ(pool.size(), threads);
    for (int64_t n : {1, 2, 7, 1000}) {
      std::vector<std::atomic<int>> count(static_cast<size_t>(n));
      Seen seen;
      pool.run(n, [&](int64_t item, int index) {
        count[static_cast<size_t>(item)].fetch_add(1);
        seen.add(index);
      });
      for (int64_t i = 0; i < n; ++i)
        EXPECT_EQ(count[static_cast<size_t>(i)].load(), 1) << threads << " " << n;
      for (int index : seen.indices) {
        EXPECT_GE(index, 0);
        EXPECT_LT(index, threads);
      }
    }
  }
}

TEST(ThreadPool, OneItemOrOneThreadStaysOnTheCaller) {
  const std::thread::id caller = std::this_thread::get_id();
  for (int threads : {1, 4}) {
    ThreadPool pool(threads, {});
    Seen seen;
    pool.run(1, [&](int64_t, int index) { seen.add(index); });
    EXPECT_EQ(seen.indices, std::set<int>{0});
    EXPECT_EQ(seen.threads, std::set<std::thread::id>{caller});
    // More items go to the workers; a pool of one has none.
    Seen many;
    pool.run(20, [&](int64_t, int index) { many.add(index); });
    if (threads == 1) {
      EXPECT_EQ(many.threads, std::set<std::thread::id>{caller});
    } else {
      EXPECT_EQ(many.threads.count(caller), 0u);
    }
  }
}

TEST(ThreadPool, AnExceptionReachesTheCallerAfterTheOtherItems) {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads, {});
    for (int64_t n : {int64_t{1}, int64_t{100}}) {
      const int64_t bad = n / 2;
      std::atomic<int> ran{0};
      try {
        pool.run(n, [&](int64_t item, int) {
          ran.fetch_add(1);
          if (item == bad) throw std::runtime_error("item " + std::to_string(item));
        });
        ADD_FAILURE() << "no exception";
      } catch (const std::runtime_error& e) {
        EXPECT_EQ(std::string(e.what()), "item " + std::to_string(bad));
      }
      EXPECT_EQ(ran.load(), n);
      // The pool stays usable.
      std::atomic<int> again{0};
      pool.run(10, [&](int64_t, int) { again.fetch_add(1); });
      EXPECT_EQ(again.load(), 10);
    }
  }
}

#ifdef _OPENMP
// A pool on the host's OpenMP threads runs each item once on the calling
// thread's team (the threads an OpenMP region of the host gets), with
// indices below its size; exceptions reach the caller; inside the host's
// own region (a team of one) every item still runs.
TEST(ThreadPool, OnTheHostsOpenMpThreadsItemsRunOnTheCallersTeam) {
  ASSERT_TRUE(kt::host_openmp_built());
  std::set<std::thread::id> team;
  std::mutex team_mutex;
#pragma omp parallel num_threads(3)
  {
    std::lock_guard<std::mutex> lock(team_mutex);
    team.insert(std::this_thread::get_id());
  }
  ThreadPool pool(3, {}, true);
  ASSERT_EQ(pool.size(), 3);
  for (int64_t n : {2, 7, 1000}) {
    std::vector<std::atomic<int>> count(static_cast<size_t>(n));
    Seen seen;
    pool.run(n, [&](int64_t item, int index) {
      count[static_cast<size_t>(item)].fetch_add(1);
      seen.add(index);
    });
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(count[static_cast<size_t>(i)].load(), 1) << n;
    for (int index : seen.indices) EXPECT_TRUE(index >= 0 && index < 3) << index;
    for (const auto& id : seen.threads) EXPECT_EQ(team.count(id), 1u) << "an item ran outside the OpenMP team";
  }
  try {
    pool.run(100, [&](int64_t item, int) {
      if (item == 50) throw std::runtime_error("item 50");
    });
    ADD_FAILURE() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "item 50");
  }
  std::atomic<int> nested{0};
#pragma omp parallel num_threads(2)
  {
#pragma omp master
    pool.run(40, [&](int64_t, int) { nested.fetch_add(1); });
  }
  EXPECT_EQ(nested.load(), 40);
}
#endif

TEST(PauseMemory, SpinsThroughTheRecentPausesBetweenRuns) {
  using std::chrono::microseconds;
  using kt::PauseMemory;
  PauseMemory m;
  // Pauses of 300 us: twice the longest.
  EXPECT_EQ(m.note(microseconds(300)), microseconds(600));
  EXPECT_EQ(m.note(microseconds(120)), microseconds(600));
  // Back to back: the longest recent pause still counts.
  for (int i = 0; i < PauseMemory::kGaps - 2; ++i) EXPECT_EQ(m.note(microseconds(0)), microseconds(600)) << i;
  // Once it has left the memory of kGaps pauses, the next longest counts.
  EXPECT_EQ(m.note(microseconds(0)), microseconds(240));
  EXPECT_EQ(m.note(microseconds(0)), PauseMemory::kMinSpin);
  // Within [kMinSpin, kMaxSpin]: half the cap is spun through (capped) ...
  EXPECT_EQ(m.note(PauseMemory::kMaxSpin / 2), PauseMemory::kMaxSpin);
  // ... longer pauses are not: once they fill the memory, the shortest spin.
  for (int i = 0; i < PauseMemory::kGaps - 1; ++i) m.note(PauseMemory::kMaxSpin + microseconds(1000));
  EXPECT_EQ(m.note(PauseMemory::kMaxSpin + microseconds(1000)), PauseMemory::kMinSpin);
  EXPECT_EQ(m.note(microseconds(10)), PauseMemory::kMinSpin);
  EXPECT_EQ(m.note(microseconds(70)), microseconds(140));
}

TEST(ThreadPool, WorkerSpinIsThePauseMemorysWithinItsBounds) {
  kt::ThreadPool pool(2, {});
  EXPECT_EQ(pool.worker_spin(), kt::ThreadPool::kMinSpin);  // no run yet
  for (int i = 0; i < 8; ++i) {
    pool.run(4, [](int64_t, int) {});
    EXPECT_GE(pool.worker_spin(), kt::ThreadPool::kMinSpin);
    EXPECT_LE(pool.worker_spin(), kt::ThreadPool::kMaxSpin);
  }
}

TEST(ThreadPool, WorkerIRunsOnTheIthCpu) {
  const std::vector<int> cpus = kt::allowed_cpus();
  ASSERT_FALSE(cpus.empty());
  ThreadPool pool(static_cast<int>(cpus.size()) + 1, cpus);
  std::mutex mutex;
  std::vector<std::pair<int, int>> where;  // (index, cpu)
  pool.run(400, [&](int64_t, int index) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      where.emplace_back(index, sched_getcpu());
    }
  });
  ASSERT_EQ(where.size(), 400u);
  for (const auto& w : where)
    EXPECT_EQ(w.second, cpus[static_cast<size_t>(w.first) % cpus.size()]) << "worker " << w.first;
}

// A grouped run: the items of group g run once each, only on the workers
// of group g, even a group's single item; one group is a plain run.
TEST(ThreadPool, GroupedRunsKeepEachGroupsItemsOnItsWorkers) {
  const std::vector<int> groups = {0, 0, 1, 1, 1};
  ThreadPool pool(5, {}, false, groups);
  ASSERT_EQ(pool.groups(), 2);
  EXPECT_EQ(pool.workers_in(0), 2);
  EXPECT_EQ(pool.workers_in(1), 3);
  for (const std::vector<int64_t>& bounds : std::vector<std::vector<int64_t>>{{0, 7, 300}, {0, 1, 2}, {0, 0, 5}, {0, 9, 9}}) {
    std::vector<std::atomic<int>> count(static_cast<size_t>(bounds[2]));
    std::vector<std::atomic<int>> group_of_runner(static_cast<size_t>(bounds[2]));
    pool.run_grouped(bounds.data(), [&](int64_t item, int index) {
      count[static_cast<size_t>(item)].fetch_add(1);
      group_of_runner[static_cast<size_t>(item)].store(pool.group_of(index));
    });
    for (int64_t i = 0; i < bounds[2]; ++i) {
      EXPECT_EQ(count[static_cast<size_t>(i)].load(), 1);
      EXPECT_EQ(group_of_runner[static_cast<size_t>(i)].load(), i < bounds[1] ? 0 : 1) << i;
    }
  }
  // Groups without a worker, or one group: not grouped.
  EXPECT_EQ(ThreadPool(3, {}, false, {0, 0, 2}).groups(), 1);
  ThreadPool one(3, {}, false, {0, 0, 0});
  EXPECT_EQ(one.groups(), 1);
  const int64_t bounds[2] = {0, 40};
  std::atomic<int> ran{0};
  one.run_grouped(bounds, [&](int64_t, int) { ran.fetch_add(1); });
  EXPECT_EQ(ran.load(), 40);
}
