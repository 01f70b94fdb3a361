// kt_comm: a rank's communicator (a CPU backend, a CUDA backend, or both),
// and the agreement step every collective call of kt begins with: each
// rank's local outcome (its argument checks) is exchanged, and a failure on
// any rank becomes the same error, naming that rank, on every rank.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/backend.h"
#include "dist/transport.h"

struct kt_comm {
  int rank = 0, world = 1;
  kt::dist::Backends backends;
  std::chrono::milliseconds timeout{30000};
  std::unique_ptr<kt::dist::Transport> cpu;   // Gloo, when backends.cpu is set
  std::unique_ptr<kt::dist::Transport> cuda;  // NCCL, when backends.cuda is set

  // Serialises the collectives of this rank (all ranks issue them in one
  // order; two host threads must not interleave theirs).
  std::mutex mutex;
  bool broken = false;  // a collective failed: nothing may run any more
  std::string broken_why;

  ~kt_comm();

  // Throws KT_ERR_COMM once the communicator is broken.
  void check_usable(const char* where) const;
  // The CPU backend, or KT_ERR_UNSUPPORTED naming where.
  kt::dist::Transport& cpu_transport(const char* where) const;
  // Runs fn (transport calls; the caller holds mutex). A KT_ERR_COMM
  // failure breaks the communicator: its connections are closed, so the
  // peers' pending calls fail too instead of waiting for their timeout.
  template <class F>
  void run(const char* where, F&& fn) {
    check_usable(where);
    try {
      fn();
    } catch (const kt::Error& e) {
      if (e.status() != KT_ERR_COMM) throw;
      mark_broken(e.what());
      kt::fail(KT_ERR_COMM, std::string(where) + ": rank " + std::to_string(rank) + ": " + e.what());
    }
  }
  void mark_broken(const std::string& why) noexcept;
};

namespace kt::dist {

// A rank's result of the local part of a collective call.
struct Outcome {
  kt_status status = KT_OK;
  std::string message;
  bool ok() const { return status == KT_OK; }
};

// Runs fn and returns its failure as an Outcome instead of throwing (with
// the ABI guard's translation of exceptions); the call that follows
// exchanges it with the other ranks.
template <class F>
Outcome attempt(F&& fn) noexcept {
  Outcome o;
  try {
    fn();
  } catch (const Error& e) {
    o.status = e.status();
    o.message = e.what();
  } catch (const std::bad_alloc&) {
    o.status = KT_ERR_OUT_OF_MEMORY;
    o.message = "out of memory";
  } catch (const std::exception& e) {
    o.status = KT_ERR_INTERNAL;
    o.message = std::string("internal error: ") + e.what();
  } catch (...) {
    o.status = KT_ERR_INTERNAL;
    o.message = "internal error";
  }
  return o;
}

// Every rank's outcome and a payload of the same size on each rank are
// gathered to every rank (one allgather on the CPU backend). When some rank
// failed, every rank throws the error of the lowest failing rank: its
// status, "<where>: rank r: <its message>". Otherwise returns the payloads,
// rank by rank (world * payload_bytes). The caller holds comm.mutex.
std::vector<char> agree(kt_comm& comm, const char* where, const Outcome& mine, const void* payload,
                        size_t payload_bytes);

// A rank's outcome as the bytes of a message header, and back (for the
// results an owner or an expert rank sends with its data).
constexpr size_t kOutcomeBytes = 1024;
void write_outcome(const Outcome& o, void* dst);
// Throws the outcome in dst when it is a failure, as agree does.
void raise_outcome(const void* src, int from_rank, const char* where);

}  // namespace kt::dist
