// A quantized layer obtained as a host obtains it: the layer written as a
// one-layer checkpoint (checkpoint_writer.h) into a temporary directory and
// opened with kt_ckpt_open, for kt_ckpt_load_layer.
#ifndef KT_BENCH_QUANT_CHECKPOINT_H_
#define KT_BENCH_QUANT_CHECKPOINT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "checkpoint_writer.h"
#include "kt_c_api.h"
#include "workload.h"

namespace kt_bench {

class QuantCheckpoint {
 public:
  // The layer number in the checkpoint's tensor names.
  static constexpr int64_t kLayer = kCheckpointLayer;

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
