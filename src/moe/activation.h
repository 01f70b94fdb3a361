// The gated activations of DESIGN.md §2 and their derivatives (fp32).
#pragma once

#include <cmath>

#include "kt_c_api.h"

namespace kt {

struct Activation {
  kt_activation kind;
  float alpha;
  float limit;  // <= 0: no clamp

  inline float forward(float g, float u) const {
    if (limit > 0.f) {
      g = std::fmin(g, limit);
      u = std::fmin(std::fmax(u, -limit), limit);
    }
    if (kind == KT_ACT_SWIGLU_OAI) return g * sigmoid(alpha * g) * (u + 1.f);
    return g * sigmoid(g) * u;
  }

  // da/dg and da/du at (g, u); zero where the clamp is active.
  inline void backward(float g, float u, float* dadg, float* dadu) const {
    float gate_pass = 1.f, up_pass = 1.f;
    if (limit > 0.f) {
      if (g > limit) {
        g = limit;
        gate_pass = 0.f;
      }
      if (u > limit || u < -limit) {
        u = std::fmin(std::fmax(u, -limit), limit);
        up_pass = 0.f;
      }
    }
    if (kind == KT_ACT_SWIGLU_OAI) {
      const float s = sigmoid(alpha * g);
      *dadg = gate_pass * (s + g * alpha * s * (1.f - s)) * (u + 1.f);
      *dadu = up_pass * g * s;
    } else {
      const float s = sigmoid(g);
      *dadg = gate_pass * s * (1.f + g * (1.f - s)) * u;
      *dadu = up_pass * g * s;
    }
  }

  static inline float sigmoid(float z) { return 1.f / (1.f + std::exp(-z)); }
};

}  // namespace kt
