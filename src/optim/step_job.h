// An optimizer's step as a submitted job (kt_optimizer_step_submit).
#pragma once

#include <memory>

#include "kt_c_api.h"
#include "optim/optimizer.h"

namespace kt {

// A step of optimizer op with options o (checked by the caller), as a new
// job with its handle, started unless deferred. The job holds the optimizer
// until it ends and writes *o.found_nonfinite then. A job that cannot be
// started registers and writes nothing, so the optimizer's destruction
// never waits for it.
kt_job* submit_optimizer_step(const std::shared_ptr<kt_optimizer>& op, const kt_optimizer_step_options& o,
                              bool deferred, const char* where);

}  // namespace kt
