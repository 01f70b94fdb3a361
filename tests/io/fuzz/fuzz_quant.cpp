// libFuzzer target: the quantization configs of config.json. Each input is a
// config.json, put beside the tensors of each synthetic quantized checkpoint
// (DeepSeek-V3 FP8 blocks, compressed-tensors int4 groups with zero points,
// gpt-oss and DeepSeek-V4 MXFP4) and walked through the public ABI
// (fuzz_ckpt_walk.h): so the config's parser, and every layer reader the
// config can send those tensors to, meet hostile settings.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_bundle.h"
#include "fuzz_ckpt_walk.h"
#include "quant_ckpt_builder.h"

namespace {

// One scratch directory per checkpoint, holding its tensors.
std::vector<std::unique_ptr<kt_fuzz::Scratch>> quantized_checkpoints() {
  using namespace kt_io_test::quant;
  constexpr int64_t E = 2, H = 32, I = 32;
  const QuantCkpt ckpts[] = {fp8_ckpt(0, E, H, I, 1), int4_ckpt(0, E, H, I, 32, false, 4),
                             gpt_oss_ckpt(0, E, H, I, 2), dsv4_ckpt(0, E, H, I, 3)};
  std::vector<std::unique_ptr<kt_fuzz::Scratch>> out;
  for (const QuantCkpt& q : ckpts) {
    out.push_back(std::make_unique<kt_fuzz::Scratch>("." + std::to_string(out.size())));
    out.back()->materialize({});
    q.write(out.back()->dir());
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto checkpoints = quantized_checkpoints();
  const std::string config(reinterpret_cast<const char*>(data), size);
  for (const auto& c : checkpoints) {
    c->write_file(c->dir() + "/config.json", config);
    kt_fuzz::walk_checkpoint(c->dir());
  }
  return 0;
}
