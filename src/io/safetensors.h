// safetensors files: a strictly validated header over a read-only memory map
// (tensors are zero-copy views into the map), and sharded checkpoints joined
// through model.safetensors.index.json. Every error is a kt::Error with
// KT_ERR_IO naming the file and, where there is one, the tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kt_c_api.h"

namespace kt {
namespace io {

// Element types a safetensors header may name.
struct StDtypeInfo {
  kt_ckpt_dtype dtype;
  const char* st_name;  // as written in the header ("BF16")
  size_t size;          // bytes per element
};
// nullptr when the name is not a safetensors dtype.
const StDtypeInfo* st_dtype_by_name(const std::string& name);
const StDtypeInfo& st_dtype_info(kt_ckpt_dtype dtype);  // throws on KT_CKPT_DTYPE_UNKNOWN

constexpr int kMaxTensorRank = 8;
// Header bytes above this are refused (real headers are a few MiB).
constexpr uint64_t kMaxHeaderBytes = uint64_t{256} << 20;

struct TensorEntry {
  std::string name;
  kt_ckpt_dtype dtype = KT_CKPT_DTYPE_UNKNOWN;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets inside the data area
  uint64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

struct ParsedHeader {
  uint64_t header_bytes = 0;  // the JSON text length N
  uint64_t data_offset = 0;   // 8 + N
  std::vector<TensorEntry> tensors;  // sorted by name
  std::map<std::string, std::string> metadata;
};

// Parses and validates a whole safetensors image (the 8-byte length, the JSON
// header, every entry against the data area that follows it). `label` names
// the file in messages. Pure function of the bytes: the fuzz target calls it.
ParsedHeader parse_safetensors(const uint8_t* bytes, size_t size, const std::string& label);

// The weight_map of a model.safetensors.index.json text: tensor -> file name,
// each file name checked to be a plain relative path without "..".
std::map<std::string, std::string> parse_index(const std::string& text, const std::string& label);

// A read-only private mapping of a whole file.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// One mapped and validated safetensors file.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  const std::string& path() const { return map_.path(); }
  const ParsedHeader& header() const { return header_; }
  const uint8_t* tensor_data(const TensorEntry& t) const {
    return map_.data() + header_.data_offset + t.begin;
  }
  uint64_t file_size() const { return map_.size(); }

 private:
  MappedFile map_;
  ParsedHeader header_;
};

// A tensor of a checkpoint: its entry, its file, its mapped bytes.
struct TensorRef {
  const TensorEntry* entry = nullptr;
  const SafetensorsFile* file = nullptr;
  const uint8_t* data = nullptr;
};

// All safetensors files of a checkpoint directory: model.safetensors.index.json
// (sharded), else model.safetensors, else adapter_model.safetensors.
class TensorSet {
 public:
  explicit TensorSet(const std::string& dir);
  const std::string& dir() const { return dir_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  // Sorted by name.
  const std::map<std::string, TensorRef>& tensors() const { return tensors_; }
  const TensorRef* find(const std::string& name) const;
  const TensorRef& get(const std::string& name) const;  // KT_ERR_IO when missing

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorRef> tensors_;
};

// Reads a whole (small) text file; KT_ERR_IO naming it on failure.
std::string read_text_file(const std::string& path);
bool file_exists(const std::string& path);

// Resolves `name` (a plain relative file name from an index) inside `dir`
// and refuses absolute paths, ".." and symlinks that lead outside `dir`.
std::string resolve_inside(const std::string& dir, const std::string& name,
                           const std::string& label);

}  // namespace io
}  // namespace kt
