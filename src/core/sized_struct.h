// Growable structs of the ABI (kt_c_api.h: the first field is struct_size,
// the caller's sizeof). kt touches only the first struct_size bytes of a
// caller's struct: older callers get defaults for the fields they do not
// know, newer callers' fields that this library does not know must be zero.
#pragma once

#include <cstddef>
#include <cstring>
#include <string>

#include "core/checked.h"
#include "core/error.h"

namespace kt {

// The library's defaults of T (struct_size = sizeof(T)).
template <class T, class SetDefaults>
T defaults_of(SetDefaults set) {
  T d;
  std::memset(&d, 0, sizeof(d));
  set(d);
  d.struct_size = sizeof(T);
  return d;
}

// Writes the defaults into the caller's struct_size bytes (zero past what this
// library knows) and sets its struct_size; a size that cannot hold
// struct_size, or that no version of a struct has (above
// kMaxOptionsStructSize), writes nothing (the call that reads the struct
// then refuses it).
template <class T, class SetDefaults>
void write_defaults(T* out, size_t struct_size, SetDefaults set) {
  if (!out || struct_size < sizeof(size_t) || struct_size > kMaxOptionsStructSize) return;
  const T d = defaults_of<T>(set);
  std::memset(static_cast<void*>(out), 0, struct_size);
  std::memcpy(static_cast<void*>(out), &d, struct_size < sizeof(T) ? struct_size : sizeof(T));
  out->struct_size = struct_size;
}

// A caller's options over the defaults (given may be NULL).
template <class T, class SetDefaults>
T read_sized(const T* given, SetDefaults set, const char* where, const char* name) {
  T o = defaults_of<T>(set);
  if (!given) return o;
  KT_CHECK(given->struct_size >= sizeof(size_t) + sizeof(int) &&
               given->struct_size <= kMaxOptionsStructSize,
           KT_ERR_INVALID_ARGUMENT,
           std::string(where) + ": " + name + "->struct_size (" +
               std::to_string(given->struct_size) +
               ") is not the size of any version of the struct; call the _init function first");
  const size_t n = given->struct_size < sizeof(T) ? given->struct_size : sizeof(T);
  std::memcpy(static_cast<void*>(&o), given, n);
  const unsigned char* extra = reinterpret_cast<const unsigned char*>(given);
  for (size_t i = sizeof(T); i < given->struct_size; ++i)
    KT_CHECK(extra[i] == 0, KT_ERR_UNSUPPORTED,
             std::string(where) + ": " + name + " sets fields this kt version does not know");
  o.struct_size = sizeof(T);
  return o;
}

// Copies `full` into the caller's struct up to its struct_size (keeping it).
template <class T>
void write_sized(T* out, const T& full, const char* where, const char* name) {
  KT_CHECK(out != nullptr, KT_ERR_NULL_POINTER, std::string(where) + ": " + name + " is NULL");
  KT_CHECK(out->struct_size >= sizeof(size_t), KT_ERR_INVALID_ARGUMENT,
           std::string(where) + ": " + name + "->struct_size is not set");
  const size_t keep = out->struct_size;
  std::memcpy(static_cast<void*>(out), &full, keep < sizeof(T) ? keep : sizeof(T));
  out->struct_size = keep;
}

}  // namespace kt
