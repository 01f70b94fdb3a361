// The checkpoint and packed-cache calls use the boundary guard, and every
// message names the kt call: errors raised deep in the readers and writers
// (which name the file) get the call's name in front.
#pragma once

#include <string>

#include "api/guard.h"

namespace kt {
namespace io {

template <class F>
kt_status guarded(const char* where, F&& fn) noexcept {
  return kt::guarded(where, [&] {
    try {
      fn();
    } catch (const Error& e) {
      const std::string prefix = std::string(where) + ": ";
      const std::string message = e.what();
      if (message.compare(0, prefix.size(), prefix) == 0) throw;
      throw Error(e.status(), prefix + message);
    }
  });
}

}  // namespace io
}  // namespace kt
