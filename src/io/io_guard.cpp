#include "io/io_guard.h"

#include "runtime/engine.h"

namespace kt {
namespace io {

void set_last_error(kt_status status, const std::string& message) {
  try {
    kt_job ended;
    ended.state = 2;
    ended.status = status;
    ended.message = message;
    (void)kt_job_wait(&ended);
  } catch (...) {
    // Out of memory while copying the message: the status still reports.
  }
}

}  // namespace io
}  // namespace kt
