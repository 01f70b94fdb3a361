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

struct Table {
  std::mutex mutex;
  HandleId next = kFirstHandle;
  std::unordered_map<HandleId, Entry> live;

  HandleId add(Entry e) {
    std::lock_guard<std::mutex> lock(mutex);
    const HandleId id = next;
    next += kHandleStep;
    live.emplace(id, std::move(e));
    return id;
  }
};

// Never destroyed: handles may be used (and destroyed) from static
// destructors and from threads that outlive main.
Table& table() {
  static Table* t = new Table;
  return *t;
}

const char* type_name(HandleKind kind) {
  switch (kind) {
    case HandleKind::kEngine: return "kt_engine";
    case HandleKind::kMoe: return "kt_moe";
    case HandleKind::kContext: return "kt_context";
    case HandleKind::kJob: return "kt_job";
    case HandleKind::kCkpt: return "kt_ckpt";
  }
  return "kt handle";
}

const char* ended_word(HandleKind kind) {
  switch (kind) {
    case HandleKind::kContext: return "released?";
    case HandleKind::kCkpt: return "closed?";
    default: return "destroyed?";
  }
}

}  // namespace

HandleId add_handle(HandleKind kind, std::shared_ptr<void> object) {
  return table().add(Entry{kind, std::move(object), 0});
}

HandleId add_context_handle(HandleId layer) {
  return table().add(Entry{HandleKind::kContext, nullptr, layer});
}

std::shared_ptr<void> find_handle(HandleId handle, HandleKind kind) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.live.find(handle);
  if (it == t.live.end() || it->second.kind != kind) return nullptr;
  return it->second.object;
}

HandleId context_owner(HandleId context) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.live.find(context);
  if (it == t.live.end() || it->second.kind != HandleKind::kContext) return 0;
  return it->second.owner;
}

std::shared_ptr<void> remove_handle(HandleId handle, HandleKind kind) {
  Table& t = table();
  std::shared_ptr<void> object;
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.live.find(handle);
  if (it == t.live.end() || it->second.kind != kind) return nullptr;
  object = std::move(it->second.object);
  t.live.erase(it);
  return object;
}

bool remove_context_handle(HandleId context) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.live.find(context);
  if (it == t.live.end() || it->second.kind != HandleKind::kContext) return false;
  t.live.erase(it);
  return true;
}

std::shared_ptr<void> live_handle(const void* handle, HandleKind kind, const char* where,
                                  const char* name) {
  check(handle != nullptr, KT_ERR_INVALID_HANDLE, std::string(where) + ": " + name + " is NULL");
  std::shared_ptr<void> object = find_handle(handle_id(handle), kind);
  check(object != nullptr, KT_ERR_INVALID_HANDLE,
        std::string(where) + ": " + name + " is not a live " + type_name(kind) + " (" +
            ended_word(kind) + ")");
  return object;
}

}  // namespace kt
