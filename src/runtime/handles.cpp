#include "runtime/handles.h"

#include <pthread.h>
#include <unistd.h>

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

// fork(): a child process inherits the parent's memory but none of its
// threads, so the engines (worker pools, job threads), layers, jobs and
// optimizers its parent made cannot run there, nor be destroyed (that would
// join threads and wait for jobs that do not exist). In the child, the
// handler below moves every inherited entry out of the table (g_inherited:
// kept, never read, never freed: destroying those objects is the parent's
// business) and records that values below g_first_own were issued before the
// fork; a lookup of such a value is refused with a message that says so.
// Handles the child makes work as usual. The table's mutex is taken around
// fork(), so the child never inherits it locked.
std::unordered_map<HandleId, Entry>* g_inherited = nullptr;
HandleId g_first_own = kFirstHandle;
pid_t g_parent_pid = 0;
bool g_atfork_registered = false;

void before_fork() { g_mutex.lock(); }
void after_fork_in_parent() { g_mutex.unlock(); }
void after_fork_in_child() {
  if (g_live) {
    if (!g_inherited) {
      g_inherited = g_live;
    } else {
      for (auto& kv : *g_live) g_inherited->emplace(kv.first, std::move(kv.second));
      delete g_live;  // only moved-from entries are left in it
    }
    g_live = nullptr;
  }
  g_first_own = g_next;
  g_parent_pid = getppid();
  g_mutex.unlock();
}

HandleId add_entry(Entry e) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_atfork_registered) {
    // Once per process (a forked child inherits the registration); glibc
    // drops the handlers if libkt is unloaded.
    g_atfork_registered = pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child) == 0;
  }
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

bool issued_before_fork(HandleId handle) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return handle >= kFirstHandle && handle < g_first_own;
}

std::string not_live_message(const void* handle, HandleKind kind, const char* where, const char* name) {
  const std::string head = std::string(where) + ": " + name;
  if (handle == nullptr) return head + " is NULL";
  HandleId first_own = 0;
  pid_t parent = 0;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    first_own = g_first_own;
    parent = g_parent_pid;
  }
  const HandleId id = handle_id(handle);
  if (id >= kFirstHandle && id < first_own)
    return head + " is a " + type_name(kind) + " made before this process was forked from process " +
           std::to_string(parent) +
           ": kt handles do not cross fork() (the engine's worker threads exist only in the parent); "
           "create a new engine in this process";
  return head + " is not a live " + type_name(kind) + " (" + ended_word(kind) + ")";
}

std::shared_ptr<void> live_handle(const void* handle, HandleKind kind, const char* where,
                                  const char* name) {
  std::shared_ptr<void> object = handle ? find_handle(handle_id(handle), kind) : nullptr;
  KT_CHECK(object != nullptr, KT_ERR_INVALID_HANDLE, not_live_message(handle, kind, where, name));
  return object;
}

}  // namespace kt
