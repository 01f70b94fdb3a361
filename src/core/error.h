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

inline void check(bool ok, kt_status status, const std::string& message) {
  if (!ok) fail(status, message);
}

}  // namespace kt
