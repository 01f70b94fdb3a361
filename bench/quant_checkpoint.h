// Quantized layers obtained as a host obtains them. kt quantizes only to
// the integer formats; fp8 and MXFP4 bases come from checkpoints. For those
// the benchmark quantizes its bf16 weights into the checkpoint's real layout,
// writes a one-layer safetensors checkpoint with its config.json into a
// temporary directory, and kt loads it with kt_ckpt_load_layer:
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
#ifndef KT_BENCH_QUANT_CHECKPOINT_H_
#define KT_BENCH_QUANT_CHECKPOINT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "kt_c_api.h"
#include "workload.h"

namespace kt_bench {

// True for the formats kt holds only as a checkpoint stores them.
bool comes_from_checkpoint(kt_weight_format format);
// True for the asymmetric int4 formats (zero points).
bool asymmetric_int4(kt_weight_format format);

class QuantCheckpoint {
 public:
  // The layer number in the checkpoint's tensor names.
  static constexpr int64_t kLayer = 0;

  // Writes layer's weights in format (comes_from_checkpoint) on `threads`
  // threads and opens the checkpoint; nullptr with *error set on failure
  // (nothing is left on disk then).
  static std::unique_ptr<QuantCheckpoint> write(const LayerWeights& layer, kt_weight_format format, int threads,
                                                std::string* error);
  ~QuantCheckpoint();  // closes the checkpoint and removes its directory
  QuantCheckpoint(const QuantCheckpoint&) = delete;
  QuantCheckpoint& operator=(const QuantCheckpoint&) = delete;

  const kt_ckpt* ckpt() const { return ckpt_; }
  double file_bytes() const { return file_bytes_; }
  double write_seconds() const { return write_seconds_; }

 private:
  QuantCheckpoint() = default;
  std::string dir_;
  kt_ckpt* ckpt_ = nullptr;
  double file_bytes_ = 0, write_seconds_ = 0;
};

}  // namespace kt_bench

#endif  // KT_BENCH_QUANT_CHECKPOINT_H_
