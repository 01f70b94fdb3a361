/* Calls that pass enum arguments the way a C host may: any int converted to
 * the enum type (in C an enum type is an integer type, so every value is
 * well-defined here). The C++ tests reach out-of-range values through these
 * without undefined behaviour on their own side. */
#include "raw_enum_calls.h"

kt_status raw_set_gemm_backend(kt_engine* engine, int backend) {
  return kt_engine_set_gemm_backend(engine, (kt_gemm_backend)backend);
}

const char* raw_status_string(int status) { return kt_status_string((kt_status)status); }
const char* raw_isa_name(int isa) { return kt_isa_name((kt_isa)isa); }
const char* raw_ckpt_dtype_name(int dtype) { return kt_ckpt_dtype_name((kt_ckpt_dtype)dtype); }
const char* raw_ckpt_layout_name(int layout) { return kt_ckpt_layout_name((kt_ckpt_layout)layout); }
const char* raw_ckpt_format_name(int format) { return kt_ckpt_format_name((kt_ckpt_format)format); }
const char* raw_weight_format_name(int format) { return kt_weight_format_name((kt_weight_format)format); }
kt_status raw_optimizer_state(kt_optimizer* opt, size_t index, int which, DLTensor* out) {
  return kt_optimizer_state(opt, index, (kt_optim_state)which, out);
}
