// Errors inside the core are kt::Error exceptions carrying a kt_status; the
// ABI shims in src/api catch them (and everything else) at the boundary.
#pragma once

#include <cstring>
#include <new>
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

// `message` as it must reach the host: starting with the call's name. Core
// code that cannot know its caller (an allocation, a file reader) throws
// messages without it; those get it here.
inline std::string naming_call(const char* where, const char* message) {
  const size_t n = std::strlen(where);
  if (std::strncmp(message, where, n) == 0 && message[n] == ':') return message;
  return std::string(where) + ": " + message;
}

// Runs fn as the ABI call `where` reports it: every exception leaves as a
// kt::Error whose message names the call (KT_ERR_OUT_OF_MEMORY for a failed
// allocation, KT_ERR_INTERNAL for anything that is not a kt::Error). The ABI
// shims turn that into a status; code below the ABI that runs a layer call
// for itself gets the same status and message.
template <class F>
void as_call(const char* where, F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    throw Error(e.status(), naming_call(where, e.what()));
  } catch (const std::bad_alloc&) {
    throw Error(KT_ERR_OUT_OF_MEMORY, std::string(where) + ": out of memory");
  } catch (const std::exception& e) {
    throw Error(KT_ERR_INTERNAL, std::string(where) + ": internal error: " + e.what());
  } catch (...) {
    throw Error(KT_ERR_INTERNAL, std::string(where) + ": internal error");
  }
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
