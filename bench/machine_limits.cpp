#include "machine_limits.h"

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "bench_common.h"

namespace kt_bench {

namespace {

// CPUs of this process's affinity mask, in order; worker i is pinned to the
// i-th (as kt pins its own workers), so peaks and kt run on the same cores.
std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

// Pins the calling thread to the i-th CPU of `cpus` (wrapping), as kt pins worker i.
void pin_to(const std::vector<int>& cpus, int i) {
  if (cpus.empty()) return;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpus[static_cast<size_t>(i) % cpus.size()], &one);
  pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
}

// Runs body(i) on `threads` pinned threads released together; returns the
// wall time from the release to the last thread's end.
double run_team(int threads, const std::function<void(int)>& body) {
  const std::vector<int> cpus = allowed_cpus();
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> team;
  for (int i = 0; i < threads; ++i) {
    team.emplace_back([&, i] {
      pin_to(cpus, i);
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) {
      }
      body(i);
    });
  }
  while (ready.load() < threads) {
  }
  const double start = now_seconds();
  go.store(true, std::memory_order_release);
  for (auto& t : team) t.join();
  return now_seconds() - start;
}

// Best rate (FLOP/s) of a few timed runs of `loop` on every thread: a peak
// is what the hardware can do, so noise only ever lowers it.
double peak_gflops(int threads, int64_t iterations, int tries, double (*loop)(int64_t)) {
  std::vector<double> flops(static_cast<size_t>(threads));
  double best = 0;
  run_team(threads, [&](int i) { flops[static_cast<size_t>(i)] = loop(iterations / 10); });  // warm-up
  for (int t = 0; t < tries; ++t) {
    const double seconds = run_team(threads, [&](int i) { flops[static_cast<size_t>(i)] = loop(iterations); });
    double total = 0;
    for (double f : flops) total += f;
    best = std::max(best, total / seconds / 1e9);
  }
  return best;
}

size_t l3_cache_bytes() {
#ifdef _SC_LEVEL3_CACHE_SIZE
  const long v = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (v > 0) return static_cast<size_t>(v);
#endif
  return 0;
}

// Plain 64-bit loads, for CPUs without AVX2.
uint64_t stream_read_portable(const void* data, size_t bytes) {
  const uint64_t* p = static_cast<const uint64_t*>(data);
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (size_t i = 0; i + 4 <= bytes / 8; i += 4) {
    s0 += p[i];
    s1 += p[i + 1];
    s2 += p[i + 2];
    s3 += p[i + 3];
  }
  return s0 + s1 + s2 + s3;
}

// A buffer for streaming reads, in huge pages where the OS gives them, as kt
// asks for its own weights (core/buffer.h): with 4 KiB pages a read of a VM's
// memory also pays a nested page walk per page, and the limit would be a
// different machine's. `bytes` is a multiple of 2 MiB.
uint8_t* alloc_stream_buffer(size_t bytes) {
  void* p = std::aligned_alloc(size_t{2} << 20, bytes);
  if (p) madvise(p, bytes, MADV_HUGEPAGE);
  return static_cast<uint8_t*>(p);
}

uint64_t stream_read(const void* data, size_t bytes, bool avx2) {
  return avx2 ? stream_read_avx2(data, bytes) : stream_read_portable(data, bytes);
}

// The best of `tries` reads of a whole buffer of about `bytes` (after one
// that warms the TLBs), by StreamReader as the reads beside kt's calls.
double dram_read_gbs(int threads, size_t bytes, int tries, bool avx2) {
  StreamReader reader(threads, bytes, avx2);
  const size_t whole = reader.buffer_bytes();
  if (whole == 0) return 0;
  double best = 0;
  for (int t = 0; t <= tries; ++t) {
    const double seconds = reader.read_seconds(whole);
    if (seconds <= 0) return 0;
    if (t > 0) best = std::max(best, static_cast<double>(whole) / seconds / 1e9);
  }
  return best;
}

}  // namespace

StreamReader::StreamReader(int threads, size_t buffer_bytes, bool avx2)
    : threads_(std::max(1, threads)),
      avx2_(avx2),
      started_(static_cast<size_t>(threads_)),
      ended_(static_cast<size_t>(threads_)),
      sums_(static_cast<size_t>(threads_)) {
  bytes_ = buffer_bytes / (size_t{2} << 20) * (size_t{2} << 20);
  buffer_ = bytes_ ? alloc_stream_buffer(bytes_) : nullptr;
  if (!buffer_) return;
  const std::vector<int> cpus = allowed_cpus();
  for (int i = 0; i < threads_; ++i)
    team_.emplace_back([this, cpus, i] {
      pin_to(cpus, i);
      worker(i);
    });
  // First touch by the threads that read, a slice of whole huge pages each,
  // so the pages lie near them.
  const size_t slice =
      bytes_ / static_cast<size_t>(threads_) / (size_t{2} << 20) * (size_t{2} << 20);
  for (int i = 0; i < threads_; ++i) {
    const size_t begin = slice * static_cast<size_t>(i);
    jobs_.push_back({begin, i + 1 == threads_ ? bytes_ - begin : slice, true});
  }
  release_and_wait();
}

StreamReader::~StreamReader() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    quit_ = true;
    ++generation_;
  }
  wake_.notify_all();
  for (std::thread& t : team_) t.join();
  std::free(buffer_);
}

void StreamReader::worker(int i) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (quit_) return;
    }
    // Sleeping threads wake some microseconds apart: they meet here, spinning
    // only for that long, so the timed reads start together.
    arrived_.fetch_add(1);
    while (arrived_.load(std::memory_order_acquire) < threads_) {
    }
    const Job& job = jobs_[static_cast<size_t>(i)];
    started_[static_cast<size_t>(i)] = now_seconds();
    if (job.touch) {
      std::memset(buffer_ + job.begin, i + 1, job.bytes);
    } else {
      const size_t first = std::min(job.bytes, bytes_ - job.begin);
      sums_[static_cast<size_t>(i)] = stream_read(buffer_ + job.begin, first, avx2_);
      if (first < job.bytes)
        sums_[static_cast<size_t>(i)] += stream_read(buffer_, job.bytes - first, avx2_);
    }
    ended_[static_cast<size_t>(i)] = now_seconds();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++done_;
    }
    done_cv_.notify_one();
  }
}

void StreamReader::release_and_wait() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    arrived_.store(0);
    done_ = 0;
    ++generation_;
  }
  wake_.notify_all();
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return done_ == threads_; });
}

double StreamReader::read_seconds(size_t bytes) {
  // Whole 256-byte groups per thread (so every piece stays aligned).
  const size_t per_thread = bytes / static_cast<size_t>(threads_) / 256 * 256;
  const size_t window = per_thread * static_cast<size_t>(threads_);
  if (!buffer_ || per_thread == 0 || window > bytes_) return -1;
  jobs_.clear();
  for (int i = 0; i < threads_; ++i)
    jobs_.push_back({(next_ + per_thread * static_cast<size_t>(i)) % bytes_, per_thread, false});
  next_ = (next_ + window) % bytes_;
  release_and_wait();
  const double start = *std::min_element(started_.begin(), started_.end());
  const double end = *std::max_element(ended_.begin(), ended_.end());
  volatile uint64_t sink = sums_[0];
  (void)sink;
  return (end - start) * static_cast<double>(bytes) / static_cast<double>(window);
}

MachineLimits measure_machine_limits(int threads, bool quick) {
  MachineLimits m;
  m.threads = std::max(1, threads);
  __builtin_cpu_init();
  m.has_avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  m.has_avx512f = __builtin_cpu_supports("avx512f");
  m.has_avx512bf16 = m.has_avx512f && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  // About 0.3 s per timed run at a few hundred GFLOP/s per core (0.03 s quick).
  const int64_t iterations = quick ? 2'000'000 : 20'000'000;
  const int tries = quick ? 1 : 3;
  m.has_avx512vnni = m.has_avx512f && __builtin_cpu_supports("avx512vnni");
  if (m.has_avx512bf16) m.bf16_dot_gflops = peak_gflops(m.threads, iterations / 2, tries, run_bf16_dot_avx512bf16);
  if (m.has_avx512vnni) {
    m.int8_dot_gops = peak_gflops(m.threads, iterations / 2, tries, run_int8_dot_avx512vnni);
    m.int16_dot_gops = peak_gflops(m.threads, iterations / 2, tries, run_int16_dot_avx512vnni);
  }
#if KT_BENCH_HAVE_AMX
  const bool tiles = __builtin_cpu_supports("amx-tile") && request_amx_permission();
  m.has_amx_bf16 = m.has_avx512bf16 && tiles && __builtin_cpu_supports("amx-bf16");
  m.has_amx_int8 = tiles && __builtin_cpu_supports("amx-int8");
  // A tdpbf16ps is 16384 FLOPs: far fewer iterations for the same time.
  if (m.has_amx_bf16) m.amx_bf16_gflops = peak_gflops(m.threads, iterations / 64, tries, run_bf16_tile_amx);
  if (m.has_amx_int8)
    m.amx_int8_gops = peak_gflops(m.threads, iterations / 128, tries, run_int8_tile_amx);
#endif
  if (m.has_avx512f) m.fp32_fma_avx512_gflops = peak_gflops(m.threads, iterations, tries, run_fp32_fma_avx512);
  if (m.has_avx2_fma) m.fp32_fma_avx2_gflops = peak_gflops(m.threads, iterations, tries, run_fp32_fma_avx2);
  // Far larger than the last-level cache, so every pass streams from DRAM.
  m.l3_bytes = l3_cache_bytes();
  const size_t gib = size_t{1} << 30;
  m.dram_buffer_bytes = quick ? gib / 4 : std::min(2 * gib, std::max(gib, 8 * m.l3_bytes));
  // More passes than the compute loops: on a shared machine a quiet moment is
  // needed, and one pass is short.
  m.dram_read_gbs = dram_read_gbs(m.threads, m.dram_buffer_bytes, quick ? 1 : 6, m.has_avx2_fma);
  return m;
}

}  // namespace kt_bench
