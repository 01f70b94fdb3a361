// The boundary guard shared by every ABI shim (src/api, src/io): run the
// call, turn every exception into a status and this thread's kt_last_error().
#pragma once

#include <string>

#include "core/error.h"
#include "kt_c_api.h"

namespace kt {

// Makes message the calling thread's kt_last_error() (defined in
// api/library.cpp, which owns the thread-local message).
void set_last_error(const std::string& message) noexcept;

template <class F>
kt_status guarded(const char* where, F&& fn) noexcept {
  try {
    as_call(where, fn);
    return KT_OK;
  } catch (const Error& e) {
    set_last_error(e.what());
    return e.status();
  } catch (...) {
    // The named message could not be built.
    set_last_error(std::string(where) + ": out of memory");
    return KT_ERR_OUT_OF_MEMORY;
  }
}

}  // namespace kt
