#include "quant_checkpoint.h"

#include <filesystem>

#include "kt_runner.h"

namespace kt_bench {

std::unique_ptr<QuantCheckpoint> QuantCheckpoint::write(const LayerWeights& layer, kt_weight_format format, int threads,
                                                        std::string* error) {
  if (!comes_from_checkpoint(format)) {
    *error = std::string("kt quantizes to ") + kt_weight_format_name(format) + " itself: no checkpoint to write";
    return nullptr;
  }
  const int64_t H = layer.shape.hidden, I = layer.shape.intermediate;
  const double start = now_seconds();
  std::unique_ptr<QuantCheckpoint> ck(new QuantCheckpoint());
  ck->dir_ = make_temp_dir(error);
  if (ck->dir_.empty()) return nullptr;
  const CheckpointLayer source{layer.gate.u16(), layer.up.u16(), layer.down.u16(), layer.experts, layer.shape.top_k, H, I};
  if (!write_quant_checkpoint(source, format, threads, ck->dir_, error)) return nullptr;
  const kt_status st = kt_ckpt_open(ck->dir_.c_str(), &ck->ckpt_);
  if (st != KT_OK) {
    *error = kt_error("kt_ckpt_open", st);
    return nullptr;
  }
  std::error_code ec;
  ck->file_bytes_ = static_cast<double>(std::filesystem::file_size(ck->dir_ + "/model.safetensors", ec));
  ck->write_seconds_ = now_seconds() - start;
  return ck;
}

QuantCheckpoint::~QuantCheckpoint() {
  kt_ckpt_close(ckpt_);
  std::error_code ec;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
}

}  // namespace kt_bench
