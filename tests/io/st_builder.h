// Test-side safetensors/checkpoint builder, written independently of
// src/io: byte-exact control of headers, offsets and file placement, so
// tests can make both well-formed checkpoints of each layout and broken ones.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"

namespace kt_io_test {

struct StTensor {
  std::string name;
  std::string dtype;  // "BF16", "F32", ...
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

inline size_t dtype_bytes(const std::string& d) {
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "BF16" || d == "F16" || d == "I16" || d == "U16") return 2;
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  return 1;
}

// The exact value every synthetic weight takes: multiples of 1/8 in [-1, 1],
// exact in bf16, fp16 and fp32 (tests/io/check_files.py has the same formula).
inline float synth_value(int64_t layer, int64_t e, int p, int64_t r, int64_t c) {
  return static_cast<float>(((layer * 5 + e * 7 + p * 11 + r * 3 + c) % 17) - 8) / 8.f;
}

inline void put(std::vector<uint8_t>& out, const std::string& dtype, float v) {
  if (dtype == "F32") {
    uint8_t b[4];
    std::memcpy(b, &v, 4);
    out.insert(out.end(), b, b + 4);
  } else {
    const uint16_t h = dtype == "BF16" ? kt::f32_to_bf16(v) : [&] {
      // the synthetic values are exact in fp16: build the bits directly
      if (v == 0.f) return uint16_t{0};
      uint32_t u;
      std::memcpy(&u, &v, 4);
      const uint32_t sign = (u >> 16) & 0x8000u;
      const int32_t exp = static_cast<int32_t>((u >> 23) & 0xff) - 127 + 15;
      return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp) << 10) | ((u & 0x7fffffu) >> 13));
    }();
    out.push_back(static_cast<uint8_t>(h & 0xff));
    out.push_back(static_cast<uint8_t>(h >> 8));
  }
}

// A [rows, cols] tensor whose element (r, c) is f(r, c).
template <class F>
StTensor matrix(const std::string& name, const std::string& dtype, int64_t rows, int64_t cols, F f) {
  StTensor t{name, dtype, {rows, cols}, {}};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) put(t.bytes, dtype, f(r, c));
  return t;
}

// A file with an arbitrary header text followed by `data_bytes` zero bytes.
inline std::vector<uint8_t> raw_file(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> out(8 + header.size() + data_bytes, 0);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<uint8_t>(n >> (8 * i));
  if (!header.empty()) std::memcpy(out.data() + 8, header.data(), header.size());
  return out;
}

// The bytes of a safetensors file holding `tensors` in the given order,
// contiguous. The header is not padded, so the data area (and the tensors)
// may start at any alignment.
inline std::vector<uint8_t> safetensors_bytes(const std::vector<StTensor>& tensors) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  uint64_t off = 0;
  for (const auto& t : tensors) {
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes.size()}}};
    off += t.bytes.size();
  }
  std::vector<uint8_t> out = raw_file(h.dump(), 0);
  for (const auto& t : tensors) {
    const size_t at = out.size();
    out.resize(at + t.bytes.size());
    if (!t.bytes.empty()) std::memcpy(out.data() + at, t.bytes.data(), t.bytes.size());
  }
  return out;
}

inline void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

}  // namespace kt_io_test
