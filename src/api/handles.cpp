#include "api/handles.h"

#include <mutex>
#include <string>
#include <unordered_map>

#include "core/error.h"

namespace kt {
namespace {

struct Entry {
  HandleKind kind;
  std::shared_ptr<void> object;
  HandleId owner = 0;  // contexts: their layer's handle
};

// Values start above the first pages and step by 16, so they never look like
// NULL or a small integer (some host runtimes, Go's among them, reject
// pointer-typed values below 4096).
constexpr HandleId kFirstHandle = 0x10000;
constexpr HandleId kHandleStep = 16;

// The live handles. The map exists only while a handle is live: a process
// (or a host that dlcloses libkt) that destroyed every handle holds no
// memory of kt's, so leak checkers see exactly what a host forgot. The
// counter lives outside it: values are never reused, even across an empty
// table.
std::mutex g_mutex;
HandleId g_next = kFirstHandle;
std::unordered_map<HandleId, Entry>* g_live = nullptr;

HandleId add_entry(Entry e) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_live) g_live = new std::unordered_map<HandleId, Entry>;
  const HandleId id = g_next;
  g_live->emplace(id, std::move(e));
  g_next += kHandleStep;  // after the insertion, which may throw
  return id;
}

// The live entry of handle, or null (g_mutex held).
Entry* find_entry(HandleId handle, HandleKind kind) {
  if (!g_live) return nullptr;
  auto it = g_live->find(handle);
  if (it == g_live->end() || it->second.kind != kind) return nullptr;
  return &it->second;
}

// Erases a live entry (g_mutex held); frees the map with the last one.
void erase_entry(HandleId handle) {
  g_live->erase(handle);
  if (g_live->empty()) {
    delete g_live;
    g_live = nullptr;
  }
}

const char* type_name(HandleKind kind) {
  switch (kind) {
    case HandleKind::kEngine: return "kt_engine";
    case HandleKind::kMoe: return "kt_moe";
    case HandleKind::kContext: return "kt_context";
    case HandleKind::kJob: return "kt_job";
    case HandleKind::kCkpt: return "kt_ckpt";
    case HandleKind::kOptimizer: return "kt_optimizer";
    case HandleKind::kComm: return "kt_comm";
    case HandleKind::kDistMoe: return "kt_dist_moe";
    case HandleKind::kDistContext: return "kt_dist_context";
  }
  return "kt handle";
}

const char* ended_word(HandleKind kind) {
  switch (kind) {
    case HandleKind::kContext:
    case HandleKind::kDistContext: return "released?";
    case HandleKind::kCkpt: return "closed?";
    default: return "destroyed?";
  }
}

}  // namespace

HandleId add_handle(HandleKind kind, std::shared_ptr<void> object) {
  return add_entry(Entry{kind, std::move(object), 0});
}

HandleId add_context_handle(HandleId layer) { return add_entry(Entry{HandleKind::kContext, nullptr, layer}); }

std::shared_ptr<void> find_handle(HandleId handle, HandleKind kind) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const Entry* e = find_entry(handle, kind);
  return e ? e->object : nullptr;
}

HandleId context_owner(HandleId context) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const Entry* e = find_entry(context, HandleKind::kContext);
  return e ? e->owner : 0;
}

std::shared_ptr<void> remove_handle(HandleId handle, HandleKind kind) {
  std::shared_ptr<void> object;  // released by the caller, after the lock
  std::lock_guard<std::mutex> lock(g_mutex);
  Entry* e = find_entry(handle, kind);
  if (!e) return nullptr;
  object = std::move(e->object);
  erase_entry(handle);
  return object;
}

bool remove_context_handle(HandleId context) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!find_entry(context, HandleKind::kContext)) return false;
  erase_entry(context);
  return true;
}

std::shared_ptr<void> live_handle(const void* handle, HandleKind kind, const char* where,
                                  const char* name) {
  KT_CHECK(handle != nullptr, KT_ERR_INVALID_HANDLE, std::string(where) + ": " + name + " is NULL");
  std::shared_ptr<void> object = find_handle(handle_id(handle), kind);
  KT_CHECK(object != nullptr, KT_ERR_INVALID_HANDLE,
           std::string(where) + ": " + name + " is not a live " + type_name(kind) + " (" +
               ended_word(kind) + ")");
  return object;
}

}  // namespace kt
