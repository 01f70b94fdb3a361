#include "io/writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/buffer.h"
#include "core/error.h"
#include "io/safetensors.h"

namespace kt {
namespace io {

namespace {

[[noreturn]] void io_fail(const std::string& message) { fail(KT_ERR_IO, message); }

std::string directory_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

AtomicFile::AtomicFile(const std::string& final_path) : final_(final_path) {
  static std::atomic<unsigned> counter{0};
  const std::string base = final_path.substr(final_path.rfind('/') + 1);
  temp_ = directory_of(final_path) + "/." + base + ".tmp." + std::to_string(::getpid()) + "." +
          std::to_string(counter.fetch_add(1));
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0) io_fail(temp_ + ": cannot create: " + std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_.c_str());
}

void AtomicFile::write(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  written_ += n;
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      io_fail(final_ + ": write failed: " + std::strerror(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void AtomicFile::write_zeros(size_t n) {
  static const char zeros[4096] = {};
  while (n > 0) {
    const size_t chunk = n < sizeof(zeros) ? n : sizeof(zeros);
    write(zeros, chunk);
    n -= chunk;
  }
}

void AtomicFile::commit() {
  if (::fsync(fd_) != 0) io_fail(final_ + ": fsync failed: " + std::strerror(errno));
  if (::close(fd_) != 0) {
    fd_ = -1;
    io_fail(final_ + ": close failed: " + std::strerror(errno));
  }
  fd_ = -1;
  if (::rename(temp_.c_str(), final_.c_str()) != 0)
    io_fail(final_ + ": cannot rename the temporary file into place: " + std::strerror(errno));
  committed_ = true;
  const std::string dir = directory_of(final_);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // best effort: some file systems refuse directory fsync
    ::close(dfd);
  }
}

uint64_t TensorToWrite::nbytes() const {
  uint64_t n = st_dtype_info(dtype).size;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

void write_safetensors_atomic(const std::string& path, std::vector<TensorToWrite> tensors,
                              const std::map<std::string, std::string>& metadata) {
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
  AtomicFile f(path);
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

void write_text_atomic(const std::string& path, const std::string& text) {
  AtomicFile f(path);
  f.write(text.data(), text.size());
  f.commit();
}

void ensure_directory(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    io_fail(dir + ": cannot create the directory" + (ec ? ": " + ec.message() : std::string()));
}

}  // namespace io
}  // namespace kt
