// Scalar element types kt reads and writes, and their conversions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kt {

enum class DType { kF32, kBF16, kF16, kF64, kI32, kI64, kI8, kU8, kBool };

const char* dtype_name(DType t);
size_t dtype_size(DType t);

using bf16_t = uint16_t;

inline float bf16_to_f32(bf16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN stays NaN (quiet).
inline bf16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        man <<= 1;
        ++e;
      } while ((man & 0x400u) == 0);
      u = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Reads element i (already offset) of a buffer of type t as float.
inline float load_as_f32(const void* p, DType t) {
  switch (t) {
    case DType::kF32: return *static_cast<const float*>(p);
    case DType::kBF16: return bf16_to_f32(*static_cast<const bf16_t*>(p));
    case DType::kF16: return f16_to_f32(*static_cast<const uint16_t*>(p));
    case DType::kF64: return static_cast<float>(*static_cast<const double*>(p));
    default: return 0.f;
  }
}

inline void store_f32(void* p, DType t, float v) {
  switch (t) {
    case DType::kF32: *static_cast<float*>(p) = v; break;
    case DType::kBF16: *static_cast<bf16_t*>(p) = f32_to_bf16(v); break;
    default: break;
  }
}

}  // namespace kt
