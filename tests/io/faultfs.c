/* Fault injection for the crash-safety tests: a shared object that
 * interposes the C library's file-changing calls (write, fsync, rename,
 * link, unlink, mkdir, ...) and, once armed, acts on the N-th of them:
 *   kill:N    SIGKILL before step N (the step does not happen)
 *   tear:N    step N writes half its bytes, then SIGKILL (a kill when
 *             step N is not a write)
 *   enospc:N  every write, fsync, mkdir and link from step N on fails
 *             with ENOSPC (a full disk)
 * Writes to descriptors 0-2 are not steps. Armed by kt_faultfs_arm() in a
 * process linked with it, or through KT_FAULTFS=<kind>:<N> when loaded with
 * LD_PRELOAD (the kt command). Test-only: never part of libkt. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

enum { kOff = 0, kKill = 1, kTear = 2, kEnospc = 3 };

static int g_kind = kOff;
static long g_at = 0;
static long g_steps = 0;

__attribute__((visibility("default"))) void kt_faultfs_arm(int kind, long step) {
  g_kind = kind;
  g_at = step;
  __atomic_store_n(&g_steps, 0, __ATOMIC_SEQ_CST);
}

__attribute__((visibility("default"))) long kt_faultfs_steps(void) {
  return __atomic_load_n(&g_steps, __ATOMIC_SEQ_CST);
}

__attribute__((constructor)) static void faultfs_from_env(void) {
  const char* spec = getenv("KT_FAULTFS");
  if (!spec) return;
  const char* colon = strchr(spec, ':');
  if (!colon) return;
  const long n = strtol(colon + 1, NULL, 10);
  if (strncmp(spec, "kill:", 5) == 0) kt_faultfs_arm(kKill, n);
  if (strncmp(spec, "tear:", 5) == 0) kt_faultfs_arm(kTear, n);
  if (strncmp(spec, "enospc:", 7) == 0) kt_faultfs_arm(kEnospc, n);
}

/* What to do at this step: 0 = go on, kTear, kEnospc (kill never returns). */
static int step(int fd, int space) {
  if (g_kind == kOff || (fd >= 0 && fd <= 2)) return 0;
  const long n = __atomic_add_fetch(&g_steps, 1, __ATOMIC_SEQ_CST);
  if (g_kind == kEnospc) return space && n >= g_at ? kEnospc : 0;
  if (n != g_at) return 0;
  if (g_kind == kKill) kill(getpid(), SIGKILL);
  return g_kind;
}

#define REAL(name) \
  static __typeof__(name)* real_##name = NULL; \
  if (!real_##name) real_##name = (__typeof__(name)*)dlsym(RTLD_NEXT, #name)

ssize_t write(int fd, const void* buf, size_t n) {
  REAL(write);
  const int act = step(fd, 1);
  if (act == kEnospc) {
    errno = ENOSPC;
    return -1;
  }
  if (act == kTear) {
    real_write(fd, buf, n / 2);
    kill(getpid(), SIGKILL);
  }
  return real_write(fd, buf, n);
}

ssize_t pwrite(int fd, const void* buf, size_t n, off_t off) {
  REAL(pwrite);
  const int act = step(fd, 1);
  if (act == kEnospc) {
    errno = ENOSPC;
    return -1;
  }
  if (act == kTear) {
    real_pwrite(fd, buf, n / 2, off);
    kill(getpid(), SIGKILL);
  }
  return real_pwrite(fd, buf, n, off);
}

#define SIMPLE(ret, name, space, params, args) \
  ret name params { \
    REAL(name); \
    const int act = step(-1, space); \
    if (act == kTear) kill(getpid(), SIGKILL); /* nothing to tear: a kill */ \
    if (act == kEnospc) { \
      errno = ENOSPC; \
      return -1; \
    } \
    return real_##name args; \
  }

SIMPLE(int, fsync, 1, (int fd), (fd))
SIMPLE(int, fdatasync, 1, (int fd), (fd))
SIMPLE(int, ftruncate, 1, (int fd, off_t len), (fd, len))
SIMPLE(int, rename, 0, (const char* a, const char* b), (a, b))
SIMPLE(int, renameat, 0, (int da, const char* a, int db, const char* b), (da, a, db, b))
SIMPLE(int, renameat2, 0, (int da, const char* a, int db, const char* b, unsigned f), (da, a, db, b, f))
SIMPLE(int, link, 1, (const char* a, const char* b), (a, b))
SIMPLE(int, linkat, 1, (int da, const char* a, int db, const char* b, int f), (da, a, db, b, f))
SIMPLE(int, symlink, 1, (const char* a, const char* b), (a, b))
SIMPLE(int, symlinkat, 1, (const char* a, int d, const char* b), (a, d, b))
SIMPLE(int, unlink, 0, (const char* a), (a))
SIMPLE(int, unlinkat, 0, (int d, const char* a, int f), (d, a, f))
SIMPLE(int, rmdir, 0, (const char* a), (a))
SIMPLE(int, mkdir, 1, (const char* a, mode_t m), (a, m))
SIMPLE(int, mkdirat, 1, (int d, const char* a, mode_t m), (d, a, m))
