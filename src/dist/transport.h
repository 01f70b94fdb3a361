// The collective engines behind a communicator, as byte collectives.
// Implementations wrap Gloo (CPU memory) and NCCL (CUDA memory); they throw
// kt::Error with KT_ERR_COMM when a peer fails or the timeout passes, and
// kt::Error with KT_ERR_UNSUPPORTED when the engine is not in this build.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kt_c_api.h"

namespace kt::dist {

class Transport {
 public:
  virtual ~Transport() = default;
  // out holds world * bytes: rank r's in at r * bytes.
  virtual void allgather(const void* in, void* out, size_t bytes) = 0;
  // Sends send_bytes[r] bytes from in (packed rank by rank) to rank r and
  // receives recv_bytes[r] bytes from rank r into out (packed likewise).
  virtual void alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                         const std::vector<int64_t>& recv_bytes) = 0;
  virtual void broadcast(void* buf, size_t bytes, int root) = 0;
  virtual void barrier() = 0;
  // Point-to-point: posts every send and receive, then waits for all of
  // them. A send to rank peer on a slot meets that rank's receive from this
  // rank on the same slot, of the same size; ranks choose slots so that each
  // send has one receive.
  struct Message {
    void* data;
    size_t bytes;
    int peer;
    uint64_t slot;
  };
  virtual void exchange(const std::vector<Message>& sends, const std::vector<Message>& receives) = 0;
  // After a failure: closes the connections, so peers blocked on this rank
  // fail now instead of at their timeout. Never throws.
  virtual void abort() noexcept = 0;
};

// Where the ranks meet: a directory (Gloo's file store) or the host's store.
struct Rendezvous {
  std::string path;
  const kt_comm_store* store = nullptr;  // copied: see store_copy
  kt_comm_store store_copy{};
  std::string prefix;
};

struct TransportOptions {
  int rank = 0, world = 1;
  Rendezvous rendezvous;
  std::string hostname;
  std::chrono::milliseconds timeout{30000};
  const void* nccl_unique_id = nullptr;
  void* nccl_comm = nullptr;
  int cuda_device = -1;
};

// Gloo over TCP; KT_ERR_UNSUPPORTED in a build without Gloo.
std::unique_ptr<Transport> make_gloo_transport(const TransportOptions& o);
// NCCL on the CUDA device (device pointers); KT_ERR_UNSUPPORTED in a build
// without NCCL or on a machine without libnccl, libcudart or a device.
std::unique_ptr<Transport> make_nccl_transport(const TransportOptions& o);
// A new NCCL unique id (KT_NCCL_UNIQUE_ID_BYTES).
void nccl_unique_id(void* out);

}  // namespace kt::dist
