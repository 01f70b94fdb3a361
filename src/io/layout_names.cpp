#include <algorithm>
#include <cstring>

#include "core/ckpt_names.h"
#include "io/layout_parts.h"

// The tensor-name grammar: which tensors are a layer's routed experts, and
// which expert, projection and part each is.

namespace kt {
namespace io {

namespace {

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

const char* const kProjNames[3] = {"gate_proj", "up_proj", "down_proj"};
const char* const kMixtralNames[3] = {"w1", "w3", "w2"};

// The group of experts a layer's rest of name starts with, the layout it
// says and where the expert index begins; false for none.
bool expert_group_of(const std::string& r, std::string* group, size_t* pos, kt_ckpt_layout* layout) {
  if (starts_with(r, 0, "mlp.experts.")) {
    *group = "mlp.experts";
    *pos = 12;
    *layout = KT_CKPT_LAYOUT_PER_EXPERT;
  } else if (starts_with(r, 0, "block_sparse_moe.experts.")) {
    *group = "block_sparse_moe.experts";
    *pos = 25;
    *layout = KT_CKPT_LAYOUT_MIXTRAL;
  } else if (starts_with(r, 0, "ffn.experts.")) {
    *group = "ffn.experts";
    *pos = 12;
    *layout = KT_CKPT_LAYOUT_MIXTRAL;
  } else {
    return false;
  }
  return true;
}

// Whether s is one of the names.
template <size_t N>
bool one_of(const std::string& s, const char* const (&names)[N]) {
  return std::find_if(std::begin(names), std::end(names), [&](const char* n) { return s == n; }) != std::end(names);
}

// A per-expert tensor's projection and part after "<e>." (rest[p...]), or
// -1 when the name is none of a model's own parts (adapters' lora_A/lora_B
// keys are not experts).
int expert_part_of(const std::string& r, size_t p, kt_ckpt_layout layout, std::string* part) {
  const size_t dot = r.find('.', p);
  if (dot == std::string::npos) return -1;
  const int proj = proj_of(r.substr(p, dot - p), layout == KT_CKPT_LAYOUT_MIXTRAL);
  if (proj < 0) return -1;
  static const char* const kParts[] = {"weight", "weight_scale_inv", "weight_packed", "weight_scale",
                                       "weight_shape", "weight_zero_point", "bias", "scale"};
  *part = r.substr(dot + 1);
  return one_of(*part, kParts) ? proj : -1;
}

bool is_fused_part(const std::string& tail) {
  static const char* const kFused[] = {"gate_up_proj",        "down_proj",           "gate_up_proj_bias",
                                       "down_proj_bias",      "gate_up_proj_blocks", "gate_up_proj_scales",
                                       "down_proj_blocks",    "down_proj_scales"};
  return one_of(tail, kFused);
}

}  // namespace

const char* const kExpertNames =
    "kt's expert tensors (mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight, "
    "block_sparse_moe.experts.{e}.{w1,w3,w2}.weight or ffn.experts.{e}.{w1,w3,w2}.weight, their quantized parts, "
    "or the fused mlp.experts.gate_up_proj and mlp.experts.down_proj)";

const char* const* proj_names(kt_ckpt_layout layout) {
  return layout == KT_CKPT_LAYOUT_MIXTRAL ? kMixtralNames : kProjNames;
}

std::map<int64_t, Collected> collect_expert_tensors(const TensorSet& tensors) {
  std::map<int64_t, Collected> by_layer;
  for (const auto& kv : tensors.tensors()) {
    LayerName n;
    if (!split_layer_name(kv.first, &n)) continue;
    const std::string& r = n.rest;
    kt_ckpt_layout layout = KT_CKPT_LAYOUT_NONE;
    std::string group;
    size_t pos = 0;
    if (!expert_group_of(r, &group, &pos, &layout)) continue;
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
      std::string part;
      const int proj = expert_part_of(r, p, layout, &part);
      if (proj < 0) continue;
      claim(layout);
      c.experts[e][static_cast<size_t>(proj)][part] = &kv.second;
      c.claimed.push_back(&kv);
    } else if (layout == KT_CKPT_LAYOUT_PER_EXPERT) {
      const std::string tail = r.substr(pos);
      if (!is_fused_part(tail)) continue;
      claim(KT_CKPT_LAYOUT_FUSED);
      c.fused[tail] = &kv.second;
      c.claimed.push_back(&kv);
    }
  }
  return by_layer;
}

std::string expert_module_name(kt_ckpt_layout naming, int64_t layer, int64_t expert, int proj) {
  const bool mixtral = naming == KT_CKPT_LAYOUT_MIXTRAL;
  return "model.layers." + std::to_string(layer) + (mixtral ? ".block_sparse_moe" : ".mlp") +
         ".experts." + std::to_string(expert) + "." + proj_names(naming)[proj];
}

}  // namespace io
}  // namespace kt
