// The library-wide calls of the ABI: version and build, status names, the
// thread-local last error, the CPU's ISA. Nothing here can fail.
#include <string>

#include "api/guard.h"
#include "core/checked.h"
#include "kernels/kernels.h"
#include "kt_c_api.h"

#ifdef KT_HAVE_BUILD_INFO_H
#include "kt_build_info.h"
#endif
#ifndef KT_BUILD_INFO
#define KT_BUILD_INFO "unknown build"
#endif

namespace {
thread_local std::string t_last_error;
}  // namespace

namespace kt {

void set_last_error(const std::string& message) noexcept {
  try {
    t_last_error = message;
  } catch (...) {
    t_last_error.clear();  // out of memory for the message: the status still reports
  }
}

}  // namespace kt

extern "C" {

const char* kt_version(void) {
#define KT_STR2(x) #x
#define KT_STR(x) KT_STR2(x)
  return KT_STR(KT_VERSION_MAJOR) "." KT_STR(KT_VERSION_MINOR) "." KT_STR(KT_VERSION_PATCH);
}

int kt_version_number(void) {
  return KT_VERSION_MAJOR * 10000 + KT_VERSION_MINOR * 100 + KT_VERSION_PATCH;
}

int kt_abi_version(void) { return KT_ABI_VERSION; }

const char* kt_build_info(void) { return KT_BUILD_INFO; }

const char* kt_status_string(kt_status status) {
  switch (kt::enum_bits(status)) {
    case KT_OK: return "KT_OK";
    case KT_ERR_INVALID_ARGUMENT: return "KT_ERR_INVALID_ARGUMENT";
    case KT_ERR_NULL_POINTER: return "KT_ERR_NULL_POINTER";
    case KT_ERR_INVALID_HANDLE: return "KT_ERR_INVALID_HANDLE";
    case KT_ERR_DTYPE: return "KT_ERR_DTYPE";
    case KT_ERR_SHAPE: return "KT_ERR_SHAPE";
    case KT_ERR_STRIDE: return "KT_ERR_STRIDE";
    case KT_ERR_DEVICE: return "KT_ERR_DEVICE";
    case KT_ERR_EXPERT_ID: return "KT_ERR_EXPERT_ID";
    case KT_ERR_TOO_MANY_TOKENS: return "KT_ERR_TOO_MANY_TOKENS";
    case KT_ERR_CONTEXT: return "KT_ERR_CONTEXT";
    case KT_ERR_NOT_BOUND: return "KT_ERR_NOT_BOUND";
    case KT_ERR_NOT_LOADED: return "KT_ERR_NOT_LOADED";
    case KT_ERR_MODE: return "KT_ERR_MODE";
    case KT_ERR_UNSUPPORTED: return "KT_ERR_UNSUPPORTED";
    case KT_ERR_OUT_OF_MEMORY: return "KT_ERR_OUT_OF_MEMORY";
    case KT_ERR_IO: return "KT_ERR_IO";
    case KT_ERR_INTERNAL: return "KT_ERR_INTERNAL";
    case KT_ERR_COMM: return "KT_ERR_COMM";
  }
  return "KT_ERR_UNKNOWN";
}

const char* kt_last_error(void) { return t_last_error.c_str(); }

void kt_clear_error(void) { t_last_error.clear(); }

kt_isa kt_cpu_isa(void) {
  try {
    return kt::detect_cpu_isa();
  } catch (...) {
    return KT_ISA_REF;
  }
}

const char* kt_isa_name(kt_isa isa) {
  return kt::enum_bits(isa) == KT_ISA_AUTO ? "auto" : kt::kernel_isa_name(isa);
}

}  // extern "C"
