// Int8 A rows (kernels.h): one quantizer for every kernel table, so a row's
// codes do not depend on the ISA that computes with them. Compiled without
// FMA contraction: the rounding below is two separate fp32 additions.
#include <cfloat>
#include <cmath>
#include <cstring>

#include "kernels/kernels.h"

namespace kt {

int64_t int8_row_bytes(int64_t kq, int64_t group) {
  const int64_t bytes = kq + 4 * (kq / group) + 4;
  return (bytes + 63) / 64 * 64;
}

void quantize_int8_row(const float* x, int64_t k, int64_t kq, int64_t group, bool nibble_order, void* row) {
  auto* q = static_cast<int8_t*>(row);
  const int64_t groups = kq / group;
  int32_t* sums = reinterpret_cast<int32_t*>(q + kq);
  float* scale = reinterpret_cast<float*>(sums + groups);
  float max_abs = 0.f;
  bool finite = true;
  for (int64_t i = 0; i < k; ++i) {
    const float a = std::fabs(x[i]);
    finite &= a <= FLT_MAX;  // false for NaN and infinity
    max_abs = a > max_abs ? a : max_abs;
  }
  std::memset(q, 0, static_cast<size_t>(kq));
  std::memset(sums, 0, static_cast<size_t>(groups) * sizeof(int32_t));
  if (!finite) {
    *scale = NAN;
    return;
  }
  *scale = max_abs / 127.f;
  if (max_abs == 0.f) return;
  const float inv = 127.f / max_abs;
  // Adding and taking off 1.5 * 2^23 rounds |v| < 2^22 to the nearest
  // integer, ties to even (the default rounding mode), without a libm call.
  constexpr float kRound = 12582912.f;
  for (int64_t i = 0; i < k; ++i) {
    float v = x[i] * inv;
    v = v > 127.f ? 127.f : v < -127.f ? -127.f : v;
    const int code = static_cast<int>((v + kRound) - kRound);
    const int64_t at = nibble_order ? (i & ~int64_t{3}) | ((i & 1) << 1) | ((i >> 1) & 1) : i;
    q[at] = static_cast<int8_t>(code);
    sums[i / group] += code;
  }
}

}  // namespace kt
