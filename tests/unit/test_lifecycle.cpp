// Training-loop behaviour through the ABI: gradient accumulation over
// micro-batches, grad_scale, several outstanding contexts, release without
// backward, async submit/wait (queued and deferred), the gradient hook,
// parameter updates, determinism, and weight-loading variants.
#include <atomic>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "cases.h"
#include "harness.h"
#include "tolerances.h"

namespace kt_test {
namespace {

Case lora_case() {
  Case c;
  c.name = "lora";
  c.E = 5; c.K = 2; c.H = 48; c.I = 40; c.T = 10;
  c.mode = KT_MODE_LORA; c.rank = 4;
  return c;
}

std::vector<double> add(const std::vector<double>& a, const std::vector<double>& b, double sb) {
  std::vector<double> r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] + sb * b[i];
  return r;
}

std::vector<double> scale(const std::vector<double>& a, double s) { return add(a, a, s - 1.0); }

TEST(Training, AccumulationOverMicroBatchesWithGradScale) {
  Runner run(lora_case(), KT_ISA_AVX2);
  if (!run.isa_available()) GTEST_SKIP() << "avx2 not available";
  const double s = 1.0 / 3.0;
  std::vector<double> want_a, want_b;
  for (int mb = 0; mb < 3; ++mb) {
    run.fill_inputs(100 + static_cast<uint32_t>(mb));
    kt_context* ctx = nullptr;
    ASSERT_EQ(run.forward(&ctx), KT_OK) << kt_last_error();
    ASSERT_EQ(run.backward(ctx, static_cast<float>(s), mb == 0 ? KT_GRAD_OVERWRITE : KT_GRAD_ACCUMULATE), KT_OK)
        << kt_last_error();
    kt_context_release(ctx);
    kt::reference::Grads g = run.ref_backward();
    want_a = mb == 0 ? scale(g.dla[0], s) : add(want_a, g.dla[0], s);
    want_b = mb == 0 ? scale(g.dlb[2], s) : add(want_b, g.dlb[2], s);
  }
  EXPECT_LE(rel_l2(run.grad_lora(0, false), want_a), 1e-5);
  EXPECT_LE(rel_l2(run.grad_lora(2, true), want_b), 1e-5);
  // A new window overwrites: the buffers now hold only this batch's grads.
  kt_context* ctx = nullptr;
  ASSERT_EQ(run.forward(&ctx), KT_OK);
  ASSERT_EQ(run.backward(ctx, 2.f, KT_GRAD_OVERWRITE), KT_OK);
  kt_context_release(ctx);
  EXPECT_LE(rel_l2(run.grad_lora(0, false), scale(run.ref_backward().dla[0], 2.0)), 1e-5);
}

TEST(Training, SeveralOutstandingContextsAndReleaseWithoutBackward) {
  Runner run(lora_case(), KT_ISA_AVX2);
  if (!run.isa_available()) GTEST_SKIP();
  std::vector<kt_context*> ctxs;
  std::vector<std::vector<double>> xs, dys;
  std::vector<TensorPtr> keep_x, keep_ids, keep_w;
  std::vector<kt::reference::Grads> want;
  for (int i = 0; i < 3; ++i) {
    run.fill_inputs(200 + static_cast<uint32_t>(i));
    kt_context* ctx = nullptr;
    ASSERT_EQ(run.forward(&ctx), KT_OK);
    ctxs.push_back(ctx);
    want.push_back(run.ref_backward());
    keep_x.push_back(std::move(run.x_));
    keep_ids.push_back(std::move(run.ids_));
    keep_w.push_back(std::move(run.w_));
    dys.push_back(run.dy_->values());
  }
  kt_context_release(ctxs[1]);  // never backpropagated
  for (int i : {2, 0}) {
    for (size_t j = 0; j < dys[static_cast<size_t>(i)].size(); ++j) run.dy_->set(static_cast<int64_t>(j), dys[static_cast<size_t>(i)][j]);
    ASSERT_EQ(run.backward(ctxs[static_cast<size_t>(i)], 1.f, KT_GRAD_OVERWRITE), KT_OK) << kt_last_error();
    EXPECT_LE(rel_l2(run.dx(), want[static_cast<size_t>(i)].dx), 1e-5) << "context " << i;
    EXPECT_LE(rel_l2(run.grad_lora(1, true), want[static_cast<size_t>(i)].dlb[1]), 1e-5) << "context " << i;
    EXPECT_EQ(run.backward(ctxs[static_cast<size_t>(i)], 1.f, KT_GRAD_OVERWRITE), KT_ERR_CONTEXT);
    EXPECT_NE(std::string(kt_last_error()).find("spent"), std::string::npos) << kt_last_error();
    kt_context_release(ctxs[static_cast<size_t>(i)]);
  }
  // A released context is rejected.
  EXPECT_EQ(run.backward(ctxs[1], 1.f, KT_GRAD_OVERWRITE), KT_ERR_CONTEXT);
}

struct HookLog {
  std::atomic<int> calls{0};
  kt_moe* seen = nullptr;
};

void on_grads(kt_moe* moe, void* user) {
  HookLog* log = static_cast<HookLog*>(user);
  log->seen = moe;
  log->calls.fetch_add(1);
  // The hook may call kt: the layer is not locked any more.
  float s;
  kt_moe_lora_scale(moe, &s);
}

TEST(Async, SubmitWaitForwardBackwardAndHook) {
  Runner run(lora_case(), KT_ISA_AUTO);
  HookLog log;
  ASSERT_EQ(kt_moe_set_grad_hook(run.moe(), on_grads, &log), KT_OK);
  kt_arg fargs[] = {{KT_ARG_X, run.x_->dl()}, {KT_ARG_IDS, run.ids_->dl()},
                    {KT_ARG_ROUTE_WEIGHTS, run.w_->dl()}, {KT_ARG_Y, run.y_->dl()}};
  kt_context* ctx = nullptr;
  kt_job* fj = nullptr;
  ASSERT_EQ(kt_moe_forward_submit(run.moe(), fargs, 4, &ctx, 0, &fj), KT_OK) << kt_last_error();
  // Backward may be queued right behind its forward.
  kt_backward_options bo;
  kt_backward_options_init(&bo);
  kt_arg bargs[] = {{KT_ARG_DY, run.dy_->dl()}, {KT_ARG_DX, run.dx_->dl()}, {KT_ARG_DROUTE_WEIGHTS, run.dw_->dl()}};
  kt_job* bj = nullptr;
  ASSERT_EQ(kt_moe_backward_submit(run.moe(), ctx, &bo, bargs, 3, 0, &bj), KT_OK) << kt_last_error();
  EXPECT_EQ(kt_moe_backward_submit(run.moe(), ctx, &bo, bargs, 3, 0, &bj), KT_ERR_CONTEXT);
  EXPECT_EQ(kt_job_wait(fj), KT_OK) << kt_last_error();
  EXPECT_EQ(kt_job_wait(bj), KT_OK) << kt_last_error();
  EXPECT_EQ(kt_job_done(fj), 1);
  kt_job_destroy(fj);
  kt_job_destroy(bj);
  kt_context_release(ctx);
  const Tolerance tol = tolerance_for(KT_ISA_AVX512BF16, false);  // loosest path
  EXPECT_LE(rel_l2(run.y(), run.ref_forward()), tol.forward);
  kt::reference::Grads g = run.ref_backward();
  EXPECT_LE(rel_l2(run.dx(), g.dx), tol.dx);
  EXPECT_LE(rel_l2(run.grad_lora(0, true), g.dlb[0]), tol.lora);
  EXPECT_EQ(log.calls.load(), 1);
  EXPECT_EQ(log.seen, run.moe());
}

TEST(Async, DeferredJobRunsThroughPlainTrampoline) {
  Runner run(lora_case(), KT_ISA_AUTO);
  kt_arg fargs[] = {{KT_ARG_X, run.x_->dl()}, {KT_ARG_IDS, run.ids_->dl()},
                    {KT_ARG_ROUTE_WEIGHTS, run.w_->dl()}, {KT_ARG_Y, run.y_->dl()}};
  kt_job* job = nullptr;
  ASSERT_EQ(kt_moe_forward_submit(run.moe(), fargs, 4, nullptr, KT_SUBMIT_DEFERRED, &job), KT_OK);
  EXPECT_EQ(kt_job_done(job), 0);
  void (*trampoline)(void*) = kt_job_run;  // what a host hands to cudaLaunchHostFunc
  std::thread host_stream([&] { trampoline(job); });
  host_stream.join();
  EXPECT_EQ(kt_job_done(job), 1);
  EXPECT_EQ(kt_job_wait(job), KT_OK);
  kt_job_destroy(job);
  EXPECT_LE(rel_l2(run.y(), run.ref_forward()), tolerance_for(KT_ISA_AVX512BF16, false).forward);
  // A deferred job nobody runs is run by wait; one whose layer dies first is cancelled.
  ASSERT_EQ(kt_moe_forward_submit(run.moe(), fargs, 4, nullptr, KT_SUBMIT_DEFERRED, &job), KT_OK);
  EXPECT_EQ(kt_job_wait(job), KT_OK);
  kt_job_destroy(job);
}

TEST(Async, ErrorsAreReportedAtSubmitOrWait) {
  Runner run(lora_case(), KT_ISA_AUTO);
  kt_arg bad[] = {{KT_ARG_X, run.x_->dl()}};
  kt_job* job = nullptr;
  EXPECT_EQ(kt_moe_forward_submit(run.moe(), bad, 1, nullptr, 0, &job), KT_ERR_NULL_POINTER);
  EXPECT_EQ(job, nullptr);
  EXPECT_NE(std::string(kt_last_error()).find("KT_ARG_IDS"), std::string::npos) << kt_last_error();
  // State-dependent errors (an unloaded expert) come from wait.
  Case c = lora_case();
  c.mode = KT_MODE_INFERENCE;
  kt_engine* engine = run.engine();
  kt_moe_options mo;
  kt_moe_options_init(&mo);
  mo.num_experts = c.E; mo.top_k = c.K; mo.hidden = c.H; mo.intermediate = c.I;
  kt_moe* empty = nullptr;
  ASSERT_EQ(kt_moe_create(engine, &mo, &empty), KT_OK);
  kt_arg fargs[] = {{KT_ARG_X, run.x_->dl()}, {KT_ARG_IDS, run.ids_->dl()},
                    {KT_ARG_ROUTE_WEIGHTS, run.w_->dl()}, {KT_ARG_Y, run.y_->dl()}};
  ASSERT_EQ(kt_moe_forward_submit(empty, fargs, 4, nullptr, 0, &job), KT_OK);
  EXPECT_EQ(kt_job_wait(job), KT_ERR_NOT_LOADED);
  EXPECT_NE(std::string(kt_last_error()).find("no weights loaded"), std::string::npos) << kt_last_error();
  kt_job_destroy(job);
  kt_moe_destroy(empty);
}

TEST(Training, Bf16ParametersAndGradientBuffers) {
  for (kt_mode mode : {KT_MODE_LORA, KT_MODE_FULL}) {
    Case c = lora_case();
    c.mode = mode;
    c.bf16_params = true;
    c.bf16_act = true;
    Runner run(c, KT_ISA_AVX2);
    if (!run.isa_available()) GTEST_SKIP();
    kt_context* ctx = nullptr;
    ASSERT_EQ(run.forward(&ctx), KT_OK) << kt_last_error();
    ASSERT_EQ(run.backward(ctx, 0.5f, KT_GRAD_OVERWRITE), KT_OK) << kt_last_error();
    kt_context_release(ctx);
    kt::reference::Grads g = run.ref_backward();
    // Gradients are computed in fp32 and rounded once into the bf16 buffers.
    const double tol = kBf16Outputs.forward;
    EXPECT_LE(rel_l2(run.y(), run.ref_forward()), tol);
    if (mode == KT_MODE_LORA) {
      EXPECT_LE(rel_l2(run.grad_lora(0, false), scale(g.dla[0], 0.5)), tol);
      EXPECT_LE(rel_l2(run.grad_lora(2, true), scale(g.dlb[2], 0.5)), tol);
    } else {
      for (int p = 0; p < 3; ++p) EXPECT_LE(rel_l2(run.grad_full(p, false), scale(g.dW[p], 0.5)), tol) << p;
    }
  }
}

// LoRA A gradients bound as rows wider than the gradient (a slice of a
// larger host buffer): overwritten unscaled fp32 rows are written by the
// GEMM where they lie, scaled or accumulated ones through a buffer; both
// fill the rows and leave the gaps between them alone.
TEST(Training, LoraAGradientsIntoSpacedRows) {
  std::vector<std::string> ran, missing;
  for (kt_isa isa : {KT_ISA_REF, KT_ISA_AVX2, KT_ISA_AVX512BF16, KT_ISA_AMX}) {
    Runner run(lora_case(), isa);
    if (!run.isa_available()) {
      missing.push_back(kt_isa_name(isa));
      continue;
    }
    ran.push_back(kt_isa_name(isa));
    const Case& c = run.c();
    constexpr int64_t kGap = 8;
    constexpr float kUntouched = 7.f;
    TensorPtr spaced[3];
    std::vector<kt_arg> bind;
    for (int p = 0; p < 3; ++p) {
      const int64_t in = p == 2 ? c.I : c.H;
      spaced[p] = Tensor::make(kF32, {c.E, c.rank, in + kGap});
      std::fill_n(spaced[p]->f32(), spaced[p]->numel(), kUntouched);
      spaced[p]->shape = {c.E, c.rank, in};
      spaced[p]->strides = {c.rank * (in + kGap), in + kGap, 1};
      spaced[p]->t.shape = spaced[p]->shape.data();
      spaced[p]->t.strides = spaced[p]->strides.data();
      bind.push_back({KT_ARG_GRAD_LORA_A_GATE + 2 * p, spaced[p]->dl()});
    }
    ASSERT_EQ(kt_moe_bind(run.moe(), bind.data(), bind.size()), KT_OK) << kt_last_error();
    // Overwrite unscaled, overwrite scaled, then accumulate: 1, 0.5, 1.5 dA.
    const struct {
      float scale;
      kt_grad_accumulate mode;
      double want;
    } steps[] = {{1.f, KT_GRAD_OVERWRITE, 1.0},
                 {0.5f, KT_GRAD_OVERWRITE, 0.5},
                 {1.f, KT_GRAD_ACCUMULATE, 1.5}};
    for (const auto& step : steps) {
      SCOPED_TRACE(std::string(kt_isa_name(isa)) + " scale " +
                   std::to_string(step.scale) +
                   (step.mode == KT_GRAD_ACCUMULATE ? " accumulate" : " overwrite"));
      kt_context* ctx = nullptr;
      ASSERT_EQ(run.forward(&ctx), KT_OK) << kt_last_error();
      ASSERT_EQ(run.backward(ctx, step.scale, step.mode), KT_OK) << kt_last_error();
      kt_context_release(ctx);
      const kt::reference::Grads g = run.ref_backward();
      for (int p = 0; p < 3; ++p) {
        const int64_t in = p == 2 ? c.I : c.H, row = in + kGap;
        std::vector<double> got;
        int64_t gaps_changed = 0;
        for (int64_t i = 0; i < c.E * c.rank; ++i)
          for (int64_t j = 0; j < row; ++j) {
            const float v = spaced[p]->f32()[i * row + j];
            if (j < in)
              got.push_back(v);
            else
              gaps_changed += v != kUntouched;
          }
        EXPECT_LE(rel_l2(got, scale(g.dla[p], step.want)), tolerance_for(isa, c.bf16_act).lora)
            << "projection " << p;
        EXPECT_EQ(gaps_changed, 0) << "projection " << p;
      }
    }
  }
  auto joined = [](const std::vector<std::string>& v) {
    std::string s;
    for (const std::string& n : v) s += (s.empty() ? "" : ", ") + n;
    return s;
  };
  if (ran.empty()) GTEST_SKIP() << "no kernel table runs here (not available: " << joined(missing) << ")";
  std::cout << "spaced LoRA A gradients checked on: " << joined(ran)
            << (missing.empty() ? "" : "; not available here: " + joined(missing)) << "\n";
}

TEST(Training, OverwriteZeroesExpertsNoTokenReached) {
  // Small blocks, and blocks of KBs at offsets that are not multiples of
  // 64 bytes (those are zeroed with streaming stores).
  for (int64_t H : {48, 1030})
    for (kt_mode mode : {KT_MODE_LORA, KT_MODE_FULL}) {
      SCOPED_TRACE("H=" + std::to_string(H) + (mode == KT_MODE_LORA ? " lora" : " full"));
      Case c = lora_case();
      c.mode = mode;
      c.H = H;
      c.E = 6;
      c.K = 1;
      c.T = 2;
      c.bias = mode == KT_MODE_FULL;
      Runner run(c, KT_ISA_AVX2);
      if (!run.isa_available()) GTEST_SKIP();
      // Stale values from an earlier window must not survive an overwrite.
      for (int p = 0; p < 3; ++p) {
        Tensor* bufs[] = {run.gla_[p].get(), run.glb_[p].get(), run.gW_[p].get(), run.gb_[p].get()};
        for (Tensor* t : bufs)
          if (t)
            for (int64_t i = 0; i < t->numel(); ++i) t->set(i, 7.0);
      }
      kt_context* ctx = nullptr;
      ASSERT_EQ(run.forward(&ctx), KT_OK);
      ASSERT_EQ(run.backward(ctx, 1.f, KT_GRAD_OVERWRITE), KT_OK) << kt_last_error();
      kt_context_release(ctx);
      kt::reference::Grads g = run.ref_backward();
      for (int p = 0; p < 3; ++p) {
        if (mode == KT_MODE_LORA) {
          EXPECT_LE(rel_l2(run.grad_lora(p, false), g.dla[p]), 1e-5) << p;
          EXPECT_LE(rel_l2(run.grad_lora(p, true), g.dlb[p]), 1e-5) << p;
        } else {
          EXPECT_LE(rel_l2(run.grad_full(p, false), g.dW[p]), 1e-5) << p;
          EXPECT_LE(rel_l2(run.grad_full(p, true), g.db[p]), 1e-5) << p;
        }
      }
    }
}

TEST(Training, ParamsChangedIsSeenByTheNextForward) {
  Runner run(lora_case(), KT_ISA_AVX2);
  if (!run.isa_available()) GTEST_SKIP();
  ASSERT_EQ(run.forward(nullptr), KT_OK);
  const std::vector<double> before = run.y();
  run.perturb_lora(2, true, 0.05);
  run.perturb_lora(0, false, 0.05);
  ASSERT_EQ(run.forward(nullptr), KT_OK);
  EXPECT_GT(rel_l2(run.y(), before), 1e-3);
  EXPECT_LE(rel_l2(run.y(), run.ref_forward()), 1e-5);
}

TEST(Training, FullModeParamsChangedRepacksBoundWeights) {
  Case c;
  c.name = "full";
  c.mode = KT_MODE_FULL;
  c.bias = true;
  Runner run(c, KT_ISA_AVX2);
  if (!run.isa_available()) GTEST_SKIP();
  kt_arg w[] = {{KT_ARG_W_GATE, run.W_[0]->dl()}, {KT_ARG_W_UP, run.W_[1]->dl()}, {KT_ARG_W_DOWN, run.W_[2]->dl()},
                {KT_ARG_B_GATE, run.B_[0]->dl()}, {KT_ARG_B_UP, run.B_[1]->dl()}, {KT_ARG_B_DOWN, run.B_[2]->dl()}};
  ASSERT_EQ(kt_moe_bind(run.moe(), w, 6), KT_OK) << kt_last_error();
  for (int64_t i = 0; i < run.W_[2]->numel(); ++i) {
    run.W_[2]->set(i, run.W_[2]->get(i) * 0.5);
    run.params.w[2][static_cast<size_t>(i)] = static_cast<float>(run.W_[2]->get(i));
  }
  run.B_[0]->set(3, 1.25);
  run.params.b[0][3] = 1.25f;
  ASSERT_EQ(kt_moe_params_changed(run.moe()), KT_OK) << kt_last_error();
  ASSERT_EQ(run.forward(nullptr), KT_OK);
  EXPECT_LE(rel_l2(run.y(), run.ref_forward()), 1e-5);
}

TEST(Determinism, SameResultsEveryRunAndForEveryThreadCount) {
  Case c = qwen3_30b_a3b_slice();
  c.H = 256; c.I = 96; c.T = 130;  // > one row chunk: 3 threads also split tokens
  std::vector<double> first_y, first_dx, first_g;
  for (int threads : {1, 2, 3, 2}) {
    Runner run(c, KT_ISA_AUTO, threads);
    kt_context* ctx = nullptr;
    ASSERT_EQ(run.forward(&ctx), KT_OK);
    ASSERT_EQ(run.backward(ctx, 1.f, KT_GRAD_OVERWRITE), KT_OK);
    kt_context_release(ctx);
    if (first_y.empty()) {
      first_y = run.y();
      first_dx = run.dx();
      first_g = run.grad_lora(1, false);
      continue;
    }
    EXPECT_EQ(run.y(), first_y) << threads << " threads";
    EXPECT_EQ(run.dx(), first_dx) << threads << " threads";
    EXPECT_EQ(run.grad_lora(1, false), first_g) << threads << " threads";
  }
}

// At decode a quantized layer's gate/up items' width follows the thread
// count (T=1 here, 8 active experts, 16 blocks of I: 1-2 threads whole
// experts, 3 threads 8 blocks, 8 threads 4, 16 threads 2), and whole-expert
// items take the one pass (experts, then the combine) only with at least 4
// active experts per worker (T=1 here: on 1-2 threads); 8 and 16 threads (a
// server's count, over a small machine's cores) cut the work in yet other
// ways. None of it may change a bit, at T=1 or with a few rows each.
TEST(Determinism, DecodeGivesTheSameBitsWhateverTheItemWidth) {
  Case c = qwen3_30b_a3b_slice();
  c.E = 16;
  c.H = 64;
  c.I = 1000;
  c.bias = true;
  for (int64_t T : {1, 8})
    for (kt_weight_format f : {KT_FORMAT_INT4_G32, KT_FORMAT_INT8_CHANNEL}) {
      c.format = f;
      c.T = T;
      std::vector<double> first_y, first_dx, first_g;
      for (int threads : {1, 2, 3, 8, 16}) {
        SCOPED_TRACE(std::string(kt_weight_format_name(f)) + ", T=" + std::to_string(T) + ", " +
                     std::to_string(threads) + " threads");
        Runner run(c, KT_ISA_AUTO, threads);
        kt_context* ctx = nullptr;
        ASSERT_EQ(run.forward(&ctx), KT_OK) << kt_last_error();
        ASSERT_EQ(run.backward(ctx, 1.f, KT_GRAD_OVERWRITE), KT_OK) << kt_last_error();
        kt_context_release(ctx);
        EXPECT_LE(rel_l2(run.y(), run.ref_forward()), 0.02);
        if (first_y.empty()) {
          first_y = run.y();
          first_dx = run.dx();
          first_g = run.grad_lora(0, true);
          continue;
        }
        EXPECT_EQ(run.y(), first_y);
        EXPECT_EQ(run.dx(), first_dx);
        EXPECT_EQ(run.grad_lora(0, true), first_g);
      }
    }
}

TEST(Profile, CountsStagesOnlyWhenOn) {
  Runner run(lora_case(), KT_ISA_AUTO);
  auto calls = [&](int stage) {
    int64_t n = -1;
    double s = -1;
    EXPECT_EQ(kt_engine_profile_stage(run.engine(), stage, &n, &s), KT_OK);
    EXPECT_GE(s, 0.0);
    return n;
  };
  kt_context* ctx = nullptr;
  ASSERT_EQ(run.forward(&ctx), KT_OK);
  kt_context_release(ctx);
  for (int st = 0; kt_stage_name(st); ++st) EXPECT_EQ(calls(st), 0) << kt_stage_name(st);
  ASSERT_EQ(kt_engine_set_profiling(run.engine(), 1), KT_OK);
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(run.forward(&ctx), KT_OK);
    ASSERT_EQ(run.backward(ctx, 1.f, KT_GRAD_OVERWRITE), KT_OK);
    kt_context_release(ctx);
  }
  for (int st : {KT_STAGE_ROUTE, KT_STAGE_GATE_UP, KT_STAGE_DOWN, KT_STAGE_BWD_DOWN, KT_STAGE_BWD_DX,
                 KT_STAGE_BWD_ROUTE, KT_STAGE_LORA_GRADS})
    EXPECT_EQ(calls(st), 2) << kt_stage_name(st);
  EXPECT_EQ(calls(KT_STAGE_LORA_A), 4);     // before gate/up and before down
  EXPECT_EQ(calls(KT_STAGE_FULL_GRADS), 0);  // a LoRA layer
  ASSERT_EQ(kt_engine_reset_profile(run.engine()), KT_OK);
  EXPECT_EQ(calls(KT_STAGE_GATE_UP), 0);
}

// The kernels a stage ran: flops and calls by kernel name.
struct StageKernels {
  std::map<std::string, int64_t> flops, calls;
  int64_t total_flops() const {
    int64_t s = 0;
    for (const auto& f : flops) s += f.second;
    return s;
  }
};
StageKernels stage_kernels(kt_engine* engine, int stage) {
  StageKernels k;
  for (int id = 0; kt_kernel_name(id); ++id) {
    int64_t calls = -1, flops = -1;
    EXPECT_EQ(kt_engine_profile_kernel(engine, stage, id, &calls, &flops), KT_OK)
        << kt_last_error();
    if (calls > 0) {
      k.calls[kt_kernel_name(id)] = calls;
      k.flops[kt_kernel_name(id)] = flops;
    } else {
      EXPECT_EQ(flops, 0) << kt_kernel_name(id);
    }
  }
  return k;
}

class KernelProfile : public ::testing::TestWithParam<kt_isa> {};

// Every weight GEMM of a forward and a dx backward is counted once, by the
// kernel of the engine's table that computed it (the worker threads' calls
// included): each stage's flops are the layer's, exactly.
TEST_P(KernelProfile, CountsEachStagesFlopsByTheKernelsThatRanThem) {
  const kt_isa isa = GetParam();
  Case c;
  c.name = "kernel_profile";
  c.E = 8;
  c.K = 2;
  c.H = 256;
  c.I = 96;
  c.T = 128;  // 32 rows per expert on average: the amx table's tiles take them
  Runner run(c, isa);
  if (!run.isa_available())
    GTEST_SKIP() << kt_isa_name(isa) << " is not available on this CPU/build";
  kt_context* ctx = nullptr;
  ASSERT_EQ(run.forward(&ctx), KT_OK) << kt_last_error();
  kt_context_release(ctx);
  for (int st = 0; kt_stage_name(st); ++st)
    EXPECT_TRUE(stage_kernels(run.engine(), st).calls.empty())
        << "counted with profiling off: " << kt_stage_name(st);

  ASSERT_EQ(kt_engine_set_profiling(run.engine(), 1), KT_OK);
  ASSERT_EQ(run.forward(&ctx), KT_OK) << kt_last_error();
  ASSERT_EQ(run.backward(ctx, 1.f, KT_GRAD_OVERWRITE), KT_OK) << kt_last_error();
  kt_context_release(ctx);
  ASSERT_EQ(kt_engine_set_profiling(run.engine(), 0), KT_OK);

  const int64_t routes = c.T * c.K, gemm = 2 * routes * c.H * c.I;  // one projection's flops
  const std::string table = std::string("__") + kt_isa_name(isa);
  int64_t all = 0;
  for (int st = 0; kt_stage_name(st); ++st) {
    const StageKernels k = stage_kernels(run.engine(), st);
    all += k.total_flops();
    for (const auto& n : k.calls) {
      const bool own = n.first.size() > table.size() &&
                       n.first.compare(n.first.size() - table.size(), table.size(), table) == 0;
      // The amx table leaves few rows to the AVX-512 BF16 kernels.
      const bool fallback = isa == KT_ISA_AMX && n.first.find("__avx512bf16") != std::string::npos;
      EXPECT_TRUE(own || fallback) << kt_stage_name(st) << " ran " << n.first;
    }
  }
  EXPECT_EQ(stage_kernels(run.engine(), KT_STAGE_GATE_UP).total_flops(), 2 * gemm);
  EXPECT_EQ(stage_kernels(run.engine(), KT_STAGE_DOWN).total_flops(), gemm);
  EXPECT_EQ(stage_kernels(run.engine(), KT_STAGE_BWD_DOWN).total_flops(), gemm);
  EXPECT_EQ(stage_kernels(run.engine(), KT_STAGE_BWD_DX).total_flops(), 2 * gemm);
  EXPECT_EQ(all, 6 * gemm);
  const StageKernels gate_up = stage_kernels(run.engine(), KT_STAGE_GATE_UP);
  EXPECT_GT(gate_up.calls.count("gemm_bf16w" + table), 0u)
      << "gate/up ran none of the table's own GEMMs";
  // dx reads W^T panels built in cache.
  EXPECT_GT(
      stage_kernels(run.engine(), KT_STAGE_BWD_DX).calls.count("transpose_panels" + table) +
          stage_kernels(run.engine(), KT_STAGE_BWD_DX).calls.count("transpose_panels__avx512bf16"),
      0u);

  ASSERT_EQ(kt_engine_reset_profile(run.engine()), KT_OK);
  for (int st = 0; kt_stage_name(st); ++st)
    EXPECT_TRUE(stage_kernels(run.engine(), st).calls.empty())
        << "not reset: " << kt_stage_name(st);
}

INSTANTIATE_TEST_SUITE_P(Isas, KernelProfile,
                         ::testing::Values(KT_ISA_REF, KT_ISA_AVX2, KT_ISA_AVX512BF16, KT_ISA_AMX),
                         [](const ::testing::TestParamInfo<kt_isa>& info) {
                           return std::string(kt_isa_name(info.param));
                         });

TEST(KernelProfile, NamesAreUniqueAndEndAfterTheLast) {
  std::set<std::string> names;
  int n = 0;
  for (; kt_kernel_name(n); ++n)
    EXPECT_TRUE(names.insert(kt_kernel_name(n)).second) << kt_kernel_name(n);
  EXPECT_GT(n, 0);
  EXPECT_EQ(kt_kernel_name(-1), nullptr);
  EXPECT_EQ(names.count("gemm_bf16w__amx"), 1u);
  EXPECT_EQ(names.count("gemm_bf16w__onednn"), 1u);
  EXPECT_EQ(names.count("sgemm_nt__avx512bf16"), 1u);
}

// Every loading form gives the same layer as stacked bf16 tensors.
TEST(Loading, AllSourceFormsMatchStackedBf16) {
  Case c;
  c.name = "load";
  c.E = 4; c.K = 2; c.H = 24; c.I = 20; c.T = 7; c.bias = true;
  Runner run(c, KT_ISA_AVX2);
  if (!run.isa_available()) GTEST_SKIP();
  ASSERT_EQ(run.forward(nullptr), KT_OK);
  const std::vector<double> want = run.y();
  // The stacked load itself against the reference, so `want` is the layer's.
  ASSERT_LE(rel_l2(want, run.ref_forward()), tolerance_for(KT_ISA_AVX2, c.bf16_act).forward);
  const int64_t E = c.E, H = c.H, I = c.I;
  auto expect_same = [&](const char* what) {
    ASSERT_EQ(run.forward(nullptr), KT_OK) << what << ": " << kt_last_error();
    EXPECT_EQ(run.y(), want) << what;
  };
  // Before each form the layer holds zero weights and biases (y = 0), so a
  // load that returns KT_OK and writes nothing cannot pass.
  TensorPtr zero_gu = Tensor::make(kBF16, {E, I, H}), zero_dn = Tensor::make(kBF16, {E, H, I});
  TensorPtr zero_bi = Tensor::make(kF32, {E, I}), zero_bh = Tensor::make(kF32, {E, H});
  auto wipe = [&](const char* before) {
    kt_arg zeros[] = {{KT_ARG_W_GATE, zero_gu->dl()}, {KT_ARG_W_UP, zero_gu->dl()},
                      {KT_ARG_W_DOWN, zero_dn->dl()}, {KT_ARG_B_GATE, zero_bi->dl()},
                      {KT_ARG_B_UP, zero_bi->dl()},   {KT_ARG_B_DOWN, zero_bh->dl()}};
    ASSERT_EQ(kt_moe_load_weights(run.moe(), nullptr, zeros, 6), KT_OK) << kt_last_error();
    ASSERT_EQ(run.forward(nullptr), KT_OK) << kt_last_error();
    EXPECT_EQ(run.y(), std::vector<double>(want.size(), 0.0)) << "zero layer before " << before;
  };
  auto value = [&](int p, int64_t e, int64_t o, int64_t i) {
    const int64_t in = p == 2 ? I : H, out = p == 2 ? H : I;
    return run.W_[p]->get((e * out + o) * in + i);
  };
  // fp32 sources, fused gate_up (concatenated), transposed (in x out) orientation.
  TensorPtr gu = Tensor::make(kF32, {E, H, 2 * I});  // in x out
  TensorPtr dn32 = Tensor::make(kF32, {E, I, H});
  TensorPtr bgu = Tensor::make(kF32, {E, 2 * I});
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t o = 0; o < 2 * I; ++o)
        gu->set((e * H + h) * 2 * I + o, value(o < I ? 0 : 1, e, o % I, h));
    for (int64_t i = 0; i < I; ++i)
      for (int64_t h = 0; h < H; ++h) dn32->set((e * I + i) * H + h, value(2, e, h, i));
    for (int64_t o = 0; o < 2 * I; ++o) bgu->set(e * 2 * I + o, run.B_[o < I ? 0 : 1]->get(e * I + o % I));
  }
  kt_load_options lo;
  kt_load_options_init(&lo);
  lo.orientation = KT_ORIENT_IN_OUT;
  kt_arg args[] = {{KT_ARG_W_GATE_UP, gu->dl()}, {KT_ARG_W_DOWN, dn32->dl()}, {KT_ARG_B_GATE_UP, bgu->dl()},
                   {KT_ARG_B_DOWN, run.B_[2]->dl()}};
  wipe("fused gate_up");
  ASSERT_EQ(kt_moe_load_weights(run.moe(), &lo, args, 4), KT_OK) << kt_last_error();
  expect_same("fused gate_up, in x out, fp32");

  // Interleaved gate/up rows (gpt-oss order), out x in, with an expert map
  // that loads the experts in reverse order.
  TensorPtr il = Tensor::make(kBF16, {E, 2 * I, H});
  TensorPtr bil = Tensor::make(kF32, {E, 2 * I});
  TensorPtr map = Tensor::make(kI32, {E});
  TensorPtr dnr = Tensor::make(kBF16, {E, H, I});
  TensorPtr bdr = Tensor::make(kF32, {E, H});
  for (int64_t p = 0; p < E; ++p) {
    const int64_t e = E - 1 - p;
    map->set(p, static_cast<double>(e));
    for (int64_t o = 0; o < 2 * I; ++o) {
      for (int64_t h = 0; h < H; ++h) il->set((p * 2 * I + o) * H + h, value(o % 2, e, o / 2, h));
      bil->set(p * 2 * I + o, run.B_[o % 2]->get(e * I + o / 2));
    }
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < I; ++i) dnr->set((p * H + h) * I + i, value(2, e, h, i));
      bdr->set(p * H + h, run.B_[2]->get(e * H + h));
    }
  }
  kt_load_options_init(&lo);
  lo.gate_up_order = KT_GATE_UP_INTERLEAVED;
  kt_arg args2[] = {{KT_ARG_W_GATE_UP, il->dl()}, {KT_ARG_W_DOWN, dnr->dl()}, {KT_ARG_B_GATE_UP, bil->dl()},
                    {KT_ARG_B_DOWN, bdr->dl()}, {KT_ARG_EXPERT_MAP, map->dl()}};
  wipe("interleaved gate_up");
  ASSERT_EQ(kt_moe_load_weights(run.moe(), &lo, args2, 5), KT_OK) << kt_last_error();
  expect_same("interleaved gate_up + expert map");

  // Per-expert 2-D tensors, with strides (a view into the stacked tensors).
  wipe("per-expert views");
  for (int64_t e = 0; e < E; ++e) {
    DLTensor g = *run.W_[0]->dl(), u = *run.W_[1]->dl(), d = *run.W_[2]->dl();
    DLTensor bg = *run.B_[0]->dl(), bu = *run.B_[1]->dl(), bd = *run.B_[2]->dl();
    int64_t gshape[] = {I, H}, dshape[] = {H, I}, bishape[] = {I}, bhshape[] = {H};
    int64_t gstr[] = {H, 1}, dstr[] = {I, 1}, bstr[] = {1};
    g.ndim = u.ndim = d.ndim = 2;
    bg.ndim = bu.ndim = bd.ndim = 1;
    g.shape = u.shape = gshape;
    d.shape = dshape;
    bg.shape = bu.shape = bishape;
    bd.shape = bhshape;
    g.strides = u.strides = gstr;
    d.strides = dstr;
    bg.strides = bu.strides = bd.strides = bstr;
    g.byte_offset = u.byte_offset = static_cast<uint64_t>(e * I * H * 2);
    d.byte_offset = static_cast<uint64_t>(e * H * I * 2);
    bg.byte_offset = bu.byte_offset = static_cast<uint64_t>(e * I * 4);
    bd.byte_offset = static_cast<uint64_t>(e * H * 4);
    kt_arg one[] = {{KT_ARG_W_GATE, &g}, {KT_ARG_W_UP, &u}, {KT_ARG_W_DOWN, &d},
                    {KT_ARG_B_GATE, &bg}, {KT_ARG_B_UP, &bu}, {KT_ARG_B_DOWN, &bd}};
    ASSERT_EQ(kt_moe_load_expert(run.moe(), e, nullptr, one, 6), KT_OK) << kt_last_error();
  }
  expect_same("per-expert strided views");
  int64_t n = 0;
  ASSERT_EQ(kt_moe_num_loaded(run.moe(), &n), KT_OK);
  EXPECT_EQ(n, E);
}

}  // namespace
}  // namespace kt_test
