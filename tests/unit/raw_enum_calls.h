/* See raw_enum_calls.c. */
#ifndef KT_TEST_RAW_ENUM_CALLS_H_
#define KT_TEST_RAW_ENUM_CALLS_H_

#include "kt_c_api.h"

#ifdef __cplusplus
extern "C" {
#endif

kt_status raw_set_gemm_backend(kt_engine* engine, int backend);
const char* raw_status_string(int status);
const char* raw_isa_name(int isa);
const char* raw_ckpt_dtype_name(int dtype);
const char* raw_ckpt_layout_name(int layout);
const char* raw_ckpt_format_name(int format);
const char* raw_weight_format_name(int format);
kt_status raw_optimizer_state(kt_optimizer* opt, size_t index, int which, DLTensor* out);

#ifdef __cplusplus
}
#endif

#endif /* KT_TEST_RAW_ENUM_CALLS_H_ */
