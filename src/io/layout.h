// MoE layouts of Hugging Face checkpoints: which tensors hold each layer's
// routed experts, their logical shapes and storage format, found from the
// tensor names and checked against config.json.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "io/safetensors.h"
#include "kt_c_api.h"

namespace kt {
namespace io {

// A checkpoint tensor with its name (an entry of TensorSet::tensors()).
using NamedTensor = std::pair<const std::string, TensorRef>;

enum Proj3 { kProjGate = 0, kProjUp = 1, kProjDown = 2 };

// One projection of one expert (per-expert layouts): the weight tensor plus
// its scale and bias tensors where the format has them.
struct ProjTensors {
  const TensorRef* weight = nullptr;  // weight, or weight_packed
  const TensorRef* scale = nullptr;   // weight_scale_inv, weight_scale or scale
  const TensorRef* zero = nullptr;    // weight_zero_point (asymmetric int4)
  const TensorRef* bias = nullptr;
};

struct MoeLayer {
  int64_t layer = 0;
  std::string prefix;  // "model.layers.3.mlp.experts"
  kt_ckpt_layout layout = KT_CKPT_LAYOUT_NONE;
  kt_ckpt_format format = KT_CKPT_FORMAT_DENSE;
  kt_ckpt_dtype weight_dtype = KT_CKPT_DTYPE_UNKNOWN;
  int64_t E = 0, H = 0, I = 0;
  bool has_bias = false;
  int64_t bytes = 0;
  // Per-expert layouts (PER_EXPERT, MIXTRAL): [E][gate, up, down].
  std::vector<std::array<ProjTensors, 3>> experts;
  // Fused layouts: stacked tensors.
  const TensorRef* gate_up = nullptr;
  const TensorRef* down = nullptr;
  const TensorRef* gate_up_bias = nullptr;
  const TensorRef* down_bias = nullptr;
  // gpt-oss MXFP4: gate_up and down are the _blocks, these the _scales.
  const TensorRef* gate_up_scales = nullptr;
  const TensorRef* down_scales = nullptr;
  // Every checkpoint tensor of the layer's routed experts that the layout
  // recognised (weights, scales, zero points, shapes, biases), in name order.
  std::vector<const NamedTensor*> tensors;
  // Quantized layers: the kt_moe format that holds the experts as stored,
  // the inputs per scale, and, when no format does (or a dequantizing load
  // is the only way), why.
  kt_weight_format native_format = KT_FORMAT_BF16;
  int64_t group = 0;
  int64_t block_rows = 1;  // rows per scale row (fp8 blocks: 128)
  bool asymmetric = false;
  bool decodable = false;  // kt can dequantize it (a format it decodes)
  std::string unsupported;
  bool quantized() const { return format != KT_CKPT_FORMAT_DENSE; }
  bool loadable() const;
  // Whether a dequantizing load can read it (a quantized format kt decodes).
  bool dequantizable() const;
};

struct ModelInfo {
  std::string architecture, model_type;
  int64_t top_k = 0;
  kt_activation activation = KT_ACT_SILU;
  float act_alpha = 1.702f, act_limit = 0.f;
  kt_ckpt_layout layout = KT_CKPT_LAYOUT_NONE;
  std::vector<MoeLayer> layers;  // ascending layer number
  const MoeLayer* find(int64_t layer) const;
  const MoeLayer& get(int64_t layer, const char* where) const;
};

// config_text may be empty (no config.json). `dir` names the checkpoint in
// messages.
ModelInfo detect_layout(const TensorSet& tensors, const std::string& config_text,
                        const std::string& dir);

// Copies a layer's weights into stacked host tensors (see kt_ckpt_read_layer).
void read_layer(const MoeLayer& layer, const kt_arg* args, size_t num_args, const char* where);

// Canonical key names of one expert projection's weight: the HF key of the
// model ("model.layers.{L}.mlp.experts.{e}.gate_proj") without ".weight".
std::string expert_module_name(kt_ckpt_layout naming, int64_t layer, int64_t expert, int proj);

}  // namespace io
}  // namespace kt
