// This machine's limits, measured in-run: dot-product and FMA peaks on all
// worker threads, and DRAM read bandwidth. kt's results are quoted against
// them, so a figure means the same thing on every CPU the benchmark runs on.
#ifndef KT_BENCH_MACHINE_LIMITS_H_
#define KT_BENCH_MACHINE_LIMITS_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace kt_bench {

struct MachineLimits {
  int threads = 1;
  bool has_avx2_fma = false;
  bool has_avx512f = false;
  bool has_avx512bf16 = false;
  bool has_avx512vnni = false;
  bool has_amx_bf16 = false;        // CPU reports AMX-BF16 and the OS granted the tile state
  bool has_amx_int8 = false;        // CPU reports AMX-INT8 and the OS granted the tile state
  double bf16_dot_gflops = 0;       // vdpbf16ps, all threads; 0 when the CPU has no AVX512_BF16
  // Integer dot products (GOP/s: a multiply and an add per product), what an
  // int8 or int16 activation path would run: vpdpbusd and vpdpwssd (0
  // without AVX512_VNNI), tdpbssd (0 without AMX-INT8).
  double int8_dot_gops = 0;
  double int16_dot_gops = 0;
  double amx_bf16_gflops = 0;       // tdpbf16ps, all threads; 0 without AMX-BF16 (or a build without it)
  double amx_int8_gops = 0;
  double fp32_fma_avx512_gflops = 0;  // 512-bit FMA, all threads; 0 without AVX-512F
  double fp32_fma_avx2_gflops = 0;    // 256-bit FMA, all threads (the AVX2 path's roof)
  double dram_read_gbs = 0;         // multi-threaded streaming read of a buffer >> L3
  size_t dram_buffer_bytes = 0;
  size_t l3_bytes = 0;              // as the OS reports it (0 if unknown)
};

// A plain streaming read by the benchmark's threads (pinned as kt's workers
// are), for timing beside kt's calls: the DRAM bandwidth at that moment, on a
// read of the same size. Each read takes the next window of the buffer, read
// round and round, so a byte is read again only after the whole buffer, far
// larger than the last-level cache: every read comes from DRAM. The threads
// sleep between reads.
class StreamReader {
 public:
  StreamReader(int threads, size_t buffer_bytes, bool avx2);
  ~StreamReader();
  StreamReader(const StreamReader&) = delete;
  StreamReader& operator=(const StreamReader&) = delete;
  // Seconds from the first thread's start to the last one's end for `bytes`
  // split evenly between the threads (scaled from the whole 256-byte groups
  // read); negative when the buffer could not be had or `bytes` is over its
  // size.
  double read_seconds(size_t bytes);
  // The buffer's bytes (whole 2 MiB pages; 0 when it could not be had).
  size_t buffer_bytes() const { return buffer_ ? bytes_ : 0; }

 private:
  struct Job {
    size_t begin, bytes;  // past the buffer's end, it goes on from its start
    bool touch;  // write (first touch) instead of reading
  };
  void worker(int i);
  void release_and_wait();

  int threads_;
  bool avx2_;
  uint8_t* buffer_ = nullptr;
  size_t bytes_ = 0, next_ = 0;
  std::vector<Job> jobs_;
  std::vector<double> started_, ended_;
  std::vector<uint64_t> sums_;
  std::vector<std::thread> team_;
  std::mutex mutex_;
  std::condition_variable wake_, done_cv_;
  uint64_t generation_ = 0;
  int done_ = 0;
  bool quit_ = false;
  std::atomic<int> arrived_{0};
};

// Runs every measurement on `threads` threads pinned to the first CPUs of the
// process's affinity mask. `quick` shortens the loops and the buffer (smoke).
MachineLimits measure_machine_limits(int threads, bool quick);

// Per-ISA loops, each in its own translation unit with its own flags; a
// caller reaches them only after checking the CPU. Each returns the FLOPs it
// executed (integer ops for the int8/int16 loops; for the read, a checksum
// that keeps the loads alive).
double run_bf16_dot_avx512bf16(int64_t iterations);
double run_int8_dot_avx512vnni(int64_t iterations);
double run_int16_dot_avx512vnni(int64_t iterations);
double run_bf16_tile_amx(int64_t iterations);
double run_int8_tile_amx(int64_t iterations);
bool request_amx_permission();  // the tile data state for this process (Linux arch_prctl)
double run_fp32_fma_avx512(int64_t iterations);
double run_fp32_fma_avx2(int64_t iterations);
uint64_t stream_read_avx2(const void* data, size_t bytes);

}  // namespace kt_bench

#endif  // KT_BENCH_MACHINE_LIMITS_H_
