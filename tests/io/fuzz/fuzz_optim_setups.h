// The optimizers whose saved state files seed the optim fuzz target, and
// that it loads fuzzed files into: AdamW and SGD (nesterov momentum) over
// fp32 host tensors, AdamW over the fp32 LoRA factors of a layer, and AdamW
// with amsgrad over a full-mode layer's bf16 weights (fp32 masters).
#pragma once

#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

#include "fuzz_host.h"
#include "kt_c_api.h"

namespace kt_fuzz {

inline const DLDataType kF32{kDLFloat, 32, 1};
inline const DLDataType kBF16{kDLBfloat, 16, 1};

struct OptimSetup {
  const char* name = "";
  std::vector<std::unique_ptr<Filled>> tensors;  // parameters, gradients, base weights
  kt_moe* layer = nullptr;
  bool owns_layer = true;  // false for a distributed layer's local one
  kt_optimizer* opt = nullptr;
  OptimSetup() = default;
  OptimSetup(const OptimSetup&) = delete;
  OptimSetup& operator=(const OptimSetup&) = delete;
  ~OptimSetup() {
    kt_optimizer_destroy(opt);
    if (owns_layer) kt_moe_destroy(layer);
  }
  DLTensor* keep(std::vector<int64_t> shape, DLDataType dtype) {
    tensors.push_back(std::make_unique<Filled>(std::move(shape), dtype, static_cast<float>(tensors.size())));
    return &tensors.back()->t;
  }
};

inline void must_ok(kt_status st) {
  if (st != KT_OK) std::abort();
}

// Parameter i of shapes[i], fp32, with an fp32 gradient.
inline std::unique_ptr<OptimSetup> host_optimizer(kt_engine* engine, const char* name,
                                                  const kt_optimizer_options& o,
                                                  const std::vector<std::vector<int64_t>>& shapes) {
  auto s = std::make_unique<OptimSetup>();
  s->name = name;
  std::vector<kt_optimizer_param> params;
  for (const auto& shape : shapes) {
    const DLTensor* p = s->keep(shape, kF32);
    params.push_back({p, s->keep(shape, kF32)});
  }
  must_ok(kt_optimizer_create(engine, &o, params.data(), params.size(), &s->opt));
  return s;
}

// The layers' shape: E=2 experts, H=16, I=8, LoRA r=2 on every projection.
inline kt_moe_options small_layer_options(kt_mode mode) {
  kt_moe_options mo;
  kt_moe_options_init(&mo);
  mo.num_experts = 2, mo.hidden = 16, mo.intermediate = 8, mo.top_k = 1, mo.max_tokens = 2;
  mo.mode = mode;
  mo.lora_rank = 2;
  mo.lora_alpha = 4.f;
  return mo;
}

// Loads s->layer (of small_layer_options) with weights in dtype, binds its
// trainable tensors in dtype (the weights, or the LoRA factors) with fp32
// gradients, and makes its optimizer.
inline void train_layer(OptimSetup* s, const kt_moe_options& mo, const kt_optimizer_options& o, DLDataType dtype) {
  const int64_t E = mo.num_experts, H = mo.hidden, I = mo.intermediate, r = mo.lora_rank;
  std::vector<kt_arg> weights, bind;
  for (int p = 0; p < 3; ++p) {
    const int64_t in = p == 2 ? I : H, out = p == 2 ? H : I;
    DLTensor* w = s->keep({E, out, in}, dtype);
    weights.push_back({KT_ARG_W_GATE + p, w});
    if (mo.mode == KT_MODE_FULL) {
      bind.push_back({KT_ARG_W_GATE + p, w});
      bind.push_back({KT_ARG_GRAD_W_GATE + p, s->keep({E, out, in}, kF32)});
    } else {
      bind.push_back({KT_ARG_LORA_A_GATE + 2 * p, s->keep({E, r, in}, dtype)});
      bind.push_back({KT_ARG_LORA_B_GATE + 2 * p, s->keep({E, out, r}, dtype)});
      bind.push_back({KT_ARG_GRAD_LORA_A_GATE + 2 * p, s->keep({E, r, in}, kF32)});
      bind.push_back({KT_ARG_GRAD_LORA_B_GATE + 2 * p, s->keep({E, out, r}, kF32)});
    }
  }
  must_ok(kt_moe_load_weights(s->layer, nullptr, weights.data(), weights.size()));
  must_ok(kt_moe_bind(s->layer, bind.data(), bind.size()));
  must_ok(kt_optimizer_create_for_layer(s->layer, &o, &s->opt));
}

inline std::unique_ptr<OptimSetup> layer_optimizer(kt_engine* engine, const char* name, const kt_optimizer_options& o,
                                                   kt_mode mode, DLDataType dtype) {
  auto s = std::make_unique<OptimSetup>();
  s->name = name;
  const kt_moe_options mo = small_layer_options(mode);
  must_ok(kt_moe_create(engine, &mo, &s->layer));
  train_layer(s.get(), mo, o, dtype);
  return s;
}

template <typename T>
void append_bytes(std::string* out, const T& v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

// Everything a load may change, as bytes: the optimizer's state tensors,
// step and hyperparameters, the host's tensors and the layer's weights.
inline std::string snapshot(const OptimSetup& s) {
  std::string out;
  size_t n = 0;
  must_ok(kt_optimizer_num_params(s.opt, &n));
  for (size_t i = 0; i < n; ++i)
    for (int which = KT_OPTIM_STATE_MASTER; which <= KT_OPTIM_STATE_MOMENTUM; ++which) {
      DLTensor t;
      if (kt_optimizer_state(s.opt, i, static_cast<kt_optim_state>(which), &t) != KT_OK) continue;
      int64_t numel = 1;
      for (int d = 0; d < t.ndim; ++d) numel *= t.shape[d];
      out.append(static_cast<const char*>(t.data), static_cast<size_t>(numel) * 4);
    }
  int64_t step = -1;
  must_ok(kt_optimizer_get_step(s.opt, &step));
  append_bytes(&out, step);
  kt_optimizer_options o;
  kt_optimizer_options_init(&o);
  must_ok(kt_optimizer_get_options(s.opt, &o));
  for (double v : {o.lr, o.weight_decay, o.beta1, o.beta2, o.eps, o.momentum, o.dampening}) append_bytes(&out, v);
  for (int v : {static_cast<int>(o.algorithm), o.amsgrad, o.nesterov, static_cast<int>(o.arithmetic), o.assume_finite})
    append_bytes(&out, v);
  for (const auto& t : s.tensors) out.append(t->bytes.begin(), t->bytes.end());
  if (s.layer) {
    const kt_moe_options mo = small_layer_options(KT_MODE_LORA);
    Filled g({mo.num_experts, mo.intermediate, mo.hidden}, kF32, 0), u({mo.num_experts, mo.intermediate, mo.hidden}, kF32, 0),
        d({mo.num_experts, mo.hidden, mo.intermediate}, kF32, 0);
    const kt_arg args[3] = {{KT_ARG_W_GATE, &g.t}, {KT_ARG_W_UP, &u.t}, {KT_ARG_W_DOWN, &d.t}};
    must_ok(kt_moe_read_weights(s.layer, args, 3));
    for (const Filled* f : {&g, &u, &d}) out.append(f->bytes.begin(), f->bytes.end());
  }
  return out;
}

inline std::vector<std::unique_ptr<OptimSetup>> optim_setups(kt_engine* engine) {
  std::vector<std::unique_ptr<OptimSetup>> out;
  kt_optimizer_options o;
  kt_optimizer_options_init(&o);
  out.push_back(host_optimizer(engine, "adamw_f32", o, {{3, 5}, {7}}));
  out.push_back(layer_optimizer(engine, "adamw_lora_f32", o, KT_MODE_LORA, kF32));
  o.amsgrad = 1;
  o.arithmetic = KT_OPTIM_TORCH2;
  out.push_back(layer_optimizer(engine, "adamw_amsgrad_full_bf16", o, KT_MODE_FULL, kBF16));
  kt_optimizer_options_init(&o);
  o.algorithm = KT_OPTIM_SGD;
  o.momentum = 0.9;
  o.nesterov = 1;
  out.push_back(host_optimizer(engine, "sgd_nesterov_f32", o, {{6}, {2, 3}}));
  return out;
}

}  // namespace kt_fuzz
