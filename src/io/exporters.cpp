#include "io/exporters.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/arg_names.h"
#include "core/ckpt_names.h"
#include "core/error.h"
#include "core/sized_struct.h"
#include "core/tensor.h"
#include "io/elements.h"
#include "io/layout.h"
#include "io/safetensors.h"
#include "io/writer.h"

namespace kt {
namespace io {

using nlohmann::json;

namespace {

const std::initializer_list<DType> kSourceDtypes = {DType::kBF16, DType::kF16, DType::kF32};

kt_ckpt_dtype checked_store_dtype(kt_ckpt_dtype dt, bool allow_f16, const char* where, const char* field) {
  const bool ok = dt == KT_CKPT_DTYPE_F32 || dt == KT_CKPT_DTYPE_BF16 || (allow_f16 && dt == KT_CKPT_DTYPE_F16);
  KT_CHECK(ok, KT_ERR_INVALID_ARGUMENT,
           std::string(where) + ": " + field + " must be KT_CKPT_DTYPE_F32 or _BF16" +
               (allow_f16 ? " or _F16" : ""));
  return dt;
}

void check_naming(kt_ckpt_layout l, const char* where, const char* field) {
  KT_CHECK(l == KT_CKPT_LAYOUT_PER_EXPERT || l == KT_CKPT_LAYOUT_MIXTRAL, KT_ERR_INVALID_ARGUMENT,
           std::string(where) + ": " + field +
               " must be KT_CKPT_LAYOUT_PER_EXPERT or KT_CKPT_LAYOUT_MIXTRAL");
}

const View* find_arg(const std::vector<std::pair<int, View>>& views, int id) {
  for (const auto& kv : views)
    if (kv.first == id) return &kv.second;
  return nullptr;
}

std::vector<std::pair<int, View>> collect(const kt_ckpt_layer_args& L, std::initializer_list<int> allowed,
                                          const std::initializer_list<DType>& dtypes, const char* where,
                                          const std::string& layer_name) {
  KT_CHECK(L.num_args == 0 || L.args != nullptr, KT_ERR_NULL_POINTER,
           std::string(where) + ": " + layer_name + ": args is NULL");
  std::vector<std::pair<int, View>> out;
  for (size_t i = 0; i < L.num_args; ++i) {
    const int id = L.args[i].id;
    bool ok = false;
    for (int a : allowed) ok = ok || a == id;
    KT_CHECK(ok, KT_ERR_INVALID_ARGUMENT,
             std::string(where) + ": " + layer_name + ": argument id " + std::to_string(id) +
                 " is not accepted here");
    KT_CHECK(find_arg(out, id) == nullptr, KT_ERR_INVALID_ARGUMENT,
             std::string(where) + ": " + layer_name + ": argument id " + std::to_string(id) +
                 " given twice");
    const char* arg = arg_name(id);
    const std::string name = layer_name + " " + (arg ? arg : std::to_string(id).c_str());
    // Biases are [E, n]; weights and LoRA factors [E, rows, cols].
    const bool bias = id == KT_ARG_B_GATE || id == KT_ARG_B_UP || id == KT_ARG_B_DOWN;
    if (bias)
      out.emplace_back(id, check_tensor(L.args[i].tensor, {name.c_str(), dtypes, {-1, -1}}, where));
    else
      out.emplace_back(id, check_tensor(L.args[i].tensor, {name.c_str(), dtypes, {-1, -1, -1}}, where));
  }
  return out;
}

void need_shape(const View& v, std::initializer_list<int64_t> shape, const char* where, const std::string& what) {
  bool ok = v.ndim == static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) ok = ok && v.shape[i++] == s;
  if (!ok) {
    std::string want = "[";
    i = 0;
    for (int64_t s : shape) want += (i++ ? "," : "") + std::to_string(s);
    fail(KT_ERR_SHAPE, std::string(where) + ": " + what + " has shape " + shape_string(v) + ", expected " + want + "]");
  }
}

const char* kProjWord[3] = {"gate", "up", "down"};

// "model-00001-of-00003.safetensors" and the like (any digit counts).
bool is_shard_name(const std::string& n) {
  const std::string head = "model-", mid = "-of-", tail = ".safetensors";
  if (n.size() <= head.size() + mid.size() + tail.size() || n.compare(0, head.size(), head) != 0 ||
      n.compare(n.size() - tail.size(), tail.size(), tail) != 0)
    return false;
  const std::string core = n.substr(head.size(), n.size() - head.size() - tail.size());
  const size_t m = core.find(mid);
  if (m == std::string::npos || m == 0 || m + mid.size() == core.size()) return false;
  for (size_t i = 0; i < core.size(); ++i)
    if ((i < m || i >= m + mid.size()) && (core[i] < '0' || core[i] > '9')) return false;
  return true;
}

// Whether s is well-formed UTF-8 (JSON text must be).
bool valid_utf8(const char* s) {
  const unsigned char* p = reinterpret_cast<const unsigned char*>(s);
  while (*p) {
    int extra = 0;
    uint32_t cp = 0;
    if (*p < 0x80) {
      ++p;
      continue;
    } else if ((*p & 0xE0) == 0xC0) {
      extra = 1, cp = *p & 0x1F;
    } else if ((*p & 0xF0) == 0xE0) {
      extra = 2, cp = *p & 0x0F;
    } else if ((*p & 0xF8) == 0xF0) {
      extra = 3, cp = *p & 0x07;
    } else {
      return false;
    }
    ++p;
    for (int i = 0; i < extra; ++i, ++p) {
      if ((*p & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (*p & 0x3F);
    }
    static const uint32_t kMin[4] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[extra] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
  }
  return true;
}

}  // namespace

void write_expert_slice(const View& v, int64_t e, kt_ckpt_dtype dt, uint8_t* dst) {
  const kt_ckpt_dtype src_dt = from_dtype(v.dtype);
  const size_t ds = st_dtype_info(dt).size;
  const int64_t es = static_cast<int64_t>(v.elem_size());
  if (v.ndim == 2) {
    for (int64_t i = 0; i < v.shape[1]; ++i) convert_elements(v.at(e, i), src_dt, dst + static_cast<size_t>(i) * ds, dt, 1);
    return;
  }
  const int64_t rows = v.shape[1], cols = v.shape[2];
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* out = dst + static_cast<size_t>(r * cols) * ds;
    const char* row = v.at(e, r, 0);
    if (v.strides[2] == 1) {
      convert_elements(row, src_dt, out, dt, cols);
    } else {
      for (int64_t c = 0; c < cols; ++c)
        convert_elements(row + c * v.strides[2] * es, src_dt, out + static_cast<size_t>(c) * ds, dt, 1);
    }
  }
}


void read_expert_slice(const uint8_t* src, kt_ckpt_dtype src_dt, const View& v, int64_t e) {
  const size_t ss = st_dtype_info(src_dt).size;
  const kt_ckpt_dtype dst_dt = from_dtype(v.dtype);
  const int64_t es = static_cast<int64_t>(v.elem_size());
  if (v.ndim == 2) {
    for (int64_t i = 0; i < v.shape[1]; ++i) convert_elements(src + static_cast<size_t>(i) * ss, src_dt, v.at(e, i), dst_dt, 1);
    return;
  }
  const int64_t rows = v.shape[1], cols = v.shape[2];
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* in = src + static_cast<size_t>(r * cols) * ss;
    char* row = v.at(e, r, 0);
    if (v.strides[2] == 1) {
      convert_elements(in, src_dt, row, dst_dt, cols);
    } else {
      for (int64_t c = 0; c < cols; ++c)
        convert_elements(in + static_cast<size_t>(c) * ss, src_dt, row + c * v.strides[2] * es, dst_dt, 1);
    }
  }
}

namespace {

// Tensors in order, in shards of at most max_bytes (a larger tensor gets its own).
std::vector<std::vector<TensorToWrite>> group_into_shards(std::vector<TensorToWrite> all, int64_t max_bytes) {
  std::vector<std::vector<TensorToWrite>> shards(1);
  uint64_t current = 0;
  for (auto& t : all) {
    const uint64_t n = t.nbytes();
    if (!shards.back().empty() && current + n > static_cast<uint64_t>(max_bytes)) {
      shards.emplace_back();
      current = 0;
    }
    current += n;
    shards.back().push_back(std::move(t));
  }
  return shards;
}

}  // namespace

void write_experts(const std::string& dir, const kt_ckpt_write_options& o, const kt_ckpt_layer_args* layers,
                   size_t num_layers, const char* where) {
  KT_CHECK(num_layers == 0 || layers != nullptr, KT_ERR_NULL_POINTER,
           std::string(where) + ": layers is NULL");
  check_naming(o.layout, where, "options->layout");
  const kt_ckpt_dtype dt = checked_store_dtype(o.dtype, true, where, "options->dtype");
  KT_CHECK(o.max_shard_bytes > 0, KT_ERR_INVALID_ARGUMENT,
           std::string(where) + ": options->max_shard_bytes must be > 0");
  std::string config_text;
  if (o.config_json) {
    json c = json::parse(o.config_json, nullptr, false);
    KT_CHECK(!c.is_discarded() && c.is_object(), KT_ERR_INVALID_ARGUMENT,
             std::string(where) + ": options->config_json is not a JSON object");
    config_text = c.dump(2) + "\n";
  }
  // Check every layer before writing anything.
  std::vector<TensorToWrite> all;
  for (size_t li = 0; li < num_layers; ++li) {
    const kt_ckpt_layer_args& L = layers[li];
    const std::string lname = "layers[" + std::to_string(li) + "] (layer " + std::to_string(L.layer) + ")";
    KT_CHECK(L.layer >= 0, KT_ERR_INVALID_ARGUMENT,
             std::string(where) + ": " + lname + ": layer must be >= 0");
    for (size_t lj = 0; lj < li; ++lj)
      KT_CHECK(layers[lj].layer != L.layer, KT_ERR_INVALID_ARGUMENT,
               std::string(where) + ": layer " + std::to_string(L.layer) + " is given twice");
    auto views = collect(L, {KT_ARG_W_GATE, KT_ARG_W_UP, KT_ARG_W_DOWN, KT_ARG_B_GATE, KT_ARG_B_UP, KT_ARG_B_DOWN},
                         kSourceDtypes, where, lname);
    const View* w[3] = {find_arg(views, KT_ARG_W_GATE), find_arg(views, KT_ARG_W_UP), find_arg(views, KT_ARG_W_DOWN)};
    const View* b[3] = {find_arg(views, KT_ARG_B_GATE), find_arg(views, KT_ARG_B_UP), find_arg(views, KT_ARG_B_DOWN)};
    KT_CHECK(w[0] && w[1] && w[2], KT_ERR_NULL_POINTER,
             std::string(where) + ": " + lname +
                 ": KT_ARG_W_GATE, KT_ARG_W_UP and KT_ARG_W_DOWN are required");
    const bool bias = b[0] || b[1] || b[2];
    KT_CHECK(!bias || (b[0] && b[1] && b[2]), KT_ERR_NULL_POINTER,
             std::string(where) + ": " + lname +
                 ": give all of KT_ARG_B_GATE, KT_ARG_B_UP, KT_ARG_B_DOWN or none");
    KT_CHECK(w[0]->ndim == 3, KT_ERR_SHAPE,
             std::string(where) + ": " + lname + ": KT_ARG_W_GATE must be [E,I,H]");
    const int64_t E = w[0]->shape[0], I = w[0]->shape[1], H = w[0]->shape[2];
    need_shape(*w[1], {E, I, H}, where, lname + " KT_ARG_W_UP");
    need_shape(*w[2], {E, H, I}, where, lname + " KT_ARG_W_DOWN");
    if (bias) {
      need_shape(*b[0], {E, I}, where, lname + " KT_ARG_B_GATE");
      need_shape(*b[1], {E, I}, where, lname + " KT_ARG_B_UP");
      need_shape(*b[2], {E, H}, where, lname + " KT_ARG_B_DOWN");
    }
    for (int64_t e = 0; e < E; ++e)
      for (int p = 0; p < 3; ++p) {
        const std::string module = expert_module_name(o.layout, L.layer, e, p);
        const int64_t out = p == 2 ? H : I, in = p == 2 ? I : H;
        const View wv = *w[p];
        all.push_back(TensorToWrite{module + ".weight", dt, {out, in},
                                    [wv, e, dt](uint8_t* dst) { write_expert_slice(wv, e, dt, dst); }});
        if (bias) {
          const View bv = *b[p];
          all.push_back(TensorToWrite{module + ".bias", dt, {out},
                                      [bv, e, dt](uint8_t* dst) { write_expert_slice(bv, e, dt, dst); }});
        }
      }
  }
  std::vector<std::vector<TensorToWrite>> shards = group_into_shards(std::move(all), o.max_shard_bytes);
  // Names, sizes and texts are settled: now the new version is built next to
  // dir and swapped in as a whole.
  const bool with_config = !config_text.empty();
  StagedDir staged(dir, owned_with_temporaries([with_config](const std::string& name) {
    return name == "model.safetensors" || name == "model.safetensors.index.json" || is_shard_name(name) ||
           (with_config && name == "config.json");
  }));
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  if (with_config) write_text(staged.file("config.json"), config_text, AtomicFile::kCreate);
  if (shards.size() == 1) {
    write_safetensors(staged.file("model.safetensors"), std::move(shards[0]), meta, AtomicFile::kCreate);
  } else {
    json weight_map = json::object();
    uint64_t total = 0;
    const size_t n = shards.size();
    for (size_t i = 0; i < n; ++i) {
      char name[64];
      std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", i + 1, n);
      for (const auto& t : shards[i]) {
        weight_map[t.name] = name;
        total += t.nbytes();
      }
      write_safetensors(staged.file(name), std::move(shards[i]), meta, AtomicFile::kCreate);
    }
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_text(staged.file("model.safetensors.index.json"), index.dump(2) + "\n", AtomicFile::kCreate);
  }
  staged.publish();
}

namespace {

std::string adapter_key(kt_ckpt_layout naming, int64_t layer, int64_t e, int p, bool a) {
  return "base_model.model." + expert_module_name(naming, layer, e, p) + (a ? ".lora_A.weight" : ".lora_B.weight");
}

const int kLoraA[3] = {KT_ARG_LORA_A_GATE, KT_ARG_LORA_A_UP, KT_ARG_LORA_A_DOWN};
const int kLoraB[3] = {KT_ARG_LORA_B_GATE, KT_ARG_LORA_B_UP, KT_ARG_LORA_B_DOWN};

}  // namespace

void write_adapter(const std::string& dir, const kt_ckpt_adapter_config& c, const kt_ckpt_layer_args* layers,
                   size_t num_layers, const char* where) {
  const std::string w = where;
  KT_CHECK(num_layers == 0 || layers != nullptr, KT_ERR_NULL_POINTER, w + ": layers is NULL");
  KT_CHECK(c.rank >= 1 && c.rank <= 1024, KT_ERR_INVALID_ARGUMENT,
           w + ": config->rank must be in [1, 1024]");
  KT_CHECK(std::isfinite(c.alpha), KT_ERR_INVALID_ARGUMENT, w + ": config->alpha must be finite");
  KT_CHECK(c.use_rslora == 0 || c.use_rslora == 1, KT_ERR_INVALID_ARGUMENT,
           w + ": config->use_rslora must be 0 or 1");
  KT_CHECK(c.targets != 0 && (c.targets & ~KT_PROJ_ALL) == 0, KT_ERR_INVALID_ARGUMENT,
           w + ": config->targets must be a non-empty set of KT_PROJ_* bits");
  check_naming(c.layout, where, "config->layout");
  const kt_ckpt_dtype dt = checked_store_dtype(c.dtype, false, where, "config->dtype");
  KT_CHECK(c.base_model == nullptr || valid_utf8(c.base_model), KT_ERR_INVALID_ARGUMENT,
           w + ": config->base_model is not valid UTF-8 text");
  const int64_t r = c.rank;
  std::vector<TensorToWrite> all;
  for (size_t li = 0; li < num_layers; ++li) {
    const kt_ckpt_layer_args& L = layers[li];
    const std::string lname = "layers[" + std::to_string(li) + "] (layer " + std::to_string(L.layer) + ")";
    KT_CHECK(L.layer >= 0, KT_ERR_INVALID_ARGUMENT, w + ": " + lname + ": layer must be >= 0");
    for (size_t lj = 0; lj < li; ++lj)
      KT_CHECK(layers[lj].layer != L.layer, KT_ERR_INVALID_ARGUMENT,
               w + ": layer " + std::to_string(L.layer) + " is given twice");
    auto views = collect(L, {KT_ARG_LORA_A_GATE, KT_ARG_LORA_B_GATE, KT_ARG_LORA_A_UP, KT_ARG_LORA_B_UP,
                             KT_ARG_LORA_A_DOWN, KT_ARG_LORA_B_DOWN},
                         {DType::kF32, DType::kBF16}, where, lname);
    int64_t E = -1, H = -1, I = -1;
    for (int p = 0; p < 3; ++p) {
      const View* a = find_arg(views, kLoraA[p]);
      const View* b = find_arg(views, kLoraB[p]);
      const bool targeted = (c.targets >> p) & 1u;
      KT_CHECK(targeted == (a != nullptr) && targeted == (b != nullptr), KT_ERR_INVALID_ARGUMENT,
               w + ": " + lname + ": LoRA A and B of " + kProjWord[p] +
                   " must be given exactly when " + kProjWord[p] + " is in config->targets");
      if (!targeted) continue;
      KT_CHECK(a->ndim == 3 && b->ndim == 3, KT_ERR_SHAPE,
               w + ": " + lname + ": LoRA tensors of " + kProjWord[p] +
                   " must be [E,r,in] and [E,out,r]");
      if (E < 0) E = a->shape[0];
      const int64_t in = a->shape[2], out = b->shape[1];
      need_shape(*a, {E, r, in}, where, lname + " LoRA A of " + kProjWord[p]);
      need_shape(*b, {E, out, r}, where, lname + " LoRA B of " + kProjWord[p]);
      const int64_t h = p == 2 ? out : in, i = p == 2 ? in : out;
      KT_CHECK((H < 0 || H == h) && (I < 0 || I == i), KT_ERR_SHAPE,
               w + ": " + lname + ": the shapes of " + arg_name(kLoraA[p]) + " " +
                   shape_string(*a) + " and " + arg_name(kLoraB[p]) + " " + shape_string(*b) +
                   " disagree with the other projections' H/I");
      H = h;
      I = i;
      const View av = *a, bv = *b;
      for (int64_t e = 0; e < E; ++e) {
        all.push_back(TensorToWrite{adapter_key(c.layout, L.layer, e, p, true), dt, {r, in},
                                    [av, e, dt](uint8_t* dst) { write_expert_slice(av, e, dt, dst); }});
        all.push_back(TensorToWrite{adapter_key(c.layout, L.layer, e, p, false), dt, {out, r},
                                    [bv, e, dt](uint8_t* dst) { write_expert_slice(bv, e, dt, dst); }});
      }
    }
  }
  const bool mixtral = c.layout == KT_CKPT_LAYOUT_MIXTRAL;
  std::string alternatives;
  for (int p = 0; p < 3; ++p)
    if ((c.targets >> p) & 1u) {
      static const char* kHf[3] = {"gate_proj", "up_proj", "down_proj"};
      static const char* kMx[3] = {"w1", "w3", "w2"};
      alternatives += (alternatives.empty() ? "" : "|") + std::string(mixtral ? kMx[p] : kHf[p]);
    }
  // A regex (PEFT full-matches it against module names) so the routed
  // experts are targeted, not the dense or shared MLPs of the same names.
  const std::string target = std::string(".*\\.") + (mixtral ? "block_sparse_moe" : "mlp") +
                             "\\.experts\\.\\d+\\.(" + alternatives + ")";
  json config = {{"peft_type", "LORA"},
                 {"task_type", "CAUSAL_LM"},
                 {"r", r},
                 {"lora_alpha", c.alpha},
                 {"use_rslora", c.use_rslora != 0},
                 {"target_modules", target},
                 {"base_model_name_or_path", c.base_model ? c.base_model : ""},
                 {"bias", "none"},
                 {"lora_dropout", 0.0},
                 {"fan_in_fan_out", false},
                 {"inference_mode", true},
                 {"modules_to_save", nullptr}};
  const std::string config_text = config.dump(2) + "\n";
  // The pair is published together: built next to dir, swapped in as a whole.
  StagedDir staged(dir, owned_with_temporaries([](const std::string& name) {
    return name == "adapter_model.safetensors" || name == "adapter_config.json";
  }));
  write_safetensors(staged.file("adapter_model.safetensors"), std::move(all), {{"format", "pt"}}, AtomicFile::kCreate);
  write_text(staged.file("adapter_config.json"), config_text, AtomicFile::kCreate);
  staged.publish();
}

void read_adapter_config(const std::string& dir, kt_ckpt_adapter_config* out) {
  // The config and the tensors from one version of the directory.
  *out = read_consistent(dir, [&](std::shared_ptr<const DirHandle> d) {
    const std::string path = d->label("adapter_config.json");
    json j = json::parse(read_text_file(*d, "adapter_config.json"), nullptr, false);
    if (j.is_discarded() || !j.is_object()) fail(KT_ERR_IO, path + ": not a JSON object");
    if (!j.contains("peft_type") || j["peft_type"] != "LORA") fail(KT_ERR_IO, path + ": peft_type is not \"LORA\"");
    if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int64_t>() < 1 || j["r"].get<int64_t>() > 1024)
      fail(KT_ERR_IO, path + ": r missing or not an integer in [1, 1024]");
    if (!j.contains("lora_alpha") || !j["lora_alpha"].is_number())
      fail(KT_ERR_IO, path + ": lora_alpha missing or not a number");
    std::string targets;
    if (j.contains("target_modules") && j["target_modules"].is_string()) {
      targets = j["target_modules"].get<std::string>();
    } else if (j.contains("target_modules") && j["target_modules"].is_array()) {
      for (const auto& t : j["target_modules"])
        if (t.is_string()) targets += t.get<std::string>() + " ";
    } else {
      fail(KT_ERR_IO, path + ": target_modules missing");
    }
    kt_ckpt_adapter_config c = defaults_of<kt_ckpt_adapter_config>(set_adapter_config_defaults);
    c.rank = j["r"].get<int64_t>();
    c.alpha = j["lora_alpha"].get<float>();
    c.use_rslora = j.contains("use_rslora") && j["use_rslora"].is_boolean() && j["use_rslora"].get<bool>();
    const bool mixtral = targets.find("w1") != std::string::npos || targets.find("w2") != std::string::npos ||
                         targets.find("w3") != std::string::npos;
    c.layout = mixtral ? KT_CKPT_LAYOUT_MIXTRAL : KT_CKPT_LAYOUT_PER_EXPERT;
    static const char* kHf[3] = {"gate_proj", "up_proj", "down_proj"};
    static const char* kMx[3] = {"w1", "w3", "w2"};
    c.targets = 0;
    for (int p = 0; p < 3; ++p)
      if (targets.find(mixtral ? kMx[p] : kHf[p]) != std::string::npos) c.targets |= 1u << p;
    if (c.targets == 0) fail(KT_ERR_IO, path + ": target_modules names no expert projection");
    TensorSet ts(d);
    c.dtype = KT_CKPT_DTYPE_F32;
    for (const auto& kv : ts.tensors())
      if (kv.first.find(".lora_A.") != std::string::npos) {
        c.dtype = kv.second.entry->dtype;
        break;
      }
    c.base_model = nullptr;
    return c;
  });
}

void read_adapter(const std::string& dir, int64_t layer, const kt_arg* args, size_t num_args, const char* where) {
  const std::string w = where;
  KT_CHECK(num_args == 0 || args != nullptr, KT_ERR_NULL_POINTER, w + ": args is NULL");
  KT_CHECK(layer >= 0, KT_ERR_INVALID_ARGUMENT, w + ": layer must be >= 0");
  kt_ckpt_layer_args L{layer, args, num_args};
  const auto views = collect(L, {KT_ARG_LORA_A_GATE, KT_ARG_LORA_B_GATE, KT_ARG_LORA_A_UP, KT_ARG_LORA_B_UP,
                                 KT_ARG_LORA_A_DOWN, KT_ARG_LORA_B_DOWN},
                             {DType::kF32, DType::kBF16}, where, "layer " + std::to_string(layer));
  read_consistent(dir, [&](std::shared_ptr<const DirHandle> d) {
    TensorSet ts(d);
    // The key naming is the one whose expert 0 exists.
    kt_ckpt_layout naming = KT_CKPT_LAYOUT_PER_EXPERT;
    bool found = false;
    for (kt_ckpt_layout l : {KT_CKPT_LAYOUT_PER_EXPERT, KT_CKPT_LAYOUT_MIXTRAL})
      for (int p = 0; p < 3 && !found; ++p)
        if (ts.find(adapter_key(l, layer, 0, p, true))) {
          naming = l;
          found = true;
        }
    // Messages name the one file, or the directory of an indexed adapter.
    const std::string file = ts.files().size() == 1 ? ts.files().front()->path() : ts.dir();
    if (!found)
      fail(KT_ERR_INVALID_ARGUMENT, w + ": " + file + " holds no LoRA tensors of layer " + std::to_string(layer));
    struct Copy {
      const TensorRef* src;
      View dst;
      int64_t e;
    };
    std::vector<Copy> copies;
    for (const auto& kv : views) {
      int p = -1;
      bool a = false;
      for (int q = 0; q < 3; ++q) {
        if (kv.first == kLoraA[q]) p = q, a = true;
        if (kv.first == kLoraB[q]) p = q;
      }
      const View& v = kv.second;
      KT_CHECK(v.ndim == 3, KT_ERR_SHAPE,
               w + ": LoRA " + (a ? "A" : "B") + " of " + kProjWord[p] + " must be rank 3");
      for (int64_t e = 0; e < v.shape[0]; ++e) {
        const std::string key = adapter_key(naming, layer, e, p, a);
        const TensorRef* t = ts.find(key);
        // Expert 0 of a projection missing: the adapter does not target it;
        // a later expert missing: the destination has more experts than it.
        if (!t && e == 0)
          fail(KT_ERR_INVALID_ARGUMENT, w + ": " + file + ": tensor '" + key + "' is missing (layer " +
                                            std::to_string(layer) + " has no LoRA " + (a ? "A" : "B") + " of " +
                                            kProjWord[p] + ")");
        if (!t)
          fail(KT_ERR_SHAPE, w + ": " + file + ": tensor '" + key + "' is missing: the destination holds " +
                                 std::to_string(v.shape[0]) + " experts, the adapter " + std::to_string(e));
        const auto& s = t->entry->shape;
        const bool float_dt = t->entry->dtype == KT_CKPT_DTYPE_F32 || t->entry->dtype == KT_CKPT_DTYPE_BF16 ||
                              t->entry->dtype == KT_CKPT_DTYPE_F16;
        const std::string stored = std::string(dtype_name(t->entry->dtype)) + " [" +
                                   (s.size() == 2 ? std::to_string(s[0]) + "," + std::to_string(s[1])
                                                  : "rank " + std::to_string(s.size())) +
                                   "]";
        if (!float_dt || s.size() != 2)
          fail(KT_ERR_IO, w + ": " + file + ": tensor '" + key + "' is " + stored + ", not a float matrix");
        if (s[0] != v.shape[1] || s[1] != v.shape[2])
          fail(KT_ERR_SHAPE, w + ": " + file + ": tensor '" + key + "' is " + stored +
                                 ", the destination wants [" + std::to_string(v.shape[1]) + "," +
                                 std::to_string(v.shape[2]) + "]");
        copies.push_back(Copy{t, v, e});
      }
    }
    for (const Copy& c : copies) read_expert_slice(c.src->data, c.src->entry->dtype, c.dst, c.e);
    return 0;
  });
}

void set_adapter_config_defaults(kt_ckpt_adapter_config& c) {
  c.rank = 16;
  c.alpha = 32.f;
  c.use_rslora = 0;
  c.targets = KT_PROJ_ALL;
  c.layout = KT_CKPT_LAYOUT_PER_EXPERT;
  c.dtype = KT_CKPT_DTYPE_F32;
  c.base_model = nullptr;
}

}  // namespace io
}  // namespace kt
