// Named-argument tables shared by the layer's calls (the ids' names:
// core/arg_names.h).
#pragma once

#include <initializer_list>
#include <string>

#include "core/arg_names.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kt_c_api.h"

namespace kt {

// One past the largest kt_arg_id: tables indexed by id are this long. Ids
// come in blocks of 16; the last block ends before it.
constexpr int kMaxArgId = 80;
static_assert(KT_ARG_GRAD_B_DOWN < kMaxArgId, "a kt_arg_id beyond kMaxArgId");

// Collects args into id-indexed slots; rejects NULL arrays, unknown and
// repeated ids, NULL tensors.
struct ArgTable {
  const DLTensor* t[kMaxArgId] = {};
  ArgTable(const kt_arg* args, size_t n, const char* where, std::initializer_list<int> allowed);
  const DLTensor* operator[](int id) const { return t[id]; }
};

// The values of a kt_backward_options (grad_scale finite, accumulate and
// param_grads in range), for the layer's and the distributed backward.
void check_backward_values(const kt_backward_options& o, const char* where);

// The defaults of the layer's options structs (what kt_*_init writes after
// struct_size).
void set_moe_options_defaults(kt_moe_options& o);
void set_load_options_defaults(kt_load_options& o);
void set_backward_options_defaults(kt_backward_options& o);

}  // namespace kt
