// libFuzzer target: a fuzzed checkpoint directory (config.json and the
// tensor files, as a bundle) walked through the public ABI
// (fuzz_ckpt_walk.h).
#include <cstdint>

#include "fuzz_bundle.h"
#include "fuzz_ckpt_walk.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static kt_fuzz::Scratch scratch;
  scratch.materialize(kt_fuzz::parse_bundle(data, size));
  kt_fuzz::walk_checkpoint(scratch.dir());
  return 0;
}
