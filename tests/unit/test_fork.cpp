// Processes forked from one that holds kt handles (DataLoader workers,
// multiprocessing's "fork"): the child has none of the parent's worker or
// job threads, so every call on an inherited handle must fail at once with
// KT_ERR_INVALID_HANDLE and a message saying it was made before the fork
// (before, kt_moe_save_packed and kt_engine_destroy waited forever for
// threads that do not exist there), while an engine made in the child works
// and the parent's handles keep working in the parent.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "tolerances.h"

namespace kt_test {
namespace {

Case fork_case() {
  Case c;
  c.name = "fork";
  c.E = 4; c.K = 2; c.H = 64; c.I = 32; c.T = 8;
  c.mode = KT_MODE_LORA; c.rank = 4;
  return c;
}

bool contains(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

// Child exit codes, for the parent's message.
enum ChildExit {
  kChildOk = 0,
  kWrongStatus = 10,       // an inherited call did not return KT_ERR_INVALID_HANDLE
  kWrongMessage = 11,      // its message does not name the call and the fork
  kSlow = 12,              // an inherited call took over a second
  kVoidCallNoMessage = 13, // a void call on an inherited handle left no message
  kNewEngine = 20,         // the child's own engine failed
  kNewForward = 21,        // its forward failed
  kNewForwardWrong = 22,   // its result is off the reference
  kNewForwardNotSame = 23, // its result differs from the parent's for the same inputs
  kSetup = 30,
};

const char* exit_meaning(int code) {
  switch (code) {
    case kWrongStatus: return "an inherited call did not return KT_ERR_INVALID_HANDLE";
    case kWrongMessage: return "an inherited call's message does not name the call and the fork";
    case kSlow: return "an inherited call took over a second";
    case kVoidCallNoMessage: return "a void call on an inherited handle left no message";
    case kNewEngine: return "the child could not create its own engine and layer";
    case kNewForward: return "the child's own forward failed";
    case kNewForwardWrong: return "the child's own forward is off the reference";
    case kNewForwardNotSame: return "the child's own forward differs from the parent's";
    case kSetup: return "child setup failed";
    default: return "unexpected exit code";
  }
}

[[noreturn]] void child_fail(ChildExit code, const std::string& what) {
  std::fprintf(stderr, "[fork child] %s: %s (kt_last_error: %s)\n", exit_meaning(code), what.c_str(),
               kt_last_error());
  std::fflush(stderr);
  _exit(code);
}

// One call on an inherited handle: must return KT_ERR_INVALID_HANDLE within a
// second, with a message that starts with the call's name, names the
// argument and says the handle was made before the fork.
template <class F>
void expect_refused(const char* call, const char* arg, F&& f) {
  kt_clear_error();
  const auto t0 = std::chrono::steady_clock::now();
  const kt_status st = f();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (s > 1.0) child_fail(kSlow, std::string(call) + " took " + std::to_string(s) + " s");
  if (st != KT_ERR_INVALID_HANDLE)
    child_fail(kWrongStatus, std::string(call) + " returned " + kt_status_string(st));
  const std::string msg = kt_last_error();
  if (msg.rfind(std::string(call) + ": " + arg + " is a ", 0) != 0 ||
      !contains(msg, "made before this process was forked from process " + std::to_string(getppid())) ||
      !contains(msg, "create a new engine in this process"))
    child_fail(kWrongMessage, std::string(call) + ": \"" + msg + "\"");
}

// A void call (destroy/release) on an inherited handle: returns at once and
// leaves the fork message.
template <class F>
void expect_void_refused(const char* call, const char* arg, F&& f) {
  kt_clear_error();
  const auto t0 = std::chrono::steady_clock::now();
  f();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (s > 1.0) child_fail(kSlow, std::string(call) + " took " + std::to_string(s) + " s");
  const std::string msg = kt_last_error();
  if (msg.empty()) child_fail(kVoidCallNoMessage, call);
  if (msg.rfind(std::string(call) + ": " + arg + " is a ", 0) != 0 ||
      !contains(msg, "made before this process was forked"))
    child_fail(kWrongMessage, std::string(call) + ": \"" + msg + "\"");
}

// Waits for the child at most timeout_s; kills it (a hang) past that.
// Returns the wait status, or -1 when it had to be killed.
int wait_child(pid_t child, double timeout_s) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    int status = 0;
    const pid_t r = waitpid(child, &status, WNOHANG);
    if (r == child) return status;
    if (r < 0) return -2;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > timeout_s) {
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void expect_child_ok(pid_t child) {
  const int status = wait_child(child, 120);
  ASSERT_NE(status, -1) << "the child hung (killed after 120 s)";
  ASSERT_NE(status, -2) << "waitpid failed";
  ASSERT_TRUE(WIFEXITED(status)) << "the child ended by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "child exit " << WEXITSTATUS(status) << ": "
                                    << exit_meaning(WEXITSTATUS(status)) << " (its stderr says which call)";
}

TEST(Fork, InheritedHandlesAreRefusedAtOnceAndAChildEngineWorks) {
  const Case c = fork_case();
  Runner parent(c, KT_ISA_AUTO);
  ASSERT_TRUE(parent.isa_available());
  parent.fill_inputs(7);
  ASSERT_EQ(parent.forward(nullptr), KT_OK) << kt_last_error();
  const std::vector<double> parent_y = parent.y();

  // Handles of every kind a trainer holds: engine, layer, saved context,
  // optimizer, a deferred job and a job submitted just before the fork
  // (possibly running on the parent's job thread while fork() happens).
  kt_context* ctx = nullptr;
  ASSERT_EQ(parent.forward(&ctx), KT_OK) << kt_last_error();
  kt_optimizer* opt = nullptr;
  ASSERT_EQ(kt_optimizer_create_for_layer(parent.moe(), nullptr, &opt), KT_OK) << kt_last_error();
  auto yj = Tensor::make(kF32, {c.T, c.H});
  kt_arg fargs[4] = {{KT_ARG_X, parent.x_->dl()}, {KT_ARG_IDS, parent.ids_->dl()},
                     {KT_ARG_ROUTE_WEIGHTS, parent.w_->dl()}, {KT_ARG_Y, yj->dl()}};
  kt_job* deferred = nullptr;
  ASSERT_EQ(kt_moe_forward_submit(parent.moe(), fargs, 4, nullptr, KT_SUBMIT_DEFERRED, &deferred), KT_OK)
      << kt_last_error();
  auto yr = Tensor::make(kF32, {c.T, c.H});
  kt_arg rargs[4] = {{KT_ARG_X, parent.x_->dl()}, {KT_ARG_IDS, parent.ids_->dl()},
                     {KT_ARG_ROUTE_WEIGHTS, parent.w_->dl()}, {KT_ARG_Y, yr->dl()}};
  kt_job* running = nullptr;
  ASSERT_EQ(kt_moe_forward_submit(parent.moe(), rargs, 4, nullptr, 0, &running), KT_OK) << kt_last_error();
  const std::string packed = testing::TempDir() + "kt_fork_" + std::to_string(getpid()) + ".ktpack";

  std::fflush(nullptr);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(100);  // a hang ends the child by SIGALRM before the parent's deadline
    kt_engine* e = parent.engine();
    kt_moe* m = parent.moe();
    expect_refused("kt_moe_save_packed", "moe", [&] { return kt_moe_save_packed(m, packed.c_str()); });
    expect_refused("kt_moe_forward", "moe", [&] { return kt_moe_forward(m, fargs, 4, nullptr); });
    expect_refused("kt_moe_forward_submit", "moe", [&] {
      kt_job* j = nullptr;
      return kt_moe_forward_submit(m, fargs, 4, nullptr, 0, &j);
    });
    expect_refused("kt_moe_backward", "moe", [&] {
      kt_backward_options bo;
      kt_backward_options_init(&bo);
      kt_arg bargs[3] = {{KT_ARG_DY, parent.dy_->dl()}, {KT_ARG_DX, parent.dx_->dl()},
                         {KT_ARG_DROUTE_WEIGHTS, parent.dw_->dl()}};
      return kt_moe_backward(m, ctx, &bo, bargs, 3);
    });
    expect_refused("kt_moe_params_changed", "moe", [&] { return kt_moe_params_changed(m); });
    expect_refused("kt_engine_get_info", "engine", [&] {
      kt_engine_info info;
      info.struct_size = sizeof(info);
      return kt_engine_get_info(e, &info);
    });
    expect_refused("kt_optimizer_step", "opt", [&] { return kt_optimizer_step(opt, nullptr); });
    expect_refused("kt_job_wait", "job", [&] { return kt_job_wait(running); });
    expect_void_refused("kt_job_run", "job", [&] { kt_job_run(deferred); });
    expect_refused("kt_moe_create", "engine", [&] {
      kt_moe_options mo;
      kt_moe_options_init(&mo);
      mo.num_experts = c.E; mo.top_k = c.K; mo.hidden = c.H; mo.intermediate = c.I;
      kt_moe* m2 = nullptr;
      return kt_moe_create(e, &mo, &m2);
    });
    // Destroying inherited handles frees nothing of the parent's and waits
    // for no thread (the engine's would be joined otherwise).
    expect_void_refused("kt_context_release", "ctx", [&] { kt_context_release(ctx); });
    expect_void_refused("kt_job_destroy", "job", [&] { kt_job_destroy(running); });
    expect_void_refused("kt_optimizer_destroy", "opt", [&] { kt_optimizer_destroy(opt); });
    expect_void_refused("kt_moe_destroy", "moe", [&] { kt_moe_destroy(m); });
    expect_refused("kt_engine_destroy", "engine", [&] { return kt_engine_destroy(e); });

    // The child's own engine and layer: the same problem gives the
    // reference's result, and the parent's bits.
    {
      Runner own(c, KT_ISA_AUTO);
      if (!own.isa_available() || !own.engine() || !own.moe()) child_fail(kNewEngine, "Runner");
      own.fill_inputs(7);
      if (own.forward(nullptr) != KT_OK) child_fail(kNewForward, "kt_moe_forward");
      kt_engine_info info;
      info.struct_size = sizeof(info);
      if (kt_engine_get_info(own.engine(), &info) != KT_OK) child_fail(kNewEngine, "kt_engine_get_info");
      const double err = rel_l2(own.y(), own.ref_forward());
      if (!(err <= tolerance_for(info.isa, false).forward))
        child_fail(kNewForwardWrong, "relative L2 error " + std::to_string(err));
      if (own.y() != parent_y) child_fail(kNewForwardNotSame, "y");
      // A packed save (which runs on the engine's workers) works here.
      if (kt_moe_save_packed(own.moe(), packed.c_str()) != KT_OK) child_fail(kNewForward, "kt_moe_save_packed");
      std::remove(packed.c_str());
    }
    _exit(kChildOk);
  }
  expect_child_ok(child);

  // The parent's handles are untouched by the child's refusals.
  EXPECT_EQ(kt_job_wait(running), KT_OK) << kt_last_error();
  kt_job_destroy(running);
  kt_job_run(deferred);
  EXPECT_EQ(kt_job_wait(deferred), KT_OK) << kt_last_error();
  kt_job_destroy(deferred);
  EXPECT_EQ(yr->values(), parent_y);
  EXPECT_EQ(yj->values(), parent_y);
  kt_context_release(ctx);
  EXPECT_STREQ(kt_last_error(), "") << "the parent's context was released in the child";
  kt_optimizer_destroy(opt);
  ASSERT_EQ(parent.forward(nullptr), KT_OK) << kt_last_error();
  EXPECT_EQ(parent.y(), parent_y);
  EXPECT_EQ(kt_moe_save_packed(parent.moe(), packed.c_str()), KT_OK) << kt_last_error();
  std::remove(packed.c_str());
}

// A grandchild refuses the handles of both its ancestors; the handles the
// child made keep working in the child.
TEST(Fork, HandlesOfEveryAncestorAreRefusedInAGrandchild) {
  const Case c = fork_case();
  Runner parent(c, KT_ISA_AUTO);
  ASSERT_TRUE(parent.isa_available());
  std::fflush(nullptr);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(100);
    Runner own(c, KT_ISA_AUTO);
    if (!own.engine() || !own.moe()) child_fail(kNewEngine, "Runner in the child");
    own.fill_inputs(3);
    std::fflush(nullptr);
    const pid_t grandchild = fork();
    if (grandchild < 0) child_fail(kSetup, "fork");
    if (grandchild == 0) {
      expect_refused("kt_moe_forward", "moe", [&] { return kt_moe_forward(parent.moe(), nullptr, 0, nullptr); });
      expect_refused("kt_moe_forward", "moe", [&] { return kt_moe_forward(own.moe(), nullptr, 0, nullptr); });
      _exit(kChildOk);
    }
    int status = 0;
    if (waitpid(grandchild, &status, 0) != grandchild || !WIFEXITED(status))
      child_fail(kSetup, "the grandchild did not exit");
    if (WEXITSTATUS(status) != 0) _exit(WEXITSTATUS(status));
    if (own.forward(nullptr) != KT_OK) child_fail(kNewForward, "the child's forward after the grandchild");
    _exit(kChildOk);
  }
  expect_child_ok(child);
  parent.fill_inputs(3);
  EXPECT_EQ(parent.forward(nullptr), KT_OK) << kt_last_error();
}

}  // namespace
}  // namespace kt_test
