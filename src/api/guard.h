// The boundary guard shared by every ABI shim (src/api, src/io): run the
// call, turn every exception into a status and this thread's kt_last_error().
#pragma once

#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "core/error.h"
#include "kt_c_api.h"

namespace kt {

// Makes message the calling thread's kt_last_error() (defined in api/moe.cpp,
// which owns the thread-local message).
void set_last_error(const std::string& message) noexcept;

// `message` as it must reach the host: starting with the call's name. Core
// code that cannot know its caller (an allocation, a file reader) throws
// messages without it; those get it here.
inline std::string naming_call(const char* where, const char* message) {
  const size_t n = std::strlen(where);
  if (std::strncmp(message, where, n) == 0 && message[n] == ':') return message;
  return std::string(where) + ": " + message;
}

template <class F>
kt_status guarded(const char* where, F&& fn) noexcept {
  try {
    fn();
    return KT_OK;
  } catch (const Error& e) {
    try {
      set_last_error(naming_call(where, e.what()));
    } catch (...) {
      set_last_error(e.what());
    }
    return e.status();
  } catch (const std::bad_alloc&) {
    set_last_error(std::string(where) + ": out of memory");
    return KT_ERR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_last_error(std::string(where) + ": internal error: " + e.what());
    return KT_ERR_INTERNAL;
  } catch (...) {
    set_last_error(std::string(where) + ": internal error");
    return KT_ERR_INTERNAL;
  }
}

}  // namespace kt
