// What the fuzz targets use as a host of kt: one engine for the process and
// owning fp32 destination tensors.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "kt_c_api.h"

namespace kt_fuzz {

// A compact fp32 DLTensor of zeros that owns its data and shape.
struct F32Tensor {
  std::vector<float> data;
  std::vector<int64_t> shape;
  DLTensor t{};
  explicit F32Tensor(std::vector<int64_t> s) : shape(std::move(s)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    data.assign(static_cast<size_t>(n), 0.f);
    t.data = data.data();
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = static_cast<int>(shape.size());
    t.dtype = DLDataType{kDLFloat, 32, 1};
    t.shape = shape.data();
    t.strides = nullptr;
  }
};

// A compact fp32 or bf16 DLTensor of the values sin(seed + 0.37 i) / 2 that
// owns its data and shape (bf16 by truncation: any bits will do).
struct Filled {
  std::vector<uint8_t> bytes;
  std::vector<int64_t> shape;
  DLTensor t{};
  Filled(std::vector<int64_t> s, DLDataType dtype, float seed) : shape(std::move(s)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const size_t width = dtype.bits / 8;
    bytes.resize(static_cast<size_t>(n) * width);
    for (int64_t i = 0; i < n; ++i) {
      const float v = std::sin(seed + 0.37f * static_cast<float>(i)) * 0.5f;
      uint32_t b;
      std::memcpy(&b, &v, 4);
      if (width == 2) b >>= 16;
      std::memcpy(bytes.data() + static_cast<size_t>(i) * width, &b, width);
    }
    t.data = bytes.data();
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = static_cast<int>(shape.size());
    t.dtype = dtype;
    t.shape = shape.data();
  }
};

// One single-threaded, unpinned engine for the whole run.
inline kt_engine* engine() {
  static kt_engine* e = [] {
    kt_engine_options o;
    kt_engine_options_init(&o);
    o.num_threads = 1;
    o.pin_threads = 0;
    kt_engine* made = nullptr;
    if (kt_engine_create(&o, &made) != KT_OK) std::abort();
    return made;
  }();
  return e;
}

}  // namespace kt_fuzz
