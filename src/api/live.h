// The object behind a live handle of the ABI (kept alive for the caller's
// call), or KT_ERR_INVALID_HANDLE naming the call and the argument. Handles
// are looked up, never dereferenced.
#pragma once

#include <memory>

#include "runtime/handles.h"
#include "moe/moe_layer.h"
#include "runtime/engine.h"

namespace kt {

inline std::shared_ptr<kt_engine> live_engine(const kt_engine* e, const char* where) {
  return live(e, HandleKind::kEngine, where, "engine");
}

inline std::shared_ptr<kt_moe> live_moe(const kt_moe* m, const char* where) {
  return live(m, HandleKind::kMoe, where, "moe");
}

}  // namespace kt
