// What the distributed checkpoint's planner (dist_ckpt_plan.cpp) and its
// exchange (dist_ckpt.cpp) share: a layer as resolved on this rank, the
// record a rank sends of it, the tensor ids and names, and the per-expert
// shapes. Private to src/dist.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "dist/dist_moe.h"
#include "kt_c_api.h"
#include "moe/args.h"
#include "moe/moe_layer.h"
#include "optim/optimizer.h"
#include "runtime/handles.h"

namespace kt::dist::ckpt {

inline const char* const kProjKey[3] = {"gate_proj", "up_proj", "down_proj"};
inline const int kWeightId[3] = {KT_ARG_W_GATE, KT_ARG_W_UP, KT_ARG_W_DOWN};
inline const int kBiasId[3] = {KT_ARG_B_GATE, KT_ARG_B_UP, KT_ARG_B_DOWN};
inline const int kLoraId[6] = {KT_ARG_LORA_A_GATE, KT_ARG_LORA_B_GATE, KT_ARG_LORA_A_UP,
                               KT_ARG_LORA_B_UP,   KT_ARG_LORA_A_DOWN, KT_ARG_LORA_B_DOWN};
inline const char* const kHyperNames[7] = {"lr", "weight_decay", "beta1", "beta2", "eps", "momentum", "dampening"};

inline size_t usize(int64_t v) { return static_cast<size_t>(v); }
inline std::string str(int64_t v) { return std::to_string(v); }

// A call on a local layer under the engine's compute lock, its failure
// reported as the ABI call `where` reports it.
template <class F>
void layer_call(const char* where, kt_moe* handle, F&& fn) {
  as_call(where, [&] {
    const std::shared_ptr<kt_moe> m = live(handle, HandleKind::kMoe, where, "moe");
    std::lock_guard<std::mutex> lock(m->engine()->compute_mutex);
    fn(*m);
  });
}

inline std::string expert_key(int64_t layer, int64_t expert) {
  return "layers." + str(layer) + ".experts." + str(expert) + ".";
}
// "gate_proj.lora_A" for LoRA tensor i (A/B of gate, up, down).
inline std::string lora_suffix(int i) { return std::string(kProjKey[i / 2]) + (i % 2 ? ".lora_B" : ".lora_A"); }

// Per-expert shape of a layer argument ([E, ...] without E).
inline std::vector<int64_t> expert_shape(const kt_moe_options& o, int id) {
  const int64_t H = o.hidden, I = o.intermediate, r = o.lora_rank;
  switch (id) {
    case KT_ARG_W_GATE: case KT_ARG_W_UP: return {I, H};
    case KT_ARG_W_DOWN: return {H, I};
    case KT_ARG_B_GATE: case KT_ARG_B_UP: return {I};
    case KT_ARG_B_DOWN: return {H};
    case KT_ARG_LORA_A_GATE: case KT_ARG_LORA_A_UP: return {r, H};
    case KT_ARG_LORA_A_DOWN: return {r, I};
    case KT_ARG_LORA_B_GATE: case KT_ARG_LORA_B_UP: return {I, r};
    default: return {H, r};  // KT_ARG_LORA_B_DOWN
  }
}

// One entry of `layers`, resolved on this rank.
struct Local {
  int64_t number = 0;
  std::shared_ptr<kt_dist_moe> dist;
  std::shared_ptr<kt_moe> moe;        // the local layer, or null
  std::shared_ptr<kt_optimizer> opt;  // or null
  const std::vector<int64_t>* experts = nullptr;  // global ids in local order
  bool holds() const { return moe != nullptr && !experts->empty(); }
  const kt_moe_options& options() const { return dist->layer_options; }
};

// A rank's record of one layer, exchanged before the files are written.
struct LayerRecord {
  int32_t holds;
  int32_t has_opt;
  int32_t weight_dtype;   // kt_ckpt_dtype of the saved weights, 0: none
  int32_t lora_dtype[6];  // 0: not saved
  int32_t algorithm, amsgrad, nesterov, momentum_started;
  int32_t arithmetic;  // kt_optim_arithmetic
  int64_t step;
  double hyper[7];  // lr, weight_decay, beta1, beta2, eps, momentum, dampening
};

inline const char* algorithm_word(int a) { return a == KT_OPTIM_SGD ? "sgd" : "adamw"; }

// The optimizer's state tensors of one parameter, as (file suffix, data).
inline std::vector<std::pair<std::string, float*>> state_of(kt_optimizer::Param& p, int algorithm, int amsgrad) {
  std::vector<std::pair<std::string, float*>> s = {{"master", p.master}};
  if (algorithm == KT_OPTIM_ADAMW) {
    s.emplace_back("exp_avg", p.m.data());
    s.emplace_back("exp_avg_sq", p.v.data());
    if (amsgrad) s.emplace_back("max_exp_avg_sq", p.vmax.data());
  } else {
    s.emplace_back("momentum_buffer", p.m.data());
  }
  return s;
}

inline std::vector<std::string> state_names(int algorithm, int amsgrad) {
  if (algorithm == KT_OPTIM_SGD) return {"master", "momentum_buffer"};
  std::vector<std::string> s = {"master", "exp_avg", "exp_avg_sq"};
  if (amsgrad) s.push_back("max_exp_avg_sq");
  return s;
}

}  // namespace kt::dist::ckpt
