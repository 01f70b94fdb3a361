#include "io/layout.h"

#include <algorithm>

#include "core/ckpt_names.h"
#include "io/layout_parts.h"

// The layers a checkpoint's tensors describe: each layer's experts, shapes
// and stored format, checked against each other and against config.json.

namespace kt {
namespace io {

namespace {

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
    describe_packed_int4(parts, packed, base, values_per_word, pt, out, in);
    *format = KT_CKPT_FORMAT_INT4_GROUP;
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

// Experts run 0, 1, ... without a gap.
void check_experts_contiguous(int64_t L, const Collected& c, const char* const* names) {
  int64_t expect = 0;
  for (const auto& kv : c.experts) {
    if (kv.first != expect)
      io_fail("layer " + std::to_string(L) + ": expert " + std::to_string(expect) +
              " is missing ('" + c.base + "." + std::to_string(expect) + "." + names[0] +
              ".weight' not found; experts run to " + std::to_string(c.experts.rbegin()->first) + ")");
    ++expect;
  }
}

// Projection p of expert e (described as format, [out, in]) agrees with
// the layer that expert 0's gate set: format, dtype, shape, bias, zero points.
void check_proj_agrees(const MoeLayer& m, int64_t e, int p, const ProjTensors& pt, kt_ckpt_format format,
                       int64_t out, int64_t in, const std::string& base, const char* const* names) {
  const std::string file = pt.weight->file->path();
  if (format != m.format || pt.weight->entry->dtype != m.weight_dtype)
    io_fail(file + ": tensor '" + pt.weight->entry->name + "': format " + format_name(format) +
            " " + dtype_name(pt.weight->entry->dtype) + " differs from the layer's " +
            format_name(m.format) + " " + dtype_name(m.weight_dtype));
  const int64_t want_out = proj_out(m, p), want_in = proj_in(m, p);
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
}

MoeLayer build_per_expert(int64_t L, const Collected& c, int64_t values_per_word) {
  MoeLayer m;
  m.layer = L;
  m.prefix = c.base;
  m.layout = c.layout;
  const char* const* names = proj_names(c.layout);
  m.E = static_cast<int64_t>(c.experts.size());
  check_experts_contiguous(L, c, names);
  m.experts.resize(static_cast<size_t>(m.E));
  for (int64_t e = 0; e < m.E; ++e) {
    for (int p = 0; p < 3; ++p) {
      const std::string base = c.base + "." + std::to_string(e) + "." + names[p];
      const auto& parts = c.experts.at(e)[static_cast<size_t>(p)];
      if (parts.empty()) io_fail("tensor '" + base + ".weight' is missing");
      ProjTensors& pt = m.experts[static_cast<size_t>(e)][static_cast<size_t>(p)];
      kt_ckpt_format format;
      int64_t out = 0, in = 0;
      describe_proj(parts, base, values_per_word, &pt, &format, &out, &in);
      if (e == 0 && p == 0) {  // expert 0's gate says what the layer is
        m.format = format;
        m.weight_dtype = pt.weight->entry->dtype;
        m.has_bias = pt.bias != nullptr;
        m.I = out;
        m.H = in;
      }
      check_proj_agrees(m, e, p, pt, format, out, in, base, names);
      if (e == 0 && p == 0) m.asymmetric = pt.zero != nullptr;
      for (const auto& kv : parts) m.bytes += static_cast<int64_t>(kv.second->entry->nbytes());
    }
  }
  return m;
}

// Dense fused experts: [E, 2I, H] and [E, H, I], or transposed.
void describe_dense_fused(const FusedParts& f, bool gpt_oss, MoeLayer* m_out) {
  MoeLayer& m = *m_out;
  m.gate_up = f.need("gate_up_proj");
  m.down = f.need("down_proj");
  const auto& g = m.gate_up->entry->shape;
  const auto& d = m.down->entry->shape;
  if (g.size() != 3 || !is_float_dtype(m.gate_up->entry->dtype)) f.bad(m.gate_up, "a float [E, 2I, H] or [E, H, 2I] tensor");
  if (d.size() != 3 || !is_float_dtype(m.down->entry->dtype)) f.bad(m.down, "a float [E, H, I] or [E, I, H] tensor");
  m.format = KT_CKPT_FORMAT_DENSE;
  m.weight_dtype = m.gate_up->entry->dtype;
  m.E = g[0];
  // g[k] == 2 * d[j], without computing 2 * d[j] (any extent passes the
  // header check of a zero-byte tensor).
  auto twice = [](int64_t gv, int64_t dv) { return gv % 2 == 0 && gv / 2 == dv; };
  const bool out_in = twice(g[1], d[2]) && g[2] == d[1];
  const bool in_out = twice(g[2], d[1]) && g[1] == d[2];
  if (d[0] != m.E || (!out_in && !in_out) || (gpt_oss && !in_out))
    f.bad(m.down, std::string(gpt_oss ? "" : "[E, H, I] with gate_up_proj [E, 2I, H], or ") +
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

MoeLayer build_fused(int64_t L, const Collected& c, bool gpt_oss_model) {
  MoeLayer m;
  m.layer = L;
  m.prefix = c.base;
  const FusedParts f{c, L};
  for (const auto& kv : c.fused) m.bytes += static_cast<int64_t>(kv.second->entry->nbytes());
  m.gate_up_bias = f.get("gate_up_proj_bias");
  m.down_bias = f.get("down_proj_bias");
  m.has_bias = m.gate_up_bias || m.down_bias;
  const bool gpt_oss = gpt_oss_model || m.has_bias || f.get("gate_up_proj_blocks");
  if (f.get("gate_up_proj_blocks"))
    describe_mxfp4_blocks(f, &m);
  else
    describe_dense_fused(f, gpt_oss, &m);
  if (m.has_bias) {
    const TensorRef* gb = f.need("gate_up_proj_bias");
    const TensorRef* db = f.need("down_proj_bias");
    if (!is_float_dtype(gb->entry->dtype) || gb->entry->shape != std::vector<int64_t>{m.E, 2 * m.I})
      f.bad(gb, "a float [" + std::to_string(m.E) + ", " + std::to_string(2 * m.I) + "] bias");
    if (!is_float_dtype(db->entry->dtype) || db->entry->shape != std::vector<int64_t>{m.E, m.H})
      f.bad(db, "a float [" + std::to_string(m.E) + ", " + std::to_string(m.H) + "] bias");
  }
  return m;
}

// Checks a quantized layer's scale tensors and quantization_config against
// each other and decides the kt format that holds it.
void check_quantized_layer(MoeLayer& m, const QuantConfig& qc) {
  const LayerCheck k(m, qc);
  if (m.format == KT_CKPT_FORMAT_FP8_BLOCK) check_fp8_layer(k);
  else if (m.format == KT_CKPT_FORMAT_INT4_GROUP) check_int4_layer(k);
  else if (m.format == KT_CKPT_FORMAT_MXFP4) check_mxfp4_layer(k);
}

}  // namespace

void check_scale_tensor(const TensorRef* sc, const std::string& what, int64_t rows, int64_t cols,
                        std::initializer_list<kt_ckpt_dtype> dtypes, const char* dtype_text, const std::string& why) {
  const TensorEntry& t = *sc->entry;
  const std::vector<int64_t> want{rows, cols};
  const bool dtype_ok = std::find(dtypes.begin(), dtypes.end(), t.dtype) != dtypes.end();
  if (!dtype_ok || t.shape != want)
    io_fail(sc->file->path() + ": tensor '" + t.name + "' (" + what + "): expected " + dtype_text + " " +
            shape_text(want) + why + ", got " + dtype_name(t.dtype) + " " + shape_text(t.shape));
}

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

}  // namespace io
}  // namespace kt
