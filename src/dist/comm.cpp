#include "dist/comm.h"

#include <cstring>

namespace kt::dist {

namespace {
struct OutcomeHeader {
  int32_t status;
  uint32_t length;
};
constexpr size_t kMessageBytes = kOutcomeBytes - sizeof(OutcomeHeader);

// An outcome as write_outcome left it in a message.
class OutcomeView {
 public:
  explicit OutcomeView(const char* p) : p_(p) { std::memcpy(&h_, p, sizeof(h_)); }
  bool ok() const { return h_.status == KT_OK; }
  Outcome outcome() const {
    Outcome o;
    // A status outside kt's set (a corrupt header) cannot be passed on as is.
    o.status = h_.status > 0 && h_.status <= KT_ERR_COMM ? static_cast<kt_status>(h_.status) : KT_ERR_INTERNAL;
    if (h_.status == KT_OK) o.status = KT_OK;
    o.message.assign(p_ + sizeof(h_), std::min<size_t>(h_.length, kMessageBytes));
    return o;
  }

 private:
  const char* p_;
  OutcomeHeader h_;
};
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

namespace {

// A message's slot: kt's own prefix beside Gloo's collectives (0x01-0x08),
// the call's number and the message's place in the call.
uint64_t message_slot(uint64_t call, unsigned phase) {
  return (uint64_t{0x4b} << 56) | ((call & ((uint64_t{1} << 48) - 1)) << 4) | phase;
}
enum : unsigned { kFirstPart = 0, kRestPart = 1, kReply = 2 };

// A reply: the relay's rank (int32, then 4 bytes of padding), its outcome,
// then the payload.
constexpr size_t kRelayBytes = 8 + kOutcomeBytes;

}  // namespace

std::vector<char> outcome_message(const Outcome& mine, const void* head, size_t head_bytes, const void* body,
                                  size_t body_bytes) {
  if (!mine.ok()) body_bytes = 0;
  std::vector<char> m(kOutcomeBytes + head_bytes + body_bytes);
  write_outcome(mine, m.data());
  if (head_bytes) std::memcpy(m.data() + kOutcomeBytes, head, head_bytes);
  if (body && body_bytes) std::memcpy(m.data() + kOutcomeBytes + head_bytes, body, body_bytes);
  return m;
}

std::vector<std::vector<char>> exchange_messages(kt_comm& comm, const char* where,
                                                 std::vector<std::vector<char>> messages,
                                                 const std::vector<bool>& from, size_t head_bytes,
                                                 size_t inline_body, const BodyBytes& body_bytes_of) {
  const uint64_t call = comm.message_calls;
  const size_t first = kOutcomeBytes + head_bytes + inline_body;
  const int me = comm.rank;
  Transport& t = comm.cpu_transport(where);
  using Message = Transport::Message;
  std::vector<Message> sends, rest_sends;
  for (int r = 0; r < comm.world; ++r) {
    std::vector<char>& m = messages[static_cast<size_t>(r)];
    if (r == me || m.empty()) continue;
    const size_t whole = m.size();
    m.resize(std::max(whole, first));  // the first message's padding
    sends.push_back({m.data(), first, r, message_slot(call, kFirstPart)});
    if (whole > first) rest_sends.push_back({m.data() + first, whole - first, r, message_slot(call, kRestPart)});
  }
  std::vector<std::vector<char>> in(static_cast<size_t>(comm.world));
  std::vector<Message> firsts, rests;
  for (int r = 0; r < comm.world; ++r) {
    if (r == me || !from[static_cast<size_t>(r)]) continue;
    in[static_cast<size_t>(r)].resize(first);
    firsts.push_back({in[static_cast<size_t>(r)].data(), first, r, message_slot(call, kFirstPart)});
  }
  // A rank that receives nothing sends its rests with its first messages (one
  // trip). One that receives waits for its first messages before the rests
  // go: a send completes only once its peer receives it, and two ranks each
  // sending a rest would otherwise each wait for the other's receive.
  if (firsts.empty()) {
    sends.insert(sends.end(), rest_sends.begin(), rest_sends.end());
    rest_sends.clear();
  }
  if (!sends.empty() || !firsts.empty()) comm.run(where, [&] { t.exchange(sends, firsts); });
  for (int r = 0; r < comm.world; ++r) {
    if (r == me || !from[static_cast<size_t>(r)]) continue;
    std::vector<char>& m = in[static_cast<size_t>(r)];
    const OutcomeView o(m.data());
    const size_t whole = kOutcomeBytes + head_bytes + (o.ok() ? body_bytes_of(m.data() + kOutcomeBytes) : 0);
    m.resize(std::max(whole, first));
    if (whole > first) rests.push_back({m.data() + first, whole - first, r, message_slot(call, kRestPart)});
    m.resize(whole);
  }
  if (!rest_sends.empty() || !rests.empty()) comm.run(where, [&] { t.exchange(rest_sends, rests); });
  in[static_cast<size_t>(me)] = std::move(messages[static_cast<size_t>(me)]);
  return in;
}

void raise_first_failure(const std::vector<std::vector<char>>& messages, const char* where) {
  for (size_t r = 0; r < messages.size(); ++r)
    if (!messages[r].empty()) raise_outcome(messages[r].data(), static_cast<int>(r), where);
}

std::vector<std::vector<char>> to_owner(kt_comm& comm, const char* where, int owner, const Outcome& mine,
                                        const void* head, size_t head_bytes, const void* body, size_t body_bytes,
                                        const BodyBytes& body_bytes_of) {
  std::vector<std::vector<char>> messages(static_cast<size_t>(comm.world));
  messages[static_cast<size_t>(owner)] = outcome_message(mine, head, head_bytes, body, body_bytes);
  const std::vector<bool> from(static_cast<size_t>(comm.world), comm.rank == owner);
  std::vector<std::vector<char>> all =
      exchange_messages(comm, where, std::move(messages), from, head_bytes, kInlineBody, body_bytes_of);
  if (comm.rank != owner) all.clear();
  return all;
}

Relay first_failure(const std::vector<std::vector<char>>& messages) {
  Relay relay;
  for (size_t r = 0; r < messages.size(); ++r) {
    const OutcomeView o(messages[r].data());
    if (o.ok()) continue;
    relay.rank = static_cast<int32_t>(r);
    relay.outcome = o.outcome();
    break;
  }
  return relay;
}

void from_owner(kt_comm& comm, const char* where, int owner, const Relay& relay,
                const std::vector<std::pair<const char*, size_t>>& payloads, char* mine, size_t mine_bytes) {
  const uint64_t call = comm.message_calls;
  Transport& t = comm.cpu_transport(where);
  using Message = Transport::Message;
  std::vector<char> head(kRelayBytes, 0);
  std::memcpy(head.data(), &relay.rank, sizeof(relay.rank));
  write_outcome(relay.outcome, head.data() + 8);
  if (comm.rank == owner) {
    std::vector<std::vector<char>> replies(static_cast<size_t>(comm.world));
    std::vector<Message> sends;
    for (int r = 0; r < comm.world; ++r) {
      const auto& p = payloads[static_cast<size_t>(r)];
      if (r == owner) {
        if (relay.outcome.ok() && p.second) std::memcpy(mine, p.first, p.second);
        continue;
      }
      std::vector<char>& m = replies[static_cast<size_t>(r)];
      m.assign(kRelayBytes + p.second, 0);
      std::memcpy(m.data(), head.data(), kRelayBytes);
      if (relay.outcome.ok() && p.second) std::memcpy(m.data() + kRelayBytes, p.first, p.second);
      sends.push_back({m.data(), m.size(), r, message_slot(call, kReply)});
    }
    comm.run(where, [&] { t.exchange(sends, {}); });
  } else {
    std::vector<char> m(kRelayBytes + mine_bytes);
    comm.run(where, [&] { t.exchange({}, {{m.data(), m.size(), owner, message_slot(call, kReply)}}); });
    std::memcpy(head.data(), m.data(), kRelayBytes);
    if (mine_bytes) std::memcpy(mine, m.data() + kRelayBytes, mine_bytes);
  }
  int32_t rank;
  std::memcpy(&rank, head.data(), sizeof(rank));
  if (rank >= 0) raise_outcome(head.data() + 8, rank, where);
  const OutcomeView o(head.data() + 8);
  if (!o.ok()) {
    const Outcome whole = o.outcome();
    fail(whole.status, whole.message);
  }
}

}  // namespace kt::dist

kt_comm::~kt_comm() {
  if (cuda) cuda->abort();
  if (cpu) cpu->abort();
}

void kt_comm::check_usable(const char* where) const {
  KT_CHECK(!broken, KT_ERR_COMM,
           std::string(where) + ": the communicator is unusable since a collective failed (" +
               broken_why + "); destroy it");
}

kt::dist::Transport& kt_comm::cpu_transport(const char* where) const {
  KT_CHECK(
      cpu != nullptr, KT_ERR_UNSUPPORTED,
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
