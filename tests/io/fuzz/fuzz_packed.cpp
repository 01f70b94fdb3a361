// libFuzzer target: the packed cache loader (kt_moe_load_packed) on a fuzzed
// file, into layers of the seeds' shape with and without biases, in each
// weight format (bf16, int8 per channel, int4 groups of 32 and 128, fp8
// 128-blocks, mxfp4). Each input is tried as is and, to reach past the
// header checksum, with that checksum recomputed (and the section checksums
// skipped). A loaded layer must run a forward; a refused load must leave the
// layer as it was.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_bundle.h"
#include "fuzz_check.h"
#include "fuzz_host.h"
#include "io/packed_cache.h"
#include "kt_c_api.h"

namespace {

using kt_fuzz::checked;
using kt_fuzz::engine;

constexpr int64_t kE = 2, kH = 32, kI = 32, kT = 2;

kt_moe* layer(bool bias, kt_weight_format format) {
  kt_moe_options o;
  kt_moe_options_init(&o);
  o.num_experts = kE, o.hidden = kH, o.intermediate = kI, o.top_k = 1, o.max_tokens = kT;
  o.has_bias = bias ? 1 : 0;
  o.weight_format = format;
  kt_moe* m = nullptr;
  if (kt_moe_create(engine(), &o, &m) != KT_OK) std::abort();
  return m;
}

void forward(kt_moe* m) {
  std::vector<float> x(kT * kH, 0.25f), y(kT * kH), w(kT, 1.f);
  std::vector<int32_t> ids = {0, 1};
  int64_t xs[2] = {kT, kH}, is[2] = {kT, 1};
  DLTensor tx{x.data(), {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, xs, nullptr, 0};
  DLTensor ty{y.data(), {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, xs, nullptr, 0};
  DLTensor ti{ids.data(), {kDLCPU, 0}, 2, {kDLInt, 32, 1}, is, nullptr, 0};
  DLTensor tw{w.data(), {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, is, nullptr, 0};
  kt_arg a[4] = {{KT_ARG_X, &tx}, {KT_ARG_IDS, &ti}, {KT_ARG_ROUTE_WEIGHTS, &tw}, {KT_ARG_Y, &ty}};
  const kt_status st = checked(kt_moe_forward(m, a, 4, nullptr), "kt_moe_forward");
  // Experts the cache flags not loaded may be routed to: the forward refuses them.
  if (st != KT_OK && st != KT_ERR_NOT_LOADED) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static kt_fuzz::Scratch scratch;
  static const std::vector<kt_moe*> layers = [] {
    std::vector<kt_moe*> all;
    for (kt_weight_format f : {KT_FORMAT_BF16, KT_FORMAT_INT8_CHANNEL, KT_FORMAT_INT4_G32, KT_FORMAT_INT4_G128,
                               KT_FORMAT_FP8_B128, KT_FORMAT_MXFP4, KT_FORMAT_INT4_G32_ZP, KT_FORMAT_INT4_G128_ZP})
      for (bool bias : {false, true}) all.push_back(layer(bias, f));
    return all;
  }();
  scratch.materialize({});
  const std::string path = scratch.dir() + "/layer.ktpack";
  std::string bytes(reinterpret_cast<const char*>(data), size);
  for (int variant = 0; variant < 2; ++variant) {
    if (variant == 1) {
      if (bytes.size() < 512) break;
      const uint64_t h = kt::io::hash64(bytes.data(), 504);
      std::memcpy(&bytes[504], &h, 8);
    }
    scratch.write_file(path, bytes);
    for (kt_moe* m : layers) {
      int64_t before = -1;
      checked(kt_moe_num_loaded(m, &before), "kt_moe_num_loaded");
      const unsigned flags = variant == 1 ? KT_PACKED_SKIP_CHECKSUMS : 0u;
      if (checked(kt_moe_load_packed(m, path.c_str(), flags), "kt_moe_load_packed") == KT_OK) {
        forward(m);
      } else {
        int64_t after = -2;
        checked(kt_moe_num_loaded(m, &after), "kt_moe_num_loaded");
        if (after != before) std::abort();
      }
    }
  }
  return 0;
}
