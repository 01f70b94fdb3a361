// The distributed layers whose checkpoints seed the dist_ckpt fuzz target,
// and that it loads fuzzed checkpoints into. One rank (Gloo, world size 1)
// holds layer 0, expert parallel in LoRA mode (fp32 factors, AdamW), and
// layer 3, owner mode, full fine-tuning of bf16 weights (SGD with momentum).
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_optim_setups.h"
#include "kt_c_api.h"

namespace kt_fuzz {

struct DistLayer : OptimSetup {
  int64_t number = 0;
  kt_dist_moe* dist = nullptr;
  ~DistLayer() {
    kt_optimizer_destroy(opt);  // before the layer it steps
    opt = nullptr;
    kt_dist_moe_destroy(dist);
  }
};

struct DistSetup {
  kt_comm* comm = nullptr;
  std::vector<std::unique_ptr<DistLayer>> layers;
  ~DistSetup() {
    layers.clear();
    kt_comm_destroy(comm);
  }
  std::vector<kt_dist_ckpt_layer> ckpt_layers(const std::vector<size_t>& which) const {
    std::vector<kt_dist_ckpt_layer> out;
    for (size_t i : which) out.push_back({layers[i]->number, layers[i]->dist, layers[i]->opt});
    return out;
  }
};

inline std::unique_ptr<DistLayer> dist_layer(kt_comm* comm, kt_engine* engine, int64_t number, kt_mode mode,
                                             kt_dist_mode dist_mode, const kt_optimizer_options& o, DLDataType dtype) {
  auto l = std::make_unique<DistLayer>();
  l->number = number;
  l->owns_layer = false;
  const kt_moe_options mo = small_layer_options(mode);
  kt_dist_moe_options dopt;
  kt_dist_moe_options_init(&dopt);
  dopt.mode = dist_mode;
  must_ok(kt_dist_moe_create(comm, engine, &mo, &dopt, &l->dist));
  must_ok(kt_dist_moe_layer(l->dist, &l->layer));
  train_layer(l.get(), mo, o, dtype);
  return l;
}

// nullptr when this build has no Gloo.
inline std::unique_ptr<DistSetup> dist_setup(kt_engine* engine) {
  char store[] = "/tmp/kt_fuzz_store.XXXXXX";
  if (!mkdtemp(store)) return nullptr;
  kt_comm_options co;
  kt_comm_options_init(&co);
  co.backend = "gloo";
  co.rank = 0;
  co.world_size = 1;
  co.store_path = store;
  auto s = std::make_unique<DistSetup>();
  const kt_status st = kt_comm_create(&co, &s->comm);
  std::system((std::string("rm -rf ") + store).c_str());
  if (st != KT_OK) return nullptr;
  kt_optimizer_options adamw, sgd;
  kt_optimizer_options_init(&adamw);
  kt_optimizer_options_init(&sgd);
  sgd.algorithm = KT_OPTIM_SGD;
  sgd.momentum = 0.9;
  s->layers.push_back(dist_layer(s->comm, engine, 0, KT_MODE_LORA, KT_DIST_EXPERT_PARALLEL, adamw, kF32));
  s->layers.push_back(dist_layer(s->comm, engine, 3, KT_MODE_FULL, KT_DIST_OWNER, sgd, kBF16));
  return s;
}

}  // namespace kt_fuzz
