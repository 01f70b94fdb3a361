// Owned, 64-byte aligned buffers. Large ones are 2 MiB aligned and advised
// for transparent huge pages (weights are read in long streams).
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdlib>
#include <new>
#include <utility>

#include "core/error.h"

namespace kt {

template <class T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t count) { resize(count); }
  ~Buffer() { std::free(data_); }
  Buffer(Buffer&& o) noexcept : data_(o.data_), size_(o.size_) { o.data_ = nullptr, o.size_ = 0; }
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // Discards the contents. Throws KT_ERR_OUT_OF_MEMORY on failure (the old
  // buffer is kept then).
  void resize(size_t count) {
    if (count == size_) return;
    if (count == 0) {
      std::free(data_);
      data_ = nullptr;
      size_ = 0;
      return;
    }
    const size_t bytes = count * sizeof(T);
    const size_t huge = size_t{2} << 20;
    const size_t align = bytes >= huge ? huge : 64;
    const size_t rounded = (bytes + align - 1) / align * align;
    void* p = std::aligned_alloc(align, rounded);
    if (!p) fail(KT_ERR_OUT_OF_MEMORY, "cannot allocate " + std::to_string(bytes) + " bytes");
    if (align == huge) madvise(p, rounded, MADV_HUGEPAGE);
    std::free(data_);
    data_ = static_cast<T*>(p);
    size_ = count;
  }
  // Grows only; keeps nothing.
  void reserve(size_t count) {
    if (count > size_) resize(count);
  }
  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }

 private:
  T* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace kt
