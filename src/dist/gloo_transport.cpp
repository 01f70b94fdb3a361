// Gloo over TCP: rendezvous through Gloo's file store or the host's store
// (kt_comm_store), a full mesh of connections, and Gloo's collectives.
#include "dist/transport.h"

#include "core/error.h"

#if KT_HAVE_GLOO

#include <gloo/allgather.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <thread>

namespace kt::dist {
namespace {

// The host's store (kt_comm_store callbacks) as a Gloo store. Gloo reads some
// keys without waiting for them first, and its own stores block in get until
// the key appears: so does this one, within the communicator's timeout, since
// a host's get reports a missing key at once.
class CallbackStore : public gloo::rendezvous::Store {
 public:
  CallbackStore(const kt_comm_store& s, std::chrono::milliseconds timeout) : s_(s), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    const int rc = s_.set(key.c_str(), data.data(), data.size(), s_.user);
    KT_CHECK(rc == 0, KT_ERR_COMM,
             "the host store's set of key '" + key + "' failed (" + std::to_string(rc) + ")");
  }

  std::vector<char> get(const std::string& key) override {
    wait({key}, timeout_);
    std::vector<char> value;
    KT_CHECK(try_get(key, &value), KT_ERR_COMM, "the host store has no key '" + key + "'");
    return value;
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    const auto end = std::chrono::steady_clock::now() + timeout;
    std::vector<char> unused;
    for (const std::string& key : keys) {
      auto pause = std::chrono::microseconds(200);
      while (!try_get(key, &unused)) {
        KT_CHECK(std::chrono::steady_clock::now() < end, KT_ERR_COMM,
                 "rendezvous: the host store has no key '" + key + "' after " +
                     std::to_string(timeout.count()) + " ms (did every rank call kt_comm_create?)");
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::microseconds(20000));
      }
    }
  }

 private:
  bool try_get(const std::string& key, std::vector<char>* value) {
    value->resize(256);
    for (;;) {
      size_t size = 0;
      const int rc = s_.get(key.c_str(), value->data(), value->size(), &size, s_.user);
      if (rc == 1) return false;
      KT_CHECK(rc == 0, KT_ERR_COMM,
               "the host store's get of key '" + key + "' failed (" + std::to_string(rc) + ")");
      if (size <= value->size()) {
        value->resize(size);
        return true;
      }
      value->resize(size);
    }
  }

  kt_comm_store s_;
  std::chrono::milliseconds timeout_;
};

// Gloo reports failures as exceptions of its own (a peer closed its
// connection, a timeout); they become KT_ERR_COMM with Gloo's words.
template <class F>
void gloo_call(const char* what, F&& fn) {
  try {
    fn();
  } catch (const kt::Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(KT_ERR_COMM, std::string("gloo ") + what + ": " + e.what());
  }
}

class GlooTransport : public Transport {
 public:
  explicit GlooTransport(const TransportOptions& o) : timeout_(o.timeout), world_(o.world) {
    gloo_call("rendezvous", [&] {
      if (o.rendezvous.store) {
        base_store_ = std::make_unique<CallbackStore>(o.rendezvous.store_copy, o.timeout);
      } else {
        base_store_ = std::make_unique<gloo::rendezvous::FileStore>(o.rendezvous.path);
      }
      store_ = std::make_unique<gloo::rendezvous::PrefixStore>(o.rendezvous.prefix, *base_store_);
      gloo::transport::tcp::attr attr;
      attr.hostname = o.hostname;
      device_ = gloo::transport::tcp::CreateDevice(attr);
      auto ctx = std::make_shared<gloo::rendezvous::Context>(o.rank, o.world);
      ctx->setTimeout(o.timeout);
      ctx->connectFullMesh(*store_, device_);
      ctx_ = std::move(ctx);
    });
  }

  ~GlooTransport() override { abort(); }

  void allgather(const void* in, void* out, size_t bytes) override {
    gloo_call("allgather", [&] {
      gloo::AllgatherOptions opts(ctx_);
      opts.setInput(static_cast<char*>(const_cast<void*>(in)), bytes);
      opts.setOutput(static_cast<char*>(out), bytes * static_cast<size_t>(world_));
      opts.setTimeout(timeout_);
      gloo::allgather(opts);
    });
  }

  void alltoallv(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                 const std::vector<int64_t>& recv_bytes) override {
    // Gloo wants addressable buffers even where nothing moves.
    char dummy_in = 0, dummy_out = 0;
    gloo_call("alltoallv", [&] {
      gloo::AlltoallvOptions opts(ctx_);
      opts.setInput(in ? static_cast<char*>(const_cast<void*>(in)) : &dummy_in, send_bytes);
      opts.setOutput(out ? static_cast<char*>(out) : &dummy_out, recv_bytes);
      opts.setTimeout(timeout_);
      gloo::alltoallv(opts);
    });
  }

  void broadcast(void* buf, size_t bytes, int root) override {
    gloo_call("broadcast", [&] {
      gloo::BroadcastOptions opts(ctx_);
      opts.setOutput(static_cast<char*>(buf), bytes);
      opts.setRoot(root);
      opts.setTimeout(timeout_);
      gloo::broadcast(opts);
    });
  }

  void barrier() override {
    gloo_call("barrier", [&] {
      gloo::BarrierOptions opts(ctx_);
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
    });
  }

  void exchange(const std::vector<Message>& sends, const std::vector<Message>& receives) override {
    gloo_call("point-to-point message", [&] {
      std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> out, in;
      for (const Message& m : sends) {
        out.push_back(ctx_->createUnboundBuffer(m.data, m.bytes));
        out.back()->send(m.peer, m.slot);
      }
      for (const Message& m : receives) {
        in.push_back(ctx_->createUnboundBuffer(m.data, m.bytes));
        in.back()->recv(m.peer, m.slot);
      }
      for (size_t i = 0; i < out.size(); ++i)
        KT_CHECK(out[i]->waitSend(timeout_), KT_ERR_COMM,
                 "the send to rank " + std::to_string(sends[i].peer) + " was aborted");
      for (size_t i = 0; i < in.size(); ++i)
        KT_CHECK(in[i]->waitRecv(timeout_), KT_ERR_COMM,
                 "the receive from rank " + std::to_string(receives[i].peer) + " was aborted");
    });
  }

  void abort() noexcept override {
    try {
      if (ctx_) ctx_->closeConnections();
    } catch (...) {
      // Closing what already failed: nothing more to do.
    }
  }

 private:
  std::chrono::milliseconds timeout_;
  int world_;
  std::unique_ptr<gloo::rendezvous::Store> base_store_;
  std::unique_ptr<gloo::rendezvous::Store> store_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> ctx_;
};

}  // namespace

std::unique_ptr<Transport> make_gloo_transport(const TransportOptions& o) {
  return std::make_unique<GlooTransport>(o);
}

}  // namespace kt::dist

#else  // no Gloo in this build

namespace kt::dist {

std::unique_ptr<Transport> make_gloo_transport(const TransportOptions&) {
  fail(KT_ERR_UNSUPPORTED, "this kt was built without Gloo (install libgloo-dev and rebuild)");
}

}  // namespace kt::dist

#endif
