// Loading a checkpoint's layer (io/layout.h) into a kt_moe: the layer reads
// the tensors the checkpoint's layout describes.
#pragma once

#include "io/layout.h"
#include "kt_c_api.h"

namespace kt {
namespace io {

// Loads `layer` into moe (shapes and format checked first; see
// kt_ckpt_load_layer and kt_ckpt_load_options).
void load_layer(const MoeLayer& layer, kt_moe* moe, const kt_ckpt_load_options& options,
                kt_ckpt_progress_fn progress, void* user, const char* where);

}  // namespace io
}  // namespace kt
