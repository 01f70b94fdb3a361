// A layer's packed cache (kt_moe_save_packed, kt_moe_load_packed): the layer
// describes its stored weights to io/packed_cache.h, which owns the file
// format, and adopts the file it maps. Both take the engine's compute lock.
#pragma once

#include <string>

#include "kt_c_api.h"

namespace kt {

// Writes moe's packed weights, biases and loaded flags to path atomically.
void save_packed_layer(kt_moe* moe, const std::string& path, const char* where);

// Maps path, checks it in full against moe, and makes it moe's weights
// (copied in KT_MODE_FULL). Nothing changes in moe when it fails.
void load_packed_layer(kt_moe* moe, const std::string& path, unsigned flags, const char* where);

}  // namespace kt
