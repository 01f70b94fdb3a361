// Handle and context lifetimes through the ABI: destroyed and released
// handles are refused (never read, never mistaken for a newer object at the
// same address), a context released while a job holds it lives until the job
// ends, a deferred backward runs its deferred forward first, and a layer
// frees every context it ever made. Run under ASan (tools/bootstrap.sh
// sanitize) these also show that no freed memory is read.
#include <malloc.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#define KT_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KT_TEST_ASAN 1
#endif
#endif
#ifndef KT_TEST_ASAN
#define KT_TEST_ASAN 0
#endif
#if KT_TEST_ASAN
// The sanitizer runtime's count of bytes its allocator has handed out
// (declared here: GCC does not ship compiler-rt's allocator_interface.h).
extern "C" size_t __sanitizer_get_current_allocated_bytes(void);
#endif

#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "harness.h"
#include "tolerances.h"

namespace kt_test {
namespace {

Case lora_case() {
  Case c;
  c.name = "handles";
  c.E = 4; c.K = 2; c.H = 32; c.I = 24; c.T = 6;
  c.mode = KT_MODE_LORA; c.rank = 4;
  return c;
}

std::string last_error() { return kt_last_error(); }

bool contains(const std::string& text, const char* needle) { return text.find(needle) != std::string::npos; }

kt_moe_options options_of(const Case& c) {
  kt_moe_options mo;
  kt_moe_options_init(&mo);
  mo.num_experts = c.E; mo.top_k = c.K; mo.hidden = c.H; mo.intermediate = c.I;
  return mo;
}

// The forward arguments of the runner's current tensors.
struct ForwardArgs {
  explicit ForwardArgs(Runner& r)
      : a{{KT_ARG_X, r.x_->dl()}, {KT_ARG_IDS, r.ids_->dl()}, {KT_ARG_ROUTE_WEIGHTS, r.w_->dl()},
          {KT_ARG_Y, r.y_->dl()}} {}
  kt_arg a[4];
};

struct BackwardArgs {
  explicit BackwardArgs(Runner& r)
      : a{{KT_ARG_DY, r.dy_->dl()}, {KT_ARG_DX, r.dx_->dl()}, {KT_ARG_DROUTE_WEIGHTS, r.dw_->dl()}} {}
  kt_arg a[3];
};

double tolerance_dx(Runner& r) {
  kt_engine_info info;
  info.struct_size = sizeof(info);
  EXPECT_EQ(kt_engine_get_info(r.engine(), &info), KT_OK);
  return tolerance_for(info.isa, false).dx;
}

// Item: a context released while its submitted backward is pending is
// freed when that job ends, and the job computes with that context. Before,
// release recycled the context at once: the next forward reused it and the
// pending backward computed with that forward's activations (and after a
// full reuse list, read freed memory).
TEST(ContextLifetime, ReleaseWhileBackwardJobPendingKeepsTheContextForTheJob) {
  Runner run(lora_case(), KT_ISA_AUTO);
  const double tol = tolerance_dx(run);
  run.fill_inputs(11);
  const std::vector<double> want_dx = run.ref_backward().dx;
  kt_context* a = nullptr;
  ASSERT_EQ(run.forward(&a), KT_OK) << kt_last_error();
  kt_backward_options bo;
  kt_backward_options_init(&bo);
  bo.param_grads = 0;
  BackwardArgs bargs(run);
  kt_job* job = nullptr;
  ASSERT_EQ(kt_moe_backward_submit(run.moe(), a, &bo, bargs.a, 3, KT_SUBMIT_DEFERRED, &job), KT_OK)
      << kt_last_error();
  kt_context_release(a);
  // Another forward (other inputs) saves a context while the job is pending.
  // (The first round's tensors stay alive: the job borrows them.)
  TensorPtr round_a[] = {std::move(run.x_), std::move(run.ids_), std::move(run.w_), std::move(run.y_),
                         std::move(run.dy_), std::move(run.dx_), std::move(run.dw_)};
  Tensor& dx_a = *round_a[5];
  run.fill_inputs(12);
  kt_context* b = nullptr;
  ASSERT_EQ(run.forward(&b), KT_OK) << kt_last_error();
  EXPECT_NE(a, b) << "a released handle was given out again";
  ASSERT_EQ(kt_job_wait(job), KT_OK) << kt_last_error();
  kt_job_destroy(job);
  EXPECT_LE(rel_l2(dx_a.values(), want_dx), tol) << "the backward did not use the released context's forward";
  // The released handle stays refused; the other context is untouched.
  kt_clear_error();
  EXPECT_EQ(run.backward(a, 1.f, KT_GRAD_OVERWRITE), KT_ERR_CONTEXT);
  EXPECT_TRUE(contains(last_error(), "kt_moe_backward: ctx is not a live context")) << last_error();
  EXPECT_EQ(run.backward(b, 1.f, KT_GRAD_OVERWRITE), KT_OK) << kt_last_error();
  EXPECT_LE(rel_l2(run.dx(), run.ref_backward().dx), tol);
  kt_context_release(b);
}

// Also for a queued (non-deferred) backward, and a forward job pending at
// release: both jobs finish with the released context.
TEST(ContextLifetime, ReleaseWhileForwardAndBackwardJobsQueued) {
  Runner run(lora_case(), KT_ISA_AUTO);
  const double tol = tolerance_dx(run);
  run.fill_inputs(21);
  ForwardArgs fargs(run);
  BackwardArgs bargs(run);
  for (unsigned flags : {0u, KT_SUBMIT_DEFERRED}) {
    kt_context* ctx = nullptr;
    kt_job* fj = nullptr;
    kt_job* bj = nullptr;
    ASSERT_EQ(kt_moe_forward_submit(run.moe(), fargs.a, 4, &ctx, flags, &fj), KT_OK) << kt_last_error();
    ASSERT_EQ(kt_moe_backward_submit(run.moe(), ctx, nullptr, bargs.a, 3, flags, &bj), KT_OK) << kt_last_error();
    kt_context_release(ctx);
    EXPECT_EQ(kt_job_wait(bj), KT_OK) << kt_last_error();
    EXPECT_EQ(kt_job_wait(fj), KT_OK) << kt_last_error();
    kt_job_destroy(bj);
    kt_job_destroy(fj);
    EXPECT_LE(rel_l2(run.dx(), run.ref_backward().dx), tol) << "flags " << flags;
    EXPECT_EQ(kt_moe_backward(run.moe(), ctx, nullptr, bargs.a, 3), KT_ERR_CONTEXT);
  }
}

// Item: a released or spent-and-released handle never names a live context,
// though kt reuses the released context's memory for the next forward.
TEST(ContextLifetime, StaleHandlesNeverReachARecycledContext) {
  Runner run(lora_case(), KT_ISA_AUTO);
  const double tol = tolerance_dx(run);
  std::vector<kt_context*> stale;
  for (int i = 0; i < 20; ++i) {  // beyond the reuse list
    kt_context* c = nullptr;
    ASSERT_EQ(run.forward(&c), KT_OK) << kt_last_error();
    if (i % 2) {
      ASSERT_EQ(run.backward(c, 1.f, KT_GRAD_OVERWRITE), KT_OK) << kt_last_error();
    }
    kt_context_release(c);
    for (kt_context* s : stale) EXPECT_NE(s, c);
    stale.push_back(c);
  }
  run.fill_inputs(31);
  kt_context* live = nullptr;
  ASSERT_EQ(run.forward(&live), KT_OK) << kt_last_error();
  for (kt_context* s : stale) {
    ASSERT_NE(s, live);
    kt_clear_error();
    EXPECT_EQ(run.backward(s, 1.f, KT_GRAD_OVERWRITE), KT_ERR_CONTEXT);
    EXPECT_TRUE(contains(last_error(), "it was released")) << last_error();
    kt_job* job = nullptr;
    BackwardArgs bargs(run);
    EXPECT_EQ(kt_moe_backward_submit(run.moe(), s, nullptr, bargs.a, 3, 0, &job), KT_ERR_CONTEXT);
    EXPECT_EQ(job, nullptr);
    // A second release of a stale handle is refused and releases nothing.
    kt_clear_error();
    kt_context_release(s);
    EXPECT_TRUE(contains(last_error(), "kt_context_release: ctx is not a live kt_context")) << last_error();
  }
  ASSERT_EQ(run.backward(live, 1.f, KT_GRAD_OVERWRITE), KT_OK) << kt_last_error();
  EXPECT_LE(rel_l2(run.dx(), run.ref_backward().dx), tol);
  kt_context_release(live);
}

// Item: waiting on a deferred backward before its deferred forward ran runs
// that forward first; waiting on the forward afterwards returns its status.
TEST(DeferredOrder, WaitingOnTheBackwardRunsItsForwardFirst) {
  Runner run(lora_case(), KT_ISA_AUTO);
  const double tol = tolerance_dx(run);
  run.fill_inputs(41);
  ForwardArgs fargs(run);
  BackwardArgs bargs(run);
  kt_context* ctx = nullptr;
  kt_job* fj = nullptr;
  kt_job* bj = nullptr;
  ASSERT_EQ(kt_moe_forward_submit(run.moe(), fargs.a, 4, &ctx, KT_SUBMIT_DEFERRED, &fj), KT_OK);
  ASSERT_EQ(kt_moe_backward_submit(run.moe(), ctx, nullptr, bargs.a, 3, KT_SUBMIT_DEFERRED, &bj), KT_OK)
      << kt_last_error();
  EXPECT_EQ(kt_job_done(fj), 0);
  EXPECT_EQ(kt_job_wait(bj), KT_OK) << kt_last_error();
  EXPECT_EQ(kt_job_done(fj), 1) << "the forward ran as part of the backward";
  EXPECT_EQ(kt_job_wait(fj), KT_OK) << kt_last_error();
  kt_job_run(fj);  // running it again does nothing
  EXPECT_LE(rel_l2(run.y(), run.ref_forward()), tolerance_for(KT_ISA_AVX512BF16, false).forward);
  kt::reference::Grads g = run.ref_backward();
  EXPECT_LE(rel_l2(run.dx(), g.dx), tol);
  EXPECT_LE(rel_l2(run.grad_lora(0, true), g.dlb[0]), tolerance_for(KT_ISA_AVX512BF16, false).lora);
  kt_job_destroy(fj);
  kt_job_destroy(bj);
  kt_context_release(ctx);

  // The same through the plain trampoline, backward first, and with a
  // queued backward behind a deferred forward: the job thread runs the
  // forward.
  ASSERT_EQ(kt_moe_forward_submit(run.moe(), fargs.a, 4, &ctx, KT_SUBMIT_DEFERRED, &fj), KT_OK);
  ASSERT_EQ(kt_moe_backward_submit(run.moe(), ctx, nullptr, bargs.a, 3, 0, &bj), KT_OK) << kt_last_error();
  // The host's stream runs the forward meanwhile; whichever thread runs it,
  // kt_job_run returns once it has ended.
  kt_job_run(fj);
  EXPECT_EQ(kt_job_done(fj), 1);
  EXPECT_LE(rel_l2(run.y(), run.ref_forward()), tolerance_for(KT_ISA_AVX512BF16, false).forward);
  EXPECT_EQ(kt_job_wait(bj), KT_OK) << kt_last_error();
  EXPECT_EQ(kt_job_wait(fj), KT_OK) << kt_last_error();
  EXPECT_LE(rel_l2(run.dx(), g.dx), tol);
  kt_job_destroy(fj);
  kt_job_destroy(bj);
  kt_context_release(ctx);
}

// A forward that fails reports its status to its backward too.
TEST(DeferredOrder, BackwardOfAFailedDeferredForwardFails) {
  Runner run(lora_case(), KT_ISA_AUTO);
  kt_moe_options mo = options_of(run.c());
  kt_moe* empty = nullptr;  // no weights loaded: its forward fails at run time
  ASSERT_EQ(kt_moe_create(run.engine(), &mo, &empty), KT_OK);
  ForwardArgs fargs(run);
  BackwardArgs bargs(run);
  kt_context* ctx = nullptr;
  kt_job* fj = nullptr;
  kt_job* bj = nullptr;
  ASSERT_EQ(kt_moe_forward_submit(empty, fargs.a, 4, &ctx, KT_SUBMIT_DEFERRED, &fj), KT_OK);
  ASSERT_EQ(kt_moe_backward_submit(empty, ctx, nullptr, bargs.a, 3, KT_SUBMIT_DEFERRED, &bj), KT_OK);
  EXPECT_EQ(kt_job_wait(bj), KT_ERR_CONTEXT);
  EXPECT_TRUE(contains(last_error(), "its forward failed")) << last_error();
  EXPECT_EQ(kt_job_wait(fj), KT_ERR_NOT_LOADED);
  kt_job_destroy(fj);
  kt_job_destroy(bj);
  kt_context_release(ctx);
  kt_moe_destroy(empty);
}

// Item: destroyed handles are refused without reading freed memory, and a
// handle value is never issued again (handles are numbers, not addresses:
// a stale one cannot name a newer object, wherever that object lives).
TEST(HandleLifetime, DestroyedHandlesAreRefusedAndNeverIssuedAgain) {
  kt_engine_options eo;
  kt_engine_options_init(&eo);
  eo.num_threads = 1;
  kt_engine* engine = nullptr;
  ASSERT_EQ(kt_engine_create(&eo, &engine), KT_OK);
  kt_moe_options mo = options_of(lora_case());
  kt_moe* old_layer = nullptr;
  ASSERT_EQ(kt_moe_create(engine, &mo, &old_layer), KT_OK);
  kt_moe_destroy(old_layer);
  kt_moe* new_layer = nullptr;
  ASSERT_EQ(kt_moe_create(engine, &mo, &new_layer), KT_OK);
  EXPECT_NE(old_layer, new_layer);
  float scale = -1.f;
  kt_clear_error();
  EXPECT_EQ(kt_moe_lora_scale(old_layer, &scale), KT_ERR_INVALID_HANDLE);
  EXPECT_TRUE(contains(last_error(), "kt_moe_lora_scale: moe is not a live kt_moe (destroyed?)")) << last_error();
  EXPECT_EQ(scale, -1.f);
  int64_t n = -1;
  EXPECT_EQ(kt_moe_num_loaded(old_layer, &n), KT_ERR_INVALID_HANDLE);
  EXPECT_EQ(n, -1);
  kt_clear_error();
  kt_moe_destroy(old_layer);  // a second destroy is refused, the new layer lives
  EXPECT_TRUE(contains(last_error(), "kt_moe_destroy: moe is not a live kt_moe")) << last_error();
  EXPECT_EQ(kt_moe_num_loaded(new_layer, &n), KT_OK) << kt_last_error();
  EXPECT_EQ(n, 0);
  // A handle of another kind is not a layer.
  EXPECT_EQ(kt_moe_lora_scale(reinterpret_cast<kt_moe*>(engine), &scale), KT_ERR_INVALID_HANDLE);
  kt_moe_destroy(new_layer);
  // Many create/destroy cycles (the allocator hands the freed objects' memory
  // out again): every handle is new, every destroyed one stays refused.
  std::set<kt_moe*> issued = {old_layer, new_layer};
  for (int i = 0; i < 64; ++i) {
    kt_moe* l = nullptr;
    ASSERT_EQ(kt_moe_create(engine, &mo, &l), KT_OK) << kt_last_error();
    EXPECT_TRUE(issued.insert(l).second) << "handle issued twice at cycle " << i;
    EXPECT_EQ(kt_moe_num_loaded(l, &n), KT_OK) << kt_last_error();
    kt_moe_destroy(l);
  }
  for (kt_moe* l : issued) EXPECT_EQ(kt_moe_num_loaded(l, &n), KT_ERR_INVALID_HANDLE);

  ASSERT_EQ(kt_engine_destroy(engine), KT_OK);
  kt_engine* other = nullptr;
  ASSERT_EQ(kt_engine_create(&eo, &other), KT_OK);
  EXPECT_NE(engine, other);
  kt_engine_info info;
  info.struct_size = sizeof(info);
  kt_clear_error();
  EXPECT_EQ(kt_engine_get_info(engine, &info), KT_ERR_INVALID_HANDLE);
  EXPECT_TRUE(contains(last_error(), "kt_engine_get_info: engine is not a live kt_engine")) << last_error();
  kt_moe* m = nullptr;
  EXPECT_EQ(kt_moe_create(engine, &mo, &m), KT_ERR_INVALID_HANDLE);
  EXPECT_EQ(m, nullptr);
  EXPECT_EQ(kt_engine_destroy(engine), KT_ERR_INVALID_HANDLE);
  EXPECT_EQ(kt_engine_get_info(other, &info), KT_OK) << kt_last_error();
  EXPECT_EQ(kt_engine_destroy(other), KT_OK);
}

TEST(HandleLifetime, ContextsOfADestroyedLayerAreRefused) {
  Runner run(lora_case(), KT_ISA_AUTO);
  kt_moe_options mo = options_of(run.c());
  kt_moe* layer = nullptr;
  ASSERT_EQ(kt_moe_create(run.engine(), &mo, &layer), KT_OK);
  kt_load_options lo;
  kt_load_options_init(&lo);
  kt_arg w[] = {{KT_ARG_W_GATE, run.W_[0]->dl()}, {KT_ARG_W_UP, run.W_[1]->dl()}, {KT_ARG_W_DOWN, run.W_[2]->dl()}};
  ASSERT_EQ(kt_moe_load_weights(layer, &lo, w, 3), KT_OK) << kt_last_error();
  ForwardArgs fargs(run);
  kt_context* ctx = nullptr;
  ASSERT_EQ(kt_moe_forward(layer, fargs.a, 4, &ctx), KT_OK) << kt_last_error();
  kt_context* queued = nullptr;
  kt_job* job = nullptr;
  ASSERT_EQ(kt_moe_forward_submit(layer, fargs.a, 4, &queued, KT_SUBMIT_DEFERRED, &job), KT_OK);
  kt_moe_destroy(layer);  // cancels the deferred job, frees both contexts
  EXPECT_EQ(kt_job_wait(job), KT_ERR_INVALID_HANDLE);
  EXPECT_TRUE(contains(last_error(), "its layer was destroyed")) << last_error();
  kt_job_destroy(job);
  for (kt_context* c : {ctx, queued}) {
    kt_clear_error();
    kt_context_release(c);
    EXPECT_TRUE(contains(last_error(), "kt_context_release: ctx is not a live kt_context")) << last_error();
  }
  // A job handle is refused after destroy, too.
  EXPECT_EQ(kt_job_wait(job), KT_ERR_INVALID_HANDLE);
  EXPECT_TRUE(contains(last_error(), "kt_job_wait: job is not a live kt_job")) << last_error();
  EXPECT_EQ(kt_job_done(job), 1);
  kt_job_run(job);
  kt_clear_error();
  kt_job_destroy(job);
  EXPECT_TRUE(contains(last_error(), "kt_job_destroy: job is not a live kt_job")) << last_error();
  // The runner's own layer is unaffected.
  kt_context* mine = nullptr;
  ASSERT_EQ(run.forward(&mine), KT_OK);
  EXPECT_EQ(run.backward(mine, 1.f, KT_GRAD_OVERWRITE), KT_OK) << kt_last_error();
  kt_context_release(mine);
}

TEST(HandleLifetime, ClosedCheckpointIsRefusedAndClosingTwiceIsHarmless) {
  Runner run(lora_case(), KT_ISA_AUTO);
  char dir[] = "/tmp/kt_handles_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  kt_arg w[] = {{KT_ARG_W_GATE, run.W_[0]->dl()}, {KT_ARG_W_UP, run.W_[1]->dl()}, {KT_ARG_W_DOWN, run.W_[2]->dl()}};
  kt_ckpt_layer_args layer{0, w, 3};
  ASSERT_EQ(kt_ckpt_write_experts(dir, nullptr, &layer, 1), KT_OK) << kt_last_error();
  kt_ckpt* first = nullptr;
  ASSERT_EQ(kt_ckpt_open(dir, &first), KT_OK) << kt_last_error();
  kt_ckpt_close(first);
  kt_ckpt* second = nullptr;
  ASSERT_EQ(kt_ckpt_open(dir, &second), KT_OK) << kt_last_error();
  EXPECT_NE(first, second);
  kt_ckpt_info info;
  info.struct_size = sizeof(info);
  kt_clear_error();
  EXPECT_EQ(kt_ckpt_get_info(first, &info), KT_ERR_INVALID_HANDLE);
  EXPECT_TRUE(contains(last_error(), "kt_ckpt_get_info: ckpt is not a live kt_ckpt (closed?)")) << last_error();
  kt_clear_error();
  kt_ckpt_close(first);
  EXPECT_TRUE(contains(last_error(), "kt_ckpt_close: ckpt is not an open kt_ckpt")) << last_error();
  ASSERT_EQ(kt_ckpt_get_info(second, &info), KT_OK) << kt_last_error();
  EXPECT_EQ(info.num_moe_layers, 1);
  kt_ckpt_close(second);
  std::system((std::string("rm -rf ") + dir).c_str());
}

// Item: a layer frees its released contexts (the reuse list) when it is
// destroyed. Heap in use must not grow over create/use/destroy cycles: by
// glibc's statistics, or under ASan (whose allocator replaces glibc's) by
// the sanitizer's own count of allocated bytes.
size_t heap_in_use() {
#if KT_TEST_ASAN
  return __sanitizer_get_current_allocated_bytes();
#else
  const struct mallinfo2 m = mallinfo2();
  return m.uordblks + m.hblkhd;
#endif
}

TEST(ContextLifetime, DestroyedLayersLeaveNoContextsBehind) {
  Case c = lora_case();
  c.T = 64; c.H = 64; c.I = 64;
  Runner run(c, KT_ISA_AUTO);
  kt_moe_options mo = options_of(c);
  mo.mode = KT_MODE_INFERENCE;
  kt_arg w[] = {{KT_ARG_W_GATE, run.W_[0]->dl()}, {KT_ARG_W_UP, run.W_[1]->dl()}, {KT_ARG_W_DOWN, run.W_[2]->dl()}};
  ForwardArgs fargs(run);
  auto cycle = [&] {
    kt_moe* layer = nullptr;
    ASSERT_EQ(kt_moe_create(run.engine(), &mo, &layer), KT_OK);
    ASSERT_EQ(kt_moe_load_weights(layer, nullptr, w, 3), KT_OK) << kt_last_error();
    std::vector<kt_context*> ctxs(8);
    for (auto& ctx : ctxs) ASSERT_EQ(kt_moe_forward(layer, fargs.a, 4, &ctx), KT_OK) << kt_last_error();
    for (auto* ctx : ctxs) kt_context_release(ctx);
    kt_moe_destroy(layer);
  };
  for (int i = 0; i < 3; ++i) cycle();  // warm up the allocator
  malloc_trim(0);
  const size_t before = heap_in_use();
  for (int i = 0; i < 40; ++i) cycle();
  malloc_trim(0);
  const size_t after = heap_in_use();
  // 8 contexts of T=64, H=I=64 hold > 8 * 64 KiB; 40 leaked cycles > 20 MiB.
  EXPECT_LT(after, before + (size_t{4} << 20)) << "heap grew from " << before << " to " << after;
}

}  // namespace
}  // namespace kt_test
