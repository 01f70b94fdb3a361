// The ABI of communicators and distributed layers (kt_comm_*, kt_dist_*).
#include <pthread.h>
#include <signal.h>

#include <cstring>
#include <string>

#include "api/guard.h"
#include "runtime/handles.h"
#include "core/checked.h"
#include "core/sized_struct.h"
#include "core/tensor.h"
#include "dist/comm.h"
#include "dist/comm_create.h"
#include "dist/dist_ckpt.h"
#include "dist/dist_moe.h"
#include "kt_c_api.h"

using kt::HandleKind;

namespace {

// Writing to a socket whose peer died raises SIGPIPE, whose default action
// kills the process; the transport does not always write with MSG_NOSIGNAL.
// Every call here runs with SIGPIPE blocked on the calling thread (threads
// the transport starts inherit that), and a SIGPIPE it raised is taken
// before the mask is restored: a dead peer becomes KT_ERR_COMM, and the
// host's own handling of SIGPIPE is not changed.
class SigpipeBlocked {
 public:
  SigpipeBlocked() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &saved_);
  }
  ~SigpipeBlocked() {
    if (sigismember(&saved_, SIGPIPE)) return;  // it was blocked before: leave it pending
    sigset_t pending;
    const struct timespec now = {0, 0};
    while (sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) && sigtimedwait(&pipe_, nullptr, &now) == SIGPIPE) {
    }
    pthread_sigmask(SIG_SETMASK, &saved_, nullptr);
  }
  SigpipeBlocked(const SigpipeBlocked&) = delete;
  SigpipeBlocked& operator=(const SigpipeBlocked&) = delete;

 private:
  sigset_t pipe_, saved_;
};

template <class F>
kt_status guarded(const char* where, F&& fn) {
  SigpipeBlocked blocked;
  return kt::guarded(where, std::forward<F>(fn));
}

void set_comm_options_defaults(kt_comm_options& o) {
  o.backend = "gloo";
  o.world_size = 1;
  o.store_prefix = "kt";
  o.hostname = "127.0.0.1";
  o.timeout_ms = 30000;
  o.cuda_device = -1;
}

void set_dist_options_defaults(kt_dist_moe_options& o) {
  o.mode = KT_DIST_OWNER;
  o.owner_rank = 0;
  o.grad_average = KT_DIST_GRAD_SUM;
}

void set_moe_defaults(kt_moe_options& o) { kt_moe_options_defaults(&o, sizeof(o)); }



kt_comm_backends backends_struct(const kt::dist::Backends& b) {
  kt_comm_backends out{};
  out.struct_size = sizeof(out);
  out.cpu = b.cpu;
  out.cuda = b.cuda;
  out.device = b.device();
  return out;
}

std::shared_ptr<kt_comm> live_comm(const kt_comm* c, const char* where) {
  return kt::live(c, HandleKind::kComm, where, "comm");
}

std::shared_ptr<kt_dist_moe> live_dist(const kt_dist_moe* d, const char* where) {
  return kt::live(d, HandleKind::kDistMoe, where, "dist");
}

// The tensor of a kt_comm collective: compact, on the CPU (CPU backend) or
// a CUDA device (CUDA backend). Returns its byte count.
size_t collective_bytes(const DLTensor* t, const char* where, const char* name) {
  KT_CHECK(t != nullptr, KT_ERR_NULL_POINTER, std::string(where) + ": " + name + " is NULL");
  KT_CHECK(t->ndim >= 0 && t->ndim <= 8, KT_ERR_SHAPE,
           std::string(where) + ": " + name + " has rank " + std::to_string(t->ndim));
  KT_CHECK(t->ndim == 0 || t->shape != nullptr, KT_ERR_NULL_POINTER,
           std::string(where) + ": " + name + " has NULL shape");
  KT_CHECK(t->dtype.lanes == 1 && t->dtype.bits % 8 == 0 && t->dtype.bits > 0, KT_ERR_DTYPE,
           std::string(where) + ": " + name + " has an element type of " +
               std::to_string(t->dtype.bits) + " bits x " + std::to_string(t->dtype.lanes) +
               " lanes (whole bytes, one lane)");
  kt::CheckedSize bytes = int64_t{t->dtype.bits / 8};
  int64_t compact = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    KT_CHECK(t->shape[i] >= 0, KT_ERR_SHAPE,
             std::string(where) + ": " + name + " has a negative extent");
    KT_CHECK(!t->strides || t->shape[i] <= 1 || t->strides[i] == compact, KT_ERR_STRIDE,
             std::string(where) + ": " + name + " must be compact (row-major)");
    bytes *= t->shape[i];
    compact = bytes.overflow() ? 0 : bytes.value() / (t->dtype.bits / 8);
  }
  KT_CHECK(!bytes.overflow(), KT_ERR_SHAPE,
           std::string(where) + ": " + name + "'s size overflows 64 bits");
  KT_CHECK(bytes.value() == 0 || t->data != nullptr, KT_ERR_NULL_POINTER,
           std::string(where) + ": " + name + "->data is NULL");
  return static_cast<size_t>(bytes.value());
}

// The transport for a tensor's device, or the reason there is none.
kt::dist::Transport& transport_for(kt_comm& c, const DLTensor* t, const char* where, const char* name) {
  const int dev = t->device.device_type;
  if (dev == kDLCPU || dev == kDLCUDAHost) return c.cpu_transport(where);
  KT_CHECK(dev == kDLCUDA, KT_ERR_DEVICE,
           std::string(where) + ": " + name + " is on device type " + std::to_string(dev) +
               " (CPU or CUDA only)");
  KT_CHECK(c.cuda != nullptr, KT_ERR_UNSUPPORTED,
           std::string(where) + ": " + name +
               " is a CUDA tensor but the communicator has no CUDA backend");
  return *c.cuda;
}

// The agreement step of kt_comm_broadcast and kt_comm_allgather: outcomes,
// and values every rank must pass alike (on the CPU backend; a CUDA-only
// communicator has none, and each rank answers for itself).
void agree_on(kt_comm& c, const char* where, const kt::dist::Outcome& mine, const int64_t* values, size_t n,
              const char* what) {
  if (!c.cpu) {
    if (!mine.ok()) kt::fail(mine.status, mine.message);
    return;
  }
  const size_t bytes = n * sizeof(int64_t);
  const std::vector<char> all = kt::dist::agree(c, where, mine, values, bytes);
  for (int r = 1; r < c.world; ++r)
    KT_CHECK(std::memcmp(all.data() + static_cast<size_t>(r) * bytes, all.data(), bytes) == 0,
             KT_ERR_INVALID_ARGUMENT,
             std::string(where) + ": the ranks disagree on " + what + " (rank " +
                 std::to_string(r) + " differs from rank 0)");
}

char* data_of(const DLTensor* t) { return static_cast<char*>(t->data) + t->byte_offset; }

// kt_dist_ckpt_save / _load. Arguments a rank can check alone are checked
// inside, where the ranks exchange their outcomes: a bad one fails every rank.
template <class Run>
kt_status checkpoint_call(const char* w, Run run, kt_comm* comm, const char* dir, const kt_dist_ckpt_layer* layers,
                          size_t num_layers, const kt_dist_ckpt_options* options) {
  return guarded(w, [&] {
    const std::shared_ptr<kt_comm> c = live_comm(comm, w);
    KT_CHECK(c->cpu != nullptr, KT_ERR_UNSUPPORTED,
             std::string(w) +
                 ": a distributed checkpoint agrees over CPU messages: the communicator needs a "
                 "CPU backend (gloo)");
    run(*c, dir, layers, num_layers, options, w);
  });
}

}  // namespace

extern "C" {

kt_status kt_comm_parse_backend(const char* backend, kt_comm_backends* out) {
  const char* w = "kt_comm_parse_backend";
  return guarded(w, [&] {
    KT_CHECK(out != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": out is NULL");
    const kt::dist::Backends b = kt::dist::parse_backends(backend, std::string(w) + ": backend");
    kt::write_sized(out, backends_struct(b), w, "out");
  });
}

void kt_comm_options_defaults(kt_comm_options* options, size_t struct_size) {
  kt::write_defaults(options, struct_size, set_comm_options_defaults);
}

kt_status kt_comm_create(const kt_comm_options* options, kt_comm** comm) {
  const char* w = "kt_comm_create";
  return guarded(w, [&] {
    KT_CHECK(comm != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": comm is NULL");
    const kt_comm_options o = kt::read_sized(options, set_comm_options_defaults, w, "options");
    const std::shared_ptr<kt_comm> c = kt::dist::create_comm(o, w);
    *comm = kt::handle_value<kt_comm>(kt::add_handle(HandleKind::kComm, c));
  });
}

void kt_comm_destroy(kt_comm* comm) {
  if (!comm) return;
  try {
    if (!kt::remove_handle(kt::handle_id(comm), HandleKind::kComm))
      kt::set_last_error(kt::not_live_message(comm, HandleKind::kComm, "kt_comm_destroy", "comm"));
  } catch (...) {
    // Destruction cannot report; nothing here throws in practice.
  }
}

kt_status kt_comm_get_info(const kt_comm* comm, kt_comm_info* info) {
  const char* w = "kt_comm_get_info";
  return guarded(w, [&] {
    const std::shared_ptr<kt_comm> c = live_comm(comm, w);
    kt_comm_info full{};
    full.struct_size = sizeof(full);
    full.rank = c->rank;
    full.world_size = c->world;
    full.backends = backends_struct(c->backends);
    full.timeout_ms = c->timeout.count();
    {
      std::lock_guard<std::mutex> lock(c->mutex);
      full.usable = c->broken ? 0 : 1;
    }
    kt::write_sized(info, full, w, "info");
  });
}

kt_status kt_comm_nccl_unique_id(void* id, size_t size) {
  const char* w = "kt_comm_nccl_unique_id";
  return guarded(w, [&] {
    KT_CHECK(id != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": id is NULL");
    KT_CHECK(size >= KT_NCCL_UNIQUE_ID_BYTES, KT_ERR_INVALID_ARGUMENT,
             std::string(w) + ": size = " + std::to_string(size) +
                 " is below KT_NCCL_UNIQUE_ID_BYTES (" + std::to_string(KT_NCCL_UNIQUE_ID_BYTES) +
                 ")");
    kt::dist::nccl_unique_id(id);
  });
}

kt_status kt_comm_barrier(kt_comm* comm) {
  const char* w = "kt_comm_barrier";
  return guarded(w, [&] {
    const std::shared_ptr<kt_comm> c = live_comm(comm, w);
    std::lock_guard<std::mutex> lock(c->mutex);
    kt::dist::Transport& t = c->cpu ? *c->cpu : *c->cuda;
    c->run(w, [&] { t.barrier(); });
  });
}

kt_status kt_comm_broadcast(kt_comm* comm, DLTensor* tensor, int root) {
  const char* w = "kt_comm_broadcast";
  return guarded(w, [&] {
    const std::shared_ptr<kt_comm> c = live_comm(comm, w);
    std::lock_guard<std::mutex> lock(c->mutex);
    c->check_usable(w);
    // The size and root are agreed on first (on the CPU backend, when there
    // is one): a mismatch fails every rank instead of corrupting memory.
    size_t bytes = 0;
    kt::dist::Transport* t = nullptr;
    const kt::dist::Outcome mine = kt::dist::attempt([&] {
      bytes = collective_bytes(tensor, w, "tensor");
      t = &transport_for(*c, tensor, w, "tensor");
      KT_CHECK(root >= 0 && root < c->world, KT_ERR_INVALID_ARGUMENT,
               std::string(w) + ": root = " + std::to_string(root) + " is outside [0, " +
                   std::to_string(c->world) + ")");
    });
    const int64_t agreed[2] = {static_cast<int64_t>(bytes), root};
    agree_on(*c, w, mine, agreed, 2, "the tensor's byte size or the root");
    if (bytes) c->run(w, [&] { t->broadcast(data_of(tensor), bytes, root); });
  });
}

kt_status kt_comm_allgather(kt_comm* comm, const DLTensor* in, DLTensor* out) {
  const char* w = "kt_comm_allgather";
  return guarded(w, [&] {
    const std::shared_ptr<kt_comm> c = live_comm(comm, w);
    std::lock_guard<std::mutex> lock(c->mutex);
    c->check_usable(w);
    size_t bytes = 0;
    kt::dist::Transport* t = nullptr;
    const kt::dist::Outcome mine = kt::dist::attempt([&] {
      bytes = collective_bytes(in, w, "in");
      const size_t out_bytes = collective_bytes(out, w, "out");
      t = &transport_for(*c, in, w, "in");
      KT_CHECK(out->device.device_type == in->device.device_type &&
                   out->device.device_id == in->device.device_id,
               KT_ERR_DEVICE, std::string(w) + ": out is not on in's device");
      KT_CHECK(out->dtype.code == in->dtype.code && out->dtype.bits == in->dtype.bits, KT_ERR_DTYPE,
               std::string(w) + ": out's dtype differs from in's");
      KT_CHECK(out_bytes == bytes * static_cast<size_t>(c->world) && out->ndim == in->ndim + 1 &&
                   out->shape[0] == c->world,
               KT_ERR_SHAPE,
               std::string(w) + ": out must be [world_size = " + std::to_string(c->world) +
                   ", ...in's shape]");
      for (int i = 0; i < in->ndim; ++i)
        KT_CHECK(out->shape[i + 1] == in->shape[i], KT_ERR_SHAPE,
                 std::string(w) + ": out must be [world_size, ...in's shape]");
    });
    const int64_t agreed = static_cast<int64_t>(bytes);
    agree_on(*c, w, mine, &agreed, 1, "in's byte size");
    if (bytes) c->run(w, [&] { t->allgather(data_of(in), data_of(out), bytes); });
  });
}

void kt_dist_moe_options_defaults(kt_dist_moe_options* options, size_t struct_size) {
  kt::write_defaults(options, struct_size, set_dist_options_defaults);
}

kt_status kt_dist_moe_create(kt_comm* comm, kt_engine* engine, const kt_moe_options* layer_options,
                             const kt_dist_moe_options* options, kt_dist_moe** dist) {
  const char* w = "kt_dist_moe_create";
  return guarded(w, [&] {
    const std::shared_ptr<kt_comm> c = live_comm(comm, w);
    KT_CHECK(c->cpu != nullptr, KT_ERR_UNSUPPORTED,
             std::string(w) +
                 ": a distributed layer exchanges CPU rows: the communicator needs a CPU backend "
                 "(gloo)");
    KT_CHECK(dist != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": dist is NULL");
    KT_CHECK(layer_options != nullptr, KT_ERR_NULL_POINTER,
             std::string(w) + ": layer_options is NULL (the shapes are required)");
    auto d = std::make_shared<kt_dist_moe>();
    d->comm = c;
    d->layer_options = kt::read_sized(layer_options, set_moe_defaults, w, "layer_options");
    d->options = kt::read_sized(options, set_dist_options_defaults, w, "options");
    d->handle = kt::add_handle(HandleKind::kDistMoe, d);
    try {
      d->create(engine, w);
    } catch (...) {
      kt::remove_handle(d->handle, HandleKind::kDistMoe);
      throw;
    }
    d->options.expert_ranks = nullptr;  // borrowed for the call only
    *dist = kt::handle_value<kt_dist_moe>(d->handle);
  });
}

void kt_dist_moe_destroy(kt_dist_moe* dist) {
  if (!dist) return;
  try {
    const std::shared_ptr<void> d = kt::remove_handle(kt::handle_id(dist), HandleKind::kDistMoe);
    if (!d) {
      kt::set_last_error(kt::not_live_message(dist, HandleKind::kDistMoe, "kt_dist_moe_destroy", "dist"));
      return;
    }
    std::static_pointer_cast<kt_dist_moe>(d)->end_contexts();
  } catch (...) {
    // Destruction cannot report; nothing here throws in practice.
  }
}

kt_status kt_dist_moe_layer(const kt_dist_moe* dist, kt_moe** layer) {
  const char* w = "kt_dist_moe_layer";
  return guarded(w, [&] {
    const std::shared_ptr<kt_dist_moe> d = live_dist(dist, w);
    KT_CHECK(layer != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": layer is NULL");
    *layer = d->local;
  });
}

kt_status kt_dist_moe_local_experts(const kt_dist_moe* dist, int64_t* experts, int64_t capacity, int64_t* count) {
  const char* w = "kt_dist_moe_local_experts";
  return guarded(w, [&] {
    const std::shared_ptr<kt_dist_moe> d = live_dist(dist, w);
    KT_CHECK(count != nullptr, KT_ERR_NULL_POINTER, std::string(w) + ": count is NULL");
    KT_CHECK(capacity >= 0, KT_ERR_INVALID_ARGUMENT, std::string(w) + ": capacity is negative");
    KT_CHECK(capacity == 0 || experts != nullptr, KT_ERR_NULL_POINTER,
             std::string(w) + ": experts is NULL");
    const int64_t n = static_cast<int64_t>(d->local_experts.size());
    for (int64_t i = 0; i < std::min(n, capacity); ++i) experts[i] = d->local_experts[static_cast<size_t>(i)];
    *count = n;
  });
}

kt_status kt_dist_moe_forward(kt_dist_moe* dist, const kt_arg* args, size_t num_args, kt_dist_context** saved) {
  const char* w = "kt_dist_moe_forward";
  return guarded(w, [&] {
    const std::shared_ptr<kt_dist_moe> d = live_dist(dist, w);
    kt_dist_context* ctx = d->forward(args, num_args, saved != nullptr, w);
    if (saved) *saved = ctx;
  });
}

kt_status kt_dist_moe_backward(kt_dist_moe* dist, kt_dist_context* ctx, const kt_backward_options* options,
                               const kt_arg* args, size_t num_args) {
  const char* w = "kt_dist_moe_backward";
  return guarded(w, [&] {
    const std::shared_ptr<kt_dist_moe> d = live_dist(dist, w);
    // A bad context is this rank's outcome, exchanged like any other.
    const std::shared_ptr<kt_dist_context> c = std::static_pointer_cast<kt_dist_context>(
        kt::find_handle(kt::handle_id(ctx), HandleKind::kDistContext));
    d->backward(c.get(), options, args, num_args, w);
  });
}

void kt_dist_context_release(kt_dist_context* ctx) {
  if (!ctx) return;
  try {
    const std::shared_ptr<kt_dist_context> c = std::static_pointer_cast<kt_dist_context>(
        kt::remove_handle(kt::handle_id(ctx), HandleKind::kDistContext));
    if (!c) {
      kt::set_last_error("kt_dist_context_release: ctx is not a live kt_dist_context (released already, or its "
                         "layer was destroyed); nothing was released");
      return;
    }
    if (auto d = std::static_pointer_cast<kt_dist_moe>(kt::find_handle(c->layer, HandleKind::kDistMoe))) {
      std::lock_guard<std::mutex> lock(d->contexts_mutex);
      d->contexts.erase(c->handle);
    }
    if (c->local) kt_context_release(c->local);
  } catch (...) {
    // Release cannot report; nothing here throws in practice.
  }
}

void kt_dist_ckpt_options_defaults(kt_dist_ckpt_options* options, size_t struct_size) {
  kt::write_defaults(options, struct_size, kt::dist::set_checkpoint_options_defaults);
}

kt_status kt_dist_ckpt_save(kt_comm* comm, const char* dir, const kt_dist_ckpt_layer* layers, size_t num_layers,
                            const kt_dist_ckpt_options* options) {
  return checkpoint_call("kt_dist_ckpt_save", kt::dist::save_checkpoint, comm, dir, layers, num_layers, options);
}

kt_status kt_dist_ckpt_load(kt_comm* comm, const char* dir, const kt_dist_ckpt_layer* layers, size_t num_layers,
                            const kt_dist_ckpt_options* options) {
  return checkpoint_call("kt_dist_ckpt_load", kt::dist::load_checkpoint, comm, dir, layers, num_layers, options);
}

}  // extern "C"
