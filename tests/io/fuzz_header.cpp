// libFuzzer target: the safetensors header parser and the index parser on
// arbitrary bytes. Either parser may refuse the input, but only with a
// kt::Error carrying KT_ERR_IO; an accepted header must describe tensors that
// lie inside the data area with sizes that agree with their dtypes and shapes,
// and the float ones are read in full through the element conversions.
#include <cstdint>
#include <cstdlib>
#include <string>

#include <vector>

#include "core/error.h"
#include "io/elements.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const kt::io::ParsedHeader h = kt::io::parse_safetensors(data, size, "fuzz.safetensors");
    const uint64_t data_size = size - h.data_offset;
    for (const auto& t : h.tensors) {
      if (t.end > data_size || t.begin > t.end) std::abort();
      if (t.nbytes() != t.numel() * kt::io::st_dtype_info(t.dtype).size) std::abort();
      const bool float_dt =
          t.dtype == KT_CKPT_DTYPE_F32 || t.dtype == KT_CKPT_DTYPE_BF16 || t.dtype == KT_CKPT_DTYPE_F16;
      if (!float_dt || t.numel() == 0) continue;
      std::vector<float> out(static_cast<size_t>(t.numel()));
      kt::io::convert_elements(data + h.data_offset + t.begin, t.dtype, out.data(), KT_CKPT_DTYPE_F32,
                               static_cast<int64_t>(t.numel()));
    }
  } catch (const kt::Error& e) {
    if (e.status() != KT_ERR_IO) std::abort();
  }
  try {
    const auto map = kt::io::parse_index(std::string(reinterpret_cast<const char*>(data), size), "fuzz.index.json");
    for (const auto& kv : map) {
      const std::string& f = kv.second;
      if (f.empty() || f[0] == '/') std::abort();
      const std::string wrapped = "/" + f + "/";
      if (wrapped.find("/../") != std::string::npos || wrapped.find("/./") != std::string::npos ||
          wrapped.find("//") != std::string::npos)
        std::abort();
    }
  } catch (const kt::Error& e) {
    if (e.status() != KT_ERR_IO) std::abort();
  }
  return 0;
}
