// Submissions whose job cannot be started (out of memory for its handle or
// its place in the queue, injected through kt::fail_job_starts_for_tests):
// the call fails with KT_ERR_OUT_OF_MEMORY, writes neither the job nor the
// context handle, leaves a context it was given as it was, and the layer's
// destruction does not wait for the job that never ran; the same for an
// optimizer's step. Linked with the
// library's objects (kt_internal) for the injection point.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <thread>

#include "harness.h"
#include "runtime/jobs.h"
#include "tolerances.h"

namespace kt_test {
namespace {

Case lora_case() {
  Case c;
  c.name = "job_faults";
  c.E = 4; c.K = 2; c.H = 32; c.I = 24; c.T = 6;
  c.mode = KT_MODE_LORA; c.rank = 4;
  return c;
}

// The bounds of the table the runner's engine chose (fp32 activations).
Tolerance tolerance_of(Runner& r) {
  kt_engine_info info;
  info.struct_size = sizeof(info);
  EXPECT_EQ(kt_engine_get_info(r.engine(), &info), KT_OK);
  return tolerance_for(info.isa, false);
}

// Runs `destroy` (the layer's and engine's destruction) and fails the test
// program when it has not returned within a minute: it would wait forever
// for a job that was registered but never queued.
template <class F>
void expect_returns(const char* what, F&& destroy) {
  std::promise<void> done;
  std::future<void> ended = done.get_future();
  std::thread t([&] {
    destroy();
    done.set_value();
  });
  if (ended.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    std::fprintf(stderr, "%s did not return within 60 s: it waits for a job that never ran\n", what);
    std::fflush(stderr);
    std::_Exit(1);
  }
  t.join();
}

TEST(JobStartFailure, ForwardSubmitWritesNothingAndTheLayerStillEnds) {
  auto run = std::make_unique<Runner>(lora_case(), KT_ISA_AUTO);
  run->fill_inputs(3);
  kt_arg fargs[4] = {{KT_ARG_X, run->x_->dl()}, {KT_ARG_IDS, run->ids_->dl()},
                     {KT_ARG_ROUTE_WEIGHTS, run->w_->dl()}, {KT_ARG_Y, run->y_->dl()}};
  kt_context* const ctx_sentinel = reinterpret_cast<kt_context*>(0x1);
  kt_job* const job_sentinel = reinterpret_cast<kt_job*>(0x1);
  for (unsigned flags : {0u, KT_SUBMIT_DEFERRED}) {
    for (bool save : {true, false}) {
      kt_context* ctx = ctx_sentinel;
      kt_job* job = job_sentinel;
      kt::fail_job_starts_for_tests(1);
      EXPECT_EQ(kt_moe_forward_submit(run->moe(), fargs, 4, save ? &ctx : nullptr, flags, &job),
                KT_ERR_OUT_OF_MEMORY)
          << "flags " << flags;
      EXPECT_EQ(ctx, ctx_sentinel) << "the failed submission wrote a context handle";
      EXPECT_EQ(job, job_sentinel) << "the failed submission wrote a job handle";
    }
  }
  kt::fail_job_starts_for_tests(0);
  // The layer works on: a submission now runs and is right.
  kt_context* ctx = nullptr;
  kt_job* job = nullptr;
  ASSERT_EQ(kt_moe_forward_submit(run->moe(), fargs, 4, &ctx, 0, &job), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_job_wait(job), KT_OK) << kt_last_error();
  kt_job_destroy(job);
  EXPECT_LE(rel_l2(run->y(), run->ref_forward()), tolerance_of(*run).forward);
  kt_context_release(ctx);
  expect_returns("destroying the layer after failed forward submissions", [&] { run.reset(); });
}

TEST(JobStartFailure, BackwardSubmitLeavesTheContextForAnotherBackward) {
  auto run = std::make_unique<Runner>(lora_case(), KT_ISA_AUTO);
  const double tol = tolerance_of(*run).dx;
  run->fill_inputs(5);
  kt_arg bargs[3] = {{KT_ARG_DY, run->dy_->dl()}, {KT_ARG_DX, run->dx_->dl()},
                     {KT_ARG_DROUTE_WEIGHTS, run->dw_->dl()}};
  for (unsigned flags : {0u, KT_SUBMIT_DEFERRED}) {
    kt_context* ctx = nullptr;
    ASSERT_EQ(run->forward(&ctx), KT_OK) << kt_last_error();
    kt_job* const job_sentinel = reinterpret_cast<kt_job*>(0x1);
    kt_job* job = job_sentinel;
    kt::fail_job_starts_for_tests(1);
    EXPECT_EQ(kt_moe_backward_submit(run->moe(), ctx, nullptr, bargs, 3, flags, &job), KT_ERR_OUT_OF_MEMORY);
    EXPECT_EQ(job, job_sentinel) << "the failed submission wrote a job handle";
    kt::fail_job_starts_for_tests(0);
    // Not marked as having a backward, nor held: a backward runs on it.
    ASSERT_EQ(kt_moe_backward_submit(run->moe(), ctx, nullptr, bargs, 3, flags, &job), KT_OK) << kt_last_error();
    ASSERT_EQ(kt_job_wait(job), KT_OK) << kt_last_error();
    kt_job_destroy(job);
    EXPECT_LE(rel_l2(run->dx(), run->ref_backward().dx), tol) << "flags " << flags;
    kt_context_release(ctx);
  }
  expect_returns("destroying the layer after failed backward submissions", [&] { run.reset(); });
}

TEST(JobStartFailure, OptimizerStepSubmitWritesNothingAndTheOptimizerStillEnds) {
  auto run = std::make_unique<Runner>(lora_case(), KT_ISA_AUTO);
  run->fill_inputs(7);
  kt_context* ctx = nullptr;
  ASSERT_EQ(run->forward(&ctx), KT_OK) << kt_last_error();
  ASSERT_EQ(run->backward(ctx, 1.f, KT_GRAD_OVERWRITE), KT_OK) << kt_last_error();
  kt_context_release(ctx);
  kt_optimizer* opt = nullptr;
  ASSERT_EQ(kt_optimizer_create_for_layer(run->moe(), nullptr, &opt), KT_OK) << kt_last_error();
  int found_nonfinite = -1;
  kt_optimizer_step_options so;
  kt_optimizer_step_options_defaults(&so, sizeof(so));
  so.found_nonfinite = &found_nonfinite;
  kt_job* const job_sentinel = reinterpret_cast<kt_job*>(0x1);
  for (unsigned flags : {0u, KT_SUBMIT_DEFERRED}) {
    kt_job* job = job_sentinel;
    kt::fail_job_starts_for_tests(1);
    EXPECT_EQ(kt_optimizer_step_submit(opt, &so, flags, &job), KT_ERR_OUT_OF_MEMORY) << "flags " << flags;
    EXPECT_EQ(job, job_sentinel) << "the failed submission wrote a job handle";
  }
  kt::fail_job_starts_for_tests(0);
  int64_t step = -1;
  ASSERT_EQ(kt_optimizer_get_step(opt, &step), KT_OK);
  EXPECT_EQ(step, 0) << "a step that was never started ran";
  EXPECT_EQ(found_nonfinite, -1) << "a step that was never started wrote its flag";
  // The optimizer works on: a submission now runs its step.
  kt_job* job = nullptr;
  ASSERT_EQ(kt_optimizer_step_submit(opt, &so, 0, &job), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_job_wait(job), KT_OK) << kt_last_error();
  kt_job_destroy(job);
  ASSERT_EQ(kt_optimizer_get_step(opt, &step), KT_OK);
  EXPECT_EQ(step, 1);
  EXPECT_EQ(found_nonfinite, 0);
  expect_returns("destroying the optimizer after failed step submissions", [&] { kt_optimizer_destroy(opt); });
  expect_returns("destroying the layer after them", [&] { run.reset(); });
}

}  // namespace
}  // namespace kt_test
