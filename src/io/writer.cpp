#include "io/writer.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "core/buffer.h"
#include "core/error.h"
#include "io/safetensors.h"

namespace kt {
namespace io {

uint64_t TensorToWrite::nbytes() const {
  uint64_t n = st_dtype_info(dtype).size;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

void write_safetensors(const std::string& path, std::vector<TensorToWrite> tensors,
                       const std::map<std::string, std::string>& metadata, AtomicFile::Mode mode) {
  std::stable_sort(tensors.begin(), tensors.end(), [](const TensorToWrite& a, const TensorToWrite& b) {
    const size_t sa = st_dtype_info(a.dtype).size, sb = st_dtype_info(b.dtype).size;
    return sa != sb ? sa > sb : a.name < b.name;
  });
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    if (header.contains(t.name)) fail(KT_ERR_INTERNAL, path + ": tensor '" + t.name + "' written twice");
    const uint64_t n = t.nbytes();
    header[t.name] = {{"dtype", st_dtype_info(t.dtype).st_name}, {"shape", t.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text += ' ';  // the data area starts 8-byte aligned
  AtomicFile f(path, mode);
  uint8_t len[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
  f.write(len, 8);
  f.write(text.data(), text.size());
  kt::Buffer<uint8_t> buf;
  for (const auto& t : tensors) {
    const size_t bytes = static_cast<size_t>(t.nbytes());
    if (bytes == 0) continue;
    buf.resize(bytes);
    t.fill(buf.data());
    f.write(buf.data(), bytes);
  }
  f.commit();
}

void write_text(const std::string& path, const std::string& text, AtomicFile::Mode mode) {
  AtomicFile f(path, mode);
  f.write(text.data(), text.size());
  f.commit();
}

}  // namespace io
}  // namespace kt
