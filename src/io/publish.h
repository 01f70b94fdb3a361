// Publishing files so that a reader sees the old state or the whole new one,
// never a mix, whatever happens to the writer (killed, disk full).
//
// One file (AtomicFile, kReplace): written under ".<name>.tmp.<pid>.<n>" in
// the destination's directory, fsync'ed, renamed over the name, and the
// directory fsync'ed. A writer holds an flock on its temporary file while it
// lives; the next writer of the same name removes the temporaries whose lock
// is free (their writer died), before it writes.
//
// A set of files (StagedDir): built in a fresh sibling directory
// ".<dir>.kt-new.<pid>.<n>" (files written in place there, each fsync'ed),
// then published in one step: renameat2(RENAME_EXCHANGE) of the two
// directories (a plain rename when dir does not exist yet), after which the
// old directory is removed. Top-level entries of the old directory that the
// writer does not own (a README, a tokenizer, a subdirectory) are carried
// into the new one as hard links (copies where the file system refuses
// links) just before the exchange. Stale siblings of writers that died are
// removed by the next writer of the same directory (they are flock'ed while
// their writer lives). On file systems without RENAME_EXCHANGE the publish
// is two renames (dir to ".<dir>.kt-old.<pid>.<n>", then the new one to dir):
// a reader in between finds no directory rather than a mix, and a writer
// killed in between leaves the old directory, which the next writer puts
// back before it starts.
//
// Everything here is plain POSIX and throws kt::Error(KT_ERR_IO) naming the
// path; the kt command-line tool compiles it too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace kt {
namespace io {

class AtomicFile {
 public:
  enum Mode {
    kReplace,  // temporary name + rename over final_path on commit
    kCreate,   // final_path itself, which must not exist (inside a StagedDir)
  };
  explicit AtomicFile(const std::string& final_path, Mode mode = kReplace);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t n);
  void write_zeros(size_t n);
  uint64_t bytes_written() const { return written_; }
  // fsync, then (kReplace) rename into place and fsync the directory.
  // Destroyed uncommitted, the file is removed and final_path untouched.
  void commit();

 private:
  std::string final_, temp_;
  Mode mode_;
  int fd_ = -1;
  bool committed_ = false;
  uint64_t written_ = 0;
};

// Whether a top-level entry of the directory belongs to the writer (it is
// replaced, not carried over).
using OwnedName = std::function<bool(const std::string& name)>;

// owned, plus the temporaries of owned names (".<name>.tmp.<pid>.<n>") that
// writers of earlier layouts left inside the directory.
OwnedName owned_with_temporaries(OwnedName owned);

class StagedDir {
 public:
  // dir: the directory to replace (created with its parents when missing; a
  // symlink to a directory is followed and stays a link). Removes the stale
  // siblings of writers that died, then creates and locks the staging one.
  StagedDir(const std::string& dir, OwnedName owned);
  ~StagedDir();
  StagedDir(const StagedDir&) = delete;
  StagedDir& operator=(const StagedDir&) = delete;

  // Path of a file to write in the new version (with AtomicFile::kCreate).
  std::string file(const std::string& name) const { return staging_ + "/" + name; }
  // The staging directory (other processes may write files into it too,
  // while this object lives).
  const std::string& staging_path() const { return staging_; }
  // Carries the foreign entries over and makes the new version dir's.
  void publish();

 private:
  std::string target_;  // absolute, resolved
  std::string parent_, base_, staging_name_, staging_;
  int parent_fd_ = -1, staging_fd_ = -1;
  OwnedName owned_;
  bool published_ = false;
};

// Creates dir (and its parents) when missing; KT_ERR_IO naming it otherwise.
void ensure_directory(const std::string& dir);

}  // namespace io
}  // namespace kt
