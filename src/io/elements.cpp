#include "io/elements.h"

#include <cstring>

#include "core/error.h"
#include "io/safetensors.h"

namespace kt {
namespace io {

DLDataType dl_dtype(kt_ckpt_dtype d) {
  switch (d) {
    case KT_CKPT_DTYPE_F32: return DLDataType{kDLFloat, 32, 1};
    case KT_CKPT_DTYPE_F16: return DLDataType{kDLFloat, 16, 1};
    case KT_CKPT_DTYPE_BF16: return DLDataType{kDLBfloat, 16, 1};
    case KT_CKPT_DTYPE_F64: return DLDataType{kDLFloat, 64, 1};
    case KT_CKPT_DTYPE_I8: return DLDataType{kDLInt, 8, 1};
    case KT_CKPT_DTYPE_I16: return DLDataType{kDLInt, 16, 1};
    case KT_CKPT_DTYPE_U16: return DLDataType{kDLUInt, 16, 1};
    case KT_CKPT_DTYPE_I32: return DLDataType{kDLInt, 32, 1};
    case KT_CKPT_DTYPE_U32: return DLDataType{kDLUInt, 32, 1};
    case KT_CKPT_DTYPE_I64: return DLDataType{kDLInt, 64, 1};
    case KT_CKPT_DTYPE_U64: return DLDataType{kDLUInt, 64, 1};
    default: return DLDataType{kDLUInt, 8, 1};
  }
}

kt_ckpt_dtype from_dtype(DType d) {
  switch (d) {
    case DType::kF32: return KT_CKPT_DTYPE_F32;
    case DType::kBF16: return KT_CKPT_DTYPE_BF16;
    case DType::kF16: return KT_CKPT_DTYPE_F16;
    default: return KT_CKPT_DTYPE_UNKNOWN;
  }
}

uint16_t f32_to_f16(float value) {
  uint32_t u;
  std::memcpy(&u, &value, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504: inf
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t exp = abs >> 23;
    const uint32_t man = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // to a 10-bit subnormal mantissa (+13)
    uint32_t half = man >> shift;
    const uint32_t rest = man & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t h = ((abs >> 13) - (112u << 10));
  const uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

namespace {

float read_f32(const uint8_t* p, kt_ckpt_dtype d) {
  if (d == KT_CKPT_DTYPE_F32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return d == KT_CKPT_DTYPE_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

void write_f32(uint8_t* p, kt_ckpt_dtype d, float v) {
  if (d == KT_CKPT_DTYPE_F32) {
    std::memcpy(p, &v, 4);
    return;
  }
  const uint16_t h = d == KT_CKPT_DTYPE_BF16 ? f32_to_bf16(v) : f32_to_f16(v);
  std::memcpy(p, &h, 2);
}

bool is_float(kt_ckpt_dtype d) {
  return d == KT_CKPT_DTYPE_F32 || d == KT_CKPT_DTYPE_BF16 || d == KT_CKPT_DTYPE_F16;
}

}  // namespace

void convert_elements(const void* src, kt_ckpt_dtype sd, void* dst, kt_ckpt_dtype dd, int64_t n) {
  if (n <= 0) return;
  if (sd == dd) {
    std::memcpy(dst, src, static_cast<size_t>(n) * st_dtype_info(sd).size);
    return;
  }
  KT_CHECK(is_float(sd) && is_float(dd), KT_ERR_DTYPE,
           std::string("cannot convert ") + st_dtype_info(sd).st_name + " elements to " +
               (dd == KT_CKPT_DTYPE_UNKNOWN ? "this dtype" : st_dtype_info(dd).st_name));
  const uint8_t* s = static_cast<const uint8_t*>(src);
  uint8_t* o = static_cast<uint8_t*>(dst);
  const size_t ss = st_dtype_info(sd).size, ds = st_dtype_info(dd).size;
  for (int64_t i = 0; i < n; ++i) write_f32(o + static_cast<size_t>(i) * ds, dd, read_f32(s + static_cast<size_t>(i) * ss, sd));
}

}  // namespace io
}  // namespace kt
