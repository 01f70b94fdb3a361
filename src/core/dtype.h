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

// OCP 8-bit float E4M3 (bias 7, no infinities): the value of code b, exact
// in bf16 (subnormals m * 2^-9; largest finite 448). S.1111.111 is NaN:
// callers refuse it before asking for a value.
inline bool e4m3_is_nan(uint8_t b) { return (b & 0x7fu) == 0x7fu; }
inline float e4m3_to_f32(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(static_cast<float>(8 + m), e - 10);
  return (b & 0x80u) ? -mag : mag;
}

// OCP 4-bit float E2M1 (bias 1) in the low nibble of u: 0, 0.5, 1, 1.5, 2,
// 3, 4, 6 and their negatives (bit 3 the sign); exact in bf16.
inline float e2m1_to_f32(uint8_t u) {
  static const float kMagnitude[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  const float mag = kMagnitude[u & 7u];
  return (u & 8u) ? -mag : mag;
}

// E8M0 scale 2^(b - 127), exact in bf16 and fp32; 0xFF is NaN (refused by
// callers).
inline bool e8m0_is_nan(uint8_t b) { return b == 0xffu; }
// Built from its bits (ldexpf is a libm call per scale): b is the fp32
// exponent field; b = 0 is the subnormal 2^-127, b = 255 infinity, as ldexpf gives.
inline float e8m0_to_f32(uint8_t b) {
  const uint32_t bits = b ? static_cast<uint32_t>(b) << 23 : 0x00400000u;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
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
