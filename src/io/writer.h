// safetensors and text files through the publishing rules of io/publish.h.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "io/publish.h"
#include "kt_c_api.h"

namespace kt {
namespace io {

struct TensorToWrite {
  std::string name;
  kt_ckpt_dtype dtype = KT_CKPT_DTYPE_F32;
  std::vector<int64_t> shape;
  // Writes the tensor's nbytes() bytes (row-major) into dst.
  std::function<void(uint8_t* dst)> fill;
  uint64_t nbytes() const;
};

// Writes a safetensors file: tensors ordered by element size (largest first)
// then name, so every tensor starts aligned to its element size; the data
// area is contiguous, as the format's reference reader requires. The header
// is built (and every name checked) before the file is created.
void write_safetensors(const std::string& path, std::vector<TensorToWrite> tensors,
                       const std::map<std::string, std::string>& metadata,
                       AtomicFile::Mode mode = AtomicFile::kReplace);

void write_text(const std::string& path, const std::string& text, AtomicFile::Mode mode = AtomicFile::kReplace);

}  // namespace io
}  // namespace kt
