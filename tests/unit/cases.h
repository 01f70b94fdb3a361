// MoE problems shared by the tests: small real-model-like shapes and awkward
// ones. Shapes are data; tests iterate over them.
#pragma once

#include <vector>

#include "harness.h"

namespace kt_test {

inline std::vector<Case> core_cases() {
  std::vector<Case> v;
  auto add = [&](Case c) { v.push_back(c); };
  Case c;
  c = Case{}; c.name = "qwen3_like_fewer_experts"; c.E = 8; c.K = 4; c.H = 256; c.I = 96; c.T = 16; add(c);
  c.name = "qwen3_like_bf16"; c.bf16_act = true; add(c);
  c = Case{}; c.name = "awkward_odd_dims"; c.E = 3; c.K = 2; c.H = 37; c.I = 19; c.T = 5; add(c);
  c = Case{}; c.name = "one_expert_E1"; c.E = 1; c.K = 1; c.H = 48; c.I = 40; c.T = 3; add(c);
  c = Case{}; c.name = "k_equals_E"; c.E = 4; c.K = 4; c.H = 64; c.I = 33; c.T = 6; add(c);
  // No tokens: y, dx and the routing-weight gradient are empty; what is
  // checked is that the call succeeds and that an overwriting backward sets
  // every parameter gradient to zero (check_run fills them with stale values).
  c = Case{}; c.name = "zero_tokens"; c.T = 0; add(c);
  c = Case{}; c.name = "zero_tokens_lora"; c.T = 0; c.mode = KT_MODE_LORA; c.rank = 4; add(c);
  c = Case{}; c.name = "zero_tokens_full_bias"; c.T = 0; c.mode = KT_MODE_FULL; c.bias = true; add(c);
  c = Case{}; c.name = "one_token"; c.T = 1; c.E = 6; c.K = 3; c.H = 80; c.I = 24; add(c);
  c = Case{}; c.name = "many_tokens"; c.T = 300; c.E = 8; c.K = 2; c.H = 64; c.I = 48; add(c);
  c = Case{}; c.name = "all_routes_one_expert"; c.E = 4; c.K = 1; c.T = 150; c.one_expert = true; add(c);
  c = Case{}; c.name = "minus_one_ids"; c.E = 5; c.K = 3; c.T = 12; c.minus_one_every = 3; add(c);
  c = Case{}; c.name = "skipped_experts"; c.E = 6; c.K = 2; c.T = 20; c.skipped = {1, 4}; c.mode = KT_MODE_LORA; c.rank = 4; add(c);
  c = Case{}; c.name = "silu_limit"; c.limit = 0.6f; c.bias = true; c.bf16_act = true; add(c);
  c = Case{}; c.name = "swiglu_oai_bias"; c.act = KT_ACT_SWIGLU_OAI; c.limit = 1.2f; c.bias = true; c.H = 72; c.I = 40; c.bf16_act = true; add(c);
  c = Case{}; c.name = "swiglu_oai_lora"; c.act = KT_ACT_SWIGLU_OAI; c.limit = 7.f; c.bias = true; c.mode = KT_MODE_LORA; c.rank = 8; add(c);
  c = Case{}; c.name = "lora_r1"; c.mode = KT_MODE_LORA; c.rank = 1; c.H = 50; c.I = 30; add(c);
  c.name = "lora_r1_bf16"; c.bf16_act = true; add(c);
  c = Case{}; c.name = "lora_r16"; c.mode = KT_MODE_LORA; c.rank = 16; c.E = 6; c.K = 2; c.H = 96; c.I = 64; c.T = 24; add(c);
  c = Case{}; c.name = "lora_r64_rslora"; c.mode = KT_MODE_LORA; c.rank = 64; c.rslora = true; c.H = 128; c.I = 80; add(c);
  c = Case{}; c.name = "lora_down_only"; c.mode = KT_MODE_LORA; c.rank = 8; c.targets = KT_PROJ_DOWN; add(c);
  c = Case{}; c.name = "lora_gate_up_bf16"; c.mode = KT_MODE_LORA; c.rank = 8; c.targets = KT_PROJ_GATE | KT_PROJ_UP; c.bf16_act = true; add(c);
  c = Case{}; c.name = "full"; c.mode = KT_MODE_FULL; c.E = 4; c.K = 2; c.H = 40; c.I = 70; c.T = 9; add(c);
  c = Case{}; c.name = "full_bias_swiglu"; c.mode = KT_MODE_FULL; c.bias = true; c.act = KT_ACT_SWIGLU_OAI; c.limit = 1.5f; c.T = 7; add(c);
  return v;
}

// Real Qwen3-30B-A3B expert shapes (H=2048, I=768, k=8) with fewer experts.
inline Case qwen3_30b_a3b_slice() {
  Case c;
  c.name = "qwen3_30b_a3b_8_experts_lora16";
  c.E = 8; c.K = 8; c.H = 2048; c.I = 768; c.T = 6;
  c.mode = KT_MODE_LORA; c.rank = 16; c.bf16_act = true;
  return c;
}

}  // namespace kt_test
