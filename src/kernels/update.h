// The optimizer's per-element loops (AdamW, SGD, the finiteness check and the
// sum of squares), compiled once per ISA from update_kernels.inc; each kernel
// table (kernels/kernels.h, Kernels::optimizer) names its ISA's. Every ISA computes the same bits: the loops use explicit fmaf
// where torch fuses and no other contraction (-ffp-contract=off).
// They are per-ISA code, so they live with the kernels, below the optimizer
// (src/optim) that drives them; the names keep the optimizer's namespace.
#pragma once

#include <cstdint>

#include "kt_c_api.h"

namespace kt {
namespace optim {

// Elements per work item of a step.
constexpr int64_t kChunkElements = int64_t{1} << 15;

// One contiguous run of one parameter's elements.
struct Span {
  float* p = nullptr;            // fp32 master
  const void* g = nullptr;       // gradient, fp32 or bf16
  bool g_bf16 = false;
  float* m = nullptr;            // AdamW exp_avg / SGD momentum buffer
  float* v = nullptr;            // AdamW exp_avg_sq
  float* vmax = nullptr;         // AdamW max_exp_avg_sq (amsgrad), else null
  uint16_t* p_bf16 = nullptr;    // bf16 copy of p to write, or null
  int64_t n = 0;
};

// Per-step scalars, rounded to fp32 once from their double definitions.
struct AdamWScalars {
  float unscale, clip;
  float decay;          // 1 - lr*wd
  float b1, one_minus_b1, b2, one_minus_b2;
  // How m moves: 0 torch 1's fma(g, 1-b1, m*b1); torch 2's lerp(m, g, 1-b1)
  // steps from m when 1-b1 < 0.5 (1: fma(1-b1, g-m, m)), else back from g
  // (2: fma(1-b1 - 1, g-m, g)).
  int moment_rule;
  float lerp_coeff;     // 1-b1 (rule 1) or 1-b1 - 1 (rule 2)
  float bc2_sqrt;       // sqrt(1 - b2^t)
  float neg_step_size;  // -lr / (1 - b1^t)
  float eps;
};

struct SgdScalars {
  float unscale, clip;
  bool decay;           // weight_decay != 0
  float wd;
  int momentum_mode;    // 0 none, 1 first step (buf = d), 2 running
  bool nesterov;
  float mu, one_minus_dampening;
  float neg_lr;
};

struct UpdateKernels {
  const char* name;
  // True when every (g * unscale) * clip of the span is finite.
  bool (*all_finite)(const Span& s, float unscale, float clip);
  // Sum of g*g in double, in element order.
  double (*sum_squares)(const Span& s);
  void (*adamw)(const Span& s, const AdamWScalars& c);
  void (*sgd)(const Span& s, const SgdScalars& c);
  // One bf16 panel (formats/packed_bf16.h: 16 rows, column pairs
  // interleaved) from `count` <= 16 fp32 rows of `cols` elements, compact;
  // missing rows and the odd column are zero. dst holds 16 * round_up(cols, 2).
  void (*pack_panel)(const float* rows, int64_t count, int64_t cols, uint16_t* dst);
};

namespace generic { extern const UpdateKernels kKernels; }
namespace avx2 { extern const UpdateKernels kKernels; }
namespace avx512 { extern const UpdateKernels kKernels; }

}  // namespace optim
}  // namespace kt
