// Names of the checkpoint enums as messages and kt_ckpt_*_name print them
// ("BF16", "per_expert", "fp8_block"); "unknown" for a value outside the enum.
// In core, below every layer whose messages name them (formats' too); they
// keep the checkpoint code's namespace, kt::io.
#pragma once

#include "kt_c_api.h"

namespace kt {
namespace io {

const char* dtype_name(kt_ckpt_dtype dtype);
const char* layout_name(kt_ckpt_layout layout);
const char* format_name(kt_ckpt_format format);

}  // namespace io
}  // namespace kt
