// Every entry point's checks: the status, a message naming the argument, and
// state left as it was (a valid call afterwards still matches the reference).
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>

#include "harness.h"
#include "tolerances.h"

namespace kt_test {
namespace {

class Errors : public ::testing::Test {
 protected:
  void SetUp() override {
    Case c;
    c.name = "errors";
    c.E = 4; c.K = 2; c.H = 32; c.I = 24; c.T = 6;
    c.mode = KT_MODE_LORA; c.rank = 4;
    run_ = std::make_unique<Runner>(c, KT_ISA_AUTO);
    kt_engine_info info;
    info.struct_size = sizeof(info);
    ASSERT_EQ(kt_engine_get_info(run_->engine(), &info), KT_OK);
    tol_ = tolerance_for(info.isa, false);
  }

  // The call fails with status and a message containing `needle`, writes
  // none of the caller's tensors (their bytes before and after); afterwards
  // a forward + backward still match the reference.
  void expect_error(kt_status status, const char* needle, const std::function<kt_status()>& call) {
    const Runner::Snapshot before = run_->snapshot();
    kt_clear_error();
    EXPECT_EQ(call(), status) << "message: " << kt_last_error();
    EXPECT_NE(std::string(kt_last_error()).find(needle), std::string::npos)
        << "message '" << kt_last_error() << "' lacks '" << needle << "'";
    for (const std::string& name : run_->changed_since(before))
      ADD_FAILURE() << "the refused call ('" << needle << "') wrote the caller's " << name;
    expect_still_valid();
  }

  void expect_still_valid() {
    kt_context* ctx = nullptr;
    ASSERT_EQ(run_->forward(&ctx), KT_OK) << kt_last_error();
    EXPECT_LE(rel_l2(run_->y(), run_->ref_forward()), tol_.forward);
    ASSERT_EQ(run_->backward(ctx, 1.f, KT_GRAD_OVERWRITE), KT_OK) << kt_last_error();
    kt_context_release(ctx);
    kt::reference::Grads g = run_->ref_backward();
    EXPECT_LE(rel_l2(run_->dx(), g.dx), tol_.dx);
    EXPECT_LE(rel_l2(run_->grad_lora(2, false), g.dla[2]), tol_.lora);
  }

  kt_status forward_with(int replace_id, DLTensor* t, kt_context** ctx = nullptr) {
    kt_arg args[] = {{KT_ARG_X, run_->x_->dl()}, {KT_ARG_IDS, run_->ids_->dl()},
                     {KT_ARG_ROUTE_WEIGHTS, run_->w_->dl()}, {KT_ARG_Y, run_->y_->dl()}};
    for (auto& a : args)
      if (a.id == replace_id) a.tensor = t;
    return kt_moe_forward(run_->moe(), args, 4, ctx);
  }

  std::unique_ptr<Runner> run_;
  Tolerance tol_{};
};

TEST_F(Errors, ForwardArguments) {
  Runner& r = *run_;
  expect_error(KT_ERR_NULL_POINTER, "KT_ARG_X", [&] { return forward_with(KT_ARG_X, nullptr); });
  expect_error(KT_ERR_INVALID_HANDLE, "moe is NULL", [&] {
    kt_arg a[] = {{KT_ARG_X, r.x_->dl()}};
    return kt_moe_forward(nullptr, a, 1, nullptr);
  });
  expect_error(KT_ERR_NULL_POINTER, "args is NULL", [&] { return kt_moe_forward(r.moe(), nullptr, 4, nullptr); });
  expect_error(KT_ERR_INVALID_ARGUMENT, "KT_ARG_DY is not an argument", [&] {
    kt_arg a[] = {{KT_ARG_DY, r.x_->dl()}};
    return kt_moe_forward(r.moe(), a, 1, nullptr);
  });
  expect_error(KT_ERR_INVALID_ARGUMENT, "given twice", [&] {
    kt_arg a[] = {{KT_ARG_X, r.x_->dl()}, {KT_ARG_X, r.x_->dl()}};
    return kt_moe_forward(r.moe(), a, 2, nullptr);
  });
  TensorPtr x16 = Tensor::make(kF16, {6, 32});
  expect_error(KT_ERR_DTYPE, "KT_ARG_X has dtype float16", [&] { return forward_with(KT_ARG_X, x16->dl()); });
  TensorPtr xshape = Tensor::make(kF32, {6, 31});
  expect_error(KT_ERR_SHAPE, "KT_ARG_X has shape [6,31]; expected [*,32]", [&] { return forward_with(KT_ARG_X, xshape->dl()); });
  TensorPtr y16 = Tensor::make(kBF16, {6, 32});
  expect_error(KT_ERR_DTYPE, "KT_ARG_Y", [&] { return forward_with(KT_ARG_Y, y16->dl()); });
  TensorPtr ids3 = Tensor::make(kI32, {6, 3});
  expect_error(KT_ERR_SHAPE, "KT_ARG_IDS", [&] { return forward_with(KT_ARG_IDS, ids3->dl()); });
  TensorPtr idsf = Tensor::make(kF32, {6, 2});
  expect_error(KT_ERR_DTYPE, "KT_ARG_IDS", [&] { return forward_with(KT_ARG_IDS, idsf->dl()); });
  // Non-unit inner stride on X.
  // Device: CUDA memory is refused.
  DLTensor xc = *r.x_->dl();
  xc.device = {kDLCUDA, 0};
  expect_error(KT_ERR_DEVICE, "KT_ARG_X is on device type 2", [&] { return forward_with(KT_ARG_X, &xc); });
  // Expert ids out of range.
  TensorPtr bad_ids = Tensor::make(kI64, {6, 2});
  for (int64_t i = 0; i < 12; ++i) bad_ids->set(i, i % 4);
  bad_ids->set(7, 4);
  expect_error(KT_ERR_EXPERT_ID, "KT_ARG_IDS[3,1] = 4 is outside [-1, 4)", [&] { return forward_with(KT_ARG_IDS, bad_ids->dl()); });
  bad_ids->set(7, -2);
  expect_error(KT_ERR_EXPERT_ID, "= -2", [&] { return forward_with(KT_ARG_IDS, bad_ids->dl()); });
  // Too many tokens: max_tokens is T = 6.
  TensorPtr x7 = Tensor::make(kF32, {7, 32});
  expect_error(KT_ERR_TOO_MANY_TOKENS, "max_tokens is 6", [&] { return forward_with(KT_ARG_X, x7->dl()); });
  // NULL data with elements.
  DLTensor xn = *r.x_->dl();
  xn.data = nullptr;
  expect_error(KT_ERR_NULL_POINTER, "NULL data", [&] { return forward_with(KT_ARG_X, &xn); });
  // Negative stride.
  DLTensor xneg = *r.x_->dl();
  int64_t neg[] = {-32, 1};
  xneg.strides = neg;
  expect_error(KT_ERR_STRIDE, "negative stride", [&] { return forward_with(KT_ARG_X, &xneg); });
  DLTensor xinner = *r.x_->dl();
  int64_t inner[] = {64, 2};
  xinner.strides = inner;
  expect_error(KT_ERR_STRIDE, "unit stride", [&] { return forward_with(KT_ARG_X, &xinner); });
}

TEST_F(Errors, BackwardContexts) {
  Runner& r = *run_;
  expect_error(KT_ERR_CONTEXT, "ctx is NULL", [&] { return r.backward(nullptr, 1.f, KT_GRAD_OVERWRITE); });
  kt_context* ctx = nullptr;
  ASSERT_EQ(r.forward(&ctx), KT_OK);
  ASSERT_EQ(r.backward(ctx, 1.f, KT_GRAD_OVERWRITE), KT_OK);
  expect_error(KT_ERR_CONTEXT, "spent", [&] { return r.backward(ctx, 1.f, KT_GRAD_OVERWRITE); });
  kt_context_release(ctx);
  // A context of another layer.
  Case c = r.c();
  Runner other(c, KT_ISA_AUTO);
  kt_context* foreign = nullptr;
  ASSERT_EQ(other.forward(&foreign), KT_OK);
  expect_error(KT_ERR_CONTEXT, "does not belong to this layer", [&] { return r.backward(foreign, 1.f, KT_GRAD_OVERWRITE); });
  kt_context_release(foreign);
  // Wrong dy shape; bad options.
  ASSERT_EQ(r.forward(&ctx), KT_OK);
  TensorPtr dy = Tensor::make(kF32, {5, 32});
  expect_error(KT_ERR_SHAPE, "KT_ARG_DY", [&] {
    kt_arg a[] = {{KT_ARG_DY, dy->dl()}};
    return kt_moe_backward(r.moe(), ctx, nullptr, a, 1);
  });
  expect_error(KT_ERR_INVALID_ARGUMENT, "grad_scale", [&] {
    kt_backward_options bo;
    kt_backward_options_init(&bo);
    bo.grad_scale = std::nanf("");
    kt_arg a[] = {{KT_ARG_DY, r.dy_->dl()}};
    return kt_moe_backward(r.moe(), ctx, &bo, a, 1);
  });
  TensorPtr dxb = Tensor::make(kBF16, {6, 32});
  expect_error(KT_ERR_DTYPE, "KT_ARG_DX", [&] {
    kt_arg a[] = {{KT_ARG_DY, r.dy_->dl()}, {KT_ARG_DX, dxb->dl()}};
    return kt_moe_backward(r.moe(), ctx, nullptr, a, 1 + 1);
  });
  expect_error(KT_ERR_NULL_POINTER, "KT_ARG_DY is required", [&] {
    kt_arg a[] = {{KT_ARG_DX, r.dx_->dl()}};
    return kt_moe_backward(r.moe(), ctx, nullptr, a, 1);
  });
  // The context survived the failed calls.
  ASSERT_EQ(r.backward(ctx, 1.f, KT_GRAD_OVERWRITE), KT_OK) << kt_last_error();
  kt_context_release(ctx);
}

TEST_F(Errors, BindingAndModes) {
  Runner& r = *run_;
  TensorPtr wrong = Tensor::make(kF32, {4, 5, 32});  // rank 5 instead of 4
  expect_error(KT_ERR_SHAPE, "KT_ARG_LORA_A_GATE has shape [4,5,32]; expected [4,4,32]", [&] {
    kt_arg a[] = {{KT_ARG_LORA_A_GATE, wrong->dl()}};
    return kt_moe_bind(r.moe(), a, 1);
  });
  TensorPtr gw = Tensor::make(kF32, {4, 24, 32});
  expect_error(KT_ERR_MODE, "KT_MODE_FULL", [&] {
    kt_arg a[] = {{KT_ARG_GRAD_W_GATE, gw->dl()}};
    return kt_moe_bind(r.moe(), a, 1);
  });
  expect_error(KT_ERR_INVALID_ARGUMENT, "cannot be bound", [&] {
    kt_arg a[] = {{KT_ARG_X, r.x_->dl()}};
    return kt_moe_bind(r.moe(), a, 1);
  });
  // One bad arg among good ones binds nothing: the good one is not replaced.
  TensorPtr other_a = Tensor::make(kF32, {4, 4, 32});
  expect_error(KT_ERR_SHAPE, "KT_ARG_LORA_B_GATE", [&] {
    kt_arg a[] = {{KT_ARG_LORA_A_GATE, other_a->dl()}, {KT_ARG_LORA_B_GATE, wrong->dl()}};
    return kt_moe_bind(r.moe(), a, 2);
  });
  // LoRA layer without bound factors, and without bound gradient buffers.
  kt_moe_options mo;
  kt_moe_options_init(&mo);
  mo.num_experts = 4; mo.top_k = 2; mo.hidden = 32; mo.intermediate = 24; mo.max_tokens = 6;
  mo.mode = KT_MODE_LORA; mo.lora_rank = 4;
  kt_moe* fresh = nullptr;
  ASSERT_EQ(kt_moe_create(r.engine(), &mo, &fresh), KT_OK);
  kt_arg w[] = {{KT_ARG_W_GATE, r.W_[0]->dl()}, {KT_ARG_W_UP, r.W_[1]->dl()}, {KT_ARG_W_DOWN, r.W_[2]->dl()}};
  ASSERT_EQ(kt_moe_load_weights(fresh, nullptr, w, 3), KT_OK);
  kt_arg f[] = {{KT_ARG_X, r.x_->dl()}, {KT_ARG_IDS, r.ids_->dl()}, {KT_ARG_ROUTE_WEIGHTS, r.w_->dl()},
                {KT_ARG_Y, r.y_->dl()}};
  kt_context* ctx = nullptr;
  EXPECT_EQ(kt_moe_forward(fresh, f, 4, &ctx), KT_ERR_NOT_BOUND);
  EXPECT_NE(std::string(kt_last_error()).find("KT_ARG_LORA_A"), std::string::npos) << kt_last_error();
  kt_arg params[] = {{KT_ARG_LORA_A_GATE, r.la_[0]->dl()}, {KT_ARG_LORA_B_GATE, r.lb_[0]->dl()},
                     {KT_ARG_LORA_A_UP, r.la_[1]->dl()}, {KT_ARG_LORA_B_UP, r.lb_[1]->dl()},
                     {KT_ARG_LORA_A_DOWN, r.la_[2]->dl()}, {KT_ARG_LORA_B_DOWN, r.lb_[2]->dl()}};
  ASSERT_EQ(kt_moe_bind(fresh, params, 6), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_moe_forward(fresh, f, 4, &ctx), KT_OK) << kt_last_error();
  kt_arg b[] = {{KT_ARG_DY, r.dy_->dl()}};
  EXPECT_EQ(kt_moe_backward(fresh, ctx, nullptr, b, 1), KT_ERR_NOT_BOUND);
  EXPECT_NE(std::string(kt_last_error()).find("KT_ARG_GRAD_LORA_A_GATE is not bound"), std::string::npos) << kt_last_error();
  kt_backward_options bo;
  kt_backward_options_init(&bo);
  bo.param_grads = 0;
  EXPECT_EQ(kt_moe_backward(fresh, ctx, &bo, b, 1), KT_OK) << kt_last_error();
  kt_context_release(ctx);
  kt_moe_destroy(fresh);
  expect_still_valid();
}

TEST_F(Errors, LoadingAndCreation) {
  Runner& r = *run_;
  TensorPtr g = Tensor::make(kBF16, {4, 24, 31});
  expect_error(KT_ERR_SHAPE, "KT_ARG_W_GATE has shape [4,24,31]; expected [4,24,32]", [&] {
    kt_arg a[] = {{KT_ARG_W_GATE, g->dl()}, {KT_ARG_W_UP, r.W_[1]->dl()}, {KT_ARG_W_DOWN, r.W_[2]->dl()}};
    return kt_moe_load_weights(r.moe(), nullptr, a, 3);
  });
  expect_error(KT_ERR_NULL_POINTER, "KT_ARG_W_DOWN is required", [&] {
    kt_arg a[] = {{KT_ARG_W_GATE, r.W_[0]->dl()}, {KT_ARG_W_UP, r.W_[1]->dl()}};
    return kt_moe_load_weights(r.moe(), nullptr, a, 2);
  });
  TensorPtr map = Tensor::make(kI32, {4});
  for (int i = 0; i < 4; ++i) map->set(i, i == 3 ? 1 : i);
  expect_error(KT_ERR_EXPERT_ID, "names expert 1 twice", [&] {
    kt_arg a[] = {{KT_ARG_W_GATE, r.W_[0]->dl()}, {KT_ARG_W_UP, r.W_[1]->dl()}, {KT_ARG_W_DOWN, r.W_[2]->dl()},
                  {KT_ARG_EXPERT_MAP, map->dl()}};
    return kt_moe_load_weights(r.moe(), nullptr, a, 4);
  });
  TensorPtr bias = Tensor::make(kF32, {4, 24});
  expect_error(KT_ERR_INVALID_ARGUMENT, "has no biases", [&] {
    kt_arg a[] = {{KT_ARG_W_GATE, r.W_[0]->dl()}, {KT_ARG_W_UP, r.W_[1]->dl()}, {KT_ARG_W_DOWN, r.W_[2]->dl()},
                  {KT_ARG_B_GATE, bias->dl()}};
    return kt_moe_load_weights(r.moe(), nullptr, a, 4);
  });
  expect_error(KT_ERR_EXPERT_ID, "expert 9 is outside [0, 4)", [&] {
    return kt_moe_load_expert(r.moe(), 9, nullptr, nullptr, 0);
  });
  kt_load_options lo;
  kt_load_options_init(&lo);
  lo.orientation = static_cast<kt_weight_orientation>(7);
  expect_error(KT_ERR_INVALID_ARGUMENT, "orientation", [&] {
    kt_arg a[] = {{KT_ARG_W_GATE, r.W_[0]->dl()}, {KT_ARG_W_UP, r.W_[1]->dl()}, {KT_ARG_W_DOWN, r.W_[2]->dl()}};
    return kt_moe_load_weights(r.moe(), &lo, a, 3);
  });
  TensorPtr mask = Tensor::make(kU8, {5});
  expect_error(KT_ERR_SHAPE, "mask", [&] { return kt_moe_set_skipped(r.moe(), mask->dl()); });

  kt_moe_options mo;
  kt_moe_options_init(&mo);
  mo.num_experts = 4; mo.top_k = 5; mo.hidden = 8; mo.intermediate = 8;
  kt_moe* m = nullptr;
  expect_error(KT_ERR_INVALID_ARGUMENT, "top_k = 5 is outside [1, 4]", [&] { return kt_moe_create(r.engine(), &mo, &m); });
  EXPECT_EQ(m, nullptr);
  mo.top_k = 2;
  mo.mode = KT_MODE_LORA;
  mo.lora_rank = 0;
  expect_error(KT_ERR_INVALID_ARGUMENT, "lora_rank", [&] { return kt_moe_create(r.engine(), &mo, &m); });
  mo.lora_rank = 4;
  mo.lora_targets = 8;
  expect_error(KT_ERR_INVALID_ARGUMENT, "lora_targets", [&] { return kt_moe_create(r.engine(), &mo, &m); });
  mo.lora_targets = KT_PROJ_ALL;
  mo.struct_size = 4;
  expect_error(KT_ERR_INVALID_ARGUMENT, "struct_size", [&] { return kt_moe_create(r.engine(), &mo, &m); });
  expect_error(KT_ERR_INVALID_HANDLE, "engine is NULL", [&] { return kt_moe_create(nullptr, &mo, &m); });
  // The engine refuses to die while a layer uses it.
  expect_error(KT_ERR_INVALID_ARGUMENT, "destroy them first", [&] { return kt_engine_destroy(r.engine()); });
  kt_engine_options eo;
  kt_engine_options_init(&eo);
  eo.num_threads = -1;
  kt_engine* e = nullptr;
  expect_error(KT_ERR_INVALID_ARGUMENT, "num_threads", [&] { return kt_engine_create(&eo, &e); });
  EXPECT_EQ(e, nullptr);
  // The GEMM backend: a value outside the enum; a layer already on the
  // engine; the oneDNN backend on the fp32-activation kernels. Each refusal
  // leaves the engine as it was.
  expect_error(KT_ERR_INVALID_ARGUMENT, "not a kt_gemm_backend",
               [&] { return kt_engine_set_gemm_backend(r.engine(), static_cast<kt_gemm_backend>(7)); });
  expect_error(KT_ERR_INVALID_ARGUMENT, "set the backend first",
               [&] { return kt_engine_set_gemm_backend(r.engine(), KT_GEMM_NATIVE); });
  expect_error(KT_ERR_INVALID_HANDLE, "engine",
               [&] { return kt_engine_set_gemm_backend(nullptr, KT_GEMM_NATIVE); });
  eo.num_threads = 1;
  eo.max_isa = KT_ISA_AVX2;
  ASSERT_EQ(kt_engine_create(&eo, &e), KT_OK);
  expect_error(KT_ERR_UNSUPPORTED, "KT_GEMM_ONEDNN needs",
               [&] { return kt_engine_set_gemm_backend(e, KT_GEMM_ONEDNN); });
  kt_engine_info info;
  info.struct_size = sizeof(info);
  ASSERT_EQ(kt_engine_get_info(e, &info), KT_OK);
  EXPECT_EQ(info.gemm_backend, KT_GEMM_NATIVE);
  EXPECT_EQ(kt_engine_destroy(e), KT_OK);
}

TEST(Status, NamesArePinned) {
  EXPECT_STREQ(kt_status_string(KT_OK), "KT_OK");
  EXPECT_STREQ(kt_status_string(KT_ERR_CONTEXT), "KT_ERR_CONTEXT");
  EXPECT_STREQ(kt_status_string(static_cast<kt_status>(999)), "KT_ERR_UNKNOWN");
  EXPECT_EQ(KT_ERR_INTERNAL, 17);
  EXPECT_EQ(KT_ERR_SHAPE, 5);
}

}  // namespace
}  // namespace kt_test

namespace kt_test {
namespace {

struct LogSink {
  std::vector<std::pair<int, std::string>> lines;
};

void sink(int level, const char* message, void* user) {
  static_cast<LogSink*>(user)->lines.emplace_back(level, message);
}

// Sets an environment variable for a scope and puts the old value back (the
// suite itself may run under a KT_MAX_ISA cap).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_, old_.c_str(), 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  bool had_;
  std::string old_;
};

TEST(Engine, UnknownIsaCapInEnvironmentIsRefused) {
  for (const char* bad : {"foo", "avx512", "avx2 ", "sse4"}) {
    ScopedEnv env("KT_MAX_ISA", bad);
    kt_engine* e = nullptr;
    EXPECT_EQ(kt_engine_create(nullptr, &e), KT_ERR_INVALID_ARGUMENT) << bad;
    EXPECT_EQ(e, nullptr);
    const std::string msg = kt_last_error();
    EXPECT_NE(msg.find("kt_engine_create"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::string("KT_MAX_ISA = '") + bad + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("ref, avx2, avx512bf16, amx, auto"), std::string::npos) << msg;
  }
}

TEST(Engine, IsaCapInEnvironmentIgnoresCase) {
  const kt_isa cpu = kt_cpu_isa();
  for (const char* cap : {"AVX2", "Avx2", "REF", "Auto"}) {
    ScopedEnv env("KT_MAX_ISA", cap);
    kt_engine_options eo;
    kt_engine_options_init(&eo);
    eo.num_threads = 1;
    kt_engine* e = nullptr;
    ASSERT_EQ(kt_engine_create(&eo, &e), KT_OK) << cap << ": " << kt_last_error();
    kt_engine_info info;
    info.struct_size = sizeof(info);
    ASSERT_EQ(kt_engine_get_info(e, &info), KT_OK);
    const std::string lower = cap[0] == 'A' && cap[1] == 'u' ? "auto" : cap[0] == 'R' ? "ref" : "avx2";
    const bool has512 = std::strstr(kt_build_info(), "avx512bf16") != nullptr;
    const bool has_amx = std::strstr(kt_build_info(), " amx") != nullptr;
    // "auto": the best table the build has and the CPU runs.
    const kt_isa want = lower == "ref"    ? KT_ISA_REF
                        : lower == "avx2" ? (cpu >= KT_ISA_AVX2 ? KT_ISA_AVX2 : KT_ISA_REF)
                                          : (cpu >= KT_ISA_AMX && has_amx          ? KT_ISA_AMX
                                             : cpu >= KT_ISA_AVX512BF16 && has512 ? KT_ISA_AVX512BF16
                                             : cpu >= KT_ISA_AVX2                 ? KT_ISA_AVX2
                                                                                  : KT_ISA_REF);
    EXPECT_EQ(info.isa, want) << cap;
    EXPECT_EQ(kt_engine_destroy(e), KT_OK);
  }
}

TEST(Engine, Fp32PrecisionChoosesFp32OperandKernels) {
  kt_engine_options eo;
  kt_engine_options_init(&eo);
  EXPECT_EQ(eo.precision, KT_PRECISION_DEFAULT);
  eo.num_threads = 1;
  eo.precision = KT_PRECISION_FP32;
  kt_engine* e = nullptr;
  ASSERT_EQ(kt_engine_create(&eo, &e), KT_OK) << kt_last_error();
  kt_engine_info info;
  info.struct_size = sizeof(info);
  ASSERT_EQ(kt_engine_get_info(e, &info), KT_OK);
  EXPECT_EQ(info.precision, KT_PRECISION_FP32);
  EXPECT_LE(info.isa, KT_ISA_AVX2);
  EXPECT_NE(std::string(info.kernel_name).find("_f32_f32_"), std::string::npos) << info.kernel_name;
  // The oneDNN backend multiplies bf16 operands: not for an fp32 engine.
  EXPECT_EQ(kt_engine_set_gemm_backend(e, KT_GEMM_ONEDNN), KT_ERR_UNSUPPORTED);
  EXPECT_EQ(kt_engine_destroy(e), KT_OK);
  // A value outside the enum is refused, naming it.
  std::memset(&eo.precision, 0, sizeof(eo.precision));
  const int bad = 7;
  std::memcpy(&eo.precision, &bad, sizeof(bad));
  e = nullptr;
  EXPECT_EQ(kt_engine_create(&eo, &e), KT_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(e, nullptr);
  EXPECT_NE(std::string(kt_last_error()).find("options->precision = 7"), std::string::npos) << kt_last_error();
}

TEST(Engine, IsaCapFromEnvironmentAndLogCallback) {
  const kt_isa cpu = kt_cpu_isa();
  for (const char* cap : {"ref", "avx2"}) {
    ScopedEnv env("KT_MAX_ISA", cap);
    LogSink log;
    kt_engine_options eo;
    kt_engine_options_init(&eo);
    eo.num_threads = 1;
    eo.verbosity = 2;
    eo.log_fn = sink;
    eo.log_user = &log;
    kt_engine* e = nullptr;
    ASSERT_EQ(kt_engine_create(&eo, &e), KT_OK);
    kt_engine_info info;
    info.struct_size = sizeof(info);
    ASSERT_EQ(kt_engine_get_info(e, &info), KT_OK);
    const kt_isa want = std::string(cap) == "ref" ? KT_ISA_REF : (cpu >= KT_ISA_AVX2 ? KT_ISA_AVX2 : KT_ISA_REF);
    EXPECT_EQ(info.isa, want) << cap;
    EXPECT_EQ(info.cpu_isa, cpu);
    ASSERT_FALSE(log.lines.empty());
    EXPECT_EQ(log.lines[0].first, 1);
    EXPECT_NE(log.lines[0].second.find(std::string("kernels ") + kt_isa_name(want)), std::string::npos)
        << log.lines[0].second;
    EXPECT_EQ(kt_engine_destroy(e), KT_OK);
  }
  // Silent by default: verbosity 0 never calls the sink.
  LogSink quiet;
  kt_engine_options eo;
  kt_engine_options_init(&eo);
  eo.verbosity = 0;
  eo.log_fn = sink;
  eo.log_user = &quiet;
  kt_engine* e = nullptr;
  ASSERT_EQ(kt_engine_create(&eo, &e), KT_OK);
  EXPECT_TRUE(quiet.lines.empty());
  EXPECT_EQ(kt_engine_destroy(e), KT_OK);
}

TEST(Engine, TwoEnginesWithDifferentSettingsCoexist) {
  kt_engine_options a, b;
  kt_engine_options_init(&a);
  kt_engine_options_init(&b);
  a.num_threads = 1;
  a.max_isa = KT_ISA_REF;
  b.num_threads = 2;
  b.pin_threads = 0;
  kt_engine *ea = nullptr, *eb = nullptr;
  ASSERT_EQ(kt_engine_create(&a, &ea), KT_OK);
  ASSERT_EQ(kt_engine_create(&b, &eb), KT_OK);
  kt_engine_info ia, ib;
  ia.struct_size = ib.struct_size = sizeof(ia);
  kt_engine_get_info(ea, &ia);
  kt_engine_get_info(eb, &ib);
  EXPECT_EQ(ia.num_threads, 1);
  EXPECT_EQ(ib.num_threads, 2);
  EXPECT_EQ(ia.isa, KT_ISA_REF);
  EXPECT_EQ(kt_engine_destroy(ea), KT_OK);
  EXPECT_EQ(kt_engine_destroy(eb), KT_OK);
}

}  // namespace
}  // namespace kt_test
