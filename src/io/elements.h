// Element conversions between checkpoint dtypes, safe for unaligned source
// and destination bytes (mapped tensors need not be aligned).
#pragma once

#include <cstddef>
#include <cstdint>

#include <dlpack/dlpack.h>

#include "core/dtype.h"
#include "kt_c_api.h"

namespace kt {
namespace io {

// DLPack type of a checkpoint dtype (E8M0 and fp8 as uint8 bytes).
DLDataType dl_dtype(kt_ckpt_dtype dtype);
// The checkpoint dtype of a kt element type (float ones; others UNKNOWN).
kt_ckpt_dtype from_dtype(DType dtype);
// fp32 -> fp16, round to nearest even; overflow gives inf, NaN stays NaN.
uint16_t f32_to_f16(float value);

// Converts n consecutive elements between F32, BF16 and F16; the same dtype
// is copied bit for bit.
void convert_elements(const void* src, kt_ckpt_dtype src_dtype, void* dst, kt_ckpt_dtype dst_dtype,
                      int64_t n);

}  // namespace io
}  // namespace kt
