#include "dist/comm_create.h"

#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/backend.h"
#include "dist/transport.h"

namespace kt::dist {

namespace {

void check_comm_options(const kt_comm_options& o, const char* w) {
  KT_CHECK(o.world_size >= 1 && o.world_size <= 65536, KT_ERR_INVALID_ARGUMENT,
           std::string(w) + ": options->world_size = " + std::to_string(o.world_size) +
               " is outside [1, 65536]");
  KT_CHECK(o.rank >= 0 && o.rank < o.world_size, KT_ERR_INVALID_ARGUMENT,
           std::string(w) + ": options->rank = " + std::to_string(o.rank) +
               " is outside [0, world_size = " + std::to_string(o.world_size) + ")");
  KT_CHECK(o.timeout_ms >= 1, KT_ERR_INVALID_ARGUMENT,
           std::string(w) + ": options->timeout_ms = " + std::to_string(o.timeout_ms) +
               " must be >= 1");
}

TransportOptions transport_options(const kt_comm_options& o, const kt_comm& c) {
  TransportOptions t;
  t.rank = o.rank;
  t.world = o.world_size;
  t.timeout = c.timeout;
  t.hostname = o.hostname ? o.hostname : "127.0.0.1";
  t.rendezvous.prefix = o.store_prefix ? std::string(o.store_prefix) : std::string();
  t.nccl_unique_id = o.nccl_unique_id;
  t.nccl_comm = o.nccl_comm;
  t.cuda_device = o.cuda_device;
  return t;
}

// Gloo meets its peers through a store path or a host's store.
void set_rendezvous(const kt_comm_options& o, TransportOptions* t, const char* w) {
  KT_CHECK((o.store_path != nullptr) != (o.store != nullptr), KT_ERR_INVALID_ARGUMENT,
           std::string(w) +
               ": Gloo meets its peers through options->store_path or options->store: give "
               "exactly one");
  if (o.store) {
    KT_CHECK(o.store->set != nullptr && o.store->get != nullptr, KT_ERR_NULL_POINTER,
             std::string(w) + ": options->store->set and ->get are required");
    t->rendezvous.store = o.store;
    t->rendezvous.store_copy = *o.store;
  } else {
    t->rendezvous.path = o.store_path;
    KT_CHECK(!t->rendezvous.path.empty(), KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": options->store_path is empty");
  }
}

// The ranks agree on what they were given before anything else runs.
void agree_on_setup(kt_comm& c, const char* w) {
  struct Setup {
    int32_t world, cpu, cuda, unused;
  } mine{c.world, c.backends.cpu, c.backends.cuda, 0};
  const Outcome ok;
  std::lock_guard<std::mutex> lock(c.mutex);
  const std::vector<char> all = agree(c, w, ok, &mine, sizeof(mine));
  for (int r = 0; r < c.world; ++r) {
    Setup s;
    std::memcpy(&s, all.data() + static_cast<size_t>(r) * sizeof(s), sizeof(s));
    KT_CHECK(std::memcmp(&s, &mine, sizeof(s)) == 0, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": rank " + std::to_string(r) +
                 " was given another world_size or backend string (" + std::to_string(s.world) +
                 " ranks, cpu " + backend_name(static_cast<kt_comm_backend>(s.cpu)) +
                 ", cuda " + backend_name(static_cast<kt_comm_backend>(s.cuda)) +
                 ") than rank " + std::to_string(c.rank) + " (" + std::to_string(mine.world) +
                 " ranks, cpu " + backend_name(c.backends.cpu) + ", cuda " +
                 backend_name(c.backends.cuda) + ")");
  }
}

void start_nccl(const kt_comm_options& o, TransportOptions t, kt_comm& c, const char* w) {
  unsigned char id[KT_NCCL_UNIQUE_ID_BYTES] = {};
  if (!o.nccl_unique_id && !o.nccl_comm) {
    KT_CHECK(c.cpu != nullptr, KT_ERR_INVALID_ARGUMENT,
             std::string(w) +
                 ": NCCL without a CPU backend needs options->nccl_unique_id or options->nccl_comm");
    // Rank 0 makes the id; its outcome reaches every rank first.
    std::lock_guard<std::mutex> lock(c.mutex);
    const Outcome made = attempt([&] {
      if (c.rank == 0) nccl_unique_id(id);
    });
    agree(c, w, made, nullptr, 0);
    c.run(w, [&] { c.cpu->broadcast(id, sizeof(id), 0); });
    t.nccl_unique_id = id;
  }
  if (c.cpu) {
    // A rank whose NCCL cannot start tells the others instead of
    // leaving them in NCCL's initialisation.
    std::lock_guard<std::mutex> lock(c.mutex);
    const Outcome made = attempt([&] { c.cuda = make_nccl_transport(t); });
    agree(c, w, made, nullptr, 0);
  } else {
    c.cuda = make_nccl_transport(t);
  }
}

}  // namespace

std::shared_ptr<kt_comm> create_comm(const kt_comm_options& o, const char* w) {
  auto c = std::make_shared<kt_comm>();
  c->backends = parse_backends(o.backend, std::string(w) + ": options->backend");
  check_comm_options(o, w);
  c->rank = o.rank;
  c->world = o.world_size;
  c->timeout = std::chrono::milliseconds(o.timeout_ms);
  TransportOptions t = transport_options(o, *c);
  if (c->backends.cpu == KT_COMM_BACKEND_GLOO) {
    set_rendezvous(o, &t, w);
    c->cpu = make_gloo_transport(t);
    agree_on_setup(*c, w);
  }
  if (c->backends.cuda == KT_COMM_BACKEND_NCCL) start_nccl(o, t, *c, w);
  return c;
}

}  // namespace kt::dist
