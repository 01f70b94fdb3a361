// NCCL on CUDA memory. libnccl.so.2 and libcudart.so are opened at run time
// (dlopen), so libkt itself never depends on CUDA: a machine without them
// (or without a device) gets KT_ERR_UNSUPPORTED when it asks for NCCL.
// Every operation is enqueued on the communicator's own stream and waited
// for by polling, with NCCL's asynchronous error and the timeout checked
// meanwhile; past the timeout the NCCL communicator is aborted
// (KT_ERR_COMM), so a dead peer never hangs the caller.
#include "dist/transport.h"

#include "core/error.h"

#if KT_HAVE_NCCL

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include <cstring>
#include <thread>

namespace kt::dist {
namespace {

struct Nccl {
  void* nccl = nullptr;
  void* cudart = nullptr;
#define KT_NCCL_FN(name) decltype(&::name) name = nullptr;
  KT_NCCL_FN(ncclGetUniqueId)
  KT_NCCL_FN(ncclCommInitRankConfig)
  KT_NCCL_FN(ncclCommDestroy)
  KT_NCCL_FN(ncclCommAbort)
  KT_NCCL_FN(ncclCommGetAsyncError)
  KT_NCCL_FN(ncclGetErrorString)
  KT_NCCL_FN(ncclAllGather)
  KT_NCCL_FN(ncclBroadcast)
  KT_NCCL_FN(ncclAllReduce)
  KT_NCCL_FN(ncclSend)
  KT_NCCL_FN(ncclRecv)
  KT_NCCL_FN(ncclGroupStart)
  KT_NCCL_FN(ncclGroupEnd)
  KT_NCCL_FN(cudaGetDeviceCount)
  KT_NCCL_FN(cudaSetDevice)
  KT_NCCL_FN(cudaStreamCreateWithFlags)
  KT_NCCL_FN(cudaStreamDestroy)
  KT_NCCL_FN(cudaStreamQuery)
  // (cuda_runtime.h overloads cudaMalloc with templates: the C one by type.)
  cudaError_t (*cudaMalloc)(void**, size_t) = nullptr;
  KT_NCCL_FN(cudaFree)
  KT_NCCL_FN(cudaGetErrorString)
#undef KT_NCCL_FN
  std::string why_not;  // empty when loaded
};

template <class Fn>
void bind(void* lib, const char* name, Fn* fn, std::string* missing) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (!*fn && missing->empty()) *missing = name;
}

// Opened once per process and never closed (NCCL keeps threads of its own).
const Nccl& nccl_library() {
  static const Nccl lib = [] {
    Nccl n;
    n.nccl = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!n.nccl) n.nccl = dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
    n.cudart = dlopen("libcudart.so", RTLD_NOW | RTLD_LOCAL);
    if (!n.cudart) n.cudart = dlopen("libcudart.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!n.cudart) n.cudart = dlopen("libcudart.so.12", RTLD_NOW | RTLD_LOCAL);
    if (!n.nccl || !n.cudart) {
      n.why_not = std::string("cannot open ") + (n.nccl ? "libcudart.so" : "libnccl.so.2") + " (" + dlerror() + ")";
      return n;
    }
    std::string missing;
#define KT_NCCL_BIND(lib, name) bind(n.lib, #name, &n.name, &missing);
    KT_NCCL_BIND(nccl, ncclGetUniqueId)
    KT_NCCL_BIND(nccl, ncclCommInitRankConfig)
    KT_NCCL_BIND(nccl, ncclCommDestroy)
    KT_NCCL_BIND(nccl, ncclCommAbort)
    KT_NCCL_BIND(nccl, ncclCommGetAsyncError)
    KT_NCCL_BIND(nccl, ncclGetErrorString)
    KT_NCCL_BIND(nccl, ncclAllGather)
    KT_NCCL_BIND(nccl, ncclBroadcast)
    KT_NCCL_BIND(nccl, ncclAllReduce)
    KT_NCCL_BIND(nccl, ncclSend)
    KT_NCCL_BIND(nccl, ncclRecv)
    KT_NCCL_BIND(nccl, ncclGroupStart)
    KT_NCCL_BIND(nccl, ncclGroupEnd)
    KT_NCCL_BIND(cudart, cudaGetDeviceCount)
    KT_NCCL_BIND(cudart, cudaSetDevice)
    KT_NCCL_BIND(cudart, cudaStreamCreateWithFlags)
    KT_NCCL_BIND(cudart, cudaStreamDestroy)
    KT_NCCL_BIND(cudart, cudaStreamQuery)
    KT_NCCL_BIND(cudart, cudaMalloc)
    KT_NCCL_BIND(cudart, cudaFree)
    KT_NCCL_BIND(cudart, cudaGetErrorString)
#undef KT_NCCL_BIND
    if (!missing.empty()) n.why_not = "the loaded NCCL or CUDA runtime lacks " + missing;
    return n;
  }();
  return lib;
}

const Nccl& loaded() {
  const Nccl& n = nccl_library();
  KT_CHECK(n.why_not.empty(), KT_ERR_UNSUPPORTED, "NCCL: " + n.why_not);
  return n;
}

void cuda_check(const Nccl& n, cudaError_t rc, const char* what) {
  KT_CHECK(rc == cudaSuccess, KT_ERR_UNSUPPORTED,
           std::string("NCCL: ") + what + ": " + n.cudaGetErrorString(rc));
}

class NcclTransport : public Transport {
 public:
  explicit NcclTransport(const TransportOptions& o) : n_(loaded()), timeout_(o.timeout), world_(o.world) {
    int devices = 0;
    cuda_check(n_, n_.cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
    KT_CHECK(devices > 0, KT_ERR_UNSUPPORTED, "NCCL: this machine has no CUDA device");
    if (o.cuda_device >= 0) {
      KT_CHECK(o.cuda_device < devices, KT_ERR_INVALID_ARGUMENT,
               "options->cuda_device = " + std::to_string(o.cuda_device) + " but the machine has " +
                   std::to_string(devices) + " CUDA devices");
      cuda_check(n_, n_.cudaSetDevice(o.cuda_device), "cudaSetDevice");
    }
    cuda_check(n_, n_.cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    if (o.nccl_comm) {
      comm_ = static_cast<ncclComm_t>(o.nccl_comm);
      owned_ = false;
      return;
    }
    ncclUniqueId id;
    std::memcpy(&id, o.nccl_unique_id, sizeof(id));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // initialisation is waited for with the timeout
    nccl_check(n_.ncclCommInitRankConfig(&comm_, o.world, id, o.rank, &config), "ncclCommInitRankConfig");
    owned_ = true;
    wait_comm("ncclCommInitRankConfig");
  }

  ~NcclTransport() override {
    if (comm_ && owned_) n_.ncclCommDestroy(comm_);
    if (scratch_) n_.cudaFree(scratch_);
    if (stream_) n_.cudaStreamDestroy(stream_);
  }

  void allgather(const void* in, void* out, size_t bytes) override {
    nccl_check(n_.ncclAllGather(in, out, bytes, ncclInt8, comm_, stream_), "ncclAllGather");
    wait_stream("ncclAllGather");
  }

  void alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                 const std::vector<int64_t>& recv_bytes) override {
    nccl_check(n_.ncclGroupStart(), "ncclGroupStart");
    size_t in_off = 0, out_off = 0;
    for (int r = 0; r < world_; ++r) {
      const size_t s = static_cast<size_t>(send_bytes[static_cast<size_t>(r)]);
      const size_t v = static_cast<size_t>(recv_bytes[static_cast<size_t>(r)]);
      if (s) nccl_check(n_.ncclSend(static_cast<const char*>(in) + in_off, s, ncclInt8, r, comm_, stream_), "ncclSend");
      if (v) nccl_check(n_.ncclRecv(static_cast<char*>(out) + out_off, v, ncclInt8, r, comm_, stream_), "ncclRecv");
      in_off += s;
      out_off += v;
    }
    nccl_check(n_.ncclGroupEnd(), "ncclGroupEnd");
    wait_stream("alltoallv (ncclSend/ncclRecv)");
  }

  // NCCL matches a pair's sends and receives in issue order: slots are not
  // needed, the callers' order per peer is the same on both sides.
  void exchange(const std::vector<Message>& sends, const std::vector<Message>& receives) override {
    nccl_check(n_.ncclGroupStart(), "ncclGroupStart");
    for (const Message& m : sends)
      nccl_check(n_.ncclSend(m.data, m.bytes, ncclInt8, m.peer, comm_, stream_), "ncclSend");
    for (const Message& m : receives)
      nccl_check(n_.ncclRecv(m.data, m.bytes, ncclInt8, m.peer, comm_, stream_), "ncclRecv");
    nccl_check(n_.ncclGroupEnd(), "ncclGroupEnd");
    wait_stream("point-to-point messages (ncclSend/ncclRecv)");
  }

  void broadcast(void* buf, size_t bytes, int root) override {
    nccl_check(n_.ncclBroadcast(buf, buf, bytes, ncclInt8, root, comm_, stream_), "ncclBroadcast");
    wait_stream("ncclBroadcast");
  }

  void barrier() override {
    if (!scratch_) cuda_check(n_, n_.cudaMalloc(&scratch_, sizeof(int)), "cudaMalloc");
    nccl_check(n_.ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream_), "ncclAllReduce");
    wait_stream("barrier (ncclAllReduce)");
  }

  void abort() noexcept override {
    if (comm_ && owned_) {
      n_.ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }

 private:
  void nccl_check(ncclResult_t rc, const char* what) {
    if (rc == ncclSuccess || rc == ncclInProgress) return;
    fail(KT_ERR_COMM, std::string("nccl ") + what + ": " + n_.ncclGetErrorString(rc));
  }

  void wait_comm(const char* what) {
    const auto end = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      nccl_check(n_.ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError");
      if (state == ncclSuccess) return;
      nccl_check(state, what);
      timed_out(end, what);
    }
  }

  void wait_stream(const char* what) {
    const auto end = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      const cudaError_t q = n_.cudaStreamQuery(stream_);
      if (q == cudaSuccess) return;
      KT_CHECK(q == cudaErrorNotReady, KT_ERR_COMM,
               std::string("nccl ") + what + ": " + n_.cudaGetErrorString(q));
      ncclResult_t state = ncclSuccess;
      nccl_check(n_.ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError");
      nccl_check(state, what);
      timed_out(end, what);
    }
  }

  void timed_out(std::chrono::steady_clock::time_point end, const char* what) {
    if (std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      return;
    }
    abort();
    fail(KT_ERR_COMM, std::string("nccl ") + what + ": not done after " + std::to_string(timeout_.count()) +
                          " ms (a peer died or stopped calling); the NCCL communicator was aborted");
  }

  const Nccl& n_;
  std::chrono::milliseconds timeout_;
  int world_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  bool owned_ = false;
  void* scratch_ = nullptr;
};

}  // namespace

std::unique_ptr<Transport> make_nccl_transport(const TransportOptions& o) {
  return std::make_unique<NcclTransport>(o);
}

void nccl_unique_id(void* out) {
  static_assert(sizeof(ncclUniqueId) == KT_NCCL_UNIQUE_ID_BYTES, "NCCL's unique id size");
  const Nccl& n = loaded();
  ncclUniqueId id;
  const ncclResult_t rc = n.ncclGetUniqueId(&id);
  KT_CHECK(rc == ncclSuccess, KT_ERR_UNSUPPORTED,
           std::string("NCCL: ncclGetUniqueId: ") + n.ncclGetErrorString(rc));
  std::memcpy(out, &id, sizeof(id));
}

}  // namespace kt::dist

#else  // no NCCL headers at build time

namespace kt::dist {

std::unique_ptr<Transport> make_nccl_transport(const TransportOptions&) {
  fail(KT_ERR_UNSUPPORTED, "this kt was built without NCCL (no nccl.h and CUDA headers were found)");
}

void nccl_unique_id(void*) {
  fail(KT_ERR_UNSUPPORTED, "this kt was built without NCCL (no nccl.h and CUDA headers were found)");
}

}  // namespace kt::dist

#endif
