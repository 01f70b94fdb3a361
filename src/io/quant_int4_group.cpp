#include "io/layout_parts.h"

#include <cstring>

#include "core/ckpt_names.h"

// compressed-tensors pack-quantized int4 in groups
// (KT_CKPT_FORMAT_INT4_GROUP): weight_packed, weight_shape, weight_scale
// and, asymmetric, weight_zero_point, checked against their config.

namespace kt {
namespace io {

namespace {

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

}  // namespace

// int4 values per int32 word of weight_packed, from the config (8 when it
// does not say).
int64_t packed_values_per_word(const QuantConfig& qc) {
  if (qc.weights && qc.weights->contains("num_bits") && (*qc.weights)["num_bits"].is_number_integer()) {
    const int64_t bits = (*qc.weights)["num_bits"].get<int64_t>();
    if (bits >= 1 && bits <= 32 && 32 % bits == 0) return 32 / bits;
  }
  return 8;
}

void describe_packed_int4(const std::map<std::string, const TensorRef*>& parts, const TensorRef* packed,
                          const std::string& base, int64_t values_per_word, ProjTensors* pt, int64_t* out,
                          int64_t* in) {
  auto get = [&](const char* s) -> const TensorRef* {
    auto it = parts.find(s);
    return it == parts.end() ? nullptr : it->second;
  };
  const std::string where = "tensor '" + base;
  const TensorEntry& t = *packed->entry;
  if (t.dtype != KT_CKPT_DTYPE_I32 || t.shape.size() != 2)
    io_fail(packed->file->path() + ": " + where + ".weight_packed': expected int32 [out, in/8], got " +
            st_dtype_info(t.dtype).st_name + " " + shape_text(t.shape));
  pt->weight = packed;
  pt->scale = get("weight_scale");
  pt->zero = get("weight_zero_point");
  if (!pt->scale) io_fail(packed->file->path() + ": " + where + ".weight_scale' is missing");
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

}  // namespace io
}  // namespace kt
