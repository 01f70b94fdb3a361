// The kt_ckpt_* ABI: argument checks, then the readers and writers of src/io.
// Every call is guarded: no exception crosses, errors become a status and a
// thread-local message.
#include <cstring>
#include <memory>
#include <string>

#include "runtime/handles.h"
#include "core/checked.h"
#include "core/error.h"
#include "core/sized_struct.h"
#include "io/exporters.h"
#include "api/io_guard.h"
#include "io/layout.h"
#include "core/ckpt_names.h"
#include "io/safetensors.h"
#include "moe/ckpt_load.h"
#include "kt_c_api.h"

struct kt_ckpt {
  std::unique_ptr<kt::io::TensorSet> tensors;
  kt::io::ModelInfo model;
  std::vector<const std::pair<const std::string, kt::io::TensorRef>*> by_index;
  int64_t total_bytes = 0;
};

namespace {

using kt::check_enum;
using kt::io::guarded;

// The checkpoint behind an open handle, kept for the call; handles are
// looked up, never dereferenced.
std::shared_ptr<kt_ckpt> check_ckpt(const kt_ckpt* c, const char* where) {
  return kt::live(c, kt::HandleKind::kCkpt, where, "ckpt");
}

void check_path(const char* path, const char* where, const char* name) {
  KT_CHECK(path != nullptr, KT_ERR_NULL_POINTER, std::string(where) + ": " + name + " is NULL");
  KT_CHECK(path[0] != '\0', KT_ERR_INVALID_ARGUMENT,
           std::string(where) + ": " + name + " is empty");
}

void fill_tensor(const std::pair<const std::string, kt::io::TensorRef>& kv, kt_ckpt_tensor* out, const char* where) {
  kt_ckpt_tensor t;
  std::memset(&t, 0, sizeof(t));
  t.struct_size = sizeof(t);
  t.name = kv.first.c_str();
  t.file = kv.second.file->path().c_str();
  t.dtype = kv.second.entry->dtype;
  t.ndim = static_cast<int>(kv.second.entry->shape.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = kv.second.entry->shape[static_cast<size_t>(i)];
  t.nbytes = static_cast<int64_t>(kv.second.entry->nbytes());
  t.data = kv.second.data;
  kt::write_sized(out, t, where, "tensor");
}

}  // namespace

extern "C" {

const char* kt_ckpt_dtype_name(kt_ckpt_dtype dtype) { return kt::io::dtype_name(dtype); }

const char* kt_ckpt_layout_name(kt_ckpt_layout layout) { return kt::io::layout_name(layout); }

const char* kt_ckpt_format_name(kt_ckpt_format format) { return kt::io::format_name(format); }

kt_status kt_ckpt_open(const char* dir, kt_ckpt** ckpt) {
  const char* w = "kt_ckpt_open";
  return guarded(w, [&] {
    check_path(dir, w, "dir");
    KT_CHECK(ckpt != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": ckpt is NULL");
    // Every file from one version of the directory (see kt::io::DirHandle).
    std::unique_ptr<kt_ckpt> opened =
        kt::io::read_consistent(dir, [&](std::shared_ptr<const kt::io::DirHandle> d) {
          std::unique_ptr<kt_ckpt> c(new kt_ckpt);
          c->tensors.reset(new kt::io::TensorSet(d));
          const std::string config = d->has("config.json") ? kt::io::read_text_file(*d, "config.json") : "";
          c->model = kt::io::detect_layout(*c->tensors, config, dir);
          for (const auto& kv : c->tensors->tensors()) {
            c->by_index.push_back(&kv);
            c->total_bytes += static_cast<int64_t>(kv.second.entry->nbytes());
          }
          return c;
        });
    *ckpt = kt::handle_value<kt_ckpt>(kt::add_handle(kt::HandleKind::kCkpt, std::shared_ptr<kt_ckpt>(std::move(opened))));
  });
}

void kt_ckpt_close(kt_ckpt* ckpt) {
  if (!ckpt) return;
  // Unmapped here, or when another thread's call on it returns.
  if (!kt::remove_handle(kt::handle_id(ckpt), kt::HandleKind::kCkpt))
    kt::set_last_error(kt::issued_before_fork(kt::handle_id(ckpt))
                           ? kt::not_live_message(ckpt, kt::HandleKind::kCkpt, "kt_ckpt_close", "ckpt")
                           : "kt_ckpt_close: ckpt is not an open kt_ckpt (closed already?)");
}

kt_status kt_ckpt_get_info(const kt_ckpt* ckpt, kt_ckpt_info* info) {
  const char* w = "kt_ckpt_get_info";
  return guarded(w, [&] {
    const std::shared_ptr<kt_ckpt> c = check_ckpt(ckpt, w);
    kt_ckpt_info full;
    std::memset(&full, 0, sizeof(full));
    full.struct_size = sizeof(full);
    full.architecture = c->model.architecture.c_str();
    full.model_type = c->model.model_type.c_str();
    full.layout = c->model.layout;
    full.num_moe_layers = static_cast<int64_t>(c->model.layers.size());
    full.num_tensors = static_cast<int64_t>(c->by_index.size());
    full.num_files = static_cast<int64_t>(c->tensors->files().size());
    full.total_bytes = c->total_bytes;
    full.top_k = c->model.top_k;
    kt::write_sized(info, full, w, "info");
  });
}

kt_status kt_ckpt_get_layer_info(const kt_ckpt* ckpt, int64_t index, kt_ckpt_layer_info* info) {
  const char* w = "kt_ckpt_get_layer_info";
  return guarded(w, [&] {
    const std::shared_ptr<kt_ckpt> c = check_ckpt(ckpt, w);
    const int64_t n = static_cast<int64_t>(c->model.layers.size());
    KT_CHECK(index >= 0 && index < n, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": index " + std::to_string(index) + " is outside [0, " +
                 std::to_string(n) + ")");
    const kt::io::MoeLayer& m = c->model.layers[static_cast<size_t>(index)];
    kt_ckpt_layer_info full;
    std::memset(&full, 0, sizeof(full));
    full.struct_size = sizeof(full);
    full.layer = m.layer;
    full.num_experts = m.E;
    full.hidden = m.H;
    full.intermediate = m.I;
    full.has_bias = m.has_bias ? 1 : 0;
    full.layout = m.layout;
    full.format = m.format;
    full.weight_dtype = m.weight_dtype;
    full.loadable = m.loadable() ? 1 : 0;
    full.bytes = m.bytes;
    full.weight_format = m.native_format;
    full.group_size = m.group;
    full.num_tensors = static_cast<int64_t>(m.tensors.size());
    kt::write_sized(info, full, w, "info");
  });
}

kt_status kt_ckpt_moe_options(const kt_ckpt* ckpt, int64_t layer, kt_moe_options* options) {
  const char* w = "kt_ckpt_moe_options";
  return guarded(w, [&] {
    const std::shared_ptr<kt_ckpt> c = check_ckpt(ckpt, w);
    KT_CHECK(options != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": options is NULL");
    const kt::io::MoeLayer& m = c->model.get(layer, w);
    kt_moe_options o;
    kt_moe_options_init(&o);
    o.num_experts = m.E;
    o.hidden = m.H;
    o.intermediate = m.I;
    o.has_bias = m.has_bias ? 1 : 0;
    o.top_k = c->model.top_k > 0 && c->model.top_k <= m.E ? c->model.top_k : 1;
    o.activation = c->model.activation;
    o.act_alpha = c->model.act_alpha;
    o.act_limit = c->model.act_limit;
    // The format that holds the experts as stored (a quantized layer no kt
    // format holds keeps bf16: it loads only dequantized, when asked).
    if (m.loadable()) o.weight_format = m.native_format;
    kt::write_sized(options, o, w, "options");
  });
}

namespace {
void set_ckpt_load_options_defaults(kt_ckpt_load_options& o) { o.dequantize = 0; }

void load_layer_call(const kt_ckpt* ckpt, int64_t layer, kt_moe* moe, const kt_ckpt_load_options& o,
                     kt_ckpt_progress_fn progress, void* user, const char* w) {
  const std::shared_ptr<kt_ckpt> c = check_ckpt(ckpt, w);
  const std::shared_ptr<kt_moe> m = kt::live(moe, kt::HandleKind::kMoe, w, "moe");
  KT_CHECK(o.dequantize == 0 || o.dequantize == 1, KT_ERR_INVALID_ARGUMENT,
           std::string(w) + ": options->dequantize = " + std::to_string(o.dequantize) +
               " is not 0 or 1");
  kt::io::load_layer(c->model.get(layer, w), m.get(), o, progress, user, w);
}
}  // namespace

void kt_ckpt_load_options_defaults(kt_ckpt_load_options* o, size_t struct_size) {
  kt::write_defaults(o, struct_size, set_ckpt_load_options_defaults);
}

kt_status kt_ckpt_load_layer(const kt_ckpt* ckpt, int64_t layer, kt_moe* moe, kt_ckpt_progress_fn progress,
                             void* user) {
  const char* w = "kt_ckpt_load_layer";
  return guarded(w, [&] {
    kt_ckpt_load_options o;
    kt_ckpt_load_options_init(&o);
    load_layer_call(ckpt, layer, moe, o, progress, user, w);
  });
}

kt_status kt_ckpt_load_layer_with(const kt_ckpt* ckpt, int64_t layer, kt_moe* moe,
                                  const kt_ckpt_load_options* options, kt_ckpt_progress_fn progress, void* user) {
  const char* w = "kt_ckpt_load_layer_with";
  return guarded(w, [&] {
    const kt_ckpt_load_options o = kt::read_sized(options, set_ckpt_load_options_defaults, w, "options");
    load_layer_call(ckpt, layer, moe, o, progress, user, w);
  });
}

kt_status kt_ckpt_read_layer(const kt_ckpt* ckpt, int64_t layer, const kt_arg* args, size_t num_args) {
  const char* w = "kt_ckpt_read_layer";
  return guarded(w, [&] {
    const std::shared_ptr<kt_ckpt> c = check_ckpt(ckpt, w);
    kt::io::read_layer(c->model.get(layer, w), args, num_args, w);
  });
}

kt_status kt_ckpt_tensor_at(const kt_ckpt* ckpt, int64_t index, kt_ckpt_tensor* tensor) {
  const char* w = "kt_ckpt_tensor_at";
  return guarded(w, [&] {
    const std::shared_ptr<kt_ckpt> c = check_ckpt(ckpt, w);
    const int64_t n = static_cast<int64_t>(c->by_index.size());
    KT_CHECK(index >= 0 && index < n, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": index " + std::to_string(index) + " is outside [0, " +
                 std::to_string(n) + ")");
    fill_tensor(*c->by_index[static_cast<size_t>(index)], tensor, w);
  });
}

kt_status kt_ckpt_layer_tensor_at(const kt_ckpt* ckpt, int64_t layer, int64_t index, kt_ckpt_tensor* tensor) {
  const char* w = "kt_ckpt_layer_tensor_at";
  return guarded(w, [&] {
    const std::shared_ptr<kt_ckpt> c = check_ckpt(ckpt, w);
    const kt::io::MoeLayer& m = c->model.get(layer, w);
    const int64_t n = static_cast<int64_t>(m.tensors.size());
    KT_CHECK(index >= 0 && index < n, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": index " + std::to_string(index) + " is outside [0, " + std::to_string(n) +
                 ") (layer " + std::to_string(layer) + "'s expert tensors)");
    fill_tensor(*m.tensors[static_cast<size_t>(index)], tensor, w);
  });
}

kt_status kt_ckpt_find_tensor(const kt_ckpt* ckpt, const char* name, kt_ckpt_tensor* tensor) {
  const char* w = "kt_ckpt_find_tensor";
  return guarded(w, [&] {
    const std::shared_ptr<kt_ckpt> c = check_ckpt(ckpt, w);
    KT_CHECK(name != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": name is NULL");
    auto it = c->tensors->tensors().find(name);
    KT_CHECK(it != c->tensors->tensors().end(), KT_ERR_IO,
             std::string(w) + ": " + c->tensors->dir() + " holds no tensor '" + name + "'");
    fill_tensor(*it, tensor, w);
  });
}

namespace {
void set_ckpt_write_options_defaults(kt_ckpt_write_options& o) {
  o.layout = KT_CKPT_LAYOUT_PER_EXPERT;
  o.dtype = KT_CKPT_DTYPE_BF16;
  o.max_shard_bytes = int64_t{4} << 30;
  o.config_json = nullptr;
}
}  // namespace

void kt_ckpt_write_options_defaults(kt_ckpt_write_options* o, size_t struct_size) {
  kt::write_defaults(o, struct_size, set_ckpt_write_options_defaults);
}

kt_status kt_ckpt_write_experts(const char* dir, const kt_ckpt_write_options* options,
                                const kt_ckpt_layer_args* layers, size_t num_layers) {
  const char* w = "kt_ckpt_write_experts";
  return guarded(w, [&] {
    check_path(dir, w, "dir");
    const kt_ckpt_write_options o = kt::read_sized(options, set_ckpt_write_options_defaults, w, "options");
    check_enum(o.layout, KT_CKPT_LAYOUT_NONE, KT_CKPT_LAYOUT_GPT_OSS, std::string(w) + ": options->layout",
               "kt_ckpt_layout");
    check_enum(o.dtype, KT_CKPT_DTYPE_UNKNOWN, KT_CKPT_DTYPE_BOOL, std::string(w) + ": options->dtype",
               "kt_ckpt_dtype");
    kt::io::write_experts(dir, o, layers, num_layers, w);
  });
}

void kt_ckpt_adapter_config_defaults(kt_ckpt_adapter_config* o, size_t struct_size) {
  kt::write_defaults(o, struct_size, kt::io::set_adapter_config_defaults);
}

kt_status kt_ckpt_adapter_write(const char* dir, const kt_ckpt_adapter_config* config,
                                const kt_ckpt_layer_args* layers, size_t num_layers) {
  const char* w = "kt_ckpt_adapter_write";
  return guarded(w, [&] {
    check_path(dir, w, "dir");
    KT_CHECK(config != nullptr, KT_ERR_NULL_POINTER,
             std::string(w) + ": config is NULL (rank and alpha are required)");
    const kt_ckpt_adapter_config c = kt::read_sized(config, kt::io::set_adapter_config_defaults, w, "config");
    check_enum(c.layout, KT_CKPT_LAYOUT_NONE, KT_CKPT_LAYOUT_GPT_OSS, std::string(w) + ": config->layout",
               "kt_ckpt_layout");
    check_enum(c.dtype, KT_CKPT_DTYPE_UNKNOWN, KT_CKPT_DTYPE_BOOL, std::string(w) + ": config->dtype",
               "kt_ckpt_dtype");
    kt::io::write_adapter(dir, c, layers, num_layers, w);
  });
}

kt_status kt_ckpt_adapter_read_config(const char* dir, kt_ckpt_adapter_config* config) {
  const char* w = "kt_ckpt_adapter_read_config";
  return guarded(w, [&] {
    check_path(dir, w, "dir");
    KT_CHECK(config != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": config is NULL");
    KT_CHECK(config->struct_size >= sizeof(size_t), KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": config->struct_size is not set");
    kt_ckpt_adapter_config c;
    kt::io::read_adapter_config(dir, &c);
    kt::write_sized(config, c, w, "config");
  });
}

kt_status kt_ckpt_adapter_read(const char* dir, int64_t layer, const kt_arg* args, size_t num_args) {
  const char* w = "kt_ckpt_adapter_read";
  return guarded(w, [&] {
    check_path(dir, w, "dir");
    kt::io::read_adapter(dir, layer, args, num_args, w);
  });
}

}  // extern "C"
