// The gated activations over rows of a C tile, written once and compiled per
// ISA so the loops vectorise (exp by a polynomial instead of a libm call).
// Static functions: each unit that includes this header compiles its own
// copy with its flags (generic/sgemm.h).
#pragma once

#include <cstdint>

#include "kernels/kernels.h"

namespace kt {
namespace generic {

// exp(x) for x in [-87, 88]: 2^i * p(r), r = x - i*ln2 in [-ln2/2, ln2/2],
// degree-6 minimax-like Taylor polynomial; relative error < 2e-7.
static inline float exp_poly(float x) {
  x = x < -87.f ? -87.f : x;
  x = x > 88.f ? 88.f : x;
  const float t = x * 1.44269504088896341f;
  // Round to nearest by the 1.5 * 2^23 shift: no branch, so the loops that
  // call this vectorise.
  const float fi = (t + 12582912.f) - 12582912.f;
  const float r = (x - fi * 0.693145751953125f) - fi * 1.428606765330187045e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, 4);
  return p * scale;
}

static inline float sigmoid_poly(float z) { return 1.f / (1.f + exp_poly(-z)); }

static void act_forward_generic(const ActParams& ap, const float* __restrict g, const float* __restrict u,
                                float* __restrict a, int64_t n) {
  const float L = ap.limit > 0.f ? ap.limit : 3.0e38f;
  if (ap.kind == KT_ACT_SWIGLU_OAI) {
    for (int64_t j = 0; j < n; ++j) {
      const float gc = g[j] < L ? g[j] : L;
      const float uc = u[j] < -L ? -L : (u[j] > L ? L : u[j]);
      a[j] = gc * sigmoid_poly(ap.alpha * gc) * (uc + 1.f);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const float gc = g[j] < L ? g[j] : L;
      const float uc = u[j] < -L ? -L : (u[j] > L ? L : u[j]);
      a[j] = gc * sigmoid_poly(gc) * uc;
    }
  }
}

// One element of the backward; returns da'[j] * a[j].
template <bool kStoreA>
static inline float act_backward_one(float L, bool oai, float alpha, float gj, float uj, float daj, float w,
                                     float* __restrict dg, float* __restrict du, float* __restrict a_out) {
  // Clamped inputs pass no gradient (torch.clamp passes it at the bounds).
  const float gp = gj <= L ? 1.f : 0.f;
  const float up = (uj >= -L && uj <= L) ? 1.f : 0.f;
  const float gc = gj < L ? gj : L;
  const float uc = uj < -L ? -L : (uj > L ? L : uj);
  const float s = sigmoid_poly(alpha * gc);
  const float ub = oai ? uc + 1.f : uc;
  const float a = gc * s * ub;
  const float dadg = (s + gc * alpha * s * (1.f - s)) * ub;
  const float dadu = gc * s;
  if (kStoreA) *a_out = a;
  *dg = gp * w * daj * dadg;
  *du = up * w * daj * dadu;
  return daj * a;
}

// Sixteen partial sums, one per lane, in blocks of 16 so the loop vectorises
// without reassociating a single sum.
template <bool kStoreA>
static float act_backward_rows(float L, bool oai, float alpha, const float* __restrict g, const float* __restrict u,
                               const float* __restrict da, float w, float* __restrict dg, float* __restrict du,
                               float* __restrict a_out, int64_t n) {
  float dot[16] = {};
  int64_t j0 = 0;
  for (; j0 + 16 <= n; j0 += 16)
    for (int l = 0; l < 16; ++l) {
      const int64_t j = j0 + l;
      dot[l] += act_backward_one<kStoreA>(L, oai, alpha, g[j], u[j], da[j], w, dg + j, du + j,
                                          kStoreA ? a_out + j : nullptr);
    }
  for (int64_t j = j0; j < n; ++j)
    dot[j - j0] += act_backward_one<kStoreA>(L, oai, alpha, g[j], u[j], da[j], w, dg + j, du + j,
                                             kStoreA ? a_out + j : nullptr);
  float sum = 0.f;
  for (int l = 0; l < 16; ++l) sum += dot[l];
  return sum;
}

static float act_backward_generic(const ActParams& ap, const float* __restrict g, const float* __restrict u,
                                  const float* __restrict da, float w, float* __restrict dg,
                                  float* __restrict du, float* __restrict a_out, int64_t n) {
  const float L = ap.limit > 0.f ? ap.limit : 3.0e38f;
  const bool oai = ap.kind == KT_ACT_SWIGLU_OAI;
  const float alpha = oai ? ap.alpha : 1.f;
  return a_out ? act_backward_rows<true>(L, oai, alpha, g, u, da, w, dg, du, a_out, n)
               : act_backward_rows<false>(L, oai, alpha, g, u, da, w, dg, du, a_out, n);
}

}  // namespace generic
}  // namespace kt
