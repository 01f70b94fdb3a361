// Atomic file writers: each file goes to a temporary name in its directory,
// is fsync'ed, then renamed over the final name (and the directory fsync'ed),
// so readers see either the old file or the whole new one.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

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
// area is contiguous, as the format's reference reader requires.
void write_safetensors_atomic(const std::string& path, std::vector<TensorToWrite> tensors,
                              const std::map<std::string, std::string>& metadata);

void write_text_atomic(const std::string& path, const std::string& text);

// A file written under a temporary name in its final directory; commit()
// fsyncs it, renames it into place and fsyncs the directory. Destroyed
// uncommitted, the temporary file is removed and the final name untouched.
class AtomicFile {
 public:
  explicit AtomicFile(const std::string& final_path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t n);
  void write_zeros(size_t n);
  uint64_t bytes_written() const { return written_; }
  void commit();

 private:
  std::string final_, temp_;
  int fd_ = -1;
  bool committed_ = false;
  uint64_t written_ = 0;
};

// Creates dir (and its parents) when missing; KT_ERR_IO naming it otherwise.
void ensure_directory(const std::string& dir);

}  // namespace io
}  // namespace kt
