// kt_optimizer through the C ABI: AdamW and SGD against reference loops
// written here (fp32 in torch.optim's operation order: exact; double: the
// bound below), loss-scale and clip factors, non-finite skips, the gradient
// norm, threads, state files (bit-identical resume, refused mismatches),
// bad input, async steps, and layers (full and LoRA) that follow each step.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "harness.h"
#include "kt_c_api.h"

namespace {

using kt_test::kBF16;
using kt_test::kF16;
using kt_test::kF32;
using kt_test::Tensor;
using kt_test::TensorPtr;

std::string temp_path(const std::string& name) {
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp && *tmp ? tmp : "/tmp") + "/kt_optim_" + std::to_string(getpid()) + "_" + name;
}

// torch.optim.AdamW (for-loop path on an AVX2 CPU) element by element: fp32
// tensors, python-float scalars rounded to fp32, add(alpha) and addcmul
// fused. m moves as torch 1.13's mul_(b1).add_(g, alpha=1-b1), or (options
// arithmetic KT_OPTIM_TORCH2) as torch 2's lerp_(g, 1-b1), whose CPU kernel
// steps from m when the weight is below 0.5 and back from g otherwise.
struct RefAdamW {
  std::vector<float> p, m, v, vmax;
  int64_t t = 0;
  explicit RefAdamW(std::vector<float> p0) : p(std::move(p0)), m(p.size()), v(p.size()), vmax(p.size()) {}
  void step(const std::vector<float>& graw, const kt_optimizer_options& o, float us = 1.f, float cc = 1.f) {
    ++t;
    const double bc1 = 1.0 - std::pow(o.beta1, double(t)), bc2 = 1.0 - std::pow(o.beta2, double(t));
    const float decay = float(1.0 - o.lr * o.weight_decay), b1 = float(o.beta1), b2 = float(o.beta2);
    const float omb1 = float(1.0 - o.beta1), omb2 = float(1.0 - o.beta2);
    const float bc2s = float(std::sqrt(bc2)), nss = float(-(o.lr / bc1)), eps = float(o.eps);
    for (size_t i = 0; i < p.size(); ++i) {
      const float g = (graw[i] * us) * cc;
      const float pd = p[i] * decay;
      if (o.arithmetic == KT_OPTIM_TORCH2) {
        const float diff = g - m[i];
        m[i] = omb1 < 0.5f ? std::fma(omb1, diff, m[i]) : std::fma(-diff, 1.f - omb1, g);
      } else {
        const float mb = m[i] * b1;
        m[i] = std::fma(g, omb1, mb);
      }
      const float vb = v[i] * b2;
      const float og = omb2 * g;
      v[i] = std::fma(og, g, vb);
      float vu = v[i];
      if (o.amsgrad) vu = vmax[i] = std::max(vmax[i], v[i]);
      const float root = std::sqrt(vu);
      const float scaled = root / bc2s;
      const float denom = scaled + eps;
      const float num = nss * m[i];
      const float upd = num / denom;
      p[i] = pd + upd;
    }
  }
};

// The same in double: the exact-arithmetic AdamW, for the error bound.
struct RefAdamWDouble {
  std::vector<double> p, m, v;
  int64_t t = 0;
  explicit RefAdamWDouble(const std::vector<float>& p0) : p(p0.begin(), p0.end()), m(p.size()), v(p.size()) {}
  void step(const std::vector<float>& g, const kt_optimizer_options& o) {
    ++t;
    const double bc1 = 1.0 - std::pow(o.beta1, double(t)), bc2 = 1.0 - std::pow(o.beta2, double(t));
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] *= 1.0 - o.lr * o.weight_decay;
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g[i];
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * double(g[i]) * g[i];
      p[i] -= o.lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + o.eps);
    }
  }
};

// torch.optim.SGD (for-loop path): add(alpha) fused.
struct RefSgd {
  std::vector<float> p, buf;
  bool started = false;
  explicit RefSgd(std::vector<float> p0) : p(std::move(p0)), buf(p.size()) {}
  void step(const std::vector<float>& g, const kt_optimizer_options& o) {
    for (size_t i = 0; i < p.size(); ++i) {
      float d = g[i];
      if (o.weight_decay != 0) d = std::fma(p[i], float(o.weight_decay), d);
      if (o.momentum != 0) {
        buf[i] = started ? std::fma(d, float(1.0 - o.dampening), buf[i] * float(o.momentum)) : d;
        d = o.nesterov ? std::fma(buf[i], float(o.momentum), d) : buf[i];
      }
      p[i] = std::fma(d, float(-o.lr), p[i]);
    }
    if (o.momentum != 0) started = true;
  }
};

std::vector<float> randn(size_t n, std::mt19937& rng, float scale = 1.f) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

TensorPtr f32_tensor(std::vector<int64_t> shape, const std::vector<float>& values) {
  TensorPtr t = Tensor::make(kF32, std::move(shape));
  std::memcpy(t->f32(), values.data(), values.size() * sizeof(float));
  return t;
}

std::vector<float> values_of(Tensor& t) {
  return std::vector<float>(t.f32(), t.f32() + t.numel());
}

// A host optimizer over one [rows, cols] parameter.
struct HostProblem {
  TensorPtr param, grad;
  kt_optimizer* opt = nullptr;
  HostProblem(std::vector<int64_t> shape, const std::vector<float>& p0, kt_engine* engine,
              const kt_optimizer_options& o) {
    param = f32_tensor(shape, p0);
    grad = Tensor::make(kF32, shape);
    kt_optimizer_param pp{param->dl(), grad->dl()};
    EXPECT_EQ(kt_optimizer_create(engine, &o, &pp, 1, &opt), KT_OK) << kt_last_error();
  }
  ~HostProblem() { kt_optimizer_destroy(opt); }
  void set_grad(const std::vector<float>& g) { std::memcpy(grad->f32(), g.data(), g.size() * sizeof(float)); }
  kt_status step(float us = 1.f, float cc = 1.f, int* nonfinite = nullptr) {
    kt_optimizer_step_options so;
    kt_optimizer_step_options_init(&so);
    so.grad_unscale = us;
    so.clip_coef = cc;
    so.found_nonfinite = nonfinite;
    return kt_optimizer_step(opt, &so);
  }
};

// An engine of `threads` unpinned workers with kernels capped at isa, or
// null for threads 0 (steps on the calling thread).
kt_engine* make_engine(int threads, kt_isa isa = KT_ISA_AUTO) {
  if (!threads) return nullptr;
  kt_engine_options eo;
  kt_engine_options_init(&eo);
  eo.num_threads = threads;
  eo.pin_threads = 0;
  eo.max_isa = isa;
  kt_engine* engine = nullptr;
  EXPECT_EQ(kt_engine_create(&eo, &engine), KT_OK) << kt_last_error();
  return engine;
}

double lr_at(int step) { return 1e-2 * (0.5 + 0.5 * std::cos(3.14159 * step / 200.0)); }

int64_t count_diff(const std::vector<float>& a, const std::vector<float>& b) {
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return n;
}

class AdamWSteps : public ::testing::TestWithParam<int> {};

// 200 steps, random gradients, cosine lr schedule, weight decay: the same
// bits as the fp32 reference (amsgrad off and on; no engine, 1 and 3 threads;
// torch 1 and torch 2 arithmetic, the latter with a lerp weight 1-b1 below
// and above 0.5).
TEST_P(AdamWSteps, MatchesReferenceBitForBit) {
  const int variant = GetParam();
  const bool amsgrad = variant & 1;
  const int threads = (variant >> 1) & 3;  // 0: no engine
  const bool torch2 = variant & 8;
  const bool small_beta1 = variant & 16;
  kt_engine* engine = make_engine(threads);
  ASSERT_TRUE(engine || !threads);
  std::mt19937 rng(7 + variant);
  const int64_t rows = 300, cols = 250;  // 75000 elements: three work items, one partial
  const std::vector<float> p0 = randn(rows * cols, rng);
  kt_optimizer_options o;
  kt_optimizer_options_init(&o);
  o.weight_decay = 0.1;
  o.amsgrad = amsgrad;
  if (torch2) o.arithmetic = KT_OPTIM_TORCH2;
  if (small_beta1) o.beta1 = 0.3;
  {
    HostProblem hp({rows, cols}, p0, engine, o);
    RefAdamW ref(p0);
    RefAdamWDouble dref(p0);
    double worst = 0;
    for (int s = 0; s < 200; ++s) {
      o.lr = lr_at(s);
      ASSERT_EQ(kt_optimizer_set_options(hp.opt, &o), KT_OK) << kt_last_error();
      const std::vector<float> g = randn(p0.size(), rng, 0.1f);
      hp.set_grad(g);
      ASSERT_EQ(hp.step(), KT_OK) << kt_last_error();
      ref.step(g, o);
      if (!amsgrad) dref.step(g, o);
    }
    const std::vector<float> got = values_of(*hp.param);
    EXPECT_EQ(count_diff(got, ref.p), 0) << "elements differing from the fp32 reference";
    if (!amsgrad) {
      for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - dref.p[i]));
      // fp32 rounding of ~10 operations per step, 200 steps, on |p| ~ 1.
      EXPECT_LT(worst, 2e-5) << "distance from exact-arithmetic AdamW";
    }
    int64_t step = 0;
    EXPECT_EQ(kt_optimizer_get_step(hp.opt, &step), KT_OK);
    EXPECT_EQ(step, 200);
  }
  EXPECT_EQ(kt_engine_destroy(engine), KT_OK);
}

INSTANTIATE_TEST_SUITE_P(Variants, AdamWSteps, ::testing::Values(0, 1, 2, 3, 6, 7, 8, 9, 14, 24, 25, 30));

struct SgdCase {
  double momentum, dampening, weight_decay;
  int nesterov;
};

class SgdSteps : public ::testing::TestWithParam<SgdCase> {};

TEST_P(SgdSteps, MatchesReferenceBitForBit) {
  const SgdCase c = GetParam();
  std::mt19937 rng(11);
  const std::vector<float> p0 = randn(40000, rng);
  kt_optimizer_options o;
  kt_optimizer_options_init(&o);
  o.algorithm = KT_OPTIM_SGD;
  o.momentum = c.momentum;
  o.dampening = c.dampening;
  o.weight_decay = c.weight_decay;
  o.nesterov = c.nesterov;
  HostProblem hp({200, 200}, p0, nullptr, o);
  RefSgd ref(p0);
  for (int s = 0; s < 200; ++s) {
    o.lr = 10 * lr_at(s);
    ASSERT_EQ(kt_optimizer_set_options(hp.opt, &o), KT_OK) << kt_last_error();
    const std::vector<float> g = randn(p0.size(), rng, 0.1f);
    hp.set_grad(g);
    ASSERT_EQ(hp.step(), KT_OK) << kt_last_error();
    ref.step(g, o);
  }
  EXPECT_EQ(count_diff(values_of(*hp.param), ref.p), 0);
}

INSTANTIATE_TEST_SUITE_P(Variants, SgdSteps,
                         ::testing::Values(SgdCase{0, 0, 0, 0}, SgdCase{0, 0, 1e-2, 0}, SgdCase{0.9, 0, 0, 0},
                                           SgdCase{0.9, 0.1, 1e-2, 0}, SgdCase{0.9, 0, 1e-2, 1}));

// bf16 gradients are read as their fp32 values.
TEST(Optimizer, Bf16GradientsStepAsTheirFp32Values) {
  std::mt19937 rng(13);
  const std::vector<float> p0 = randn(3000, rng);
  kt_optimizer_options o;
  kt_optimizer_options_init(&o);
  TensorPtr param = f32_tensor({3000}, p0), grad = Tensor::make(kBF16, {3000});
  kt_optimizer_param pp{param->dl(), grad->dl()};
  kt_optimizer* opt = nullptr;
  ASSERT_EQ(kt_optimizer_create(nullptr, &o, &pp, 1, &opt), KT_OK) << kt_last_error();
  RefAdamW ref(p0);
  for (int s = 0; s < 10; ++s) {
    std::vector<float> g = randn(p0.size(), rng);
    for (size_t i = 0; i < g.size(); ++i) {
      grad->set(static_cast<int64_t>(i), g[i]);
      g[i] = static_cast<float>(grad->get(static_cast<int64_t>(i)));
    }
    ASSERT_EQ(kt_optimizer_step(opt, nullptr), KT_OK);
    ref.step(g, o);
  }
  EXPECT_EQ(count_diff(values_of(*param), ref.p), 0);
  kt_optimizer_destroy(opt);
}

// grad_unscale and clip_coef act as (g * unscale) * clip before the update.
TEST(Optimizer, UnscaleAndClipMultiplyTheGradient) {
  std::mt19937 rng(3);
  const std::vector<float> p0 = randn(1000, rng);
  kt_optimizer_options o;
  kt_optimizer_options_init(&o);
  HostProblem hp({1000}, p0, nullptr, o);
  RefAdamW ref(p0);
  for (int s = 0; s < 5; ++s) {
    const std::vector<float> g = randn(p0.size(), rng, 1024.f);
    hp.set_grad(g);
    ASSERT_EQ(hp.step(1.f / 1024.f, 0.75f), KT_OK);
    ref.step(g, o, 1.f / 1024.f, 0.75f);
  }
  EXPECT_EQ(count_diff(values_of(*hp.param), ref.p), 0);
}

// A non-finite gradient (or one that overflows when unscaled) skips the
// step: nothing changes, and the next step continues as if it never came.
TEST(Optimizer, NonFiniteGradientSkipsTheStep) {
  std::mt19937 rng(5);
  const std::vector<float> p0 = randn(70000, rng);
  kt_optimizer_options o;
  kt_optimizer_options_init(&o);
  HostProblem hp({70000}, p0, nullptr, o);
  RefAdamW ref(p0);
  std::vector<float> g = randn(p0.size(), rng);
  hp.set_grad(g);
  ASSERT_EQ(hp.step(), KT_OK);
  ref.step(g, o);
  const std::vector<float> before = values_of(*hp.param);
  DLTensor m;
  ASSERT_EQ(kt_optimizer_state(hp.opt, 0, KT_OPTIM_STATE_EXP_AVG, &m), KT_OK);
  const std::vector<float> m_before(static_cast<float*>(m.data), static_cast<float*>(m.data) + p0.size());
  for (float bad : {INFINITY, -INFINITY, NAN, 3e38f}) {
    std::vector<float> gb = randn(p0.size(), rng);
    gb[69999] = bad;
    hp.set_grad(gb);
    int nonfinite = -1;
    ASSERT_EQ(hp.step(bad == 3e38f ? 10.f : 1.f, 1.f, &nonfinite), KT_OK) << kt_last_error();
    EXPECT_EQ(nonfinite, 1) << bad;
    EXPECT_EQ(count_diff(values_of(*hp.param), before), 0) << bad;
    EXPECT_EQ(std::memcmp(m.data, m_before.data(), m_before.size() * sizeof(float)), 0) << bad;
    int64_t step = 0;
    kt_optimizer_get_step(hp.opt, &step);
    EXPECT_EQ(step, 1) << bad;
  }
  g = randn(p0.size(), rng);
  hp.set_grad(g);
  int nonfinite = -1;
  ASSERT_EQ(hp.step(1.f, 1.f, &nonfinite), KT_OK);
  EXPECT_EQ(nonfinite, 0);
  ref.step(g, o);
  EXPECT_EQ(count_diff(values_of(*hp.param), ref.p), 0);
}

// Equal bits, or both NaN (a NaN's payload may depend on operand order).
int64_t count_diff_nan(const std::vector<float>& a, const std::vector<float>& b) {
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i)
    n += !(std::memcmp(&a[i], &b[i], sizeof(float)) == 0 || (std::isnan(a[i]) && std::isnan(b[i])));
  return n;
}

// (kernel ISA, threads: 0 = no engine).
class NonFiniteLast : public ::testing::TestWithParam<std::tuple<kt_isa, int>> {};

// Three parameters (fp32 and bf16 gradients, several work items each), a
// non-finite g in the last element of the last one: the step changes no
// parameter, moment or momentum buffer and keeps the step count, whichever
// kernels and threads run it. With assume_finite the same gradients go
// through in one pass: every other element as the reference, the bad one
// non-finite, nothing skipped.
TEST_P(NonFiniteLast, ChangesNothingUnlessAssumedFinite) {
  const kt_isa isa = std::get<0>(GetParam());
  const int threads = std::get<1>(GetParam());
  if (isa > kt_cpu_isa()) GTEST_SKIP() << kt_isa_name(isa) << " does not run on this CPU";
  kt_engine* engine = make_engine(threads, isa);
  ASSERT_TRUE(engine || !threads);
  for (const kt_optim_algorithm algo : {KT_OPTIM_ADAMW, KT_OPTIM_SGD}) {
    SCOPED_TRACE(algo == KT_OPTIM_ADAMW ? "adamw" : "sgd");
    const bool adamw = algo == KT_OPTIM_ADAMW;
    std::mt19937 rng(31 + threads);
    const std::vector<std::vector<int64_t>> shapes = {{70000}, {3, 5}, {300, 250}};
    // The last gradient is fp32 for AdamW, bf16 for SGD; the middle one bf16.
    const DLDataType gdt[3] = {kF32, kBF16, adamw ? kF32 : kBF16};
    std::vector<TensorPtr> params, grads;
    std::vector<kt_optimizer_param> pairs;
    std::vector<RefAdamW> ref_a;
    std::vector<RefSgd> ref_s;
    for (int t = 0; t < 3; ++t) {
      int64_t n = 1;
      for (int64_t d : shapes[t]) n *= d;
      const std::vector<float> p0 = randn(static_cast<size_t>(n), rng);
      params.push_back(f32_tensor(shapes[t], p0));
      grads.push_back(Tensor::make(gdt[t], shapes[t]));
      pairs.push_back({params.back()->dl(), grads.back()->dl()});
      ref_a.emplace_back(p0);
      ref_s.emplace_back(p0);
    }
    kt_optimizer_options o;
    kt_optimizer_options_init(&o);
    o.algorithm = algo;
    o.weight_decay = 0.1;
    if (adamw) o.amsgrad = 1;
    else o.momentum = 0.9;
    kt_optimizer* opt = nullptr;
    if (!threads) setenv("KT_MAX_ISA", kt_isa_name(isa), 1);
    ASSERT_EQ(kt_optimizer_create(engine, &o, pairs.data(), pairs.size(), &opt), KT_OK) << kt_last_error();
    if (!threads) unsetenv("KT_MAX_ISA");

    // Fresh gradients (bad at element at of tensor `in`, by default the last
    // element of the last tensor), also given to the references as the
    // values kt reads.
    auto step = [&](float bad, bool give_ref, int* nonfinite, float unscale = 1.f, int in = 2, int64_t at = -1) {
      std::normal_distribution<float> normal(0.f, 0.1f);
      std::vector<std::vector<float>> g(3);
      for (int t = 0; t < 3; ++t) {
        const int64_t n = grads[t]->numel();
        for (int64_t i = 0; i < n; ++i) {
          float v = normal(rng);
          if (t == in && i == (at < 0 ? n - 1 : at)) v = bad == 0.f ? 0.05f : bad;  // bad 0: a finite step
          grads[t]->set(i, v);
          g[t].push_back(static_cast<float>(grads[t]->get(i)));
        }
        if (give_ref) {
          if (adamw) ref_a[t].step(g[t], o, unscale);
          else {
            std::vector<float> scaled(g[t]);
            for (float& x : scaled) x *= unscale;
            ref_s[t].step(scaled, o);
          }
        }
      }
      kt_optimizer_step_options so;
      kt_optimizer_step_options_init(&so);
      so.grad_unscale = unscale;
      so.found_nonfinite = nonfinite;
      return kt_optimizer_step(opt, &so);
    };
    const std::vector<kt_optim_state> kinds =
        adamw ? std::vector<kt_optim_state>{KT_OPTIM_STATE_EXP_AVG, KT_OPTIM_STATE_EXP_AVG_SQ,
                                            KT_OPTIM_STATE_MAX_EXP_AVG_SQ}
              : std::vector<kt_optim_state>{KT_OPTIM_STATE_MOMENTUM};
    // Every parameter and state tensor, in order.
    auto snapshot = [&] {
      std::vector<std::vector<float>> all;
      for (int t = 0; t < 3; ++t) {
        all.push_back(values_of(*params[t]));
        for (kt_optim_state k : kinds) {
          DLTensor st;
          EXPECT_EQ(kt_optimizer_state(opt, static_cast<size_t>(t), k, &st), KT_OK) << kt_last_error();
          const float* d = static_cast<const float*>(st.data);
          all.emplace_back(d, d + params[t]->numel());
        }
      }
      return all;
    };
    auto steps_made = [&] {
      int64_t s = -1;
      EXPECT_EQ(kt_optimizer_get_step(opt, &s), KT_OK);
      return s;
    };
    auto expect_reference = [&](const char* when) {
      for (int t = 0; t < 3; ++t)
        EXPECT_EQ(count_diff_nan(values_of(*params[t]), adamw ? ref_a[t].p : ref_s[t].p), 0) << when << " " << t;
    };

    int nonfinite = -1;
    ASSERT_EQ(step(0.f, true, &nonfinite), KT_OK) << kt_last_error();
    EXPECT_EQ(nonfinite, 0);
    const std::vector<std::vector<float>> before = snapshot();
    for (float bad : {NAN, INFINITY, -INFINITY, 3e38f}) {
      nonfinite = -1;
      // 3e38 is finite, 3e38 * 10 is not.
      ASSERT_EQ(step(bad, false, &nonfinite, bad == 3e38f ? 10.f : 1.f), KT_OK) << kt_last_error();
      EXPECT_EQ(nonfinite, 1) << bad;
      const std::vector<std::vector<float>> after = snapshot();
      for (size_t k = 0; k < before.size(); ++k) EXPECT_EQ(count_diff(after[k], before[k]), 0) << bad << " " << k;
      EXPECT_EQ(steps_made(), 1) << bad;
    }
    // Elsewhere: the first element, the last of a 15-element tensor, one in
    // the middle of a work item.
    for (const std::pair<int, int64_t>& at : {std::make_pair(0, int64_t{0}), std::make_pair(1, int64_t{14}),
                                             std::make_pair(0, int64_t{40000})}) {
      nonfinite = -1;
      ASSERT_EQ(step(NAN, false, &nonfinite, 1.f, at.first, at.second), KT_OK) << kt_last_error();
      EXPECT_EQ(nonfinite, 1) << at.first << " " << at.second;
      const std::vector<std::vector<float>> after = snapshot();
      for (size_t k = 0; k < before.size(); ++k) EXPECT_EQ(count_diff(after[k], before[k]), 0) << k;
    }
    expect_reference("after the skipped steps");

    // assume_finite: a finite step is the same step; a non-finite g goes in.
    o.assume_finite = 1;
    ASSERT_EQ(kt_optimizer_set_options(opt, &o), KT_OK) << kt_last_error();
    ASSERT_EQ(step(0.f, true, &nonfinite), KT_OK);
    EXPECT_EQ(nonfinite, 0);
    expect_reference("assume_finite, finite g");
    nonfinite = -1;
    ASSERT_EQ(step(NAN, true, &nonfinite), KT_OK);
    EXPECT_EQ(nonfinite, 0);
    EXPECT_EQ(steps_made(), 3);
    expect_reference("assume_finite, a NaN g");
    EXPECT_TRUE(std::isnan(params[2]->f32()[params[2]->numel() - 1]));
    // Only its own element: the others of that tensor are finite.
    int64_t bad_elements = 0;
    for (int t = 0; t < 3; ++t)
      for (int64_t i = 0; i < params[t]->numel(); ++i) bad_elements += !std::isfinite(params[t]->f32()[i]);
    EXPECT_EQ(bad_elements, 1);
    kt_optimizer_options got;
    kt_optimizer_options_init(&got);
    ASSERT_EQ(kt_optimizer_get_options(opt, &got), KT_OK);
    EXPECT_EQ(got.assume_finite, 1);
    kt_optimizer_destroy(opt);
  }
  EXPECT_EQ(kt_engine_destroy(engine), KT_OK);
}

INSTANTIATE_TEST_SUITE_P(IsasAndThreads, NonFiniteLast,
                         ::testing::Combine(::testing::Values(KT_ISA_REF, KT_ISA_AVX2, KT_ISA_AVX512BF16),
                                            ::testing::Values(0, 1, 3)));

TEST(Optimizer, GradSqNormIsTheSumOfSquares) {
  std::mt19937 rng(9);
  kt_engine* engine = make_engine(2);
  ASSERT_NE(engine, nullptr);
  TensorPtr p1 = f32_tensor({100000}, randn(100000, rng)), g1 = f32_tensor({100000}, randn(100000, rng));
  TensorPtr p2 = f32_tensor({3, 5}, randn(15, rng));
  TensorPtr g2 = Tensor::make(kBF16, {3, 5});
  for (int i = 0; i < 15; ++i) g2->set(i, 0.5 * i - 3);
  kt_optimizer_param pp[2] = {{p1->dl(), g1->dl()}, {p2->dl(), g2->dl()}};
  kt_optimizer* opt = nullptr;
  ASSERT_EQ(kt_optimizer_create(engine, nullptr, pp, 2, &opt), KT_OK) << kt_last_error();
  double want = 0;
  for (int64_t i = 0; i < 100000; ++i) want += double(g1->f32()[i]) * g1->f32()[i];
  for (int64_t i = 0; i < 15; ++i) want += g2->get(i) * g2->get(i);
  double got = 0;
  ASSERT_EQ(kt_optimizer_grad_sq_norm(opt, &got), KT_OK);
  EXPECT_NEAR(got, want, want * 1e-12);
  size_t count = 0;
  EXPECT_EQ(kt_optimizer_num_params(opt, &count), KT_OK);
  EXPECT_EQ(count, 2u);
  g1->f32()[5] = NAN;
  ASSERT_EQ(kt_optimizer_grad_sq_norm(opt, &got), KT_OK);
  EXPECT_TRUE(std::isnan(got));
  // The engine is in use: it refuses to go first.
  EXPECT_EQ(kt_engine_destroy(engine), KT_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kt_last_error()).find("optimizer"), std::string::npos) << kt_last_error();
  kt_optimizer_destroy(opt);
  EXPECT_EQ(kt_engine_destroy(engine), KT_OK);
}

// Save at step 50, run 50 more; a second optimizer loads the file and runs
// the same 50: the same bits (masters, moments, step, hyperparameters).
TEST(OptimizerState, ResumeIsBitIdentical) {
  for (int algorithm : {KT_OPTIM_ADAMW, KT_OPTIM_SGD}) {
    std::mt19937 rng(21);
    const std::vector<float> p0 = randn(5000, rng);
    kt_optimizer_options o;
    kt_optimizer_options_init(&o);
    o.algorithm = static_cast<kt_optim_algorithm>(algorithm);
    o.amsgrad = algorithm == KT_OPTIM_ADAMW;
    o.momentum = algorithm == KT_OPTIM_SGD ? 0.9 : 0.0;
    o.arithmetic = algorithm == KT_OPTIM_ADAMW ? KT_OPTIM_TORCH2 : KT_OPTIM_TORCH1;
    std::vector<std::vector<float>> grads;
    for (int s = 0; s < 100; ++s) grads.push_back(randn(p0.size(), rng));
    const std::string path = temp_path("resume.safetensors");
    HostProblem a({50, 100}, p0, nullptr, o);
    for (int s = 0; s < 100; ++s) {
      o.lr = lr_at(s);
      ASSERT_EQ(kt_optimizer_set_options(a.opt, &o), KT_OK);
      a.set_grad(grads[s]);
      ASSERT_EQ(a.step(), KT_OK);
      if (s == 49) {
        ASSERT_EQ(kt_optimizer_save(a.opt, path.c_str()), KT_OK) << kt_last_error();
      }
    }
    kt_optimizer_options fresh;
    kt_optimizer_options_init(&fresh);
    fresh.algorithm = o.algorithm;
    fresh.amsgrad = o.amsgrad;
    HostProblem b({50, 100}, randn(p0.size(), rng), nullptr, fresh);
    ASSERT_EQ(kt_optimizer_load(b.opt, path.c_str()), KT_OK) << kt_last_error();
    int64_t step = 0;
    kt_optimizer_get_step(b.opt, &step);
    EXPECT_EQ(step, 50);
    kt_optimizer_options loaded;
    kt_optimizer_options_init(&loaded);
    ASSERT_EQ(kt_optimizer_get_options(b.opt, &loaded), KT_OK);
    EXPECT_EQ(loaded.lr, lr_at(49));
    EXPECT_EQ(loaded.momentum, o.momentum);
    EXPECT_EQ(loaded.arithmetic, o.arithmetic);
    for (int s = 50; s < 100; ++s) {
      o.lr = lr_at(s);
      ASSERT_EQ(kt_optimizer_set_options(b.opt, &o), KT_OK);
      b.set_grad(grads[s]);
      ASSERT_EQ(b.step(), KT_OK);
    }
    EXPECT_EQ(count_diff(values_of(*a.param), values_of(*b.param)), 0) << algorithm;
    std::remove(path.c_str());
  }
}

// Files of another shape, algorithm or amsgrad setting, and damaged files,
// are refused and change nothing.
TEST(OptimizerState, MismatchedOrDamagedFilesChangeNothing) {
  std::mt19937 rng(23);
  kt_optimizer_options o;
  kt_optimizer_options_init(&o);
  HostProblem a({10, 20}, randn(200, rng), nullptr, o);
  a.set_grad(randn(200, rng));
  ASSERT_EQ(a.step(), KT_OK);
  const std::string good = temp_path("good.safetensors");
  ASSERT_EQ(kt_optimizer_save(a.opt, good.c_str()), KT_OK) << kt_last_error();

  HostProblem other_shape({20, 10}, randn(200, rng), nullptr, o);
  kt_optimizer_options ams = o;
  ams.amsgrad = 1;
  HostProblem other_ams({10, 20}, randn(200, rng), nullptr, ams);
  kt_optimizer_options sgd = o;
  sgd.algorithm = KT_OPTIM_SGD;
  HostProblem other_algo({10, 20}, randn(200, rng), nullptr, sgd);

  // Truncated copies of the good file.
  std::ifstream in(good, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 100u);
  const std::string cut = temp_path("cut.safetensors");
  std::ofstream(cut, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size() - 4));

  struct Expect {
    HostProblem* hp;
    std::string path;
    kt_status status;
    const char* needle;
  };
  const std::string missing = temp_path("missing.safetensors");
  // A safetensors file that is not an optimizer state: a checkpoint.
  const std::string ckpt_dir = temp_path("ckpt");
  TensorPtr wg = f32_tensor({1, 2, 2}, {1, 2, 3, 4}), wu = f32_tensor({1, 2, 2}, {1, 2, 3, 4});
  TensorPtr wd = f32_tensor({1, 2, 2}, {1, 2, 3, 4});
  kt_arg wargs[] = {{KT_ARG_W_GATE, wg->dl()}, {KT_ARG_W_UP, wu->dl()}, {KT_ARG_W_DOWN, wd->dl()}};
  kt_ckpt_layer_args layer{0, wargs, 3};
  ASSERT_EQ(kt_ckpt_write_experts(ckpt_dir.c_str(), nullptr, &layer, 1), KT_OK) << kt_last_error();
  const std::string foreign = ckpt_dir + "/model.safetensors";
  for (const Expect& e : {Expect{&other_shape, good, KT_ERR_SHAPE, "param.0.master"},
                          Expect{&other_ams, good, KT_ERR_INVALID_ARGUMENT, "amsgrad"},
                          Expect{&other_algo, good, KT_ERR_INVALID_ARGUMENT, "adamw"},
                          Expect{&a, cut, KT_ERR_IO, "cut.safetensors"},
                          Expect{&a, missing, KT_ERR_IO, "missing.safetensors"},
                          Expect{&a, foreign, KT_ERR_IO, "not a kt optimizer state file"}}) {
    const std::vector<float> before = values_of(*e.hp->param);
    int64_t step_before = 0;
    kt_optimizer_get_step(e.hp->opt, &step_before);
    EXPECT_EQ(kt_optimizer_load(e.hp->opt, e.path.c_str()), e.status) << e.path;
    const std::string msg = kt_last_error();
    EXPECT_EQ(msg.rfind("kt_optimizer_load: ", 0), 0u) << msg;
    EXPECT_NE(msg.find(e.needle), std::string::npos) << msg;
    EXPECT_EQ(count_diff(values_of(*e.hp->param), before), 0);
    int64_t step_after = 0;
    kt_optimizer_get_step(e.hp->opt, &step_after);
    EXPECT_EQ(step_after, step_before);
  }
  std::remove(good.c_str());
  std::remove(cut.c_str());
  std::remove(foreign.c_str());
  std::remove(ckpt_dir.c_str());
}

TEST(OptimizerBadInput, RefusedWithNamedArguments) {
  std::mt19937 rng(1);
  TensorPtr p = f32_tensor({4, 8}, randn(32, rng)), g = Tensor::make(kF32, {4, 8});
  TensorPtr g_shape = Tensor::make(kF32, {8, 4}), g_f16 = Tensor::make(kF16, {4, 8});
  TensorPtr p_bf16 = Tensor::make(kBF16, {4, 8});
  kt_optimizer* opt = nullptr;
  auto create = [&](const DLTensor* param, const DLTensor* grad, const kt_optimizer_options* o = nullptr) {
    kt_optimizer_param pp{param, grad};
    opt = nullptr;
    const kt_status st = kt_optimizer_create(nullptr, o, &pp, 1, &opt);
    kt_optimizer_destroy(opt);
    return st;
  };
  auto expect = [](kt_status got, kt_status want, const char* needle) {
    EXPECT_EQ(got, want) << kt_last_error();
    EXPECT_NE(std::string(kt_last_error()).find(needle), std::string::npos) << kt_last_error();
  };
  expect(kt_optimizer_create(nullptr, nullptr, nullptr, 1, &opt), KT_ERR_NULL_POINTER, "kt_optimizer_create: params");
  expect(create(p->dl(), nullptr), KT_ERR_NULL_POINTER, "params[0].grad");
  expect(create(p->dl(), g_shape->dl()), KT_ERR_SHAPE, "params[0].grad");
  expect(create(p->dl(), g_f16->dl()), KT_ERR_DTYPE, "params[0].grad");
  expect(create(p_bf16->dl(), g->dl()), KT_ERR_DTYPE, "params[0].param");
  expect(create(p->dl(), p->dl()), KT_ERR_INVALID_ARGUMENT, "params[0].param");
  int64_t strides[2] = {1, 4};
  DLTensor transposed = *p->dl();
  transposed.strides = strides;
  transposed.shape = g_shape->dl()->shape;
  expect(create(&transposed, g_shape->dl()), KT_ERR_STRIDE, "params[0].param");
  kt_optimizer_options o;
  kt_optimizer_options_init(&o);
  o.lr = -1;
  expect(create(p->dl(), g->dl(), &o), KT_ERR_INVALID_ARGUMENT, "options->lr");
  kt_optimizer_options_init(&o);
  o.beta2 = 1.0;
  expect(create(p->dl(), g->dl(), &o), KT_ERR_INVALID_ARGUMENT, "options->beta2");
  kt_optimizer_options_init(&o);
  o.algorithm = static_cast<kt_optim_algorithm>(7);
  expect(create(p->dl(), g->dl(), &o), KT_ERR_INVALID_ARGUMENT, "options->algorithm");
  kt_optimizer_options_init(&o);
  o.algorithm = KT_OPTIM_SGD;
  o.nesterov = 1;
  expect(create(p->dl(), g->dl(), &o), KT_ERR_INVALID_ARGUMENT, "nesterov");
  kt_optimizer_options_init(&o);
  o.arithmetic = static_cast<kt_optim_arithmetic>(2);
  expect(create(p->dl(), g->dl(), &o), KT_ERR_INVALID_ARGUMENT, "options->arithmetic");

  kt_optimizer_param pp{p->dl(), g->dl()};
  ASSERT_EQ(kt_optimizer_create(nullptr, nullptr, &pp, 1, &opt), KT_OK);
  expect(kt_optimizer_step(nullptr, nullptr), KT_ERR_INVALID_HANDLE, "kt_optimizer_step: opt is NULL");
  expect(kt_optimizer_grad_sq_norm(opt, nullptr), KT_ERR_NULL_POINTER, "out");
  DLTensor view;
  expect(kt_optimizer_state(opt, 0, KT_OPTIM_STATE_MOMENTUM, &view), KT_ERR_INVALID_ARGUMENT, "keeps no such state");
  expect(kt_optimizer_state(opt, 1, KT_OPTIM_STATE_MASTER, &view), KT_ERR_INVALID_ARGUMENT, "index 1");
  expect(kt_optimizer_set_grad(opt, 0, g_shape->dl()), KT_ERR_SHAPE, "kt_optimizer_set_grad: grad");
  expect(kt_optimizer_set_grad(opt, 0, p->dl()), KT_ERR_INVALID_ARGUMENT, "params[0].param");
  kt_optimizer_options_init(&o);
  o.algorithm = KT_OPTIM_SGD;
  expect(kt_optimizer_set_options(opt, &o), KT_ERR_INVALID_ARGUMENT, "algorithm");
  kt_optimizer_options_init(&o);
  o.amsgrad = 1;
  expect(kt_optimizer_set_options(opt, &o), KT_ERR_INVALID_ARGUMENT, "amsgrad");
  expect(kt_optimizer_set_step(opt, -1), KT_ERR_INVALID_ARGUMENT, "negative");
  kt_optimizer_step_options so;
  kt_optimizer_step_options_init(&so);
  so.grad_unscale = NAN;
  expect(kt_optimizer_step(opt, &so), KT_ERR_INVALID_ARGUMENT, "grad_unscale");
  kt_job* job = nullptr;
  expect(kt_optimizer_step_submit(opt, nullptr, 0, &job), KT_ERR_UNSUPPORTED, "no engine");
  expect(kt_optimizer_save(opt, nullptr), KT_ERR_NULL_POINTER, "path");
  expect(kt_optimizer_save(opt, "/nonexistent-dir/x/state.safetensors"), KT_ERR_IO, "kt_optimizer_save");
  // Nothing above changed the parameter.
  int64_t step = -1;
  kt_optimizer_get_step(opt, &step);
  EXPECT_EQ(step, 0);
  kt_optimizer_destroy(opt);
  kt_optimizer_destroy(nullptr);
}

// A submitted step gives what a direct step gives.
TEST(Optimizer, SubmittedStepEqualsDirectStep) {
  kt_engine* engine = make_engine(2);
  ASSERT_NE(engine, nullptr);
  std::mt19937 rng(31);
  const std::vector<float> p0 = randn(50000, rng);
  const std::vector<float> g = randn(p0.size(), rng);
  kt_optimizer_options o;
  kt_optimizer_options_init(&o);
  {
    HostProblem direct({50000}, p0, nullptr, o), submitted({50000}, p0, engine, o);
    direct.set_grad(g);
    submitted.set_grad(g);
    ASSERT_EQ(direct.step(), KT_OK);
    for (unsigned flags : {0u, unsigned(KT_SUBMIT_DEFERRED)}) {
      int nonfinite = -1;
      kt_optimizer_step_options so;
      kt_optimizer_step_options_init(&so);
      so.found_nonfinite = &nonfinite;
      kt_job* job = nullptr;
      ASSERT_EQ(kt_optimizer_step_submit(submitted.opt, &so, flags, &job), KT_OK) << kt_last_error();
      if (flags) kt_job_run(job);
      EXPECT_EQ(kt_job_wait(job), KT_OK) << kt_last_error();
      kt_job_destroy(job);
      EXPECT_EQ(nonfinite, 0);
      if (!flags) {
        EXPECT_EQ(count_diff(values_of(*direct.param), values_of(*submitted.param)), 0);
        ASSERT_EQ(direct.step(), KT_OK);
      }
    }
    EXPECT_EQ(count_diff(values_of(*direct.param), values_of(*submitted.param)), 0);
  }
  EXPECT_EQ(kt_engine_destroy(engine), KT_OK);
}

}  // namespace
