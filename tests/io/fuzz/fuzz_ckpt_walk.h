// What the checkpoint fuzz targets do with a fuzzed checkpoint directory,
// through the public ABI: kt_ckpt_open (config.json layout and quantization
// detection), every info query, kt_ckpt_read_layer into fp32 tensors and
// kt_ckpt_load_layer into a layer made from kt_ckpt_moe_options, and for
// quantized layers kt_ckpt_load_layer_with(dequantize) into a bf16 layer
// (small layers only).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_check.h"
#include "fuzz_host.h"
#include "kt_c_api.h"

namespace kt_fuzz {

inline void walk_checkpoint(const std::string& dir) {
  kt_ckpt* ck = nullptr;
  if (checked(kt_ckpt_open(dir.c_str(), &ck), "kt_ckpt_open") != KT_OK) return;
  kt_ckpt_info info;
  info.struct_size = sizeof(info);
  checked(kt_ckpt_get_info(ck, &info), "kt_ckpt_get_info");
  for (int64_t i = 0; i < info.num_tensors && i < 64; ++i) {
    kt_ckpt_tensor t;
    t.struct_size = sizeof(t);
    if (checked(kt_ckpt_tensor_at(ck, i, &t), "kt_ckpt_tensor_at") == KT_OK)
      checked(kt_ckpt_find_tensor(ck, t.name, &t), "kt_ckpt_find_tensor");
  }
  for (int64_t i = 0; i < info.num_moe_layers; ++i) {
    kt_ckpt_layer_info li;
    li.struct_size = sizeof(li);
    if (checked(kt_ckpt_get_layer_info(ck, i, &li), "kt_ckpt_get_layer_info") != KT_OK) continue;
    kt_moe_options mo;
    kt_moe_options_init(&mo);  // kt_ckpt_moe_options writes struct_size bytes
    if (checked(kt_ckpt_moe_options(ck, li.layer, &mo), "kt_ckpt_moe_options") != KT_OK) continue;
    const int64_t E = li.num_experts, H = li.hidden, I = li.intermediate;
    const bool small = E > 0 && H > 0 && I > 0 && E <= 64 && H <= 512 && I <= 512 && E * H * I <= (1 << 16);
    if (!small) continue;
    F32Tensor g({E, I, H}), u({E, I, H}), d({E, H, I}), bg({E, I}), bu({E, I}), bd({E, H});
    std::vector<kt_arg> args = {{KT_ARG_W_GATE, &g.t}, {KT_ARG_W_UP, &u.t}, {KT_ARG_W_DOWN, &d.t}};
    if (li.has_bias) {
      args.push_back({KT_ARG_B_GATE, &bg.t});
      args.push_back({KT_ARG_B_UP, &bu.t});
      args.push_back({KT_ARG_B_DOWN, &bd.t});
    }
    checked(kt_ckpt_read_layer(ck, li.layer, args.data(), args.size()), "kt_ckpt_read_layer");
    mo.max_tokens = 2;
    kt_moe* moe = nullptr;
    if (checked(kt_moe_create(engine(), &mo, &moe), "kt_moe_create") != KT_OK) continue;
    checked(kt_ckpt_load_layer(ck, li.layer, moe, nullptr, nullptr), "kt_ckpt_load_layer");
    kt_moe_destroy(moe);
    if (li.format == KT_CKPT_FORMAT_DENSE) continue;
    // A quantized layer also goes into a bf16 layer, dequantized when asked.
    mo.weight_format = KT_FORMAT_BF16;
    moe = nullptr;
    if (checked(kt_moe_create(engine(), &mo, &moe), "kt_moe_create") != KT_OK) continue;
    kt_ckpt_load_options lo;
    kt_ckpt_load_options_init(&lo);
    lo.dequantize = 1;
    checked(kt_ckpt_load_layer_with(ck, li.layer, moe, &lo, nullptr, nullptr), "kt_ckpt_load_layer_with");
    kt_moe_destroy(moe);
  }
  kt_ckpt_close(ck);
}

}  // namespace kt_fuzz
