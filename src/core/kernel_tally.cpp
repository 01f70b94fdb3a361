#include "core/kernel_tally.h"

#include <array>
#include <string>

namespace kt {

const char* kernel_id_name(int id) {
  static const std::array<std::string, kKernelIds> names = [] {
    const char* const entries[] = {"gemm_bf16w", "gemm_bf16w_nn",   "gemm_bf16w_grouped",
                                   "gemm_quant", "gemm_int8",       "gemm_zip_bf16",
                                   "sgemm_nn",   "sgemm_nt",        "sgemm_tn",
                                   "transpose_panels"};
    const char* const tables[] = {"ref", "avx2", "avx512bf16", "amx", "onednn"};
    static_assert(sizeof(entries) / sizeof(*entries) == static_cast<size_t>(KernelEntry::kCount),
                  "entry names");
    static_assert(sizeof(tables) / sizeof(*tables) == static_cast<size_t>(KernelTable::kCount),
                  "table names");
    std::array<std::string, kKernelIds> n;
    for (int t = 0; t < static_cast<int>(KernelTable::kCount); ++t)
      for (int e = 0; e < static_cast<int>(KernelEntry::kCount); ++e)
        n[static_cast<size_t>(
            kernel_id(static_cast<KernelTable>(t), static_cast<KernelEntry>(e)))] =
            std::string(entries[e]) + "__" + tables[t];
    return n;
  }();
  return id >= 0 && id < kKernelIds ? names[static_cast<size_t>(id)].c_str() : nullptr;
}

}  // namespace kt
