// libFuzzer target: distributed checkpoints (kt_dist_ckpt_load) on a fuzzed
// checkpoint directory (the manifest and the rank files, as a bundle), into
// the layers of fuzz_dist_setups.h: each alone and both together. A refused
// load must leave every layer and optimizer as it was and the communicator
// usable; a load that succeeds must give optimizers that step, and state
// that saves and loads again.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "fuzz_bundle.h"
#include "fuzz_check.h"
#include "fuzz_dist_setups.h"
#include "fuzz_host.h"
#include "kt_c_api.h"

namespace {

using kt_fuzz::checked;

bool comm_usable(kt_comm* comm) {
  kt_comm_info info;
  info.struct_size = sizeof(info);
  return kt_comm_get_info(comm, &info) == KT_OK && info.usable == 1;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static kt_fuzz::Scratch scratch;
  static const auto setup = [] {
    auto s = kt_fuzz::dist_setup(kt_fuzz::engine());
    if (!s) std::abort();  // built only with Gloo
    return s;
  }();
  scratch.materialize(kt_fuzz::parse_bundle(data, size));
  const std::string again = scratch.root() + "/again";
  for (const std::vector<size_t>& which : {std::vector<size_t>{0}, {1}, {0, 1}}) {
    const std::vector<kt_dist_ckpt_layer> layers = setup->ckpt_layers(which);
    std::vector<std::string> before;
    for (size_t i : which) before.push_back(kt_fuzz::snapshot(*setup->layers[i]));
    const kt_status st = checked(kt_dist_ckpt_load(setup->comm, scratch.dir().c_str(), layers.data(),
                                                   layers.size(), nullptr), "kt_dist_ckpt_load");
    if (!comm_usable(setup->comm)) std::abort();
    if (st != KT_OK) {
      for (size_t j = 0; j < which.size(); ++j)
        if (kt_fuzz::snapshot(*setup->layers[which[j]]) != before[j]) std::abort();
      continue;
    }
    for (size_t i : which)
      if (checked(kt_optimizer_step(setup->layers[i]->opt, nullptr), "kt_optimizer_step") != KT_OK) std::abort();
    // What was loaded is a state kt itself saves and loads.
    if (checked(kt_dist_ckpt_save(setup->comm, again.c_str(), layers.data(), layers.size(), nullptr),
                "kt_dist_ckpt_save") != KT_OK ||
        checked(kt_dist_ckpt_load(setup->comm, again.c_str(), layers.data(), layers.size(), nullptr),
                "kt_dist_ckpt_load") != KT_OK)
      std::abort();
  }
  return 0;
}
