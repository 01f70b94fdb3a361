// kt-moe: kt's command-line tool. Uses only the public C ABI of libkt, plus
// the POSIX publishing helper of src/io (io/publish.h) compiled in, for convert.
// Its name is the wheel's distribution name: `kt` is kt-kernel's command, and
// both wheels in one environment would overwrite each other's `kt`.
//   kt-moe info PATH [--json]   what a checkpoint holds: MoE layers, shapes, formats;
//                               or a packed cache (a .ktpack file, or a convert
//                               output): each layer's storage format and bytes
//   kt-moe demo [--json] [--keep DIR]
//                               writes a small synthetic checkpoint, loads a layer
//                               from it through the ABI, runs a forward, checks it
//   kt-moe convert DIR OUT [--layers L,...] [--format F] [--json]
//                               packs each MoE layer of a checkpoint (as stored,
//                               or in format F) into OUT/layer-<L>.ktpack
//                               (kt_moe_load_packed maps them back) plus
//                               OUT/manifest.json
//   kt-moe version [--json]
#include <dirent.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/publish.h"
#include "kt_c_api.h"

namespace {

// ------------------------------------------------------------------ output

std::string json_string(const char* s) {
  std::string out = "\"";
  for (const unsigned char* p = reinterpret_cast<const unsigned char*>(s); *p; ++p) {
    switch (*p) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (*p < 0x20) {
          char b[8];
          std::snprintf(b, sizeof(b), "\\u%04x", *p);
          out += b;
        } else {
          out += static_cast<char>(*p);
        }
    }
  }
  return out + "\"";
}

std::string json_string(const std::string& s) { return json_string(s.c_str()); }

std::string human_bytes(int64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char b[32];
  std::snprintf(b, sizeof(b), u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return b;
}

int report_failure(const char* what, kt_status st, bool json) {
  if (json)
    std::printf("{\"ok\": false, \"status\": %s, \"error\": %s}\n", json_string(kt_status_string(st)).c_str(),
                json_string(kt_last_error()).c_str());
  else
    std::fprintf(stderr, "kt-moe %s: %s: %s\n", what, kt_status_string(st), kt_last_error());
  return 1;
}

int usage(FILE* to) {
  std::fprintf(to,
               "usage: kt-moe <command> [options]\n"
               "  info PATH [--json]         describe a checkpoint directory (layers, experts,\n"
               "                             shapes, dtypes, formats, bytes), or a packed cache\n"
               "                             (a .ktpack file or a kt-moe convert output: each layer's\n"
               "                             storage format, experts and bytes)\n"
               "  demo [--json] [--keep DIR] write a synthetic checkpoint, load a layer from it,\n"
               "                             run a forward and check it against the same weights\n"
               "                             loaded from tensors\n"
               "  convert DIR OUT [--layers L,...] [--format F] [--json]\n"
               "                             pack the MoE layers of checkpoint DIR into a packed\n"
               "                             cache: OUT/layer-<L>.ktpack (memory-mapped back by\n"
               "                             kt_moe_load_packed) and OUT/manifest.json. Each layer\n"
               "                             is kept as stored (bf16 for bf16/fp16/fp32 layers,\n"
               "                             fp8_b128, mxfp4, int4_g32, int4_g128, int4_g32_zp or\n"
               "                             int4_g128_zp for quantized checkpoints: codes, scales\n"
               "                             and zero points as they are), or F:\n"
               "                             int8_channel, int4_g32 or int4_g128 quantize a dense\n"
               "                             layer (the error is stated in kt_c_api.h), bf16\n"
               "                             dequantizes a quantized one\n"
               "  bench [options]            the benchmark: kt against this machine's limits,\n"
               "                             oneDNN, torch eager and the peers installed (kt-kernel,\n"
               "                             DeepSpeed's CPU Adam, vLLM's CPU fused MoE with\n"
               "                             --vllm-python; kt-moe bench --help lists options)\n"
               "  version [--json]           library version, ABI, build, CPU ISA\n"
               "kt-moe is kt's command: the pip distribution kt-moe (pip install . in a clone of kt),\n"
               "python -m kt, or the Debian package kt-tools. `kt` is kt-kernel's command, and\n"
               "`pip install kt` installs an unrelated placeholder, not this project.\n");
  return to == stderr ? 2 : 0;
}

// -------------------------------------------------------------------- info

// One packed cache file: its header (kt_packed_read_info).
bool packed_info(const std::string& path, kt_packed_info* info) {
  std::memset(info, 0, sizeof(*info));
  info->struct_size = sizeof(*info);
  return kt_packed_read_info(path.c_str(), info) == KT_OK;
}

bool is_regular_file(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool is_packed_cache_name(const std::string& name);

// kt-moe info on a packed cache: a .ktpack file, or a directory of them (kt
// convert's output, whose manifest names the source).
int cmd_info_packed(const std::string& path, bool json) {
  std::vector<std::string> files;
  if (is_regular_file(path)) {
    files.push_back(path);
  } else if (DIR* d = opendir(path.c_str())) {
    while (const dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n != "manifest.json" && is_packed_cache_name(n)) files.push_back(path + "/" + n);
    }
    closedir(d);
    // Layer files in layer order.
    std::sort(files.begin(), files.end(), [](const std::string& a, const std::string& b) {
      return a.size() != b.size() ? a.size() < b.size() : a < b;
    });
  }
  std::vector<kt_packed_info> infos(files.size());
  for (size_t i = 0; i < files.size(); ++i)
    if (!packed_info(files[i], &infos[i])) return report_failure("info", KT_ERR_IO, json);
  if (json) {
    std::printf("{\n  \"ok\": true,\n  \"packed_cache\": %s,\n  \"layers\": [", json_string(path).c_str());
    for (size_t i = 0; i < files.size(); ++i) {
      const kt_packed_info& p = infos[i];
      std::printf("%s\n    {\"file\": %s, \"weight_format\": %s, \"experts\": %lld, \"loaded\": %lld, "
                  "\"hidden\": %lld, \"intermediate\": %lld, \"bias\": %s, \"weight_bytes\": %lld, "
                  "\"bytes\": %lld, \"cache_version\": %d}",
                  i ? "," : "", json_string(files[i]).c_str(), json_string(kt_weight_format_name(p.weight_format)).c_str(),
                  static_cast<long long>(p.num_experts), static_cast<long long>(p.num_loaded),
                  static_cast<long long>(p.hidden), static_cast<long long>(p.intermediate),
                  p.has_bias ? "true" : "false", static_cast<long long>(p.weight_bytes),
                  static_cast<long long>(p.file_bytes), p.format_version);
    }
    std::printf("%s]\n}\n", files.empty() ? "" : "\n  ");
    return 0;
  }
  std::printf("packed cache  %s (%zu layer file%s)\n", path.c_str(), files.size(), files.size() == 1 ? "" : "s");
  std::printf("%-24s %-13s %8s %7s %7s %12s %5s %10s\n", "file", "format", "experts", "loaded", "hidden",
              "intermediate", "bias", "bytes");
  for (size_t i = 0; i < files.size(); ++i) {
    const kt_packed_info& p = infos[i];
    const std::string name = files[i].substr(files[i].find_last_of('/') + 1);
    std::printf("%-24s %-13s %8lld %7lld %7lld %12lld %5s %10s\n", name.c_str(), kt_weight_format_name(p.weight_format),
                static_cast<long long>(p.num_experts), static_cast<long long>(p.num_loaded),
                static_cast<long long>(p.hidden), static_cast<long long>(p.intermediate), p.has_bias ? "yes" : "no",
                human_bytes(p.file_bytes).c_str());
  }
  return 0;
}

int cmd_info(const std::string& dir, bool json) {
  if (is_regular_file(dir) || is_regular_file(dir + "/manifest.json")) return cmd_info_packed(dir, json);
  kt_ckpt* ck = nullptr;
  kt_status st = kt_ckpt_open(dir.c_str(), &ck);
  if (st != KT_OK) return report_failure("info", st, json);
  kt_ckpt_info info;
  std::memset(&info, 0, sizeof(info));
  info.struct_size = sizeof(info);
  st = kt_ckpt_get_info(ck, &info);
  if (st != KT_OK) {
    kt_ckpt_close(ck);
    return report_failure("info", st, json);
  }
  std::vector<kt_ckpt_layer_info> layers(static_cast<size_t>(info.num_moe_layers));
  int64_t expert_bytes = 0, experts = 0;
  for (int64_t i = 0; i < info.num_moe_layers; ++i) {
    kt_ckpt_layer_info& li = layers[static_cast<size_t>(i)];
    std::memset(&li, 0, sizeof(li));
    li.struct_size = sizeof(li);
    st = kt_ckpt_get_layer_info(ck, i, &li);
    if (st != KT_OK) {
      kt_ckpt_close(ck);
      return report_failure("info", st, json);
    }
    expert_bytes += li.bytes;
    experts += li.num_experts;
  }
  // Tensor dtype histogram (count and bytes per dtype).
  int64_t dtype_count[32] = {0}, dtype_bytes[32] = {0};
  for (int64_t i = 0; i < info.num_tensors; ++i) {
    kt_ckpt_tensor t;
    t.struct_size = sizeof(t);
    if (kt_ckpt_tensor_at(ck, i, &t) != KT_OK) continue;
    const int d = static_cast<int>(t.dtype) & 31;
    dtype_count[d] += 1;
    dtype_bytes[d] += t.nbytes;
  }
  if (json) {
    std::printf("{\n  \"ok\": true,\n  \"dir\": %s,\n  \"architecture\": %s,\n  \"model_type\": %s,\n",
                json_string(dir).c_str(), json_string(info.architecture).c_str(),
                json_string(info.model_type).c_str());
    std::printf("  \"layout\": %s,\n  \"files\": %lld,\n  \"tensors\": %lld,\n  \"bytes\": %lld,\n",
                json_string(kt_ckpt_layout_name(info.layout)).c_str(), static_cast<long long>(info.num_files),
                static_cast<long long>(info.num_tensors), static_cast<long long>(info.total_bytes));
    std::printf("  \"top_k\": %lld,\n  \"moe_layers\": %lld,\n  \"routed_experts\": %lld,\n  \"expert_bytes\": %lld,\n",
                static_cast<long long>(info.top_k), static_cast<long long>(info.num_moe_layers),
                static_cast<long long>(experts), static_cast<long long>(expert_bytes));
    std::printf("  \"dtypes\": {");
    bool first = true;
    for (int d = 0; d < 32; ++d) {
      if (!dtype_count[d]) continue;
      std::printf("%s%s: {\"tensors\": %lld, \"bytes\": %lld}", first ? "" : ", ",
                  json_string(kt_ckpt_dtype_name(static_cast<kt_ckpt_dtype>(d))).c_str(),
                  static_cast<long long>(dtype_count[d]), static_cast<long long>(dtype_bytes[d]));
      first = false;
    }
    std::printf("},\n  \"layers\": [");
    for (size_t i = 0; i < layers.size(); ++i) {
      const kt_ckpt_layer_info& li = layers[i];
      std::printf(
          "%s\n    {\"layer\": %lld, \"experts\": %lld, \"hidden\": %lld, \"intermediate\": %lld, "
          "\"bias\": %s, \"layout\": %s, \"format\": %s, \"dtype\": %s, \"loadable\": %s, "
          "\"weight_format\": %s, \"group_size\": %lld, \"bytes\": %lld}",
          i ? "," : "", static_cast<long long>(li.layer), static_cast<long long>(li.num_experts),
          static_cast<long long>(li.hidden), static_cast<long long>(li.intermediate),
          li.has_bias ? "true" : "false", json_string(kt_ckpt_layout_name(li.layout)).c_str(),
          json_string(kt_ckpt_format_name(li.format)).c_str(),
          json_string(kt_ckpt_dtype_name(li.weight_dtype)).c_str(), li.loadable ? "true" : "false",
          li.loadable ? json_string(kt_weight_format_name(li.weight_format)).c_str() : "null",
          static_cast<long long>(li.group_size), static_cast<long long>(li.bytes));
    }
    std::printf("%s]\n}\n", layers.empty() ? "" : "\n  ");
  } else {
    std::printf("checkpoint    %s\n", dir.c_str());
    std::printf("architecture  %s (model_type %s)\n", info.architecture[0] ? info.architecture : "-",
                info.model_type[0] ? info.model_type : "-");
    std::printf("files         %lld safetensors, %lld tensors, %s\n", static_cast<long long>(info.num_files),
                static_cast<long long>(info.num_tensors), human_bytes(info.total_bytes).c_str());
    std::printf("dtypes       ");
    for (int d = 0; d < 32; ++d)
      if (dtype_count[d])
        std::printf(" %s x%lld (%s)", kt_ckpt_dtype_name(static_cast<kt_ckpt_dtype>(d)),
                    static_cast<long long>(dtype_count[d]), human_bytes(dtype_bytes[d]).c_str());
    std::printf("\nrouted experts %s layout, %lld MoE layers, %lld experts in all, %s, top_k %lld\n",
                kt_ckpt_layout_name(info.layout), static_cast<long long>(info.num_moe_layers),
                static_cast<long long>(experts), human_bytes(expert_bytes).c_str(), static_cast<long long>(info.top_k));
    if (!layers.empty())
      std::printf("%6s %8s %7s %12s %5s %-12s %-11s %-8s %-8s %-12s %5s %s\n", "layer", "experts",
                  "hidden", "intermediate", "bias", "layout", "format", "dtype", "loadable",
                  "kt format", "group", "bytes");
    // kt format: the kt_moe weight format that holds the layer as stored
    // (only where it loads); group: inputs per scale (0: dense).
    for (const auto& li : layers)
      std::printf("%6lld %8lld %7lld %12lld %5s %-12s %-11s %-8s %-8s %-12s %5lld %s\n",
                  static_cast<long long>(li.layer), static_cast<long long>(li.num_experts),
                  static_cast<long long>(li.hidden), static_cast<long long>(li.intermediate),
                  li.has_bias ? "yes" : "no", kt_ckpt_layout_name(li.layout),
                  kt_ckpt_format_name(li.format), kt_ckpt_dtype_name(li.weight_dtype),
                  li.loadable ? "yes" : "no",
                  li.loadable ? kt_weight_format_name(li.weight_format) : "-",
                  static_cast<long long>(li.group_size), human_bytes(li.bytes).c_str());
  }
  kt_ckpt_close(ck);
  return 0;
}

// -------------------------------------------------------------------- demo

struct Host {  // a compact host tensor
  std::vector<float> data;
  std::vector<int64_t> shape;
  DLTensor t{};
  Host(std::vector<int64_t> s) : shape(std::move(s)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    data.assign(static_cast<size_t>(n), 0.f);
    t.data = data.data();
    t.device.device_type = kDLCPU;
    t.ndim = static_cast<int>(shape.size());
    t.dtype.code = kDLFloat;
    t.dtype.bits = 32;
    t.dtype.lanes = 1;
    t.shape = shape.data();
    t.strides = nullptr;
  }
  Host(const Host&) = delete;
  Host& operator=(const Host&) = delete;
};

// Deterministic weights with the scale of a trained layer (~1/sqrt(fan_in)).
void fill_weights(Host& h, uint32_t seed, float scale) {
  uint32_t s = seed * 2654435761u + 1u;
  for (float& v : h.data) {
    s = s * 1664525u + 1013904223u;
    v = (static_cast<float>(s >> 8) / 16777216.f * 2.f - 1.f) * scale;
  }
}

void remove_tree(const std::string& path) {
  DIR* d = opendir(path.c_str());
  if (d) {
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n == "." || n == "..") continue;
      remove_tree(path + "/" + n);
    }
    closedir(d);
    rmdir(path.c_str());
  } else {
    unlink(path.c_str());
  }
}

void on_progress(int64_t done, int64_t total, void* user) {
  auto* log = static_cast<std::vector<int64_t>*>(user);
  log->push_back(done);
  (void)total;
}

int cmd_demo(bool json, const std::string& keep_dir) {
  // A Qwen3-MoE-shaped model, small: 2 MoE layers, 8 experts, top-2.
  const int64_t E = 8, H = 256, I = 128, K = 2, T = 6, layers = 2;
  std::string dir = keep_dir;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/kt_demo.XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (!mkdtemp(buf.data())) {
      std::fprintf(stderr, "kt-moe demo: cannot create a temporary directory: %s\n", std::strerror(errno));
      return 1;
    }
    dir = buf.data();
  }
  int rc = 1;
  kt_engine* engine = nullptr;
  kt_ckpt* ck = nullptr;
  kt_moe *from_ckpt = nullptr, *from_tensors = nullptr;
  std::vector<int64_t> progress;
  double max_diff = 0, y_norm = 0;
  std::vector<double> token_norms;
  kt_ckpt_info info;
  std::memset(&info, 0, sizeof(info));
  info.struct_size = sizeof(info);
  const char* failed_at = "";
  kt_status st = KT_OK;
  {
    std::vector<Host*> owned;
    std::vector<std::vector<kt_arg>> args(static_cast<size_t>(layers));
    std::vector<kt_ckpt_layer_args> layer_args;
    for (int64_t L = 0; L < layers; ++L) {
      Host* g = new Host({E, I, H});
      Host* u = new Host({E, I, H});
      Host* d = new Host({E, H, I});
      fill_weights(*g, static_cast<uint32_t>(3 * L + 1), 1.f / std::sqrt(static_cast<float>(H)));
      fill_weights(*u, static_cast<uint32_t>(3 * L + 2), 1.f / std::sqrt(static_cast<float>(H)));
      fill_weights(*d, static_cast<uint32_t>(3 * L + 3), 1.f / std::sqrt(static_cast<float>(I)));
      owned.insert(owned.end(), {g, u, d});
      args[static_cast<size_t>(L)] = {{KT_ARG_W_GATE, &g->t}, {KT_ARG_W_UP, &u->t}, {KT_ARG_W_DOWN, &d->t}};
    }
    for (int64_t L = 0; L < layers; ++L)
      layer_args.push_back({L + 1, args[static_cast<size_t>(L)].data(), args[static_cast<size_t>(L)].size()});
    kt_ckpt_write_options wo;
    kt_ckpt_write_options_init(&wo);
    wo.max_shard_bytes = 2 << 20;  // two shards, joined by an index
    const std::string config =
        "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"model_type\": \"qwen3_moe\", \"hidden_size\": " +
        std::to_string(H) + ", \"moe_intermediate_size\": " + std::to_string(I) + ", \"num_experts\": " +
        std::to_string(E) + ", \"num_experts_per_tok\": " + std::to_string(K) +
        ", \"num_hidden_layers\": 3, \"hidden_act\": \"silu\", \"torch_dtype\": \"bfloat16\"}";
    wo.config_json = config.c_str();
    Host x({T, H}), w({T, K}), y1({T, H}), y2({T, H});
    std::vector<int32_t> ids(static_cast<size_t>(T * K));
    int64_t id_shape[2] = {T, K};
    DLTensor ids_t{};
    ids_t.data = ids.data();
    ids_t.device.device_type = kDLCPU;
    ids_t.ndim = 2;
    ids_t.dtype.code = kDLInt;
    ids_t.dtype.bits = 32;
    ids_t.dtype.lanes = 1;
    ids_t.shape = id_shape;
    fill_weights(x, 99, 1.f);
    for (int64_t t = 0; t < T; ++t) {
      ids[static_cast<size_t>(t * K)] = static_cast<int32_t>((3 * t) % E);
      ids[static_cast<size_t>(t * K + 1)] = static_cast<int32_t>((3 * t + 5) % E);
      w.data[static_cast<size_t>(t * K)] = 0.625f;
      w.data[static_cast<size_t>(t * K + 1)] = 0.375f;
    }
    kt_moe_options mo;
    const int64_t layer = 2;
    do {
      failed_at = "writing the checkpoint";
      if ((st = kt_ckpt_write_experts(dir.c_str(), &wo, layer_args.data(), layer_args.size())) != KT_OK) break;
      failed_at = "opening it";
      if ((st = kt_ckpt_open(dir.c_str(), &ck)) != KT_OK) break;
      if ((st = kt_ckpt_get_info(ck, &info)) != KT_OK) break;
      failed_at = "creating the layer";
      if ((st = kt_engine_create(nullptr, &engine)) != KT_OK) break;
      kt_moe_options_init(&mo);
      if ((st = kt_ckpt_moe_options(ck, layer, &mo)) != KT_OK) break;
      if ((st = kt_moe_create(engine, &mo, &from_ckpt)) != KT_OK) break;
      if ((st = kt_moe_create(engine, &mo, &from_tensors)) != KT_OK) break;
      failed_at = "loading the layer";
      if ((st = kt_ckpt_load_layer(ck, layer, from_ckpt, on_progress, &progress)) != KT_OK) break;
      if ((st = kt_moe_load_weights(from_tensors, nullptr, args[1].data(), args[1].size())) != KT_OK) break;
      failed_at = "running the forward";
      kt_arg f1[4] = {{KT_ARG_X, &x.t}, {KT_ARG_IDS, &ids_t}, {KT_ARG_ROUTE_WEIGHTS, &w.t}, {KT_ARG_Y, &y1.t}};
      kt_arg f2[4] = {{KT_ARG_X, &x.t}, {KT_ARG_IDS, &ids_t}, {KT_ARG_ROUTE_WEIGHTS, &w.t}, {KT_ARG_Y, &y2.t}};
      if ((st = kt_moe_forward(from_ckpt, f1, 4, nullptr)) != KT_OK) break;
      if ((st = kt_moe_forward(from_tensors, f2, 4, nullptr)) != KT_OK) break;
      for (int64_t t = 0; t < T; ++t) {
        double n = 0;
        for (int64_t h = 0; h < H; ++h) {
          const double a = y1.data[static_cast<size_t>(t * H + h)], b = y2.data[static_cast<size_t>(t * H + h)];
          n += a * a;
          max_diff = std::fmax(max_diff, std::fabs(a - b));
        }
        token_norms.push_back(std::sqrt(n));
        y_norm += n;
      }
      y_norm = std::sqrt(y_norm);
      rc = max_diff == 0.0 && y_norm > 0.0 ? 0 : 1;
    } while (false);
    for (Host* h : owned) delete h;
  }
  if (st != KT_OK) {
    std::string what = std::string("demo (") + failed_at + ")";
    report_failure(what.c_str(), st, json);
  } else if (json) {
    std::printf("{\n  \"ok\": %s,\n  \"checkpoint\": %s,\n  \"kept\": %s,\n  \"files\": %lld,\n  \"tensors\": %lld,\n",
                rc == 0 ? "true" : "false", json_string(dir).c_str(), keep_dir.empty() ? "false" : "true",
                static_cast<long long>(info.num_files), static_cast<long long>(info.num_tensors));
    std::printf("  \"layer\": 2,\n  \"experts\": %lld,\n  \"hidden\": %lld,\n  \"intermediate\": %lld,\n"
                "  \"top_k\": %lld,\n  \"tokens\": %lld,\n  \"progress_calls\": %zu,\n",
                static_cast<long long>(E), static_cast<long long>(H), static_cast<long long>(I),
                static_cast<long long>(K), static_cast<long long>(T), progress.size());
    std::printf("  \"y_norm\": %.9g,\n  \"token_norms\": [", y_norm);
    for (size_t i = 0; i < token_norms.size(); ++i) std::printf("%s%.9g", i ? ", " : "", token_norms[i]);
    std::printf("],\n  \"max_abs_diff_vs_tensors\": %.9g\n}\n", max_diff);
  } else {
    std::printf("kt-moe demo: wrote a Qwen3-MoE-shaped checkpoint (%lld MoE layers, E=%lld, H=%lld, I=%lld, bf16)\n"
                "         to %s: %lld files, %lld tensors\n",
                static_cast<long long>(layers), static_cast<long long>(E), static_cast<long long>(H),
                static_cast<long long>(I), dir.c_str(), static_cast<long long>(info.num_files),
                static_cast<long long>(info.num_tensors));
    std::printf("loaded layer 2 through kt_ckpt_load_layer (%zu progress calls), forward of %lld tokens, top-%lld:\n",
                progress.size(), static_cast<long long>(T), static_cast<long long>(K));
    for (size_t t = 0; t < token_norms.size(); ++t)
      std::printf("  token %zu -> experts %d, %d   |y| = %.6f\n", t, static_cast<int>((3 * t) % E),
                  static_cast<int>((3 * t + 5) % E), token_norms[t]);
    std::printf("same weights loaded from tensors: max |difference| = %.3g  -> %s\n", max_diff,
                rc == 0 ? "identical" : "MISMATCH");
  }
  kt_moe_destroy(from_ckpt);
  kt_moe_destroy(from_tensors);
  kt_engine_destroy(engine);
  kt_ckpt_close(ck);
  if (keep_dir.empty()) remove_tree(dir);
  return rc;
}

// ----------------------------------------------------------------- convert

// "3,5,7" -> {3, 5, 7}; false on anything else.
bool parse_layer_list(const std::string& text, std::vector<int64_t>* out) {
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find(',', at);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(at, end - at);
    char* stop = nullptr;
    errno = 0;
    const long long v = std::strtoll(item.c_str(), &stop, 10);
    if (item.empty() || errno != 0 || *stop != '\0' || v < 0) return false;
    out->push_back(v);
    at = end + 1;
  }
  return !out->empty();
}

struct ConvertProgress {
  bool draw = false;
  size_t index = 0, count = 0;
  int64_t layer = 0;
};

void draw_progress(int64_t done, int64_t total, void* user) {
  const auto* p = static_cast<const ConvertProgress*>(user);
  if (!p->draw) return;
  const int width = 30;
  const int filled = total > 0 ? static_cast<int>(done * width / total) : width;
  std::fprintf(stderr, "\rlayer %lld (%zu/%zu) [%.*s%*s] %lld/%lld experts", static_cast<long long>(p->layer),
               p->index + 1, p->count, filled, "##############################", width - filled, "",
               static_cast<long long>(done), static_cast<long long>(total));
  std::fflush(stderr);
}

// The names kt-moe convert writes in OUT: manifest.json and layer-<L>.ktpack.
bool is_packed_cache_name(const std::string& name) {
  if (name == "manifest.json") return true;
  const std::string head = "layer-", tail = ".ktpack";
  if (name.size() <= head.size() + tail.size() || name.compare(0, head.size(), head) != 0 ||
      name.compare(name.size() - tail.size(), tail.size(), tail) != 0)
    return false;
  for (size_t i = head.size(); i < name.size() - tail.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return false;
  return true;
}

int64_t file_size(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

// "int4_g32" -> KT_FORMAT_INT4_G32 (kt_weight_format_name's names).
bool parse_format(const std::string& text, kt_weight_format* out) {
  for (kt_weight_format f : {KT_FORMAT_BF16, KT_FORMAT_INT8_CHANNEL, KT_FORMAT_INT4_G32, KT_FORMAT_INT4_G128,
                             KT_FORMAT_FP8_B128, KT_FORMAT_MXFP4, KT_FORMAT_INT4_G32_ZP, KT_FORMAT_INT4_G128_ZP})
    if (text == kt_weight_format_name(f)) {
      *out = f;
      return true;
    }
  return false;
}

int cmd_convert(const std::string& dir, const std::string& out, const std::string& layer_list,
                const std::string& format_name, bool json) {
  // Without --format every layer keeps the format that holds it as stored.
  kt_weight_format format = KT_FORMAT_BF16;
  const bool format_given = !format_name.empty();
  if (format_given && !parse_format(format_name, &format)) {
    std::fprintf(stderr,
                 "kt-moe convert: --format takes bf16, int8_channel, int4_g32, int4_g128, fp8_b128, mxfp4, int4_g32_zp or "
                 "int4_g128_zp, got '%s'\n",
                 format_name.c_str());
    return 2;
  }
  std::vector<int64_t> wanted;
  if (!layer_list.empty() && !parse_layer_list(layer_list, &wanted)) {
    std::fprintf(stderr, "kt-moe convert: --layers takes layer numbers separated by commas, got '%s'\n",
                 layer_list.c_str());
    return 2;
  }
  kt_ckpt* ck = nullptr;
  kt_status st = kt_ckpt_open(dir.c_str(), &ck);
  if (st != KT_OK) return report_failure("convert", st, json);
  kt_ckpt_info info;
  std::memset(&info, 0, sizeof(info));
  info.struct_size = sizeof(info);
  if ((st = kt_ckpt_get_info(ck, &info)) != KT_OK) {
    kt_ckpt_close(ck);
    return report_failure("convert", st, json);
  }
  std::vector<kt_ckpt_layer_info> layers;
  for (int64_t i = 0; i < info.num_moe_layers; ++i) {
    kt_ckpt_layer_info li;
    std::memset(&li, 0, sizeof(li));
    li.struct_size = sizeof(li);
    if ((st = kt_ckpt_get_layer_info(ck, i, &li)) != KT_OK) {
      kt_ckpt_close(ck);
      return report_failure("convert", st, json);
    }
    const bool selected = wanted.empty() || std::find(wanted.begin(), wanted.end(), li.layer) != wanted.end();
    if (selected) layers.push_back(li);
  }
  for (int64_t L : wanted) {
    bool found = false;
    for (const auto& li : layers) found = found || li.layer == L;
    if (!found) {
      kt_ckpt_close(ck);
      std::fprintf(stderr, "kt-moe convert: %s has no MoE layer %lld\n", dir.c_str(), static_cast<long long>(L));
      return 1;
    }
  }
  // A layer kt cannot hold as stored can still be dequantized when the host
  // asks for bf16 (the load says so when it cannot).
  const bool dequantize = format_given && format == KT_FORMAT_BF16;
  for (const auto& li : layers) {
    if (li.loadable || dequantize) continue;
    kt_ckpt_close(ck);
    std::fprintf(stderr,
                 "kt-moe convert: layer %lld stores %s %s weights, which kt cannot hold as stored (kt-moe info says why); "
                 "--format bf16 dequantizes a quantized layer\n",
                 static_cast<long long>(li.layer), kt_ckpt_format_name(li.format), kt_ckpt_dtype_name(li.weight_dtype));
    return 1;
  }
  // OUT is replaced as a whole (kt/io/publish.h): the layer files and the
  // manifest are written into a new version next to it, which is swapped in
  // last, so a reader sees the old packed cache or the new one, never a mix.
  std::unique_ptr<kt::io::StagedDir> staged;
  try {
    staged.reset(new kt::io::StagedDir(out, kt::io::owned_with_temporaries(is_packed_cache_name)));
  } catch (const kt::Error& e) {
    kt_ckpt_close(ck);
    std::fprintf(stderr, "kt-moe convert: %s\n", e.what());
    return 1;
  }
  kt_engine* engine = nullptr;
  if ((st = kt_engine_create(nullptr, &engine)) != KT_OK) {
    kt_ckpt_close(ck);
    return report_failure("convert", st, json);
  }
  ConvertProgress progress;
  progress.draw = !json && isatty(STDERR_FILENO);
  progress.count = layers.size();
  std::string entries;
  int64_t total_bytes = 0;
  std::vector<kt_weight_format> written;  // per layer
  for (size_t i = 0; i < layers.size() && st == KT_OK; ++i) {
    const kt_ckpt_layer_info& li = layers[i];
    progress.index = i;
    progress.layer = li.layer;
    kt_moe_options mo;
    kt_moe* moe = nullptr;
    const std::string name = "layer-" + std::to_string(li.layer) + ".ktpack";
    const std::string path = staged->file(name);
    kt_moe_options_init(&mo);
    if ((st = kt_ckpt_moe_options(ck, li.layer, &mo)) == KT_OK) {
      mo.max_tokens = 1;  // the layer only packs and saves: keep its workspaces small
      if (format_given) mo.weight_format = format;
      st = kt_moe_create(engine, &mo, &moe);
    }
    kt_ckpt_load_options lo;
    kt_ckpt_load_options_init(&lo);
    lo.dequantize = dequantize ? 1 : 0;
    if (st == KT_OK) st = kt_ckpt_load_layer_with(ck, li.layer, moe, &lo, draw_progress, &progress);
    if (st == KT_OK) st = kt_moe_save_packed(moe, path.c_str());
    kt_moe_destroy(moe);
    if (st != KT_OK) break;
    const int64_t bytes = file_size(path);
    total_bytes += bytes;
    char entry[640];
    std::snprintf(entry, sizeof(entry),
                  "%s\n    {\"layer\": %lld, \"file\": %s, \"bytes\": %lld, \"experts\": %lld, \"hidden\": %lld, "
                  "\"intermediate\": %lld, \"bias\": %s, \"top_k\": %lld, \"activation\": %s, \"act_alpha\": %.9g, "
                  "\"act_limit\": %.9g, \"source_dtype\": %s, \"weight_format\": %s}",
                  i ? "," : "", static_cast<long long>(li.layer), json_string(name).c_str(),
                  static_cast<long long>(bytes), static_cast<long long>(li.num_experts),
                  static_cast<long long>(li.hidden), static_cast<long long>(li.intermediate),
                  li.has_bias ? "true" : "false", static_cast<long long>(mo.top_k),
                  json_string(mo.activation == KT_ACT_SWIGLU_OAI ? "swiglu_oai" : "silu").c_str(),
                  static_cast<double>(mo.act_alpha), static_cast<double>(mo.act_limit),
                  json_string(kt_ckpt_dtype_name(li.weight_dtype)).c_str(),
                  json_string(kt_weight_format_name(mo.weight_format)).c_str());
    entries += entry;
    written.push_back(mo.weight_format);
  }
  if (progress.draw && !layers.empty()) std::fprintf(stderr, "\n");
  kt_engine_destroy(engine);
  if (st != KT_OK) {
    kt_ckpt_close(ck);
    return report_failure("convert", st, json);
  }
  // The manifest goes last: its presence says every layer file is complete.
  std::string manifest = "{\n  \"format\": \"kt-packed-cache\",\n  \"kt_version\": " + json_string(kt_version()) +
                         ",\n  \"abi\": " + std::to_string(kt_abi_version()) + ",\n  \"source\": " + json_string(dir) +
                         ",\n  \"architecture\": " + json_string(info.architecture) +
                         ",\n  \"model_type\": " + json_string(info.model_type) +
                         ",\n  \"layout\": " + json_string(kt_ckpt_layout_name(info.layout)) +
                         ",\n  \"bytes\": " + std::to_string(total_bytes) + ",\n  \"layers\": [" + entries +
                         (layers.empty() ? "" : "\n  ") + "]\n}\n";
  kt_ckpt_close(ck);
  try {
    kt::io::AtomicFile f(staged->file("manifest.json"), kt::io::AtomicFile::kCreate);
    f.write(manifest.data(), manifest.size());
    f.commit();
    staged->publish();
  } catch (const kt::Error& e) {
    std::fprintf(stderr, "kt-moe convert: %s\n", e.what());
    return 1;
  }
  // The layers' format, or "mixed" when they differ (manifest.json has each).
  std::string formats = written.empty() ? kt_weight_format_name(format) : kt_weight_format_name(written[0]);
  for (kt_weight_format f : written)
    if (f != written[0]) formats = "mixed";
  if (json) {
    std::printf("{\"ok\": true, \"out\": %s, \"manifest\": %s, \"layers\": %zu, \"bytes\": %lld, "
                "\"weight_format\": %s}\n",
                json_string(out).c_str(), json_string(out + "/manifest.json").c_str(), layers.size(),
                static_cast<long long>(total_bytes), json_string(formats).c_str());
  } else {
    std::printf("kt-moe convert: packed %zu MoE layer(s) of %s into %s as %s (%s), manifest.json written\n",
                layers.size(), dir.c_str(), out.c_str(), formats.c_str(), human_bytes(total_bytes).c_str());
  }
  return 0;
}

int cmd_version(bool json) {
  if (json)
    std::printf("{\"version\": %s, \"abi\": %d, \"build\": %s, \"cpu_isa\": %s}\n", json_string(kt_version()).c_str(),
                kt_abi_version(), json_string(kt_build_info()).c_str(), json_string(kt_isa_name(kt_cpu_isa())).c_str());
  else
    std::printf("kt %s (abi %d)\n%s\ncpu isa: %s\n", kt_version(), kt_abi_version(), kt_build_info(),
                kt_isa_name(kt_cpu_isa()));
  return 0;
}

}  // namespace

// ------------------------------------------------------------------- bench

// kt-moe bench runs the benchmark program with the remaining arguments. It is
// looked up as $KT_BENCH, then next to an installed kt
// (<prefix>/libexec/kt/kt_bench), then in the build tree kt was built in.
int cmd_bench(int argc, char** argv) {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("KT_BENCH"); env && *env) candidates.push_back(env);
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    self[n] = '\0';
    std::string dir(self);
    dir = dir.substr(0, dir.find_last_of('/'));
    candidates.push_back(dir + "/../libexec/kt/kt_bench");
  }
#ifdef KT_BENCH_BUILD_PATH
  candidates.push_back(KT_BENCH_BUILD_PATH);
#endif
  for (const std::string& path : candidates) {
    if (access(path.c_str(), X_OK) != 0) continue;
    std::vector<char*> args;
    args.push_back(const_cast<char*>(path.c_str()));
    for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
    args.push_back(nullptr);
    execv(path.c_str(), args.data());
    std::fprintf(stderr, "kt-moe bench: cannot run %s: %s\n", path.c_str(), std::strerror(errno));
    return 1;
  }
  std::fprintf(stderr, "kt-moe bench: the benchmark program (kt_bench) is not installed here; set KT_BENCH to its path\n");
  return 1;
}

int main(int argc, char** argv) {
  if (argc < 2) return usage(stderr);
  const std::string cmd = argv[1];
  if (cmd == "bench") return cmd_bench(argc, argv);
  bool json = false;
  std::string keep, layer_list, format_name;
  std::vector<std::string> positional;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") {
      json = true;
    } else if (a == "--keep" && cmd == "demo" && i + 1 < argc) {
      keep = argv[++i];
    } else if (a == "--layers" && cmd == "convert" && i + 1 < argc) {
      layer_list = argv[++i];
    } else if (a == "--format" && cmd == "convert" && i + 1 < argc) {
      format_name = argv[++i];
    } else if (a == "-h" || a == "--help") {
      return usage(stdout);
    } else if (!a.empty() && a[0] == '-') {
      std::fprintf(stderr, "kt-moe %s: unknown option %s\n", cmd.c_str(), a.c_str());
      return usage(stderr);
    } else {
      positional.push_back(a);
    }
  }
  if (cmd == "info" && positional.size() == 1) return cmd_info(positional[0], json);
  if (cmd == "demo" && positional.empty()) return cmd_demo(json, keep);
  if (cmd == "convert" && positional.size() == 2) return cmd_convert(positional[0], positional[1], layer_list, format_name, json);
  if (cmd == "version" && positional.empty()) return cmd_version(json);
  if (cmd == "help" || cmd == "-h" || cmd == "--help") return usage(stdout);
  return usage(stderr);
}
