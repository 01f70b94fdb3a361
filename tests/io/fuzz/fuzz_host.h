// What the fuzz targets use as a host of kt: one engine for the process and
// owning fp32 destination tensors.
#pragma once

#include <cstdint>
#include <cstdlib>
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
