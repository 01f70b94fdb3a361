// The handles kt gives hosts (engines, layers, contexts, jobs, checkpoints,
// optimizers, communicators, distributed layers and their contexts)
// are opaque numbers, not addresses. A process-wide table maps each live one
// to its object; a value is never given out twice. So a destroyed, released
// or never-issued handle is found missing in the table without reading the
// memory it once named, and a stale handle can never reach a newer object
// that happens to live at the same address (no ABA). In a process forked
// from one that held handles, the inherited ones are not live: calls on them
// are refused, saying so, and their objects are left alone.
//
// The table owns every object but a layer's contexts through shared
// pointers; a call looks its handle up and keeps the object alive for the
// call's duration, so destroying a handle while another thread's call on it
// runs frees the object when that call ends. Contexts are owned by their
// layer; their entry names the layer's handle.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace kt {

enum class HandleKind { kEngine, kMoe, kContext, kJob, kCkpt, kOptimizer, kComm, kDistMoe, kDistContext };

using HandleId = uintptr_t;

inline HandleId handle_id(const void* handle) { return reinterpret_cast<HandleId>(handle); }
template <class T>
T* handle_value(HandleId id) {
  return reinterpret_cast<T*>(id);
}

// Adds a live handle for object (the table shares its ownership) and
// returns its value, never issued before in this process.
HandleId add_handle(HandleKind kind, std::shared_ptr<void> object);
// Adds a context handle of the layer handle `layer`.
HandleId add_context_handle(HandleId layer);

// The object of a live handle of that kind, or null (unknown, destroyed, or
// another kind). Never dereferences the handle.
std::shared_ptr<void> find_handle(HandleId handle, HandleKind kind);
// The layer handle of a live context handle, or 0.
HandleId context_owner(HandleId context);

// Ends a handle: later lookups fail. Returns its object (null when the
// handle was not a live one of that kind), whose last reference may be the
// caller's or an in-flight call's.
std::shared_ptr<void> remove_handle(HandleId handle, HandleKind kind);
// Ends a context handle; false if it was not live.
bool remove_context_handle(HandleId context);

// Whether handle was issued before this process was forked (by the parent,
// or an ancestor): such handles are never live here (see handles.cpp).
bool issued_before_fork(HandleId handle);

// Why handle is not a live one of that kind: NULL, ended, or made before
// fork() in the parent; names the call (where) and the argument (name).
std::string not_live_message(const void* handle, HandleKind kind, const char* where, const char* name);

// The object of a live handle, or a kt::Error (KT_ERR_INVALID_HANDLE) whose
// message is not_live_message's.
std::shared_ptr<void> live_handle(const void* handle, HandleKind kind, const char* where,
                                  const char* name);

template <class T>
std::shared_ptr<T> live(const T* handle, HandleKind kind, const char* where, const char* name) {
  return std::static_pointer_cast<T>(live_handle(handle, kind, where, name));
}

}  // namespace kt
