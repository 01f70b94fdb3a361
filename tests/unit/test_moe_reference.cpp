// The MoE op through the C ABI against the double-precision reference, for
// every compiled ISA path forced in turn through the engine's ISA cap.
#include <cstdio>
#include <tuple>

#include "cases.h"
#include "harness.h"
#include "tolerances.h"

namespace kt_test {
namespace {

using Param = std::tuple<kt_isa, Case>;

class MoeVsReference : public ::testing::TestWithParam<Param> {};

void expect_close(const char* what, const std::vector<double>& got, const std::vector<double>& ref,
                  double tol) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  const double err = rel_l2(got, ref);
  EXPECT_LE(err, tol) << what << ": relative L2 error " << err << " > " << tol;
  char text[32];
  std::snprintf(text, sizeof(text), "%.3e", err);  // std::to_string would print 1e-7 as 0.000000
  ::testing::Test::RecordProperty(what, text);
}

void check_case(kt_isa isa, const Case& c, kt_gemm_backend backend = KT_GEMM_AUTO) {
  Runner run(c, isa, 2, backend);
  if (!run.isa_available())
    GTEST_SKIP() << kt_isa_name(isa) << (backend == KT_GEMM_ONEDNN ? " with the oneDNN backend" : "")
                 << " is not available on this CPU/build";
  const Tolerance tol = tolerance_for(isa, c.bf16_act);
  kt_context* ctx = nullptr;
  ASSERT_EQ(run.forward(&ctx), KT_OK) << kt_last_error();
  ASSERT_NE(ctx, nullptr);
  expect_close("forward", run.y(), run.ref_forward(), tol.forward);
  ASSERT_EQ(run.backward(ctx, 1.f, KT_GRAD_OVERWRITE), KT_OK) << kt_last_error();
  kt_context_release(ctx);
  kt::reference::Grads g = run.ref_backward();
  expect_close("dx", run.dx(), g.dx, tol.dx);
  expect_close("droute", run.dw(), g.dw, tol.droute);
  for (int p = 0; p < 3; ++p) {
    if (c.mode == KT_MODE_LORA && ((c.targets >> p) & 1u)) {
      // Skipped experts' gradient entries are never written (stay zero here),
      // and the reference gives them zero as well.
      expect_close("lora_A", run.grad_lora(p, false), g.dla[p], tol.lora);
      expect_close("lora_B", run.grad_lora(p, true), g.dlb[p], tol.lora);
    }
    if (c.mode == KT_MODE_FULL) {
      expect_close("full_W", run.grad_full(p, false), g.dW[p], tol.full);
      if (c.bias) expect_close("full_b", run.grad_full(p, true), g.db[p], tol.full);
    }
  }
}

TEST_P(MoeVsReference, ForwardBackwardMatch) { check_case(std::get<0>(GetParam()), std::get<1>(GetParam())); }

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::string(kt_isa_name(std::get<0>(info.param))) + "_" + std::get<1>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(Isa, MoeVsReference,
                         ::testing::Combine(::testing::Values(KT_ISA_REF, KT_ISA_AVX2, KT_ISA_AVX512BF16),
                                            ::testing::ValuesIn(core_cases())),
                         param_name);

INSTANTIATE_TEST_SUITE_P(RealShape, MoeVsReference,
                         ::testing::Combine(::testing::Values(KT_ISA_AVX2, KT_ISA_AVX512BF16),
                                            ::testing::Values(qwen3_30b_a3b_slice())),
                         param_name);

// Engines created with KT_PRECISION_FP32, on every case and whatever the CPU:
// fp32 activations keep fp32 operands, so the fp32 tolerances hold (on the
// default avx512bf16 engine the same fp32 cases need kBf16OperandsFp32Io).
class Fp32Precision : public ::testing::TestWithParam<Case> {};

TEST_P(Fp32Precision, ForwardBackwardMatchWithFp32Operands) {
  Case c = GetParam();
  c.precision = KT_PRECISION_FP32;
  Runner run(c, KT_ISA_AUTO);
  ASSERT_TRUE(run.isa_available());
  kt_engine_info info;
  info.struct_size = sizeof(info);
  ASSERT_EQ(kt_engine_get_info(run.engine(), &info), KT_OK);
  EXPECT_EQ(info.precision, KT_PRECISION_FP32);
  EXPECT_LE(info.isa, KT_ISA_AVX2) << "fp32 precision must run kernels with fp32 operands";
  EXPECT_NE(std::string(info.kernel_name).find("_f32_f32_"), std::string::npos) << info.kernel_name;
  check_case(KT_ISA_AUTO, c);  // tolerance_for(AUTO, ...) = the fp32-operand tolerances
}

INSTANTIATE_TEST_SUITE_P(Cases, Fp32Precision, ::testing::ValuesIn(core_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// The oneDNN GEMM backend on the same cases: shapes whose K is a multiple of
// 32 go through oneDNN (the others through kt's kernel), so the mix checks
// both and their hand-over. Same tolerances as the avx512bf16 path (the
// same bf16 operands, fp32 accumulation).
class OneDnnBackend : public ::testing::TestWithParam<Case> {};

TEST_P(OneDnnBackend, ForwardBackwardMatch) { check_case(KT_ISA_AVX512BF16, GetParam(), KT_GEMM_ONEDNN); }

std::vector<Case> onednn_cases() {
  std::vector<Case> v = core_cases();
  v.push_back(qwen3_30b_a3b_slice());
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, OneDnnBackend, ::testing::ValuesIn(onednn_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
}  // namespace kt_test
