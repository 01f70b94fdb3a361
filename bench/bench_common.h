// Small pieces shared by the benchmark's translation units: bf16 rounding,
// a deterministic generator, host tensors described as DLPack, timing.
#ifndef KT_BENCH_COMMON_H_
#define KT_BENCH_COMMON_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <dlpack/dlpack.h>

namespace kt_bench {

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// xorshift64; normal() is a cheap sum-of-uniforms approximation: the
// benchmark needs plausible magnitudes, not exact statistics.
struct Rng {
  uint64_t state;
  explicit Rng(uint64_t seed) : state(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  }
  float normal() {
    const uint64_t r = next();
    float acc = 0;
    for (int i = 0; i < 4; ++i) acc += static_cast<float>((r >> (16 * i)) & 0xffff) / 65535.f;
    return (acc - 2.f) * 1.7320508f;
  }
};

// A compact row-major host tensor whose DLTensor view kt and the baselines borrow.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DLDataTypeCode code, int bits, std::vector<int64_t> shape) : shape_(std::move(shape)) {
    int64_t n = 1;
    for (int64_t d : shape_) n *= d;
    numel_ = n;
    storage_.assign(static_cast<size_t>(n * bits / 8 + 64), 0);
    // 64-byte aligned start: vector loads in the baselines never split a line.
    uintptr_t p = reinterpret_cast<uintptr_t>(storage_.data());
    offset_ = static_cast<size_t>((64 - (p & 63)) & 63);
    dl_.data = storage_.data() + offset_;
    dl_.device = {kDLCPU, 0};
    dl_.ndim = static_cast<int>(shape_.size());
    dl_.dtype = {static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1};
    dl_.shape = shape_.data();
  }
  HostTensor(const HostTensor&) = delete;
  HostTensor& operator=(const HostTensor&) = delete;
  HostTensor(HostTensor&& o) noexcept { *this = std::move(o); }
  HostTensor& operator=(HostTensor&& o) noexcept {
    storage_ = std::move(o.storage_);
    shape_ = std::move(o.shape_);
    offset_ = o.offset_;
    numel_ = o.numel_;
    dl_ = o.dl_;
    dl_.data = storage_.empty() ? nullptr : storage_.data() + offset_;
    dl_.shape = shape_.data();
    return *this;
  }

  const DLTensor* dl() const { return &dl_; }
  int64_t numel() const { return numel_; }
  int64_t dim(int i) const { return shape_[static_cast<size_t>(i)]; }
  uint16_t* u16() { return static_cast<uint16_t*>(dl_.data); }
  const uint16_t* u16() const { return static_cast<const uint16_t*>(dl_.data); }
  float* f32() { return static_cast<float*>(dl_.data); }
  const float* f32() const { return static_cast<const float*>(dl_.data); }
  int32_t* i32() { return static_cast<int32_t*>(dl_.data); }
  const int32_t* i32() const { return static_cast<const int32_t*>(dl_.data); }
  size_t bytes() const { return storage_.empty() ? 0 : storage_.size() - 64; }

 private:
  std::vector<uint8_t> storage_;
  std::vector<int64_t> shape_;
  size_t offset_ = 0;
  int64_t numel_ = 0;
  DLTensor dl_{};
};

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Median wall time of `reps` calls after `warmup` calls; run(i) gets the call
// index so callers can cycle through inputs (cold weights). With pause_s,
// the caller sleeps that long before each call, untimed (a host's own work
// between calls). Returns a negative value as soon as a call reports
// failure.
inline double median_seconds(int warmup, int reps, const std::function<bool(int)>& run,
                             double pause_s = 0) {
  int call = 0;
  for (int i = 0; i < warmup; ++i)
    if (!run(call++)) return -1;
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    if (pause_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(pause_s));
    const double start = now_seconds();
    if (!run(call++)) return -1;
    times.push_back(now_seconds() - start);
  }
  std::sort(times.begin(), times.end());
  const size_t n = times.size();
  return n % 2 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2]);
}

}  // namespace kt_bench

#endif  // KT_BENCH_COMMON_H_
