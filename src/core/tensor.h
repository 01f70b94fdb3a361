// Checked, strided views of borrowed DLPack tensors.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/dtype.h"
#include "kt_c_api.h"

namespace kt {

constexpr int kMaxRank = 4;

struct View {
  char* data = nullptr;  // first element
  DType dtype = DType::kF32;
  int ndim = 0;
  int64_t shape[kMaxRank] = {0, 0, 0, 0};
  int64_t strides[kMaxRank] = {0, 0, 0, 0};  // elements

  bool valid() const { return data != nullptr || numel() == 0; }
  int64_t numel() const;
  size_t elem_size() const { return dtype_size(dtype); }
  char* at(int64_t i0) const { return data + i0 * strides[0] * static_cast<int64_t>(elem_size()); }
  char* at(int64_t i0, int64_t i1) const {
    return data + (i0 * strides[0] + i1 * strides[1]) * static_cast<int64_t>(elem_size());
  }
  char* at(int64_t i0, int64_t i1, int64_t i2) const {
    return data + (i0 * strides[0] + i1 * strides[1] + i2 * strides[2]) *
                      static_cast<int64_t>(elem_size());
  }
  float get(int64_t i0, int64_t i1) const { return load_as_f32(at(i0, i1), dtype); }
  float get(int64_t i0, int64_t i1, int64_t i2) const { return load_as_f32(at(i0, i1, i2), dtype); }
  // Integer element (ids, maps, masks).
  int64_t get_int(int64_t i0) const;
  int64_t get_int(int64_t i0, int64_t i1) const;
  // Slice of the leading dimension: a view of rank ndim-1.
  View slice0(int64_t i0) const;
  // Swaps the two trailing dimensions (no copy).
  View transposed() const;
};

// What an argument accepts. Extents < 0 are free (any size).
struct TensorSpec {
  const char* name;                     // "KT_ARG_X", "mask", ...
  std::initializer_list<DType> dtypes;  // accepted
  std::initializer_list<int64_t> shape; // expected extents; -1 = any
  bool inner_contiguous = false;        // innermost stride must be 1
};

std::string shape_string(const View& v);

// Converts and checks a tensor against spec; throws kt::Error naming `where`
// (the calling function) and spec.name. Besides dtype, shape, strides and
// device, the byte size and the byte offset of every element must fit in
// 64 bits (KT_ERR_SHAPE, KT_ERR_STRIDE), so View::at cannot overflow.
View check_tensor(const DLTensor* t, const TensorSpec& spec, const char* where);

// A tensor kt writes: no two indices may address the same element (a
// stride of 0 over an extent > 1, or dims that interleave). KT_ERR_STRIDE.
void check_writable(const View& v, const char* where, const char* name);

enum class Overlap { kNo, kYes, kUnknown };
// Whether two views share an element. Exact for views that are slices of a
// common tensor (any dims); kUnknown only when telling them apart would take
// millions of steps.
Overlap views_overlap(const View& a, const View& b);
// Refuses (KT_ERR_INVALID_ARGUMENT) when `a`, which kt writes, may share
// memory with `b`.
void check_disjoint(const View& a, const char* a_name, const View& b, const char* b_name,
                    const char* where);

}  // namespace kt
