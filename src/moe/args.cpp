#include "moe/args.h"

#include <cmath>

#include "core/checked.h"

namespace kt {

ArgTable::ArgTable(const kt_arg* args, size_t n, const char* where,
                   std::initializer_list<int> allowed) {
  KT_CHECK(n == 0 || args != nullptr, KT_ERR_NULL_POINTER, std::string(where) + ": args is NULL");
  for (size_t i = 0; i < n; ++i) {
    const int id = args[i].id;
    bool ok = false;
    for (int a : allowed) ok = ok || a == id;
    KT_CHECK(ok, KT_ERR_INVALID_ARGUMENT,
             std::string(where) + ": " + id_string(id) + " is not an argument of this call");
    KT_CHECK(t[id] == nullptr, KT_ERR_INVALID_ARGUMENT,
             std::string(where) + ": " + id_string(id) + " given twice");
    KT_CHECK(args[i].tensor != nullptr, KT_ERR_NULL_POINTER,
             std::string(where) + ": " + id_string(id) + " is NULL");
    t[id] = args[i].tensor;
  }
}

void check_backward_values(const kt_backward_options& o, const char* where) {
  KT_CHECK(std::isfinite(o.grad_scale), KT_ERR_INVALID_ARGUMENT,
           std::string(where) + ": options->grad_scale is not finite");
  check_enum(o.accumulate, KT_GRAD_OVERWRITE, KT_GRAD_ACCUMULATE,
             std::string(where) + ": options->accumulate", "kt_grad_accumulate");
  KT_CHECK(o.param_grads == 0 || o.param_grads == 1, KT_ERR_INVALID_ARGUMENT,
           std::string(where) + ": options->param_grads = " + std::to_string(o.param_grads) +
               " must be 0 or 1");
}

void set_moe_options_defaults(kt_moe_options& o) {
  o.max_tokens = 1024;
  o.activation = KT_ACT_SILU;
  o.act_alpha = 1.702f;
  o.act_limit = 0.f;
  o.mode = KT_MODE_INFERENCE;
  o.weight_format = KT_FORMAT_BF16;
  o.lora_rank = 16;
  o.lora_alpha = 32.f;
  o.lora_targets = KT_PROJ_ALL;
}

void set_load_options_defaults(kt_load_options& o) {
  o.orientation = KT_ORIENT_OUT_IN;
  o.gate_up_order = KT_GATE_UP_CONCAT;
}

void set_backward_options_defaults(kt_backward_options& o) {
  o.grad_scale = 1.f;
  o.accumulate = KT_GRAD_OVERWRITE;
  o.param_grads = 1;
}

}  // namespace kt
