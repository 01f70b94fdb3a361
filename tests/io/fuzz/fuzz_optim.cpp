// libFuzzer target: kt's optimizer state files (kt_optimizer_load) on a
// fuzzed file, into each optimizer of fuzz_optim_setups.h. A refused load
// must leave everything as it was: every state tensor, the step count, the
// hyperparameters and the host's tensors. A load that succeeds must give an
// optimizer that steps, and whose state saves and loads again.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_bundle.h"
#include "fuzz_check.h"
#include "fuzz_host.h"
#include "fuzz_optim_setups.h"
#include "kt_c_api.h"

namespace {

using kt_fuzz::checked;
using kt_fuzz::snapshot;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static kt_fuzz::Scratch scratch;
  static const auto setups = kt_fuzz::optim_setups(kt_fuzz::engine());
  scratch.materialize({});
  const std::string path = scratch.dir() + "/optimizer.safetensors";
  const std::string again = scratch.dir() + "/saved_again.safetensors";
  scratch.write_file(path, std::string(reinterpret_cast<const char*>(data), size));
  for (const auto& s : setups) {
    const std::string before = snapshot(*s);
    if (checked(kt_optimizer_load(s->opt, path.c_str()), "kt_optimizer_load") != KT_OK) {
      if (snapshot(*s) != before) std::abort();
      continue;
    }
    int nonfinite = -1;
    kt_optimizer_step_options so;
    kt_optimizer_step_options_init(&so);
    so.found_nonfinite = &nonfinite;
    if (checked(kt_optimizer_step(s->opt, &so), "kt_optimizer_step") != KT_OK || nonfinite != 0) std::abort();
    // What was loaded is a state kt itself saves and loads.
    if (checked(kt_optimizer_save(s->opt, again.c_str()), "kt_optimizer_save") != KT_OK) std::abort();
    if (checked(kt_optimizer_load(s->opt, again.c_str()), "kt_optimizer_load") != KT_OK) std::abort();
  }
  return 0;
}
