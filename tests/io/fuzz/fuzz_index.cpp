// libFuzzer target: a sharded checkpoint directory (model.safetensors.index.json
// with its shards, or one model.safetensors / adapter_model.safetensors),
// through the internal TensorSet: every accepted tensor's bytes lie inside
// its mapped file and are read in full.
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "core/error.h"
#include "fuzz_bundle.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static kt_fuzz::Scratch scratch;
  scratch.materialize(kt_fuzz::parse_bundle(data, size));
  try {
    const kt::io::TensorSet ts(std::make_shared<const kt::io::DirHandle>(scratch.dir()));
    uint64_t sum = 0;
    for (const auto& kv : ts.tensors()) {
      const kt::io::TensorRef& r = kv.second;
      const uint8_t* begin = r.file->tensor_data(*r.entry);
      if (begin != r.data) std::abort();
      const uint64_t n = r.entry->nbytes();
      if (r.file->header().data_offset + r.entry->end > r.file->file_size()) std::abort();
      for (uint64_t i = 0; i < n; ++i) sum += r.data[i];
    }
    if (sum == 1) std::abort();  // keeps the reads
  } catch (const kt::Error& e) {
    if (e.status() != KT_ERR_IO) std::abort();
  }
  return 0;
}
