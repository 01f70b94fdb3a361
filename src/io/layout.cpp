#include "io/layout.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <mutex>

#include <nlohmann/json.hpp>

#include "core/buffer.h"
#include "core/checked.h"
#include "core/error.h"
#include "core/tensor.h"
#include "core/sized_struct.h"
#include "formats/formats.h"
#include "io/elements.h"
#include "io/names.h"
#include "moe/args.h"
#include "moe/moe_layer.h"
#include "runtime/engine.h"

namespace kt {
namespace io {

using nlohmann::json;

namespace {

[[noreturn]] void io_fail(const std::string& message) { fail(KT_ERR_IO, message); }

// extent * factor for a logical extent derived from a stored one (packed
// elements, interleaved rows). Headers allow any extent on a zero-byte
// tensor, so the product is checked.
int64_t scaled_extent(int64_t extent, int64_t factor, const TensorRef& t) {
  int64_t out = 0;
  if (!mul_fits(extent, factor, &out))
    io_fail(t.file->path() + ": tensor '" + t.entry->name + "': extent " + std::to_string(extent) +
            " times " + std::to_string(factor) + " overflows a 64-bit count");
  return out;
}

bool is_float_dtype(kt_ckpt_dtype d) {
  return d == KT_CKPT_DTYPE_BF16 || d == KT_CKPT_DTYPE_F16 || d == KT_CKPT_DTYPE_F32;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}

// Reads decimal digits at s[pos...] up to the next '.'; false when absent.
bool read_index(const std::string& s, size_t* pos, int64_t* value) {
  size_t p = *pos;
  int64_t v = 0;
  const size_t start = p;
  while (p < s.size() && s[p] >= '0' && s[p] <= '9' && p - start < 9) v = v * 10 + (s[p++] - '0');
  if (p == start || p >= s.size() || s[p] != '.') return false;
  *pos = p + 1;
  *value = v;
  return true;
}

bool starts_with(const std::string& s, size_t pos, const char* prefix) {
  return s.compare(pos, std::strlen(prefix), prefix) == 0;
}

// A name split as <prefix>layers.<L>.<rest>.
struct LayerName {
  std::string before;  // "model."
  int64_t layer = 0;
  std::string rest;    // "mlp.experts.3.gate_proj.weight"
};

bool split_layer_name(const std::string& name, LayerName* out) {
  size_t at = 0;
  while ((at = name.find("layers.", at)) != std::string::npos) {
    if (at == 0 || name[at - 1] == '.') {
      size_t p = at + 7;
      int64_t L = 0;
      if (read_index(name, &p, &L)) {
        out->before = name.substr(0, at);
        out->layer = L;
        out->rest = name.substr(p);
        return true;
      }
    }
    at += 7;
  }
  return false;
}

int proj_of(const std::string& p, bool mixtral) {
  if (mixtral) return p == "w1" ? kProjGate : p == "w3" ? kProjUp : p == "w2" ? kProjDown : -1;
  return p == "gate_proj" ? kProjGate : p == "up_proj" ? kProjUp : p == "down_proj" ? kProjDown : -1;
}

const char* kProjNames[3] = {"gate_proj", "up_proj", "down_proj"};
const char* kMixtralNames[3] = {"w1", "w3", "w2"};
// The expert tensors kt recognises, as messages name them.
const char* const kExpertNames =
    "kt's expert tensors (mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight, "
    "block_sparse_moe.experts.{e}.{w1,w3,w2}.weight or ffn.experts.{e}.{w1,w3,w2}.weight, their quantized parts, "
    "or the fused mlp.experts.gate_up_proj and mlp.experts.down_proj)";

struct Collected {
  std::string base;  // "model.layers.3.mlp.experts"
  kt_ckpt_layout layout = KT_CKPT_LAYOUT_NONE;
  // per-expert: expert -> proj -> suffix -> tensor
  std::map<int64_t, std::array<std::map<std::string, const TensorRef*>, 3>> experts;
  std::map<std::string, const TensorRef*> fused;  // "gate_up_proj", "down_proj_bias", ...
  std::vector<const NamedTensor*> claimed;         // all of the above, in name order
  std::string seen;  // the first tensor under the layer's experts, recognised or not
};

int64_t config_int(const json& c, std::initializer_list<const char*> keys) {
  for (const char* k : keys) {
    if (c.contains(k) && c[k].is_number_integer()) return c[k].get<int64_t>();
    if (c.contains("text_config") && c["text_config"].is_object() && c["text_config"].contains(k) &&
        c["text_config"][k].is_number_integer())
      return c["text_config"][k].get<int64_t>();
  }
  return -1;
}

// An integer read from a small tensor (weight_shape): I32 or I64 element i.
int64_t small_int(const TensorRef& t, int64_t i) {
  if (t.entry->dtype == KT_CKPT_DTYPE_I32) {
    int32_t v;
    std::memcpy(&v, t.data + i * 4, 4);
    return v;
  }
  int64_t v;
  std::memcpy(&v, t.data + i * 8, 8);
  return v;
}

// Logical [out, in] of a per-expert projection and its format.
// values_per_word: int4 values per int32 of weight_packed (8; 32/num_bits
// of quantization_config).
void describe_proj(const std::map<std::string, const TensorRef*>& parts, const std::string& base,
                   int64_t values_per_word, ProjTensors* pt, kt_ckpt_format* format, int64_t* out, int64_t* in) {
  auto get = [&](const char* s) -> const TensorRef* {
    auto it = parts.find(s);
    return it == parts.end() ? nullptr : it->second;
  };
  const std::string where = "tensor '" + base;
  if (const TensorRef* packed = get("weight_packed")) {
    const TensorEntry& t = *packed->entry;
    if (t.dtype != KT_CKPT_DTYPE_I32 || t.shape.size() != 2)
      io_fail(packed->file->path() + ": " + where + ".weight_packed': expected int32 [out, in/8], got " +
              st_dtype_info(t.dtype).st_name + " " + shape_text(t.shape));
    pt->weight = packed;
    pt->scale = get("weight_scale");
    pt->zero = get("weight_zero_point");
    if (!pt->scale) io_fail(packed->file->path() + ": " + where + ".weight_scale' is missing");
    *format = KT_CKPT_FORMAT_INT4_GROUP;
    *out = t.shape[0];
    *in = scaled_extent(t.shape[1], values_per_word, *packed);
    if (const TensorRef* ws = get("weight_shape")) {
      const TensorEntry& st = *ws->entry;
      if ((st.dtype != KT_CKPT_DTYPE_I32 && st.dtype != KT_CKPT_DTYPE_I64) || st.shape != std::vector<int64_t>{2})
        io_fail(ws->file->path() + ": " + where + ".weight_shape': expected int32/int64 [2], got " +
                st_dtype_info(st.dtype).st_name + " " + shape_text(st.shape));
      const int64_t o = small_int(*ws, 0), i = small_int(*ws, 1);
      if (o != t.shape[0] || i < 1 || (i + values_per_word - 1) / values_per_word != t.shape[1])
        io_fail(packed->file->path() + ": " + where + ".weight_packed' is " + shape_text(t.shape) +
                " but weight_shape [" + std::to_string(o) + "," + std::to_string(i) + "] needs [" +
                std::to_string(o) + "," + std::to_string(i < 1 ? 0 : (i + values_per_word - 1) / values_per_word) +
                "] (" + std::to_string(values_per_word) + " values an int32)" +
                (o == t.shape[0] && i >= 1 && (i + values_per_word - 1) / values_per_word > t.shape[1]
                     ? ": too short"
                     : ""));
      *in = i;
    }
  } else if (const TensorRef* w = get("weight")) {
    const TensorEntry& t = *w->entry;
    if (t.shape.size() != 2)
      io_fail(w->file->path() + ": " + where + ".weight': expected rank 2, got " + shape_text(t.shape));
    pt->weight = w;
    *out = t.shape[0];
    *in = t.shape[1];
    if (is_float_dtype(t.dtype)) {
      *format = KT_CKPT_FORMAT_DENSE;
    } else if (t.dtype == KT_CKPT_DTYPE_F8_E4M3 &&
               (get("weight_scale_inv") ||
                (get("weight_scale") && get("weight_scale")->entry->shape.size() == 2))) {
      // The multiplier of each block: DeepSeek names it weight_scale_inv,
      // compressed-tensors (float-quantized) weight_scale; a scale of rank
      // 0 or 1 (per tensor) is not a block grid: "other".
      pt->scale = get("weight_scale_inv") ? get("weight_scale_inv") : get("weight_scale");
      *format = KT_CKPT_FORMAT_FP8_BLOCK;
    } else if ((t.dtype == KT_CKPT_DTYPE_U8 || t.dtype == KT_CKPT_DTYPE_I8) && get("scale")) {
      pt->scale = get("scale");
      *format = KT_CKPT_FORMAT_MXFP4;
      *in = scaled_extent(t.shape[1], 2, *w);
    } else {
      // Described (stored extents), never loaded: e.g. per-tensor fp8 or nvfp4.
      *format = KT_CKPT_FORMAT_OTHER;
    }
  } else {
    io_fail("tensor '" + base + ".weight' is missing");
  }
  pt->bias = get("bias");
}

MoeLayer build_per_expert(int64_t L, const Collected& c, int64_t values_per_word) {
  MoeLayer m;
  m.layer = L;
  m.prefix = c.base;
  m.layout = c.layout;
  const bool mixtral = c.layout == KT_CKPT_LAYOUT_MIXTRAL;
  const char** names = mixtral ? kMixtralNames : kProjNames;
  m.E = static_cast<int64_t>(c.experts.size());
  int64_t expect = 0;
  for (const auto& kv : c.experts) {
    if (kv.first != expect)
      io_fail("layer " + std::to_string(L) + ": expert " + std::to_string(expect) +
              " is missing ('" + c.base + "." + std::to_string(expect) + "." + names[0] +
              ".weight' not found; experts run to " + std::to_string(c.experts.rbegin()->first) + ")");
    ++expect;
  }
  m.experts.resize(static_cast<size_t>(m.E));
  bool first = true;
  for (int64_t e = 0; e < m.E; ++e) {
    for (int p = 0; p < 3; ++p) {
      const std::string base = c.base + "." + std::to_string(e) + "." + names[p];
      const auto& parts = c.experts.at(e)[static_cast<size_t>(p)];
      if (parts.empty()) io_fail("tensor '" + base + ".weight' is missing");
      ProjTensors& pt = m.experts[static_cast<size_t>(e)][static_cast<size_t>(p)];
      kt_ckpt_format format;
      int64_t out = 0, in = 0;
      describe_proj(parts, base, values_per_word, &pt, &format, &out, &in);
      const std::string file = pt.weight->file->path();
      if (first) {
        m.format = format;
        m.weight_dtype = pt.weight->entry->dtype;
        m.has_bias = pt.bias != nullptr;
        if (p == kProjGate) {
          m.I = out;
          m.H = in;
        }
        first = false;
      }
      if (format != m.format || pt.weight->entry->dtype != m.weight_dtype)
        io_fail(file + ": tensor '" + pt.weight->entry->name + "': format " + format_name(format) +
                " " + dtype_name(pt.weight->entry->dtype) + " differs from the layer's " +
                format_name(m.format) + " " + dtype_name(m.weight_dtype));
      const int64_t want_out = p == kProjDown ? m.H : m.I, want_in = p == kProjDown ? m.I : m.H;
      // Packed extents of an unknown format need not transpose between projections.
      const bool known = m.format != KT_CKPT_FORMAT_OTHER;
      if (known && (out != want_out || in != want_in))
        io_fail(file + ": tensor '" + pt.weight->entry->name + "': logical shape [" + std::to_string(out) +
                "," + std::to_string(in) + "] does not match the layer's [" + std::to_string(want_out) +
                "," + std::to_string(want_in) + "] (H=" + std::to_string(m.H) + ", I=" +
                std::to_string(m.I) + " from expert 0's " + names[0] + ")");
      if ((pt.bias != nullptr) != m.has_bias)
        io_fail("tensor '" + base + ".bias' is " + (m.has_bias ? "missing" : "present") +
                " while expert 0's gate " + (m.has_bias ? "has one" : "has none"));
      if (pt.bias) {
        const TensorEntry& b = *pt.bias->entry;
        if (!is_float_dtype(b.dtype) || b.shape != std::vector<int64_t>{want_out})
          io_fail(pt.bias->file->path() + ": tensor '" + b.name + "': expected a float [" +
                  std::to_string(want_out) + "] bias, got " + dtype_name(b.dtype) + " " +
                  shape_text(b.shape));
      }
      if ((pt.zero != nullptr) != m.asymmetric && !(e == 0 && p == 0))
        io_fail("tensor '" + base + ".weight_zero_point' is " + (m.asymmetric ? "missing" : "present") +
                " while expert 0's " + names[0] + (m.asymmetric ? " has one" : " has none") +
                ": one layer mixes symmetric and asymmetric int4");
      if (e == 0 && p == 0) m.asymmetric = pt.zero != nullptr;
      for (const auto& kv : parts) m.bytes += static_cast<int64_t>(kv.second->entry->nbytes());
    }
  }
  return m;
}

MoeLayer build_fused(int64_t L, const Collected& c, bool gpt_oss_model) {
  MoeLayer m;
  m.layer = L;
  m.prefix = c.base;
  auto get = [&](const char* s) -> const TensorRef* {
    auto it = c.fused.find(s);
    return it == c.fused.end() ? nullptr : it->second;
  };
  auto need = [&](const char* s) -> const TensorRef* {
    const TensorRef* t = get(s);
    if (!t) io_fail("tensor '" + c.base + "." + s + "' is missing (layer " + std::to_string(L) + ")");
    return t;
  };
  auto bad = [&](const TensorRef* t, const std::string& expected) {
    io_fail(t->file->path() + ": tensor '" + t->entry->name + "': expected " + expected + ", got " +
            dtype_name(t->entry->dtype) + " " + shape_text(t->entry->shape));
  };
  for (const auto& kv : c.fused) m.bytes += static_cast<int64_t>(kv.second->entry->nbytes());
  m.gate_up_bias = get("gate_up_proj_bias");
  m.down_bias = get("down_proj_bias");
  m.has_bias = m.gate_up_bias || m.down_bias;
  const bool gpt_oss = gpt_oss_model || m.has_bias || get("gate_up_proj_blocks");
  if (get("gate_up_proj_blocks")) {
    // MXFP4: blocks [E, out, in/32, 16] u8, scales [E, out, in/32] e8m0 (out x in).
    const TensorRef* gb = need("gate_up_proj_blocks");
    const TensorRef* db = need("down_proj_blocks");
    m.gate_up = gb;
    m.down = db;
    m.gate_up_scales = need("gate_up_proj_scales");
    m.down_scales = need("down_proj_scales");
    const auto& gs = gb->entry->shape;
    const auto& ds = db->entry->shape;
    if (gs.size() != 4 || gs[3] != 16 || gb->entry->dtype != KT_CKPT_DTYPE_U8) bad(gb, "U8 [E, 2I, H/32, 16]");
    if (ds.size() != 4 || ds[3] != 16 || db->entry->dtype != KT_CKPT_DTYPE_U8) bad(db, "U8 [E, H, I/32, 16]");
    m.layout = KT_CKPT_LAYOUT_GPT_OSS;
    m.format = KT_CKPT_FORMAT_MXFP4;
    m.weight_dtype = KT_CKPT_DTYPE_U8;
    m.E = gs[0];
    m.I = gs[1] / 2;
    m.H = scaled_extent(gs[2], 32, *gb);
    if (gs[1] % 2 != 0 || ds[0] != m.E || ds[1] != m.H || scaled_extent(ds[2], 32, *db) != m.I)
      bad(db, "U8 [" + std::to_string(m.E) + ", " + std::to_string(m.H) + ", " +
                  std::to_string(m.I / 32) + ", 16] to match " + gb->entry->name);
    // e8m0 scales, one per 32 inputs: [E, out, in/32] beside the blocks.
    auto check_scales = [&](const TensorRef* sc, const TensorRef* blocks) {
      const auto& bs = blocks->entry->shape;
      const std::vector<int64_t> want{bs[0], bs[1], bs[2]};
      const kt_ckpt_dtype dt = sc->entry->dtype;
      if ((dt != KT_CKPT_DTYPE_U8 && dt != KT_CKPT_DTYPE_E8M0) || sc->entry->shape != want)
        bad(sc, "U8/E8M0 (e8m0 scales) " + shape_text(want) + " to match " + blocks->entry->name);
    };
    check_scales(m.gate_up_scales, gb);
    check_scales(m.down_scales, db);
  } else {
    m.gate_up = need("gate_up_proj");
    m.down = need("down_proj");
    const auto& g = m.gate_up->entry->shape;
    const auto& d = m.down->entry->shape;
    if (g.size() != 3 || !is_float_dtype(m.gate_up->entry->dtype)) bad(m.gate_up, "a float [E, 2I, H] or [E, H, 2I] tensor");
    if (d.size() != 3 || !is_float_dtype(m.down->entry->dtype)) bad(m.down, "a float [E, H, I] or [E, I, H] tensor");
    m.format = KT_CKPT_FORMAT_DENSE;
    m.weight_dtype = m.gate_up->entry->dtype;
    m.E = g[0];
    // g[k] == 2 * d[j], without computing 2 * d[j] (any extent passes the
    // header check of a zero-byte tensor).
    auto twice = [](int64_t gv, int64_t dv) { return gv % 2 == 0 && gv / 2 == dv; };
    const bool out_in = twice(g[1], d[2]) && g[2] == d[1];
    const bool in_out = twice(g[2], d[1]) && g[1] == d[2];
    if (d[0] != m.E || (!out_in && !in_out) || (gpt_oss && !in_out))
      bad(m.down, std::string(gpt_oss ? "" : "[E, H, I] with gate_up_proj [E, 2I, H], or ") +
                      "[E, I, H] with gate_up_proj [E, H, 2I]; gate_up_proj is " + shape_text(g));
    if (in_out) {
      m.H = g[1];
      m.I = g[2] / 2;
    } else {
      m.I = g[1] / 2;
      m.H = g[2];
    }
    m.layout = gpt_oss ? KT_CKPT_LAYOUT_GPT_OSS : in_out ? KT_CKPT_LAYOUT_FUSED_IN_OUT : KT_CKPT_LAYOUT_FUSED;
  }
  if (m.has_bias) {
    const TensorRef* gb = need("gate_up_proj_bias");
    const TensorRef* db = need("down_proj_bias");
    if (!is_float_dtype(gb->entry->dtype) || gb->entry->shape != std::vector<int64_t>{m.E, 2 * m.I})
      bad(gb, "a float [" + std::to_string(m.E) + ", " + std::to_string(2 * m.I) + "] bias");
    if (!is_float_dtype(db->entry->dtype) || db->entry->shape != std::vector<int64_t>{m.E, m.H})
      bad(db, "a float [" + std::to_string(m.E) + ", " + std::to_string(m.H) + "] bias");
  }
  return m;
}

// config.json's quantization_config (top level, or under text_config):
// what the checkpoint says its quantized tensors are.
struct QuantConfig {
  const json* q = nullptr;  // the object, or nullptr when absent
  std::string path;         // "<dir>/config.json: quantization_config"
  std::string method;       // quant_method
  // compressed-tensors: the weights of the config group for the experts.
  const json* weights = nullptr;
  std::string ct_format;  // "pack-quantized", ...
};

std::string json_text(const json& j) { return j.dump(); }

QuantConfig read_quant_config(const json& config, const std::string& config_path) {
  QuantConfig qc;
  qc.path = config_path + ": quantization_config";
  const json* q = nullptr;
  if (config.contains("quantization_config")) q = &config["quantization_config"];
  else if (config.contains("text_config") && config["text_config"].is_object() &&
           config["text_config"].contains("quantization_config"))
    q = &config["text_config"]["quantization_config"];
  if (!q || q->is_null()) return qc;
  if (!q->is_object()) io_fail(qc.path + " is not a JSON object");
  qc.q = q;
  if (q->contains("quant_method") && (*q)["quant_method"].is_string())
    qc.method = (*q)["quant_method"].get<std::string>();
  if (q->contains("format") && (*q)["format"].is_string()) qc.ct_format = (*q)["format"].get<std::string>();
  if (qc.method == "compressed-tensors" && q->contains("config_groups") && (*q)["config_groups"].is_object()) {
    // The group that quantizes the experts: one whose targets name Linear
    // layers or experts, else the first with weights.
    for (const auto& g : (*q)["config_groups"].items()) {
      const json& grp = g.value();
      if (!grp.is_object() || !grp.contains("weights") || !grp["weights"].is_object()) continue;
      bool targets_experts = false;
      if (grp.contains("targets") && grp["targets"].is_array())
        for (const auto& t : grp["targets"])
          if (t.is_string() && (t.get<std::string>() == "Linear" || t.get<std::string>().find("expert") != std::string::npos))
            targets_experts = true;
      if (!qc.weights || targets_experts) {
        qc.weights = &grp["weights"];
        if (grp.contains("format") && grp["format"].is_string()) qc.ct_format = grp["format"].get<std::string>();
        if (targets_experts) break;
      }
    }
  }
  return qc;
}

// int4 values per int32 word of weight_packed, from the config (8 when it
// does not say).
int64_t packed_values_per_word(const QuantConfig& qc) {
  if (qc.weights && qc.weights->contains("num_bits") && (*qc.weights)["num_bits"].is_number_integer()) {
    const int64_t bits = (*qc.weights)["num_bits"].get<int64_t>();
    if (bits >= 1 && bits <= 32 && 32 % bits == 0) return 32 / bits;
  }
  return 8;
}

// One projection's scale (and zero-point) tensors checked against the
// weight and the group: [ceil(out / row_div), ceil(in / group)].
void check_scale_tensor(const TensorRef* sc, const std::string& what, int64_t rows, int64_t cols,
                        std::initializer_list<kt_ckpt_dtype> dtypes, const char* dtype_text, const std::string& why) {
  const TensorEntry& t = *sc->entry;
  const std::vector<int64_t> want{rows, cols};
  const bool dtype_ok = std::find(dtypes.begin(), dtypes.end(), t.dtype) != dtypes.end();
  if (!dtype_ok || t.shape != want)
    io_fail(sc->file->path() + ": tensor '" + t.name + "' (" + what + "): expected " + dtype_text + " " +
            shape_text(want) + why + ", got " + dtype_name(t.dtype) + " " + shape_text(t.shape));
}

int64_t ceil_div64(int64_t a, int64_t b) { return a / b + (a % b != 0); }

// What the checks of one quantized layer share: the layer, its config, the
// layer's name in messages.
struct LayerCheck {
  MoeLayer& m;
  const QuantConfig& qc;
  std::string layer;

  LayerCheck(MoeLayer& layer_in, const QuantConfig& config)
      : m(layer_in), qc(config), layer("layer " + std::to_string(layer_in.layer) + " ('" + layer_in.prefix + "')") {}
  // A config's quant_method that contradicts what the layer holds fails the open.
  void method_must_be(const char* want, const std::string& found) const {
    if (qc.q && qc.method != want)
      io_fail(qc.path + ".quant_method is '" + qc.method + "' but " + layer + " holds " + found +
              " (quant_method '" + want + "')");
  }
  // f(projection's tensors, out, in) for every expert's three projections.
  void per_expert(const std::function<void(const ProjTensors&, int64_t out, int64_t in)>& f) const {
    for (const auto& ex : m.experts)
      for (int p = 0; p < 3; ++p) f(ex[static_cast<size_t>(p)], p == kProjDown ? m.H : m.I, p == kProjDown ? m.I : m.H);
  }
};

const std::initializer_list<kt_ckpt_dtype> kFloatScales = {KT_CKPT_DTYPE_F32, KT_CKPT_DTYPE_BF16, KT_CKPT_DTYPE_F16};

// The fp8 blocks of compressed-tensors float-quantized weights: the
// weights of the experts' config group say them; anything but e4m3 in
// symmetric 128 x 128 blocks is described (m.unsupported), not loaded.
// False when the config gives no block sizes to check the scales against.
bool fp8_blocks_of_compressed_tensors(const LayerCheck& k, int64_t* b0, int64_t* b1, std::string* from) {
  MoeLayer& m = k.m;
  const QuantConfig& qc = k.qc;
  if (!qc.ct_format.empty() && qc.ct_format != "float-quantized")
    io_fail(qc.path + ": format is '" + qc.ct_format + "' but " + k.layer +
            " holds F8_E4M3 weights with weight_scale (format 'float-quantized')");
  const json* w = qc.weights;
  auto is = [&](const char* key, const json& want) { return w && w->contains(key) && (*w)[key] == want; };
  if (!w || !is("num_bits", 8) || !is("type", "float") || !is("strategy", "block") ||
      (w->contains("symmetric") && !is("symmetric", true))) {
    m.unsupported = "config_groups weights are " + (w ? json_text(*w) : std::string("absent")) +
                    ": kt holds fp8 (num_bits 8, type float) in symmetric blocks (strategy block)";
    return false;
  }
  const json* bs = w->contains("block_structure") ? &(*w)["block_structure"] : nullptr;
  const bool sizes = bs && bs->is_array() && bs->size() == 2 && (*bs)[0].is_number_integer() &&
                     (*bs)[1].is_number_integer() && (*bs)[0].get<int64_t>() >= 1 && (*bs)[1].get<int64_t>() >= 1;
  if (!sizes || (*bs)[0].get<int64_t>() != 128 || (*bs)[1].get<int64_t>() != 128)
    m.unsupported = "config_groups weights block_structure is " + (bs ? json_text(*bs) : std::string("absent")) +
                    ": kt holds fp8 in 128 x 128 blocks (fp8_b128)";
  if (!sizes) return false;
  *b0 = (*bs)[0].get<int64_t>();
  *b1 = (*bs)[1].get<int64_t>();
  *from = " (block_structure " + json_text(*bs) + ")";
  return true;
}

// The fp8 blocks of DeepSeek's config (quant_method fp8): fmt e4m3,
// weight_block_size, activation_scheme; what kt does not hold is described.
void fp8_blocks_of_deepseek(const LayerCheck& k, int64_t* b0, int64_t* b1, std::string* from) {
  MoeLayer& m = k.m;
  const json& q = *k.qc.q;
  if (q.contains("fmt") && !(q["fmt"].is_string() && q["fmt"].get<std::string>() == "e4m3"))
    io_fail(k.qc.path + ".fmt is " + json_text(q["fmt"]) + " but " + k.layer + " holds F8_E4M3 weights");
  if (!q.contains("weight_block_size") || !q["weight_block_size"].is_array() ||
      q["weight_block_size"].size() != 2 || !q["weight_block_size"][0].is_number_integer() ||
      !q["weight_block_size"][1].is_number_integer() || q["weight_block_size"][0].get<int64_t>() < 1 ||
      q["weight_block_size"][1].get<int64_t>() < 1) {
    m.unsupported = "quantization_config.weight_block_size is " +
                    (q.contains("weight_block_size") ? json_text(q["weight_block_size"]) : std::string("absent")) +
                    ": kt holds fp8 in 128 x 128 blocks";
  } else {
    *b0 = q["weight_block_size"][0].get<int64_t>();
    *b1 = q["weight_block_size"][1].get<int64_t>();
    *from = " (weight_block_size " + json_text(q["weight_block_size"]) + ")";
    if (*b0 != 128 || *b1 != 128)
      m.unsupported = "quantization_config.weight_block_size is " + json_text(q["weight_block_size"]) +
                      ": kt holds fp8 in 128 x 128 blocks (fp8_b128)";
  }
  if (q.contains("activation_scheme")) {
    const json& a = q["activation_scheme"];
    if (!a.is_string() || (a.get<std::string>() != "dynamic" && a.get<std::string>() != "static"))
      m.unsupported = "quantization_config.activation_scheme is " + json_text(a) + " (kt knows 'dynamic' and 'static')";
  }
}

// F8_E4M3 weights: weight_scale_inv is DeepSeek's fp8 (quant_method fp8);
// weight_scale compressed-tensors' float-quantized, whose config says the
// blocks.
void check_fp8_layer(const LayerCheck& k) {
  MoeLayer& m = k.m;
  const std::string& scale_name = m.experts[0][kProjGate].scale->entry->name;
  const bool ct = scale_name.size() < 4 || scale_name.compare(scale_name.size() - 4, 4, "_inv") != 0;
  if (!ct) k.method_must_be("fp8", "F8_E4M3 weights with weight_scale_inv (fp8 blocks)");
  if (ct && !k.qc.q) {
    m.unsupported = "F8_E4M3 weights with weight_scale and no quantization_config: kt reads fp8 blocks that "
                    "a config says (compressed-tensors float-quantized, or DeepSeek's weight_scale_inv)";
    return;
  }
  if (ct) k.method_must_be("compressed-tensors", "F8_E4M3 weights with weight_scale (float-quantized)");
  int64_t b0 = 128, b1 = 128;
  std::string from = " (blocks of 128 x 128: config.json has no quantization_config)";
  if (ct) {
    if (!fp8_blocks_of_compressed_tensors(k, &b0, &b1, &from)) return;
  } else if (k.qc.q) {
    fp8_blocks_of_deepseek(k, &b0, &b1, &from);
  }
  k.per_expert([&](const ProjTensors& pt, int64_t out, int64_t in) {
    check_scale_tensor(pt.scale, "fp8 block scales", ceil_div64(out, b0), ceil_div64(in, b1), kFloatScales, "float",
                       from + " for weight " + shape_text(pt.weight->entry->shape));
  });
  m.group = b1;
  m.block_rows = b0;
  m.decodable = true;
  m.native_format = KT_FORMAT_FP8_B128;
}

// The group of compressed-tensors pack-quantized int4 weights from the
// config group's weights (0 when it names none), and what kt does not hold
// described; a config contradicting the tensors fails the open.
int64_t int4_group_of_config(const LayerCheck& k, std::string* from) {
  MoeLayer& m = k.m;
  const QuantConfig& qc = k.qc;
  const json& w = *qc.weights;
  auto field = [&](const char* key) { return w.contains(key) ? json_text(w[key]) : std::string("absent"); };
  if (!qc.ct_format.empty() && qc.ct_format != "pack-quantized")
    io_fail(qc.path + ": format is '" + qc.ct_format + "' but " + k.layer +
            " holds weight_packed tensors (format 'pack-quantized')");
  if (w.contains("num_bits") && !(w["num_bits"].is_number_integer() && w["num_bits"].get<int64_t>() == 4))
    m.unsupported = "config_groups weights num_bits is " + field("num_bits") + ": kt holds 4-bit integers";
  else if (w.contains("type") && !(w["type"].is_string() && w["type"].get<std::string>() == "int"))
    m.unsupported = "config_groups weights type is " + field("type") + ": kt holds 'int'";
  else if (w.contains("strategy") && !(w["strategy"].is_string() && w["strategy"].get<std::string>() == "group"))
    m.unsupported = "config_groups weights strategy is " + field("strategy") + ": kt holds 'group'";
  int64_t group = 0;
  if (w.contains("group_size") && w["group_size"].is_number_integer() && w["group_size"].get<int64_t>() > 0) {
    group = w["group_size"].get<int64_t>();
    *from = " (config_groups group_size " + std::to_string(group) + ")";
  }
  if (w.contains("symmetric") && w["symmetric"].is_boolean()) {
    const bool sym = w["symmetric"].get<bool>();
    if (sym == m.asymmetric)
      io_fail(qc.path + ": config_groups weights symmetric is " + (sym ? "true" : "false") + " but " + k.layer +
              (m.asymmetric ? " has weight_zero_point tensors" : " has no weight_zero_point tensors"));
  }
  return group;
}

// compressed-tensors pack-quantized int4 in groups (with zero points when
// asymmetric).
void check_int4_layer(const LayerCheck& k) {
  MoeLayer& m = k.m;
  k.method_must_be("compressed-tensors", "int4 weight_packed tensors (compressed-tensors pack-quantized)");
  const ProjTensors& first = m.experts[0][kProjGate];
  std::string from;
  int64_t group = k.qc.weights ? int4_group_of_config(k, &from) : 0;
  if (group == 0) {
    // No config: the scale columns of expert 0's gate give the group.
    const auto& ss = first.scale->entry->shape;
    const int64_t cols = ss.size() == 2 ? ss[1] : 0;
    group = cols > 0 ? ceil_div64(m.H, cols) : 0;
    if (group < 1 || ceil_div64(m.H, group) != cols)
      io_fail(first.scale->file->path() + ": tensor '" + first.scale->entry->name + "' is " + shape_text(ss) +
              ": no group size gives " + std::to_string(cols) + " scales for " + std::to_string(m.H) + " inputs");
    from = " (group " + std::to_string(group) + " from expert 0's weight_scale)";
  }
  k.per_expert([&](const ProjTensors& pt, int64_t out, int64_t in) {
    check_scale_tensor(pt.scale, "int4 group scales", out, ceil_div64(in, group), kFloatScales, "float", from);
    if (pt.zero)
      check_scale_tensor(pt.zero, "int4 zero points, 8 rows an int32", ceil_div64(out, 8), ceil_div64(in, group),
                         {KT_CKPT_DTYPE_I32}, "I32", from);
  });
  m.group = group;
  // Any group of 4-bit integers decodes; other widths do not.
  m.decodable = m.unsupported.empty();
  // Zero points (asymmetric) are held as stored, in the _ZP formats.
  const WeightFormat* held = weight_format_holding(QuantCode::kInt, 4, group, m.asymmetric);
  if (m.unsupported.empty() && !held)
    m.unsupported = "int4 groups of " + std::to_string(group) + ": kt holds groups of " + held_groups(QuantCode::kInt, 4);
  m.native_format = (held ? held : weight_format_holding(QuantCode::kInt, 4, 32, m.asymmetric))->format;
}

void check_mxfp4_layer(const LayerCheck& k) {
  MoeLayer& m = k.m;
  k.method_must_be("mxfp4", "MXFP4 weights (e2m1 with e8m0 scales)");
  if (m.layout != KT_CKPT_LAYOUT_GPT_OSS)
    k.per_expert([&](const ProjTensors& pt, int64_t out, int64_t in) {
      check_scale_tensor(pt.scale, "e8m0 scales, one per 32 inputs", out, ceil_div64(in, 32),
                         {KT_CKPT_DTYPE_E8M0, KT_CKPT_DTYPE_U8}, "E8M0/U8", "");
    });
  m.group = 32;
  m.decodable = true;
  m.native_format = KT_FORMAT_MXFP4;
}

// Checks a quantized layer's scale tensors and quantization_config against
// each other (a contradiction fails the open, KT_ERR_IO) and decides the
// kt format that holds it (or why none does).
void check_quantized_layer(MoeLayer& m, const QuantConfig& qc) {
  const LayerCheck k(m, qc);
  if (m.format == KT_CKPT_FORMAT_FP8_BLOCK) check_fp8_layer(k);
  else if (m.format == KT_CKPT_FORMAT_INT4_GROUP) check_int4_layer(k);
  else if (m.format == KT_CKPT_FORMAT_MXFP4) check_mxfp4_layer(k);
}

}  // namespace

bool MoeLayer::loadable() const {
  if (format == KT_CKPT_FORMAT_DENSE) return is_float_dtype(weight_dtype);
  return format != KT_CKPT_FORMAT_OTHER && unsupported.empty();
}

bool MoeLayer::dequantizable() const { return decodable; }

const MoeLayer* ModelInfo::find(int64_t layer) const {
  for (const auto& l : layers)
    if (l.layer == layer) return &l;
  return nullptr;
}

const MoeLayer& ModelInfo::get(int64_t layer, const char* where) const {
  const MoeLayer* l = find(layer);
  if (!l) {
    std::string have;
    for (size_t i = 0; i < layers.size() && i < 8; ++i) have += (i ? ", " : "") + std::to_string(layers[i].layer);
    if (layers.size() > 8) have += ", ...";
    fail(KT_ERR_INVALID_ARGUMENT, std::string(where) + ": layer " + std::to_string(layer) +
                                      " has no routed experts in this checkpoint (MoE layers: " +
                                      (have.empty() ? "none" : have) + ")");
  }
  return *l;
}

std::string expert_module_name(kt_ckpt_layout naming, int64_t layer, int64_t expert, int proj) {
  const bool mixtral = naming == KT_CKPT_LAYOUT_MIXTRAL;
  return "model.layers." + std::to_string(layer) + (mixtral ? ".block_sparse_moe" : ".mlp") +
         ".experts." + std::to_string(expert) + "." + (mixtral ? kMixtralNames : kProjNames)[proj];
}

namespace {

// config.json's architecture, model type, top-k and (gpt-oss) activation
// into info; the parsed config (an empty object without one).
json read_model_config(const std::string& config_text, const std::string& config_path, ModelInfo* info_out) {
  ModelInfo& info = *info_out;
  json config = json::object();
  if (!config_text.empty()) {
    config = json::parse(config_text, nullptr, false);
    if (config.is_discarded() || !config.is_object())
      io_fail(config_path + ": not a JSON object");
    if (config.contains("architectures") && config["architectures"].is_array() &&
        !config["architectures"].empty() && config["architectures"][0].is_string())
      info.architecture = config["architectures"][0].get<std::string>();
    if (config.contains("model_type") && config["model_type"].is_string())
      info.model_type = config["model_type"].get<std::string>();
    const int64_t k = config_int(config, {"num_experts_per_tok", "experts_per_token", "moe_topk"});
    info.top_k = k > 0 ? k : 0;
  }
  if (info.model_type == "gpt_oss") {
    info.activation = KT_ACT_SWIGLU_OAI;
    info.act_alpha = 1.702f;
    info.act_limit = 7.f;
    if (config.contains("swiglu_limit") && config["swiglu_limit"].is_number())
      info.act_limit = config["swiglu_limit"].get<float>();
  }
  return config;
}

// The expert tensors of every layer, by the layout their names say (one
// layout per layer: a second fails the open).
std::map<int64_t, Collected> collect_expert_tensors(const TensorSet& tensors) {
  std::map<int64_t, Collected> by_layer;
  for (const auto& kv : tensors.tensors()) {
    LayerName n;
    if (!split_layer_name(kv.first, &n)) continue;
    const std::string& r = n.rest;
    kt_ckpt_layout layout = KT_CKPT_LAYOUT_NONE;
    std::string group;
    size_t pos = 0;
    if (starts_with(r, 0, "mlp.experts.")) {
      group = "mlp.experts";
      pos = 12;
      layout = KT_CKPT_LAYOUT_PER_EXPERT;
    } else if (starts_with(r, 0, "block_sparse_moe.experts.")) {
      group = "block_sparse_moe.experts";
      pos = 25;
      layout = KT_CKPT_LAYOUT_MIXTRAL;
    } else if (starts_with(r, 0, "ffn.experts.")) {
      group = "ffn.experts";
      pos = 12;
      layout = KT_CKPT_LAYOUT_MIXTRAL;
    } else {
      continue;
    }
    const std::string base = n.before + "layers." + std::to_string(n.layer) + "." + group;
    Collected& c = by_layer[n.layer];
    if (c.seen.empty()) c.seen = kv.first;
    auto claim = [&](kt_ckpt_layout l) {
      if (c.layout != KT_CKPT_LAYOUT_NONE && (c.layout != l || c.base != base))
        io_fail(kv.second.file->path() + ": tensor '" + kv.first + "' mixes a second expert layout into layer " +
                std::to_string(n.layer) + " (already " + layout_name(c.layout) + " under '" + c.base + "')");
      c.layout = l;
      c.base = base;
    };
    int64_t e = 0;
    size_t p = pos;
    if (read_index(r, &p, &e)) {
      const size_t dot = r.find('.', p);
      if (dot == std::string::npos) continue;
      const int proj = proj_of(r.substr(p, dot - p), layout == KT_CKPT_LAYOUT_MIXTRAL);
      if (proj < 0) continue;
      // Only a model's own parts (adapters' lora_A/lora_B keys are not experts).
      const std::string part = r.substr(dot + 1);
      static const char* kParts[] = {"weight", "weight_scale_inv", "weight_packed", "weight_scale",
                                     "weight_shape", "weight_zero_point", "bias", "scale"};
      if (std::find_if(std::begin(kParts), std::end(kParts), [&](const char* k) { return part == k; }) ==
          std::end(kParts))
        continue;
      claim(layout);
      c.experts[e][static_cast<size_t>(proj)][r.substr(dot + 1)] = &kv.second;
      c.claimed.push_back(&kv);
    } else if (layout == KT_CKPT_LAYOUT_PER_EXPERT) {
      const std::string tail = r.substr(pos);
      static const char* kFused[] = {"gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias",
                                     "gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks",
                                     "down_proj_scales"};
      if (std::find_if(std::begin(kFused), std::end(kFused), [&](const char* f) { return tail == f; }) ==
          std::end(kFused))
        continue;
      claim(KT_CKPT_LAYOUT_FUSED);
      c.fused[tail] = &kv.second;
      c.claimed.push_back(&kv);
    }
  }

  return by_layer;
}

// config.json, where it states them, must agree with the tensors.
void check_config_agrees(const json& config, const ModelInfo& info, const std::map<int64_t, Collected>& by_layer,
                         const std::string& dir, const std::string& config_path) {
  const int64_t cfg_h = config_int(config, {"hidden_size", "dim"});
  const int64_t cfg_e = config_int(config, {"num_experts", "n_routed_experts", "num_local_experts"});
  const int64_t cfg_i = config_int(config, {"moe_intermediate_size"});
  for (const auto& m : info.layers) {
    if (m.E == 0 && (cfg_h > 0 || cfg_e > 0 || cfg_i > 0))
      io_fail(dir + ": layer " + std::to_string(m.layer) + " has no recognised expert tensors: '" +
              by_layer.at(m.layer).seen + "' and the others under its experts are none of " + kExpertNames);
    auto mismatch = [&](const char* key, int64_t cfg, int64_t got) {
      io_fail(config_path + ": " + key + " = " + std::to_string(cfg) + " but layer " +
              std::to_string(m.layer) + "'s expert tensors ('" + m.prefix + "') give " + std::to_string(got));
    };
    if (cfg_h > 0 && cfg_h != m.H) mismatch("hidden_size", cfg_h, m.H);
    if (cfg_e > 0 && cfg_e != m.E) mismatch("the expert count", cfg_e, m.E);
    if (cfg_i > 0 && cfg_i != m.I) mismatch("moe_intermediate_size", cfg_i, m.I);
  }
}

}  // namespace

ModelInfo detect_layout(const TensorSet& tensors, const std::string& config_text,
                        const std::string& dir) {
  ModelInfo info;
  const std::string config_path = dir + "/config.json";
  const json config = read_model_config(config_text, config_path, &info);
  const bool gpt_oss = info.model_type == "gpt_oss";
  const QuantConfig quant_config = read_quant_config(config, config_path);
  std::map<int64_t, Collected> by_layer = collect_expert_tensors(tensors);
  for (auto& kv : by_layer) {
    Collected& c = kv.second;
    MoeLayer m = c.layout == KT_CKPT_LAYOUT_FUSED ? build_fused(kv.first, c, gpt_oss)
                                                 : build_per_expert(kv.first, c, packed_values_per_word(quant_config));
    check_quantized_layer(m, quant_config);
    m.tensors = std::move(c.claimed);
    if (info.layout == KT_CKPT_LAYOUT_NONE) info.layout = m.layout;
    info.layers.push_back(std::move(m));
  }
  check_config_agrees(config, info, by_layer, dir, config_path);
  return info;
}

// ------------------------------------------------------------------ loading

namespace {

// A DLTensor over mapped (or copied) bytes with its own shape storage.
struct Tensor3 {
  DLTensor t{};
  int64_t shape[3] = {0, 0, 0};
  int64_t strides[3] = {0, 0, 0};
  void set(const void* data, kt_ckpt_dtype dt, int ndim, const int64_t* s, const int64_t* st) {
    t.data = const_cast<void*>(data);
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = ndim;
    t.dtype = dl_dtype(dt);
    for (int i = 0; i < ndim; ++i) {
      shape[i] = s[i];
      strides[i] = st[i];
    }
    t.shape = shape;
    t.strides = strides;
    t.byte_offset = 0;
  }
};

bool aligned_for(const void* p, kt_ckpt_dtype dt) {
  return reinterpret_cast<uintptr_t>(p) % st_dtype_info(dt).size == 0;
}

void check_moe_matches(const MoeLayer& L, const kt_moe* moe, const char* where) {
  KT_CHECK(moe != nullptr, KT_ERR_INVALID_HANDLE, std::string(where) + ": moe is NULL");
  KT_CHECK(L.loadable() || L.dequantizable(), KT_ERR_UNSUPPORTED,
           std::string(where) + ": layer " + std::to_string(L.layer) + " stores " +
               format_name(L.format) + " " + dtype_name(L.weight_dtype) +
               " weights" +
               (L.unsupported.empty() ? std::string("; this kt cannot read them")
                                      : ": " + L.unsupported));
  auto same = [&](const char* what, int64_t layer_v, int64_t moe_v) {
    KT_CHECK(layer_v == moe_v, KT_ERR_SHAPE,
             std::string(where) + ": layer " + std::to_string(L.layer) + " has " + what + " = " +
                 std::to_string(layer_v) + " but the kt_moe was created with " +
                 std::to_string(moe_v));
  };
  same("num_experts", L.E, moe->E);
  same("hidden", L.H, moe->H);
  same("intermediate", L.I, moe->I);
  same("biases (1 = present)", L.has_bias ? 1 : 0, moe->opt.has_bias ? 1 : 0);
}

// Calls moe->load for the stacked experts `map` (stacked index i holds
// logical expert map[i]) under the engine's compute lock.
void load_chunk(kt_moe* moe, const kt_load_options& lo, std::vector<kt_arg> args, std::vector<int64_t> map,
                const char* where) {
  const int64_t n = static_cast<int64_t>(map.size());
  Tensor3 mt;
  const int64_t one = 1;
  mt.set(map.data(), KT_CKPT_DTYPE_I64, 1, &n, &one);
  args.push_back(kt_arg{KT_ARG_EXPERT_MAP, &mt.t});
  std::lock_guard<std::mutex> lock(moe->engine->compute_mutex);
  moe->load(lo, args.data(), args.size(), -1, where);
}

void load_per_expert(const MoeLayer& L, kt_moe* moe, kt_ckpt_progress_fn progress, void* user,
                     const char* where) {
  kt_load_options lo = defaults_of<kt_load_options>(set_load_options_defaults);
  constexpr int64_t kMaxRun = 32;
  // Experts in the order their gate tensors sit in the files: writers sort
  // tensor names, so experts 1, 10, 100, ... follow each other at a constant
  // stride, and one strided DLTensor (with an expert map) covers many.
  std::vector<int64_t> order(static_cast<size_t>(L.E));
  for (int64_t e = 0; e < L.E; ++e) order[static_cast<size_t>(e)] = e;
  auto gate_of = [&](int64_t e) { return L.experts[static_cast<size_t>(e)][kProjGate].weight; };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const TensorRef *ga = gate_of(a), *gb = gate_of(b);
    if (ga->file != gb->file) return ga->file->path() < gb->file->path();
    return ga->data < gb->data;
  });
  auto tensor_of = [&](int64_t k, int p) {
    return L.experts[static_cast<size_t>(order[static_cast<size_t>(k)])][static_cast<size_t>(p)].weight;
  };
  int64_t k0 = 0, done = 0;
  while (k0 < L.E) {
    // Grow a run of experts whose tensors sit at a constant byte stride
    // (per projection), so one strided DLTensor covers them all.
    int64_t n = 1;
    int64_t stride[3] = {0, 0, 0};
    bool all_aligned = true;
    for (int p = 0; p < 3; ++p) all_aligned = all_aligned && aligned_for(tensor_of(k0, p)->data, tensor_of(k0, p)->entry->dtype);
    while (all_aligned && k0 + n < L.E && n < kMaxRun) {
      bool fits = true;
      for (int p = 0; p < 3 && fits; ++p) {
        const TensorRef* first = tensor_of(k0, p);
        const TensorRef* next = tensor_of(k0 + n, p);
        const int64_t es = static_cast<int64_t>(st_dtype_info(first->entry->dtype).size);
        const int64_t d = next->data - first->data;
        if (next->file != first->file || next->entry->dtype != first->entry->dtype) {
          fits = false;
        } else if (n == 1) {
          if (d <= 0 || d % es != 0) fits = false;
          else stride[p] = d;
        } else if (d != stride[p] * n) {
          fits = false;
        }
      }
      if (!fits) break;
      ++n;
    }
    std::vector<int64_t> map(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) map[static_cast<size_t>(i)] = order[static_cast<size_t>(k0 + i)];
    const int64_t e0 = map[0];
    Tensor3 w[3], b[3];
    std::vector<kt::Buffer<char>> copies;
    std::vector<kt_arg> args;
    static const int kW[3] = {KT_ARG_W_GATE, KT_ARG_W_UP, KT_ARG_W_DOWN};
    static const int kB[3] = {KT_ARG_B_GATE, KT_ARG_B_UP, KT_ARG_B_DOWN};
    // Places a tensor for the load: zero-copy when aligned, else copied.
    auto place = [&](const TensorRef* r) -> const void* {
      if (aligned_for(r->data, r->entry->dtype)) return r->data;
      copies.emplace_back(static_cast<size_t>(r->entry->nbytes()));
      std::memcpy(copies.back().data(), r->data, static_cast<size_t>(r->entry->nbytes()));
      return copies.back().data();
    };
    for (int p = 0; p < 3; ++p) {
      const ProjTensors& pt = L.experts[static_cast<size_t>(e0)][static_cast<size_t>(p)];
      const int64_t out = p == kProjDown ? L.H : L.I, in = p == kProjDown ? L.I : L.H;
      const int64_t es = static_cast<int64_t>(st_dtype_info(pt.weight->entry->dtype).size);
      const int64_t shape[3] = {n, out, in};
      const int64_t strides[3] = {n > 1 ? stride[p] / es : out * in, in, 1};
      w[p].set(place(pt.weight), pt.weight->entry->dtype, 3, shape, strides);
      args.push_back(kt_arg{kW[p], &w[p].t});
    }
    if (L.has_bias) {
      // Biases are small: gather the run's into one contiguous fp32 block.
      std::vector<std::vector<float>> gathered(3);
      for (int p = 0; p < 3; ++p) {
        const int64_t out = p == kProjDown ? L.H : L.I;
        gathered[static_cast<size_t>(p)].resize(static_cast<size_t>(n * out));
        for (int64_t i = 0; i < n; ++i) {
          const TensorRef* br = L.experts[static_cast<size_t>(map[static_cast<size_t>(i)])][static_cast<size_t>(p)].bias;
          convert_elements(br->data, br->entry->dtype, gathered[static_cast<size_t>(p)].data() + i * out,
                           KT_CKPT_DTYPE_F32, out);
        }
        copies.emplace_back(gathered[static_cast<size_t>(p)].size() * sizeof(float));
        std::memcpy(copies.back().data(), gathered[static_cast<size_t>(p)].data(), copies.back().size());
        const int64_t shape[2] = {n, out};
        const int64_t strides[2] = {out, 1};
        b[p].set(copies.back().data(), KT_CKPT_DTYPE_F32, 2, shape, strides);
        args.push_back(kt_arg{kB[p], &b[p].t});
      }
    }
    load_chunk(moe, lo, args, std::move(map), where);
    // The run is packed: its source pages need not stay resident.
    for (int64_t i = k0; i < k0 + n; ++i)
      for (const ProjTensors& pt : L.experts[static_cast<size_t>(order[static_cast<size_t>(i)])]) {
        release_mapped_pages(pt.weight->data, static_cast<size_t>(pt.weight->entry->nbytes()));
        if (pt.bias) release_mapped_pages(pt.bias->data, static_cast<size_t>(pt.bias->entry->nbytes()));
      }
    k0 += n;
    done += n;
    if (progress) progress(done, L.E, user);
  }
}

void load_fused(const MoeLayer& L, kt_moe* moe, kt_ckpt_progress_fn progress, void* user,
                const char* where) {
  kt_load_options lo = defaults_of<kt_load_options>(set_load_options_defaults);
  const bool in_out = L.layout != KT_CKPT_LAYOUT_FUSED;
  lo.orientation = in_out ? KT_ORIENT_IN_OUT : KT_ORIENT_OUT_IN;
  lo.gate_up_order = L.layout == KT_CKPT_LAYOUT_GPT_OSS ? KT_GATE_UP_INTERLEAVED : KT_GATE_UP_CONCAT;
  const int64_t kChunk = 16;
  for (int64_t e0 = 0; e0 < L.E; e0 += kChunk) {
    const int64_t n = std::min(kChunk, L.E - e0);
    std::vector<kt::Buffer<char>> copies;
    std::vector<kt_arg> args;
    std::vector<std::pair<const uint8_t*, size_t>> consumed;
    Tensor3 t[4];
    auto stacked = [&](const TensorRef* r, int id, Tensor3* dst) {
      const auto& s = r->entry->shape;
      int64_t per = 1;
      for (size_t i = 1; i < s.size(); ++i) per *= s[i];
      const size_t es = st_dtype_info(r->entry->dtype).size;
      const uint8_t* p = r->data + static_cast<size_t>(e0 * per) * es;
      consumed.emplace_back(p, static_cast<size_t>(n * per) * es);
      const void* data = p;
      if (!aligned_for(p, r->entry->dtype)) {
        copies.emplace_back(static_cast<size_t>(n * per) * es);
        std::memcpy(copies.back().data(), p, copies.back().size());
        data = copies.back().data();
      }
      int64_t shape[3] = {n, s.size() > 1 ? s[1] : 1, s.size() > 2 ? s[2] : 1};
      int64_t strides[3] = {per, s.size() > 2 ? s[2] : 1, 1};
      dst->set(data, r->entry->dtype, static_cast<int>(s.size()), shape, strides);
      args.push_back(kt_arg{id, &dst->t});
    };
    stacked(L.gate_up, KT_ARG_W_GATE_UP, &t[0]);
    stacked(L.down, KT_ARG_W_DOWN, &t[1]);
    if (L.has_bias) {
      stacked(L.gate_up_bias, KT_ARG_B_GATE_UP, &t[2]);
      stacked(L.down_bias, KT_ARG_B_DOWN, &t[3]);
    }
    std::vector<int64_t> map(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) map[static_cast<size_t>(i)] = e0 + i;
    load_chunk(moe, lo, args, std::move(map), where);
    for (const auto& range : consumed) release_mapped_pages(range.first, range.second);
    if (progress) progress(e0 + n, L.E, user);
  }
}

// ------------------------------------------------- quantized checkpoints

// How a quantized layer is stored, for messages.
std::string stored_text(const MoeLayer& L) {
  switch (L.format) {
    case KT_CKPT_FORMAT_FP8_BLOCK:
      return "fp8 e4m3 with a scale per " + std::to_string(L.block_rows) + " x " + std::to_string(L.group) + " block";
    case KT_CKPT_FORMAT_INT4_GROUP:
      return std::string("compressed-tensors int4 in groups of ") + std::to_string(L.group) +
             (L.asymmetric ? ", asymmetric" : ", symmetric");
    case KT_CKPT_FORMAT_MXFP4: return "mxfp4 (e2m1 with e8m0 scales per 32)";
    default: return format_name(L.format);
  }
}

// Projection p of expert e of a quantized layer as a QuantSource.
QuantSource quant_source(const MoeLayer& L, int64_t e, int p) {
  QuantSource src;
  src.group = L.group;
  const int64_t out = p == kProjDown ? L.H : L.I, in = p == kProjDown ? L.I : L.H;
  const int64_t groups = ceil_div64(in, L.group);
  auto scales_from = [&](const TensorRef* t) {
    src.scales = t->data;
    src.scale_dtype = t->entry->dtype;
  };
  if (L.layout == KT_CKPT_LAYOUT_GPT_OSS) {
    // Blocks [E, rows, in/32, 16] and scales [E, rows, in/32]; gate and up
    // interleave in the rows of gate_up.
    const TensorRef* blocks = p == kProjDown ? L.down : L.gate_up;
    const TensorRef* scales = p == kProjDown ? L.down_scales : L.gate_up_scales;
    const int64_t rows = p == kProjDown ? L.H : 2 * L.I;
    src.code = QuantCode::kE2M1;
    src.bits = 4;
    src.code_row_bytes = in / 2;
    src.codes = blocks->data + e * rows * src.code_row_bytes;
    scales_from(scales);
    src.scale_row = in / 32;
    src.scales += e * rows * src.scale_row;
    src.row0 = p == kProjUp ? 1 : 0;
    src.row_step = p == kProjDown ? 1 : 2;
    src.name = blocks->entry->name.c_str();
    (void)out;
    return src;
  }
  const ProjTensors& pt = L.experts[static_cast<size_t>(e)][static_cast<size_t>(p)];
  src.codes = pt.weight->data;
  src.name = pt.weight->entry->name.c_str();
  scales_from(pt.scale);
  src.scale_row = groups;
  switch (L.format) {
    case KT_CKPT_FORMAT_FP8_BLOCK:
      src.code = QuantCode::kE4M3;
      src.bits = 8;
      src.code_row_bytes = in;
      src.scale_row_div = L.block_rows;
      break;
    case KT_CKPT_FORMAT_INT4_GROUP:
      src.code = QuantCode::kInt;
      src.bits = 4;
      src.code_row_bytes = pt.weight->entry->shape[1] * 4;
      if (pt.zero) {
        src.zeros = pt.zero->data;
        src.zero_row = groups;
      }
      break;
    default:  // MXFP4, per expert
      src.code = QuantCode::kE2M1;
      src.bits = 4;
      src.code_row_bytes = pt.weight->entry->shape[1];
      break;
  }
  return src;
}

// Biases of expert e, projection p, as fp32 (out values).
void bias_rows(const MoeLayer& L, int64_t e, int p, float* dst) {
  const int64_t out = p == kProjDown ? L.H : L.I;
  if (L.layout == KT_CKPT_LAYOUT_PER_EXPERT || L.layout == KT_CKPT_LAYOUT_MIXTRAL) {
    const TensorRef* b = L.experts[static_cast<size_t>(e)][static_cast<size_t>(p)].bias;
    convert_elements(b->data, b->entry->dtype, dst, KT_CKPT_DTYPE_F32, out);
    return;
  }
  const TensorRef* b = p == kProjDown ? L.down_bias : L.gate_up_bias;
  const size_t es = st_dtype_info(b->entry->dtype).size;
  if (p == kProjDown) {
    convert_elements(b->data + static_cast<size_t>(e * L.H) * es, b->entry->dtype, dst, KT_CKPT_DTYPE_F32, out);
    return;
  }
  const bool inter = L.layout == KT_CKPT_LAYOUT_GPT_OSS;
  for (int64_t o = 0; o < out; ++o) {
    const int64_t j = inter ? 2 * o + (p == kProjUp) : o + (p == kProjUp ? L.I : 0);
    convert_elements(b->data + static_cast<size_t>(e * 2 * L.I + j) * es, b->entry->dtype, dst + o, KT_CKPT_DTYPE_F32, 1);
  }
}

constexpr int64_t kQuantLoadChunk = 16;

// Checks every expert's codes and scales (under the compute lock, a chunk
// at a time, on the engine's threads) before anything is stored.
void check_quant_sources(const MoeLayer& L, kt_moe* moe, bool native, const char* where) {
  for (int64_t e0 = 0; e0 < L.E; e0 += kQuantLoadChunk) {
    const int64_t n = std::min(kQuantLoadChunk, L.E - e0);
    std::vector<SourceProblem> problems(static_cast<size_t>(n * 3));
    {
      std::lock_guard<std::mutex> lock(moe->engine->compute_mutex);
      moe->engine->pool->run(n * 3, [&](int64_t i, int) {
        const int64_t e = e0 + i / 3;
        const int p = static_cast<int>(i % 3);
        const int64_t out = p == kProjDown ? L.H : L.I, in = p == kProjDown ? L.I : L.H;
        problems[static_cast<size_t>(i)] =
            check_quant_source(quant_source(L, e, p), out, in, native ? &moe->quant_shape(p) : nullptr);
      });
    }
    for (const SourceProblem& problem : problems)
      if (problem.status != KT_OK)
        fail(problem.status, std::string(where) + ": layer " + std::to_string(L.layer) + ": tensor '" +
                                 problem.text + "; nothing was loaded");
  }
}

// Experts [e0, e0 + n) of a quantized layer are packed: their source pages
// (codes, scales, zero points, biases) need not stay resident.
void release_quant_sources(const MoeLayer& L, int64_t e0, int64_t n) {
  auto slice = [&](const TensorRef* t) {  // experts e0.. of a tensor stacked over E
    if (!t) return;
    const size_t per = static_cast<size_t>(t->entry->nbytes() / L.E);
    release_mapped_pages(t->data + static_cast<size_t>(e0) * per, static_cast<size_t>(n) * per);
  };
  if (L.layout == KT_CKPT_LAYOUT_GPT_OSS) {
    for (const TensorRef* t : {L.gate_up, L.down, L.gate_up_scales, L.down_scales, L.gate_up_bias, L.down_bias})
      slice(t);
    return;
  }
  for (int64_t e = e0; e < e0 + n; ++e)
    for (const ProjTensors& pt : L.experts[static_cast<size_t>(e)])
      for (const TensorRef* t : {pt.weight, pt.scale, pt.zero, pt.bias})
        if (t) release_mapped_pages(t->data, static_cast<size_t>(t->entry->nbytes()));
}

void load_quantized_native(const MoeLayer& L, kt_moe* moe, kt_ckpt_progress_fn progress, void* user,
                           const char* where) {
  check_quant_sources(L, moe, true, where);
  for (int64_t e0 = 0; e0 < L.E; e0 += kQuantLoadChunk) {
    const int64_t n = std::min(kQuantLoadChunk, L.E - e0);
    std::vector<int64_t> map(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) map[static_cast<size_t>(i)] = e0 + i;
    std::vector<float> biases[3];
    if (L.has_bias)
      for (int p = 0; p < 3; ++p) {
        const int64_t out = p == kProjDown ? L.H : L.I;
        biases[p].resize(static_cast<size_t>(n * out));
        for (int64_t i = 0; i < n; ++i) bias_rows(L, e0 + i, p, biases[p].data() + i * out);
      }
    {
      std::lock_guard<std::mutex> lock(moe->engine->compute_mutex);
      moe->store_quantized(
          map,
          [&](int64_t i, int p, uint8_t* dst) { pack_quant_source(quant_source(L, e0 + i, p), moe->quant_shape(p), dst); },
          L.has_bias ? biases : nullptr);
    }
    release_quant_sources(L, e0, n);
    if (progress) progress(e0 + n, L.E, user);
  }
}

// A quantized layer into a bf16 layer: each expert dequantized to fp32
// (exact) and loaded as any fp32 source is (rounded to bf16 once).
void load_dequantized(const MoeLayer& L, kt_moe* moe, kt_ckpt_progress_fn progress, void* user,
                      const char* where) {
  check_quant_sources(L, moe, false, where);
  kt_load_options lo = defaults_of<kt_load_options>(set_load_options_defaults);
  static const int kW[3] = {KT_ARG_W_GATE, KT_ARG_W_UP, KT_ARG_W_DOWN};
  static const int kB[3] = {KT_ARG_B_GATE, KT_ARG_B_UP, KT_ARG_B_DOWN};
  constexpr int64_t kChunk = 4;
  for (int64_t e0 = 0; e0 < L.E; e0 += kChunk) {
    const int64_t n = std::min(kChunk, L.E - e0);
    std::vector<kt::Buffer<float>> values(3), biases(3);
    Tensor3 w[3], b[3];
    std::vector<kt_arg> args;
    for (int p = 0; p < 3; ++p) {
      const int64_t out = p == kProjDown ? L.H : L.I, in = p == kProjDown ? L.I : L.H;
      values[static_cast<size_t>(p)].resize(static_cast<size_t>(n * out * in));
      float* dst = values[static_cast<size_t>(p)].data();
      {
        std::lock_guard<std::mutex> lock(moe->engine->compute_mutex);
        moe->engine->pool->run(n * out, [&](int64_t row, int) {
          const QuantSource src = quant_source(L, e0 + row / out, p);
          const int64_t r = row % out;
          for (int64_t c = 0; c < in; ++c) dst[row * in + c] = quant_source_value(src, r, c);
        });
      }
      const int64_t shape[3] = {n, out, in};
      const int64_t strides[3] = {out * in, in, 1};
      w[p].set(dst, KT_CKPT_DTYPE_F32, 3, shape, strides);
      args.push_back(kt_arg{kW[p], &w[p].t});
      if (L.has_bias) {
        biases[static_cast<size_t>(p)].resize(static_cast<size_t>(n * out));
        for (int64_t i = 0; i < n; ++i) bias_rows(L, e0 + i, p, biases[static_cast<size_t>(p)].data() + i * out);
        const int64_t bshape[2] = {n, out};
        const int64_t bstrides[2] = {out, 1};
        b[p].set(biases[static_cast<size_t>(p)].data(), KT_CKPT_DTYPE_F32, 2, bshape, bstrides);
        args.push_back(kt_arg{kB[p], &b[p].t});
      }
    }
    std::vector<int64_t> map(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) map[static_cast<size_t>(i)] = e0 + i;
    load_chunk(moe, lo, args, std::move(map), where);
    if (progress) progress(e0 + n, L.E, user);
  }
}

// Which way a quantized layer goes into moe, or why it cannot.
void load_quantized(const MoeLayer& L, kt_moe* moe, const kt_ckpt_load_options& o, kt_ckpt_progress_fn progress,
                    void* user, const char* where) {
  const kt_weight_format have = moe->opt.weight_format;
  const std::string head = std::string(where) + ": layer " + std::to_string(L.layer) + " stores " + stored_text(L) +
                           "; the kt_moe stores " + weight_format_name(have);
  if (have == L.native_format && L.loadable()) {
    load_quantized_native(L, moe, progress, user, where);
    return;
  }
  if (have == KT_FORMAT_BF16) {
    KT_CHECK(o.dequantize != 0, KT_ERR_UNSUPPORTED,
             head + ": create the kt_moe with weight_format " +
                 weight_format_name(L.native_format) +
                 (L.loadable() ? std::string(" (kt_ckpt_moe_options sets it)")
                               : " (which cannot hold it: " + L.unsupported + ")") +
                 ", or ask for a dequantized load (kt_ckpt_load_options.dequantize = 1)");
    load_dequantized(L, moe, progress, user, where);
    return;
  }
  fail(KT_ERR_UNSUPPORTED,
       head + (have == L.native_format ? ": " + L.unsupported
                                         : std::string(": a quantized checkpoint is never re-quantized; create the "
                                                       "kt_moe with weight_format ") +
                                               weight_format_name(L.native_format) +
                                               ", or bf16 with kt_ckpt_load_options.dequantize = 1"));
}

}  // namespace

void load_layer(const MoeLayer& layer, kt_moe* moe, const kt_ckpt_load_options& options,
                kt_ckpt_progress_fn progress, void* user, const char* where) {
  check_moe_matches(layer, moe, where);
  if (layer.quantized())
    load_quantized(layer, moe, options, progress, user, where);
  else if (layer.layout == KT_CKPT_LAYOUT_PER_EXPERT || layer.layout == KT_CKPT_LAYOUT_MIXTRAL)
    load_per_expert(layer, moe, progress, user, where);
  else
    load_fused(layer, moe, progress, user, where);
}

namespace {

// A tensor kt_ckpt_read_layer fills: its argument id, view, projection and
// whether it is the projection's biases.
struct ReadDest {
  int id;
  View v;
  int proj;
  bool bias;
};

const char* const kReadNames[] = {"KT_ARG_W_GATE", "KT_ARG_W_UP", "KT_ARG_W_DOWN",
                                  "KT_ARG_B_GATE", "KT_ARG_B_UP", "KT_ARG_B_DOWN"};

const char* read_name(const ReadDest& d) { return kReadNames[d.proj + (d.bias ? 3 : 0)]; }

// The arguments of a read, each checked (id, shape, dtype, writable, and
// disjoint from the others) before anything is written.
std::vector<ReadDest> read_destinations(const MoeLayer& L, const kt_arg* args, size_t num_args, const char* where) {
  std::vector<ReadDest> dests;
  const std::initializer_list<DType> kOut = {DType::kF32, DType::kBF16, DType::kF16};
  for (size_t i = 0; i < num_args; ++i) {
    const int id = args[i].id;
    int proj = -1;
    bool bias = false;
    switch (id) {
      case KT_ARG_W_GATE: proj = kProjGate; break;
      case KT_ARG_W_UP: proj = kProjUp; break;
      case KT_ARG_W_DOWN: proj = kProjDown; break;
      case KT_ARG_B_GATE: proj = kProjGate, bias = true; break;
      case KT_ARG_B_UP: proj = kProjUp, bias = true; break;
      case KT_ARG_B_DOWN: proj = kProjDown, bias = true; break;
      default:
        fail(KT_ERR_INVALID_ARGUMENT, std::string(where) + ": argument id " + std::to_string(id) +
                                          " is not W_GATE/W_UP/W_DOWN/B_GATE/B_UP/B_DOWN");
    }
    for (const ReadDest& d : dests)
      KT_CHECK(d.id != id, KT_ERR_INVALID_ARGUMENT,
               std::string(where) + ": argument id " + std::to_string(id) + " given twice");
    KT_CHECK(!bias || L.has_bias, KT_ERR_INVALID_ARGUMENT,
             std::string(where) + ": layer " + std::to_string(L.layer) + " has no biases");
    const int64_t out = proj == kProjDown ? L.H : L.I, in = proj == kProjDown ? L.I : L.H;
    const char* name = kReadNames[proj + (bias ? 3 : 0)];
    View v = bias ? check_tensor(args[i].tensor, {name, kOut, {L.E, out}}, where)
                  : check_tensor(args[i].tensor, {name, kOut, {L.E, out, in}}, where);
    dests.push_back(ReadDest{id, v, proj, bias});
  }
  for (size_t i = 0; i < dests.size(); ++i) {
    check_writable(dests[i].v, where, read_name(dests[i]));
    for (size_t j = 0; j < i; ++j) check_disjoint(dests[i].v, read_name(dests[i]), dests[j].v, read_name(dests[j]), where);
  }
  return dests;
}

// Where expert e's element (o, i) of a destination's projection lies in the
// stored tensor: src's element base + o*so + i*si.
struct SourceWalk {
  const TensorRef* src = nullptr;
  int64_t base = 0, so = 0, si = 0;
};

SourceWalk source_walk(const MoeLayer& L, const ReadDest& d, int64_t e) {
  const bool fused = !(L.layout == KT_CKPT_LAYOUT_PER_EXPERT || L.layout == KT_CKPT_LAYOUT_MIXTRAL);
  const bool in_out = fused && L.layout != KT_CKPT_LAYOUT_FUSED;
  const bool interleaved = L.layout == KT_CKPT_LAYOUT_GPT_OSS;
  const int64_t out = d.proj == kProjDown ? L.H : L.I, in = d.proj == kProjDown ? L.I : L.H;
  SourceWalk w;
  if (!fused) {
    const ProjTensors& pt = L.experts[static_cast<size_t>(e)][static_cast<size_t>(d.proj)];
    w.src = d.bias ? pt.bias : pt.weight;
    w.so = d.bias ? 1 : in;
    w.si = 1;
  } else if (d.bias) {
    w.src = d.proj == kProjDown ? L.down_bias : L.gate_up_bias;
    const int64_t width = d.proj == kProjDown ? L.H : 2 * L.I;
    w.base = e * width;
    w.so = 1;
    if (d.proj == kProjUp) w.base += interleaved ? 1 : L.I;
    if (d.proj != kProjDown && interleaved) w.so = 2;
  } else {
    w.src = d.proj == kProjDown ? L.down : L.gate_up;
    const int64_t rows = d.proj == kProjDown ? out : 2 * L.I;  // logical out rows of the tensor
    w.base = e * rows * in;
    int64_t row0 = 0, row_step = 1;
    if (d.proj != kProjDown) {
      row0 = d.proj == kProjUp ? (interleaved ? 1 : L.I) : 0;
      row_step = interleaved ? 2 : 1;
    }
    if (in_out) {  // stored [in, rows]
      w.base += row0;
      w.so = row_step;
      w.si = rows;
    } else {       // stored [rows, in]
      w.base += row0 * in;
      w.so = row_step * in;
      w.si = 1;
    }
  }
  return w;
}

// One destination, every expert: stored values converted to its dtype, or
// for a quantized layer's weights each code times its scale (exact in fp32)
// converted.
void read_into(const MoeLayer& L, const ReadDest& d) {
  const int64_t out = d.proj == kProjDown ? L.H : L.I, in = d.proj == kProjDown ? L.I : L.H;
  const kt_ckpt_dtype dst_dt = from_dtype(d.v.dtype);
  for (int64_t e = 0; e < L.E; ++e) {
    if (L.quantized() && !d.bias) {
      const QuantSource src = quant_source(L, e, d.proj);
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) {
          const float v = quant_source_value(src, o, i);
          convert_elements(reinterpret_cast<const uint8_t*>(&v), KT_CKPT_DTYPE_F32, d.v.at(e, o, i), dst_dt, 1);
        }
      continue;
    }
    const SourceWalk w = source_walk(L, d, e);
    const kt_ckpt_dtype src_dt = w.src->entry->dtype;
    const size_t ses = st_dtype_info(src_dt).size;
    for (int64_t o = 0; o < out; ++o) {
      if (d.bias) {
        convert_elements(w.src->data + static_cast<size_t>(w.base + o * w.so) * ses, src_dt, d.v.at(e, o), dst_dt, 1);
        continue;
      }
      if (w.si == 1 && d.v.strides[2] == 1) {
        convert_elements(w.src->data + static_cast<size_t>(w.base + o * w.so) * ses, src_dt, d.v.at(e, o, 0), dst_dt,
                         in);
      } else {
        for (int64_t i = 0; i < in; ++i)
          convert_elements(w.src->data + static_cast<size_t>(w.base + o * w.so + i * w.si) * ses, src_dt,
                           d.v.at(e, o, i), dst_dt, 1);
      }
    }
  }
}

}  // namespace

void read_layer(const MoeLayer& L, const kt_arg* args, size_t num_args, const char* where) {
  KT_CHECK(num_args == 0 || args != nullptr, KT_ERR_NULL_POINTER,
           std::string(where) + ": args is NULL");
  KT_CHECK(L.quantized() ? L.dequantizable() : L.loadable(), KT_ERR_UNSUPPORTED,
           std::string(where) + ": layer " + std::to_string(L.layer) + " stores " +
               format_name(L.format) +
               " weights; only bf16/fp16/fp32 layers and the quantized formats kt decodes can be "
               "read into tensors");
  for (const ReadDest& d : read_destinations(L, args, num_args, where)) {
    // Nothing to copy; also keeps a layer of 2^62 zero-byte experts from
    // looping over them.
    if (d.v.numel() == 0) continue;
    read_into(L, d);
  }
}

}  // namespace io
}  // namespace kt
