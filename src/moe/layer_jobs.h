// A layer's forward and backward as submitted jobs (kt_moe_forward_submit,
// kt_moe_backward_submit), with the holds and rollback that keep the layer
// and its context valid until the job ends.
#pragma once

#include <cstddef>
#include <memory>

#include "kt_c_api.h"
#include "moe/moe_layer.h"

namespace kt {

// A forward of layer, its arguments checked now, as a new job with its
// handle, started unless deferred. With saved, a new context whose handle is
// written there; the job holds it until it ends (a release meanwhile frees
// it then) and marks it ready, or failed. A refused check registers and
// writes nothing; nor does a job that cannot be started (out of memory for
// its handle or its place in the queue): the job and its context are
// dropped, so the layer's destruction never waits for them.
kt_job* submit_forward(const std::shared_ptr<kt_moe>& layer, const kt_arg* args, size_t num_args,
                       kt_context** saved, bool deferred, const char* where);

// A backward of context ctx of layer, its arguments checked now, as a new
// job with its handle, started unless deferred. The job holds the context
// until it ends; one whose forward job has not ended may be submitted
// against: the backward job runs or waits for that forward first. The
// layer's gradient-ready hook is called after the job let go of the layer.
// KT_ERR_CONTEXT when ctx already has a backward submitted; a refused check,
// or a job that cannot be started, leaves the context as it was.
kt_job* submit_backward(const std::shared_ptr<kt_moe>& layer, kt_context* ctx,
                        const kt_backward_options* options, const kt_arg* args, size_t num_args,
                        bool deferred, const char* where);

}  // namespace kt
