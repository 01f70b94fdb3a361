// The parts of finding a checkpoint's MoE layout (io/layout.h), shared by
// its files: the tensor-name grammar (layout_names.cpp), config.json
// (layout_config.cpp), each quantized format's checks (quant_fp8_block.cpp,
// quant_int4_group.cpp, quant_mxfp4.cpp), the layer descriptions
// (layout.cpp) and read-back (layout_read.cpp); loading into a layer,
// above io, is moe/ckpt_load.cpp.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/checked.h"
#include "core/error.h"
#include "formats/packed_quant.h"
#include "io/layout.h"

namespace kt {
namespace io {

using nlohmann::json;

[[noreturn]] inline void io_fail(const std::string& message) { fail(KT_ERR_IO, message); }

// extent * factor for a logical extent derived from a stored one (packed
// elements, interleaved rows). Headers allow any extent on a zero-byte
// tensor, so the product is checked.
inline int64_t scaled_extent(int64_t extent, int64_t factor, const TensorRef& t) {
  int64_t out = 0;
  if (!mul_fits(extent, factor, &out))
    io_fail(t.file->path() + ": tensor '" + t.entry->name + "': extent " + std::to_string(extent) +
            " times " + std::to_string(factor) + " overflows a 64-bit count");
  return out;
}

inline bool is_float_dtype(kt_ckpt_dtype d) {
  return d == KT_CKPT_DTYPE_BF16 || d == KT_CKPT_DTYPE_F16 || d == KT_CKPT_DTYPE_F32;
}

inline std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}

inline std::string json_text(const json& j) { return j.dump(); }

inline int64_t ceil_div64(int64_t a, int64_t b) { return a / b + (a % b != 0); }

// Logical [out, in] of projection p: down is [H, I], gate and up [I, H].
inline int64_t proj_out(const MoeLayer& m, int p) { return p == kProjDown ? m.H : m.I; }
inline int64_t proj_in(const MoeLayer& m, int p) { return p == kProjDown ? m.I : m.H; }

// ---- the tensor-name grammar (layout_names.cpp)

// The expert tensors of one layer, as their names group them.
struct Collected {
  std::string base;  // "model.layers.3.mlp.experts"
  kt_ckpt_layout layout = KT_CKPT_LAYOUT_NONE;
  // per-expert: expert -> proj -> suffix -> tensor
  std::map<int64_t, std::array<std::map<std::string, const TensorRef*>, 3>> experts;
  std::map<std::string, const TensorRef*> fused;  // "gate_up_proj", "down_proj_bias", ...
  std::vector<const NamedTensor*> claimed;         // all of the above, in name order
  std::string seen;  // the first tensor under the layer's experts, recognised or not
};

// The expert tensors of every layer, by the layout their names say (one
// layout per layer: a second fails the open).
std::map<int64_t, Collected> collect_expert_tensors(const TensorSet& tensors);

// The projections' names in the layout's order gate, up, down: gate_proj,
// up_proj, down_proj; Mixtral's w1, w3, w2.
const char* const* proj_names(kt_ckpt_layout layout);

// The expert tensors kt recognises, as messages name them.
extern const char* const kExpertNames;

// ---- config.json (layout_config.cpp)

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

// config.json's architecture, model type, top-k and (gpt-oss) activation
// into info; the parsed config (an empty object without one).
json read_model_config(const std::string& config_text, const std::string& config_path, ModelInfo* info);
QuantConfig read_quant_config(const json& config, const std::string& config_path);
// config.json, where it states them, must agree with the tensors.
void check_config_agrees(const json& config, const ModelInfo& info, const std::map<int64_t, Collected>& by_layer,
                         const std::string& dir, const std::string& config_path);

// ---- the quantized formats' checks (quant_*.cpp)

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
      for (int p = 0; p < 3; ++p) f(ex[static_cast<size_t>(p)], proj_out(m, p), proj_in(m, p));
  }
};

inline const std::initializer_list<kt_ckpt_dtype> kFloatScales = {KT_CKPT_DTYPE_F32, KT_CKPT_DTYPE_BF16,
                                                                   KT_CKPT_DTYPE_F16};

// One projection's scale (and zero-point) tensors checked against the
// weight and the group: [ceil(out / row_div), ceil(in / group)].
void check_scale_tensor(const TensorRef* sc, const std::string& what, int64_t rows, int64_t cols,
                        std::initializer_list<kt_ckpt_dtype> dtypes, const char* dtype_text, const std::string& why);

// Each checks a quantized layer of its format against quantization_config
// (a contradiction fails the open, KT_ERR_IO) and decides the kt format
// that holds it (or why none does).
void check_fp8_layer(const LayerCheck& k);
void check_int4_layer(const LayerCheck& k);
void check_mxfp4_layer(const LayerCheck& k);

// compressed-tensors pack-quantized int4: the projection described from its
// weight_packed (and weight_shape) tensors; values_per_word int4 values per
// int32 (packed_values_per_word).
void describe_packed_int4(const std::map<std::string, const TensorRef*>& parts, const TensorRef* packed,
                          const std::string& base, int64_t values_per_word, ProjTensors* pt, int64_t* out,
                          int64_t* in);
int64_t packed_values_per_word(const QuantConfig& qc);

// The tensors of a fused layer by their suffix, and its messages.
struct FusedParts {
  const Collected& c;
  int64_t layer;
  const TensorRef* get(const char* suffix) const {
    auto it = c.fused.find(suffix);
    return it == c.fused.end() ? nullptr : it->second;
  }
  const TensorRef* need(const char* suffix) const;
  [[noreturn]] void bad(const TensorRef* t, const std::string& expected) const;
};

// gpt-oss MXFP4 blocks and scales: m's shape, format and tensors.
void describe_mxfp4_blocks(const FusedParts& f, MoeLayer* m);

// ---- the stored values (layout_read.cpp)

// Projection p of expert e of a quantized layer as a QuantSource.
QuantSource quant_source(const MoeLayer& L, int64_t e, int p);

// Where element (o, i) of expert e's projection p (its biases: element o)
// lies in a dense layer's stored tensor: src's element base + o*so + i*si,
// whatever the layout (per expert, fused, transposed, interleaved).
struct SourceWalk {
  const TensorRef* src = nullptr;
  int64_t base = 0, so = 0, si = 0;
};
SourceWalk source_walk(const MoeLayer& L, int proj, bool bias, int64_t e);

}  // namespace io
}  // namespace kt
