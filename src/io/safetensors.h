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

#include "core/error.h"
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

// A directory opened once. The files of one checkpoint are opened relative
// to it, so a reader sees one version of a directory that a writer replaces
// as a whole (io/publish.h), never files of two versions.
class DirHandle {
 public:
  explicit DirHandle(const std::string& path);  // KT_ERR_IO when not a directory
  ~DirHandle();
  DirHandle(const DirHandle&) = delete;
  DirHandle& operator=(const DirHandle&) = delete;
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  std::string label(const std::string& name) const { return path_ + "/" + name; }
  bool has(const std::string& name) const;  // an entry of that name exists (links followed)
  // Whether path still names the directory opened (false once a writer has
  // swapped a new version in).
  bool still_current() const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t dev_ = 0, ino_ = 0;
};

// A read-only private mapping of a whole regular file. Anything else (a FIFO,
// a device, a directory) is refused without blocking on it.
// Drops the resident pages that lie wholly inside [data, data + bytes) of a
// read-only file mapping from the process (they stay in the page cache and
// are read again on the next access), so a loader that has consumed them
// does not keep a second copy of the checkpoint resident.
void release_mapped_pages(const void* data, size_t bytes);
// Asks the kernel to start reading [data, data + bytes) of a file mapping
// now, in large requests, so that a loader touching it later finds it in the
// page cache instead of faulting it in a few pages at a time.
void prefetch_mapped_pages(const void* data, size_t bytes);

class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  // listed_in: the index naming the file; when given, a file that resolves
  // outside dir (a symlink out) is refused.
  MappedFile(const DirHandle& dir, const std::string& name, const std::string& listed_in = "");
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  void map(int fd);
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// One mapped and validated safetensors file.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(std::unique_ptr<MappedFile> map);
  const std::string& path() const { return map_->path(); }
  const ParsedHeader& header() const { return header_; }
  const uint8_t* tensor_data(const TensorEntry& t) const {
    return map_->data() + header_.data_offset + t.begin;
  }
  uint64_t file_size() const { return map_->size(); }

 private:
  std::unique_ptr<MappedFile> map_;
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
  explicit TensorSet(std::shared_ptr<const DirHandle> dir);
  const std::string& dir() const { return dir_->path(); }
  const DirHandle& handle() const { return *dir_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  // Sorted by name.
  const std::map<std::string, TensorRef>& tensors() const { return tensors_; }
  const TensorRef* find(const std::string& name) const;
  const TensorRef& get(const std::string& name) const;  // KT_ERR_IO when missing

 private:
  std::shared_ptr<const DirHandle> dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorRef> tensors_;
};

// Reads a whole (small: at most kMaxHeaderBytes) regular file; KT_ERR_IO
// naming it on failure, without blocking on a FIFO or device.
std::string read_text_file(const std::string& path);
std::string read_text_file(const DirHandle& dir, const std::string& name);

// Runs read(dir) on the directory at path, opened once, and gives its
// result only if path still names that directory afterwards: a writer swaps
// the new version in before it deletes the old one, so a read that overlapped
// the deletion (where a file such as config.json may already be gone) is
// noticed and made again on the new version. KT_ERR_IO after five tries.
template <class F>
auto read_consistent(const std::string& path, F&& read) {
  constexpr int kTries = 5;
  for (int attempt = 1;; ++attempt) {
    auto dir = std::make_shared<const DirHandle>(path);
    try {
      auto result = read(dir);
      if (dir->still_current()) return result;
    } catch (const Error&) {
      if (attempt >= kTries || dir->still_current()) throw;
    }
    if (attempt >= kTries)
      fail(KT_ERR_IO, path + ": replaced by a writer while it was read, " + std::to_string(kTries) +
                          " times in a row");
  }
}

}  // namespace io
}  // namespace kt
