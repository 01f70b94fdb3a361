// One MoE layer's bf16 experts quantized and written as a quantized
// checkpoint stores them. kt quantizes only to the integer formats; fp8 and
// MXFP4 bases come from checkpoints. For those the benchmarks quantize their
// bf16 weights into the checkpoint's real layout and write a one-layer
// safetensors checkpoint with its config.json, which kt loads with
// kt_ckpt_load_layer. Nothing here calls kt: kt_ab, which reaches its two
// libraries through dlopen only, writes with it too.
// - fp8_b128 (DeepSeek-V3 / Kimi-K2): per expert `weight` F8_E4M3 [out, in]
//   and `weight_scale_inv` F32 [ceil(out/128), ceil(in/128)], scale_inv =
//   max|W| / 448 of its block, codes round to nearest even; quantization_config
//   quant_method fp8, fmt e4m3, weight_block_size [128, 128], activation_scheme
//   dynamic.
// - mxfp4 (DeepSeek-V4 style, per expert): `weight` U8 [out, in/2] (two e2m1
//   codes a byte, the even element in the low nibble) and `scale` U8 (e8m0)
//   [out, ceil(in/32)], scale 2^(floor(log2 max|W|) - 2) of its 32 inputs as
//   the OCP MX rule sets it; quantization_config quant_method mxfp4.
// - int4_g32_zp, int4_g128_zp (compressed-tensors asymmetric int4, as
//   Kimi-K2-Thinking-style checkpoints with zero points store it):
//   `weight_packed` I32, `weight_scale` BF16, `weight_zero_point` I32 and
//   `weight_shape`, min/max per (row, group) mapped onto the 16 codes;
//   quantization_config compressed-tensors pack-quantized, symmetric false.
#ifndef KT_BENCH_CHECKPOINT_WRITER_H_
#define KT_BENCH_CHECKPOINT_WRITER_H_

#include <cstdint>
#include <string>

#include "kt_c_api.h"

namespace kt_bench {

// The layer number in the checkpoint's tensor names.
inline constexpr int64_t kCheckpointLayer = 0;

// True for the formats kt holds only as a checkpoint stores them.
bool comes_from_checkpoint(kt_weight_format format);
// True for the asymmetric int4 formats (zero points).
bool asymmetric_int4(kt_weight_format format);

// The layer's bf16 weights, stacked as kt_moe_load_weights takes them:
// gate and up [experts, intermediate, hidden], down [experts, hidden,
// intermediate].
struct CheckpointLayer {
  const uint16_t* gate = nullptr;
  const uint16_t* up = nullptr;
  const uint16_t* down = nullptr;
  int64_t experts = 0, top_k = 0, hidden = 0, intermediate = 0;
};

// A new directory under $TMPDIR (default /tmp); "" with *error set on failure.
std::string make_temp_dir(std::string* error);

// Quantizes the layer to format (comes_from_checkpoint) on `threads` threads
// and writes model.safetensors and config.json into dir; false with *error
// set on failure (the caller removes dir).
bool write_quant_checkpoint(const CheckpointLayer& layer, kt_weight_format format, int threads, const std::string& dir,
                            std::string* error);

}  // namespace kt_bench

#endif  // KT_BENCH_CHECKPOINT_WRITER_H_
