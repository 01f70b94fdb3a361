#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kt {
namespace io {

using nlohmann::json;

namespace {

const StDtypeInfo kDtypes[] = {
    {KT_CKPT_DTYPE_F32, "F32", 4},         {KT_CKPT_DTYPE_F16, "F16", 2},
    {KT_CKPT_DTYPE_BF16, "BF16", 2},       {KT_CKPT_DTYPE_F64, "F64", 8},
    {KT_CKPT_DTYPE_F8_E4M3, "F8_E4M3", 1}, {KT_CKPT_DTYPE_F8_E5M2, "F8_E5M2", 1},
    {KT_CKPT_DTYPE_E8M0, "F8_E8M0", 1},    {KT_CKPT_DTYPE_I8, "I8", 1},
    {KT_CKPT_DTYPE_U8, "U8", 1},           {KT_CKPT_DTYPE_I16, "I16", 2},
    {KT_CKPT_DTYPE_U16, "U16", 2},         {KT_CKPT_DTYPE_I32, "I32", 4},
    {KT_CKPT_DTYPE_U32, "U32", 4},         {KT_CKPT_DTYPE_I64, "I64", 8},
    {KT_CKPT_DTYPE_U64, "U64", 8},         {KT_CKPT_DTYPE_BOOL, "BOOL", 1},
};

[[noreturn]] void io_fail(const std::string& message) { fail(KT_ERR_IO, message); }

std::string printable(const std::string& s) {
  // Names come from untrusted files: keep messages printable and bounded.
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < 200; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) {
      out += '?';
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > 200) out += "...";
  return out + "'";
}

// A non-negative integer that fits int64 (JSON numbers may be negative,
// fractional or huge).
bool as_count(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return *out <= static_cast<uint64_t>(INT64_MAX);
  }
  if (v.is_number_integer()) {
    const int64_t s = v.get<int64_t>();
    if (s < 0) return false;
    *out = static_cast<uint64_t>(s);
    return true;
  }
  return false;
}

// Parses JSON text, refusing duplicate keys in the top-level object (the
// library would silently keep the last one).
// The top-level keys of a JSON text, for its duplicates, in one linear pass
// (nlohmann's DOM parser keeps the last of two equal keys silently, and its
// callback parser rescans an object's members at the end of each member:
// quadratic in a 50k-tensor header).
class TopLevelKeys : public json::json_sax_t {
 public:
  std::string duplicate;

  bool key(string_t& k) override {
    if (depth_ == 1 && !seen_.insert(k).second && duplicate.empty()) duplicate = k;
    return true;
  }
  bool start_object(std::size_t) override { return ++depth_, true; }
  bool end_object() override { return --depth_, true; }
  bool start_array(std::size_t) override { return ++depth_, true; }
  bool end_array() override { return --depth_, true; }
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool parse_error(std::size_t, const std::string&, const json::exception&) override { return false; }

 private:
  int depth_ = 0;
  std::set<std::string> seen_;
};

json parse_json_strict(const char* begin, const char* end, const std::string& label,
                       const char* what) {
  TopLevelKeys keys;
  json j = json::sax_parse(begin, end, &keys) ? json::parse(begin, end, nullptr, /*allow_exceptions=*/false)
                                              : json(json::value_t::discarded);
  if (j.is_discarded()) {
    // Re-parse with exceptions for the parser's position message.
    std::string why = "not valid JSON";
    try {
      const json reparsed = json::parse(begin, end);
      why = reparsed.is_discarded() ? why : "not valid JSON";
    } catch (const json::exception& e) {
      why = e.what();
    }
    io_fail(label + ": " + what + " is malformed: " + why);
  }
  if (!keys.duplicate.empty()) io_fail(label + ": " + what + " names " + printable(keys.duplicate) + " twice");
  return j;
}

}  // namespace

const StDtypeInfo* st_dtype_by_name(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.st_name) return &d;
  if (name == "E8M0") return st_dtype_by_name("F8_E8M0");
  return nullptr;
}

const StDtypeInfo& st_dtype_info(kt_ckpt_dtype dtype) {
  for (const auto& d : kDtypes)
    if (d.dtype == dtype) return d;
  fail(KT_ERR_INVALID_ARGUMENT, "kt_ckpt_dtype " + std::to_string(static_cast<int>(dtype)) +
                                    " is not a checkpoint dtype");
}

uint64_t TensorEntry::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

ParsedHeader parse_safetensors(const uint8_t* bytes, size_t size, const std::string& label) {
  if (size < 8)
    io_fail(label + ": file is " + std::to_string(size) +
            " bytes, shorter than the 8-byte safetensors header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];  // little-endian
  if (n > size - 8)
    io_fail(label + ": header length " + std::to_string(n) + " runs past the end of the file (" +
            std::to_string(size) + " bytes; truncated?)");
  if (n > kMaxHeaderBytes)
    io_fail(label + ": header length " + std::to_string(n) + " is above the " +
            std::to_string(kMaxHeaderBytes) + "-byte limit");
  if (n < 2) io_fail(label + ": header of " + std::to_string(n) + " bytes cannot hold a JSON object");
  const char* text = reinterpret_cast<const char*>(bytes + 8);
  json j = parse_json_strict(text, text + n, label, "header");
  if (!j.is_object()) io_fail(label + ": header is not a JSON object");

  ParsedHeader h;
  h.header_bytes = n;
  h.data_offset = 8 + n;
  const uint64_t data_size = size - h.data_offset;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) io_fail(label + ": __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          io_fail(label + ": __metadata__ entry " + printable(m.key()) + " is not a string");
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = label + ": tensor " + printable(name);
    if (name.empty()) io_fail(label + ": a tensor has an empty name");
    if (!v.is_object()) io_fail(where + ": entry is not an object");
    for (auto f = v.begin(); f != v.end(); ++f)
      if (f.key() != "dtype" && f.key() != "shape" && f.key() != "data_offsets")
        io_fail(where + ": unknown field " + printable(f.key()));
    if (!v.contains("dtype") || !v["dtype"].is_string()) io_fail(where + ": dtype missing or not a string");
    const std::string dt = v["dtype"].get<std::string>();
    const StDtypeInfo* info = st_dtype_by_name(dt);
    if (!info) io_fail(where + ": unknown dtype " + printable(dt));
    if (!v.contains("shape") || !v["shape"].is_array()) io_fail(where + ": shape missing or not an array");
    if (v["shape"].size() > static_cast<size_t>(kMaxTensorRank))
      io_fail(where + ": rank " + std::to_string(v["shape"].size()) + " is above " +
              std::to_string(kMaxTensorRank));
    TensorEntry t;
    t.name = name;
    t.dtype = info->dtype;
    // numel * element size must not overflow: bound the running product.
    unsigned __int128 bytes_needed = info->size;
    for (const json& d : v["shape"]) {
      uint64_t e = 0;
      if (!as_count(d, &e)) io_fail(where + ": shape has an entry that is not a non-negative integer");
      t.shape.push_back(static_cast<int64_t>(e));
      bytes_needed *= e;
      if (bytes_needed > static_cast<unsigned __int128>(INT64_MAX)) bytes_needed = static_cast<unsigned __int128>(INT64_MAX) + 1;
    }
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
      io_fail(where + ": data_offsets missing or not a [begin, end] pair");
    if (!as_count(v["data_offsets"][0], &t.begin) || !as_count(v["data_offsets"][1], &t.end))
      io_fail(where + ": data_offsets are not non-negative integers");
    if (t.end < t.begin)
      io_fail(where + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
              "] end before they begin");
    if (t.end > data_size)
      io_fail(where + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
              "] run past the data area (" + std::to_string(data_size) + " bytes; truncated?)");
    if (bytes_needed != static_cast<unsigned __int128>(t.end - t.begin)) {
      std::string shape = "[";
      for (size_t i = 0; i < t.shape.size(); ++i) shape += (i ? "," : "") + std::to_string(t.shape[i]);
      io_fail(where + ": dtype " + info->st_name + " and shape " + shape + "] need " +
              (bytes_needed > static_cast<unsigned __int128>(INT64_MAX)
                   ? std::string("more than 2^63")
                   : std::to_string(static_cast<uint64_t>(bytes_needed))) +
              " bytes but data_offsets span " + std::to_string(t.end - t.begin));
    }
    h.tensors.push_back(std::move(t));
  }
  // No two tensors may share bytes (zero-sized tensors own none).
  std::vector<const TensorEntry*> by_offset;
  for (const auto& t : h.tensors)
    if (t.end > t.begin) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorEntry* a, const TensorEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->name < b->name;
  });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->begin < by_offset[i - 1]->end)
      io_fail(label + ": tensor " + printable(by_offset[i]->name) + " (bytes " +
              std::to_string(by_offset[i]->begin) + ".." + std::to_string(by_offset[i]->end) +
              ") overlaps tensor " + printable(by_offset[i - 1]->name) + " (bytes " +
              std::to_string(by_offset[i - 1]->begin) + ".." + std::to_string(by_offset[i - 1]->end) + ")");
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const TensorEntry& a, const TensorEntry& b) { return a.name < b.name; });
  return h;
}

std::map<std::string, std::string> parse_index(const std::string& text, const std::string& label) {
  json j = parse_json_strict(text.data(), text.data() + text.size(), label, "index");
  if (!j.is_object()) io_fail(label + ": index is not a JSON object");
  if (!j.contains("weight_map") || !j["weight_map"].is_object())
    io_fail(label + ": weight_map missing or not an object");
  std::map<std::string, std::string> out;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    const std::string where = label + ": weight_map entry for tensor " + printable(it.key());
    if (it.key().empty()) io_fail(label + ": weight_map has an empty tensor name");
    if (!it.value().is_string()) io_fail(where + " is not a file name string");
    const std::string file = it.value().get<std::string>();
    if (file.empty()) io_fail(where + " is an empty file name");
    if (file[0] == '/') io_fail(where + ": file " + printable(file) + " is an absolute path");
    if (file.find('\0') != std::string::npos) io_fail(where + ": file name holds a NUL byte");
    // Split on '/' and refuse ".." components (and "." for tidiness).
    size_t start = 0;
    while (start <= file.size()) {
      const size_t slash = std::min(file.find('/', start), file.size());
      const std::string part = file.substr(start, slash - start);
      if (part == ".." || part == "." || part.empty())
        io_fail(where + ": file " + printable(file) + " is not a plain relative path inside the directory");
      start = slash + 1;
    }
    out[it.key()] = file;
  }
  return out;
}

namespace {

// Opens name (relative to dirfd, or a path with AT_FDCWD) for reading and
// refuses anything but a regular file. O_NONBLOCK: opening a FIFO must not
// wait for a writer.
int open_regular(int dirfd, const std::string& name, const std::string& label, struct stat* st) {
  const int fd = ::openat(dirfd, name.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) io_fail(label + ": cannot open: " + std::strerror(errno));
  if (::fstat(fd, st) != 0) {
    const int err = errno;
    ::close(fd);
    io_fail(label + ": cannot stat: " + std::strerror(err));
  }
  if (!S_ISREG(st->st_mode)) {
    ::close(fd);
    io_fail(label + ": not a regular file (" +
            (S_ISFIFO(st->st_mode) ? "a FIFO" : S_ISDIR(st->st_mode) ? "a directory" : "a device or socket") + ")");
  }
  return fd;
}

std::string read_all(int fd, const std::string& label, const struct stat& st) {
  if (static_cast<uint64_t>(st.st_size) > kMaxHeaderBytes) {
    ::close(fd);
    io_fail(label + ": " + std::to_string(st.st_size) + " bytes, above the " + std::to_string(kMaxHeaderBytes) +
            "-byte limit for a JSON file");
  }
  std::string out;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      io_fail(label + ": read error: " + std::strerror(err));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > kMaxHeaderBytes) {
      ::close(fd);
      io_fail(label + ": grew above the " + std::to_string(kMaxHeaderBytes) + "-byte limit while read");
    }
  }
  ::close(fd);
  return out;
}

// The path a descriptor refers to now (its directory may have been renamed
// since it was opened); "" when /proc cannot say.
std::string fd_path(int fd) {
  char buf[PATH_MAX + 1];
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = ::readlink(link.c_str(), buf, PATH_MAX);
  if (n <= 0) return "";
  return std::string(buf, static_cast<size_t>(n));
}

// Refuses a file of an index (opened as fd) that resolves outside dir:
// absolute paths and ".." are refused by parse_index; this catches symlinks.
void check_inside(const DirHandle& dir, int fd, const std::string& name, const std::string& label) {
  std::string base = fd_path(dir.fd()), resolved = fd_path(fd);
  if (base.empty() || resolved.empty()) {
    char* real_dir = ::realpath(dir.path().c_str(), nullptr);
    char* real_file = ::realpath(dir.label(name).c_str(), nullptr);
    base = real_dir ? real_dir : "";
    resolved = real_file ? real_file : "";
    std::free(real_dir);
    std::free(real_file);
    if (base.empty() || resolved.empty())
      io_fail(label + ": file " + printable(name) + " (" + dir.label(name) + "): cannot resolve its path");
  }
  auto inside = [&](const std::string& root) {
    return resolved.size() > root.size() && resolved.compare(0, root.size(), root) == 0 &&
           (root == "/" || resolved[root.size()] == '/');
  };
  // The Hugging Face hub cache links <repo>/snapshots/<rev>/<file> to
  // <repo>/blobs/<hash>: those links are the cache's own, not an escape.
  const size_t rev_slash = base.rfind('/');
  const size_t snap_slash = rev_slash == std::string::npos || rev_slash == 0
                                ? std::string::npos
                                : base.rfind('/', rev_slash - 1);
  bool hub_blob = false;
  if (snap_slash != std::string::npos &&
      base.compare(snap_slash, rev_slash - snap_slash, "/snapshots") == 0)
    hub_blob = inside(base.substr(0, snap_slash) + "/blobs");
  if (!inside(base) && !hub_blob)
    io_fail(label + ": file " + printable(name) + " resolves to " + resolved +
            ", outside the checkpoint directory " + base);
}

}  // namespace

DirHandle::DirHandle(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd_ < 0) {
    const int err = errno;
    io_fail(path + (err == ENOTDIR ? ": not a directory" : ": cannot open the directory: " + std::string(std::strerror(err))));
  }
  struct stat st;
  if (::fstat(fd_, &st) == 0) {
    dev_ = static_cast<uint64_t>(st.st_dev);
    ino_ = static_cast<uint64_t>(st.st_ino);
  }
}

DirHandle::~DirHandle() {
  if (fd_ >= 0) ::close(fd_);
}

bool DirHandle::has(const std::string& name) const {
  struct stat st;
  return ::fstatat(fd_, name.c_str(), &st, 0) == 0;
}

bool DirHandle::still_current() const {
  struct stat st;
  return ::stat(path_.c_str(), &st) == 0 && static_cast<uint64_t>(st.st_dev) == dev_ &&
         static_cast<uint64_t>(st.st_ino) == ino_;
}

MappedFile::MappedFile(const std::string& path) : path_(path) {
  struct stat st;
  const int fd = open_regular(AT_FDCWD, path, path, &st);
  map(fd);
}

MappedFile::MappedFile(const DirHandle& dir, const std::string& name, const std::string& listed_in)
    : path_(dir.label(name)) {
  struct stat st;
  const std::string label = listed_in.empty() ? path_ : listed_in + ": file " + printable(name) + " (" + path_ + ")";
  const int fd = open_regular(dir.fd(), name, label, &st);
  if (!listed_in.empty()) {
    // The containment check looks at the file actually opened.
    try {
      check_inside(dir, fd, name, listed_in);
    } catch (...) {
      ::close(fd);
      throw;
    }
  }
  map(fd);
}

void MappedFile::map(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    io_fail(path_ + ": cannot stat: " + std::strerror(err));
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      io_fail(path_ + ": cannot map " + std::to_string(size_) + " bytes: " + std::strerror(err));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
}

void release_mapped_pages(const void* data, size_t bytes) {
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / page * page;
  // Advice only: a failure leaves the pages resident, nothing else changes.
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

void prefetch_mapped_pages(const void* data, size_t bytes) {
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(data) + bytes;
  // Advice only, as above.
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_WILLNEED);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

SafetensorsFile::SafetensorsFile(std::unique_ptr<MappedFile> map)
    : map_(std::move(map)), header_(parse_safetensors(map_->data(), map_->size(), map_->path())) {}

std::string read_text_file(const std::string& path) {
  struct stat st;
  const int fd = open_regular(AT_FDCWD, path, path, &st);
  return read_all(fd, path, st);
}

std::string read_text_file(const DirHandle& dir, const std::string& name) {
  struct stat st;
  const std::string label = dir.label(name);
  const int fd = open_regular(dir.fd(), name, label, &st);
  return read_all(fd, label, st);
}

TensorSet::TensorSet(std::shared_ptr<const DirHandle> dir) : dir_(std::move(dir)) {
  const DirHandle& d = *dir_;
  const std::string index_name = "model.safetensors.index.json";
  const std::string index = d.label(index_name);
  if (d.has(index_name)) {
    const std::map<std::string, std::string> weight_map = parse_index(read_text_file(d, index_name), index);
    std::map<std::string, const SafetensorsFile*> by_name;
    for (const auto& kv : weight_map) {
      if (by_name.count(kv.second)) continue;
      files_.emplace_back(new SafetensorsFile(std::unique_ptr<MappedFile>(new MappedFile(d, kv.second, index))));
      by_name[kv.second] = files_.back().get();
    }
    for (const auto& kv : weight_map) {
      const SafetensorsFile* f = by_name[kv.second];
      const auto& ts = f->header().tensors;
      auto it = std::lower_bound(ts.begin(), ts.end(), kv.first,
                                 [](const TensorEntry& t, const std::string& n) { return t.name < n; });
      if (it == ts.end() || it->name != kv.first)
        io_fail(index + ": tensor " + printable(kv.first) + " is mapped to " + f->path() +
                ", which does not hold it");
      tensors_[kv.first] = TensorRef{&*it, f, f->tensor_data(*it)};
    }
    for (const auto& f : files_)
      for (const auto& t : f->header().tensors) {
        auto it = weight_map.find(t.name);
        if (it == weight_map.end())
          io_fail(f->path() + ": tensor " + printable(t.name) + " is not listed in " + index);
      }
    return;
  }
  for (const char* single : {"model.safetensors", "adapter_model.safetensors"}) {
    if (!d.has(single)) continue;
    files_.emplace_back(new SafetensorsFile(std::unique_ptr<MappedFile>(new MappedFile(d, single))));
    const SafetensorsFile* f = files_.back().get();
    for (const auto& t : f->header().tensors) tensors_[t.name] = TensorRef{&t, f, f->tensor_data(t)};
    return;
  }
  io_fail(d.path() + ": holds no model.safetensors.index.json, model.safetensors or "
                     "adapter_model.safetensors");
}

const TensorRef* TensorSet::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const TensorRef& TensorSet::get(const std::string& name) const {
  const TensorRef* r = find(name);
  if (!r) io_fail(dir_->path() + ": tensor " + printable(name) + " is missing from the checkpoint");
  return *r;
}

}  // namespace io
}  // namespace kt
