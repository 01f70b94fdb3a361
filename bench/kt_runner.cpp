#include "kt_runner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace kt_bench {

std::vector<std::vector<float>> lora_factors(const LayerWeights& layer) {
  const ModelShape& s = layer.shape;
  const int64_t E = layer.experts, r = kLoraRank;
  std::vector<std::vector<float>> f;
  Rng rng(77);
  for (int p = 0; p < 3; ++p) {
    const int64_t in = p == 2 ? s.intermediate : s.hidden, out = p == 2 ? s.hidden : s.intermediate;
    std::vector<float> a(static_cast<size_t>(E * r * in)), b(static_cast<size_t>(E * out * r));
    for (float& v : a) v = rng.normal() / std::sqrt(static_cast<float>(in));
    for (float& v : b) v = 0.02f * rng.normal();
    f.push_back(std::move(a));
    f.push_back(std::move(b));
  }
  return f;
}

std::string kt_error(const char* call, kt_status status) {
  return std::string(call) + " failed: " + kt_status_string(status) + ": " + kt_last_error();
}

KtRunner::KtRunner(kt_engine* engine, const LayerWeights& layer, int64_t max_tokens,
                   kt_weight_format format, const kt_ckpt* source, int64_t source_layer,
                   kt_compute compute)
    : engine_(engine),
      layer_(layer),
      max_tokens_(max_tokens),
      format_(format),
      compute_(compute),
      source_(source),
      source_layer_(source_layer) {}

KtRunner::~KtRunner() { release_layer(); }

void KtRunner::release_layer() {
  kt_moe_destroy(moe_);
  moe_ = nullptr;
  params_.clear();
}

bool KtRunner::prepare(kt_mode mode, std::string* error) {
  if (moe_ && mode_ == mode) return true;
  // One layer at a time: a full-size layer is packed once per mode, and
  // memory never holds two packed copies.
  release_layer();
  const ModelShape& s = layer_.shape;
  kt_moe_options options;
  kt_moe_options_init(&options);
  options.num_experts = layer_.experts;
  options.top_k = s.top_k;
  options.hidden = s.hidden;
  options.intermediate = s.intermediate;
  options.max_tokens = max_tokens_;
  options.mode = mode;
  options.weight_format = format_;
  options.compute = compute_;
  if (mode == KT_MODE_LORA) {
    options.lora_rank = kLoraRank;
    options.lora_alpha = 2.f * kLoraRank;
  }
  kt_status st = kt_moe_create(engine_, &options, &moe_);
  if (st != KT_OK) {
    *error = kt_error("kt_moe_create", st);
    moe_ = nullptr;
    return false;
  }
  mode_ = mode;
  const kt_arg load[] = {{KT_ARG_W_GATE, layer_.gate.dl()}, {KT_ARG_W_UP, layer_.up.dl()}, {KT_ARG_W_DOWN, layer_.down.dl()}};
  const double start = now_seconds();
  st = source_ ? kt_ckpt_load_layer(source_, source_layer_, moe_, nullptr, nullptr)
               : kt_moe_load_weights(moe_, nullptr, load, 3);
  loads_.emplace_back(mode == KT_MODE_LORA ? "lora" : mode == KT_MODE_FULL ? "full" : "inference", now_seconds() - start);
  if (st != KT_OK) {
    *error = kt_error(source_ ? "kt_ckpt_load_layer" : "kt_moe_load_weights", st);
    release_layer();
    return false;
  }
  kt_moe_info info;
  info.struct_size = sizeof(info);
  if (kt_moe_get_info(moe_, &info) == KT_OK)
    expert_weight_bytes_ = static_cast<double>(info.weight_bytes) / static_cast<double>(layer_.experts);

  std::vector<kt_arg> bind;
  const int64_t E = layer_.experts, r = kLoraRank;
  if (mode == KT_MODE_LORA) {
    // fp32 factors as a trainer keeps them.
    const std::vector<std::vector<float>> factors = lora_factors(layer_);
    for (int p = 0; p < 3; ++p) {
      const int64_t in = p == 2 ? s.intermediate : s.hidden, out = p == 2 ? s.hidden : s.intermediate;
      HostTensor a(kDLFloat, 32, {E, r, in}), b(kDLFloat, 32, {E, out, r});
      std::copy(factors[static_cast<size_t>(2 * p)].begin(), factors[static_cast<size_t>(2 * p)].end(), a.f32());
      std::copy(factors[static_cast<size_t>(2 * p + 1)].begin(), factors[static_cast<size_t>(2 * p + 1)].end(),
                b.f32());
      params_.push_back(std::move(a));
      params_.push_back(std::move(b));
      params_.emplace_back(kDLFloat, 32, std::vector<int64_t>{E, r, in});
      params_.emplace_back(kDLFloat, 32, std::vector<int64_t>{E, out, r});
    }
    for (int p = 0; p < 3; ++p) {
      bind.push_back({KT_ARG_LORA_A_GATE + 2 * p, params_[static_cast<size_t>(4 * p)].dl()});
      bind.push_back({KT_ARG_LORA_B_GATE + 2 * p, params_[static_cast<size_t>(4 * p + 1)].dl()});
      bind.push_back({KT_ARG_GRAD_LORA_A_GATE + 2 * p, params_[static_cast<size_t>(4 * p + 2)].dl()});
      bind.push_back({KT_ARG_GRAD_LORA_B_GATE + 2 * p, params_[static_cast<size_t>(4 * p + 3)].dl()});
    }
  } else if (mode == KT_MODE_FULL) {
    // The trainable weights are the host's own; fp32 gradient buffers as a
    // mixed-precision trainer keeps them.
    params_.emplace_back(kDLFloat, 32, std::vector<int64_t>{E, s.intermediate, s.hidden});
    params_.emplace_back(kDLFloat, 32, std::vector<int64_t>{E, s.intermediate, s.hidden});
    params_.emplace_back(kDLFloat, 32, std::vector<int64_t>{E, s.hidden, s.intermediate});
    bind = {{KT_ARG_W_GATE, layer_.gate.dl()},      {KT_ARG_W_UP, layer_.up.dl()},
            {KT_ARG_W_DOWN, layer_.down.dl()},      {KT_ARG_GRAD_W_GATE, params_[0].dl()},
            {KT_ARG_GRAD_W_UP, params_[1].dl()},    {KT_ARG_GRAD_W_DOWN, params_[2].dl()}};
  }
  if (!bind.empty()) {
    st = kt_moe_bind(moe_, bind.data(), bind.size());
    if (st != KT_OK) {
      *error = kt_error("kt_moe_bind", st);
      release_layer();
      return false;
    }
  }
  return true;
}

double KtRunner::weight_rel_l2(std::string* error) const {
  if (!moe_) {
    *error = "weight_rel_l2: no layer prepared";
    return NAN;
  }
  double num = 0, den = 0;
  const HostTensor* host[3] = {&layer_.gate, &layer_.up, &layer_.down};
  for (int p = 0; p < 3; ++p) {
    // One projection at a time: fp32 copies of a full layer are large.
    HostTensor got(kDLFloat, 32, {host[p]->dim(0), host[p]->dim(1), host[p]->dim(2)});
    const kt_arg arg = {KT_ARG_W_GATE + p, got.dl()};
    const kt_status st = kt_moe_read_weights(moe_, &arg, 1);
    if (st != KT_OK) {
      *error = kt_error("kt_moe_read_weights", st);
      return NAN;
    }
    for (int64_t i = 0; i < got.numel(); ++i) {
      const double ref = from_bf16(host[p]->u16()[i]), d = got.f32()[i] - ref;
      num += d * d;
      den += ref * ref;
    }
  }
  return std::sqrt(num / den);
}

namespace {
kt_mode mode_of(Case which) {
  return which == Case::kTrainLora ? KT_MODE_LORA : which == Case::kTrainFull ? KT_MODE_FULL : KT_MODE_INFERENCE;
}
}  // namespace

bool KtRunner::call(Case which, const Batch& b, HostTensor& y, HostTensor& dx, HostTensor& droute, std::string* error) {
  const bool training = which != Case::kForward;
  const kt_arg forward_args[] = {{KT_ARG_X, b.x.dl()},
                                 {KT_ARG_IDS, b.ids.dl()},
                                 {KT_ARG_ROUTE_WEIGHTS, b.route_weights.dl()},
                                 {KT_ARG_Y, y.dl()}};
  kt_context* saved = nullptr;
  kt_status st = kt_moe_forward(moe_, forward_args, 4, training ? &saved : nullptr);
  if (st != KT_OK) {
    *error = kt_error("kt_moe_forward", st);
    return false;
  }
  if (!training) return true;
  kt_backward_options options;
  kt_backward_options_init(&options);
  const kt_arg backward_args[] = {{KT_ARG_DY, b.dy.dl()}, {KT_ARG_DX, dx.dl()}, {KT_ARG_DROUTE_WEIGHTS, droute.dl()}};
  st = kt_moe_backward(moe_, saved, &options, backward_args, 3);
  kt_context_release(saved);
  if (st != KT_OK) {
    *error = kt_error("kt_moe_backward", st);
    return false;
  }
  return true;
}

double KtRunner::time_case(Case which, const Workload& work, int warmup, int reps,
                           std::string* error, double pause_s) {
  if (!prepare(mode_of(which), error)) return -1;
  const ModelShape& s = layer_.shape;
  const int64_t T = work.tokens;
  HostTensor y(kDLBfloat, 16, {T, s.hidden}), dx(kDLBfloat, 16, {T, s.hidden});
  HostTensor droute(kDLFloat, 32, {T, s.top_k});
  return median_seconds(
      warmup, reps,
      [&](int i) {
        return call(which, work.batches[static_cast<size_t>(i) % work.batches.size()], y, dx,
                    droute, error);
      },
      pause_s);
}

KtRunner::Alternating KtRunner::time_alternating(KtRunner* other, Case which, const Workload& work,
                                                 int warmup, int reps, std::string* error,
                                                 const std::function<double()>& beside) {
  const Alternating failed;
  if (!prepare(mode_of(which), error) || (other && !other->prepare(mode_of(which), error)))
    return failed;
  const ModelShape& s = layer_.shape;
  const int64_t T = work.tokens;
  HostTensor y(kDLBfloat, 16, {T, s.hidden}), dx(kDLBfloat, 16, {T, s.hidden});
  HostTensor droute(kDLFloat, 32, {T, s.top_k});
  std::vector<double> mine, theirs, besides;
  // Untimed rounds: `warmup`, and at least half a second of them. Right
  // after a format's layer was made (a checkpoint written and loaded), the
  // first calls of both layers ran up to 3x slower for about a second.
  constexpr double kSettleSeconds = 0.5;
  const double settle_start = now_seconds();
  int settled = -1;  // the round the timed ones start at
  bool beside_ran = static_cast<bool>(beside);
  for (int i = 0; settled < 0 || i < settled + reps; ++i) {
    if (settled < 0 && i >= warmup && now_seconds() - settle_start >= kSettleSeconds) settled = i;
    const Batch& b = work.batches[static_cast<size_t>(i) % work.batches.size()];
    const auto timed = [&](KtRunner* r, double* seconds) {
      const double start = now_seconds();
      if (!r->call(which, b, y, dx, droute, error)) return false;
      *seconds = now_seconds() - start;
      return true;
    };
    // The layers take turns at going first (the one after the read beside
    // runs on colder caches).
    const bool other_first = other && i % 2 == 1;
    double t_mine = NAN, t_theirs = NAN;
    if (other_first && !timed(other, &t_theirs)) return failed;
    if (!timed(this, &t_mine)) return failed;
    if (other && !other_first && !timed(other, &t_theirs)) return failed;
    const double t_beside = beside_ran ? beside() : -1;
    beside_ran = beside_ran && t_beside >= 0;
    if (settled < 0) continue;
    mine.push_back(t_mine);
    theirs.push_back(t_theirs);
    besides.push_back(t_beside);
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  };
  const auto best = [](const std::vector<double>& v) {
    return *std::min_element(v.begin(), v.end());
  };
  std::vector<double> ratios;
  for (size_t i = 0; other && i < mine.size(); ++i) ratios.push_back(mine[i] / theirs[i]);
  std::vector<double> beside_ratios;
  for (size_t i = 0; beside_ran && i < mine.size(); ++i) beside_ratios.push_back(besides[i] / mine[i]);
  return {median(mine),
          other ? median(theirs) : NAN,
          beside_ran ? median(besides) : NAN,
          best(mine),
          other ? best(theirs) : NAN,
          beside_ran ? best(besides) : NAN,
          other ? median(ratios) : NAN,
          beside_ran ? median(beside_ratios) : NAN};
}

std::string kernel_summary(const std::vector<KernelUse>& kernels) {
  std::vector<KernelUse> by_kernel;  // in order of first use
  double total = 0;
  for (const KernelUse& k : kernels) {
    auto it = std::find_if(by_kernel.begin(), by_kernel.end(),
                           [&](const KernelUse& b) { return b.kernel == k.kernel; });
    if (it == by_kernel.end())
      it = by_kernel.insert(by_kernel.end(), KernelUse{"", k.kernel, 0, 0});
    it->calls += k.calls;
    it->gflop += k.gflop;
    total += k.gflop;
  }
  std::stable_sort(by_kernel.begin(), by_kernel.end(),
                   [](const KernelUse& a, const KernelUse& b) { return a.gflop > b.gflop; });
  std::string s;
  char buf[160];
  for (const KernelUse& k : by_kernel) {
    if (k.gflop > 0)
      std::snprintf(buf, sizeof buf, "%s %.1f%% (%.0f calls)", k.kernel.c_str(),
                    100 * k.gflop / total, k.calls);
    else
      std::snprintf(buf, sizeof buf, "%s (%.0f calls)", k.kernel.c_str(), k.calls);
    s += (s.empty() ? "" : ", ") + std::string(buf);
  }
  return s;
}

bool KtRunner::profile_case(Case which, const Workload& work, int calls, CaseProfile* profile,
                            std::string* error) {
  if (!prepare(mode_of(which), error)) return false;
  kt_status st = kt_engine_reset_profile(engine_);
  if (st == KT_OK) st = kt_engine_set_profiling(engine_, 1);
  if (st != KT_OK) {
    *error = kt_error("kt_engine_set_profiling", st);
    return false;
  }
  // Whole rounds of the workload's batches, so the counts per call are the
  // mean over the same batches as the case's routes and FLOPs.
  const int batches = static_cast<int>(work.batches.size());
  calls = std::max(calls, batches);
  calls = (calls + batches - 1) / batches * batches;
  const bool ran = time_case(which, work, 0, calls, error) >= 0;
  kt_engine_set_profiling(engine_, 0);
  if (!ran) return false;
  *profile = CaseProfile{};
  for (int stage = 0; kt_stage_name(stage) != nullptr; ++stage) {
    int64_t count = 0;
    double seconds = 0;
    if (kt_engine_profile_stage(engine_, stage, &count, &seconds) != KT_OK || count == 0) continue;
    profile->stage_ms.emplace_back(kt_stage_name(stage), seconds * 1e3 / calls);
    for (int kernel = 0; kt_kernel_name(kernel) != nullptr; ++kernel) {
      int64_t n = 0, flops = 0;
      if (kt_engine_profile_kernel(engine_, stage, kernel, &n, &flops) == KT_OK && n > 0)
        profile->kernels.push_back(KernelUse{kt_stage_name(stage), kt_kernel_name(kernel),
                                             static_cast<double>(n) / calls,
                                             static_cast<double>(flops) * 1e-9 / calls});
    }
  }
  return true;
}

bool KtRunner::outputs(Case which, const Workload& work, std::vector<float>* y_out, std::vector<float>* dx_out,
                       std::string* error) {
  if (!prepare(mode_of(which), error)) return false;
  const ModelShape& s = layer_.shape;
  const int64_t T = work.tokens;
  HostTensor y(kDLBfloat, 16, {T, s.hidden}), dx(kDLBfloat, 16, {T, s.hidden});
  HostTensor droute(kDLFloat, 32, {T, s.top_k});
  if (!call(which, work.batches.front(), y, dx, droute, error)) return false;
  y_out->resize(static_cast<size_t>(y.numel()));
  for (int64_t i = 0; i < y.numel(); ++i) (*y_out)[static_cast<size_t>(i)] = from_bf16(y.u16()[i]);
  dx_out->clear();
  if (which != Case::kForward) {
    dx_out->resize(static_cast<size_t>(dx.numel()));
    for (int64_t i = 0; i < dx.numel(); ++i) (*dx_out)[static_cast<size_t>(i)] = from_bf16(dx.u16()[i]);
  }
  return true;
}

}  // namespace kt_bench
