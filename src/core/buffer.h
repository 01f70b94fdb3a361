// Owned, 64-byte aligned buffers. Large ones are 2 MiB aligned and advised
// for transparent huge pages (weights are read in long streams). And a bulk
// zero fill that bypasses the caches.
#pragma once

#include <emmintrin.h>
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
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

// Zeroes n bytes at p with non-temporal stores (small blocks: memset), for
// zeros written in bulk and not read soon (the gradients of experts no token
// reached: tens of MB to GB per step): they are then written without first
// being read into the caches.
inline void zero_bytes_streaming(void* p, size_t n) {
  constexpr size_t kStreamFrom = size_t{4} << 10;
  if (n < kStreamFrom) {
    std::memset(p, 0, n);
    return;
  }
  char* c = static_cast<char*>(p);
  const size_t head = (64 - reinterpret_cast<uintptr_t>(c) % 64) % 64;
  std::memset(c, 0, head);
  c += head;
  n -= head;
  const __m128i zero = _mm_setzero_si128();
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(c + i), zero);
    _mm_stream_si128(reinterpret_cast<__m128i*>(c + i + 16), zero);
    _mm_stream_si128(reinterpret_cast<__m128i*>(c + i + 32), zero);
    _mm_stream_si128(reinterpret_cast<__m128i*>(c + i + 48), zero);
  }
  std::memset(c + i, 0, n - i);
  // Later reads of these bytes, on any thread, see the zeros.
  _mm_sfence();
}

}  // namespace kt
