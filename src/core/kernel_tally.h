// Which kernels ran. While the engine's profile is on, every call of a
// kernel table's GEMM entries (and of its W^T panel builds) is counted, with
// the flops it computed, into the tally of the stage that runs: the
// stage clock points this thread's tally at that stage, and the worker pool
// hands the caller's tally to its workers for the run. Off, a call costs one
// thread-local load.
//
// A call counts as the kernel that computed it: the AMX GEMMs count only
// what they run on tiles; what they leave to the AVX-512 kernels (fewer than
// 16 rows, a K remainder) counts as those kernels' calls, as does what the
// oneDNN backend leaves to kt's. Table entries count through
// kernels/counted.h.
#pragma once

#include <atomic>
#include <cstdint>

namespace kt {

enum class KernelTable : int { kRef, kAvx2, kAvx512Bf16, kAmx, kOneDnn, kCount };
enum class KernelEntry : int {
  kGemmBf16w,
  kGemmBf16wNn,
  kGemmBf16wGrouped,
  kGemmQuant,
  kGemmInt8,
  kGemmZipBf16,
  kSgemmNn,
  kSgemmNt,
  kSgemmTn,
  kTransposePanels,
  kCount
};

constexpr int kKernelIds =
    static_cast<int>(KernelTable::kCount) * static_cast<int>(KernelEntry::kCount);
constexpr int kernel_id(KernelTable t, KernelEntry e) {
  return static_cast<int>(t) * static_cast<int>(KernelEntry::kCount) + static_cast<int>(e);
}
// "gemm_bf16w__amx" (entry__table), or nullptr outside [0, kKernelIds).
const char* kernel_id_name(int id);

struct KernelTally {
  std::atomic<int64_t> calls[kKernelIds] = {};
  std::atomic<int64_t> flops[kKernelIds] = {};  // 2 m n k of each GEMM
  void reset() {
    for (int i = 0; i < kKernelIds; ++i) {
      calls[i].store(0, std::memory_order_relaxed);
      flops[i].store(0, std::memory_order_relaxed);
    }
  }
};

// This thread's tally (nullptr: not counting).
inline KernelTally*& current_kernel_tally() {
  static thread_local KernelTally* tally = nullptr;
  return tally;
}

inline void count_kernel(int id, int64_t flops) {
  if (KernelTally* t = current_kernel_tally()) {
    t->calls[id].fetch_add(1, std::memory_order_relaxed);
    t->flops[id].fetch_add(flops, std::memory_order_relaxed);
  }
}

// Points this thread's tally at t for the scope (the pool's workers, for one run).
class KernelTallyScope {
 public:
  explicit KernelTallyScope(KernelTally* t) : saved_(current_kernel_tally()) {
    current_kernel_tally() = t;
  }
  ~KernelTallyScope() { current_kernel_tally() = saved_; }
  KernelTallyScope(const KernelTallyScope&) = delete;
  KernelTallyScope& operator=(const KernelTallyScope&) = delete;

 private:
  KernelTally* saved_;
};

}  // namespace kt
