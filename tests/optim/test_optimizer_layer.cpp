// kt_optimizer over a layer's bound parameters: after a step the layer
// computes with the new values (full mode: repacked weights; LoRA mode: the
// new factors), exactly as a layer freshly loaded with the updated masters.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "harness.h"
#include "kt_c_api.h"

namespace {

using kt_test::kBF16;
using kt_test::kF32;
using kt_test::kI32;
using kt_test::Tensor;
using kt_test::TensorPtr;

// I = 21: a partial panel (gate, up) and an odd column count (down); H = 40:
// gate/up rows of one whole 16-pair block and a tail of 4 pairs.
constexpr int64_t E = 3, K = 2, H = 40, I = 21, T = 6, R = 4;

struct Engine {
  kt_engine* e = nullptr;
  Engine() {
    kt_engine_options o;
    kt_engine_options_init(&o);
    o.num_threads = 2;
    o.pin_threads = 0;
    EXPECT_EQ(kt_engine_create(&o, &e), KT_OK);
  }
  ~Engine() { EXPECT_EQ(kt_engine_destroy(e), KT_OK) << kt_last_error(); }
};

TensorPtr random_tensor(DLDataType dt, std::vector<int64_t> shape, std::mt19937& rng, float scale) {
  TensorPtr t = Tensor::make(dt, std::move(shape));
  std::normal_distribution<float> d(0.f, scale);
  for (int64_t i = 0; i < t->numel(); ++i) t->set(i, d(rng));
  return t;
}

kt_moe* make_layer(kt_engine* engine, kt_mode mode, bool bias = false) {
  kt_moe_options o;
  kt_moe_options_init(&o);
  o.num_experts = E;
  o.top_k = K;
  o.hidden = H;
  o.intermediate = I;
  o.max_tokens = 64;
  o.mode = mode;
  o.has_bias = bias;
  o.lora_rank = R;
  o.lora_alpha = 8;
  kt_moe* m = nullptr;
  EXPECT_EQ(kt_moe_create(engine, &o, &m), KT_OK) << kt_last_error();
  return m;
}

// Weights w[0..2] (gate, up, down) and biases w[3..5].
struct Weights {
  TensorPtr w[6];
  Weights(DLDataType dt, std::mt19937& rng) {
    w[0] = random_tensor(dt, {E, I, H}, rng, 0.2f);
    w[1] = random_tensor(dt, {E, I, H}, rng, 0.2f);
    w[2] = random_tensor(dt, {E, H, I}, rng, 0.2f);
    w[3] = random_tensor(dt, {E, I}, rng, 0.2f);
    w[4] = random_tensor(dt, {E, I}, rng, 0.2f);
    w[5] = random_tensor(dt, {E, H}, rng, 0.2f);
  }
};

void load(kt_moe* m, Weights& w, bool bias = false) {
  kt_arg args[] = {{KT_ARG_W_GATE, w.w[0]->dl()}, {KT_ARG_W_UP, w.w[1]->dl()}, {KT_ARG_W_DOWN, w.w[2]->dl()},
                   {KT_ARG_B_GATE, w.w[3]->dl()}, {KT_ARG_B_UP, w.w[4]->dl()},  {KT_ARG_B_DOWN, w.w[5]->dl()}};
  ASSERT_EQ(kt_moe_load_weights(m, nullptr, args, bias ? 6 : 3), KT_OK) << kt_last_error();
}

struct Inputs {
  TensorPtr x, ids, rw;
  explicit Inputs(std::mt19937& rng) {
    x = random_tensor(kF32, {T, H}, rng, 1.f);
    ids = Tensor::make(kI32, {T, K});
    for (int64_t i = 0; i < T * K; ++i) ids->set(i, (i / K + i % K) % E);
    rw = random_tensor(kF32, {T, K}, rng, 0.5f);
  }
  std::vector<float> forward(kt_moe* m) {
    TensorPtr y = Tensor::make(kF32, {T, H});
    kt_arg args[] = {{KT_ARG_X, x->dl()}, {KT_ARG_IDS, ids->dl()}, {KT_ARG_ROUTE_WEIGHTS, rw->dl()},
                     {KT_ARG_Y, y->dl()}};
    EXPECT_EQ(kt_moe_forward(m, args, 4, nullptr), KT_OK) << kt_last_error();
    return std::vector<float>(y->f32(), y->f32() + T * H);
  }
};

// A full-mode layer (no biases) loaded with w, w's tensors bound as its
// weights and g's as their gradients.
kt_moe* bound_full_layer(kt_engine* engine, Weights& w, Weights& g) {
  kt_moe* layer = make_layer(engine, KT_MODE_FULL);
  load(layer, w);
  std::vector<kt_arg> bind;
  for (int p = 0; p < 3; ++p) {
    bind.push_back({KT_ARG_W_GATE + p, w.w[p]->dl()});
    bind.push_back({KT_ARG_GRAD_W_GATE + p, g.w[p]->dl()});
  }
  EXPECT_EQ(kt_moe_bind(layer, bind.data(), bind.size()), KT_OK) << kt_last_error();
  return layer;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class FullMode : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

// A full-mode layer after kt's step computes what a layer freshly loaded with
// the updated masters computes; the masters are those of a host optimizer
// stepping copies of the same tensors.
TEST_P(FullMode, StepLeavesPackedWeightsConsistentWithMasters) {
  const bool bf16 = std::get<0>(GetParam()), bias = std::get<1>(GetParam());
  const int np = bias ? 6 : 3;
  const DLDataType dt = bf16 ? kBF16 : kF32;
  Engine engine;
  std::mt19937 rng(41);
  Weights w(dt, rng);
  Inputs in(rng);
  kt_moe* layer = make_layer(engine.e, KT_MODE_FULL, bias);
  load(layer, w, bias);
  Weights g(kF32, rng);
  std::vector<kt_arg> bind;
  for (int p = 0; p < np; ++p) {
    const int param_id = p < 3 ? KT_ARG_W_GATE + p : KT_ARG_B_GATE + p - 3;
    const int grad_id = p < 3 ? KT_ARG_GRAD_W_GATE + p : KT_ARG_GRAD_B_GATE + p - 3;
    bind.push_back({param_id, w.w[p]->dl()});
    bind.push_back({grad_id, g.w[p]->dl()});
  }
  ASSERT_EQ(kt_moe_bind(layer, bind.data(), bind.size()), KT_OK) << kt_last_error();
  const std::vector<float> y_before = in.forward(layer);

  // Host twin: the same values as fp32, the same gradients.
  TensorPtr host[6];
  kt_optimizer_param pairs[6];
  for (int p = 0; p < np; ++p) {
    host[p] = Tensor::make(kF32, w.w[p]->shape);
    for (int64_t i = 0; i < host[p]->numel(); ++i) host[p]->set(i, w.w[p]->get(i));
    pairs[p] = {host[p]->dl(), g.w[p]->dl()};
  }
  kt_optimizer_options o;
  kt_optimizer_options_init(&o);
  o.lr = 0.05;
  kt_optimizer *opt = nullptr, *twin = nullptr;
  ASSERT_EQ(kt_optimizer_create_for_layer(layer, &o, &opt), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_optimizer_create(nullptr, &o, pairs, static_cast<size_t>(np), &twin), KT_OK) << kt_last_error();
  size_t n = 0;
  EXPECT_EQ(kt_optimizer_num_params(opt, &n), KT_OK);
  EXPECT_EQ(n, static_cast<size_t>(np));
  for (int s = 0; s < 3; ++s) {
    ASSERT_EQ(kt_optimizer_step(opt, nullptr), KT_OK) << kt_last_error();
    ASSERT_EQ(kt_optimizer_step(twin, nullptr), KT_OK) << kt_last_error();
  }
  for (int p = 0; p < np; ++p) {
    DLTensor master;
    ASSERT_EQ(kt_optimizer_state(opt, static_cast<size_t>(p), KT_OPTIM_STATE_MASTER, &master), KT_OK);
    EXPECT_EQ(std::memcmp(master.data, host[p]->f32(), static_cast<size_t>(host[p]->numel()) * 4), 0) << p;
    if (bf16) {  // the bound bf16 tensor holds the rounded master
      for (int64_t i = 0; i < host[p]->numel(); ++i)
        ASSERT_EQ(w.w[p]->u16()[i], kt::f32_to_bf16(host[p]->f32()[i])) << p << " " << i;
    }
  }
  const std::vector<float> y_after = in.forward(layer);
  EXPECT_FALSE(same_bits(y_before, y_after)) << "the step did not reach the layer";

  // A non-finite gradient: the step is skipped, the layer and masters unchanged.
  const float kept = g.w[2]->f32()[7];
  g.w[2]->f32()[7] = NAN;
  kt_optimizer_step_options so;
  kt_optimizer_step_options_init(&so);
  int nonfinite = -1;
  so.found_nonfinite = &nonfinite;
  ASSERT_EQ(kt_optimizer_step(opt, &so), KT_OK) << kt_last_error();
  EXPECT_EQ(nonfinite, 1);
  g.w[2]->f32()[7] = kept;
  EXPECT_TRUE(same_bits(y_after, in.forward(layer)));
  for (int p = 0; p < np; ++p) {
    DLTensor master;
    ASSERT_EQ(kt_optimizer_state(opt, static_cast<size_t>(p), KT_OPTIM_STATE_MASTER, &master), KT_OK);
    EXPECT_EQ(std::memcmp(master.data, host[p]->f32(), static_cast<size_t>(host[p]->numel()) * 4), 0) << p;
  }

  // A layer loaded from the masters (bf16 parameters: from their bf16 copies).
  Weights updated(dt, rng);
  for (int p = 0; p < np; ++p)
    for (int64_t i = 0; i < host[p]->numel(); ++i) updated.w[p]->set(i, host[p]->f32()[i]);
  kt_moe* fresh = make_layer(engine.e, KT_MODE_INFERENCE, bias);
  load(fresh, updated, bias);
  EXPECT_TRUE(same_bits(y_after, in.forward(fresh)));
  // And the layer's own repack of its bound tensors agrees with the step's packing.
  ASSERT_EQ(kt_moe_params_changed(layer), KT_OK) << kt_last_error();
  EXPECT_TRUE(same_bits(y_after, in.forward(layer)));

  // Rebinding a parameter: the optimizer refuses to step a tensor it does not own.
  TensorPtr other = random_tensor(dt, {E, I, H}, rng, 0.2f);
  kt_arg rebind[] = {{KT_ARG_W_GATE, other->dl()}};
  ASSERT_EQ(kt_moe_bind(layer, rebind, 1), KT_OK);
  EXPECT_EQ(kt_optimizer_step(opt, nullptr), KT_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kt_last_error()).find("W_GATE was bound again"), std::string::npos) << kt_last_error();

  kt_optimizer_destroy(twin);
  kt_moe_destroy(fresh);
  // The layer goes first: the optimizer reports it instead of touching it.
  kt_moe_destroy(layer);
  EXPECT_EQ(kt_optimizer_step(opt, nullptr), KT_ERR_INVALID_HANDLE);
  EXPECT_NE(std::string(kt_last_error()).find("layer was destroyed"), std::string::npos) << kt_last_error();
  kt_optimizer_destroy(opt);
}

INSTANTIATE_TEST_SUITE_P(DtypesAndBiases, FullMode,
                         ::testing::Combine(::testing::Values(false, true), ::testing::Values(false, true)));

// assume_finite on a full-mode layer with bf16 weights: a NaN gradient
// whose payload would carry a plain rounding into a zero (all bits set) or an
// infinity leaves a NaN in the bf16 copy and the packed panel, the bits
// kt_moe_params_changed packs from that copy; every other element is finite.
TEST(LayerOptimizer, AssumedFiniteNaNStaysNaNInBf16) {
  Engine engine;
  std::mt19937 rng(53);
  Weights w(kBF16, rng);
  Inputs in(rng);
  Weights g(kF32, rng);
  kt_moe* layer = bound_full_layer(engine.e, w, g);
  kt_optimizer_options o;
  kt_optimizer_options_init(&o);
  o.assume_finite = 1;
  kt_optimizer* opt = nullptr;
  ASSERT_EQ(kt_optimizer_create_for_layer(layer, &o, &opt), KT_OK) << kt_last_error();
  const uint32_t payloads[] = {0xffffffffu, 0x7fffffffu, 0x7f808000u};
  for (int p = 0; p < 3; ++p) std::memcpy(&g.w[p]->f32()[5 + p], &payloads[p], 4);
  kt_optimizer_step_options so;
  kt_optimizer_step_options_init(&so);
  int nonfinite = -1;
  so.found_nonfinite = &nonfinite;
  ASSERT_EQ(kt_optimizer_step(opt, &so), KT_OK) << kt_last_error();
  EXPECT_EQ(nonfinite, 0);
  for (int p = 0; p < 3; ++p) {
    DLTensor master;
    ASSERT_EQ(kt_optimizer_state(opt, static_cast<size_t>(p), KT_OPTIM_STATE_MASTER, &master), KT_OK);
    const float* m = static_cast<const float*>(master.data);
    int64_t bad = 0;
    for (int64_t i = 0; i < w.w[p]->numel(); ++i) {
      bad += !std::isfinite(m[i]);
      ASSERT_EQ(w.w[p]->u16()[i], kt::f32_to_bf16(m[i])) << p << " " << i;
    }
    EXPECT_EQ(bad, 1) << p;
    EXPECT_TRUE(std::isnan(m[5 + p])) << p;
    EXPECT_EQ(w.w[p]->u16()[5 + p] & 0x7fffu, (w.w[p]->u16()[5 + p] & 0x7fffu) | 0x7fc0u) << p << ": not a quiet NaN";
  }
  const std::vector<float> y_step = in.forward(layer);
  ASSERT_EQ(kt_moe_params_changed(layer), KT_OK) << kt_last_error();
  EXPECT_TRUE(same_bits(y_step, in.forward(layer)));
  kt_optimizer_destroy(opt);
  kt_moe_destroy(layer);
}

// The overlap pattern: the layer's gradient hook submits the optimizer step
// while the backward job ends; the step equals a host optimizer's on the
// same gradients.
struct HookState {
  kt_optimizer* opt = nullptr;
  kt_job* job = nullptr;
  kt_status status = KT_ERR_INTERNAL;
};

void submit_step(kt_moe*, void* user) {
  HookState* h = static_cast<HookState*>(user);
  h->status = kt_optimizer_step_submit(h->opt, nullptr, 0, &h->job);
}

TEST(LayerOptimizer, GradHookSubmitsTheStep) {
  Engine engine;
  std::mt19937 rng(59);
  Weights w(kF32, rng);
  Inputs in(rng);
  Weights g(kF32, rng);
  kt_moe* layer = bound_full_layer(engine.e, w, g);
  TensorPtr host[3];
  kt_optimizer_param pairs[3];
  for (int p = 0; p < 3; ++p) {
    host[p] = Tensor::make(kF32, w.w[p]->shape);
    std::memcpy(host[p]->f32(), w.w[p]->f32(), static_cast<size_t>(host[p]->numel()) * 4);
    pairs[p] = {host[p]->dl(), g.w[p]->dl()};
  }
  HookState h;
  kt_optimizer* twin = nullptr;
  ASSERT_EQ(kt_optimizer_create_for_layer(layer, nullptr, &h.opt), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_optimizer_create(nullptr, nullptr, pairs, 3, &twin), KT_OK);
  ASSERT_EQ(kt_moe_set_grad_hook(layer, submit_step, &h), KT_OK);

  TensorPtr y = Tensor::make(kF32, {T, H}), dy = random_tensor(kF32, {T, H}, rng, 1.f);
  kt_arg fwd[] = {{KT_ARG_X, in.x->dl()}, {KT_ARG_IDS, in.ids->dl()}, {KT_ARG_ROUTE_WEIGHTS, in.rw->dl()},
                  {KT_ARG_Y, y->dl()}};
  kt_context* ctx = nullptr;
  ASSERT_EQ(kt_moe_forward(layer, fwd, 4, &ctx), KT_OK) << kt_last_error();
  kt_arg bwd[] = {{KT_ARG_DY, dy->dl()}};
  kt_job* backward = nullptr;
  ASSERT_EQ(kt_moe_backward_submit(layer, ctx, nullptr, bwd, 1, 0, &backward), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_job_wait(backward), KT_OK) << kt_last_error();
  kt_job_destroy(backward);
  kt_context_release(ctx);
  ASSERT_EQ(h.status, KT_OK);
  ASSERT_NE(h.job, nullptr);
  ASSERT_EQ(kt_job_wait(h.job), KT_OK) << kt_last_error();
  kt_job_destroy(h.job);

  ASSERT_EQ(kt_optimizer_step(twin, nullptr), KT_OK);
  int64_t step = 0;
  kt_optimizer_get_step(h.opt, &step);
  EXPECT_EQ(step, 1);
  for (int p = 0; p < 3; ++p)
    EXPECT_EQ(std::memcmp(w.w[p]->f32(), host[p]->f32(), static_cast<size_t>(host[p]->numel()) * 4), 0) << p;
  ASSERT_EQ(kt_moe_set_grad_hook(layer, nullptr, nullptr), KT_OK);
  kt_optimizer_destroy(twin);
  kt_optimizer_destroy(h.opt);
  kt_moe_destroy(layer);
}

TEST(LoraMode, StepMakesTheLayerReadTheNewFactors) {
  Engine engine;
  std::mt19937 rng(43);
  Weights w(kF32, rng);
  Inputs in(rng);
  kt_moe* layer = make_layer(engine.e, KT_MODE_LORA);
  load(layer, w);
  std::vector<TensorPtr> factors, grads;
  std::vector<kt_arg> bind;
  for (int p = 0; p < 3; ++p) {
    const int64_t inp = p == 2 ? I : H, out = p == 2 ? H : I;
    factors.push_back(random_tensor(kF32, {E, R, inp}, rng, 0.2f));
    factors.push_back(random_tensor(kF32, {E, out, R}, rng, 0.2f));
    grads.push_back(random_tensor(kF32, {E, R, inp}, rng, 0.1f));
    grads.push_back(random_tensor(kF32, {E, out, R}, rng, 0.1f));
    bind.push_back({KT_ARG_LORA_A_GATE + 2 * p, factors[2 * p]->dl()});
    bind.push_back({KT_ARG_LORA_B_GATE + 2 * p, factors[2 * p + 1]->dl()});
    bind.push_back({KT_ARG_GRAD_LORA_A_GATE + 2 * p, grads[2 * p]->dl()});
    bind.push_back({KT_ARG_GRAD_LORA_B_GATE + 2 * p, grads[2 * p + 1]->dl()});
  }
  ASSERT_EQ(kt_moe_bind(layer, bind.data(), bind.size()), KT_OK) << kt_last_error();
  const std::vector<float> y_before = in.forward(layer);
  kt_optimizer* opt = nullptr;
  ASSERT_EQ(kt_optimizer_create_for_layer(layer, nullptr, &opt), KT_OK) << kt_last_error();
  size_t n = 0;
  EXPECT_EQ(kt_optimizer_num_params(opt, &n), KT_OK);
  EXPECT_EQ(n, 6u);
  EXPECT_EQ(kt_optimizer_set_grad(opt, 0, grads[0]->dl()), KT_ERR_MODE);
  ASSERT_EQ(kt_optimizer_step(opt, nullptr), KT_OK) << kt_last_error();
  const std::vector<float> y_after = in.forward(layer);
  EXPECT_FALSE(same_bits(y_before, y_after));

  // A second layer bound to copies of the updated factors computes the same.
  kt_moe* fresh = make_layer(engine.e, KT_MODE_LORA);
  load(fresh, w);
  std::vector<TensorPtr> copies;
  std::vector<kt_arg> bind2;
  for (size_t i = 0; i < factors.size(); ++i) {
    copies.push_back(Tensor::make(kF32, factors[i]->shape));
    std::memcpy(copies[i]->f32(), factors[i]->f32(), static_cast<size_t>(factors[i]->numel()) * 4);
    bind2.push_back({static_cast<int>(KT_ARG_LORA_A_GATE + i), copies[i]->dl()});
  }
  ASSERT_EQ(kt_moe_bind(fresh, bind2.data(), bind2.size()), KT_OK) << kt_last_error();
  EXPECT_TRUE(same_bits(y_after, in.forward(fresh)));
  kt_optimizer_destroy(opt);
  kt_moe_destroy(fresh);
  kt_moe_destroy(layer);
}

TEST(LayerOptimizer, RefusesLayersWithoutTrainableBindings) {
  Engine engine;
  std::mt19937 rng(47);
  kt_moe* inference = make_layer(engine.e, KT_MODE_INFERENCE);
  kt_optimizer* opt = nullptr;
  EXPECT_EQ(kt_optimizer_create_for_layer(inference, nullptr, &opt), KT_ERR_MODE);
  EXPECT_NE(std::string(kt_last_error()).find("KT_MODE_INFERENCE"), std::string::npos) << kt_last_error();
  kt_moe* full = make_layer(engine.e, KT_MODE_FULL);
  EXPECT_EQ(kt_optimizer_create_for_layer(full, nullptr, &opt), KT_ERR_NOT_BOUND);
  EXPECT_NE(std::string(kt_last_error()).find("KT_ARG_W_GATE is not bound"), std::string::npos) << kt_last_error();
  EXPECT_EQ(kt_optimizer_create_for_layer(nullptr, nullptr, &opt), KT_ERR_INVALID_HANDLE);
  EXPECT_EQ(kt_optimizer_create_for_layer(full, nullptr, nullptr), KT_ERR_NULL_POINTER);
  kt_moe_destroy(inference);
  kt_moe_destroy(full);
}

// A layer optimizer's state file: a resumed layer continues bit-identically,
// and a file of another layer shape is refused.
TEST(LayerOptimizer, StateFileResumesAndRefusesOtherShapes) {
  Engine engine;
  std::mt19937 rng(53);
  Weights w(kF32, rng);
  Inputs in(rng);
  TensorPtr g[3] = {random_tensor(kF32, {E, I, H}, rng, 0.1f), random_tensor(kF32, {E, I, H}, rng, 0.1f),
                    random_tensor(kF32, {E, H, I}, rng, 0.1f)};
  auto make = [&](Weights& ww, kt_moe** m, kt_optimizer** opt) {
    *m = make_layer(engine.e, KT_MODE_FULL);
    load(*m, ww);
    kt_arg bind[] = {{KT_ARG_W_GATE, ww.w[0]->dl()},  {KT_ARG_W_UP, ww.w[1]->dl()},
                     {KT_ARG_W_DOWN, ww.w[2]->dl()},  {KT_ARG_GRAD_W_GATE, g[0]->dl()},
                     {KT_ARG_GRAD_W_UP, g[1]->dl()}, {KT_ARG_GRAD_W_DOWN, g[2]->dl()}};
    ASSERT_EQ(kt_moe_bind(*m, bind, 6), KT_OK) << kt_last_error();
    ASSERT_EQ(kt_optimizer_create_for_layer(*m, nullptr, opt), KT_OK) << kt_last_error();
  };
  kt_moe* a = nullptr;
  kt_optimizer* oa = nullptr;
  make(w, &a, &oa);
  ASSERT_EQ(kt_optimizer_step(oa, nullptr), KT_OK);
  const std::string path = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/kt_optim_layer_" +
                           std::to_string(getpid()) + ".safetensors";
  ASSERT_EQ(kt_optimizer_save(oa, path.c_str()), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_optimizer_step(oa, nullptr), KT_OK);

  Weights w2(kF32, rng);
  kt_moe* b = nullptr;
  kt_optimizer* ob = nullptr;
  make(w2, &b, &ob);
  ASSERT_EQ(kt_optimizer_load(ob, path.c_str()), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_optimizer_step(ob, nullptr), KT_OK);
  EXPECT_TRUE(same_bits(in.forward(a), in.forward(b)));
  for (int p = 0; p < 3; ++p)
    EXPECT_EQ(std::memcmp(w.w[p]->f32(), w2.w[p]->f32(), static_cast<size_t>(w.w[p]->numel()) * 4), 0) << p;

  // A LoRA layer's optimizer has other parameter names.
  TensorPtr hp = random_tensor(kF32, {E, I, H}, rng, 1.f), hg = random_tensor(kF32, {E, I, H}, rng, 1.f);
  kt_optimizer_param pair{hp->dl(), hg->dl()};
  kt_optimizer* host = nullptr;
  ASSERT_EQ(kt_optimizer_create(nullptr, nullptr, &pair, 1, &host), KT_OK);
  EXPECT_EQ(kt_optimizer_load(host, path.c_str()), KT_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kt_last_error()).find("param.0.master"), std::string::npos) << kt_last_error();
  kt_optimizer_destroy(host);
  kt_optimizer_destroy(oa);
  kt_optimizer_destroy(ob);
  kt_moe_destroy(a);
  kt_moe_destroy(b);
  std::remove(path.c_str());
}

}  // namespace
