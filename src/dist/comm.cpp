#include "dist/comm.h"

#include <cstring>

namespace kt::dist {

namespace {
struct OutcomeHeader {
  int32_t status;
  uint32_t length;
};
constexpr size_t kMessageBytes = kOutcomeBytes - sizeof(OutcomeHeader);
}  // namespace

void write_outcome(const Outcome& o, void* dst) {
  char* p = static_cast<char*>(dst);
  std::memset(p, 0, kOutcomeBytes);
  const size_t n = std::min(o.message.size(), kMessageBytes);
  const OutcomeHeader h{static_cast<int32_t>(o.status), static_cast<uint32_t>(n)};
  std::memcpy(p, &h, sizeof(h));
  std::memcpy(p + sizeof(h), o.message.data(), n);
}

void raise_outcome(const void* src, int from_rank, const char* where) {
  OutcomeHeader h;
  std::memcpy(&h, src, sizeof(h));
  if (h.status == KT_OK) return;
  const size_t n = std::min<size_t>(h.length, kMessageBytes);
  const std::string message(static_cast<const char*>(src) + sizeof(h), n);
  // A status outside kt's set (a corrupt header) cannot be passed on as is.
  const kt_status status =
      h.status > 0 && h.status <= KT_ERR_COMM ? static_cast<kt_status>(h.status) : KT_ERR_INTERNAL;
  fail(status, std::string(where) + ": rank " + std::to_string(from_rank) + ": " + message);
}

std::vector<char> agree(kt_comm& comm, const char* where, const Outcome& mine, const void* payload,
                        size_t payload_bytes) {
  const size_t record = kOutcomeBytes + payload_bytes;
  std::vector<char> in(record), all(record * static_cast<size_t>(comm.world));
  write_outcome(mine, in.data());
  if (payload_bytes) std::memcpy(in.data() + kOutcomeBytes, payload, payload_bytes);
  Transport& t = comm.cpu_transport(where);
  comm.run(where, [&] { t.allgather(in.data(), all.data(), record); });
  for (int r = 0; r < comm.world; ++r) raise_outcome(all.data() + static_cast<size_t>(r) * record, r, where);
  std::vector<char> payloads(payload_bytes * static_cast<size_t>(comm.world));
  for (int r = 0; r < comm.world; ++r)
    if (payload_bytes)
      std::memcpy(payloads.data() + static_cast<size_t>(r) * payload_bytes,
                  all.data() + static_cast<size_t>(r) * record + kOutcomeBytes, payload_bytes);
  return payloads;
}

}  // namespace kt::dist

kt_comm::~kt_comm() {
  if (cuda) cuda->abort();
  if (cpu) cpu->abort();
}

void kt_comm::check_usable(const char* where) const {
  kt::check(!broken, KT_ERR_COMM,
            std::string(where) + ": the communicator is unusable since a collective failed (" + broken_why +
                "); destroy it");
}

kt::dist::Transport& kt_comm::cpu_transport(const char* where) const {
  kt::check(cpu != nullptr, KT_ERR_UNSUPPORTED,
            std::string(where) + ": the communicator has no CPU backend (its backend string names none)");
  return *cpu;
}

void kt_comm::mark_broken(const std::string& why) noexcept {
  try {
    broken_why = why;
  } catch (...) {
    // The flag below is what matters.
  }
  broken = true;
  if (cpu) cpu->abort();
  if (cuda) cuda->abort();
}
