#include "core/arg_names.h"

namespace kt {

const char* arg_name(int id) {
  switch (id) {
    case KT_ARG_X: return "KT_ARG_X";
    case KT_ARG_IDS: return "KT_ARG_IDS";
    case KT_ARG_ROUTE_WEIGHTS: return "KT_ARG_ROUTE_WEIGHTS";
    case KT_ARG_Y: return "KT_ARG_Y";
    case KT_ARG_DY: return "KT_ARG_DY";
    case KT_ARG_DX: return "KT_ARG_DX";
    case KT_ARG_DROUTE_WEIGHTS: return "KT_ARG_DROUTE_WEIGHTS";
    case KT_ARG_W_GATE: return "KT_ARG_W_GATE";
    case KT_ARG_W_UP: return "KT_ARG_W_UP";
    case KT_ARG_W_DOWN: return "KT_ARG_W_DOWN";
    case KT_ARG_W_GATE_UP: return "KT_ARG_W_GATE_UP";
    case KT_ARG_B_GATE: return "KT_ARG_B_GATE";
    case KT_ARG_B_UP: return "KT_ARG_B_UP";
    case KT_ARG_B_DOWN: return "KT_ARG_B_DOWN";
    case KT_ARG_B_GATE_UP: return "KT_ARG_B_GATE_UP";
    case KT_ARG_EXPERT_MAP: return "KT_ARG_EXPERT_MAP";
    case KT_ARG_LORA_A_GATE: return "KT_ARG_LORA_A_GATE";
    case KT_ARG_LORA_B_GATE: return "KT_ARG_LORA_B_GATE";
    case KT_ARG_LORA_A_UP: return "KT_ARG_LORA_A_UP";
    case KT_ARG_LORA_B_UP: return "KT_ARG_LORA_B_UP";
    case KT_ARG_LORA_A_DOWN: return "KT_ARG_LORA_A_DOWN";
    case KT_ARG_LORA_B_DOWN: return "KT_ARG_LORA_B_DOWN";
    case KT_ARG_GRAD_LORA_A_GATE: return "KT_ARG_GRAD_LORA_A_GATE";
    case KT_ARG_GRAD_LORA_B_GATE: return "KT_ARG_GRAD_LORA_B_GATE";
    case KT_ARG_GRAD_LORA_A_UP: return "KT_ARG_GRAD_LORA_A_UP";
    case KT_ARG_GRAD_LORA_B_UP: return "KT_ARG_GRAD_LORA_B_UP";
    case KT_ARG_GRAD_LORA_A_DOWN: return "KT_ARG_GRAD_LORA_A_DOWN";
    case KT_ARG_GRAD_LORA_B_DOWN: return "KT_ARG_GRAD_LORA_B_DOWN";
    case KT_ARG_GRAD_W_GATE: return "KT_ARG_GRAD_W_GATE";
    case KT_ARG_GRAD_W_UP: return "KT_ARG_GRAD_W_UP";
    case KT_ARG_GRAD_W_DOWN: return "KT_ARG_GRAD_W_DOWN";
    case KT_ARG_GRAD_B_GATE: return "KT_ARG_GRAD_B_GATE";
    case KT_ARG_GRAD_B_UP: return "KT_ARG_GRAD_B_UP";
    case KT_ARG_GRAD_B_DOWN: return "KT_ARG_GRAD_B_DOWN";
    default: return nullptr;
  }
}

std::string id_string(int id) {
  const char* n = arg_name(id);
  return n ? std::string(n) : "argument id " + std::to_string(id);
}

}  // namespace kt
