// Errors inside the core are kt::Error exceptions carrying a kt_status; the
// ABI shims in src/api catch them (and everything else) at the boundary.
#pragma once

#include <stdexcept>
#include <string>

#include "kt_c_api.h"

namespace kt {

class Error : public std::runtime_error {
 public:
  Error(kt_status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  kt_status status() const { return status_; }

 private:
  kt_status status_;
};

[[noreturn]] inline void fail(kt_status status, const std::string& message) {
  throw Error(status, message);
}

}  // namespace kt

// Fails with status and message unless ok. A macro so that the message is
// built only on failure: these checks run on every call, and building the
// messages of a passing decode forward's checks took about half of its
// bookkeeping time.
#define KT_CHECK(ok, status, message)           \
  do {                                          \
    if (!(ok)) ::kt::fail((status), (message)); \
  } while (0)
