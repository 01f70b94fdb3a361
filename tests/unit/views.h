// Views of plain host arrays for the kernel tests.
#pragma once

#include "core/tensor.h"

namespace kt_test {

// A compact row-major [rows, cols] fp32 view of data.
inline kt::View view2d(float* data, int64_t rows, int64_t cols) {
  kt::View v;
  v.data = reinterpret_cast<char*>(data);
  v.dtype = kt::DType::kF32;
  v.ndim = 2;
  v.shape[0] = rows;
  v.shape[1] = cols;
  v.strides[0] = cols;
  v.strides[1] = 1;
  return v;
}

}  // namespace kt_test
