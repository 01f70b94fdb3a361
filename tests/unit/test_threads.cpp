// Several host threads on the public ABI at once: forward, backward, submit,
// wait, release and destroy, on a shared layer, on layers of their own, and on
// short-lived layers that one thread destroys while others still call them.
// Every result is checked against the reference; a call on a handle another
// thread destroyed must be refused (KT_ERR_INVALID_HANDLE), never crash. Run
// under TSan and ASan by tools/bootstrap.sh sanitize. KT_STRESS_ROUNDS sets
// the rounds per thread (default 24).
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "tolerances.h"

namespace kt_test {
namespace {

Case small_case(kt_mode mode, uint32_t seed) {
  Case c;
  c.name = "stress";
  c.E = 4; c.K = 2; c.H = 32; c.I = 24; c.T = 6;
  c.mode = mode;
  c.rank = mode == KT_MODE_LORA ? 4 : 0;
  c.seed = seed;
  return c;
}

TensorPtr clone(const Tensor& t) {
  TensorPtr c = Tensor::make(t.t.dtype, t.shape);
  c->bytes = t.bytes;
  c->t.data = c->bytes.data();
  return c;
}

TensorPtr like(const Tensor& t) { return Tensor::make(t.t.dtype, t.shape); }

// One thread's copies of a runner's inputs, with outputs of its own.
struct Inputs {
  explicit Inputs(const Runner& r)
      : x(clone(*r.x_)), ids(clone(*r.ids_)), w(clone(*r.w_)), dy(clone(*r.dy_)), y(like(*r.y_)),
        dx(like(*r.dx_)), dw(like(*r.dw_)) {}
  TensorPtr x, ids, w, dy, y, dx, dw;
  std::vector<kt_arg> forward_args() {
    return {{KT_ARG_X, x->dl()}, {KT_ARG_IDS, ids->dl()}, {KT_ARG_ROUTE_WEIGHTS, w->dl()}, {KT_ARG_Y, y->dl()}};
  }
  std::vector<kt_arg> backward_args() {
    return {{KT_ARG_DY, dy->dl()}, {KT_ARG_DX, dx->dl()}, {KT_ARG_DROUTE_WEIGHTS, dw->dl()}};
  }
};

// Failures seen by any thread (gtest's own macros are kept to the main one).
class Failures {
 public:
  void add(const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (messages_.size() < 20) messages_.push_back(what);
    ++count_;
  }
  void expect_status(kt_status got, kt_status want, const std::string& what) {
    if (got != want) add(what + ": status " + kt_status_string(got) + " (" + kt_last_error() + ")");
  }
  void expect_close(const std::vector<double>& got, const std::vector<double>& want, double tol,
                    const std::string& what) {
    const double err = rel_l2(got, want);
    if (!(err <= tol)) add(what + ": relative error " + std::to_string(err));
  }
  int count() const { return count_; }
  std::string report() const {
    std::string s;
    for (const auto& m : messages_) s += m + "\n";
    return s;
  }

 private:
  std::mutex mutex_;
  std::vector<std::string> messages_;
  int count_ = 0;
};

TEST(ThreadStress, SharedOwnAndShortLivedLayersFromSeveralHostThreads) {
  const int rounds = std::getenv("KT_STRESS_ROUNDS") ? std::atoi(std::getenv("KT_STRESS_ROUNDS")) : 24;
  constexpr int kThreads = 4;
  // The shared layer (LoRA, dx and routing grads only: its gradient buffers
  // would be written by every thread) and its reference.
  Runner shared(small_case(KT_MODE_LORA, 1), KT_ISA_AUTO, 2);
  kt_engine_info info;
  info.struct_size = sizeof(info);
  ASSERT_EQ(kt_engine_get_info(shared.engine(), &info), KT_OK);
  const Tolerance tol = tolerance_for(info.isa, false);
  const std::vector<double> shared_y = shared.ref_forward();
  const std::vector<double> shared_dx = shared.ref_backward().dx;
  // Weights and reference of the short-lived inference layers, which live
  // on the shared engine.
  Runner plain(small_case(KT_MODE_INFERENCE, 2), KT_ISA_AUTO, 1);
  const std::vector<double> plain_y = plain.ref_forward();
  kt_moe_options plain_options;
  kt_moe_options_init(&plain_options);
  plain_options.num_experts = plain.c().E; plain_options.top_k = plain.c().K;
  plain_options.hidden = plain.c().H; plain_options.intermediate = plain.c().I;
  // Layers of each thread's own (own engine, full LoRA training).
  std::vector<std::unique_ptr<Runner>> own;
  std::vector<kt::reference::Grads> own_grads;
  for (int t = 0; t < kThreads; ++t) {
    own.push_back(std::make_unique<Runner>(small_case(KT_MODE_LORA, 10 + static_cast<uint32_t>(t)), KT_ISA_AUTO, 1));
    own_grads.push_back(own.back()->ref_backward());
  }
  Failures failures;
  // Handles one thread publishes and others use while it may destroy them.
  std::atomic<kt_moe*> published_layer{nullptr};
  std::atomic<kt_job*> published_job{nullptr};
  std::atomic<int> refused{0}, accepted{0}, cancelled{0};

  auto worker = [&](int t) {
    Inputs s(shared), p(plain);
    std::vector<kt_arg> sf = s.forward_args(), sb = s.backward_args(), pf = p.forward_args();
    kt_backward_options no_param_grads;
    kt_backward_options_init(&no_param_grads);
    no_param_grads.param_grads = 0;
    const std::string who = "thread " + std::to_string(t);
    for (int k = 0; k < rounds; ++k) {
      const std::string at = who + " round " + std::to_string(k);
      switch ((t + k) % 5) {
        case 0: {  // shared layer, synchronous
          kt_context* ctx = nullptr;
          failures.expect_status(kt_moe_forward(shared.moe(), sf.data(), 4, &ctx), KT_OK, at + " forward");
          failures.expect_close(s.y->values(), shared_y, tol.forward, at + " forward y");
          failures.expect_status(kt_moe_backward(shared.moe(), ctx, &no_param_grads, sb.data(), 3), KT_OK,
                                 at + " backward");
          failures.expect_close(s.dx->values(), shared_dx, tol.dx, at + " backward dx");
          kt_context_release(ctx);
          break;
        }
        case 1: {  // shared layer, submitted (queued or deferred), waits in either order
          const unsigned flags = (k / 5) % 2 ? KT_SUBMIT_DEFERRED : 0u;
          kt_context* ctx = nullptr;
          kt_job* fj = nullptr;
          kt_job* bj = nullptr;
          failures.expect_status(kt_moe_forward_submit(shared.moe(), sf.data(), 4, &ctx, flags, &fj), KT_OK,
                                 at + " forward_submit");
          failures.expect_status(
              kt_moe_backward_submit(shared.moe(), ctx, &no_param_grads, sb.data(), 3, flags, &bj), KT_OK,
              at + " backward_submit");
          if (k % 3 == 0) kt_context_release(ctx);  // while its jobs are pending
          published_job.store(fj);
          if (k % 2) {
            failures.expect_status(kt_job_wait(bj), KT_OK, at + " wait backward");
            failures.expect_status(kt_job_wait(fj), KT_OK, at + " wait forward");
          } else {
            failures.expect_status(kt_job_wait(fj), KT_OK, at + " wait forward");
            failures.expect_status(kt_job_wait(bj), KT_OK, at + " wait backward");
          }
          failures.expect_close(s.y->values(), shared_y, tol.forward, at + " submitted y");
          failures.expect_close(s.dx->values(), shared_dx, tol.dx, at + " submitted dx");
          kt_job_destroy(fj);  // stays published: others then use a destroyed handle
          kt_job_destroy(bj);
          if (k % 3 != 0) kt_context_release(ctx);
          break;
        }
        case 2: {  // the thread's own layer, with parameter gradients
          Runner& r = *own[static_cast<size_t>(t)];
          kt_context* ctx = nullptr;
          failures.expect_status(r.forward(&ctx), KT_OK, at + " own forward");
          failures.expect_status(r.backward(ctx, 1.f, KT_GRAD_OVERWRITE), KT_OK, at + " own backward");
          failures.expect_close(r.grad_lora(1, true), own_grads[static_cast<size_t>(t)].dlb[1], tol.lora,
                                at + " own LoRA grad");
          kt_context_release(ctx);
          break;
        }
        case 3: {  // a short-lived layer on the shared engine, destroyed with a job pending
          kt_moe* layer = nullptr;
          failures.expect_status(kt_moe_create(shared.engine(), &plain_options, &layer), KT_OK, at + " create");
          kt_arg wts[] = {{KT_ARG_W_GATE, plain.W_[0]->dl()}, {KT_ARG_W_UP, plain.W_[1]->dl()},
                          {KT_ARG_W_DOWN, plain.W_[2]->dl()}};
          failures.expect_status(kt_moe_load_weights(layer, nullptr, wts, 3), KT_OK, at + " load");
          published_layer.store(layer);
          kt_job* job = nullptr;
          const unsigned flags = (k / 5) % 2 ? KT_SUBMIT_DEFERRED : 0u;
          failures.expect_status(kt_moe_forward_submit(layer, pf.data(), 4, nullptr, flags, &job), KT_OK,
                                 at + " short-lived submit");
          std::this_thread::yield();
          kt_moe_destroy(layer);  // stays published: others then use a destroyed handle
          const kt_status st = kt_job_wait(job);
          if (st == KT_OK) {
            failures.expect_close(p.y->values(), plain_y, tol.forward, at + " short-lived y");
          } else {
            failures.expect_status(st, flags ? KT_ERR_INVALID_HANDLE : KT_OK, at + " short-lived job");
            cancelled.fetch_add(1);
          }
          kt_job_destroy(job);
          break;
        }
        case 4: {  // handles other threads may be destroying right now
          std::vector<kt_arg> own_out = pf;
          TensorPtr y = like(*p.y);
          own_out[3].tensor = y->dl();
          if (kt_moe* layer = published_layer.load()) {
            const kt_status st = kt_moe_forward(layer, own_out.data(), 4, nullptr);
            if (st == KT_OK) {
              accepted.fetch_add(1);
              failures.expect_close(y->values(), plain_y, tol.forward, at + " forward on another's layer");
            } else if (st == KT_ERR_INVALID_HANDLE) {
              refused.fetch_add(1);
            } else {
              failures.expect_status(st, KT_OK, at + " forward on another's layer");
            }
          }
          if (kt_job* job = published_job.load()) {
            const kt_status st = kt_job_wait(job);
            if (st == KT_ERR_INVALID_HANDLE) {
              refused.fetch_add(1);
            } else {
              accepted.fetch_add(1);
              failures.expect_status(st, KT_OK, at + " wait on another's job");
            }
            (void)kt_job_done(job);
          }
          break;
        }
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.count(), 0) << failures.report();
  // The shared layer still computes the reference afterwards.
  kt_context* ctx = nullptr;
  ASSERT_EQ(shared.forward(&ctx), KT_OK) << kt_last_error();
  ASSERT_EQ(shared.backward(ctx, 1.f, KT_GRAD_OVERWRITE), KT_OK) << kt_last_error();
  EXPECT_LE(rel_l2(shared.dx(), shared_dx), tol.dx);
  kt_context_release(ctx);
  std::printf("stress: %d threads x %d rounds; calls on other threads' handles: %d served, %d refused "
              "(destroyed); %d deferred jobs cancelled by their layer's destroy\n",
              kThreads, rounds, accepted.load(), refused.load(), cancelled.load());
}

// Destroying a layer and its engine from a gradient hook that runs on the
// engine's job thread: the hook may call kt, and must not hang or touch
// freed memory.
struct HookState {
  kt_engine* engine = nullptr;
  std::atomic<int> calls{0};
  kt_status engine_destroyed = KT_ERR_INTERNAL;
};

void destroy_from_hook(kt_moe* moe, void* user) {
  HookState* h = static_cast<HookState*>(user);
  kt_moe_destroy(moe);
  h->engine_destroyed = kt_engine_destroy(h->engine);
  h->calls.fetch_add(1);
}

TEST(ThreadStress, HookOnTheJobThreadMayDestroyItsLayerAndEngine) {
  Runner run(small_case(KT_MODE_LORA, 3), KT_ISA_AUTO, 1);
  kt_engine_options eo;
  kt_engine_options_init(&eo);
  eo.num_threads = 1;
  HookState h;
  ASSERT_EQ(kt_engine_create(&eo, &h.engine), KT_OK);
  kt_moe_options mo;
  kt_moe_options_init(&mo);
  mo.num_experts = run.c().E; mo.top_k = run.c().K; mo.hidden = run.c().H; mo.intermediate = run.c().I;
  mo.mode = KT_MODE_LORA; mo.lora_rank = run.c().rank;
  mo.lora_alpha = 2.f * static_cast<float>(mo.lora_rank);  // as the runner, whose reference is used
  kt_moe* layer = nullptr;
  ASSERT_EQ(kt_moe_create(h.engine, &mo, &layer), KT_OK);
  kt_arg wts[] = {{KT_ARG_W_GATE, run.W_[0]->dl()}, {KT_ARG_W_UP, run.W_[1]->dl()}, {KT_ARG_W_DOWN, run.W_[2]->dl()}};
  ASSERT_EQ(kt_moe_load_weights(layer, nullptr, wts, 3), KT_OK) << kt_last_error();
  std::vector<kt_arg> bind;
  for (int p = 0; p < 3; ++p) {
    bind.push_back({KT_ARG_LORA_A_GATE + 2 * p, run.la_[p]->dl()});
    bind.push_back({KT_ARG_LORA_B_GATE + 2 * p, run.lb_[p]->dl()});
  }
  TensorPtr grads[6];
  for (int p = 0; p < 3; ++p) {
    grads[2 * p] = like(*run.gla_[p]);
    grads[2 * p + 1] = like(*run.glb_[p]);
    bind.push_back({KT_ARG_GRAD_LORA_A_GATE + 2 * p, grads[2 * p]->dl()});
    bind.push_back({KT_ARG_GRAD_LORA_B_GATE + 2 * p, grads[2 * p + 1]->dl()});
  }
  ASSERT_EQ(kt_moe_bind(layer, bind.data(), bind.size()), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_moe_set_grad_hook(layer, destroy_from_hook, &h), KT_OK);
  Inputs in(run);
  std::vector<kt_arg> f = in.forward_args(), b = in.backward_args();
  kt_context* ctx = nullptr;
  kt_job* fj = nullptr;
  kt_job* bj = nullptr;
  ASSERT_EQ(kt_moe_forward_submit(layer, f.data(), 4, &ctx, 0, &fj), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_moe_backward_submit(layer, ctx, nullptr, b.data(), 3, 0, &bj), KT_OK) << kt_last_error();
  EXPECT_EQ(kt_job_wait(bj), KT_OK) << kt_last_error();
  EXPECT_EQ(kt_job_wait(fj), KT_OK) << kt_last_error();
  EXPECT_EQ(h.calls.load(), 1);
  EXPECT_EQ(h.engine_destroyed, KT_OK);
  EXPECT_LE(rel_l2(grads[3]->values(), run.ref_backward().dlb[1]), tolerance_for(KT_ISA_AVX512BF16, false).lora);
  kt_job_destroy(fj);
  kt_job_destroy(bj);
  kt_clear_error();
  kt_context_release(ctx);  // its layer is gone: refused, harmless
  EXPECT_NE(std::string(kt_last_error()).find("not a live kt_context"), std::string::npos) << kt_last_error();
  float scale;
  EXPECT_EQ(kt_moe_lora_scale(layer, &scale), KT_ERR_INVALID_HANDLE);
}

}  // namespace
}  // namespace kt_test
