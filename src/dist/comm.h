// kt_comm: a rank's communicator (a CPU backend, a CUDA backend, or both),
// and the agreement step every collective call of kt begins with: each
// rank's local outcome (its argument checks) is exchanged, and a failure on
// any rank becomes the same error, naming that rank, on every rank.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
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
  // Calls made by point-to-point messages so far (owner-rank calls,
  // expert-parallel exchanges; every rank counts them alike): they tell the
  // messages of one call from another's.
  uint64_t message_calls = 0;
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

// Point-to-point messages that carry their sender's outcome, so that the
// outcomes travel with the data instead of in an agreement of their own: a
// message is kOutcomeBytes of outcome, a head of head_bytes (the same size
// on every rank), then a body whose size body_bytes_of(head) tells (none
// after a failed outcome). The first message to a rank has a fixed size, so
// that the rank can receive it before it knows the body's: outcome, head and
// up to inline_body bytes of body; a longer body sends its rest in a second.
constexpr size_t kInlineBody = 16384;  // a few rows at decode
using BodyBytes = std::function<size_t(const char* head)>;

// This rank's message: its outcome and head, then body_bytes of body, copied
// from body or left zero for the caller to fill when body is null (no body
// after a failed outcome).
std::vector<char> outcome_message(const Outcome& mine, const void* head, size_t head_bytes, const void* body,
                                  size_t body_bytes);

// Sends messages[r] to each other rank r whose message is not empty and
// receives the message of each other rank r with from[r] (which sends this
// rank one). Returns the messages, rank by rank, each as long as its outcome,
// head and body; this rank's own (messages[comm.rank], if any) is moved to
// its place. The caller holds comm.mutex and counted the call in
// comm.message_calls.
std::vector<std::vector<char>> exchange_messages(kt_comm& comm, const char* where,
                                                 std::vector<std::vector<char>> messages,
                                                 const std::vector<bool>& from, size_t head_bytes,
                                                 size_t inline_body, const BodyBytes& body_bytes_of);

// Throws, as agree does, the outcome of the lowest rank whose message
// (exchange_messages') holds a failure.
void raise_first_failure(const std::vector<std::vector<char>>& messages, const char* where);

// Owner-rank calls by point-to-point messages: one trip to the owner and one
// back, where an agreement, a gather and a scatter would take three rounds.
//
// to_owner: every rank sends the owner its outcome, a head of head_bytes
// (the same size on every rank) and a body. On the owner returns every
// rank's message, rank by rank (its own included): kOutcomeBytes of outcome,
// the head, then the body, whose size body_bytes_of(head) tells (0 for a rank
// whose outcome is a failure: bodies go only with a good outcome). Elsewhere
// returns nothing. The caller holds comm.mutex and counted the call in
// comm.message_calls.
std::vector<std::vector<char>> to_owner(kt_comm& comm, const char* where, int owner, const Outcome& mine,
                                        const void* head, size_t head_bytes, const void* body, size_t body_bytes,
                                        const BodyBytes& body_bytes_of);

// What the owner tells every rank: an error to raise, from a rank's outcome
// (rank >= 0: "<where>: rank r: <its message>", as agree raises it) or whole
// as the owner made it (rank -1), or nothing (outcome ok).
struct Relay {
  int32_t rank = -1;
  Outcome outcome;
};
// The relay of the lowest rank whose outcome in messages (to_owner's) is a
// failure, else an ok one.
Relay first_failure(const std::vector<std::vector<char>>& messages);

// from_owner: the owner sends rank r the relay and payloads[r] (its own
// included, which lands in mine); every rank receives its payload into mine
// (mine_bytes, which the rank knows) and then throws the relayed error, if
// any. On the owner, payloads has a (data, bytes) per rank; the payloads are
// not read when the relay is an error.
void from_owner(kt_comm& comm, const char* where, int owner, const Relay& relay,
                const std::vector<std::pair<const char*, size_t>>& payloads, char* mine, size_t mine_bytes);

}  // namespace kt::dist
