// The ABI shims of src/io: run the call, turn every exception into a status
// and this thread's kt_last_error() message.
#pragma once

#include <new>
#include <string>

#include "core/error.h"
#include "kt_c_api.h"

namespace kt {
namespace io {

// Makes `message` the calling thread's kt_last_error(). The message lives in
// the API boundary file; the exported kt_job_wait is the path that sets it
// from a message, so an already-ended job carries it there.
void set_last_error(kt_status status, const std::string& message);

template <class F>
kt_status guarded(const char* where, F&& fn) {
  try {
    fn();
    return KT_OK;
  } catch (const Error& e) {
    set_last_error(e.status(), e.what());
    return e.status();
  } catch (const std::bad_alloc&) {
    set_last_error(KT_ERR_OUT_OF_MEMORY, std::string(where) + ": out of memory");
    return KT_ERR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_last_error(KT_ERR_INTERNAL, std::string(where) + ": internal error: " + e.what());
    return KT_ERR_INTERNAL;
  } catch (...) {
    set_last_error(KT_ERR_INTERNAL, std::string(where) + ": internal error");
    return KT_ERR_INTERNAL;
  }
}

}  // namespace io
}  // namespace kt
