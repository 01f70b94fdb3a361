#include "io/publish.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/error.h"

namespace kt {
namespace io {

namespace {

[[noreturn]] void io_fail(const std::string& message) { fail(KT_ERR_IO, message); }

std::string errno_text(int err) { return std::strerror(err); }

std::string directory_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

std::string base_of(const std::string& path) { return path.substr(path.rfind('/') + 1); }

std::string unique_suffix() {
  static std::atomic<unsigned> counter{0};
  return std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

// Closes fd on scope exit.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

void fsync_directory(const std::string& dir) {
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // best effort: some file systems refuse directory fsync
    ::close(dfd);
  }
}

// Takes an exclusive lock on a file this process just created under a unique
// name; false when a cleaner removed the name first (then try another name).
bool lock_fresh(int fd) {
  while (::flock(fd, LOCK_EX) != 0)
    if (errno != EINTR) return true;  // no flock here: nothing to coordinate with
  struct stat st;
  return ::fstat(fd, &st) != 0 || st.st_nlink > 0;
}

// Names in dirfd, without "." and "..".
std::vector<std::string> list_names(int dirfd) {
  std::vector<std::string> names;
  const int dup_fd = ::fcntl(dirfd, F_DUPFD_CLOEXEC, 0);
  if (dup_fd < 0) return names;
  DIR* d = ::fdopendir(dup_fd);
  if (!d) {
    ::close(dup_fd);
    return names;
  }
  ::rewinddir(d);
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  return names;
}

// Removes the temporaries ".<base>.tmp.*" in dir whose writer died (their
// flock can be taken).
void remove_stale_temps(const std::string& dir, const std::string& base) {
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return;
  Fd guard(dfd);
  const std::string prefix = "." + base + ".tmp.";
  for (const std::string& name : list_names(dfd)) {
    if (!starts_with(name, prefix)) continue;
    const int fd = ::openat(dfd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) continue;
    Fd f(fd);
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) continue;  // a live writer holds it
    ::unlinkat(dfd, name.c_str(), 0);
  }
}

void write_all(int fd, const void* data, size_t n, const std::string& label) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      io_fail(label + ": write failed: " + errno_text(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void copy_file(int from_dir, int to_dir, const std::string& name, mode_t mode, const std::string& label) {
  const int in = ::openat(from_dir, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (in < 0) io_fail(label + ": cannot open to carry it over: " + errno_text(errno));
  Fd fin(in);
  const int out = ::openat(to_dir, name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode & 07777);
  if (out < 0) io_fail(label + ": cannot create its copy: " + errno_text(errno));
  Fd fout(out);
  std::vector<char> buf(1 << 20);
  for (;;) {
    const ssize_t r = ::read(in, buf.data(), buf.size());
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) io_fail(label + ": read failed while carrying it over: " + errno_text(errno));
    if (r == 0) break;
    write_all(out, buf.data(), static_cast<size_t>(r), label + " (copy)");
  }
  if (::fsync(out) != 0) io_fail(label + " (copy): fsync failed: " + errno_text(errno));
}

// Recreates the entries of from_dir in to_dir: files as hard links (copies
// where links are refused), symlinks as symlinks, directories recursively.
void carry_entries(int from_dir, int to_dir, const std::string& label, const OwnedName* owned) {
  for (const std::string& name : list_names(from_dir)) {
    if (owned && (*owned)(name)) continue;
    const std::string what = label + "/" + name;
    struct stat st;
    if (::fstatat(from_dir, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) continue;  // removed meanwhile
      io_fail(what + ": cannot stat to carry it over: " + errno_text(errno));
    }
    if (S_ISREG(st.st_mode)) {
      if (::linkat(from_dir, name.c_str(), to_dir, name.c_str(), 0) != 0) {
        const int err = errno;
        if (err == ENOENT) continue;
        if (err != EXDEV && err != EPERM && err != EMLINK && err != ENOTSUP && err != EACCES)
          io_fail(what + ": cannot link it into the new version: " + errno_text(err));
        copy_file(from_dir, to_dir, name, st.st_mode, what);
      }
    } else if (S_ISLNK(st.st_mode)) {
      std::vector<char> target(static_cast<size_t>(st.st_size > 0 ? st.st_size : PATH_MAX) + 1);
      const ssize_t n = ::readlinkat(from_dir, name.c_str(), target.data(), target.size() - 1);
      if (n < 0) io_fail(what + ": cannot read the link: " + errno_text(errno));
      target[static_cast<size_t>(n)] = '\0';
      if (::symlinkat(target.data(), to_dir, name.c_str()) != 0)
        io_fail(what + ": cannot recreate the link: " + errno_text(errno));
    } else if (S_ISDIR(st.st_mode)) {
      if (::mkdirat(to_dir, name.c_str(), st.st_mode & 07777) != 0)
        io_fail(what + ": cannot create the directory: " + errno_text(errno));
      const int sub_from = ::openat(from_dir, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (sub_from < 0) io_fail(what + ": cannot open: " + errno_text(errno));
      Fd f1(sub_from);
      const int sub_to = ::openat(to_dir, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (sub_to < 0) io_fail(what + ": cannot open its new copy: " + errno_text(errno));
      Fd f2(sub_to);
      carry_entries(sub_from, sub_to, what, nullptr);
      ::fsync(sub_to);
    } else {
      io_fail(what + " is not a regular file, link or directory; kt replaces the directory as a whole "
                     "and cannot carry it over");
    }
  }
}

void remove_tree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);  // does not follow symlinks
}

int rename_flags(int olddir, const char* oldname, int newdir, const char* newname, unsigned flags) {
  return ::renameat2(olddir, oldname, newdir, newname, flags);
}

}  // namespace

// ------------------------------------------------------------------ AtomicFile

AtomicFile::AtomicFile(const std::string& final_path, Mode mode) : final_(final_path), mode_(mode) {
  if (mode_ == kCreate) {
    temp_ = final_;
    fd_ = ::open(final_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0) io_fail(final_ + ": cannot create: " + errno_text(errno));
    return;
  }
  const std::string dir = directory_of(final_path);
  const std::string base = base_of(final_path);
  remove_stale_temps(dir, base);
  for (;;) {
    temp_ = dir + "/." + base + ".tmp." + unique_suffix();
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0) {
      const int err = errno;
      if (err == EEXIST) continue;
      io_fail(final_ + ": cannot create a temporary file in " + dir + ": " + errno_text(err));
    }
    if (lock_fresh(fd_)) break;
    ::close(fd_);
    fd_ = -1;
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_.c_str());
}

void AtomicFile::write(const void* data, size_t n) {
  write_all(fd_, data, n, final_);
  written_ += n;
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
  if (::fsync(fd_) != 0) io_fail(final_ + ": fsync failed: " + errno_text(errno));
  if (mode_ == kCreate) {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) io_fail(final_ + ": close failed: " + errno_text(errno));
    committed_ = true;
    return;
  }
  // The lock stays held (fd open) until the name is in place.
  if (::rename(temp_.c_str(), final_.c_str()) != 0)
    io_fail(final_ + ": cannot rename the temporary file into place: " + errno_text(errno));
  committed_ = true;
  const int fd = fd_;
  fd_ = -1;
  ::close(fd);
  fsync_directory(directory_of(final_));
}

// ------------------------------------------------------------------- StagedDir

OwnedName owned_with_temporaries(OwnedName owned) {
  return [owned](const std::string& name) {
    if (owned(name)) return true;
    const size_t tmp = name.find(".tmp.");
    return name.size() > 1 && name[0] == '.' && tmp != std::string::npos && tmp > 1 &&
           owned(name.substr(1, tmp - 1));
  };
}

void ensure_directory(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    io_fail(dir + ": cannot create the directory" + (ec ? ": " + ec.message() : std::string()));
}

StagedDir::StagedDir(const std::string& dir, OwnedName owned) : owned_(std::move(owned)) {
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  struct stat st;
  if (::stat(d.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) io_fail(d + ": exists and is not a directory");
    char* real = ::realpath(d.c_str(), nullptr);
    if (!real) io_fail(d + ": cannot resolve: " + errno_text(errno));
    target_ = real;
    std::free(real);
  } else {
    const std::string parent = directory_of(d);
    const std::string base = base_of(d);
    if (base.empty() || base == "." || base == "..") io_fail(d + ": not a directory name kt can create");
    ensure_directory(parent);
    char* real = ::realpath(parent.c_str(), nullptr);
    if (!real) io_fail(parent + ": cannot resolve: " + errno_text(errno));
    target_ = std::string(real) + (std::strcmp(real, "/") == 0 ? "" : "/") + base;
    std::free(real);
  }
  if (target_ == "/") io_fail(d + ": the root directory cannot be replaced");
  parent_ = directory_of(target_);
  base_ = base_of(target_);
  parent_fd_ = ::open(parent_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (parent_fd_ < 0) io_fail(parent_ + ": cannot open: " + errno_text(errno));

  // Siblings of writers that died: a half-built new version (or, after an
  // exchange, the old one) is removed; an old version moved aside by the
  // two-rename fallback is put back when dir is missing.
  const std::string new_prefix = "." + base_ + ".kt-new.", old_prefix = "." + base_ + ".kt-old.";
  for (const std::string& name : list_names(parent_fd_)) {
    const bool is_new = starts_with(name, new_prefix), is_old = starts_with(name, old_prefix);
    if (!is_new && !is_old) continue;
    const int fd = ::openat(parent_fd_, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) continue;
    Fd f(fd);
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) continue;  // its writer is alive
    struct stat tst;
    if (is_old && ::fstatat(parent_fd_, base_.c_str(), &tst, AT_SYMLINK_NOFOLLOW) != 0 && errno == ENOENT &&
        ::renameat(parent_fd_, name.c_str(), parent_fd_, base_.c_str()) == 0)
      continue;
    remove_tree(parent_ + "/" + name);
  }

  for (;;) {
    staging_name_ = "." + base_ + ".kt-new." + unique_suffix();
    if (::mkdirat(parent_fd_, staging_name_.c_str(), 0777) != 0) {
      const int err = errno;
      if (err == EEXIST) continue;
      io_fail(target_ + ": cannot create the staging directory " + parent_ + "/" + staging_name_ + ": " +
              errno_text(err) + " (kt writes the new version next to the directory and swaps the two)");
    }
    staging_fd_ = ::openat(parent_fd_, staging_name_.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (staging_fd_ < 0) continue;  // removed by a cleaner already
    if (lock_fresh(staging_fd_)) break;
    ::close(staging_fd_);
    staging_fd_ = -1;
  }
  staging_ = parent_ + "/" + staging_name_;
}

StagedDir::~StagedDir() {
  if (!published_ && !staging_.empty()) remove_tree(staging_);
  if (staging_fd_ >= 0) ::close(staging_fd_);
  if (parent_fd_ >= 0) ::close(parent_fd_);
}

void StagedDir::publish() {
  std::string old_name;
  for (int attempt = 0;; ++attempt) {
    const int target_fd = ::openat(parent_fd_, base_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (target_fd >= 0) {
      Fd t(target_fd);
      carry_entries(target_fd, staging_fd_, target_, &owned_);
      struct stat st;
      if (::fstat(target_fd, &st) == 0) ::fchmod(staging_fd_, st.st_mode & 07777);
    } else if (errno != ENOENT) {
      io_fail(target_ + ": cannot open: " + errno_text(errno));
    }
    if (::fsync(staging_fd_) != 0 && errno != EINVAL)
      io_fail(staging_ + ": fsync failed: " + errno_text(errno));

    if (rename_flags(parent_fd_, staging_name_.c_str(), parent_fd_, base_.c_str(), RENAME_EXCHANGE) == 0) {
      old_name = staging_name_;
      break;
    }
    const int err = errno;
    if (err == ENOENT) {
      // No old version: a plain rename that must not replace one made meanwhile.
      if (rename_flags(parent_fd_, staging_name_.c_str(), parent_fd_, base_.c_str(), RENAME_NOREPLACE) == 0) break;
      const int err2 = errno;
      if (err2 == EINVAL || err2 == ENOSYS || err2 == ENOTSUP) {
        if (::renameat(parent_fd_, staging_name_.c_str(), parent_fd_, base_.c_str()) == 0) break;
        io_fail(target_ + ": cannot rename the new version into place: " + errno_text(errno));
      }
      if ((err2 == EEXIST || err2 == ENOTEMPTY) && attempt < 3) continue;
      io_fail(target_ + ": cannot rename the new version into place: " + errno_text(err2));
    }
    if (err == EINVAL || err == ENOSYS || err == ENOTSUP) {
      // No RENAME_EXCHANGE on this file system: move the old version aside first.
      old_name = "." + base_ + ".kt-old." + unique_suffix();
      if (::renameat(parent_fd_, base_.c_str(), parent_fd_, old_name.c_str()) != 0)
        io_fail(target_ + ": cannot move the old version aside: " + errno_text(errno));
      if (::renameat(parent_fd_, staging_name_.c_str(), parent_fd_, base_.c_str()) != 0) {
        const int err3 = errno;
        ::renameat(parent_fd_, old_name.c_str(), parent_fd_, base_.c_str());
        io_fail(target_ + ": cannot rename the new version into place: " + errno_text(err3));
      }
      break;
    }
    io_fail(target_ + ": cannot swap in the new version: " + errno_text(err));
  }
  published_ = true;
  ::fsync(parent_fd_);
  if (!old_name.empty()) remove_tree(parent_ + "/" + old_name);
}

}  // namespace io
}  // namespace kt
