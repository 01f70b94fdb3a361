// The layer's calls as the C++ layer offers them: create (options checked),
// destroy, forward and backward with saved contexts, context release. The
// ABI shims (src/api/moe.cpp) translate handles and call these; code below
// the ABI that drives a layer of its own (src/dist) calls them directly.
// `where` names the ABI call in every message.
#pragma once

#include <cstddef>
#include <memory>

#include "kt_c_api.h"
#include "moe/moe_layer.h"
#include "runtime/engine.h"
#include "runtime/handles.h"

namespace kt {

// Refuses options a layer cannot be made of (ranges, enums, formats, the
// int8 compute's limits) with KT_ERR_INVALID_ARGUMENT, _UNSUPPORTED or _MODE.
void validate_moe_options(const kt_moe_options& o, const char* where);

// A new layer of engine `eng` with its handle: options checked, its memory
// counted against the machine's before any allocation.
std::shared_ptr<kt_moe> create_layer(const std::shared_ptr<kt_engine>& eng, const kt_moe_options& o,
                                     const char* where);

// Ends a layer whose handle was removed: cancels jobs that never started,
// waits for the others, detaches its optimizers, ends its context handles
// and leaves its engine. The object is freed when the last holder lets go.
void destroy_layer(const std::shared_ptr<kt_moe>& m);

// Forward under the engine's compute lock; with saved, a new context whose
// handle is written there on success.
void forward_layer(kt_moe& layer, const kt_arg* args, size_t num_args, kt_context** saved,
                   const char* where);

// Backward of context ctx under the engine's compute lock; returns the hook
// to call when parameter gradients were written (else an empty one).
GradHook backward_layer(kt_moe& layer, kt_context* ctx, const kt_backward_options* options,
                        const kt_arg* args, size_t num_args, const char* where);

// Holds a context of a layer for one synchronous call (kt_moe::hold_context).
class ContextHold {
 public:
  ContextHold(kt_moe* m, const kt_context* handle, const char* where)
      : m_(m), ctx_(m->hold_context(handle, where)) {}
  ~ContextHold() { m_->drop_hold(ctx_); }
  ContextHold(const ContextHold&) = delete;
  ContextHold& operator=(const ContextHold&) = delete;
  kt_context* get() const { return ctx_; }

 private:
  kt_moe* m_;
  kt_context* ctx_;
};

// Ends a context handle; false when ctx is not a live context of a live layer.
bool release_layer_context(const kt_context* ctx);

// Ends a submitted job's bookkeeping on its layer. The job's closure keeps
// the layer alive; after this, destroy_layer may return.
void finish_job(kt_moe* m, kt_job* job);

}  // namespace kt
