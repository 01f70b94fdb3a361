/* kt_delay_link: a point-to-point IP link between two network namespaces
 * that holds every packet for a fixed one-way delay.
 *
 *   kt_delay_link NETNS_A NETNS_B DEVICE DELAY_US
 *
 * NETNS_A/B are namespace files (/var/run/netns/NAME, as `ip netns add`
 * makes them). A TUN device named DEVICE is opened in each (the fd stays
 * bound to its device after setns back), "ready" is printed, and IP packets
 * are then copied between the two fds, each released DELAY_US after it was
 * read. It stands in for `tc qdisc ... netem delay` where the kernel lacks
 * netem. The devices vanish when the program exits (they are not
 * persistent); the caller gives them addresses and brings them up.
 *
 * One thread serves both directions: a FIFO per direction, ppoll until the
 * next release, and a spin over the last few microseconds because the
 * kernel's timer wakeups are late by tens of microseconds. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

enum { kSlotBytes = 16384, kSlots = 2048, kSpinNs = 40000, kReadBatch = 64 };

struct packet {
  int64_t due_ns;
  int len;
  unsigned char data[kSlotBytes];
};

/* One direction: packets read from `in`, written to `out` when due. */
struct direction {
  int in, out;
  struct packet* ring;
  size_t head, count;
  uint64_t forwarded, dropped;
};

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void die(const char* what) {
  fprintf(stderr, "kt_delay_link: %s: %s\n", what, strerror(errno));
  exit(1);
}

static int open_tun_in(const char* netns_path, const char* device) {
  int ns = open(netns_path, O_RDONLY | O_CLOEXEC);
  if (ns < 0) die(netns_path);
  if (setns(ns, CLONE_NEWNET) != 0) die("setns");
  close(ns);
  int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) die("/dev/net/tun");
  struct ifreq ifr;
  memset(&ifr, 0, sizeof ifr);
  ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
  snprintf(ifr.ifr_name, IFNAMSIZ, "%s", device);
  if (ioctl(fd, TUNSETIFF, &ifr) != 0) die("TUNSETIFF");
  return fd;
}

/* Reads what is waiting on d->in (up to a batch), stamping each packet. */
static void take(struct direction* d, int64_t delay_ns) {
  for (int n = 0; n < kReadBatch && d->count < kSlots; ++n) {
    struct packet* p = &d->ring[(d->head + d->count) % kSlots];
    ssize_t len = read(d->in, p->data, sizeof p->data);
    if (len < 0) {
      if (errno == EAGAIN || errno == EINTR) return;
      die("read");
    }
    p->len = (int)len;
    p->due_ns = now_ns() + delay_ns;
    d->count++;
  }
}

/* Writes the packets that are due; returns when the next one is, or -1. */
static int64_t release(struct direction* d, int64_t now) {
  while (d->count) {
    struct packet* p = &d->ring[d->head];
    if (p->due_ns > now) return p->due_ns;
    /* A TUN write hands the packet to the peer namespace's stack at once;
     * a failure is a lost packet, which TCP recovers as on a real link. */
    if (write(d->out, p->data, (size_t)p->len) == p->len)
      d->forwarded++;
    else
      d->dropped++;
    d->head = (d->head + 1) % kSlots;
    d->count--;
  }
  return -1;
}

int main(int argc, char** argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: %s NETNS_A NETNS_B DEVICE DELAY_US\n", argv[0]);
    return 2;
  }
  char* end = NULL;
  const double delay_us = strtod(argv[4], &end);
  if (*end || delay_us < 0) {
    fprintf(stderr, "kt_delay_link: DELAY_US must be a number >= 0\n");
    return 2;
  }
  const int64_t delay_ns = (int64_t)(delay_us * 1000.0);
  /* The default 50 us timer slack would add itself to every release. */
  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);

  int home = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
  if (home < 0) die("/proc/self/ns/net");
  const int a = open_tun_in(argv[1], argv[3]);
  const int b = open_tun_in(argv[2], argv[3]);
  if (setns(home, CLONE_NEWNET) != 0) die("setns back");
  close(home);

  struct direction dirs[2] = {{a, b, NULL, 0, 0, 0, 0}, {b, a, NULL, 0, 0, 0, 0}};
  for (int i = 0; i < 2; ++i) {
    dirs[i].ring = malloc(sizeof(struct packet) * kSlots);
    if (!dirs[i].ring) die("malloc");
  }
  printf("ready\n");
  fflush(stdout);

  for (;;) {
    take(&dirs[0], delay_ns);
    take(&dirs[1], delay_ns);
    const int64_t now = now_ns();
    int64_t next = -1;
    for (int i = 0; i < 2; ++i) {
      const int64_t due = release(&dirs[i], now);
      if (due >= 0 && (next < 0 || due < next)) next = due;
    }
    /* Close to a release: spin (reading as packets come) rather than sleep. */
    if (next >= 0 && next - now_ns() <= kSpinNs) continue;
    struct pollfd fds[2];
    nfds_t nfds = 0;
    for (int i = 0; i < 2; ++i)
      if (dirs[i].count < kSlots) fds[nfds++] = (struct pollfd){dirs[i].in, POLLIN, 0};
    struct timespec ts, *timeout = NULL;
    if (next >= 0) {
      const int64_t wait = next - now_ns() - kSpinNs;
      ts.tv_sec = wait > 0 ? wait / 1000000000 : 0;
      ts.tv_nsec = wait > 0 ? wait % 1000000000 : 0;
      timeout = &ts;
    }
    if (ppoll(fds, nfds, timeout, NULL) < 0 && errno != EINTR) die("ppoll");
  }
}
