#include "io/layout_parts.h"

// fp8 e4m3 weights in blocks (KT_CKPT_FORMAT_FP8_BLOCK), held as fp8_b128:
// DeepSeek's (quant_method fp8, weight_scale_inv) and compressed-tensors'
// float-quantized (weight_scale) checked against their config.

namespace kt {
namespace io {

namespace {

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

}  // namespace

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
  m.group = b1;
  m.block_rows = b0;
  m.decodable = true;
  m.native_format = KT_FORMAT_FP8_B128;
  k.per_expert([&](const ProjTensors& pt, int64_t out, int64_t in) {
    check_scale_tensor(pt.scale, "fp8 block scales", ceil_div64(out, b0), ceil_div64(in, b1), kFloatScales, "float",
                       from + " for weight " + shape_text(pt.weight->entry->shape));
  });
}

}  // namespace io
}  // namespace kt
