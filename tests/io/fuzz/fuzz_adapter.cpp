// libFuzzer target: a PEFT adapter directory (adapter_config.json +
// adapter_model.safetensors, or an index) through kt_ckpt_adapter_read_config
// and kt_ckpt_adapter_read, with destinations shaped from the tensors found
// (and one expert more, which must fail cleanly).
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "fuzz_bundle.h"
#include "fuzz_check.h"
#include "fuzz_host.h"
#include "kt_c_api.h"

namespace {

using kt_fuzz::checked;
using kt_fuzz::F32Tensor;

// The layer, expert and projection a PEFT key names; false for other keys.
bool parse_key(const std::string& k, int64_t* layer, int64_t* expert, int* proj, bool* a) {
  const size_t l = k.find("layers.");
  const size_t e = k.find(".experts.");
  if (l == std::string::npos || e == std::string::npos || e < l) return false;
  *layer = std::strtoll(k.c_str() + l + 7, nullptr, 10);
  char* rest = nullptr;
  *expert = std::strtoll(k.c_str() + e + 9, &rest, 10);
  const std::string tail = rest ? rest : "";
  static const char* kNames[6] = {".gate_proj.", ".up_proj.", ".down_proj.", ".w1.", ".w3.", ".w2."};
  *proj = -1;
  for (int p = 0; p < 6; ++p)
    if (tail.find(kNames[p]) == 0) *proj = p % 3;
  *a = tail.find(".lora_A.") != std::string::npos;
  return *proj >= 0 && *layer >= 0 && *layer < (1 << 20) && *expert >= 0 && *expert < 64;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static kt_fuzz::Scratch scratch;
  scratch.materialize(kt_fuzz::parse_bundle(data, size));
  const char* dir = scratch.dir().c_str();
  kt_ckpt_adapter_config c;
  c.struct_size = sizeof(c);
  checked(kt_ckpt_adapter_read_config(dir, &c), "kt_ckpt_adapter_read_config");

  // Destination shapes from the tensors of expert 0, per layer and projection.
  struct Proj {
    int64_t experts = 0;
    std::vector<int64_t> a, b;
  };
  std::map<int64_t, std::array<Proj, 3>> layers;
  kt_ckpt* ck = nullptr;
  if (kt_ckpt_open(dir, &ck) == KT_OK) {
    kt_ckpt_info info;
    info.struct_size = sizeof(info);
    if (kt_ckpt_get_info(ck, &info) == KT_OK)
      for (int64_t i = 0; i < info.num_tensors && i < 256; ++i) {
        kt_ckpt_tensor t;
        t.struct_size = sizeof(t);
        if (kt_ckpt_tensor_at(ck, i, &t) != KT_OK || t.ndim != 2) continue;
        int64_t L, e;
        int p;
        bool a;
        if (!parse_key(t.name, &L, &e, &p, &a) || layers.size() >= 4) continue;
        if (t.shape[0] <= 0 || t.shape[1] <= 0 || t.shape[0] > 256 || t.shape[1] > 256) continue;
        Proj& pr = layers[L][p];
        pr.experts = std::max(pr.experts, e + 1);
        if (e == 0) (a ? pr.a : pr.b) = {t.shape[0], t.shape[1]};
      }
    kt_ckpt_close(ck);
  }
  if (layers.empty()) layers[0][0] = Proj{1, {1, 4}, {4, 1}};
  for (auto& kv : layers) {
    for (int extra = 0; extra < 2; ++extra) {
      std::vector<F32Tensor> dests;
      dests.reserve(6);
      std::vector<kt_arg> args;
      static const int kA[3] = {KT_ARG_LORA_A_GATE, KT_ARG_LORA_A_UP, KT_ARG_LORA_A_DOWN};
      static const int kB[3] = {KT_ARG_LORA_B_GATE, KT_ARG_LORA_B_UP, KT_ARG_LORA_B_DOWN};
      for (int p = 0; p < 3; ++p) {
        const Proj& pr = kv.second[p];
        if (pr.a.empty() || pr.b.empty() || pr.experts * pr.a[0] * pr.a[1] > (1 << 16) ||
            pr.experts * pr.b[0] * pr.b[1] > (1 << 16))
          continue;
        const int64_t E = pr.experts + extra;
        dests.emplace_back(std::vector<int64_t>{E, pr.a[0], pr.a[1]});
        args.push_back({kA[p], &dests.back().t});
        dests.emplace_back(std::vector<int64_t>{E, pr.b[0], pr.b[1]});
        args.push_back({kB[p], &dests.back().t});
      }
      const kt_status st = checked(kt_ckpt_adapter_read(dir, kv.first, args.data(), args.size()),
                                   "kt_ckpt_adapter_read");
      // Nothing is written when the call fails.
      if (st != KT_OK)
        for (const F32Tensor& d : dests)
          for (float v : d.data)
            if (v != 0.f) std::abort();
    }
  }
  return 0;
}
