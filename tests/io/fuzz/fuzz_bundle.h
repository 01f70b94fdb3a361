// A fuzz input that is a small directory: a sequence of entries
//   <name> NUL <length: 4 bytes little-endian> <bytes>
// written as files of one scratch directory before each run. A name starting
// with '@' makes a symlink <name without '@'> -> <bytes> instead. Names are
// reduced to [A-Za-z0-9._-] (no leading '.'), symlink targets too, except a
// leading "../" which stays (to reach the one file beside the directory,
// "outside.safetensors", that the links may point at). At most 8 entries.
#pragma once

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace kt_fuzz {

struct Entry {
  std::string name;
  std::string bytes;
  bool link = false;
};

inline std::string clean_name(const std::string& raw) {
  std::string out;
  for (char c : raw) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == '-';
    if (ok) out += c;
  }
  while (!out.empty() && out[0] == '.') out.erase(0, 1);
  if (out.size() > 64) out.resize(64);
  return out;
}

inline std::vector<Entry> parse_bundle(const uint8_t* data, size_t size) {
  std::vector<Entry> out;
  size_t at = 0;
  while (at < size && out.size() < 8) {
    size_t end = at;
    while (end < size && data[end] != 0) ++end;
    if (end + 5 > size) break;
    Entry e;
    std::string raw(reinterpret_cast<const char*>(data + at), end - at);
    e.link = !raw.empty() && raw[0] == '@';
    e.name = clean_name(e.link ? raw.substr(1) : raw);
    uint32_t n = 0;
    for (int i = 3; i >= 0; --i) n = (n << 8) | data[end + 1 + static_cast<size_t>(i)];
    at = end + 5;
    const size_t take = n < size - at ? n : size - at;
    e.bytes.assign(reinterpret_cast<const char*>(data + at), take);
    at += take;
    if (!e.name.empty()) out.push_back(std::move(e));
  }
  return out;
}

inline std::string encode_bundle(const std::vector<Entry>& entries) {
  std::string out;
  for (const Entry& e : entries) {
    out += (e.link ? "@" : "") + e.name;
    out += '\0';
    const uint32_t n = static_cast<uint32_t>(e.bytes.size());
    for (int i = 0; i < 4; ++i) out += static_cast<char>((n >> (8 * i)) & 0xff);
    out += e.bytes;
  }
  return out;
}

// A scratch directory of this process, emptied before each input; tag
// tells apart several of one process.
class Scratch {
 public:
  explicit Scratch(const std::string& tag = "") {
    const char* base = std::getenv("KT_FUZZ_SCRATCH");
    std::string root = base && *base ? base : (access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp");
    root_ = root + "/kt_fuzz." + std::to_string(getpid()) + tag;
    mkdir(root_.c_str(), 0700);
    dir_ = root_ + "/ckpt";
  }
  ~Scratch() { clear_all(); }
  const std::string& dir() const { return dir_; }
  const std::string& root() const { return root_; }

  // Writes the bundle's entries into dir() (recreated empty).
  void materialize(const std::vector<Entry>& entries) {
    clear_all();
    mkdir(root_.c_str(), 0700);
    mkdir(dir_.c_str(), 0700);
    write_file(root_ + "/outside.safetensors", "\x02\0\0\0\0\0\0\0{}");
    for (const Entry& e : entries) {
      const std::string path = dir_ + "/" + e.name;
      if (e.link) {
        std::string target = e.bytes.compare(0, 3, "../") == 0 ? "../" + clean_name(e.bytes.substr(3))
                                                               : clean_name(e.bytes);
        if (target.empty() || target == "../") target = "missing";
        unlink(path.c_str());
        if (symlink(target.c_str(), path.c_str()) != 0) continue;
      } else {
        write_file(path, e.bytes);
      }
    }
  }

  void write_file(const std::string& path, const std::string& bytes) {
    unlink(path.c_str());
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f) return;
    if (!bytes.empty()) std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
  }

 private:
  void clear_dir(const std::string& d) {
    DIR* dd = opendir(d.c_str());
    if (!dd) return;
    std::vector<std::string> names;
    while (const dirent* e = readdir(dd)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    closedir(dd);
    for (const std::string& n : names) {
      const std::string p = d + "/" + n;
      struct stat st;
      if (lstat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
        clear_dir(p);
        rmdir(p.c_str());
      } else {
        unlink(p.c_str());
      }
    }
  }
  void clear_all() {
    clear_dir(root_);
    rmdir(root_.c_str());
  }
  std::string root_, dir_;
};

}  // namespace kt_fuzz
