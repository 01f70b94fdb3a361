// What every fuzz target asserts about a kt call on hostile files: it returns
// a documented failure status (never KT_ERR_INTERNAL) with a message that
// names the call, or succeeds.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kt_c_api.h"

namespace kt_fuzz {

inline kt_status checked(kt_status st, const char* call) {
  if (st == KT_OK) return st;
  const char* msg = kt_last_error();
  const size_t n = std::strlen(call);
  if (st == KT_ERR_INTERNAL || std::strncmp(msg, call, n) != 0 || msg[n] != ':') {
    std::fprintf(stderr, "%s returned %s with the message: %s\n", call, kt_status_string(st), msg);
    std::abort();
  }
  return st;
}

}  // namespace kt_fuzz
