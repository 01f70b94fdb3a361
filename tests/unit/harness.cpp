#include "harness.h"

namespace kt_test {

static int64_t in_dim(const Case& c, int p) { return p == 2 ? c.I : c.H; }
static int64_t out_dim(const Case& c, int p) { return p == 2 ? c.H : c.I; }

// W' of the formats kt quantizes at load, from the header's contract and
// nothing of kt's: per row and group of inputs, s = the smallest bf16 >=
// max|W| / qmax, W' = round_half_even(W / s) * s clamped to [-qmax, qmax].
// Empty for formats not made at load.
static std::vector<double> quantized_at_load(kt_weight_format f, const std::vector<double>& w, int64_t in) {
  int64_t group = 0;
  double qmax = 7;
  switch (f) {
    case KT_FORMAT_INT8_CHANNEL: group = in; qmax = 127; break;
    case KT_FORMAT_INT4_G32: group = 32; break;
    case KT_FORMAT_INT4_G128: group = 128; break;
    default: return {};
  }
  auto bf16_at_least = [](double v) {  // bf16 values are floats with 16 low zero bits
    float f = static_cast<float>(v);
    if (static_cast<double>(f) < v) f = std::nextafter(f, INFINITY);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if (bits & 0xffffu) bits = (bits | 0xffffu) + 1;  // up to the next bf16 (v >= 0)
    std::memcpy(&f, &bits, 4);
    return static_cast<double>(f);
  };
  std::vector<double> out(w.size());
  for (size_t r0 = 0; r0 < w.size(); r0 += static_cast<size_t>(in))
    for (int64_t c0 = 0; c0 < in; c0 += group) {
      const size_t a = r0 + static_cast<size_t>(c0), b = r0 + static_cast<size_t>(std::min(in, c0 + group));
      double amax = 0;
      for (size_t i = a; i < b; ++i) amax = std::max(amax, std::fabs(w[i]));
      const double s = bf16_at_least(amax / qmax);
      for (size_t i = a; i < b; ++i)
        out[i] = s > 0 ? std::min(qmax, std::max(-qmax, std::nearbyint(w[i] / s))) * s : 0.0;
    }
  return out;
}

Runner::Runner(const Case& c, kt_isa isa, int threads, kt_gemm_backend backend, kt_engine* shared)
    : c_(c), engine_(shared), own_engine_(shared == nullptr) {
  if (own_engine_) {
    kt_engine_options eo;
    kt_engine_options_init(&eo);
    eo.num_threads = threads;
    eo.max_isa = isa;
    eo.verbosity = 0;
    eo.precision = c.precision;
    EXPECT_EQ(kt_engine_create(&eo, &engine_), KT_OK) << kt_last_error();
    const kt_status st = kt_engine_set_gemm_backend(engine_, backend);
    if (st == KT_ERR_UNSUPPORTED && backend == KT_GEMM_ONEDNN) return;  // available_ stays false
    EXPECT_EQ(st, KT_OK) << kt_last_error();
  }
  kt_engine_info info;
  info.struct_size = sizeof(info);
  kt_engine_get_info(engine_, &info);
  available_ = info.isa == isa || (isa == KT_ISA_AUTO);
  if (backend == KT_GEMM_ONEDNN) EXPECT_EQ(info.gemm_backend, KT_GEMM_ONEDNN);
  if (!available_) return;

  kt_moe_options mo;
  kt_moe_options_init(&mo);
  mo.num_experts = c.E;
  mo.top_k = c.K;
  mo.hidden = c.H;
  mo.intermediate = c.I;
  mo.max_tokens = std::max<int64_t>(c.T, 1);
  mo.activation = c.act;
  mo.act_limit = c.limit;
  mo.has_bias = c.bias;
  mo.mode = c.mode;
  mo.lora_rank = c.rank > 0 ? c.rank : 16;
  mo.lora_alpha = 2.f * static_cast<float>(mo.lora_rank);
  mo.use_rslora = c.rslora;
  mo.lora_targets = c.targets;
  mo.weight_format = c.format;
  mo.compute = c.compute;
  EXPECT_EQ(kt_moe_create(engine_, &mo, &moe_), KT_OK) << kt_last_error();

  spec.E = c.E;
  spec.K = c.K;
  spec.H = c.H;
  spec.I = c.I;
  spec.activation = c.act;
  spec.alpha = 1.702;
  spec.limit = c.limit;
  spec.bias = c.bias;
  spec.rank = c.mode == KT_MODE_LORA ? c.rank : 0;
  // The reference's LoRA scale comes from the options (alpha/r, or
  // alpha/sqrt(r) with rsLoRA), never from the code under test; kt's own
  // must agree with it.
  if (c.mode == KT_MODE_LORA) {
    const double r = static_cast<double>(mo.lora_rank), alpha = mo.lora_alpha;
    spec.lora_scale = c.rslora ? alpha / std::sqrt(r) : alpha / r;
    float kt_scale = 0.f;
    EXPECT_EQ(kt_moe_lora_scale(moe_, &kt_scale), KT_OK) << kt_last_error();
    EXPECT_NEAR(kt_scale, spec.lora_scale, 1e-6 * spec.lora_scale) << "kt's LoRA scale";
  }
  spec.targets = c.targets;

  std::mt19937 rng(c.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  if (!c.ckpt_dir.empty()) {
    load_checkpoint();
  } else {
    load_random(rng);
  }

  if (!c.skipped.empty()) {
    TensorPtr mask = Tensor::make(kU8, {c.E});
    params.skipped.assign(static_cast<size_t>(c.E), 0);
    for (int e : c.skipped) {
      mask->bytes[static_cast<size_t>(e)] = 1;
      params.skipped[static_cast<size_t>(e)] = 1;
    }
    EXPECT_EQ(kt_moe_set_skipped(moe_, mask->dl()), KT_OK) << kt_last_error();
  }

  std::vector<kt_arg> bind;
  if (c.mode == KT_MODE_LORA) {
    for (int p = 0; p < 3; ++p) {
      if (!((c.targets >> p) & 1u)) continue;
      const int64_t in = in_dim(c, p), out = out_dim(c, p), r = c.rank;
      const DLDataType pt = c.bf16_params ? kBF16 : kF32;
      la_[p] = Tensor::make(pt, {c.E, r, in});
      lb_[p] = Tensor::make(pt, {c.E, out, r});
      gla_[p] = Tensor::make(pt, {c.E, r, in});
      glb_[p] = Tensor::make(pt, {c.E, out, r});
      params.la[p].resize(static_cast<size_t>(la_[p]->numel()));
      params.lb[p].resize(static_cast<size_t>(lb_[p]->numel()));
      for (int64_t i = 0; i < la_[p]->numel(); ++i) {
        la_[p]->set(i, normal(rng) / std::sqrt(static_cast<double>(in)));
        params.la[p][static_cast<size_t>(i)] = static_cast<float>(la_[p]->get(i));
      }
      for (int64_t i = 0; i < lb_[p]->numel(); ++i) {
        lb_[p]->set(i, 0.3 * normal(rng) / std::sqrt(static_cast<double>(r)));
        params.lb[p][static_cast<size_t>(i)] = static_cast<float>(lb_[p]->get(i));
      }
      bind.push_back({KT_ARG_LORA_A_GATE + 2 * p, la_[p]->dl()});
      bind.push_back({KT_ARG_LORA_B_GATE + 2 * p, lb_[p]->dl()});
      bind.push_back({KT_ARG_GRAD_LORA_A_GATE + 2 * p, gla_[p]->dl()});
      bind.push_back({KT_ARG_GRAD_LORA_B_GATE + 2 * p, glb_[p]->dl()});
    }
  }
  if (c.mode == KT_MODE_FULL) {
    for (int p = 0; p < 3; ++p) {
      gW_[p] = Tensor::make(c.bf16_params ? kBF16 : kF32, {c.E, out_dim(c, p), in_dim(c, p)});
      bind.push_back({KT_ARG_GRAD_W_GATE + p, gW_[p]->dl()});
      if (c.bias) {
        gb_[p] = Tensor::make(kF32, {c.E, out_dim(c, p)});
        bind.push_back({KT_ARG_GRAD_B_GATE + p, gb_[p]->dl()});
      }
    }
  }
  if (!bind.empty()) EXPECT_EQ(kt_moe_bind(moe_, bind.data(), bind.size()), KT_OK) << kt_last_error();
  fill_inputs(c.seed + 1000);
}

void Runner::load_random(std::mt19937& rng) {
  const Case& c = c_;
  std::normal_distribution<double> normal(0.0, 1.0);
  // Weights: bf16 tensors for kt; the reference sees the same rounded values.
  for (int p = 0; p < 3; ++p) {
    const int64_t in = in_dim(c, p), out = out_dim(c, p);
    W_[p] = Tensor::make(kBF16, {c.E, out, in});
    params.w[p].resize(static_cast<size_t>(c.E * out * in));
    const double sd = 1.0 / std::sqrt(static_cast<double>(in));
    for (int64_t i = 0; i < W_[p]->numel(); ++i) {
      W_[p]->set(i, sd * normal(rng));
      params.w[p][static_cast<size_t>(i)] = static_cast<float>(W_[p]->get(i));
    }
    if (c.bias) {
      B_[p] = Tensor::make(kF32, {c.E, out});
      params.b[p].resize(static_cast<size_t>(c.E * out));
      for (int64_t i = 0; i < B_[p]->numel(); ++i) {
        B_[p]->set(i, 0.1 * normal(rng));
        params.b[p][static_cast<size_t>(i)] = static_cast<float>(B_[p]->get(i));
      }
    }
  }
  std::vector<kt_arg> load = {{KT_ARG_W_GATE, W_[0]->dl()}, {KT_ARG_W_UP, W_[1]->dl()},
                              {KT_ARG_W_DOWN, W_[2]->dl()}};
  if (c.bias) {
    load.push_back({KT_ARG_B_GATE, B_[0]->dl()});
    load.push_back({KT_ARG_B_UP, B_[1]->dl()});
    load.push_back({KT_ARG_B_DOWN, B_[2]->dl()});
  }
  EXPECT_EQ(kt_moe_load_weights(moe_, nullptr, load.data(), load.size()), KT_OK) << kt_last_error();
  if (c.format != KT_FORMAT_BF16) {
    for (int p = 0; p < 3; ++p) {
      TensorPtr deq = Tensor::make(kF32, W_[p]->shape);
      kt_arg a{KT_ARG_W_GATE + p, deq->dl()};
      EXPECT_EQ(kt_moe_read_weights(moe_, &a, 1), KT_OK) << kt_last_error();
      std::vector<double> given(params.w[p].begin(), params.w[p].end());
      const std::vector<double> held = deq->values();
      quant_error[p] = rel_l2(held, given);
      // The reference computes from what kt holds; that must be the
      // header's quantization of what was loaded, made here independently.
      const std::vector<double> want = quantized_at_load(c.format, given, in_dim(c, p));
      if (!want.empty()) {
        size_t differ = 0, first = 0;
        for (size_t i = 0; i < held.size(); ++i)
          if (held[i] != want[i] && differ++ == 0) first = i;
        EXPECT_EQ(differ, 0u) << kt_weight_format_name(c.format) << " projection " << p << ": first at " << first
                              << ", kt holds " << (differ ? held[first] : 0.0) << ", the contract gives "
                              << (differ ? want[first] : 0.0);
      }
      for (size_t i = 0; i < held.size(); ++i) params.w[p][i] = static_cast<float>(held[i]);
    }
  }

}

void Runner::load_checkpoint() {
  const Case& c = c_;
  kt_ckpt* ck = nullptr;
  ASSERT_EQ(kt_ckpt_open(c.ckpt_dir.c_str(), &ck), KT_OK) << kt_last_error();
  kt_ckpt_load_options lo;
  kt_ckpt_load_options_init(&lo);
  lo.dequantize = c.dequantize ? 1 : 0;
  EXPECT_EQ(kt_ckpt_load_layer_with(ck, c.ckpt_layer, moe_, &lo, nullptr, nullptr), KT_OK) << kt_last_error();
  kt_ckpt_close(ck);
  for (int p = 0; p < 3; ++p) {
    W_[p] = Tensor::make(kF32, {c.E, out_dim(c, p), in_dim(c, p)});
    kt_arg a{KT_ARG_W_GATE + p, W_[p]->dl()};
    EXPECT_EQ(kt_moe_read_weights(moe_, &a, 1), KT_OK) << kt_last_error();
    const std::vector<double> held = W_[p]->values();
    params.w[p].assign(held.begin(), held.end());
    if (c.bias) {
      B_[p] = Tensor::make(kF32, {c.E, out_dim(c, p)});
      kt_arg b{KT_ARG_B_GATE + p, B_[p]->dl()};
      EXPECT_EQ(kt_moe_read_weights(moe_, &b, 1), KT_OK) << kt_last_error();
      const std::vector<double> bias = B_[p]->values();
      params.b[p].assign(bias.begin(), bias.end());
    }
  }
}

Runner::~Runner() {
  kt_moe_destroy(moe_);
  if (own_engine_) EXPECT_EQ(kt_engine_destroy(engine_), KT_OK) << kt_last_error();
}

void Runner::fill_inputs(uint32_t seed) {
  const Case& c = c_;
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  const DLDataType act = c.bf16_act ? kBF16 : kF32;
  x_ = Tensor::make(act, {c.T, c.H});
  y_ = Tensor::make(act, {c.T, c.H});
  dy_ = Tensor::make(act, {c.T, c.H});
  dx_ = Tensor::make(act, {c.T, c.H});
  ids_ = Tensor::make(c.E % 2 ? kI64 : kI32, {c.T, c.K});
  w_ = Tensor::make(kF32, {c.T, c.K});
  dw_ = Tensor::make(kF32, {c.T, c.K});
  for (int64_t i = 0; i < x_->numel(); ++i) {
    x_->set(i, normal(rng));
    dy_->set(i, normal(rng));
  }
  std::vector<int> perm(static_cast<size_t>(c.E));
  int64_t route = 0;
  for (int64_t t = 0; t < c.T; ++t) {
    for (int e = 0; e < c.E; ++e) perm[static_cast<size_t>(e)] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    double sum = 0;
    std::vector<double> ws(static_cast<size_t>(c.K));
    for (auto& v : ws) sum += (v = 0.1 + std::uniform_real_distribution<double>(0, 1)(rng));
    for (int64_t j = 0; j < c.K; ++j, ++route) {
      int64_t e = c.one_expert ? 0 : perm[static_cast<size_t>(j)];
      if (c.minus_one_every && route % c.minus_one_every == 0) e = -1;
      ids_->set(t * c.K + j, static_cast<double>(e));
      w_->set(t * c.K + j, ws[static_cast<size_t>(j)] / sum);
    }
  }
}

kt_status Runner::forward(kt_context** save) {
  kt_arg args[] = {{KT_ARG_X, x_->dl()}, {KT_ARG_IDS, ids_->dl()},
                   {KT_ARG_ROUTE_WEIGHTS, w_->dl()}, {KT_ARG_Y, y_->dl()}};
  return kt_moe_forward(moe_, args, 4, save);
}

kt_status Runner::backward(kt_context* ctx, float grad_scale, kt_grad_accumulate mode) {
  kt_backward_options bo;
  kt_backward_options_init(&bo);
  bo.grad_scale = grad_scale;
  bo.accumulate = mode;
  kt_arg args[] = {{KT_ARG_DY, dy_->dl()}, {KT_ARG_DX, dx_->dl()}, {KT_ARG_DROUTE_WEIGHTS, dw_->dl()}};
  return kt_moe_backward(moe_, ctx, &bo, args, 3);
}

namespace {
std::vector<double> maybe_bf16(std::vector<double> v, bool round) {
  if (round)
    for (double& e : v) e = kt::bf16_to_f32(kt::f32_to_bf16(static_cast<float>(e)));
  return v;
}
}  // namespace

std::vector<double> Runner::ref_forward(bool bf16_operands) const {
  std::vector<int64_t> ids(static_cast<size_t>(ids_->numel()));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(ids_->get(static_cast<int64_t>(i)));
  return kt::reference::forward(spec, params, c_.T, maybe_bf16(x_->values(), bf16_operands), ids, w_->values());
}

kt::reference::Grads Runner::ref_backward(bool bf16_operands) const {
  std::vector<int64_t> ids(static_cast<size_t>(ids_->numel()));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(ids_->get(static_cast<int64_t>(i)));
  return kt::reference::backward(spec, params, c_.T, maybe_bf16(x_->values(), bf16_operands), ids, w_->values(),
                                 maybe_bf16(dy_->values(), bf16_operands));
}

std::vector<std::pair<std::string, const Tensor*>> Runner::host_tensors() const {
  std::vector<std::pair<std::string, const Tensor*>> v = {{"x", x_.get()},   {"ids", ids_.get()}, {"route_weights", w_.get()},
                                                          {"y", y_.get()},   {"dy", dy_.get()},   {"dx", dx_.get()},
                                                          {"droute_weights", dw_.get()}};
  const char* proj[3] = {"gate", "up", "down"};
  for (int p = 0; p < 3; ++p) {
    const std::pair<const char*, const TensorPtr*> per[] = {{"W_", W_},         {"B_", B_},          {"lora_A_", la_},
                                                            {"lora_B_", lb_},   {"grad_lora_A_", gla_}, {"grad_lora_B_", glb_},
                                                            {"grad_W_", gW_},   {"grad_B_", gb_}};
    for (const auto& q : per)
      if (q.second[p]) v.emplace_back(std::string(q.first) + proj[p], q.second[p].get());
  }
  return v;
}

Runner::Snapshot Runner::snapshot() const {
  Snapshot s;
  for (const auto& t : host_tensors()) s.emplace_back(t.first, t.second->bytes);
  return s;
}

std::vector<std::string> Runner::changed_since(const Snapshot& before) const {
  std::vector<std::string> changed;
  const auto now = host_tensors();
  for (const auto& b : before) {
    bool found = false;
    for (const auto& t : now)
      if (t.first == b.first) {
        found = true;
        if (t.second->bytes != b.second) changed.push_back(b.first);
      }
    if (!found) changed.push_back(b.first + " (gone)");
  }
  return changed;
}

void Runner::perturb_lora(int p, bool b, double delta) {
  Tensor& t = b ? *lb_[p] : *la_[p];
  std::vector<float>& v = b ? params.lb[p] : params.la[p];
  for (int64_t i = 0; i < t.numel(); ++i) {
    t.f32()[i] += static_cast<float>(delta * std::sin(static_cast<double>(i)));
    v[static_cast<size_t>(i)] = t.f32()[i];
  }
  EXPECT_EQ(kt_moe_params_changed(moe_), KT_OK) << kt_last_error();
}

}  // namespace kt_test
