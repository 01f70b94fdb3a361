// The packed-cache calls of the ABI (kt_moe_save_packed, kt_moe_load_packed,
// kt_packed_read_info): argument checks, then the layer's side
// (moe/packed_layer.h) or the file format (io/packed_cache.h).
#include <memory>
#include <string>

#include "api/live.h"
#include "core/error.h"
#include "api/io_guard.h"
#include "io/packed_cache.h"
#include "kt_c_api.h"
#include "moe/moe_layer.h"
#include "moe/packed_layer.h"

namespace {

void check_path_arg(const char* path, const char* where) {
  KT_CHECK(path != nullptr, KT_ERR_NULL_POINTER, std::string(where) + ": path is NULL");
  KT_CHECK(path[0] != '\0', KT_ERR_INVALID_ARGUMENT, std::string(where) + ": path is empty");
}

}  // namespace

using kt::live_moe;

kt_status kt_moe_save_packed(kt_moe* moe, const char* path) {
  const char* w = "kt_moe_save_packed";
  return kt::io::guarded(w, [&] {
    const std::shared_ptr<kt_moe> m = live_moe(moe, w);
    check_path_arg(path, w);
    kt::save_packed_layer(m.get(), path, w);
  });
}

kt_status kt_packed_read_info(const char* path, kt_packed_info* info) {
  const char* w = "kt_packed_read_info";
  return kt::io::guarded(w, [&] {
    check_path_arg(path, w);
    KT_CHECK(info != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": info is NULL");
    kt::io::read_info(path, info, w);
  });
}

kt_status kt_moe_load_packed(kt_moe* moe, const char* path, unsigned flags) {
  const char* w = "kt_moe_load_packed";
  return kt::io::guarded(w, [&] {
    const std::shared_ptr<kt_moe> m = live_moe(moe, w);
    check_path_arg(path, w);
    KT_CHECK((flags & ~KT_PACKED_SKIP_CHECKSUMS) == 0, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": flags has bits this kt does not know");
    kt::load_packed_layer(m.get(), path, flags, w);
  });
}
