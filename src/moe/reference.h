// The plain reference of docs/math.md: loops in double precision over
// unpacked fp32 weights, written independently of the engine's algorithm.
// Tests, the example and benchmarks check kt against it.
#pragma once

#include <cstdint>
#include <vector>

#include "kt_c_api.h"

namespace kt {
namespace reference {

struct Spec {
  int64_t E = 1, K = 1, H = 1, I = 1;
  kt_activation activation = KT_ACT_SILU;
  double alpha = 1.702, limit = 0.0;
  bool bias = false;
  int64_t rank = 0;         // 0 = no LoRA
  double lora_scale = 0.0;  // s
  unsigned targets = KT_PROJ_ALL;
};

// Weights in HF layout, fp32 (already rounded as kt stores them, e.g. bf16).
struct Params {
  std::vector<float> w[3];   // gate [E,I,H], up [E,I,H], down [E,H,I]
  std::vector<float> b[3];   // [E,I], [E,I], [E,H] (when spec.bias)
  std::vector<float> la[3];  // LoRA A [E,r,in]
  std::vector<float> lb[3];  // LoRA B [E,out,r]
  std::vector<uint8_t> skipped;  // [E] (empty = none)
};

struct Grads {
  std::vector<double> dx;        // [T,H]
  std::vector<double> dw;        // [T,K]
  std::vector<double> dla[3];    // [E,r,in]
  std::vector<double> dlb[3];    // [E,out,r]
  std::vector<double> dW[3];     // [E,out,in]
  std::vector<double> db[3];     // [E,out]
};

// y [T,H]. ids: -1 or skipped experts contribute nothing.
std::vector<double> forward(const Spec& s, const Params& p, int64_t T, const std::vector<double>& x,
                            const std::vector<int64_t>& ids, const std::vector<double>& w);

// Gradients of L = <dy, y>. LoRA grads are filled when s.rank > 0, full
// weight/bias grads always.
Grads backward(const Spec& s, const Params& p, int64_t T, const std::vector<double>& x,
               const std::vector<int64_t>& ids, const std::vector<double>& w,
               const std::vector<double>& dy);

// Activation a(g, u) and its partial derivatives, in double.
double activation(const Spec& s, double g, double u);

}  // namespace reference
}  // namespace kt
