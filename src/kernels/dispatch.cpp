// Runtime ISA dispatch: cpuid feature bits, confirmed by the OS-enabled state
// in XCR0 (and the AMX tile permission on Linux).
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

#include "kernels/kernels.h"

namespace kt {

#define KT_KERNELS(isa, symbol, compiled, name) extern const Kernels symbol;
#define KT_KERNEL_VARIANT(isa, symbol, compiled, name, feature, feature_name) extern const Kernels symbol;
#include "kernels/kernel_list.inc"

static uint64_t read_xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

static bool amx_permitted() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

kt_isa detect_cpu_isa() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return KT_ISA_REF;
  // F16C: the AVX2 unit converts fp8 codes through half precision.
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), f16c = c & (1u << 29);
  if (!osxsave) return KT_ISA_REF;
  const uint64_t xcr0 = read_xcr0();
  const bool os_avx = (xcr0 & 0x6) == 0x6;
  const bool os_avx512 = (xcr0 & 0xe6) == 0xe6;
  const bool os_amx = (xcr0 & 0x60000) == 0x60000;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return KT_ISA_REF;
  const bool avx2 = b & (1u << 5);
  const bool avx512f = b & (1u << 16), avx512bw = b & (1u << 30), avx512vl = b & (1u << 31);
  const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
  unsigned a1 = 0, b1, c1, d1;
  __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
  const bool avx512bf16 = a1 & (1u << 5);
  if (!(os_avx && avx2 && fma && f16c)) return KT_ISA_REF;
  if (!(os_avx512 && avx512f && avx512bw && avx512vl && avx512bf16)) return KT_ISA_AVX2;
  if (os_amx && amx_bf16 && amx_tile && amx_permitted()) return KT_ISA_AMX;
  return KT_ISA_AVX512BF16;
}

const Kernels* kernels_for(kt_isa isa) {
#define KT_KERNELS(level, symbol, compiled, name) \
  if ((compiled) && isa == (level)) return &symbol;
#include "kernels/kernel_list.inc"
  return nullptr;
}

std::vector<KernelTableInfo> compiled_kernel_tables() {
  std::vector<KernelTableInfo> v;
  const kt_isa cpu = detect_cpu_isa();
  const auto add = [&](const Kernels& k, const char* name, bool (*feature)(), const char* feature_name) {
    KernelTableInfo t{&k, name, ""};
    if (k.isa > cpu)
      t.missing = kernel_isa_name(k.isa);
    else if (feature && !feature())
      t.missing = feature_name;
    v.push_back(t);
  };
#define KT_KERNELS(level, symbol, compiled, name) \
  if (compiled) add(symbol, name, nullptr, "");
#define KT_KERNEL_VARIANT(level, symbol, compiled, name, feature, feature_name) \
  if (compiled) add(symbol, name, feature, feature_name);
#include "kernels/kernel_list.inc"
  return v;
}

const char* kernel_isa_name(kt_isa isa) {
#define KT_KERNELS(level, symbol, compiled, name) \
  if (isa == (level)) return name;
#include "kernels/kernel_list.inc"
  return "unknown";
}

bool cpu_has_avx_vnni() {
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 4));
}

bool cpu_has_amx_int8() {
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25));
}

#if KT_HAVE_AMX
namespace amx {
bool self_test();
}
bool amx_kernels_verified() {
  static const bool verified = amx::self_test();
  return verified;
}
#else
bool amx_kernels_verified() { return false; }
#endif

const Kernels& select_kernels(kt_isa cap) {
  kt_isa cpu = detect_cpu_isa();
  if (cpu == KT_ISA_AMX && !amx_kernels_verified()) cpu = KT_ISA_AVX512BF16;
  const Kernels* best = &kernels_ref;
#define KT_KERNELS(level, symbol, compiled, name) \
  if ((compiled) && (level) <= cap && (level) <= cpu) best = &symbol;
#include "kernels/kernel_list.inc"
  return *best;
}

}  // namespace kt
